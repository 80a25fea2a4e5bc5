//! The CUDA driver calls ferrolink makes, as thin functions over cudarc's `sys`/`result`
//! bindings (the driver library is loaded at run time, so this builds on machines without
//! CUDA). Each function does one driver call (or a fixed pair), returns `Result`, and states
//! its contract; no policy lives here (when to lock, wait or retry is decided in
//! [`super`]). All of the backend's FFI `unsafe` is in this file.

use crate::error::cuda_err;
use crate::{Error, Result};
use cudarc::driver::{result, sys};
use std::ffi::{CString, c_void};
use std::sync::OnceLock;

/// Whether the CUDA backend can be used: the driver library loads, `cuInit` succeeds and at
/// least one GPU is visible. Checked once per process.
pub(crate) fn availability() -> Result<()> {
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

/// GPUs the driver sees (for the runtime's `device_count`).
pub(crate) fn device_count_public() -> Result<usize> {
    device_count()
}

/// GPUs the driver sees.
pub(super) fn device_count() -> Result<usize> {
    Ok(result::device::get_count().map_err(cuda_err("cuDeviceGetCount"))? as usize)
}

/// The device handle of GPU `ordinal` (< [`device_count`]).
pub(super) fn device(ordinal: usize) -> Result<sys::CUdevice> {
    result::device::get(ordinal as i32).map_err(cuda_err("cuDeviceGet"))
}

/// A device attribute.
pub(super) fn attribute(device: sys::CUdevice, attr: sys::CUdevice_attribute) -> Result<i32> {
    // SAFETY: `device` is a handle from cuDeviceGet; attribute queries have no side effects.
    unsafe { result::device::get_attribute(device, attr) }.map_err(cuda_err("cuDeviceGetAttribute"))
}

/// The device's name.
pub(super) fn device_name(device: sys::CUdevice) -> Result<String> {
    result::device::get_name(device).map_err(cuda_err("cuDeviceGetName"))
}

/// Whether `a` can map memory of `b`.
pub(super) fn can_access_peer(a: sys::CUdevice, b: sys::CUdevice) -> Result<bool> {
    let mut can = 0;
    // SAFETY: both handles come from cuDeviceGet.
    unsafe { sys::cuDeviceCanAccessPeer(&mut can, a, b) }.result().map_err(cuda_err("cuDeviceCanAccessPeer"))?;
    Ok(can != 0)
}

/// The device's UUID.
pub(super) fn device_uuid(device: sys::CUdevice) -> Result<[u8; 16]> {
    // SAFETY: all-zero is a valid CUuuid.
    let mut u: sys::CUuuid = unsafe { std::mem::zeroed() };
    // SAFETY: `device` is a handle from cuDeviceGet; `u` is written.
    unsafe { sys::cuDeviceGetUuid_v2(&mut u, device) }.result().map_err(cuda_err("cuDeviceGetUuid"))?;
    Ok(u.bytes.map(|b| b as u8))
}

/// Retains `device`'s primary context.
pub(super) fn primary_ctx_retain(device: sys::CUdevice) -> Result<sys::CUcontext> {
    // SAFETY: `device` is a handle from cuDeviceGet.
    unsafe { result::primary_ctx::retain(device) }.map_err(cuda_err("cuDevicePrimaryCtxRetain"))
}

/// Releases a retain of `device`'s primary context.
///
/// # Safety
/// Pairs one earlier [`primary_ctx_retain`]; nothing of the context is used afterwards by
/// the releasing owner.
pub(super) unsafe fn primary_ctx_release(device: sys::CUdevice) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { result::primary_ctx::release(device) }.map_err(cuda_err("cuDevicePrimaryCtxRelease"))
}

/// While alive, `context` is current on this thread; dropping it restores the context that
/// was current before (the caller's, if it had one).
pub(super) struct CtxGuard(());

/// Makes `context` current until the guard drops (`cuCtxPushCurrent` / `cuCtxPopCurrent`).
///
/// # Safety
/// `context` is a live (retained) context.
pub(super) unsafe fn push_context(context: sys::CUcontext) -> Result<CtxGuard> {
    // SAFETY: the caller's contract.
    unsafe { sys::cuCtxPushCurrent_v2(context) }.result().map_err(cuda_err("cuCtxPushCurrent"))?;
    Ok(CtxGuard(()))
}

impl Drop for CtxGuard {
    fn drop(&mut self) {
        let mut popped = std::ptr::null_mut();
        // SAFETY: pops the context this guard pushed (guards are created and dropped in
        // stack order on one thread: the type is neither Send nor Clone).
        if let Err(e) = unsafe { sys::cuCtxPopCurrent_v2(&mut popped) }.result() {
            tracing::error!(target: "ferrolink::runtime", error = ?e, "cuCtxPopCurrent failed");
        }
    }
}

