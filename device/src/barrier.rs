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
//! * **wait**: coop thread `p` polls `inbox_me[index][p]` with **relaxed** loads at the LSA
//!   scope until it reaches `e + 1` (wrap-safe compare), then issues one **`fence.acquire`**
//!   at that scope; then the coop meets again.
//!
//! # Ordering argument
//! A write made before `arrive` by any thread of the arriving coop is ordered before that
//! coop's `sync` (a CTA-scope barrier, which makes it visible to the releasing thread);
//! the release store is cumulative, so it publishes those writes at the LSA scope. The
//! waiting coop's thread `p` reads peer `p`'s store with a relaxed (strong) load and then
//! fences with `fence.acquire`: an acquire pattern, so it synchronizes with the release;
//! its closing `sync` extends that to the whole coop. Hence: every write before `arrive` on any rank happens-before every
//! access after `wait` on every rank. The scope is `.gpu` when all LSA peers share the GPU
//! and `.sys` otherwise (`DevComm::lsa_scope`), the cheapest that covers the peers.
//!
//! With a weaker [`BarrierOrder`] (`arrive_with`, `wait_with`, `sync_with`) the release store
//! becomes relaxed (no fence before it) and/or the `fence.acquire` is left out; the control
//! guarantee stays, the happens-before edge needs both halves.
//!
//! A peer may be one round ahead, so the wait of round `k` can read the peer's round `k + 1`
//! store instead of its round `k` one. That later store carries round `k`'s guarantee only
//! if it releases too: **on one barrier index, an arrive that follows a releasing arrive
//! must also release** whenever a waiter relies on the earlier round's ordering. Using one
//! order per index satisfies this. The LL protocol's relaxed arrivals (`crate::coll::ll`) do
//! not break it: each comes in a later kernel of the stream than the index's previous
//! arrival, and a kernel ends only when its writes are performed, so a waiter of the earlier
//! round that reads the later epoch finds them; or, in a shared launch carrying several
//! calls (`crate::coll::group::serve_launch`, only when every rank of the domain is on this
//! GPU, in that launch), after a grid barrier at GPU scope that follows the earlier round's
//! work on every CTA, which orders it for every waiter (all on this GPU).
//!
//! # Epochs and wrap-around
//! Inbox words only grow, by one per round; a peer can be at most one round ahead (it
//! cannot pass the next wait without this rank's arrival), so comparing
//! `(value - target) as i32 >= 0` is exact across `u32` wrap-around. The session writes its
//! epoch back when dropped, so the next session on the same index continues the sequence.
//!
//! # Barrier sets, faults, abort and diagnosis
//! A session names a barrier by its set ([`LsaBarrierHandle`]: the default
//! [`DevComm::lsa_barrier`], or a library's own) and an index in it. Opening a session checks
//! both: an index outside its set fills the control block's error record ([`DevComm::fail`])
//! and traps, so a launch with more CTAs than barriers is a reported error, never a write
//! past the barrier memory.
//!
//! A wait that is still waiting after its fast spin phase writes a [`WaitRecord`] (epoch and
//! CTA) into host-mapped memory once, then backs off and looks at the control block's abort
//! flag every few polls. The host's watchdog reads the record and this rank's inbox row to
//! name the peers that have not arrived, and raises the abort flag after its timeout;
//! `Communicator::abort` raises it at once. An aborted wait returns (`try_wait`,
//! `wait_timeout` and `sync_timeout` say so with [`BarrierError::Aborted`]), and the session
//! skips its later waits. None of this adds work to a wait that ends in the fast phase.
//!
//! Use one barrier index per CTA: two CTAs must never use the same index at the same time.
//! Within a CTA, consecutive sessions on one index with *different* coops (say a warp's, then
//! the whole CTA's) need a `CoopCta` sync between them: the first session's threads save the
//! epoch, and threads outside that coop would otherwise read a stale one.

use crate::arch::{self, FenceOrder, LoadOrder, StoreOrder, atomic};
use crate::comm::{DevComm, LsaBarrierHandle, WaitRecord, error_code};
use crate::coop::{Coop, CoopWarp};

/// Bytes of one barrier's inbox row: a word per peer, padded to 128 bytes so barriers of
/// different CTAs do not share a cache line.
///
/// ```
/// use ferrolink_device::barrier::inbox_row_bytes;
/// assert_eq!(inbox_row_bytes(8), 128); // 8 words, padded to a cache line
/// assert_eq!(inbox_row_bytes(40), 256);
/// ```
pub const fn inbox_row_bytes(lsa_size: u32) -> usize {
    (lsa_size as usize * 4).next_multiple_of(128)
}

/// Bytes of the barrier window per rank for `count` barriers in an LSA domain of `lsa_size`.
///
/// ```
/// use ferrolink_device::barrier::inbox_bytes;
/// // The default 32 barriers in an LSA domain of 8: 4 KiB of barrier window per rank.
/// assert_eq!(inbox_bytes(32, 8), 4096);
/// ```
pub const fn inbox_bytes(count: u32, lsa_size: u32) -> usize {
    count as usize * inbox_row_bytes(lsa_size)
}

/// `a >= b` for sequence numbers that may wrap around `u32`.
///
/// ```
/// use ferrolink_device::barrier::seq_reached;
/// assert!(seq_reached(5, 5) && !seq_reached(4, 5));
/// assert!(seq_reached(0, u32::MAX)); // one past the wrap
/// assert!(!seq_reached(u32::MAX, 0));
/// ```
#[inline(always)]
pub const fn seq_reached(value: u32, target: u32) -> bool {
    (value.wrapping_sub(target) as i32) >= 0
}

/// Polls of an inbox word before a waiting thread starts to back off with `nanosleep`. On
/// the GPU a poll costs an L2 round trip and peers usually arrive within a microsecond. On
/// the CPU emulator every poll is a rendezvous of 32 OS threads (the warp vote), so waiting
/// warps back off at once and leave the cores to the threads they wait for.
pub(crate) const SPINS_BEFORE_BACKOFF: u32 = if cfg!(target_arch = "nvptx64") { 2048 } else { SPINS_PER_CHECK };

/// Polls between two looks at the clock (timeouts) and at the backoff threshold.
const SPINS_PER_CHECK: u32 = if cfg!(target_arch = "nvptx64") { 64 } else { 1 };

