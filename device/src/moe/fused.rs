//! The **fused combine**: the experts' kernels add their weighted results straight into
//! their tokens' ranks, so no combine pass moves rows.
//!
//! A dispatch given the weights (`MoeArgs::topk_weights` not 0) also writes, with every row
//! it puts, the row's [`RowSource`] (source rank, token, k, weight) into the receive window
//! after the rows (from [`sources_offset`]). An expert kernel (the caller's, launched after
//! the dispatch on its stream with a [`FusedCombineArgs`]) computes its rows and, per row,
//! hands over `weight * y` ([`FusedCombineArgs::add`]) and then reports the row done
//! ([`FusedCombineArgs::row_added`]). Where the result goes depends on the token's rank:
//! * **reached directly** (in this rank's LSA domain, GIN not forced through the proxy): the
//!   adds go straight into the token's `f32` accumulator row on its rank through the LSA
//!   mapping (`red.add.v4.f32` at system scope), and the report raises [`signal::FUSED`]
//!   there. Each result crosses NVLink once, as its expert's adds.
//! * **another domain** (or `FERROLINK_GIN=proxy`): GIN has no remote float add, so the adds
//!   write `weight * y` into this rank's staging row for the entry (`stage`, `f32`), and the
//!   report puts that row (one GIN put, `4 * hidden` bytes) into the entry's return row on
//!   the token's rank (`ret`, row `token * top_k + k`) with [`signal::FUSED`] as its signal.
//!
//! The token rank's [`finish`] waits until every entry it kept was reported, then writes
//! `out[t] = bf16(acc[t] + sum of the return rows of t's entries from other domains)` (`k`
//! order after the accumulator), and zeroes the accumulators for the next call. The sum over
//! `k` happens in arrival order for the adds, so its `f32` rounding may differ from the
//! combine's `k` order.
//!
//! Per call: one dispatch given the weights, then **one** expert launch that reports every
//! received row once, then [`finish`] (the host's `Moe` refuses other orders).
//!
//! # Ordering
//! * Sources: each goes with its row (two `put_value`s on the row's path) before the CTA's
//!   data signal, which is raised after them (`PeerTally`); an expert kernel runs after
//!   its dispatch, which waited for that signal, on its stream.
//! * Adds → [`finish`] (direct): a lane's adds are relaxed at system scope; the warp meets
//!   (`bar.warp.sync` orders the lanes' memory operations), then lane 0 adds 1 to the
//!   source rank's `FUSED` signal with a release at system scope, cumulative over the lanes'
//!   adds. `finish` waits for its target with an acquire at system scope, then reads.
//! * Staged rows → [`finish`] (other domains): the lanes' plain stores into the staging row
//!   are ordered before the put by the warp's meeting inside [`Gin::put`]; the put's signal
//!   is strong (raised on the token's rank after the row landed: see [`crate::gin`]), so the
//!   same acquiring wait covers the return rows. A staging row is written again only for
//!   the same entry of a later call, whose row reaches this rank only after the token rank's
//!   `finish` saw this call's put land (its next dispatch is after that `finish` on its
//!   stream), so the proxy has read it by then.
//! * The target: `FUSED` counts every report since the `Moe` was made (never reset; a put's
//!   signal and an add's report count 1 each). The state's `fused_done` is the total the last
//!   fused finish waited for, and the dispatch sets `fused_target = fused_done + kept` (no
//!   signal read on its path). Every
//!   report of an earlier call is in `fused_done`: its `finish` waited for all of them,
//!   earlier on the stream, and its CTA 0 then wrote `fused_done` (read by the next dispatch
//!   after the kernel boundary). A dispatch given weights and followed by the plain combine
//!   instead gets no reports and leaves `fused_done` as it was. No report of call `c + 1`
//!   can count towards call `c`'s wait: an expert reports only rows it received, and this
//!   rank puts the rows of `c + 1` only after its dispatch `c + 1` started, after `finish`
//!   (one expert launch per call, then `finish`; the host refuses other orders).
//! * Reuse: `finish` zeroes the accumulators after reading them; the next dispatch runs after
//!   it on the stream, and an expert adds into this rank for that call only after it received
//!   a row this rank put after its dispatch started (the count exchange in between), so the
//!   zeroes come first. Return rows of call `c + 1` land, likewise, only after this rank's
//!   dispatch `c + 1` started, after `finish` read them. The receive window's rows and sources of call `c` are read by the
//!   expert kernel before its rank's dispatch `c + 1` starts (stream order), and rows of
//!   `c + 1` land only after every rank started `c + 1` (as for the combine).
//! * `RETURN`: the dispatch counts, in the state's `ret_total`, the results a plain combine
//!   would put back; `finish` takes them out (its CTA 0's thread 0, with `fused_done`), as
//!   no combine follows, so a later combine's target stays right.
//! * `READY`: `finish` raises it on every direct peer as a combine does (nothing is read in
//!   place here), so a later combine's target stays `epoch` times the direct peers.

