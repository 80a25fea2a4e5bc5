//! GIN: GPU-initiated networking (NCCL's `ncclGin`): kernels put data into peers' windows,
//! raise signals on them and wait for signals, for peers they may not be able to map.
//!
//! # Backends, chosen per peer
//! * **direct**: a peer in this rank's LSA domain. A put is a copy by the coop's threads
//!   through the peer's flat window mapping; a signal is one `red.release.sys.add` on the
//!   peer's signal slot. No CPU involved.
//! * **proxy**: any other peer (or every peer when the host forces it, `FERROLINK_GIN=proxy`).
//!   One thread of the coop writes a 64-byte [`GinDescriptor`] into a ring in host memory
//!   mapped for the device, one ring per (context, peer); the host's proxy thread executes it
//!   through a transport (copy engine, TCP, RDMA) and reports local completion.
//!
//! # Signals and counters
//! Signal `id` is a set of 64-bit slots on the receiving rank, one per sending rank
//! (`slot[id][src]`, in a symmetric window so that direct peers can add to it): only rank
//! `src` (or the proxy delivering for it) ever changes `slot[id][src]`, so no remote
//! read-modify-write is needed on any path. [`Gin::read_signal`] sums the slots and subtracts
//! the value [`Gin::reset_signal`] recorded (a reset is local: it never races with senders).
//! Counters count local completions (the source of a put may be reused): the direct path
//! adds to a device word, the proxy to a host word, and a read sums the two.
//!
//! # Ordering (strong signals, as NCCL's)
//! A signal raised with a put (or after puts) on one context to one peer becomes visible to
//! the peer only after that put and every earlier put of the same coop on the same context
//! to the same peer has landed:
//! * direct: the coop meets (`coop.sync()`, CTA scope) after its copy, then one thread adds to
//!   the signal slot with a **release at system scope**, which is cumulative and so publishes
//!   every thread's earlier stores; the waiter polls with relaxed loads and issues
//!   `fence.acquire.sys` once the sum is reached.
//! * proxy: the coop meets, then the thread that posts the descriptor writes its fields with
//!   relaxed system-scope stores and its sequence word last with a **release at system
//!   scope** (publishing the descriptor and, cumulatively, the source data the coop wrote);
//!   the proxy reads the sequence word with an acquire load before the fields. The proxy runs
//!   one ring in order, and each transport keeps that order to the peer: the copy engine on
//!   one stream per (context, peer), TCP on one connection per (context, peer), where the
//!   receiver writes the data before the signal. The signal slot is written after the data
//!   in both.
//!
//! Contexts are independent queues; order holds only within one.

use crate::arch::{self, FenceOrder, LoadOrder, RmwOrder, Scope, StoreOrder, atomic};
use crate::barrier::BarrierError;
use crate::comm::{DevComm, Team, error_code};
use crate::coop::Coop;
use crate::window::DevWindow;
use bytemuck::{Pod, Zeroable};

/// Bits of [`DevGin::flags`].
pub mod flags {
    /// The communicator has GIN resources.
    ///
    /// ```
    /// use ferrolink_device::{DevComm, gin::flags};
    /// assert_eq!(DevComm::default().gin.flags & flags::PRESENT, 0); // `Gin::new` would fault
    /// ```
    pub const PRESENT: u32 = 1;
    /// Every peer goes through the proxy, LSA peers too (`FERROLINK_GIN=proxy`).
    ///
    /// ```
    /// use ferrolink_device::gin::{DevGin, flags};
    /// let g = DevGin { flags: flags::PRESENT | flags::FORCE_PROXY, context_count: 1, ..DevGin::default() };
    /// assert_ne!(g.flags & flags::FORCE_PROXY, 0); // what `Gin::uses_proxy` reports
    /// ```
    pub const FORCE_PROXY: u32 = 2;
}

/// A communicator's GIN resources, inside its [`DevComm`] (NCCL's GIN part of
/// `ncclDevComm`).
///
/// ```
/// use ferrolink_device::{DevComm, gin::{DevGin, flags}};
/// // Inside every device communicator; all zero (no GIN) unless the host asked for GIN.
/// let comm = DevComm::default();
/// assert_eq!(comm.gin, DevGin::default());
/// assert_eq!(comm.gin.flags & flags::PRESENT, 0);
/// ```
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct DevGin {
    /// [`flags`].
    pub flags: u32,
    /// Contexts (independent queues); a context index is taken modulo this.
    pub context_count: u32,
    /// Signals, the GIN barriers' included (they are the last `barrier_count`).
    pub signal_count: u32,
    /// Counters.
    pub counter_count: u32,
    /// Descriptors per ring (a power of two).
    pub queue_depth: u32,
    /// The first signal the GIN barriers use (signal `barrier_signal_first + index`).
    pub barrier_signal_first: u32,
    /// GIN barriers.
    pub barrier_count: u32,
    /// Padding.
    pub _reserved: u32,
    /// The signal slots: a symmetric window holding `u64 slot[signal_count][nranks]` per rank.
    pub signals: DevWindow,
    /// Device address of `u64[signal_count]`: what [`Gin::reset_signal`] recorded.
    pub signal_base: u64,
    /// Device address of `u64[counter_count]`: completions of direct puts.
    pub counters: u64,
    /// Host-mapped address of `u64[counter_count]`: completions the proxy reports.
    pub counters_host: u64,
    /// Device address of `u64[counter_count]`: what [`Gin::reset_counter`] recorded.
    pub counter_base: u64,
    /// Host-mapped address of the rings: `GinDescriptor[context][nranks][queue_depth]`.
    pub queues: u64,
    /// Device address of `u64[context][nranks]`: descriptors claimed per ring.
    pub produced: u64,
    /// Host-mapped address of `u64[context][nranks]`: descriptors the proxy has completed
    /// locally (their sources may be reused) per ring.
    pub consumed: u64,
    /// Device address of `u64[context][nranks]`: per ring, the latest `consumed` value a
    /// device thread has read (a lower bound of it). A post reads host memory (a PCIe round
    /// trip) only when this copy shows no free slot.
    pub consumed_seen: u64,
    /// Device address of `u64[barrier_count][1 + nranks]`: per GIN barrier, its round count
    /// (the epoch), then per world rank the barrier signals expected from it so far.
    pub barrier_epochs: u64,
    /// Host-mapped address of `GinWaitRecord[signal_count]`: waits that went slow, for the
    /// host's watchdog (0: none kept).
    pub wait_records: u64,
}

/// A signal wait that went slow, as the host's watchdog reads it (one record per signal, in
/// host-mapped memory). The waiting thread writes the fields, then `state` with a release at
/// system scope, once per wait, and sets `state` back to [`wait_state::IDLE`] when the wait
/// ends; the watchdog reads `state` with an acquire before the fields. Several waiters of one
/// signal share its record: the last one to go slow is described.
///
/// ```
/// use ferrolink_device::gin::{GinWaitRecord, wait_state};
/// // What a slow `wait_signal(coop, id, 5)` of CTA 3 publishes in signal `id`'s record:
/// let r = GinWaitRecord { target: 5, cta: 3, state: wait_state::SIGNAL, ..GinWaitRecord::default() };
/// assert_eq!(core::mem::size_of_val(&r), 32);
/// assert_ne!(r.state, wait_state::IDLE);
/// ```
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct GinWaitRecord {
    /// The value waited for (a signal value; for a GIN barrier, its epoch).
    pub target: u64,
    /// Linear CTA index of the waiter.
    pub cta: u32,
    /// One of [`wait_state`].
    pub state: u32,
    /// GIN barriers: world rank of the team's rank 0, the team's stride and size, the epoch.
    pub team_first: u32,
    /// See `team_first`.
    pub team_stride: u32,
    /// See `team_first`.
    pub team_size: u32,
    /// See `team_first`.
    pub epoch: u32,
}

/// Values of [`GinWaitRecord::state`].
pub mod wait_state {
    /// No slow wait.
    ///
    /// ```
    /// use ferrolink_device::gin::{GinWaitRecord, wait_state};
    /// assert_eq!(GinWaitRecord::default().state, wait_state::IDLE);
    /// ```
    pub const IDLE: u32 = 0;
    /// A `wait_signal` is slow: `target` is a signal value (after resets).
    ///
    /// ```
    /// use ferrolink_device::gin::{GinWaitRecord, wait_state};
    /// let r = GinWaitRecord { target: 2, state: wait_state::SIGNAL, ..GinWaitRecord::default() };
    /// assert_eq!(r.target, 2); // "waits for GIN signal id to reach 2"
    /// ```
    pub const SIGNAL: u32 = 1;
    /// A GIN barrier is slow: the team fields are set; the expected counts are in the
    /// barrier's state.
    ///
    /// ```
    /// use ferrolink_device::gin::{GinWaitRecord, wait_state};
    /// // A GIN barrier over world ranks 0, 1, 2, 3 slow in its fifth round:
    /// let r = GinWaitRecord {
    ///     target: 5, state: wait_state::BARRIER,
    ///     team_first: 0, team_stride: 1, team_size: 4, epoch: 5,
    ///     ..GinWaitRecord::default()
    /// };
    /// assert_eq!(r.team_first + (r.team_size - 1) * r.team_stride, 3); // its last member
    /// ```
    pub const BARRIER: u32 = 2;
    /// A wait for one sender's part of a signal is slow ([`super::Gin::read_signal_from`]):
    /// `target` is the value of `slot[id][team_first]`, `team_first` the sender's world rank.
    ///
    /// ```
    /// use ferrolink_device::gin::{GinWaitRecord, wait_state};
    /// // Waiting for world rank 2's part of a signal to reach 7 (`Gin::note_slow_wait(id, 2, 7)`):
    /// let r = GinWaitRecord { target: 7, state: wait_state::PEER_SIGNAL, team_first: 2, ..GinWaitRecord::default() };
    /// assert_eq!((r.team_first, r.target), (2, 7));
    /// ```
    pub const PEER_SIGNAL: u32 = 3;
}

