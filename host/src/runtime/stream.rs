//! Streams (ordered queues of device work) and events (points in a stream).

use crate::runtime::backend::{
    EmulatedLaunch, EmulatedLaunchFactory, EventBackend, EventState, GraphBackend, LaunchRequest, StreamBackend,
};
use crate::runtime::device::Device;
use crate::runtime::launch::{KernelArgs, LaunchArgs, LaunchConfig, LaunchTracking};
use crate::runtime::launch::{LaunchArg, sealed::Sealed};
use crate::runtime::lifetime::{self, Completion, StreamId, Uses, lock};
use crate::runtime::memory::{DeviceBuffer, TrackedPtr};
use crate::runtime::module::Module;
use crate::{Error, Result};
use bytemuck::Pod;
use ferrolink_device::emulator;
use ferrolink_device::graph::DeviceGraph;
use ferrolink_device::kernel::Kernel;
use std::sync::{Arc, Mutex, OnceLock, RwLock, Weak};

/// Something a stream's errors are explained by, or raised from: a communicator whose
/// kernels run on the stream (its abort and asynchronous errors), a device communicator
/// whose control block holds fault reports.
pub(crate) trait StreamObserver: Send + Sync {
    /// A clearer error for the stream's failure `err` (a device fault report), if any.
    fn explain_failure(&self, err: &Error) -> Option<Error>;
    /// An error raised outside the stream that its work must report (an abort), if any.
    fn external_error(&self) -> Option<Error>;
}

/// The shared part of a [`Stream`].
pub(crate) struct StreamCore {
    id: StreamId,
    backend: RwLock<Arc<dyn StreamBackend>>,
    observers: Mutex<Vec<Weak<dyn StreamObserver>>>,
    /// The completion of the last tracked operation.
    tail: Mutex<Option<Completion>>,
    /// While [`Stream::capture`] runs: what the captured work uses.
    capture: Mutex<Option<Captured>>,
    /// Operations handed to a persistent kernel that the stream has not waited for yet
    /// ([`Stream::post_deferred`]).
    deferred: Mutex<Deferred>,
    /// Another stream's work that this stream's later work must follow, not waited for yet
    /// ([`Stream::follow`]).
    follow: Mutex<Option<Completion>>,
}

/// Operations handed to a persistent kernel on a stream and not waited for yet: the stream
/// waits for them (a wait on their completion word) before any other work it queues, before
/// a host wait for any of them, and before another stream waits for one.
#[derive(Default)]
struct Deferred {
    /// The completion word the waits are on.
    word: u64,
    /// Each operation's sequence number and the event that stands for its end.
    pending: Vec<(u64, Arc<DeferredEvent>)>,
}

/// The end of an operation handed over by [`Stream::post_deferred`]: pending until its stream
/// has queued the wait for it, then that wait's event. A host wait for it queues the wait
/// first ([`settled`]); so does a stream that waits for it.
pub(crate) struct DeferredEvent {
    stream: Weak<StreamCore>,
    real: OnceLock<Arc<dyn EventBackend>>,
}

impl DeferredEvent {
    fn settled(&self) -> Result<Arc<dyn EventBackend>> {
        if self.real.get().is_none()
            && let Some(s) = self.stream.upgrade()
        {
            // Not the stream's followed work: that may wait for other threads (a GPU group's
            // launch not queued yet), and retiring memory settles deferred events.
            s.settle_deferred()?;
        }
        self.real
            .get()
            .cloned()
            .ok_or_else(|| Error::StreamFailed("the wait for a persistent collective could not be queued".into()))
    }
}

impl EventBackend for DeferredEvent {
    fn query(&self) -> EventState {
        // A query does not queue the wait: only waiting for the event does.
        self.real.get().map_or(EventState::Pending, |e| e.query())
    }
    fn synchronize(&self) -> Result<()> {
        self.settled()?.synchronize()
    }
    fn elapsed_ms_since(&self, _start: &dyn EventBackend) -> Result<f32> {
        Err(super::backend::untimed_completion())
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn stand_in(&self) -> Option<Result<Option<Arc<dyn EventBackend>>>> {
        Some(self.settled().map(Some))
    }
}

/// What a stream waits for in `event`'s place: `event` itself, or for one that stands for
/// work not queued yet ([`EventBackend::stand_in`]: a deferred event, a GPU group's launch
/// not queued yet) the event of that work, queued or awaited now; `None` when that work will
/// not run.
pub(crate) fn settled(event: &Arc<dyn EventBackend>) -> Result<Option<Arc<dyn EventBackend>>> {
    match event.stand_in() {
        // A stand-in may itself stand for later work.
        Some(Ok(Some(e))) if e.stand_in().is_some() => settled(&e),
        Some(r) => r,
        None => Ok(Some(event.clone())),
    }
}

/// Queues the stream wait that a deferred event stands for, if `event` is one (never waits
/// for other threads: what retiring memory does, so that its reaper can see it pass).
pub(crate) fn settle_deferred(event: &Arc<dyn EventBackend>) -> Result<()> {
    match event.as_any().downcast_ref::<DeferredEvent>() {
        Some(d) => d.settled().map(drop),
        None => Ok(()),
    }
}

/// What captured work uses (the graph's tracking, recorded at each launch).
#[derive(Default)]
struct Captured {
    reads: Vec<Arc<Uses>>,
    writes: Vec<Arc<Uses>>,
    holds: Vec<Arc<Uses>>,
    untracked: bool,
}

impl StreamCore {
    /// The stream's backend, for queuing work: first the waits for deferred operations (any
    /// work after them must see them complete).
    pub(crate) fn backend(&self) -> Arc<dyn StreamBackend> {
        if let Err(e) = self.settle() {
            tracing::error!(target: "ferrolink::runtime", stream = self.id, error = %e,
                "could not queue the wait for persistent collectives");
        }
        self.raw_backend()
    }