/// Backoff iterations between two looks at the abort flag. It lives in host memory, so a
/// look costs a PCIe round trip (about a microsecond); one backoff iteration costs about
/// 0.2 us on the H200, so a waiting warp sees an abort within about 10 us.
pub(crate) const BACKOFFS_PER_ABORT_CHECK: u32 = if cfg!(target_arch = "nvptx64") { 32 } else { 8 };

/// Why a barrier wait returned without every peer's arrival.
///
/// ```no_run
/// use ferrolink_device::{arch, kernel, BarrierError, CoopCta, DevComm, LsaBarrierSession};
/// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
/// kernel! {
///     /// CTA `b` meets the other ranks at barrier `b` and writes to `status[b]`: 0 (all
///     /// arrived), 1 (timed out) or 2 (the communicator was aborted).
///     ///
///     /// # Safety
///     /// `comm` from a live handle with at least `grid` barriers; `status` holds `grid` words.
///     pub unsafe fn checked_sync(comm: DevComm, timeout_ns: u64, status: *mut u32) {
///         let b = arch::block_idx_x();
///         // SAFETY: one barrier per CTA (kernel contract).
///         let mut bar = unsafe { LsaBarrierSession::new(CoopCta, &comm, b as u32) };
///         // The same result in every thread of the CTA.
///         let s = match bar.sync_timeout(timeout_ns) {
///             Ok(()) => 0,
///             Err(BarrierError::Timeout) => 1,
///             Err(BarrierError::Aborted) => 2,
///         };
///         if arch::thread_rank_in_block() == 0 {
///             // SAFETY: `status` holds one word per CTA.
///             unsafe { status.add(b).write(s) };
///         }
///     }
/// }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BarrierError {
    /// The wait's own timeout passed ([`LsaBarrierSession::wait_timeout`]).
    Timeout,
    /// The host aborted the communicator (`Communicator::abort`, its watchdog, or a failed
    /// rank), or a kernel of this rank reported a fault.
    Aborted,
}

/// How one inbox poll loop ended.
#[derive(Clone, Copy, PartialEq, Eq)]
enum PollEnd {
    Reached,
    TimedOut,
    Aborted,
}

/// The memory ordering a barrier operation gives (NCCL's `cuda::memory_order` argument of
/// `arrive`/`wait`/`sync`). Control is the same for all: no thread passes `wait` before every
/// peer's coop has reached the matching `arrive`.
///
/// A write on rank A happens-before a read on rank B after a barrier only if A's `arrive`
/// *releases* and B's `wait` *acquires*; [`BarrierOrder::AcqRel`] (what the plain methods use)
/// gives both. Weaker orders skip a fence (the release's `MEMBAR`) or the acquire's cache
/// invalidation; use them only when something else orders the data (for instance, a barrier
/// that only separates two phases of control flags that are themselves released/acquired).
///
/// ```no_run
/// use ferrolink_device::{arch, kernel, BarrierOrder, CoopCta, DevComm, LsaBarrierSession};
/// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
/// kernel! {
///     /// CTA `b` of every rank notes `%globaltimer` before and after a barrier that shares
///     /// no memory (control only), in `times[2b]` and `times[2b + 1]`.
///     ///
///     /// # Safety
///     /// `comm` from a live handle with at least `grid` barriers; `times` holds `2 * grid` words.
///     pub unsafe fn start_together(comm: DevComm, times: *mut u64) {
///         let b = arch::block_idx_x();
///         // SAFETY: one barrier per CTA (kernel contract).
///         let mut bar = unsafe { LsaBarrierSession::new(CoopCta, &comm, b as u32) };
///         let arrived = arch::global_timer_ns();
///         bar.sync_with(BarrierOrder::Relaxed);
///         let left = arch::global_timer_ns();
///         if arch::thread_rank_in_block() == 0 {
///             // SAFETY: `times` holds two words per CTA.
///             unsafe {
///                 times.add(2 * b).write(arrived);
///                 times.add(2 * b + 1).write(left);
///             }
///         }
///     }
/// }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BarrierOrder {
    /// Control only: no memory ordering between ranks.
    Relaxed,
    /// `wait` acquires the peers' arrivals; `arrive` does not release.
    Acquire,
    /// `arrive` releases this coop's earlier writes; `wait` does not acquire.
    Release,
    /// Both: `arrive` releases and `wait` acquires.
    AcqRel,
}

impl BarrierOrder {
    /// Whether `arrive` with this order releases.
    ///
    /// ```
    /// use ferrolink_device::BarrierOrder;
    /// assert!(BarrierOrder::AcqRel.releases() && BarrierOrder::Release.releases());
    /// assert!(!BarrierOrder::Acquire.releases());
    /// ```
    pub const fn releases(self) -> bool {
        matches!(self, BarrierOrder::Release | BarrierOrder::AcqRel)
    }

    /// Whether `wait` with this order acquires.
    ///
    /// ```
    /// use ferrolink_device::BarrierOrder;
    /// assert!(BarrierOrder::AcqRel.acquires() && BarrierOrder::Acquire.acquires());
    /// assert!(!BarrierOrder::Release.acquires());
    /// ```
    pub const fn acquires(self) -> bool {
        matches!(self, BarrierOrder::Acquire | BarrierOrder::AcqRel)
    }

    /// The order as a `u32` for kernel arguments: `0` relaxed, `1` acquire, `2` release,
    /// `3` acq_rel.
    ///
    /// ```
    /// use ferrolink_device::BarrierOrder;
    /// // The host passes an order to a kernel as its code.
    /// assert_eq!(BarrierOrder::Relaxed.code(), 0);
    /// assert_eq!(BarrierOrder::from_code(BarrierOrder::Release.code()), BarrierOrder::Release);
    /// ```
    pub const fn code(self) -> u32 {
        match self {
            BarrierOrder::Relaxed => 0,
            BarrierOrder::Acquire => 1,
            BarrierOrder::Release => 2,
            BarrierOrder::AcqRel => 3,
        }
    }

    /// Decodes [`BarrierOrder::code`]; unknown codes mean [`BarrierOrder::AcqRel`], the strongest.
    ///
    /// ```
    /// use ferrolink_device::BarrierOrder;
    /// assert_eq!(BarrierOrder::from_code(1), BarrierOrder::Acquire);
    /// assert_eq!(BarrierOrder::from_code(7), BarrierOrder::AcqRel); // unknown: the strongest
    /// ```
    pub const fn from_code(code: u32) -> BarrierOrder {
        match code {
            0 => BarrierOrder::Relaxed,
            1 => BarrierOrder::Acquire,
            2 => BarrierOrder::Release,
            _ => BarrierOrder::AcqRel,
        }
    }
}

