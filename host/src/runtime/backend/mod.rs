//! The backend interface: what a device must provide for the rest of ferrolink to run on it.
//!
//! Two backends implement it, each in its own folder: [`cuda`] (a GPU through the CUDA driver)
//! and [`cpu`] (the CPU emulator). Nothing outside this folder names a backend's types or
//! matches on backends: the runtime above holds `Arc<dyn DeviceBackend>` and the trait objects
//! it hands out. Operations that only make sense on one backend stay inside it (a CUDA range
//! maps only CUDA physical memory; it says so with an error if given anything else).
//!
//! This layer is unchecked in the wgpu sense: its `unsafe fn`s take raw device addresses,
//! and the runtime ([`crate::runtime`]) validates and tracks before it calls them.

pub(crate) mod cpu;
pub(crate) mod cuda;

use crate::runtime::launch::LaunchConfig;
use crate::{Backend, Error, Result};
use ferrolink_device::emulator::{EmuError, LaunchSpec};
use std::any::Any;
use std::collections::HashSet;
use std::ffi::c_void;
use std::sync::Arc;

/// Which physical device a backend device is, for "same device" checks: two handles of one
/// GPU share its primary context (and must map a window once, not twice).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum DeviceKey {
    /// A GPU, by its driver ordinal handle.
    Cuda(i32),
    /// An emulated device, by a process-unique number.
    Cpu(u64),
}

/// The work of one emulated launch, run by the CPU backend's stream worker.
pub(crate) type EmulatedLaunch = Box<dyn FnOnce(&LaunchSpec) -> std::result::Result<(), EmuError> + Send>;

/// Makes the work of one emulated launch; a captured launch calls it at every replay.
pub(crate) type EmulatedLaunchFactory = Arc<dyn Fn() -> EmulatedLaunch + Send + Sync>;

/// One kernel launch as the backends see it: the CUDA backend passes `params` to
/// `cuLaunchKernel`; the CPU backend calls `emulate` to get the job it queues (once, or at
/// every replay of a captured graph).
pub(crate) struct LaunchRequest<'a> {
    /// The kernel's entry name.
    pub(crate) kernel: &'static str,
    /// Launch shape (validated by the caller).
    pub(crate) cfg: &'a LaunchConfig,
    /// One pointer per argument, as `cuLaunchKernel` wants them.
    pub(crate) params: &'a mut [*mut c_void],
    /// Makes what builds the emulated launch (called only by a backend that emulates).
    pub(crate) emulate: &'a dyn Fn() -> EmulatedLaunchFactory,
}

/// Whether a recorded point of a stream has been reached.
#[derive(Clone, Debug)]
pub(crate) enum EventState {
    /// Work before it may still run.
    Pending,
    /// Everything before it has finished.
    Done,
    /// The stream failed before reaching it (or the query itself failed): nothing before it
    /// runs any more, but the work did not complete. Memory it used may be released.
    Failed,
}

