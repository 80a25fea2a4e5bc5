//! Vectorized copy.
//!
//! [`copy_bytes`] is the cooperative routine (any number of threads split the work); the
//! [`ferrolink_copy`] kernel runs it over the whole grid. [`variants`] holds the alternatives
//! the perf tool measures beside it (`ferrolink-perf copy --sweep`), so the choice of split,
//! unrolling and cache hints stays measured rather than remembered (docs/PERF.md).
//!
//! Measured on the H200 (2026-11-29): the warp-contiguous split with 8 vectors per lane and
//! about one pass over the data (many small CTAs) beat grid-stride loops by 3–6 %.

use crate::arch::{self, U32x4};
use crate::kernel;

/// 16-byte vectors each lane moves per iteration in [`copy_bytes`] (loads are issued before
/// stores, so each lane has this many independent 16-byte loads in flight).
///
/// ```
/// use ferrolink_device::kernels::copy::{VECTORS_PER_LANE, WARP_CHUNK_BYTES};
/// // Each of a warp's 32 lanes moves this many 16-byte vectors per iteration.
/// assert_eq!(WARP_CHUNK_BYTES, 32 * VECTORS_PER_LANE * 16);
/// ```
pub const VECTORS_PER_LANE: usize = 8;

/// Bytes one warp moves per iteration of [`copy_bytes`].
///
/// ```
/// use ferrolink_device::kernels::copy::WARP_CHUNK_BYTES;
/// // A 1 MiB copy is 256 warp iterations, spread over the warps that share it.
/// assert_eq!((1 << 20) / WARP_CHUNK_BYTES, 256);
/// ```
pub const WARP_CHUNK_BYTES: usize = 32 * VECTORS_PER_LANE * 16;

/// Copies `bytes` bytes from `src` to `dst`, shared among `nthreads` cooperating threads of
/// which the caller is `rank`. Each thread must call it with the same arguments.
///
/// When `src` and `dst` have the same address modulo 16 and `nthreads` is a multiple of 32,
/// the bulk moves warp-contiguously: each warp copies [`WARP_CHUNK_BYTES`] consecutive bytes
/// per iteration as 16-byte vectors (`ld.global.v4.u32` / `st.global.v4.u32`), lane `l`
/// taking vectors `l, l + 32, …`. Heads and tails go bytewise, other cases grid-stride.
///
/// Memory order: plain (weak) loads and stores; the caller orders them with a barrier,
/// fence or release as its protocol requires.
///
/// # Safety
/// `src` must be valid for reads and `dst` for writes of `bytes` bytes in global memory;
/// the ranges must not overlap, and nothing else may write them during the copy.
///
/// # Examples
///
/// ```
/// use ferrolink_device::kernels::copy::copy_bytes;
/// use ferrolink_device::{arch, kernel};
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// kernel! {
///     /// CTA `b` copies row `b` (`row` bytes) of `src` into `dst`, its threads sharing the row.
///     pub unsafe fn copy_rows(dst: *mut u8, src: *const u8, row: usize) {
///         let at = arch::block_idx_x() * row;
///         // SAFETY: the launcher passes a row per CTA in both buffers, which do not overlap.
///         unsafe { copy_bytes(dst.add(at), src.add(at), row, arch::thread_idx_x(), arch::block_dim_x()) }
///     }
/// }
/// let src: Vec<u8> = (0..3000u32).map(|i| i as u8).collect();
/// let mut dst = vec![0u8; src.len()];
/// # let spec = LaunchSpec { name: copy_rows.name(),
/// #     grid: [3, 1, 1], block: [64, 1, 1], shared_mem_bytes: 0, timeout: Duration::from_secs(10) };
/// // SAFETY: three rows of 1000 bytes in each buffer, which outlive the launch.
/// unsafe { emulator::launch(&spec, copy_rows.host_entry(), (dst.as_mut_ptr(), src.as_ptr(), 1000)) }.unwrap();
/// assert_eq!(dst, src);
/// ```
#[inline(always)]
pub unsafe fn copy_bytes(dst: *mut u8, src: *const u8, bytes: usize, rank: usize, nthreads: usize) {
    // SAFETY: forwarded contract.
    unsafe { copy_bytes_warp_contiguous::<VECTORS_PER_LANE, false>(dst, src, bytes, rank, nthreads) }
}

