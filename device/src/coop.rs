//! Cooperation scopes: the group of threads that performs one operation together (NCCL's
//! `ncclCoopThread`, `ncclCoopWarp`, `ncclCoopCta`). Helpers generic over [`Coop`] split
//! work by `thread_rank`/`size` and meet at `sync`.

use crate::arch;

/// A group of threads cooperating on one operation.
///
/// ```
/// # use ferrolink_device::arch;
/// # use ferrolink_device::coop::{Coop, CoopCta, CoopThread, CoopWarp};
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// /// Fills `dst[..n]` with `0..n`, split over the group's threads; returns when all are done.
/// fn fill<C: Coop>(coop: C, dst: *mut u32, n: usize) {
///     let mut i = coop.thread_rank();
///     while i < n {
///         // SAFETY: `dst` holds `n` words (caller); each `i` is written by one thread.
///         unsafe { *dst.add(i) = i as u32 };
///         i += coop.size();
///     }
///     coop.sync();
/// }
/// unsafe fn kernel((out,): (*mut u32,)) {
///     fill(CoopCta, out, 100);
/// }
/// let spec = LaunchSpec { name: "ex", grid: [1, 1, 1], block: [64, 1, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// let mut out = vec![0u32; 100];
/// // SAFETY: `out` holds 100 words and outlives the launch.
/// unsafe { emulator::launch(&spec, kernel, (out.as_mut_ptr(),)) }.unwrap();
/// assert_eq!(out, (0..100).collect::<Vec<u32>>());
/// ```
pub trait Coop: Copy {
    /// This thread's index in the group.
    fn thread_rank(&self) -> usize;
    /// Threads in the group.
    fn size(&self) -> usize;
    /// Waits for every thread of the group; orders their memory accesses at CTA scope.
    fn sync(&self);
    /// [`Coop::sync`], returning whether `pred` was true for any thread of the group.
    fn sync_any(&self, pred: bool) -> bool;
    /// Whether `pred` holds for any of the group's threads in the caller's warp (no
    /// group-wide barrier). Keeps loops warp-uniform.
    fn warp_any(&self, pred: bool) -> bool;
    /// The lanes of the caller's warp that belong to the group, as a lane mask (the mask a
    /// warp vote over the group's part of this warp names).
    fn warp_lanes(&self) -> u32;
    /// Whether every warp that holds threads of the group holds 32 of them (then
    /// [`Coop::warp_lanes`] is the full mask in every such warp). It depends on the launch
    /// shape only, so a branch on it keeps the warp converged in ptxas's eyes, where a branch
    /// on `warp_lanes() == FULL_MASK` (a per-thread value to it) does not.
    fn full_warps(&self) -> bool;
    /// [`Coop::sync`] for callers whose warps arrive converged (every lane of a warp reaches
    /// it together); may use a cheaper instruction.
    fn sync_converged(&self) {
        self.sync()
    }
}

/// One thread on its own.
///
/// ```
/// # use ferrolink_device::arch;
/// # use ferrolink_device::coop::{Coop, CoopCta, CoopThread, CoopWarp};
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// unsafe fn kernel((out,): (*mut (usize, usize),)) {
///     let coop = CoopThread;
///     coop.sync(); // nothing to wait for
///     assert!(coop.sync_any(true));
///     // SAFETY: one entry per thread.
///     unsafe { *out.add(arch::thread_idx_x()) = (coop.thread_rank(), coop.size()) };
/// }
/// let spec = LaunchSpec { name: "ex", grid: [1, 1, 1], block: [4, 1, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// let mut out = vec![(0, 0); 4];
/// // SAFETY: `out` has an entry for every thread and outlives the launch.
/// unsafe { emulator::launch(&spec, kernel, (out.as_mut_ptr(),)) }.unwrap();
/// assert!(out.iter().all(|&rs| rs == (0, 1)));
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct CoopThread;

/// The 32 lanes of this thread's warp (all must be present and converged).
///
/// ```
/// # use ferrolink_device::arch;
/// # use ferrolink_device::coop::{Coop, CoopCta, CoopThread, CoopWarp};
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// unsafe fn kernel((out,): (*mut (usize, usize),)) {
///     let warp = CoopWarp;
///     assert!(warp.warp_any(warp.thread_rank() == 5));
///     warp.sync();
///     // SAFETY: one entry per thread.
///     unsafe { *out.add(arch::thread_idx_x()) = (warp.thread_rank(), warp.size()) };
/// }
/// let spec = LaunchSpec { name: "ex", grid: [1, 1, 1], block: [64, 1, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// let mut out = vec![(0, 0); 64];
/// // SAFETY: `out` has an entry for every thread and outlives the launch.
/// unsafe { emulator::launch(&spec, kernel, (out.as_mut_ptr(),)) }.unwrap();
/// assert!(out.iter().enumerate().all(|(t, &rs)| rs == (t % 32, 32)));
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct CoopWarp;

