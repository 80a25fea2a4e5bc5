//! MoE dispatch and combine (expert parallelism), written on the public GIN API: each token
//! row goes to the rank that owns its expert with a put, and each token's rank sums its
//! experts' results, read in place inside an LSA domain and put back across domains. GIN
//! takes each peer's path (stores through the LSA mapping inside the domain, the proxy across
//! domains), so one kernel serves a node and many.
//!
//! # Layout
//! `num_experts` experts, `num_experts / nranks` per rank: expert `e` lives on rank
//! `e / experts_per_rank` as its local expert `e % experts_per_rank`. A rank's `T` tokens
//! each name `top_k` experts (`topk_idx[t * top_k + k]`, `-1`: none); an *entry* is one
//! (token, k) pair. Every rank's receive window holds `capacity` rows per local expert
//! (`[local expert][capacity][row]`); the rows of expert `e` are packed in the order (source
//! rank, token, k): the first `counts[0][e]` come from rank 0, and so on, so the layout is
//! the same whatever the timing. An entry whose place is at or past `capacity` is dropped
//! (counted, never written: see [`MoeState::dropped`]); it adds nothing in the combine.
//!
//! # The dispatch kernel ([`dispatch`])
//! 1. CTA `b` copies its run of token rows into the send window (`TokenRows`: bf16, or
//!    fp8 with scales), takes entries `[b * chunk, (b + 1) * chunk)`, counts them per expert, and
//!    publishes the counts with a flag (the call's epoch) in the state's scratch. It then
//!    sums the counts of the CTAs before it (waiting for their flags: CTAs wait only for
//!    lower indices, which never wait for them, so this ends however CTAs are scheduled),
//!    and gives each of its entries its `slot`: the entries of this rank to the same expert
//!    before it.
//! 2. The last CTA, whose sum covers every entry, puts this rank's count per expert into row
//!    `rank` of every rank's count matrix (signal [`signal::COUNTS`]). Every CTA waits for
//!    all `nranks` rows.
//! 3. Entry `(t, k)` to expert `e` goes to row `base(e) + slot` of `e`'s place on its rank,
//!    where `base(e)` is the count of entries to `e` of the ranks before this one: one put of
//!    the token's row by a warp (then one [`signal::DATA`] per CTA and rank). This rank
//!    remembers where the result will be (its [`ResultPlace`]): in the expert rank's receive
//!    window, row for row where the token went, when that rank is a direct (LSA) peer; else
//!    in this rank's return window, where the combine will put it; [`NO_RETURN`] for a
//!    dropped entry or no expert.
//!    Given the weights (`MoeArgs::topk_weights`: the fused combine, [`fused`]), the CTA then
//!    puts each of its rows' [`fused::RowSource`] too, in a walk of its own, before its data
//!    signals.
//! 4. CTA 0 computes, from the matrix, the rows this rank receives per local expert (its
//!    `recv_counts`) and waits for them all.
//!
//! # Relaying across domains (the hierarchical dispatch, [`Relay`])
//! With LSA domains of more than one rank (`MoeArgs::relay_domains`: nodes of several GPUs),
//! an entry whose expert lies in another domain `D` is not put straight to its rank: each
//! token with entries in `D` crosses once, to its *relay* (the rank of `D` with this rank's
//! index in its domain), as its row and a descriptor naming each of its entries in `D` (the
//! expert's rank, the row's place there, computed here from the count matrix as for a direct
//! put, and the weight). Each CTA holds whole tokens; step 1 also counts, per other domain,
//! the tokens with an entry there (extra columns of the count row, exchanged with the
//! counts), so each relay knows how many descriptors come. After its own puts (3b: one
//! [`signal::RELAY`] per CTA and relay), every CTA of the relay waits for this call's
//! descriptors and copies each row to its experts' ranks in the domain through the LSA
//! mapping (3c), raising [`signal::DATA`] there as a direct put would. The receive layout
//! and the counts are the same as without a relay: only the path of the rows changes (across
//! a node boundary, a token's row crosses once per node instead of once per expert there).
//! The combine relays too: see below.
//!
//! # The combine kernel ([`combine`])
//! Results are **read where they lie** inside an LSA domain and **put back** across domains.
//! CTA 0 raises [`signal::READY`] on every direct peer: this rank's expert results (in its
//! receive window, written by the kernels before on its stream) may be read. Row `i` of local
//! expert `e` from a rank `src` that is not a direct peer goes back into `src`'s return
//! window at `prefix(src, e) + i - base(src, e)`, where `prefix(src, e)` is the count of
//! `src`'s entries to experts below `e`: a place `src` knows too (the place the dispatch
//! kept). One put per row, one [`signal::RETURN`] per CTA and rank. Then every CTA waits for
//! the results put to it and for every direct peer's `READY`, and computes `out[t] = sum_k
//! topk_weights[t, k] * result(t, k)` in `f32` (in `k` order), rounded once to bf16, loading
//! each result from its place (a direct peer's receive window through the LSA mapping, or
//! the own return window). Inside a domain each result crosses once (a load) instead of a
//! put and a load.
//!
//! Relaying ([`Relay`]), a token's results in another domain come back once, summed by its
//! relay: the token's rank puts, for each (token, other domain) it has entries in, a weights
//! message (the token's weights, and the return row and kind the dispatch chose:
//! [`RelayGroup`]) to the relay (one [`signal::WEIGHTS`] per CTA and relay). The relay waits
//! for the weights of every token relayed to it and for its direct peers' `READY`, reads each
//! token's results in place (the targets of the dispatch's descriptor), and puts back their
//! weighted sum in `f32` (`4 * hidden` bytes), or, for a token with one entry there, that
//! result's bf16 row (weighted at the token's rank): never more bytes than a row per entry
//! sent there (entries dropped at capacity count), and fewer as soon as a token has three
//! or more entries in a domain (two: as many). The token's rank adds
//! the sum as it is ([`RELAYED_SUM`]; the group's other entries are [`RELAYED_PART`]). The
//! sum's order differs from the `k` order by grouping; both are `f32`, rounded once to bf16.
//!
//! # Ordering
//! * Counts within the grid: a CTA's threads write its token rows and its counts, meet (CTA
//!   barrier), then thread 0 stores the flag with a release at GPU scope (cumulative: it
//!   publishes the threads' stores); a later CTA's thread 0 reads each flag relaxed, issues an acquire
//!   fence at GPU scope, and its CTA meets before any thread reads those counts.
//! * Between ranks: rows are put with no signal of their own; once a CTA's puts are out, it
//!   raises each rank's data (or return) signal once, by the rows it put there (`PeerTally`:
//!   its ordering argument), so each signal becomes visible after the rows it counts have
//!   landed (GIN's strong signals: see [`crate::gin`]). [`Gin::wait_signal`] acquires at
//!   system scope before
//!   the coop meets, so a CTA that saw `nranks` count rows reads all of them, and CTA 0
//!   that saw every expected row has them (the next kernel on the stream reads them after
//!   this one ended).
//! * `READY`: each rank's combine adds 1 on every direct peer with a release at system
//!   scope, after the kernels before it on its stream wrote its expert results (stream order
//!   makes those writes happen before the release, which is cumulative); a peer reads them
//!   after its acquiring wait saw `epoch` adds from every direct peer.
//! * Relay: the source's lanes write a descriptor's targets (plain stores), its CTA meets
//!   (inside the data signal), a warp writes its head and puts the row, then the descriptor
//!   (in order on one context), and the CTA raises `RELAY` on the relay after them (as
//!   `PeerTally` argues for rows); so a relay that saw its `RELAY` target (acquire at system
//!   scope) reads whole rows and descriptors. The descriptor's head and each target carry
//!   the call's epoch: slots and targets of earlier calls are skipped. The relay's copies
//!   are direct puts counted in its `PeerTally`, so the destination's `DATA` is raised after
//!   them (release at system scope). Reuse: a source writes its descriptors and relay slots
//!   of call `c + 1` only after the count exchange of `c + 1`, which needs the relay's count
//!   row of `c + 1`, put after the relay's dispatch `c` (which read the slots) ended. The
//!   `RELAY` target is `relay_base[epoch % 2]` plus the call's counts (from the matrix):
//!   every CTA reads that word, and CTA 0 writes the sum into the other one for the next
//!   call (read after the kernel boundary).
//! * The combine's relay: a token's rank writes a weights message (lanes of a warp) and puts
//!   it (the warp's put publishes its stores, as any put's source); its CTA raises
//!   `WEIGHTS` on the relay after its puts (`PeerTally`). The relay waits for
//!   `weights_target` (set by its dispatch: `weights_done` plus the tokens relayed to it in
//!   this call; the combine stores it into `weights_done`, which no other thread of the
//!   kernel reads) with an acquire at system scope, and for `READY` from its direct peers (the
//!   results it reads), then stages each row in the token's inbound slot (its token row was
//!   read by the dispatch before, on this stream) and puts it, counted for `RETURN` as any
//!   returned row. Reuse: a rank writes messages of call `c + 1` only after the count
//!   exchange of `c + 1`, which needs the relay's count row of `c + 1`, put after the
//!   relay's combine `c` ended (and flushed its puts out of the slots). A token's return
//!   rows of call `c + 1` are written by a relay only after its wait for the weights of
//!   `c + 1`, which include the token's rank's own, sent by its combine `c + 1`: after its
//!   combine `c` read the rows.
//! * Signals are never reset: each rank's part of the counts signal reaches `epoch` at call
//!   `epoch` (each rank puts its row once per call). The wait is per rank
//!   ([`Gin::wait_signal_each`]), not for the total `epoch * nranks`: a rank that needs
//!   nothing from a slow rank in its combine (no rows to or from it) can put its counts of
//!   call `epoch + 1` while the slow rank's row of call `epoch` is still on its way through
//!   the proxy, and a total would let that add stand in for the missing row (a stale row
//!   read: seen on an H200, 3 processes through the TCP proxy). `READY` reaches `epoch` times the direct peers, and the data and
//!   return signals are compared with running
//!   totals kept in the state, each written by one thread (CTA 0's thread 0 in the
//!   dispatch) and read by later kernels.
//! * Reuse across calls: the count matrix of call `epoch` is matrix `epoch % 2`. A rank puts
//!   its counts of call `c + 1` only after its combine of call `c` ended, which may be before
//!   a peer's combine `c` has read matrix `c % 2` (when nothing comes back from that peer, the
//!   rank waits for nothing of it), hence the second matrix; it cannot reach call `c + 2`
//!   before every rank has put its counts of `c + 1`, that is before every combine `c` ended.
//!   Rows are put only after all counts of the call are in: a rank puts rows of call `c + 1`
//!   only once every rank has started `c + 1`, so no row lands in a receive buffer that its
//!   rank still reads for call `c`; results of `c + 1` come back only after every dispatch of
//!   `c + 1` has ended, so none lands in a return row still being summed for `c`. The same
//!   holds for results read in place: a receive window takes rows of call `c + 1` only after
//!   every rank has started `c + 1`, that is after every combine `c` (every read) ended. Both
//!   kernels end with [`Gin::flush`], so the proxy has read every source (token rows, expert
//!   rows, counts) before the stream may rewrite it.

use crate::arch::{self, FenceOrder, LoadOrder, RmwOrder, Scope, StoreOrder, U32x4, atomic};
use crate::comm::{DevComm, error_code};
use crate::coop::{Coop, CoopCta, CoopWarp};
use crate::gin::{Gin, LocalAction, RemoteAction};
use crate::window::DevWindow;
use bytemuck::{Pod, Zeroable};

pub mod fused;
pub mod low_latency;