/// A device of some backend.
pub(crate) trait DeviceBackend: Send + Sync + 'static {
    /// The backend.
    fn kind(&self) -> Backend;
    /// The physical device's identity.
    fn key(&self) -> DeviceKey;
    /// A readable name.
    fn name(&self) -> String;
    /// Streaming multiprocessors (on the emulator: host cores).
    fn sm_count(&self) -> u32;
    /// A 16-byte identity that other processes can compare: the GPU's UUID on CUDA; on the
    /// emulator, one made of the process id and the device's number (emulated devices of
    /// different processes differ, but their memory is shared through file descriptors).
    fn uuid(&self) -> [u8; 16];
    /// Whether this device can map memory of the device with identity `uuid`, which may be
    /// another process's: on CUDA, when that GPU is visible here and has peer access (or is
    /// this one); on the emulator, for any emulated device of this machine.
    fn can_access_uuid(&self, uuid: &[u8; 16]) -> Result<bool>;
    /// Whether kernels of several processes can run on this device at the same time; the
    /// error says why not and what to do (on CUDA: MPS must be running).
    fn check_multi_process(&self) -> Result<()>;
    /// Free and total device memory.
    fn mem_info(&self) -> Result<(usize, usize)>;

    /// `bytes` of zeroed device memory, 256-byte aligned, usable by every stream of the
    /// device when this returns. Never waits for running kernels.
    fn malloc_zeroed(&self, bytes: usize) -> Result<u64>;
    /// Frees memory from [`DeviceBackend::malloc_zeroed`] without waiting for the device.
    ///
    /// # Safety
    /// `addr` came from `malloc_zeroed(bytes)` here, is freed once, and no work that uses it
    /// is queued or running.
    unsafe fn free(&self, addr: u64, bytes: usize) -> Result<()>;
    /// Copies host bytes to device memory; they have landed when this returns. Waits for no
    /// kernel.
    ///
    /// # Safety
    /// `[addr, addr + src.len())` is device memory of this device that no running or queued
    /// work accesses.
    unsafe fn write(&self, addr: u64, src: &[u8]) -> Result<()>;
    /// Copies device memory to host bytes. Waits for no kernel.
    ///
    /// # Safety
    /// `[addr, addr + dst.len())` is device memory of this device (or host-mapped memory)
    /// that no running or queued work writes, unless the caller accepts a torn snapshot of
    /// words that are only written atomically (the watchdog's reads of barrier inboxes).
    unsafe fn read(&self, addr: u64, dst: &mut [u8]) -> Result<()>;
    /// Fills `[addr, addr + bytes)` with zeros; done when this returns. Waits for no kernel.
    ///
    /// # Safety
    /// As [`DeviceBackend::write`].
    unsafe fn memset_zero(&self, addr: u64, bytes: usize) -> Result<()>;
    /// Reads `dst.len()` words that kernels may be writing with atomics (the watchdog's
    /// look at barrier inboxes and GIN words): each word is some value it held. Waits for no
    /// other work of the device (on CUDA a stream of its own: a stalled wait must still be
    /// named while the device's copy stream holds work that the stall holds up).
    ///
    /// # Safety
    /// The range is live device memory of this device (or host-mapped memory), 4-byte
    /// aligned, and kernels access it only with word atomics.
    unsafe fn read_atomic_words(&self, addr: u64, dst: &mut [u32]) -> Result<()>;
    /// Host memory the device can access at a device address (pinned and mapped on CUDA),
    /// zeroed.
    fn alloc_host_mapped(&self, bytes: usize) -> Result<Box<dyn HostMappedMemory>>;

    /// A stream whose work may run concurrently with other streams' work.
    fn create_stream(&self) -> Result<Box<dyn StreamBackend>>;
    /// How many hardware queues the device's streams share, where they share a bounded
    /// number, and the setting that sets it (CUDA: the context's connections,
    /// `CUDA_DEVICE_MAX_CONNECTIONS`, 8 unless set, 32 at most); `None` where every stream
    /// has its own (the CPU backend: a thread each). Work in one queue starts in order, so
    /// work on a stream can wait behind a kernel of another stream that shares its queue: a
    /// copy that such a kernel waits for never runs.
    fn stream_queues(&self) -> Option<(usize, &'static str)>;
    /// Loads a module and resolves each of `entries`. `cubin`, when given, is the same
    /// module assembled ahead of time; a backend that can run it uses it instead of compiling
    /// the PTX, and falls back to the PTX when the GPU cannot run it. `device_runtime`: the
    /// PTX declares functions of the CUDA device runtime (a kernel launching graphs), which a
    /// GPU backend links into the module.
    fn load_module(
        &self,
        ptx: &str,
        cubin: Option<&[u8]>,
        entries: &HashSet<String>,
        device_runtime: bool,
    ) -> Result<Box<dyn ModuleBackend>>;

    /// The VMM granularity: sizes and strides of symmetric memory are multiples of it.
    fn vmm_granularity(&self) -> Result<usize>;
    /// Whether memory from [`DeviceBackend::vmm_create`] starts zero-filled (else the caller
    /// zeroes it once mapped).
    fn vmm_memory_is_zeroed(&self) -> bool;
    /// Physical memory of `size` bytes (a multiple of the granularity), exportable.
    fn vmm_create(&self, size: usize) -> Result<Box<dyn PhysicalMemory>>;
    /// A reserved virtual range of `size` bytes aligned to `align`.
    fn vmm_reserve(&self, size: usize, align: usize) -> Result<Box<dyn AddressRange>>;
    /// Physical memory of `size` bytes exported by another process of this machine as the
    /// file descriptor `fd` ([`PhysicalMemory::export_fd`]); takes the descriptor.
    fn vmm_import(&self, fd: std::os::fd::OwnedFd, size: usize) -> Result<Box<dyn PhysicalMemory>>;

    /// For the backend's own downcasts (peer checks between devices of one backend).
    fn as_any(&self) -> &dyn Any;
}

