//! Copy and reduce helpers over LSA pointers: read one or several sources (local or peers'
//! window slots), write one or several destinations, 16 bytes at a time, split over a coop.
//!
//! Memory order: plain loads and stores. Order them with an LSA barrier (or release/acquire
//! signals) around the call: peers' sources must be complete before (barrier before), and
//! peers must not reuse destinations or sources until all readers are done (barrier after).

use crate::coll::{CollElem, SumOp};
use crate::coop::Coop;
use crate::kernels::copy::copy_bytes;

/// Copies `bytes` bytes from `src` to `dst` with all threads of `coop` (see
/// [`crate::kernels::copy::copy_bytes`]). `part`/`parts` split the range further among
/// several coops (e.g. CTAs of a grid): this coop copies part `part` of `parts`.
///
/// # Safety
/// As `copy_bytes` for the whole range; every thread of the coop calls with the same arguments.
///
/// # Examples
///
/// ```
/// use ferrolink_device::{arch, lsa, CoopCta};
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # let spec = |name, grid| LaunchSpec { name, grid: [grid, 1, 1], block: [32, 1, 1], shared_mem_bytes: 0,
/// #     timeout: std::time::Duration::from_secs(30) };
/// /// Each CTA copies its part of `bytes` bytes.
/// unsafe fn grid_copy(args: (*mut u8, *const u8, usize)) {
///     let (dst, src, bytes) = args;
///     // SAFETY: both hold `bytes` bytes (the launch below); parts do not overlap.
///     unsafe { lsa::copy(CoopCta, dst, src, bytes, arch::block_idx_x(), arch::grid_dim_x()) };
/// }
/// let src: Vec<u8> = (0..1000).map(|i| i as u8).collect();
/// let mut dst = vec![0u8; 1000];
/// // SAFETY: `src` and `dst` hold 1000 bytes each and outlive the launch.
/// unsafe { emulator::launch(&spec("grid_copy", 3), grid_copy, (dst.as_mut_ptr(), src.as_ptr(), 1000)) }.unwrap();
/// assert_eq!(dst, src);
/// ```
#[inline(always)]
pub unsafe fn copy<C: Coop>(coop: C, dst: *mut u8, src: *const u8, bytes: usize, part: usize, parts: usize) {
    let (start, len) = split_16(bytes, part, parts);
    // SAFETY: [start, start + len) lies within the caller's range.
    unsafe { copy_bytes(dst.add(start), src.add(start), len, coop.thread_rank(), coop.size()) }
}

/// The `part`-th of `parts` pieces of `[0, bytes)`, cut at multiples of 16 bytes.
///
/// ```
/// use ferrolink_device::lsa::split_16;
/// // 1000 bytes in 4 pieces of 256 bytes (cut at multiples of 16); the last is short.
/// assert_eq!(split_16(1000, 0, 4), (0, 256));
/// assert_eq!(split_16(1000, 3, 4), (768, 232));
/// assert_eq!(split_16(100, 3, 4), (96, 4));
/// ```
#[inline(always)]
pub fn split_16(bytes: usize, part: usize, parts: usize) -> (usize, usize) {
    let chunk = bytes.div_ceil(parts.max(1)).next_multiple_of(16);
    let start = (part * chunk).min(bytes);
    (start, chunk.min(bytes - start))
}

/// An element type the reduce helpers sum: any element type of the collectives
/// ([`crate::coll::CollElem`]: `f32`, `f64`, `u32`, `f16`, `bf16`, `i32`, `i64`, `u8`).
///
/// ```
/// use ferrolink_device::lsa::{reduce_sum, ReduceElem};
/// use ferrolink_device::CoopThread;
///
/// /// `a + b` element-wise, by one thread.
/// fn add<T: ReduceElem>(a: &[T], b: &[T], out: &mut [T]) {
///     assert!(a.len() == out.len() && b.len() == out.len());
///     // SAFETY: three distinct slices of `out.len()` elements.
///     unsafe { reduce_sum(CoopThread, &[out.as_mut_ptr()], &[a.as_ptr(), b.as_ptr()], out.len(), 0, 1) };
/// }
/// let mut out = [0i64; 3];
/// add(&[1, 2, 3], &[10, 20, 30], &mut out);
/// assert_eq!(out, [11, 22, 33]);
/// ```
pub trait ReduceElem: CollElem {}

impl<T: CollElem> ReduceElem for T {}