/// The context current on this thread (null if none).
pub(crate) fn current_context() -> Result<sys::CUcontext> {
    let mut ctx = std::ptr::null_mut();
    // SAFETY: writes one handle.
    unsafe { sys::cuCtxGetCurrent(&mut ctx) }.result().map_err(cuda_err("cuCtxGetCurrent"))?;
    Ok(ctx)
}

/// Free and total memory of the current context's GPU.
pub(super) fn mem_info() -> Result<(usize, usize)> {
    result::mem_get_info().map_err(cuda_err("cuMemGetInfo"))
}

// ---- streams -------------------------------------------------------------------------

/// A non-blocking stream of the current context (no implicit synchronization with the
/// legacy default stream, so kernels of different ranks can run at the same time).
pub(super) fn stream_create() -> Result<sys::CUstream> {
    result::stream::create(result::stream::StreamKind::NonBlocking).map_err(cuda_err("cuStreamCreate"))
}

/// Destroys a stream; queued work still completes.
///
/// # Safety
/// `stream` is live and not used afterwards.
pub(super) unsafe fn stream_destroy(stream: sys::CUstream) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { result::stream::destroy(stream) }.map_err(cuda_err("cuStreamDestroy"))
}

/// Waits for the stream's work.
///
/// # Safety
/// `stream` is live.
pub(super) unsafe fn stream_synchronize(stream: sys::CUstream) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { result::stream::synchronize(stream) }.map_err(cuda_err("cuStreamSynchronize"))
}

/// `Ok(true)` if all the stream's work has finished, `Ok(false)` if some is pending, the
/// error if the stream (or context) failed.
///
/// # Safety
/// `stream` is live.
pub(super) unsafe fn stream_query(stream: sys::CUstream) -> Result<bool> {
    // SAFETY: the caller's contract.
    match unsafe { sys::cuStreamQuery(stream) } {
        sys::CUresult::CUDA_SUCCESS => Ok(true),
        sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        e => Err(cuda_err("cuStreamQuery")(e.result().unwrap_err())),
    }
}

/// Makes later work of `stream` wait for `event`.
///
/// # Safety
/// Both are live.
pub(super) unsafe fn stream_wait_event(stream: sys::CUstream, event: sys::CUevent) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { sys::cuStreamWaitEvent(stream, event, 0) }.result().map_err(cuda_err("cuStreamWaitEvent"))
}

// ---- memory --------------------------------------------------------------------------

/// Allocates `bytes` from the device's default memory pool in stream order on `stream`.
///
/// # Safety
/// `stream` is live.
pub(super) unsafe fn mem_alloc_async(bytes: usize, stream: sys::CUstream) -> Result<sys::CUdeviceptr> {
    let mut p = 0;
    // SAFETY: the caller's contract; `p` is written.
    unsafe { sys::cuMemAllocAsync(&mut p, bytes, stream) }.result().map_err(cuda_err("cuMemAllocAsync"))?;
    Ok(p)
}

/// Frees pool memory in stream order on `stream` (never waits for the device).
///
/// # Safety
/// `ptr` came from [`mem_alloc_async`], is freed once, and no work that runs after the free
/// in `stream`'s order uses it.
pub(super) unsafe fn mem_free_async(ptr: sys::CUdeviceptr, stream: sys::CUstream) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { sys::cuMemFreeAsync(ptr, stream) }.result().map_err(cuda_err("cuMemFreeAsync"))
}

/// Queues a byte fill.
///
/// # Safety
/// `[dst, dst + bytes)` is device memory valid until the fill has run.
pub(super) unsafe fn memset_async(dst: sys::CUdeviceptr, value: u8, bytes: usize, stream: sys::CUstream) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { result::memset_d8_async(dst, value, bytes, stream) }.map_err(cuda_err("cuMemsetD8Async"))
}

/// Queues a host-to-device copy. From pageable memory the driver stages `src` before this
/// returns; from pinned memory it reads `src` when the copy runs.
///
/// # Safety
/// `[dst, dst + src.len())` is device memory valid until the copy has run; where `src` is
/// pinned memory, it stays valid and unwritten until then too.
pub(super) unsafe fn memcpy_htod_async(dst: sys::CUdeviceptr, src: &[u8], stream: sys::CUstream) -> Result<()> {
    // SAFETY: the caller's contract; `src` is a valid host slice.
    unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.as_ptr() as *const c_void, src.len(), stream) }
        .result()
        .map_err(cuda_err("cuMemcpyHtoDAsync"))
}

