//! Device communicators: the per-rank [`DevComm`] value kernels receive, and the host
//! resources behind it (NCCL's `ncclDevCommCreate`): the barrier window and epochs, the
//! window table, and the control block (abort flag, fault record, wait records) in
//! host-mapped memory.

mod diagnostics;
pub mod requirements;

use crate::comm::control::{ControlSource, StalledWait, WaitOn};
use crate::comm::{Communicator, check_all_ranks, on_rank_threads};
use crate::mem::window::Window;
use crate::runtime::device::Device;
use crate::runtime::host_mapped::HostMapped;
use crate::runtime::launch::{LaunchArg, LaunchTracking, sealed::Sealed};
use crate::runtime::lifetime::{self, Uses, lock};
use crate::runtime::memory::DeviceBuffer;
use crate::runtime::stream::StreamObserver;
use crate::{Error, Result};
use ferrolink_device::barrier::{inbox_bytes, inbox_row_bytes, seq_reached};
use ferrolink_device::comm::DevCommHeader;
use ferrolink_device::{DevComm, DevControl, DevErrorRecord, DevWindow, LsaBarrierHandle, WaitRecord};
pub use requirements::{DevCommRequirements, DevResource, ResourceId, ResourceRequest};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

/// Where the wait records start in the control block (after the [`DevControl`]).
const WAIT_RECORDS_OFFSET: usize = std::mem::size_of::<DevControl>().next_multiple_of(64);

/// One rank's device communicator resources. Registered with its communicator as a
/// [`ControlSource`] and with the streams it is launched on as a [`StreamObserver`].
struct DevCommResources {
    dev: Device,
    rank: usize,
    lsa_rank: usize,
    lsa_size: usize,
    barrier_total: u32,
    control: HostMapped,
    barrier_window: Window,
    epochs: Mutex<DeviceBuffer<u32>>,
    table: Mutex<DeviceBuffer<DevWindow>>,
    windows: Mutex<Vec<Window>>,
    uses: Arc<Uses>,
    /// Per barrier, the last epoch the watchdog found complete (no need to look again).
    known_done: Mutex<HashMap<u32, u32>>,
    /// The GIN resources and proxy, if asked for (stopped when this is dropped, after the
    /// kernels that used it).
    gin: Option<crate::gin::GinOwner>,
}

impl DevCommResources {
    fn control_word(&self, offset: usize) -> &AtomicU32 {
        debug_assert!(offset + 4 <= self.control.len() && offset.is_multiple_of(4));
        // SAFETY: `offset` is a 4-byte aligned word inside the live control block (host
        // memory); kernels access it only with word atomics, and so does the host.
        unsafe { AtomicU32::from_ptr(self.control.host_ptr().add(offset) as *mut u32) }
    }

    fn control_dword(&self, offset: usize) -> &AtomicU64 {
        debug_assert!(offset + 8 <= self.control.len() && offset.is_multiple_of(8));
        // SAFETY: as in `control_word`, for an 8-byte aligned word.
        unsafe { AtomicU64::from_ptr(self.control.host_ptr().add(offset) as *mut u64) }
    }

    fn fault_record(&self) -> Option<DevErrorRecord> {
        let e = std::mem::offset_of!(DevControl, error);
        let w = |f: usize| self.control_word(e + f).load(Ordering::Acquire);
        let code = w(std::mem::offset_of!(DevErrorRecord, code));
        if code == 0 {
            return None;
        }
        Some(DevErrorRecord {
            code,
            rank: w(std::mem::offset_of!(DevErrorRecord, rank)),
            cta: w(std::mem::offset_of!(DevErrorRecord, cta)),
            thread: w(std::mem::offset_of!(DevErrorRecord, thread)),
            a: self.control_dword(e + std::mem::offset_of!(DevErrorRecord, a)).load(Ordering::Acquire),
            b: self.control_dword(e + std::mem::offset_of!(DevErrorRecord, b)).load(Ordering::Acquire),
        })
    }

