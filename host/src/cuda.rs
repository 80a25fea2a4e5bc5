//! The CUDA layer: the driver calls ferrolink uses, as small RAII types over cudarc's
//! `result`/`sys` bindings. All unsafe FFI of the crate lives here; everything above it is
//! safe. The driver library is loaded at run time, so this builds and links on machines
//! without CUDA; [`availability`] says up front whether it can be used.

use crate::error::cuda_err;
use crate::{Error, Result};
use cudarc::driver::{result, sys};
use std::cell::Cell;
use std::ffi::{CString, c_void};
use std::sync::{OnceLock, RwLock};

/// Orders context-wide blocking driver calls against group launches.
///
/// Several ranks on one GPU share its primary context. A driver call that waits for the
/// whole context (`cuCtxSynchronize`, module load/unload, `cuMemFree`, VMM unmap) made while
/// another thread has launched only some ranks of a group waits for kernels that spin until
/// the rest of the group is launched — and the driver may hold a context lock that stalls
/// those launches: a deadlock (seen on the H200 with concurrent tests). Group launches
/// ([`crate::comm::launch_all`]) hold this lock exclusively; context-wide calls hold it shared,
/// so they never interleave with a half-launched group.
static GROUP_LOCK: RwLock<()> = RwLock::new(());

thread_local! {
    /// Set while this thread holds `GROUP_LOCK` exclusively (its context-wide calls inside
    /// the group launch must not try to take it again).
    static IN_GROUP_LAUNCH: Cell<bool> = const { Cell::new(false) };
}

/// Runs a driver call that may block on the whole context outside any half-launched group.
/// Used for synchronization, module load/unload, allocation, VMM map/unmap and the
/// synchronous copies and fills: all cheap to serialize against the short launch loops.
pub(crate) fn context_wide<R>(f: impl FnOnce() -> R) -> R {
    if IN_GROUP_LAUNCH.get() {
        return f();
    }
    let _shared = GROUP_LOCK.read().unwrap_or_else(|e| e.into_inner());
    f()
}

/// Whether the calling thread is inside [`group_launch`] (where waiting for the whole device
/// would wait for ranks launched later: a deadlock).
pub(crate) fn in_group_launch() -> bool {
    IN_GROUP_LAUNCH.get()
}

/// Runs `f` (which launches every rank of a group) with the group lock held exclusively.
pub(crate) fn group_launch<R>(f: impl FnOnce() -> R) -> R {
    if IN_GROUP_LAUNCH.get() {
        return f();
    }
    let _exclusive = GROUP_LOCK.write().unwrap_or_else(|e| e.into_inner());
    IN_GROUP_LAUNCH.set(true);
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            IN_GROUP_LAUNCH.set(false);
        }
    }
    let _reset = Reset;
    f()
}

/// Whether the CUDA backend can be used: the driver library loads, `cuInit` succeeds and at
/// least one GPU is visible. Checked once per process.
pub fn availability() -> Result<()> {
    static AVAILABLE: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    AVAILABLE
        .get_or_init(|| {
            // SAFETY: only probes whether the shared library can be loaded.
            if !unsafe { sys::is_culib_present() } {
                return Err("the CUDA driver library (libcuda.so) was not found".into());
            }
            result::init().map_err(|e| format!("cuInit failed: {e:?}"))?;
            match result::device::get_count() {
                Ok(0) => Err("the CUDA driver sees no GPU".into()),
                Ok(_) => Ok(()),
                Err(e) => Err(format!("cuDeviceGetCount failed: {e:?}")),
            }
        })
        .clone()
        .map_err(Error::CudaUnavailable)
}

/// A GPU and its retained primary context.
#[derive(Debug)]
pub struct CudaDevice {
    ordinal: usize,
    device: sys::CUdevice,
    context: sys::CUcontext,
    /// Streaming multiprocessors.
    pub sm_count: u32,
    /// Compute capability (major, minor).
    pub compute_capability: (u32, u32),
    /// The device's name.
    pub name: String,
}