/// Whether the driver has `cuMemcpyBatchAsync_v2` (CUDA 13.0 drivers and later); asked once.
fn has_batch_copies() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        let mut version = 0;
        // SAFETY: writes one int; callable before and after `cuInit`.
        let ok = unsafe { sys::cuDriverGetVersion(&mut version) }.result().is_ok();
        ok && version >= 13000
    })
}

/// Queues `copies` `(dst, src, bytes)` (device memory, or the device address of host-mapped
/// pinned memory) as one `cuMemcpyBatchAsync`: one driver call and one submission for all,
/// which run after the stream's earlier work, in no order among themselves. `Ok(false)`: not
/// queued, as this driver has no batch copies (the caller copies one by one).
///
/// # Safety
/// Every range is valid until the stream has run the batch; no destination overlaps another
/// copy's destination or source; the sources are not written before the batch has run.
pub(super) unsafe fn memcpy_batch_async(copies: &[(u64, u64, usize)], stream: sys::CUstream) -> Result<bool> {
    if !has_batch_copies() {
        return Ok(false);
    }
    let copies: Vec<_> = copies.iter().filter(|c| c.2 > 0).collect();
    if copies.is_empty() {
        return Ok(true);
    }
    let mut dsts: Vec<sys::CUdeviceptr> = copies.iter().map(|c| c.0).collect();
    let mut srcs: Vec<sys::CUdeviceptr> = copies.iter().map(|c| c.1).collect();
    let mut sizes: Vec<usize> = copies.iter().map(|c| c.2).collect();
    let nowhere = sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_INVALID, id: 0 };
    // Sources read in stream order (as a plain async copy), no placement hints.
    let mut attrs = sys::CUmemcpyAttributes {
        srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
        srcLocHint: nowhere,
        dstLocHint: nowhere,
        // Copy engines rather than SMs where the driver heeds it (CUDA 13.1 and later, by
        // their release notes): the kernels waiting for these copies may hold every SM.
        flags: sys::CUmemcpyFlags::CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE as u32,
    };
    let mut first = 0usize;
    // SAFETY: the arrays hold `copies.len()` entries each and one attribute for all copies
    // (starting at copy 0); the ranges are the caller's contract.
    unsafe {
        sys::cuMemcpyBatchAsync_v2(
            dsts.as_mut_ptr(),
            srcs.as_mut_ptr(),
            sizes.as_mut_ptr(),
            copies.len(),
            &mut attrs,
            &mut first,
            1,
            stream,
        )
    }
    .result()
    .map_err(cuda_err("cuMemcpyBatchAsync"))?;
    Ok(true)
}

/// Queues a device-to-host copy into pageable memory (complete when this returns, by the
/// driver's rule for pageable destinations; the caller still synchronizes the stream).
///
/// # Safety
/// `[src, src + dst.len())` is device memory, valid until the copy has run.
pub(super) unsafe fn memcpy_dtoh_async(dst: &mut [u8], src: sys::CUdeviceptr, stream: sys::CUstream) -> Result<()> {
    // SAFETY: the caller's contract; `dst` is a valid host slice.
    unsafe { sys::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr() as *mut c_void, src, dst.len(), stream) }
        .result()
        .map_err(cuda_err("cuMemcpyDtoHAsync"))
}

/// Queues a write of `bytes` (1, 2, 4, 8) bytes of `value` to `dst` after the stream's work:
/// `cuMemsetD8Async`/`cuMemsetD16Async` for 1 and 2 bytes, `cuStreamWriteValue32/64` for 4 and 8.
///
/// # Safety
/// `dst` is device memory writable by the stream's device, aligned to `bytes`.
pub(super) unsafe fn write_value_async(
    dst: sys::CUdeviceptr,
    value: u64,
    bytes: u32,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe {
        match bytes {
            1 => sys::cuMemsetD8Async(dst, value as u8, 1, stream).result().map_err(cuda_err("cuMemsetD8Async")),
            2 => sys::cuMemsetD16Async(dst, value as u16, 1, stream).result().map_err(cuda_err("cuMemsetD16Async")),
            4 => sys::cuStreamWriteValue32_v2(stream, dst, value as u32, 0)
                .result()
                .map_err(cuda_err("cuStreamWriteValue32")),
            _ => sys::cuStreamWriteValue64_v2(stream, dst, value, 0).result().map_err(cuda_err("cuStreamWriteValue64")),
        }
    }
}

