//! Warp-synchronous operations (`shfl.sync`, `vote.sync`, `activemask`).
//!
//! `mask` names the lanes that execute the call together; every lane in `mask` must
//! reach the same call, and the calling lane must be in `mask`. In a partial last warp of a
//! CTA (block size not a multiple of 32) pass [`active_mask`] or the lanes that exist.

use super::imp;

/// All 32 lanes.
pub const FULL_MASK: u32 = 0xffff_ffff;

/// The lanes of this warp executing this call together (`activemask.b32`). On the emulator:
/// the lanes of this warp that exist and have not exited.
#[inline(always)]
pub fn active_mask() -> u32 {
    imp::active_mask()
}

/// `value` of lane `src_lane` (`shfl.sync.idx.b32`). A source lane outside `mask` yields
/// an unspecified value (on the emulator: the caller's own).
#[inline(always)]
pub fn shfl_sync(mask: u32, value: u32, src_lane: u32) -> u32 {
    imp::shfl(imp::ShflMode::Idx, mask, value, src_lane)
}

/// `value` of lane `lane_id + delta`, or the caller's own value where that is past 31
/// (`shfl.sync.down.b32`). The building block of tree reductions. A source lane that is
/// not in `mask` (e.g. missing from a partial warp) gives an unspecified value on the GPU
/// (0 was seen on the H200; the emulator returns the caller's own).
#[inline(always)]
pub fn shfl_down_sync(mask: u32, value: u32, delta: u32) -> u32 {
    imp::shfl(imp::ShflMode::Down, mask, value, delta)
}

/// `value` of lane `lane_id - delta`, or the caller's own where that is below 0
/// (`shfl.sync.up.b32`). The building block of scans.
#[inline(always)]
pub fn shfl_up_sync(mask: u32, value: u32, delta: u32) -> u32 {
    imp::shfl(imp::ShflMode::Up, mask, value, delta)
}

/// `value` of lane `lane_id ^ lane_mask` (`shfl.sync.bfly.b32`): butterfly exchange.
#[inline(always)]
pub fn shfl_xor_sync(mask: u32, value: u32, lane_mask: u32) -> u32 {
    imp::shfl(imp::ShflMode::Xor, mask, value, lane_mask)
}

/// Broadcasts a 64-bit value from `src_lane` (two `shfl.sync.idx.b32`).
#[inline(always)]
pub fn shfl_sync_u64(mask: u32, value: u64, src_lane: u32) -> u64 {
    let lo = shfl_sync(mask, value as u32, src_lane);
    let hi = shfl_sync(mask, (value >> 32) as u32, src_lane);
    (u64::from(hi) << 32) | u64::from(lo)
}

/// Bit `i` set iff lane `i` of `mask` passed `predicate == true` (`vote.sync.ballot.b32`).
#[inline(always)]
pub fn ballot_sync(mask: u32, predicate: bool) -> u32 {
    imp::ballot(mask, predicate)
}

/// Waits until all lanes in `mask` reach this call (`bar.warp.sync`).
#[inline(always)]
pub fn sync_warp(mask: u32) {
    imp::sync_warp(mask)
}