// SAFETY: CUdevice is an integer and CUcontext a handle the driver lets any thread make
// current; every use goes through `bind`, which makes it current on the calling thread.
unsafe impl Send for CudaDevice {}
// SAFETY: as above; the driver API is thread-safe.
unsafe impl Sync for CudaDevice {}

impl CudaDevice {
    /// Opens GPU `ordinal` and retains its primary context.
    pub fn open(ordinal: usize) -> Result<CudaDevice> {
        availability()?;
        let count = result::device::get_count().map_err(cuda_err("cuDeviceGetCount"))? as usize;
        if ordinal >= count {
            return Err(Error::InvalidArgument(format!(
                "GPU ordinal {ordinal} does not exist: the driver sees {count} GPU(s)"
            )));
        }
        let device = result::device::get(ordinal as i32).map_err(cuda_err("cuDeviceGet"))?;
        // SAFETY: `device` is a valid handle from cuDeviceGet.
        let context = unsafe { result::primary_ctx::retain(device) }.map_err(cuda_err("cuDevicePrimaryCtxRetain"))?;
        let attr = |a| {
            // SAFETY: `device` is valid; attribute queries have no side effects.
            unsafe { result::device::get_attribute(device, a) }.map_err(cuda_err("cuDeviceGetAttribute"))
        };
        use sys::CUdevice_attribute as A;
        let sm_count = attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
        let major = attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)? as u32;
        let minor = attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)? as u32;
        let name = result::device::get_name(device).map_err(cuda_err("cuDeviceGetName"))?;
        let dev = CudaDevice { ordinal, device, context, sm_count, compute_capability: (major, minor), name };
        dev.bind()?;
        Ok(dev)
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Makes this device's context current on the calling thread (cheap; done before every call).
    pub fn bind(&self) -> Result<()> {
        // SAFETY: the context is retained for the lifetime of `self`.
        unsafe { result::ctx::set_current(self.context) }.map_err(cuda_err("cuCtxSetCurrent"))
    }

    /// Waits for all work on the device (`cuCtxSynchronize`).
    pub fn synchronize(&self) -> Result<()> {
        self.bind()?;
        context_wide(|| result::ctx::synchronize().map_err(cuda_err("cuCtxSynchronize")))
    }

    /// Allocates `bytes` of device memory (`cuMemAlloc`, 256-byte aligned).
    pub fn malloc(&self, bytes: usize) -> Result<sys::CUdeviceptr> {
        self.bind()?;
        // SAFETY: a plain allocation in the current context.
        context_wide(|| unsafe { result::malloc_sync(bytes.max(1)) }).map_err(cuda_err("cuMemAlloc"))
    }

    /// Frees memory from [`CudaDevice::malloc`].
    ///
    /// # Safety
    /// `ptr` came from `malloc` on this device, is not freed twice, and no pending work uses it.
    pub unsafe fn free(&self, ptr: sys::CUdeviceptr) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller's contract.
        context_wide(|| unsafe { result::free_sync(ptr) }.map_err(cuda_err("cuMemFree")))
    }

    /// Fills `bytes` bytes at `dst` with zeros, synchronously.
    ///
    /// # Safety
    /// `dst` is valid device memory for `bytes` bytes with no pending work on it.
    pub unsafe fn memset_zero(&self, dst: sys::CUdeviceptr, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the caller's contract.
        context_wide(|| unsafe { result::memset_d8_sync(dst, 0, bytes) }).map_err(cuda_err("cuMemsetD8"))?;
        // cuMemsetD8 may return before the fill is done, and it is ordered only with the
        // legacy default stream, not with our non-blocking streams: wait for it.
        self.wait_legacy_stream()
    }

    /// Waits for the work on the legacy default stream (where the synchronous memcpy and
    /// memset calls run) and nothing else. In particular it does not wait for kernels on our
    /// non-blocking streams: an allocation or host copy made while one rank's kernel spins,
    /// waiting for a rank not yet launched, must not deadlock (seen on the H200 when it did).
    fn wait_legacy_stream(&self) -> Result<()> {
        // SAFETY: the null stream handle names the legacy default stream of the current context.
        unsafe { result::stream::synchronize(std::ptr::null_mut()) }.map_err(cuda_err("cuStreamSynchronize(legacy)"))
    }

    /// Copies host bytes to device memory; the data has landed when it returns.
    ///
    /// # Safety
    /// `dst` is valid device memory for `src.len()` bytes with no pending work on it.
    pub unsafe fn htod(&self, dst: sys::CUdeviceptr, src: &[u8]) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller's contract; `src` is a valid host slice.
        context_wide(|| unsafe { result::memcpy_htod_sync(dst, src) }).map_err(cuda_err("cuMemcpyHtoD"))?;
        // From pageable memory, cuMemcpyHtoD returns once the data is staged, possibly before
        // the DMA lands, and only the legacy default stream is ordered after it: kernels on
        // our non-blocking streams could read stale bytes (seen on the H200). Wait for it.
        self.wait_legacy_stream()
    }

    /// Copies device memory to host bytes, synchronously.
    ///
    /// # Safety
    /// `src` is valid device memory for `dst.len()` bytes with no pending writes.
    pub unsafe fn dtoh(&self, dst: &mut [u8], src: sys::CUdeviceptr) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller's contract; `dst` is a valid host slice.
        context_wide(|| unsafe { result::memcpy_dtoh_sync(dst, src) }).map_err(cuda_err("cuMemcpyDtoH"))
    }

    /// Creates a non-blocking stream (no implicit synchronization with the legacy default
    /// stream, so kernels of different ranks can run at the same time).
    pub fn create_stream(&self) -> Result<RawStream> {
        self.bind()?;
        let stream =
            result::stream::create(result::stream::StreamKind::NonBlocking).map_err(cuda_err("cuStreamCreate"))?;
        Ok(RawStream(stream))
    }

    /// Loads a PTX module (JIT-compiled by the driver for this GPU).
    pub fn load_ptx(&self, ptx: &str) -> Result<RawModule> {
        self.bind()?;
        let image = CString::new(ptx).map_err(|_| Error::InvalidArgument("PTX text contains a NUL byte".into()))?;
        // SAFETY: `image` is a NUL-terminated PTX string, alive during the call.
        let module = context_wide(|| unsafe { result::module::load_data(image.as_ptr() as *const c_void) })
            .map_err(cuda_err("cuModuleLoadData"))?;
        Ok(RawModule(module))
    }

    /// Creates an event that records time.
    pub fn create_event(&self) -> Result<RawEvent> {
        self.bind()?;
        let e = result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).map_err(cuda_err("cuEventCreate"))?;
        Ok(RawEvent(e))
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        // SAFETY: releases the retain taken in `open`; nothing uses the context afterwards
        // (all objects holding the device hold it through an Arc).
        let _ = unsafe { result::primary_ctx::release(self.device) };
    }
}