/// Queues `writes` `(addr, value, bytes)` (4 or 8 bytes each), then, with `wait`
/// `(addr, value)`, a wait until that 64-bit word is at least `value`, as one
/// `cuStreamBatchMemOp` (one driver call). Each write is preceded by a memory barrier (the
/// driver's default; the v2 API refuses `CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER` with
/// CUDA_ERROR_INVALID_VALUE, seen on the H200), so the last write is ordered after the
/// others and after the stream's earlier work.
///
/// # Safety
/// Each address is device memory writable by the stream's device, aligned to its size; the
/// waited word stays valid until the wait has passed and is written only atomically.
pub(super) unsafe fn write_values_batched(
    writes: &[(u64, u64, u32)],
    wait: Option<(u64, u64)>,
    stream: sys::CUstream,
) -> Result<()> {
    use sys::CUstreamBatchMemOpParams_union_CUstreamMemOpWriteValueParams_st__bindgen_ty_1 as WriteValue;
    let mut params: Vec<sys::CUstreamBatchMemOpParams> = writes
        .iter()
        .map(|&(addr, value, bytes)| {
            let (operation, v) = if bytes == 4 {
                (sys::CUstreamBatchMemOpType::CU_STREAM_MEM_OP_WRITE_VALUE_32, WriteValue { value: value as u32 })
            } else {
                (sys::CUstreamBatchMemOpType::CU_STREAM_MEM_OP_WRITE_VALUE_64, WriteValue { value64: value })
            };
            sys::CUstreamBatchMemOpParams {
                writeValue: sys::CUstreamBatchMemOpParams_union_CUstreamMemOpWriteValueParams_st {
                    operation,
                    address: addr,
                    __bindgen_anon_1: v,
                    flags: 0,
                    alias: 0,
                },
            }
        })
        .collect();
    if let Some((addr, value)) = wait {
        params.push(sys::CUstreamBatchMemOpParams {
            waitValue: sys::CUstreamBatchMemOpParams_union_CUstreamMemOpWaitValueParams_st {
                operation: sys::CUstreamBatchMemOpType::CU_STREAM_MEM_OP_WAIT_VALUE_64,
                address: addr,
                __bindgen_anon_1: sys::CUstreamBatchMemOpParams_union_CUstreamMemOpWaitValueParams_st__bindgen_ty_1 {
                    value64: value,
                },
                flags: sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
                alias: 0,
            },
        });
    }
    let count = u32::try_from(params.len()).map_err(|_| Error::InvalidArgument("too many stream writes".into()))?;
    // SAFETY: `params` holds `count` initialized operations; the caller's contract covers
    // their addresses.
    unsafe { sys::cuStreamBatchMemOp_v2(stream, count, params.as_mut_ptr(), 0) }
        .result()
        .map_err(cuda_err("cuStreamBatchMemOp"))
}

/// Queues a device-to-device copy.
///
/// # Safety
/// Both ranges are device memory valid until the copy has run.
pub(super) unsafe fn memcpy_dtod_async(
    dst: sys::CUdeviceptr,
    src: sys::CUdeviceptr,
    bytes: usize,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { result::memcpy_dtod_async(dst, src, bytes, stream) }.map_err(cuda_err("cuMemcpyDtoDAsync"))
}

/// Pinned host memory mapped into the device's address space (`cuMemHostAlloc` with
/// DEVICEMAP | PORTABLE); returns the host pointer.
pub(super) fn host_alloc_mapped(bytes: usize) -> Result<*mut u8> {
    let mut p: *mut c_void = std::ptr::null_mut();
    let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
    // SAFETY: allocates; `p` is written.
    unsafe { sys::cuMemHostAlloc(&mut p, bytes.max(1), flags) }.result().map_err(cuda_err("cuMemHostAlloc"))?;
    Ok(p as *mut u8)
}

/// The device address of mapped host memory.
///
/// # Safety
/// `p` came from [`host_alloc_mapped`] and is live.
pub(super) unsafe fn host_device_pointer(p: *mut u8) -> Result<sys::CUdeviceptr> {
    let mut d = 0;
    // SAFETY: the caller's contract.
    unsafe { sys::cuMemHostGetDevicePointer_v2(&mut d, p as *mut c_void, 0) }
        .result()
        .map_err(cuda_err("cuMemHostGetDevicePointer"))?;
    Ok(d)
}

/// Frees memory from [`host_alloc_mapped`].
///
/// # Safety
/// `p` came from it, is freed once, and nothing uses it afterwards.
pub(super) unsafe fn host_free(p: *mut u8) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { sys::cuMemFreeHost(p as *mut c_void) }.result().map_err(cuda_err("cuMemFreeHost"))
}

// ---- modules and launches --------------------------------------------------------------