#[inline(always)]
unsafe fn load<const STREAMING: bool>(p: *const U32x4) -> U32x4 {
    // SAFETY: forwarded from the copy routines' contracts.
    unsafe { if STREAMING { arch::load_v4_readonly_prefetch256(p) } else { arch::load_v4(p) } }
}

#[inline(always)]
unsafe fn store<const STREAMING: bool>(p: *mut U32x4, v: U32x4) {
    // SAFETY: forwarded from the copy routines' contracts.
    unsafe { if STREAMING { arch::store_v4_streaming(p, v) } else { arch::store_v4(p, v) } }
}

/// Splits `[0, bytes)` into an unaligned head, 16-byte vectors and a tail, given that
/// `dst` and `src` are equally aligned: returns `(head, vectors)`.
#[inline(always)]
fn vector_split(dst: *mut u8, bytes: usize) -> (usize, usize) {
    let head = ((16 - (dst as usize & 15)) & 15).min(bytes);
    (head, (bytes - head) / 16)
}

/// Warp-contiguous copy (see [`copy_bytes`]) with `N` vectors per lane; with `STREAMING`,
/// loads take the read-only path with a 256-byte L2 prefetch and stores the evict-first hint.
///
/// # Safety
/// As [`copy_bytes`]; with `STREAMING`, nothing may write `src` during the kernel.
///
/// # Examples
///
/// ```
/// use ferrolink_device::arch::{self, U32x4};
/// use ferrolink_device::kernels::copy::copy_bytes_warp_contiguous;
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// unsafe fn copy4(args: (*mut u8, *const u8, usize)) {
///     let (dst, src, bytes) = args;
///     // SAFETY: the launch below passes two buffers of `bytes` bytes that do not overlap.
///     unsafe { copy_bytes_warp_contiguous::<4, false>(dst, src, bytes, arch::thread_idx_x(), arch::block_dim_x()) }
/// }
/// // Equally aligned buffers and whole warps: the warp-contiguous vector path.
/// let src: Vec<U32x4> = (0..300u32).map(|i| U32x4([i, i + 1, i + 2, i + 3])).collect();
/// let mut dst = vec![U32x4::default(); src.len()];
/// # let spec = LaunchSpec { name: "copy4",
/// #     grid: [1, 1, 1], block: [64, 1, 1], shared_mem_bytes: 0, timeout: Duration::from_secs(10) };
/// let args = (dst.as_mut_ptr().cast::<u8>(), src.as_ptr().cast::<u8>(), 16 * src.len());
/// // SAFETY: both buffers hold `16 * src.len()` bytes and outlive the launch.
/// unsafe { emulator::launch(&spec, copy4, args) }.unwrap();
/// assert_eq!(dst, src);
/// ```
#[inline(always)]
pub unsafe fn copy_bytes_warp_contiguous<const N: usize, const STREAMING: bool>(
    dst: *mut u8,
    src: *const u8,
    bytes: usize,
    rank: usize,
    nthreads: usize,
) {
    if !nthreads.is_multiple_of(32) || (dst as usize & 15) != (src as usize & 15) {
        // SAFETY: forwarded contract.
        unsafe { copy_bytes_grid_stride::<N, STREAMING>(dst, src, bytes, rank, nthreads) };
        return;
    }
    let (head, vectors) = vector_split(dst, bytes);
    let region = 32 * N;
    let regions = vectors / region;
    let (lane, warp, warps) = (rank % 32, rank / 32, nthreads / 32);
    // SAFETY: the head, `regions` full regions of vectors, and the rest partition [0, bytes);
    // the vector part is 16-byte aligned in both buffers.
    unsafe {
        let vdst = dst.add(head) as *mut U32x4;
        let vsrc = src.add(head) as *const U32x4;
        let mut k = warp;
        while k < regions {
            let base = k * region + lane;
            let mut v = [U32x4::default(); N];
            for (u, slot) in v.iter_mut().enumerate() {
                *slot = load::<STREAMING>(vsrc.add(base + 32 * u));
            }
            for (u, value) in v.iter().enumerate() {
                store::<STREAMING>(vdst.add(base + 32 * u), *value);
            }
            k += warps;
        }
        // The last partial region: one warp (the next in turn), its loads all issued before
        // its stores as above, so a row that is not a whole number of regions (a 14 KiB MoE
        // row is 3.5) costs one more round trip to memory rather than one per 32 vectors.
        let rest = regions * region;
        if rest < vectors && warp == regions % warps {
            let base = rest + lane;
            let mut v = [U32x4::default(); N];
            for (u, slot) in v.iter_mut().enumerate() {
                if base + 32 * u < vectors {
                    *slot = load::<STREAMING>(vsrc.add(base + 32 * u));
                }
            }
            for (u, value) in v.iter().enumerate() {
                if base + 32 * u < vectors {
                    store::<STREAMING>(vdst.add(base + 32 * u), *value);
                }
            }
        }
        copy_small(dst, src, head, rank, nthreads);
        let tail = head + vectors * 16;
        copy_small(dst.add(tail), src.add(tail), bytes - tail, rank, nthreads);
    }
}

