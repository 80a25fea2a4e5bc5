//! The CPU emulator: runs kernels written with [`crate::kernel!`] on host threads.
//!
//! # Execution model
//! A launch of `grid × block` threads runs every emulated GPU thread as its own OS thread,
//! all at once. So all CTAs of a launch — and of launches running concurrently on other
//! streams, one per rank — are co-resident, and cross-CTA and cross-rank spin-waits make
//! progress. Spin-waits yield: every emulated atomic load and [`crate::arch::nanosleep`]
//! polls the launch, yielding the host thread every few calls, so two host cores suffice.
//!
//! * CTA barrier ([`crate::arch::sync_threads`]): all live threads of the CTA meet;
//!   exited threads count as arrived.
//! * Warp operations: the lanes named in `mask` (and present in the warp) meet, exchange
//!   values, and leave together. A partial last warp has only its present lanes.
//! * Dynamic shared memory: one zeroed, 16-byte aligned allocation per CTA, which all its
//!   threads read and write through raw pointers (it is never reached through a reference).
//! * Memory model: host atomics with at least the requested ordering; scopes are ignored
//!   (every scope behaves like `.sys`). x86-64 is stronger than the GPU, so a missing
//!   fence that would break on the GPU may pass here — the GPU runs stay necessary.
//!
//! # Hang safety
//! Every blocking point (CTA barrier, warp rendezvous, atomic polling) checks the launch's
//! deadline. When it passes, the launch is aborted: all its threads unwind and
//! [`launch`] returns [`EmuError::Timeout`] naming the kernel. A panic or `trap` in one
//! thread aborts the others the same way.
//!
//! # A failed launch makes no further effects visible
//! Once a launch has recorded a failure (panic, trap or timeout), none of its threads
//! performs another effect through the emulator's memory primitives: every atomic store,
//! read-modify-write (`fetch_add`, `swap`, `compare_swap`, `fetch_max`, `red_add`) and fence
//! first checks the launch's status (one relaxed load) and unwinds
//! the thread instead, and a thread released from a CTA barrier or a warp rendezvous checks
//! it before going on. So the other threads of a CTA, released from a barrier because a
//! thread that failed counts as arrived, cannot raise a flag that a concurrently running
//! launch (another rank's kernel) polls. A thread that is already unwinding (its own panic,
//! or an abort, running destructors) cannot unwind again: its atomic stores and reductions
//! are skipped and its read-modify-writes only read. Plain (non-atomic) stores in kernel
//! code are not intercepted; ferrolink's cross-rank protocols all signal through the
//! checked primitives.
//!
//! # Limits
//! See [`Limits`]: at most 1024 threads per CTA (as on the GPU), at most
//! [`Limits::max_threads_per_launch`] threads in a launch (OS threads are the cost), shared
//! memory up to 227 KiB per CTA. Larger launches are rejected with
//! [`EmuError::InvalidLaunch`] before anything runs.

use crate::kernel::KernelArgs;
use core::fmt;
use core::ptr::NonNull;
use core::sync::atomic::{AtomicU8, Ordering};
use std::alloc::{self, Layout};
use std::boxed::Box;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::string::{String, ToString};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};
use std::vec::Vec;
use std::{format, thread};

/// Shape and limits of one emulated launch.
///
/// ```
/// use ferrolink_device::emulator::{self, LaunchSpec};
/// let spec = LaunchSpec { name: "reduce", grid: [4, 1, 1], block: [256, 1, 1], shared_mem_bytes: 1024,
///     timeout: emulator::default_timeout() };
/// assert!(emulator::validate(&spec).is_ok());
/// ```
#[derive(Clone, Debug)]
pub struct LaunchSpec {
    /// Kernel name, used in errors.
    pub name: &'static str,
    /// CTAs per axis (x, y, z).
    pub grid: [u32; 3],
    /// Threads per CTA per axis (x, y, z).
    pub block: [u32; 3],
    /// Bytes of dynamic shared memory per CTA.
    pub shared_mem_bytes: usize,
    /// The launch fails with [`EmuError::Timeout`] if it has not finished after this long.
    pub timeout: Duration,
}

/// What the emulator accepts.
///
/// ```
/// use ferrolink_device::emulator::Limits;
/// let limits = Limits::current();
/// assert_eq!(limits.max_threads_per_block, 1024);
/// assert_eq!(limits.max_shared_mem_bytes, 227 * 1024);
/// ```
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Threads per CTA (the GPU's limit, 1024).
    pub max_threads_per_block: usize,
    /// Threads per launch: each is an OS thread.
    pub max_threads_per_launch: usize,
    /// Dynamic shared memory per CTA (the H100/H200 opt-in maximum, 227 KiB).
    pub max_shared_mem_bytes: usize,
}