    fn wait_record(&self, i: u32) -> WaitRecord {
        let base = WAIT_RECORDS_OFFSET + i as usize * std::mem::size_of::<WaitRecord>();
        let w = |f: usize| self.control_word(base + f).load(Ordering::Acquire);
        WaitRecord {
            epoch: w(std::mem::offset_of!(WaitRecord, epoch)),
            cta: w(std::mem::offset_of!(WaitRecord, cta)),
            active: w(std::mem::offset_of!(WaitRecord, active)),
            _reserved: 0,
        }
    }
}

impl ControlSource for DevCommResources {
    fn rank(&self) -> usize {
        self.rank
    }

    fn raise_abort(&self) {
        self.control_word(std::mem::offset_of!(DevControl, abort)).store(1, Ordering::SeqCst);
    }

    fn fault(&self) -> Option<String> {
        self.fault_record().map(|r| diagnostics::describe_fault(&r))
    }

    fn stalled_waits(&self) -> Result<Vec<StalledWait>> {
        let mut out = Vec::new();
        let mut done = lock(&self.known_done);
        let mut row = vec![0u32; self.lsa_size];
        for i in 0..self.barrier_total {
            let r = self.wait_record(i);
            if r.active == 0 || done.get(&i) == Some(&r.epoch) {
                continue;
            }
            self.barrier_window.peek_words(i as usize * inbox_row_bytes(self.lsa_size as u32), &mut row)?;
            let first = self.rank - self.lsa_rank;
            let missing: Vec<usize> =
                row.iter().enumerate().filter(|(_, v)| !seq_reached(**v, r.epoch)).map(|(p, _)| first + p).collect();
            if missing.is_empty() {
                done.insert(i, r.epoch);
            } else {
                out.push(StalledWait {
                    rank: self.rank,
                    cta: r.cta,
                    on: WaitOn::LsaBarrier { barrier: i, epoch: r.epoch },
                    missing,
                });
            }
        }
        if let Some(gin) = &self.gin {
            out.extend(gin.0.stalled_waits()?);
        }
        Ok(out)
    }

    fn reset(&self) -> Result<()> {
        let mut epochs = lock(&self.epochs);
        let zeros = vec![0u32; epochs.len()];
        epochs.copy_from_host(&zeros)?;
        drop(epochs);
        self.barrier_window.zero(0, self.barrier_window.size())?;
        for off in (0..self.control.len()).step_by(4) {
            self.control_word(off).store(0, Ordering::SeqCst);
        }
        lock(&self.known_done).clear();
        Ok(())
    }
}

impl StreamObserver for DevCommResources {
    fn explain_failure(&self, err: &Error) -> Option<Error> {
        self.fault().map(|report| Error::DeviceFault { report, cause: err.to_string() })
    }

    fn external_error(&self) -> Option<Error> {
        None
    }
}

/// One rank's device communicator: owns the barrier window, the epoch words, the window
/// table and the control block that its [`DevComm`] points to. Pass `&handle` to launches
/// (the launch then keeps it alive until the kernel ends, and the kernel's fault reports
/// become the stream's errors). Dropping it never waits for the device.
///
/// ```
/// # use ferrolink::{Communicator, DevCommRequirements, Device, LaunchConfig};
/// use ferrolink::device_api::kernels::lsa::lsa_ring_exchange;
/// # fn main() -> ferrolink::Result<()> {
/// let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
/// let bufs = comms.iter().map(|c| c.mem_alloc(64)).collect::<ferrolink::Result<Vec<_>>>()?;
/// let windows = ferrolink::register_window(&comms, bufs)?;
/// let handles = ferrolink::create_dev_comms(&comms, &DevCommRequirements::default())?;
/// let srcs = [dev.alloc_from(&[10u8; 64])?, dev.alloc_from(&[11u8; 64])?];
/// let module = dev.builtin_module()?;
/// ferrolink::launch_all(&comms, |c| {
///     let r = c.rank();
///     // SAFETY: the kernel's contract: the source and the window slots hold 64 bytes; one CTA
///     // uses barrier 0 of the default 32; every rank launches the same grid.
///     unsafe {
///         let args = (&handles[r], &windows[r], &srcs[r], 64usize);
///         c.stream().launch(module, &lsa_ring_exchange, LaunchConfig::linear(1, 32), args)
///     }
/// })?;
/// for c in &comms {
///     c.synchronize()?;
/// }
/// // Each rank's slot now holds the previous rank's bytes.
/// assert_eq!(windows[0].read::<u8>(0, 64)?, [11u8; 64]);
/// assert_eq!(windows[1].read::<u8>(0, 64)?, [10u8; 64]);
/// # Ok(()) }
/// ```
pub struct DevCommHandle {
    res: Arc<DevCommResources>,
    dev_comm: DevComm,
    resources: Vec<DevResource>,
}

