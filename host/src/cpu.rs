//! The CPU backend: device memory is aligned host memory; a stream is a worker thread that
//! runs its operations in order; kernels run on the emulator
//! ([`ferrolink_device::emulator`]).

use crate::{Error, Result};
use std::alloc::Layout;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;

/// Alignment of CPU-backend allocations: the same 256 bytes `cuMemAlloc` guarantees.
pub(crate) const ALLOC_ALIGN: usize = 256;

/// One queued stream operation. Returns an error to make the stream fail.
pub(crate) type Job = Box<dyn FnOnce() -> Result<()> + Send>;

enum Msg {
    Run(Job),
    Flush(Sender<Option<Error>>),
}

/// State shared by a stream's handle and its worker.
struct StreamShared {
    error: Mutex<Option<Error>>,
}

/// A CPU-backend stream: a worker thread executing jobs in order.
pub(crate) struct CpuStream {
    tx: Option<Sender<Msg>>,
    worker: Option<JoinHandle<()>>,
    shared: Arc<StreamShared>,
}

impl CpuStream {
    fn new() -> Result<CpuStream> {
        let (tx, rx) = channel::<Msg>();
        let shared = Arc::new(StreamShared { error: Mutex::new(None) });
        let worker_shared = shared.clone();
        let worker = std::thread::Builder::new()
            .name("ferrolink-cpu-stream".into())
            .spawn(move || worker_loop(rx, worker_shared))
            .map_err(|e| Error::InvalidArgument(format!("could not start a CPU stream thread: {e}")))?;
        Ok(CpuStream { tx: Some(tx), worker: Some(worker), shared })
    }

    /// Queues a job.
    pub(crate) fn enqueue(&self, job: Job) -> Result<()> {
        if let Some(e) = lock(&self.shared.error).clone() {
            return Err(Error::StreamFailed(e.to_string()));
        }
        self.tx
            .as_ref()
            .expect("sender lives until drop")
            .send(Msg::Run(job))
            .map_err(|_| Error::StreamFailed("the CPU stream's worker thread has stopped".into()))
    }

    /// Waits until every queued job ran; returns the stream's error if one failed.
    pub(crate) fn synchronize(&self) -> Result<()> {
        let (tx, rx) = channel();
        let sent = self.tx.as_ref().expect("sender lives until drop").send(Msg::Flush(tx));
        if sent.is_err() {
            return Err(Error::StreamFailed("the CPU stream's worker thread has stopped".into()));
        }
        match rx.recv() {
            Ok(None) => Ok(()),
            Ok(Some(e)) => Err(e),
            Err(_) => Err(Error::StreamFailed("the CPU stream's worker thread has stopped".into())),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn worker_loop(rx: Receiver<Msg>, shared: Arc<StreamShared>) {
    for msg in rx {
        match msg {
            Msg::Run(job) => {
                // After a failure the stream is dead, like a CUDA stream after a fault:
                // later jobs are dropped unrun.
                if lock(&shared.error).is_some() {
                    continue;
                }
                if let Err(e) = job() {
                    tracing::error!(error = %e, "CPU stream operation failed");
                    *lock(&shared.error) = Some(e);
                }
            }
            Msg::Flush(reply) => {
                let _ = reply.send(lock(&shared.error).clone());
            }
        }
    }
}

impl Drop for CpuStream {
    fn drop(&mut self) {
        // Closing the channel ends the worker after the queued jobs ran.
        drop(self.tx.take());
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

/// The CPU "device": allocations and the streams that must be drained before memory is
/// freed or touched by the host.
pub(crate) struct CpuDevice {
    streams: Mutex<Vec<Weak<CpuStream>>>,
}

impl CpuDevice {
    pub(crate) fn new() -> CpuDevice {
        CpuDevice { streams: Mutex::new(Vec::new()) }
    }

    pub(crate) fn create_stream(&self) -> Result<Arc<CpuStream>> {
        let s = Arc::new(CpuStream::new()?);
        let mut streams = lock(&self.streams);
        streams.retain(|w| w.strong_count() > 0);
        streams.push(Arc::downgrade(&s));
        Ok(s)
    }

    /// Drains every live stream. Returns the first stream error seen.
    pub(crate) fn synchronize(&self) -> Result<()> {
        let streams: Vec<Arc<CpuStream>> = lock(&self.streams).iter().filter_map(Weak::upgrade).collect();
        let mut first = Ok(());
        for s in streams {
            if let (Err(e), true) = (s.synchronize(), first.is_ok()) {
                first = Err(e);
            }
        }
        first
    }

    pub(crate) fn malloc(&self, bytes: usize) -> Result<u64> {
        let layout = Self::layout(bytes)?;
        // SAFETY: `layout` has non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        if p.is_null() {
            return Err(Error::InvalidArgument(format!("out of host memory allocating {bytes} bytes")));
        }
        Ok(p as u64)
    }

    /// # Safety
    /// `ptr` came from `malloc(bytes)` on this device and is not used after this.
    pub(crate) unsafe fn free(&self, ptr: u64, bytes: usize) {
        let layout = Self::layout(bytes).expect("layout was valid at allocation");
        // SAFETY: the caller's contract.
        unsafe { std::alloc::dealloc(ptr as *mut u8, layout) }
    }

    fn layout(bytes: usize) -> Result<Layout> {
        Layout::from_size_align(bytes.max(1), ALLOC_ALIGN)
            .map_err(|_| Error::InvalidArgument(format!("allocation of {bytes} bytes is too large")))
    }
}