/// Operations of a [`GinDescriptor`].
pub mod op {
    /// Copy `bytes` from the source window to the destination window.
    ///
    /// ```
    /// use ferrolink_device::gin::{GinDescriptor, desc_flags, op};
    /// let d = GinDescriptor { kind: GinDescriptor::kind(op::PUT, desc_flags::REMOTE_NONE, 0), ..GinDescriptor::default() };
    /// assert_eq!(d.op(), op::PUT);
    /// ```
    pub const PUT: u32 = 1;
    /// Store `bytes` (1, 2, 4 or 8) bytes of `value` into the destination window.
    ///
    /// ```
    /// use ferrolink_device::gin::{GinDescriptor, desc_flags, op};
    /// // An 8-byte value, raising a signal by one:
    /// let d = GinDescriptor {
    ///     kind: GinDescriptor::kind(op::PUT_VALUE, desc_flags::REMOTE_SIGNAL_INC, 8),
    ///     bytes_or_value: 42,
    ///     ..GinDescriptor::default()
    /// };
    /// assert_eq!((d.op(), d.value_bytes()), (op::PUT_VALUE, 8));
    /// ```
    pub const PUT_VALUE: u32 = 2;
    /// Only the remote action.
    ///
    /// ```
    /// use ferrolink_device::gin::{GinDescriptor, desc_flags, op};
    /// let d = GinDescriptor {
    ///     kind: GinDescriptor::kind(op::SIGNAL, desc_flags::REMOTE_SIGNAL_ADD, 0),
    ///     signal_id: 1,
    ///     signal_value: 3,
    ///     ..GinDescriptor::default()
    /// };
    /// assert_eq!(d.flags() & desc_flags::REMOTE_MASK, desc_flags::REMOTE_SIGNAL_ADD);
    /// ```
    pub const SIGNAL: u32 = 3;
}

/// Bits of [`GinDescriptor::flags`].
pub mod desc_flags {
    /// Remote action: none.
    ///
    /// ```
    /// use ferrolink_device::gin::desc_flags;
    /// // A put that only counts its local completion raises nothing remotely:
    /// assert_eq!(desc_flags::LOCAL_COUNTER_INC & desc_flags::REMOTE_MASK, desc_flags::REMOTE_NONE);
    /// ```
    pub const REMOTE_NONE: u32 = 0;
    /// Remote action: add 1 to signal `signal_id`.
    ///
    /// ```
    /// use ferrolink_device::gin::{GinDescriptor, desc_flags, op};
    /// let kind = GinDescriptor::kind(op::PUT, desc_flags::REMOTE_SIGNAL_INC, 0);
    /// let d = GinDescriptor { kind, signal_id: 4, signal_value: 1, ..GinDescriptor::default() };
    /// assert_eq!(d.flags(), desc_flags::REMOTE_SIGNAL_INC);
    /// ```
    pub const REMOTE_SIGNAL_INC: u32 = 1;
    /// Remote action: add `signal_value` to signal `signal_id`.
    ///
    /// ```
    /// use ferrolink_device::gin::{GinDescriptor, desc_flags, op};
    /// let kind = GinDescriptor::kind(op::SIGNAL, desc_flags::REMOTE_SIGNAL_ADD, 0);
    /// let d = GinDescriptor { kind, signal_id: 4, signal_value: 10, ..GinDescriptor::default() };
    /// assert_eq!(d.flags(), desc_flags::REMOTE_SIGNAL_ADD);
    /// ```
    pub const REMOTE_SIGNAL_ADD: u32 = 2;
    /// Mask of the remote action.
    ///
    /// ```
    /// use ferrolink_device::gin::desc_flags;
    /// let f = desc_flags::REMOTE_SIGNAL_ADD | desc_flags::LOCAL_COUNTER_INC;
    /// assert_eq!(f & desc_flags::REMOTE_MASK, desc_flags::REMOTE_SIGNAL_ADD);
    /// ```
    pub const REMOTE_MASK: u32 = 3;
    /// Local action: add 1 to counter `counter_id` once the source may be reused.
    ///
    /// ```
    /// use ferrolink_device::gin::{GinDescriptor, desc_flags, op};
    /// let kind = GinDescriptor::kind(op::PUT, desc_flags::REMOTE_NONE | desc_flags::LOCAL_COUNTER_INC, 0);
    /// let d = GinDescriptor { kind, counter_id: 2, ..GinDescriptor::default() };
    /// assert_ne!(d.flags() & desc_flags::LOCAL_COUNTER_INC, 0);
    /// ```
    pub const LOCAL_COUNTER_INC: u32 = 4;
}

/// One proxy request, 64 bytes, in a ring in host memory (written by one GPU thread, read by
/// the proxy). `seq` is written last with a release: the ticket of the slot plus one (0 =
/// empty); the proxy accepts the slot when `seq` equals the ticket it expects.
///
/// ```
/// use ferrolink_device::gin::{GinDescriptor, desc_flags, op};
/// // What the proxy path of `Gin::put` posts: 4096 bytes from window 0 at offset 0 into world
/// // rank 3's window 1 at offset 8192, raising signal 2 there by one.
/// let d = GinDescriptor {
///     kind: GinDescriptor::kind(op::PUT, desc_flags::REMOTE_SIGNAL_INC, 0),
///     peer: 3,
///     dst_window: 1,
///     src_window: 0,
///     signal_id: 2,
///     dst_offset: 8192,
///     bytes_or_value: 4096,
///     signal_value: 1,
///     ..GinDescriptor::default()
/// };
/// assert_eq!(core::mem::size_of_val(&d), 64);
/// assert_eq!(d.seq, 0); // empty until the posting thread writes `ticket + 1`, last
/// ```
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct GinDescriptor {
    /// Ticket + 1.
    pub seq: u64,
    /// The operation ([`op`], bits 0–7), its [`desc_flags`] (bits 8–15) and, for `PUT_VALUE`,
    /// the bytes of the value to store (1, 2, 4, 8; bits 16–23): see [`GinDescriptor::kind`].
    pub kind: u32,
    /// Destination world rank.
    pub peer: u32,
    /// Destination window ([`DevWindow::id`]).
    pub dst_window: u32,
    /// Source window (`PUT`).
    pub src_window: u32,
    /// Signal of the remote action.
    pub signal_id: u32,
    /// Counter of the local action.
    pub counter_id: u32,
    /// Destination offset.
    pub dst_offset: u64,
    /// Source offset (`PUT`).
    pub src_offset: u64,
    /// `PUT`: bytes; `PUT_VALUE`: the value.
    pub bytes_or_value: u64,
    /// `REMOTE_SIGNAL_ADD`: the amount.
    pub signal_value: u64,
}

impl GinDescriptor {
    /// Packs an operation, its flags and a value size into [`GinDescriptor::kind`].
    ///
    /// ```
    /// use ferrolink_device::gin::{GinDescriptor, desc_flags, op};
    /// assert_eq!(GinDescriptor::kind(op::PUT_VALUE, desc_flags::REMOTE_SIGNAL_INC, 4), 0x04_01_02);
    /// ```
    pub const fn kind(op: u32, flags: u32, value_bytes: u32) -> u32 {
        (op & 0xFF) | ((flags & 0xFF) << 8) | ((value_bytes & 0xFF) << 16)
    }
    /// The operation ([`op`]).
    ///
    /// ```
    /// use ferrolink_device::gin::{GinDescriptor, op};
    /// let d = GinDescriptor { kind: GinDescriptor::kind(op::SIGNAL, 0, 0), ..GinDescriptor::default() };
    /// assert_eq!(d.op(), op::SIGNAL);
    /// ```
    pub const fn op(&self) -> u32 {
        self.kind & 0xFF
    }
    /// The [`desc_flags`].
    ///
    /// ```
    /// use ferrolink_device::gin::{GinDescriptor, desc_flags, op};
    /// let f = desc_flags::REMOTE_SIGNAL_INC | desc_flags::LOCAL_COUNTER_INC;
    /// let d = GinDescriptor { kind: GinDescriptor::kind(op::PUT, f, 0), ..GinDescriptor::default() };
    /// assert_eq!(d.flags(), f);
    /// ```
    pub const fn flags(&self) -> u32 {
        (self.kind >> 8) & 0xFF
    }
    /// `PUT_VALUE`: the bytes of the value to store.
    ///
    /// ```
    /// use ferrolink_device::gin::{GinDescriptor, op};
    /// let d = GinDescriptor { kind: GinDescriptor::kind(op::PUT_VALUE, 0, 2), ..GinDescriptor::default() };
    /// assert_eq!(d.value_bytes(), 2);
    /// ```
    pub const fn value_bytes(&self) -> u32 {
        (self.kind >> 16) & 0xFF
    }
}

/// What a put or signal does on the receiving rank once its data has landed.
///
/// ```
/// use ferrolink_device::gin::RemoteAction;
/// // How much each adds to its signal (what a descriptor's `signal_value` carries):
/// let amount = |r: RemoteAction| match r {
///     RemoteAction::None => 0,
///     RemoteAction::SignalInc(_) => 1,
///     RemoteAction::SignalAdd(_, v) => v,
/// };
/// assert_eq!(amount(RemoteAction::SignalInc(2)), 1);
/// assert_eq!(amount(RemoteAction::SignalAdd(2, 5)), 5);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RemoteAction {
    /// Nothing.
    None,
    /// Add 1 to signal `id` (NCCL's `ncclGin_SignalInc`).
    SignalInc(u32),
    /// Add `value` to signal `id` (NCCL's `ncclGin_SignalAdd`).
    SignalAdd(u32, u64),
}

/// What a put does on this rank once its source may be reused.
///
/// ```
/// use ferrolink_device::gin::LocalAction;
/// // Count this put's local completion on counter 0 (`Gin::read_counter(0)`), or not at all:
/// let (counted, not) = (LocalAction::CounterInc(0), LocalAction::None);
/// assert_ne!(counted, not);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LocalAction {
    /// Nothing.
    None,
    /// Add 1 to counter `id` (NCCL's `ncclGin_CounterInc`).
    CounterInc(u32),
}

/// Polls before a wait starts looking at the clock, the abort flag, and backing off.
const FAST_POLLS: u32 = if cfg!(target_arch = "nvptx64") { 2048 } else { 1 };

/// A waiter for ring credit or a flush that is not the ring's next waiter reads the host's
/// `consumed` word only every this many polls; between, it reads the device's copy. Reads of
/// host memory cross PCIe, and many warps polling it slow the proxy's own copies over PCIe
/// several-fold (benches/cuda/copies_under_held_sms.cu, docs/PERF.md 2026-12-06: 4 KiB copies
/// took 0.2 ms beside kernels reading no memory, 0.6-1.3 ms beside one host reader per CTA
/// with 100 ns sleeps, 1.3-5 ms beside one per warp or per thread).
const HOST_POLL_EVERY: u32 = 64;

/// As [`HOST_POLL_EVERY`] for a flush, whose waiter has no one else refreshing the copy for it
/// (one thread per coop: a shorter interval, for the flush's latency).
const FLUSH_HOST_POLL_EVERY: u32 = 8;

