//! The device communicator and teams: `#[repr(C)]` values the host creates and passes to
//! kernels by value (defined once, here, and used by the host crate).

use crate::arch::Scope;
use crate::arch::atomic::{self, LoadOrder, RmwOrder, StoreOrder};
use crate::window::DevWindow;
use bytemuck::{Pod, Zeroable};

/// A set of ranks `{rank, size, stride}` (NCCL's `ncclTeam`): team rank `r` is world rank
/// `world_rank + (r - rank) * stride` of the calling rank. World and LSA teams have stride 1;
/// the rail team (same LSA rank on every LSA domain) has stride `lsa_size`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct Team {
    /// This rank's index in the team.
    pub rank: u32,
    /// Ranks in the team.
    pub size: u32,
    /// World-rank distance between consecutive team ranks.
    pub stride: u32,
}

/// `DevComm::header.magic`: "FLDC" in ASCII, little-endian.
pub const DEV_COMM_MAGIC: u32 = u32::from_le_bytes(*b"FLDC");

/// The layout version of [`DevComm`] and the structures it points to ([`DevControl`],
/// [`WaitRecord`]). Raised whenever any of them changes, so that a kernel built against one
/// version rejects a `DevComm` made by a host built against another.
pub const DEV_COMM_ABI_VERSION: u32 = 4;

/// [`DevComm::fault_claim`] states: no fault yet, a thread is writing the record, the record
/// is written (threads that lost the claim trap only then, or after [`FAULT_RECORD_WAIT_NS`]).
const FAULT_CLAIM_FREE: u32 = 0;
const FAULT_RECORD_WRITING: u32 = 1;
const FAULT_RECORD_WRITTEN: u32 = 2;

/// How long a faulting thread that lost the claim waits for the record before it traps anyway.
const FAULT_RECORD_WAIT_NS: u64 = 1_000_000;

/// The first 16 bytes of a [`DevComm`]: what it is, its layout version and its size. Kernels
/// check it when they open a barrier session ([`DevComm::check_header`]); the host checks it
/// when a `DevComm` value comes back to it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct DevCommHeader {
    /// [`DEV_COMM_MAGIC`].
    pub magic: u32,
    /// [`DEV_COMM_ABI_VERSION`].
    pub abi_version: u32,
    /// `size_of::<DevComm>()`.
    pub size: u32,
    /// Zero.
    pub _reserved: u32,
}

impl DevCommHeader {
    /// The header of a `DevComm` of this crate's version.
    pub const CURRENT: DevCommHeader = DevCommHeader {
        magic: DEV_COMM_MAGIC,
        abi_version: DEV_COMM_ABI_VERSION,
        size: core::mem::size_of::<DevComm>() as u32,
        _reserved: 0,
    };
}

/// A set of LSA barriers (NCCL's `ncclLsaBarrierHandle`): barrier indices `0..count` of the
/// set are the communicator's barriers `first..first + count`. The default set is
/// [`DevComm::lsa_barrier`]; a library asks for its own set when the device communicator is
/// created (the host's `DevCommRequirements::resources`), so that its barriers never collide
/// with the user's.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct LsaBarrierHandle {
    /// The set's first barrier among the communicator's.
    pub first: u32,
    /// Barriers in the set.
    pub count: u32,
}