impl Limits {
    /// The limits in force: the defaults, with `FERROLINK_EMU_MAX_THREADS` overriding
    /// `max_threads_per_launch` (default 16384).
    ///
    /// ```
    /// use ferrolink_device::emulator::{self, Limits, LaunchSpec};
    /// let limits = Limits::current();
    /// // The largest CTA, with the most shared memory, is accepted.
    /// let spec = LaunchSpec { name: "k", grid: [1, 1, 1], block: [limits.max_threads_per_block as u32, 1, 1],
    ///     shared_mem_bytes: limits.max_shared_mem_bytes, timeout: emulator::default_timeout() };
    /// assert!(emulator::validate(&spec).is_ok());
    /// ```
    pub fn current() -> Limits {
        let max_threads_per_launch =
            std::env::var("FERROLINK_EMU_MAX_THREADS").ok().and_then(|v| v.parse().ok()).unwrap_or(16384);
        Limits { max_threads_per_block: 1024, max_threads_per_launch, max_shared_mem_bytes: 227 * 1024 }
    }
}

/// Why an emulated launch failed.
///
/// ```
/// use ferrolink_device::arch::{self, atomic::{self, LoadOrder, Scope}};
/// use ferrolink_device::emulator::{self, EmuError, LaunchSpec};
/// use std::time::Duration;
/// unsafe fn wait((flag,): (*const u32,)) {
///     // Nobody ever raises the flag: on a GPU this would hang.
///     // SAFETY: `flag` is a live word, accessed only atomically.
///     while unsafe { atomic::load(flag, LoadOrder::Acquire, Scope::Gpu) } == 0 {
///         arch::spin_wait_hint(100);
///     }
/// }
/// let spec = LaunchSpec { name: "wait", grid: [1, 1, 1], block: [1, 1, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_millis(200) };
/// let flag = 0u32;
/// // SAFETY: `flag` outlives the launch.
/// let err = unsafe { emulator::launch(&spec, wait, (&raw const flag,)) }.unwrap_err();
/// assert!(matches!(err, EmuError::Timeout { kernel: "wait", .. }));
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EmuError {
    /// The launch shape is outside [`Limits`] or empty; nothing ran.
    InvalidLaunch {
        /// Kernel name.
        kernel: &'static str,
        /// What was wrong.
        reason: String,
    },
    /// The launch did not finish within its timeout (a deadlock or a lost signal).
    Timeout {
        /// Kernel name.
        kernel: &'static str,
        /// The timeout that passed.
        after: Duration,
        /// Where the first thread to notice was blocked.
        blocked_in: &'static str,
    },
    /// A thread of the kernel panicked (on the GPU this would be a fault or a trap).
    Panicked {
        /// Kernel name.
        kernel: &'static str,
        /// The thread (block and thread index, x axis first).
        thread: String,
        /// The panic message.
        message: String,
    },
    /// A thread called [`crate::arch::trap`].
    Trapped {
        /// Kernel name.
        kernel: &'static str,
        /// The thread.
        thread: String,
    },
}

impl fmt::Display for EmuError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EmuError::InvalidLaunch { kernel, reason } => {
                write!(f, "emulator rejected launch of `{kernel}`: {reason}")
            }
            EmuError::Timeout { kernel, after, blocked_in } => write!(
                f,
                "kernel `{kernel}` did not finish within {after:?} on the CPU emulator (a thread \
                 was blocked in {blocked_in}): a deadlock, a barrier some thread never reaches, or a \
                 signal never sent. Raise the limit with FERROLINK_EMU_TIMEOUT_MS if the kernel is \
                 merely slow."
            ),
            EmuError::Panicked { kernel, thread, message } => {
                write!(f, "kernel `{kernel}` panicked in thread {thread}: {message}")
            }
            EmuError::Trapped { kernel, thread } => {
                write!(f, "kernel `{kernel}` executed trap in thread {thread}")
            }
        }
    }
}

impl std::error::Error for EmuError {}

