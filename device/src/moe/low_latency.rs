//! MoE dispatch and combine in **low-latency mode**: no count exchange before the data, a
//! fixed place for every row, two buffers by call parity, and each half (send, receive) a
//! kernel of its own if the caller wants one (the *receive hook*: compute overlaps the
//! transfer between them).
//!
//! # Layout
//! Expert `e` lives on rank `e / experts_per_rank` as its local expert `l`. Every (local
//! expert, source rank) pair owns `max_tokens` rows of the receive window, twice (call
//! parity `p = epoch % 2`): row `i` of local expert `l` from rank `s` lies at [`RowLayout::recv_row`]`(p,
//! l, s, i)`. A rank gives each of its entries to expert `e` the next free *slot* of `e`
//! (an atomic counter per expert: the order of a source's rows in its region is not fixed,
//! the rows are), puts the token's row there, and, once all its entries are out, its count
//! per local expert to every rank. Nothing is dropped: a source has at most `max_tokens`
//! entries per expert when its tokens name distinct experts; more is a fault
//! ([`error_code::MOE_CAPACITY`]), never an overwrite.
//!
//! A source reads the results of a direct (LSA) peer's experts in place, in that peer's
//! receive window where it put the row; those of other ranks come back into its return
//! window, row `e * max_tokens + slot` ([`RowLayout::ret_row`]). It remembers either place
//! per entry (a [`super::ResultPlace`]), and the combine sums them per token as in normal
//! mode (the weighted sum of [`super::combine`]).
//!
//! # The kernels
//! * [`dispatch`] with [`phase::SEND`]: each CTA takes a run of tokens, copies their rows
//!   into the send window, meets, then its warps take the run's entries in turn: per entry a
//!   slot and a put of the row; then one signal [`signal::DATA`]`[p]` per rank by the rows the
//!   CTA put there (`PeerTally`). The last CTA to finish (a counter of finished CTAs)
//!   puts this rank's counts per local expert to every rank (signal [`signal::COUNTS`]`[p]`) and
//!   zeroes the other parity's counters for the next call.
//! * [`dispatch`] with [`phase::RECV`]: CTA 0 waits for every rank's counts of this call,
//!   writes `recv_counts [local expert][source]`, and waits for that many rows.
//! * [`combine`] with [`phase::SEND`]: CTA 0 raises [`signal::READY`] on every direct peer
//!   (its results may be read in place); every received row from a rank outside the domain
//!   goes back to it, the rows of all such (source, local expert) regions dealt to the grid's
//!   warps in turn, then one signal [`signal::RETURN`] per rank per CTA. With
//!   [`phase::RECV`]: every CTA waits for the results put back to this rank and for every
//!   direct peer's `READY`, and computes its share of the weighted sums.
//!
//! [`phase::BOTH`] runs both halves in one kernel (no hook).
//!
//! # Ordering
//! * Slots: lane 0 of the warp takes a slot with a relaxed atomic add at GPU scope. Each CTA
//!   meets (CTA barrier), then its thread 0 issues a release fence at GPU scope and adds 1 to
//!   the finished-CTA counter; the thread that reads `grid - 1` there issues an acquire fence
//!   at GPU scope and its CTA meets: it sees every slot taken (the counters' final values).
//! * Counters of the other parity are zeroed by that last CTA; the next call (the other
//!   parity) runs after this kernel on the stream.
//! * Rows and counts between ranks: each signal is raised once the data it counts has landed
//!   (GIN's strong signals; for the rows' per-CTA signals, `PeerTally`);
//!   [`Gin::wait_signal`] acquires at system scope. The receiver
//!   counts the rows it expects from the counts and waits for the running total of rows of
//!   this parity (kept by CTA 0's thread 0 in the state), so the order of counts and rows on
//!   the wire does not matter. Each rank's part of the counts signal of parity `p` reaches
//!   `(epoch + 1) / 2`, waited for per rank ([`Gin::wait_signal_each`]): a fast rank's counts
//!   of call `c + 2` may arrive before a slow rank's of call `c` (the same parity), and a
//!   total would count them in its place.
//! * `READY` as in normal mode ([`super`]): a release at system scope after the stream's
//!   earlier kernels wrote the results; it reaches `epoch` times the direct peers.
//! * Reuse: a rank sends rows of call `c + 2` (parity `p` again) only after its receive of
//!   `c + 1`, which waited for every rank's counts of `c + 1`; a rank sends those only after
//!   its combine of `c` ended (stream and call order), and a combine ends after its sources
//!   (the rows of parity `p`) were read ([`Gin::flush`], and, for results read in place, the
//!   peers' sums of call `c`, which ended before they sent counts of `c + 1`). Results of
//!   `c + 1` come back to a
//!   source only after it sent rows of `c + 1`, that is after its combine of `c` ended, so one
//!   return buffer is enough. Every kernel ends with [`Gin::flush`], so the send window and the
//!   own counts may be rewritten by the next call.