/// All threads of this thread's CTA. Every thread of the CTA must take part in each
/// operation (none may have exited).
///
/// ```
/// # use ferrolink_device::arch;
/// # use ferrolink_device::coop::{Coop, CoopCta, CoopThread, CoopWarp};
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// unsafe fn kernel((out,): (*mut (usize, usize),)) {
///     let cta = CoopCta;
///     // Every thread of the CTA learns that thread 47 saw something.
///     assert!(cta.sync_any(cta.thread_rank() == 47));
///     // SAFETY: one entry per thread.
///     unsafe { *out.add(cta.thread_rank()) = (cta.thread_rank(), cta.size()) };
/// }
/// let spec = LaunchSpec { name: "ex", grid: [1, 1, 1], block: [16, 4, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// let mut out = vec![(0, 0); 64];
/// // SAFETY: `out` has an entry for every thread and outlives the launch.
/// unsafe { emulator::launch(&spec, kernel, (out.as_mut_ptr(),)) }.unwrap();
/// assert!(out.iter().enumerate().all(|(t, &rs)| rs == (t, 64)));
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct CoopCta;

impl Coop for CoopThread {
    #[inline(always)]
    fn thread_rank(&self) -> usize {
        0
    }
    #[inline(always)]
    fn size(&self) -> usize {
        1
    }
    #[inline(always)]
    fn sync(&self) {}
    #[inline(always)]
    fn sync_any(&self, pred: bool) -> bool {
        pred
    }
    #[inline(always)]
    fn warp_any(&self, pred: bool) -> bool {
        pred
    }
    #[inline(always)]
    fn warp_lanes(&self) -> u32 {
        1 << arch::lane_id()
    }
    #[inline(always)]
    fn full_warps(&self) -> bool {
        false
    }
}

impl Coop for CoopWarp {
    #[inline(always)]
    fn thread_rank(&self) -> usize {
        arch::lane_id() as usize
    }
    #[inline(always)]
    fn size(&self) -> usize {
        arch::WARP_SIZE
    }
    #[inline(always)]
    fn sync(&self) {
        arch::sync_warp(arch::FULL_MASK)
    }
    #[inline(always)]
    fn sync_any(&self, pred: bool) -> bool {
        warp_sync_any(arch::FULL_MASK, pred)
    }
    #[inline(always)]
    fn warp_any(&self, pred: bool) -> bool {
        arch::ballot_sync(arch::FULL_MASK, pred) != 0
    }
    #[inline(always)]
    fn warp_lanes(&self) -> u32 {
        arch::FULL_MASK
    }
    #[inline(always)]
    fn full_warps(&self) -> bool {
        true
    }
}

impl Coop for CoopCta {
    #[inline(always)]
    fn thread_rank(&self) -> usize {
        arch::thread_rank_in_block()
    }
    #[inline(always)]
    fn size(&self) -> usize {
        arch::block_size()
    }
    // A CTA of one warp meets at the warp barrier instead: `bar.warp.sync` orders memory
    // among its threads as the CTA barrier does, and costs less (docs/PERF.md, LSA barrier).
    #[inline(always)]
    fn sync(&self) {
        match single_warp_lanes() {
            Some(lanes) => arch::sync_warp(lanes),
            None => arch::sync_threads(),
        }
    }
    #[inline(always)]
    fn sync_any(&self, pred: bool) -> bool {
        match single_warp_lanes() {
            Some(lanes) => warp_sync_any(lanes, pred),
            None => arch::sync_threads_or(pred),
        }
    }
    #[inline(always)]
    fn warp_any(&self, pred: bool) -> bool {
        // Every thread of the CTA takes part, so the vote names every lane the warp has (not
        // `activemask`, which reports only the lanes converged right now and would let a split
        // warp vote in parts); `vote.sync` then reconverges them.
        // A literal full mask where the warps are full: a run-time mask costs the vote a
        // uniformity check and hides the warp's convergence from ptxas.
        if self.full_warps() {
            arch::ballot_sync(arch::FULL_MASK, pred) != 0
        } else {
            arch::ballot_sync(self.warp_lanes(), pred) != 0
        }
    }
    #[inline(always)]
    fn full_warps(&self) -> bool {
        arch::block_size().is_multiple_of(arch::WARP_SIZE)
    }
    #[inline(always)]
    fn warp_lanes(&self) -> u32 {
        let first = arch::warp_id_in_block() * arch::WARP_SIZE;
        let lanes = (arch::block_size() - first).min(arch::WARP_SIZE);
        if lanes == arch::WARP_SIZE { arch::FULL_MASK } else { (1u32 << lanes) - 1 }
    }
    #[inline(always)]
    fn sync_converged(&self) {
        match single_warp_lanes() {
            Some(lanes) => arch::sync_warp(lanes),
            None => arch::sync_threads_converged(),
        }
    }
}

/// Meets `lanes` of this warp and returns whether `pred` held for any of them. `vote.sync`
/// converges the lanes but does not order memory: `bar.warp.sync` does.
#[inline(always)]
fn warp_sync_any(lanes: u32, pred: bool) -> bool {
    let any = arch::ballot_sync(lanes, pred) != 0;
    arch::sync_warp(lanes);
    any
}

/// For a CTA of one warp, its lanes (`Some`), else `None`. A full warp gets the literal full
/// mask: with a run-time mask `bar.warp.sync`/`vote.sync` first check the mask's uniformity
/// (`MATCH.ANY` and friends), which costs more than the barrier itself.
#[inline(always)]
fn single_warp_lanes() -> Option<u32> {
    let n = arch::block_size();
    if n == arch::WARP_SIZE {
        Some(arch::FULL_MASK)
    } else if n < arch::WARP_SIZE {
        Some((1u32 << n) - 1)
    } else {
        None
    }
}
