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
pub const VECTORS_PER_LANE: usize = 8;

/// Bytes one warp moves per iteration of [`copy_bytes`].
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
        copy_variant_grid_stride4, copy_bytes_grid_stride, 4, false
    );
    variant!(
        /// Grid-stride, 8 vectors in flight, read-only prefetching loads, evict-first stores.
        copy_variant_grid_stride8_streaming, copy_bytes_grid_stride, 8, true
    );
    variant!(
        /// Warp-contiguous, 4 vectors per lane.
        copy_variant_warp_contiguous4, copy_bytes_warp_contiguous, 4, false
    );
    variant!(
        /// Warp-contiguous, 16 vectors per lane (80 registers: at most 768 threads per CTA).
        copy_variant_warp_contiguous16, copy_bytes_warp_contiguous, 16, false
    );
    variant!(
        /// Warp-contiguous, 8 vectors per lane, read-only prefetching loads, evict-first stores.
        copy_variant_warp_contiguous8_streaming, copy_bytes_warp_contiguous, 8, true
    );
}
