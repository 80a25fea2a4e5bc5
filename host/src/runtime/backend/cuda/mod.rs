//! The CUDA backend: a GPU through the driver API ([`driver`] holds every FFI call). Every
//! operation makes the device's primary context current for its duration and restores the
//! caller's current context afterwards, so ferrolink never changes what a host thread's other
//! CUDA code sees.
//!
//! Policy decided here (not in the FFI layer):
//! * memory comes from the device's stream-ordered pool on a private *copy stream*, and is
//!   freed in stream order there: `cuMemFree` may wait for the whole device, `cuMemFreeAsync`
//!   never does, and the runtime frees only memory whose users have finished;
//! * host copies run on that copy stream too, never on the legacy default stream, so they
//!   wait for no kernel of ours;
//! * driver calls that may wait for the whole context (module load and unload, VMM map,
//!   unmap and release, freeing pinned host memory) run under
//!   [`crate::runtime::group::context_wide`], so they never interleave with a half-launched
//!   group of ranks that wait for each other;
//! * pinned host memory is not freed while the device is open: a freed block goes to the
//!   context's cache ([`Ctx::pinned_cache`], up to [`PINNED_CACHE_BYTES`]) and the next
//!   allocation of its size takes it back. `cuMemFreeHost` (and `cuMemHostAlloc`) may wait for
//!   every kernel of the context while holding a driver lock; with ranks of one process in
//!   several LSA domains, a rank that dropped its GIN (its rings, its TCP staging) while a
//!   peer's kernel still waited for data that this process's TCP receiver had to copy in
//!   stalled the copy behind the lock and the kernel behind the copy (seen on the H200,
//!   2026-12-02: MoE dispatch and combine across domains, one process).

pub(crate) mod driver;

pub(crate) use driver::availability;

use super::{
    AddressRange, DeviceBackend, DeviceKey, EventBackend, EventState, GraphBackend, HostMappedMemory, LaunchRequest,
    ModuleBackend, PhysicalMemory, StreamBackend, mixed_backends,
};
use crate::runtime::group::context_wide;
use crate::{Backend, Error, Result};
use cudarc::driver::sys;
use std::any::Any;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// A retained primary context and what ferrolink keeps with it. Every backend object of the
/// device holds it, so the context outlives them all.
struct Ctx {
    device: sys::CUdevice,
    context: sys::CUcontext,
    /// Private non-blocking stream for allocations, frees and host copies.
    copy_stream: sys::CUstream,
    /// Private non-blocking stream for the watchdog's reads of words that kernels update
    /// (`read_atomic_words`) and nothing else: a stalled wait must be named even when the copy
    /// stream holds work that the stall holds up (a fill waiting for an SM).
    peek_stream: sys::CUstream,
    /// Events without timing that no one holds any more, for the next records: a loop of
    /// launches records one per launch, and creating and destroying each costs two driver
    /// calls. (Re-recording an event is allowed; waits already queued on it keep the record
    /// they saw.)
    free_events: std::sync::Mutex<Vec<sys::CUevent>>,
    /// Freed pinned host allocations by size, for the next allocations of that size (see the
    /// module docs), and their bytes in all.
    pinned_cache: std::sync::Mutex<(HashMap<usize, Vec<usize>>, usize)>,
    /// The hardware queues ("connections") the context's streams share, as the driver read
    /// them from the environment when it made the context (see [`STREAM_QUEUES_VAR`]).
    stream_queues: usize,
}

/// The driver's variable for the number of hardware queues a context's streams share: read
/// once, when the driver makes the context; 8 unless set, 1 to 32.
const STREAM_QUEUES_VAR: &str = crate::runtime::CUDA_STREAM_QUEUES_VAR;

/// The hardware queues a context made now gets: [`STREAM_QUEUES_VAR`] as the driver reads it.
fn stream_queues_from_env() -> usize {
    std::env::var(STREAM_QUEUES_VAR).ok().and_then(|v| v.trim().parse::<usize>().ok()).map_or(8, |q| q.clamp(1, 32))
}

/// The GPU's launch figures. 256 threads per CTA: the collective kernel, one body for every
/// type and reduction, takes up to 254 registers per thread on sm_90, so 256 threads is the
/// most a CTA holds. The LL kernels, that protocol's path alone, take under 128 (`coll_ll` 80,
/// `coll_ll_group_launch` 116 with ptxas 13.0, 2026-12-05): 512 threads, one per unit of payload of an LL CTA (`ll::UNITS_PER_CTA`), so
/// that no thread handles two units one after the other. Collectives aim at 16 KiB per CTA; copies cover their bytes in one pass of
/// the warp-contiguous copy. Point to point: 32 channels of 2 slots (128 KiB per channel and
/// step is where sendrecv reaches NVLink's rate on two H200s, docs/PERF.md). Kernels whose
/// CTAs wait for each other take the SMs, shared by the ranks on the GPU.
pub(crate) const LAUNCH_PROFILE: super::LaunchProfile = super::LaunchProfile {
    coll_threads: 256,
    ll_threads: 512,
    coll_bytes_per_cta: 16 << 10,
    waiting_ctas: None,
    moe_threads: 256,
    moe_ctas: None,
    copy_threads: 256,
    copy_ctas: None,
    staging_copy: None,
    p2p_channels: 32,
    p2p_slots: 2,
    p2p_chunk_bytes: None,
    default_timeout_secs: 600.0,
};