/// What a kernel knows about its communicator (NCCL's `ncclDevComm`): who it is, its LSA
/// domain, the registered windows, the barrier resources, and the control block through
/// which the host aborts it and it reports errors and waits. Created on the host by
/// `ferrolink::DevCommHandle` and passed to kernels by value; valid while that handle lives.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct DevComm {
    /// Magic, layout version and size ([`DevCommHeader::CURRENT`]).
    pub header: DevCommHeader,
    /// World rank.
    pub rank: u32,
    /// World size.
    pub nranks: u32,
    /// Rank within the LSA domain (ranks that can load/store each other's memory).
    pub lsa_rank: u32,
    /// Ranks in the LSA domain.
    pub lsa_size: u32,
    /// Scope at which LSA peers synchronize, as a [`Scope::code`]: `.gpu` when every
    /// LSA peer runs on this GPU (virtual ranks), `.sys` when peers are on other GPUs.
    pub lsa_scope_code: u32,
    /// LSA barriers of the communicator, over all sets (the default set and every set a
    /// library requested).
    pub lsa_barrier_total: u32,
    /// The default LSA barrier set (`DevCommRequirements::lsa_barrier_count` barriers):
    /// what [`crate::barrier::LsaBarrierSession::new`] uses.
    pub lsa_barrier: LsaBarrierHandle,
    /// The symmetric window holding the barrier inboxes (`lsa_barrier_total` rows).
    pub barrier_window: DevWindow,
    /// Device address of this rank's `lsa_barrier_total` epoch words (local memory).
    pub barrier_epochs: u64,
    /// Device address of the window table (`window_capacity` [`DevWindow`]s).
    pub windows: u64,
    /// Windows registered in the table.
    pub window_count: u32,
    /// Padding (keeps the layout explicit).
    pub _reserved: u32,
    /// Address of this rank's [`DevControl`] (host memory mapped for the device): the abort
    /// flag the host raises and the error record kernels fill. Zero: none.
    pub control: u64,
    /// Address of `lsa_barrier_total` [`WaitRecord`]s (host memory mapped for the device),
    /// one per barrier: what a slow wait is waiting for, for the host's watchdog. Zero: none.
    pub wait_records: u64,
    /// Address of a word in device memory that the first faulting thread claims (compare and
    /// swap at `.gpu` scope) before it fills [`DevControl::error`], so that several threads
    /// faulting at once leave one whole record, not a mix; it then marks the word written, and
    /// the others trap only after that (bounded, see [`DevComm::fail`]). Zero: none.
    pub fault_claim: u64,
    /// GPU-initiated networking resources ([`crate::gin`]); `gin.flags == 0`: none.
    pub gin: crate::gin::DevGin,
}

/// The control block of one rank's device communicator, in host memory mapped for the
/// device (so the host reads it even after a kernel fault). The host writes `abort`; kernels
/// read it while they wait, and write `error` (then raise `abort`) when they find a fault.
///
/// Ordering: the host's store to `abort` needs no fence (a kernel that sees it only stops
/// waiting). A kernel fills the error record with relaxed system-scope stores, then raises
/// `abort`, then `fence.sc.sys`: the host reads the record after the kernel has ended (stream
/// error or completion), when every store of it is visible.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct DevControl {
    /// Non-zero: the communicator was aborted; waits return at once.
    pub abort: u32,
    /// Padding.
    pub _reserved: u32,
    /// The last fault a kernel reported ([`DevErrorRecord::code`] zero: none).
    pub error: DevErrorRecord,
}

/// A fault found on the device, written to [`DevControl::error`] before the kernel traps.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct DevErrorRecord {
    /// What went wrong: one of [`error_code`].
    pub code: u32,
    /// World rank of the kernel.
    pub rank: u32,
    /// Linear CTA index.
    pub cta: u32,
    /// Thread index in the CTA.
    pub thread: u32,
    /// First code-specific value (for a barrier index error: the index).
    pub a: u64,
    /// Second code-specific value (for a barrier index error: `first << 32 | count` of the set).
    pub b: u64,
}