/// One context of a communicator's GIN (NCCL's `ncclGin(devComm, context)`). Every method
/// that takes a coop is called by every thread of the coop with the same arguments.
///
/// ```no_run
/// use ferrolink_device::gin::{Gin, LocalAction, RemoteAction};
/// use ferrolink_device::{Coop, CoopCta, DevComm, DevWindow, arch, kernel};
/// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
/// kernel! {
///     /// Every rank puts its `bytes` of `src` into block `me` of every other rank's `dst`,
///     /// CTA `b` on context `b` for peers `p % grid == b`, raising signal 0; then waits for
///     /// the blocks of all `nranks - 1` others. `round`: 1, 2, … (the number of this call).
///     pub unsafe fn my_gather(comm: DevComm, dst: DevWindow, src: DevWindow, bytes: u32, round: u32) {
///         let (coop, b, grid) = (CoopCta, arch::block_idx_x() as u32, arch::grid_dim_x() as u32);
///         let gin = Gin::new(&comm, b);
///         let (me, n, bytes) = (comm.rank, comm.nranks, bytes as usize);
///         let mut p = b;
///         while p < n {
///             if p != me {
///                 // SAFETY: both ranges lie in the windows (checked too); `src` is not
///                 // written during the call and block `me` of `dst` has this rank as its
///                 // only writer, read by its owner after the signal.
///                 unsafe {
///                     gin.put(coop, comm.world(), p, dst, me as usize * bytes, src, 0, bytes,
///                             RemoteAction::SignalInc(0), LocalAction::None)
///                 };
///             }
///             p += grid;
///         }
///         // Strong signals: once signal 0 has counted every block, every block has landed.
///         if gin.wait_signal(coop, 0, u64::from(round) * u64::from(n - 1)).is_err() {
///             return; // aborted: the host reports it
///         }
///         gin.flush(coop);
///     }
/// }
/// ```
#[derive(Clone, Copy)]
pub struct Gin<'a> {
    comm: &'a DevComm,
    ctx: u32,
}

impl<'a> Gin<'a> {
    /// Context `context` (taken modulo the communicator's context count) of `comm`'s GIN. A
    /// `DevComm` without GIN resources is a fault: the kernel reports it and traps.
    ///
    /// ```no_run
    /// # use ferrolink_device::{Coop, CoopCta, CoopThread, DevComm, DevWindow};
    /// # use ferrolink_device::gin::{Gin, GinBarrierSession, LocalAction, RemoteAction, hybrid_sync};
    /// # use ferrolink_device::barrier::BarrierError;
    /// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
    /// fn my_kernel(comm: &DevComm) {
    ///     // CTA `b` on its own context (contexts are independent queues).
    ///     let gin = Gin::new(comm, ferrolink_device::arch::block_idx_x() as u32);
    ///     # let _ = gin;
    /// }
    /// ```
    #[inline(always)]
    pub fn new(comm: &'a DevComm, context: u32) -> Gin<'a> {
        comm.check_header();
        let g = &comm.gin;
        if g.flags & flags::PRESENT == 0 || g.context_count == 0 {
            comm.fail(error_code::GIN_ABSENT, 0, 0);
        }
        Gin { comm, ctx: context % g.context_count }
    }

    /// The communicator.
    ///
    /// ```no_run
    /// # use ferrolink_device::{Coop, CoopCta, CoopThread, DevComm, DevWindow};
    /// # use ferrolink_device::gin::{Gin, GinBarrierSession, LocalAction, RemoteAction, hybrid_sync};
    /// # use ferrolink_device::barrier::BarrierError;
    /// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
    /// fn peers(gin: &Gin<'_>) -> u32 {
    ///     gin.comm().nranks - 1
    /// }
    /// ```
    #[inline(always)]
    pub fn comm(&self) -> &'a DevComm {
        self.comm
    }