/// The most bytes of pinned host memory a context keeps for reuse (more is freed at once).
const PINNED_CACHE_BYTES: usize = 1 << 30;

/// Events kept in [`Ctx::free_events`] at most (more are destroyed).
const EVENT_POOL: usize = 1024;

// SAFETY: CUdevice is an integer, CUcontext, CUstream and CUevent are driver handles that any thread
// may use with the context current (every use pushes it first); the driver API is
// thread-safe.
unsafe impl Send for Ctx {}
// SAFETY: as above.
unsafe impl Sync for Ctx {}

impl Ctx {
    /// Makes the context current until the guard drops.
    fn bind(&self) -> Result<driver::CtxGuard> {
        // SAFETY: the context is retained for the lifetime of `self`.
        unsafe { driver::push_context(self.context) }
    }
}

impl Drop for Ctx {
    fn drop(&mut self) {
        if let Ok(_g) = self.bind() {
            for e in std::mem::take(&mut *crate::runtime::lifetime::lock(&self.free_events)) {
                // SAFETY: a pooled event: no one holds it (its `CudaEvent` is gone).
                let _ = unsafe { driver::event_destroy(e) };
            }
            let (cache, _) = std::mem::take(&mut *crate::runtime::lifetime::lock(&self.pinned_cache));
            for host in cache.into_values().flatten() {
                // SAFETY: a cached allocation of `host_alloc_mapped`: no one holds it (its
                // `CudaHostMemory` is gone, after the kernels that used it).
                if let Err(e) = context_wide("cuMemFreeHost", || unsafe { driver::host_free(host as *mut u8) }) {
                    tracing::warn!(target: "ferrolink::runtime", error = %e, "freeing pinned host memory failed");
                }
            }
            // SAFETY: the copy stream is ours and nothing uses it any more (every object that
            // could holds this context).
            if let Err(e) = unsafe { driver::stream_destroy(self.copy_stream) } {
                tracing::warn!(target: "ferrolink::runtime", error = %e, "destroying the copy stream failed");
            }
            // SAFETY: as for the copy stream.
            if let Err(e) = unsafe { driver::stream_destroy(self.peek_stream) } {
                tracing::warn!(target: "ferrolink::runtime", error = %e, "destroying the peek stream failed");
            }
        }
        // SAFETY: releases the retain taken in `CudaDevice::open`; nothing uses the context
        // afterwards (every user held this `Ctx`).
        if let Err(e) = unsafe { driver::primary_ctx_release(self.device) } {
            tracing::warn!(target: "ferrolink::runtime", error = %e, "releasing the primary context failed");
        }
    }
}

/// A GPU.
pub(crate) struct CudaDevice {
    ctx: Arc<Ctx>,
    ordinal: usize,
    sm_count: u32,
    name: String,
    uuid: [u8; 16],
}

impl CudaDevice {
    /// Opens GPU `ordinal` and retains its primary context.
    pub(crate) fn open(ordinal: usize) -> Result<CudaDevice> {
        availability()?;
        let count = driver::device_count()?;
        if ordinal >= count {
            return Err(Error::InvalidArgument(format!(
                "GPU ordinal {ordinal} does not exist: the driver sees {count} GPU(s)"
            )));
        }
        let device = driver::device(ordinal)?;
        let sm_count =
            driver::attribute(device, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
        let name = driver::device_name(device)?;
        let uuid = driver::device_uuid(device)?;
        let context = driver::primary_ctx_retain(device)?;
        // SAFETY: just retained.
        let guard = unsafe { driver::push_context(context) };
        let streams = guard.and_then(|_g| {
            let copy = driver::stream_create()?;
            match driver::stream_create() {
                Ok(peek) => Ok((copy, peek)),
                Err(e) => {
                    // SAFETY: just made, unused.
                    let _ = unsafe { driver::stream_destroy(copy) };
                    Err(e)
                }
            }
        });
        let (copy_stream, peek_stream) = match streams {
            Ok(s) => s,
            Err(e) => {
                // SAFETY: pairs the retain above; nothing is left in the context.
                let _ = unsafe { driver::primary_ctx_release(device) };
                return Err(e);
            }
        };
        Ok(CudaDevice {
            ctx: Arc::new(Ctx {
                device,
                context,
                copy_stream,
                peek_stream,
                free_events: Default::default(),
                pinned_cache: Default::default(),
                stream_queues: stream_queues_from_env(),
            }),
            ordinal,
            sm_count,
            name,
            uuid,
        })
    }

    fn peer(other: &dyn DeviceBackend) -> Result<&CudaDevice> {
        other.as_any().downcast_ref::<CudaDevice>().ok_or_else(|| mixed_backends("peer device"))
    }

    /// Runs `f` on the copy stream and waits for it (and only it).
    fn on_copy_stream(&self, f: impl FnOnce(sys::CUstream) -> Result<()>) -> Result<()> {
        let _g = self.ctx.bind()?;
        f(self.ctx.copy_stream)?;
        // SAFETY: the copy stream lives as long as the context.
        unsafe { driver::stream_synchronize(self.ctx.copy_stream) }
    }
}

impl DeviceBackend for CudaDevice {
    fn kind(&self) -> Backend {
        Backend::Cuda
    }