use super::{MoeArgs, MoeState, ResultPlace, comes_back, signal, signal_ready};
use crate::arch::{self, Scope, U32x4, atomic};
use crate::comm::{DevComm, error_code};
use crate::coop::{Coop, CoopCta, CoopWarp};
use crate::gin::{Gin, LocalAction, RemoteAction};
use crate::window::DevWindow;
use bytemuck::{Pod, Zeroable};

/// Where a received row came from (16 bytes per receive slot, written by a dispatch given
/// the weights).
///
/// ```
/// use ferrolink_device::moe::fused::RowSource;
/// // 16 bytes per receive slot, as the dispatch puts them:
/// assert_eq!(size_of::<RowSource>(), 16);
/// let s = RowSource { rank: 2, token: 10, k: 1, weight: 0.75 }; // entry (10, 1) of rank 2
/// assert_eq!(s.weight, 0.75);
/// ```
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Pod, Zeroable)]
pub struct RowSource {
    /// The token's rank (world rank).
    pub rank: u32,
    /// The token's index on its rank.
    pub token: u32,
    /// Which of the token's `top_k` experts this row is for.
    pub k: u32,
    /// The token's weight for this expert (`topk_weights[token, k]`).
    pub weight: f32,
}

/// Byte offset of the [`RowSource`]s in the receive window: after its `experts_per_rank *
/// capacity` rows of `row_bytes` (`2 * hidden`); slot `l * capacity + i`'s source is at
/// `sources_offset + (l * capacity + i) * 16`.
///
/// ```
/// use ferrolink_device::moe::fused::sources_offset;
/// // 2 local experts x capacity 16, bf16 rows of hidden 64 (128 bytes):
/// let at = sources_offset(2, 16, 128);
/// assert_eq!(at, 4096);
/// // The source of slot (l = 1, i = 3):
/// assert_eq!(at + (16 + 3) * 16, 4400);
/// ```
pub const fn sources_offset(experts_per_rank: usize, capacity: usize, row_bytes: usize) -> usize {
    experts_per_rank * capacity * row_bytes
}

/// Puts `source` into `dst`'s receive window at `offset` (the coop is the warp that put the
/// row): two 8-byte `put_value`s, on the row's path.
///
/// # Safety
/// `offset` is a slot's source place inside `recv` ([`sources_offset`]).
#[inline(always)]
pub(crate) unsafe fn put_source(
    gin: &Gin,
    comm: &DevComm,
    recv: &DevWindow,
    offset: usize,
    dst: u32,
    source: RowSource,
) {
    let words: [u64; 2] = bytemuck::cast(source);
    for (i, w) in words.into_iter().enumerate() {
        // SAFETY: the caller's contract: the 16 bytes lie in the window.
        unsafe { gin.put_value(CoopWarp, comm.world(), dst, *recv, offset + 8 * i, w, 8, RemoteAction::None) };
    }
}

