//! Communicators: the ranks of a job, their devices and streams, their teams, and the
//! communicator-wide abort, asynchronous error and recovery.
//!
//! A [`Communicator`] is one rank's handle. Every rank of a job calls the collective methods
//! (`register_window`, `create_dev_comm`, `split`, `recover`, …) in the same order; the ranks
//! meet through a bootstrap ([`bootstrap::Bootstrap`]). Three ways to create one:
//! * [`Communicator::init_all`]: every rank of a job in this process (like `ncclCommInitAll`),
//!   one rank per entry of a device list (a device may appear several times: *virtual
//!   ranks*), each rank's collectives run on a thread over an in-process bootstrap;
//! * [`Communicator::init_rank`]: one rank, from a unique id ([`bootstrap::UniqueId`]) shared by
//!   the program (like `ncclCommInitRank`), over TCP;
//! * [`Communicator::from_env`]: one rank, from a launcher's environment (torchrun, mpirun,
//!   srun, `ferrolink-run`; [`launch`]).
//!
//! For calls that take every rank's handle at once (`register_window(&comms, ..)`, …), the
//! ranks of one process run the per-rank call on threads.

pub mod bootstrap;
pub mod control;
pub mod fdpass;
pub mod launch;
pub mod topology;
pub(crate) mod watchdog;

use crate::runtime::device::Device;
use crate::runtime::stream::{Stream, StreamObserver};
use crate::{Backend, Error, Result};
use bootstrap::in_process::InProcessBootstrap;
use bootstrap::{Bootstrap, Subgroup, UniqueId};
pub use control::CommConfig;
use control::CommControl;
use ferrolink_device::arch::Scope;
use ferrolink_device::comm::Team;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use topology::{LsaMode, PeerInfo};

/// One rank's state, shared by the clones of its handle.
pub(crate) struct CommShared {
    /// The communicator's id: the same on every rank (rank 0's random number).
    pub(crate) id: u64,
    rank: usize,
    nranks: usize,
    device: Device,
    /// Every rank's description, by world rank.
    pub(crate) peers: Arc<Vec<PeerInfo>>,
    lsa_size: usize,
    pub(crate) bootstrap: Arc<dyn Bootstrap>,
    pub(crate) control: Arc<CommControl>,
    /// Collective calls made so far (every rank counts the same): names windows across ranks.
    collectives: AtomicU64,
    /// Calls of [`Communicator::recover`] so far: objects whose device state a failed call
    /// can leave half done (`moe::Moe`) remember it when made and refuse work after one.
    recoveries: AtomicU64,
    config: CommConfig,
    /// File-descriptor exchange with this machine's other processes, opened on first need.
    fds: std::sync::OnceLock<Arc<fdpass::FdExchange>>,
    /// The collectives' device communicator and staging windows (made by the first call).
    pub(crate) coll: std::sync::Mutex<Option<crate::coll::CollState>>,
    /// The point-to-point resources (made by `enable_p2p`).
    pub(crate) p2p: std::sync::Mutex<Option<crate::coll::p2p::P2pState>>,
    /// The persistent kernel (made by `start_persistent`).
    pub(crate) persistent: std::sync::Mutex<Option<crate::coll::persistent::PersistentState>>,
}

/// One rank of a communicator. Cheap to clone (the rank's stream is shared).
///
/// ```
/// # use ferrolink::{Communicator, Device};
/// # fn main() -> ferrolink::Result<()> {
/// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// let comms = Communicator::init_all(&[dev.clone(), dev])?;
/// let handle = comms[1].clone(); // the same rank, sharing its stream
/// assert!(handle.same_comm(&comms[0]));
/// assert_eq!((handle.rank(), handle.nranks()), (1, 2));
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Communicator {
    pub(crate) shared: Arc<CommShared>,
    stream: Arc<Stream>,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.rank())
            .field("nranks", &self.nranks())
            .field("lsa_size", &self.shared.lsa_size)
            .field("backend", &self.device().backend())
            .finish()
    }
}

/// How long bootstrap exchanges wait for the slowest rank: `FERROLINK_BOOTSTRAP_TIMEOUT`
/// seconds, default 120; any other value than a number of seconds above 0 is an error.
///
/// ```
/// use std::time::Duration;
/// let t = ferrolink::comm::bootstrap_timeout()?;
/// if std::env::var_os("FERROLINK_BOOTSTRAP_TIMEOUT").is_none() {
///     assert_eq!(t, Duration::from_secs(120));
/// }
/// assert!(t > Duration::ZERO);
/// # Ok::<(), ferrolink::Error>(())
/// ```
pub fn bootstrap_timeout() -> Result<Duration> {
    let secs = crate::comm::control::env_secs("FERROLINK_BOOTSTRAP_TIMEOUT", "a number of seconds above 0")?;
    match secs {
        Some(s) if s <= 0.0 => {
            Err(Error::InvalidArgument("FERROLINK_BOOTSTRAP_TIMEOUT=0: it takes a number of seconds above 0".into()))
        }
        Some(s) => Ok(Duration::from_secs_f64(s)),
        None => Ok(Duration::from_secs(120)),
    }
}

