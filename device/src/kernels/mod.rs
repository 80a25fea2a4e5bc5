//! Built-in kernels, written only on the public primitives of this crate.
//!
//! * [`copy`] — vectorized byte copy (the bandwidth baseline for every put).
//! * [`lsa`] — puts, ring exchange, one-shot all-reduce, fused compute-and-put, barrier
//!   stress and latency kernels over the LSA device API.
//! * [`gin`] — GIN exchanges, put-value, queue wrap-around, GIN and hybrid barriers (the
//!   test suite's), put-with-signal ping-pong and all-to-all (examples and perf).
//! * [`coll`] and [`p2p`] — the collectives and the point-to-point group kernel.
//! * [`moe`] — MoE dispatch and combine.
//! * [`workqueue`] — a persistent kernel with a batched atomic work queue.
//! * [`probe`] — the SM clock and single-primitive latencies, for the perf tool.
//! * [`selftest`] — kernels the test suite uses to check the arch layer on each backend:
//!   message passing litmus, contended CAS counters, warp operations, timed waits.

pub mod coll;
pub mod copy;
pub mod gin;
pub mod lsa;
pub mod moe;
pub mod p2p;
pub mod probe;
pub mod selftest;
pub mod workqueue;