/// Codes of [`DevErrorRecord::code`].
pub mod error_code {
    /// No error.
    pub const NONE: u32 = 0;
    /// An LSA barrier index outside its set: `a` = index, `b` = `first << 32 | count`.
    pub const LSA_BARRIER_INDEX: u32 = 1;
    /// A barrier set outside the communicator's barriers: `a` = `first << 32 | count`,
    /// `b` = the communicator's total.
    pub const LSA_BARRIER_SET: u32 = 2;
    /// GIN used on a device communicator created without GIN resources.
    pub const GIN_ABSENT: u32 = 3;
    /// A GIN signal id out of range: `a` = id, `b` = signal count.
    pub const GIN_SIGNAL_ID: u32 = 4;
    /// A GIN counter id out of range: `a` = id, `b` = counter count.
    pub const GIN_COUNTER_ID: u32 = 5;
    /// A GIN peer outside its team: `a` = team rank, `b` = team size.
    pub const GIN_PEER: u32 = 6;
    /// A GIN put or value outside its window, or a value of a bad size: `a` = offset, `b` =
    /// `window id << 48 | window size` (or the value's size).
    pub const GIN_RANGE: u32 = 7;
    /// A GIN barrier index out of range: `a` = index, `b` = GIN barrier count.
    pub const GIN_BARRIER_INDEX: u32 = 8;
    /// Collective arguments the kernel does not know: `a` = `kind << 32 | algo`, `b` =
    /// `dtype << 32 | op`.
    pub const COLL_ARGS: u32 = 9;
    /// Point-to-point arguments the kernel cannot use: `a` = `kind << 32 | peer` of an
    /// operation (or `channels << 32 | slots`, or an operation's `after`), `b` = its bytes
    /// (or the chunk size, or its index).
    pub const P2P_ARGS: u32 = 10;
    /// MoE arguments the kernels cannot use (`a` = `num_experts << 32 | hidden`, `b` =
    /// `chunk << 32 | grid`), or an entry naming an expert past the last (`a` = the entry,
    /// `b` = the expert).
    pub const MOE_ARGS: u32 = 11;
    /// Low-latency MoE: more than `max_tokens` entries of this rank to one expert in a call
    /// (`a` = the expert, `b` = `max_tokens`).
    pub const MOE_CAPACITY: u32 = 12;
    /// The fused MoE combine's finish, where some peer is not reached directly, without
    /// return rows for its results (`a` = the bytes needed, `b` = the return window's size).
    pub const MOE_FUSED_PATH: u32 = 13;
}

/// What one slow barrier wait is waiting for (one record per barrier of the communicator,
/// host memory mapped for the device). A wait that has not finished after its fast spin
/// phase writes it once; the host's watchdog reads it, reads the barrier's inbox row to see
/// which peers have not arrived at `epoch`, and reports or aborts. Finished waits leave the
/// record as it is: every peer has then reached `epoch`, which the watchdog sees.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct WaitRecord {
    /// The epoch the wait needs every peer's inbox word to reach.
    pub epoch: u32,
    /// Linear CTA index of the waiting coop.
    pub cta: u32,
    /// 1 once a wait on this barrier has gone slow (0: never).
    pub active: u32,
    /// Padding.
    pub _reserved: u32,
}

impl DevComm {
    /// The world team: all ranks.
    #[inline(always)]
    pub fn world(&self) -> Team {
        Team { rank: self.rank, size: self.nranks, stride: 1 }
    }

    /// The LSA team: the ranks whose windows this rank can load from and store to.
    #[inline(always)]
    pub fn lsa(&self) -> Team {
        Team { rank: self.lsa_rank, size: self.lsa_size, stride: 1 }
    }

    /// The rail team: the ranks with this rank's LSA rank in every LSA domain.
    #[inline(always)]
    pub fn rail(&self) -> Team {
        Team { rank: self.rank / self.lsa_size, size: self.nranks / self.lsa_size, stride: self.lsa_size }
    }

    /// The scope LSA synchronization uses (see [`DevComm::lsa_scope_code`]).
    #[inline(always)]
    pub fn lsa_scope(&self) -> Scope {
        Scope::from_code(self.lsa_scope_code)
    }

    /// World rank of team rank `r` of `team` (which must contain this rank).
    #[inline(always)]
    pub fn team_rank_to_world(&self, team: Team, r: u32) -> u32 {
        (self.rank as i64 + (r as i64 - team.rank as i64) * team.stride as i64) as u32
    }

