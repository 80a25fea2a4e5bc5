//! Streams (ordered queues of device work) and events (timestamps in a stream).

use crate::cpu::CpuStream;
use crate::cuda::{RawEvent, RawStream};
use crate::device::{Device, DeviceImpl};
use crate::launch::{KernelArgs, LaunchConfig, Module};
use crate::memory::DeviceBuffer;
use crate::{Error, Result};
use bytemuck::Pod;
use ferrolink_device::emulator::{self, LaunchSpec};
use ferrolink_device::kernel::Kernel;
use std::sync::{Arc, Mutex};
use std::time::Instant;

enum StreamImpl {
    Cuda(RawStream),
    Cpu(Arc<CpuStream>),
}

/// An in-order queue of device work. Work on different streams may run concurrently —
/// on CUDA the streams are non-blocking; on the CPU backend each is a worker thread.
pub struct Stream {
    dev: Device,
    imp: StreamImpl,
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stream").field("device", &self.dev).finish()
    }
}

struct SendArgs<A>(A);
// SAFETY: kernel arguments are values and device addresses handed to the emulator's
// threads; `Stream::launch` is unsafe and its caller vouches for what the kernel does.
unsafe impl<A> Send for SendArgs<A> {}

impl Stream {
    pub(crate) fn new(dev: &Device) -> Result<Stream> {
        let imp = match &dev.0.imp {
            DeviceImpl::Cuda(d) => StreamImpl::Cuda(d.create_stream()?),
            DeviceImpl::Cpu(d) => StreamImpl::Cpu(d.create_stream()?),
        };
        Ok(Stream { dev: dev.clone(), imp })
    }

    /// The stream's device.
    pub fn device(&self) -> &Device {
        &self.dev
    }

    /// Waits until all work queued on this stream has finished; returns its error if any
    /// operation failed (on the emulator: a timeout, panic or trap in a kernel).
    pub fn synchronize(&self) -> Result<()> {
        match (&self.imp, &self.dev.0.imp) {
            (StreamImpl::Cuda(s), DeviceImpl::Cuda(d)) => s.synchronize(d),
            (StreamImpl::Cpu(s), _) => s.synchronize(),
            _ => unreachable!("stream and device backends agree"),
        }
    }

    /// Queues `kernel` from `module` with `args`.
    ///
    /// The argument tuple's type is the kernel's declared parameter types, so wrong
    /// arguments do not compile; the launch shape is validated before anything is queued.
    ///
    /// ```
    /// # use ferrolink::{Device, LaunchConfig};
    /// # use ferrolink_device::kernels::copy::ferrolink_copy;
    /// # fn main() -> ferrolink::Result<()> {
    /// let dev = Device::open(0)?;
    /// let stream = dev.create_stream()?;
    /// let src = dev.alloc_from(&[7u8; 64])?;
    /// let mut dst = dev.alloc::<u8>(64)?;
    /// // SAFETY: both buffers hold 64 bytes and outlive the kernel (`to_vec` waits for it).
    /// unsafe {
    ///     stream.launch(
    ///         dev.builtin_module()?,
    ///         &ferrolink_copy,
    ///         LaunchConfig::linear(1, 32),
    ///         (dst.as_kernel_mut_ptr(), src.as_kernel_ptr(), 64usize),
    ///     )?
    /// };
    /// assert_eq!(dst.to_vec()?, vec![7u8; 64]);
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
    /// unsafe {
    ///     stream.launch(
    ///         dev.builtin_module()?,
    ///         &ferrolink_copy,
    ///         LaunchConfig::linear(1, 32),
    ///         (dst.as_kernel_mut_ptr(), src.as_kernel_ptr(), 64u32),
    ///     )?
    /// };
    /// # Ok(()) }
    /// ```
    ///
    /// # Safety
    /// The kernel's documented contract must hold: every pointer in `args` refers to device
    /// memory (of this device) valid for what the kernel does with it until the kernel has
    /// finished, and no other work races with the kernel's accesses.
    pub unsafe fn launch<A: KernelArgs>(
        &self,
        module: &Module,
        kernel: &Kernel<A>,
        cfg: LaunchConfig,
        mut args: A,
    ) -> Result<()> {
        if !module.belongs_to(&self.dev) {
            return Err(Error::WrongDevice("module"));
        }
        let name = kernel.name();
        cfg.validate(name)?;
        if !module.has_kernel(name) {
            return Err(Error::KernelNotFound(name.into()));
        }
        match (&self.imp, &self.dev.0.imp) {
            (StreamImpl::Cuda(s), DeviceImpl::Cuda(d)) => {
                let f = module.cuda_function(name)?;
                if cfg.block_threads() > u64::from(f.1.max_threads_per_block) {
                    return Err(Error::InvalidArgument(format!(
                        "launch of `{name}`: {} threads per CTA, but the kernel uses {} registers per \
                         thread and can run at most {} threads per CTA on this GPU",
                        cfg.block_threads(),
                        f.1.registers,
                        f.1.max_threads_per_block
                    )));
                }
                // SAFETY: `f` is `name` from `module`, whose PTX was built from the same
                // declaration as `kernel`, so `A` matches the parameters; the caller upholds
                // the kernel's contract.
                args.with_param_ptrs(|p| unsafe { s.launch(d, f.0, cfg.grid, cfg.block, cfg.shared_mem_bytes, p) })
            }
            (StreamImpl::Cpu(s), _) => {
                let spec = LaunchSpec {
                    name,
                    grid: [cfg.grid.0, cfg.grid.1, cfg.grid.2],
                    block: [cfg.block.0, cfg.block.1, cfg.block.2],
                    shared_mem_bytes: cfg.shared_mem_bytes as usize,
                    timeout: cfg.emulator_timeout.unwrap_or_else(emulator::default_timeout),
                };
                emulator::validate(&spec)?;
                let entry = kernel.host_entry();
                let args = SendArgs(args);
                s.enqueue(Box::new(move || {
                    let args = args;
                    // SAFETY: the caller of `launch` upholds the kernel's contract.
                    unsafe { emulator::launch(&spec, entry, args.0) }.map_err(Error::from)
                }))
            }
            _ => unreachable!("stream and device backends agree"),
        }
    }

