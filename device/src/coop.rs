//! Cooperation scopes: the group of threads that performs one operation together (NCCL's
//! `ncclCoopThread`, `ncclCoopWarp`, `ncclCoopCta`). Helpers generic over [`Coop`] split
//! work by `thread_rank`/`size` and meet at `sync`.

use crate::arch;

/// A group of threads cooperating on one operation.
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
    /// [`Coop::sync`] for callers whose warps arrive converged (every lane of a warp reaches
    /// it together); may use a cheaper instruction.
    fn sync_converged(&self) {
        self.sync()
    }
}

/// One thread on its own.
#[derive(Clone, Copy, Debug, Default)]
pub struct CoopThread;

/// The 32 lanes of this thread's warp (all must be present and converged).
#[derive(Clone, Copy, Debug, Default)]
pub struct CoopWarp;

/// All threads of this thread's CTA. Every thread of the CTA must take part in each
/// operation (none may have exited).
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
        let any = arch::ballot_sync(arch::FULL_MASK, pred) != 0;
        // `vote.sync` converges the lanes but does not order memory: `bar.warp.sync` does.
        arch::sync_warp(arch::FULL_MASK);
        any
    }
    #[inline(always)]
    fn warp_any(&self, pred: bool) -> bool {
        arch::ballot_sync(arch::FULL_MASK, pred) != 0
    }
    #[inline(always)]
    fn warp_lanes(&self) -> u32 {
        arch::FULL_MASK
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
    #[inline(always)]
    fn sync(&self) {
        arch::sync_threads()
    }
    #[inline(always)]
    fn sync_any(&self, pred: bool) -> bool {
        arch::sync_threads_or(pred)
    }
    #[inline(always)]
    fn warp_any(&self, pred: bool) -> bool {
        // Every thread of the CTA takes part, so the vote names every lane the warp has (not
        // `activemask`, which reports only the lanes converged right now and would let a split
        // warp vote in parts); `vote.sync` then reconverges them.
        arch::ballot_sync(self.warp_lanes(), pred) != 0
    }
    #[inline(always)]
    fn warp_lanes(&self) -> u32 {
        let first = arch::warp_id_in_block() * arch::WARP_SIZE;
        let lanes = (arch::block_size() - first).min(arch::WARP_SIZE);
        if lanes == arch::WARP_SIZE { arch::FULL_MASK } else { (1u32 << lanes) - 1 }
    }
    #[inline(always)]
    fn sync_converged(&self) {
        arch::sync_threads_converged()
    }
}