/// Checks a launch shape against [`Limits::current`] without running anything.
///
/// ```
/// use ferrolink_device::emulator::{self, EmuError, LaunchSpec};
/// let spec = LaunchSpec { name: "big", grid: [1, 1, 1], block: [2048, 1, 1], shared_mem_bytes: 0,
///     timeout: emulator::default_timeout() };
/// assert!(matches!(emulator::validate(&spec), Err(EmuError::InvalidLaunch { kernel: "big", .. })));
/// let spec = LaunchSpec { block: [1024, 1, 1], ..spec };
/// assert!(emulator::validate(&spec).is_ok());
/// ```
pub fn validate(spec: &LaunchSpec) -> Result<(), EmuError> {
    let limits = Limits::current();
    let invalid = |reason: String| Err(EmuError::InvalidLaunch { kernel: spec.name, reason });
    let block: usize = spec.block.iter().map(|&d| d as usize).product();
    let ctas: usize = spec.grid.iter().map(|&d| d as usize).product();
    if block == 0 || ctas == 0 {
        return invalid(format!("empty launch: grid {:?}, block {:?}", spec.grid, spec.block));
    }
    if block > limits.max_threads_per_block {
        return invalid(format!("{block} threads per CTA exceeds the limit of {}", limits.max_threads_per_block));
    }
    let total = block.saturating_mul(ctas);
    if total > limits.max_threads_per_launch {
        return invalid(format!(
            "{total} threads ({ctas} CTAs x {block}) exceed the emulator's limit of {} per launch \
             (each emulated thread is an OS thread); use fewer CTAs or raise \
             FERROLINK_EMU_MAX_THREADS",
            limits.max_threads_per_launch
        ));
    }
    if spec.shared_mem_bytes > limits.max_shared_mem_bytes {
        return invalid(format!(
            "{} bytes of dynamic shared memory exceed the limit of {}",
            spec.shared_mem_bytes, limits.max_shared_mem_bytes
        ));
    }
    Ok(())
}

/// The default launch timeout: `FERROLINK_EMU_TIMEOUT_MS`, else 120 s.
///
/// ```
/// use ferrolink_device::emulator::{self, LaunchSpec};
/// let spec = LaunchSpec { name: "k", grid: [1, 1, 1], block: [32, 1, 1], shared_mem_bytes: 0,
///     timeout: emulator::default_timeout() };
/// assert!(!spec.timeout.is_zero());
/// ```
pub fn default_timeout() -> Duration {
    std::env::var("FERROLINK_EMU_TIMEOUT_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .map(Duration::from_millis)
        .unwrap_or(Duration::from_secs(120))
}

// ---- launch-wide state -----------------------------------------------------------------

const RUNNING: u8 = 0;
const ABORT_TIMEOUT: u8 = 1;
const ABORT_PANIC: u8 = 2;
const ABORT_TRAP: u8 = 3;

struct LaunchState {
    name: &'static str,
    status: AtomicU8,
    deadline: Instant,
    timeout: Duration,
    first_error: Mutex<Option<EmuError>>,
    /// Runs the graphs its threads launch ([`DeviceGraphLauncher`]): set when the launching
    /// thread runs a graph's work ([`with_graph_launcher`]).
    graphs: Option<Arc<dyn DeviceGraphLauncher>>,
}

/// Unwinds an emulated thread out of its kernel after the launch was aborted.
struct AbortToken;

impl LaunchState {
    fn record(&self, err: EmuError, status: u8) {
        let mut first = lock(&self.first_error);
        if first.is_none() {
            *first = Some(err);
        }
        drop(first);
        let _ = self.status.compare_exchange(RUNNING, status, Ordering::SeqCst, Ordering::SeqCst);
    }

    /// Whether a failure has been recorded.
    fn failed(&self) -> bool {
        self.status.load(Ordering::Relaxed) != RUNNING
    }

    /// Unwinds this thread if the launch has failed (unless it is already unwinding). Called
    /// on leaving a rendezvous: a thread released because a failed thread counted as arrived
    /// must not go on.
    fn stop_if_failed(&self) {
        if self.failed() && may_abort() {
            abort_thread();
        }
    }

    /// `Err` if this thread must stop: the launch was aborted or its deadline passed.
    fn check(&self, blocked_in: &'static str) -> Result<(), AbortToken> {
        if self.failed() {
            return Err(AbortToken);
        }
        if Instant::now() >= self.deadline {
            self.record(EmuError::Timeout { kernel: self.name, after: self.timeout, blocked_in }, ABORT_TIMEOUT);
            return Err(AbortToken);
        }
        Ok(())
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A poisoned lock only means another emulated thread unwound while holding it; the
    // launch is being aborted anyway and the data stays consistent for reading errors.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn abort_thread() -> ! {
    // `resume_unwind` skips the panic hook: aborted threads print nothing.
    std::panic::resume_unwind(Box::new(AbortToken))
}

/// Whether this thread may unwind now: not while it is already unwinding (a `Drop` in the
/// kernel that polls would otherwise cause a double panic, aborting the process).
fn may_abort() -> bool {
    !std::thread::panicking()
}

// ---- rendezvous: CTA barrier and warp exchange -----------------------------------------

#[derive(Default)]
struct Round {
    expected: u32,
    arrived: u32,
    generation: u64,
    values: [u64; 32],
    snapshot: [u64; 32],
    present: u32,
    any: bool,
    any_result: bool,
}

impl Round {
    fn complete(&mut self) {
        self.snapshot = self.values;
        self.any_result = core::mem::take(&mut self.any);
        self.arrived = 0;
        self.generation = self.generation.wrapping_add(1);
    }
}

const WAIT_SLICE: Duration = Duration::from_millis(10);

/// Blocks until `round` (selected from the guard by `pick`) leaves generation `generation_seen`.
fn wait_generation<'a, T>(
    cv: &Condvar,
    mut guard: MutexGuard<'a, T>,
    generation_seen: u64,
    pick: impl Fn(&mut T) -> &mut Round,
    launch: &LaunchState,
    what: &'static str,
) -> MutexGuard<'a, T> {
    while pick(&mut guard).generation == generation_seen {
        guard = cv.wait_timeout(guard, WAIT_SLICE).unwrap_or_else(|e| e.into_inner()).0;
        if pick(&mut guard).generation != generation_seen {
            break;
        }
        if launch.check(what).is_err() && may_abort() {
            drop(guard);
            abort_thread();
        }
    }
    guard
}