/// Loads a PTX module into the current context (JIT-compiled by the driver).
pub(super) fn module_load(ptx: &str) -> Result<sys::CUmodule> {
    let image = CString::new(ptx).map_err(|_| Error::InvalidArgument("PTX text contains a NUL byte".into()))?;
    // SAFETY: `image` is a NUL-terminated PTX string, alive during the call.
    unsafe { result::module::load_data(image.as_ptr() as *const c_void) }.map_err(cuda_err("cuModuleLoadData"))
}

/// Loads an assembled module (a cubin for this GPU's architecture) into the current context.
pub(super) fn module_load_image(image: &[u8]) -> Result<sys::CUmodule> {
    // A cubin is an ELF image: check the magic so that stray bytes are refused here rather
    // than handed to the driver as a pointer it would read as text.
    if image.len() < 4 || &image[..4] != b"\x7fELF" {
        return Err(Error::InvalidArgument("the module image is not a cubin (no ELF header)".into()));
    }
    // SAFETY: `image` is a whole ELF image alive during the call; the driver reads it only
    // there (it copies what it keeps).
    unsafe { result::module::load_data(image.as_ptr() as *const c_void) }.map_err(cuda_err("cuModuleLoadData"))
}

/// Links `ptx` with the static library at `library` (a `.a` of device code: the CUDA device
/// runtime) into a cubin for the current context's GPU. A failure's error holds the linker's
/// log.
pub(super) fn link_with_library(ptx: &str, library: &std::path::Path) -> Result<Vec<u8>> {
    use std::os::unix::ffi::OsStrExt as _;
    let image = CString::new(ptx).map_err(|_| Error::InvalidArgument("PTX text contains a NUL byte".into()))?;
    let path = CString::new(library.as_os_str().as_bytes())
        .map_err(|_| Error::InvalidArgument("the library's path contains a NUL byte".into()))?;
    let mut log = vec![0u8; 16 * 1024];
    let mut options =
        [sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER, sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES];
    // A size option's value is the number itself, in the pointer's place.
    let mut values = [log.as_mut_ptr() as *mut c_void, log.len() as *mut c_void];
    let mut state: sys::CUlinkState = std::ptr::null_mut();
    // SAFETY: two options with their values; `log` outlives the linker (destroyed below).
    unsafe { sys::cuLinkCreate_v2(2, options.as_mut_ptr(), values.as_mut_ptr(), &mut state) }
        .result()
        .map_err(cuda_err("cuLinkCreate"))?;
    let linked = (|| -> Result<Vec<u8>> {
        // The driver writes its log through the pointer given at creation.
        let with_log = |what: &'static str, e: result::DriverError| {
            let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
            let text = String::from_utf8_lossy(&log[..end]);
            Error::InvalidArgument(format!("{what}: {e:?}: {}", text.trim()))
        };
        // SAFETY: `image` is NUL-terminated PTX, alive during the call (the linker copies it);
        // the name is a NUL-terminated string; no options.
        unsafe {
            sys::cuLinkAddData_v2(
                state,
                sys::CUjitInputType::CU_JIT_INPUT_PTX,
                image.as_ptr() as *mut c_void,
                image.as_bytes_with_nul().len(),
                c"module".as_ptr(),
                0,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(|e| with_log("cuLinkAddData (the PTX)", e))?;
        // SAFETY: `path` is a NUL-terminated path; no options.
        unsafe {
            sys::cuLinkAddFile_v2(
                state,
                sys::CUjitInputType::CU_JIT_INPUT_LIBRARY,
                path.as_ptr(),
                0,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(|e| with_log("cuLinkAddFile (the library)", e))?;
        let (mut cubin, mut size): (*mut c_void, usize) = (std::ptr::null_mut(), 0);
        // SAFETY: valid out-pointers; the image belongs to the linker until it is destroyed.
        unsafe { sys::cuLinkComplete(state, &mut cubin, &mut size) }
            .result()
            .map_err(|e| with_log("cuLinkComplete", e))?;
        // SAFETY: the linker's image: `size` bytes at `cubin`, alive until `cuLinkDestroy`.
        Ok(unsafe { std::slice::from_raw_parts(cubin as *const u8, size) }.to_vec())
    })();
    // SAFETY: made above, not used after this.
    let _ = unsafe { sys::cuLinkDestroy(state) };
    linked
}

/// Unloads a module.
///
/// # Safety
/// `module` is loaded, and no queued or running kernel is from it.
pub(super) unsafe fn module_unload(module: sys::CUmodule) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { result::module::unload(module) }.map_err(cuda_err("cuModuleUnload"))
}

/// Looks up a kernel entry.
///
/// # Safety
/// `module` is loaded.
pub(super) unsafe fn module_function(module: sys::CUmodule, name: &str) -> Result<sys::CUfunction> {
    let cname = CString::new(name).map_err(|_| Error::KernelNotFound(name.into()))?;
    // SAFETY: the caller's contract.
    unsafe { result::module::get_function(module, cname) }.map_err(|e| {
        if e.0 == sys::cudaError_enum::CUDA_ERROR_NOT_FOUND {
            Error::KernelNotFound(name.into())
        } else {
            Error::Cuda { call: "cuModuleGetFunction", source: e }
        }
    })
}

/// A function attribute.
///
/// # Safety
/// `f` is a function of a loaded module.
pub(super) unsafe fn function_attribute(f: sys::CUfunction, attr: sys::CUfunction_attribute) -> Result<i32> {
    // SAFETY: the caller's contract; attribute queries have no side effects.
    unsafe { result::function::get_function_attribute(f, attr) }.map_err(cuda_err("cuFuncGetAttribute"))
}

/// How many CTAs of `f` with `threads` threads and `shared_bytes` of dynamic shared memory
/// one SM holds at once (`cuOccupancyMaxActiveBlocksPerMultiprocessor`).
///
/// # Safety
/// `f` is a function of a loaded module.
pub(super) unsafe fn occupancy_ctas_per_sm(f: sys::CUfunction, threads: u32, shared_bytes: u32) -> Result<u32> {
    let mut n: i32 = 0;
    // SAFETY: the caller's contract; `n` is a valid output location.
    unsafe { sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut n, f, threads as i32, shared_bytes as usize) }
        .result()
        .map_err(cuda_err("cuOccupancyMaxActiveBlocksPerMultiprocessor"))?;
    Ok(n.max(0) as u32)
}

/// Raises `f`'s dynamic shared memory limit to `bytes`.
///
/// # Safety
/// `f` is a function of a loaded module.
pub(super) unsafe fn function_set_max_dynamic_shared(f: sys::CUfunction, bytes: u32) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe {
        sys::cuFuncSetAttribute(
            f,
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes as i32,
        )
    }
    .result()
    .map_err(cuda_err("cuFuncSetAttribute"))
}