impl std::fmt::Debug for DevCommHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevCommHandle").field("dev_comm", &self.dev_comm).finish()
    }
}

impl Drop for DevCommHandle {
    fn drop(&mut self) {
        let mut waits = self.res.uses.pending_for_free();
        waits.extend(self.res.dev.0.untracked.pending_for_free());
        lifetime::retire(waits, Box::new(self.res.clone()), "device communicator");
    }
}

/// Creates every rank's device communicator for the ranks of one process (pass all ranks, in
/// rank order): runs [`Communicator::create_dev_comm`] for each rank on a thread.
///
/// ```
/// # use ferrolink::{Communicator, DevCommRequirements, Device};
/// # fn main() -> ferrolink::Result<()> {
/// let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// let comms = Communicator::init_all(&[dev.clone(), dev])?;
/// let reqs = DevCommRequirements { lsa_barrier_count: 4, ..Default::default() };
/// let handles = ferrolink::create_dev_comms(&comms, &reqs)?;
/// assert_eq!(handles.len(), 2);
/// assert_eq!(handles[1].dev_comm().lsa_barrier_total, 4);
/// # Ok(()) }
/// ```
pub fn create_dev_comms(comms: &[Communicator], reqs: &DevCommRequirements) -> Result<Vec<DevCommHandle>> {
    check_all_ranks(comms, "create_dev_comms")?;
    on_rank_threads(comms.len(), |r| comms[r].create_dev_comm(reqs))
}

/// Lays out the barrier sets: the default one first, then each request's, back to back.
/// Returns the total and the requested resources' handles.
fn barrier_sets(reqs: &DevCommRequirements) -> Result<(u32, Vec<DevResource>)> {
    if reqs.lsa_barrier_count == 0 {
        return Err(Error::InvalidArgument("create_dev_comm: lsa_barrier_count must be at least 1".into()));
    }
    let mut total = reqs.lsa_barrier_count;
    let mut resources = Vec::with_capacity(reqs.resources.len());
    for r in &reqs.resources {
        match *r {
            ResourceRequest::LsaBarriers { count } => {
                if count == 0 {
                    return Err(Error::InvalidArgument(
                        "create_dev_comm: a barrier set needs at least 1 barrier".into(),
                    ));
                }
                resources.push(DevResource::LsaBarriers(LsaBarrierHandle { first: total, count }));
                total = total
                    .checked_add(count)
                    .ok_or_else(|| Error::InvalidArgument("create_dev_comm: too many barriers requested".into()))?;
            }
        }
    }
    Ok((total, resources))
}

