//! The CPU backend's streams and events: a stream is a worker thread that runs its jobs in
//! order; an event is a flag the worker sets when it reaches it.

use super::super::{EventBackend, EventState, GraphBackend, LaunchRequest, ModuleBackend, StreamBackend};
use crate::{Error, Result};
use ferrolink_device::emulator::{self, LaunchSpec};
use ferrolink_device::graph::GraphLaunchMode;
use std::any::Any;
use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::Instant;

/// One queued stream operation. Returns an error to make the stream fail.
pub(crate) type Job = Box<dyn FnOnce() -> Result<()> + Send>;

/// A stream operation that can run again (captured into a graph).
type Replayable = Arc<dyn Fn() -> Result<()> + Send + Sync>;

enum Msg {
    Run(Job),
    Signal(Arc<CpuEvent>),
    Wait(Arc<dyn EventBackend>),
    Flush(Sender<Option<Error>>),
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A poisoned lock only means a thread panicked while holding it; the data (an error slot,
    // an event state) stays meaningful.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A CPU-backend stream. Dropping it closes the queue: the worker runs what is queued and
/// ends by itself (nothing waits for it).
pub(crate) struct CpuStream {
    tx: Mutex<Sender<Msg>>,
    error: Arc<Mutex<Option<Error>>>,
    /// While capturing: the operations queued so far (not run).
    capture: Mutex<Option<Vec<Replayable>>>,
}

/// Captured operations, run in order by each launch.
struct CpuGraph {
    ops: Arc<GraphOps>,
    /// Its handle among [`DEVICE_GRAPHS`], when made for device launch.
    device_handle: u64,
}

/// A graph's operations, and whether a launch of it runs (a graph made for device launch may
/// not be launched from a kernel while it runs, as on a GPU).
struct GraphOps {
    ops: Vec<Replayable>,
    running: AtomicBool,
}

/// The emulator's graphs made for device launch, by the handle kernels launch them by.
static DEVICE_GRAPHS: Mutex<BTreeMap<u64, Weak<GraphOps>>> = Mutex::new(BTreeMap::new());
/// The next handle (never 0, which is no graph).
static NEXT_DEVICE_GRAPH: AtomicU64 = AtomicU64::new(1);

impl GraphBackend for CpuGraph {
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn device_handle(&self) -> u64 {
        self.device_handle
    }
}

impl Drop for CpuGraph {
    fn drop(&mut self) {
        if self.device_handle != 0 {
            lock(&DEVICE_GRAPHS).remove(&self.device_handle);
        }
    }
}

/// Runs the graphs that the kernels of one launch of a graph launch (the emulator's device
/// runtime): fire-and-forget and sibling launches start at once on threads of their own and
/// are joined when the launching graph's work is done (a graph is complete only with its
/// children; a sibling is joined with them, which is later than CUDA needs); tail launches
/// run after that, in order.
#[derive(Default)]
struct GraphRun {
    children: Mutex<Vec<std::thread::JoinHandle<Result<()>>>>,
    tails: Mutex<Vec<Arc<GraphOps>>>,
}

impl emulator::DeviceGraphLauncher for GraphRun {
    fn launch(&self, exec: u64, stream: u64) -> u32 {
        const INVALID_VALUE: u32 = ferrolink_device::graph::GraphLaunchError::INVALID_VALUE;
        let Some(graph) = lock(&DEVICE_GRAPHS).get(&exec).and_then(Weak::upgrade) else {
            return INVALID_VALUE;
        };
        match GraphLaunchMode::from_stream(stream) {
            Some(GraphLaunchMode::Tail) => lock(&self.tails).push(graph),
            Some(GraphLaunchMode::FireAndForget | GraphLaunchMode::Sibling) => {
                // Refused while a launch of it runs (a tail launch of itself is allowed).
                if graph.running.swap(true, Ordering::AcqRel) {
                    return INVALID_VALUE;
                }
                let child = std::thread::Builder::new()
                    .name("ferrolink-cpu-device-graph".into())
                    .spawn(move || run_graph_marked(&graph));
                match child {
                    Ok(h) => lock(&self.children).push(h),
                    Err(_) => return INVALID_VALUE,
                }
            }
            None => return INVALID_VALUE,
        }
        0
    }
}

/// Runs `graph` (marked running by its launcher) and its tail launches, then marks it done.
fn run_graph_marked(graph: &Arc<GraphOps>) -> Result<()> {
    let result = run_graph(graph);
    graph.running.store(false, Ordering::Release);
    result
}

/// One launch of `graph` in the calling thread: its operations (their kernels' graph launches
/// go to a [`GraphRun`]), its children, then its tail launches (those a tail graph makes run
/// before the ones made earlier, as on a GPU).
fn run_graph(graph: &Arc<GraphOps>) -> Result<()> {
    let mut queue = VecDeque::from([graph.clone()]);
    while let Some(g) = queue.pop_front() {
        let run = Arc::new(GraphRun::default());
        let mut result = emulator::with_graph_launcher(run.clone(), || g.ops.iter().try_for_each(|op| op()));
        for child in std::mem::take(&mut *lock(&run.children)) {
            let joined = child.join().unwrap_or_else(|_| {
                Err(Error::StreamFailed("a graph launched from a kernel panicked on the emulator".into()))
            });
            result = result.and(joined);
        }
        result?;
        for tail in std::mem::take(&mut *lock(&run.tails)).into_iter().rev() {
            queue.push_front(tail);
        }
    }
    Ok(())
}

impl CpuStream {
    pub(crate) fn new() -> Result<CpuStream> {
        let (tx, rx) = channel::<Msg>();
        let error = Arc::new(Mutex::new(None));
        let worker_error = error.clone();
        std::thread::Builder::new()
            .name("ferrolink-cpu-stream".into())
            .spawn(move || worker_loop(rx, worker_error))
            .map_err(|e| Error::InvalidArgument(format!("could not start a CPU stream thread: {e}")))?;
        Ok(CpuStream { tx: Mutex::new(tx), error, capture: Mutex::new(None) })
    }

    fn send(&self, msg: Msg) -> Result<()> {
        lock(&self.tx).send(msg).map_err(|_| Error::StreamFailed("the CPU stream's worker thread has stopped".into()))
    }

    /// Queues `op`, or records it while capturing.
    fn submit(&self, op: Replayable) -> Result<()> {
        if let Some(ops) = lock(&self.capture).as_mut() {
            ops.push(op);
            return Ok(());
        }
        self.enqueue(Box::new(move || op()))
    }

    /// Queues a job; refused once the stream has failed.
    pub(crate) fn enqueue(&self, job: Job) -> Result<()> {
        if let Some(e) = lock(&self.error).clone() {
            return Err(Error::StreamFailed(e.to_string()));
        }
        self.send(Msg::Run(job))
    }
}

fn worker_loop(rx: Receiver<Msg>, error: Arc<Mutex<Option<Error>>>) {
    for msg in rx {
        match msg {
            Msg::Run(job) => {
                // After a failure the stream is dead, like a CUDA stream after a fault:
                // later jobs are dropped unrun.
                if lock(&error).is_some() {
                    continue;
                }
                if let Err(e) = job() {
                    tracing::error!(target: "ferrolink::runtime", error = %e, "CPU stream operation failed");
                    *lock(&error) = Some(e);
                }
            }
            Msg::Signal(event) => event.reach(lock(&error).clone()),
            Msg::Wait(event) => {
                if lock(&error).is_none() {
                    // A failed event means the work it marks no longer runs: go on either way.
                    let _ = event.synchronize();
                }
            }
            Msg::Flush(reply) => {
                let _ = reply.send(lock(&error).clone());
            }
        }
    }
}

impl StreamBackend for CpuStream {
    unsafe fn launch(&self, _module: &dyn ModuleBackend, req: LaunchRequest<'_>) -> Result<()> {
        let cfg = req.cfg;
        let spec = LaunchSpec {
            name: req.kernel,
            grid: [cfg.grid.0, cfg.grid.1, cfg.grid.2],
            block: [cfg.block.0, cfg.block.1, cfg.block.2],
            shared_mem_bytes: cfg.shared_mem_bytes as usize,
            timeout: cfg.emulator_timeout.unwrap_or_else(emulator::default_timeout),
        };
        emulator::validate(&spec)?;
        let make = (req.emulate)();
        self.submit(Arc::new(move || make()(&spec).map_err(Error::from)))
    }

    unsafe fn copy_dtod(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        self.submit(Arc::new(move || {
            // SAFETY: the caller's contract: both ranges are valid until the copy has run and
            // do not overlap.
            unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, bytes) };
            Ok(())
        }))
    }