/// A CUDA stream, destroyed on drop.
#[derive(Debug)]
pub struct RawStream(pub(crate) sys::CUstream);
// SAFETY: stream handles may be used from any thread with the context current.
unsafe impl Send for RawStream {}
// SAFETY: as above; the driver serializes operations on a stream.
unsafe impl Sync for RawStream {}

impl RawStream {
    /// Waits for the stream's work.
    pub fn synchronize(&self, dev: &CudaDevice) -> Result<()> {
        dev.bind()?;
        // SAFETY: the stream is alive.
        unsafe { result::stream::synchronize(self.0) }.map_err(cuda_err("cuStreamSynchronize"))
    }

    /// Enqueues a device-to-device copy.
    ///
    /// # Safety
    /// Both ranges are valid device memory of `bytes` bytes until the copy has run.
    pub unsafe fn memcpy_dtod(
        &self,
        dev: &CudaDevice,
        dst: sys::CUdeviceptr,
        src: sys::CUdeviceptr,
        bytes: usize,
    ) -> Result<()> {
        dev.bind()?;
        // SAFETY: the caller's contract.
        unsafe { result::memcpy_dtod_async(dst, src, bytes, self.0) }.map_err(cuda_err("cuMemcpyDtoDAsync"))
    }

    /// Enqueues a byte fill.
    ///
    /// # Safety
    /// `dst` is valid device memory of `bytes` bytes until the fill has run.
    pub unsafe fn memset_d8(&self, dev: &CudaDevice, dst: sys::CUdeviceptr, value: u8, bytes: usize) -> Result<()> {
        dev.bind()?;
        // SAFETY: the caller's contract.
        unsafe { result::memset_d8_async(dst, value, bytes, self.0) }.map_err(cuda_err("cuMemsetD8Async"))
    }