    fn raw_backend(&self) -> Arc<dyn StreamBackend> {
        self.backend.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Queues the waits the stream owes before other work: for the work it follows
    /// ([`Stream::follow`]) and for every deferred operation (resolving their events).
    fn settle(&self) -> Result<()> {
        self.settle_follow()?;
        self.settle_deferred()
    }

    /// Queues the wait for every deferred operation (resolving their events).
    fn settle_deferred(&self) -> Result<()> {
        let mut d = lock(&self.deferred);
        let Some(&(last, _)) = d.pending.last() else { return Ok(()) };
        let b = self.raw_backend();
        // SAFETY: the completion word of a live persistent kernel's sync block
        // (`post_deferred`'s contract: its work keeps it alive until the wait has passed).
        unsafe { b.post(None, &[], Some((d.word, last)))? };
        let e = b.record(false)?;
        for (_, ev) in d.pending.drain(..) {
            let _ = ev.real.set(e.clone());
        }
        Ok(())
    }

    /// Queues the wait for the work the stream follows ([`Stream::follow`]), if any.
    fn settle_follow(&self) -> Result<()> {
        // Taken out of the lock before waiting: the wait may settle another stream (which
        // takes that stream's locks); put back if it cannot be queued.
        let followed = lock(&self.follow).take();
        if let Some(c) = followed {
            let queued = settled(c.event()).and_then(|e| e.map_or(Ok(()), |e| self.raw_backend().wait_event(&e)));
            if let Err(e) = queued {
                lock(&self.follow).get_or_insert(c);
                return Err(e);
            }
        }
        Ok(())
    }

    /// Makes the stream wait for the other streams' pending uses that `t` conflicts with.
    fn wait_foreign(&self, backend: &dyn StreamBackend, t: &LaunchTracking) -> Result<()> {
        for c in t.foreign_pending(self.id) {
            if let Some(e) = settled(c.event())? {
                backend.wait_event(&e)?;
            }
        }
        Ok(())
    }

    /// Notes `c` in everything `t` uses, and as the stream's tail.
    fn record_uses(&self, t: LaunchTracking, c: &Completion) {
        t.note(c);
        for o in t.observers {
            self.add_observer(o);
        }
        *lock(&self.tail) = Some(c.clone());
    }

    fn observers(&self) -> Vec<Arc<dyn StreamObserver>> {
        lock(&self.observers).iter().filter_map(Weak::upgrade).collect()
    }

    /// The stream's error, explained by its observers where they can.
    fn explain(&self, err: Error) -> Error {
        self.observers().iter().find_map(|o| o.explain_failure(&err)).unwrap_or(err)
    }

    pub(crate) fn synchronize(&self) -> Result<()> {
        if lock(&self.capture).is_some() {
            return Err(Error::InvalidArgument(
                "synchronize: the stream is capturing a graph (its work runs when the graph is launched)".into(),
            ));
        }
        self.backend().synchronize().map_err(|e| self.explain(e))?;
        match self.observers().iter().find_map(|o| o.external_error()) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// The stream's failure, if it has failed; queues nothing and waits for nothing (the
    /// watchdog's check).
    pub(crate) fn failure(&self) -> Option<Error> {
        self.raw_backend().failure()
    }

    pub(crate) fn add_observer(&self, o: Weak<dyn StreamObserver>) {
        let mut list = lock(&self.observers);
        list.retain(|w| w.strong_count() > 0);
        if !list.iter().any(|w| Weak::ptr_eq(w, &o)) {
            list.push(o);
        }
    }
}

impl Drop for StreamCore {
    fn drop(&mut self) {
        // Deferred operations' events must resolve: queue their wait (nothing waits here).
        // Not the wait for followed work: no later work of this stream needs it, and it may
        // wait for other threads (a GPU group's launch not queued yet).
        if let Err(e) = self.settle_deferred() {
            tracing::warn!(target: "ferrolink::runtime", stream = self.id, error = %e,
                "could not queue the wait for persistent collectives of a dropped stream");
        }
    }
}

/// An in-order queue of device work. Work on different streams may run concurrently: on
/// CUDA the streams are non-blocking; on the CPU backend each is a worker thread. Dropping a
/// stream does not wait for its work (memory its work uses stays alive by its own tracking).
///
/// ```
/// # fn main() -> ferrolink::Result<()> {
/// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// let stream = dev.create_stream()?;
/// let src = dev.alloc_from(&[1u32, 2, 3, 4])?;
/// let mut dst = dev.alloc::<u32>(4)?;
/// stream.copy_buffer(&mut dst, &src)?; // queued: returns at once
/// drop(src); // fine: freed once the copy has run
/// assert_eq!(dst.to_vec()?, [1, 2, 3, 4]); // waits for the copy
/// # Ok(()) }
/// ```
pub struct Stream {
    dev: Device,
    core: Arc<StreamCore>,
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stream").field("device", &self.dev).field("id", &self.core.id).finish()
    }
}

/// Kernel arguments handed to the emulator's worker thread.
#[derive(Clone, Copy)]
struct EmulatorArgs<A: KernelArgs>(A);
// SAFETY: `A` is a tuple of `KernelParam`s, which that unsafe trait requires to be plain
// values and device addresses that any thread may copy; what the kernel does through the
// addresses is `Stream::launch`'s caller's contract.
unsafe impl<A: KernelArgs> Send for EmulatorArgs<A> {}
// SAFETY: as above (plain values, copied by each replay).
unsafe impl<A: KernelArgs> Sync for EmulatorArgs<A> {}

impl Stream {
    pub(crate) fn new(dev: &Device) -> Result<Stream> {
        let backend: Arc<dyn StreamBackend> = Arc::from(dev.backend_device().create_stream()?);
        let core = Arc::new(StreamCore {
            id: lifetime::next_stream_id(),
            backend: RwLock::new(backend),
            observers: Mutex::new(Vec::new()),
            tail: Mutex::new(None),
            capture: Mutex::new(None),
            deferred: Mutex::new(Deferred::default()),
            follow: Mutex::new(None),
        });
        Ok(Stream { dev: dev.clone(), core })
    }

    /// Another handle of this stream (the same queue).
    pub(crate) fn share(&self) -> Stream {
        Stream { dev: self.dev.clone(), core: self.core.clone() }
    }

    pub(crate) fn core(&self) -> &Arc<StreamCore> {
        &self.core
    }

    /// The stream's process-unique number.
    pub(crate) fn id(&self) -> StreamId {
        self.core.id
    }

    /// The stream's device.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let stream = dev.create_stream()?;
    /// assert!(stream.device().same_as(&dev));
    /// # Ok(()) }
    /// ```
    pub fn device(&self) -> &Device {
        &self.dev
    }

    /// Waits until all work queued on this stream has finished. Returns the stream's error if
    /// an operation failed (on the emulator: a timeout, panic or trap in a kernel), explained
    /// by a device fault report where one exists; on a communicator's stream, also the
    /// communicator's asynchronous error (an abort) if it has one.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let stream = dev.create_stream()?;
    /// let (src, mut dst) = (dev.alloc_from(&[9u8; 64])?, dev.alloc::<u8>(64)?);
    /// stream.copy_buffer(&mut dst, &src)?;
    /// let copied = stream.record_event()?;
    /// stream.synchronize()?;
    /// assert!(copied.is_reached());
    /// # Ok(()) }
    /// ```
    pub fn synchronize(&self) -> Result<()> {
        self.core.synchronize()
    }

    /// The stream's failure, if it has failed (does not wait).
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let stream = dev.create_stream()?;
    /// stream.synchronize()?;
    /// assert!(stream.failure().is_none()); // `Stream::recover` shows a failed one
    /// # Ok(()) }
    /// ```
    pub fn failure(&self) -> Option<Error> {
        self.core.failure().map(|e| self.core.explain(e))
    }

    /// Replaces a failed stream's queue with a fresh one, so that work can be queued again
    /// (on the emulator after a timeout, panic or trap). Returns whether it replaced it. On
    /// CUDA a kernel fault usually breaks the whole context: then the probe launch fails
    /// and the error says so; only a new process recovers from that.
    ///
    /// ```
    /// # use ferrolink::LaunchConfig;
    /// # use ferrolink_device::kernels::selftest::selftest_wait_flag;
    /// # use std::time::Duration;
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let stream = dev.create_stream()?;
    /// let (flag, mut status) = (dev.alloc::<u32>(1)?, dev.alloc::<u32>(1)?);
    /// // A wait for a flag that nobody raises, ended by the emulator's timeout.
    /// let cfg = LaunchConfig::linear(1, 1).with_emulator_timeout(Duration::from_millis(50));
    /// let args = (&flag, 1u32, u64::MAX, &mut status);
    /// // SAFETY: `flag` and `status` are valid words (the kernel's contract).
    /// unsafe { stream.launch(dev.builtin_module()?, &selftest_wait_flag, cfg, args)? };
    /// assert!(stream.synchronize().is_err());
    /// assert!(stream.failure().is_some());
    /// assert!(stream.recover()?); // a fresh queue
    /// stream.synchronize()?;
    /// assert!(!stream.recover()?); // nothing to recover from
    /// # Ok(()) }
    /// ```
    pub fn recover(&self) -> Result<bool> {
        let Some(old) = self.core.backend().failure() else { return Ok(false) };
        let fresh: Arc<dyn StreamBackend> = Arc::from(self.dev.backend_device().create_stream()?);
        fresh.record(false)?.synchronize().map_err(|e| {
            Error::StreamFailed(format!(
                "the stream failed ({old}) and a fresh stream does not work either ({e}): the device's \
                 context is broken, which only a new process recovers from"
            ))
        })?;
        *self.core.backend.write().unwrap_or_else(|e| e.into_inner()) = fresh;
        tracing::info!(target: "ferrolink::runtime", stream = self.core.id, error = %old, "replaced a failed stream");
        Ok(true)
    }