/// An in-order queue of device work.
pub(crate) trait StreamBackend: Send + Sync {
    /// Queues a kernel launch.
    ///
    /// # Safety
    /// `module` is a module of this backend that declares `req.kernel`; the parameters
    /// match the kernel's; the kernel's contract holds.
    unsafe fn launch(&self, module: &dyn ModuleBackend, req: LaunchRequest<'_>) -> Result<()>;
    /// Queues a device-to-device copy.
    ///
    /// # Safety
    /// Both ranges are device memory of this device, valid until the copy has run, and do
    /// not overlap.
    unsafe fn copy_dtod(&self, dst: u64, src: u64, bytes: usize) -> Result<()>;
    /// Queues a copy of host bytes `src` to device address `dst` after the stream's earlier
    /// work, without waiting for it. The GIN proxy writes what it receives this way, a whole
    /// batch of deliveries at a time and then one wait, on a stream of its own: the device's
    /// shared copy stream may hold work that needs an SM (a fill of a fresh allocation), which
    /// kernels waiting for the proxy may hold.
    ///
    /// # Safety
    /// `[dst, dst + src.len())` is device memory of this device (or host-mapped memory),
    /// valid until the copy has run, that kernels read only after a later signal or write;
    /// `src` stays valid and unwritten until the stream has run the copy (the caller
    /// synchronizes the stream before it lets go of `src`).
    unsafe fn write_async(&self, dst: u64, src: &[u8]) -> Result<()>;
    /// Queues `copies` `(dst, src, bytes)` after the stream's earlier work, in no order among
    /// themselves: as one submission where the backend can (the GIN proxy's copies while the
    /// ranks' kernels hold every SM cost about 0.2 ms each on an H200, waits or not), else
    /// one by one. Addresses are device memory or the device address of host-mapped pinned
    /// memory (never pageable memory).
    ///
    /// # Safety
    /// Every range is valid until the stream has run the copies; no destination overlaps
    /// another copy's destination or source; the sources are not written before the copies
    /// have run.
    unsafe fn copy_batch(&self, copies: &[(u64, u64, usize)]) -> Result<()> {
        for &(dst, src, bytes) in copies {
            // SAFETY: the caller's contract, for each copy.
            unsafe { self.copy_dtod(dst, src, bytes)? };
        }
        Ok(())
    }
    /// Copies device bytes at `src` into `dst` after the stream's earlier work and waits
    /// until it has run.
    ///
    /// # Safety
    /// `[src, src + dst.len())` is device memory of this device (or host-mapped memory),
    /// valid until the copy has run and written by no work meanwhile.
    unsafe fn read_sync(&self, dst: &mut [u8], src: u64) -> Result<()>;
    /// Queues a write of the low `bytes` (1, 2, 4 or 8) bytes of `value` to `addr`, after the
    /// stream's earlier work (a signal written after the data it announces).
    ///
    /// # Safety
    /// `addr` is device memory this device can write, aligned to `bytes`, valid until the
    /// write has run.
    unsafe fn write_value(&self, addr: u64, value: u64, bytes: u32) -> Result<()>;
    /// Queues the writes `(addr, value, bytes)` in order, as [`StreamBackend::write_value`]
    /// each (a backend may hand them to the device in one call).
    ///
    /// # Safety
    /// As [`StreamBackend::write_value`] for each.
    unsafe fn write_values(&self, writes: &[(u64, u64, u32)]) -> Result<()> {
        for &(addr, value, bytes) in writes {
            // SAFETY: the caller's contract.
            unsafe { self.write_value(addr, value, bytes)? };
        }
        Ok(())
    }
    /// Records the current end of the stream; `timing` events can be compared with
    /// [`EventBackend::elapsed_ms_since`].
    fn record(&self, timing: bool) -> Result<Arc<dyn EventBackend>>;
    /// Makes later work of this stream wait (on the device) for `event`.
    fn wait_event(&self, event: &Arc<dyn EventBackend>) -> Result<()>;
    /// Waits until all queued work has finished; its error if any failed.
    fn synchronize(&self) -> Result<()>;
    /// Makes the stream's later work wait until the 64-bit word at `addr` is at least
    /// `value` (written by a kernel or another stream). On the emulator a wait longer than
    /// the emulator's kernel time limit fails the stream.
    ///
    /// # Safety
    /// `addr` is device memory of this device, 8-byte aligned, valid until the wait has
    /// passed, and written only atomically meanwhile.
    unsafe fn wait_value(&self, addr: u64, value: u64) -> Result<()>;
    /// Queues a message: `copy` `(dst, src, bytes)` if any, then `writes` in order, whose
    /// last write says it is complete (the copy and earlier writes need only be visible
    /// before the last one, not before each other), then with `wait` `(addr, value)`
    /// [`StreamBackend::wait_value`] for it.
    ///
    /// # Safety
    /// As [`StreamBackend::copy_dtod`] for the copy, [`StreamBackend::write_value`] for each
    /// write and [`StreamBackend::wait_value`].
    unsafe fn post(
        &self,
        copy: Option<(u64, u64, usize)>,
        writes: &[(u64, u64, u32)],
        wait: Option<(u64, u64)>,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe {
            if let Some((dst, src, bytes)) = copy {
                self.copy_dtod(dst, src, bytes)?;
            }
            self.write_values(writes)?;
            match wait {
                Some((addr, value)) => self.wait_value(addr, value),
                None => Ok(()),
            }
        }
    }
    /// Starts capturing: work queued from now on (on this stream, from any thread) is
    /// recorded into a graph instead of run, until [`StreamBackend::end_capture`].
    fn begin_capture(&self) -> Result<()>;
    /// Ends the capture and makes the graph executable; with `device_launch`, executable
    /// from kernels too (instantiated for device launch and uploaded on this stream).
    fn end_capture(&self, device_launch: bool) -> Result<Box<dyn GraphBackend>>;
    /// Queues one run of `graph` (made by a stream of this device).
    fn launch_graph(&self, graph: &dyn GraphBackend) -> Result<()>;
    /// The stream's failure, if it has one (does not wait).
    fn failure(&self) -> Option<Error>;
}

/// An executable graph of captured stream work.
pub(crate) trait GraphBackend: Send + Sync {
    /// For the backend's own downcasts.
    fn as_any(&self) -> &dyn Any;
    /// The handle kernels launch it by (`ferrolink_device::graph::DeviceGraph::exec`), when
    /// it was made for device launch; else 0.
    fn device_handle(&self) -> u64;
}

/// What [`EventBackend::elapsed_ms_since`] says of a completion that stands in for an event
/// (a shared launch's pending completion, a deferred hand-over): it has no timestamp.
pub(crate) fn untimed_completion() -> Error {
    Error::InvalidArgument("a collective's completion carries no time".into())
}

/// A recorded point of a stream.
pub(crate) trait EventBackend: Send + Sync {
    /// Whether the stream has reached this point (does not wait).
    fn query(&self) -> EventState;
    /// Waits until the stream has reached this point (or failed before it).
    fn synchronize(&self) -> Result<()>;
    /// Milliseconds from `start` to this event (both recorded with timing).
    fn elapsed_ms_since(&self, start: &dyn EventBackend) -> Result<f32>;
    /// For the backend's own downcasts.
    fn as_any(&self) -> &dyn Any;
    /// For an event that stands for work not queued yet (a persistent collective whose
    /// stream has not queued its wait, a GPU group's launch that the group's last member has
    /// still to queue): the event a stream waits for in its place, made or awaited now
    /// (`Some(Ok(None))`: that work will not run, nothing to wait for). `None` for a
    /// recorded event: it stands for itself.
    fn stand_in(&self) -> Option<Result<Option<Arc<dyn EventBackend>>>> {
        None
    }
}

/// A loaded module of kernels.
pub(crate) trait ModuleBackend: Send + Sync {
    /// For the backend's own downcasts.
    fn as_any(&self) -> &dyn Any;
    /// How many CTAs of kernel `name` (of `threads` threads and `shared_bytes` of dynamic
    /// shared memory) one SM holds at once; `None`: no such limit (the emulator runs every
    /// CTA of a grid at once).
    fn resident_ctas_per_sm(&self, name: &str, threads: u32, shared_bytes: u32) -> Result<Option<u32>> {
        let _ = (name, threads, shared_bytes);
        Ok(None)
    }
}

/// Host memory mapped for a device; freed on drop.
pub(crate) trait HostMappedMemory: Send + Sync {
    /// The host's address.
    fn host_ptr(&self) -> *mut u8;
    /// The address kernels use.
    fn device_addr(&self) -> u64;
}

/// Physical memory of the VMM allocator; released on drop (the memory lives on while a
/// range still maps it, in any process).
pub(crate) trait PhysicalMemory: Send + Sync {
    /// Bytes.
    fn size(&self) -> usize;
    /// A file descriptor another process of this machine can import the memory from
    /// ([`DeviceBackend::vmm_import`]); the caller owns (and closes) it.
    fn export_fd(&self) -> Result<std::os::fd::OwnedFd>;
    /// For the backend's own downcasts.
    fn as_any(&self) -> &dyn Any;
}

/// A reserved virtual address range; unmapped and freed on drop.
pub(crate) trait AddressRange: Send + Sync {
    /// Base address.
    fn base(&self) -> u64;
    /// Maps all of `phys` at `offset`.
    fn map(&mut self, offset: usize, phys: &dyn PhysicalMemory) -> Result<()>;
    /// Grants read/write access to the whole (fully mapped) range to each of `devices`.
    fn grant_access(&self, devices: &[&dyn DeviceBackend]) -> Result<()>;
}

/// The launch figures of ferrolink's built-in kernels that differ between backends. A GPU
/// wants wide CTAs, as many as stay resident; the emulator runs every thread of a CTA on host
/// threads, so it wants few, narrow CTAs (and small point-to-point chunks, so that tests
/// cross many). Each backend's folder holds its figures ([`launch_profile`]); the modules
/// that launch read them and never ask which backend runs. `None` in a figure means the
/// GPU's rule, which its field says.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LaunchProfile {
    /// Threads per CTA of the collective and point-to-point kernels.
    pub(crate) coll_threads: u32,
    /// Threads per CTA of the LL collective kernels (`coll_ll`, `coll_ll_group_launch`),
    /// when the GPU holds as many of them per SM as of the general kernel at
    /// [`LaunchProfile::coll_threads`] (else they run at that width).
    pub(crate) ll_threads: u32,
    /// Bytes per CTA that a collective inside one LSA domain aims for.
    pub(crate) coll_bytes_per_cta: usize,
    /// The most CTAs per rank of a kernel whose CTAs wait for each other (point to point,
    /// the persistent collective kernel); `None`: the SMs shared evenly by the ranks on the
    /// GPU.
    pub(crate) waiting_ctas: Option<u32>,
    /// Threads per CTA of the MoE kernels (whole warps: they put rows a warp at a time).
    pub(crate) moe_threads: u32,
    /// The most CTAs of an MoE kernel (capped by the device crate's `moe::MAX_CTAS`);
    /// `None`: as [`LaunchProfile::waiting_ctas`]'s.
    pub(crate) moe_ctas: Option<u32>,
    /// Threads per CTA of the copy kernel.
    pub(crate) copy_threads: u32,
    /// CTAs of a copy: `None`: enough to cover the bytes in about one pass, at most
    /// [`LaunchProfile::COPY_CTAS_PER_SM`] per SM; `Some(n)`: the SMs, at most `n`.
    pub(crate) copy_ctas: Option<u32>,
    /// A copy queued among the ranks' own kernels (staging into or out of a window), as
    /// (CTAs, threads); `None`: shaped as any copy.
    pub(crate) staging_copy: Option<(u32, u32)>,
    /// Point-to-point channels and slots per channel.
    pub(crate) p2p_channels: u32,
    /// Slots per point-to-point channel.
    pub(crate) p2p_slots: u32,
    /// Point-to-point slot bytes; `None`: `64 MiB / nranks / 2`, between 512 KiB and 4 MiB.
    pub(crate) p2p_chunk_bytes: Option<u32>,
    /// A communicator's default timeout (`FERROLINK_TIMEOUT` overrides it), seconds.
    pub(crate) default_timeout_secs: f64,
}