    /// Enqueues a kernel launch.
    ///
    /// # Safety
    /// `func` is from a loaded module; `params` point to values whose types and layout match
    /// the kernel's parameters; the kernel's own contract holds.
    pub unsafe fn launch(
        &self,
        dev: &CudaDevice,
        func: sys::CUfunction,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared_mem_bytes: u32,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        dev.bind()?;
        if shared_mem_bytes > 48 * 1024 {
            // SAFETY: `func` is valid; raising the dynamic shared memory limit has no other effect.
            unsafe {
                sys::cuFuncSetAttribute(
                    func,
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    shared_mem_bytes as i32,
                )
            }
            .result()
            .map_err(cuda_err("cuFuncSetAttribute"))?;
        }
        // SAFETY: the caller's contract.
        unsafe { result::launch_kernel(func, grid, block, shared_mem_bytes, self.0, params) }
            .map_err(cuda_err("cuLaunchKernel"))
    }
}

impl Drop for RawStream {
    fn drop(&mut self) {
        // SAFETY: the stream is not used after this; pending work completes in the driver.
        let _ = unsafe { result::stream::destroy(self.0) };
    }
}

/// A loaded module, unloaded on drop.
#[derive(Debug)]
pub struct RawModule(sys::CUmodule);
// SAFETY: module handles may be used from any thread with the context current.
unsafe impl Send for RawModule {}
// SAFETY: as above.
unsafe impl Sync for RawModule {}

impl RawModule {
    /// Looks up a kernel entry by name.
    pub fn function(&self, dev: &CudaDevice, name: &str) -> Result<sys::CUfunction> {
        dev.bind()?;
        let cname = CString::new(name).map_err(|_| Error::KernelNotFound(name.into()))?;
        // SAFETY: the module is loaded. (Under lazy loading this loads code onto the GPU.)
        context_wide(|| unsafe { result::module::get_function(self.0, cname) }).map_err(|e| {
            if e.0 == sys::cudaError_enum::CUDA_ERROR_NOT_FOUND {
                Error::KernelNotFound(name.into())
            } else {
                Error::Cuda { call: "cuModuleGetFunction", source: e }
            }
        })
    }
}

/// Resource limits of one kernel, read from the driver.
#[derive(Clone, Copy, Debug)]
pub struct FunctionLimits {
    /// The most threads per CTA this kernel can be launched with (its register use decides).
    pub max_threads_per_block: u32,
    /// Registers per thread.
    pub registers: u32,
}

/// Reads a kernel's limits.
pub(crate) fn function_limits(dev: &CudaDevice, f: sys::CUfunction) -> Result<FunctionLimits> {
    dev.bind()?;
    use sys::CUfunction_attribute as A;
    let get = |a| {
        // SAFETY: `f` is a function of a loaded module; attribute queries have no side effects.
        unsafe { result::function::get_function_attribute(f, a) }.map_err(cuda_err("cuFuncGetAttribute"))
    };
    Ok(FunctionLimits {
        max_threads_per_block: get(A::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK)? as u32,
        registers: get(A::CU_FUNC_ATTRIBUTE_NUM_REGS)? as u32,
    })
}

impl Drop for RawModule {
    fn drop(&mut self) {
        // SAFETY: kernels launched from the module hold the module's owner alive until they
        // were synchronized (Module's drop synchronizes the device first).
        let _ = context_wide(|| unsafe { result::module::unload(self.0) });
    }
}