use super::{
    NO_RETURN, PUSHED, PeerTally, ResultPlace, ResultRows, SumArgs, TokenRows, dealt_start, direct_peers, rows_fit,
    signal_ready, weighted_sum,
};
use crate::arch::{self, FenceOrder, RmwOrder, Scope, U32x4, atomic};
use crate::comm::{DevComm, error_code};
use crate::coop::{Coop, CoopCta, CoopWarp};
use crate::gin::{Gin, LocalAction, RemoteAction};
use crate::window::DevWindow;
use bytemuck::{Pod, Zeroable};

/// Which halves a low-latency kernel runs ([`MoeLowLatencyArgs::phase`]).
pub mod phase {
    /// Sends (the dispatch's rows and counts, the combine's results).
    ///
    /// ```
    /// use ferrolink_device::moe::low_latency::phase;
    /// assert_eq!(phase::SEND | phase::RECV, phase::BOTH);
    /// ```
    pub const SEND: u32 = 1;
    /// Receives (the dispatch waits for its rows, the combine for its results and sums them).
    ///
    /// ```
    /// use ferrolink_device::moe::low_latency::phase;
    /// assert_eq!(phase::RECV & phase::SEND, 0); // separate bits
    /// ```
    pub const RECV: u32 = 2;
    /// Both, in one kernel.
    ///
    /// ```
    /// use ferrolink_device::moe::low_latency::phase;
    /// assert_eq!(phase::BOTH, phase::SEND | phase::RECV); // one kernel, no receive hook
    /// ```
    pub const BOTH: u32 = 3;
}

/// The GIN signals of the low-latency kernels (GIN context 0 of their own device
/// communicator).
pub mod signal {
    /// Count messages received, by call parity.
    ///
    /// ```
    /// use ferrolink_device::moe::low_latency::signal;
    /// let epoch = 3u64; // call 3 uses the buffers and signals of parity 1
    /// assert_eq!(signal::COUNTS[(epoch % 2) as usize], 1);
    /// ```
    pub const COUNTS: [u32; 2] = [0, 1];
    /// Rows received, by call parity.
    ///
    /// ```
    /// use ferrolink_device::moe::low_latency::signal;
    /// let epoch = 3u64;
    /// assert_eq!(signal::DATA[(epoch % 2) as usize], 3);
    /// ```
    pub const DATA: [u32; 2] = [2, 3];
    /// Results received.
    ///
    /// ```
    /// use ferrolink_device::moe::low_latency::signal;
    /// assert!(signal::RETURN < signal::COUNT);
    /// ```
    pub const RETURN: u32 = 4;
    /// A direct peer's expert results may be read in place.
    ///
    /// ```
    /// use ferrolink_device::moe::low_latency::signal;
    /// assert!(signal::READY < signal::COUNT);
    /// ```
    pub const READY: u32 = 5;
    /// Signals in all.
    ///
    /// ```
    /// use ferrolink_device::moe::low_latency::signal;
    /// // Both parities' counts and data signals, then the return and ready signals.
    /// assert_eq!(signal::COUNT, signal::READY + 1);
    /// ```
    pub const COUNT: u32 = 6;
}