    fn key(&self) -> DeviceKey {
        DeviceKey::Cuda(self.ctx.device)
    }

    fn name(&self) -> String {
        self.name.clone()
    }

    fn sm_count(&self) -> u32 {
        self.sm_count
    }

    fn uuid(&self) -> [u8; 16] {
        self.uuid
    }

    fn can_access_uuid(&self, uuid: &[u8; 16]) -> Result<bool> {
        if *uuid == self.uuid {
            return Ok(true);
        }
        for ordinal in 0..driver::device_count()? {
            let d = driver::device(ordinal)?;
            if driver::device_uuid(d)? == *uuid {
                return driver::can_access_peer(self.ctx.device, d);
            }
        }
        Ok(false) // not visible in this process (CUDA_VISIBLE_DEVICES): no mapping possible
    }

    fn check_multi_process(&self) -> Result<()> {
        // Without MPS, kernels of different processes on one GPU time-slice: a kernel that
        // spins on another process's barrier never sees it arrive. The MPS control daemon
        // keeps a `control` pipe in its pipe directory.
        let dir = std::env::var("CUDA_MPS_PIPE_DIRECTORY").unwrap_or_else(|_| "/tmp/nvidia-mps".into());
        if std::path::Path::new(&dir).join("control").exists() {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "several processes share GPU {} ({}), but no MPS control daemon was found (no {dir}/control): without MPS their kernels time-slice and a kernel waiting for another process's never sees it arrive. Start MPS (as root: `nvidia-cuda-mps-control -d`, with CUDA_MPS_PIPE_DIRECTORY set the same in every process), or run one process per GPU",
                self.ordinal, self.name
            )))
        }
    }

    fn mem_info(&self) -> Result<(usize, usize)> {
        let _g = self.ctx.bind()?;
        driver::mem_info()
    }

    fn malloc_zeroed(&self, bytes: usize) -> Result<u64> {
        let mut addr = 0;
        self.on_copy_stream(|s| {
            // SAFETY: the copy stream is live; the fill covers the fresh allocation.
            unsafe {
                addr = driver::mem_alloc_async(bytes.max(1), s)?;
                driver::memset_async(addr, 0, bytes.max(1), s)
            }
        })?;
        Ok(addr)
    }

    unsafe fn free(&self, addr: u64, _bytes: usize) -> Result<()> {
        let _g = self.ctx.bind()?;
        // SAFETY: the caller's contract (allocated by `malloc_zeroed`, unused from now on).
        unsafe { driver::mem_free_async(addr, self.ctx.copy_stream) }
    }

    unsafe fn write(&self, addr: u64, src: &[u8]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: the caller's contract; the copy is complete when `on_copy_stream` returns.
        self.on_copy_stream(|s| unsafe { driver::memcpy_htod_async(addr, src, s) })
    }

    unsafe fn read(&self, addr: u64, dst: &mut [u8]) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: the caller's contract; the copy is complete when `on_copy_stream` returns.
        self.on_copy_stream(|s| unsafe { driver::memcpy_dtoh_async(dst, addr, s) })
    }

    unsafe fn memset_zero(&self, addr: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: the caller's contract; the fill is complete when `on_copy_stream` returns.
        self.on_copy_stream(|s| unsafe { driver::memset_async(addr, 0, bytes, s) })
    }

    unsafe fn read_atomic_words(&self, addr: u64, dst: &mut [u32]) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        let _g = self.ctx.bind()?;
        // A DMA copy reads each aligned word whole. On the peek stream, which holds nothing
        // else (the watchdog reads these words while work on the copy stream may be stalled).
        // SAFETY: the caller's contract; `dst` outlives the copy (synchronized below).
        unsafe {
            driver::memcpy_dtoh_async(bytemuck::cast_slice_mut(dst), addr, self.ctx.peek_stream)?;
            driver::stream_synchronize(self.ctx.peek_stream)
        }
    }

    fn alloc_host_mapped(&self, bytes: usize) -> Result<Box<dyn HostMappedMemory>> {
        let _g = self.ctx.bind()?;
        let cached = {
            let mut cache = crate::runtime::lifetime::lock(&self.ctx.pinned_cache);
            let host = cache.0.get_mut(&bytes).and_then(Vec::pop);
            if host.is_some() {
                cache.1 -= bytes;
            }
            host
        };
        let host = match cached {
            Some(host) => host as *mut u8,
            None => context_wide("cuMemHostAlloc", || driver::host_alloc_mapped(bytes))?,
        };
        // SAFETY: an allocation of `bytes` bytes (fresh, or cached: no one else holds it).
        unsafe { std::ptr::write_bytes(host, 0, bytes) };
        let mem = CudaHostMemory { ctx: self.ctx.clone(), host, bytes };
        // SAFETY: `host` is live.
        let device = unsafe { driver::host_device_pointer(host) }?;
        Ok(Box::new(MappedHost { mem, device }))
    }

    fn create_stream(&self) -> Result<Box<dyn StreamBackend>> {
        let _g = self.ctx.bind()?;
        Ok(Box::new(CudaStream { ctx: self.ctx.clone(), stream: driver::stream_create()? }))
    }

    fn stream_queues(&self) -> Option<(usize, &'static str)> {
        Some((self.ctx.stream_queues, STREAM_QUEUES_VAR))
    }

    fn load_module(
        &self,
        ptx: &str,
        cubin: Option<&[u8]>,
        entries: &HashSet<String>,
        device_runtime: bool,
    ) -> Result<Box<dyn ModuleBackend>> {
        let _g = self.ctx.bind()?;
        let started = std::time::Instant::now();
        // PTX that calls the device runtime (a kernel launching a graph) is linked with it;
        // a cubin of it is relocatable (ptxas -c), so the PTX is what gets linked.
        let cubin = cubin.filter(|_| !device_runtime);
        // The driver compiles PTX on first load (the built-in PTX took ~85 s on an H200 with
        // an empty compute cache); a cubin for this GPU's architecture loads at once.
        let assembled = cubin.and_then(|image| {
            match context_wide("cuModuleLoadData (cubin)", || driver::module_load_image(image)) {
                Ok(m) => Some(m),
                Err(e) => {
                    tracing::info!(target: "ferrolink::runtime", error = %e,
                    "the ahead-of-time cubin does not load on this GPU; compiling the PTX");
                    None
                }
            }
        });
        let from_cubin = assembled.is_some();
        let handle = match assembled {
            Some(m) => m,
            None if device_runtime => {
                let library = device_runtime_library()?;
                let image = context_wide("cuLink (PTX and libcudadevrt)", || driver::link_with_library(ptx, &library))?;
                context_wide("cuModuleLoadData (linked)", || driver::module_load_image(&image))?
            }
            None => context_wide("cuModuleLoadData (PTX)", || driver::module_load(ptx))?,
        };
        tracing::debug!(target: "ferrolink::runtime", from_cubin, seconds = started.elapsed().as_secs_f64(),
            "module loaded");
        let module = CudaModule { ctx: self.ctx.clone(), module: handle, functions: HashMap::new() };
        let mut module = module;
        // Resolve every entry now. Under CUDA's lazy loading (the default since 12.2) a
        // function is loaded onto the GPU on first lookup, and that load can wait for running
        // kernels: a kernel launched to signal a running kernel would deadlock behind it
        // (seen on the H200: the waiter timed out first).
        for name in entries {
            // SAFETY: the module is loaded.
            let f = context_wide("cuModuleGetFunction", || unsafe { driver::module_function(module.module, name) })?;
            module.functions.insert(name.clone(), Function { f, limits: function_limits(f)? });
        }
        Ok(Box::new(module))
    }

    fn vmm_granularity(&self) -> Result<usize> {
        driver::vmm_granularity(self.ctx.device)
    }

    fn vmm_memory_is_zeroed(&self) -> bool {
        false
    }

    fn vmm_create(&self, size: usize) -> Result<Box<dyn PhysicalMemory>> {
        let _g = self.ctx.bind()?;
        let handle = context_wide("cuMemCreate", || driver::vmm_create(self.ctx.device, size))?;
        Ok(Box::new(CudaPhysical { ctx: self.ctx.clone(), handle, size }))
    }

    fn vmm_import(&self, fd: std::os::fd::OwnedFd, size: usize) -> Result<Box<dyn PhysicalMemory>> {
        use std::os::fd::AsRawFd;
        let _g = self.ctx.bind()?;
        // SAFETY: `fd` is an open descriptor another process exported (the caller's word);
        // the driver does not take it, and it is closed when `fd` drops below.
        let handle =
            context_wide("cuMemImportFromShareableHandle", || unsafe { driver::vmm_import_fd(fd.as_raw_fd()) })?;
        Ok(Box::new(CudaPhysical { ctx: self.ctx.clone(), handle, size }))
    }

    fn vmm_reserve(&self, size: usize, align: usize) -> Result<Box<dyn AddressRange>> {
        let _g = self.ctx.bind()?;
        let base = driver::vmm_reserve(size, align)?;
        Ok(Box::new(CudaRange { ctx: self.ctx.clone(), base, size, mapped: Vec::new() }))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Resource limits of one kernel, read from the driver.
#[derive(Clone, Copy, Debug)]
struct FunctionLimits {
    max_threads_per_block: u32,
    registers: u32,
}

fn function_limits(f: sys::CUfunction) -> Result<FunctionLimits> {
    use sys::CUfunction_attribute as A;
    // SAFETY: `f` is a function of a loaded module.
    let get = |a| unsafe { driver::function_attribute(f, a) };
    Ok(FunctionLimits {
        max_threads_per_block: get(A::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK)? as u32,
        registers: get(A::CU_FUNC_ATTRIBUTE_NUM_REGS)? as u32,
    })
}

#[derive(Clone, Copy)]
struct Function {
    f: sys::CUfunction,
    limits: FunctionLimits,
}

struct CudaModule {
    ctx: Arc<Ctx>,
    module: sys::CUmodule,
    functions: HashMap<String, Function>,
}

// SAFETY: module and function handles may be used from any thread with the context current.
unsafe impl Send for CudaModule {}
// SAFETY: as above; the map is read-only after loading.
unsafe impl Sync for CudaModule {}

impl ModuleBackend for CudaModule {
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn resident_ctas_per_sm(&self, name: &str, threads: u32, shared_bytes: u32) -> Result<Option<u32>> {
        let f = self.functions.get(name).ok_or_else(|| Error::KernelNotFound(name.to_string()))?;
        let _g = self.ctx.bind()?;
        // SAFETY: `f` is a function of this loaded module.
        unsafe { driver::occupancy_ctas_per_sm(f.f, threads, shared_bytes) }.map(Some)
    }
}

impl Drop for CudaModule {
    fn drop(&mut self) {
        let Ok(_g) = self.ctx.bind() else { return };
        // SAFETY: the runtime retires a module only after every kernel launched from it has
        // finished.
        if let Err(e) = context_wide("cuModuleUnload", || unsafe { driver::module_unload(self.module) }) {
            tracing::warn!(target: "ferrolink::runtime", error = %e, "unloading a module failed");
        }
    }
}

struct CudaStream {
    ctx: Arc<Ctx>,
    stream: sys::CUstream,
}

// SAFETY: stream handles may be used from any thread with the context current; the driver
// serializes operations on a stream.
unsafe impl Send for CudaStream {}
// SAFETY: as above.
unsafe impl Sync for CudaStream {}

impl CudaStream {
    /// Queues `copy` (of `bytes` bytes; none: nothing) on this stream and waits until the
    /// stream has run it and everything before it: `read_sync`.
    fn copy_sync(&self, bytes: usize, copy: impl FnOnce(sys::CUstream) -> Result<()>) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        let _g = self.ctx.bind()?;
        copy(self.stream)?;
        // SAFETY: the stream is live.
        unsafe { driver::stream_synchronize(self.stream) }
    }
}