/// A CUDA event, destroyed on drop.
#[derive(Debug)]
pub struct RawEvent(sys::CUevent);
// SAFETY: event handles may be used from any thread with the context current.
unsafe impl Send for RawEvent {}
// SAFETY: as above.
unsafe impl Sync for RawEvent {}

impl RawEvent {
    /// Records the event on `stream`.
    pub fn record(&self, dev: &CudaDevice, stream: &RawStream) -> Result<()> {
        dev.bind()?;
        // SAFETY: both handles are alive.
        unsafe { result::event::record(self.0, stream.0) }.map_err(cuda_err("cuEventRecord"))
    }
    /// Milliseconds from `start` to `self`; waits for `self` first.
    pub fn elapsed_ms_since(&self, dev: &CudaDevice, start: &RawEvent) -> Result<f32> {
        dev.bind()?;
        // SAFETY: both events are alive.
        unsafe {
            result::event::synchronize(start.0).map_err(cuda_err("cuEventSynchronize"))?;
            result::event::synchronize(self.0).map_err(cuda_err("cuEventSynchronize"))?;
            result::event::elapsed(start.0, self.0).map_err(cuda_err("cuEventElapsedTime"))
        }
    }
}

impl Drop for RawEvent {
    fn drop(&mut self) {
        // SAFETY: the event is not used after this.
        let _ = unsafe { result::event::destroy(self.0) };
    }
}

// ---- virtual memory management (cuMem*) -----------------------------------------------

/// A physical allocation made with `cuMemCreate` (exportable as a POSIX file descriptor,
/// for multi-process windows later), released on drop.
#[derive(Debug)]
pub struct PhysicalAllocation {
    handle: sys::CUmemGenericAllocationHandle,
    /// Size in bytes (a multiple of the granularity).
    pub size: usize,
}

fn allocation_prop(dev: &CudaDevice) -> sys::CUmemAllocationProp {
    // SAFETY: an all-zero CUmemAllocationProp is a valid starting value (the C API's
    // documented way to initialize it); the fields we need are set below.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev.device;
    prop
}

impl CudaDevice {
    /// The VMM allocation granularity (recommended) of this GPU: 2 MiB on the H200.
    pub fn vmm_granularity(&self) -> Result<usize> {
        self.bind()?;
        let prop = allocation_prop(self);
        let mut g = 0usize;
        // SAFETY: `prop` and `g` are valid for the call.
        unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut g,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
            )
        }
        .result()
        .map_err(cuda_err("cuMemGetAllocationGranularity"))?;
        Ok(g)
    }

    /// Creates `size` bytes (a multiple of the granularity) of physical memory on this GPU.
    pub fn mem_create(&self, size: usize) -> Result<PhysicalAllocation> {
        self.bind()?;
        let prop = allocation_prop(self);
        let mut handle = 0;
        // SAFETY: `prop` describes pinned device memory on this GPU; `handle` is written.
        context_wide(|| unsafe { sys::cuMemCreate(&mut handle, size, &prop, 0) }.result())
            .map_err(cuda_err("cuMemCreate"))?;
        Ok(PhysicalAllocation { handle, size })
    }

    /// Whether this GPU can map memory of `peer` (peer access over NVLink/PCIe).
    pub fn can_access_peer(&self, peer: &CudaDevice) -> Result<bool> {
        if peer.device == self.device {
            return Ok(true);
        }
        let mut can = 0;
        // SAFETY: both device handles are valid.
        unsafe { sys::cuDeviceCanAccessPeer(&mut can, self.device, peer.device) }
            .result()
            .map_err(cuda_err("cuDeviceCanAccessPeer"))?;
        Ok(can != 0)
    }

    /// The device handle's ordinal identity (for comparing devices).
    pub fn raw_device(&self) -> i32 {
        self.device
    }
}

impl Drop for PhysicalAllocation {
    fn drop(&mut self) {
        // SAFETY: the handle came from cuMemCreate; the driver frees the memory once its last
        // mapping is gone (owners unmap before releasing).
        let _ = context_wide(|| unsafe { sys::cuMemRelease(self.handle) });
    }
}