    /// Copies `src` into `dst` by the driver's copy path (`cuMemcpyDtoDAsync` on this stream;
    /// on the CPU backend a host memcpy) and waits for it: the copy is complete when this
    /// returns, so the borrows cover it. Lengths must match. For overlapping asynchronous
    /// copies, launch the copy kernel with [`Stream::launch`] (`unsafe`: the caller keeps
    /// other work off the buffers).
    pub fn copy_buffer<T: Pod>(&self, dst: &mut DeviceBuffer<T>, src: &DeviceBuffer<T>) -> Result<()> {
        if !dst.device().same_as(&self.dev) || !src.device().same_as(&self.dev) {
            return Err(Error::WrongDevice("buffer"));
        }
        if dst.len() != src.len() {
            return Err(Error::InvalidArgument(format!(
                "copy_buffer: destination has {} elements, source {}",
                dst.len(),
                src.len()
            )));
        }
        self.copy_raw_dtod(dst.addr(), src.addr(), src.bytes())?;
        // Wait: the borrows end when this returns, and another stream could otherwise write
        // `src` or touch `dst` while the copy runs (a data race on the CPU backend).
        self.synchronize()
    }

    /// `copy_buffer` on raw addresses, for the perf module's baseline (same buffers as the
    /// kernel it is compared with).
    pub(crate) fn copy_raw_dtod(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        match (&self.imp, &self.dev.0.imp) {
            // SAFETY: crate-internal; callers pass ranges inside live buffers of this device
            // that outlive the copy (they synchronize before dropping them).
            (StreamImpl::Cuda(s), DeviceImpl::Cuda(d)) => unsafe { s.memcpy_dtod(d, dst, src, bytes) },
            (StreamImpl::Cpu(s), _) => s.enqueue(Box::new(move || {
                // SAFETY: as above; distinct allocations.
                unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, bytes) };
                Ok(())
            })),
            _ => unreachable!("stream and device backends agree"),
        }
    }

    /// Records an event: a timestamp taken when the stream reaches this point.
    pub fn record_event(&self) -> Result<Event> {
        let imp = match (&self.imp, &self.dev.0.imp) {
            (StreamImpl::Cuda(s), DeviceImpl::Cuda(d)) => {
                let e = d.create_event()?;
                e.record(d, s)?;
                EventImpl::Cuda(e)
            }
            (StreamImpl::Cpu(s), _) => {
                let slot = Arc::new(Mutex::new(None));
                let writer = slot.clone();
                s.enqueue(Box::new(move || {
                    *writer.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
                    Ok(())
                }))?;
                EventImpl::Cpu(slot)
            }
            _ => unreachable!("stream and device backends agree"),
        };
        Ok(Event { dev: self.dev.clone(), imp })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // Queued work may use buffers the caller is about to free: finish it first.
        let _ = self.synchronize();
    }
}

enum EventImpl {
    Cuda(RawEvent),
    Cpu(Arc<Mutex<Option<Instant>>>),
}

/// A point in a stream, with the time the stream reached it (see [`Stream::record_event`]).
pub struct Event {
    dev: Device,
    imp: EventImpl,
}

impl Event {
    /// Milliseconds between `start` and this event (waits for this event).
    pub fn elapsed_ms_since(&self, start: &Event) -> Result<f32> {
        if !self.dev.same_as(&start.dev) {
            return Err(Error::WrongDevice("event"));
        }
        match (&self.imp, &start.imp, &self.dev.0.imp) {
            (EventImpl::Cuda(end), EventImpl::Cuda(begin), DeviceImpl::Cuda(d)) => end.elapsed_ms_since(d, begin),
            (EventImpl::Cpu(end), EventImpl::Cpu(begin), _) => {
                self.dev.synchronize()?;
                let read = |s: &Arc<Mutex<Option<Instant>>>| *s.lock().unwrap_or_else(|e| e.into_inner());
                match (read(begin), read(end)) {
                    (Some(b), Some(e)) => Ok(e.saturating_duration_since(b).as_secs_f32() * 1e3),
                    _ => Err(Error::StreamFailed("an event was never reached (its stream failed)".into())),
                }
            }
            _ => Err(Error::WrongDevice("event")),
        }
    }
}
