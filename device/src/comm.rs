//! The device communicator and teams: `#[repr(C)]` values the host creates and passes to
//! kernels by value (defined once, here, and used by the host crate).

use crate::arch::Scope;
use crate::arch::atomic::{self, LoadOrder, RmwOrder, StoreOrder};
use crate::window::DevWindow;
use bytemuck::{Pod, Zeroable};

/// A set of ranks `{rank, size, stride}` (NCCL's `ncclTeam`): team rank `r` is world rank
/// `world_rank + (r - rank) * stride` of the calling rank. World and LSA teams have stride 1;
/// the rail team (same LSA rank on every LSA domain) has stride `lsa_size`.
///
/// ```
/// use ferrolink_device::{DevComm, Team};
/// // World rank 6 of 8. A team of the even ranks: team rank r is world rank 2 * r.
/// let comm = DevComm { rank: 6, nranks: 8, lsa_rank: 2, lsa_size: 4, ..Default::default() };
/// let even = Team { rank: 3, size: 4, stride: 2 };
/// assert_eq!(comm.team_rank_to_world(even, 1), 2);
/// assert_eq!(comm.world_rank_to_team(even, 5), None);
/// ```
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
///
/// ```
/// use ferrolink_device::comm::{DevCommHeader, DEV_COMM_MAGIC};
/// assert_eq!(DEV_COMM_MAGIC.to_le_bytes(), *b"FLDC");
/// assert_eq!(DevCommHeader::CURRENT.magic, DEV_COMM_MAGIC);
/// ```
pub const DEV_COMM_MAGIC: u32 = u32::from_le_bytes(*b"FLDC");