/// A reserved virtual address range (`cuMemAddressReserve`), freed on drop after its
/// mappings are removed.
#[derive(Debug)]
pub struct AddressRange {
    /// Base address.
    pub base: sys::CUdeviceptr,
    /// Size in bytes.
    pub size: usize,
    mapped: Vec<(usize, usize)>,
}

impl AddressRange {
    /// Reserves `size` bytes aligned to `align`.
    pub fn reserve(dev: &CudaDevice, size: usize, align: usize) -> Result<AddressRange> {
        dev.bind()?;
        let mut base = 0;
        // SAFETY: reserves address space only; `base` is written.
        unsafe { sys::cuMemAddressReserve(&mut base, size, align, 0, 0) }
            .result()
            .map_err(cuda_err("cuMemAddressReserve"))?;
        Ok(AddressRange { base, size, mapped: Vec::new() })
    }

    /// Maps all of `phys` at `offset` in this range.
    pub fn map(&mut self, dev: &CudaDevice, offset: usize, phys: &PhysicalAllocation) -> Result<()> {
        if offset.checked_add(phys.size).is_none_or(|end| end > self.size) {
            return Err(Error::InvalidArgument(format!(
                "mapping {} bytes at offset {offset} overruns a {}-byte range",
                phys.size, self.size
            )));
        }
        dev.bind()?;
        // SAFETY: [base + offset, + size) lies in the reservation and is unmapped (each
        // offset is mapped once by the owners); `phys` is alive.
        context_wide(|| unsafe { sys::cuMemMap(self.base + offset as u64, phys.size, 0, phys.handle, 0) }.result())
            .map_err(cuda_err("cuMemMap"))?;
        self.mapped.push((offset, phys.size));
        Ok(())
    }

    /// Grants read/write access to the whole range to each of `devices`.
    pub fn set_access(&self, dev: &CudaDevice, devices: &[&CudaDevice]) -> Result<()> {
        dev.bind()?;
        let descs: Vec<sys::CUmemAccessDesc> = devices
            .iter()
            .map(|d| {
                // SAFETY: all-zero is a valid starting value for this plain C struct.
                let mut desc: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
                desc.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
                desc.location.id = d.device;
                desc.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
                desc
            })
            .collect();
        // SAFETY: the range is fully mapped (callers map every slot first); `descs` is valid.
        context_wide(|| unsafe { sys::cuMemSetAccess(self.base, self.size, descs.as_ptr(), descs.len()) }.result())
            .map_err(cuda_err("cuMemSetAccess"))
    }

    /// Unmaps everything mapped and frees the reservation.
    pub fn release(mut self, dev: &CudaDevice) -> Result<()> {
        context_wide(|| self.release_inner(dev))
    }

    fn release_inner(&mut self, dev: &CudaDevice) -> Result<()> {
        dev.bind()?;
        // Unmap everything and free the reservation even if one step fails: report the first
        // error, but do not strand the rest.
        let mut first: Result<()> = Ok(());
        for (offset, size) in self.mapped.drain(..) {
            // SAFETY: this exact sub-range was mapped by `map`; no work uses it (owners
            // synchronize the devices first).
            let r =
                unsafe { sys::cuMemUnmap(self.base + offset as u64, size) }.result().map_err(cuda_err("cuMemUnmap"));
            if first.is_ok() {
                first = r;
            }
        }
        if self.size > 0 {
            // SAFETY: the reservation is unmapped and freed once (size set to 0 after).
            let r =
                unsafe { sys::cuMemAddressFree(self.base, self.size) }.result().map_err(cuda_err("cuMemAddressFree"));
            self.size = 0;
            if first.is_ok() {
                first = r;
            }
        }
        first
    }
}

/// Free and total device memory of the current context's GPU (`cuMemGetInfo`).
pub fn mem_info(dev: &CudaDevice) -> Result<(usize, usize)> {
    dev.bind()?;
    result::mem_get_info().map_err(cuda_err("cuMemGetInfo"))
}