    unsafe fn write_async(&self, dst: u64, src: &[u8]) -> Result<()> {
        let (src, bytes) = (src.as_ptr() as u64, src.len());
        // SAFETY: the caller's contract: `src` stays valid and unwritten until this copy has
        // run (a later synchronize), `dst` is valid; host and device ranges do not overlap.
        unsafe { self.copy_dtod(dst, src, bytes) }
    }

    unsafe fn read_sync(&self, dst: &mut [u8], src: u64) -> Result<()> {
        self.synchronize()?;
        // SAFETY: the caller's contract: the range is valid and written by nothing meanwhile.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    unsafe fn write_value(&self, addr: u64, value: u64, bytes: u32) -> Result<()> {
        self.submit(Arc::new(move || {
            use std::sync::atomic::{AtomicU8, AtomicU16, AtomicU32, AtomicU64, Ordering::Release};
            // SAFETY: the caller's contract (valid, aligned device memory); kernels access
            // these words only atomically, so the write is atomic too.
            unsafe {
                match bytes {
                    1 => AtomicU8::from_ptr(addr as *mut u8).store(value as u8, Release),
                    2 => AtomicU16::from_ptr(addr as *mut u16).store(value as u16, Release),
                    4 => AtomicU32::from_ptr(addr as *mut u32).store(value as u32, Release),
                    _ => AtomicU64::from_ptr(addr as *mut u64).store(value, Release),
                }
            }
            Ok(())
        }))
    }