/// Queues a kernel launch.
///
/// # Safety
/// `f` is from a loaded module; `params` point to values whose types and layout match the
/// kernel's parameters; the kernel's own contract holds; `stream` is live.
pub(super) unsafe fn launch_kernel(
    f: sys::CUfunction,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    shared_mem_bytes: u32,
    stream: sys::CUstream,
    params: &mut [*mut c_void],
) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { result::launch_kernel(f, grid, block, shared_mem_bytes, stream, params) }
        .map_err(cuda_err("cuLaunchKernel"))
}

// ---- events ----------------------------------------------------------------------------

/// Creates an event (with timing or without, which makes recording cheaper).
pub(super) fn event_create(timing: bool) -> Result<sys::CUevent> {
    let flags = if timing { sys::CUevent_flags::CU_EVENT_DEFAULT } else { sys::CUevent_flags::CU_EVENT_DISABLE_TIMING };
    result::event::create(flags).map_err(cuda_err("cuEventCreate"))
}

/// Records `event` at the current end of `stream`.
///
/// # Safety
/// Both are live.
pub(super) unsafe fn event_record(event: sys::CUevent, stream: sys::CUstream) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { result::event::record(event, stream) }.map_err(cuda_err("cuEventRecord"))
}

/// `Ok(true)` if reached, `Ok(false)` if pending, the error if the work before it failed.
///
/// # Safety
/// `event` is live.
pub(super) unsafe fn event_query(event: sys::CUevent) -> Result<bool> {
    // SAFETY: the caller's contract.
    match unsafe { sys::cuEventQuery(event) } {
        sys::CUresult::CUDA_SUCCESS => Ok(true),
        sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        e => Err(cuda_err("cuEventQuery")(e.result().unwrap_err())),
    }
}

/// Waits for `event`.
///
/// # Safety
/// `event` is live.
pub(super) unsafe fn event_synchronize(event: sys::CUevent) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { result::event::synchronize(event) }.map_err(cuda_err("cuEventSynchronize"))
}

/// Milliseconds between two reached timing events.
///
/// # Safety
/// Both are live and were created with timing.
pub(super) unsafe fn event_elapsed_ms(start: sys::CUevent, end: sys::CUevent) -> Result<f32> {
    // SAFETY: the caller's contract.
    unsafe { result::event::elapsed(start, end) }.map_err(cuda_err("cuEventElapsedTime"))
}

