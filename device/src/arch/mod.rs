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
///
/// ```
/// # use ferrolink_device::arch;
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// unsafe fn kernel((out,): (*mut u32,)) {
///     // Tree sum over shared memory; the threads that skip the add still meet the barrier.
///     let sh = arch::dynamic_shared_mem::<u32>();
///     let t = arch::thread_idx_x();
///     // SAFETY: shared memory holds a word per thread.
///     unsafe { sh.add(t).write(t as u32) };
///     let mut half = arch::block_dim_x() / 2;
///     while half > 0 {
///         arch::sync_threads();
///         if t < half {
///             // SAFETY: words `t` and `t + half`, written before the barrier; only `t` writes `t`.
///             unsafe { sh.add(t).write(sh.add(t).read() + sh.add(t + half).read()) };
///         }
///         half /= 2;
///     }
///     if t == 0 {
///         // SAFETY: one thread writes the one word.
///         unsafe { out.write(sh.read()) };
///     }
/// }
/// let spec = LaunchSpec { name: "ex", grid: [1, 1, 1], block: [64, 1, 1], shared_mem_bytes: 64 * 4,
///     timeout: Duration::from_secs(10) };
/// let mut sum = 0u32;
/// // SAFETY: `sum` outlives the launch.
/// unsafe { emulator::launch(&spec, kernel, (&raw mut sum,)) }.unwrap();
/// assert_eq!(sum, (0..64).sum::<u32>());
/// ```
#[inline(always)]
pub fn sync_threads() {
    imp::sync_threads()
}

/// [`sync_threads`] for callers whose warps arrive converged: `bar.sync 0`
/// (= `barrier.sync.aligned`), cheaper than the non-aligned form. Every lane of a warp must
/// reach it together; otherwise use [`sync_threads`].
///
/// ```
/// # use ferrolink_device::arch;
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// unsafe fn kernel((out,): (*mut u32,)) {
///     let sh = arch::dynamic_shared_mem::<u32>();
///     let (t, n) = (arch::thread_idx_x(), arch::block_dim_x());
///     // SAFETY: shared memory holds a word per thread; each thread writes its own.
///     unsafe { sh.add(t).write(t as u32) };
///     // No branch before it: every warp arrives converged.
///     arch::sync_threads_converged();
///     // SAFETY: reads a word written before the barrier; one output word per thread.
///     unsafe { *out.add(t) = sh.add(n - 1 - t).read() };
/// }
/// let spec = LaunchSpec { name: "ex", grid: [1, 1, 1], block: [64, 1, 1], shared_mem_bytes: 64 * 4,
///     timeout: Duration::from_secs(10) };
/// let mut out = vec![0u32; 64];
/// // SAFETY: `out` has a word for every thread and outlives the launch.
/// unsafe { emulator::launch(&spec, kernel, (out.as_mut_ptr(),)) }.unwrap();
/// assert_eq!(out, (0..64).rev().collect::<Vec<u32>>());
/// ```
#[inline(always)]
pub fn sync_threads_converged() {
    imp::sync_threads_converged()
}

/// [`sync_threads`] that also reduces a predicate: returns whether `pred` was true in any
/// thread of the CTA (`barrier.red.or.pred`, CUDA's `__syncthreads_or`).
///
/// ```
/// # use ferrolink_device::arch;
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// unsafe fn kernel((out,): (*mut bool,)) {
///     let t = arch::thread_idx_x();
///     // Only thread 37 sees a problem; every thread learns of it.
///     let any = arch::sync_threads_or(t == 37);
///     let none = !arch::sync_threads_or(false);
///     // SAFETY: one word per thread.
///     unsafe { *out.add(t) = any && none };
/// }
/// let spec = LaunchSpec { name: "ex", grid: [1, 1, 1], block: [64, 1, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// let mut out = vec![false; 64];
/// // SAFETY: `out` has a word for every thread and outlives the launch.
/// unsafe { emulator::launch(&spec, kernel, (out.as_mut_ptr(),)) }.unwrap();
/// assert!(out.iter().all(|&ok| ok));
/// ```
#[inline(always)]
pub fn sync_threads_or(pred: bool) -> bool {
    imp::sync_threads_or(pred)
}