    #[inline(always)]
    fn g(&self) -> &'a DevGin {
        &self.comm.gin
    }

    /// World rank of team rank `peer` (checked).
    #[inline(always)]
    fn world(&self, team: Team, peer: u32) -> u32 {
        if peer >= team.size {
            self.comm.fail(error_code::GIN_PEER, u64::from(peer), u64::from(team.size));
        }
        self.comm.team_rank_to_world(team, peer)
    }

    /// Whether `world` is reached directly (in this rank's LSA domain, not forced through
    /// the proxy).
    #[inline(always)]
    fn direct(&self, world: u32) -> bool {
        let c = self.comm;
        self.g().flags & flags::FORCE_PROXY == 0 && world / c.lsa_size == c.rank / c.lsa_size
    }

    #[inline(always)]
    fn check_signal(&self, id: u32) {
        // The user's signals are `0..barrier_signal_first`; the GIN barriers' come after.
        if id >= self.g().barrier_signal_first {
            self.comm.fail(error_code::GIN_SIGNAL_ID, u64::from(id), u64::from(self.g().barrier_signal_first));
        }
    }

    #[inline(always)]
    fn check_counter(&self, id: u32) {
        if id >= self.g().counter_count {
            self.comm.fail(error_code::GIN_COUNTER_ID, u64::from(id), u64::from(self.g().counter_count));
        }
    }

    #[inline(always)]
    fn check_range(&self, w: &DevWindow, offset: usize, bytes: usize) {
        if offset.checked_add(bytes).is_none_or(|end| end as u64 > w.size) {
            self.comm.fail(error_code::GIN_RANGE, offset as u64, (u64::from(w.id) << 48) | w.size);
        }
    }

    /// Address of `slot[id][src]` in LSA rank `lsa_peer`'s signal window.
    #[inline(always)]
    fn signal_slot(&self, id: u32, src: u32, lsa_peer: u32) -> *mut u64 {
        self.g().signals.lsa_ptr((id as usize * self.comm.nranks as usize + src as usize) * 8, lsa_peer)
    }

    /// Puts `bytes` bytes from this rank's `src` window at `src_offset` into team rank
    /// `peer`'s `dst` window at `dst_offset` (NCCL's `ncclGin::put`), then does the actions:
    /// `remote` on the peer once the data has landed (ordering: see the module docs), `local`
    /// here once the source may be reused. Ranges outside the windows, a peer outside the
    /// team and unknown signal or counter ids are faults (reported, then a trap).
    ///
    /// # Safety
    /// `src` and `dst` are windows of this communicator (from live handles); nothing writes
    /// the source range while the put reads it, and nothing else writes the destination range
    /// until the peer has seen the put's signal.
    ///
    /// ```no_run
    /// # use ferrolink_device::{Coop, CoopCta, CoopThread, DevComm, DevWindow};
    /// # use ferrolink_device::gin::{Gin, GinBarrierSession, LocalAction, RemoteAction, hybrid_sync};
    /// # use ferrolink_device::barrier::BarrierError;
    /// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
    /// /// Puts `bytes` of `src` into block `me` of `peer`'s `dst`, raising signal 0 there and
    /// /// counter 0 here once `src` may be reused.
    /// fn send_block(comm: &DevComm, dst: DevWindow, src: DevWindow, peer: u32, bytes: usize) {
    ///     let (coop, gin) = (CoopCta, Gin::new(comm, 0));
    ///     // SAFETY: both ranges lie in the windows (checked too); nothing writes `src` until
    ///     // counter 0 counts this put, nor block `me` of the peer's `dst` until the peer saw signal 0.
    ///     unsafe {
    ///         gin.put(coop, comm.world(), peer, dst, comm.rank as usize * bytes, src, 0, bytes,
    ///                 RemoteAction::SignalInc(0), LocalAction::CounterInc(0))
    ///     };
    /// }
    /// ```
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn put<C: Coop>(
        &self,
        coop: C,
        team: Team,
        peer: u32,
        dst: DevWindow,
        dst_offset: usize,
        src: DevWindow,
        src_offset: usize,
        bytes: usize,
        remote: RemoteAction,
        local: LocalAction,
    ) {
        let world = self.world(team, peer);
        self.check_range(&dst, dst_offset, bytes);
        self.check_range(&src, src_offset, bytes);
        self.check_actions(remote, local);
        // The coop's earlier stores (the source, typically) are read by every thread below.
        coop.sync();
        if self.direct(world) {
            let lsa_peer = world % self.comm.lsa_size;
            // SAFETY: both ranges were checked against their windows; the caller vouches for
            // the windows and for no racing writes.
            unsafe {
                crate::kernels::copy::copy_bytes(
                    dst.lsa_ptr(dst_offset, lsa_peer),
                    src.local_ptr(src_offset),
                    bytes,
                    coop.thread_rank(),
                    coop.size(),
                )
            };
            coop.sync();
            if coop.thread_rank() == 0 {
                self.remote_direct(lsa_peer, remote);
                self.local_direct(local);
            }
        } else if coop.thread_rank() == 0 {
            let src_ptr: *const u8 = src.local_ptr(src_offset);
            let inline =
                matches!(bytes, 4 | 8) && dst_offset.is_multiple_of(bytes) && (src_ptr as usize).is_multiple_of(bytes);
            if inline {
                // A small aligned put travels as a value in its descriptor: the proxy need not
                // read the source (no copy to queue; the copy engine writes a value). Reading
                // it now is allowed: the source may not change until local completion.
                // SAFETY: the range was checked against the source window; aligned for `bytes`.
                let value = unsafe {
                    if bytes == 8 {
                        (src_ptr as *const u64).read_volatile()
                    } else {
                        u64::from((src_ptr as *const u32).read_volatile())
                    }
                };
                let d = GinDescriptor {
                    kind: GinDescriptor::kind(op::PUT_VALUE, remote_flags(remote) | local_flags(local), bytes as u32),
                    peer: world,
                    dst_window: dst.id,
                    signal_id: remote_id(remote),
                    counter_id: local_id(local),
                    dst_offset: dst_offset as u64,
                    bytes_or_value: value,
                    signal_value: remote_value(remote),
                    ..GinDescriptor::default()
                };
                self.post(world, d);
            } else {
                let d = GinDescriptor {
                    kind: GinDescriptor::kind(op::PUT, remote_flags(remote) | local_flags(local), 0),
                    peer: world,
                    dst_window: dst.id,
                    src_window: src.id,
                    signal_id: remote_id(remote),
                    counter_id: local_id(local),
                    dst_offset: dst_offset as u64,
                    src_offset: src_offset as u64,
                    bytes_or_value: bytes as u64,
                    signal_value: remote_value(remote),
                    ..GinDescriptor::default()
                };
                self.post(world, d);
            }
        }
        coop.sync();
    }

    /// Stores the low `bytes` (1, 2, 4 or 8) bytes of `value` into team rank `peer`'s `dst`
    /// window at `dst_offset` (NCCL's `putValue`), then does `remote` there.
    ///
    /// # Safety
    /// As [`Gin::put`] for the destination.
    ///
    /// ```no_run
    /// # use ferrolink_device::{Coop, CoopCta, CoopThread, DevComm, DevWindow};
    /// # use ferrolink_device::gin::{Gin, GinBarrierSession, LocalAction, RemoteAction, hybrid_sync};
    /// # use ferrolink_device::barrier::BarrierError;
    /// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
    /// /// Stores `v` into word `me` of `peer`'s `dst` and raises signal 0 there.
    /// fn send_value(comm: &DevComm, dst: DevWindow, peer: u32, v: u64) {
    ///     let gin = Gin::new(comm, 0);
    ///     // SAFETY: word `me` of `dst` lies in the window, 8-byte aligned; this rank is its only
    ///     // writer, and the peer reads it after signal 0.
    ///     unsafe { gin.put_value(CoopCta, comm.world(), peer, dst, comm.rank as usize * 8, v, 8, RemoteAction::SignalInc(0)) };
    /// }
    /// ```
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn put_value<C: Coop>(
        &self,
        coop: C,
        team: Team,
        peer: u32,
        dst: DevWindow,
        dst_offset: usize,
        value: u64,
        bytes: u32,
        remote: RemoteAction,
    ) {
        let world = self.world(team, peer);
        if !matches!(bytes, 1 | 2 | 4 | 8) || !dst_offset.is_multiple_of(bytes as usize) {
            self.comm.fail(error_code::GIN_RANGE, dst_offset as u64, u64::from(bytes));
        }
        self.check_range(&dst, dst_offset, bytes as usize);
        self.check_actions(remote, LocalAction::None);
        coop.sync();
        if coop.thread_rank() == 0 {
            if self.direct(world) {
                let lsa_peer = world % self.comm.lsa_size;
                let p: *mut u8 = dst.lsa_ptr(dst_offset, lsa_peer);
                // SAFETY: the range was checked and is naturally aligned for its size; the
                // caller vouches for the window.
                unsafe {
                    match bytes {
                        1 => p.write_volatile(value as u8),
                        2 => (p as *mut u16).write_volatile(value as u16),
                        4 => (p as *mut u32).write_volatile(value as u32),
                        _ => (p as *mut u64).write_volatile(value),
                    }
                }
                self.remote_direct(lsa_peer, remote);
            } else {
                let d = GinDescriptor {
                    kind: GinDescriptor::kind(op::PUT_VALUE, remote_flags(remote), bytes),
                    peer: world,
                    dst_window: dst.id,
                    signal_id: remote_id(remote),
                    dst_offset: dst_offset as u64,
                    bytes_or_value: value,
                    signal_value: remote_value(remote),
                    ..GinDescriptor::default()
                };
                self.post(world, d);
            }
        }
        coop.sync();
    }

    /// Raises `remote` on team rank `peer` after every earlier put of this coop on this
    /// context to that peer has landed (NCCL's `signal`).
    ///
    /// ```no_run
    /// # use ferrolink_device::{Coop, CoopCta, CoopThread, DevComm, DevWindow};
    /// # use ferrolink_device::gin::{Gin, GinBarrierSession, LocalAction, RemoteAction, hybrid_sync};
    /// # use ferrolink_device::barrier::BarrierError;
    /// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
    /// /// World rank `b`'s answer to `a`'s puts: waits until signal 0 counts them (`round`: 1, 2,
    /// /// … per call), then tells `a` with signal 1.
    /// fn answer(comm: &DevComm, a: u32, round: u32) {
    ///     let (coop, gin) = (CoopCta, Gin::new(comm, 0));
    ///     if gin.wait_signal(coop, 0, u64::from(round)).is_ok() {
    ///         gin.signal(coop, comm.world(), a, RemoteAction::SignalInc(1));
    ///     }
    ///     gin.flush(coop);
    /// }
    /// ```
    #[inline(always)]
    pub fn signal<C: Coop>(&self, coop: C, team: Team, peer: u32, remote: RemoteAction) {
        let world = self.world(team, peer);
        self.check_actions(remote, LocalAction::None);
        coop.sync();
        if coop.thread_rank() == 0 {
            self.signal_from_thread(world, remote);
        }
        coop.sync();
    }

    /// [`Gin::signal`] by one thread on its own (no coop barrier): for loops where each thread
    /// signals a different peer, after the caller's own synchronization.
    ///
    /// ```no_run
    /// # use ferrolink_device::{Coop, CoopCta, CoopThread, DevComm, DevWindow};
    /// # use ferrolink_device::gin::{Gin, GinBarrierSession, LocalAction, RemoteAction, hybrid_sync};
    /// # use ferrolink_device::barrier::BarrierError;
    /// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
    /// /// Raises signal `id` on every other rank, the CTA's threads sharing the peers.
    /// fn signal_all(comm: &DevComm, id: u32) {
    ///     let (coop, gin) = (CoopCta, Gin::new(comm, 0));
    ///     coop.sync(); // the CTA's earlier stores and puts come first
    ///     let mut p = coop.thread_rank() as u32;
    ///     while p < comm.nranks {
    ///         if p != comm.rank {
    ///             gin.signal_from_thread(p, RemoteAction::SignalInc(id)); // `p`: a world rank
    ///         }
    ///         p += coop.size() as u32;
    ///     }
    ///     coop.sync();
    /// }
    /// ```
    #[inline(always)]
    pub fn signal_from_thread(&self, world: u32, remote: RemoteAction) {
        if self.direct(world) {
            self.remote_direct(world % self.comm.lsa_size, remote);
        } else {
            let d = GinDescriptor {
                kind: GinDescriptor::kind(op::SIGNAL, remote_flags(remote), 0),
                peer: world,
                signal_id: remote_id(remote),
                signal_value: remote_value(remote),
                ..GinDescriptor::default()
            };
            self.post(world, d);
        }
    }

    /// Waits until every put of this context issued so far by this rank is complete locally:
    /// their sources may be reused (NCCL's `flush`). Not remote completion: wait for a
    /// signal for that.
    ///
    /// ```no_run
    /// # use ferrolink_device::{Coop, CoopCta, CoopThread, DevComm, DevWindow};
    /// # use ferrolink_device::gin::{Gin, GinBarrierSession, LocalAction, RemoteAction, hybrid_sync};
    /// # use ferrolink_device::barrier::BarrierError;
    /// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
    /// /// Puts `src` to `peer`, then writes `src` again for the next round.
    /// fn put_then_refill(comm: &DevComm, dst: DevWindow, src: DevWindow, peer: u32, bytes: usize) {
    ///     let (coop, gin) = (CoopCta, Gin::new(comm, 0));
    ///     // SAFETY: ranges inside the windows (checked too); `src` is not written before the
    ///     // flush, and the peer's `dst` is written only by this rank, read after signal 0.
    ///     unsafe { gin.put(coop, comm.world(), peer, dst, 0, src, 0, bytes, RemoteAction::SignalInc(0), LocalAction::None) };
    ///     gin.flush(coop);
    ///     // The put has read `src`: it may change now (the peer may not have the data yet).
    ///     if coop.thread_rank() == 0 {
    ///         // SAFETY: this rank's `src`, which no put reads any more.
    ///         unsafe { src.local_ptr::<u8>(0).write_volatile(1) };
    ///     }
    /// }
    /// ```
    #[inline(always)]
    pub fn flush<C: Coop>(&self, coop: C) {
        coop.sync();
        if coop.thread_rank() == 0 {
            for p in 0..self.comm.nranks {
                if self.direct(p) {
                    continue;
                }
                let ring = self.ring(p);
                // SAFETY: `produced` holds a word per ring (device memory).
                let produced = unsafe { atomic::load(self.produced(ring), LoadOrder::Relaxed, Scope::Gpu) };
                let polls = core::cell::Cell::new(0u32);
                let _ = self.poll(
                    || {
                        // The device's copy first; the host's word every FLUSH_HOST_POLL_EVERY
                        // polls (and at once), refreshing the copy. Both only grow.
                        let n = polls.get();
                        polls.set(n.wrapping_add(1));
                        let c = if n.is_multiple_of(FLUSH_HOST_POLL_EVERY) {
                            self.consumed_from_host(ring)
                        } else {
                            self.consumed_seen_copy(ring)
                        };
                        c.wrapping_sub(produced) as i64 >= 0
                    },
                    None,
                );
            }
            arch::atomic::fence(FenceOrder::Acquire, Scope::Sys);
        }
        coop.sync();
    }

    /// Signal `id`'s value: the sum of its slots, minus what the last reset recorded.
    ///
    /// ```no_run
    /// # use ferrolink_device::{Coop, CoopCta, CoopThread, DevComm, DevWindow};
    /// # use ferrolink_device::gin::{Gin, GinBarrierSession, LocalAction, RemoteAction, hybrid_sync};
    /// # use ferrolink_device::barrier::BarrierError;
    /// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
    /// /// After `ops` values sent to this rank with SignalInc(0): whether signal 0 counts exactly them.
    /// fn all_arrived(comm: &DevComm, ops: u32) -> bool {
    ///     let (coop, gin) = (CoopCta, Gin::new(comm, 0));
    ///     gin.wait_signal(coop, 0, u64::from(ops)).is_ok() && gin.read_signal(0) == u64::from(ops)
    /// }
    /// ```
    #[inline(always)]
    pub fn read_signal(&self, id: u32) -> u64 {
        self.check_signal(id);
        // SAFETY: `signal_base` holds a word per signal.
        let base = unsafe {
            atomic::load((self.g().signal_base as *const u64).add(id as usize), LoadOrder::Relaxed, Scope::Gpu)
        };
        self.signal_sum(id).wrapping_sub(base)
    }

    #[inline(always)]
    fn signal_sum(&self, id: u32) -> u64 {
        let me = self.comm.lsa_rank;
        let mut sum = 0u64;
        for src in 0..self.comm.nranks {
            // SAFETY: the slot lies in this rank's signal window (id checked by the callers);
            // senders change it only atomically.
            sum = sum
                .wrapping_add(unsafe { atomic::load(self.signal_slot(id, src, me), LoadOrder::Relaxed, Scope::Sys) });
        }
        sum
    }

    /// Waits until signal `id` reaches `least` (a rolling compare: `value - least` as a signed
    /// number is not negative), then acquires what the signals' senders released. Returns
    /// early, with the same result on every thread of the coop, if the communicator is
    /// aborted.
    ///
    /// ```no_run
    /// # use ferrolink_device::{Coop, CoopCta, CoopThread, DevComm, DevWindow};
    /// # use ferrolink_device::gin::{Gin, GinBarrierSession, LocalAction, RemoteAction, hybrid_sync};
    /// # use ferrolink_device::barrier::BarrierError;
    /// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
    /// /// Each of the `nranks - 1` peers puts one block per call with SignalInc(`sig`); `round`
    /// /// is the number of this call (1, 2, …).
    /// fn wait_blocks(comm: &DevComm, sig: u32, round: u32) -> Result<(), BarrierError> {
    ///     let gin = Gin::new(comm, 0);
    ///     gin.wait_signal(CoopCta, sig, u64::from(round) * u64::from(comm.nranks - 1))?;
    ///     // Every peer's block of this call is visible to every thread of the CTA here.
    ///     Ok(())
    /// }
    /// ```
    #[inline(always)]
    pub fn wait_signal<C: Coop>(&self, coop: C, id: u32, least: u64) -> Result<(), BarrierError> {
        self.wait_signal_until(coop, id, least, None)
    }

    /// [`Gin::wait_signal`] that gives up after `timeout_ns` of `%globaltimer`.
    ///
    /// ```no_run
    /// # use ferrolink_device::{Coop, CoopCta, CoopThread, DevComm, DevWindow};
    /// # use ferrolink_device::gin::{Gin, GinBarrierSession, LocalAction, RemoteAction, hybrid_sync};
    /// # use ferrolink_device::barrier::BarrierError;
    /// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
    /// fn wait_one_second(comm: &DevComm) -> bool {
    ///     let gin = Gin::new(comm, 0);
    ///     match gin.wait_signal_timeout(CoopCta, 0, 1, 1_000_000_000) {
    ///         Ok(()) => true,
    ///         Err(BarrierError::Timeout) => false, // a second passed: signal 0 is still below 1
    ///         Err(BarrierError::Aborted) => false,
    ///     }
    /// }
    /// ```
    #[inline(always)]
    pub fn wait_signal_timeout<C: Coop>(
        &self,
        coop: C,
        id: u32,
        least: u64,
        timeout_ns: u64,
    ) -> Result<(), BarrierError> {
        let deadline = arch::global_timer_ns().saturating_add(timeout_ns);
        self.wait_signal_until(coop, id, least, Some(deadline))
    }

    /// Waits until every world rank's part of signal `id` (its slot, not counting resets)
    /// has reached `least` (a rolling compare), then acquires what they released. For
    /// protocols in which every rank adds once per round: there a total could be reached
    /// with a fast rank's add for the next round standing in for a slow rank's add for this
    /// one (on another path, it may still be on its way). Every rank's slot counts, this
    /// rank's own too: a protocol in which a rank does not signal itself never ends this
    /// wait. A slow wait names the rank it waits for. Returns early, with the same result on
    /// every thread of the coop, if the communicator is aborted.
    ///
    /// ```no_run
    /// # use ferrolink_device::{Coop, CoopCta, CoopThread, DevComm, DevWindow};
    /// # use ferrolink_device::gin::{Gin, GinBarrierSession, LocalAction, RemoteAction, hybrid_sync};
    /// # use ferrolink_device::barrier::BarrierError;
    /// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
    /// /// Every rank, this one too, puts its `bytes` of `src` into row `me` of every rank's `dst`
    /// /// with SignalInc(0), once per call; `epoch` is the number of this call (1, 2, …).
    /// fn exchange_rows(comm: &DevComm, dst: DevWindow, src: DevWindow, bytes: usize, epoch: u32) -> bool {
    ///     let (coop, gin) = (CoopCta, Gin::new(comm, 0));
    ///     for p in 0..comm.nranks {
    ///         // SAFETY: ranges inside the windows (checked too); row `me` of each `dst` has this
    ///         // rank as its only writer; `src` is not written during the call.
    ///         unsafe {
    ///             gin.put(coop, comm.world(), p, dst, comm.rank as usize * bytes, src, 0, bytes,
    ///                     RemoteAction::SignalInc(0), LocalAction::None)
    ///         };
    ///     }
    ///     // Each rank's own part must reach `epoch`: a total of `epoch * nranks` could be
    ///     // reached by a fast rank's next call while a slow rank's row is still on its way.
    ///     let ok = gin.wait_signal_each(coop, 0, u64::from(epoch)).is_ok();
    ///     gin.flush(coop);
    ///     ok
    /// }
    /// ```
    #[inline(always)]
    pub fn wait_signal_each<C: Coop>(&self, coop: C, id: u32, least: u64) -> Result<(), BarrierError> {
        self.check_signal(id);
        let mut end = Ok(());
        if coop.thread_rank() == 0 {
            for src in 0..self.comm.nranks {
                let record = GinWaitRecord {
                    target: least,
                    state: wait_state::PEER_SIGNAL,
                    team_first: src,
                    ..GinWaitRecord::default()
                };
                end = self.poll_recorded(
                    || self.read_signal_from(id, src).wrapping_sub(least) as i64 >= 0,
                    None,
                    Some((id, record)),
                );
                if end.is_err() {
                    break;
                }
            }
            arch::atomic::fence(FenceOrder::Acquire, Scope::Sys);
        }
        uniform(coop, end)
    }

    #[inline(always)]
    fn wait_signal_until<C: Coop>(
        &self,
        coop: C,
        id: u32,
        least: u64,
        deadline: Option<u64>,
    ) -> Result<(), BarrierError> {
        self.check_signal(id);
        let mut end = Ok(());
        if coop.thread_rank() == 0 {
            let record = GinWaitRecord { target: least, state: wait_state::SIGNAL, ..GinWaitRecord::default() };
            end = self.poll_recorded(
                || self.read_signal(id).wrapping_sub(least) as i64 >= 0,
                deadline,
                Some((id, record)),
            );
            arch::atomic::fence(FenceOrder::Acquire, Scope::Sys);
        }
        uniform(coop, end)
    }

    /// What world rank `src` has added to signal `id` here (its slot `slot[id][src]`), not
    /// counting resets: for protocols that follow each sender separately (point-to-point
    /// channels) and never reset the signal. A relaxed read: after it shows the value waited
    /// for, [`Gin::acquire`] makes what the sender released with it visible.
    ///
    /// ```no_run
    /// # use ferrolink_device::{Coop, CoopCta, CoopThread, DevComm, DevWindow};
    /// # use ferrolink_device::gin::{Gin, GinBarrierSession, LocalAction, RemoteAction, hybrid_sync};
    /// # use ferrolink_device::barrier::BarrierError;
    /// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
    /// /// Waits until world rank `src`'s part of signal `id` reaches `target` (a count that only
    /// /// grows), then the data `src` released with it is visible to the CTA.
    /// fn wait_from(comm: &DevComm, id: u32, src: u32, target: u64) -> bool {
    ///     let (coop, gin) = (CoopCta, Gin::new(comm, 0));
    ///     loop {
    ///         let ready = coop.thread_rank() == 0 && gin.read_signal_from(id, src) >= target;
    ///         if ready {
    ///             gin.acquire();
    ///         }
    ///         if coop.sync_any(ready) {
    ///             return true;
    ///         }
    ///         if coop.sync_any(coop.thread_rank() == 0 && comm.abort_requested()) {
    ///             return false;
    ///         }
    ///     }
    /// }
    /// ```
    #[inline(always)]
    pub fn read_signal_from(&self, id: u32, src: u32) -> u64 {
        self.check_signal(id);
        if src >= self.comm.nranks {
            self.comm.fail(error_code::GIN_PEER, u64::from(src), u64::from(self.comm.nranks));
        }
        // SAFETY: the slot lies in this rank's signal window (id and src checked); senders
        // change it only atomically.
        unsafe { atomic::load(self.signal_slot(id, src, self.comm.lsa_rank), LoadOrder::Relaxed, Scope::Sys) }
    }

    /// An acquire fence at system scope: after a relaxed read of a signal
    /// ([`Gin::read_signal_from`]) showed a value, the data its sender released with it (a
    /// direct put's stores, or the proxy's delivery) is visible to this thread, and to the
    /// coop after its next `sync`.
    ///
    /// ```no_run
    /// # use ferrolink_device::{Coop, CoopCta, CoopThread, DevComm, DevWindow};
    /// # use ferrolink_device::gin::{Gin, GinBarrierSession, LocalAction, RemoteAction, hybrid_sync};
    /// # use ferrolink_device::barrier::BarrierError;
    /// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
    /// fn poll_once(comm: &DevComm, id: u32, src: u32, target: u64) -> bool {
    ///     let (coop, gin) = (CoopCta, Gin::new(comm, 0));
    ///     let ready = coop.thread_rank() == 0 && gin.read_signal_from(id, src) >= target;
    ///     if ready {
    ///         gin.acquire(); // `src`'s data is visible to this thread...
    ///     }
    ///     coop.sync_any(ready) // ...and, past this CTA barrier, to every thread of the CTA
    /// }
    /// ```
    #[inline(always)]
    pub fn acquire(&self) {
        arch::atomic::fence(FenceOrder::Acquire, Scope::Sys);
    }

    /// Whether every peer goes through the proxy, LSA peers too (`FERROLINK_GIN=proxy`).
    ///
    /// ```no_run
    /// # use ferrolink_device::{Coop, CoopCta, CoopThread, DevComm, DevWindow};
    /// # use ferrolink_device::gin::{Gin, GinBarrierSession, LocalAction, RemoteAction, hybrid_sync};
    /// # use ferrolink_device::barrier::BarrierError;
    /// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
    /// /// Whether every peer of the communicator is reached by direct stores.
    /// fn all_direct(comm: &DevComm) -> bool {
    ///     comm.lsa_size == comm.nranks && !Gin::new(comm, 0).uses_proxy()
    /// }
    /// ```
    #[inline(always)]
    pub fn uses_proxy(&self) -> bool {
        self.g().flags & flags::FORCE_PROXY != 0
    }

    /// Whether world rank `world` is reached directly (stores through the LSA mapping, no
    /// proxy): in this rank's LSA domain and not forced through the proxy.
    ///
    /// ```no_run
    /// # use ferrolink_device::{Coop, CoopCta, CoopThread, DevComm, DevWindow};
    /// # use ferrolink_device::gin::{Gin, GinBarrierSession, LocalAction, RemoteAction, hybrid_sync};
    /// # use ferrolink_device::barrier::BarrierError;
    /// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
    /// /// Sends `v` to word `me` of world rank `peer`'s `win` and raises signal 0 there.
    /// fn send_word(comm: &DevComm, win: DevWindow, peer: u32, v: u32) {
    ///     let (coop, gin, at) = (CoopThread, Gin::new(comm, 0), comm.rank as usize * 4);
    ///     if gin.is_direct(peer) {
    ///         // SAFETY: word `me` of the peer's slot (mapped: an LSA peer); read after the signal.
    ///         unsafe { win.lsa_ptr::<u32>(at, peer % comm.lsa_size).write_volatile(v) };
    ///         gin.signal(coop, comm.world(), peer, RemoteAction::SignalInc(0)); // releases the store
    ///     } else {
    ///         // SAFETY: word `me` of the peer's `win`, aligned; read after the signal.
    ///         unsafe { gin.put_value(coop, comm.world(), peer, win, at, u64::from(v), 4, RemoteAction::SignalInc(0)) };
    ///     }
    /// }
    /// ```
    #[inline(always)]
    pub fn is_direct(&self, world: u32) -> bool {
        self.direct(world)
    }

    /// Tells the host's watchdog that this CTA's wait for world rank `src`'s part of signal
    /// `id` to reach `target` has gone slow (so that a hang names who waits on whom);
    /// [`Gin::clear_slow_wait`] when it ends. For waits written as polls of
    /// [`Gin::read_signal_from`]. One thread calls it.
    ///
    /// ```no_run
    /// # use ferrolink_device::{Coop, CoopCta, CoopThread, DevComm, DevWindow};
    /// # use ferrolink_device::gin::{Gin, GinBarrierSession, LocalAction, RemoteAction, hybrid_sync};
    /// # use ferrolink_device::barrier::BarrierError;
    /// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
    /// /// Polls world rank `src`'s part of signal `id` until it reaches `target`; once slow, the
    /// /// watchdog names `src`.
    /// fn wait_from(comm: &DevComm, id: u32, src: u32, target: u64) -> bool {
    ///     let (coop, gin) = (CoopCta, Gin::new(comm, 0));
    ///     let mut polls = 0u32;
    ///     let arrived = loop {
    ///         let ready = coop.thread_rank() == 0 && gin.read_signal_from(id, src) >= target;
    ///         if ready {
    ///             gin.acquire();
    ///         }
    ///         if coop.sync_any(ready) {
    ///             break true;
    ///         }
    ///         polls += 1;
    ///         if polls == 1 << 16 && coop.thread_rank() == 0 {
    ///             gin.note_slow_wait(id, src, target);
    ///         }
    ///         if coop.sync_any(coop.thread_rank() == 0 && comm.abort_requested()) {
    ///             break false;
    ///         }
    ///     };
    ///     if polls >= 1 << 16 && coop.thread_rank() == 0 {
    ///         gin.clear_slow_wait(id);
    ///     }
    ///     arrived
    /// }
    /// ```
    #[inline(always)]
    pub fn note_slow_wait(&self, id: u32, src: u32, target: u64) {
        self.check_signal(id);
        let slot = self.record_slot(id);
        if slot.is_null() {
            return;
        }
        let r = GinWaitRecord {
            target,
            state: wait_state::PEER_SIGNAL,
            cta: arch::linear_block_idx() as u32,
            team_first: src,
            ..GinWaitRecord::default()
        };
        // SAFETY: `slot` is signal `id`'s record (id checked).
        unsafe { write_record(slot, r) };
    }

    /// Ends what [`Gin::note_slow_wait`] noted for signal `id`.
    ///
    /// ```no_run
    /// # use ferrolink_device::{Coop, CoopCta, CoopThread, DevComm, DevWindow};
    /// # use ferrolink_device::gin::{Gin, GinBarrierSession, LocalAction, RemoteAction, hybrid_sync};
    /// # use ferrolink_device::barrier::BarrierError;
    /// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
    /// /// The end of a wait for signal `id` that thread 0 noted as slow (`noted`: see
    /// /// [`Gin::note_slow_wait`]'s example).
    /// fn wait_ended(comm: &DevComm, id: u32, noted: bool) {
    ///     if noted && CoopCta.thread_rank() == 0 {
    ///         Gin::new(comm, 0).clear_slow_wait(id);
    ///     }
    /// }
    /// ```
    #[inline(always)]
    pub fn clear_slow_wait(&self, id: u32) {
        let slot = self.record_slot(id);
        if !slot.is_null() {
            // SAFETY: `record_slot` checked `id` against the records.
            unsafe { atomic::store(slot.add(3), wait_state::IDLE, StoreOrder::Relaxed, Scope::Sys) };
        }
    }

    /// The words of signal `id`'s wait record (null: records are not kept).
    #[inline(always)]
    fn record_slot(&self, id: u32) -> *mut u32 {
        if self.g().wait_records == 0 || id >= self.g().signal_count {
            return core::ptr::null_mut();
        }
        (self.g().wait_records as *mut GinWaitRecord).wrapping_add(id as usize) as *mut u32
    }

    /// Makes signal `id` read 0 from now on (records its current sum; NCCL's `resetSignal`).
    /// Local: no sender needs to stop, but a wait must not span it.
    ///
    /// ```no_run
    /// # use ferrolink_device::{Coop, CoopCta, CoopThread, DevComm, DevWindow};
    /// # use ferrolink_device::gin::{Gin, GinBarrierSession, LocalAction, RemoteAction, hybrid_sync};
    /// # use ferrolink_device::barrier::BarrierError;
    /// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
    /// /// Ends a round: the wait consumed every raise of signal `sig` of this round, and peers
    /// /// raise it again only after the barrier.
    /// fn end_round(comm: &DevComm, sig: u32, expected: u64) {
    ///     let (coop, gin) = (CoopCta, Gin::new(comm, 0));
    ///     if gin.wait_signal(coop, sig, expected).is_err() {
    ///         return; // aborted
    ///     }
    ///     if coop.thread_rank() == 0 {
    ///         gin.reset_signal(sig); // reads 0 from now on: the next round waits for `expected` again
    ///     }
    ///     // SAFETY: LSA barrier 0 (and GIN barrier 0) are this kernel's.
    ///     let _ = unsafe { hybrid_sync(coop, comm, 0, 0) };
    /// }
    /// ```
    #[inline(always)]
    pub fn reset_signal(&self, id: u32) {
        self.check_signal(id);
        let sum = self.signal_sum(id);
        // SAFETY: `signal_base` holds a word per signal.
        unsafe {
            atomic::store((self.g().signal_base as *mut u64).add(id as usize), sum, StoreOrder::Relaxed, Scope::Gpu)
        };
    }

    /// Counter `id`'s value: completions of puts that asked for it, minus the last reset.
    ///
    /// ```no_run
    /// # use ferrolink_device::{Coop, CoopCta, CoopThread, DevComm, DevWindow};
    /// # use ferrolink_device::gin::{Gin, GinBarrierSession, LocalAction, RemoteAction, hybrid_sync};
    /// # use ferrolink_device::barrier::BarrierError;
    /// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
    /// /// After this call's puts, each with `LocalAction::CounterInc(ctr)`: whether all completed
    /// /// locally (`sent` of them since the last reset).
    /// fn all_completed(comm: &DevComm, ctr: u32, sent: u64) -> bool {
    ///     let (coop, gin) = (CoopCta, Gin::new(comm, 0));
    ///     gin.flush(coop);
    ///     gin.read_counter(ctr) == sent
    /// }
    /// ```
    #[inline(always)]
    pub fn read_counter(&self, id: u32) -> u64 {
        self.check_counter(id);
        let g = self.g();
        // SAFETY: the three arrays hold a word per counter.
        unsafe {
            let d = atomic::load((g.counters as *const u64).add(id as usize), LoadOrder::Relaxed, Scope::Gpu);
            let h = atomic::load((g.counters_host as *const u64).add(id as usize), LoadOrder::Relaxed, Scope::Sys);
            let b = atomic::load((g.counter_base as *const u64).add(id as usize), LoadOrder::Relaxed, Scope::Gpu);
            d.wrapping_add(h).wrapping_sub(b)
        }
    }

    /// Waits until counter `id` reaches `least` (rolling compare), or the communicator is aborted.
    ///
    /// ```no_run
    /// # use ferrolink_device::{Coop, CoopCta, CoopThread, DevComm, DevWindow};
    /// # use ferrolink_device::gin::{Gin, GinBarrierSession, LocalAction, RemoteAction, hybrid_sync};
    /// # use ferrolink_device::barrier::BarrierError;
    /// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
    /// /// Puts `src` to `peer` asking for counter 0, and waits until that put's source may be
    /// /// reused; `round`: the number of this call (1, 2, …).
    /// fn put_and_wait_local(comm: &DevComm, dst: DevWindow, src: DevWindow, peer: u32, bytes: usize, round: u32) -> bool {
    ///     let (coop, gin) = (CoopCta, Gin::new(comm, 0));
    ///     // SAFETY: ranges inside the windows (checked too); `src` is not written before the
    ///     // counter counts the put; the peer's `dst` has this rank as its only writer.
    ///     unsafe { gin.put(coop, comm.world(), peer, dst, 0, src, 0, bytes, RemoteAction::SignalInc(0), LocalAction::CounterInc(0)) };
    ///     gin.wait_counter(coop, 0, u64::from(round)).is_ok() // then `src` may be written again
    /// }
    /// ```
    #[inline(always)]
    pub fn wait_counter<C: Coop>(&self, coop: C, id: u32, least: u64) -> Result<(), BarrierError> {
        self.check_counter(id);
        let mut end = Ok(());
        if coop.thread_rank() == 0 {
            end = self.poll(|| self.read_counter(id).wrapping_sub(least) as i64 >= 0, None);
            arch::atomic::fence(FenceOrder::Acquire, Scope::Sys);
        }
        uniform(coop, end)
    }

    /// Makes counter `id` read 0 from now on (NCCL's `resetCounter`).
    ///
    /// ```no_run
    /// # use ferrolink_device::{Coop, CoopCta, CoopThread, DevComm, DevWindow};
    /// # use ferrolink_device::gin::{Gin, GinBarrierSession, LocalAction, RemoteAction, hybrid_sync};
    /// # use ferrolink_device::barrier::BarrierError;
    /// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
    /// fn finish(comm: &DevComm, ctr: u32) {
    ///     let (coop, gin) = (CoopCta, Gin::new(comm, 0));
    ///     gin.flush(coop); // every put that asked for `ctr` has completed and counted
    ///     if coop.thread_rank() == 0 {
    ///         gin.reset_counter(ctr); // one thread
    ///     }
    /// }
    /// ```
    #[inline(always)]
    pub fn reset_counter(&self, id: u32) {
        let v = self.read_counter(id);
        let g = self.g();
        // SAFETY: the arrays hold a word per counter.
        unsafe {
            let b = (g.counter_base as *mut u64).add(id as usize);
            let old = atomic::load(b, LoadOrder::Relaxed, Scope::Gpu);
            atomic::store(b, old.wrapping_add(v), StoreOrder::Relaxed, Scope::Gpu);
        }
    }

    // ---- internals ------------------------------------------------------------------

    #[inline(always)]
    fn check_actions(&self, remote: RemoteAction, local: LocalAction) {
        match remote {
            RemoteAction::None => {}
            RemoteAction::SignalInc(id) | RemoteAction::SignalAdd(id, _) => self.check_signal(id),
        }
        if let LocalAction::CounterInc(id) = local {
            self.check_counter(id);
        }
    }

    /// The remote action on a direct peer: one release add at system scope on the peer's slot
    /// for this rank (publishing the coop's earlier stores; see the module docs).
    #[inline(always)]
    fn remote_direct(&self, lsa_peer: u32, remote: RemoteAction) {
        let (id, v) = match remote {
            RemoteAction::None => return,
            RemoteAction::SignalInc(id) => (id, 1),
            RemoteAction::SignalAdd(id, v) => (id, v),
        };
        // SAFETY: the slot lies in the peer's signal window (id checked); only this rank adds to it.
        unsafe { atomic::red_add(self.signal_slot(id, self.comm.rank, lsa_peer), v, StoreOrder::Release, Scope::Sys) };
    }

    #[inline(always)]
    fn local_direct(&self, local: LocalAction) {
        if let LocalAction::CounterInc(id) = local {
            // SAFETY: `counters` holds a word per counter (id checked).
            unsafe {
                atomic::red_add((self.g().counters as *mut u64).add(id as usize), 1, StoreOrder::Relaxed, Scope::Gpu)
            };
        }
    }

    #[inline(always)]
    fn ring(&self, peer: u32) -> usize {
        self.ctx as usize * self.comm.nranks as usize + peer as usize
    }

    #[inline(always)]
    fn produced(&self, ring: usize) -> *mut u64 {
        (self.g().produced as *mut u64).wrapping_add(ring)
    }

    #[inline(always)]
    fn consumed(&self, ring: usize) -> *mut u64 {
        (self.g().consumed as *mut u64).wrapping_add(ring)
    }

    /// The device's copy of ring `ring`'s consumed word (a lower bound of it, in L2).
    /// Ordering: read with an acquire at GPU scope, pairing with the release of
    /// [`Gin::consumed_from_host`]'s refresh, which came after that thread's acquire of the
    /// proxy's store: a thread that takes credit from the copy is ordered after the proxy's
    /// read of the slot, as one reading host memory is.
    #[inline(always)]
    fn consumed_seen_copy(&self, ring: usize) -> u64 {
        // SAFETY: `consumed_seen` holds a word per ring (device memory), accessed atomically.
        unsafe { atomic::load((self.g().consumed_seen as *mut u64).wrapping_add(ring), LoadOrder::Acquire, Scope::Gpu) }
    }

    /// Ring `ring`'s consumed word read from host memory (acquire, system scope: the proxy
    /// stores it with a release after reading the slots it frees), and the device's copy
    /// raised to it (an atomic max with a release at GPU scope: the copy only grows).
    #[inline(always)]
    fn consumed_from_host(&self, ring: usize) -> u64 {
        // SAFETY: `consumed` holds a word per ring, written by the proxy only; `consumed_seen`
        // holds a word per ring (device memory); both accessed atomically.
        unsafe {
            let c = atomic::load(self.consumed(ring), LoadOrder::Acquire, Scope::Sys);
            let seen = (self.g().consumed_seen as *mut u64).wrapping_add(ring);
            atomic::fetch_max(seen, c, RmwOrder::Release, Scope::Gpu);
            c
        }
    }

    /// Posts `d` on the ring to `peer`: claims a ticket, waits for credit (a free slot),
    /// writes the fields, then the sequence word with a release at system scope.
    #[inline(always)]
    fn post(&self, peer: u32, mut d: GinDescriptor) {
        let ring = self.ring(peer);
        let depth = u64::from(self.g().queue_depth);
        // SAFETY: `produced` holds a word per ring; only this rank's threads claim from it.
        let ticket = unsafe { atomic::fetch_add(self.produced(ring), 1, RmwOrder::Relaxed, Scope::Gpu) };
        // Credit: the slot is free once the proxy has completed the descriptor `depth` back.
        // The device's copy of the consumed word first (L2); host memory only when that
        // shows no credit. Ordering: the proxy stores `consumed` with a release after it has
        // read the slot; the load below acquires it (system scope), and the copy is stored
        // with a release and read with an acquire at GPU scope, so a thread that takes its
        // credit from the copy is ordered after the proxy's read of the slot as well.
        //
        // Only the ring's next waiter (the ticket the copy's next advance frees first) reads
        // host memory at every poll; the others read the copy, which that waiter refreshes,
        // and host memory every HOST_POLL_EVERY polls (so no wait depends on another thread).
        // The copy only grows (an atomic max), so while anyone waits, the holder of ticket
        // `copy + depth` is among the waiters (tickets are claimed in order, and it took no
        // credit from a larger copy) and reads host memory.
        let cached = self.consumed_seen_copy(ring);
        if ticket.wrapping_sub(cached) >= depth {
            let polls = core::cell::Cell::new(0u32);
            let _ = self.poll(
                || {
                    let n = polls.get();
                    polls.set(n.wrapping_add(1));
                    let copy = self.consumed_seen_copy(ring);
                    if ticket.wrapping_sub(copy) < depth {
                        return true;
                    }
                    if ticket.wrapping_sub(copy) != depth && !n.is_multiple_of(HOST_POLL_EVERY) {
                        return false;
                    }
                    ticket.wrapping_sub(self.consumed_from_host(ring)) < depth
                },
                None,
            );
        }
        let slot =
            (self.g().queues as *mut GinDescriptor).wrapping_add(ring * depth as usize + (ticket % depth) as usize);
        d.seq = 0;
        let words: [u64; 8] = bytemuck::cast(d);
        let dst = slot as *mut u64;
        // SAFETY: the slot is this ticket's (credit above): no one else writes it until the
        // proxy has read it; the proxy reads the fields only after `seq` (written last).
        unsafe {
            for (i, w) in words.iter().enumerate().skip(1) {
                atomic::store(dst.add(i), *w, StoreOrder::Relaxed, Scope::Sys);
            }
            atomic::store(dst, ticket + 1, StoreOrder::Release, Scope::Sys);
        }
    }

    /// Spins until `done()`, then `Ok`; after the fast phase backs off and looks at the
    /// deadline (`Err(Timeout)`) and the abort flag (`Err(Aborted)`).
    #[inline(always)]
    fn poll(&self, done: impl Fn() -> bool, deadline: Option<u64>) -> Result<(), BarrierError> {
        self.poll_recorded(done, deadline, None)
    }

    /// [`Gin::poll`] that, once slow, publishes `record` for signal `id` (see
    /// [`GinWaitRecord`]) and clears it when the wait ends.
    #[inline(always)]
    fn poll_recorded(
        &self,
        done: impl Fn() -> bool,
        deadline: Option<u64>,
        record: Option<(u32, GinWaitRecord)>,
    ) -> Result<(), BarrierError> {
        let mut polls = 0u32;
        let slot = match record {
            Some((id, _)) if self.g().wait_records != 0 => {
                (self.g().wait_records as *mut GinWaitRecord).wrapping_add(id as usize) as *mut u32
            }
            _ => core::ptr::null_mut(),
        };
        let end = loop {
            if done() {
                break Ok(());
            }
            polls = polls.saturating_add(1);
            if polls == FAST_POLLS
                && let Some((_, mut r)) = record
                && !slot.is_null()
            {
                r.cta = arch::linear_block_idx() as u32;
                // SAFETY: `slot` is this signal's record (id checked by the callers).
                unsafe { write_record(slot, r) };
            }
            if polls >= FAST_POLLS {
                if deadline.is_some_and(|d| arch::global_timer_ns() >= d) {
                    break Err(BarrierError::Timeout);
                }
                if polls.is_multiple_of(32) && self.comm.abort_requested() {
                    break Err(BarrierError::Aborted);
                }
                arch::spin_wait_hint(100);
            }
        };
        if polls >= FAST_POLLS && !slot.is_null() {
            // SAFETY: as above; the wait is over.
            unsafe { atomic::store(slot.add(3), wait_state::IDLE, StoreOrder::Relaxed, Scope::Sys) };
        }
        end
    }
}

