//! Copy and reduce helpers over LSA pointers: read one or several sources (local or peers'
//! window slots), write one or several destinations, 16 bytes at a time, split over a coop.
//!
//! Memory order: plain loads and stores. Order them with an LSA barrier (or release/acquire
//! signals) around the call: peers' sources must be complete before (barrier before), and
//! peers must not reuse destinations or sources until all readers are done (barrier after).

use crate::arch::{self, U32x4};
use crate::coop::Coop;
use crate::kernels::copy::copy_bytes;

/// Copies `bytes` bytes from `src` to `dst` with all threads of `coop` (see
/// [`crate::kernels::copy::copy_bytes`]). `part`/`parts` split the range further among
/// several coops (e.g. CTAs of a grid): this coop copies part `part` of `parts`.
///
/// # Safety
/// As `copy_bytes` for the whole range; every thread of the coop calls with the same arguments.
#[inline(always)]
pub unsafe fn copy<C: Coop>(coop: C, dst: *mut u8, src: *const u8, bytes: usize, part: usize, parts: usize) {
    let (start, len) = split_16(bytes, part, parts);
    // SAFETY: [start, start + len) lies within the caller's range.
    unsafe { copy_bytes(dst.add(start), src.add(start), len, coop.thread_rank(), coop.size()) }
}

/// The `part`-th of `parts` pieces of `[0, bytes)`, cut at multiples of 16 bytes.
#[inline(always)]
pub fn split_16(bytes: usize, part: usize, parts: usize) -> (usize, usize) {
    let chunk = bytes.div_ceil(parts.max(1)).next_multiple_of(16);
    let start = (part * chunk).min(bytes);
    (start, chunk.min(bytes - start))
}

/// An element type the reduce helpers sum, four 32-bit or two 64-bit lanes per 16 bytes.
pub trait ReduceElem: Copy + Default {
    /// `a + b` lane-wise on 16 bytes.
    fn add_v4(a: U32x4, b: U32x4) -> U32x4;
    /// `a + b`.
    fn add(a: Self, b: Self) -> Self;
}

impl ReduceElem for f32 {
    #[inline(always)]
    fn add_v4(a: U32x4, b: U32x4) -> U32x4 {
        let mut r = [0u32; 4];
        for (i, slot) in r.iter_mut().enumerate() {
            *slot = (f32::from_bits(a.0[i]) + f32::from_bits(b.0[i])).to_bits();
        }
        U32x4(r)
    }
    #[inline(always)]
    fn add(a: Self, b: Self) -> Self {
        a + b
    }
}

impl ReduceElem for u32 {
    #[inline(always)]
    fn add_v4(a: U32x4, b: U32x4) -> U32x4 {
        U32x4([
            a.0[0].wrapping_add(b.0[0]),
            a.0[1].wrapping_add(b.0[1]),
            a.0[2].wrapping_add(b.0[2]),
            a.0[3].wrapping_add(b.0[3]),
        ])
    }
    #[inline(always)]
    fn add(a: Self, b: Self) -> Self {
        a.wrapping_add(b)
    }
}

impl ReduceElem for f64 {
    #[inline(always)]
    fn add_v4(a: U32x4, b: U32x4) -> U32x4 {
        let f = |v: U32x4, i: usize| f64::from_bits(u64::from(v.0[2 * i]) | (u64::from(v.0[2 * i + 1]) << 32));
        let lo = (f(a, 0) + f(b, 0)).to_bits();
        let hi = (f(a, 1) + f(b, 1)).to_bits();
        U32x4([lo as u32, (lo >> 32) as u32, hi as u32, (hi >> 32) as u32])
    }
    #[inline(always)]
    fn add(a: Self, b: Self) -> Self {
        a + b
    }
}

/// Element-wise sum of `srcs` (e.g. every LSA peer's slot of a window) into every pointer of
/// `dsts`, over `count` elements, split among the threads of `coop` and, by `part`/`parts`,
/// among several coops. Sums in the order of `srcs`, so every destination (and every rank
/// calling with the same `srcs` order) gets bitwise the same result.
///
/// # Safety
/// Every source is valid for reads and every destination for writes of `count` elements;
/// destinations overlap no source; all pointers are aligned to `T`; nothing else writes them
/// during the call; every thread of the coop calls with the same arguments.
#[inline(always)]
pub unsafe fn reduce_sum<T: ReduceElem, C: Coop>(
    coop: C,
    dsts: &[*mut T],
    srcs: &[*const T],
    count: usize,
    part: usize,
    parts: usize,
) {
    // SAFETY: forwarded contract.
    unsafe { reduce_sum_with(coop, dsts, srcs.len(), |s| srcs[s], count, part, parts) }
}

