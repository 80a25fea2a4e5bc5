//! Safe operations built on the built-in kernels. They check what the kernels' contracts
//! need (lengths, bounds, launch shapes) and pass borrowed buffers, so the launches are
//! tracked: the operations return without waiting, and the buffers stay alive and ordered
//! until the kernels have run.

use crate::runtime::backend::LaunchProfile;
use crate::runtime::device::Device;
use crate::runtime::launch::LaunchConfig;
use crate::runtime::memory::{DeviceBuffer, TrackedPtr};
use crate::runtime::stream::Stream;
use crate::{Error, Result};
use bytemuck::Pod;
use ferrolink_device::kernel::Kernel;
use ferrolink_device::kernels::copy::ferrolink_copy;

/// The launch shape [`copy`] uses on `dev` for `bytes` bytes. On a GPU: 256-thread CTAs,
/// enough to cover the data in about one pass of the warp-contiguous copy, capped at 64 per
/// SM (measured best on the H200, docs/PERF.md). On the emulator: 64 threads per host core,
/// at most 8 CTAs.
///
/// ```
/// # fn main() -> ferrolink::Result<()> {
/// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// let cfg = ferrolink::ops::copy_launch_config(&dev, 1 << 20);
/// assert!(cfg.is_1d());
/// cfg.validate("ferrolink_copy")?;
/// # Ok(()) }
/// ```
pub fn copy_launch_config(dev: &Device, bytes: usize) -> LaunchConfig {
    let profile = dev.launch_profile();
    let threads = profile.copy_threads;
    let ctas = match profile.copy_ctas {
        Some(most) => dev.sm_count().clamp(1, most),
        None => {
            let per_cta = (threads as usize / 32) * ferrolink_device::kernels::copy::WARP_CHUNK_BYTES;
            bytes.div_ceil(per_cta).clamp(1, dev.sm_count() as usize * LaunchProfile::COPY_CTAS_PER_SM) as u32
        }
    };
    LaunchConfig::linear(ctas, threads)
}

/// The launch shape of a copy queued among the ranks' own kernels (staging into or out of a
/// window): [`copy_launch_config`] on a GPU; on the emulator one CTA of 8 threads, as every
/// rank's kernels share the host's cores.
pub(crate) fn staging_copy_config(dev: &Device, bytes: usize) -> LaunchConfig {
    match dev.launch_profile().staging_copy {
        Some((ctas, threads)) => LaunchConfig::linear(ctas, threads),
        None => copy_launch_config(dev, bytes),
    }
}

/// A kernel with the copy kernel's signature and contract.
///
/// ```
/// use ferrolink::ops::{CopyKernel, builtin_copy_kernels};
/// use ferrolink_device::kernels::copy::ferrolink_copy;
/// let k: &CopyKernel = &ferrolink_copy;
/// assert_eq!(builtin_copy_kernels()[0].1.name(), k.name());
/// ```
pub type CopyKernel = Kernel<(*mut u8, *const u8, usize)>;

/// Queues a copy of all of `src` into `dst` with the vectorized copy kernel (lengths must
/// match), on `stream`. Host reads of `dst` wait for it.
///
/// ```
/// # fn main() -> ferrolink::Result<()> {
/// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// # let stream = dev.create_stream()?;
/// let src = dev.alloc_from(&[1.0f32, 2.0, 3.0])?;
/// let mut dst = dev.alloc::<f32>(3)?;
/// ferrolink::ops::copy(&stream, &mut dst, &src)?;
/// assert_eq!(dst.to_vec()?, [1.0, 2.0, 3.0]);
/// assert!(ferrolink::ops::copy(&stream, &mut dev.alloc::<f32>(2)?, &src).is_err()); // lengths differ
/// # Ok(()) }
/// ```
pub fn copy<T: Pod>(stream: &Stream, dst: &mut DeviceBuffer<T>, src: &DeviceBuffer<T>) -> Result<()> {
    if dst.len() != src.len() {
        return Err(Error::InvalidArgument(format!(
            "copy: destination has {} elements, source {}",
            dst.len(),
            src.len()
        )));
    }
    let bytes = src.bytes();
    let cfg = copy_launch_config(stream.device(), bytes);
    launch_copy(stream, &ferrolink_copy, dst.bytes_at_mut(0)?, src.bytes_at(0)?, bytes, cfg)
}

/// Queues a copy of `bytes` bytes from `src[src_offset..]` to `dst[dst_offset..]` with the
/// copy kernel and launch shape `cfg` (one-dimensional; see [`copy_launch_config`]). Offsets
/// need no alignment.
///
/// ```
/// use ferrolink::{LaunchConfig, ops::copy_bytes_with};
/// # fn main() -> ferrolink::Result<()> {
/// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// # let stream = dev.create_stream()?;
/// let src = dev.alloc_from(&[7u8; 32])?;
/// let mut dst = dev.alloc::<u8>(32)?;
/// copy_bytes_with(&stream, &mut dst, 0, &src, 0, 32, LaunchConfig::linear(1, 32))?;
/// assert_eq!(dst.to_vec()?, vec![7u8; 32]);
/// let two_d = LaunchConfig { block: (8, 4, 1), ..LaunchConfig::linear(1, 1) };
/// assert!(copy_bytes_with(&stream, &mut dst, 0, &src, 0, 32, two_d).is_err()); // 1-D only
/// # Ok(()) }
/// ```
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
    launch_copy(stream, &ferrolink_copy, dst.bytes_at_mut(dst_offset)?, src.bytes_at(src_offset)?, bytes, cfg)
}