/// Writes wait record `r` at `slot`: the fields first, `state` (word 3) last with a release,
/// as the watchdog's acquire expects.
///
/// # Safety
/// `slot` is a signal's record in the host-mapped array of records.
#[inline(always)]
unsafe fn write_record(slot: *mut u32, r: GinWaitRecord) {
    let words: [u32; 8] = bytemuck::cast(r);
    // SAFETY: the caller's contract; eight words per record.
    unsafe {
        for (i, w) in words.iter().enumerate() {
            if i != 3 {
                atomic::store(slot.add(i), *w, StoreOrder::Relaxed, Scope::Sys);
            }
        }
        atomic::store(slot.add(3), words[3], StoreOrder::Release, Scope::Sys);
    }
}

/// Makes a result decided by one thread the coop's: every thread returns the same.
#[inline(always)]
fn uniform<C: Coop>(coop: C, end: Result<(), BarrierError>) -> Result<(), BarrierError> {
    let failed = coop.sync_any(end.is_err());
    if !failed {
        return Ok(());
    }
    if coop.sync_any(end == Err(BarrierError::Aborted)) {
        Err(BarrierError::Aborted)
    } else {
        Err(BarrierError::Timeout)
    }
}

#[inline(always)]
fn remote_flags(r: RemoteAction) -> u32 {
    match r {
        RemoteAction::None => desc_flags::REMOTE_NONE,
        RemoteAction::SignalInc(_) => desc_flags::REMOTE_SIGNAL_INC,
        RemoteAction::SignalAdd(..) => desc_flags::REMOTE_SIGNAL_ADD,
    }
}