impl StreamBackend for CudaStream {
    unsafe fn launch(&self, module: &dyn ModuleBackend, req: LaunchRequest<'_>) -> Result<()> {
        let module = module.as_any().downcast_ref::<CudaModule>().ok_or_else(|| mixed_backends("launch"))?;
        let name = req.kernel;
        let func = *module.functions.get(name).ok_or_else(|| Error::KernelNotFound(name.into()))?;
        let cfg = req.cfg;
        if cfg.block_threads() > u64::from(func.limits.max_threads_per_block) {
            return Err(Error::InvalidArgument(format!(
                "launch of `{name}`: {} threads per CTA, but the kernel uses {} registers per thread and can \
                 run at most {} threads per CTA on this GPU",
                cfg.block_threads(),
                func.limits.registers,
                func.limits.max_threads_per_block
            )));
        }
        let _g = self.ctx.bind()?;
        if cfg.shared_mem_bytes > 48 * 1024 {
            // SAFETY: `func.f` is a function of the live module.
            unsafe { driver::function_set_max_dynamic_shared(func.f, cfg.shared_mem_bytes)? };
        }
        // SAFETY: the caller's contract (parameters match the kernel, its contract holds).
        unsafe { driver::launch_kernel(func.f, cfg.grid, cfg.block, cfg.shared_mem_bytes, self.stream, req.params) }
    }

