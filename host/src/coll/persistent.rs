//! Persistent mode: one long-lived kernel per rank runs the collectives (NCCL-style
//! persistent kernels; the book chapter's device-side work queue).
//!
//! [`Communicator::start_persistent`] (collective) launches, on a stream of its own, a kernel
//! of a few CTAs that waits on a mailbox in device memory. From then on each collective call
//! queues, on the rank's stream and in its order, the stream memory writes of the operation
//! and its sequence number (one `cuStreamBatchMemOp`), then a stream wait for the completion
//! word (`cuStreamWaitValue64`, greater or equal): no kernel launch, and the stream's later
//! work (and the host, through the stream) sees the result when the kernel has finished it.
//! Staging copies for device buffers stay kernels on the stream, as without persistent mode.
//! [`Communicator::stop_persistent`] ends the kernel; an abort of the communicator ends it
//! too, and releases every stream waiting on it (their work then reports the abort).
//!
//! ```
//! # fn main() -> ferrolink::Result<()> {
//! use ferrolink::coll::ReduceOp;
//! use ferrolink::{Communicator, Device, run_ranks};
//! let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
//! let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
//! let sums = run_ranks(&comms, |c| {
//!     c.start_persistent(Default::default())?;
//!     let send = c.device().alloc_from(&[c.rank() as f32 + 1.0; 5])?;
//!     let mut recv = c.device().alloc::<f32>(5)?;
//!     c.all_reduce(&send, &mut recv, ReduceOp::Sum)?; // no launch: the kernel runs it
//!     let out = recv.to_vec()?;
//!     c.stop_persistent()?;
//!     Ok(out)
//! })?;
//! assert_eq!(sums[0], vec![3.0; 5]);
//! # Ok(()) }
//! ```

use crate::comm::Communicator;
use crate::devcomm::{DevCommHandle, DevCommRequirements};
use crate::mem::window::Window;
use crate::runtime::launch::{LaunchArg, LaunchConfig, LaunchTracking};
use crate::runtime::lifetime::lock;
use crate::runtime::memory::TrackedPtr;
use crate::runtime::stream::Stream;
use crate::{Backend, Error, Result};
use ferrolink_device::coll::CollArgs;
use ferrolink_device::coll::persistent::{self, COMPLETED_OFFSET, CollOp, Mailbox, OP_WORDS, SEQ_OFFSET};
use ferrolink_device::kernels::coll::coll_persistent;
use std::time::Duration;

/// CTAs of the persistent kernel by default (each a 256-thread CTA on an SM of its own).
pub const DEFAULT_PERSISTENT_CTAS: u32 = 16;

/// How [`Communicator::start_persistent`] sets persistent mode up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PersistentConfig {
    /// CTAs of the kernel (`None`: [`DEFAULT_PERSISTENT_CTAS`], at most the GPU's SMs over
    /// the ranks sharing it).
    pub ctas: Option<u32>,
    /// Bytes of staging (each of the collectives' send and receive windows) made at the
    /// start: while the kernel runs nothing can be allocated (an allocation may wait for the
    /// device to idle, which a persistent kernel never does), so calls from device buffers
    /// needing more are errors. Windows (zero copy) need none.
    pub staging_bytes: usize,
}

impl Default for PersistentConfig {
    fn default() -> Self {
        PersistentConfig { ctas: None, staging_bytes: 16 << 20 }
    }
}

/// One rank's persistent kernel.
pub(crate) struct PersistentState {
    ctas: u32,
    mailbox: Window,
    /// The kernel's stream (kept: the kernel runs on it until stopped).
    stream: Stream,
    /// The rank's stream: a drop in persistent mode queues the shutdown there, after the
    /// rank's collectives.
    comm_stream: Stream,
    /// Keeps the kernel's device communicator alive (the launch tracks it too).
    _handle: DevCommHandle,
    /// The next operation's sequence number.
    next: u64,
}