    /// The completion of the last tracked operation queued here, if any.
    pub(crate) fn tail(&self) -> Option<Completion> {
        lock(&self.core.tail).clone()
    }

    /// Makes the stream's later work wait for the other streams' pending uses that `t`
    /// conflicts with, runs `op`, records a completion, and notes it in everything `t` uses.
    /// While capturing: waits on the host for those uses instead (a capture cannot wait for
    /// work outside it), queues `op` into the graph, and notes what it uses in the capture;
    /// the completion returned is then already reached.
    fn enqueue_tracked(
        &self,
        t: LaunchTracking,
        op: impl FnOnce(&dyn StreamBackend) -> Result<()>,
    ) -> Result<Completion> {
        t.check()?;
        let backend = self.core.backend();
        let id = self.core.id;
        if let Some(cap) = lock(&self.core.capture).as_mut() {
            lifetime::wait_all(&t.foreign_pending(id), "a captured operation")?;
            op(&*backend)?;
            cap.reads.extend(t.reads);
            cap.writes.extend(t.writes);
            cap.holds.extend(t.holds);
            cap.holds.extend(t.keeps);
            cap.untracked |= t.untracked;
            for o in t.observers {
                self.core.add_observer(o);
            }
            let reached = Arc::new(lifetime::HostFlag::default());
            reached.raise();
            return Ok(Completion::new(reached, id));
        }
        self.core.wait_foreign(&*backend, &t)?;
        // (Host-time phases of collective calls, with FERROLINK_HOST_PHASES=1.)
        super::phases::mark(super::phases::Phase::Track);
        op(&*backend)?;
        super::phases::mark(super::phases::Phase::Driver);
        let c = Completion::ordered(backend.record(false)?, id, t.order);
        self.core.record_uses(t, &c);
        super::phases::mark(super::phases::Phase::Record);
        Ok(c)
    }

    /// Queues `kernel` from `module` with `args`.
    ///
    /// The argument tuple becomes the kernel's declared parameter types, so wrong arguments
    /// do not compile; the launch shape is validated before anything is queued. Arguments
    /// that borrow handles (`&DeviceBuffer`, `&mut DeviceBuffer`, `&Window`,
    /// `&DevCommHandle`) are tracked: their memory outlives the kernel whatever the caller
    /// drops, host copies wait for the kernel, and buffers written here are ordered after
    /// other streams' uses ([`crate::runtime::launch`] has the table).
    ///
    /// ```
    /// # use ferrolink::{Device, LaunchConfig};
    /// # use ferrolink_device::kernels::copy::ferrolink_copy;
    /// # fn main() -> ferrolink::Result<()> {
    /// let dev = Device::open(0)?;
    /// let stream = dev.create_stream()?;
    /// let src = dev.alloc_from(&[7u8; 64])?;
    /// let mut dst = dev.alloc::<u8>(64)?;
    /// // SAFETY: the copy kernel's contract: both buffers hold 64 bytes and do not overlap.
    /// // Their lifetimes are tracked: dropping either now would be safe.
    /// unsafe {
    ///     stream.launch(dev.builtin_module()?, &ferrolink_copy, LaunchConfig::linear(1, 32), (&mut dst, &src, 64usize))?
    /// };
    /// assert_eq!(dst.to_vec()?, vec![7u8; 64]); // waits for the kernel (not for the device)
    /// # Ok(()) }
    /// ```
    ///
    /// `ferrolink_copy` takes `(*mut u8, *const u8, usize)`; a `u32` length is a compile error:
    ///
    /// ```compile_fail
    /// # use ferrolink::{Device, LaunchConfig};
    /// # use ferrolink_device::kernels::copy::ferrolink_copy;
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open(0)?;
    /// # let stream = dev.create_stream()?;
    /// # let src = dev.alloc_from(&[7u8; 64])?;
    /// # let mut dst = dev.alloc::<u8>(64)?;
    /// unsafe { stream.launch(dev.builtin_module()?, &ferrolink_copy, LaunchConfig::linear(1, 32), (&mut dst, &src, 64u32))? };
    /// # Ok(()) }
    /// ```
    ///
    /// # Safety
    /// The kernel's documented contract must hold. Raw pointers (and `DevComm`/`DevWindow`
    /// values) among the arguments must refer to device memory of this device that stays
    /// valid until the kernel has finished (the runtime keeps memory dropped after the launch
    /// alive until then, but cannot know about memory freed by other means), and no other
    /// work may race with the kernel's accesses through them.
    pub unsafe fn launch<A: KernelArgs, L: LaunchArgs<Params = A>>(
        &self,
        module: &Module,
        kernel: &Kernel<A>,
        cfg: LaunchConfig,
        args: L,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.launch_tracked(module, kernel, cfg, args, LaunchTracking::new(&self.dev)).map(drop) }
    }

    /// [`Stream::launch`], also tracking `extra` (what the kernel uses through addresses it
    /// reads from memory); returns the launch's completion.
    ///
    /// # Safety
    /// As [`Stream::launch`].
    pub(crate) unsafe fn launch_tracked<A: KernelArgs, L: LaunchArgs<Params = A>>(
        &self,
        module: &Module,
        kernel: &Kernel<A>,
        cfg: LaunchConfig,
        args: L,
        extra: LaunchTracking,
    ) -> Result<Completion> {
        // SAFETY: the caller's contract.
        unsafe { self.launch_tracked_after_copy(module, kernel, cfg, args, extra, None) }
    }

    /// [`Stream::launch_tracked`], with the driver's copy `copy` (`(dst, src, bytes)`, as
    /// [`Stream::copy_raw`]) queued right before the kernel, under the same tracking (one
    /// completion for both): how a shared launch brings entries that its parameter does not
    /// hold into device memory.
    ///
    /// # Safety
    /// As [`Stream::launch`]; the copy's ranges as [`Stream::copy_raw`]'s, alive until the
    /// kernel has finished (`extra` holds them), and read or written by no other work meanwhile.
    pub(crate) unsafe fn launch_tracked_after_copy<A: KernelArgs, L: LaunchArgs<Params = A>>(
        &self,
        module: &Module,
        kernel: &Kernel<A>,
        cfg: LaunchConfig,
        args: L,
        extra: LaunchTracking,
        copy: Option<(u64, u64, usize)>,
    ) -> Result<Completion> {
        if !module.belongs_to(&self.dev) {
            return Err(Error::WrongDevice("module"));
        }
        let name = kernel.name();
        cfg.validate(name)?;
        if !module.has_kernel(name) {
            return Err(Error::KernelNotFound(name.into()));
        }
        if module.launches_graphs(name) && !self.is_capturing() {
            // CUDA refuses it too (CUDA_ERROR_NOT_SUPPORTED), without saying why.
            return Err(Error::InvalidArgument(format!(
                "kernel `{name}` launches graphs from the device, which the CUDA device runtime allows only to \
                 kernels that run inside a graph: capture its launch (Stream::capture) and launch the graph"
            )));
        }
        let mut t = extra;
        args.track(&mut t);
        t.holds.push(module.uses.clone());
        let params = args.params();
        let entry = kernel.host_entry();
        // A captured launch is emulated at every replay: each gets a copy of the arguments.
        // Made only by a backend that emulates (a GPU's launch allocates and copies nothing
        // for it: a GPU group's parameter is 7.7 KB).
        let emulate = || -> EmulatedLaunchFactory {
            let host_args = EmulatorArgs(params);
            Arc::new(move || -> EmulatedLaunch {
                let args = host_args;
                Box::new(move |spec| {
                    let args = args;
                    // SAFETY: the caller of `launch` upholds the kernel's contract (for a
                    // graph, at every replay: the graph keeps what it uses alive).
                    unsafe { emulator::launch(spec, entry, args.0) }
                })
            })
        };
        self.enqueue_tracked(t, |backend| {
            if let Some((dst, src, bytes)) = copy {
                // SAFETY: the caller's contract.
                unsafe { backend.copy_dtod(dst, src, bytes)? };
            }
            params.with_param_ptrs(|p| {
                let req = LaunchRequest { kernel: name, cfg: &cfg, params: p, emulate: &emulate };
                // SAFETY: the module belongs to this device and declares the kernel (checked
                // above); `A` is the kernel's declared parameter tuple; the caller upholds the
                // kernel's contract.
                unsafe { backend.launch(module.backend(), req) }
            })
        })
    }