/// What an expert kernel needs for the fused combine (a kernel argument, made by the host's
/// `Moe::fused_target` for one call): the rows it computes and where their results go.
///
/// ```no_run
/// use ferrolink_device::moe::fused::FusedCombineArgs;
/// use ferrolink_device::{DevComm, arch, kernel};
/// kernel! {
///     /// Identity experts (`y = x`): a warp per received row adds `weight * x` into the
///     /// token's rank and reports the row.
///     ///
///     /// # Safety
///     /// `target` is what `Moe::fused_target` gave this call and `comm` is `Moe::dev_comm`;
///     /// this is the call's only expert launch; whole warps per CTA.
///     pub unsafe fn identity_experts(comm: DevComm, target: FusedCombineArgs) {
///         // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
///         let warps = arch::block_dim_x() / arch::WARP_SIZE;
///         let (first, stride) = (arch::block_idx_x() * warps + arch::warp_id_in_block(), arch::grid_dim_x() * warps);
///         let bf16 = |h: u32| f32::from_bits(h << 16);
///         for l in 0..target.experts_per_rank as usize {
///             // SAFETY: the kernel's contract: `l < experts_per_rank`, `i < rows(l)`, channels
///             // below `hidden`; the whole warp reports each of its rows once.
///             unsafe {
///                 let mut i = first;
///                 while i < target.rows(l) {
///                     let (x, source) = (target.row(l, i), target.source(l, i));
///                     let mut c = 4 * arch::lane_id() as usize;
///                     while c < target.hidden as usize {
///                         let v = arch::load_v4(x.add(c / 8)).0;
///                         let (a, b) = (v[c % 8 / 2], v[c % 8 / 2 + 1]);
///                         target.add(&source, c, [bf16(a & 0xffff), bf16(a >> 16), bf16(b & 0xffff), bf16(b >> 16)]);
///                         c += 4 * arch::WARP_SIZE;
///                     }
///                     target.row_added(&comm, &source);
///                     i += stride;
///                 }
///             }
///         }
///     }
/// }
/// ```
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct FusedCombineArgs {
    /// The receive window: rows, then their [`RowSource`]s.
    pub recv: DevWindow,
    /// The accumulators: every rank's `f32 [max_tokens][hidden]`, through the LSA mapping.
    pub acc: DevWindow,
    /// The return rows of results from other domains: every rank's `f32 [max_tokens *
    /// top_k][hidden]`, written by GIN puts (empty when every rank is reached directly).
    pub ret: DevWindow,
    /// This rank's staging rows for results going to other domains: `f32 [(nranks -
    /// domain_size) * max_tokens * top_k][hidden]` (see [`FusedCombineArgs::stage_row`];
    /// empty when every rank is reached directly).
    pub stage: DevWindow,
    /// Device address of `i32 [experts_per_rank]`: rows received per local expert.
    pub recv_counts: u64,
    /// Local experts.
    pub experts_per_rank: u32,
    /// Rows per local expert in the receive window.
    pub capacity: u32,
    /// Elements per token (a multiple of 8).
    pub hidden: u32,
    /// Experts per token.
    pub top_k: u32,
    /// The most tokens per rank.
    pub max_tokens: u32,
    /// World rank of the first rank of this rank's LSA domain.
    pub domain_first: u32,
    /// Ranks reached directly from this one: `domain_first..domain_first + domain_size` (the
    /// LSA domain; 0 when GIN is forced through the proxy).
    pub domain_size: u32,
    /// Padding.
    pub _reserved: u32,
}

impl FusedCombineArgs {
    /// Rows local expert `l` received.
    ///
    /// # Safety
    /// `self` is what the host gave this launch; `l < experts_per_rank`.
    ///
    /// # Examples
    ///
    /// ```
    /// use ferrolink_device::moe::fused::FusedCombineArgs;
    /// let recv_counts = [3i32, 0, 5]; // as the dispatch wrote them
    /// let target =
    ///     FusedCombineArgs { recv_counts: recv_counts.as_ptr() as u64, experts_per_rank: 3, ..Default::default() };
    /// // SAFETY: `recv_counts` holds `experts_per_rank` counts.
    /// let rows: Vec<usize> = (0..3).map(|l| unsafe { target.rows(l) }).collect();
    /// assert_eq!(rows, [3, 0, 5]);
    /// ```
    #[inline(always)]
    pub unsafe fn rows(&self, l: usize) -> usize {
        // SAFETY: the contract: `recv_counts` holds `experts_per_rank` counts, written by the
        // dispatch before this kernel (stream order).
        unsafe { (self.recv_counts as *const i32).add(l).read() as usize }
    }