impl LaunchProfile {
    /// The most copy CTAs per SM (measured best on the H200, docs/PERF.md).
    pub(crate) const COPY_CTAS_PER_SM: usize = 64;
}

/// The launch figures of `backend`.
pub(crate) fn launch_profile(backend: Backend) -> &'static LaunchProfile {
    match backend {
        Backend::Cuda => &cuda::LAUNCH_PROFILE,
        Backend::Cpu => &cpu::LAUNCH_PROFILE,
    }
}

/// Opens device `ordinal` of `backend`.
pub(crate) fn open(backend: Backend, ordinal: usize) -> Result<Arc<dyn DeviceBackend>> {
    match backend {
        Backend::Cuda => Ok(Arc::new(cuda::CudaDevice::open(ordinal)?)),
        Backend::Cpu => Ok(Arc::new(cpu::CpuDevice::new())),
    }
}

/// Devices `backend` has here (see `crate::runtime::device_count`).
pub(crate) fn device_count(backend: Backend) -> Result<usize> {
    match backend {
        Backend::Cpu => Ok(usize::MAX),
        Backend::Cuda => match cuda::availability() {
            Ok(()) => cuda::driver::device_count_public(),
            Err(_) => Ok(0),
        },
    }
}

/// Whether `backend` can be used here; the error says why not.
pub(crate) fn availability(backend: Backend) -> Result<()> {
    match backend {
        Backend::Cpu => Ok(()),
        Backend::Cuda => cuda::availability(),
    }
}

/// A mismatch between objects of different backends (a CUDA range asked to map emulator
/// memory, …): a bug in the runtime above, reported as an error.
pub(crate) fn mixed_backends(what: &str) -> Error {
    Error::InvalidArgument(format!("{what}: objects of different backends were mixed"))
}
