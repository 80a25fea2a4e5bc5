//! Vectorized copy.
//!
//! [`copy_bytes`] is the cooperative routine (any number of threads split the work); the
//! [`ferrolink_copy`] kernel runs it over the whole grid. [`variants`] holds the alternatives
//! the perf tool measures beside it (`ferrolink-perf copy --sweep`), so the choice of
//! unrolling, cache hints and work split stays measured rather than remembered.

use crate::arch::{self, U32x4};
use crate::kernel;

/// 16-byte vectors each thread moves per loop iteration in [`copy_bytes`]: loads are issued
/// before stores, so each thread has this many independent 16-byte loads in flight.
pub const UNROLL: usize = 4;

/// Copies `bytes` bytes from `src` to `dst`, shared among `nthreads` cooperating threads of
/// which the caller is `rank`. Each thread must call it with the same arguments.
///
/// When `src` and `dst` have the same address modulo 16, the bulk moves as 16-byte vectors
/// (`ld.global.v4.u32` / `st.global.v4.u32`) with [`UNROLL`] vectors in flight per thread,
/// and the unaligned head and tail bytewise; otherwise the whole copy is bytewise.
///
/// Memory order: plain (weak) loads and stores; the caller orders them with a barrier,
/// fence or release as its protocol requires.
///
/// # Safety
/// `src` must be valid for reads and `dst` for writes of `bytes` bytes in global memory;
/// the ranges must not overlap, and nothing else may write them during the copy.
#[inline(always)]
pub unsafe fn copy_bytes(dst: *mut u8, src: *const u8, bytes: usize, rank: usize, nthreads: usize) {
    // SAFETY: forwarded contract.
    unsafe { copy_bytes_tuned::<UNROLL, false>(dst, src, bytes, rank, nthreads) }
}

/// [`copy_bytes`] with the unroll depth and cache hints as parameters: with `STREAMING`,
/// loads go through the read-only path without L1 allocation and with a 256-byte L2
/// prefetch, and stores carry the evict-first hint.
///
/// # Safety
/// As [`copy_bytes`]; with `STREAMING`, nothing may write `src` during the kernel.
#[inline(always)]
pub unsafe fn copy_bytes_tuned<const N: usize, const STREAMING: bool>(
    dst: *mut u8,
    src: *const u8,
    bytes: usize,
    rank: usize,
    nthreads: usize,
) {
    let misalign = dst as usize & 15;
    if misalign != src as usize & 15 {
        // SAFETY: forwarded contract.
        unsafe { copy_bytewise(dst, src, bytes, rank, nthreads) };
        return;
    }
    let head = ((16 - misalign) & 15).min(bytes);
    let vectors = (bytes - head) / 16;
    let tail_start = head + vectors * 16;
    // SAFETY: head, vector body and tail partition [0, bytes); the body is 16-byte aligned
    // because `dst + head` and `src + head` are.
    unsafe {
        copy_bytewise(dst, src, head, rank, nthreads);
        let vdst = dst.add(head) as *mut U32x4;
        let vsrc = src.add(head) as *const U32x4;
        let load = |p| if STREAMING { arch::load_v4_readonly_prefetch256(p) } else { arch::load_v4(p) };
        let store = |p, v| if STREAMING { arch::store_v4_streaming(p, v) } else { arch::store_v4(p, v) };
        let mut i = rank;
        while i + (N - 1) * nthreads < vectors {
            let mut v = [U32x4::default(); N];
            for (u, slot) in v.iter_mut().enumerate() {
                *slot = load(vsrc.add(i + u * nthreads));
            }
            for (u, value) in v.iter().enumerate() {
                store(vdst.add(i + u * nthreads), *value);
            }
            i += N * nthreads;
        }
        while i < vectors {
            store(vdst.add(i), load(vsrc.add(i)));
            i += nthreads;
        }
        copy_bytewise(dst.add(tail_start), src.add(tail_start), bytes - tail_start, rank, nthreads);
    }
}

/// Bytewise cooperative copy (for heads, tails and mismatched alignments).
///
/// # Safety
/// As [`copy_bytes`].
#[inline(always)]
unsafe fn copy_bytewise(dst: *mut u8, src: *const u8, bytes: usize, rank: usize, nthreads: usize) {
    let mut i = rank;
    while i < bytes {
        // SAFETY: i < bytes; the caller guarantees both ranges.
        unsafe { dst.add(i).write(src.add(i).read()) };
        i += nthreads;
    }
}

kernel! {
    /// Copies `bytes` bytes from `src` to `dst` with every thread of a 1-D grid
    /// (see [`copy_bytes`]). Any grid and block size works; about four 512-thread CTAs per
    /// SM saturate HBM.
    ///
    /// # Safety
    /// As [`copy_bytes`].
    pub unsafe fn ferrolink_copy(dst: *mut u8, src: *const u8, bytes: usize) {
        // SAFETY: the launcher guarantees the buffers (kernel contract).
        unsafe { copy_bytes(dst, src, bytes, arch::global_thread_idx_x(), arch::grid_threads_x()) }
    }
}

pub mod variants {
    //! Copy kernels the perf tool measures beside [`ferrolink_copy`](super::ferrolink_copy).
    //! Each has the same arguments and contract as it.
    use super::*;