    unsafe fn copy_dtod(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        let _g = self.ctx.bind()?;
        // SAFETY: the caller's contract.
        unsafe { driver::memcpy_dtod_async(dst, src, bytes, self.stream) }
    }

    unsafe fn copy_batch(&self, copies: &[(u64, u64, usize)]) -> Result<()> {
        let _g = self.ctx.bind()?;
        // SAFETY: the caller's contract.
        if unsafe { driver::memcpy_batch_async(copies, self.stream)? } {
            return Ok(());
        }
        for &(dst, src, bytes) in copies {
            // SAFETY: the caller's contract, for each copy.
            unsafe { driver::memcpy_dtod_async(dst, src, bytes, self.stream)? };
        }
        Ok(())
    }

    unsafe fn write_async(&self, dst: u64, src: &[u8]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        let _g = self.ctx.bind()?;
        // SAFETY: the caller's contract (`src` outlives the copy: the caller synchronizes).
        unsafe { driver::memcpy_htod_async(dst, src, self.stream) }
    }

    unsafe fn read_sync(&self, dst: &mut [u8], src: u64) -> Result<()> {
        let bytes = dst.len();
        // SAFETY: the caller's contract; `dst` outlives the copy (`copy_sync` synchronizes).
        self.copy_sync(bytes, |s| unsafe { driver::memcpy_dtoh_async(dst, src, s) })
    }