/// Runs `f(rank)` for every rank on threads of this process and returns the results in rank
/// order (the first error if any): how the calls that take every rank's handle run the
/// per-rank collectives.
pub(crate) fn on_rank_threads<T: Send>(n: usize, f: impl Fn(usize) -> Result<T> + Sync) -> Result<Vec<T>> {
    if n == 1 {
        return Ok(vec![f(0)?]);
    }
    let results: Vec<Result<T>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|r| {
                let f = &f;
                std::thread::Builder::new()
                    .name(format!("ferrolink-rank-{r}"))
                    .stack_size(256 * 1024)
                    .spawn_scoped(s, move || f(r))
                    .expect("starting a rank thread")
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(Error::InvalidArgument("a rank thread panicked".into()))))
            .collect()
    });
    // Report the most telling error: one that is not merely another rank's absence.
    let mut out = Vec::with_capacity(n);
    let mut first_err: Option<Error> = None;
    for r in results {
        match r {
            Ok(v) => out.push(v),
            Err(e) => {
                let secondary = matches!(e, Error::Bootstrap(_));
                if first_err.as_ref().is_none_or(|f| matches!(f, Error::Bootstrap(_)) && !secondary) {
                    first_err = Some(e);
                }
            }
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(out),
    }
}

impl Communicator {
    /// Creates all ranks of a single-process job: rank `r` runs on `devices[r]`. Repeating a
    /// device makes virtual ranks on it. All devices must use the same backend. The watchdog
    /// settings come from the environment ([`CommConfig::from_env`]).
    ///
    /// The LSA domain (ranks that load/store each other's windows) is every rank when all
    /// pairs of GPUs have peer access (and always on one GPU or on the emulator); otherwise
    /// consecutive equal blocks of ranks that reach each other, else each rank alone
    /// ([`topology::lsa_layout`]). `FERROLINK_LSA=process` makes the whole process one domain.
    ///
    /// ```
    /// # use ferrolink::{Communicator, Device};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// // Three virtual ranks on one device.
    /// let comms = Communicator::init_all(&[dev.clone(), dev.clone(), dev])?;
    /// assert!(comms.iter().enumerate().all(|(r, c)| c.rank() == r && c.nranks() == 3));
    /// assert!(Communicator::init_all(&[]).is_err());
    /// # Ok(()) }
    /// ```
    pub fn init_all(devices: &[Device]) -> Result<Vec<Communicator>> {
        let backend = devices.first().map_or(Backend::Cpu, Device::backend);
        Communicator::init_all_with(devices, CommConfig::from_env(backend)?)
    }

    /// [`Communicator::init_all`] with explicit watchdog settings.
    ///
    /// ```
    /// # use ferrolink::{CommConfig, Communicator, Device};
    /// # use std::time::Duration;
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let config = CommConfig { timeout: Some(Duration::from_secs(5)), ..CommConfig::from_env(dev.backend())? };
    /// let comms = Communicator::init_all_with(&[dev.clone(), dev], config)?;
    /// assert_eq!(comms[1].config().timeout, Some(Duration::from_secs(5)));
    /// # Ok(()) }
    /// ```
    pub fn init_all_with(devices: &[Device], config: CommConfig) -> Result<Vec<Communicator>> {
        if devices.is_empty() {
            return Err(Error::InvalidArgument("init_all needs at least one device".into()));
        }
        let group = InProcessBootstrap::group(devices.len(), bootstrap_timeout()?);
        on_rank_threads(devices.len(), |r| {
            Communicator::from_bootstrap(group[r].clone() as Arc<dyn Bootstrap>, &devices[r], config)
        })
    }

    /// Creates this process's rank `rank` of an `nranks`-rank job (like `ncclCommInitRank`):
    /// every rank calls it with the same `id` (made by one of them with [`UniqueId::new`] and
    /// handed to the others by the program), its own `rank`, and its device. Rank 0's process
    /// runs the bootstrap's root at `id.root()`. Returns when every rank has joined, or fails
    /// after `FERROLINK_BOOTSTRAP_TIMEOUT` (120 s) with an error naming the ranks that never
    /// came.
    ///
    /// ```
    /// # use ferrolink::{Communicator, Device, UniqueId};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// // Where rank 0's root listens (in a real job: rank 0's machine, a port every rank reaches).
    /// let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    /// let id = UniqueId::new(([127, 0, 0, 1], port).into())?;
    /// // Usually one process per rank; here two ranks on threads of this one.
    /// let comms = std::thread::scope(|s| {
    ///     let (id, dev) = (&id, &dev);
    ///     let ranks: Vec<_> = (0..2).map(|r| s.spawn(move || Communicator::init_rank(id, 2, r, dev))).collect();
    ///     ranks.into_iter().map(|h| h.join().unwrap()).collect::<ferrolink::Result<Vec<_>>>()
    /// })?;
    /// assert_eq!((comms[1].rank(), comms[1].nranks()), (1, 2));
    /// assert!(comms[0].same_comm(&comms[1]));
    /// # Ok(()) }
    /// ```
    pub fn init_rank(id: &UniqueId, nranks: usize, rank: usize, device: &Device) -> Result<Communicator> {
        Communicator::init_rank_with(id, nranks, rank, device, CommConfig::from_env(device.backend())?)
    }