/// What the low-latency kernels run with (the same on every rank but `tokens` and the
/// addresses).
///
/// ```
/// use ferrolink_device::moe::low_latency::{MoeLowLatencyArgs, phase};
/// // The send half of call 1 (8 bf16 tokens of hidden 64), before the device addresses:
/// let send = MoeLowLatencyArgs {
///     tokens: 8,
///     top_k: 2,
///     num_experts: 16,
///     max_tokens: 8,
///     hidden: 64,
///     phase: phase::SEND,
///     x_units: 64 / 8,
///     epoch: 1,
///     ..MoeLowLatencyArgs::default()
/// };
/// // Its receive half, launched later (the receive hook): the same arguments but the phase.
/// let recv = MoeLowLatencyArgs { phase: phase::RECV, ..send };
/// assert_eq!(send.phase | recv.phase, phase::BOTH);
/// ```
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct MoeLowLatencyArgs {
    /// This rank's tokens in this call (at most `max_tokens`).
    pub tokens: u32,
    /// Experts per token.
    pub top_k: u32,
    /// Experts in all (a multiple of `nranks`).
    pub num_experts: u32,
    /// The most tokens of a rank per call, and the rows per (local expert, source).
    pub max_tokens: u32,
    /// Elements per token: a multiple of 8. Every row slot of the windows holds `2 * hidden`
    /// bytes (a bf16 row; an fp8 row with its scales fits too).
    pub hidden: u32,
    /// [`phase`] bits.
    pub phase: u32,
    /// 16-byte units of `x` per token row (the dispatch; see the normal mode's `TokenRows`).
    pub x_units: u32,
    /// 16-byte units of `scales` per token row (0 for bf16 rows).
    pub scale_units: u32,
    /// The dispatch call's number, from 1 (its parity picks the buffers).
    pub epoch: u64,
    /// Device address of the tokens, `x_units` 16-byte units per token (dispatch).
    pub x: u64,
    /// Device address of the tokens' scales, `scale_units` 16-byte units per token, or 0.
    pub scales: u64,
    /// Device address of `i32 [tokens * top_k]`: each entry's expert, or -1 (dispatch).
    pub topk_idx: u64,
    /// Device address of `f32 [tokens * top_k]` (combine).
    pub topk_weights: u64,
    /// Device address of [`ResultPlace`]` [tokens * top_k]`: where each entry's result will
    /// be (written by the dispatch, read by the combine).
    pub ret_index: u64,
    /// Device address of `i32 [experts per rank][nranks]`: rows received per (local expert,
    /// source) (dispatch).
    pub recv_counts: u64,
    /// Device address of the [`LowLatencyState`] and the slot counters after it
    /// ([`scratch_bytes`]).
    pub state: u64,
    /// Device address of `bf16 [tokens][hidden]`: the combine's output.
    pub out: u64,
}

impl SumArgs for MoeLowLatencyArgs {
    fn sum_shape(&self) -> (usize, usize, usize) {
        (self.tokens as usize, self.top_k as usize, self.hidden as usize)
    }
    fn sum_buffers(&self) -> (*const ResultPlace, *const f32, *mut U32x4) {
        (self.ret_index as *const ResultPlace, self.topk_weights as *const f32, self.out as *mut U32x4)
    }
}