/// One use of LSA barrier `index` by a coop (see the [module docs](self)). Create it, call
/// [`sync`](Self::sync) (or [`arrive`](Self::arrive) then [`wait`](Self::wait)) as many
/// times as needed; dropping it saves the epoch for the next session (every thread of the
/// coop stores the same value, so the next session needs no extra barrier to read it).
///
/// ```no_run
/// use ferrolink_device::{arch, kernel, CoopCta, DevComm, DevWindow, LsaBarrierSession};
/// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
/// kernel! {
///     /// CTA `b` stores `value` into word `b` of the next LSA rank's slot of `win`, and copies
///     /// word `b` of its own slot (the previous rank's value) to `out[b]`.
///     ///
///     /// # Safety
///     /// `comm`, `win` from live handles; `grid <= lsa_barrier_count`; `win` holds one word
///     /// per CTA; `out` one.
///     pub unsafe fn pass_along(comm: DevComm, win: DevWindow, value: u32, out: *mut u32) {
///         let b = arch::block_idx_x();
///         let leader = arch::thread_rank_in_block() == 0;
///         let next = (comm.lsa_rank + 1) % comm.lsa_size;
///         // SAFETY: the handle is alive; barrier b belongs to this CTA alone.
///         let mut bar = unsafe { LsaBarrierSession::new(CoopCta, &comm, b as u32) };
///         if leader {
///             // SAFETY: word b lies in the next rank's slot.
///             unsafe { win.lsa_ptr::<u32>(4 * b, next).write(value) };
///         }
///         bar.arrive(); // publishes the store above to every LSA peer
///         // ... work that touches no window memory may overlap the wait here ...
///         bar.wait(); // every peer's store into this rank's slot is visible
///         if leader {
///             // SAFETY: word b lies in this rank's slot; `out` holds one word per CTA.
///             unsafe { out.add(b).write(win.local_ptr::<u32>(4 * b).read()) };
///         }
///         bar.sync(); // closing: no rank overwrites word b (say, next launch) before it is read
///     } // dropping the session saves the epoch for the next launch
/// }
/// ```
pub struct LsaBarrierSession<'a, C: Coop> {
    coop: C,
    comm: &'a DevComm,
    /// The barrier's index among all of the communicator's barriers (set's first + index).
    index: u32,
    epoch: u32,
    /// Whether this thread saw the communicator aborted: later operations return at once.
    aborted: bool,
    scope: arch::Scope,
    /// Whether every peer has its own coop thread (`lsa_size <= coop.size()`), the common
    /// case: then each thread handles at most peer `thread_rank`, through the two words below,
    /// computed once per session so that `arrive` and `wait` do no address arithmetic.
    one_peer_per_thread: bool,
    /// Peer `thread_rank`'s inbox word for this rank (where this thread signals), or null.
    signal_slot: *mut u32,
    /// This rank's inbox word for peer `thread_rank % lsa_size` (what this thread polls:
    /// lanes past the last peer poll a duplicate word, which keeps the poll loop free of
    /// per-lane branches and changes nothing, as every word must reach the epoch anyway).
    poll_slot: *const u32,
    /// Whether this thread's warp has coop threads with a peer (the others do not poll).
    warp_polls: bool,
    /// The coop's lanes of this thread's warp (the mask of its polling votes).
    lanes: u32,
    /// Whether the coop is exactly one full warp (a `CoopWarp`, or a `CoopCta` of 32
    /// threads): then the session runs as a `CoopWarp` one, the same threads with warp-level
    /// code throughout (for a 32-thread CTA coop this brought a round from about 90 ns slower
    /// than a `CoopWarp` session to about 40 ns slower on the H200, docs/PERF.md).
    one_warp: bool,
}

impl<'a, C: Coop> LsaBarrierSession<'a, C> {
    /// Opens barrier `index` of the communicator's default barrier set
    /// ([`DevComm::lsa_barrier`]) for `coop`. Every thread of the coop calls this with the
    /// same arguments. An index outside the set is reported to the host (the control block's
    /// error record names the index and the set's size) and the kernel traps; so does a
    /// `DevComm` of another ferrolink version.
    ///
    /// # Safety
    /// The `DevCommHandle` behind `comm` must be alive, and no other coop may use the same
    /// barrier while this session exists.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use ferrolink_device::{arch, kernel, CoopCta, DevComm, DevWindow, LsaBarrierSession};
    /// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
    /// kernel! {
    ///     /// Every thread of the grid stores `value` into the next LSA rank's slot of `win`
    ///     /// (word per thread), then CTA `b` meets the other ranks at barrier `b`.
    ///     ///
    ///     /// # Safety
    ///     /// `comm`, `win` from live handles; `grid <= lsa_barrier_count`; `win` holds a word per
    ///     /// thread of the grid.
    ///     pub unsafe fn put_next(comm: DevComm, win: DevWindow, value: u32) {
    ///         let next = (comm.lsa_rank + 1) % comm.lsa_size;
    ///         let i = arch::global_thread_idx_x();
    ///         // SAFETY: word i lies in the next rank's slot; only this thread writes it.
    ///         unsafe { win.lsa_ptr::<u32>(4 * i, next).write(value) };
    ///         // SAFETY: the handle is alive; barrier b of the default set belongs to this CTA alone.
    ///         let mut bar = unsafe { LsaBarrierSession::new(CoopCta, &comm, arch::block_idx_x() as u32) };
    ///         bar.sync();
    ///     }
    /// }
    /// ```
    #[inline(always)]
    pub unsafe fn new(coop: C, comm: &'a DevComm, index: u32) -> Self {
        // SAFETY: forwarded contract.
        unsafe { Self::with_set(coop, comm, comm.lsa_barrier, index) }
    }