#[inline(always)]
fn remote_id(r: RemoteAction) -> u32 {
    match r {
        RemoteAction::None => 0,
        RemoteAction::SignalInc(id) | RemoteAction::SignalAdd(id, _) => id,
    }
}

#[inline(always)]
fn remote_value(r: RemoteAction) -> u64 {
    match r {
        RemoteAction::SignalAdd(_, v) => v,
        RemoteAction::SignalInc(_) => 1,
        RemoteAction::None => 0,
    }
}

#[inline(always)]
fn local_flags(l: LocalAction) -> u32 {
    match l {
        LocalAction::None => 0,
        LocalAction::CounterInc(_) => desc_flags::LOCAL_COUNTER_INC,
    }
}

#[inline(always)]
fn local_id(l: LocalAction) -> u32 {
    match l {
        LocalAction::None => 0,
        LocalAction::CounterInc(id) => id,
    }
}

/// A GIN barrier (NCCL's `ncclGinBarrierSession`): every rank of `team` signals every other
/// (SignalInc on the barrier's signal), then waits until **each** other member's slot has
/// reached the number of rounds that member and this rank have shared on this barrier.
///
/// Per-source counts, not the slots' sum: a sum can be reached early when a fast member is
/// already a round ahead while a slow member's signal for this round is still in flight (on
/// another connection), and then that member's data put before its signal might not have
/// landed. Counting per source also lets one barrier index serve teams of different sizes in
/// turn (the world team, then the rail team of a hybrid barrier). Strong signals make it a
/// release/acquire barrier: what a rank put (on the same context) before it is visible to
/// every member after it.
///
/// ```no_run
/// # use ferrolink_device::{Coop, CoopCta, CoopThread, DevComm, DevWindow};
/// # use ferrolink_device::gin::{Gin, GinBarrierSession, LocalAction, RemoteAction, hybrid_sync};
/// # use ferrolink_device::barrier::BarrierError;
/// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
/// /// `rounds` rounds of puts to every other rank, each ended by GIN barrier `b` over the world.
/// fn rounds_of_puts(comm: &DevComm, dst: DevWindow, src: DevWindow, bytes: usize, rounds: u32) {
///     let (coop, gin, world) = (CoopCta, Gin::new(comm, 0), comm.world());
///     let b = ferrolink_device::arch::block_idx_x() as u32;
///     // One session per index for the whole kernel: it keeps the barrier's round count.
///     let mut barrier = GinBarrierSession::new(coop, gin, world, b);
///     for _ in 0..rounds {
///         for p in (0..comm.nranks).filter(|&p| p != comm.rank) {
///             // SAFETY: ranges inside the windows (checked too); block `me` of every `dst` has
///             // this rank as its only writer, read between the barriers; `src` is unchanged.
///             unsafe {
///                 gin.put(coop, world, p, dst, comm.rank as usize * bytes, src, 0, bytes,
///                         RemoteAction::None, LocalAction::None)
///             };
///         }
///         // Past it, every member's puts of the round (same context) have landed here.
///         if barrier.sync().is_err() {
///             break; // aborted
///         }
///         // ... read the blocks of `dst` ...
///         // No member puts the next round into `dst` before every member has read it.
///         if barrier.sync().is_err() {
///             break;
///         }
///     }
///     gin.flush(coop);
/// }
/// ```
pub struct GinBarrierSession<'a, C: Coop> {
    gin: Gin<'a>,
    coop: C,
    team: Team,
    index: u32,
    signal: u32,
    epoch: u32,
}