/// The layout version of [`DevComm`] and the structures it points to ([`DevControl`],
/// [`WaitRecord`]). Raised whenever any of them changes, so that a kernel built against one
/// version rejects a `DevComm` made by a host built against another.
///
/// ```
/// use ferrolink_device::comm::{DevCommHeader, DEV_COMM_ABI_VERSION};
/// use ferrolink_device::DevComm;
/// // A DevComm of another layout version is rejected.
/// let header = DevCommHeader { abi_version: DEV_COMM_ABI_VERSION + 1, ..DevCommHeader::CURRENT };
/// assert!(!DevComm { header, ..Default::default() }.header_ok());
/// ```
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
///
/// ```
/// use ferrolink_device::comm::DevCommHeader;
/// use ferrolink_device::DevComm;
/// assert_eq!(DevCommHeader::CURRENT.size as usize, size_of::<DevComm>());
/// // An all-zero value is not a DevComm.
/// assert_ne!(DevComm::default().header, DevCommHeader::CURRENT);
/// ```
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
    ///
    /// ```
    /// # use ferrolink_device::comm::DevCommHeader;
    /// # use ferrolink_device::DevComm;
    /// let comm = DevComm { header: DevCommHeader::CURRENT, ..Default::default() };
    /// assert!(comm.header_ok());
    /// ```
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
///
/// ```no_run
/// use ferrolink_device::{arch, kernel, CoopCta, DevComm, LsaBarrierHandle, LsaBarrierSession};
/// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
/// kernel! {
///     /// CTA `b` syncs the LSA ranks on barrier `b` of barrier set `set` (a library's, from
///     /// the host's `handle.lsa_barriers(id)`).
///     ///
///     /// # Safety
///     /// `comm` comes from a live handle and `set` from that handle; `grid <= set.count`.
///     pub unsafe fn lib_sync(comm: DevComm, set: LsaBarrierHandle) {
///         let b = arch::block_idx_x() as u32;
///         // SAFETY: the handle is alive; barrier b of the set belongs to this CTA alone.
///         let mut bar = unsafe { LsaBarrierSession::with_set(CoopCta, &comm, set, b) };
///         bar.sync();
///     }
/// }
/// ```
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
///
/// ```no_run
/// use ferrolink_device::{arch, kernel, DevComm};
/// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
/// kernel! {
///     /// Thread 0 writes this rank's world rank and LSA rank to `out[0..2]`.
///     ///
///     /// # Safety
///     /// `comm` comes from a live `DevCommHandle`; `out` holds 2 words.
///     pub unsafe fn whoami(comm: DevComm, out: *mut u32) {
///         if arch::global_thread_idx_x() == 0 {
///             // SAFETY: `out` holds 2 words (kernel contract).
///             unsafe {
///                 out.write(comm.rank);
///                 out.add(1).write(comm.lsa_rank);
///             }
///         }
///     }
/// }
/// ```
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
///
/// ```
/// use ferrolink_device::comm::error_code;
/// use ferrolink_device::DevControl;
/// // A fresh control block: not aborted, no fault recorded.
/// let ctl = DevControl::default();
/// assert_eq!((ctl.abort, ctl.error.code), (0, error_code::NONE));
/// ```
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
///
/// ```
/// use ferrolink_device::comm::error_code;
/// use ferrolink_device::DevErrorRecord;
/// // What a CTA opening barrier 40 of the default set of 32 leaves (the host decodes it).
/// let rec = DevErrorRecord { code: error_code::LSA_BARRIER_INDEX, rank: 1, cta: 40, thread: 0, a: 40, b: 32 };
/// let (first, count) = (rec.b >> 32, rec.b & 0xffff_ffff);
/// assert_eq!((rec.a, first, count), (40, 0, 32));
/// ```
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
    ///
    /// ```
    /// # use ferrolink_device::comm::error_code;
    /// assert_eq!(ferrolink_device::DevErrorRecord::default().code, error_code::NONE);
    /// ```
    pub const NONE: u32 = 0;
    /// An LSA barrier index outside its set: `a` = index, `b` = `first << 32 | count`.
    ///
    /// ```
    /// # use ferrolink_device::{comm::error_code, DevErrorRecord};
    /// // Index 9 of a set of 8 barriers starting at barrier 32:
    /// let rec = DevErrorRecord { code: error_code::LSA_BARRIER_INDEX, a: 9, b: 32 << 32 | 8, ..Default::default() };
    /// assert_eq!((rec.a, rec.b >> 32, rec.b & 0xffff_ffff), (9, 32, 8));
    /// ```
    pub const LSA_BARRIER_INDEX: u32 = 1;
    /// A barrier set outside the communicator's barriers: `a` = `first << 32 | count`,
    /// `b` = the communicator's total.
    ///
    /// ```
    /// # use ferrolink_device::{comm::error_code, DevErrorRecord};
    /// // A set of 8 barriers from barrier 60, in a communicator of 64:
    /// let rec = DevErrorRecord { code: error_code::LSA_BARRIER_SET, a: 60 << 32 | 8, b: 64, ..Default::default() };
    /// assert!((rec.a >> 32) + (rec.a & 0xffff_ffff) > rec.b);
    /// ```
    pub const LSA_BARRIER_SET: u32 = 2;
    /// GIN used on a device communicator created without GIN resources.
    ///
    /// ```
    /// # use ferrolink_device::{comm::error_code, DevErrorRecord};
    /// // No values: `a` and `b` are zero.
    /// let rec = DevErrorRecord { code: error_code::GIN_ABSENT, ..Default::default() };
    /// assert_eq!((rec.a, rec.b), (0, 0));
    /// ```
    pub const GIN_ABSENT: u32 = 3;
    /// A GIN signal id out of range: `a` = id, `b` = signal count.
    ///
    /// ```
    /// # use ferrolink_device::{comm::error_code, DevErrorRecord};
    /// // Signal 16 of 16:
    /// let rec = DevErrorRecord { code: error_code::GIN_SIGNAL_ID, a: 16, b: 16, ..Default::default() };
    /// assert!(rec.a >= rec.b);
    /// ```
    pub const GIN_SIGNAL_ID: u32 = 4;
    /// A GIN counter id out of range: `a` = id, `b` = counter count.
    ///
    /// ```
    /// # use ferrolink_device::{comm::error_code, DevErrorRecord};
    /// // Counter 5 of 4:
    /// let rec = DevErrorRecord { code: error_code::GIN_COUNTER_ID, a: 5, b: 4, ..Default::default() };
    /// assert!(rec.a >= rec.b);
    /// ```
    pub const GIN_COUNTER_ID: u32 = 5;
    /// A GIN peer outside its team: `a` = team rank, `b` = team size.
    ///
    /// ```
    /// # use ferrolink_device::{comm::error_code, DevErrorRecord};
    /// // Team rank 8 of a team of 8:
    /// let rec = DevErrorRecord { code: error_code::GIN_PEER, a: 8, b: 8, ..Default::default() };
    /// assert!(rec.a >= rec.b);
    /// ```
    pub const GIN_PEER: u32 = 6;
    /// A GIN put or value outside its window, or a value of a bad size: `a` = offset, `b` =
    /// `window id << 48 | window size` (or the value's size).
    ///
    /// ```
    /// # use ferrolink_device::{comm::error_code, DevErrorRecord};
    /// // Offset 4096 in window 3 of 4096 bytes:
    /// let rec = DevErrorRecord { code: error_code::GIN_RANGE, a: 4096, b: 3 << 48 | 4096, ..Default::default() };
    /// assert_eq!((rec.b >> 48, rec.b & 0xffff_ffff_ffff), (3, 4096));
    /// ```
    pub const GIN_RANGE: u32 = 7;
    /// A GIN barrier index out of range: `a` = index, `b` = GIN barrier count.
    ///
    /// ```
    /// # use ferrolink_device::{comm::error_code, DevErrorRecord};
    /// // GIN barrier 2 of 2:
    /// let rec = DevErrorRecord { code: error_code::GIN_BARRIER_INDEX, a: 2, b: 2, ..Default::default() };
    /// assert!(rec.a >= rec.b);
    /// ```
    pub const GIN_BARRIER_INDEX: u32 = 8;
    /// Collective arguments the kernel does not know: `a` = `kind << 32 | algo`, `b` =
    /// `dtype << 32 | op`.
    ///
    /// ```
    /// # use ferrolink_device::{comm::error_code, DevErrorRecord};
    /// // Collective kind 99, algorithm 0:
    /// let rec = DevErrorRecord { code: error_code::COLL_ARGS, a: 99 << 32, ..Default::default() };
    /// assert_eq!((rec.a >> 32, rec.a & 0xffff_ffff), (99, 0));
    /// ```
    pub const COLL_ARGS: u32 = 9;
    /// Point-to-point arguments the kernel cannot use: `a` = `kind << 32 | peer` of an
    /// operation (or `channels << 32 | slots`, or an operation's `after`), `b` = its bytes
    /// (or the chunk size, or its index).
    ///
    /// ```
    /// # use ferrolink_device::{comm::error_code, DevErrorRecord};
    /// // An operation of kind 7 (neither send nor receive) with peer 1, of 256 bytes:
    /// let rec = DevErrorRecord { code: error_code::P2P_ARGS, a: 7 << 32 | 1, b: 256, ..Default::default() };
    /// assert_eq!((rec.a >> 32, rec.a & 0xffff_ffff, rec.b), (7, 1, 256));
    /// ```
    pub const P2P_ARGS: u32 = 10;
    /// MoE arguments the kernels cannot use (`a` = `num_experts << 32 | hidden`, `b` =
    /// `chunk << 32 | grid`), or an entry naming an expert past the last (`a` = the entry,
    /// `b` = the expert).
    ///
    /// ```
    /// # use ferrolink_device::{comm::error_code, DevErrorRecord};
    /// // 8 experts of hidden size 0, chunk 0, grid 4:
    /// let rec = DevErrorRecord { code: error_code::MOE_ARGS, a: 8 << 32, b: 4, ..Default::default() };
    /// assert_eq!((rec.a >> 32, rec.a & 0xffff_ffff), (8, 0));
    /// ```
    pub const MOE_ARGS: u32 = 11;
    /// Low-latency MoE: more than `max_tokens` entries of this rank to one expert in a call
    /// (`a` = the expert, `b` = `max_tokens`).
    ///
    /// ```
    /// # use ferrolink_device::{comm::error_code, DevErrorRecord};
    /// // Expert 3 got more than its 128 tokens:
    /// let rec = DevErrorRecord { code: error_code::MOE_CAPACITY, a: 3, b: 128, ..Default::default() };
    /// assert_eq!((rec.a, rec.b), (3, 128));
    /// ```
    pub const MOE_CAPACITY: u32 = 12;
    /// The fused MoE combine's finish, where some peer is not reached directly, without
    /// return rows for its results (`a` = the bytes needed, `b` = the return window's size).
    ///
    /// ```
    /// # use ferrolink_device::{comm::error_code, DevErrorRecord};
    /// // 1 MiB of return rows needed, a return window of 0 bytes:
    /// let rec = DevErrorRecord { code: error_code::MOE_FUSED_PATH, a: 1 << 20, b: 0, ..Default::default() };
    /// assert!(rec.a > rec.b);
    /// ```
    pub const MOE_FUSED_PATH: u32 = 13;
}