    /// Opens barrier `index` of barrier set `set` (NCCL's `ncclLsaBarrierSession(coop,
    /// devComm, team, handle, index)`): the default set, or one a library requested with
    /// `DevCommRequirements::resources`. Checked like [`Self::new`].
    ///
    /// # Safety
    /// As [`Self::new`].
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use ferrolink_device::{arch, kernel, CoopCta, DevComm, LsaBarrierHandle, LsaBarrierSession};
    /// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
    /// /// A library's device function: a barrier among the LSA ranks for CTA `b`, on barrier `b`
    /// /// of the library's own set, so it never collides with a session of its caller.
    /// ///
    /// /// # Safety
    /// /// `comm` from a live handle and `set` from that handle; `grid <= set.count`; every
    /// /// thread of the CTA calls it.
    /// unsafe fn lib_sync(comm: &DevComm, set: LsaBarrierHandle) {
    ///     // SAFETY: the handle is alive; barrier b of the library's set belongs to this CTA alone.
    ///     let mut bar = unsafe { LsaBarrierSession::with_set(CoopCta, comm, set, arch::block_idx_x() as u32) };
    ///     bar.sync();
    /// }
    ///
    /// kernel! {
    ///     /// Calls the library while the CTA's own session on the default set is open.
    ///     ///
    ///     /// # Safety
    ///     /// As `lib_sync`, and `grid <= lsa_barrier_count`.
    ///     pub unsafe fn user_calls_library(comm: DevComm, set: LsaBarrierHandle) {
    ///         // SAFETY: the handle is alive; barrier b of the default set belongs to this CTA alone.
    ///         let mut bar = unsafe { LsaBarrierSession::new(CoopCta, &comm, arch::block_idx_x() as u32) };
    ///         bar.arrive();
    ///         // SAFETY: the kernel's contract.
    ///         unsafe { lib_sync(&comm, set) };
    ///         bar.wait();
    ///     }
    /// }
    /// ```
    #[inline(always)]
    pub unsafe fn with_set(coop: C, comm: &'a DevComm, set: LsaBarrierHandle, index: u32) -> Self {
        comm.check_header();
        if set.count > comm.lsa_barrier_total || set.first > comm.lsa_barrier_total - set.count {
            comm.fail(
                error_code::LSA_BARRIER_SET,
                (u64::from(set.first) << 32) | u64::from(set.count),
                u64::from(comm.lsa_barrier_total),
            );
        }
        if index >= set.count {
            comm.fail(
                error_code::LSA_BARRIER_INDEX,
                u64::from(index),
                (u64::from(set.first) << 32) | u64::from(set.count),
            );
        }
        let index = set.first + index;
        // SAFETY: the epochs array holds `lsa_barrier_total` words and `index` is below it
        // (checked above).
        let epoch = unsafe {
            atomic::load((comm.barrier_epochs as *const u32).add(index as usize), LoadOrder::Relaxed, arch::Scope::Gpu)
        };
        let n = comm.lsa_size as usize;
        let p = coop.thread_rank();
        let win = &comm.barrier_window;
        let signal_slot = if p < n {
            win.lsa_ptr::<u32>(inbox_offset(comm, index, comm.lsa_rank), p as u32)
        } else {
            core::ptr::null_mut()
        };
        // (32-bit: a 64-bit remainder is a software routine on the GPU.)
        let poll_slot = win.local_ptr::<u32>(inbox_offset(comm, index, p as u32 % (n as u32).max(1))) as *const u32;
        LsaBarrierSession {
            coop,
            comm,
            index,
            epoch,
            aborted: false,
            scope: comm.lsa_scope(),
            one_peer_per_thread: n <= coop.size(),
            signal_slot,
            poll_slot,
            warp_polls: coop.warp_any(p < n),
            lanes: coop.warp_lanes(),
            one_warp: coop.full_warps() && coop.size() == arch::WARP_SIZE,
        }
    }

    /// Signals this rank's arrival to every LSA peer with [`BarrierOrder::AcqRel`]'s release.
    ///
    /// ```no_run
    /// use ferrolink_device::{arch, kernel, CoopCta, DevComm, DevWindow, LsaBarrierSession};
    /// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
    /// kernel! {
    ///     /// CTA `b` stores `value` into word `[b][me]` of every LSA peer's slot of `win`, then
    ///     /// sums row `b` of its own slot (a word from each peer) into `out[b]`.
    ///     ///
    ///     /// # Safety
    ///     /// `comm`, `win` from live handles; `grid <= lsa_barrier_count`; `win` holds
    ///     /// `grid * lsa_size` words; `out` one per CTA.
    ///     pub unsafe fn gather_sum(comm: DevComm, win: DevWindow, value: u32, out: *mut u32) {
    ///         let (b, t) = (arch::block_idx_x(), arch::thread_rank_in_block());
    ///         let (me, n) = (comm.lsa_rank as usize, comm.lsa_size as usize);
    ///         // SAFETY: one barrier per CTA (kernel contract).
    ///         let mut bar = unsafe { LsaBarrierSession::new(CoopCta, &comm, b as u32) };
    ///         bar.sync(); // no peer still reads row b of an earlier launch
    ///         let mut p = t;
    ///         while p < n {
    ///             // SAFETY: word [b][me] lies in peer p's slot; only this thread writes it.
    ///             unsafe { win.lsa_ptr::<u32>(4 * (b * n + me), p as u32).write(value) };
    ///             p += arch::block_size();
    ///         }
    ///         bar.arrive(); // releases the stores above to every peer
    ///         bar.wait();
    ///         if t == 0 {
    ///             // SAFETY: row b lies in this rank's slot.
    ///             let sum = (0..n).map(|q| unsafe { win.local_ptr::<u32>(4 * (b * n + q)).read() }).sum();
    ///             // SAFETY: `out` holds one word per CTA.
    ///             unsafe { out.add(b).write(sum) };
    ///         }
    ///     }
    /// }
    /// ```
    #[inline(always)]
    pub fn arrive(&mut self) {
        self.arrive_with(BarrierOrder::AcqRel)
    }