impl<'a, C: Coop> GinBarrierSession<'a, C> {
    /// Opens GIN barrier `index` (< the communicator's GIN barrier count; checked) over `team`
    /// on `gin`'s context. One coop per index at a time; every rank of the team uses the
    /// same team and index.
    ///
    /// ```no_run
    /// # use ferrolink_device::{Coop, CoopCta, CoopThread, DevComm, DevWindow};
    /// # use ferrolink_device::gin::{Gin, GinBarrierSession, LocalAction, RemoteAction, hybrid_sync};
    /// # use ferrolink_device::barrier::BarrierError;
    /// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
    /// fn rail_barrier(comm: &DevComm) -> Result<(), BarrierError> {
    ///     let gin = Gin::new(comm, 0);
    ///     // GIN barrier 0 over this rank's rail (one rank per LSA domain).
    ///     let mut bar = GinBarrierSession::new(CoopCta, gin, comm.rail(), 0);
    ///     bar.sync()
    /// }
    /// ```
    #[inline(always)]
    pub fn new(coop: C, gin: Gin<'a>, team: Team, index: u32) -> Self {
        let g = gin.g();
        if index >= g.barrier_count {
            gin.comm.fail(error_code::GIN_BARRIER_INDEX, u64::from(index), u64::from(g.barrier_count));
        }
        let s = GinBarrierSession { gin, coop, team, index, signal: g.barrier_signal_first + index, epoch: 0 };
        // SAFETY: word 0 of the barrier's state (index checked).
        let epoch = unsafe { atomic::load(s.state(), LoadOrder::Relaxed, Scope::Gpu) } as u32;
        GinBarrierSession { epoch, ..s }
    }