struct Cta {
    barrier: Mutex<Round>,
    barrier_cv: Condvar,
    warps: Vec<Warp>,
    shared: SharedMem,
}

/// A CTA's dynamic shared memory: one zeroed, 16-byte aligned heap allocation owned by the
/// [`Cta`]. Every thread of the CTA reads and writes it through copies of the raw pointer
/// that [`alloc::alloc_zeroed`] returned, which carries write permission for the whole
/// allocation; no reference to the bytes is ever created, so writes through those copies
/// do not go through a shared reference (as they did when the buffer was a `Box<[u128]>`
/// reached through `Arc<Cta>`).
struct SharedMem {
    ptr: NonNull<u8>,
    /// `None` for an empty buffer: `ptr` is then dangling (aligned, never dereferenced).
    layout: Option<Layout>,
}

// SAFETY: `SharedMem` owns its allocation (like a `Box<[u8]>`) and itself only hands out
// the raw pointer; accesses through it are the kernel's, synchronized (or racy) exactly as
// shared memory on the GPU, under `launch`'s contract.
unsafe impl Send for SharedMem {}
// SAFETY: as above: `&SharedMem` only gives out the pointer, never a reference to the bytes.
unsafe impl Sync for SharedMem {}

impl SharedMem {
    fn new(bytes: usize) -> SharedMem {
        if bytes == 0 {
            return SharedMem { ptr: NonNull::<u128>::dangling().cast(), layout: None };
        }
        let layout = Layout::from_size_align(bytes.next_multiple_of(16), 16)
            .expect("shared memory size was validated against Limits (at most 227 KiB)");
        // SAFETY: `layout` has a non-zero size.
        let p = unsafe { alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(p) else { alloc::handle_alloc_error(layout) };
        SharedMem { ptr, layout: Some(layout) }
    }

    fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for SharedMem {
    fn drop(&mut self) {
        if let Some(layout) = self.layout {
            // SAFETY: `ptr` came from `alloc_zeroed(layout)` and is freed only here. The CTA
            // is dropped when the last `Arc<Cta>` goes, after every one of its threads has
            // finished, so no kernel still uses the pointer.
            unsafe { alloc::dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

struct Warp {
    /// Lanes that exist in this warp (a partial last warp has fewer than 32).
    present: u32,
    state: Mutex<WarpState>,
    cv: Condvar,
}

/// A warp's lanes that have not exited, and its open rendezvous, keyed by the caller's mask.
/// One lock for both, so an exiting lane can release the rounds that were waiting for it.
#[derive(Default)]
struct WarpState {
    alive: u32,
    rounds: HashMap<u32, Round>,
}

impl Cta {
    fn new(threads: u32, shared_bytes: usize) -> Cta {
        let warps = threads.div_ceil(32);
        let warps = (0..warps)
            .map(|w| {
                let lanes = (threads - w * 32).min(32);
                let present = if lanes == 32 { u32::MAX } else { (1u32 << lanes) - 1 };
                Warp {
                    present,
                    state: Mutex::new(WarpState { alive: present, rounds: HashMap::new() }),
                    cv: Condvar::new(),
                }
            })
            .collect();
        Cta {
            barrier: Mutex::new(Round { expected: threads, ..Round::default() }),
            barrier_cv: Condvar::new(),
            warps,
            shared: SharedMem::new(shared_bytes),
        }
    }

    /// The CTA barrier; returns whether any thread arrived with `pred` set. A thread of a
    /// failed launch does not pass it (it unwinds, on arriving or on being released).
    fn sync(&self, pred: bool, launch: &LaunchState) -> bool {
        launch.stop_if_failed();
        let any = self.rendezvous(pred, launch);
        // Released, perhaps because a thread that failed counted as arrived: its failure was
        // recorded before its exit released us (and the barrier lock orders the two).
        launch.stop_if_failed();
        any
    }

    fn rendezvous(&self, pred: bool, launch: &LaunchState) -> bool {
        let mut r = lock(&self.barrier);
        r.arrived += 1;
        r.any |= pred;
        if r.arrived >= r.expected {
            r.complete();
            self.barrier_cv.notify_all();
            return r.any_result;
        }
        let generation_seen = r.generation;
        wait_generation(&self.barrier_cv, r, generation_seen, |r| r, launch, "a CTA barrier (sync_threads)").any_result
    }

    fn thread_exited(&self, warp: usize, lane: u32) {
        let mut r = lock(&self.barrier);
        r.expected -= 1;
        if r.arrived > 0 && r.arrived >= r.expected {
            r.complete();
            self.barrier_cv.notify_all();
        }
        drop(r);
        self.warps[warp].lane_exited(lane);
    }
}

impl Warp {
    /// All lanes in `mask` that have not exited deposit `value`; each gets every lane's
    /// value. Returns the values and the mask of lanes that took part. As on the GPU, lanes of
    /// `mask` that exited do not take part (and a lane exiting while others wait releases them).
    /// A lane of a failed launch does not pass it (it unwinds, on arriving or on being released).
    fn exchange(&self, mask: u32, lane: u32, value: u64, launch: &LaunchState) -> ([u64; 32], u32) {
        if mask & self.present & (1 << lane) == 0 {
            panic!(
                "warp operation with mask {mask:#010x} called by lane {lane}, which is not in the \
                 mask (undefined behaviour on the GPU)"
            );
        }
        launch.stop_if_failed();
        let result = self.rendezvous(mask, lane, value, launch);
        // As in `Cta::sync`: released perhaps by a failed lane's exit, recorded before it.
        launch.stop_if_failed();
        result
    }

    fn rendezvous(&self, mask: u32, lane: u32, value: u64, launch: &LaunchState) -> ([u64; 32], u32) {
        let mut st = lock(&self.state);
        let alive = st.alive;
        let r = st.rounds.entry(mask).or_default();
        r.values[lane as usize] = value;
        r.arrived += 1;
        r.present = mask & alive;
        r.expected = r.present.count_ones();
        if r.arrived >= r.expected {
            r.complete();
            self.cv.notify_all();
            return (r.snapshot, r.present);
        }
        let generation_seen = r.generation;
        let mut st = wait_generation(
            &self.cv,
            st,
            generation_seen,
            |w| w.rounds.get_mut(&mask).expect("round exists while waited on"),
            launch,
            "a warp operation (shfl/ballot/sync_warp)",
        );
        let r = st.rounds.get_mut(&mask).expect("round exists");
        (r.snapshot, r.present)
    }

    /// Removes `lane` from the live lanes and completes any open round now complete without it.
    fn lane_exited(&self, lane: u32) {
        let mut st = lock(&self.state);
        st.alive &= !(1 << lane);
        let alive = st.alive;
        let mut released = false;
        for (mask, r) in st.rounds.iter_mut() {
            if r.arrived > 0 && mask & (1 << lane) != 0 {
                r.present = mask & alive;
                r.expected = r.present.count_ones();
                if r.arrived >= r.expected {
                    r.complete();
                    released = true;
                }
            }
        }
        if released {
            self.cv.notify_all();
        }
    }

    fn alive(&self) -> u32 {
        lock(&self.state).alive
    }
}

// ---- per-thread context ----------------------------------------------------------------

pub(crate) struct ThreadCtx {
    pub(crate) tid: [u32; 3],
    pub(crate) ntid: [u32; 3],
    pub(crate) ctaid: [u32; 3],
    pub(crate) nctaid: [u32; 3],
    pub(crate) lane: u32,
    warp: usize,
    cta: Arc<Cta>,
    launch: Arc<LaunchState>,
}

std::thread_local! {
    static CTX: RefCell<Option<ThreadCtx>> = const { RefCell::new(None) };
    static GRAPH_LAUNCHER: RefCell<Option<Arc<dyn DeviceGraphLauncher>>> = const { RefCell::new(None) };
    static POLLS: Cell<u32> = const { Cell::new(0) };
    /// Set while this thread writes a device fault record ([`RecordingFault`]).
    static RECORDING_FAULT: Cell<bool> = const { Cell::new(false) };
}

pub(crate) fn with_ctx<R>(f: impl FnOnce(&ThreadCtx) -> R) -> R {
    CTX.with_borrow(|c| {
        f(c.as_ref().expect(
            "a ferrolink-device arch function that needs a thread context was called outside a \
             kernel launch: on the host, kernels run through the emulator (ferrolink's CPU backend)",
        ))
    })
}

fn thread_label(c: &ThreadCtx) -> String {
    format!("block {:?} thread {:?}", c.ctaid, c.tid)
}

pub(crate) fn sync_threads() {
    with_ctx(|c| c.cta.sync(false, &c.launch));
}

pub(crate) fn sync_threads_or(pred: bool) -> bool {
    with_ctx(|c| c.cta.sync(pred, &c.launch))
}

pub(crate) fn warp_exchange(mask: u32, value: u64) -> ([u64; 32], u32) {
    with_ctx(|c| c.cta.warps[c.warp].exchange(mask, c.lane, value, &c.launch))
}

pub(crate) fn active_mask() -> u32 {
    with_ctx(|c| c.cta.warps[c.warp].alive())
}

pub(crate) fn dynamic_shared_mem() -> *mut u8 {
    with_ctx(|c| c.cta.shared.as_ptr())
}

/// Called by every emulated atomic effect (atomic store, read-modify-write, reduction, fence)
/// before it is performed: whether to perform it. (Vector and plain stores are data, not
/// signals, and are not checked.)
///
/// * Outside a launch, or in a launch still running: `true`.
/// * In a launch that has recorded a failure: the thread unwinds (it never returns).
/// * In a thread that is already unwinding (its destructors are running; it cannot unwind
///   again without aborting the process): `false`, and the caller skips the effect (a store
///   or reduction does nothing, a read-modify-write only reads). Such a thread is ending its
///   launch in failure: an abort, or its own panic, which the emulator records when the
///   unwind reaches the thread's entry.
pub(crate) fn effect_allowed() -> bool {
    let failed = CTX.with_borrow(|c| c.as_ref().map(|c| c.launch.failed()));
    match failed {
        None => true,
        Some(failed) => {
            if !may_abort() {
                return false;
            }
            if failed && !RECORDING_FAULT.get() {
                abort_thread();
            }
            true
        }
    }
}

/// While it lives, this thread's stores of a device fault record (`DevComm::fail`, after it
/// claimed the record) run even if another thread of the launch has trapped: the threads that
/// lost the claim trap at once, and stopping the claimer between its stores left the host a
/// bare trap with no record to explain it (seen in CI as a flaky
/// `barrier_index_outside_its_set_is_a_reported_error`).
pub(crate) struct RecordingFault(());

impl RecordingFault {
    /// Marks this thread as writing a fault record until the value is dropped.
    pub(crate) fn start() -> RecordingFault {
        RECORDING_FAULT.set(true);
        RecordingFault(())
    }
}

impl Drop for RecordingFault {
    fn drop(&mut self) {
        RECORDING_FAULT.set(false);
    }
}

/// Called at every emulated spin point: yields the host thread now and then and aborts
/// the thread if the launch timed out or failed. Outside a launch it does nothing.
pub(crate) fn poll(what: &'static str) {
    let n = POLLS.get().wrapping_add(1);
    POLLS.set(n);
    if !n.is_multiple_of(16) {
        return;
    }
    thread::yield_now();
    let abort = CTX.with_borrow(|c| c.as_ref().map(|c| c.launch.check(what).is_err()));
    if abort == Some(true) && may_abort() {
        abort_thread();
    }
}

pub(crate) fn trap() -> ! {
    with_ctx(|c| c.launch.record(EmuError::Trapped { kernel: c.launch.name, thread: thread_label(c) }, ABORT_TRAP));
    abort_thread()
}

/// Nanoseconds since the emulator's epoch (first use in this process).
pub(crate) fn now_ns() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

// ---- device graph launch ---------------------------------------------------------------

/// What runs the graphs that emulated kernels launch ([`crate::graph::DeviceGraph::launch`]),
/// as the CUDA device runtime does on a GPU: the host's CPU backend gives one to the kernels
/// of each graph it runs ([`with_graph_launcher`]). Kernels launched outside a graph have
/// none, and their graph launches fail with `cudaErrorInvalidValue` (on a GPU such a kernel
/// cannot be launched at all, and the host refuses it before it gets here).
///
/// ```
/// use ferrolink_device::emulator::{self, DeviceGraphLauncher, LaunchSpec};
/// use ferrolink_device::{arch, DeviceGraph, GraphLaunchMode};
/// use std::sync::{Arc, Mutex};
/// # use std::time::Duration;
/// /// Records the launches instead of running graphs.
/// struct Recorder(Mutex<Vec<(u64, u64)>>);
/// impl DeviceGraphLauncher for Recorder {
///     fn launch(&self, exec: u64, stream: u64) -> u32 {
///         self.0.lock().unwrap().push((exec, stream));
///         0
///     }
/// }
/// unsafe fn kernel((graph,): (DeviceGraph,)) {
///     if arch::thread_idx_x() == 0 {
///         // SAFETY: on the emulator `graph` names one of the recorder's graphs.
///         unsafe { graph.launch(GraphLaunchMode::FireAndForget) }.unwrap();
///     }
/// }
/// let spec = LaunchSpec { name: "ex", grid: [1, 1, 1], block: [32, 1, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// let recorder = Arc::new(Recorder(Mutex::new(Vec::new())));
/// emulator::with_graph_launcher(recorder.clone(), || {
///     // SAFETY: the kernel takes no pointers.
///     unsafe { emulator::launch(&spec, kernel, (DeviceGraph { exec: 7 },)) }
/// })
/// .unwrap();
/// assert_eq!(*recorder.0.lock().unwrap(), [(7, GraphLaunchMode::FireAndForget.stream())]);
/// ```
pub trait DeviceGraphLauncher: Send + Sync {
    /// Launches the graph `exec` into the device runtime's graph launch stream `stream`;
    /// returns the CUDA error code (0: launched).
    fn launch(&self, exec: u64, stream: u64) -> u32;
}

/// Runs `f` (which runs launches on this thread) with `launcher` running the graphs that its
/// launches' kernels launch; the previous launcher is back afterwards, even if `f` panics.
///
/// ```
/// use ferrolink_device::emulator::{self, DeviceGraphLauncher, LaunchSpec};
/// use ferrolink_device::{arch, DeviceGraph, GraphLaunchError, GraphLaunchMode};
/// use std::sync::Arc;
/// # use std::time::Duration;
/// struct Accept;
/// impl DeviceGraphLauncher for Accept {
///     fn launch(&self, _exec: u64, _stream: u64) -> u32 {
///         0
///     }
/// }
/// unsafe fn kernel((graph, code): (DeviceGraph, *mut u32)) {
///     if arch::thread_idx_x() == 0 {
///         // SAFETY: `graph` names a graph of the launcher (if any); `code` is a live word.
///         unsafe { code.write(graph.launch(GraphLaunchMode::Tail).err().map_or(0, |e| e.code)) };
///     }
/// }
/// let spec = LaunchSpec { name: "ex", grid: [1, 1, 1], block: [1, 1, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// let (graph, mut code) = (DeviceGraph { exec: 3 }, u32::MAX);
/// // SAFETY: `code` outlives the launches.
/// emulator::with_graph_launcher(Arc::new(Accept), || unsafe {
///     emulator::launch(&spec, kernel, (graph, &raw mut code))
/// })
/// .unwrap();
/// assert_eq!(code, 0);
/// // Outside, no launcher runs the graph: the launch is refused.
/// // SAFETY: as above.
/// unsafe { emulator::launch(&spec, kernel, (graph, &raw mut code)) }.unwrap();
/// assert_eq!(code, GraphLaunchError::INVALID_VALUE);
/// ```
pub fn with_graph_launcher<R>(launcher: Arc<dyn DeviceGraphLauncher>, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<Arc<dyn DeviceGraphLauncher>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            GRAPH_LAUNCHER.set(self.0.take());
        }
    }
    let _restore = Restore(GRAPH_LAUNCHER.replace(Some(launcher)));
    f()
}

/// A graph launch by an emulated thread ([`crate::arch::launch_graph`]). A launch that has
/// failed launches nothing (the thread unwinds, as at any other effect).
pub(crate) fn launch_graph(exec: u64, stream: u64) -> u32 {
    if !effect_allowed() {
        return crate::graph::GraphLaunchError::INVALID_VALUE;
    }
    match with_ctx(|c| c.launch.graphs.clone()) {
        Some(launcher) => launcher.launch(exec, stream),
        None => crate::graph::GraphLaunchError::INVALID_VALUE,
    }
}

// ---- launch ----------------------------------------------------------------------------

struct SendArgs<A: KernelArgs>(A);
// SAFETY: `A` is a tuple of `KernelParam`s, which that unsafe trait requires to be plain
// values and device addresses that every thread of a launch may copy at once; what the
// kernel does through the addresses is `launch`'s caller's contract.
unsafe impl<A: KernelArgs> Send for SendArgs<A> {}
// SAFETY: as above; the threads only copy the arguments.
unsafe impl<A: KernelArgs> Sync for SendArgs<A> {}

/// Stack size of an emulated thread. Kernels use little stack when optimized, but the
/// collectives' kernel (every type and reduction inlined into one body) needs more than 256
/// KiB unoptimized. Reserved, not committed: untouched pages cost nothing.
const EMULATED_THREAD_STACK: usize = 2 * 1024 * 1024;

/// Runs `entry(args)` on `spec.grid × spec.block` emulated threads and waits for all of them.
///
/// The arguments are [`KernelArgs`]: a tuple of plain data and device addresses, which every
/// emulated thread copies. A pointer to a host [`AtomicU32`](core::sync::atomic::AtomicU32)
/// is such an argument:
///
/// ```
/// use core::sync::atomic::{AtomicU32, Ordering};
/// use ferrolink_device::emulator::{self, LaunchSpec};
/// use std::time::Duration;
///
/// unsafe fn count(args: (*const AtomicU32,)) {
///     // SAFETY: the launch below passes a live counter.
///     unsafe { (*args.0).fetch_add(1, Ordering::Relaxed) };
/// }
/// let spec = LaunchSpec { name: "count", grid: [1, 1, 1], block: [4, 1, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// let n = AtomicU32::new(0);
/// // SAFETY: `n` outlives the launch.
/// unsafe { emulator::launch(&spec, count, (&raw const n,)) }.unwrap();
/// assert_eq!(n.load(Ordering::Relaxed), 4);
/// ```
///
/// A reference is not a kernel argument ([`KernelParam`](crate::kernel::KernelParam)), so
/// this launch, whose threads would all share one `Cell`, does not compile:
///
/// ```compile_fail,E0277
/// use core::cell::Cell;
/// use ferrolink_device::emulator::{self, LaunchSpec};
/// use std::time::Duration;
///
/// unsafe fn bump(args: (&'static Cell<u32>,)) {
///     args.0.set(args.0.get() + 1); // a data race if all threads ran this
/// }
/// let spec = LaunchSpec { name: "bump", grid: [1, 1, 1], block: [4, 1, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// let cell: &'static Cell<u32> = Box::leak(Box::new(Cell::new(0)));
/// // SAFETY: (does not compile: `&Cell<u32>` is not a `KernelParam`)
/// let _ = unsafe { emulator::launch(&spec, bump, (cell,)) };
/// ```
///
/// # Safety
/// The same contract as launching the kernel on a GPU: every pointer in `args` must be
/// valid for what the kernel does with it, for the whole launch, and the kernel's own
/// documented requirements must hold.
pub unsafe fn launch<A: KernelArgs>(spec: &LaunchSpec, entry: unsafe fn(A), args: A) -> Result<(), EmuError> {
    validate(spec)?;
    let launch = Arc::new(LaunchState {
        name: spec.name,
        status: AtomicU8::new(RUNNING),
        deadline: Instant::now() + spec.timeout,
        timeout: spec.timeout,
        first_error: Mutex::new(None),
        graphs: GRAPH_LAUNCHER.with_borrow(Clone::clone),
    });
    let [bx, by, bz] = spec.block;
    let [gx, gy, gz] = spec.grid;
    let threads_per_cta = bx * by * bz;
    let args = SendArgs(args);
    let args = &args;
    let spawn_result = thread::scope(|s| {
        for cz in 0..gz {
            for cy in 0..gy {
                for cx in 0..gx {
                    let cta = Arc::new(Cta::new(threads_per_cta, spec.shared_mem_bytes));
                    for t in 0..threads_per_cta {
                        let ctx = ThreadCtx {
                            tid: [t % bx, (t / bx) % by, t / (bx * by)],
                            ntid: spec.block,
                            ctaid: [cx, cy, cz],
                            nctaid: spec.grid,
                            lane: t % 32,
                            warp: (t / 32) as usize,
                            cta: cta.clone(),
                            launch: launch.clone(),
                        };
                        let body = move || run_thread(ctx, entry, args);
                        let spawned = thread::Builder::new()
                            .name(format!("emu:{}", spec.name))
                            .stack_size(EMULATED_THREAD_STACK)
                            .spawn_scoped(s, body);
                        if let Err(e) = spawned {
                            launch.record(
                                EmuError::InvalidLaunch {
                                    kernel: spec.name,
                                    reason: format!("could not start an emulated thread: {e}"),
                                },
                                ABORT_PANIC,
                            );
                            return Err(());
                        }
                    }
                }
            }
        }
        Ok(())
    });
    let first = lock(&launch.first_error).take();
    match (spawn_result, first) {
        (_, Some(err)) => Err(err),
        (Err(()), None) => unreachable!("a failed spawn records an error"),
        (Ok(()), None) => Ok(()),
    }
}

fn run_thread<A: KernelArgs>(ctx: ThreadCtx, entry: unsafe fn(A), args: &SendArgs<A>) {
    let cta = ctx.cta.clone();
    let launch = ctx.launch.clone();
    let (warp, lane) = (ctx.warp, ctx.lane);
    let label = thread_label(&ctx);
    CTX.set(Some(ctx));
    POLLS.set(0);
    let a = args.0;
    // SAFETY: `launch`'s caller guarantees the kernel's contract for these arguments.
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| unsafe { entry(a) }));
    CTX.set(None);
    // Record a panic before this thread counts as exited: its exit may release the others
    // from a barrier, and their later errors must not be reported as the cause.
    if let Err(payload) = &outcome
        && payload.downcast_ref::<AbortToken>().is_none()
    {
        let message = if let Some(s) = payload.downcast_ref::<&str>() {
            (*s).to_string()
        } else if let Some(s) = payload.downcast_ref::<String>() {
            s.clone()
        } else {
            "non-string panic payload".to_string()
        };
        launch.record(EmuError::Panicked { kernel: launch.name, thread: label, message }, ABORT_PANIC);
    }
    cta.thread_exited(warp, lane);
}