impl Communicator {
    /// Starts persistent mode (collective: every rank calls it with the same `cfg`).
    /// Collectives then run in this rank's persistent kernel, queued by stream memory
    /// operations instead of launched. See the [module docs](self).
    pub fn start_persistent(&self, cfg: PersistentConfig) -> Result<()> {
        let ctas = cfg.ctas;
        let n = self.nranks();
        if self.lsa_size() != n {
            return Err(Error::InvalidArgument(
                "start_persistent: persistent collectives need one LSA domain (as the collectives do)".into(),
            ));
        }
        let dev = self.device();
        let most = match dev.backend() {
            Backend::Cuda => (dev.sm_count() / self.ranks_sharing_gpu() as u32).max(1),
            Backend::Cpu => 4,
        };
        let ctas = ctas.unwrap_or(DEFAULT_PERSISTENT_CTAS.min(most));
        if ctas == 0 || ctas > most.min(super::MAX_CTAS) {
            return Err(Error::InvalidArgument(format!(
                "start_persistent: {ctas} CTAs; between 1 and {} here (every CTA must stay resident beside \
                 the other ranks' on this GPU)",
                most.min(super::MAX_CTAS)
            )));
        }
        if self.is_persistent() {
            return Err(Error::InvalidArgument("start_persistent: already started".into()));
        }
        // Everything before the launch: the module, the collectives' resources, the mailbox
        // (zeroed), the device communicator, the stream (making any of them may wait for
        // running kernels). The collectives' lock is taken (and released) before this one's,
        // in the order `collective` takes them: no deadlock between threads of one rank.
        let step =
            |what: &str| tracing::debug!(target: "ferrolink::coll", rank = self.rank(), "start_persistent: {what}");
        let module = dev.builtin_module()?;
        step("module loaded");
        self.prepare_collectives(cfg.staging_bytes)?;
        step("collectives' resources made");
        let mut guard = lock(&self.shared.persistent);
        if guard.is_some() {
            return Err(Error::InvalidArgument("start_persistent: already started".into()));
        }
        let mailbox = self.register_window(self.mem_alloc(std::mem::size_of::<Mailbox>())?)?;
        mailbox.zero(0, std::mem::size_of::<Mailbox>())?;
        step("mailbox made");
        let handle = self.create_dev_comm(&DevCommRequirements { lsa_barrier_count: ctas, ..Default::default() })?;
        let stream = dev.create_stream()?;
        step("device communicator and stream made");
        self.barrier()?;
        let threads = if dev.backend() == Backend::Cuda { 256 } else { 8 };
        // The kernel runs until stopped: no emulator time limit.
        let cfg = LaunchConfig {
            emulator_timeout: Some(Duration::from_secs(10 * 365 * 24 * 3600)),
            ..LaunchConfig::linear(ctas, threads)
        };
        let slot: TrackedPtr<'_, *mut Mailbox> = mailbox.slot_ptr(0, std::mem::size_of::<Mailbox>())?;
        // SAFETY: the kernel's contract: the mailbox is this rank's, zeroed, written only by
        // this rank's stream as `persistent::run` says (`enqueue_persistent`); every rank runs
        // the same operations (collective calls) with the same `ctas`; the device
        // communicator's barriers 0..ctas are the kernel's alone.
        unsafe { stream.launch(module, &coll_persistent, cfg, (&handle, slot))? };
        tracing::debug!(target: "ferrolink::coll", rank = self.rank(), ctas, "persistent kernel launched");
        *guard = Some(PersistentState {
            ctas,
            mailbox,
            stream,
            comm_stream: self.stream().share(),
            _handle: handle,
            next: 1,
        });
        Ok(())
    }

    /// Whether persistent mode is on.
    pub fn is_persistent(&self) -> bool {
        lock(&self.shared.persistent).is_some()
    }

    /// Ends persistent mode (collective): queues the shutdown on this rank's stream after its
    /// collectives, and waits for the kernel to end.
    pub fn stop_persistent(&self) -> Result<()> {
        let state = lock(&self.shared.persistent).take();
        let Some(mut state) = state else {
            return Err(Error::InvalidArgument("stop_persistent: persistent mode is not on".into()));
        };
        let args = CollArgs { kind: persistent::SHUTDOWN, ..CollArgs::default() };
        let op = CollOp { args, ..CollOp::default() };
        post(self, &mut state, op, LaunchTracking::new(self.device()))?;
        // The shutdown is queued: the drop must not queue another, whatever the kernel's end.
        state.next = 0;
        state.stream.synchronize()
    }

