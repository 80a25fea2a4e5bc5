//! Communicators: the ranks of a job, their devices and streams, and their teams.
//!
//! [`Communicator::init_all`] creates every rank of a single-process job at once (like
//! `ncclCommInitAll`): one rank per entry of the device list. A device may appear several
//! times: those ranks are *virtual ranks* sharing one GPU (or the emulator), each with its
//! own stream. Multi-process bootstrap comes later; the types keep rank-local state
//! ([`Communicator`]) apart from job-wide state so that it can.

use crate::device::DeviceImpl;
use crate::stream::Stream;
use crate::{Backend, Device, Error, Result};
use ferrolink_device::arch::Scope;
use ferrolink_device::comm::Team;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Job-wide facts, shared by all ranks' handles.
pub(crate) struct CommShared {
    pub(crate) id: u64,
    pub(crate) devices: Vec<Device>,
    pub(crate) lsa_size: usize,
    pub(crate) backend: Backend,
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
    /// device makes virtual ranks on it. All devices must use the same backend.
    ///
    /// The LSA domain (ranks that load/store each other's windows) is every rank when all
    /// pairs of GPUs have peer access (and always on one GPU or on the emulator); otherwise
    /// it is the ranks of one GPU when every GPU holds the same number of consecutive ranks,
    /// else each rank alone.
    pub fn init_all(devices: &[Device]) -> Result<Vec<Communicator>> {
        if devices.is_empty() {
            return Err(Error::InvalidArgument("init_all needs at least one device".into()));
        }
        let backend = devices[0].backend();
        if devices.iter().any(|d| d.backend() != backend) {
            return Err(Error::InvalidArgument("init_all: every rank's device must use the same backend".into()));
        }
        let lsa_size = lsa_domain_size(devices)?;
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        let shared = Arc::new(CommShared {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            devices: devices.to_vec(),
            lsa_size,
            backend,
        });
        tracing::debug!(nranks = devices.len(), lsa_size, %backend, "communicator created");
        devices
            .iter()
            .enumerate()
            .map(|(rank, dev)| {
                Ok(Communicator { shared: shared.clone(), rank, stream: Arc::new(dev.create_stream()?) })
            })
            .collect()
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

    /// This rank's stream (non-blocking: ranks' kernels run concurrently).
    pub fn stream(&self) -> &Stream {
        &self.stream
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
}

/// Launches work for every rank of a group: calls `launch(comm)` for each rank in order,
/// as one unit with respect to ferrolink's context-wide waits (device synchronization, module
/// loads, frees) made by other threads, which otherwise could stall a GPU whose first ranks
/// already spin waiting for ranks not yet launched. Use it whenever the kernels of different
/// ranks wait for each other (LSA barriers, signals).
///
/// Inside `launch`, do only launches and other non-blocking calls: a host access to device
/// memory there waits for kernels that wait for ranks launched after it.
///
/// ```
/// # use ferrolink::{Communicator, Device};
/// # fn main() -> ferrolink::Result<()> {
/// let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
/// ferrolink::launch_all(&comms, |c| {
///     // e.g. `unsafe { c.stream().launch(module, &kernel, cfg, (dev_comms[c.rank()].dev_comm(), ..)) }`
///     let _ = c.rank();
///     Ok(())
/// })?;
/// # Ok(()) }
/// ```
pub fn launch_all(comms: &[Communicator], mut launch: impl FnMut(&Communicator) -> Result<()>) -> Result<()> {
    crate::cuda::group_launch(|| comms.iter().try_for_each(&mut launch))
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

fn lsa_domain_size(devices: &[Device]) -> Result<usize> {
    let n = devices.len();
    let cuda: Vec<&crate::cuda::CudaDevice> = devices
        .iter()
        .filter_map(|d| match &d.0.imp {
            DeviceImpl::Cuda(c) => Some(c),
            DeviceImpl::Cpu(_) => None,
        })
        .collect();
    if cuda.is_empty() {
        return Ok(n); // the emulator: all host memory is shared
    }
    let mut all_pairs = true;
    for a in &cuda {
        for b in &cuda {
            all_pairs &= a.can_access_peer(b)?;
        }
    }
    if all_pairs {
        return Ok(n);
    }
    // Ranks of one GPU only: consecutive and equally many per GPU.
    let per_gpu = devices.iter().take_while(|d| d.same_as(&devices[0])).count();
    let grouped = n.is_multiple_of(per_gpu) && devices.chunks(per_gpu).all(|c| c.iter().all(|d| d.same_as(&c[0])));
    Ok(if grouped { per_gpu } else { 1 })
}