    macro_rules! grid_variant {
        ($(#[$m:meta])* $name:ident, $n:expr, $streaming:expr) => {
            kernel! {
                $(#[$m])*
                /// # Safety
                /// As [`copy_bytes`].
                pub unsafe fn $name(dst: *mut u8, src: *const u8, bytes: usize) {
                    // SAFETY: the launcher guarantees the buffers (kernel contract).
                    unsafe {
                        copy_bytes_tuned::<{ $n }, { $streaming }>(
                            dst, src, bytes, arch::global_thread_idx_x(), arch::grid_threads_x(),
                        )
                    }
                }
            }
        };
    }

    grid_variant!(
        /// Grid-stride, 8 vectors in flight per thread.
        copy_variant_unroll8, 8, false
    );
    grid_variant!(
        /// Grid-stride, 4 vectors in flight, read-only loads and evict-first stores.
        copy_variant_unroll4_streaming, 4, true
    );
    grid_variant!(
        /// Grid-stride, 8 vectors in flight, read-only loads and evict-first stores.
        copy_variant_unroll8_streaming, 8, true
    );

    /// Warp-contiguous split: each warp moves `32 * N` consecutive vectors per iteration
    /// (instruction `u` loads vectors `base + 32u + lane`), so a warp's accesses stay within
    /// one `N * 512`-byte span of DRAM. `STREAMING` as in [`copy_bytes_tuned`]. Falls back to [`copy_bytes`] when `nthreads` is not a
    /// multiple of 32 or the alignments differ.
    ///
    /// # Safety
    /// As [`copy_bytes`].
    #[inline(always)]
    pub unsafe fn copy_bytes_warp_contiguous<const N: usize, const STREAMING: bool>(
        dst: *mut u8,
        src: *const u8,
        bytes: usize,
        rank: usize,
        nthreads: usize,
    ) {
        let misalign = dst as usize & 15;
        if nthreads % 32 != 0 || misalign != src as usize & 15 || bytes < 16 {
            // SAFETY: forwarded contract.
            unsafe { copy_bytes(dst, src, bytes, rank, nthreads) };
            return;
        }
        let head = (16 - misalign) & 15;
        let vectors = (bytes - head) / 16;
        let region = 32 * N;
        let regions = vectors / region;
        let (lane, warp, warps) = (rank % 32, rank / 32, nthreads / 32);
        // SAFETY: the head, `regions` full regions, the vector remainder and the byte tail
        // partition [0, bytes), with the vector part 16-byte aligned.
        unsafe {
            let vdst = dst.add(head) as *mut U32x4;
            let vsrc = src.add(head) as *const U32x4;
            let mut k = warp;
            while k < regions {
                let base = k * region + lane;
                let mut v = [U32x4::default(); N];
                for (u, slot) in v.iter_mut().enumerate() {
                    let p = vsrc.add(base + 32 * u);
                    *slot = if STREAMING { arch::load_v4_readonly_prefetch256(p) } else { arch::load_v4(p) };
                }
                for (u, value) in v.iter().enumerate() {
                    let p = vdst.add(base + 32 * u);
                    if STREAMING { arch::store_v4_streaming(p, *value) } else { arch::store_v4(p, *value) }
                }
                k += warps;
            }
            // The rest (head, partial region, tail) with the plain routine.
            copy_bytes(dst, src, head, rank, nthreads);
            let done = head + regions * region * 16;
            copy_bytes(dst.add(done), src.add(done), bytes - done, rank, nthreads);
        }
    }

    macro_rules! warp_contiguous_variant {
        ($(#[$m:meta])* $name:ident, $n:expr, $streaming:expr) => {
            kernel! {
                $(#[$m])*
                /// # Safety
                /// As [`copy_bytes`].
                pub unsafe fn $name(dst: *mut u8, src: *const u8, bytes: usize) {
                    // SAFETY: the launcher guarantees the buffers (kernel contract).
                    unsafe {
                        copy_bytes_warp_contiguous::<{ $n }, { $streaming }>(
                            dst, src, bytes, arch::global_thread_idx_x(), arch::grid_threads_x(),
                        )
                    }
                }
            }
        };
    }

    warp_contiguous_variant!(
        /// Warp-contiguous split ([`copy_bytes_warp_contiguous`]), 4 vectors per lane.
        copy_variant_warp_contiguous4, 4, false
    );
    warp_contiguous_variant!(
        /// Warp-contiguous split ([`copy_bytes_warp_contiguous`]), 8 vectors per lane.
        copy_variant_warp_contiguous8, 8, false
    );
    warp_contiguous_variant!(
        /// Warp-contiguous split, 8 vectors per lane, read-only prefetching loads and
        /// evict-first stores.
        copy_variant_warp_contiguous8_streaming, 8, true
    );
    warp_contiguous_variant!(
        /// Warp-contiguous split, 16 vectors per lane.
        copy_variant_warp_contiguous16, 16, false
    );
    warp_contiguous_variant!(
        /// Warp-contiguous split, 16 vectors per lane, read-only prefetching loads and
        /// evict-first stores.
        copy_variant_warp_contiguous16_streaming, 16, true
    );

    kernel! {
        /// Each CTA copies one contiguous chunk (a multiple of 16 bytes), its threads
        /// striding within it, 4 vectors in flight.
        ///
        /// # Safety
        /// As [`copy_bytes`].
        pub unsafe fn copy_variant_cta_chunks(dst: *mut u8, src: *const u8, bytes: usize) {
            let ctas = arch::grid_dim_x();
            let chunk = bytes.div_ceil(ctas).next_multiple_of(16);
            let start = (arch::block_idx_x() * chunk).min(bytes);
            let len = chunk.min(bytes - start);
            // SAFETY: [start, start + len) lies within both buffers (kernel contract).
            unsafe { copy_bytes(dst.add(start), src.add(start), len, arch::thread_idx_x(), arch::block_dim_x()) }
        }
    }
}
