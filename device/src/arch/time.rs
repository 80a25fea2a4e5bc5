//! Timers.

use super::imp;

/// Nanoseconds of a global clock (`%globaltimer`): comparable across SMs of one GPU, with
/// a resolution of about 1 µs on current GPUs (the register updates in steps). For timeouts
/// and coarse timing, not for measuring short code sequences.
#[inline(always)]
pub fn global_timer_ns() -> u64 {
    imp::global_timer_ns()
}

/// Per-SM cycle counter (`%clock64`). Only differences taken on the same SM are meaningful.
#[inline(always)]
pub fn clock64() -> u64 {
    imp::clock64()
}

/// Suspends the thread for about `ns` nanoseconds (`nanosleep.u32`, at most 1 ms;
/// the hardware may wake it earlier). On the emulator: yield the host thread.
#[inline(always)]
pub fn nanosleep(ns: u32) {
    imp::nanosleep(ns)
}
