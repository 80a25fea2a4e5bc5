//! Warp-synchronous operations (`shfl.sync`, `vote.sync`, `activemask`).
//!
//! `mask` names the lanes that execute the call together; every lane in `mask` must
//! reach the same call, and the calling lane must be in `mask`. In a partial last warp of a
//! CTA (block size not a multiple of 32) pass [`active_mask`] or the lanes that exist.

use super::imp;

/// All 32 lanes.
///
/// ```
/// use ferrolink_device::arch::{FULL_MASK, WARP_SIZE};
/// assert_eq!(FULL_MASK.count_ones() as usize, WARP_SIZE);
/// ```
pub const FULL_MASK: u32 = 0xffff_ffff;

/// The lanes of this warp executing this call together (`activemask.b32`). On the emulator:
/// the lanes of this warp that exist and have not exited.
///
/// ```
/// # use ferrolink_device::arch::{self, FULL_MASK};
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// unsafe fn kernel((out,): (*mut u32,)) {
///     // A 40-thread CTA: warp 0 is full, warp 1 has 8 lanes.
///     let lanes = arch::ballot_sync(arch::active_mask(), true).count_ones();
///     // SAFETY: one word per thread.
///     unsafe { *out.add(arch::thread_idx_x()) = lanes };
/// }
/// let spec = LaunchSpec { name: "ex", grid: [1, 1, 1], block: [40, 1, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// let mut out = vec![0; 40];
/// // SAFETY: `out` has a word for every thread and outlives the launch.
/// unsafe { emulator::launch(&spec, kernel, (out.as_mut_ptr(),)) }.unwrap();
/// assert!(out[..32].iter().all(|&n| n == 32));
/// assert!(out[32..].iter().all(|&n| n == 8));
/// ```
#[inline(always)]
pub fn active_mask() -> u32 {
    imp::active_mask()
}

/// `value` of lane `src_lane` (`shfl.sync.idx.b32`). A source lane outside `mask` yields
/// an unspecified value (on the emulator: the caller's own).
///
/// ```
/// # use ferrolink_device::arch::{self, FULL_MASK};
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// unsafe fn kernel((out,): (*mut u32,)) {
///     // Every lane reads lane 3's value.
///     let v = arch::shfl_sync(FULL_MASK, 10 * arch::lane_id(), 3);
///     // SAFETY: one word per thread.
///     unsafe { *out.add(arch::thread_idx_x()) = v };
/// }
/// let spec = LaunchSpec { name: "ex", grid: [1, 1, 1], block: [32, 1, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// let mut out = vec![0; 32];
/// // SAFETY: `out` has a word for every thread and outlives the launch.
/// unsafe { emulator::launch(&spec, kernel, (out.as_mut_ptr(),)) }.unwrap();
/// assert!(out.iter().all(|&v| v == 30));
/// ```
#[inline(always)]
pub fn shfl_sync(mask: u32, value: u32, src_lane: u32) -> u32 {
    imp::shfl(imp::ShflMode::Idx, mask, value, src_lane)
}

/// `value` of lane `lane_id + delta`, or the caller's own value where that is past 31
/// (`shfl.sync.down.b32`). The building block of tree reductions. A source lane that is
/// not in `mask` (e.g. missing from a partial warp) gives an unspecified value on the GPU
/// (0 was seen on the H200; the emulator returns the caller's own).
///
/// ```
/// # use ferrolink_device::arch::{self, FULL_MASK};
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// unsafe fn kernel((out,): (*mut u32,)) {
///     // Tree sum of 1..=32: lane 0 ends with the total.
///     let mut v = arch::lane_id() + 1;
///     for delta in [16, 8, 4, 2, 1] {
///         v += arch::shfl_down_sync(FULL_MASK, v, delta);
///     }
///     if arch::lane_id() == 0 {
///         // SAFETY: one thread writes the one word.
///         unsafe { out.write(v) };
///     }
/// }
/// let spec = LaunchSpec { name: "ex", grid: [1, 1, 1], block: [32, 1, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// let mut out = vec![0; 1];
/// // SAFETY: `out` has a word for every thread and outlives the launch.
/// unsafe { emulator::launch(&spec, kernel, (out.as_mut_ptr(),)) }.unwrap();
/// assert_eq!(out[0], 32 * 33 / 2);
/// ```
#[inline(always)]
pub fn shfl_down_sync(mask: u32, value: u32, delta: u32) -> u32 {
    imp::shfl(imp::ShflMode::Down, mask, value, delta)
}

/// `value` of lane `lane_id - delta`, or the caller's own where that is below 0
/// (`shfl.sync.up.b32`). The building block of scans.
///
/// ```
/// # use ferrolink_device::arch::{self, FULL_MASK};
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// unsafe fn kernel((out,): (*mut u32,)) {
///     // Inclusive scan of all-ones: lane i ends with i + 1.
///     let lane = arch::lane_id();
///     let mut v = 1;
///     for delta in [1, 2, 4, 8, 16] {
///         let below = arch::shfl_up_sync(FULL_MASK, v, delta);
///         if lane >= delta {
///             v += below;
///         }
///     }
///     // SAFETY: one word per thread.
///     unsafe { *out.add(lane as usize) = v };
/// }
/// let spec = LaunchSpec { name: "ex", grid: [1, 1, 1], block: [32, 1, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// let mut out = vec![0; 32];
/// // SAFETY: `out` has a word for every thread and outlives the launch.
/// unsafe { emulator::launch(&spec, kernel, (out.as_mut_ptr(),)) }.unwrap();
/// assert_eq!(out, (1..=32).collect::<Vec<u32>>());
/// ```
#[inline(always)]
pub fn shfl_up_sync(mask: u32, value: u32, delta: u32) -> u32 {
    imp::shfl(imp::ShflMode::Up, mask, value, delta)
}