/// Grid-stride copy: thread `rank` moves vectors `rank, rank + nthreads, …`, `N` at a time.
///
/// # Safety
/// As [`copy_bytes_warp_contiguous`].
///
/// # Examples
///
/// ```
/// use ferrolink_device::arch;
/// use ferrolink_device::kernels::copy::copy_bytes_grid_stride;
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// unsafe fn copy_grid(args: (*mut u8, *const u8, usize)) {
///     let (dst, src, bytes) = args;
///     // SAFETY: the launch below passes two buffers of `bytes` bytes that do not overlap.
///     let (rank, nthreads) = (arch::global_thread_idx_x(), arch::grid_threads_x());
///     // SAFETY: the launch below passes two buffers of `bytes` bytes that do not overlap.
///     unsafe { copy_bytes_grid_stride::<4, false>(dst, src, bytes, rank, nthreads) }
/// }
/// let src: Vec<u8> = (0..3001u32).map(|i| (i * 7) as u8).collect();
/// let mut dst = vec![0u8; src.len()];
/// # let spec = LaunchSpec { name: "copy_grid",
/// #     grid: [2, 1, 1], block: [32, 1, 1], shared_mem_bytes: 0, timeout: Duration::from_secs(10) };
/// // SAFETY: both buffers hold `src.len()` bytes and outlive the launch.
/// unsafe { emulator::launch(&spec, copy_grid, (dst.as_mut_ptr(), src.as_ptr(), src.len())) }.unwrap();
/// assert_eq!(dst, src);
/// ```
#[inline(always)]
pub unsafe fn copy_bytes_grid_stride<const N: usize, const STREAMING: bool>(
    dst: *mut u8,
    src: *const u8,
    bytes: usize,
    rank: usize,
    nthreads: usize,
) {
    if (dst as usize & 15) != (src as usize & 15) {
        // SAFETY: forwarded contract.
        unsafe { copy_small(dst, src, bytes, rank, nthreads) };
        return;
    }
    let (head, vectors) = vector_split(dst, bytes);
    let tail_start = head + vectors * 16;
    // SAFETY: head, vector body and tail partition [0, bytes); the body is 16-byte aligned.
    unsafe {
        copy_small(dst, src, head, rank, nthreads);
        let vdst = dst.add(head) as *mut U32x4;
        let vsrc = src.add(head) as *const U32x4;
        let mut i = rank;
        while i + (N - 1) * nthreads < vectors {
            let mut v = [U32x4::default(); N];
            for (u, slot) in v.iter_mut().enumerate() {
                *slot = load::<STREAMING>(vsrc.add(i + u * nthreads));
            }
            for (u, value) in v.iter().enumerate() {
                store::<STREAMING>(vdst.add(i + u * nthreads), *value);
            }
            i += N * nthreads;
        }
        while i < vectors {
            store::<STREAMING>(vdst.add(i), load::<STREAMING>(vsrc.add(i)));
            i += nthreads;
        }
        copy_small(dst.add(tail_start), src.add(tail_start), bytes - tail_start, rank, nthreads);
    }
}