    /// Queues a copy of `src` into `dst` by the driver's copy path (`cuMemcpyDtoDAsync`; on
    /// the CPU backend a host memcpy). Lengths must match. Tracked like a launch: it does not
    /// wait, and the buffers stay alive and ordered until it has run.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let (a, b) = (dev.create_stream()?, dev.create_stream()?);
    /// let src = dev.alloc_from(&[5u8; 32])?;
    /// let (mut mid, mut out) = (dev.alloc::<u8>(32)?, dev.alloc::<u8>(32)?);
    /// a.copy_buffer(&mut mid, &src)?;
    /// b.copy_buffer(&mut out, &mid)?; // ordered after stream `a`'s write of `mid`
    /// assert_eq!(out.to_vec()?, vec![5u8; 32]);
    /// assert!(a.copy_buffer(&mut out, &dev.alloc::<u8>(8)?).is_err()); // lengths differ
    /// # Ok(()) }
    /// ```
    pub fn copy_buffer<T: Pod>(&self, dst: &mut DeviceBuffer<T>, src: &DeviceBuffer<T>) -> Result<()> {
        if dst.len() != src.len() {
            return Err(Error::InvalidArgument(format!(
                "copy_buffer: destination has {} elements, source {}",
                dst.len(),
                src.len()
            )));
        }
        let mut t = LaunchTracking::new(&self.dev);
        t.expect_device(dst.device(), "buffer");
        t.expect_device(src.device(), "buffer");
        t.writes.push(dst.uses().clone());
        t.reads.push(src.uses().clone());
        let (d, s, bytes) = (dst.addr(), src.addr(), src.bytes());
        // SAFETY: both ranges are whole live buffers of this device (checked), distinct
        // allocations; tracking keeps them alive and ordered until the copy has run.
        self.enqueue_tracked(t, |b| unsafe { b.copy_dtod(d, s, bytes) })?;
        Ok(())
    }

    /// Queues the driver's device-to-device copy on raw addresses (the baseline the perf tool
    /// measures kernels against). Untracked.
    ///
    /// # Safety
    /// Both ranges are device memory of this device, valid until the copy has run, not
    /// overlapping, and no other work races with the copy.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let stream = dev.create_stream()?;
    /// let src = dev.alloc_from(&[1u8, 2, 3, 4, 5, 6, 7, 8])?;
    /// let dst = dev.alloc::<u8>(8)?;
    /// // SAFETY: both are 8-byte buffers of this device, distinct, alive until the stream is
    /// // synchronized below; nothing else uses them meanwhile.
    /// unsafe { stream.copy_raw(dst.addr(), src.addr(), 8)? };
    /// stream.synchronize()?;
    /// assert_eq!(dst.to_vec()?, [1, 2, 3, 4, 5, 6, 7, 8]);
    /// # Ok(()) }
    /// ```
    pub unsafe fn copy_raw(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        let mut t = LaunchTracking::new(&self.dev);
        t.untracked = true;
        // SAFETY: the caller's contract.
        self.enqueue_tracked(t, |b| unsafe { b.copy_dtod(dst, src, bytes) })?;
        Ok(())
    }

    /// Queues a write of the low `bytes` (1, 2, 4 or 8) bytes of `value` to `addr` after the
    /// stream's earlier work (how the GIN proxy raises a signal after its data). Untracked.
    /// On CUDA a 4- or 8-byte write is a stream memory operation, which the driver allows in
    /// communicator memory ([`Communicator::mem_alloc`](crate::Communicator::mem_alloc),
    /// windows) and host-mapped memory but refuses in [`Device::alloc`]'s stream-ordered pool.
    ///
    /// # Safety
    /// `addr` is device memory this stream's device can write, aligned to `bytes`, valid
    /// until the write has run, and only written atomically by others meanwhile.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let stream = dev.create_stream()?;
    /// let flag = dev.alloc::<u32>(2)?;
    /// // SAFETY: the buffer's second word is 4-byte aligned, alive until the stream is
    /// // synchronized below, and nothing else writes it.
    /// unsafe { stream.write_value_raw(flag.addr() + 4, 0xdead_beef, 4)? };
    /// stream.synchronize()?;
    /// assert_eq!(flag.to_vec()?, [0, 0xdead_beef]);
    /// # Ok(()) }
    /// ```
    pub unsafe fn write_value_raw(&self, addr: u64, value: u64, bytes: u32) -> Result<()> {
        let mut t = LaunchTracking::new(&self.dev);
        t.untracked = true;
        // SAFETY: the caller's contract.
        self.enqueue_tracked(t, |b| unsafe { b.write_value(addr, value, bytes) })?;
        Ok(())
    }

    /// Queues writes of `words` at `dst` (a pointer made for `words.len()` words: a window's
    /// slot range or a buffer's), in stream order (after the stream's earlier work, before
    /// its later work), by the driver's stream memory operations: how a kernel's small
    /// argument table reaches the device without a host copy that waits, and without
    /// changing it under a kernel still reading it. Tracked as `dst` says. (The values are
    /// taken now.) On CUDA the memory must not come from a stream-ordered pool (the driver
    /// refuses stream memory operations there): window memory is fine.
    pub(crate) fn write_words(&self, dst: TrackedPtr<'_, *mut u64>, words: &[u64]) -> Result<()> {
        let mut t = LaunchTracking::new(&self.dev);
        dst.track(&mut t);
        let base = dst.param() as u64;
        let writes: Vec<(u64, u64, u32)> =
            words.iter().enumerate().map(|(i, &w)| (base + i as u64 * 8, w, 8)).collect();
        self.enqueue_tracked(t, |b| {
            // The driver takes fewer than 256 operations per call.
            for part in writes.chunks(128) {
                // SAFETY: every address is an aligned word of the range `dst` was made for
                // (its maker checked the length), kept alive by the tracking until the writes
                // have run.
                unsafe { b.write_values(part)? };
            }
            Ok(())
        })?;
        Ok(())
    }

    /// Queues `copy` `(dst, src, bytes)` if any, the writes `(addr, value, bytes)` in order,
    /// then, with `wait` `(addr, value)`, a wait until that 64-bit word is at least `value`,
    /// as one piece of work tracked by `t` (how a collective is handed to the persistent
    /// kernel and its end awaited, in stream order). The last write completes the message:
    /// the copy and the other writes are only ordered before it.
    ///
    /// # Safety
    /// As [`StreamBackend::copy_dtod`] for the copy, [`StreamBackend::write_value`] for each
    /// write and [`StreamBackend::wait_value`] for the wait; `t` covers everything the work
    /// the wait stands for uses.
    pub(crate) unsafe fn post(
        &self,
        t: LaunchTracking,
        copy: Option<(u64, u64, usize)>,
        writes: &[(u64, u64, u32)],
        wait: Option<(u64, u64)>,
    ) -> Result<Completion> {
        // SAFETY: the caller's contract.
        self.enqueue_tracked(t, |b| unsafe { b.post(copy, writes, wait) })
    }