/// The GIN signals the MoE kernels use (on GIN context 0 of their own device communicator).
pub mod signal {
    /// Count rows received (one per rank per dispatch).
    ///
    /// ```
    /// use ferrolink_device::moe::signal;
    /// // Each rank's part reaches `epoch` at dispatch `epoch` (one count row per rank per call).
    /// assert!(signal::COUNTS < signal::COUNT);
    /// ```
    pub const COUNTS: u32 = 0;
    /// Token rows received (dispatch).
    ///
    /// ```
    /// use ferrolink_device::moe::signal;
    /// assert!(signal::DATA < signal::COUNT);
    /// ```
    pub const DATA: u32 = 1;
    /// Expert results received (combine).
    ///
    /// ```
    /// use ferrolink_device::moe::signal;
    /// assert!(signal::RETURN < signal::COUNT);
    /// ```
    pub const RETURN: u32 = 2;
    /// A direct peer's expert results may be read in place (combine).
    ///
    /// ```
    /// use ferrolink_device::moe::signal;
    /// // A combine waits until it reaches `epoch` times the direct peers.
    /// assert!(signal::READY < signal::COUNT);
    /// ```
    pub const READY: u32 = 3;
    /// Rows an expert kernel added into this rank's accumulators (the fused combine: see
    /// [`super::fused`]).
    ///
    /// ```
    /// use ferrolink_device::moe::signal;
    /// assert!(signal::FUSED < signal::COUNT);
    /// ```
    pub const FUSED: u32 = 4;
    /// Token rows received for relaying into this rank's LSA domain (the dispatch across
    /// domains: see [`super::Relay`]).
    ///
    /// ```
    /// use ferrolink_device::moe::signal;
    /// assert!(signal::RELAY < signal::COUNT);
    /// ```
    pub const RELAY: u32 = 5;
    /// Weights received for summing relayed tokens' results (the combine across domains:
    /// see [`super::Relay`]).
    ///
    /// ```
    /// use ferrolink_device::moe::signal;
    /// assert!(signal::WEIGHTS < signal::COUNT);
    /// ```
    pub const WEIGHTS: u32 = 6;
    /// Signals in all.
    ///
    /// ```
    /// use ferrolink_device::moe::signal::*;
    /// // The host asks for this many GIN signals on the MoE's device communicator.
    /// assert_eq!([COUNTS, DATA, RETURN, READY, FUSED, RELAY, WEIGHTS].len() as u32, COUNT);
    /// ```
    pub const COUNT: u32 = 7;
}

/// A result row meaning "nothing comes back": no expert (`-1`), or dropped at capacity.
///
/// ```
/// use ferrolink_device::moe::{NO_RETURN, ResultPlace, comes_back};
/// // A dropped entry (or one without an expert): the combine adds nothing for it.
/// assert!(!comes_back(ResultPlace { row: NO_RETURN, rank: 0 }));
/// ```
pub const NO_RETURN: u32 = u32::MAX;

/// [`ResultPlace::rank`] of a result put back into this rank's return window (a bf16 row,
/// weighted by the combine).
///
/// ```
/// use ferrolink_device::moe::{PUSHED, ResultPlace, comes_back};
/// // Row 5 of this rank's return window, put back by an expert's rank in another domain:
/// assert!(comes_back(ResultPlace { row: 5, rank: PUSHED }));
/// ```
pub const PUSHED: u32 = u32::MAX;

/// [`ResultPlace::rank`] of the entry that reads its relay's sum (the combine across
/// domains, [`Relay`]): the token's results in one other domain, weighted and summed there
/// in `f32`, come back as one row of `4 * hidden` bytes at `row` of the return window.
///
/// ```
/// use ferrolink_device::moe::{RELAYED_SUM, ResultPlace, comes_back};
/// // The relay's `f32` sum of the token's results in one other domain, at return row 2:
/// assert!(comes_back(ResultPlace { row: 2, rank: RELAYED_SUM }));
/// ```
pub const RELAYED_SUM: u32 = u32::MAX - 1;

/// [`ResultPlace::rank`] of a kept entry whose result is in its group's [`RELAYED_SUM`] (the
/// combine adds nothing for it; the fused combine, which returns every entry, does).
///
/// ```
/// use ferrolink_device::moe::{RELAYED_PART, ResultPlace, comes_back};
/// // Part of a relayed sum: the plain combine adds nothing for it, the fused finish its return row.
/// assert!(comes_back(ResultPlace { row: 3, rank: RELAYED_PART }));
/// ```
pub const RELAYED_PART: u32 = u32::MAX - 2;

/// Whether a kept result comes back into the return window (not read in place): the fused
/// finish adds such entries' return rows.
///
/// ```
/// use ferrolink_device::moe::{PUSHED, ResultPlace, comes_back};
/// // Read in place in world rank 1's receive window: does not come back.
/// assert!(!comes_back(ResultPlace { row: 4, rank: 1 }));
/// assert!(comes_back(ResultPlace { row: 4, rank: PUSHED }));
/// ```
#[inline(always)]
pub const fn comes_back(place: ResultPlace) -> bool {
    place.row != NO_RETURN && place.rank >= RELAYED_PART
}

/// Where an entry's result will be (two `u32`, written by the dispatch, read by the combine).
///
/// ```
/// use ferrolink_device::moe::ResultPlace;
/// // Two `u32` per entry: `ret_index` holds `tokens * top_k` of them.
/// assert_eq!(size_of::<ResultPlace>(), 8);
/// let in_place = ResultPlace { row: 12, rank: 3 }; // row 12 of rank 3's receive window
/// assert_eq!(in_place, ResultPlace { row: 12, rank: 3 });
/// ```
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct ResultPlace {
    /// The row: in `rank`'s receive window, or, for [`PUSHED`], [`RELAYED_SUM`] and
    /// [`RELAYED_PART`], in this rank's return window; [`NO_RETURN`]: no result.
    pub row: u32,
    /// The world rank (a direct peer, maybe this one) whose receive window holds the result
    /// in place, or [`PUSHED`], [`RELAYED_SUM`], [`RELAYED_PART`].
    pub rank: u32,
}

/// The most CTAs a dispatch grid may have (the state's scratch holds a count row per CTA).
///
/// ```
/// use ferrolink_device::moe::MAX_CTAS;
/// // The host clamps the dispatch grid to it.
/// let grid = 100_000usize.div_ceil(64).clamp(1, MAX_CTAS);
/// assert_eq!(grid, 256);
/// ```
pub const MAX_CTAS: usize = 256;

/// What the MoE kernels run with (the same on every rank but `tokens` and the addresses).
///
/// ```
/// use ferrolink_device::moe::MoeArgs;
/// // What the host's `Moe` fills in for a dispatch of 6 bf16 tokens over a grid of 3 CTAs,
/// // before the device addresses:
/// let (tokens, top_k, grid) = (6u32, 2u32, 3u32);
/// let args = MoeArgs {
///     tokens,
///     top_k,
///     num_experts: 8,
///     capacity: 12,
///     hidden: 64,
///     chunk: tokens.div_ceil(grid) * top_k, // whole tokens per CTA
///     x_units: 64 / 8,                      // a bf16 row: hidden / 8 units of 16 bytes
///     epoch: 1,
///     max_tokens: 6,
///     ..MoeArgs::default()
/// };
/// assert!(args.chunk * grid >= args.tokens * args.top_k); // the chunks cover every entry
/// ```
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct MoeArgs {
    /// This rank's tokens in this call.
    pub tokens: u32,
    /// Experts per token.
    pub top_k: u32,
    /// Experts in all (a multiple of `nranks`).
    pub num_experts: u32,
    /// Rows per local expert in the receive window.
    pub capacity: u32,
    /// Elements per token: a multiple of 8. Every row slot of the windows holds `2 * hidden`
    /// bytes (a bf16 row: the experts' results; an fp8 row with its scales fits too).
    pub hidden: u32,
    /// Entries per CTA in the dispatch (at least 1).
    pub chunk: u32,
    /// 16-byte units of `x` per token row (the dispatch; see `TokenRows`).
    pub x_units: u32,
    /// 16-byte units of `scales` per token row (0 for bf16 rows).
    pub scale_units: u32,
    /// The dispatch call's number, from 1 (each rank's part of the count signal reaches `epoch`).
    pub epoch: u64,
    /// Device address of `i32 [tokens * top_k]`: each entry's expert, or -1.
    pub topk_idx: u64,
    /// Device address of `f32 [tokens * top_k]` (the combine). In the dispatch: 0, or the
    /// weights, and then every row put also gets its [`fused::RowSource`] (see
    /// [`fused::sources_offset`]).
    pub topk_weights: u64,
    /// Device address of [`ResultPlace`]` [tokens * top_k]`: where each entry's result will
    /// be (written by the dispatch, read by the combine).
    pub ret_index: u64,
    /// Device address of `i32 [experts per rank]`: rows received per local expert.
    pub recv_counts: u64,
    /// Device address of the [`MoeState`], followed by the dispatch's scratch (see
    /// [`scratch_bytes`]).
    pub state: u64,
    /// Device address of `bf16 [tokens * hidden]`: the combine's output.
    pub out: u64,
    /// Device address of the tokens, `x_units` 16-byte units per token (the dispatch).
    pub x: u64,
    /// Device address of the tokens' scales, `scale_units` 16-byte units per token, or 0.
    pub scales: u64,
    /// LSA domains when rows to other domains are relayed (one copy per token and domain:
    /// see [`Relay`]); 0: every row is put straight to its expert's rank.
    pub relay_domains: u32,
    /// The most tokens per rank (the relay's slots per source).
    pub max_tokens: u32,
}

/// Running totals of one rank's MoE calls, in device memory (written by one thread each).
///
/// ```
/// use ferrolink_device::moe::{MoeState, count_columns, scratch_bytes};
/// // The state opens the dispatch's scratch; the host reads it back, e.g. the entries dropped:
/// let scratch = vec![0u8; scratch_bytes(count_columns(8, 0))];
/// let state: MoeState = bytemuck::pod_read_unaligned(&scratch[..size_of::<MoeState>()]);
/// assert_eq!(state.dropped, 0);
/// ```
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct MoeState {
    /// Rows received by every dispatch so far (the data signal's target).
    pub data_total: u64,
    /// Results put back to this rank by every combine so far (the return signal's target:
    /// those from ranks that are not direct peers). Each dispatch adds its `pushed`; a fused
    /// finish, after which no combine puts them, takes them out again.
    pub ret_total: u64,
    /// Entries of this rank dropped at capacity by the last dispatch.
    pub dropped: u64,
    /// Rows this rank received in the last dispatch.
    pub received: u64,
    /// Entries of this rank the last dispatch kept (sent to an expert, not dropped).
    pub kept: u64,
    /// What the [`signal::FUSED`] signal reaches once every kept entry of the last dispatch
    /// was added by its expert (the fused combine's wait: see [`fused`]): `fused_done +
    /// kept`.
    pub fused_target: u64,
    /// The [`signal::FUSED`] total every fused combine so far waited for (written by the
    /// fused finish, as its call's `fused_target`).
    pub fused_done: u64,
    /// Results of the last dispatch that a plain combine would put back to this rank (in
    /// `ret_total`).
    pub pushed: u64,
    /// The [`signal::RELAY`] total before the dispatches of each parity: call `epoch` waits
    /// for `relay_base[epoch % 2]` plus its rows, and CTA 0 writes that sum into the other
    /// word (the next call's base) while the other CTAs read this one.
    pub relay_base: [u64; 2],
    /// What the [`signal::WEIGHTS`] signal reaches once the sources of every token relayed
    /// here by the last dispatch sent their weights (the combine's wait): `weights_done`
    /// plus those tokens.
    pub weights_target: u64,
    /// The [`signal::WEIGHTS`] total every combine so far waited for (written by the
    /// combine; a fused finish sends no weights and leaves it).
    pub weights_done: u64,
}