impl Communicator {
    /// Creates this rank's device communicator (collective: every rank calls it with the same
    /// requirements; NCCL's `ncclDevCommCreate`): registers the barrier window (one inbox row
    /// per barrier of every set) and allocates zeroed epoch words, the window table and the
    /// control block.
    ///
    /// ```
    /// # use ferrolink::{Communicator, DevCommRequirements, Device};
    /// # fn main() -> ferrolink::Result<()> {
    /// let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let comms = Communicator::init_all(&[dev.clone(), dev])?;
    /// let reqs = DevCommRequirements::default();
    /// let handles = ferrolink::run_ranks(&comms, |c| c.create_dev_comm(&reqs))?;
    /// let dc = handles[1].dev_comm();
    /// assert_eq!((dc.rank, dc.nranks, dc.lsa_size), (1, 2, 2));
    /// assert_eq!(dc.lsa_barrier.count, reqs.lsa_barrier_count);
    /// # Ok(()) }
    /// ```
    pub fn create_dev_comm(&self, reqs: &DevCommRequirements) -> Result<DevCommHandle> {
        let (total, resources) = barrier_sets(reqs)?;
        let lsa = self.lsa_size() as u32;
        let buffer = self.mem_alloc(inbox_bytes(total, lsa))?;
        let barrier_window = self.register_window(buffer)?;
        let control_bytes = WAIT_RECORDS_OFFSET + total as usize * std::mem::size_of::<WaitRecord>();
        let dev = self.device();
        // The epoch words, then the fault claim word (DevComm::fault_claim).
        let epochs = dev.alloc::<u32>(total as usize + 1)?;
        let table = dev.alloc::<DevWindow>(reqs.window_capacity.max(1) as usize)?;
        let control = HostMapped::alloc(dev, control_bytes)?;
        let (dev_gin, gin) = if reqs.wants_gin() {
            let shape = crate::gin::GinShape {
                contexts: reqs.gin_context_count.max(1),
                signals: reqs.gin_signal_count,
                counters: reqs.gin_counter_count,
                depth: if reqs.gin_queue_depth == 0 { 64 } else { reqs.gin_queue_depth },
                barriers: reqs.gin_barrier_count,
                mode: reqs.gin_mode,
                transport: reqs.gin_transport,
            };
            let (d, g) = crate::gin::create(self, shape)?;
            (d, Some(g))
        } else {
            (ferrolink_device::gin::DevGin::default(), None)
        };
        let dev_comm = DevComm {
            header: DevCommHeader::CURRENT,
            rank: self.rank() as u32,
            nranks: self.nranks() as u32,
            lsa_rank: self.lsa_rank() as u32,
            lsa_size: lsa,
            lsa_scope_code: self.lsa_scope().code(),
            lsa_barrier_total: total,
            lsa_barrier: LsaBarrierHandle { first: 0, count: reqs.lsa_barrier_count },
            barrier_window: barrier_window.dev_window(),
            barrier_epochs: epochs.addr(),
            windows: table.addr(),
            window_count: 0,
            _reserved: 0,
            control: control.device_addr(),
            wait_records: control.device_addr() + WAIT_RECORDS_OFFSET as u64,
            fault_claim: epochs.addr() + u64::from(total) * 4,
            gin: dev_gin,
        };
        let res = Arc::new(DevCommResources {
            dev: dev.clone(),
            rank: self.rank(),
            lsa_rank: self.lsa_rank(),
            lsa_size: lsa as usize,
            barrier_total: total,
            control,
            barrier_window,
            epochs: Mutex::new(epochs),
            table: Mutex::new(table),
            windows: Mutex::new(Vec::new()),
            uses: Arc::default(),
            known_done: Mutex::new(HashMap::new()),
            gin,
        });
        let source: Weak<dyn ControlSource> = Arc::downgrade(&(res.clone() as Arc<dyn ControlSource>));
        self.control().add_source(source);
        // Every rank is done with its allocations (some driver calls among them may wait for
        // the device) before any rank can launch a kernel that waits for the others.
        self.barrier()?;
        if self.rank() == 0 {
            tracing::debug!(target: "ferrolink::devcomm", nranks = self.nranks(), barriers = total, "device communicators created");
        }
        Ok(DevCommHandle { res, dev_comm, resources })
    }
}