    unsafe fn write_value(&self, addr: u64, value: u64, bytes: u32) -> Result<()> {
        let _g = self.ctx.bind()?;
        // SAFETY: the caller's contract.
        unsafe { driver::write_value_async(addr, value, bytes, self.stream) }.map_err(|e| match e {
            // Seen on the H200 for a word of the stream-ordered pool (`Device::alloc`).
            Error::Cuda { source, .. } if source.0 == sys::CUresult::CUDA_ERROR_INVALID_VALUE && bytes >= 4 => {
                Error::InvalidArgument(format!(
                    "{e}: the driver refused a stream write to {addr:#x}; streams write words only in memory that \
                     allows stream memory operations, such as communicator memory (Communicator::mem_alloc, \
                     windows) or host-mapped memory, not the pool of Device::alloc"
                ))
            }
            e => e,
        })
    }

    unsafe fn write_values(&self, writes: &[(u64, u64, u32)]) -> Result<()> {
        let _g = self.ctx.bind()?;
        if writes.len() > 1 && writes.iter().all(|w| matches!(w.2, 4 | 8)) {
            // SAFETY: the caller's contract.
            return unsafe { driver::write_values_batched(writes, None, self.stream) };
        }
        for &(addr, value, bytes) in writes {
            // SAFETY: the caller's contract.
            unsafe { driver::write_value_async(addr, value, bytes, self.stream)? };
        }
        Ok(())
    }

    fn record(&self, timing: bool) -> Result<Arc<dyn EventBackend>> {
        let _g = self.ctx.bind()?;
        let pooled = if timing { None } else { crate::runtime::lifetime::lock(&self.ctx.free_events).pop() };
        let event = match pooled {
            Some(event) => CudaEvent { ctx: self.ctx.clone(), event, timing },
            None => CudaEvent { ctx: self.ctx.clone(), event: driver::event_create(timing)?, timing },
        };
        // SAFETY: both handles are live.
        unsafe { driver::event_record(event.event, self.stream)? };
        Ok(Arc::new(event))
    }

    fn wait_event(&self, event: &Arc<dyn EventBackend>) -> Result<()> {
        let event = event.as_any().downcast_ref::<CudaEvent>().ok_or_else(|| mixed_backends("stream wait"))?;
        let _g = self.ctx.bind()?;
        // SAFETY: both handles are live.
        unsafe { driver::stream_wait_event(self.stream, event.event) }
    }

    fn synchronize(&self) -> Result<()> {
        let _g = self.ctx.bind()?;
        // SAFETY: the stream is live.
        unsafe { driver::stream_synchronize(self.stream) }
    }

    fn failure(&self) -> Option<Error> {
        let _g = self.ctx.bind().ok()?;
        // A query would end a capture in error: a capturing stream runs nothing, so it has not
        // failed.
        // SAFETY: the stream is live.
        if unsafe { driver::stream_is_capturing(self.stream) }.unwrap_or(false) {
            return None;
        }
        // SAFETY: the stream is live.
        unsafe { driver::stream_query(self.stream) }.err()
    }

    unsafe fn post(
        &self,
        copy: Option<(u64, u64, usize)>,
        writes: &[(u64, u64, u32)],
        wait: Option<(u64, u64)>,
    ) -> Result<()> {
        if let Some((dst, src, bytes)) = copy {
            // SAFETY: the caller's contract. The batch's writes below come after the copy in
            // stream order, and a stream write is a memory barrier for the work before it
            // (no CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER).
            unsafe { self.copy_dtod(dst, src, bytes)? };
        }
        if writes.len() >= 255 || !writes.iter().all(|w| matches!(w.2, 4 | 8)) {
            // SAFETY: the caller's contract.
            unsafe {
                self.write_values(writes)?;
                return match wait {
                    Some((addr, value)) => self.wait_value(addr, value),
                    None => Ok(()),
                };
            }
        }
        let _g = self.ctx.bind()?;
        // SAFETY: the caller's contract.
        unsafe { driver::write_values_batched(writes, wait, self.stream) }
    }

    unsafe fn wait_value(&self, addr: u64, value: u64) -> Result<()> {
        let _g = self.ctx.bind()?;
        // SAFETY: the caller's contract.
        unsafe { driver::stream_wait_value_geq(self.stream, addr, value) }
    }

    fn begin_capture(&self) -> Result<()> {
        let _g = self.ctx.bind()?;
        // SAFETY: the stream is live.
        unsafe { driver::stream_begin_capture(self.stream) }
    }

    fn end_capture(&self, device_launch: bool) -> Result<Box<dyn GraphBackend>> {
        let _g = self.ctx.bind()?;
        // SAFETY: the stream is live (and capturing, or the driver says not).
        let (graph, exec) = unsafe { driver::stream_end_capture(self.stream, device_launch) }.map_err(|e| {
            if device_launch {
                Error::InvalidArgument(format!(
                    "{e} (a graph for device launch may hold only kernels, copies of device or mapped \
                     memory and memsets: no stream waits or writes of words, no host functions)"
                ))
            } else {
                e
            }
        })?;
        let g = CudaGraph { ctx: self.ctx.clone(), graph, exec, device_launch };
        if device_launch {
            // SAFETY: both live, of this context; kernels launch it only after this upload
            // (stream order: the graph's first launches come after it on this stream, and
            // other streams' kernels get its handle from work queued after this returns).
            unsafe { driver::graph_upload(exec, self.stream)? };
        }
        Ok(Box::new(g))
    }