/// Bytes of the state and the dispatch's scratch after it, for `num_experts` count columns
/// (pass [`count_columns`], which adds a column per relay domain to the experts): the
/// [`MoeState`], a flag per CTA, and a count row (`u32` per column) per CTA.
///
/// ```
/// use ferrolink_device::moe::{MAX_CTAS, MoeState, count_columns, scratch_bytes};
/// // Sized by the count columns, as the host's `Moe` does (16 experts, no relay):
/// let bytes = scratch_bytes(count_columns(16, 0));
/// assert_eq!(bytes, size_of::<MoeState>() + 8 * MAX_CTAS + 4 * MAX_CTAS * 16);
/// ```
pub const fn scratch_bytes(num_experts: usize) -> usize {
    core::mem::size_of::<MoeState>() + 8 * MAX_CTAS + 4 * MAX_CTAS * num_experts
}

/// Dynamic shared memory the dispatch needs per CTA, for `num_experts` count columns (pass
/// [`count_columns`], as for [`scratch_bytes`]): three `u32` arrays of that many, two of
/// `chunk`, an aligned `u64`, and a `PeerTally` (that many words cover any number of
/// ranks).
///
/// ```
/// use ferrolink_device::moe::{count_columns, dispatch_shared_bytes};
/// // 16 experts, 2 relay domains, 32 entries per CTA:
/// let shared = dispatch_shared_bytes(count_columns(16, 2), 32);
/// assert_eq!(shared, 552);
/// ```
pub const fn dispatch_shared_bytes(num_experts: usize, chunk: usize) -> usize {
    4 * (target_word(num_experts, chunk) + 2 + num_experts)
}

/// Columns of a count row: one per expert, then, when rows are relayed, one per LSA domain
/// (the rank's tokens relayed into that domain).
///
/// ```
/// use ferrolink_device::moe::count_columns;
/// assert_eq!(count_columns(16, 0), 16); // no relay: a column per expert
/// assert_eq!(count_columns(16, 2), 18); // and one per LSA domain
/// ```
pub const fn count_columns(num_experts: usize, relay_domains: usize) -> usize {
    num_experts + relay_domains
}

/// The relay across LSA domains (hierarchical dispatch and combine,
/// `MoeArgs::relay_domains` > 0): a token with experts in another domain `D` crosses to `D`
/// once, to its *relay*, the rank of `D` with the same index in its domain (`D * lsa_size +
/// rank % lsa_size`), which copies it to each expert's rank in `D` through the LSA mapping;
/// in the combine the relay reads those experts' results in place, sums them with the
/// token's weights, and puts one row back. Each relay serves one rank of each other domain.
///
/// The relay window holds, per other domain, `max_tokens` inbound slots (a descriptor, then
/// `4 * hidden` bytes: the token row in the dispatch, the row going back in the combine),
/// then per other domain `max_tokens` outbound descriptors (staged here, put to the relay),
/// then inbound and outbound weights messages, as many. A descriptor: `epoch: u64`,
/// `row_bytes: u32`, `sources: u32` (1: forward each row's [`fused::RowSource`] too), then
/// `top_k` targets of `dst: u32, place: u32, epoch: u32, weight: f32` (target `k` is the
/// token's entry `k`; one whose `epoch` is not the call's low word is not for this call). A
/// weights message: `epoch: u32` (low word), the return row, the [`RelayGroup`] kind (1 or
/// 2), 0, then the token's `top_k` weights (`f32`), padded to 16 bytes.
///
/// ```
/// use ferrolink_device::moe::Relay;
/// // 2 domains of 4 ranks, 128 tokens per rank, top_k 8, hidden 4096:
/// let r = Relay::new(2, 4, 128, 8, 4096);
/// assert_eq!(r.slot, r.desc + 4 * 4096); // a descriptor and an f32 row
/// // One other domain: 128 of each kind of slot.
/// assert_eq!(r.window_bytes(), 128 * (r.slot + r.desc + 2 * r.weights));
/// ```
#[derive(Clone, Copy)]
pub struct Relay {
    /// LSA domains.
    pub domains: usize,
    /// Ranks per domain.
    pub lsa_size: usize,
    /// Slots per source (the most tokens per rank).
    pub max_tokens: usize,
    /// Bytes of a descriptor.
    pub desc: usize,
    /// Bytes of an inbound slot (descriptor and row).
    pub slot: usize,
    /// Bytes of a weights message.
    pub weights: usize,
}

impl Relay {
    /// The layout for these sizes.
    ///
    /// ```
    /// use ferrolink_device::moe::Relay;
    /// let r = Relay::new(2, 4, 128, 8, 4096);
    /// assert_eq!(r.desc, 16 + 16 * 8); // a head and a target per entry
    /// assert_eq!(r.weights, 16 + 32); // a head and 8 f32 weights
    /// ```
    pub const fn new(domains: usize, lsa_size: usize, max_tokens: usize, top_k: usize, hidden: usize) -> Relay {
        let desc = 16 + 16 * top_k;
        Relay {
            domains,
            lsa_size,
            max_tokens,
            desc,
            slot: desc + 4 * hidden,
            weights: 16 + (4 * top_k).div_ceil(16) * 16,
        }
    }

    /// Bytes of the relay window.
    ///
    /// ```
    /// use ferrolink_device::moe::Relay;
    /// // 3 domains of 2 ranks: 2 other domains of 16 tokens each.
    /// let r = Relay::new(3, 2, 16, 2, 64);
    /// assert_eq!(r.window_bytes(), 2 * 16 * (r.slot + r.desc + 2 * r.weights));
    /// ```
    pub const fn window_bytes(&self) -> usize {
        self.regions() * (self.slot + self.desc + 2 * self.weights)
    }

    /// Slots of each kind: `max_tokens` per other domain.
    const fn regions(&self) -> usize {
        (self.domains - 1) * self.max_tokens
    }

    /// Index of domain `d` among the domains other than `mine`.
    const fn other(d: usize, mine: usize) -> usize {
        if d < mine { d } else { d - 1 }
    }

    /// The domain of index `i` among the domains other than `mine`.
    const fn other_back(i: usize, mine: usize) -> usize {
        if i < mine { i } else { i + 1 }
    }

    /// Offset of the inbound slot of token `t` from domain `src_domain`, in a relay of
    /// domain `relay_domain`.
    ///
    /// ```
    /// use ferrolink_device::moe::Relay;
    /// let r = Relay::new(3, 2, 16, 2, 64); // 3 domains, 16 tokens per rank
    /// // In a relay of domain 1, the slots of domain 0 come first, then those of domain 2:
    /// assert_eq!(r.inbound(0, 1, 0), 0);
    /// assert_eq!(r.inbound(2, 1, 5), (16 + 5) * r.slot);
    /// ```
    pub const fn inbound(&self, src_domain: usize, relay_domain: usize, t: usize) -> usize {
        (Self::other(src_domain, relay_domain) * self.max_tokens + t) * self.slot
    }

    /// Offset of this rank's (domain `mine`) outbound descriptor of token `t` for domain `d`.
    ///
    /// ```
    /// use ferrolink_device::moe::Relay;
    /// let r = Relay::new(3, 2, 16, 2, 64); // 3 domains, 16 tokens per rank
    /// // After every inbound slot:
    /// assert_eq!(r.outbound(0, 1, 0), r.inbound(2, 1, 15) + r.slot);
    /// ```
    pub const fn outbound(&self, d: usize, mine: usize, t: usize) -> usize {
        self.regions() * self.slot + (Self::other(d, mine) * self.max_tokens + t) * self.desc
    }

    /// Offset of the inbound weights message of token `t` from domain `src_domain`, in a
    /// relay of domain `relay_domain`.
    ///
    /// ```
    /// use ferrolink_device::moe::Relay;
    /// let r = Relay::new(3, 2, 16, 2, 64); // 3 domains, 16 tokens per rank
    /// // After every outbound descriptor:
    /// assert_eq!(r.inbound_weights(0, 1, 0), r.outbound(2, 1, 15) + r.desc);
    /// ```
    pub const fn inbound_weights(&self, src_domain: usize, relay_domain: usize, t: usize) -> usize {
        self.regions() * (self.slot + self.desc)
            + (Self::other(src_domain, relay_domain) * self.max_tokens + t) * self.weights
    }

    /// Offset of this rank's (domain `mine`) outbound weights message of token `t` for
    /// domain `d`.
    ///
    /// ```
    /// use ferrolink_device::moe::Relay;
    /// let r = Relay::new(3, 2, 16, 2, 64); // 3 domains, 16 tokens per rank
    /// assert_eq!(r.outbound_weights(0, 1, 0), r.inbound_weights(2, 1, 15) + r.weights);
    /// // The last region of the window:
    /// assert_eq!(r.outbound_weights(2, 1, 15) + r.weights, r.window_bytes());
    /// ```
    pub const fn outbound_weights(&self, d: usize, mine: usize, t: usize) -> usize {
        self.regions() * (self.slot + self.desc + self.weights)
            + (Self::other(d, mine) * self.max_tokens + t) * self.weights
    }
}

/// A token's entries in one other LSA domain, as the relay returns their results: `count`
/// entries (experts there, dropped or not), whose results come back at `row` of the return
/// window (the token's rows `t * top_k ..`, shared by its domains in domain order) as the
/// one entry's bf16 row (`count` 1: kind 1, one row, weighted at the token's rank) or as
/// their weighted sum in `f32` (kind 2, two rows). The rows of a token's groups fit its
/// `top_k` rows: a group takes at most as many as it has entries.
///
/// ```
/// use ferrolink_device::moe::RelayGroup;
/// // A group never takes more return rows than it has entries.
/// assert!((1..=8).all(|count| RelayGroup::rows(count) <= count));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RelayGroup {
    /// The token's entries with an expert in the domain.
    pub count: usize,
    /// The group's first return row.
    pub row: usize,
}

impl RelayGroup {
    /// The group of token `t`'s entries (`expert(kk)` for `kk < top_k`: the expert of entry
    /// `kk`, `None` for none) in domain `d`, where `domain_of` maps an expert to its domain
    /// and `mine` is the token's own domain (no group).
    ///
    /// ```
    /// use ferrolink_device::moe::RelayGroup;
    /// // Token 1 of a rank in domain 0, top_k 4, experts 1, 5, 6, 9, four experts per domain:
    /// let experts = [1usize, 5, 6, 9];
    /// let expert = |k: usize| Some(experts[k]);
    /// let domain_of = |e: usize| e / 4;
    /// // Two entries in domain 1: their f32 sum, rows 4 and 5 (the token's rows are 4..8).
    /// assert_eq!(RelayGroup::of(1, 4, 1, 0, expert, domain_of), RelayGroup { count: 2, row: 4 });
    /// // One in domain 2: its bf16 row, after domain 1's group.
    /// assert_eq!(RelayGroup::of(1, 4, 2, 0, expert, domain_of), RelayGroup { count: 1, row: 6 });
    /// ```
    #[inline(always)]
    pub fn of(
        t: usize,
        top_k: usize,
        d: usize,
        mine: usize,
        expert: impl Fn(usize) -> Option<usize>,
        domain_of: impl Fn(usize) -> usize,
    ) -> RelayGroup {
        // Entries per domain, counted as each domain's first entry is met: for each entry
        // whose domain `e` is before `d` and not yet met, the rows of `e`'s group.
        let mut count = 0;
        let mut row = t * top_k;
        for kk in 0..top_k {
            let Some(x) = expert(kk) else { continue };
            let e = domain_of(x);
            if e == d {
                count += 1;
            } else if e < d && e != mine && !(0..kk).any(|i| expert(i).is_some_and(|y| domain_of(y) == e)) {
                let in_e = (kk..top_k).filter(|&i| expert(i).is_some_and(|y| domain_of(y) == e)).count();
                row += Self::rows(in_e);
            }
        }
        RelayGroup { count, row }
    }