    /// Queues `args` (with its windows and output) for the persistent kernel, if persistent
    /// mode is on: `Ok(false)` if it is not.
    pub(crate) fn enqueue_persistent(
        &self,
        args: CollArgs,
        send: &Window,
        recv_win: &Window,
        recv: TrackedPtr<'_, *mut u8>,
    ) -> Result<bool> {
        let mut guard = lock(&self.shared.persistent);
        let Some(state) = guard.as_mut() else { return Ok(false) };
        if self.stream().is_capturing() {
            return Err(Error::InvalidArgument(
                "a collective in persistent mode cannot be captured into a graph: its sequence number is \
                 counted on the host, so a replay would not match the kernel's (stop_persistent first)"
                    .into(),
            ));
        }
        let mut t = LaunchTracking::new(self.device());
        send.track(&mut t);
        recv_win.track(&mut t);
        recv.track(&mut t);
        let op = CollOp { args, send: send.param(), recv_win: recv_win.param(), recv: recv.param() as u64 };
        post(self, state, op, t)?;
        Ok(true)
    }

    /// CTAs of the persistent kernel (parts of each collective), if on.
    pub(crate) fn persistent_ctas(&self) -> Option<u32> {
        lock(&self.shared.persistent).as_ref().map(|s| s.ctas)
    }
}

/// Queues on the rank's stream: the operation's words and its sequence number into the
/// mailbox, then a wait for its completion; `t` tracks what the operation uses.
fn post(comm: &Communicator, state: &mut PersistentState, op: CollOp, t: LaunchTracking) -> Result<()> {
    let seq = state.next;
    let words: [u64; OP_WORDS] = bytemuck::cast(op);
    let base = state.mailbox.slot_ptr::<*mut u8>(0, std::mem::size_of::<Mailbox>())?.param() as u64;
    let mut writes: Vec<(u64, u64, u32)> =
        words.iter().enumerate().map(|(i, &w)| (base + i as u64 * 8, w, 8)).collect();
    writes.push((base + SEQ_OFFSET as u64, seq, 8));
    let mut t = t;
    (&state.mailbox).track(&mut t);
    // SAFETY: aligned words of the live mailbox window (tracked: kept alive until the wait
    // has passed), written only by this stream and, atomically, the kernel; `t` covers the
    // operation's windows and output, which the kernel uses until `completed` reaches `seq`.
    unsafe { comm.stream().write_then_wait(t, &writes, base + COMPLETED_OFFSET as u64, seq)? };
    tracing::trace!(target: "ferrolink::coll", rank = comm.rank(), seq, kind = op.args.kind, "posted to the persistent kernel");
    state.next += 1;
    Ok(())
}

impl Drop for PersistentState {
    fn drop(&mut self) {
        // Stopped already (`next` is 0), or dropped in persistent mode: then queue the
        // shutdown on the rank's stream, after its collectives; nothing waits for it.
        if self.next == 0 {
            return;
        }
        let Ok(base) = self.mailbox.slot_ptr::<*mut u8>(0, std::mem::size_of::<Mailbox>()).map(|p| p.param() as u64)
        else {
            return;
        };
        let args = CollArgs { kind: persistent::SHUTDOWN, ..CollArgs::default() };
        let words: [u64; OP_WORDS] = bytemuck::cast(CollOp { args, ..CollOp::default() });
        let mut writes: Vec<(u64, u64, u32)> =
            words.iter().enumerate().map(|(i, &w)| (base + i as u64 * 8, w, 8)).collect();
        writes.push((base + SEQ_OFFSET as u64, self.next, 8));
        // SAFETY: aligned words of the mailbox, which the kernel's launch keeps alive until
        // the kernel ends (after this shutdown); the kernel reads them only after `seq`.
        if let Err(e) = unsafe { self.comm_stream.copy_then_write_raw(None, &writes) } {
            tracing::warn!(target: "ferrolink::coll", error = %e, "could not stop the persistent kernel");
        }
    }
}