    /// The token row (`hidden` bf16, as `hidden / 8` 16-byte units) of local expert `l`'s
    /// row `i`.
    ///
    /// ```
    /// use ferrolink_device::DevWindow;
    /// use ferrolink_device::moe::fused::FusedCombineArgs;
    /// // A receive window of 2 local experts x capacity 4 rows, hidden 64 (128-byte rows):
    /// let recv = DevWindow { flat_base: 0x10_0000, stride: 4096, size: 4096, lsa_size: 1, ..Default::default() };
    /// let target = FusedCombineArgs { recv, experts_per_rank: 2, capacity: 4, hidden: 64, ..Default::default() };
    /// assert_eq!(target.row(1, 2) as u64, 0x10_0000 + (4 + 2) * 128);
    /// ```
    #[inline(always)]
    pub fn row(&self, l: usize, i: usize) -> *const U32x4 {
        self.recv.local_ptr((l * self.capacity as usize + i) * self.hidden as usize * 2)
    }

    /// Where local expert `l`'s row `i` came from.
    ///
    /// # Safety
    /// As [`FusedCombineArgs::rows`], and `i < self.rows(l)`.
    ///
    /// # Examples
    ///
    /// ```
    /// use ferrolink_device::arch::U32x4;
    /// use ferrolink_device::moe::fused::{FusedCombineArgs, RowSource, sources_offset};
    /// use ferrolink_device::DevWindow;
    /// // 1 local expert, capacity 2, hidden 8: two 16-byte rows, then a source per slot.
    /// assert_eq!(sources_offset(1, 2, 16), 2 * 16);
    /// let mut recv = vec![U32x4::default(); 4];
    /// recv[3] = U32x4([5, 7, 1, 0.25f32.to_bits()]); // slot 1's source, as the dispatch put it
    /// let recv_counts = [2i32];
    /// let base = recv.as_ptr() as u64;
    /// let target = FusedCombineArgs {
    ///     recv: DevWindow { flat_base: base, stride: 64, size: 64, lsa_size: 1, ..Default::default() },
    ///     recv_counts: recv_counts.as_ptr() as u64,
    ///     experts_per_rank: 1,
    ///     capacity: 2,
    ///     hidden: 8,
    ///     ..Default::default()
    /// };
    /// // SAFETY: expert 0 received 2 rows, whose sources lie in `recv`.
    /// let source = unsafe { target.source(0, 1) };
    /// assert_eq!(source, RowSource { rank: 5, token: 7, k: 1, weight: 0.25 });
    /// ```
    #[inline(always)]
    pub unsafe fn source(&self, l: usize, i: usize) -> RowSource {
        let (per, cap) = (self.experts_per_rank as usize, self.capacity as usize);
        let at = sources_offset(per, cap, 2 * self.hidden as usize) + (l * cap + i) * 16;
        // SAFETY: the contract: a received row's source lies there, written by the dispatch.
        let v = unsafe { arch::load_v4(self.recv.local_ptr(at)) };
        bytemuck::cast(v.0)
    }

    /// Whether world rank `rank` is reached directly (the same rule as GIN's).
    ///
    /// ```
    /// use ferrolink_device::moe::fused::FusedCombineArgs;
    /// // This rank's LSA domain is ranks 4..8:
    /// let target = FusedCombineArgs { domain_first: 4, domain_size: 4, ..Default::default() };
    /// assert!(target.is_direct(4) && target.is_direct(7));
    /// assert!(!target.is_direct(3) && !target.is_direct(8));
    /// ```
    #[inline(always)]
    pub fn is_direct(&self, rank: u32) -> bool {
        rank.wrapping_sub(self.domain_first) < self.domain_size
    }

    /// Row of [`FusedCombineArgs::stage`] for `source` (a rank not reached directly): the
    /// ranks outside this domain in order, then `(token, k)`.
    ///
    /// ```
    /// use ferrolink_device::moe::fused::{FusedCombineArgs, RowSource};
    /// let target =
    ///     FusedCombineArgs { domain_first: 4, domain_size: 4, max_tokens: 8, top_k: 2, ..Default::default() };
    /// // Rank 9 is index 5 among the ranks outside 4..8 (0, 1, 2, 3, 8, 9, ..):
    /// let source = RowSource { rank: 9, token: 1, k: 1, weight: 1.0 };
    /// assert_eq!(target.stage_row(&source), (5 * 8 + 1) * 2 + 1);
    /// ```
    #[inline(always)]
    pub fn stage_row(&self, source: &RowSource) -> usize {
        let r = source.rank;
        let outside = if r < self.domain_first { r } else { r - self.domain_size };
        (outside as usize * self.max_tokens as usize + source.token as usize) * self.top_k as usize + source.k as usize
    }

