//! LSA barrier sessions: synchronize the ranks of an LSA domain from inside kernels
//! (NCCL's `ncclLsaBarrierSession`).
//!
//! # Protocol
//! Barrier `index` owns, on every rank `q`, a row of inbox words `inbox_q[index][p]`, one per
//! LSA peer `p`, in the communicator's barrier window. Each rank also keeps a local epoch
//! `e[index]`, carried from one session to the next.
//!
//! * **arrive**: the coop meets (`coop.sync()`), the epoch becomes `e + 1`, and coop thread
//!   `p` (striding over peers) stores `e + 1` into `inbox_p[index][me]` with a **release**
//!   at the LSA scope.
//! * **wait**: coop thread `p` spins until `inbox_me[index][p]` reaches `e + 1` (wrap-safe
//!   compare), loading with **acquire** at the LSA scope; then the coop meets again.
//!
//! # Ordering argument
//! A write made before `arrive` by any thread of the arriving coop is ordered before that
//! coop's `sync` (a CTA-scope barrier, which makes it visible to the releasing thread);
//! the release store is cumulative, so it publishes those writes at the LSA scope. The
//! waiting coop's thread `p` acquires peer `p`'s store and its closing `sync` extends that
//! to the whole coop. Hence: every write before `arrive` on any rank happens-before every
//! access after `wait` on every rank. The scope is `.gpu` when all LSA peers share the GPU
//! and `.sys` otherwise (`DevComm::lsa_scope`), the cheapest that covers the peers.
//!
//! # Epochs and wrap-around
//! Inbox words only grow, by one per round; a peer can be at most one round ahead (it
//! cannot pass the next wait without this rank's arrival), so comparing
//! `(value - target) as i32 >= 0` is exact across `u32` wrap-around. The session writes its
//! epoch back when dropped, so the next session on the same index continues the sequence.
//!
//! Use one barrier index per CTA: two CTAs must never use the same index at the same time.
//! Within a CTA, consecutive sessions on one index with *different* coops (say a warp's, then
//! the whole CTA's) need a `CoopCta` sync between them: the first session's threads save the
//! epoch, and threads outside that coop would otherwise read a stale one.

use crate::arch::{self, LoadOrder, StoreOrder, atomic};
use crate::comm::DevComm;
use crate::coop::Coop;

/// Bytes of one barrier's inbox row: a word per peer, padded to 128 bytes so barriers of
/// different CTAs do not share a cache line.
pub const fn inbox_row_bytes(lsa_size: u32) -> usize {
    (lsa_size as usize * 4).next_multiple_of(128)
}

/// Bytes of the barrier window per rank for `count` barriers in an LSA domain of `lsa_size`.
pub const fn inbox_bytes(count: u32, lsa_size: u32) -> usize {
    count as usize * inbox_row_bytes(lsa_size)
}

/// `a >= b` for sequence numbers that may wrap around `u32`.
#[inline(always)]
pub const fn seq_reached(value: u32, target: u32) -> bool {
    (value.wrapping_sub(target) as i32) >= 0
}

/// Polls of an inbox word before a waiting thread starts to back off with `nanosleep`.
const SPINS_BEFORE_BACKOFF: u32 = 2048;

/// A barrier wait that gave up after its timeout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BarrierTimeout;

/// One use of LSA barrier `index` by a coop (see the [module docs](self)). Create it, call
/// [`sync`](Self::sync) (or [`arrive`](Self::arrive) then [`wait`](Self::wait)) as many
/// times as needed; dropping it saves the epoch for the next session (every thread of the
/// coop stores the same value, so the next session needs no extra barrier to read it).
pub struct LsaBarrierSession<'a, C: Coop> {
    coop: C,
    comm: &'a DevComm,
    index: u32,
    epoch: u32,
}

impl<'a, C: Coop> LsaBarrierSession<'a, C> {
    /// Opens barrier `index` (< `comm.lsa_barrier_count`) for `coop`. Every thread of the
    /// coop calls this with the same arguments.
    ///
    /// # Safety
    /// The `DevCommHandle` behind `comm` must be alive, `index` in range, and no other coop
    /// may use `index` while this session exists.
    #[inline(always)]
    pub unsafe fn new(coop: C, comm: &'a DevComm, index: u32) -> Self {
        // SAFETY: the epochs array holds `lsa_barrier_count` words (caller: index in range).
        let epoch = unsafe {
            atomic::load((comm.barrier_epochs as *const u32).add(index as usize), LoadOrder::Relaxed, arch::Scope::Gpu)
        };
        LsaBarrierSession { coop, comm, index, epoch }
    }

    fn inbox_offset(&self, from: u32) -> usize {
        self.index as usize * inbox_row_bytes(self.comm.lsa_size) + from as usize * 4
    }

