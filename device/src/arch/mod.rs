//! Layer 0: the hardware primitives every other layer is written on.
//!
//! Each function documents the PTX it becomes on nvptx64. On the host the same functions
//! run on the CPU emulator ([`crate::emulator`]) with semantics at least as strong as asked
//! (the emulator runs on x86-64, whose memory model is stronger than the GPU's).
//!
//! Indices come back as `usize` so that offset arithmetic never overflows 32 bits
//! (the PTX special registers are 32-bit; see TOOLCHAIN.md "Index intrinsics return u32").
//!
//! # Memory-model vocabulary
//! Every atomic takes an *order* and a [`Scope`]. A release operation at scope S makes the
//! writes before it (in program order, and those it observed) visible to any thread in S
//! that acquires the released value. Peers on the same GPU need [`Scope::Gpu`]; peers on
//! other GPUs or the host need [`Scope::Sys`]; threads of one CTA can use [`Scope::Cta`].

pub mod atomic;
mod index;
mod memory;
mod time;
mod warp;

#[cfg(not(target_arch = "nvptx64"))]
mod host;
#[cfg(target_arch = "nvptx64")]
mod ptx;

#[cfg(not(target_arch = "nvptx64"))]
use host as imp;
#[cfg(target_arch = "nvptx64")]
use ptx as imp;

pub use atomic::{FenceOrder, LoadOrder, RmwOrder, Scope, StoreOrder};
pub use index::*;
pub use memory::*;
pub use time::*;
pub use warp::*;

/// Waits until every thread of the CTA has reached this call, and makes each thread's
/// earlier shared- and global-memory writes visible to the others (`barrier.sync 0`, which
/// orders memory at CTA scope). Threads that have exited count as arrived. Warps may arrive
/// diverged (the non-aligned form; sm_70+).
#[inline(always)]
pub fn sync_threads() {
    imp::sync_threads()
}

/// [`sync_threads`] for callers whose warps arrive converged: `bar.sync 0`
/// (= `barrier.sync.aligned`), cheaper than the non-aligned form. Every lane of a warp must
/// reach it together; otherwise use [`sync_threads`].
#[inline(always)]
pub fn sync_threads_converged() {
    imp::sync_threads_converged()
}

/// [`sync_threads`] that also reduces a predicate: returns whether `pred` was true in any
/// thread of the CTA (`barrier.red.or.pred`, CUDA's `__syncthreads_or`).
#[inline(always)]
pub fn sync_threads_or(pred: bool) -> bool {
    imp::sync_threads_or(pred)
}

/// A hint inside a spin-wait loop. On the GPU it is `nanosleep.u32 ns` (the SM may
/// run other warps meanwhile); on the emulator it yields the host thread and checks the
/// launch's timeout, so a spin that can never end becomes an error rather than a hang.
#[inline(always)]
pub fn spin_wait_hint(ns: u32) {
    imp::nanosleep(ns)
}

/// Launches the executable graph `exec` into the device-only stream `stream` from the
/// calling thread: the CUDA device runtime's `cudaGraphLaunch` (an `.extern .func` in the
/// PTX, so the module must be linked with `libcudadevrt`, which ferrolink's host does when it
/// loads such a module). Returns the CUDA error code: 0 when the launch was queued. On the
/// emulator the host's CPU backend runs the graph (see [`crate::emulator::DeviceGraphLauncher`]).
/// Use [`crate::graph::DeviceGraph::launch`], which names the streams.
///
/// # Safety
/// `exec` is an executable graph instantiated for device launch and uploaded, alive until the
/// launched work has finished; `stream` is one of the device runtime's graph launch streams.
#[inline(always)]
pub unsafe fn launch_graph(exec: u64, stream: u64) -> u32 {
    // SAFETY: the caller's contract.
    unsafe { imp::launch_graph(exec, stream) }
}

/// Stops the kernel with an error (`trap`). On the emulator the launch fails with
/// an error naming the kernel.
#[inline(always)]
pub fn trap() -> ! {
    imp::trap()
}