    /// Hands over `source.weight * y[j]` for channels `channel + j` (`j < 4`) of `source`'s
    /// row: added to the token's accumulator row on its rank (relaxed, system scope) when that
    /// rank is reached directly, else written into the row's staging place, which
    /// [`FusedCombineArgs::row_added`] puts. Any lane, any order; each channel of a row once.
    ///
    /// # Safety
    /// As [`FusedCombineArgs::source`] for the `source` passed (read by this launch);
    /// `channel` is a multiple of 4 below `hidden`.
    ///
    /// # Examples
    ///
    /// ```
    /// use ferrolink_device::emulator::{self, LaunchSpec};
    /// use ferrolink_device::moe::fused::{FusedCombineArgs, RowSource};
    /// use ferrolink_device::DevWindow;
    /// # use std::time::Duration;
    /// // One rank, its own LSA domain: the accumulators of 2 tokens of hidden 8.
    /// #[repr(align(16))]
    /// struct Acc([f32; 16]);
    /// let mut acc = Acc([0.0; 16]);
    /// let base = acc.0.as_mut_ptr() as u64;
    /// let acc_win = DevWindow { flat_base: base, stride: 64, size: 64, lsa_size: 1, ..Default::default() };
    /// let target =
    ///     FusedCombineArgs { acc: acc_win, hidden: 8, top_k: 1, max_tokens: 2, domain_size: 1, ..Default::default() };
    /// unsafe fn expert(args: (FusedCombineArgs,)) {
    ///     let source = RowSource { rank: 0, token: 1, k: 0, weight: 0.5 };
    ///     // SAFETY: token 1 of rank 0 has an accumulator row; channel 4 is a multiple of 4 below hidden.
    ///     unsafe { args.0.add(&source, 4, [2.0, 4.0, 6.0, 8.0]) };
    /// }
    /// # let spec = LaunchSpec { name: "expert", grid: [1, 1, 1], block: [1, 1, 1], shared_mem_bytes: 0,
    /// #     timeout: Duration::from_secs(10) };
    /// // SAFETY: the accumulators outlive the launch.
    /// unsafe { emulator::launch(&spec, expert, (target,)) }.unwrap();
    /// assert_eq!(acc.0[8 + 4..], [1.0, 2.0, 3.0, 4.0]); // weight * y, in token 1's row
    /// ```
    #[inline(always)]
    pub unsafe fn add(&self, source: &RowSource, channel: usize, y: [f32; 4]) {
        let w = source.weight;
        let v = [w * y[0], w * y[1], w * y[2], w * y[3]];
        if self.is_direct(source.rank) {
            let at = (source.token as usize * self.hidden as usize + channel) * 4;
            let p = self.acc.lsa_ptr::<f32>(at, source.rank % self.acc.lsa_size);
            // SAFETY: the accumulators hold `max_tokens` rows of `hidden` f32 on every rank
            // and the source names a token of its rank; 16-byte aligned (`channel % 4 == 0`,
            // `hidden % 8 == 0`); only these reductions touch them until `finish` acquires.
            unsafe { atomic::red_add_f32x4(p, v, Scope::Sys) };
        } else {
            let at = (self.stage_row(source) * self.hidden as usize + channel) * 4;
            // Outside the staging window (a target made wrong) nothing is written: the
            // row's put in `row_added` covers this place and faults naming the window.
            if at + 16 <= self.stage.size as usize {
                let words = U32x4(v.map(f32::to_bits));
                // SAFETY: inside the staging window (16-byte aligned as above); the row is
                // this entry's alone, and its last put has been read (module docs: ordering).
                unsafe { arch::store_v4(self.stage.local_ptr(at), words) };
            }
        }
    }