/// What one slow barrier wait is waiting for (one record per barrier of the communicator,
/// host memory mapped for the device). A wait that has not finished after its fast spin
/// phase writes it once; the host's watchdog reads it, reads the barrier's inbox row to see
/// which peers have not arrived at `epoch`, and reports or aborts. Finished waits leave the
/// record as it is: every peer has then reached `epoch`, which the watchdog sees.
///
/// ```
/// use ferrolink_device::barrier::seq_reached;
/// use ferrolink_device::WaitRecord;
/// // The watchdog's view: a slow wait for epoch 7, and this rank's inbox row of the barrier.
/// let rec = WaitRecord { epoch: 7, cta: 0, active: 1, _reserved: 0 };
/// let inbox = [7u32, 6, 7, 8];
/// let late: Vec<usize> = (0..4).filter(|&p| !seq_reached(inbox[p], rec.epoch)).collect();
/// assert_eq!(late, [1]);
/// ```
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
    ///
    /// ```
    /// # use ferrolink_device::{DevComm, Team};
    /// let comm = DevComm { rank: 6, nranks: 8, lsa_rank: 2, lsa_size: 4, ..Default::default() };
    /// assert_eq!(comm.world(), Team { rank: 6, size: 8, stride: 1 });
    /// ```
    #[inline(always)]
    pub fn world(&self) -> Team {
        Team { rank: self.rank, size: self.nranks, stride: 1 }
    }

    /// The LSA team: the ranks whose windows this rank can load from and store to.
    ///
    /// ```
    /// # use ferrolink_device::{DevComm, Team};
    /// // 8 ranks in 2 LSA domains of 4: world rank 6 is LSA rank 2 of ranks 4..8.
    /// let comm = DevComm { rank: 6, nranks: 8, lsa_rank: 2, lsa_size: 4, ..Default::default() };
    /// assert_eq!(comm.lsa(), Team { rank: 2, size: 4, stride: 1 });
    /// assert_eq!(comm.team_rank_to_world(comm.lsa(), 0), 4);
    /// ```
    #[inline(always)]
    pub fn lsa(&self) -> Team {
        Team { rank: self.lsa_rank, size: self.lsa_size, stride: 1 }
    }

    /// The rail team: the ranks with this rank's LSA rank in every LSA domain.
    ///
    /// ```
    /// # use ferrolink_device::{DevComm, Team};
    /// // 8 ranks in 2 LSA domains of 4: world rank 6's rail is world ranks 2 and 6.
    /// let comm = DevComm { rank: 6, nranks: 8, lsa_rank: 2, lsa_size: 4, ..Default::default() };
    /// assert_eq!(comm.rail(), Team { rank: 1, size: 2, stride: 4 });
    /// assert_eq!(comm.team_rank_to_world(comm.rail(), 0), 2);
    /// ```
    #[inline(always)]
    pub fn rail(&self) -> Team {
        Team { rank: self.rank / self.lsa_size, size: self.nranks / self.lsa_size, stride: self.lsa_size }
    }

    /// The scope LSA synchronization uses (see [`DevComm::lsa_scope_code`]).
    ///
    /// ```
    /// use ferrolink_device::{arch::Scope, DevComm};
    /// // Every LSA peer on this GPU (virtual ranks):
    /// let comm = DevComm { lsa_scope_code: Scope::Gpu.code(), ..Default::default() };
    /// assert_eq!(comm.lsa_scope(), Scope::Gpu);
    /// ```
    #[inline(always)]
    pub fn lsa_scope(&self) -> Scope {
        Scope::from_code(self.lsa_scope_code)
    }

    /// World rank of team rank `r` of `team` (which must contain this rank).
    ///
    /// ```
    /// # use ferrolink_device::DevComm;
    /// let comm = DevComm { rank: 6, nranks: 8, lsa_rank: 2, lsa_size: 4, ..Default::default() };
    /// // The next rank of the LSA domain, with wrap-around: world rank 7.
    /// let lsa = comm.lsa();
    /// assert_eq!(comm.team_rank_to_world(lsa, (lsa.rank + 1) % lsa.size), 7);
    /// ```
    #[inline(always)]
    pub fn team_rank_to_world(&self, team: Team, r: u32) -> u32 {
        (self.rank as i64 + (r as i64 - team.rank as i64) * team.stride as i64) as u32
    }

    /// Team rank of world rank `world` in `team`, or `None` if it is not a member.
    ///
    /// ```
    /// # use ferrolink_device::DevComm;
    /// let comm = DevComm { rank: 6, nranks: 8, lsa_rank: 2, lsa_size: 4, ..Default::default() };
    /// assert_eq!(comm.world_rank_to_team(comm.lsa(), 5), Some(1));
    /// assert_eq!(comm.world_rank_to_team(comm.lsa(), 3), None); // another LSA domain
    /// assert_eq!(comm.world_rank_to_team(comm.rail(), 2), Some(0));
    /// ```
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
    ///
    /// ```
    /// # use ferrolink_device::{comm::DevCommHeader, DevComm};
    /// assert!(DevComm { header: DevCommHeader::CURRENT, ..Default::default() }.header_ok());
    /// assert!(!DevComm::default().header_ok());
    /// ```
    #[inline(always)]
    pub fn header_ok(&self) -> bool {
        self.header == DevCommHeader::CURRENT
    }

    /// Traps unless [`DevComm::header_ok`]: a `DevComm` made by another version of ferrolink
    /// (or not a `DevComm` at all) cannot be trusted to report the error itself.
    ///
    /// ```
    /// # use ferrolink_device::{comm::DevCommHeader, DevComm};
    /// let comm = DevComm { header: DevCommHeader::CURRENT, ..Default::default() };
    /// comm.check_header(); // returns: the header is this version's
    /// ```
    #[inline(always)]
    pub fn check_header(&self) {
        if !self.header_ok() {
            crate::arch::trap();
        }
    }

    /// Whether the host has aborted the communicator (a relaxed system-scope load of
    /// [`DevControl::abort`]; false without a control block). A load from host memory costs
    /// a PCIe round trip: waits call it only after their fast spin phase.
    ///
    /// ```no_run
    /// use ferrolink_device::arch::{self, atomic, LoadOrder};
    /// use ferrolink_device::{Coop, CoopCta, DevComm};
    /// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
    /// /// Thread 0 waits until `*flag >= target`, looking at the abort flag every 64 polls (it is
    /// /// in host memory); the CTA then leaves together. False if the communicator was aborted.
    /// ///
    /// /// # Safety
    /// /// `flag` is a word that peers raise with release stores at the LSA scope; every thread
    /// /// of the CTA calls this.
    /// unsafe fn wait_flag(comm: &DevComm, flag: *const u32, target: u32) -> bool {
    ///     let mut aborted = false;
    ///     if CoopCta.thread_rank() == 0 {
    ///         let mut polls = 0u32;
    ///         // SAFETY: a live word, accessed only atomically (contract).
    ///         while unsafe { atomic::load(flag, LoadOrder::Acquire, comm.lsa_scope()) } < target {
    ///             polls = polls.wrapping_add(1);
    ///             if polls.is_multiple_of(64) && comm.abort_requested() {
    ///                 aborted = true;
    ///                 break;
    ///             }
    ///             arch::spin_wait_hint(64);
    ///         }
    ///     }
    ///     !CoopCta.sync_any(aborted)
    /// }
    /// ```
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
    ///
    /// ```no_run
    /// use ferrolink_device::comm::error_code;
    /// use ferrolink_device::p2p::P2pArgs;
    /// use ferrolink_device::DevComm;
    /// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
    /// /// Checks a group's layout as `p2p::run` does: a bad one is reported to the host (the
    /// /// stream's error names the code and values) and the kernel traps.
    /// fn check_args(comm: &DevComm, args: &P2pArgs) {
    ///     if args.channels == 0 || args.slots == 0 || !(args.chunk as usize).is_multiple_of(16 * args.channels as usize) {
    ///         comm.fail(error_code::P2P_ARGS, u64::from(args.channels) << 32 | u64::from(args.slots), u64::from(args.chunk));
    ///     }
    /// }
    /// ```
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
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use ferrolink_device::{arch, kernel, DevComm};
    /// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
    /// kernel! {
    ///     /// Thread 0 writes 1 into word 0 of this rank's slot of window 0 of the table.
    ///     ///
    ///     /// # Safety
    ///     /// `comm` comes from a live handle whose table holds a window of at least 4 bytes.
    ///     pub unsafe fn mark(comm: DevComm) {
    ///         // SAFETY: the handle is alive (kernel contract).
    ///         let Some(win) = (unsafe { comm.window(0) }) else { arch::trap() };
    ///         if arch::global_thread_idx_x() == 0 {
    ///             // SAFETY: word 0 lies in this rank's slot; only this thread writes it.
    ///             unsafe { win.local_ptr::<u32>(0).write(1) };
    ///         }
    ///     }
    /// }
    /// ```
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
