//! Vectorized copy.
//!
//! [`copy_bytes`] is the cooperative routine (any number of threads split the work); the
//! [`ferrolink_copy`] kernel runs it over the whole grid.

use crate::arch::{self, U32x4};
use crate::kernel;

/// 16-byte vectors each thread moves per loop iteration: loads are issued before stores,
/// so each thread has this many independent 16-byte loads in flight.
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
        let step = nthreads * UNROLL;
        let mut i = rank;
        while i + (UNROLL - 1) * nthreads < vectors {
            let mut v = [U32x4::default(); UNROLL];
            for (u, slot) in v.iter_mut().enumerate() {
                *slot = arch::load_v4(vsrc.add(i + u * nthreads));
            }
            for (u, value) in v.iter().enumerate() {
                arch::store_v4(vdst.add(i + u * nthreads), *value);
            }
            i += step;
        }
        while i < vectors {
            arch::store_v4(vdst.add(i), arch::load_v4(vsrc.add(i)));
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