    /// Signals this rank's arrival to every LSA peer: meets the coop, then stores the new
    /// epoch into each peer's inbox at the LSA scope, as a **release** if `order` releases
    /// (publishing every write the coop made before this call), else relaxed.
    ///
    /// ```no_run
    /// use ferrolink_device::{arch, kernel, BarrierOrder, CoopCta, DevComm, LsaBarrierSession};
    /// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
    /// kernel! {
    ///     /// CTA `b` notes `%globaltimer` after its arrival and after its wait on barrier `b`,
    ///     /// a barrier that shares no memory (control only), in `times[2b]` and `times[2b + 1]`.
    ///     ///
    ///     /// # Safety
    ///     /// `comm` from a live handle with at least `grid` barriers; `times` holds `2 * grid` words.
    ///     pub unsafe fn arrive_then_wait(comm: DevComm, times: *mut u64) {
    ///         let b = arch::block_idx_x();
    ///         // SAFETY: one barrier per CTA (kernel contract).
    ///         let mut bar = unsafe { LsaBarrierSession::new(CoopCta, &comm, b as u32) };
    ///         // Relaxed on every arrival of this index (one order per index).
    ///         bar.arrive_with(BarrierOrder::Relaxed);
    ///         let arrived = arch::global_timer_ns();
    ///         bar.wait_with(BarrierOrder::Relaxed);
    ///         let left = arch::global_timer_ns();
    ///         if arch::thread_rank_in_block() == 0 {
    ///             // SAFETY: `times` holds two words per CTA.
    ///             unsafe {
    ///                 times.add(2 * b).write(arrived);
    ///                 times.add(2 * b + 1).write(left);
    ///             }
    ///         }
    ///     }
    /// }
    /// ```
    #[inline(always)]
    pub fn arrive_with(&mut self, order: BarrierOrder) {
        if self.one_warp { self.arrive_by(CoopWarp, order) } else { self.arrive_by(self.coop, order) }
    }

    /// [`Self::arrive_with`] carried out by `coop`: the session's coop, or the same threads
    /// seen as a [`CoopWarp`] (see `one_warp`).
    #[inline(always)]
    fn arrive_by<K: Coop>(&mut self, coop: K, order: BarrierOrder) {
        coop.sync();
        if self.aborted {
            return;
        }
        self.epoch = self.epoch.wrapping_add(1);
        let store_order = if order.releases() { StoreOrder::Release } else { StoreOrder::Relaxed };
        if self.one_peer_per_thread {
            if !self.signal_slot.is_null() {
                // One instruction per (order, scope) pair, chosen outside the store.
                let store = |scope| {
                    // SAFETY: the slot lies in peer `thread_rank`'s barrier row (set up in `new`).
                    unsafe { atomic::store(self.signal_slot, self.epoch, store_order, scope) }
                };
                match self.scope {
                    arch::Scope::Gpu => store(arch::Scope::Gpu),
                    arch::Scope::Sys => store(arch::Scope::Sys),
                    arch::Scope::Cta => store(arch::Scope::Cta),
                }
            }
            return;
        }
        let me = self.comm.lsa_rank;
        let mut p = coop.thread_rank();
        while p < self.comm.lsa_size as usize {
            let slot = self.comm.barrier_window.lsa_ptr::<u32>(inbox_offset(self.comm, self.index, me), p as u32);
            // SAFETY: `slot` is inside peer p's barrier row (window sized by inbox_bytes).
            unsafe { atomic::store(slot, self.epoch, store_order, self.scope) };
            p += coop.size();
        }
    }

    /// Waits until every LSA peer has arrived at this epoch (acquiring their arrivals), then
    /// meets the coop. If the communicator is aborted meanwhile it returns without them (the
    /// barrier then orders nothing; later operations of the session return at once); use
    /// [`try_wait`](Self::try_wait) to learn which happened.
    ///
    /// ```no_run
    /// use ferrolink_device::{arch, kernel, CoopCta, DevComm, DevWindow, LsaBarrierSession};
    /// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
    /// kernel! {
    ///     /// CTA `b` reads word `b` of its slot of `win` once every LSA peer has arrived at
    ///     /// barrier `b` (a peer wrote it before its arrival), into `out[b]`.
    ///     ///
    ///     /// # Safety
    ///     /// `comm`, `win` from live handles; `grid <= lsa_barrier_count`; `out` holds a word per CTA.
    ///     pub unsafe fn read_after(comm: DevComm, win: DevWindow, out: *mut u32) {
    ///         let b = arch::block_idx_x();
    ///         // SAFETY: one barrier per CTA (kernel contract).
    ///         let mut bar = unsafe { LsaBarrierSession::new(CoopCta, &comm, b as u32) };
    ///         bar.arrive();
    ///         bar.wait(); // acquires every peer's arrival (unless the communicator was aborted)
    ///         if arch::thread_rank_in_block() == 0 {
    ///             // SAFETY: word b lies in this rank's slot; `out` holds a word per CTA.
    ///             unsafe { out.add(b).write(win.local_ptr::<u32>(4 * b).read()) };
    ///         }
    ///     }
    /// }
    /// ```
    #[inline(always)]
    pub fn wait(&mut self) {
        let _ = self.wait_until(BarrierOrder::AcqRel, None, false);
    }

    /// [`wait`](Self::wait) that acquires only if `order` acquires.
    ///
    /// ```no_run
    /// use ferrolink_device::{arch, kernel, BarrierOrder, CoopCta, DevComm, LsaBarrierSession};
    /// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
    /// kernel! {
    ///     /// `rounds` barrier rounds on barrier `b` with the order of code `order` (the same
    ///     /// order on every round: one order per index).
    ///     ///
    ///     /// # Safety
    ///     /// `comm` from a live handle with at least `grid` barriers.
    ///     pub unsafe fn rounds_with(comm: DevComm, rounds: u32, order: u32) {
    ///         let order = BarrierOrder::from_code(order);
    ///         // SAFETY: one barrier per CTA (kernel contract).
    ///         let mut bar = unsafe { LsaBarrierSession::new(CoopCta, &comm, arch::block_idx_x() as u32) };
    ///         for _ in 0..rounds {
    ///             bar.arrive_with(order);
    ///             bar.wait_with(order);
    ///         }
    ///     }
    /// }
    /// ```
    #[inline(always)]
    pub fn wait_with(&mut self, order: BarrierOrder) {
        let _ = self.wait_until(order, None, false);
    }