    /// Reports `source`'s row done (every lane of the warp calls, after all its
    /// [`FusedCombineArgs::add`]s for the row): the warp meets, then, for a token rank
    /// reached directly, lane 0 raises [`signal::FUSED`] there with a release at system
    /// scope; else the warp puts the row's staging place into the entry's return row there,
    /// with [`signal::FUSED`] as the put's signal. Each received row must be reported
    /// exactly once per call.
    ///
    /// # Safety
    /// Every lane of the warp calls it with the same `source`, read by this launch
    /// ([`FusedCombineArgs::source`]) of a row not reported yet; `comm` is the `Moe`'s device
    /// communicator (`Moe::dev_comm`). A report too many lets the token rank's `finish` read
    /// the accumulators while adds still land.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use ferrolink_device::moe::fused::FusedCombineArgs;
    /// use ferrolink_device::{DevComm, arch};
    /// /// A warp's whole work on local expert `l`'s row `i`: `y = 1` in every channel, then the report.
    /// ///
    /// /// # Safety
    /// /// Every lane of one warp calls it, once per received row (`i < target.rows(l)`) of this
    /// /// call's only expert launch; `target` and `comm` come from that `Moe`.
    /// unsafe fn ones_row(comm: &DevComm, target: &FusedCombineArgs, l: usize, i: usize) {
    ///     // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
    ///     // SAFETY: the caller's contract.
    ///     unsafe {
    ///         let source = target.source(l, i);
    ///         let mut c = 4 * arch::lane_id() as usize;
    ///         while c < target.hidden as usize {
    ///             target.add(&source, c, [1.0; 4]);
    ///             c += 4 * arch::WARP_SIZE;
    ///         }
    ///         // Every lane, after all of its adds for the row.
    ///         target.row_added(comm, &source);
    ///     }
    /// }
    /// ```
    #[inline(always)]
    pub unsafe fn row_added(&self, comm: &DevComm, source: &RowSource) {
        let gin = Gin::new(comm, 0);
        if self.is_direct(source.rank) {
            gin.signal(CoopWarp, comm.world(), source.rank, RemoteAction::SignalInc(signal::FUSED));
            return;
        }
        let bytes = self.hidden as usize * 4;
        let entry = source.token as usize * self.top_k as usize + source.k as usize;
        // SAFETY: both windows are this Moe's (the host made the target); `put` checks the
        // ranges (a fault names them); the staging row is not written again until the token
        // rank has seen this put land, and the return row is this entry's alone, read by the
        // token rank's `finish` after the put's signal (module docs: ordering).
        unsafe {
            gin.put(
                CoopWarp,
                comm.world(),
                source.rank,
                self.ret,
                entry * bytes,
                self.stage,
                self.stage_row(source) * bytes,
                bytes,
                RemoteAction::SignalInc(signal::FUSED),
                LocalAction::None,
            )
        };
    }
}