/// A rank's running totals in low-latency mode (device memory). Each field is written by one
/// thread at a time, and only field by field: the send half's last CTA writes `ret_total`
/// and `done` while, in the same kernel, CTA 0's receive writes `data_total` and `received`.
///
/// ```
/// use ferrolink_device::moe::low_latency::{LowLatencyState, scratch_bytes};
/// // The state opens the scratch, the slot counters follow it.
/// assert_eq!(scratch_bytes(16), size_of::<LowLatencyState>() + 2 * 16 * 4);
/// assert_eq!(LowLatencyState::default().data_total, [0, 0]);
/// ```
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct LowLatencyState {
    /// Rows received by every receive of each parity so far (the data signals' targets).
    pub data_total: [u64; 2],
    /// Results put back to this rank by every combine so far (the return signal's target:
    /// those of ranks that are not direct peers), counted by the dispatches' sends.
    pub ret_total: u64,
    /// Rows this rank received in the last dispatch.
    pub received: u64,
    /// Finished dispatch CTAs, by parity (the last one sends the counts).
    pub done: [u32; 2],
    /// Unused.
    pub _reserved: [u32; 6],
}

/// Bytes of the state and the slot counters after it (`u32 [2][num_experts]`).
///
/// ```
/// use ferrolink_device::moe::low_latency::scratch_bytes;
/// // A `u32` slot counter per expert and parity after the state:
/// assert_eq!(scratch_bytes(16) - scratch_bytes(0), 2 * 16 * 4);
/// ```
pub const fn scratch_bytes(num_experts: usize) -> usize {
    core::mem::size_of::<LowLatencyState>() + 8 * num_experts
}

/// Dynamic shared memory the kernels need per CTA, for `num_experts` experts: a `u64` and a
/// `PeerTally` (`num_experts` words cover any number of ranks).
///
/// ```
/// use ferrolink_device::moe::low_latency::shared_bytes;
/// assert_eq!(shared_bytes(64), 8 + 4 * 64);
/// ```
pub const fn shared_bytes(num_experts: usize) -> usize {
    8 + 4 * num_experts
}

/// Where rows lie in the receive and return windows, for one shape.
///
/// ```
/// use ferrolink_device::moe::low_latency::RowLayout;
/// // 2 experts per rank, 4 ranks, 8 rows per (expert, source), bf16 rows of hidden 64:
/// let rows = RowLayout { per_rank: 2, nranks: 4, max_tokens: 8, row_bytes: 128 };
/// // Parity 1's rows follow all of parity 0's.
/// assert_eq!(rows.recv_row(1, 0, 0, 0), 2 * 4 * 8 * 128);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowLayout {
    /// Experts per rank.
    pub per_rank: usize,
    /// Ranks.
    pub nranks: usize,
    /// `max_tokens`: rows per (local expert, source), and per expert in the return window.
    pub max_tokens: usize,
    /// Bytes per row (`2 * hidden`).
    pub row_bytes: usize,
}

impl RowLayout {
    /// Byte offset of row `i` from source `s` of local expert `l` in the receive window, for
    /// call parity `p` (`[2][experts per rank][nranks][max_tokens]` rows).
    ///
    /// ```
    /// use ferrolink_device::moe::low_latency::RowLayout;
    /// let rows = RowLayout { per_rank: 2, nranks: 4, max_tokens: 8, row_bytes: 128 };
    /// // Row 3 from source 2 of local expert 1, parity 0:
    /// assert_eq!(rows.recv_row(0, 1, 2, 3), ((4 + 2) * 8 + 3) * 128);
    /// ```
    pub const fn recv_row(&self, p: usize, l: usize, s: usize, i: usize) -> usize {
        (((p * self.per_rank + l) * self.nranks + s) * self.max_tokens + i) * self.row_bytes
    }

    /// The return row of slot `i` of expert `e` (`e * max_tokens + i`; its byte offset is
    /// that times the row size).
    ///
    /// ```
    /// use ferrolink_device::moe::low_latency::RowLayout;
    /// let rows = RowLayout { per_rank: 2, nranks: 4, max_tokens: 8, row_bytes: 128 };
    /// // Slot 3 of expert 5: row 43, at byte 43 * 128 of the return window.
    /// assert_eq!(rows.ret_row(5, 3), 43);
    /// ```
    pub const fn ret_row(&self, e: usize, i: usize) -> usize {
        e * self.max_tokens + i
    }
}