    /// Team rank of world rank `world` in `team`, or `None` if it is not a member.
    #[inline(always)]
    pub fn world_rank_to_team(&self, team: Team, world: u32) -> Option<u32> {
        let first = self.rank as i64 - team.rank as i64 * team.stride as i64;
        let d = world as i64 - first;
        if d < 0 || d % team.stride as i64 != 0 || d / team.stride as i64 >= team.size as i64 {
            None
        } else {
            Some((d / team.stride as i64) as u32)
        }
    }

    /// Whether this value carries the header of this crate's `DevComm` layout.
    #[inline(always)]
    pub fn header_ok(&self) -> bool {
        self.header == DevCommHeader::CURRENT
    }

    /// Traps unless [`DevComm::header_ok`]: a `DevComm` made by another version of ferrolink
    /// (or not a `DevComm` at all) cannot be trusted to report the error itself.
    #[inline(always)]
    pub fn check_header(&self) {
        if !self.header_ok() {
            crate::arch::trap();
        }
    }

    /// Whether the host has aborted the communicator (a relaxed system-scope load of
    /// [`DevControl::abort`]; false without a control block). A load from host memory costs
    /// a PCIe round trip: waits call it only after their fast spin phase.
    #[inline(always)]
    pub fn abort_requested(&self) -> bool {
        if self.control == 0 {
            return false;
        }
        // SAFETY: `control` points to this rank's live DevControl (the handle is alive while
        // kernels use this value); the host and kernels access `abort` only atomically.
        unsafe { atomic::load(self.control as *const u32, LoadOrder::Relaxed, Scope::Sys) != 0 }
    }

    /// Records a fault in the control block (see [`DevControl`] for the ordering), raises
    /// the abort flag so that this communicator's other waits stop, and traps. `a` and `b`
    /// are the code's values ([`error_code`]).
    #[inline(never)]
    #[cold]
    pub fn fail(&self, code: u32, a: u64, b: u64) -> ! {
        // The first faulting thread of this rank writes the record; the others wait, bounded,
        // until it is written, then trap: a trap ends the whole grid, and one from a thread
        // that lost the claim could otherwise end it between the claimer's stores.
        // Ordering: the claimer's record stores, then `fence.sc.sys`, then its release store of
        // FAULT_RECORD_WRITTEN (GPU scope); a loser's acquire load of that value orders its trap
        // after the record is visible at system scope. The bound keeps a claimer that never
        // finishes (its grid ended by another trap) from keeping the others waiting.
        let claim = self.fault_claim as *mut u32;
        // SAFETY: `fault_claim` is this rank's live claim word in device memory, accessed
        // only atomically.
        let first = self.fault_claim == 0
            || unsafe {
                atomic::compare_swap(claim, FAULT_CLAIM_FREE, FAULT_RECORD_WRITING, RmwOrder::Relaxed, Scope::Gpu)
            } == FAULT_CLAIM_FREE;
        if !first {
            let start = crate::arch::global_timer_ns();
            // SAFETY: as above.
            while unsafe { atomic::load(claim, LoadOrder::Acquire, Scope::Gpu) } != FAULT_RECORD_WRITTEN
                && crate::arch::global_timer_ns().wrapping_sub(start) < FAULT_RECORD_WAIT_NS
            {
                crate::arch::nanosleep(100);
            }
        }
        if first && self.control != 0 {
            // On the emulator the record's stores and fence run to the end even if a thread
            // that lost the claim has trapped meanwhile (`emulator::RecordingFault`).
            #[cfg(not(target_arch = "nvptx64"))]
            let _recording = crate::emulator::RecordingFault::start();
            let c = self.control as *mut DevControl;
            // SAFETY: `control` points to this rank's live DevControl; its words are only
            // accessed atomically while kernels run (the host reads them after).
            unsafe {
                let e = &raw mut (*c).error;
                atomic::store(&raw mut (*e).rank, self.rank, StoreOrder::Relaxed, Scope::Sys);
                atomic::store(
                    &raw mut (*e).cta,
                    crate::arch::linear_block_idx() as u32,
                    StoreOrder::Relaxed,
                    Scope::Sys,
                );
                atomic::store(
                    &raw mut (*e).thread,
                    crate::arch::thread_rank_in_block() as u32,
                    StoreOrder::Relaxed,
                    Scope::Sys,
                );
                atomic::store(&raw mut (*e).a, a, StoreOrder::Relaxed, Scope::Sys);
                atomic::store(&raw mut (*e).b, b, StoreOrder::Relaxed, Scope::Sys);
                atomic::store(&raw mut (*e).code, code, StoreOrder::Relaxed, Scope::Sys);
                atomic::store(&raw mut (*c).abort, 1, StoreOrder::Relaxed, Scope::Sys);
            }
            atomic::fence(crate::arch::FenceOrder::SeqCst, Scope::Sys);
        }
        if first && self.fault_claim != 0 {
            // SAFETY: as for the claim above.
            unsafe { atomic::store(claim, FAULT_RECORD_WRITTEN, StoreOrder::Release, Scope::Gpu) };
        }
        crate::arch::trap()
    }