/// Cooperative copy of small pieces (heads, tails) and of ranges whose 16-byte alignments
/// differ: in 8-byte words where `dst` and `src` are equally aligned to 8, else in 4-byte
/// words where they are to 4, else bytewise. (Words matter most for peers' memory: an 8-byte
/// put copied bytewise was eight NVLink writes, and a release after it waits for every one.)
///
/// # Safety
/// As [`copy_bytes`].
#[inline(always)]
unsafe fn copy_small(dst: *mut u8, src: *const u8, bytes: usize, rank: usize, nthreads: usize) {
    let apart = (dst as usize) ^ (src as usize);
    // SAFETY: forwarded contract.
    unsafe {
        if apart & 7 == 0 {
            copy_in_words::<u64>(dst, src, bytes, rank, nthreads);
        } else if apart & 3 == 0 {
            copy_in_words::<u32>(dst, src, bytes, rank, nthreads);
        } else {
            copy_bytes_one_by_one(dst, src, bytes, rank, nthreads);
        }
    }
}

/// [`copy_small`] with words of `W`: bytes up to `dst`'s first `W`-aligned address, the
/// words, then the bytes after the last whole word. `dst` and `src` are equally aligned to
/// `size_of::<W>()`.
///
/// # Safety
/// As [`copy_bytes`].
#[inline(always)]
unsafe fn copy_in_words<W: Copy>(dst: *mut u8, src: *const u8, bytes: usize, rank: usize, nthreads: usize) {
    let size = core::mem::size_of::<W>();
    let head = ((size - (dst as usize % size)) % size).min(bytes);
    let words = (bytes - head) / size;
    let tail = head + words * size;
    // SAFETY: the head, the words and the tail partition [0, bytes); the words are aligned
    // to `size` in both buffers (equal alignment).
    unsafe {
        copy_bytes_one_by_one(dst, src, head, rank, nthreads);
        let (wdst, wsrc) = (dst.add(head) as *mut W, src.add(head) as *const W);
        let mut i = rank;
        while i < words {
            wdst.add(i).write(wsrc.add(i).read());
            i += nthreads;
        }
        copy_bytes_one_by_one(dst.add(tail), src.add(tail), bytes - tail, rank, nthreads);
    }
}

/// Bytewise cooperative copy.
///
/// # Safety
/// As [`copy_bytes`].
#[inline(always)]
unsafe fn copy_bytes_one_by_one(dst: *mut u8, src: *const u8, bytes: usize, rank: usize, nthreads: usize) {
    let mut i = rank;
    while i < bytes {
        // SAFETY: i < bytes; the caller guarantees both ranges.
        unsafe { dst.add(i).write(src.add(i).read()) };
        i += nthreads;
    }
}