impl DevCommHandle {
    /// The value to pass to kernels, raw (an untracked launch: prefer passing `&handle`).
    ///
    /// ```
    /// # use ferrolink::{Communicator, DevCommRequirements, Device};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev])?;
    /// # let handles = ferrolink::create_dev_comms(&comms, &DevCommRequirements::default())?;
    /// let dc = handles[1].dev_comm();
    /// assert_eq!((dc.rank, dc.nranks, dc.window_count), (1, 2, 0));
    /// # Ok(()) }
    /// ```
    pub fn dev_comm(&self) -> DevComm {
        self.dev_comm
    }

    /// This handle's rank.
    ///
    /// ```
    /// # use ferrolink::{Communicator, DevCommRequirements, Device};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev])?;
    /// # let handles = ferrolink::create_dev_comms(&comms, &DevCommRequirements::default())?;
    /// assert_eq!(handles[1].rank(), 1);
    /// # Ok(()) }
    /// ```
    pub fn rank(&self) -> usize {
        self.res.rank
    }

    /// Whether its GIN puts all go through the proxy, LSA peers' too (`FERROLINK_GIN=proxy`):
    /// then no kernel of it reaches a peer by direct stores. False without GIN.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// use ferrolink::{Communicator, Device, DevCommRequirements};
    /// let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let comms = Communicator::init_all(&[dev.clone(), dev])?;
    /// let handles = ferrolink::run_ranks(&comms, |c| c.create_dev_comm(&DevCommRequirements::default()))?;
    /// assert!(!handles[0].uses_proxy());
    /// # Ok(())
    /// # }
    /// ```
    pub fn uses_proxy(&self) -> bool {
        self.dev_comm.gin.flags & ferrolink_device::gin::flags::FORCE_PROXY != 0
    }

    /// The resource requested as `id` ([`DevCommRequirements::request`]).
    ///
    /// ```
    /// # use ferrolink::{Communicator, DevCommRequirements, DevResource, Device, ResourceRequest};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev])?;
    /// let mut reqs = DevCommRequirements::default();
    /// let id = reqs.request(ResourceRequest::LsaBarriers { count: 4 });
    /// let handles = ferrolink::create_dev_comms(&comms, &reqs)?;
    /// assert!(matches!(handles[0].resource(id)?, DevResource::LsaBarriers(set) if set.count == 4));
    /// // An id of other requirements, beyond this handle's requests, is an error.
    /// let mut other = DevCommRequirements::default();
    /// other.request(ResourceRequest::LsaBarriers { count: 1 });
    /// let second = other.request(ResourceRequest::LsaBarriers { count: 1 });
    /// assert!(handles[0].resource(second).is_err());
    /// # Ok(()) }
    /// ```
    pub fn resource(&self, id: ResourceId) -> Result<DevResource> {
        self.resources.get(id.0).copied().ok_or_else(|| {
            Error::InvalidArgument(format!(
                "resource id {} was not requested for this device communicator ({} requested)",
                id.0,
                self.resources.len()
            ))
        })
    }

    /// The LSA barrier set requested as `id`.
    ///
    /// ```
    /// # use ferrolink::{Communicator, DevCommRequirements, Device, ResourceRequest};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev])?;
    /// let mut reqs = DevCommRequirements { lsa_barrier_count: 16, ..Default::default() };
    /// let a = reqs.request(ResourceRequest::LsaBarriers { count: 8 });
    /// let b = reqs.request(ResourceRequest::LsaBarriers { count: 2 });
    /// let handles = ferrolink::create_dev_comms(&comms, &reqs)?;
    /// // The sets follow the default 16 barriers, back to back.
    /// let (sa, sb) = (handles[0].lsa_barriers(a)?, handles[0].lsa_barriers(b)?);
    /// assert_eq!((sa.first, sa.count, sb.first, sb.count), (16, 8, 24, 2));
    /// # Ok(()) }
    /// ```
    pub fn lsa_barriers(&self, id: ResourceId) -> Result<LsaBarrierHandle> {
        match self.resource(id)? {
            DevResource::LsaBarriers(h) => Ok(h),
        }
    }