    /// Return rows of a group of `count` entries: the one bf16 row, or an `f32` row.
    ///
    /// ```
    /// use ferrolink_device::moe::RelayGroup;
    /// assert_eq!(RelayGroup::rows(1), 1); // the one bf16 row
    /// assert_eq!(RelayGroup::rows(3), 2); // an f32 sum: twice a bf16 row
    /// ```
    pub const fn rows(count: usize) -> usize {
        if count == 1 { 1 } else { 2 }
    }

    /// The weights message's kind: 1, the entry's row as it is; 2, the weighted sum.
    ///
    /// ```
    /// use ferrolink_device::moe::RelayGroup;
    /// assert_eq!(RelayGroup { count: 1, row: 0 }.kind(), 1);
    /// assert_eq!(RelayGroup { count: 3, row: 0 }.kind(), 2);
    /// ```
    pub const fn kind(&self) -> u32 {
        if self.count == 1 { 1 } else { 2 }
    }
}

/// The `u32` index of the dispatch's shared `u64` (8-byte aligned).
const fn target_word(num_experts: usize, chunk: usize) -> usize {
    (3 * num_experts + 2 * chunk + 1) & !1
}

/// Dynamic shared memory the combine needs per CTA: two `u32` per (rank, local expert) and
/// a `PeerTally`.
///
/// ```
/// use ferrolink_device::moe::combine_shared_bytes;
/// assert_eq!(combine_shared_bytes(64), 768);
/// ```
pub const fn combine_shared_bytes(num_experts: usize) -> usize {
    12 * num_experts
}

/// Rows one CTA put to each rank (a `u32` per rank in shared memory), raised as one signal
/// per rank once the CTA's puts are out: one release at system scope per (CTA, rank) rather
/// than one per row.
///
/// Ordering: the rows go as puts with no remote action; then the CTA meets (its barrier
/// orders every warp's copies before what follows), and thread `p` adds the rows it counted
/// for rank `p` to `p`'s signal. Direct peers: that add is a release at system scope,
/// cumulative over the stores that happen before it, the other warps' copies included (the
/// argument of a coop's own put-with-signal, with the CTA as the coop). Proxy peers: the
/// signal's descriptor claims its ring slot after every put of the CTA to `p` claimed its
/// own (before the meeting), in the same (context, peer) ring, which the proxy and each
/// transport run in order; so the signal lands after those rows.
#[derive(Clone, Copy)]
pub(crate) struct PeerTally {
    rows: *mut u32,
    nranks: usize,
}

impl PeerTally {
    /// A zeroed tally in `rows` (every thread of the CTA calls; the CTA meets in it).
    ///
    /// # Safety
    /// `rows` is this CTA's shared memory with `nranks` words, used for nothing else while
    /// the tally lives.
    #[inline(always)]
    pub(crate) unsafe fn new(cta: CoopCta, rows: *mut u32, nranks: usize) -> Self {
        // SAFETY: `p < nranks` words (the contract).
        for_each_rank_by_thread(cta, nranks, |p| unsafe { rows.add(p).write(0) });
        cta.sync();
        PeerTally { rows, nranks }
    }

    /// One more row put to world rank `peer` (one thread per put).
    #[inline(always)]
    pub(crate) fn add(&self, peer: usize) {
        // SAFETY: `peer < nranks` (a rank of the communicator), in the tally's words.
        unsafe { atomic::fetch_add(self.rows.add(peer), 1u32, RmwOrder::Relaxed, Scope::Cta) };
    }

    /// A warp's put of one row (`bytes` from this rank's `src` at `src_offset` into world rank
    /// `peer`'s `dst` at `dst_offset`, no actions), counted for `peer`: the rows go without a
    /// signal each, and [`PeerTally::signal`] raises one per rank for them.
    ///
    /// # Safety
    /// As [`Gin::put`]; every lane of the warp calls with the same arguments.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn put_row(
        &self,
        gin: &Gin,
        comm: &DevComm,
        peer: usize,
        dst: DevWindow,
        dst_offset: usize,
        src: DevWindow,
        src_offset: usize,
        bytes: usize,
    ) {
        // SAFETY: the caller's contract is `Gin::put`'s.
        unsafe {
            gin.put(
                CoopWarp,
                comm.world(),
                peer as u32,
                dst,
                dst_offset,
                src,
                src_offset,
                bytes,
                RemoteAction::None,
                LocalAction::None,
            )
        };
        if arch::lane_id() == 0 {
            self.add(peer);
        }
    }

    /// Zeroes the tally for puts that another signal counts (every thread of the CTA calls,
    /// after [`PeerTally::signal`]; the CTA meets in it).
    #[inline(always)]
    pub(crate) fn reset(&self, cta: CoopCta) {
        // SAFETY: `p < nranks` words; the CTA met at the end of the last `signal`.
        for_each_rank_by_thread(cta, self.nranks, |p| unsafe { self.rows.add(p).write(0) });
        cta.sync();
    }

    /// Raises signal `id` on every rank by the rows put to it (every thread of the CTA calls,
    /// after its puts).
    #[inline(always)]
    pub(crate) fn signal(&self, gin: &Gin, cta: CoopCta, id: u32) {
        cta.sync();
        for_each_rank_by_thread(cta, self.nranks, |p| {
            // SAFETY: `p < nranks`; the CTA met after the last `add`.
            let rows = unsafe { self.rows.add(p).read() };
            if rows > 0 {
                gin.signal_from_thread(p as u32, RemoteAction::SignalAdd(id, u64::from(rows)));
            }
        });
        cta.sync();
    }
}

/// Where the count matrices lie in `counts` (`u32 [2][nranks][num_experts]`, then this
/// rank's own row, the source of its puts): call `epoch` uses matrix `epoch % 2`.
#[derive(Clone, Copy)]
struct CountMatrix<'a> {
    counts: &'a DevWindow,
    nranks: usize,
    experts: usize,
    parity: usize,
}

impl CountMatrix<'_> {
    /// Byte offset of row `src` of this call's matrix.
    fn row(&self, src: usize) -> usize {
        (self.parity * self.nranks + src) * self.experts * 4
    }

    /// Byte offset of this rank's own row (the source of its puts).
    fn own(&self) -> usize {
        2 * self.nranks * self.experts * 4
    }

    /// Entries of rank `src` to expert `e` in this call.
    fn at(&self, src: usize, e: usize) -> u32 {
        // SAFETY: the window holds `(2 nranks + 1) num_experts` words (the kernels'
        // contract); written by puts acquired before any read (see the module's ordering).
        unsafe { self.counts.local_ptr::<u32>(self.row(src) + e * 4).read_volatile() }
    }
}

/// The combine's last step: `out[t] = sum_k topk_weights[t, k] * result(t, k)` over this
/// rank's `args.tokens` tokens, accumulated in `f32` in `k` order and rounded once to bf16
/// ([`NO_RETURN`] adds nothing), for the 16-byte units `first, first + stride, ..` of `out`
/// (a thread's share). Each result is loaded from its [`ResultPlace`] (see [`ResultRows`]).
///
/// A unit's `top_k` rows are read [`SUM_BATCH`] at a time, every load of a batch issued
/// before the first is used: the reads are scattered rows, so the time is the memory's
/// latency unless several are in flight per thread.
///
/// # Safety
/// Every place in `args.ret_index[..tokens * top_k]` but [`NO_RETURN`] holds a row of `2 *
/// args.hidden` bytes with its data landed and published to this thread (see `rows`);
/// `args.topk_weights` and `args.out` hold `tokens * top_k` weights and `tokens * hidden`
/// bf16.
#[inline(always)]
pub(crate) unsafe fn weighted_sum<A: SumArgs>(rows: &ResultRows, args: &A, first: usize, stride: usize) {
    let (tokens, k, hidden) = args.sum_shape();
    let (places, weights, out) = args.sum_buffers();
    let vecs = hidden / 8;
    let units = tokens * vecs;
    let mut u = first;
    // SAFETY: the caller's contract: every index below lies in the buffers it describes.
    unsafe {
        while u < units {
            let (t, v) = (u / vecs, u % vecs);
            let mut acc = [0f32; 8];
            add_weighted_rows(&mut acc, k, |i| {
                let place = places.add(t * k + i).read();
                summed_in_batch(place).then(|| (rows.unit(place, v), weights.add(t * k + i).read()))
            });
            if rows.relayed {
                // The relays' sums (`f32` rows, weighted there).
                for kk in 0..k {
                    let place = places.add(t * k + kk).read();
                    if place.rank == RELAYED_SUM && place.row != NO_RETURN {
                        let at = rows.ret.local_ptr::<U32x4>(place.row as usize * rows.row_bytes + v * 32);
                        let (lo, hi) = (arch::load_v4(at), arch::load_v4(at.add(1)));
                        for (a, w) in acc.iter_mut().zip(lo.0.iter().chain(hi.0.iter())) {
                            *a += f32::from_bits(*w);
                        }
                    }
                }
            }
            let mut words = [0u32; 4];
            for (i, a) in acc.iter().enumerate() {
                words[i / 2] |= u32::from(half::bf16::from_f32(*a).to_bits()) << (16 * (i % 2));
            }
            arch::store_v4(out.add(u), U32x4(words));
            u += stride;
        }
    }
}

/// Rows of one output unit [`add_weighted_rows`] has in flight at once.
const SUM_BATCH: usize = 8;

/// `acc[j] += w_i * x_i[j]` over the rows `i < count` that `row_of(i)` gives (the address of
/// one 16-byte unit, eight bf16, and its weight; `None`: adds nothing), in `i` order, the
/// loads of [`SUM_BATCH`] rows issued before the first is used: the rows are scattered, so
/// the time is the memory's latency unless several are in flight per thread.
///
/// # Safety
/// Every address `row_of` gives is readable and holds data published to this thread.
#[inline(always)]
unsafe fn add_weighted_rows(acc: &mut [f32; 8], count: usize, row_of: impl Fn(usize) -> Option<(*const U32x4, f32)>) {
    let mut k0 = 0;
    while k0 < count {
        let batch = (count - k0).min(SUM_BATCH);
        // Eight named rows rather than arrays: arrays indexed in loops that LLVM does not
        // fully unroll live in local memory, and the loads would wait on it.
        let entry = |i: usize| if i < batch { row_of(k0 + i) } else { None };
        // SAFETY: the caller's contract.
        let fetch = |e: Option<(*const U32x4, f32)>| e.map_or(U32x4::default(), |(at, _)| unsafe { arch::load_v4(at) });
        let (e0, e1, e2, e3, e4, e5, e6, e7) =
            (entry(0), entry(1), entry(2), entry(3), entry(4), entry(5), entry(6), entry(7));
        let (x0, x1, x2, x3) = (fetch(e0), fetch(e1), fetch(e2), fetch(e3));
        let (x4, x5, x6, x7) = (fetch(e4), fetch(e5), fetch(e6), fetch(e7));
        accumulate(acc, e0, x0);
        accumulate(acc, e1, x1);
        accumulate(acc, e2, x2);
        accumulate(acc, e3, x3);
        accumulate(acc, e4, x4);
        accumulate(acc, e5, x5);
        accumulate(acc, e6, x6);
        accumulate(acc, e7, x7);
        k0 += batch;
    }
}