/// A hint inside a spin-wait loop. On the GPU it is `nanosleep.u32 ns` (the SM may
/// run other warps meanwhile); on the emulator it yields the host thread and checks the
/// launch's timeout, so a spin that can never end becomes an error rather than a hang.
///
/// ```
/// # use ferrolink_device::arch;
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// use ferrolink_device::arch::atomic::{self, LoadOrder, Scope, StoreOrder};
/// unsafe fn kernel((data, flag): (*mut u32, *mut u32)) {
///     if arch::block_idx_x() == 0 {
///         // SAFETY: `data` is read only after the release below; `flag` is only accessed
///         // atomically.
///         unsafe {
///             data.write(42);
///             atomic::store(flag, 1, StoreOrder::Release, Scope::Gpu);
///         }
///     } else {
///         // SAFETY: as above.
///         while unsafe { atomic::load(flag, LoadOrder::Acquire, Scope::Gpu) } == 0 {
///             arch::spin_wait_hint(32);
///         }
///         // SAFETY: the acquire above saw the release after the write.
///         assert_eq!(unsafe { data.read() }, 42);
///     }
/// }
/// let spec = LaunchSpec { name: "ex", grid: [2, 1, 1], block: [1, 1, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// let (mut data, mut flag) = (0u32, 0u32);
/// // SAFETY: both words outlive the launch.
/// unsafe { emulator::launch(&spec, kernel, (&raw mut data, &raw mut flag)) }.unwrap();
/// ```
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
/// ```
/// # use ferrolink_device::arch;
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// # use ferrolink_device::emulator::DeviceGraphLauncher;
/// # use std::sync::{Arc, Mutex};
/// use ferrolink_device::GraphLaunchMode;
/// // On the emulator the host's CPU backend stands for the device runtime; this one records.
/// # struct Recorder(Mutex<Vec<(u64, u64)>>);
/// # impl DeviceGraphLauncher for Recorder {
/// #     fn launch(&self, exec: u64, stream: u64) -> u32 {
/// #         self.0.lock().unwrap().push((exec, stream));
/// #         0
/// #     }
/// # }
/// unsafe fn kernel((exec,): (u64,)) {
///     if arch::thread_idx_x() == 0 {
///         // SAFETY: `exec` names a graph of the recording launcher below.
///         let code = unsafe { arch::launch_graph(exec, GraphLaunchMode::Tail.stream()) };
///         assert_eq!(code, 0);
///     }
/// }
/// let spec = LaunchSpec { name: "ex", grid: [1, 1, 1], block: [32, 1, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// let recorder = Arc::new(Recorder(Mutex::new(Vec::new())));
/// // SAFETY: the kernel takes no pointers.
/// emulator::with_graph_launcher(recorder.clone(), || unsafe { emulator::launch(&spec, kernel, (7,)) })
///     .unwrap();
/// assert_eq!(*recorder.0.lock().unwrap(), [(7, GraphLaunchMode::Tail.stream())]);
/// ```
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
///
/// ```
/// # use ferrolink_device::arch;
/// # use ferrolink_device::emulator::{self, LaunchSpec};
/// # use std::time::Duration;
/// use ferrolink_device::emulator::EmuError;
/// unsafe fn kernel((n, limit): (u32, u32)) {
///     if n > limit {
///         arch::trap();
///     }
/// }
/// let spec = LaunchSpec { name: "checked", grid: [1, 1, 1], block: [4, 1, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// // SAFETY: the kernel takes no pointers.
/// unsafe { emulator::launch(&spec, kernel, (3, 4)) }.unwrap();
/// // SAFETY: as above.
/// let err = unsafe { emulator::launch(&spec, kernel, (5, 4)) }.unwrap_err();
/// assert!(matches!(err, EmuError::Trapped { kernel: "checked", .. }));
/// ```
#[inline(always)]
pub fn trap() -> ! {
    imp::trap()
}