    /// GIN signal `id` of this rank as kernels read it (`Gin::read_signal`): a snapshot, for
    /// debugging; it may change while kernels run. An error if the device communicator has no
    /// GIN or no such signal.
    ///
    /// ```
    /// # use ferrolink::{Communicator, DevCommRequirements, Device};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev])?;
    /// let reqs = DevCommRequirements { gin_signal_count: 2, ..Default::default() };
    /// let handles = ferrolink::create_dev_comms(&comms, &reqs)?;
    /// assert_eq!(handles[0].gin_signal(1)?, 0); // no kernel has signalled yet
    /// assert!(handles[0].gin_signal(2).is_err()); // the ids are 0..2
    /// # Ok(()) }
    /// ```
    pub fn gin_signal(&self, id: u32) -> Result<u64> {
        self.gin()?.0.signal_value(id)
    }

    /// GIN counter `id` of this rank as kernels read it (`Gin::read_counter`): a snapshot,
    /// for debugging.
    ///
    /// ```
    /// # use ferrolink::{Communicator, DevCommRequirements, Device};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev])?;
    /// let reqs = DevCommRequirements { gin_counter_count: 1, ..Default::default() };
    /// let handles = ferrolink::create_dev_comms(&comms, &reqs)?;
    /// assert_eq!(handles[1].gin_counter(0)?, 0);
    /// assert!(handles[1].gin_counter(1).is_err()); // only counter 0 exists
    /// # Ok(()) }
    /// ```
    pub fn gin_counter(&self, id: u32) -> Result<u64> {
        self.gin()?.0.counter_value(id)
    }

    fn gin(&self) -> Result<&crate::gin::GinOwner> {
        self.res.gin.as_ref().ok_or_else(|| {
            Error::InvalidArgument(
                "this device communicator has no GIN resources: set a gin_* count in DevCommRequirements".into(),
            )
        })
    }

    /// The fault a kernel reported through this device communicator, if any.
    ///
    /// ```
    /// # use ferrolink::{Communicator, DevCommRequirements, Device, LaunchConfig};
    /// use ferrolink::device_api::kernels::lsa::lsa_barrier_try_sync;
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// // One barrier, but two CTAs: CTA 1 has no barrier of its own, a reported fault.
    /// let reqs = DevCommRequirements { lsa_barrier_count: 1, ..Default::default() };
    /// let handles = ferrolink::create_dev_comms(&comms, &reqs)?;
    /// assert_eq!(handles[0].fault(), None);
    /// let mut status = [dev.alloc::<u32>(2)?, dev.alloc::<u32>(2)?];
    /// let module = dev.builtin_module()?;
    /// ferrolink::launch_all(&comms, |c| {
    ///     let r = c.rank();
    ///     let args = (&handles[r], 1_000_000_000u64, &mut status[r]);
    ///     // SAFETY: `status` holds a word per CTA; the grid past the barrier set is checked.
    ///     unsafe { c.stream().launch(module, &lsa_barrier_try_sync, LaunchConfig::linear(2, 32), args) }
    /// })?;
    /// assert!(comms[0].synchronize().is_err());
    /// assert!(handles[0].fault().unwrap().contains("outside its barrier set"));
    /// # Ok(()) }
    /// ```
    pub fn fault(&self) -> Option<String> {
        self.res.fault()
    }