    fn record(&self, _timing: bool) -> Result<Arc<dyn EventBackend>> {
        let event = Arc::new(CpuEvent::default());
        if let Some(e) = lock(&self.error).clone() {
            // A failed stream never reaches anything again.
            event.reach(Some(e));
        } else {
            self.send(Msg::Signal(event.clone()))?;
        }
        Ok(event)
    }

    fn wait_event(&self, event: &Arc<dyn EventBackend>) -> Result<()> {
        self.send(Msg::Wait(event.clone()))
    }

    fn synchronize(&self) -> Result<()> {
        let (tx, rx) = channel();
        self.send(Msg::Flush(tx))?;
        match rx.recv() {
            Ok(None) => Ok(()),
            Ok(Some(e)) => Err(e),
            Err(_) => Err(Error::StreamFailed("the CPU stream's worker thread has stopped".into())),
        }
    }

    fn failure(&self) -> Option<Error> {
        lock(&self.error).clone()
    }

    unsafe fn wait_value(&self, addr: u64, value: u64) -> Result<()> {
        let limit = emulator::default_timeout();
        self.submit(Arc::new(move || {
            use std::sync::atomic::{AtomicU64, Ordering::Acquire};
            let start = Instant::now();
            // SAFETY: the caller's contract (valid, aligned, written only atomically).
            let word = unsafe { AtomicU64::from_ptr(addr as *mut u64) };
            while word.load(Acquire) < value {
                if start.elapsed() > limit {
                    return Err(Error::StreamFailed(format!(
                        "a stream wait for the word at {addr:#x} to reach {value} timed out after {limit:?} (it is {})",
                        word.load(Acquire)
                    )));
                }
                std::thread::yield_now();
            }
            Ok(())
        }))
    }

    fn begin_capture(&self) -> Result<()> {
        let mut c = lock(&self.capture);
        if c.is_some() {
            return Err(Error::InvalidArgument("the stream is capturing already".into()));
        }
        *c = Some(Vec::new());
        Ok(())
    }

    fn end_capture(&self, device_launch: bool) -> Result<Box<dyn GraphBackend>> {
        let ops = lock(&self.capture)
            .take()
            .ok_or_else(|| Error::InvalidArgument("end_capture: the stream is not capturing".into()))?;
        let ops = Arc::new(GraphOps { ops, running: AtomicBool::new(false) });
        let device_handle = if device_launch {
            let h = NEXT_DEVICE_GRAPH.fetch_add(1, Ordering::Relaxed);
            lock(&DEVICE_GRAPHS).insert(h, Arc::downgrade(&ops));
            h
        } else {
            0
        };
        Ok(Box::new(CpuGraph { ops, device_handle }))
    }

    fn launch_graph(&self, graph: &dyn GraphBackend) -> Result<()> {
        let g = graph
            .as_any()
            .downcast_ref::<CpuGraph>()
            .ok_or_else(|| Error::InvalidArgument("a graph of another backend".into()))?;
        let ops = g.ops.clone();
        self.submit(Arc::new(move || {
            // Kernels may not launch it while this launch runs (as on a GPU, where doing
            // so is undefined).
            let was_running = ops.running.swap(true, Ordering::AcqRel);
            let result = run_graph(&ops);
            if !was_running {
                ops.running.store(false, Ordering::Release);
            }
            result
        }))
    }
}

#[derive(Default)]
struct EventInner {
    reached: Option<Instant>,
    failed: Option<Error>,
    done: bool,
}

/// A point in a CPU stream.
#[derive(Default)]
pub(crate) struct CpuEvent {
    state: Mutex<EventInner>,
    cv: Condvar,
}

impl CpuEvent {
    fn reach(&self, failed: Option<Error>) {
        let mut s = lock(&self.state);
        s.reached = Some(Instant::now());
        s.failed = failed;
        s.done = true;
        drop(s);
        self.cv.notify_all();
    }
}

impl EventBackend for CpuEvent {
    fn query(&self) -> EventState {
        let s = lock(&self.state);
        match (&s.done, &s.failed) {
            (false, _) => EventState::Pending,
            (true, None) => EventState::Done,
            (true, Some(_)) => EventState::Failed,
        }
    }

    fn synchronize(&self) -> Result<()> {
        let mut s = lock(&self.state);
        while !s.done {
            s = self.cv.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        match &s.failed {
            None => Ok(()),
            Some(e) => Err(Error::StreamFailed(e.to_string())),
        }
    }

    fn elapsed_ms_since(&self, start: &dyn EventBackend) -> Result<f32> {
        let start = start.as_any().downcast_ref::<CpuEvent>().ok_or(Error::WrongDevice("event"))?;
        start.synchronize()?;
        self.synchronize()?;
        let (a, b) = (lock(&start.state).reached, lock(&self.state).reached);
        match (a, b) {
            (Some(a), Some(b)) => Ok(b.saturating_duration_since(a).as_secs_f32() * 1e3),
            _ => Err(Error::StreamFailed("an event was never reached (its stream failed)".into())),
        }
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