    /// Queues the driver's copy of `bytes` from `src` to `dst` and returns its completion,
    /// noted in nothing and waiting for nothing: the caller notes it where the ranges'
    /// memory keeps its uses (a GPU group's copy of its launch entries). Unlike
    /// [`Stream::copy_raw`], it neither marks the device's work untracked nor waits for other
    /// streams' uses of the memory.
    ///
    /// # Safety
    /// Both ranges are device memory of this device (or host-mapped memory), not
    /// overlapping, valid until the copy has run, and no other work races with the copy.
    pub(crate) unsafe fn copy_then_record(&self, dst: u64, src: u64, bytes: usize) -> Result<Completion> {
        // SAFETY: the caller's contract.
        unsafe { self.core.backend().copy_dtod(dst, src, bytes)? };
        self.record_completion()
    }

    /// A completion recorded here now: the point other streams wait for with
    /// [`Stream::wait_for`] (not while capturing: a capture's events are not this stream's).
    pub(crate) fn record_completion(&self) -> Result<Completion> {
        Ok(Completion::new(self.core.backend().record(false)?, self.core.id))
    }

    /// A completion that stands for everything queued here so far: the work the stream
    /// follows if nothing was queued since ([`Stream::follow`]: no event recorded), else a
    /// completion recorded now. How a GPU group's member marks its arrival: in a loop of
    /// collectives the members' streams then record nothing.
    pub(crate) fn arrival(&self) -> Result<Completion> {
        if let Some(c) = lock(&self.core.follow).as_ref() {
            return Ok(c.clone());
        }
        self.record_completion()
    }

    /// Makes this stream's later work come after `c`, lazily: the stream queues the wait for
    /// it only before its next work, or a host wait on it (as
    /// [`Stream::post_deferred`]'s waits), so that a member of a GPU group whose next call
    /// is the group's next collective queues nothing. `c` must come after everything queued
    /// here so far (work that waited for this stream's [`Stream::arrival`]): it replaces the
    /// work the stream followed. Also the stream's tail.
    pub(crate) fn follow(&self, c: Completion) {
        *lock(&self.core.tail) = Some(c.clone());
        if c.stream() != self.core.id {
            *lock(&self.core.follow) = Some(c);
        }
    }

    /// Makes this stream's later work wait until `c` has passed (a CUDA-visible dependency
    /// between streams: an event wait, never a wait on a memory value).
    pub(crate) fn wait_for(&self, c: &Completion) -> Result<()> {
        if c.stream() == self.core.id {
            return Ok(());
        }
        match settled(c.event())? {
            Some(e) => self.core.backend().wait_event(&e),
            None => Ok(()),
        }
    }

    /// Hands operation `seq` to a persistent kernel without waiting for it: queues `copy`
    /// (the operation's description, as in [`Stream::post`]), the write of `seq` into
    /// `seq_word` and, when an earlier deferred operation is `window` or more
    /// behind, a wait until `completed_word` reaches `seq - window / 2` (one batch), so that
    /// the event that marks the waited-for operations' end is recorded once per `window / 2`
    /// or so hand-overs, not at each (an event record is a driver call on every call's path:
    /// PERF.md call 21). The stream
    /// waits for the rest before any other work it queues (and a host or stream wait for the
    /// returned completion queues it): consecutive operations run back to back on the kernel
    /// while the stream's waits trail behind. `t` (what the operation uses) is ordered after
    /// other streams' uses now and noted with the returned completion, which stands for the
    /// operation's end.
    ///
    /// # Safety
    /// As [`StreamBackend::copy_dtod`] for `copy`, [`StreamBackend::write_value`] for
    /// `seq_word` and [`StreamBackend::wait_value`] for `completed_word`, which must stay live until every deferred wait on it has passed
    /// (`t` holds it); the kernel publishes completion of operation `s` by raising
    /// `completed_word` to at least `s`, in order.
    pub(crate) unsafe fn post_deferred(
        &self,
        t: LaunchTracking,
        copy: (u64, u64, usize),
        seq_word: u64,
        completed_word: u64,
        seq: u64,
        window: u64,
    ) -> Result<Completion> {
        t.check()?;
        if self.is_capturing() {
            return Err(Error::InvalidArgument("a persistent collective cannot be captured into a graph".into()));
        }
        let stale = {
            let d = lock(&self.core.deferred);
            !d.pending.is_empty() && d.word != completed_word
        };
        self.core.settle_follow()?;
        if stale {
            self.core.settle()?;
        }
        let backend = self.core.raw_backend();
        // Before taking this stream's lock: waiting for another stream's deferred operation
        // takes that stream's lock (two streams waiting for each other's must not deadlock).
        self.core.wait_foreign(&*backend, &t)?;
        let mut d = lock(&self.core.deferred);
        d.word = completed_word;
        let target = seq.saturating_sub(window / 2);
        let wait = d.pending.first().is_some_and(|&(s, _)| s.saturating_add(window) <= seq);
        // SAFETY: the caller's contract.
        unsafe { backend.post(Some(copy), &[(seq_word, seq, 8)], wait.then_some((completed_word, target)))? };
        if wait {
            let e = backend.record(false)?;
            let done = d.pending.iter().take_while(|(s, _)| *s <= target).count();
            for (_, ev) in d.pending.drain(..done) {
                let _ = ev.real.set(e.clone());
            }
        }
        let ev = Arc::new(DeferredEvent { stream: Arc::downgrade(&self.core), real: OnceLock::new() });
        d.pending.push((seq, ev.clone()));
        drop(d);
        let c = Completion::new(ev, self.core.id);
        self.core.record_uses(t, &c);
        Ok(c)
    }

    /// Queues the copy `(dst, src, bytes)` if any, then the writes `(addr, value, bytes)` in
    /// order, as one untracked piece of work with one completion (the GIN copy engine's put:
    /// data, then its signal). One event for all of it: each event costs a driver call to
    /// make and one to record, on the proxy's latency path.
    ///
    /// # Safety
    /// As [`Stream::copy_raw`] for the copy and [`Stream::write_value_raw`] for each write.
    pub(crate) unsafe fn copy_then_write_raw(
        &self,
        copy: Option<(u64, u64, usize)>,
        writes: &[(u64, u64, u32)],
    ) -> Result<Completion> {
        let mut t = LaunchTracking::new(&self.dev);
        t.untracked = true;
        self.enqueue_tracked(t, |b| {
            if let Some((dst, src, bytes)) = copy {
                // SAFETY: the caller's contract.
                unsafe { b.copy_dtod(dst, src, bytes)? };
            }
            // SAFETY: the caller's contract.
            unsafe { b.write_values(writes) }
        })
    }

    /// Captures the work `queue` puts on this stream into a [`Graph`] instead of running it
    /// (CUDA stream capture, relaxed mode; on the emulator the operations are recorded). The
    /// graph keeps everything the work uses alive while it exists, and each
    /// [`Graph::launch`] is tracked like the work itself. Host waits on the stream inside
    /// `queue` are errors; work of other streams that the captured work depends on is waited
    /// for on the host, at capture time. The work must be replayable as it is: collectives
    /// are (their barriers keep their state on the device); point-to-point groups are not
    /// (their sequence numbers are counted on the host) and refuse to be captured.
    ///
    /// ```
    /// # use ferrolink::{Device, LaunchConfig};
    /// # use ferrolink_device::kernels::copy::ferrolink_copy;
    /// # fn main() -> ferrolink::Result<()> {
    /// let dev = Device::open(0)?;
    /// let stream = dev.create_stream()?;
    /// let mut src = dev.alloc_from(&[1u8; 64])?;
    /// let mut dst = dev.alloc::<u8>(64)?;
    /// let graph = stream.capture(|| {
    ///     // SAFETY: the copy kernel's contract: 64 bytes each, no overlap.
    ///     unsafe { stream.launch(dev.builtin_module()?, &ferrolink_copy, LaunchConfig::linear(1, 32), (&mut dst, &src, 64usize)) }
    /// })?;
    /// assert_eq!(dst.to_vec()?, vec![0u8; 64]); // captured, not run
    /// for v in 2..5u8 {
    ///     src.copy_from_host(&[v; 64])?;
    ///     graph.launch(&stream)?;
    ///     assert_eq!(dst.to_vec()?, vec![v; 64]);
    /// }
    /// # Ok(()) }
    /// ```
    pub fn capture(&self, queue: impl FnOnce() -> Result<()>) -> Result<Graph> {
        self.capture_graph(false, queue)
    }

