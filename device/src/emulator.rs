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
//! * Dynamic shared memory: one zeroed, 16-byte aligned buffer per CTA.
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
//! # Limits
//! See [`Limits`]: at most 1024 threads per CTA (as on the GPU), at most
//! [`Limits::max_threads_per_launch`] threads in a launch (OS threads are the cost), shared
//! memory up to 227 KiB per CTA. Larger launches are rejected with
//! [`EmuError::InvalidLaunch`] before anything runs.

use core::fmt;
use core::sync::atomic::{AtomicU8, Ordering};
use std::boxed::Box;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::string::{String, ToString};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};
use std::vec::Vec;
use std::{format, thread};

/// Shape and limits of one emulated launch.
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
    pub fn current() -> Limits {
        let max_threads_per_launch =
            std::env::var("FERROLINK_EMU_MAX_THREADS").ok().and_then(|v| v.parse().ok()).unwrap_or(16384);
        Limits { max_threads_per_block: 1024, max_threads_per_launch, max_shared_mem_bytes: 227 * 1024 }
    }
}

/// Why an emulated launch failed.
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

    /// `Err` if this thread must stop: the launch was aborted or its deadline passed.
    fn check(&self, blocked_in: &'static str) -> Result<(), AbortToken> {
        if self.status.load(Ordering::Relaxed) != RUNNING {
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
    shared: Box<[u128]>,
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
            shared: std::vec![0u128; shared_bytes.div_ceil(16)].into_boxed_slice(),
        }
    }

    /// The CTA barrier; returns whether any thread arrived with `pred` set.
    fn sync(&self, pred: bool, launch: &LaunchState) -> bool {
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
    fn exchange(&self, mask: u32, lane: u32, value: u64, launch: &LaunchState) -> ([u64; 32], u32) {
        if mask & self.present & (1 << lane) == 0 {
            panic!(
                "warp operation with mask {mask:#010x} called by lane {lane}, which is not in the \
                 mask (undefined behaviour on the GPU)"
            );
        }
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
    static POLLS: Cell<u32> = const { Cell::new(0) };
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
    with_ctx(|c| c.cta.shared.as_ptr() as *mut u8)
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

// ---- launch ----------------------------------------------------------------------------

struct SendArgs<A>(A);
// SAFETY: kernel arguments are plain values and device addresses; sharing them with the
// emulated threads is what a launch does, and `launch`'s contract makes the caller
// responsible for what the kernel does through them.
unsafe impl<A> Send for SendArgs<A> {}
// SAFETY: as above; the threads only copy the arguments.
unsafe impl<A> Sync for SendArgs<A> {}

/// Stack size of an emulated thread. Kernels use little stack.
const EMULATED_THREAD_STACK: usize = 256 * 1024;

/// Runs `entry(args)` on `spec.grid × spec.block` emulated threads and waits for all of them.
///
/// # Safety
/// The same contract as launching the kernel on a GPU: every pointer in `args` must be
/// valid for what the kernel does with it, for the whole launch, and the kernel's own
/// documented requirements must hold.
pub unsafe fn launch<A: Copy>(spec: &LaunchSpec, entry: unsafe fn(A), args: A) -> Result<(), EmuError> {
    validate(spec)?;
    let launch = Arc::new(LaunchState {
        name: spec.name,
        status: AtomicU8::new(RUNNING),
        deadline: Instant::now() + spec.timeout,
        timeout: spec.timeout,
        first_error: Mutex::new(None),
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

fn run_thread<A: Copy>(ctx: ThreadCtx, entry: unsafe fn(A), args: &SendArgs<A>) {
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