/// Destroys an event.
///
/// # Safety
/// `event` is live and not used afterwards.
pub(super) unsafe fn event_destroy(event: sys::CUevent) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { result::event::destroy(event) }.map_err(cuda_err("cuEventDestroy"))
}

// ---- virtual memory management ----------------------------------------------------------

fn allocation_prop(device: sys::CUdevice) -> sys::CUmemAllocationProp {
    // SAFETY: an all-zero CUmemAllocationProp is a valid starting value (the C API's
    // documented way to initialize it); the fields we need are set below.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device;
    prop
}

/// The recommended VMM granularity of `device` (2 MiB on the H200).
pub(super) fn vmm_granularity(device: sys::CUdevice) -> Result<usize> {
    let prop = allocation_prop(device);
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

/// Creates `size` bytes (a multiple of the granularity) of physical memory on `device`,
/// exportable as a POSIX file descriptor.
pub(super) fn vmm_create(device: sys::CUdevice, size: usize) -> Result<sys::CUmemGenericAllocationHandle> {
    let prop = allocation_prop(device);
    let mut handle = 0;
    // SAFETY: `prop` describes pinned device memory; `handle` is written.
    unsafe { sys::cuMemCreate(&mut handle, size, &prop, 0) }.result().map_err(cuda_err("cuMemCreate"))?;
    Ok(handle)
}

/// Exports a physical allocation as a POSIX file descriptor (the caller owns it).
///
/// # Safety
/// `handle` is a live allocation created with the POSIX_FD handle type.
pub(super) unsafe fn vmm_export_fd(handle: sys::CUmemGenericAllocationHandle) -> Result<i32> {
    let mut fd: i32 = -1;
    // SAFETY: the caller's contract; `fd` is written.
    unsafe {
        sys::cuMemExportToShareableHandle(
            (&raw mut fd).cast(),
            handle,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    }
    .result()
    .map_err(cuda_err("cuMemExportToShareableHandle"))?;
    Ok(fd)
}

/// Imports a physical allocation another process exported as `fd` (which stays open: the
/// caller closes it).
///
/// # Safety
/// `fd` is an open descriptor from [`vmm_export_fd`] (in any process of this machine).
pub(super) unsafe fn vmm_import_fd(fd: i32) -> Result<sys::CUmemGenericAllocationHandle> {
    let mut handle = 0;
    // SAFETY: the caller's contract; for POSIX_FD handles the driver takes the descriptor's
    // value in the pointer argument.
    unsafe {
        sys::cuMemImportFromShareableHandle(
            &mut handle,
            fd as isize as *mut c_void,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        )
    }
    .result()
    .map_err(cuda_err("cuMemImportFromShareableHandle"))?;
    Ok(handle)
}

/// Releases a physical allocation (its memory lives on while mapped somewhere).
///
/// # Safety
/// `handle` came from [`vmm_create`] and is released once.
pub(super) unsafe fn vmm_release(handle: sys::CUmemGenericAllocationHandle) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { sys::cuMemRelease(handle) }.result().map_err(cuda_err("cuMemRelease"))
}

/// Reserves `size` bytes of virtual addresses aligned to `align`.
pub(super) fn vmm_reserve(size: usize, align: usize) -> Result<sys::CUdeviceptr> {
    let mut base = 0;
    // SAFETY: reserves address space only; `base` is written.
    unsafe { sys::cuMemAddressReserve(&mut base, size, align, 0, 0) }
        .result()
        .map_err(cuda_err("cuMemAddressReserve"))?;
    Ok(base)
}

/// Maps all of `handle` (`size` bytes) at `va`.
///
/// # Safety
/// `[va, va + size)` lies in a live reservation and is unmapped; `handle` is live.
pub(super) unsafe fn vmm_map(
    va: sys::CUdeviceptr,
    size: usize,
    handle: sys::CUmemGenericAllocationHandle,
) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { sys::cuMemMap(va, size, 0, handle, 0) }.result().map_err(cuda_err("cuMemMap"))
}

/// Grants read/write access to `[va, va + size)` to each of `devices`.
///
/// # Safety
/// The range is fully mapped.
pub(super) unsafe fn vmm_set_access(va: sys::CUdeviceptr, size: usize, devices: &[sys::CUdevice]) -> Result<()> {
    let descs: Vec<sys::CUmemAccessDesc> = devices
        .iter()
        .map(|&d| {
            // SAFETY: all-zero is a valid starting value for this plain C struct.
            let mut desc: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
            desc.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
            desc.location.id = d;
            desc.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
            desc
        })
        .collect();
    // SAFETY: the caller's contract; `descs` is valid for the call.
    unsafe { sys::cuMemSetAccess(va, size, descs.as_ptr(), descs.len()) }.result().map_err(cuda_err("cuMemSetAccess"))
}

