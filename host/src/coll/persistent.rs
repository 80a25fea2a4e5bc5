//! Persistent mode: one long-lived kernel per GPU runs the collectives of the communicator's
//! ranks on it (NCCL-style persistent kernels; the book chapter's device-side work queue).
//!
//! [`Communicator::start_persistent`] (collective) launches, on a stream of its own, a kernel
//! of a few CTAs per rank that waits on the ranks' mailboxes in device memory (the last rank
//! of a GPU to start launches it for all of the GPU's ranks in its process; the grid is
//! checked with the occupancy API to fit on the GPU at once). From then on each collective call
//! queues, on the rank's stream and in its order, the stream memory writes of the operation
//! and its sequence number (one `cuStreamBatchMemOp`), then a stream wait for the completion
//! word (`cuStreamWaitValue64`, greater or equal): no kernel launch, and the stream's later
//! work (and the host, through the stream) sees the result when the kernel has finished it.
//! Staging copies for device buffers stay kernels on the stream, as without persistent mode.
//! [`Communicator::stop_persistent`] ends the kernel; an abort of the communicator ends it
//! too, and releases every stream waiting on it (their work then reports the abort).
//!
//! ```
//! # fn main() -> ferrolink::Result<()> {
//! use ferrolink::coll::ReduceOp;
//! use ferrolink::{Communicator, Device, run_ranks};
//! let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
//! let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
//! let sums = run_ranks(&comms, |c| {
//!     c.start_persistent(Default::default())?;
//!     let send = c.device().alloc_from(&[c.rank() as f32 + 1.0; 5])?;
//!     let mut recv = c.device().alloc::<f32>(5)?;
//!     c.all_reduce(&send, &mut recv, ReduceOp::Sum)?; // no launch: the kernel runs it
//!     let out = recv.to_vec()?;
//!     c.stop_persistent()?;
//!     Ok(out)
//! })?;
//! assert_eq!(sums[0], vec![3.0; 5]);
//! # Ok(()) }
//! ```

use super::mailbox::{Part, Purpose, RankMailbox};
use crate::comm::Communicator;
use crate::devcomm::{DevCommHandle, DevCommRequirements};
use crate::mem::window::Window;
use crate::runtime::launch::{LaunchArg, LaunchConfig, LaunchTracking};
use crate::runtime::lifetime::lock;
use crate::runtime::memory::TrackedPtr;
use crate::runtime::stream::Stream;
use crate::{Backend, Error, Result};
use ferrolink_device::coll::CollArgs;
use ferrolink_device::coll::persistent::{self, CollOp, MAX_LOCAL_RANKS};
use ferrolink_device::kernels::coll::coll_mailboxes;
use std::time::Duration;

/// CTAs of the persistent kernel by default (each a 256-thread CTA on an SM of its own).
pub const DEFAULT_PERSISTENT_CTAS: u32 = 16;

/// How [`Communicator::start_persistent`] sets persistent mode up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PersistentConfig {
    /// CTAs of the kernel (`None`: [`DEFAULT_PERSISTENT_CTAS`], at most the GPU's SMs over
    /// the ranks sharing it).
    pub ctas: Option<u32>,
    /// Bytes of staging (each of the collectives' send and receive windows) made at the
    /// start: while the kernel runs nothing can be allocated (an allocation may wait for the
    /// device to idle, which a persistent kernel never does), so calls from device buffers
    /// needing more are errors. Windows (zero copy) need none.
    pub staging_bytes: usize,
}

impl Default for PersistentConfig {
    fn default() -> Self {
        PersistentConfig { ctas: None, staging_bytes: 16 << 20 }
    }
}

/// One rank's part of its GPU's persistent kernel.
pub(crate) struct PersistentState {
    ctas: u32,
    mailbox: RankMailbox,
    /// The kernel's stream, on the rank that launched it (kept: the kernel runs on it until
    /// every rank of the GPU has stopped).
    _kernel_stream: Option<Stream>,
    /// The rank's stream: a drop in persistent mode queues the shutdown there, after the
    /// rank's collectives.
    comm_stream: Stream,
    /// The kernel's device communicator for this rank (in the mailbox; alive until stopped).
    handle: DevCommHandle,
    /// Whether the shutdown is queued (the drop must not queue another).
    stopped: bool,
}

