//! Built-in kernels, written only on the public primitives of this crate.
//!
//! * [`copy`] — vectorized byte copy (the bandwidth baseline for every put).
//! * [`selftest`] — kernels the test suite uses to check the arch layer on each backend:
//!   message passing litmus, contended CAS counters, warp operations, timed waits.

pub mod copy;
pub mod selftest;
