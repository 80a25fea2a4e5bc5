//! Safe operations built on the built-in kernels.

use crate::device::Device;
use crate::launch::LaunchConfig;
use crate::memory::DeviceBuffer;
use crate::stream::Stream;
use crate::{Backend, Error, Result};
use bytemuck::Pod;
use ferrolink_device::kernel::Kernel;
use ferrolink_device::kernels::copy::ferrolink_copy;

/// The launch shape [`copy`] uses on `dev` for `bytes` bytes. On a GPU: 256-thread CTAs,
/// enough to cover the data in about one pass of the warp-contiguous copy, capped at 64 per
/// SM (measured best on the H200, docs/PERF.md). On the emulator: 64 threads per host core.
pub fn copy_launch_config(dev: &Device, bytes: usize) -> LaunchConfig {
    match dev.backend() {
        Backend::Cuda => {
            const THREADS: u32 = 256;
            let per_cta = (THREADS as usize / 32) * ferrolink_device::kernels::copy::WARP_CHUNK_BYTES;
            let ctas = bytes.div_ceil(per_cta).clamp(1, dev.sm_count() as usize * 64) as u32;
            LaunchConfig::linear(ctas, THREADS)
        }
        Backend::Cpu => LaunchConfig::linear(dev.sm_count().clamp(1, 8), 64),
    }
}

/// Copies all of `src` into `dst` with the vectorized copy kernel (lengths must match), on
/// `stream`, and waits for it. (The safe copies are synchronous so that their borrows cover
/// the copy; for asynchronous copies launch `ferrolink_copy` with the `unsafe`
/// [`Stream::launch`].)
pub fn copy<T: Pod>(stream: &Stream, dst: &mut DeviceBuffer<T>, src: &DeviceBuffer<T>) -> Result<()> {
    if dst.len() != src.len() {
        return Err(Error::InvalidArgument(format!(
            "copy: destination has {} elements, source {}",
            dst.len(),
            src.len()
        )));
    }
    let cfg = copy_launch_config(stream.device(), src.bytes());
    copy_raw(stream, &ferrolink_copy, dst.addr(), dst.device(), src.addr(), src.device(), src.bytes(), cfg)?;
    // The borrows end when this returns: wait, so no other stream can race the copy.
    stream.synchronize()
}

/// Copies `bytes` bytes from `src[src_offset..]` to `dst[dst_offset..]` with the copy kernel
/// and launch shape `cfg` (see [`copy_launch_config`]). Offsets need no alignment.
pub fn copy_bytes_with(
    stream: &Stream,
    dst: &mut DeviceBuffer<u8>,
    dst_offset: usize,
    src: &DeviceBuffer<u8>,
    src_offset: usize,
    bytes: usize,
    cfg: LaunchConfig,
) -> Result<()> {
    let in_bounds = |off: usize, len: usize| off.checked_add(bytes).is_some_and(|end| end <= len);
    if !in_bounds(dst_offset, dst.len()) || !in_bounds(src_offset, src.len()) {
        return Err(Error::InvalidArgument(format!(
            "copy_bytes: {bytes} bytes at destination offset {dst_offset} (of {}) or source offset \
             {src_offset} (of {}) run past the buffer",
            dst.len(),
            src.len()
        )));
    }
    copy_raw(
        stream,
        &ferrolink_copy,
        dst.addr() + dst_offset as u64,
        dst.device(),
        src.addr() + src_offset as u64,
        src.device(),
        bytes,
        cfg,
    )?;
    // The borrows end when this returns: wait, so no other stream can race the copy.
    stream.synchronize()
}

/// [`copy_bytes_with`] with the default launch shape.
pub fn copy_bytes(
    stream: &Stream,
    dst: &mut DeviceBuffer<u8>,
    dst_offset: usize,
    src: &DeviceBuffer<u8>,
    src_offset: usize,
    bytes: usize,
) -> Result<()> {
    let cfg = copy_launch_config(stream.device(), bytes);
    copy_bytes_with(stream, dst, dst_offset, src, src_offset, bytes, cfg)
}

/// A kernel with the copy kernel's signature and contract.
pub(crate) type CopyKernel = Kernel<(*mut u8, *const u8, usize)>;

/// Launches `kernel`, which must have [`ferrolink_copy`]'s contract (only the built-in copy
/// kernel and its variants are passed here), after the callers' bounds checks.
#[allow(clippy::too_many_arguments)]
pub(crate) fn copy_raw(
    stream: &Stream,
    kernel: &CopyKernel,
    dst: u64,
    dst_dev: &Device,
    src: u64,
    src_dev: &Device,
    bytes: usize,
    cfg: LaunchConfig,
) -> Result<()> {
    if !dst_dev.same_as(stream.device()) || !src_dev.same_as(stream.device()) {
        return Err(Error::WrongDevice("buffer"));
    }
    if bytes == 0 {
        return Ok(());
    }
    let module = stream.device().builtin_module()?;
    // SAFETY: both ranges were bounds-checked against live buffers of this device; they do
    // not overlap (distinct allocations, `&mut` excludes aliasing); buffers outlive the
    // kernel because dropping one synchronizes the device, and host access synchronizes first.
    unsafe { stream.launch(module, kernel, cfg, (dst as *mut u8, src as *const u8, bytes)) }
}