    /// Adds `window` (this rank's handle, same communicator) to the device-side window table,
    /// so kernels can use `DevComm::window(index)`; returns the index. [`dev_comm`](Self::dev_comm)
    /// returns a copy: take it again after adding windows (an older copy's `window_count`
    /// does not include them, and `window(i)` returns `None` for them). Waits for the kernels
    /// that use the table (it must not change under them). The window stays alive at least
    /// as long as this handle.
    ///
    /// ```
    /// # use ferrolink::{Communicator, DevCommRequirements, Device};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev])?;
    /// let bufs = comms.iter().map(|c| c.mem_alloc(256)).collect::<ferrolink::Result<Vec<_>>>()?;
    /// let windows = ferrolink::register_window(&comms, bufs)?;
    /// let mut handles = ferrolink::create_dev_comms(&comms, &DevCommRequirements::default())?;
    /// for (h, w) in handles.iter_mut().zip(&windows) {
    ///     assert_eq!(h.add_window(w)?, 0); // its index in the table
    /// }
    /// assert_eq!(handles[0].dev_comm().window_count, 1); // a fresh copy sees it
    /// assert!(handles[0].add_window(&windows[1]).is_err()); // another rank's window
    /// # Ok(()) }
    /// ```
    pub fn add_window(&mut self, window: &Window) -> Result<u32> {
        if window.comm_id() != self.res.barrier_window.comm_id() || window.rank() != self.res.rank {
            return Err(Error::InvalidArgument(
                "add_window: the window belongs to another communicator or rank".into(),
            ));
        }
        let index = self.dev_comm.window_count;
        let mut table = lock(&self.res.table);
        if index as usize >= table.len() {
            return Err(Error::InvalidArgument(format!(
                "add_window: the window table is full ({} windows; raise DevCommRequirements::window_capacity)",
                table.len()
            )));
        }
        lifetime::wait_all(&self.res.uses.pending(), "add_window")?;
        let mut entries = table.to_vec()?;
        entries[index as usize] = window.dev_window();
        table.copy_from_host(&entries)?;
        lock(&self.res.windows).push(window.clone());
        self.dev_comm.window_count += 1;
        Ok(index)
    }
}

impl Sealed for &DevCommHandle {}

impl LaunchArg for &DevCommHandle {
    type Param = DevComm;
    fn param(&self) -> DevComm {
        self.dev_comm
    }
    fn track(&self, t: &mut LaunchTracking) {
        t.expect_device(&self.res.dev, "device communicator");
        t.holds.push(self.res.uses.clone());
        // Kernels reach the table's windows through `DevComm::window(i)`: their host copies
        // must wait for this launch too.
        for w in lock(&self.res.windows).iter() {
            t.holds.push(w.uses().clone());
        }
        let observer: Weak<dyn StreamObserver> = Arc::downgrade(&(self.res.clone() as Arc<dyn StreamObserver>));
        t.observers.push(observer);
    }
}

/// Returns every rank's LSA barriers to their initial state (zero epochs, empty inboxes, no
/// wait records) and clears the device-side abort flag and fault record, after waiting for the
/// kernels that use them. Collective: pass every rank's handle of one communicator, in rank
/// order. It leaves the communicator's host-side state alone: after an abort, use
/// [`crate::recover`], which does this and also replaces failed streams and forgets the
/// asynchronous error.
///
/// ```
/// # use ferrolink::{Communicator, DevCommRequirements, Device};
/// # fn main() -> ferrolink::Result<()> {
/// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// # let comms = Communicator::init_all(&[dev.clone(), dev])?;
/// let mut handles = ferrolink::create_dev_comms(&comms, &DevCommRequirements::default())?;
/// ferrolink::reset_barriers(&mut handles)?;
/// // Collective: one rank's handle alone is refused.
/// assert!(ferrolink::reset_barriers(&mut handles[..1]).is_err());
/// # Ok(()) }
/// ```
pub fn reset_barriers(handles: &mut [DevCommHandle]) -> Result<()> {
    let Some(first) = handles.first() else { return Ok(()) };
    let ranks = first.dev_comm.nranks as usize;
    let comm = first.res.barrier_window.comm_id();
    if handles.len() != ranks
        || handles.iter().enumerate().any(|(r, h)| h.res.barrier_window.comm_id() != comm || h.res.rank != r)
    {
        return Err(Error::InvalidArgument(format!(
            "reset_barriers is collective: pass all {ranks} ranks' handles of one communicator, in rank order"
        )));
    }
    for h in handles.iter() {
        lifetime::wait_all(&h.res.uses.pending(), "reset_barriers")?;
        h.res.reset()?;
    }
    Ok(())
}