/// `value` of lane `lane_id ^ lane_mask` (`shfl.sync.bfly.b32`): butterfly exchange.
///
/// ```
/// # use ferrolink_device::arch::{self, FULL_MASK};
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// unsafe fn kernel((out,): (*mut u32,)) {
///     // Butterfly all-reduce: every lane ends with the sum of all lane ids.
///     let mut v = arch::lane_id();
///     for lane_mask in [16, 8, 4, 2, 1] {
///         v += arch::shfl_xor_sync(FULL_MASK, v, lane_mask);
///     }
///     // SAFETY: one word per thread.
///     unsafe { *out.add(arch::thread_idx_x()) = v };
/// }
/// let spec = LaunchSpec { name: "ex", grid: [1, 1, 1], block: [32, 1, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// let mut out = vec![0; 32];
/// // SAFETY: `out` has a word for every thread and outlives the launch.
/// unsafe { emulator::launch(&spec, kernel, (out.as_mut_ptr(),)) }.unwrap();
/// assert!(out.iter().all(|&v| v == 31 * 32 / 2));
/// ```
#[inline(always)]
pub fn shfl_xor_sync(mask: u32, value: u32, lane_mask: u32) -> u32 {
    imp::shfl(imp::ShflMode::Xor, mask, value, lane_mask)
}

/// Broadcasts a 64-bit value from `src_lane` (two `shfl.sync.idx.b32`).
///
/// ```
/// # use ferrolink_device::arch::{self, FULL_MASK};
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// unsafe fn kernel((out,): (*mut u64,)) {
///     let mine = (u64::from(arch::lane_id()) << 40) | 7;
///     let v = arch::shfl_sync_u64(FULL_MASK, mine, 5);
///     // SAFETY: one word per thread.
///     unsafe { *out.add(arch::thread_idx_x()) = v };
/// }
/// let spec = LaunchSpec { name: "ex", grid: [1, 1, 1], block: [32, 1, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// let mut out = vec![0; 32];
/// // SAFETY: `out` has a word for every thread and outlives the launch.
/// unsafe { emulator::launch(&spec, kernel, (out.as_mut_ptr(),)) }.unwrap();
/// assert!(out.iter().all(|&v| v == (5 << 40) | 7));
/// ```
#[inline(always)]
pub fn shfl_sync_u64(mask: u32, value: u64, src_lane: u32) -> u64 {
    let lo = shfl_sync(mask, value as u32, src_lane);
    let hi = shfl_sync(mask, (value >> 32) as u32, src_lane);
    (u64::from(hi) << 32) | u64::from(lo)
}

/// Bit `i` set iff lane `i` of `mask` passed `predicate == true` (`vote.sync.ballot.b32`).
///
/// ```
/// # use ferrolink_device::arch::{self, FULL_MASK};
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// unsafe fn kernel((out,): (*mut u32,)) {
///     let even = arch::ballot_sync(FULL_MASK, arch::lane_id() % 2 == 0);
///     // SAFETY: one word per thread.
///     unsafe { *out.add(arch::thread_idx_x()) = even };
/// }
/// let spec = LaunchSpec { name: "ex", grid: [1, 1, 1], block: [32, 1, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// let mut out = vec![0; 32];
/// // SAFETY: `out` has a word for every thread and outlives the launch.
/// unsafe { emulator::launch(&spec, kernel, (out.as_mut_ptr(),)) }.unwrap();
/// assert!(out.iter().all(|&m| m == 0x5555_5555));
/// ```
#[inline(always)]
pub fn ballot_sync(mask: u32, predicate: bool) -> u32 {
    imp::ballot(mask, predicate)
}

/// Waits until all lanes in `mask` reach this call (`bar.warp.sync`).
///
/// ```
/// # use ferrolink_device::arch::{self, FULL_MASK};
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// unsafe fn kernel((out,): (*mut u32,)) {
///     let sh = arch::dynamic_shared_mem::<u32>();
///     let lane = arch::lane_id() as usize;
///     // SAFETY: 32 words of shared memory; each lane writes its own.
///     unsafe { sh.add(lane).write(2 * lane as u32) };
///     arch::sync_warp(FULL_MASK); // the writes above are now visible to the whole warp
///     // SAFETY: reads a neighbour's word, written before the warp barrier; one output per lane.
///     unsafe { *out.add(lane) = sh.add((lane + 1) % 32).read() };
/// }
/// let spec = LaunchSpec { name: "ex", grid: [1, 1, 1], block: [32, 1, 1], shared_mem_bytes: 128,
///     timeout: Duration::from_secs(10) };
/// let mut out = vec![0; 32];
/// // SAFETY: `out` has a word for every thread and outlives the launch.
/// unsafe { emulator::launch(&spec, kernel, (out.as_mut_ptr(),)) }.unwrap();
/// assert!((0..32).all(|l| out[l] == 2 * ((l as u32 + 1) % 32)));
/// ```
#[inline(always)]
pub fn sync_warp(mask: u32) {
    imp::sync_warp(mask)
}