kernel! {
    /// Copies `bytes` bytes from `src` to `dst` with every thread of a 1-D grid
    /// (see [`copy_bytes`]). Any shape works; fastest on the H200 with 256-thread CTAs and
    /// enough of them to cover the data in about one pass (`ferrolink::ops::copy_launch_config`).
    ///
    /// # Safety
    /// As [`copy_bytes`].
    ///
    /// # Examples
    ///
    /// ```
    /// use ferrolink_device::emulator::{self, LaunchSpec};
    /// use ferrolink_device::kernels::copy::ferrolink_copy;
    /// # use std::time::Duration;
    /// let src: Vec<u8> = (0..5000u32).map(|i| (i * 7) as u8).collect();
    /// let mut dst = vec![0u8; src.len()];
    /// # let spec = LaunchSpec { name: ferrolink_copy.name(),
    /// #     grid: [2, 1, 1], block: [64, 1, 1], shared_mem_bytes: 0, timeout: Duration::from_secs(10) };
    /// let args = (dst.as_mut_ptr(), src.as_ptr(), src.len());
    /// // SAFETY: both buffers hold `src.len()` bytes, do not overlap, and outlive the launch.
    /// unsafe { emulator::launch(&spec, ferrolink_copy.host_entry(), args) }.unwrap();
    /// assert_eq!(dst, src);
    /// ```
    pub unsafe fn ferrolink_copy(dst: *mut u8, src: *const u8, bytes: usize) {
        // SAFETY: the launcher guarantees the buffers (kernel contract).
        unsafe { copy_bytes(dst, src, bytes, arch::global_thread_idx_x(), arch::grid_threads_x()) }
    }
}

pub mod variants {
    //! Copy kernels the perf tool measures beside [`ferrolink_copy`].
    //! Each has the same arguments and contract as it.
    use super::*;