/// Element-wise sum of `srcs` (e.g. every LSA peer's slot of a window) into every pointer of
/// `dsts`, over `count` elements, split among the threads of `coop` and, by `part`/`parts`,
/// among several coops. Sums in the order of `srcs`, so every destination (and every rank
/// calling with the same `srcs` order) gets bitwise the same result.
///
/// # Safety
/// Every source is valid for reads and every destination for writes of `count` elements;
/// destinations overlap no source; all pointers are aligned to `T`; nothing else writes them
/// during the call; every thread of the coop calls with the same arguments.
///
/// # Examples
///
/// ```
/// use ferrolink_device::{lsa, CoopCta};
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # let spec = |name, grid| LaunchSpec { name, grid: [grid, 1, 1], block: [32, 1, 1], shared_mem_bytes: 0,
/// #     timeout: std::time::Duration::from_secs(30) };
/// /// One CTA sums `a` and `b` into both `d0` and `d1` (reduce and broadcast in one pass).
/// unsafe fn sum2(args: (*mut f32, *mut f32, *const f32, *const f32, usize)) {
///     let (d0, d1, a, b, n) = args;
///     // SAFETY: four distinct arrays of `n` floats (the launch below).
///     unsafe { lsa::reduce_sum(CoopCta, &[d0, d1], &[a, b], n, 0, 1) };
/// }
/// let (a, b) = (vec![1.5f32; 100], vec![2.0f32; 100]);
/// let (mut d0, mut d1) = (vec![0f32; 100], vec![0f32; 100]);
/// let args = (d0.as_mut_ptr(), d1.as_mut_ptr(), a.as_ptr(), b.as_ptr(), 100);
/// // SAFETY: all four hold 100 floats and outlive the launch.
/// unsafe { emulator::launch(&spec("sum2", 1), sum2, args) }.unwrap();
/// assert!(d0.iter().chain(&d1).all(|&x| x == 3.5));
/// ```
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
///
/// # Examples
///
/// ```no_run
/// use ferrolink_device::{arch, kernel, lsa, CoopCta, DevComm, DevWindow, LsaBarrierSession};
/// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
/// kernel! {
///     /// One-shot all-reduce: every rank's input is `count` floats at offset 0 of its slot of
///     /// `win`; CTA `b` sums part `b` of every peer's input into `out`.
///     ///
///     /// # Safety
///     /// `comm`, `win` from live handles; `win.size >= count * 4`; `out` holds `count`
///     /// floats; `grid <= lsa_barrier_count`.
///     pub unsafe fn allreduce_sum(comm: DevComm, win: DevWindow, out: *mut f32, count: usize) {
///         let b = arch::block_idx_x();
///         // SAFETY: one barrier per CTA (kernel contract).
///         let mut bar = unsafe { LsaBarrierSession::new(CoopCta, &comm, b as u32) };
///         bar.sync(); // before: every peer's input is complete
///         // SAFETY: every peer's slot holds `count` floats at offset 0; `out` holds `count`.
///         unsafe { lsa::reduce_sum_window(CoopCta, &[out], &win, 0, count, b, arch::grid_dim_x()) };
///         bar.sync(); // after: no peer overwrites its input while others still read it
///     }
/// }
/// ```
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
/// The collectives' element-wise reduction ([`crate::coll::reduce`]) with a sum.
///
/// # Safety
/// As [`reduce_sum`].
///
/// # Examples
///
/// ```
/// use ferrolink_device::{lsa, CoopThread};
/// // Sum the 3 rows of a 3x4 matrix: source `s` is row `s`, computed, not tabled.
/// let m: [u32; 12] = [1, 2, 3, 4, 10, 20, 30, 40, 100, 200, 300, 400];
/// let mut out = [0u32; 4];
/// // SAFETY: each row holds 4 elements; `out` is distinct; one thread.
/// unsafe { lsa::reduce_sum_with(CoopThread, &[out.as_mut_ptr()], 3, |s| m[4 * s..].as_ptr(), 4, 0, 1) };
/// assert_eq!(out, [111, 222, 333, 444]);
/// ```
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
    // SAFETY: forwarded contract.
    unsafe {
        crate::coll::reduce::<T, SumOp, C>(
            coop,
            dsts.len(),
            |d| dsts[d],
            nsrcs,
            src,
            count,
            part,
            parts,
            |_, x| x,
            |x| x,
        )
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

    /// Sixteen-byte-aligned host storage for the reduce tests.
    #[repr(C, align(16))]
    struct Aligned<T>([T; 8]);

    fn sum_of<T: ReduceElem + PartialEq + core::fmt::Debug>(a: [T; 8], b: [T; 8]) -> [T; 8] {
        let (a, b) = (Aligned(a), Aligned(b));
        let mut out = Aligned(a.0);
        // SAFETY: three distinct aligned arrays of 8 elements; one thread.
        unsafe { reduce_sum(crate::coop::CoopThread, &[out.0.as_mut_ptr()], &[a.0.as_ptr(), b.0.as_ptr()], 8, 0, 1) };
        out.0
    }

    #[test]
    fn sums_are_element_wise_in_vectors_and_tails() {
        let f = sum_of([1.5f32, 2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 4.0], [0.25, 3.0, 1.0, 7.0, 1.0, 1.0, 1.0, 1.0]);
        assert_eq!(f, [1.75, 5.0, 0.0, 7.0, 2.0, 3.0, 4.0, 5.0]);
        let u = sum_of([u32::MAX, 1, 2, 3, 4, 5, 6, 7], [1; 8]);
        assert_eq!(u, [0, 2, 3, 4, 5, 6, 7, 8]);
        let d = sum_of([1.25f64, -3.0, 0.5, 0.0, 1.0, 1.0, 1.0, 1.0], [2.0; 8]);
        assert_eq!(d, [3.25, -1.0, 2.5, 2.0, 3.0, 3.0, 3.0, 3.0]);
    }
}
