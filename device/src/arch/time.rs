//! Timers.

use super::imp;

/// Nanoseconds of a global clock (`%globaltimer`): comparable across SMs of one GPU, with
/// a resolution of about 1 µs on current GPUs (the register updates in steps). For timeouts
/// and coarse timing, not for measuring short code sequences.
///
/// ```
/// # use ferrolink_device::arch;
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// unsafe fn kernel((out,): (*mut u64,)) {
///     // Waits at least 50 µs, as a timeout loop does.
///     let start = arch::global_timer_ns();
///     while arch::global_timer_ns().wrapping_sub(start) < 50_000 {
///         arch::spin_wait_hint(100);
///     }
///     // SAFETY: one thread writes the one word.
///     unsafe { out.write(arch::global_timer_ns() - start) };
/// }
/// let spec = LaunchSpec { name: "ex", grid: [1, 1, 1], block: [1, 1, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// let mut waited = 0u64;
/// // SAFETY: `waited` outlives the launch.
/// unsafe { emulator::launch(&spec, kernel, (&raw mut waited,)) }.unwrap();
/// assert!(waited >= 50_000);
/// ```
#[inline(always)]
pub fn global_timer_ns() -> u64 {
    imp::global_timer_ns()
}

/// Per-SM cycle counter (`%clock64`). Only differences taken on the same SM are meaningful.
/// On the CPU emulator it reads the same nanosecond clock as [`global_timer_ns`].
///
/// ```
/// # use ferrolink_device::arch;
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// unsafe fn kernel((out,): (*mut [u64; 2],)) {
///     let c0 = arch::clock64();
///     let mut x = 0u32;
///     for i in 0..1000 {
///         x = core::hint::black_box(x.wrapping_mul(31).wrapping_add(i));
///     }
///     // Both reads on the same SM: their difference counts the loop's cycles.
///     let c1 = arch::clock64();
///     // SAFETY: one thread writes the one pair.
///     unsafe { out.write([c0, c1]) };
/// }
/// let spec = LaunchSpec { name: "ex", grid: [1, 1, 1], block: [1, 1, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// let mut clocks = [0u64; 2];
/// // SAFETY: `clocks` outlives the launch.
/// unsafe { emulator::launch(&spec, kernel, (&raw mut clocks,)) }.unwrap();
/// assert!(clocks[1] >= clocks[0]); // on the emulator, nanoseconds
/// ```
#[inline(always)]
pub fn clock64() -> u64 {
    imp::clock64()
}

/// Suspends the thread for about `ns` nanoseconds (`nanosleep.u32`, at most 1 ms;
/// the hardware may wake it earlier). On the emulator: yield the host thread.
///
/// ```
/// # use ferrolink_device::arch;
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// use ferrolink_device::arch::atomic::{self, LoadOrder, Scope, StoreOrder};
/// unsafe fn kernel((flag,): (*mut u32,)) {
///     if arch::block_idx_x() == 0 {
///         // SAFETY: `flag` is a live word, accessed only atomically.
///         unsafe { atomic::store(flag, 1, StoreOrder::Release, Scope::Gpu) };
///     } else {
///         // Polls with a growing back-off (the hardware may wake the thread earlier).
///         let mut ns = 32;
///         // SAFETY: as above.
///         while unsafe { atomic::load(flag, LoadOrder::Acquire, Scope::Gpu) } == 0 {
///             arch::nanosleep(ns);
///             ns = (2 * ns).min(1000);
///         }
///     }
/// }
/// let spec = LaunchSpec { name: "ex", grid: [2, 1, 1], block: [1, 1, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// let mut flag = 0u32;
/// // SAFETY: `flag` outlives the launch.
/// unsafe { emulator::launch(&spec, kernel, (&raw mut flag,)) }.unwrap();
/// assert_eq!(flag, 1);
/// ```
#[inline(always)]
pub fn nanosleep(ns: u32) {
    imp::nanosleep(ns)
}