    /// Signals this rank's arrival to every LSA peer: meets the coop, then releases the new
    /// epoch into each peer's inbox at the LSA scope.
    #[inline(always)]
    pub fn arrive(&mut self) {
        self.coop.sync();
        self.epoch = self.epoch.wrapping_add(1);
        let scope = self.comm.lsa_scope();
        let me = self.comm.lsa_rank;
        let mut p = self.coop.thread_rank();
        while p < self.comm.lsa_size as usize {
            let slot = self.comm.barrier_window.lsa_ptr::<u32>(self.inbox_offset(me), p as u32);
            // SAFETY: `slot` is inside peer p's barrier row (window sized by inbox_bytes).
            unsafe { atomic::store(slot, self.epoch, StoreOrder::Release, scope) };
            p += self.coop.size();
        }
    }

    /// Waits until every LSA peer has arrived at this epoch, then meets the coop.
    #[inline(always)]
    pub fn wait(&mut self) {
        let _ = self.wait_until(u64::MAX);
    }

    /// [`wait`](Self::wait) that gives up after `timeout_ns` of `%globaltimer`. The result is
    /// the same for every thread of the coop. After a timeout the barrier is out of step (this
    /// rank already signalled the epoch): abandon the kernel's protocol, report the error to
    /// the host, and have the host call `ferrolink::reset_barriers` before the barriers are
    /// used again.
    #[inline(always)]
    pub fn wait_timeout(&mut self, timeout_ns: u64) -> Result<(), BarrierTimeout> {
        let start = arch::global_timer_ns();
        self.wait_until(start.saturating_add(timeout_ns))
    }

    fn wait_until(&mut self, deadline_ns: u64) -> Result<(), BarrierTimeout> {
        let scope = self.comm.lsa_scope();
        let timed = deadline_ns != u64::MAX;
        let n = self.comm.lsa_size as usize;
        let coop = self.coop;
        // The coop's lanes of each warp poll together and leave together (the loop conditions
        // are warp-uniform through `warp_any`), so warps reach the closing barrier converged
        // and it may use the cheaper aligned form.
        let mut timed_out = false;
        let mut p = coop.thread_rank();
        while coop.warp_any(p < n) && !timed_out {
            let slot = (p < n).then(|| self.comm.barrier_window.local_ptr::<u32>(self.inbox_offset(p as u32)));
            let mut spins = 0u32;
            loop {
                let pending = match slot {
                    // SAFETY: `slot` is inside this rank's barrier row.
                    Some(s) => !seq_reached(unsafe { atomic::load(s, LoadOrder::Acquire, scope) }, self.epoch),
                    None => false,
                };
                if !coop.warp_any(pending) {
                    break;
                }
                spins = spins.wrapping_add(1);
                // Spin tight first: peers usually arrive within a microsecond, and a
                // nanosleep costs more than that. Back off only for long waits.
                if spins > SPINS_BEFORE_BACKOFF {
                    arch::spin_wait_hint(64);
                }
                if timed && spins.is_multiple_of(64) && coop.warp_any(arch::global_timer_ns() >= deadline_ns) {
                    timed_out = true;
                    break;
                }
            }
            p += coop.size();
        }
        if timed {
            if coop.sync_any(timed_out) { Err(BarrierTimeout) } else { Ok(()) }
        } else {
            coop.sync_converged();
            Ok(())
        }
    }

    /// `arrive` then `wait`: a full barrier among the LSA domain's ranks.
    #[inline(always)]
    pub fn sync(&mut self) {
        self.arrive();
        self.wait();
    }

    /// `arrive` then `wait_timeout`.
    #[inline(always)]
    pub fn sync_timeout(&mut self, timeout_ns: u64) -> Result<(), BarrierTimeout> {
        self.arrive();
        self.wait_timeout(timeout_ns)
    }

    /// The epoch of the last arrival.
    pub fn epoch(&self) -> u32 {
        self.epoch
    }
}

impl<C: Coop> Drop for LsaBarrierSession<'_, C> {
    fn drop(&mut self) {
        // Every thread of the coop stores the same epoch: a later session's `new`, in any
        // thread, then reads this value without needing another coop barrier. `.gpu` scope,
        // so that a later session in another CTA (a persistent kernel handing the index on
        // after a GPU-scope sync) also reads it.
        // SAFETY: in range (caller of `new`); this coop owns the index.
        unsafe {
            atomic::store(
                (self.comm.barrier_epochs as *mut u32).add(self.index as usize),
                self.epoch,
                StoreOrder::Relaxed,
                arch::Scope::Gpu,
            )
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequence_compare_survives_wrap_around() {
        assert!(seq_reached(5, 5));
        assert!(seq_reached(6, 5));
        assert!(!seq_reached(4, 5));
        assert!(seq_reached(0, u32::MAX));
        assert!(seq_reached(1, u32::MAX));
        assert!(!seq_reached(u32::MAX, 0));
    }

    #[test]
    fn inbox_rows_are_cache_line_padded() {
        assert_eq!(inbox_row_bytes(1), 128);
        assert_eq!(inbox_row_bytes(8), 128);
        assert_eq!(inbox_row_bytes(33), 256);
        assert_eq!(inbox_bytes(4, 8), 512);
    }
}