    macro_rules! variant {
        ($(#[$m:meta])* $name:ident, $routine:ident, $n:expr, $streaming:expr) => {
            kernel! {
                $(#[$m])*
                /// # Safety
                /// As [`copy_bytes`].
                pub unsafe fn $name(dst: *mut u8, src: *const u8, bytes: usize) {
                    // SAFETY: the launcher guarantees the buffers (kernel contract).
                    unsafe {
                        $routine::<{ $n }, { $streaming }>(
                            dst, src, bytes, arch::global_thread_idx_x(), arch::grid_threads_x(),
                        )
                    }
                }
            }
        };
    }

    variant!(
        /// Grid-stride, 4 vectors in flight per thread (the first design; 0.93x at best).
        ///
        /// ```
        /// use ferrolink_device::emulator::{self, LaunchSpec};
        /// use ferrolink_device::kernels::copy::variants::copy_variant_grid_stride4;
        /// # use std::time::Duration;
        /// let src: Vec<u8> = (0..5000u32).map(|i| (i * 7) as u8).collect();
        /// let mut dst = vec![0u8; src.len()];
        /// # let spec = LaunchSpec { name: copy_variant_grid_stride4.name(),
        /// #     grid: [2, 1, 1], block: [64, 1, 1], shared_mem_bytes: 0, timeout: Duration::from_secs(10) };
        /// let args = (dst.as_mut_ptr(), src.as_ptr(), src.len());
        /// // SAFETY: both buffers hold `src.len()` bytes, do not overlap, and outlive the launch.
        /// unsafe { emulator::launch(&spec, copy_variant_grid_stride4.host_entry(), args) }.unwrap();
        /// assert_eq!(dst, src);
        /// ```
        copy_variant_grid_stride4, copy_bytes_grid_stride, 4, false
    );
    variant!(
        /// Grid-stride, 8 vectors in flight, read-only prefetching loads, evict-first stores.
        ///
        /// ```
        /// use ferrolink_device::emulator::{self, LaunchSpec};
        /// use ferrolink_device::kernels::copy::variants::copy_variant_grid_stride8_streaming;
        /// # use std::time::Duration;
        /// let src: Vec<u8> = (0..5000u32).map(|i| (i * 7) as u8).collect();
        /// let mut dst = vec![0u8; src.len()];
        /// # let spec = LaunchSpec { name: copy_variant_grid_stride8_streaming.name(),
        /// #     grid: [2, 1, 1], block: [64, 1, 1], shared_mem_bytes: 0, timeout: Duration::from_secs(10) };
        /// let args = (dst.as_mut_ptr(), src.as_ptr(), src.len());
        /// // SAFETY: both buffers hold `src.len()` bytes, do not overlap, and outlive the launch.
        /// unsafe { emulator::launch(&spec, copy_variant_grid_stride8_streaming.host_entry(), args) }.unwrap();
        /// assert_eq!(dst, src);
        /// ```
        copy_variant_grid_stride8_streaming, copy_bytes_grid_stride, 8, true
    );
    variant!(
        /// Warp-contiguous, 4 vectors per lane.
        ///
        /// ```
        /// use ferrolink_device::emulator::{self, LaunchSpec};
        /// use ferrolink_device::kernels::copy::variants::copy_variant_warp_contiguous4;
        /// # use std::time::Duration;
        /// let src: Vec<u8> = (0..5000u32).map(|i| (i * 7) as u8).collect();
        /// let mut dst = vec![0u8; src.len()];
        /// # let spec = LaunchSpec { name: copy_variant_warp_contiguous4.name(),
        /// #     grid: [2, 1, 1], block: [64, 1, 1], shared_mem_bytes: 0, timeout: Duration::from_secs(10) };
        /// let args = (dst.as_mut_ptr(), src.as_ptr(), src.len());
        /// // SAFETY: both buffers hold `src.len()` bytes, do not overlap, and outlive the launch.
        /// unsafe { emulator::launch(&spec, copy_variant_warp_contiguous4.host_entry(), args) }.unwrap();
        /// assert_eq!(dst, src);
        /// ```
        copy_variant_warp_contiguous4, copy_bytes_warp_contiguous, 4, false
    );
    variant!(
        /// Warp-contiguous, 16 vectors per lane (80 registers: at most 768 threads per CTA).
        ///
        /// ```
        /// use ferrolink_device::emulator::{self, LaunchSpec};
        /// use ferrolink_device::kernels::copy::variants::copy_variant_warp_contiguous16;
        /// # use std::time::Duration;
        /// let src: Vec<u8> = (0..5000u32).map(|i| (i * 7) as u8).collect();
        /// let mut dst = vec![0u8; src.len()];
        /// # let spec = LaunchSpec { name: copy_variant_warp_contiguous16.name(),
        /// #     grid: [2, 1, 1], block: [64, 1, 1], shared_mem_bytes: 0, timeout: Duration::from_secs(10) };
        /// let args = (dst.as_mut_ptr(), src.as_ptr(), src.len());
        /// // SAFETY: both buffers hold `src.len()` bytes, do not overlap, and outlive the launch.
        /// unsafe { emulator::launch(&spec, copy_variant_warp_contiguous16.host_entry(), args) }.unwrap();
        /// assert_eq!(dst, src);
        /// ```
        copy_variant_warp_contiguous16, copy_bytes_warp_contiguous, 16, false
    );
    variant!(
        /// Warp-contiguous, 8 vectors per lane, read-only prefetching loads, evict-first stores.
        ///
        /// ```
        /// use ferrolink_device::emulator::{self, LaunchSpec};
        /// use ferrolink_device::kernels::copy::variants::copy_variant_warp_contiguous8_streaming;
        /// # use std::time::Duration;
        /// let src: Vec<u8> = (0..5000u32).map(|i| (i * 7) as u8).collect();
        /// let mut dst = vec![0u8; src.len()];
        /// # let spec = LaunchSpec { name: copy_variant_warp_contiguous8_streaming.name(),
        /// #     grid: [2, 1, 1], block: [64, 1, 1], shared_mem_bytes: 0, timeout: Duration::from_secs(10) };
        /// let args = (dst.as_mut_ptr(), src.as_ptr(), src.len());
        /// // SAFETY: both buffers hold `src.len()` bytes, do not overlap, and outlive the launch.
        /// unsafe { emulator::launch(&spec, copy_variant_warp_contiguous8_streaming.host_entry(), args) }.unwrap();
        /// assert_eq!(dst, src);
        /// ```
        copy_variant_warp_contiguous8_streaming, copy_bytes_warp_contiguous, 8, true
    );
}
