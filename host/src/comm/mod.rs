//! Communicators: the ranks of a job, their devices and streams, their teams, and the
//! communicator-wide abort, asynchronous error and recovery.
//!
//! [`Communicator::init_all`] creates every rank of a single-process job at once (like
//! `ncclCommInitAll`): one rank per entry of the device list. A device may appear several
//! times: those ranks are *virtual ranks* sharing one GPU (or the emulator), each with its
//! own stream. Rank-local state ([`Communicator`]) is kept apart from job-wide state so that
//! a multi-process bootstrap can build the same objects.

pub mod bootstrap;
pub mod control;
pub mod fdpass;
pub(crate) mod topology;
pub(crate) mod watchdog;

use crate::runtime::device::Device;
use crate::runtime::stream::{Stream, StreamObserver};
use crate::{Backend, Error, Result};
pub use control::CommConfig;
use control::CommControl;
use ferrolink_device::arch::Scope;
use ferrolink_device::comm::Team;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Job-wide facts, shared by all ranks' handles.
pub(crate) struct CommShared {
    pub(crate) id: u64,
    pub(crate) devices: Vec<Device>,
    pub(crate) lsa_size: usize,
    pub(crate) backend: Backend,
    pub(crate) control: Arc<CommControl>,
}

/// One rank of a communicator. Cheap to clone (the rank's stream is shared).
#[derive(Clone)]
pub struct Communicator {
    pub(crate) shared: Arc<CommShared>,
    rank: usize,
    stream: Arc<Stream>,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.rank)
            .field("nranks", &self.nranks())
            .field("lsa_size", &self.shared.lsa_size)
            .field("backend", &self.shared.backend)
            .finish()
    }
}

impl Communicator {
    /// Creates all ranks of a single-process job: rank `r` runs on `devices[r]`. Repeating a
    /// device makes virtual ranks on it. All devices must use the same backend. The watchdog
    /// settings come from the environment ([`CommConfig::from_env`]).
    ///
    /// The LSA domain (ranks that load/store each other's windows) is every rank when all
    /// pairs of GPUs have peer access (and always on one GPU or on the emulator); otherwise
    /// it is the ranks of one GPU when every GPU holds the same number of consecutive ranks,
    /// else each rank alone.
    pub fn init_all(devices: &[Device]) -> Result<Vec<Communicator>> {
        let backend = devices.first().map_or(Backend::Cpu, Device::backend);
        Communicator::init_all_with(devices, CommConfig::from_env(backend))
    }

    /// [`Communicator::init_all`] with explicit watchdog settings.
    pub fn init_all_with(devices: &[Device], config: CommConfig) -> Result<Vec<Communicator>> {
        if devices.is_empty() {
            return Err(Error::InvalidArgument("init_all needs at least one device".into()));
        }
        let backend = devices[0].backend();
        if devices.iter().any(|d| d.backend() != backend) {
            return Err(Error::InvalidArgument("init_all: every rank's device must use the same backend".into()));
        }
        let lsa_size = topology::lsa_domain_size(devices)?;
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let control = Arc::new(CommControl::new(id, config));
        let shared =
            Arc::new(CommShared { id, devices: devices.to_vec(), lsa_size, backend, control: control.clone() });
        let observer: std::sync::Weak<dyn StreamObserver> =
            Arc::downgrade(&(control.clone() as Arc<dyn StreamObserver>));
        let comms = devices
            .iter()
            .enumerate()
            .map(|(rank, dev)| {
                let stream = Arc::new(dev.create_stream()?);
                stream.core().add_observer(observer.clone());
                control.watch_stream(rank, Arc::downgrade(stream.core()));
                Ok(Communicator { shared: shared.clone(), rank, stream })
            })
            .collect::<Result<Vec<_>>>()?;
        watchdog::watch(Arc::downgrade(&control));
        tracing::debug!(target: "ferrolink::comm", comm = id, nranks = devices.len(), lsa_size, %backend, "communicator created");
        Ok(comms)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the job.
    pub fn nranks(&self) -> usize {
        self.shared.devices.len()
    }

    /// This rank's device.
    pub fn device(&self) -> &Device {
        &self.shared.devices[self.rank]
    }

    /// This rank's stream (non-blocking: ranks' kernels run concurrently). Its
    /// `synchronize` also reports the communicator's asynchronous error.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// Waits for this rank's queued work; the stream's error, or the communicator's
    /// asynchronous error (an abort, a watchdog timeout, another rank's failure) if any.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize()
    }

    /// Aborts the communicator (NCCL's `ncclCommAbort`, without freeing anything): every
    /// device wait of every rank returns promptly, kernels run to their end, and every rank's
    /// [`Communicator::synchronize`] and [`Communicator::async_error`] then report the abort.
    /// Callable from any thread, at any time. Use [`recover`] to go on with the same
    /// communicator afterwards.
    pub fn abort(&self) {
        self.shared.control.abort(Error::Aborted(format!("Communicator::abort was called on rank {}", self.rank)));
    }

    /// The communicator's asynchronous error (NCCL's `ncclCommGetAsyncError`): why it was
    /// aborted, if it was.
    pub fn async_error(&self) -> Option<Error> {
        if self.shared.control.is_aborted() { self.shared.control.error() } else { None }
    }

    /// The watchdog settings.
    pub fn config(&self) -> CommConfig {
        self.shared.control.config()
    }

    /// Ranks in this rank's LSA domain.
    pub fn lsa_size(&self) -> usize {
        self.shared.lsa_size
    }