/// Where the counts lie in the counts window (`u32`): received `[2][nranks][experts per
/// rank]`, then this rank's own `[nranks][experts per rank]` (the sources of its puts).
#[derive(Clone, Copy)]
struct Counts {
    n: usize,
    per_rank: usize,
}

impl Counts {
    /// Byte offset of the counts from `src` for parity `p`.
    fn received(&self, p: usize, src: usize) -> usize {
        (p * self.n + src) * self.per_rank * 4
    }
    /// Byte offset of this rank's counts for rank `dst`.
    fn own(&self, dst: usize) -> usize {
        (2 * self.n + dst) * self.per_rank * 4
    }
}

/// Bytes of the counts window for `num_experts` experts (three blocks of `nranks *
/// experts_per_rank = num_experts` words).
///
/// ```
/// use ferrolink_device::moe::low_latency::counts_bytes;
/// assert_eq!(counts_bytes(16), 3 * 16 * 4);
/// ```
pub const fn counts_bytes(num_experts: usize) -> usize {
    3 * num_experts * 4
}

#[inline(always)]
fn check_args(comm: &DevComm, args: &MoeLowLatencyArgs) {
    let n = comm.nranks;
    let bad = n == 0
        || args.num_experts == 0
        || !args.num_experts.is_multiple_of(n)
        || args.hidden == 0
        || !args.hidden.is_multiple_of(8)
        || !rows_fit(args.x_units, args.scale_units, args.hidden)
        || args.max_tokens == 0
        || args.tokens > args.max_tokens
        || args.phase == 0
        || args.phase > phase::BOTH;
    if bad {
        comm.fail(
            error_code::MOE_ARGS,
            u64::from(args.num_experts) << 32 | u64::from(args.hidden),
            u64::from(args.max_tokens) << 32 | u64::from(args.phase),
        );
    }
}