    /// [`wait`](Self::wait) that says whether every peer arrived (`Ok`) or the communicator
    /// was aborted (`Err(BarrierError::Aborted)`); the result is the same for every thread of
    /// the coop.
    ///
    /// ```no_run
    /// use ferrolink_device::{arch, kernel, CoopCta, DevComm, LsaBarrierSession};
    /// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
    /// kernel! {
    ///     /// CTA `b` meets the other ranks at barrier `b` and writes 1 to `status[b]` if they all
    ///     /// arrived, 0 if the communicator was aborted (a rank failed).
    ///     ///
    ///     /// # Safety
    ///     /// `comm` from a live handle with at least `grid` barriers; `status` holds `grid` words.
    ///     pub unsafe fn sync_or_abort(comm: DevComm, status: *mut u32) {
    ///         let b = arch::block_idx_x();
    ///         // SAFETY: one barrier per CTA (kernel contract).
    ///         let mut bar = unsafe { LsaBarrierSession::new(CoopCta, &comm, b as u32) };
    ///         bar.arrive();
    ///         let ok = bar.try_wait().is_ok(); // the same in every thread of the CTA
    ///         if arch::thread_rank_in_block() == 0 {
    ///             // SAFETY: `status` holds one word per CTA.
    ///             unsafe { status.add(b).write(u32::from(ok)) };
    ///         }
    ///     }
    /// }
    /// ```
    #[inline(always)]
    pub fn try_wait(&mut self) -> Result<(), BarrierError> {
        self.wait_until(BarrierOrder::AcqRel, None, true)
    }

    /// Whether this thread has seen the communicator aborted in this session.
    ///
    /// ```no_run
    /// use ferrolink_device::{arch, kernel, CoopCta, DevComm, LsaBarrierSession};
    /// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
    /// kernel! {
    ///     /// `rounds` barrier rounds on barrier `b`; thread 0 then writes 1 to `status[b]` if it
    ///     /// saw the communicator aborted (the later rounds then returned at once).
    ///     ///
    ///     /// # Safety
    ///     /// `comm` from a live handle with at least `grid` barriers; `status` holds `grid` words.
    ///     pub unsafe fn sync_rounds(comm: DevComm, rounds: u32, status: *mut u32) {
    ///         let b = arch::block_idx_x();
    ///         // SAFETY: one barrier per CTA (kernel contract).
    ///         let mut bar = unsafe { LsaBarrierSession::new(CoopCta, &comm, b as u32) };
    ///         for _ in 0..rounds {
    ///             bar.sync();
    ///         }
    ///         if arch::thread_rank_in_block() == 0 {
    ///             // This thread's view (`try_sync` gives every thread of the coop one answer).
    ///             // SAFETY: `status` holds one word per CTA.
    ///             unsafe { status.add(b).write(u32::from(bar.aborted())) };
    ///         }
    ///     }
    /// }
    /// ```
    #[inline(always)]
    pub fn aborted(&self) -> bool {
        self.aborted
    }

    /// [`wait`](Self::wait) that gives up after `timeout_ns` of `%globaltimer`. The result is
    /// the same for every thread of the coop. After a timeout the barrier is out of step (this
    /// rank already signalled the epoch): abandon the kernel's protocol, report the error to
    /// the host, and have the host recover the communicator (`ferrolink::recover`) before the
    /// barriers are used again. `Err(BarrierError::Aborted)` if the communicator was aborted.
    ///
    /// ```no_run
    /// use ferrolink_device::{arch, kernel, BarrierError, CoopCta, DevComm, LsaBarrierSession};
    /// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
    /// kernel! {
    ///     /// CTA `b` arrives at barrier `b`, then waits at most `timeout_ns`; `status[b]` is 0
    ///     /// (all arrived), 1 (timed out: the host recovers the communicator) or 2 (aborted).
    ///     ///
    ///     /// # Safety
    ///     /// `comm` from a live handle with at least `grid` barriers; `status` holds `grid` words.
    ///     pub unsafe fn bounded_wait(comm: DevComm, timeout_ns: u64, status: *mut u32) {
    ///         let b = arch::block_idx_x();
    ///         // SAFETY: one barrier per CTA (kernel contract).
    ///         let mut bar = unsafe { LsaBarrierSession::new(CoopCta, &comm, b as u32) };
    ///         bar.arrive();
    ///         let s = match bar.wait_timeout(timeout_ns) {
    ///             Ok(()) => 0,
    ///             // Out of step: abandon the protocol and report.
    ///             Err(BarrierError::Timeout) => 1,
    ///             Err(BarrierError::Aborted) => 2,
    ///         };
    ///         if arch::thread_rank_in_block() == 0 {
    ///             // SAFETY: `status` holds one word per CTA.
    ///             unsafe { status.add(b).write(s) };
    ///         }
    ///     }
    /// }
    /// ```
    #[inline(always)]
    pub fn wait_timeout(&mut self, timeout_ns: u64) -> Result<(), BarrierError> {
        // Each thread reads the clock itself, so deadlines differ slightly between threads;
        // whether there is one does not (`Some` for all), which keeps the votes uniform.
        let start = arch::global_timer_ns();
        self.wait_until(BarrierOrder::AcqRel, Some(start.saturating_add(timeout_ns)), true)
    }

    /// One poll of an inbox word: a relaxed load (the acquire, where wanted, is one
    /// `fence.acquire` after the last poll).
    #[inline(always)]
    fn load_word(&self, slot: *const u32, scope: arch::Scope) -> u32 {
        // SAFETY: the callers poll only words of this rank's barrier row.
        unsafe { atomic::load(slot, LoadOrder::Relaxed, scope) }
    }

    /// Polls `slot` until it reaches the epoch, warp-uniformly: every coop lane of the warp
    /// (`lanes`) keeps polling its own word until all of them are done, so the warp leaves
    /// converged. Ends early when the deadline passes or the communicator is aborted. `scope`
    /// and `lanes` are constants at the hot call sites (see [`Self::poll_at_lsa_scope`]), so
    /// the inner loop is a load, a compare, a vote and a count. (Two loads in flight,
    /// staggered by half a round trip, measured 0.1 us slower per round on the H200:
    /// docs/PERF.md.)
    ///
    /// After the fast spin phase (`SPINS_BEFORE_BACKOFF` polls) the wait is slow: it writes
    /// its [`WaitRecord`] once (for the host's watchdog), then backs off between polls and
    /// looks at the abort flag every `BACKOFFS_PER_ABORT_CHECK` polls. Neither costs anything
    /// in the fast phase.
    #[inline(always)]
    fn poll_until(&self, slot: *const u32, scope: arch::Scope, lanes: u32, deadline_ns: Option<u64>) -> PollEnd {
        let mut polls = 0u32;
        loop {
            // Spin tight first: peers usually arrive within a microsecond, and a nanosleep
            // costs more than that. Look at the clock only between bursts, and after
            // SPINS_BEFORE_BACKOFF polls back off between single polls.
            let burst = if polls < SPINS_BEFORE_BACKOFF { SPINS_PER_CHECK } else { 1 };
            for _ in 0..burst {
                if arch::ballot_sync(lanes, !seq_reached(self.load_word(slot, scope), self.epoch)) == 0 {
                    return PollEnd::Reached;
                }
            }
            // Wrapping: a saturated count would never be a multiple of the abort check
            // again (a wait of hours), and a wrapped one only spins fast for a while.
            polls = polls.wrapping_add(burst);
            if let Some(deadline) = deadline_ns
                && arch::ballot_sync(lanes, arch::global_timer_ns() >= deadline) != 0
            {
                return PollEnd::TimedOut;
            }
            if polls >= SPINS_BEFORE_BACKOFF {
                let slow = polls - SPINS_BEFORE_BACKOFF;
                if slow == 0 {
                    self.publish_wait();
                }
                if slow.is_multiple_of(BACKOFFS_PER_ABORT_CHECK)
                    && arch::ballot_sync(lanes, self.comm.abort_requested()) != 0
                {
                    return PollEnd::Aborted;
                }
                arch::spin_wait_hint(64);
            }
        }
    }