/// One CTA (`block` of `grid`) of the fused combine's last step on a token's rank: waits
/// until every entry this rank kept in the last dispatch was reported (added into its
/// accumulators `acc`, `f32 [tokens][hidden]`, or put into its return rows `ret`), then
/// writes `out[t] = bf16(acc[t] + the return rows of t's entries from other domains)` for
/// its share of the units and zeroes the accumulators. False on an abort or a timeout (the
/// host reports it).
///
/// # Safety
/// As the [`super::combine`] it replaces: the same `args` (`out`, `state`, `ret_index`,
/// `tokens`, `top_k`, `hidden`, `epoch`) after a dispatch given the weights, on the same
/// stream, after the expert kernel; `acc` is this `Moe`'s accumulator window (every rank's
/// `tokens * hidden` f32 at least) and `ret` its return rows (`tokens * top_k * hidden` f32
/// when some rank is not reached directly: checked). The kernel writes the state's
/// `fused_done` (nothing else uses the state while it runs).
///
/// # Examples
///
/// ```no_run
/// use ferrolink_device::moe::{MoeArgs, fused};
/// use ferrolink_device::{DevComm, DevWindow, arch, kernel};
/// kernel! {
///     /// The fused combine's last step as a kernel of one's own (as the built-in
///     /// `moe_fused_finish`), after the expert launch on the same stream.
///     ///
///     /// # Safety
///     /// As `fused::finish`.
///     pub unsafe fn my_fused_finish(comm: DevComm, acc: DevWindow, ret: DevWindow, args: MoeArgs) {
///         // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
///         let (block, grid) = (arch::block_idx_x(), arch::grid_dim_x());
///         // SAFETY: the kernel's contract. False: an abort or a timeout (the host reports it).
///         let _ = unsafe { fused::finish(&comm, &acc, &ret, &args, block, grid) };
///     }
/// }
/// ```
pub unsafe fn finish(
    comm: &DevComm,
    acc: &DevWindow,
    ret: &DevWindow,
    args: &MoeArgs,
    block: usize,
    grid: usize,
) -> bool {
    let cta = CoopCta;
    let gin = Gin::new(comm, 0);
    let n = comm.nranks as usize;
    let (hidden, top_k) = (args.hidden as usize, args.top_k as usize);
    // Results of ranks not reached directly come as return rows (other domains, or
    // `FERROLINK_GIN=proxy`).
    let returns = comm.lsa_size != comm.nranks || gin.uses_proxy();
    if !args.hidden.is_multiple_of(8) {
        comm.fail(error_code::MOE_ARGS, u64::from(args.num_experts.max(1)) << 32 | u64::from(args.hidden), 0);
    }
    let ret_bytes = args.tokens as u64 * top_k as u64 * hidden as u64 * 4;
    if returns && ret.size < ret_bytes {
        comm.fail(error_code::MOE_FUSED_PATH, ret_bytes, ret.size);
    }
    if block == 0 {
        signal_ready(&gin, cta, n, signal::READY);
    }
    // SAFETY: the state is this rank's, written by the dispatch before this kernel; only the
    // target's word is read (CTA 0's thread 0 writes `fused_done` below).
    let target = unsafe { core::ptr::addr_of!((*(args.state as *const MoeState)).fused_target).read_volatile() };
    if gin.wait_signal(cta, signal::FUSED, target).is_err() {
        return false;
    }
    if block == 0 && cta.thread_rank() == 0 {
        // SAFETY: the state is this rank's; only this thread writes it during this kernel,
        // and every other thread reads only `fused_target`, another word.
        unsafe {
            let state = args.state as *mut MoeState;
            core::ptr::addr_of_mut!((*state).fused_done).write_volatile(target);
            // No combine puts this call's results back: the return signal's target drops
            // what the dispatch added for one.
            let (ret_total, pushed) =
                (core::ptr::addr_of_mut!((*state).ret_total), core::ptr::addr_of_mut!((*state).pushed));
            ret_total.write_volatile(ret_total.read_volatile() - pushed.read_volatile());
            pushed.write_volatile(0);
        }
    }
    let units = args.tokens as usize * hidden / 8;
    let out = args.out as *mut U32x4;
    let places = args.ret_index as *const ResultPlace;
    let threads = cta.size();
    let mut u = block * threads + cta.thread_rank();
    while u < units {
        let (lo, hi) = (acc.local_ptr::<U32x4>(u * 32), acc.local_ptr::<U32x4>(u * 32 + 16));
        // SAFETY: unit `u` (8 f32) lies in this rank's accumulators and 8 bf16 in `out`
        // (the contract); every add and put landed (the wait above), none comes until the
        // next call; with `returns`, `ret_index` holds the dispatch's `tokens * top_k`
        // places and `ret` their rows (checked above).
        unsafe {
            let (a, b) = (arch::load_v4(lo), arch::load_v4(hi));
            arch::store_v4(lo, U32x4::default());
            arch::store_v4(hi, U32x4::default());
            let mut sum = [0f32; 8];
            for (i, w) in a.0.iter().chain(b.0.iter()).enumerate() {
                sum[i] = f32::from_bits(*w);
            }
            if returns {
                let (t, c) = (u / (hidden / 8), u % (hidden / 8) * 8);
                for k in 0..top_k {
                    let entry = t * top_k + k;
                    let place = places.add(entry).read();
                    if !comes_back(place) {
                        continue;
                    }
                    let row = ret.local_ptr::<U32x4>((entry * hidden + c) * 4);
                    let (p, q) = (arch::load_v4(row), arch::load_v4(row.add(1)));
                    for (s, w) in sum.iter_mut().zip(p.0.iter().chain(q.0.iter())) {
                        *s += f32::from_bits(*w);
                    }
                }
            }
            let mut words = [0u32; 4];
            for (i, v) in sum.iter().enumerate() {
                words[i / 2] |= u32::from(half::bf16::from_f32(*v).to_bits()) << (16 * (i % 2));
            }
            arch::store_v4(out.add(u), U32x4(words));
        }
        u += grid * threads;
    }
    true
}