    /// This rank's index in its LSA domain.
    pub fn lsa_rank(&self) -> usize {
        self.rank % self.shared.lsa_size
    }

    /// The world team.
    pub fn world_team(&self) -> Team {
        Team { rank: self.rank as u32, size: self.nranks() as u32, stride: 1 }
    }

    /// The LSA team.
    pub fn lsa_team(&self) -> Team {
        Team { rank: self.lsa_rank() as u32, size: self.lsa_size() as u32, stride: 1 }
    }

    /// The rail team: ranks with this LSA rank in every LSA domain.
    pub fn rail_team(&self) -> Team {
        let l = self.lsa_size();
        Team { rank: (self.rank / l) as u32, size: (self.nranks() / l) as u32, stride: l as u32 }
    }

    /// World ranks of this rank's LSA domain.
    pub fn lsa_peers(&self) -> std::ops::Range<usize> {
        let first = self.rank - self.lsa_rank();
        first..first + self.lsa_size()
    }

    /// The scope LSA synchronization needs: [`Scope::Gpu`] when every LSA peer runs on this
    /// rank's GPU (virtual ranks; on the emulator, the same emulated device), else
    /// [`Scope::Sys`] (peers on other GPUs see our writes only at system scope).
    pub fn lsa_scope(&self) -> Scope {
        let me = self.device();
        if self.lsa_peers().all(|p| self.shared.devices[p].same_as(me)) { Scope::Gpu } else { Scope::Sys }
    }

    /// Whether `other` is a rank of the same communicator.
    pub fn same_comm(&self, other: &Communicator) -> bool {
        Arc::ptr_eq(&self.shared, &other.shared)
    }

    pub(crate) fn control(&self) -> &Arc<CommControl> {
        &self.shared.control
    }
}

/// Launches work for every rank of a group: calls `launch(comm)` for each rank in order,
/// as one unit with respect to ferrolink's context-wide driver calls (module loads, VMM
/// unmaps) made by other threads, which otherwise could stall a GPU whose first ranks
/// already spin waiting for ranks not yet launched. Use it whenever the kernels of different
/// ranks wait for each other (LSA barriers, signals).
///
/// Inside `launch`, do only launches and other non-blocking calls: a host wait there (a host
/// copy of memory a kernel still uses, [`Device::synchronize`]) is refused with an error,
/// since it could wait for kernels that wait for ranks launched after it.
///
/// ```
/// # use ferrolink::{Communicator, Device};
/// # fn main() -> ferrolink::Result<()> {
/// let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
/// ferrolink::launch_all(&comms, |c| {
///     // e.g. `unsafe { c.stream().launch(module, &kernel, cfg, (&dev_comms[c.rank()], ..)) }`
///     let _ = c.rank();
///     Ok(())
/// })?;
/// # Ok(()) }
/// ```
pub fn launch_all(comms: &[Communicator], mut launch: impl FnMut(&Communicator) -> Result<()>) -> Result<()> {
    crate::runtime::group::group_launch(|| comms.iter().try_for_each(&mut launch))
}

/// How long [`recover`] waits for kernels to stop after it aborted them.
const RECOVER_DRAIN: Duration = Duration::from_secs(10);

/// Makes a communicator usable again after an error or an abort, without dropping anything
/// (collective: pass all ranks, in rank order). It
/// 1. aborts the communicator if kernels of it still run, and waits (up to 10 s) until every
///    rank's stream has drained;
/// 2. replaces failed streams ([`Stream::recover`]; on the emulator after a timeout, panic or
///    trap. A CUDA kernel fault breaks the device's context, and then this fails with an
///    error saying so);
/// 3. returns every device communicator's barriers (epochs, inboxes, wait records), abort
///    flag and fault record to their initial state, and forgets the asynchronous error.
///
/// Buffers, windows and device communicators stay valid; their contents are whatever the
/// failed work left.
pub fn recover(comms: &[Communicator]) -> Result<()> {
    check_all_ranks(comms, "recover")?;
    let control = comms[0].control();
    let busy = |c: &Communicator| c.stream.tail().is_some_and(|t| !t.finished());
    if comms.iter().any(busy) {
        control.abort(Error::Aborted("recover() was called while kernels still ran".into()));
    }
    let deadline = Instant::now() + RECOVER_DRAIN;
    for c in comms {
        while busy(c) {
            if Instant::now() >= deadline {
                return Err(Error::StreamFailed(format!(
                    "recover: rank {}'s kernels did not stop within {RECOVER_DRAIN:?} of the abort (a kernel that \
                     never reaches a wait, or a broken device); the device cannot be recovered in this process",
                    c.rank
                )));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    for c in comms {
        c.stream.recover()?;
    }
    control.reset_sources()?;
    control.clear();
    tracing::info!(target: "ferrolink::comm", comm = control.comm_id, "communicator recovered");
    Ok(())
}

/// Checks that `comms` are all ranks of one communicator, in rank order.
pub(crate) fn check_all_ranks(comms: &[Communicator], what: &str) -> Result<()> {
    let Some(first) = comms.first() else {
        return Err(Error::InvalidArgument(format!("{what}: no ranks given")));
    };
    if comms.len() != first.nranks() {
        return Err(Error::InvalidArgument(format!(
            "{what} is collective: pass all {} ranks' communicators, in rank order (got {})",
            first.nranks(),
            comms.len()
        )));
    }
    for (i, c) in comms.iter().enumerate() {
        if !c.same_comm(first) || c.rank() != i {
            return Err(Error::InvalidArgument(format!("{what}: entry {i} is not rank {i} of the same communicator")));
        }
    }
    Ok(())
}