/// Whether [`weighted_sum`]'s batches add the result at `place` (a bf16 row, weighted
/// there): not [`NO_RETURN`], nor a relay's sum or a part of one.
#[inline(always)]
fn summed_in_batch(place: ResultPlace) -> bool {
    place.row != NO_RETURN && place.rank != RELAYED_SUM && place.rank != RELAYED_PART
}

/// `acc[j] += w * x[j]` for the eight bf16 of `x`, for a row that is there.
#[inline(always)]
fn accumulate(acc: &mut [f32; 8], row: Option<(*const U32x4, f32)>, x: U32x4) {
    let Some((_, w)) = row else { return };
    for (j, a) in acc.iter_mut().enumerate() {
        let bits = (x.0[j / 2] >> (16 * (j % 2))) & 0xffff;
        *a += w * half::bf16::from_bits(bits as u16).to_f32();
    }
}

/// Where [`weighted_sum`] finds results: direct peers' receive windows (through the LSA
/// mapping) and this rank's return window.
pub(crate) struct ResultRows<'a> {
    /// Receive windows (every direct peer's, by its LSA index).
    pub recv: &'a DevWindow,
    /// This rank's return window.
    pub ret: &'a DevWindow,
    /// The LSA domain's size (world rank `r` is LSA index `r % lsa_size`, as in GIN).
    pub lsa_size: u32,
    /// Bytes per row.
    pub row_bytes: usize,
    /// Whether results may come as relays' sums ([`RELAYED_SUM`]).
    pub relayed: bool,
}

impl ResultRows<'_> {
    /// Address of 16-byte unit `v` of the result at `place` (not [`NO_RETURN`]).
    #[inline(always)]
    fn unit(&self, place: ResultPlace, v: usize) -> *const U32x4 {
        let at = place.row as usize * self.row_bytes + v * 16;
        if place.rank == PUSHED { self.ret.local_ptr(at) } else { self.recv.lsa_ptr(at, place.rank % self.lsa_size) }
    }
}

/// The number of direct (LSA) peers of this rank, itself included: the [`signal::READY`]
/// adds a combine waits for per call.
#[inline(always)]
pub(crate) fn direct_peers(gin: &Gin, nranks: usize) -> u64 {
    (0..nranks as u32).filter(|&p| gin.is_direct(p)).count() as u64
}

/// Raises `ready` on every direct peer (thread `p` of the CTA signals world rank `p`).
#[inline(always)]
pub(crate) fn signal_ready(gin: &Gin, cta: CoopCta, nranks: usize, ready: u32) {
    for_each_rank_by_thread(cta, nranks, |p| {
        if gin.is_direct(p as u32) {
            gin.signal_from_thread(p as u32, RemoteAction::SignalInc(ready));
        }
    });
}

/// Runs `f(p)` for every world rank `p < nranks`, on thread `p` of the CTA (modulo its
/// size): the CTA acts for each rank once.
#[inline(always)]
pub(crate) fn for_each_rank_by_thread(cta: CoopCta, nranks: usize, mut f: impl FnMut(usize)) {
    let mut p = cta.thread_rank();
    while p < nranks {
        f(p);
        p += cta.size();
    }
}

/// Where, in a region of rows, a warp starts when the rows of a sequence of regions are dealt
/// to warps in turn (warp `first` of `stride` takes rows `first, first + stride, ..` of the
/// sequence) and `before` rows of the sequence come before the region: its first row there.
/// Dealing the whole sequence rather than each region from warp 0 keeps the warps even when
/// regions hold few rows.
#[inline(always)]
pub(crate) const fn dealt_start(first: usize, stride: usize, before: usize) -> usize {
    (first + stride - before % stride) % stride
}

/// A rank's token rows as a dispatch sends them: token `t`'s row is `x_units` 16-byte units
/// of `x` (from unit `t * x_units`), then `scale_units` units of `scales` (from unit `t *
/// scale_units`). A bf16 token is `hidden / 8` units of `x` and no scales; an fp8 token
/// (`hidden` bytes) is `hidden / 16` units and its `f32` scales, one per 128 channels, `hidden
/// / 512` units. The dispatch copies each row into the token's slot of the send window
/// (`2 * hidden` bytes: room for either) and puts [`TokenRows::bytes`] of it.
#[derive(Clone, Copy)]
pub(crate) struct TokenRows {
    x: *const U32x4,
    scales: *const U32x4,
    x_units: usize,
    scale_units: usize,
}

impl TokenRows {
    /// The rows at `x` and `scales` (device addresses) with the given units per token.
    #[inline(always)]
    pub(crate) fn new(x: u64, x_units: u32, scales: u64, scale_units: u32) -> TokenRows {
        TokenRows {
            x: x as *const U32x4,
            scales: scales as *const U32x4,
            x_units: x_units as usize,
            scale_units: scale_units as usize,
        }
    }

    /// Bytes per row.
    #[inline(always)]
    pub(crate) fn bytes(&self) -> usize {
        (self.x_units + self.scale_units) * 16
    }

    /// Copies the rows of tokens `first..last` into `send` (token `t` at byte `t * slot`),
    /// shared by the `nthreads` threads calling, of which this is `rank`: consecutive threads
    /// take consecutive units (coalesced), each thread [`STAGE_BATCH`] at a time with every
    /// load of a batch issued before its first store (one unit per round trip would leave
    /// the copy waiting on memory latency).
    ///
    /// # Safety
    /// `x` and `scales` hold the rows of tokens `..last`, `send` `last` slots of `slot` bytes
    /// (at least [`TokenRows::bytes`]); nothing writes either meanwhile.
    #[inline(always)]
    pub(crate) unsafe fn stage(
        &self,
        send: &DevWindow,
        slot: usize,
        first: usize,
        last: usize,
        rank: usize,
        nthreads: usize,
    ) {
        let units = self.x_units + self.scale_units;
        let total = (last - first) * units;
        // Unit `u` of the run: where it is read and where it goes.
        let at = |u: usize| -> (*const U32x4, *mut U32x4) {
            let (t, w) = (first + u / units, u % units);
            let from = if w < self.x_units {
                self.x.wrapping_add(t * self.x_units + w)
            } else {
                self.scales.wrapping_add(t * self.scale_units + w - self.x_units)
            };
            (from, send.local_ptr::<U32x4>(t * slot + w * 16))
        };
        let mut u = rank;
        // SAFETY: every unit below `total` lies in the rows and slots of the contract.
        unsafe {
            while u + (STAGE_BATCH - 1) * nthreads < total {
                let ((s0, d0), (s1, d1)) = (at(u), at(u + nthreads));
                let ((s2, d2), (s3, d3)) = (at(u + 2 * nthreads), at(u + 3 * nthreads));
                let (v0, v1, v2, v3) = (arch::load_v4(s0), arch::load_v4(s1), arch::load_v4(s2), arch::load_v4(s3));
                arch::store_v4(d0, v0);
                arch::store_v4(d1, v1);
                arch::store_v4(d2, v2);
                arch::store_v4(d3, v3);
                u += STAGE_BATCH * nthreads;
            }
            while u < total {
                let (from, to) = at(u);
                arch::store_v4(to, arch::load_v4(from));
                u += nthreads;
            }
        }
    }
}

/// Units of a token row [`TokenRows::stage`] has in flight per thread.
const STAGE_BATCH: usize = 4;

/// Whether rows of `x_units + scale_units` 16-byte units fit a slot of `2 * hidden` bytes
/// (and are not empty).
#[inline(always)]
pub(crate) fn rows_fit(x_units: u32, scale_units: u32, hidden: u32) -> bool {
    x_units > 0 && (u64::from(x_units) + u64::from(scale_units)) * 16 <= 2 * u64::from(hidden)
}

/// What [`weighted_sum`] reads from a kernel's arguments.
pub(crate) trait SumArgs {
    /// `(tokens, top_k, hidden)`.
    fn sum_shape(&self) -> (usize, usize, usize);
    /// `(ret_index, topk_weights, out)`.
    fn sum_buffers(&self) -> (*const ResultPlace, *const f32, *mut U32x4);
}

impl SumArgs for MoeArgs {
    fn sum_shape(&self) -> (usize, usize, usize) {
        (self.tokens as usize, self.top_k as usize, self.hidden as usize)
    }
    fn sum_buffers(&self) -> (*const ResultPlace, *const f32, *mut U32x4) {
        (self.ret_index as *const ResultPlace, self.topk_weights as *const f32, self.out as *mut U32x4)
    }
}

/// Fails the kernel with [`error_code::MOE_ARGS`] unless `args` fit this communicator.
#[inline(always)]
fn check_args(comm: &DevComm, args: &MoeArgs, dispatch_grid: Option<usize>) {
    let n = comm.nranks;
    let chunks_short = dispatch_grid.is_some_and(|grid| {
        args.chunk == 0
            || grid > MAX_CTAS
            || (args.chunk as u64) * (grid as u64) < u64::from(args.tokens) * u64::from(args.top_k)
    });
    let bad = n == 0
        || args.num_experts == 0
        || !args.num_experts.is_multiple_of(n)
        || !args.hidden.is_multiple_of(8)
        || !rows_fit(args.x_units, args.scale_units, args.hidden)
        || args.capacity == 0
        || chunks_short;
    if bad {
        comm.fail(
            error_code::MOE_ARGS,
            u64::from(args.num_experts) << 32 | u64::from(args.hidden),
            u64::from(args.chunk) << 32 | dispatch_grid.unwrap_or(0) as u64,
        );
    }
}

/// Faults unless the relay can run as `args` asks: domains of equal size, each rank reached
/// directly inside its own, whole tokens per CTA (the dispatch), the tokens within
/// `max_tokens`, and a relay window of [`Relay::window_bytes`].
fn check_relay(comm: &DevComm, gin: &Gin, args: &MoeArgs, relay: &DevWindow, dispatch: bool) {
    let nd = args.relay_domains as usize;
    if nd == 0 {
        return;
    }
    let (n, lsa) = (comm.nranks as usize, comm.lsa_size as usize);
    let layout = Relay::new(nd.max(2), lsa, args.max_tokens as usize, args.top_k as usize, args.hidden as usize);
    let bad = nd < 2
        || nd * lsa != n
        || gin.uses_proxy()
        || args.top_k == 0
        || (dispatch && !args.chunk.is_multiple_of(args.top_k))
        || args.tokens > args.max_tokens
        || relay.size < layout.window_bytes() as u64;
    if bad {
        comm.fail(
            error_code::MOE_ARGS,
            u64::from(args.num_experts) << 32 | u64::from(args.hidden),
            u64::from(args.relay_domains),
        );
    }
}