/// [`reduce_sum`] over the `lsa_size` slots of a window at byte `offset` (peer order 0, 1, …),
/// computing each peer's address instead of reading it from a table.
///
/// # Safety
/// As [`reduce_sum`], for every peer's slot of `window` at `offset`.
#[inline(always)]
pub unsafe fn reduce_sum_window<T: ReduceElem, C: Coop>(
    coop: C,
    dsts: &[*mut T],
    window: &crate::window::DevWindow,
    offset: usize,
    count: usize,
    part: usize,
    parts: usize,
) {
    // SAFETY: forwarded contract.
    unsafe {
        reduce_sum_with(coop, dsts, window.lsa_size as usize, |s| window.lsa_ptr(offset, s as u32), count, part, parts)
    }
}

/// The engine of the reduce helpers: sources given by `src(i)` for `i < nsrcs` (at least 1).
///
/// # Safety
/// As [`reduce_sum`].
#[inline(always)]
pub unsafe fn reduce_sum_with<T: ReduceElem, C: Coop>(
    coop: C,
    dsts: &[*mut T],
    nsrcs: usize,
    src: impl Fn(usize) -> *const T,
    count: usize,
    part: usize,
    parts: usize,
) {
    let size = core::mem::size_of::<T>();
    let (start_b, len_b) = split_16(count * size, part, parts);
    let (start, n) = (start_b / size, len_b / size);
    let aligned = (0..nsrcs).all(|s| (src(s) as usize + start_b) & 15 == 0)
        && dsts.iter().all(|p| (*p as usize + start_b) & 15 == 0);
    let (rank, nthreads) = (coop.thread_rank(), coop.size());
    let per_vec = 16 / size;
    let vectors = if aligned { n / per_vec } else { 0 };
    // SAFETY: every access is at an element index in [start, start + n) of the caller's
    // ranges; the vector path runs only when all pointers are 16-byte aligned there.
    unsafe {
        let mut v = rank;
        while v < vectors {
            let off = start + v * per_vec;
            let mut acc = arch::load_v4(src(0).add(off) as *const U32x4);
            for s in 1..nsrcs {
                acc = T::add_v4(acc, arch::load_v4(src(s).add(off) as *const U32x4));
            }
            for d in dsts {
                arch::store_v4(d.add(off) as *mut U32x4, acc);
            }
            v += nthreads;
        }
        let mut i = vectors * per_vec + rank;
        while i < n {
            let off = start + i;
            let mut acc = src(0).add(off).read();
            for s in 1..nsrcs {
                acc = T::add(acc, src(s).add(off).read());
            }
            for d in dsts {
                d.add(off).write(acc);
            }
            i += nthreads;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_cover_the_range_in_16_byte_pieces() {
        for bytes in [0usize, 1, 15, 16, 17, 1000, 4096, 100_003] {
            for parts in [1usize, 2, 3, 7, 64] {
                let mut next = 0;
                for part in 0..parts {
                    let (start, len) = split_16(bytes, part, parts);
                    assert_eq!(start, next.min(bytes), "bytes {bytes} parts {parts} part {part}");
                    assert!(start % 16 == 0 || len == 0);
                    next = start + len;
                }
                assert_eq!(next, bytes);
            }
        }
    }

    #[test]
    fn vector_adds_match_scalar_adds() {
        let a = U32x4([1.5f32.to_bits(), 2.0f32.to_bits(), (-1.0f32).to_bits(), 0]);
        let b = U32x4([0.25f32.to_bits(), 3.0f32.to_bits(), 1.0f32.to_bits(), 7.0f32.to_bits()]);
        let r = f32::add_v4(a, b);
        assert_eq!(r.0.map(f32::from_bits), [1.75, 5.0, 0.0, 7.0]);
        assert_eq!(u32::add_v4(U32x4([u32::MAX, 1, 2, 3]), U32x4([1, 1, 1, 1])).0, [0, 2, 3, 4]);
        let d = |x: f64| [x.to_bits() as u32, (x.to_bits() >> 32) as u32];
        let [a0, a1] = d(1.25);
        let [b0, b1] = d(-3.0);
        let [c0, c1] = d(2.0);
        let r = f64::add_v4(U32x4([a0, a1, b0, b1]), U32x4([c0, c1, c0, c1]));
        assert_eq!(f64::from_bits(u64::from(r.0[0]) | (u64::from(r.0[1]) << 32)), 3.25);
        assert_eq!(f64::from_bits(u64::from(r.0[2]) | (u64::from(r.0[3]) << 32)), -1.0);
    }
}