    fn launch_graph(&self, graph: &dyn GraphBackend) -> Result<()> {
        let g = graph.as_any().downcast_ref::<CudaGraph>().ok_or_else(|| mixed_backends("graph launch"))?;
        let _g = self.ctx.bind()?;
        // SAFETY: both are live, of this context.
        unsafe { driver::graph_launch(g.exec, self.stream) }
    }
}

/// Where the CUDA device runtime's static library (`libcudadevrt.a`) is: `FERROLINK_CUDADEVRT`
/// (the file), else `lib64/` or `lib/` of `CUDA_HOME`, `CUDA_PATH` and `/usr/local/cuda`, else
/// `/usr/lib/x86_64-linux-gnu`.
fn device_runtime_library() -> Result<std::path::PathBuf> {
    use std::path::PathBuf;
    if let Some(p) = std::env::var_os("FERROLINK_CUDADEVRT") {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(Error::InvalidArgument(format!("FERROLINK_CUDADEVRT names {}, which is not a file", p.display())))
        };
    }
    let roots = ["CUDA_HOME", "CUDA_PATH"]
        .iter()
        .filter_map(std::env::var_os)
        .map(PathBuf::from)
        .chain([PathBuf::from("/usr/local/cuda")]);
    let mut candidates: Vec<PathBuf> = roots
        .flat_map(|r| ["lib64", "lib", "targets/x86_64-linux/lib"].map(|d| r.join(d).join("libcudadevrt.a")))
        .collect();
    candidates.push(PathBuf::from("/usr/lib/x86_64-linux-gnu/libcudadevrt.a"));
    candidates.iter().find(|p| p.is_file()).cloned().ok_or_else(|| {
        Error::InvalidArgument(format!(
            "the module's kernels call the CUDA device runtime (they launch graphs), so it must be linked with \
             libcudadevrt.a, which was not found (looked at {}); set FERROLINK_CUDADEVRT to the file (it comes with \
             the CUDA toolkit)",
            candidates.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
        ))
    })
}

/// A captured graph and its executable.
struct CudaGraph {
    ctx: Arc<Ctx>,
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    /// Instantiated for device launch.
    device_launch: bool,
}

// SAFETY: graph handles may be used from any thread with the context current; launches are
// serialized by their streams.
unsafe impl Send for CudaGraph {}
// SAFETY: as above.
unsafe impl Sync for CudaGraph {}

impl GraphBackend for CudaGraph {
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn device_handle(&self) -> u64 {
        if self.device_launch { self.exec as u64 } else { 0 }
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        let Ok(_g) = self.ctx.bind() else { return };
        // SAFETY: not used after this (the owner retires it once its launches finished).
        if let Err(e) = unsafe { driver::graph_destroy(self.graph, self.exec) } {
            tracing::warn!(target: "ferrolink::runtime", error = %e, "destroying a graph failed");
        }
    }
}

impl Drop for CudaStream {
    fn drop(&mut self) {
        let Ok(_g) = self.ctx.bind() else { return };
        // SAFETY: not used after this; queued work completes in the driver.
        if let Err(e) = unsafe { driver::stream_destroy(self.stream) } {
            tracing::warn!(target: "ferrolink::runtime", error = %e, "destroying a stream failed");
        }
    }
}

struct CudaEvent {
    ctx: Arc<Ctx>,
    event: sys::CUevent,
    /// Made with timing (never pooled).
    timing: bool,
}

// SAFETY: event handles may be used from any thread with the context current.
unsafe impl Send for CudaEvent {}
// SAFETY: as above.
unsafe impl Sync for CudaEvent {}

impl EventBackend for CudaEvent {
    fn query(&self) -> EventState {
        let Ok(_g) = self.ctx.bind() else { return EventState::Failed };
        // SAFETY: the event is live.
        match unsafe { driver::event_query(self.event) } {
            Ok(true) => EventState::Done,
            Ok(false) => EventState::Pending,
            Err(_) => EventState::Failed,
        }
    }

    fn synchronize(&self) -> Result<()> {
        let _g = self.ctx.bind()?;
        // SAFETY: the event is live.
        unsafe { driver::event_synchronize(self.event) }
    }

    fn elapsed_ms_since(&self, start: &dyn EventBackend) -> Result<f32> {
        let start = start.as_any().downcast_ref::<CudaEvent>().ok_or(Error::WrongDevice("event"))?;
        let _g = self.ctx.bind()?;
        // SAFETY: both events are live.
        unsafe {
            driver::event_synchronize(start.event)?;
            driver::event_synchronize(self.event)?;
            driver::event_elapsed_ms(start.event, self.event)
        }
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        if !self.timing {
            let mut pool = crate::runtime::lifetime::lock(&self.ctx.free_events);
            if pool.len() < EVENT_POOL {
                pool.push(self.event);
                return;
            }
        }
        let Ok(_g) = self.ctx.bind() else { return };
        // SAFETY: not used after this.
        let _ = unsafe { driver::event_destroy(self.event) };
    }
}