    /// [`Stream::capture`] for a graph that kernels launch too
    /// ([`ferrolink_device::graph::DeviceGraph::launch`]): instantiated for device launch and
    /// uploaded on this stream. Pass `&graph` to a kernel, as an argument of a launch that is
    /// itself captured into a graph (the device runtime launches graphs only from kernels
    /// that run inside one); the argument becomes a
    /// [`DeviceGraph`] and makes the launch track what
    /// the graph uses. Such a graph may hold only kernels, copies of device or mapped memory
    /// and memsets (CUDA's rule for device graphs): collectives, whose streams wait for words,
    /// are refused when the capture ends. Linking: a module whose kernels launch graphs is
    /// linked with the CUDA device runtime (`libcudadevrt.a`, found through
    /// `FERROLINK_CUDADEVRT`, `CUDA_HOME` or `/usr/local/cuda`) when it is loaded.
    ///
    /// ```
    /// # use ferrolink::{Device, LaunchConfig};
    /// # use ferrolink_device::kernels::copy::ferrolink_copy;
    /// # fn main() -> ferrolink::Result<()> {
    /// let dev = Device::open(0)?;
    /// let stream = dev.create_stream()?;
    /// let src = dev.alloc_from(&[3u8; 64])?;
    /// let mut dst = dev.alloc::<u8>(64)?;
    /// let graph = stream.capture_for_device_launch(|| {
    ///     // SAFETY: the copy kernel's contract: 64 bytes each, no overlap.
    ///     unsafe { stream.launch(dev.builtin_module()?, &ferrolink_copy, LaunchConfig::linear(1, 32), (&mut dst, &src, 64usize)) }
    /// })?;
    /// assert!(graph.device_graph().is_some());
    /// graph.launch(&stream)?; // from the host too
    /// assert_eq!(dst.to_vec()?, vec![3u8; 64]);
    /// # Ok(()) }
    /// ```
    pub fn capture_for_device_launch(&self, queue: impl FnOnce() -> Result<()>) -> Result<Graph> {
        self.capture_graph(true, queue)
    }

    fn capture_graph(&self, device_launch: bool, queue: impl FnOnce() -> Result<()>) -> Result<Graph> {
        {
            let mut cap = lock(&self.core.capture);
            if cap.is_some() {
                return Err(Error::InvalidArgument("capture: the stream is capturing already".into()));
            }
            self.core.backend().begin_capture()?;
            *cap = Some(Captured::default());
        }
        // Ends the capture if `queue` panics: the stream must not stay in capture mode.
        struct EndOnUnwind<'a>(&'a StreamCore, bool);
        impl Drop for EndOnUnwind<'_> {
            fn drop(&mut self) {
                if self.1 {
                    lock(&self.0.capture).take();
                    let _ = self.0.backend().end_capture(false);
                }
            }
        }
        let mut guard = EndOnUnwind(&self.core, true);
        let queued = queue();
        guard.1 = false;
        let captured = lock(&self.core.capture).take().expect("set above");
        let graph = self.core.backend().end_capture(device_launch);
        queued?;
        let graph = graph?;
        let mut captured = captured;
        // Each captured operation added what it uses: keep each resource once.
        for list in [&mut captured.reads, &mut captured.writes, &mut captured.holds] {
            list.sort_by_key(|u| Arc::as_ptr(u) as usize);
            list.dedup_by(|a, b| Arc::ptr_eq(a, b));
        }
        let keeper = Arc::new(lifetime::HostFlag::default());
        let keep = Completion::new(keeper.clone(), lifetime::next_stream_id());
        for u in captured.reads.iter().chain(&captured.writes).chain(&captured.holds) {
            u.record_keeper(&keep);
        }
        if captured.untracked {
            self.dev.0.untracked.record_keeper(&keep);
        }
        Ok(Graph {
            dev: self.dev.clone(),
            backend: Some(graph),
            captured,
            keeper,
            launches: Mutex::new(Vec::new()),
            uses: Arc::default(),
        })
    }

    /// Whether [`Stream::capture`] is running on this stream.
    pub(crate) fn is_capturing(&self) -> bool {
        lock(&self.core.capture).is_some()
    }

    /// Queues a run of `graph` (tracked like the captured work).
    fn launch_graph(&self, graph: &Graph) -> Result<Completion> {
        if graph.dev.backend_device().key() != self.dev.backend_device().key() {
            return Err(Error::WrongDevice("graph"));
        }
        let mut t = LaunchTracking::new(&self.dev);
        t.reads.extend(graph.captured.reads.iter().cloned());
        t.writes.extend(graph.captured.writes.iter().cloned());
        t.holds.extend(graph.captured.holds.iter().cloned());
        t.untracked = graph.captured.untracked;
        let g = graph.backend.as_deref().expect("present until drop");
        self.enqueue_tracked(t, |b| b.launch_graph(g))
    }

    /// Records an event: a point in the stream, with the time the stream reached it.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let stream = dev.create_stream()?;
    /// let start = stream.record_event()?;
    /// let end = stream.record_event()?;
    /// assert!(end.elapsed_ms_since(&start)? >= 0.0);
    /// # Ok(()) }
    /// ```
    pub fn record_event(&self) -> Result<Event> {
        Ok(Event { dev: self.dev.clone(), event: self.core.backend().record(true)? })
    }
}

/// A point in a stream, with the time the stream reached it (see [`Stream::record_event`]).
///
/// ```
/// # fn main() -> ferrolink::Result<()> {
/// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// # let stream = dev.create_stream()?;
/// let (src, mut dst) = (dev.alloc_from(&[1u8; 4096])?, dev.alloc::<u8>(4096)?);
/// let start = stream.record_event()?;
/// ferrolink::ops::copy(&stream, &mut dst, &src)?;
/// let end = stream.record_event()?;
/// let ms = end.elapsed_ms_since(&start)?; // waits for both
/// assert!(ms >= 0.0 && end.is_reached());
/// # Ok(()) }
/// ```
pub struct Event {
    dev: Device,
    event: Arc<dyn EventBackend>,
}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Event").field("device", &self.dev).finish()
    }
}

impl Event {
    /// Whether the stream has reached this event (or failed before it); does not wait.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let stream = dev.create_stream()?;
    /// let event = stream.record_event()?;
    /// stream.synchronize()?;
    /// assert!(event.is_reached());
    /// # Ok(()) }
    /// ```
    pub fn is_reached(&self) -> bool {
        !matches!(self.event.query(), crate::runtime::backend::EventState::Pending)
    }

    /// Milliseconds between `start` and this event (waits for both).
    ///
    /// ```
    /// # use ferrolink::{Backend, Device, Error};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(Backend::Cpu, 0)?;
    /// # let stream = dev.create_stream()?;
    /// let start = stream.record_event()?;
    /// let end = stream.record_event()?;
    /// assert!(end.elapsed_ms_since(&start)? >= 0.0);
    /// let elsewhere = Device::open_with(Backend::Cpu, 1)?.create_stream()?.record_event()?;
    /// assert!(matches!(end.elapsed_ms_since(&elsewhere), Err(Error::WrongDevice(_))));
    /// # Ok(()) }
    /// ```
    pub fn elapsed_ms_since(&self, start: &Event) -> Result<f32> {
        if !self.dev.same_as(&start.dev) {
            return Err(Error::WrongDevice("event"));
        }
        self.event.elapsed_ms_since(&*start.event)
    }