impl Communicator {
    /// Starts persistent mode (collective: every rank calls it with the same `cfg`).
    /// Collectives then run in this rank's persistent kernel, queued by stream memory
    /// operations instead of launched. See the [module docs](self).
    pub fn start_persistent(&self, cfg: PersistentConfig) -> Result<()> {
        let ctas = cfg.ctas;
        let n = self.nranks();
        if self.lsa_size() != n {
            return Err(Error::InvalidArgument(
                "start_persistent: persistent collectives need one LSA domain (as the collectives do)".into(),
            ));
        }
        let dev = self.device();
        let most = match dev.backend() {
            Backend::Cuda => (dev.sm_count() / self.ranks_sharing_gpu() as u32).max(1),
            Backend::Cpu => 4,
        };
        let ctas = ctas.unwrap_or(DEFAULT_PERSISTENT_CTAS.min(most));
        if ctas == 0 || ctas > most.min(super::MAX_CTAS) {
            return Err(Error::InvalidArgument(format!(
                "start_persistent: {ctas} CTAs; between 1 and {} here (every CTA must stay resident beside \
                 the other ranks' on this GPU)",
                most.min(super::MAX_CTAS)
            )));
        }
        if self.is_persistent() {
            return Err(Error::InvalidArgument("start_persistent: already started".into()));
        }
        // Everything before the launch: the module, the collectives' resources, the mailbox
        // (zeroed), the device communicator, the stream (making any of them may wait for
        // running kernels). The collectives' lock is taken (and released) before this one's,
        // in the order `collective` takes them: no deadlock between threads of one rank.
        let step =
            |what: &str| tracing::debug!(target: "ferrolink::coll", rank = self.rank(), "start_persistent: {what}");
        let module = dev.builtin_module()?;
        step("module loaded");
        self.prepare_collectives(cfg.staging_bytes)?;
        let (group, meeting) = {
            let mut coll = lock(&self.shared.coll);
            let state = super::coll_state(self, &mut coll)?;
            state.persistent_starts += 1;
            (state.group.clone(), state.persistent_starts)
        };
        step("collectives' resources made");
        if !group.fits() {
            return Err(Error::InvalidArgument(format!(
                "start_persistent: {} ranks of this communicator share this GPU in this process; one persistent \
                 kernel serves at most {MAX_LOCAL_RANKS}",
                group.members.len()
            )));
        }
        let threads = super::threads(dev);
        let resident = module.resident_ctas(&coll_mailboxes, LaunchConfig::linear(1, threads))?;
        group.check_resident(ctas, resident, "start_persistent")?;
        let mut guard = lock(&self.shared.persistent);
        if guard.is_some() {
            return Err(Error::InvalidArgument("start_persistent: already started".into()));
        }
        let mut mailbox = RankMailbox::new(self)?;
        let handle = self.create_dev_comm(&DevCommRequirements { lsa_barrier_count: ctas, ..Default::default() })?;
        mailbox.store_comm(&handle, 0)?;
        step("mailbox and device communicator made");
        let stream = dev.create_stream()?;
        self.barrier()?;
        let mut keep = LaunchTracking::new(dev);
        (&handle).track(&mut keep);
        let control = handle.dev_comm().control;
        let part = Part { rank: self.rank(), mailbox: &mailbox, served: true, control, ctas, keep };
        let served = group.arrive(Purpose::Persistent, meeting, part)?;
        let kernel_stream = match served {
            Some(served) => {
                let ranks = served.ranks;
                // The kernel runs until stopped: no emulator time limit.
                let cfg = LaunchConfig {
                    emulator_timeout: Some(Duration::from_secs(10 * 365 * 24 * 3600)),
                    ..LaunchConfig::linear(ranks.count * ranks.ctas_per_rank, threads)
                };
                // SAFETY: the kernel's contract: every member's mailbox is zeroed, holds its
                // rank's device communicator (whose control block is in `ranks`), and is
                // written only by its rank's stream as `serve` says (`enqueue_persistent`);
                // each member keeps its mailbox and communicator until it has stopped (its
                // part has ended); every rank runs the same operations (collective calls)
                // with the same `ctas`; the communicators' barriers 0..ctas are the kernel's.
                let launched = unsafe { stream.launch(module, &coll_mailboxes, cfg, (&served, 1u64, 0u32)) };
                if let Err(e) = launched {
                    // The other members have started: their posts would wait for ever.
                    group.release_after_failed_launch(self, &served);
                    return Err(e);
                }
                tracing::debug!(target: "ferrolink::coll", rank = self.rank(), ctas, parts = ranks.count,
                    "persistent kernel launched");
                Some(stream)
            }
            None => None,
        };
        *guard = Some(PersistentState {
            ctas,
            mailbox,
            _kernel_stream: kernel_stream,
            comm_stream: self.stream().share(),
            handle,
            stopped: false,
        });
        Ok(())
    }