/// Unmaps `[va, va + size)`.
///
/// # Safety
/// Exactly this range was mapped by [`vmm_map`], and no work uses it any more.
pub(super) unsafe fn vmm_unmap(va: sys::CUdeviceptr, size: usize) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { sys::cuMemUnmap(va, size) }.result().map_err(cuda_err("cuMemUnmap"))
}

/// Frees a reservation.
///
/// # Safety
/// It came from [`vmm_reserve`] with this size, is unmapped, and is freed once.
pub(super) unsafe fn vmm_address_free(base: sys::CUdeviceptr, size: usize) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { sys::cuMemAddressFree(base, size) }.result().map_err(cuda_err("cuMemAddressFree"))
}

/// Starts capturing `stream` in relaxed mode (other threads' driver calls are not
/// restricted: ranks of one process capture at once).
///
/// # Safety
/// `stream` is live.
pub(super) unsafe fn stream_begin_capture(stream: sys::CUstream) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { sys::cuStreamBeginCapture_v2(stream, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED) }
        .result()
        .map_err(cuda_err("cuStreamBeginCapture"))
}

/// Whether `stream` is capturing now.
///
/// # Safety
/// `stream` is live.
pub(super) unsafe fn stream_is_capturing(stream: sys::CUstream) -> Result<bool> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: the caller's contract; `status` is a valid out-pointer.
    unsafe { sys::cuStreamIsCapturing(stream, &mut status) }.result().map_err(cuda_err("cuStreamIsCapturing"))?;
    Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// Ends the capture of `stream` and instantiates the graph (for device launch too with
/// `device_launch`): (graph, executable graph).
///
/// # Safety
/// `stream` is live and capturing.
pub(super) unsafe fn stream_end_capture(
    stream: sys::CUstream,
    device_launch: bool,
) -> Result<(sys::CUgraph, sys::CUgraphExec)> {
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: the caller's contract; `graph` is a valid out-pointer.
    unsafe { sys::cuStreamEndCapture(stream, &mut graph) }.result().map_err(cuda_err("cuStreamEndCapture"))?;
    let mut exec: sys::CUgraphExec = std::ptr::null_mut();
    let flags = if device_launch {
        sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH.0 as u64
    } else {
        0
    };
    // SAFETY: `graph` was just made; `exec` is a valid out-pointer.
    if let Err(e) = unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, flags) }.result() {
        // SAFETY: `graph` is ours and unused.
        unsafe { sys::cuGraphDestroy(graph) };
        return Err(cuda_err("cuGraphInstantiateWithFlags")(e));
    }
    Ok((graph, exec))
}

/// Queues a run of `exec` on `stream`.
///
/// # Safety
/// Both are live, of the current context.
pub(super) unsafe fn graph_launch(exec: sys::CUgraphExec, stream: sys::CUstream) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { sys::cuGraphLaunch(exec, stream) }.result().map_err(cuda_err("cuGraphLaunch"))
}

/// Uploads `exec` (instantiated for device launch) on `stream`, so that kernels may launch it.
///
/// # Safety
/// Both are live, of the current context.
pub(super) unsafe fn graph_upload(exec: sys::CUgraphExec, stream: sys::CUstream) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { sys::cuGraphUpload(exec, stream) }.result().map_err(cuda_err("cuGraphUpload"))
}

/// Destroys a graph and its executable.
///
/// # Safety
/// Neither is used after this (launches already queued complete in the driver).
pub(super) unsafe fn graph_destroy(graph: sys::CUgraph, exec: sys::CUgraphExec) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { sys::cuGraphExecDestroy(exec) }.result().map_err(cuda_err("cuGraphExecDestroy"))?;
    // SAFETY: as above.
    unsafe { sys::cuGraphDestroy(graph) }.result().map_err(cuda_err("cuGraphDestroy"))
}

/// Makes `stream` wait until the 64-bit word at `addr` is at least `value` (greater or
/// equal, as unsigned numbers).
///
/// # Safety
/// `addr` is device memory (or mapped host memory) of the stream's device, 8-byte aligned,
/// valid until the wait has passed.
pub(super) unsafe fn stream_wait_value_geq(stream: sys::CUstream, addr: sys::CUdeviceptr, value: u64) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe {
        sys::cuStreamWaitValue64_v2(stream, addr, value, sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32)
    }
    .result()
    .map_err(cuda_err("cuStreamWaitValue64"))
}