/// One CTA (`block` of `grid`) of the low-latency dispatch: see the module docs. `send` holds
/// `max_tokens` rows (this rank's, copied in by the kernel), `recv` the rows received
/// (`[2][experts per rank][nranks][max_tokens]`), `counts` [`counts_bytes`]. False on an
/// abort (the host reports it).
///
/// # Safety
/// Every rank runs it with the same `args` (but `tokens`, `phase` and the addresses) and
/// windows (by id); the send half with every CTA resident at once when the receive half runs
/// in the same kernel; [`shared_bytes`] of dynamic shared memory and a whole number of warps
/// per CTA; the windows hold what is said above; the addresses in `args` hold what
/// [`MoeLowLatencyArgs`] says, the state is this rank's and used by one of these kernels at a
/// time; the signals [`signal`] of GIN context 0 are these kernels'; `args.epoch` counts the
/// dispatches, and the halves run in the order send, receive, combine send, combine receive.
///
/// # Examples
///
/// ```no_run
/// use ferrolink_device::moe::low_latency::{self, MoeLowLatencyArgs};
/// use ferrolink_device::{DevComm, DevWindow, arch, kernel};
/// kernel! {
///     /// The low-latency dispatch as a kernel of one's own (as the built-in
///     /// `moe_ll_dispatch`): the halves `args.phase` names.
///     ///
///     /// # Safety
///     /// As `low_latency::dispatch`.
///     pub unsafe fn my_ll_dispatch(
///         comm: DevComm, send: DevWindow, recv: DevWindow, counts: DevWindow, args: MoeLowLatencyArgs
///     ) {
///         // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
///         let (block, grid) = (arch::block_idx_x(), arch::grid_dim_x());
///         // SAFETY: the kernel's contract. False: the communicator was aborted (the host reports it).
///         let _ = unsafe { low_latency::dispatch(&comm, &send, &recv, &counts, &args, block, grid) };
///     }
/// }
/// ```
pub unsafe fn dispatch(
    comm: &DevComm,
    send: &DevWindow,
    recv: &DevWindow,
    counts: &DevWindow,
    args: &MoeLowLatencyArgs,
    block: usize,
    grid: usize,
) -> bool {
    check_args(comm, args);
    let cta = CoopCta;
    let gin = Gin::new(comm, 0);
    let (n, me) = (comm.nranks as usize, comm.rank as usize);
    let ne = args.num_experts as usize;
    let per_rank = ne / n;
    let max = args.max_tokens as usize;
    let row = args.hidden as usize * 2;
    let k = args.top_k as usize;
    let p = (args.epoch % 2) as usize;
    let c = Counts { n, per_rank };
    let rows = RowLayout { per_rank, nranks: n, max_tokens: max, row_bytes: row };
    let (tid, threads) = (cta.thread_rank(), cta.size());
    let state = args.state as *mut LowLatencyState;
    let slots = (args.state as usize + core::mem::size_of::<LowLatencyState>()) as *mut u32;
    // SAFETY: (the whole body) every index lies in the arrays the contract sizes: rows by
    // `tokens <= max_tokens`, entries by `tokens * top_k`, counters by `2 * num_experts`,
    // window offsets by the layout above.
    unsafe {
        if args.phase & phase::SEND != 0 {
            let (warp, warps) = (arch::warp_id_in_block(), threads / arch::WARP_SIZE);
            let lane = arch::lane_id() as usize;
            let idx = args.topk_idx as *const i32;
            let ret_index = args.ret_index as *mut ResultPlace;
            let token_rows = TokenRows::new(args.x, args.x_units, args.scales, args.scale_units);
            let tally = PeerTally::new(cta, arch::dynamic_shared_mem::<u32>().wrapping_add(2), n);
            // This CTA's run of tokens: their rows into the send window, by every thread.
            let tokens = args.tokens as usize;
            let run = tokens.div_ceil(grid);
            let (first, last) = ((block * run).min(tokens), ((block + 1) * run).min(tokens));
            token_rows.stage(send, row, first, last, tid, threads);
            cta.sync();
            // Its entries, a warp each in turn.
            let mut j = first * k + warp;
            while j < last * k {
                let t = j / k;
                let e = idx.add(j).read();
                if e < 0 {
                    if lane == 0 {
                        ret_index.add(j).write(ResultPlace { row: NO_RETURN, rank: PUSHED });
                    }
                    j += warps;
                    continue;
                }
                if e >= ne as i32 {
                    comm.fail(error_code::MOE_ARGS, j as u64, u64::from(e as u32));
                }
                let e = e as usize;
                let mut slot = 0u32;
                if lane == 0 {
                    slot = atomic::fetch_add(slots.add(p * ne + e), 1u32, RmwOrder::Relaxed, Scope::Gpu);
                }
                let slot = arch::shfl_sync(arch::FULL_MASK, slot, 0) as usize;
                if slot >= max {
                    comm.fail(error_code::MOE_CAPACITY, e as u64, max as u64);
                }
                let (l, dst) = (e % per_rank, (e / per_rank) as u32);
                if lane == 0 {
                    let place = if gin.is_direct(dst) {
                        ResultPlace { row: (rows.recv_row(p, l, me, slot) / row) as u32, rank: dst }
                    } else {
                        ResultPlace { row: rows.ret_row(e, slot) as u32, rank: PUSHED }
                    };
                    ret_index.add(j).write(place);
                }
                tally.put_row(
                    &gin,
                    comm,
                    dst as usize,
                    *recv,
                    rows.recv_row(p, l, me, slot),
                    *send,
                    t * row,
                    token_rows.bytes(),
                );
                j += warps;
            }
            tally.signal(&gin, cta, signal::DATA[p]);
            // The last CTA to finish sends the counts.
            cta.sync();
            let mut last = false;
            if tid == 0 {
                atomic::fence(FenceOrder::Release, Scope::Gpu);
                let done = core::ptr::addr_of_mut!((*state).done[p]);
                last = atomic::fetch_add(done, 1u32, RmwOrder::Relaxed, Scope::Gpu) as usize == grid - 1;
                if last {
                    atomic::fence(FenceOrder::Acquire, Scope::Gpu);
                }
            }
            if cta.sync_any(last) {
                let mine = counts.local_ptr::<u32>(c.own(0));
                let mut e = tid;
                while e < ne {
                    let got = atomic::load(slots.add(p * ne + e), arch::LoadOrder::Relaxed, Scope::Gpu);
                    // Own counts: rank `e / per_rank`'s vector, entry `e % per_rank`.
                    mine.add(e).write(got);
                    slots.add((1 - p) * ne + e).write(0);
                    e += threads;
                }
                cta.sync();
                if tid == 0 {
                    // Field by field: in one kernel with the receive half, CTA 0 writes the
                    // data totals meanwhile.
                    // Results from direct peers are read in place: none is put back.
                    let mut sent = 0u64;
                    for e in 0..ne {
                        if !gin.is_direct((e / per_rank) as u32) {
                            sent += u64::from(mine.add(e).read());
                        }
                    }
                    let ret_total = core::ptr::addr_of_mut!((*state).ret_total);
                    ret_total.write_volatile(ret_total.read_volatile() + sent);
                    core::ptr::addr_of_mut!((*state).done[1 - p]).write_volatile(0);
                }
                let (warp, warps) = (arch::warp_id_in_block(), threads / arch::WARP_SIZE);
                let mut d = warp;
                while d < n {
                    gin.put(
                        CoopWarp,
                        comm.world(),
                        d as u32,
                        *counts,
                        c.received(p, me),
                        *counts,
                        c.own(d),
                        per_rank * 4,
                        RemoteAction::SignalInc(signal::COUNTS[p]),
                        LocalAction::None,
                    );
                    d += warps;
                }
            }
        }
        if args.phase & phase::RECV != 0 && block == 0 {
            let calls = args.epoch.div_ceil(2);
            if gin.wait_signal_each(cta, signal::COUNTS[p], calls).is_err() {
                return false;
            }
            let target = arch::dynamic_shared_mem::<u64>();
            if tid == 0 {
                let mut expected = 0u64;
                for s in 0..n {
                    let from = counts.local_ptr::<u32>(c.received(p, s));
                    for l in 0..per_rank {
                        let got = from.add(l).read_volatile();
                        (args.recv_counts as *mut i32).add(l * n + s).write(got as i32);
                        expected += u64::from(got);
                    }
                }
                // Field by field (the send half's last CTA may be writing the others).
                let total = core::ptr::addr_of_mut!((*state).data_total[p]);
                let t = total.read_volatile() + expected;
                total.write_volatile(t);
                core::ptr::addr_of_mut!((*state).received).write_volatile(expected);
                target.write(t);
            }
            cta.sync();
            if gin.wait_signal(cta, signal::DATA[p], target.read()).is_err() {
                return false;
            }
        }
    }
    gin.flush(cta);
    true
}