    /// [`Communicator::init_rank`] with explicit watchdog settings.
    ///
    /// ```
    /// # use ferrolink::{CommConfig, Communicator, Device, UniqueId};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    /// let id = UniqueId::new(([127, 0, 0, 1], port).into())?;
    /// let config = CommConfig { timeout: None, ..CommConfig::from_env(dev.backend())? }; // no watchdog
    /// assert!(Communicator::init_rank_with(&id, 1, 1, &dev, config).is_err()); // rank 1 of 1
    /// let comm = Communicator::init_rank_with(&id, 1, 0, &dev, config)?; // a job of one rank
    /// assert_eq!(comm.config().timeout, None);
    /// # Ok(()) }
    /// ```
    pub fn init_rank_with(
        id: &UniqueId,
        nranks: usize,
        rank: usize,
        device: &Device,
        config: CommConfig,
    ) -> Result<Communicator> {
        if rank >= nranks {
            return Err(Error::InvalidArgument(format!("init_rank: rank {rank} is outside 0..{nranks}")));
        }
        let b = bootstrap::tcp::TcpBootstrap::init(id, rank, nranks, bootstrap_timeout()?)?;
        Communicator::from_bootstrap(b, device, config)
    }

    /// Creates this process's rank from a launcher's environment (torchrun, Open MPI, Slurm,
    /// `ferrolink-run`; [`launch::LaunchEnv`] says which variables are read), on `device`.
    ///
    /// ```no_run
    /// # use ferrolink::{Communicator, Device};
    /// # fn main() -> ferrolink::Result<()> {
    /// // Needs a launcher's environment (one process per rank), e.g. `ferrolink-run -n 2 prog`,
    /// // `torchrun`, `mpirun` or `srun`: without one it returns an error.
    /// let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let comm = Communicator::from_env(&dev)?;
    /// comm.barrier()?; // every rank has joined
    /// assert!(comm.rank() < comm.nranks());
    /// # Ok(()) }
    /// ```
    pub fn from_env(device: &Device) -> Result<Communicator> {
        let env = launch::LaunchEnv::detect()?.ok_or_else(|| {
            Error::InvalidArgument(
                "Communicator::from_env: no launcher environment (RANK/WORLD_SIZE, OMPI_COMM_WORLD_RANK/SIZE, \
                 SLURM_PROCID/NTASKS, or FERROLINK_RANK/FERROLINK_NRANKS): start the program with torchrun, \
                 mpirun, srun or ferrolink-run, or use init_all/init_rank"
                    .into(),
            )
        })?;
        Communicator::init_rank(&env.unique_id()?, env.nranks, env.rank, device)
    }