/// One CTA (`block` of `grid`) of the dispatch: see the module docs. The kernel copies this
/// rank's token rows (`TokenRows` of `args.x` and `args.scales`) into `send` (a slot of `2 *
/// hidden` bytes per token); `recv` receives rows (`[experts per rank][capacity]` slots, then,
/// when `args.topk_weights` is not 0, a [`fused::RowSource`] per slot from
/// [`fused::sources_offset`]);
/// `counts` holds the count matrices (`u32 [2][nranks][num_experts]`, then
/// a row). False on an abort (the host reports it).
///
/// # Safety
/// Every rank runs it with the same `args` (but `tokens` and the addresses), the same
/// windows (by id) and the same grid, every CTA with [`dispatch_shared_bytes`] of dynamic
/// shared memory and a whole number of warps; the windows hold what is said above; the
/// addresses in `args` hold what [`MoeArgs`] says; the state's scratch is this rank's and
/// used by one MoE kernel at a time; signals [`signal`] of GIN context 0 are these kernels';
/// `args.epoch` counts this communicator's dispatches, and calls alternate dispatch, combine.
///
/// # Examples
///
/// ```no_run
/// use ferrolink_device::moe::{self, MoeArgs};
/// use ferrolink_device::{DevComm, DevWindow, arch, kernel};
/// kernel! {
///     /// The MoE dispatch as a kernel of one's own (as the built-in `moe_dispatch`).
///     ///
///     /// # Safety
///     /// As `moe::dispatch`.
///     pub unsafe fn my_dispatch(
///         comm: DevComm, send: DevWindow, recv: DevWindow, counts: DevWindow, relay: DevWindow, args: MoeArgs
///     ) {
///         // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
///         let (block, grid) = (arch::block_idx_x(), arch::grid_dim_x());
///         // SAFETY: the kernel's contract. False: the communicator was aborted (the host reports it).
///         let _ = unsafe { moe::dispatch(&comm, &send, &recv, &counts, &relay, &args, block, grid) };
///     }
/// }
/// ```
#[allow(clippy::too_many_arguments)]
pub unsafe fn dispatch(
    comm: &DevComm,
    send: &DevWindow,
    recv: &DevWindow,
    counts: &DevWindow,
    relay: &DevWindow,
    args: &MoeArgs,
    block: usize,
    grid: usize,
) -> bool {
    check_args(comm, args, Some(grid));
    let cta = CoopCta;
    let gin = Gin::new(comm, 0);
    let (n, me) = (comm.nranks as usize, comm.rank as usize);
    let ne = args.num_experts as usize;
    let per_rank = ne / n;
    let cap = args.capacity as usize;
    let row = args.hidden as usize * 2;
    check_relay(comm, &gin, args, relay, true);
    let tokens = TokenRows::new(args.x, args.x_units, args.scales, args.scale_units);
    let entries = args.tokens as usize * args.top_k as usize;
    let chunk = args.chunk as usize;
    let (start, end) = ((block * chunk).min(entries), ((block + 1) * chunk).min(entries));
    let (tid, threads) = (cta.thread_rank(), cta.size());
    let state = args.state as *mut MoeState;
    let flags = (args.state as usize + core::mem::size_of::<MoeState>()) as *mut u64;
    let rows_g = flags.wrapping_add(MAX_CTAS) as *mut u32;
    let k = args.top_k as usize;
    // Relaying: rows to another domain go once per token to that domain's relay.
    let nd = args.relay_domains as usize;
    let lsa = comm.lsa_size as usize;
    let my_domain = me / lsa;
    let layout = Relay::new(nd.max(2), lsa, args.max_tokens as usize, k, args.hidden as usize);
    let relayed = |x: usize| nd > 0 && x / per_rank / lsa != my_domain;
    let cols = count_columns(ne, nd);
    // Shared: own counts / counts before, base, prefix (per column); experts and slots (per entry).
    let sh = arch::dynamic_shared_mem::<u32>();
    let (hist, base, prefix) = (sh, sh.wrapping_add(cols), sh.wrapping_add(2 * cols));
    let (ex, slots) = (sh.wrapping_add(3 * cols), sh.wrapping_add(3 * cols + chunk));
    let idx = args.topk_idx as *const i32;
    let m = CountMatrix { counts, nranks: n, experts: cols, parity: (args.epoch % 2) as usize };
    let weights = args.topk_weights as *const f32;
    // SAFETY: (the whole body) every index below is inside the arrays the contract sizes:
    // shared arrays by `ne` and `chunk`, global ones by `entries`, `MAX_CTAS` and `ne`.
    unsafe {
        let tally = PeerTally::new(cta, sh.wrapping_add(target_word(cols, chunk) + 2), n);
        // 0. This CTA's run of token rows into the send window: every CTA's copies happen
        // before its count flag (below), hence before the last CTA's counts, hence before any
        // CTA's puts (after its wait for the counts).
        let t_run = (args.tokens as usize).div_ceil(grid);
        let t_first = (block * t_run).min(args.tokens as usize);
        let t_last = ((block + 1) * t_run).min(args.tokens as usize);
        tokens.stage(send, row, t_first, t_last, tid, threads);
        // 1. This CTA's counts per expert (and, relaying, its tokens per other domain: the
        // chunk holds whole tokens), and its entries' experts.
        let mut e = tid;
        while e < cols {
            hist.add(e).write(0);
            e += threads;
        }
        cta.sync();
        let mut j = start + tid;
        while j < end {
            let x = idx.add(j).read();
            if x >= ne as i32 || x < -1 {
                comm.fail(error_code::MOE_ARGS, j as u64, u64::from(x as u32));
            }
            // -1 (no expert) becomes u32::MAX.
            ex.add(j - start).write(x as u32);
            if x >= 0 {
                atomic::fetch_add(hist.add(x as usize), 1u32, RmwOrder::Relaxed, Scope::Cta);
                // The token's first entry into another domain counts the token there.
                let d = x as usize / per_rank / lsa;
                if relayed(x as usize) {
                    let first = (j / k) * k;
                    let seen = (first..j).any(|i| {
                        let y = idx.add(i).read();
                        y >= 0 && y < ne as i32 && y as usize / per_rank / lsa == d
                    });
                    if !seen {
                        atomic::fetch_add(hist.add(ne + d), 1u32, RmwOrder::Relaxed, Scope::Cta);
                    }
                }
            }
            j += threads;
        }
        cta.sync();
        let mut e = tid;
        while e < cols {
            rows_g.add(block * cols + e).write_volatile(hist.add(e).read());
            e += threads;
        }
        cta.sync();
        if tid == 0 {
            atomic::store(flags.add(block), args.epoch, StoreOrder::Release, Scope::Gpu);
            // The CTAs before this one publish theirs without waiting for anyone.
            for b in 0..block {
                while atomic::load(flags.add(b), LoadOrder::Relaxed, Scope::Gpu) != args.epoch {
                    arch::spin_wait_hint(32);
                }
            }
            atomic::fence(FenceOrder::Acquire, Scope::Gpu);
        }
        cta.sync();
        // Counts of the CTAs before (into `base` for now), then each entry's slot.
        let mut e = tid;
        while e < cols {
            let mut s = 0u32;
            for b in 0..block {
                s += rows_g.add(b * cols + e).read_volatile();
            }
            base.add(e).write(s);
            e += threads;
        }
        cta.sync();
        let mut j = tid;
        while j < end - start {
            let x = ex.add(j).read();
            let mut before = 0u32;
            if x != u32::MAX {
                for i in 0..j {
                    before += u32::from(ex.add(i).read() == x);
                }
                before += base.add(x as usize).read();
            }
            slots.add(j).write(before);
            j += threads;
        }
        // 2. The last CTA's sum covers every entry: this rank's counts, to every rank.
        if block == grid - 1 {
            let mine = counts.local_ptr::<u32>(m.own());
            let mut e = tid;
            while e < cols {
                mine.add(e).write(base.add(e).read() + hist.add(e).read());
                e += threads;
            }
            cta.sync();
            let (warp, warps) = (arch::warp_id_in_block(), threads / arch::WARP_SIZE);
            let mut p = warp;
            while p < n {
                gin.put(
                    CoopWarp,
                    comm.world(),
                    p as u32,
                    *counts,
                    m.row(me),
                    *counts,
                    m.own(),
                    cols * 4,
                    RemoteAction::SignalInc(signal::COUNTS),
                    LocalAction::None,
                );
                p += warps;
            }
        }
        if gin.wait_signal_each(cta, signal::COUNTS, args.epoch).is_err() {
            return false;
        }
        // 3. Where this rank's entries go: base(e) (ranks before this one) and prefix(e)
        // (this rank's entries to experts below e: its return indices).
        let mut e = tid;
        while e < ne {
            let mut b = 0u32;
            for src in 0..me {
                b += m.at(src, e);
            }
            base.add(e).write(b);
            let mut p = 0u32;
            for f in 0..e {
                p += m.at(me, f);
            }
            prefix.add(e).write(p);
            e += threads;
        }
        cta.sync();
        let (warp, warps) = (arch::warp_id_in_block(), threads / arch::WARP_SIZE);
        let lane0 = arch::lane_id() == 0;
        let ret = args.ret_index as *mut ResultPlace;
        // Entry `j`'s expert and its place among the expert's rows, if it has one that fits.
        let place_of = |j: usize| -> Option<(usize, usize, usize)> {
            let x = ex.add(j - start).read();
            let slot = slots.add(j - start).read() as usize;
            if x == u32::MAX {
                return None;
            }
            let pos = base.add(x as usize).read() as usize + slot;
            (pos < cap).then_some((x as usize, slot, pos))
        };
        // Token `t`'s entries' experts (relaying: the chunk holds whole tokens).
        let expert_of = |t: usize| {
            move |kk: usize| {
                let x = ex.add(t * k + kk - start).read();
                (x != u32::MAX).then_some(x as usize)
            }
        };
        let mut j = start + warp;
        while j < end {
            let Some((x, slot, pos)) = place_of(j) else {
                if lane0 {
                    ret.add(j).write(ResultPlace { row: NO_RETURN, rank: PUSHED });
                }
                j += warps;
                continue;
            };
            let dst = (x / per_rank) as u32;
            let t = j / k;
            if lane0 {
                let place = if gin.is_direct(dst) {
                    ResultPlace { row: ((x % per_rank) * cap + pos) as u32, rank: dst }
                } else if relayed(x) {
                    // The relay returns the token's results in this domain as its group.
                    let d = x / per_rank / lsa;
                    let group = RelayGroup::of(t, k, d, my_domain, expert_of(t), |y| y / per_rank / lsa);
                    let first_kept = (t * k..j).all(|i| place_of(i).is_none_or(|(y, _, _)| y / per_rank / lsa != d));
                    let rank = match (group.count, first_kept) {
                        (1, _) => PUSHED,
                        (_, true) => RELAYED_SUM,
                        _ => RELAYED_PART,
                    };
                    ResultPlace { row: group.row as u32, rank }
                } else {
                    ResultPlace { row: prefix.add(x).read() + slot as u32, rank: PUSHED }
                };
                ret.add(j).write(place);
            }
            if relayed(x) {
                // Target `j % k` of the token's descriptor for that domain (put below).
                if lane0 {
                    let w = if weights.is_null() { 0 } else { weights.add(j).read().to_bits() };
                    let at = layout.outbound(x / per_rank / lsa, my_domain, t) + 16 + 16 * (j % k);
                    let target = U32x4([dst, ((x % per_rank) * cap + pos) as u32, args.epoch as u32, w]);
                    arch::store_v4(relay.local_ptr(at), target);
                }
                j += warps;
                continue;
            }
            tally.put_row(
                &gin,
                comm,
                dst as usize,
                *recv,
                ((x % per_rank) * cap + pos) * row,
                *send,
                t * row,
                tokens.bytes(),
            );
            j += warps;
        }
        // Each row's source when the weights are given, in a walk of its own (the rows' walk
        // stays as lean without them); before the data signal, which covers them too.
        if !weights.is_null() {
            let mut j = start + warp;
            while j < end {
                if let Some((x, _, pos)) = place_of(j)
                    && !relayed(x)
                {
                    let place = (x % per_rank) * cap + pos;
                    let source = fused::RowSource {
                        rank: me as u32,
                        token: (j / k) as u32,
                        k: (j % k) as u32,
                        weight: weights.add(j).read(),
                    };
                    let at = fused::sources_offset(per_rank, cap, row) + place * 16;
                    fused::put_source(&gin, comm, recv, at, (x / per_rank) as u32, source);
                }
                j += warps;
            }
        }
        tally.signal(&gin, cta, signal::DATA);
        if nd > 0 {
            // 3b. Relaying: each token of this CTA with entries in another domain goes
            // there once, its row and then its descriptor, to the domain's relay; one
            // RELAY signal per (CTA, relay) by the descriptors put.
            tally.reset(cta);
            let (t0, t1) = (start / k, end.div_ceil(k));
            let mut q = warp;
            while q < (t1 - t0) * nd {
                let (t, d) = (t0 + q / nd, q % nd);
                q += warps;
                let to_d = (t * k..t * k + k).any(|j| {
                    let x = ex.add(j - start).read();
                    x != u32::MAX && x as usize / per_rank / lsa == d
                });
                if d == my_domain || !to_d {
                    continue;
                }
                let (out, inb) = (layout.outbound(d, my_domain, t), layout.inbound(my_domain, d, t));
                if lane0 {
                    let head = relay.local_ptr::<u32>(out);
                    (head as *mut u64).write(args.epoch);
                    head.add(2).write(tokens.bytes() as u32);
                    head.add(3).write(u32::from(!weights.is_null()));
                    // The head of the combine's weights message (which adds the weights).
                    let group = RelayGroup::of(t, k, d, my_domain, expert_of(t), |y| y / per_rank / lsa);
                    let msg = U32x4([args.epoch as u32, group.row as u32, group.kind(), 0]);
                    arch::store_v4(relay.local_ptr(layout.outbound_weights(d, my_domain, t)), msg);
                }
                let relay_rank = d * lsa + me % lsa;
                gin.put(
                    CoopWarp,
                    comm.world(),
                    relay_rank as u32,
                    *relay,
                    inb + layout.desc,
                    *send,
                    t * row,
                    tokens.bytes(),
                    RemoteAction::None,
                    LocalAction::None,
                );
                tally.put_row(&gin, comm, relay_rank, *relay, inb, *relay, out, layout.desc);
            }
            tally.signal(&gin, cta, signal::RELAY);
            // 3c. As a relay: wait for the tokens of this call from the other domains, then
            // copy each row to its experts' ranks here (direct), with its source when
            // given; one DATA signal per (CTA, rank) by the rows copied.
            let want = sh.wrapping_add(target_word(cols, chunk)) as *mut u64;
            if tid == 0 {
                let p = (args.epoch % 2) as usize;
                let bases = core::ptr::addr_of_mut!((*state).relay_base) as *mut u64;
                let mut total = bases.add(p).read_volatile();
                for d in (0..nd).filter(|&d| d != my_domain) {
                    total += u64::from(m.at(d * lsa + me % lsa, ne + my_domain));
                }
                if block == 0 {
                    // The next call's base; every CTA reads only word `p` in this call.
                    bases.add(1 - p).write_volatile(total);
                }
                want.write(total);
            }
            cta.sync();
            if gin.wait_signal(cta, signal::RELAY, want.read()).is_err() {
                return false;
            }
            tally.reset(cta);
            let slots_in = (nd - 1) * layout.max_tokens;
            let mut q = block * warps + warp;
            while q < slots_in {
                let (src_domain, t) = (Relay::other_back(q / layout.max_tokens, my_domain), q % layout.max_tokens);
                q += grid * warps;
                let at = layout.inbound(src_domain, my_domain, t);
                let head = relay.local_ptr::<u32>(at);
                if (head as *const u64).read_volatile() != args.epoch {
                    continue;
                }
                let (bytes, sources) = (head.add(2).read_volatile() as usize, head.add(3).read_volatile());
                for kk in 0..k {
                    let target = arch::load_v4(relay.local_ptr::<U32x4>(at + 16 + 16 * kk)).0;
                    if target[2] != args.epoch as u32 {
                        continue;
                    }
                    let (dst, place) = (target[0] as usize, target[1] as usize);
                    tally.put_row(&gin, comm, dst, *recv, place * row, *relay, at + layout.desc, bytes);
                    if sources != 0 {
                        let source = fused::RowSource {
                            rank: (src_domain * lsa + me % lsa) as u32,
                            token: t as u32,
                            k: kk as u32,
                            weight: f32::from_bits(target[3]),
                        };
                        let at = fused::sources_offset(per_rank, cap, row) + place * 16;
                        fused::put_source(&gin, comm, recv, at, dst as u32, source);
                    }
                }
            }
            tally.signal(&gin, cta, signal::DATA);
        }
        // 4. CTA 0 receives.
        if block == 0 {
            let target = sh.wrapping_add(target_word(cols, chunk)) as *mut u64;
            if tid == 0 {
                let mut expected = 0u64;
                for l in 0..per_rank {
                    let e = me * per_rank + l;
                    let mut total = 0usize;
                    for src in 0..n {
                        total += m.at(src, e) as usize;
                    }
                    let got = total.min(cap);
                    (args.recv_counts as *mut i32).add(l).write(got as i32);
                    expected += got as u64;
                }
                let (mut pushed, mut dropped, mut kept) = (0u64, 0u64, 0u64);
                for e in 0..ne {
                    let mine = m.at(me, e) as usize;
                    let fit = cap.saturating_sub(base.add(e).read() as usize).min(mine);
                    // Results from direct peers are read in place: none is put back.
                    if !gin.is_direct((e / per_rank) as u32) && nd == 0 {
                        pushed += fit as u64;
                    }
                    dropped += (mine - fit) as u64;
                    kept += fit as u64;
                }
                // Relaying, each relay returns once per token it relayed (a row, or a bare
                // count when every entry was dropped), and waits for the weights of each
                // token relayed to it.
                let mut relayed_in = 0u64;
                for d in (0..nd).filter(|&d| d != my_domain) {
                    pushed += u64::from(m.at(me, ne + d));
                    relayed_in += u64::from(m.at(d * lsa + me % lsa, ne + my_domain));
                }
                let weights_done = core::ptr::addr_of!((*state).weights_done).read_volatile();
                core::ptr::addr_of_mut!((*state).weights_target).write_volatile(weights_done + relayed_in);
                // Word by word: the other CTAs read `relay_base` meanwhile.
                let data_total = core::ptr::addr_of!((*state).data_total).read_volatile() + expected;
                let ret_total = core::ptr::addr_of!((*state).ret_total).read_volatile() + pushed;
                let fused_target = core::ptr::addr_of!((*state).fused_done).read_volatile() + kept;
                core::ptr::addr_of_mut!((*state).data_total).write_volatile(data_total);
                core::ptr::addr_of_mut!((*state).ret_total).write_volatile(ret_total);
                core::ptr::addr_of_mut!((*state).dropped).write_volatile(dropped);
                core::ptr::addr_of_mut!((*state).received).write_volatile(expected);
                core::ptr::addr_of_mut!((*state).kept).write_volatile(kept);
                core::ptr::addr_of_mut!((*state).fused_target).write_volatile(fused_target);
                core::ptr::addr_of_mut!((*state).pushed).write_volatile(pushed);
                target.write(data_total);
            }
            cta.sync();
            if gin.wait_signal(cta, signal::DATA, target.read()).is_err() {
                return false;
            }
        }
    }
    gin.flush(cta);
    true
}