    /// Writes this wait's [`WaitRecord`] (every polling lane stores the same values): the
    /// watchdog then reports the peers whose inbox words are below the session's epoch. The
    /// LL protocol (`crate::coll::ll`) calls it too when its data is slow to come, after a
    /// relaxed arrival that each sender makes once its data is sent.
    #[cold]
    pub(crate) fn publish_wait(&self) {
        if self.comm.wait_records == 0 {
            return;
        }
        let r = (self.comm.wait_records as *mut WaitRecord).wrapping_add(self.index as usize);
        let sys = arch::Scope::Sys;
        // SAFETY: `wait_records` holds `lsa_barrier_total` records and `index` is below it
        // (checked in `with_set`); the host only reads them, and kernels write them only
        // with these atomic stores.
        unsafe {
            atomic::store(&raw mut (*r).epoch, self.epoch, StoreOrder::Relaxed, sys);
            atomic::store(&raw mut (*r).cta, arch::linear_block_idx() as u32, StoreOrder::Relaxed, sys);
            atomic::store(&raw mut (*r).active, 1, StoreOrder::Relaxed, sys);
        }
    }

    /// [`Self::poll_until`] at the session's scope and with the session's lane mask, each
    /// specialized (a literal full mask where the coop's warps are full spares the votes
    /// their convergence check), followed by `fence.acquire` at that scope if `acquire`.
    #[inline(always)]
    fn poll_at_lsa_scope<K: Coop>(
        &self,
        coop: K,
        slot: *const u32,
        acquire: bool,
        deadline_ns: Option<u64>,
    ) -> PollEnd {
        let poll = |scope| {
            let end = if coop.full_warps() {
                self.poll_until(slot, scope, arch::FULL_MASK, deadline_ns)
            } else {
                self.poll_until(slot, scope, self.lanes, deadline_ns)
            };
            if acquire {
                arch::atomic::fence(FenceOrder::Acquire, scope);
            }
            end
        };
        match self.scope {
            arch::Scope::Gpu => poll(arch::Scope::Gpu),
            arch::Scope::Sys => poll(arch::Scope::Sys),
            arch::Scope::Cta => poll(arch::Scope::Cta),
        }
    }

    /// The wait of every variant. With `uniform_result` the coop agrees on the result
    /// (one extra coop vote); without it the result is this thread's own view.
    #[inline(always)]
    fn wait_until(
        &mut self,
        order: BarrierOrder,
        deadline_ns: Option<u64>,
        uniform_result: bool,
    ) -> Result<(), BarrierError> {
        if self.one_warp {
            self.wait_by(CoopWarp, order, deadline_ns, uniform_result)
        } else {
            self.wait_by(self.coop, order, deadline_ns, uniform_result)
        }
    }

    /// [`Self::wait_until`] carried out by `coop` (as in [`Self::arrive_by`]).
    #[inline(always)]
    fn wait_by<K: Coop>(
        &mut self,
        coop: K,
        order: BarrierOrder,
        deadline_ns: Option<u64>,
        uniform_result: bool,
    ) -> Result<(), BarrierError> {
        let acquire = order.acquires();
        // The coop's lanes of each warp poll together and leave together (`poll_until` is
        // warp-uniform), so warps reach the closing barrier converged and it may use the
        // cheaper aligned form.
        let mut end = PollEnd::Reached;
        if self.aborted {
            end = PollEnd::Aborted;
        } else if self.one_peer_per_thread {
            if self.warp_polls {
                end = self.poll_at_lsa_scope(coop, self.poll_slot, acquire, deadline_ns);
            }
        } else {
            // More peers than coop threads: thread `t` polls peers `t`, `t + size`, …; lanes
            // past the last peer of a pass poll that pass's first peer (a duplicate word).
            let n = self.comm.lsa_size as usize;
            let mut first = 0;
            while first < n && end == PollEnd::Reached {
                let p = first + coop.thread_rank();
                let p = if p < n { p } else { first };
                let slot = self.comm.barrier_window.local_ptr::<u32>(inbox_offset(self.comm, self.index, p as u32));
                end = self.poll_at_lsa_scope(coop, slot, acquire, deadline_ns);
                first += coop.size();
            }
        }
        self.aborted |= end == PollEnd::Aborted;
        if !uniform_result {
            coop.sync_converged();
            return if end == PollEnd::Reached { Ok(()) } else { Err(BarrierError::Aborted) };
        }
        if !coop.sync_any(end != PollEnd::Reached) {
            return Ok(());
        }
        // Something failed somewhere in the coop (only this path pays a second vote): an
        // abort anywhere wins over a timeout, and every thread then treats the session as
        // aborted.
        if coop.sync_any(end == PollEnd::Aborted) {
            self.aborted = true;
            Err(BarrierError::Aborted)
        } else {
            Err(BarrierError::Timeout)
        }
    }