    /// Creates one rank over any bootstrap (the other constructors end here): gathers every
    /// rank's description, checks the job, computes the LSA domains, creates the rank's stream.
    ///
    /// ```
    /// # use ferrolink::{CommConfig, Communicator, Device};
    /// # use std::sync::Arc;
    /// use ferrolink::comm::bootstrap::{Bootstrap, in_process::InProcessBootstrap};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// // What init_all does: a bootstrap per rank, each rank on a thread.
    /// let group = InProcessBootstrap::group(2, ferrolink::comm::bootstrap_timeout()?);
    /// let config = CommConfig::from_env(dev.backend())?;
    /// let comms = std::thread::scope(|s| {
    ///     let ranks: Vec<_> = group
    ///         .iter()
    ///         .map(|b| {
    ///             let b = b.clone() as Arc<dyn Bootstrap>;
    ///             s.spawn(|| Communicator::from_bootstrap(b, &dev, config))
    ///         })
    ///         .collect();
    ///     ranks.into_iter().map(|h| h.join().unwrap()).collect::<ferrolink::Result<Vec<_>>>()
    /// })?;
    /// assert_eq!(comms[1].rank(), 1);
    /// assert!(comms[0].same_comm(&comms[1]));
    /// # Ok(()) }
    /// ```
    pub fn from_bootstrap(bootstrap: Arc<dyn Bootstrap>, device: &Device, config: CommConfig) -> Result<Communicator> {
        let (rank, nranks) = (bootstrap.rank(), bootstrap.nranks());
        crate::log::init();
        let me = PeerInfo::local(device);
        let mut hello = me.encode();
        let mut id_bytes = [0u8; 8];
        getrandom::fill(&mut id_bytes).map_err(|e| Error::Bootstrap(format!("no random numbers: {e}")))?;
        hello.extend_from_slice(&id_bytes);
        let gathered = bootstrap.all_gather(&hello)?;
        let id = gathered[0]
            .len()
            .checked_sub(8)
            .map(|at| u64::from_le_bytes(gathered[0][at..].try_into().expect("8 bytes")))
            .ok_or_else(|| Error::Bootstrap("rank 0's description is malformed".into()))?;
        let control = CommControl::for_comm(id, config);
        let peers = match control.peers.get() {
            Some(p) => p.clone(),
            None => {
                let mut peers = Vec::with_capacity(nranks);
                for (r, g) in gathered.iter().enumerate() {
                    let info = g.len().checked_sub(8).map(|at| &g[..at]);
                    peers.push(PeerInfo::decode(
                        info.ok_or_else(|| Error::Bootstrap(format!("rank {r}'s description is malformed")))?,
                    )?);
                }
                control.peers.get_or_init(|| Arc::new(peers)).clone()
            }
        };
        if let Some(r) = peers.iter().position(|p| p.backend != me.backend) {
            return Err(Error::InvalidArgument(format!(
                "rank {r} runs on the {} backend and rank {rank} on {}: every rank of a job must use the same backend",
                peers[r].backend, me.backend
            )));
        }
        if let Some(problem) = topology::shared_device_problem(&peers) {
            return Err(Error::InvalidArgument(problem));
        }
        // Which ranks this one can map, then everyone's answer.
        let b = device.backend_device();
        let mut row = Vec::with_capacity(nranks);
        for p in peers.iter() {
            row.push(u8::from(p.node == me.node && b.can_access_uuid(&p.uuid)?));
        }
        let rows = bootstrap.all_gather(&row)?;
        let layout = match control.layout.get() {
            Some(l) => *l,
            None => {
                let reach: Vec<Vec<bool>> = rows.iter().map(|r| r.iter().map(|&x| x != 0).collect()).collect();
                if reach.iter().any(|r| r.len() != nranks) {
                    return Err(Error::Bootstrap("a rank's reach list is malformed".into()));
                }
                *control.layout.get_or_init(|| topology::lsa_layout(&peers, &reach, config.lsa))
            }
        };
        LsaMode::from_env()?;
        let stream = Arc::new(device.create_stream()?);
        let observer: std::sync::Weak<dyn StreamObserver> =
            Arc::downgrade(&(control.clone() as Arc<dyn StreamObserver>));
        stream.core().add_observer(observer);
        control.watch_stream(format!("rank {rank}'s stream"), Arc::downgrade(stream.core()));
        let shared = Arc::new(CommShared {
            id,
            rank,
            nranks,
            device: device.clone(),
            peers,
            lsa_size: layout.size,
            bootstrap,
            control,
            collectives: AtomicU64::new(0),
            recoveries: AtomicU64::new(0),
            config,
            fds: std::sync::OnceLock::new(),
            coll: std::sync::Mutex::new(None),
            p2p: std::sync::Mutex::new(None),
            persistent: std::sync::Mutex::new(None),
        });
        if rank == 0 {
            tracing::debug!(target: "ferrolink::comm", comm = id, nranks, lsa_size = layout.size, "communicator created");
        }
        Ok(Communicator { shared, stream })
    }

    /// Splits the communicator (collective over all its ranks; NCCL's `ncclCommSplit`): the
    /// ranks passing the same `color` form a new communicator, ordered by `key` (ties by their
    /// rank here). A rank passing `None` takes part but gets no communicator. The new
    /// communicators have their own windows, device communicators and watchdog; their
    /// bootstrap messages travel over this one's.
    ///
    /// ```
    /// # use ferrolink::{Communicator, Device};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let comms = Communicator::init_all(&vec![dev; 4])?;
    /// // Even and odd ranks apart; rank 3 takes part but joins none.
    /// let subs = ferrolink::run_ranks(&comms, |c| {
    ///     let color = (c.rank() != 3).then_some(c.rank() as u32 % 2);
    ///     c.split(color, 0)
    /// })?;
    /// let (even, odd) = (subs[2].as_ref().unwrap(), subs[1].as_ref().unwrap());
    /// assert_eq!((even.rank(), even.nranks(), odd.nranks()), (1, 2, 1));
    /// assert!(even.same_comm(subs[0].as_ref().unwrap()) && !even.same_comm(odd));
    /// assert!(subs[3].is_none());
    /// # Ok(()) }
    /// ```
    pub fn split(&self, color: Option<u32>, key: i64) -> Result<Option<Communicator>> {
        let mut msg = Vec::with_capacity(13);
        msg.push(u8::from(color.is_some()));
        msg.extend_from_slice(&color.unwrap_or(0).to_le_bytes());
        msg.extend_from_slice(&key.to_le_bytes());
        let all = self.shared.bootstrap.all_gather(&msg)?;
        let space = self.shared.bootstrap.next_tag();
        let Some(color) = color else { return Ok(None) };
        let mut members: Vec<(i64, usize)> = Vec::new();
        for (r, m) in all.iter().enumerate() {
            if m.len() != 13 {
                return Err(Error::Bootstrap(format!("rank {r}'s split request is malformed")));
            }
            let c = u32::from_le_bytes(m[1..5].try_into().expect("4 bytes"));
            if m[0] == 1 && c == color {
                members.push((i64::from_le_bytes(m[5..13].try_into().expect("8 bytes")), r));
            }
        }
        members.sort();
        let members: Vec<usize> = members.into_iter().map(|(_, r)| r).collect();
        let sub = Subgroup::new(self.shared.bootstrap.clone(), members, space ^ (u64::from(color) << 40))?;
        Communicator::from_bootstrap(Arc::new(sub), &self.shared.device, self.shared.config).map(Some)
    }