    /// Whether persistent mode is on.
    pub fn is_persistent(&self) -> bool {
        lock(&self.shared.persistent).is_some()
    }

    /// Ends persistent mode (collective): queues the shutdown on this rank's stream after its
    /// collectives, and waits until this rank's part of the kernel has ended (the kernel ends
    /// when every rank of its GPU has stopped).
    pub fn stop_persistent(&self) -> Result<()> {
        let state = lock(&self.shared.persistent).take();
        let Some(mut state) = state else {
            return Err(Error::InvalidArgument("stop_persistent: persistent mode is not on".into()));
        };
        let args = CollArgs { kind: persistent::SHUTDOWN, ..CollArgs::default() };
        let op = CollOp { args, ..CollOp::default() };
        let queued = post(self, &mut state, op, LaunchTracking::new(self.device()));
        // Queued or not, the drop must not queue another shutdown.
        state.stopped = true;
        queued?;
        self.stream().synchronize()
    }

    /// Queues `args` (with its windows and output) for the persistent kernel, if persistent
    /// mode is on: `Ok(false)` if it is not.
    pub(crate) fn enqueue_persistent(
        &self,
        args: CollArgs,
        send: &Window,
        recv_win: &Window,
        recv: TrackedPtr<'_, *mut u8>,
    ) -> Result<bool> {
        let mut guard = lock(&self.shared.persistent);
        let Some(state) = guard.as_mut() else { return Ok(false) };
        if self.stream().is_capturing() {
            return Err(Error::InvalidArgument(
                "a collective in persistent mode cannot be captured into a graph: its sequence number is \
                 counted on the host, so a replay would not match the kernel's (stop_persistent first)"
                    .into(),
            ));
        }
        let mut t = LaunchTracking::new(self.device());
        send.track(&mut t);
        recv_win.track(&mut t);
        recv.track(&mut t);
        let op = CollOp { args, send: send.param(), recv_win: recv_win.param(), recv: recv.param() as u64 };
        post(self, state, op, t)?;
        Ok(true)
    }

    /// CTAs of the persistent kernel (parts of each collective), if on.
    pub(crate) fn persistent_ctas(&self) -> Option<u32> {
        lock(&self.shared.persistent).as_ref().map(|s| s.ctas)
    }
}

/// Queues on the rank's stream: the operation's words and its sequence number into the
/// mailbox, then a wait for its completion; `t` tracks what the operation uses.
fn post(comm: &Communicator, state: &mut PersistentState, op: CollOp, t: LaunchTracking) -> Result<()> {
    let (writes, seq) = state.mailbox.message(op, &state.handle, 0)?;
    state.mailbox.post(comm.stream(), t, &writes, seq)?;
    tracing::trace!(target: "ferrolink::coll", rank = comm.rank(), seq, kind = op.args.kind, "posted to the persistent kernel");
    Ok(())
}

impl Drop for PersistentState {
    fn drop(&mut self) {
        // Stopped already, or dropped in persistent mode: then queue the shutdown on the
        // rank's stream, after its collectives; nothing waits for it.
        if self.stopped {
            return;
        }
        let args = CollArgs { kind: persistent::SHUTDOWN, ..CollArgs::default() };
        let result =
            self.mailbox.message(CollOp { args, ..CollOp::default() }, &self.handle, 0).and_then(|(writes, _)| {
                let mut t = LaunchTracking::new(self.comm_stream.device());
                self.mailbox.track(&mut t);
                // SAFETY: aligned words of the mailbox (tracked until they are written; the
                // kernel reads them only after `seq`, and its part ends with the shutdown).
                unsafe { self.comm_stream.post(t, &writes, None) }
            });
        if let Err(e) = result {
            tracing::warn!(target: "ferrolink::coll", error = %e, "could not stop the persistent kernel");
        }
    }
}