    /// Waits until the stream has reached this event.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let stream = dev.create_stream()?;
    /// let event = stream.record_event()?;
    /// event.synchronize()?;
    /// assert!(event.is_reached());
    /// # Ok(()) }
    /// ```
    pub fn synchronize(&self) -> Result<()> {
        self.event.synchronize()
    }
}

/// Captured stream work, launched as a whole ([`Stream::capture`]): a CUDA graph on CUDA,
/// the recorded operations on the emulator. Dropping it does not wait: its executable is
/// released once its launches have finished, and what it uses stays alive until then.
///
/// ```
/// # fn main() -> ferrolink::Result<()> {
/// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// # let stream = dev.create_stream()?;
/// let src = dev.alloc_from(&[4u16; 8])?;
/// let mut dst = dev.alloc::<u16>(8)?;
/// let graph = stream.capture(|| stream.copy_buffer(&mut dst, &src))?;
/// assert_eq!(dst.to_vec()?, [0; 8]); // captured, not run
/// graph.launch(&stream)?;
/// assert_eq!(dst.to_vec()?, [4; 8]);
/// # Ok(()) }
/// ```
pub struct Graph {
    dev: Device,
    backend: Option<Box<dyn GraphBackend>>,
    captured: Captured,
    /// Raised when the graph is dropped: until then, freeing what it uses waits.
    keeper: Arc<lifetime::HostFlag>,
    /// The last launch's completion per stream.
    launches: Mutex<Vec<Completion>>,
    /// Kernels' launches that may launch it (`&Graph` arguments): its executable lives until
    /// they have finished.
    uses: Arc<lifetime::Uses>,
}

impl std::fmt::Debug for Graph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Graph").field("device", &self.dev).finish()
    }
}

impl Graph {
    /// Queues one run of the captured work on `stream` (any stream of the device), ordered
    /// after other streams' uses of its memory as the work itself would be.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let (capturing, other) = (dev.create_stream()?, dev.create_stream()?);
    /// let mut src = dev.alloc_from(&[1u8; 16])?;
    /// let mut dst = dev.alloc::<u8>(16)?;
    /// let graph = capturing.capture(|| capturing.copy_buffer(&mut dst, &src))?;
    /// for v in 2..4u8 {
    ///     src.copy_from_host(&[v; 16])?;
    ///     graph.launch(&other)?; // any stream of the device
    ///     assert_eq!(dst.to_vec()?, [v; 16]);
    /// }
    /// # Ok(()) }
    /// ```
    pub fn launch(&self, stream: &Stream) -> Result<()> {
        let c = stream.launch_graph(self)?;
        let mut l = lock(&self.launches);
        l.retain(|x| x.stream() != c.stream() && !x.finished());
        l.push(c);
        Ok(())
    }
}

impl Graph {
    /// The handle kernels launch it by, when it was made by
    /// [`Stream::capture_for_device_launch`]. Passing `&graph` as a launch argument gives
    /// the kernel the same handle and also tracks what the graph uses, as the launch's own
    /// reads and writes. A kernel that launches the graph only once a flag says that its
    /// inputs are ready (a scheduler waiting for a collective that writes them) takes this
    /// raw handle instead: tracked, the collective would wait for the scheduler, which waits
    /// for the collective. A launch with the raw handle is untracked work: the graph's
    /// executable, and memory freed meanwhile, live until it has finished; the kernel's
    /// flags order the graph's accesses.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let stream = dev.create_stream()?;
    /// let (src, mut dst) = (dev.alloc_from(&[1u8; 8])?, dev.alloc::<u8>(8)?);
    /// let host_only = stream.capture(|| stream.copy_buffer(&mut dst, &src))?;
    /// assert!(host_only.device_graph().is_none());
    /// let for_kernels = stream.capture_for_device_launch(|| stream.copy_buffer(&mut dst, &src))?;
    /// assert!(for_kernels.device_graph().is_some());
    /// # Ok(()) }
    /// ```
    pub fn device_graph(&self) -> Option<DeviceGraph> {
        let exec = self.backend.as_deref().map_or(0, |g| g.device_handle());
        (exec != 0).then_some(DeviceGraph { exec })
    }
}

impl Sealed for &Graph {}