    /// This rank.
    ///
    /// ```
    /// # use ferrolink::{Communicator, Device};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let comms = Communicator::init_all(&[dev.clone(), dev])?;
    /// assert_eq!(comms.iter().map(|c| c.rank()).collect::<Vec<_>>(), [0, 1]);
    /// # Ok(()) }
    /// ```
    pub fn rank(&self) -> usize {
        self.shared.rank
    }

    /// Ranks in the job.
    ///
    /// ```
    /// # use ferrolink::{Communicator, Device};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let comms = Communicator::init_all(&[dev.clone(), dev])?;
    /// assert!(comms.iter().all(|c| c.nranks() == 2));
    /// # Ok(()) }
    /// ```
    pub fn nranks(&self) -> usize {
        self.shared.nranks
    }

    /// This rank's device.
    ///
    /// ```
    /// # use ferrolink::{Communicator, Device};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let comms = Communicator::init_all(&[dev.clone(), dev])?;
    /// assert_eq!(comms[1].device().backend(), ferrolink::Backend::Cpu);
    /// # Ok(()) }
    /// ```
    pub fn device(&self) -> &Device {
        &self.shared.device
    }

    /// This rank's stream (non-blocking: ranks' kernels run concurrently). Its
    /// `synchronize` also reports the communicator's asynchronous error.
    ///
    /// ```
    /// # use ferrolink::{Communicator, Device};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let comms = Communicator::init_all(&[dev.clone(), dev])?;
    /// let c = &comms[0];
    /// let src = c.device().alloc_from(&[1u32, 2, 3])?;
    /// let mut dst = c.device().alloc::<u32>(3)?;
    /// c.stream().copy_buffer(&mut dst, &src)?; // queued on rank 0's stream
    /// c.stream().synchronize()?;
    /// assert_eq!(dst.to_vec()?, [1, 2, 3]);
    /// # Ok(()) }
    /// ```
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// Where every rank runs (machine, process, device), by world rank.
    ///
    /// ```
    /// # use ferrolink::{Communicator, Device};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let comms = Communicator::init_all(&[dev.clone(), dev])?;
    /// let peers = comms[0].peers();
    /// assert_eq!(peers.len(), 2);
    /// assert!(peers[0].same_process(&peers[1])); // virtual ranks of this process
    /// # Ok(()) }
    /// ```
    pub fn peers(&self) -> &[PeerInfo] {
        &self.shared.peers
    }

