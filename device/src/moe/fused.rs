//! The **fused combine**: the experts' kernels add their weighted results straight into
//! their tokens' ranks, so no combine pass moves rows.
//!
//! A dispatch given the weights (`MoeArgs::topk_weights` not 0) also writes, with every row
//! it puts, the row's [`RowSource`] (source rank, token, k, weight) into the receive window
//! after the rows (from [`sources_offset`]). An expert kernel (the caller's, launched after
//! the dispatch on its stream with a [`FusedCombineArgs`]) computes its rows and, per row,
//! adds `weight * y` into the token's `f32` accumulator row on the source rank through the
//! LSA mapping ([`FusedCombineArgs::add`]: `red.add.v4.f32` at system scope), then reports
//! the row done ([`FusedCombineArgs::row_added`]: signal [`signal::FUSED`] there). The token
//! rank's [`finish`] waits until every entry it kept was added, rounds its accumulators to
//! bf16 into `out` and zeroes them for the next call. Each result crosses NVLink once, as
//! its expert's adds; the sum over `k` happens in the accumulator (in arrival order, so its
//! `f32` rounding may differ from the combine's `k` order).
//!
//! Every rank must be a direct (LSA) peer of every other, with no peer forced through the
//! proxy (`FERROLINK_GIN=proxy`): the adds are stores through the mapping (GIN has no remote
//! float add). [`finish`] fails with [`error_code::MOE_FUSED_PATH`] otherwise.
//!
//! Per call: one dispatch given the weights, then **one** expert launch that reports every
//! received row once, then [`finish`] (the host's `Moe` refuses other orders).
//!
//! # Ordering
//! * Sources: each goes with its row (two `put_value`s on the row's path) before the CTA's
//!   data signal, which is raised after them (`PeerTally`); an expert kernel runs after
//!   its dispatch, which waited for that signal, on its stream.
//! * Adds → [`finish`]: a lane's adds are relaxed at system scope; the warp meets
//!   (`bar.warp.sync` orders the lanes' memory operations), then lane 0 adds 1 to the
//!   source rank's `FUSED` signal with a release at system scope, cumulative over the lanes'
//!   adds. `finish` waits for its target with an acquire at system scope, then reads.
//! * The target: `FUSED` counts every add report since the `Moe` was made (never reset).
//!   The state's `fused_done` is the total the last fused finish waited for, and the
//!   dispatch sets `fused_target = fused_done + kept` (no signal read on its path). Every
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
//!   zeroes come first. The receive window's rows and sources of call `c` are read by the
//!   expert kernel before its rank's dispatch `c + 1` starts (stream order), and rows of
//!   `c + 1` land only after every rank started `c + 1` (as for the combine).
//! * `READY`: `finish` raises it on every direct peer as a combine does (nothing is read in
//!   place here), so a later combine's target stays `epoch` times the direct peers.

use super::{MoeArgs, MoeState, signal, signal_ready};
use crate::arch::{self, Scope, U32x4, atomic};
use crate::comm::{DevComm, error_code};
use crate::coop::{Coop, CoopCta, CoopWarp};
use crate::gin::{Gin, RemoteAction};
use crate::window::DevWindow;
use bytemuck::{Pod, Zeroable};

/// Where a received row came from (16 bytes per receive slot, written by a dispatch given
/// the weights).
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
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct FusedCombineArgs {
    /// The receive window: rows, then their [`RowSource`]s.
    pub recv: DevWindow,
    /// The accumulators: every rank's `f32 [max_tokens][hidden]`, through the LSA mapping.
    pub acc: DevWindow,
    /// Device address of `i32 [experts_per_rank]`: rows received per local expert.
    pub recv_counts: u64,
    /// Local experts.
    pub experts_per_rank: u32,
    /// Rows per local expert in the receive window.
    pub capacity: u32,
    /// Elements per token (a multiple of 8).
    pub hidden: u32,
    /// Padding.
    pub _reserved: u32,
}

impl FusedCombineArgs {
    /// Rows local expert `l` received.
    ///
    /// # Safety
    /// `self` is what the host gave this launch; `l < experts_per_rank`.
    #[inline(always)]
    pub unsafe fn rows(&self, l: usize) -> usize {
        // SAFETY: the contract: `recv_counts` holds `experts_per_rank` counts, written by the
        // dispatch before this kernel (stream order).
        unsafe { (self.recv_counts as *const i32).add(l).read() as usize }
    }

    /// The token row (`hidden` bf16, as `hidden / 8` 16-byte units) of local expert `l`'s
    /// row `i`.
    #[inline(always)]
    pub fn row(&self, l: usize, i: usize) -> *const U32x4 {
        self.recv.local_ptr((l * self.capacity as usize + i) * self.hidden as usize * 2)
    }

    /// Where local expert `l`'s row `i` came from.
    ///
    /// # Safety
    /// As [`FusedCombineArgs::rows`], and `i < self.rows(l)`.
    #[inline(always)]
    pub unsafe fn source(&self, l: usize, i: usize) -> RowSource {
        let (per, cap) = (self.experts_per_rank as usize, self.capacity as usize);
        let at = sources_offset(per, cap, 2 * self.hidden as usize) + (l * cap + i) * 16;
        // SAFETY: the contract: a received row's source lies there, written by the dispatch.
        let v = unsafe { arch::load_v4(self.recv.local_ptr(at)) };
        bytemuck::cast(v.0)
    }