/// One CTA (`block` of `grid`) of the combine: see the module docs. `recv` holds the
/// experts' results where the dispatch put their rows (direct peers read them there); `ret`
/// receives this rank's results from other domains (`[tokens * top_k]` rows); `counts` is
/// the dispatch's count matrix; `relay` the relay window when relaying. False on an abort.
///
/// # Safety
/// As [`dispatch`] (the same windows and `args`, after it, with [`combine_shared_bytes`] of
/// dynamic shared memory per CTA); `args.topk_weights` and `args.out` hold `tokens * top_k`
/// weights and `tokens * hidden` bf16, and `args.ret_index` what the dispatch wrote.
///
/// # Examples
///
/// ```no_run
/// use ferrolink_device::moe::{self, MoeArgs};
/// use ferrolink_device::{DevComm, DevWindow, arch, kernel};
/// kernel! {
///     /// The MoE combine as a kernel of one's own (as the built-in `moe_combine`), launched
///     /// after the dispatch and the experts on the same stream.
///     ///
///     /// # Safety
///     /// As `moe::combine`.
///     pub unsafe fn my_combine(
///         comm: DevComm, recv: DevWindow, ret: DevWindow, counts: DevWindow, relay: DevWindow, args: MoeArgs
///     ) {
///         // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
///         let (block, grid) = (arch::block_idx_x(), arch::grid_dim_x());
///         // SAFETY: the kernel's contract. False: the communicator was aborted (the host reports it).
///         let _ = unsafe { moe::combine(&comm, &recv, &ret, &counts, &relay, &args, block, grid) };
///     }
/// }
/// ```
#[allow(clippy::too_many_arguments)]
pub unsafe fn combine(
    comm: &DevComm,
    recv: &DevWindow,
    ret: &DevWindow,
    counts: &DevWindow,
    relay: &DevWindow,
    args: &MoeArgs,
    block: usize,
    grid: usize,
) -> bool {
    check_args(comm, args, None);
    let cta = CoopCta;
    let gin = Gin::new(comm, 0);
    check_relay(comm, &gin, args, relay, false);
    let (n, me) = (comm.nranks as usize, comm.rank as usize);
    let ne = args.num_experts as usize;
    let per_rank = ne / n;
    let cap = args.capacity as usize;
    let row = args.hidden as usize * 2;
    let nd = args.relay_domains as usize;
    let (tid, threads) = (cta.thread_rank(), cta.size());
    // Shared: per (src, local expert), base(src, e) and prefix(src, e).
    let sh = arch::dynamic_shared_mem::<u32>();
    let (bases, prefixes) = (sh, sh.wrapping_add(ne));
    let cols = count_columns(ne, nd);
    let m = CountMatrix { counts, nranks: n, experts: cols, parity: (args.epoch % 2) as usize };
    let warps = threads / arch::WARP_SIZE;
    let (first, stride) = (block * warps + arch::warp_id_in_block(), grid * warps);
    let state = args.state as *mut MoeState;
    // SAFETY: (the whole body) indices inside the arrays the contract sizes.
    unsafe {
        if block == 0 {
            signal_ready(&gin, cta, n, signal::READY);
        }
        let tally = PeerTally::new(cta, sh.wrapping_add(2 * ne), n);
        if nd > 0 {
            // Relaying: the weights of this rank's relayed tokens go to their relays, which
            // return the results of each domain at once (below).
            send_relay_weights(&gin, comm, &tally, relay, args, first, stride);
            tally.signal(&gin, cta, signal::WEIGHTS);
            tally.reset(cta);
            if block == 0 && tid == 0 {
                // Only this thread writes the state in this kernel; the others read
                // `weights_target` and `ret_total`, other words.
                let target = core::ptr::addr_of!((*state).weights_target).read_volatile();
                core::ptr::addr_of_mut!((*state).weights_done).write_volatile(target);
            }
            let weights_target = core::ptr::addr_of!((*state).weights_target).read_volatile();
            if gin.wait_signal(cta, signal::WEIGHTS, weights_target).is_err()
                || gin.wait_signal(cta, signal::READY, args.epoch * direct_peers(&gin, n)).is_err()
            {
                return false;
            }
            return_relayed(&gin, comm, &tally, recv, ret, relay, args, first, stride);
        } else {
            let mut i = tid;
            while i < n * per_rank {
                let (src, l) = (i / per_rank, i % per_rank);
                let e = me * per_rank + l;
                let mut b = 0u32;
                for s in 0..src {
                    b += m.at(s, e);
                }
                let mut p = 0u32;
                for f in 0..e {
                    p += m.at(src, f);
                }
                bases.add(i).write(b);
                prefixes.add(i).write(p);
                i += threads;
            }
            cta.sync();
            // Every received row from a rank outside the domain back to it, a warp per row:
            // the rows of every (local expert, source) region of such ranks in one sequence
            // (`before`: the rows of the regions before), dealt to the grid's warps in turn.
            // Direct peers read theirs in place: their regions are skipped whole.
            let mut before = 0usize;
            for l in 0..per_rank {
                let got = (args.recv_counts as *const i32).add(l).read() as usize;
                for src in 0..n {
                    if gin.is_direct(src as u32) {
                        continue;
                    }
                    // Rows `from..to` of the expert came from `src` (the capacity may cut them).
                    let from = (bases.add(src * per_rank + l).read() as usize).min(got);
                    let to = (from + m.at(src, me * per_rank + l) as usize).min(got);
                    let at = prefixes.add(src * per_rank + l).read() as usize;
                    let mut i = dealt_start(first, stride, before);
                    before += to - from;
                    while from + i < to {
                        tally.put_row(&gin, comm, src, *ret, (at + i) * row, *recv, (l * cap + from + i) * row, row);
                        i += stride;
                    }
                }
            }
        }
        tally.signal(&gin, cta, signal::RETURN);
        // Every result put back to this rank, every direct peer's results readable, then
        // the weighted sums.
        let expected = core::ptr::addr_of!((*state).ret_total).read_volatile();
        if gin.wait_signal(cta, signal::RETURN, expected).is_err()
            || gin.wait_signal(cta, signal::READY, args.epoch * direct_peers(&gin, n)).is_err()
        {
            return false;
        }
        let rows = ResultRows { recv, ret, lsa_size: comm.lsa_size, row_bytes: row, relayed: nd > 0 };
        weighted_sum(&rows, args, block * threads + tid, grid * threads);
    }
    gin.flush(cta);
    true
}