    /// Waits for this rank's queued work; the stream's error, or the communicator's
    /// asynchronous error (an abort, a watchdog timeout, another rank's failure) if any.
    ///
    /// ```
    /// # use ferrolink::{Communicator, Device};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let comms = Communicator::init_all(&[dev.clone(), dev])?;
    /// comms[0].synchronize()?; // nothing queued, no error
    /// comms[1].abort();
    /// assert!(matches!(comms[0].synchronize(), Err(ferrolink::Error::Aborted(_))));
    /// # Ok(()) }
    /// ```
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize()
    }

    /// Waits until every rank has called it (a host barrier through the bootstrap).
    ///
    /// ```
    /// # use ferrolink::{Communicator, Device};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let comms = Communicator::init_all(&[dev.clone(), dev])?;
    /// use std::sync::atomic::{AtomicUsize, Ordering};
    /// let arrived = AtomicUsize::new(0);
    /// let seen = ferrolink::run_ranks(&comms, |c| {
    ///     arrived.fetch_add(1, Ordering::SeqCst);
    ///     c.barrier()?;
    ///     Ok(arrived.load(Ordering::SeqCst))
    /// })?;
    /// assert_eq!(seen, [2, 2]); // no rank left before both arrived
    /// # Ok(()) }
    /// ```
    pub fn barrier(&self) -> Result<()> {
        self.shared.bootstrap.barrier()
    }

    /// Every rank's `data`, in rank order, through the bootstrap (collective; NCCL's
    /// `bootstrapAllGather`): small host-side exchanges such as addresses. Every rank
    /// calls it; the sizes may differ.
    ///
    /// ```
    /// # use ferrolink::{Backend, Communicator, Device};
    /// let dev = Device::open_with(Backend::Cpu, 0)?;
    /// let comms = Communicator::init_all(&[dev.clone(), dev])?;
    /// let all = ferrolink::run_ranks(&comms, |c| c.all_gather_bytes(&[c.rank() as u8; 3]))?;
    /// assert_eq!(all[1], vec![vec![0u8; 3], vec![1u8; 3]]);
    /// # Ok::<(), ferrolink::Error>(())
    /// ```
    pub fn all_gather_bytes(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.shared.bootstrap.all_gather(data)
    }

    /// Aborts the communicator (NCCL's `ncclCommAbort`, without freeing anything): every
    /// device wait of this process's ranks of it returns promptly, kernels run to their end,
    /// and their [`Communicator::synchronize`] and [`Communicator::async_error`] then report
    /// the abort. Callable from any thread, at any time. Ranks in other processes are not
    /// told: their watchdogs report the ranks that stopped arriving. Use
    /// [`Communicator::recover`] to go on with the same communicator afterwards.
    ///
    /// ```
    /// # use ferrolink::{Communicator, Device};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let comms = Communicator::init_all(&[dev.clone(), dev])?;
    /// comms[0].abort();
    /// assert!(matches!(comms[1].async_error(), Some(ferrolink::Error::Aborted(_))));
    /// ferrolink::recover(&comms)?; // usable again
    /// assert!(comms[1].async_error().is_none());
    /// # Ok(()) }
    /// ```
    pub fn abort(&self) {
        self.shared.control.abort(Error::Aborted(format!("Communicator::abort was called on rank {}", self.rank())));
    }

    /// The communicator's asynchronous error (NCCL's `ncclCommGetAsyncError`): why it was
    /// aborted, if it was.
    ///
    /// ```
    /// # use ferrolink::{Communicator, Device};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let comms = Communicator::init_all(&[dev.clone(), dev])?;
    /// assert!(comms[0].async_error().is_none());
    /// comms[1].abort();
    /// assert!(comms[0].async_error().is_some()); // the whole communicator
    /// # Ok(()) }
    /// ```
    pub fn async_error(&self) -> Option<Error> {
        if self.shared.control.is_aborted() { self.shared.control.error() } else { None }
    }

    /// The watchdog settings.
    ///
    /// ```
    /// # use ferrolink::{CommConfig, Communicator, Device};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// assert_eq!(comms[0].config(), CommConfig::from_env(dev.backend())?); // init_all's settings
    /// # Ok(()) }
    /// ```
    pub fn config(&self) -> CommConfig {
        self.shared.control.config()
    }

    /// Changes the communicator's timeout ([`CommConfig::timeout`]) for every rank of it in
    /// this process, from now on: device waits (the watchdog), host waits of ranks sharing a
    /// GPU, and waits in progress at their next look. Not collective: other processes keep
    /// theirs. For example a test that waits for a timeout on purpose with a short one, then
    /// goes on after [`crate::recover`] with the default:
    ///
    /// ```
    /// # use ferrolink::{CommConfig, Communicator, Device};
    /// # use std::time::Duration;
    /// # fn main() -> ferrolink::Result<()> {
    /// let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// comms[0].set_timeout(Some(Duration::from_secs(1)));
    /// assert_eq!(comms[1].config().timeout, Some(Duration::from_secs(1))); // one process: both ranks
    /// comms[0].set_timeout(CommConfig::from_env(dev.backend())?.timeout);
    /// # Ok(()) }
    /// ```
    pub fn set_timeout(&self, timeout: Option<std::time::Duration>) {
        self.shared.control.set_timeout(timeout);
    }

    /// Ranks in this rank's LSA domain.
    ///
    /// ```
    /// # use ferrolink::{CommConfig, Communicator, Device, LsaMode};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// // Four ranks in LSA domains of two: {0, 1} and {2, 3}.
    /// let config = CommConfig { lsa: LsaMode::Size(2), ..CommConfig::from_env(dev.backend())? };
    /// let comms = Communicator::init_all_with(&vec![dev; 4], config)?;
    /// assert_eq!(comms[3].lsa_size(), 2);
    /// # Ok(()) }
    /// ```
    pub fn lsa_size(&self) -> usize {
        self.shared.lsa_size
    }

    /// This rank's index in its LSA domain.
    ///
    /// ```
    /// # use ferrolink::{CommConfig, Communicator, Device, LsaMode};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// // Four ranks in LSA domains of two: {0, 1} and {2, 3}.
    /// let config = CommConfig { lsa: LsaMode::Size(2), ..CommConfig::from_env(dev.backend())? };
    /// let comms = Communicator::init_all_with(&vec![dev; 4], config)?;
    /// assert_eq!(comms.iter().map(|c| c.lsa_rank()).collect::<Vec<_>>(), [0, 1, 0, 1]);
    /// # Ok(()) }
    /// ```
    pub fn lsa_rank(&self) -> usize {
        self.rank() % self.shared.lsa_size
    }

    /// The world team.
    ///
    /// ```
    /// # use ferrolink::{Communicator, Device};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let comms = Communicator::init_all(&[dev.clone(), dev])?;
    /// use ferrolink::device_api::Team;
    /// assert_eq!(comms[1].world_team(), Team { rank: 1, size: 2, stride: 1 });
    /// # Ok(()) }
    /// ```
    pub fn world_team(&self) -> Team {
        Team { rank: self.rank() as u32, size: self.nranks() as u32, stride: 1 }
    }

    /// The LSA team.
    ///
    /// ```
    /// # use ferrolink::{CommConfig, Communicator, Device, LsaMode};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// // Four ranks in LSA domains of two: {0, 1} and {2, 3}.
    /// let config = CommConfig { lsa: LsaMode::Size(2), ..CommConfig::from_env(dev.backend())? };
    /// let comms = Communicator::init_all_with(&vec![dev; 4], config)?;
    /// use ferrolink::device_api::Team;
    /// assert_eq!(comms[3].lsa_team(), Team { rank: 1, size: 2, stride: 1 });
    /// # Ok(()) }
    /// ```
    pub fn lsa_team(&self) -> Team {
        Team { rank: self.lsa_rank() as u32, size: self.lsa_size() as u32, stride: 1 }
    }

    /// The rail team: ranks with this LSA rank in every LSA domain.
    ///
    /// ```
    /// # use ferrolink::{CommConfig, Communicator, Device, LsaMode};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// // Four ranks in LSA domains of two: {0, 1} and {2, 3}.
    /// let config = CommConfig { lsa: LsaMode::Size(2), ..CommConfig::from_env(dev.backend())? };
    /// let comms = Communicator::init_all_with(&vec![dev; 4], config)?;
    /// use ferrolink::device_api::Team;
    /// // Ranks 1 and 3 (LSA rank 1 of each domain), two world ranks apart.
    /// assert_eq!(comms[3].rail_team(), Team { rank: 1, size: 2, stride: 2 });
    /// # Ok(()) }
    /// ```
    pub fn rail_team(&self) -> Team {
        let l = self.lsa_size();
        Team { rank: (self.rank() / l) as u32, size: (self.nranks() / l) as u32, stride: l as u32 }
    }

    /// World ranks of this rank's LSA domain.
    ///
    /// ```
    /// # use ferrolink::{CommConfig, Communicator, Device, LsaMode};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// // Four ranks in LSA domains of two: {0, 1} and {2, 3}.
    /// let config = CommConfig { lsa: LsaMode::Size(2), ..CommConfig::from_env(dev.backend())? };
    /// let comms = Communicator::init_all_with(&vec![dev; 4], config)?;
    /// assert_eq!(comms[3].lsa_peers(), 2..4);
    /// # Ok(()) }
    /// ```
    pub fn lsa_peers(&self) -> std::ops::Range<usize> {
        let first = self.rank() - self.lsa_rank();
        first..first + self.lsa_size()
    }

    /// The scope LSA synchronization needs: [`Scope::Gpu`] when every LSA peer runs on this
    /// rank's GPU (virtual ranks, or processes sharing it under MPS; on the emulator, the
    /// same emulated device of one process), else [`Scope::Sys`] (peers on other GPUs see
    /// our writes only at system scope).
    ///
    /// ```
    /// # use ferrolink::{Communicator, Device};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let comms = Communicator::init_all(&[dev.clone(), dev])?;
    /// use ferrolink::device_api::arch::Scope;
    /// assert_eq!(comms[0].lsa_scope(), Scope::Gpu); // every LSA peer on this rank's device
    /// # Ok(()) }
    /// ```
    pub fn lsa_scope(&self) -> Scope {
        let me = &self.shared.peers[self.rank()];
        if self.lsa_peers().all(|p| self.shared.peers[p].uuid == me.uuid) { Scope::Gpu } else { Scope::Sys }
    }

    /// Whether `other` is a rank of the same communicator.
    ///
    /// ```
    /// # use ferrolink::{Communicator, Device};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let a = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// let b = Communicator::init_all(&[dev])?;
    /// assert!(a[0].same_comm(&a[1]));
    /// assert!(!a[0].same_comm(&b[0]));
    /// # Ok(()) }
    /// ```
    pub fn same_comm(&self, other: &Communicator) -> bool {
        self.shared.id == other.shared.id
    }

    pub(crate) fn control(&self) -> &Arc<CommControl> {
        &self.shared.control
    }

    pub(crate) fn bootstrap(&self) -> &Arc<dyn Bootstrap> {
        &self.shared.bootstrap
    }

    /// This rank's file-descriptor exchange (a Unix socket named after the communicator and
    /// the rank), opened on first use. A peer that sends before it is open retries until the
    /// bootstrap's timeout.
    pub(crate) fn fd_exchange(&self) -> Result<Arc<fdpass::FdExchange>> {
        if let Some(f) = self.shared.fds.get() {
            return Ok(f.clone());
        }
        let f = Arc::new(fdpass::FdExchange::new(self.shared.id, self.rank(), self.shared.bootstrap.timeout())?);
        Ok(self.shared.fds.get_or_init(|| f).clone())
    }

    /// Numbers this rank's next collective call; every rank gets the same number for the same
    /// call. The ranks compare it in their first exchange, so calls made in different orders
    /// are an error rather than a mix-up.
    pub(crate) fn next_collective(&self) -> u64 {
        self.shared.collectives.fetch_add(1, Ordering::Relaxed)
    }

    /// How many times [`Communicator::recover`] was called on this rank.
    pub(crate) fn recoveries(&self) -> u64 {
        self.shared.recoveries.load(Ordering::Relaxed)
    }

    /// Makes the communicator usable again after an error or an abort, without dropping
    /// anything (collective: every rank calls it). It
    /// 1. aborts the communicator if kernels of this rank still run, and waits (up to 10 s)
    ///    until its stream has drained;
    /// 2. replaces a failed stream ([`Stream::recover`]; on the emulator after a timeout,
    ///    panic or trap. A CUDA kernel fault breaks the device's context, and then this fails
    ///    with an error saying so);
    /// 3. returns this rank's device communicators' barriers (epochs, inboxes, wait records),
    ///    abort flag and fault record to their initial state, meets the other ranks, puts the
    ///    ranks sharing its GPU back in step (a call that failed on some of them only counted
    ///    there), and forgets the asynchronous error.
    ///
    /// Buffers, windows and device communicators stay valid; their contents are whatever the
    /// failed work left. MoE objects made before refuse further calls (their signals may
    /// count the failed call's rows): make new ones.
    ///
    /// ```
    /// # use ferrolink::{Communicator, Device};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let comms = Communicator::init_all(&[dev.clone(), dev])?;
    /// comms[0].abort();
    /// assert!(comms[1].synchronize().is_err());
    /// ferrolink::run_ranks(&comms, |c| c.recover())?; // every rank
    /// comms[1].synchronize()?;
    /// assert!(comms[0].async_error().is_none());
    /// # Ok(()) }
    /// ```
    pub fn recover(&self) -> Result<()> {
        // Counted first: even a recover that fails leaves MoE objects out of step.
        self.shared.recoveries.fetch_add(1, Ordering::Relaxed);
        let control = self.control();
        if self.stream.tail().is_some_and(|t| !t.finished()) {
            control.abort(Error::Aborted("recover() was called while kernels still ran".into()));
        }
        // Then a point after everything the stream queued or follows (recorded after the
        // abort: following a GPU group's launch that its last member has not queued waits
        // for it, and an abort ends that wait; the tail alone may be such a launch that never
        // ran, which does not cover the stream's own work).
        let drained = self.stream.record_completion().ok().or_else(|| self.stream.tail());
        let busy = || drained.as_ref().is_some_and(|t| !t.finished());
        let deadline = Instant::now() + RECOVER_DRAIN;
        while busy() {
            if Instant::now() >= deadline {
                return Err(Error::StreamFailed(format!(
                    "recover: rank {}'s kernels did not stop within {RECOVER_DRAIN:?} of the abort (a kernel that \
                     never reaches a wait, or a broken device); the device cannot be recovered in this process",
                    self.rank()
                )));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        self.stream.recover()?;
        control.reset_sources_of(self.rank())?;
        self.barrier()?;
        // Every rank is past its failed work and none calls a collective until the barrier
        // below: the ranks sharing this GPU can be put back in step.
        crate::coll::after_recover(self)?;
        control.clear();
        // Nobody may start new work before every rank has cleared its state.
        self.barrier()?;
        if self.rank() == 0 {
            tracing::info!(target: "ferrolink::comm", comm = self.shared.id, "communicator recovered");
        }
        Ok(())
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

/// Runs `f` for each rank of `comms` (ranks of one process, from [`Communicator::init_all`]) on
/// a thread of its own, and returns the results in rank order (the first error if any): the
/// way to run per-rank code, written for one process per rank, with every rank in this
/// process. Per-rank collective calls inside `f` meet through the in-process bootstrap.
///
/// ```
/// # use ferrolink::{Communicator, Device};
/// # fn main() -> ferrolink::Result<()> {
/// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// let comms = Communicator::init_all(&[dev.clone(), dev])?;
/// let out = ferrolink::run_ranks(&comms, |c| {
///     c.barrier()?; // a per-rank collective: every rank runs at once
///     Ok(10 * c.rank())
/// })?;
/// assert_eq!(out, [0, 10]);
/// # Ok(()) }
/// ```
pub fn run_ranks<T: Send>(comms: &[Communicator], f: impl Fn(&Communicator) -> Result<T> + Sync) -> Result<Vec<T>> {
    on_rank_threads(comms.len(), |r| f(&comms[r]))
}

/// How long [`Communicator::recover`] waits for kernels to stop after it aborted them.
const RECOVER_DRAIN: Duration = Duration::from_secs(10);

/// [`Communicator::recover`] for every rank of a communicator in this process (pass all
/// ranks, in rank order): the per-rank calls run on threads.
///
/// ```
/// # use ferrolink::{Communicator, Device};
/// # fn main() -> ferrolink::Result<()> {
/// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// let comms = Communicator::init_all(&[dev.clone(), dev])?;
/// comms[1].abort();
/// assert!(ferrolink::recover(&comms[..1]).is_err()); // every rank, or none
/// ferrolink::recover(&comms)?;
/// assert!(comms[1].async_error().is_none());
/// # Ok(()) }
/// ```
pub fn recover(comms: &[Communicator]) -> Result<()> {
    check_all_ranks(comms, "recover")?;
    on_rank_threads(comms.len(), |r| comms[r].recover()).map(drop)
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