/// A graph as a kernel argument: the kernel gets its [`DeviceGraph`] (null for a graph made
/// for host launch only: launching it is refused on the device), and the launch is tracked
/// as the graph's work (what it reads and writes, and the graph itself, which lives until
/// the launch has finished).
impl LaunchArg for &Graph {
    type Param = DeviceGraph;
    fn param(&self) -> DeviceGraph {
        self.device_graph().unwrap_or_default()
    }
    fn track(&self, t: &mut LaunchTracking) {
        t.expect_device(&self.dev, "graph");
        t.reads.extend(self.captured.reads.iter().cloned());
        t.writes.extend(self.captured.writes.iter().cloned());
        t.holds.extend(self.captured.holds.iter().cloned());
        t.holds.push(self.uses.clone());
        t.untracked |= self.captured.untracked;
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        self.keeper.raise();
        if let Some(g) = self.backend.take() {
            let mut waits = std::mem::take(&mut *lock(&self.launches));
            waits.extend(self.uses.pending_for_free());
            // Launches that got its raw handle (`device_graph`) are tracked as untracked work
            // (not the live graphs' keepers: those would hold its executable for their life).
            waits.extend(self.dev.0.untracked.pending());
            lifetime::retire(waits, Box::new(g), "graph");
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::{Backend, Device, LaunchConfig};
    use ferrolink_device::kernels::copy::ferrolink_copy;

    /// A stream that follows another's work (lazily, `Stream::follow`) runs its next work
    /// after that work; its arrival is the followed work until it queues something.
    #[test]
    fn a_following_stream_runs_its_next_work_after_the_followed_work() {
        use crate::runtime::host_mapped::HostMapped;
        use crate::runtime::launch::LaunchTracking;
        let dev = Device::open_with(Backend::Cpu, 0).unwrap();
        let (a, b) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
        let gate = HostMapped::alloc(&dev, 8).unwrap();
        let src = dev.alloc_from(&[7u8; 64]).unwrap();
        let mid = dev.alloc::<u8>(64).unwrap();
        let out = dev.alloc::<u8>(64).unwrap();
        // SAFETY: `gate` is an aligned host-mapped word, alive until the streams have been
        // synchronized below; the buffers hold 64 bytes each and do not overlap.
        unsafe {
            a.post(LaunchTracking::new(&dev), None, &[], Some((gate.device_addr(), 1))).unwrap();
            a.copy_raw(mid.addr(), src.addr(), 64).unwrap();
        }
        let done = a.record_completion().unwrap();
        b.follow(done.clone());
        assert!(b.arrival().unwrap().stream() == done.stream(), "nothing queued since: the followed work");
        // SAFETY: as above.
        unsafe { b.copy_raw(out.addr(), mid.addr(), 64).unwrap() };
        let copied = b.record_completion().unwrap();
        assert!(!copied.finished() && !done.finished(), "stream a waits for the gate, b for a");
        // SAFETY: the word is host-mapped, 8-byte aligned, read by stream `a` only atomically.
        unsafe { (gate.host_ptr() as *const std::sync::atomic::AtomicU64).as_ref().unwrap() }
            .store(1, std::sync::atomic::Ordering::Release);
        b.synchronize().unwrap();
        assert_eq!(out.to_vec().unwrap(), vec![7u8; 64]);
        a.synchronize().unwrap();
    }

    /// `post_deferred`'s cadence (PERF.md call 21: an event record is a driver call on every
    /// persistent call's path): with a window of 8 the stream queues a wait only when the
    /// oldest operation not waited for is 8 posts behind, at posts 9, 14 and 19, each for the
    /// operations up to 4 back (one event for those 5), and never has more than 8 pending. An
    /// operation's event stands for the wait on its completion word: pending until the
    /// (simulated) kernel raises the word that far.
    #[test]
    fn deferred_waits_are_queued_once_per_half_window() {
        use super::DeferredEvent;
        use crate::runtime::host_mapped::HostMapped;
        use crate::runtime::launch::LaunchTracking;
        use crate::runtime::lifetime::lock;
        use std::sync::atomic::{AtomicU64, Ordering};
        const WINDOW: u64 = 8;
        let dev = Device::open_with(Backend::Cpu, 0).unwrap();
        let stream = dev.create_stream().unwrap();
        // The persistent kernel's sync block: the sequence number the host writes, and the
        // completion word the simulated kernel raises.
        let seq_word = HostMapped::alloc(&dev, 8).unwrap();
        let completed = HostMapped::alloc(&dev, 8).unwrap();
        // SAFETY: 8-byte aligned host-mapped words, alive until the stream is synchronized
        // at the end; the stream reads and writes them only atomically.
        let (seq_now, completed_now) = unsafe {
            (
                (seq_word.host_ptr() as *const AtomicU64).as_ref().unwrap(),
                (completed.host_ptr() as *const AtomicU64).as_ref().unwrap(),
            )
        };
        let src = dev.alloc_from(&[3u8; 64]).unwrap();
        let ring = dev.alloc::<u8>(64).unwrap();
        let resolved = |c: &crate::runtime::lifetime::Completion| {
            c.event().as_any().downcast_ref::<DeferredEvent>().expect("a deferred event").real.get().cloned()
        };
        let pending = || lock(&stream.core.deferred).pending.iter().map(|&(s, _)| s).collect::<Vec<u64>>();
        let mut ops = Vec::new();
        let mut waits_at = Vec::new();
        for seq in 1..=20u64 {
            let before = pending();
            // SAFETY: `ring` and `src` hold 64 bytes each and do not overlap; the words are
            // host-mapped and live until the stream is synchronized below (the contract's
            // "kernel" is this test, which raises `completed` in order).
            let c = unsafe {
                stream
                    .post_deferred(
                        LaunchTracking::new(&dev),
                        (ring.addr(), src.addr(), 64),
                        seq_word.device_addr(),
                        completed.device_addr(),
                        seq,
                        WINDOW,
                    )
                    .unwrap()
            };
            let after = pending();
            assert!(after.len() as u64 <= WINDOW, "at post {seq}: {after:?} pending");
            assert_eq!(after.last(), Some(&seq));
            if after.len() <= before.len() {
                // A wait was queued: every operation up to `seq - WINDOW / 2` now has its event.
                waits_at.push(seq);
                let target = seq - WINDOW / 2;
                assert_eq!(after.first(), Some(&(target + 1)), "at post {seq}");
            }
            ops.push(c);
        }
        assert_eq!(waits_at, vec![9, 14, 19], "one wait per WINDOW / 2 + 1 posts");
        // Operations 1..=5 share the event of the wait queued at post 9, 6..=10 that of post 14.
        let e1 = resolved(&ops[0]).expect("resolved by the wait at post 9");
        for (i, op) in ops.iter().enumerate().take(5) {
            assert!(std::sync::Arc::ptr_eq(&resolved(op).unwrap(), &e1), "operation {}", i + 1);
        }
        let e6 = resolved(&ops[5]).expect("resolved by the wait at post 14");
        assert!(!std::sync::Arc::ptr_eq(&e1, &e6));
        assert!(resolved(&ops[15]).is_none(), "operation 16 is waited for by nothing yet");
        // The stream's wait at post 9 holds until the kernel has completed operation 5.
        assert!(!ops[0].finished(), "the completion word is 0");
        completed_now.store(4, Ordering::Release);
        assert!(!ops[0].finished(), "operation 5 has not completed");
        completed_now.store(5, Ordering::Release);
        ops[4].event().synchronize().unwrap();
        assert!(ops[0].finished() && ops[4].finished());
        // A host wait for an operation nobody waits for yet queues the wait for all of them.
        completed_now.store(20, Ordering::Release);
        ops[19].event().synchronize().unwrap();
        assert!(pending().is_empty(), "the host's wait settled every deferred operation");
        stream.synchronize().unwrap();
        assert_eq!(seq_now.load(Ordering::Acquire), 20);
        assert_eq!(ring.to_vec().unwrap(), vec![3u8; 64]);
    }

    /// `write_async` and `read_sync` run after the stream's earlier work; `read_sync` is done
    /// when it returns, `write_async` once the stream is synchronized (the GIN proxy's copies
    /// rely on both), on every backend.
    #[test]
    fn synchronous_stream_copies_follow_the_streams_work() {
        crate::testing::for_each_backend("synchronous_stream_copies_follow_the_streams_work", |dev| {
            let stream = dev.backend_device().create_stream()?;
            let old: Vec<u8> = (0..200u8).collect();
            let a = dev.alloc_from(&old)?;
            let b = dev.alloc::<u8>(old.len())?;
            let new = vec![0xa5u8; old.len()];
            let mut back = vec![0u8; old.len()];
            // SAFETY: `a` and `b` hold 200 bytes each, do not overlap and live until the
            // stream has run everything (each call below waits for it); nothing else uses them.
            unsafe {
                stream.copy_dtod(b.addr(), a.addr(), old.len())?;
                stream.write_async(a.addr(), &new)?;
                stream.read_sync(&mut back, b.addr())?;
            }
            assert_eq!(back, old, "the copy queued first read `a` before the write");
            stream.synchronize()?;
            // SAFETY: as above.
            unsafe { stream.read_sync(&mut back, a.addr())? };
            assert_eq!(back, new, "the write is done once the stream is synchronized");
            // SAFETY: empty ranges.
            unsafe {
                stream.write_async(a.addr(), &[])?;
                stream.read_sync(&mut [], a.addr())?;
            }
            Ok(())
        });
    }

    /// A graph holds what it uses for freeing (a keeper) but not for host accesses, replays
    /// with new inputs, and lets go when dropped; a capture whose closure fails or panics
    /// leaves the stream usable.
    #[test]
    fn graphs_keep_their_memory_and_failed_captures_end() {
        let dev = Device::open_with(Backend::Cpu, 0).unwrap();
        let stream = dev.create_stream().unwrap();
        let mut src = dev.alloc_from(&[5u8; 64]).unwrap();
        let mut dst = dev.alloc::<u8>(64).unwrap();
        let graph = stream
            .capture(|| {
                // SAFETY: the copy kernel's contract: 64 bytes each, no overlap.
                unsafe {
                    stream.launch(
                        dev.builtin_module()?,
                        &ferrolink_copy,
                        LaunchConfig::linear(1, 8),
                        (&mut dst, &src, 64usize),
                    )
                }
            })
            .unwrap();
        for v in [9u8, 10, 11] {
            src.copy_from_host(&[v; 64]).unwrap();
            graph.launch(&stream).unwrap();
            assert_eq!(dst.to_vec().unwrap(), vec![v; 64]);
        }
        stream.synchronize().unwrap();
        assert!(dst.uses().pending().is_empty(), "host accesses do not wait for a live graph");
        assert!(!dst.uses().pending_for_free().is_empty(), "freeing waits for a live graph");
        drop(graph);
        assert!(dst.uses().pending_for_free().is_empty(), "a dropped graph holds nothing");
        let err = stream.capture(|| Err(crate::Error::InvalidArgument("no".into()))).expect_err("the closure failed");
        assert!(err.to_string().contains("no"));
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _ = stream.capture(|| panic!("inside a capture"));
        }));
        assert!(panicked.is_err());
        // Not capturing any more: a synchronize works.
        stream.synchronize().unwrap();
    }
}