    /// This barrier's state in `barrier_epochs`: `u64[1 + nranks]` — the round count, then
    /// per world rank the signals expected from it so far.
    #[inline(always)]
    fn state(&self) -> *mut u64 {
        (self.gin.g().barrier_epochs as *mut u64)
            .wrapping_add(self.index as usize * (1 + self.gin.comm.nranks as usize))
    }

    /// Signals every other member of the team, then waits for all of them (acquiring what
    /// they released). `Err(Aborted)` if the communicator was aborted meanwhile.
    ///
    /// ```no_run
    /// # use ferrolink_device::{Coop, CoopCta, CoopThread, DevComm, DevWindow};
    /// # use ferrolink_device::gin::{Gin, GinBarrierSession, LocalAction, RemoteAction, hybrid_sync};
    /// # use ferrolink_device::barrier::BarrierError;
    /// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
    /// fn meet_twice(comm: &DevComm) -> Result<(), BarrierError> {
    ///     let mut bar = GinBarrierSession::new(CoopCta, Gin::new(comm, 0), comm.world(), 0);
    ///     bar.sync()?; // round 1
    ///     bar.sync() // round 2: the session counts the rounds
    /// }
    /// ```
    #[inline(always)]
    pub fn sync(&mut self) -> Result<(), BarrierError> {
        self.coop.sync();
        self.epoch = self.epoch.wrapping_add(1);
        let me = self.team.rank;
        let expected = self.state().wrapping_add(1);
        let mut m = self.coop.thread_rank() as u32;
        while m < self.team.size {
            if m != me {
                let world = self.gin.comm.team_rank_to_world(self.team, m);
                // SAFETY: one word per world rank after the round count; this coop owns the
                // barrier, and member `m` is handled by one thread.
                unsafe {
                    let e = expected.add(world as usize);
                    atomic::store(
                        e,
                        atomic::load(e, LoadOrder::Relaxed, Scope::Gpu).wrapping_add(1),
                        StoreOrder::Relaxed,
                        Scope::Gpu,
                    );
                }
                self.gin.signal_from_thread(world, RemoteAction::SignalInc(self.signal));
            }
            m += self.coop.size() as u32;
        }
        // Thread 0 reads every member's expectation below.
        self.coop.sync();
        let mut end = Ok(());
        if self.coop.thread_rank() == 0 {
            let team = self.team;
            let record = GinWaitRecord {
                target: u64::from(self.epoch),
                state: wait_state::BARRIER,
                team_first: self.gin.comm.team_rank_to_world(team, 0),
                team_stride: team.stride,
                team_size: team.size,
                epoch: self.epoch,
                ..GinWaitRecord::default()
            };
            // Members already seen complete stay complete (slots only grow): resume there.
            let next = core::cell::Cell::new(0u32);
            let slots_me = self.gin.comm.lsa_rank;
            end = self.gin.poll_recorded(
                || {
                    while next.get() < team.size {
                        let m = next.get();
                        if m != me {
                            let world = self.gin.comm.team_rank_to_world(team, m);
                            // SAFETY: the slot lies in this rank's signal window and the
                            // expectation in this barrier's state (both sized by nranks).
                            let (got, want) = unsafe {
                                (
                                    atomic::load(
                                        self.gin.signal_slot(self.signal, world, slots_me),
                                        LoadOrder::Relaxed,
                                        Scope::Sys,
                                    ),
                                    atomic::load(expected.add(world as usize), LoadOrder::Relaxed, Scope::Gpu),
                                )
                            };
                            if !seq_reached64(got, want) {
                                return false;
                            }
                        }
                        next.set(m + 1);
                    }
                    true
                },
                None,
                Some((self.signal, record)),
            );
            arch::atomic::fence(FenceOrder::Acquire, Scope::Sys);
        }
        uniform(self.coop, end)
    }
}

impl<C: Coop> Drop for GinBarrierSession<'_, C> {
    fn drop(&mut self) {
        if self.coop.thread_rank() == 0 {
            // SAFETY: in range (checked in `new`); this coop owns the index.
            unsafe { atomic::store(self.state(), u64::from(self.epoch), StoreOrder::Relaxed, Scope::Gpu) };
        }
    }
}

#[inline(always)]
fn seq_reached64(value: u64, target: u64) -> bool {
    value.wrapping_sub(target) as i64 >= 0
}

/// A barrier over every rank of the communicator (NCCL's hybrid `ncclBarrierSession`): the
/// LSA barrier `index` inside the domain, the GIN barrier `index` over the rail team across
/// domains, and the LSA barrier again, so that every rank leaves after every rank arrived.
///
/// # Safety
/// As [`crate::LsaBarrierSession::new`] for LSA barrier `index`.
///
/// ```no_run
/// # use ferrolink_device::{Coop, CoopCta, CoopThread, DevComm, DevWindow};
/// # use ferrolink_device::gin::{Gin, GinBarrierSession, LocalAction, RemoteAction, hybrid_sync};
/// # use ferrolink_device::barrier::BarrierError;
/// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
/// /// A barrier over every rank of the communicator, across LSA domains.
/// fn everyone(comm: &DevComm) -> Result<(), BarrierError> {
///     // SAFETY: LSA barrier 0 is this kernel's (no other coop uses it meanwhile).
///     unsafe { hybrid_sync(CoopCta, comm, 0, 0) }
/// }
/// ```
#[inline(always)]
pub unsafe fn hybrid_sync<C: Coop>(coop: C, comm: &DevComm, context: u32, index: u32) -> Result<(), BarrierError> {
    // SAFETY: forwarded contract.
    let mut lsa = unsafe { crate::LsaBarrierSession::new(coop, comm, index) };
    lsa.try_sync()?;
    if comm.nranks > comm.lsa_size {
        let gin = Gin::new(comm, context);
        let mut rail = GinBarrierSession::new(coop, gin, comm.rail(), index);
        rail.sync()?;
    }
    lsa.try_sync()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_are_64_bytes_and_gin_state_is_stable() {
        assert_eq!(core::mem::size_of::<GinDescriptor>(), 64);
        assert_eq!(core::mem::size_of::<DevGin>(), 32 + 40 + 80);
        assert_eq!(core::mem::size_of::<GinWaitRecord>(), 32);
        assert!(seq_reached64(5, 5) && seq_reached64(0, u64::MAX) && !seq_reached64(4, 5));
    }
}