/// One CTA (`block` of `grid`) of the low-latency combine: see the module docs. `recv` holds
/// the experts' results where the dispatch put their rows, `ret` this rank's results
/// (`[num_experts][max_tokens]` rows), `counts` the dispatch's counts. False on an abort.
///
/// # Safety
/// As [`dispatch`] (the same windows and `args`, after its receive half);
/// `args.topk_weights` and `args.out` hold `tokens * top_k` weights and `tokens * hidden`
/// bf16, and `args.ret_index` what the dispatch wrote.
///
/// # Examples
///
/// ```no_run
/// use ferrolink_device::moe::low_latency::{self, MoeLowLatencyArgs};
/// use ferrolink_device::{DevComm, DevWindow, arch, kernel};
/// kernel! {
///     /// The low-latency combine as a kernel of one's own (as the built-in `moe_ll_combine`).
///     ///
///     /// # Safety
///     /// As `low_latency::combine`.
///     pub unsafe fn my_ll_combine(
///         comm: DevComm, recv: DevWindow, ret: DevWindow, counts: DevWindow, args: MoeLowLatencyArgs
///     ) {
///         // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
///         let (block, grid) = (arch::block_idx_x(), arch::grid_dim_x());
///         // SAFETY: the kernel's contract. False: the communicator was aborted (the host reports it).
///         let _ = unsafe { low_latency::combine(&comm, &recv, &ret, &counts, &args, block, grid) };
///     }
/// }
/// ```
pub unsafe fn combine(
    comm: &DevComm,
    recv: &DevWindow,
    ret: &DevWindow,
    counts: &DevWindow,
    args: &MoeLowLatencyArgs,
    block: usize,
    grid: usize,
) -> bool {
    check_args(comm, args);
    let cta = CoopCta;
    let gin = Gin::new(comm, 0);
    let (n, me) = (comm.nranks as usize, comm.rank as usize);
    let per_rank = args.num_experts as usize / n;
    let max = args.max_tokens as usize;
    let row = args.hidden as usize * 2;
    let p = (args.epoch % 2) as usize;
    let c = Counts { n, per_rank };
    let rows = RowLayout { per_rank, nranks: n, max_tokens: max, row_bytes: row };
    let (tid, threads) = (cta.thread_rank(), cta.size());
    // SAFETY: (the whole body) indices inside the windows and buffers the contract sizes.
    unsafe {
        if args.phase & phase::SEND != 0 {
            if block == 0 {
                signal_ready(&gin, cta, n, signal::READY);
            }
            let tally = PeerTally::new(cta, arch::dynamic_shared_mem::<u32>().wrapping_add(2), n);
            let warps = threads / arch::WARP_SIZE;
            let (first, stride) = (block * warps + arch::warp_id_in_block(), grid * warps);
            // The rows of every (source, local expert) region of the sources outside the
            // domain in one sequence (`before`: the rows of the regions before), dealt to the
            // grid's warps in turn: a region holds few rows in this mode, and per region the
            // same few warps would do all the work. Direct peers read theirs in place.
            let mut before = 0usize;
            for s in 0..n {
                if gin.is_direct(s as u32) {
                    continue;
                }
                let from = counts.local_ptr::<u32>(c.received(p, s));
                for l in 0..per_rank {
                    let got = from.add(l).read_volatile() as usize;
                    let mut i = dealt_start(first, stride, before);
                    before += got;
                    while i < got {
                        tally.put_row(
                            &gin,
                            comm,
                            s,
                            *ret,
                            rows.ret_row(me * per_rank + l, i) * row,
                            *recv,
                            rows.recv_row(p, l, s, i),
                            row,
                        );
                        i += stride;
                    }
                }
            }
            tally.signal(&gin, cta, signal::RETURN);
        }
        if args.phase & phase::RECV != 0 {
            let expected = (args.state as *const LowLatencyState).read_volatile().ret_total;
            if gin.wait_signal(cta, signal::RETURN, expected).is_err()
                || gin.wait_signal(cta, signal::READY, args.epoch * direct_peers(&gin, n)).is_err()
            {
                return false;
            }
            let rows = ResultRows { recv, ret, lsa_size: comm.lsa_size, row_bytes: row, relayed: false };
            weighted_sum(&rows, args, block * threads + tid, grid * threads);
        }
    }
    gin.flush(cta);
    true
}