struct CudaHostMemory {
    ctx: Arc<Ctx>,
    host: *mut u8,
    bytes: usize,
}

struct MappedHost {
    mem: CudaHostMemory,
    device: u64,
}

// SAFETY: pinned host memory owned by this value; the runtime accesses its words only
// atomically or through its own synchronization.
unsafe impl Send for MappedHost {}
// SAFETY: as above.
unsafe impl Sync for MappedHost {}

impl HostMappedMemory for MappedHost {
    fn host_ptr(&self) -> *mut u8 {
        self.mem.host
    }
    fn device_addr(&self) -> u64 {
        self.device
    }
}

impl Drop for CudaHostMemory {
    fn drop(&mut self) {
        {
            // Kept for reuse rather than freed (see the module docs).
            let mut cache = crate::runtime::lifetime::lock(&self.ctx.pinned_cache);
            if cache.1 + self.bytes <= PINNED_CACHE_BYTES {
                cache.1 += self.bytes;
                cache.0.entry(self.bytes).or_default().push(self.host as usize);
                return;
            }
        }
        let Ok(_g) = self.ctx.bind() else { return };
        // SAFETY: allocated by `host_alloc_mapped`; retired only after the kernels that used
        // it finished.
        if let Err(e) = context_wide("cuMemFreeHost", || unsafe { driver::host_free(self.host) }) {
            tracing::warn!(target: "ferrolink::runtime", error = %e, "freeing pinned host memory failed");
        }
    }
}

struct CudaPhysical {
    ctx: Arc<Ctx>,
    handle: sys::CUmemGenericAllocationHandle,
    size: usize,
}

impl PhysicalMemory for CudaPhysical {
    fn size(&self) -> usize {
        self.size
    }
    fn export_fd(&self) -> Result<std::os::fd::OwnedFd> {
        use std::os::fd::FromRawFd;
        let _g = self.ctx.bind()?;
        // SAFETY: the handle is live and was created with the POSIX_FD handle type.
        let fd = unsafe { driver::vmm_export_fd(self.handle)? };
        // SAFETY: the driver returned a fresh descriptor that the caller owns.
        Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Drop for CudaPhysical {
    fn drop(&mut self) {
        let Ok(_g) = self.ctx.bind() else { return };
        // SAFETY: the handle came from cuMemCreate; the driver frees the memory once its last
        // mapping is gone.
        if let Err(e) = context_wide("cuMemRelease", || unsafe { driver::vmm_release(self.handle) }) {
            tracing::warn!(target: "ferrolink::runtime", error = %e, "releasing VMM memory failed");
        }
    }
}

struct CudaRange {
    ctx: Arc<Ctx>,
    base: sys::CUdeviceptr,
    size: usize,
    mapped: Vec<(usize, usize)>,
}

impl AddressRange for CudaRange {
    fn base(&self) -> u64 {
        self.base
    }

    fn map(&mut self, offset: usize, phys: &dyn PhysicalMemory) -> Result<()> {
        let phys = phys.as_any().downcast_ref::<CudaPhysical>().ok_or_else(|| mixed_backends("mapping memory"))?;
        if offset.checked_add(phys.size).is_none_or(|end| end > self.size) {
            return Err(Error::InvalidArgument(format!(
                "mapping {} bytes at offset {offset} overruns a {}-byte range",
                phys.size, self.size
            )));
        }
        let _g = self.ctx.bind()?;
        // SAFETY: [base + offset, + size) lies in the reservation and is unmapped (the runtime
        // maps each offset once); `phys` is alive.
        context_wide("cuMemMap", || unsafe { driver::vmm_map(self.base + offset as u64, phys.size, phys.handle) })?;
        self.mapped.push((offset, phys.size));
        Ok(())
    }

    fn grant_access(&self, devices: &[&dyn DeviceBackend]) -> Result<()> {
        let ids = devices.iter().map(|d| CudaDevice::peer(*d).map(|d| d.ctx.device)).collect::<Result<Vec<_>>>()?;
        let _g = self.ctx.bind()?;
        // SAFETY: the runtime maps every slot before granting access.
        context_wide("cuMemSetAccess", || unsafe { driver::vmm_set_access(self.base, self.size, &ids) })
    }
}

impl Drop for CudaRange {
    fn drop(&mut self) {
        let Ok(_g) = self.ctx.bind() else { return };
        context_wide("cuMemUnmap", || {
            // Unmap everything and free the reservation even if one step fails.
            for (offset, size) in self.mapped.drain(..) {
                // SAFETY: this exact sub-range was mapped by `map`; the runtime retires ranges
                // only after the kernels that used them finished.
                if let Err(e) = unsafe { driver::vmm_unmap(self.base + offset as u64, size) } {
                    tracing::warn!(target: "ferrolink::runtime", error = %e, "cuMemUnmap failed");
                }
            }
            // SAFETY: unmapped above; freed once.
            if let Err(e) = unsafe { driver::vmm_address_free(self.base, self.size) } {
                tracing::warn!(target: "ferrolink::runtime", error = %e, "cuMemAddressFree failed");
            }
        });
    }
}