    /// `arrive` then `wait`: a full barrier among the LSA domain's ranks (acquire-release).
    ///
    /// ```no_run
    /// use ferrolink_device::{arch, kernel, lsa, CoopCta, DevComm, DevWindow, LsaBarrierSession};
    /// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
    /// kernel! {
    ///     /// Copies `bytes` bytes of `src` into the next LSA rank's slot of `win`, CTA `b` taking
    ///     /// part `b`, then meets the other ranks at barrier `b`: when the kernel ends, this
    ///     /// rank's slot holds the previous rank's bytes.
    ///     ///
    ///     /// # Safety
    ///     /// `comm`, `win` from live handles; `src` holds `bytes <= win.size` bytes;
    ///     /// `grid <= lsa_barrier_count`.
    ///     pub unsafe fn ring_copy(comm: DevComm, win: DevWindow, src: *const u8, bytes: usize) {
    ///         let (b, grid) = (arch::block_idx_x(), arch::grid_dim_x());
    ///         let next = (comm.lsa_rank + 1) % comm.lsa_size;
    ///         // SAFETY: one barrier per CTA (kernel contract).
    ///         let mut bar = unsafe { LsaBarrierSession::new(CoopCta, &comm, b as u32) };
    ///         // SAFETY: the range lies in the next rank's slot (kernel contract).
    ///         unsafe { lsa::copy(CoopCta, win.lsa_ptr(0, next), src, bytes, b, grid) };
    ///         bar.sync();
    ///     }
    /// }
    /// ```
    #[inline(always)]
    pub fn sync(&mut self) {
        self.sync_with(BarrierOrder::AcqRel);
    }

    /// `arrive_with(order)` then `wait_with(order)`.
    ///
    /// ```no_run
    /// use ferrolink_device::{arch, kernel, BarrierOrder, CoopCta, DevComm, LsaBarrierSession};
    /// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
    /// kernel! {
    ///     /// CTA `b` of every rank starts its phase together with the others: a barrier that
    ///     /// shares no memory, so `Relaxed` (control only) suffices.
    ///     ///
    ///     /// # Safety
    ///     /// `comm` from a live handle with at least `grid` barriers.
    ///     pub unsafe fn start_together(comm: DevComm) {
    ///         // SAFETY: one barrier per CTA (kernel contract).
    ///         let mut bar = unsafe { LsaBarrierSession::new(CoopCta, &comm, arch::block_idx_x() as u32) };
    ///         bar.sync_with(BarrierOrder::Relaxed);
    ///         // ... the phase ...
    ///     }
    /// }
    /// ```
    #[inline(always)]
    pub fn sync_with(&mut self, order: BarrierOrder) {
        self.arrive_with(order);
        let _ = self.wait_until(order, None, false);
    }

    /// `arrive` then [`try_wait`](Self::try_wait).
    ///
    /// ```no_run
    /// use ferrolink_device::{arch, kernel, CoopCta, DevComm, LsaBarrierSession};
    /// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
    /// kernel! {
    ///     /// One barrier round on barrier `b`; `status[b]` is 1 if every rank arrived, 0 if the
    ///     /// communicator was aborted (a failed rank must never let the others pass).
    ///     ///
    ///     /// # Safety
    ///     /// `comm` from a live handle with at least `grid` barriers; `status` holds `grid` words.
    ///     pub unsafe fn guarded_sync(comm: DevComm, status: *mut u32) {
    ///         let b = arch::block_idx_x();
    ///         // SAFETY: one barrier per CTA (kernel contract).
    ///         let mut bar = unsafe { LsaBarrierSession::new(CoopCta, &comm, b as u32) };
    ///         let ok = bar.try_sync().is_ok();
    ///         if arch::thread_rank_in_block() == 0 {
    ///             // SAFETY: `status` holds one word per CTA.
    ///             unsafe { status.add(b).write(u32::from(ok)) };
    ///         }
    ///     }
    /// }
    /// ```
    #[inline(always)]
    pub fn try_sync(&mut self) -> Result<(), BarrierError> {
        self.arrive();
        self.try_wait()
    }

    /// `arrive` then `wait_timeout`.
    ///
    /// ```no_run
    /// use ferrolink_device::{arch, kernel, CoopCta, DevComm, LsaBarrierSession};
    /// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
    /// kernel! {
    ///     /// One barrier round on barrier `b` that gives up after `timeout_ns`: a rank that never
    ///     /// arrives makes the others report (1 in `status[b]`) instead of hanging.
    ///     ///
    ///     /// # Safety
    ///     /// `comm` from a live handle with at least `grid` barriers; `status` holds `grid` words.
    ///     pub unsafe fn sync_or_time_out(comm: DevComm, timeout_ns: u64, status: *mut u32) {
    ///         let b = arch::block_idx_x();
    ///         // SAFETY: one barrier per CTA (kernel contract).
    ///         let mut bar = unsafe { LsaBarrierSession::new(CoopCta, &comm, b as u32) };
    ///         let failed = bar.sync_timeout(timeout_ns).is_err();
    ///         if arch::thread_rank_in_block() == 0 {
    ///             // SAFETY: `status` holds one word per CTA.
    ///             unsafe { status.add(b).write(u32::from(failed)) };
    ///         }
    ///     }
    /// }
    /// ```
    #[inline(always)]
    pub fn sync_timeout(&mut self, timeout_ns: u64) -> Result<(), BarrierError> {
        self.arrive();
        self.wait_timeout(timeout_ns)
    }

    /// The epoch of the last arrival.
    ///
    /// ```no_run
    /// use ferrolink_device::{arch, kernel, CoopCta, DevComm, LsaBarrierSession};
    /// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
    /// kernel! {
    ///     /// One barrier round on barrier `b`; `epochs[b]` gets the epoch after it (one more per
    ///     /// round, carried across launches).
    ///     ///
    ///     /// # Safety
    ///     /// `comm` from a live handle with at least `grid` barriers; `epochs` holds `grid` words.
    ///     pub unsafe fn note_epoch(comm: DevComm, epochs: *mut u32) {
    ///         let b = arch::block_idx_x();
    ///         // SAFETY: one barrier per CTA (kernel contract).
    ///         let mut bar = unsafe { LsaBarrierSession::new(CoopCta, &comm, b as u32) };
    ///         bar.sync();
    ///         if arch::thread_rank_in_block() == 0 {
    ///             // SAFETY: `epochs` holds one word per CTA.
    ///             unsafe { epochs.add(b).write(bar.epoch()) };
    ///         }
    ///     }
    /// }
    /// ```
    pub fn epoch(&self) -> u32 {
        self.epoch
    }
}

/// Byte offset of barrier `index`'s inbox word for arrivals from LSA rank `from`.
#[inline(always)]
fn inbox_offset(comm: &DevComm, index: u32, from: u32) -> usize {
    index as usize * inbox_row_bytes(comm.lsa_size) + from as usize * 4
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