/// The combine's first half as a token's rank when relaying: each weights message the
/// dispatch staged for this call (one per token and other domain it has entries in) gets
/// the token's weights and goes to the relay, a warp per message (warp `first` of `stride`),
/// counted in `tally`.
///
/// # Safety
/// As [`combine`], with `relay_domains` > 0 (checked).
unsafe fn send_relay_weights(
    gin: &Gin,
    comm: &DevComm,
    tally: &PeerTally,
    relay: &DevWindow,
    args: &MoeArgs,
    first: usize,
    stride: usize,
) {
    let (nd, lsa, me) = (args.relay_domains as usize, comm.lsa_size as usize, comm.rank as usize);
    let (k, tokens) = (args.top_k as usize, args.tokens as usize);
    let my_domain = me / lsa;
    let layout = Relay::new(nd, lsa, args.max_tokens as usize, k, args.hidden as usize);
    let weights = args.topk_weights as *const f32;
    let mut q = first;
    while q < (nd - 1) * tokens {
        let (d, t) = (Relay::other_back(q / tokens, my_domain), q % tokens);
        q += stride;
        let out = layout.outbound_weights(d, my_domain, t);
        // SAFETY: the message lies in the relay window (checked size); the dispatch wrote
        // its head, read after the kernel boundary.
        let head = unsafe { relay.local_ptr::<u32>(out).read_volatile() };
        if head != args.epoch as u32 {
            continue;
        }
        let lane = arch::lane_id() as usize;
        let mut kk = lane;
        while kk < k {
            // SAFETY: `t < tokens`: weight `t * k + kk` is in the caller's weights; the word
            // lies in the message (`16 + 4 k` bytes at most).
            unsafe { relay.local_ptr::<f32>(out + 16 + 4 * kk).write(weights.add(t * k + kk).read()) };
            kk += arch::WARP_SIZE;
        }
        let relay_rank = d * lsa + me % lsa;
        let at = layout.inbound_weights(my_domain, d, t);
        // SAFETY: both ranges lie in the relay window (the same layout on every rank); the
        // relay reads the message only after the signal that counts it.
        unsafe { tally.put_row(gin, comm, relay_rank, *relay, at, *relay, out, layout.weights) };
    }
}

/// The combine's relay half: for each token relayed here in this call (an inbound slot of
/// this epoch), the results of its entries in this domain (read in place in the experts'
/// ranks' receive windows), weighted and summed in `f32` (or, a group of one, that entry's
/// row as it is), staged in the slot's row and put back to the token's rank at the row its
/// weights message names; a warp per token (warp `first` of `stride`), each counted in
/// `tally` (a token whose entries here were all dropped returns a count without a row).
///
/// # Safety
/// As [`combine`], with `relay_domains` > 0, after this call's weights and every direct
/// peer's `READY` were acquired.
#[allow(clippy::too_many_arguments)]
unsafe fn return_relayed(
    gin: &Gin,
    comm: &DevComm,
    tally: &PeerTally,
    recv: &DevWindow,
    ret: &DevWindow,
    relay: &DevWindow,
    args: &MoeArgs,
    first: usize,
    stride: usize,
) {
    let (nd, lsa, me) = (args.relay_domains as usize, comm.lsa_size as usize, comm.rank as usize);
    let (k, hidden) = (args.top_k as usize, args.hidden as usize);
    let my_domain = me / lsa;
    let layout = Relay::new(nd, lsa, args.max_tokens as usize, k, hidden);
    let row = 2 * hidden;
    let lane = arch::lane_id() as usize;
    let mut q = first;
    while q < layout.regions() {
        let (src_domain, t) = (Relay::other_back(q / layout.max_tokens, my_domain), q % layout.max_tokens);
        q += stride;
        let at = layout.inbound(src_domain, my_domain, t);
        let msg = layout.inbound_weights(src_domain, my_domain, t);
        // SAFETY: (the rest of the loop) the slot, its descriptor and the message lie in the
        // relay window (checked size); the descriptor landed before the dispatch's RELAY
        // signal, the message before this call's WEIGHTS (acquired); the results were
        // published by their ranks' READY (acquired); the staged row is this slot's, which
        // nothing else uses in this call.
        unsafe {
            if (relay.local_ptr::<u64>(at)).read_volatile() != args.epoch {
                continue;
            }
            let head = arch::load_v4(relay.local_ptr::<U32x4>(msg)).0;
            let (ret_row, kind) = (head[1] as usize, head[2]);
            let source = src_domain * lsa + me % lsa;
            // Entry `kk`'s target, if it is for this call: (its rank, its row there).
            let target = |kk: usize| -> Option<(u32, usize)> {
                let x = arch::load_v4(relay.local_ptr::<U32x4>(at + 16 + 16 * kk)).0;
                (x[2] == args.epoch as u32).then_some((x[0] % lsa as u32, x[1] as usize))
            };
            // The group's first result for this call; none: every entry here was dropped.
            let Some((one_peer, one_place)) = (0..k).find_map(target) else {
                if lane == 0 {
                    tally.add(source);
                }
                continue;
            };
            let staged = at + layout.desc;
            let units = hidden / 8;
            // Unit `v` of entry `kk`'s result, if it is for this call, and its weight.
            let unit = |kk: usize, v: usize| {
                target(kk).map(|(peer, place)| {
                    let w = relay.local_ptr::<f32>(msg + 16 + 4 * kk).read();
                    (recv.lsa_ptr::<U32x4>(place * row + v * 16, peer) as *const U32x4, w)
                })
            };
            let mut v = lane;
            if kind == 1 {
                // The group's one result as it is (weighted at the token's rank).
                while v < units {
                    let from = recv.lsa_ptr::<U32x4>(one_place * row + v * 16, one_peer);
                    arch::store_v4(relay.local_ptr(staged + v * 16), arch::load_v4(from));
                    v += arch::WARP_SIZE;
                }
            } else {
                while v < units {
                    let mut acc = [0f32; 8];
                    add_weighted_rows(&mut acc, k, |kk| unit(kk, v));
                    let bits = |i: usize| acc[i].to_bits();
                    arch::store_v4(relay.local_ptr(staged + v * 32), U32x4([bits(0), bits(1), bits(2), bits(3)]));
                    arch::store_v4(relay.local_ptr(staged + v * 32 + 16), U32x4([bits(4), bits(5), bits(6), bits(7)]));
                    v += arch::WARP_SIZE;
                }
            }
            let bytes = if kind == 1 { row } else { 2 * row };
            tally.put_row(gin, comm, source, *ret, ret_row * row, *relay, staged, bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Relay, RelayGroup};
    use std::vec::Vec;

    /// Every relay's inbound slots (per source domain and token) and a source's outbound
    /// descriptors (per destination domain and token) are disjoint and inside the window, and
    /// the index of a domain among the others maps back.
    #[test]
    fn relay_slots_are_disjoint_and_inside_the_window() {
        for (domains, top_k, hidden, max_tokens) in [(2, 1, 8, 3), (3, 8, 64, 5), (5, 2, 16, 1)] {
            let r = Relay::new(domains, 2, max_tokens, top_k, hidden);
            for me in 0..domains {
                let mut ranges = Vec::new();
                for other in (0..domains).filter(|&d| d != me) {
                    assert_eq!(Relay::other_back(Relay::other(other, me), me), other);
                    for t in 0..max_tokens {
                        ranges.push((r.inbound(other, me, t), r.slot));
                        ranges.push((r.outbound(other, me, t), r.desc));
                        ranges.push((r.inbound_weights(other, me, t), r.weights));
                        ranges.push((r.outbound_weights(other, me, t), r.weights));
                    }
                }
                ranges.sort_unstable();
                for pair in ranges.windows(2) {
                    assert!(pair[0].0 + pair[0].1 <= pair[1].0, "overlap: {pair:?} ({domains} domains)");
                }
                let (last, len) = *ranges.last().expect("slots");
                assert_eq!(last + len, r.window_bytes(), "the window ends with the last slot");
                assert!(ranges.iter().all(|(at, _)| at % 16 == 0), "16-byte aligned slots");
                assert!(r.weights >= 16 + 4 * top_k && r.slot >= r.desc + 4 * hidden, "room for weights and f32 rows");
            }
        }
    }

    /// A token's groups (its entries per other domain) take disjoint return rows inside the
    /// token's `top_k` rows, one row for a group of one and two for more, in domain order.
    #[test]
    fn relay_groups_share_the_tokens_rows() {
        // Experts 0..16 in 4 domains of 4; the token's own domain is 1.
        let domain_of = |x: usize| x / 4;
        // (domain, count, first row within the token's rows)
        type Group = (usize, usize, usize);
        let cases: [(&[i32], &[Group]); 4] = [
            // (experts by k, expected (domain, count, first row) per other domain with entries)
            (&[0, 1, 12, 5], &[(0, 2, 0), (3, 1, 2)]),
            (&[13, -1, 2, 14, 15, 9], &[(0, 1, 0), (2, 1, 1), (3, 3, 2)]),
            (&[4, 5, -1], &[]),
            (&[8, 0, 9, 1, 12], &[(0, 2, 0), (2, 2, 2), (3, 1, 4)]),
        ];
        for (experts, want) in cases {
            let k = experts.len();
            let expert = |kk: usize| (experts[kk] >= 0).then_some(experts[kk] as usize);
            let t = 3;
            let mut rows = Vec::new();
            for d in [0, 2, 3] {
                let g = RelayGroup::of(t, k, d, 1, expert, domain_of);
                if g.count == 0 {
                    assert!(!want.iter().any(|w| w.0 == d), "{experts:?}: domain {d} has entries");
                    continue;
                }
                let w = want.iter().find(|w| w.0 == d).expect("an expected group");
                assert_eq!((g.count, g.row), (w.1, t * k + w.2), "{experts:?}, domain {d}");
                assert_eq!(g.kind(), if g.count == 1 { 1 } else { 2 });
                rows.extend(g.row..g.row + RelayGroup::rows(g.count));
            }
            let total = rows.len();
            rows.sort_unstable();
            rows.dedup();
            assert_eq!(rows.len(), total, "{experts:?}: groups overlap");
            assert!(rows.iter().all(|&r| r >= t * k && r < (t + 1) * k), "{experts:?}: rows outside the token's");
        }
    }
}