    /// Adds `source.weight * y[j]` to channels `channel + j` (`j < 4`) of the token's
    /// accumulator row on its rank (relaxed, system scope; any lane, any order).
    ///
    /// # Safety
    /// As [`FusedCombineArgs::source`] for the `source` passed (read by this launch);
    /// `channel` is a multiple of 4 below `hidden`.
    #[inline(always)]
    pub unsafe fn add(&self, source: &RowSource, channel: usize, y: [f32; 4]) {
        let w = source.weight;
        let at = (source.token as usize * self.hidden as usize + channel) * 4;
        let p = self.acc.lsa_ptr::<f32>(at, source.rank % self.acc.lsa_size);
        // SAFETY: the accumulators hold `max_tokens` rows of `hidden` f32 on every rank and
        // the source names a token of its rank; 16-byte aligned (`channel % 4 == 0`,
        // `hidden % 8 == 0`); only these reductions touch them until `finish` acquires.
        unsafe { atomic::red_add_f32x4(p, [w * y[0], w * y[1], w * y[2], w * y[3]], Scope::Sys) };
    }

    /// Reports `source`'s row added (every lane of the warp calls, after all its
    /// [`FusedCombineArgs::add`]s for the row): the warp meets, then lane 0 raises
    /// [`signal::FUSED`] on the token's rank with a release at system scope. Each received
    /// row must be reported exactly once per call.
    ///
    /// # Safety
    /// Every lane of the warp calls it with the same `source`, read by this launch
    /// ([`FusedCombineArgs::source`]) of a row not reported yet; `comm` is the `Moe`'s device
    /// communicator (`Moe::dev_comm`). A report too many lets the token rank's `finish` read
    /// the accumulators while adds still land.
    #[inline(always)]
    pub unsafe fn row_added(&self, comm: &DevComm, source: &RowSource) {
        Gin::new(comm, 0).signal(CoopWarp, comm.world(), source.rank, RemoteAction::SignalInc(signal::FUSED));
    }
}

/// One CTA (`block` of `grid`) of the fused combine's last step on a token's rank: waits
/// until every entry this rank kept in the last dispatch was added into its accumulators
/// (`acc`, `f32 [tokens][hidden]`), then writes `out[t] = bf16(acc[t])` for its share of the
/// units and zeroes them. False on an abort or a timeout (the host reports it).
///
/// # Safety
/// As the [`super::combine`] it replaces: the same `args` (`out`, `state`, `tokens`,
/// `hidden`, `epoch`) after a dispatch given the weights, on the same stream, after the
/// expert kernel; `acc` is this `Moe`'s accumulator window (every rank's `tokens * hidden`
/// f32 at least). The kernel writes the state's `fused_done` (nothing else uses the state
/// while it runs).
pub unsafe fn finish(comm: &DevComm, acc: &DevWindow, args: &MoeArgs, block: usize, grid: usize) -> bool {
    let cta = CoopCta;
    let gin = Gin::new(comm, 0);
    let n = comm.nranks as usize;
    // Ranks not reached directly could not have added (the host's `enable_fused` refuses
    // them: another LSA domain, or `FERROLINK_GIN=proxy`).
    if comm.lsa_size != comm.nranks || gin.uses_proxy() {
        let domains = u64::from(comm.lsa_size) << 32 | u64::from(comm.nranks);
        comm.fail(error_code::MOE_FUSED_PATH, domains, u64::from(gin.uses_proxy()));
    }
    if !args.hidden.is_multiple_of(8) {
        comm.fail(error_code::MOE_ARGS, u64::from(args.num_experts.max(1)) << 32 | u64::from(args.hidden), 0);
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
        // and every thread reads only `fused_target`, another word.
        unsafe { core::ptr::addr_of_mut!((*(args.state as *mut MoeState)).fused_done).write_volatile(target) };
    }
    let units = args.tokens as usize * args.hidden as usize / 8;
    let out = args.out as *mut U32x4;
    let threads = cta.size();
    let mut u = block * threads + cta.thread_rank();
    while u < units {
        let (lo, hi) = (acc.local_ptr::<U32x4>(u * 32), acc.local_ptr::<U32x4>(u * 32 + 16));
        // SAFETY: unit `u` (8 f32) lies in this rank's accumulators and 8 bf16 in `out`
        // (the contract); every add landed (the wait above), none comes until the next call.
        unsafe {
            let (a, b) = (arch::load_v4(lo), arch::load_v4(hi));
            arch::store_v4(lo, U32x4::default());
            arch::store_v4(hi, U32x4::default());
            let mut words = [0u32; 4];
            for (i, w) in a.0.iter().chain(b.0.iter()).enumerate() {
                words[i / 2] |= u32::from(half::bf16::from_f32(f32::from_bits(*w)).to_bits()) << (16 * (i % 2));
            }
            arch::store_v4(out.add(u), U32x4(words));
        }
        u += grid * threads;
    }
    true
}