/// [`copy_bytes_with`] with the default launch shape.
///
/// ```
/// # fn main() -> ferrolink::Result<()> {
/// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// # let stream = dev.create_stream()?;
/// let src = dev.alloc_from(&[1u8, 2, 3, 4, 5, 6, 7, 8])?;
/// let mut dst = dev.alloc::<u8>(8)?;
/// ferrolink::ops::copy_bytes(&stream, &mut dst, 5, &src, 1, 3)?; // src[1..4] to dst[5..8]
/// assert_eq!(dst.to_vec()?, [0, 0, 0, 0, 0, 2, 3, 4]);
/// assert!(ferrolink::ops::copy_bytes(&stream, &mut dst, 6, &src, 0, 3).is_err()); // past the end
/// # Ok(()) }
/// ```
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

/// The built-in copy kernels: [`ferrolink_copy`] and its
/// [`variants`](ferrolink_device::kernels::copy::variants), which share its contract.
///
/// ```
/// # fn main() -> ferrolink::Result<()> {
/// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// let module = dev.builtin_module()?;
/// for (label, kernel) in ferrolink::ops::builtin_copy_kernels() {
///     assert!(module.has_kernel(kernel.name()), "{label}");
/// }
/// # Ok(()) }
/// ```
pub fn builtin_copy_kernels() -> [(&'static str, &'static CopyKernel); 6] {
    use ferrolink_device::kernels::copy::variants::*;
    [
        ("ferrolink_copy", &ferrolink_copy),
        ("grid-stride x4", &copy_variant_grid_stride4),
        ("grid-stride x8 streaming", &copy_variant_grid_stride8_streaming),
        ("warp-contiguous x4", &copy_variant_warp_contiguous4),
        ("warp-contiguous x16", &copy_variant_warp_contiguous16),
        ("warp-contiguous x8 streaming", &copy_variant_warp_contiguous8_streaming),
    ]
}

/// Runs `kernel` (one of [`builtin_copy_kernels`]) over all of `src` into `dst` with shape
/// `cfg`: the perf tool's way to time them.
///
/// ```
/// use ferrolink::ops::{builtin_copy_kernels, copy_launch_config, copy_with_kernel};
/// # fn main() -> ferrolink::Result<()> {
/// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// # let stream = dev.create_stream()?;
/// let src = dev.alloc_from(&[3u64; 512])?;
/// let cfg = copy_launch_config(&dev, src.bytes());
/// for (_, kernel) in builtin_copy_kernels() {
///     let mut dst = dev.alloc::<u64>(512)?;
///     copy_with_kernel(&stream, kernel, &mut dst, &src, cfg)?;
///     assert_eq!(dst.to_vec()?, vec![3u64; 512]);
/// }
/// # Ok(()) }
/// ```
pub fn copy_with_kernel<T: Pod>(
    stream: &Stream,
    kernel: &'static CopyKernel,
    dst: &mut DeviceBuffer<T>,
    src: &DeviceBuffer<T>,
    cfg: LaunchConfig,
) -> Result<()> {
    if !builtin_copy_kernels().iter().any(|(_, k)| k.name() == kernel.name()) {
        return Err(Error::InvalidArgument(format!(
            "copy_with_kernel: `{}` is not a built-in copy kernel",
            kernel.name()
        )));
    }
    if dst.len() != src.len() {
        return Err(Error::InvalidArgument("copy_with_kernel: lengths differ".into()));
    }
    let bytes = src.bytes();
    launch_copy(stream, kernel, dst.bytes_at_mut(0)?, src.bytes_at(0)?, bytes, cfg)
}

/// Launches a copy kernel on checked ranges.
pub(crate) fn launch_copy(
    stream: &Stream,
    kernel: &CopyKernel,
    dst: TrackedPtr<'_, *mut u8>,
    src: TrackedPtr<'_, *const u8>,
    bytes: usize,
    cfg: LaunchConfig,
) -> Result<()> {
    if !cfg.is_1d() {
        // The copy kernels index threads along x only: in a 2-D or 3-D launch several threads
        // would store the same bytes at once (a data race).
        return Err(Error::InvalidArgument(format!(
            "copy: the launch shape must be one-dimensional (grid {:?}, block {:?})",
            cfg.grid, cfg.block
        )));
    }
    if bytes == 0 {
        return Ok(());
    }
    let module = stream.device().builtin_module()?;
    // SAFETY: the copy kernels' contract: the callers bounds-checked `bytes` bytes at both
    // pointers against live buffers (the launch checks their devices and keeps them alive);
    // the ranges do not overlap (distinct allocations: `dst` comes from a `&mut` borrow);
    // the launch is 1-D, so each byte is written by one thread.
    unsafe { stream.launch(module, kernel, cfg, (dst, src, bytes)) }
}