    /// Registered window `i` of the window table, or `None` past the registered count.
    ///
    /// # Safety
    /// The `DevCommHandle` this value came from must still be alive.
    #[inline(always)]
    pub unsafe fn window(&self, i: u32) -> Option<DevWindow> {
        if i >= self.window_count {
            return None;
        }
        // SAFETY: the table holds `window_count` initialized entries (caller: handle alive).
        Some(unsafe { (self.windows as *const DevWindow).add(i as usize).read() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn comm(rank: u32, nranks: u32, lsa_size: u32) -> DevComm {
        DevComm {
            header: DevCommHeader::CURRENT,
            rank,
            nranks,
            lsa_rank: rank % lsa_size,
            lsa_size,
            ..DevComm::default()
        }
    }

    #[test]
    fn teams_translate_ranks_both_ways() {
        // 8 ranks in 2 LSA domains of 4: rank 6 is LSA rank 2 of the second domain.
        let c = comm(6, 8, 4);
        assert_eq!(c.lsa(), Team { rank: 2, size: 4, stride: 1 });
        assert_eq!(c.rail(), Team { rank: 1, size: 2, stride: 4 });
        assert_eq!(c.team_rank_to_world(c.lsa(), 0), 4);
        assert_eq!(c.team_rank_to_world(c.rail(), 0), 2);
        assert_eq!(c.world_rank_to_team(c.lsa(), 5), Some(1));
        assert_eq!(c.world_rank_to_team(c.lsa(), 3), None);
        assert_eq!(c.world_rank_to_team(c.rail(), 2), Some(0));
        assert_eq!(c.world_rank_to_team(c.rail(), 3), None);
        assert_eq!(c.world_rank_to_team(c.world(), 7), Some(7));
        for r in 0..4 {
            assert_eq!(c.world_rank_to_team(c.lsa(), c.team_rank_to_world(c.lsa(), r)), Some(r));
        }
    }

    #[test]
    fn dev_comm_layout_is_stable() {
        // Host and device share this layout; a change must be deliberate.
        assert_eq!(
            core::mem::size_of::<DevComm>(),
            16 + 32 + core::mem::size_of::<DevWindow>() + 48 + core::mem::size_of::<crate::gin::DevGin>()
        );
        assert_eq!(core::mem::size_of::<DevWindow>(), 40);
        assert_eq!(core::mem::align_of::<DevComm>(), 8);
        assert_eq!(core::mem::size_of::<DevControl>(), 40);
        assert_eq!(core::mem::size_of::<WaitRecord>(), 16);
        assert!(comm(0, 1, 1).header_ok());
        assert!(!DevComm::default().header_ok());
    }
}
