//! Window registration ([`register_window`], like `ncclCommWindowRegister`): every LSA peer's
//! allocation mapped into one flat virtual range per GPU, slot `p` at `base + p * stride`,
//! with access granted to that GPU; kernels reach a peer's slot with
//! [`DevWindow::lsa_ptr`](ferrolink_device::DevWindow::lsa_ptr).
//!
//! # Lifetimes
//! A rank's [`Window`] owns its buffer, its GPU's flat mapping (shared with the other ranks of
//! this process on that GPU) and the memory it imported from other processes. Launches that
//! pass `&window` record their use of it; host copies wait for this process's kernels that
//! used it; and when a rank's last handle (its [`Window`] clones, and every `DevCommHandle`
//! it was added to) is dropped, its part is retired: unmapped and released once this
//! process's kernels that used the window have finished (and any untracked launch on its
//! devices), without waiting for a device. Physical memory lives on while another rank, in
//! any process, still maps it: no rank can free memory under a peer's kernel.

use crate::comm::{Communicator, check_all_ranks, on_rank_threads};
use crate::mem::symmetric::SymBuffer;
use crate::runtime::backend::{AddressRange, DeviceKey, PhysicalMemory};
use crate::runtime::device::Device;
use crate::runtime::launch::{LaunchArg, LaunchTracking, sealed::Sealed};
use crate::runtime::lifetime::{self, Completion, Uses, lock};
use crate::runtime::memory::TrackedPtr;
use crate::{Error, Result};
use bytemuck::Pod;
use ferrolink_device::DevWindow;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// One GPU's flat mapping of every LSA peer's buffer, shared by this process's ranks on that
/// GPU. Dropping it unmaps the range, then releases its references to the physical memory.
struct FlatMapping {
    range: Box<dyn AddressRange>,
    _phys: Vec<Arc<dyn PhysicalMemory>>,
}

/// What this process's ranks of one window share: the uses of their kernels (peers write
/// into each other's slots), their buffers (while the window is being registered), and the
/// flat mapping of each of their GPUs.
struct LocalWindow {
    /// Each of this process's ranks' use records ([`WindowRank::uses`]), read together by a
    /// host access or a release: any rank's kernel may write into any slot.
    ranks_uses: Mutex<Vec<Arc<Uses>>>,
    devices: Mutex<Vec<Device>>,
    phys: Mutex<HashMap<usize, Arc<dyn PhysicalMemory>>>,
    flat: Mutex<HashMap<(DeviceKey, usize), Arc<FlatMapping>>>,
    /// Serializes host reads and writes of the window's buffers: handles are `Clone` and
    /// `Send`, and on the CPU backend two unsynchronized host copies into one slot would be a
    /// data race on host memory.
    host_access: Mutex<()>,
}

impl LocalWindow {
    /// Everything a host access or a release must wait for: every kernel of this process
    /// that used the window, and untracked launches on its devices. (Kernels of other
    /// processes are theirs to order: see `Window::copy_to_host`.)
    fn pending(&self) -> Vec<Completion> {
        let mut w: Vec<Completion> = lock(&self.ranks_uses).iter().flat_map(|u| u.pending()).collect();
        for d in lock(&self.devices).iter() {
            w.extend(d.0.untracked.pending());
        }
        w
    }

    /// What releasing the window waits for: [`LocalWindow::pending`] and keepers (captured
    /// graphs that use it).
    fn pending_for_free(&self) -> Vec<Completion> {
        let mut w: Vec<Completion> = lock(&self.ranks_uses).iter().flat_map(|u| u.pending_for_free()).collect();
        for d in lock(&self.devices).iter() {
            w.extend(d.0.untracked.pending_for_free());
        }
        w
    }
}

/// Windows being registered in this process, by (communicator, collective call).
type Registering = Mutex<HashMap<(u64, u64), Arc<LocalWindow>>>;

/// Windows being registered in this process: how the ranks of one process find each other's
/// buffers and mappings.
fn registering() -> &'static Registering {
    static R: OnceLock<Registering> = OnceLock::new();
    R.get_or_init(|| Mutex::new(HashMap::new()))
}

/// A rank's part of a window: its GPU's flat mapping, its buffer, and the memory it imported.
type RankMemory = (Option<Arc<FlatMapping>>, SymBuffer, Vec<Arc<dyn PhysicalMemory>>);

/// Every live window of this process, by (communicator, rank, window id): how GIN's proxy
/// finds the memory a descriptor names. An entry outlives the handles while the memory is
/// retiring (its kernels may still post puts that name it): see [`LiveWindow`].
type LiveWindows = Mutex<HashMap<(u64, usize, u32), LiveWindow>>;

/// What the registry keeps of a window: its handle (while one lives) and, for after the last
/// handle is dropped, what rebuilds one while the memory is still held (by its retirement,
/// until its kernels have finished, or by another rebuilt handle).
struct LiveWindow {
    handle: std::sync::Weak<WindowRank>,
    memory: std::sync::Weak<HeldMemory>,
    comm_id: u64,
    rank: usize,
    dev: Device,
    local: Arc<LocalWindow>,
    uses: Arc<Uses>,
    addr: u64,
    dev_window: DevWindow,
}

/// A rank's window memory, shared by its handles and its retirement: freed when the last
/// of them is gone.
struct HeldMemory(#[allow(dead_code)] Mutex<RankMemory>);

fn live_windows() -> &'static LiveWindows {
    static L: OnceLock<LiveWindows> = OnceLock::new();
    L.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Rank `rank`'s handle of window `id` of communicator `comm_id`, if it lives in this process.
pub(crate) fn lookup(comm_id: u64, rank: usize, id: u32) -> Option<Window> {
    let live = lock(live_windows());
    let w = live.get(&(comm_id, rank, id))?;
    if let Some(shared) = w.handle.upgrade() {
        return Some(Window { shared, dev_window: w.dev_window });
    }
    // Every handle is gone but the memory is not (its kernels have not all finished): a
    // handle on it for the proxy, which holds the memory while it uses it.
    let memory = w.memory.upgrade()?;
    let shared = Arc::new(WindowRank {
        comm_id: w.comm_id,
        rank: w.rank,
        dev: w.dev.clone(),
        local: w.local.clone(),
        uses: w.uses.clone(),
        memory: Some(memory),
        addr: w.addr,
    });
    Some(Window { shared, dev_window: w.dev_window })
}

/// One rank's part of a window; retired as one piece when its last handle is dropped.
struct WindowRank {
    comm_id: u64,
    rank: usize,
    dev: Device,
    local: Arc<LocalWindow>,
    /// This rank's kernels' uses of the window (one of `local`'s `ranks_uses`): kept per rank
    /// so that the ranks of a GPU group, which launch a call every few microseconds each,
    /// note their launches without sharing a lock or a count (PERF.md issue 12, call 11:
    /// noting took 2.6 µs per call at 8 ranks).
    uses: Arc<Uses>,
    /// This rank's buffer, its GPU's flat mapping, and peers' memory imported from other
    /// processes (kept while mapped here).
    memory: Option<Arc<HeldMemory>>,
    addr: u64,
}

impl Drop for WindowRank {
    fn drop(&mut self) {
        if let Some(memory) = self.memory.take() {
            lifetime::retire(self.local.pending_for_free(), Box::new(memory), "window");
        }
    }
}

/// One rank's handle to a registered window. Clone it freely; the window lives until its
/// last handle is dropped (see the [module docs](self)).
///
/// ```
/// # use ferrolink::{Communicator, Device, LaunchConfig};
/// use ferrolink::device_api::kernels::lsa::lsa_put;
/// # fn main() -> ferrolink::Result<()> {
/// let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
/// let bufs = comms.iter().map(|c| c.mem_alloc(64)).collect::<ferrolink::Result<Vec<_>>>()?;
/// let windows = ferrolink::register_window(&comms, bufs)?;
/// let src = dev.alloc_from(&[7u8; 16])?;
/// // Rank 0 stores into rank 1's slot, at byte 8.
/// // SAFETY: `src` holds 16 bytes; 8 + 16 <= the window's 64; peer 1 < lsa_size 2.
/// unsafe {
///     let args = (&windows[0], 1u32, 8usize, &src, 16usize);
///     comms[0].stream().launch(dev.builtin_module()?, &lsa_put, LaunchConfig::linear(1, 32), args)?;
/// }
/// // The host read waits for the kernel (any rank's kernel may write into any slot).
/// assert_eq!(windows[1].read::<u8>(0, 32)?, [[0u8; 8], [7; 8], [7; 8], [0; 8]].concat());
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Window {
    shared: Arc<WindowRank>,
    dev_window: DevWindow,
}

impl std::fmt::Debug for Window {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Window").field("rank", &self.shared.rank).field("dev_window", &self.dev_window).finish()
    }
}

/// Registers every rank's [`SymBuffer`] as a window, for the ranks of one process (pass all
/// ranks in rank order, and `buffers[r]` of rank `r`; NCCL's `ncclCommWindowRegister` per
/// rank): runs [`Communicator::register_window`] for each rank on a thread. Returns each
/// rank's handle.
///
/// ```
/// # use ferrolink::{Communicator, Device};
/// # fn main() -> ferrolink::Result<()> {
/// let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// let comms = Communicator::init_all(&[dev.clone(), dev])?;
/// let bufs = comms.iter().map(|c| c.mem_alloc(4096)).collect::<ferrolink::Result<Vec<_>>>()?;
/// let windows = ferrolink::register_window(&comms, bufs)?;
/// assert_eq!(windows.len(), 2);
/// assert_eq!((windows[1].rank(), windows[1].size()), (1, 4096));
/// # Ok(()) }
/// ```
pub fn register_window(comms: &[Communicator], buffers: Vec<SymBuffer>) -> Result<Vec<Window>> {
    check_all_ranks(comms, "register_window")?;
    if buffers.len() != comms.len() {
        return Err(Error::InvalidArgument(format!(
            "register_window: {} buffers for {} ranks (one per rank)",
            buffers.len(),
            comms.len()
        )));
    }
    let slots: Vec<Mutex<Option<SymBuffer>>> = buffers.into_iter().map(|b| Mutex::new(Some(b))).collect();
    on_rank_threads(comms.len(), |r| {
        let buf = lock(&slots[r]).take().expect("each rank takes its buffer once");
        comms[r].register_window(buf)
    })
}

/// The first exchange of a registration: the call's number and the buffer's sizes.
fn describe(seq: u64, buf: &SymBuffer) -> Vec<u8> {
    [seq, buf.len() as u64, buf.allocated() as u64].iter().flat_map(|v| v.to_le_bytes()).collect()
}

impl Communicator {
    /// Registers this rank's symmetric buffer as a window (collective: every rank calls it,
    /// with buffers of the same size; NCCL's `ncclCommWindowRegister`). Every LSA peer's
    /// buffer is mapped into one flat range on this rank's GPU, slot `p` at `base + p *
    /// stride`: ranks of this process share their buffers and their GPU's mapping directly;
    /// buffers of other processes of this machine arrive as file descriptors over a Unix
    /// socket and are imported.
    ///
    /// ```
    /// # use ferrolink::{Communicator, Device};
    /// # fn main() -> ferrolink::Result<()> {
    /// let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let comms = Communicator::init_all(&[dev.clone(), dev])?;
    /// let windows = ferrolink::run_ranks(&comms, |c| c.register_window(c.mem_alloc(1024)?))?;
    /// assert_eq!(windows[0].read::<u32>(0, 256)?, [0; 256]); // zero-filled
    /// // Buffers of different sizes are refused (on every rank).
    /// let bad = ferrolink::run_ranks(&comms, |c| c.register_window(c.mem_alloc(64 << c.rank())?));
    /// assert!(bad.is_err());
    /// # Ok(()) }
    /// ```
    pub fn register_window(&self, buf: SymBuffer) -> Result<Window> {
        if !buf.device().same_as(self.device()) {
            return Err(Error::WrongDevice("register_window: the buffer"));
        }
        let rank = self.rank();
        let seq = self.next_collective();
        let key = (self.shared.id, seq);
        let local = lock(registering())
            .entry(key)
            .or_insert_with(|| {
                Arc::new(LocalWindow {
                    ranks_uses: Mutex::new(Vec::new()),
                    devices: Mutex::new(Vec::new()),
                    phys: Mutex::new(HashMap::new()),
                    flat: Mutex::new(HashMap::new()),
                    host_access: Mutex::new(()),
                })
            })
            .clone();
        lock(&local.phys).insert(rank, buf.phys.clone());
        {
            let mut devs = lock(&local.devices);
            if !devs.iter().any(|d| d.same_as(self.device())) {
                devs.push(self.device().clone());
            }
        }
        let result = self.map_window(&local, seq, buf);
        // Every rank of this process has taken what it needs once the others have mapped.
        let met = self.bootstrap().barrier();
        lock(registering()).remove(&key);
        let window = result?;
        met?;
        Ok(window)
    }

    fn map_window(&self, local: &Arc<LocalWindow>, seq: u64, buf: SymBuffer) -> Result<Window> {
        let (rank, n) = (self.rank(), self.nranks());
        let all = self.bootstrap().all_gather(&describe(seq, &buf))?;
        let field = |r: usize, i: usize| -> Result<u64> {
            all[r]
                .get(8 * i..8 * i + 8)
                .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
                .ok_or_else(|| Error::Bootstrap(format!("rank {r}'s window description is malformed")))
        };
        for r in 0..n {
            if field(r, 0)? != seq {
                return Err(Error::InvalidArgument(format!(
                    "register_window: rank {r} is at its collective call {} and rank {rank} at {seq}: every rank must make the same collective calls in the same order",
                    field(r, 0)?
                )));
            }
            if field(r, 1)? != buf.len() as u64 || field(r, 2)? != buf.allocated() as u64 {
                return Err(Error::InvalidArgument(format!(
                    "register_window: rank {r}'s buffer has {} bytes but rank {rank}'s has {}; window buffers must have the same size on every rank",
                    field(r, 1)?,
                    buf.len()
                )));
            }
        }
        let stride = buf.allocated();
        let peers = self.lsa_peers();
        let me = &self.peers()[rank];
        // Peers of other processes: send ours to each, then take theirs.
        let remote: Vec<usize> = peers.clone().filter(|&p| p != rank && !self.peers()[p].same_process(me)).collect();
        let mut imported: Vec<Arc<dyn PhysicalMemory>> = Vec::new();
        let mut by_rank: HashMap<usize, Arc<dyn PhysicalMemory>> = HashMap::new();
        if !remote.is_empty() {
            let fds = self.fd_exchange()?;
            for &p in &remote {
                let fd = buf.phys.export_fd()?;
                fds.send_fd(p, seq, std::os::fd::AsFd::as_fd(&fd))?;
            }
            for &p in &remote {
                let fd = fds.recv_fd(p, seq)?;
                let phys: Arc<dyn PhysicalMemory> = Arc::from(self.device().backend_device().vmm_import(fd, stride)?);
                imported.push(phys.clone());
                by_rank.insert(p, phys);
            }
        }
        let flat = {
            let dev = self.device();
            let mut flats = lock(&local.flat);
            // One mapping per device and LSA domain (virtual ranks of several domains may
            // share a device: `LsaMode::Size`).
            let flat_key = (dev.key(), peers.start);
            match flats.get(&flat_key) {
                Some(f) => f.clone(),
                None => {
                    let b = dev.backend_device();
                    let mut range = b.vmm_reserve(peers.len() * stride, b.vmm_granularity()?)?;
                    let mut held = Vec::with_capacity(peers.len());
                    for (slot, p) in peers.clone().enumerate() {
                        let phys = match by_rank.get(&p) {
                            Some(ph) => ph.clone(),
                            None => lock(&local.phys).get(&p).cloned().ok_or_else(|| {
                                Error::Bootstrap(format!("register_window: rank {p}'s buffer is not in this process"))
                            })?,
                        };
                        range.map(slot * stride, &*phys)?;
                        held.push(phys);
                    }
                    range.grant_access(&[&**b])?;
                    let f = Arc::new(FlatMapping { range, _phys: held });
                    flats.insert(flat_key, f.clone());
                    f
                }
            }
        };
        let dev_window = DevWindow {
            flat_base: flat.range.base(),
            stride: stride as u64,
            size: buf.len() as u64,
            lsa_rank: self.lsa_rank() as u32,
            lsa_size: self.lsa_size() as u32,
            id: u32::try_from(seq)
                .map_err(|_| Error::InvalidArgument("too many windows in one communicator".into()))?,
            _reserved: 0,
        };
        let addr = buf.addr();
        let uses = Arc::new(Uses::default());
        lock(&local.ranks_uses).push(uses.clone());
        let window = Window {
            shared: Arc::new(WindowRank {
                comm_id: self.shared.id,
                rank,
                dev: self.device().clone(),
                local: local.clone(),
                uses: uses.clone(),
                memory: Some(Arc::new(HeldMemory(Mutex::new((Some(flat), buf, imported))))),
                addr,
            }),
            dev_window,
        };
        let mut live = lock(live_windows());
        live.retain(|_, w| w.handle.strong_count() > 0 || w.memory.strong_count() > 0);
        live.insert(
            (self.shared.id, rank, dev_window.id),
            LiveWindow {
                handle: Arc::downgrade(&window.shared),
                memory: Arc::downgrade(window.shared.memory.as_ref().expect("just made")),
                comm_id: self.shared.id,
                rank,
                dev: self.device().clone(),
                local: local.clone(),
                uses,
                addr,
                dev_window,
            },
        );
        Ok(window)
    }
}

impl Window {
    /// The kernel argument for this rank, as a raw value (an untracked launch: prefer
    /// passing `&window`, which keeps the window alive until the kernel ends).
    ///
    /// ```
    /// # use ferrolink::{Communicator, Device};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// # let bufs = comms.iter().map(|c| c.mem_alloc(256)).collect::<ferrolink::Result<Vec<_>>>()?;
    /// # let windows = ferrolink::register_window(&comms, bufs)?;
    /// let dw = windows[1].dev_window();
    /// assert_eq!((dw.lsa_rank, dw.lsa_size, dw.size), (1, 2, 256));
    /// assert_eq!(dw.stride as usize, ferrolink::mem::granularity(&dev)?); // slot p at flat_base + p * stride
    /// # Ok(()) }
    /// ```
    pub fn dev_window(&self) -> DevWindow {
        self.dev_window
    }

    /// This handle's rank.
    ///
    /// ```
    /// # use ferrolink::{Communicator, Device};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// # let bufs = comms.iter().map(|c| c.mem_alloc(256)).collect::<ferrolink::Result<Vec<_>>>()?;
    /// # let windows = ferrolink::register_window(&comms, bufs)?;
    /// assert_eq!(windows[1].rank(), 1);
    /// # Ok(()) }
    /// ```
    pub fn rank(&self) -> usize {
        self.shared.rank
    }

    /// The device of this handle's rank.
    ///
    /// ```
    /// # use ferrolink::{Communicator, Device};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// # let bufs = comms.iter().map(|c| c.mem_alloc(256)).collect::<ferrolink::Result<Vec<_>>>()?;
    /// # let windows = ferrolink::register_window(&comms, bufs)?;
    /// assert!(windows[1].device().same_as(&dev));
    /// # Ok(()) }
    /// ```
    pub fn device(&self) -> &Device {
        &self.shared.dev
    }

    /// Usable bytes per rank.
    ///
    /// ```
    /// # use ferrolink::{Communicator, Device};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// let bufs = comms.iter().map(|c| c.mem_alloc(100)).collect::<ferrolink::Result<Vec<_>>>()?;
    /// let windows = ferrolink::register_window(&comms, bufs)?;
    /// assert_eq!(windows[0].size(), 100); // as requested, not the rounded-up allocation
    /// # Ok(()) }
    /// ```
    pub fn size(&self) -> usize {
        self.dev_window.size as usize
    }

    fn check_range<T>(&self, offset: usize, len: usize) -> Result<u64> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .and_then(|b| b.checked_add(offset))
            .filter(|&end| end <= self.size());
        if bytes.is_none() || !offset.is_multiple_of(std::mem::align_of::<T>()) {
            return Err(Error::InvalidArgument(format!(
                "window access of {len} x {} bytes at offset {offset} is outside the {}-byte window \
                 or misaligned",
                std::mem::size_of::<T>(),
                self.size()
            )));
        }
        Ok(self.shared.addr + offset as u64)
    }

    /// Writes `src` into this rank's buffer at byte `offset` (bounds-checked). Waits first
    /// for this process's kernels that used the window (peers write into this slot too).
    /// Kernels of ranks in other processes are not waited for: order them with the program's
    /// own protocol (a barrier kernel, or [`Communicator::barrier`] after they finished).
    /// With several ranks in this process (virtual ranks), a peer's collective already
    /// launched on the window may be waiting for this rank's part of it, which this rank's
    /// thread has not launched because it is waiting here: write the next input only after
    /// every rank's previous call on the window (a [`Communicator::barrier`] after it), or the
    /// wait lasts until the communicator's timeout, which names it.
    ///
    /// ```
    /// # use ferrolink::{Communicator, Device};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// # let bufs = comms.iter().map(|c| c.mem_alloc(256)).collect::<ferrolink::Result<Vec<_>>>()?;
    /// # let windows = ferrolink::register_window(&comms, bufs)?;
    /// windows[0].copy_from_host(8, &[1u32, 2, 3])?;
    /// assert_eq!(windows[0].read::<u32>(0, 5)?, [0, 0, 1, 2, 3]);
    /// assert!(windows[0].copy_from_host(252, &[1u32, 2]).is_err()); // past the 256 bytes
    /// # Ok(()) }
    /// ```
    pub fn copy_from_host<T: Pod>(&self, offset: usize, src: &[T]) -> Result<()> {
        let addr = self.check_range::<T>(offset, src.len())?;
        let _exclusive = lock(&self.shared.local.host_access);
        lifetime::wait_all(&self.shared.local.pending(), "Window::copy_from_host")?;
        // SAFETY: the range was bounds-checked against this rank's live buffer; no kernel of
        // this process uses the window (waited above) and the lock excludes other host copies.
        unsafe { self.device().backend_device().write(addr, bytemuck::cast_slice(src)) }
    }

    /// Fills `bytes` bytes of this rank's buffer at `offset` with zeros, as
    /// [`Window::copy_from_host`] does with data.
    ///
    /// ```
    /// # use ferrolink::{Communicator, Device};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// # let bufs = comms.iter().map(|c| c.mem_alloc(256)).collect::<ferrolink::Result<Vec<_>>>()?;
    /// # let windows = ferrolink::register_window(&comms, bufs)?;
    /// windows[1].copy_from_host(0, &[9u8; 8])?;
    /// windows[1].zero(2, 4)?;
    /// assert_eq!(windows[1].read::<u8>(0, 8)?, [9, 9, 0, 0, 0, 0, 9, 9]);
    /// # Ok(()) }
    /// ```
    pub fn zero(&self, offset: usize, bytes: usize) -> Result<()> {
        let addr = self.check_range::<u8>(offset, bytes)?;
        let _exclusive = lock(&self.shared.local.host_access);
        lifetime::wait_all(&self.shared.local.pending(), "Window::zero")?;
        // SAFETY: as in `copy_from_host`.
        unsafe { self.device().backend_device().memset_zero(addr, bytes) }
    }

    /// Reads this rank's buffer at byte `offset` into `dst` (bounds-checked). Waits first for
    /// this process's kernels that used the window (see [`Window::copy_from_host`] for the
    /// kernels of other processes).
    ///
    /// ```
    /// # use ferrolink::{Communicator, Device};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// # let bufs = comms.iter().map(|c| c.mem_alloc(256)).collect::<ferrolink::Result<Vec<_>>>()?;
    /// # let windows = ferrolink::register_window(&comms, bufs)?;
    /// windows[0].copy_from_host(0, &[1.5f32, -2.0])?;
    /// let mut out = [0f32; 2];
    /// windows[0].copy_to_host(0, &mut out)?;
    /// assert_eq!(out, [1.5, -2.0]);
    /// assert!(windows[0].copy_to_host(2, &mut out).is_err()); // misaligned for f32
    /// # Ok(()) }
    /// ```
    pub fn copy_to_host<T: Pod>(&self, offset: usize, dst: &mut [T]) -> Result<()> {
        let addr = self.check_range::<T>(offset, dst.len())?;
        let _exclusive = lock(&self.shared.local.host_access);
        lifetime::wait_all(&self.shared.local.pending(), "Window::copy_to_host")?;
        // SAFETY: as in `copy_from_host`.
        unsafe { self.device().backend_device().read(addr, bytemuck::cast_slice_mut(dst)) }
    }

    /// `len` elements of this rank's buffer at `offset`, as a `Vec`.
    ///
    /// ```
    /// # use ferrolink::{Communicator, Device};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// # let bufs = comms.iter().map(|c| c.mem_alloc(256)).collect::<ferrolink::Result<Vec<_>>>()?;
    /// # let windows = ferrolink::register_window(&comms, bufs)?;
    /// windows[1].copy_from_host(0, &[5u64, 6])?;
    /// assert_eq!(windows[1].read::<u64>(8, 1)?, [6]);
    /// # Ok(()) }
    /// ```
    pub fn read<T: Pod>(&self, offset: usize, len: usize) -> Result<Vec<T>> {
        let mut v = vec![T::zeroed(); len];
        self.copy_to_host(offset, &mut v)?;
        Ok(v)
    }

    /// The device address of byte `offset` of this rank's own buffer (bounds-checked with
    /// `bytes`).
    pub(crate) fn local_addr(&self, offset: usize, bytes: usize) -> Result<u64> {
        self.check_range::<u8>(offset, bytes)
    }

    /// `bytes` at `offset` of this rank's buffer as a pointer launch argument (`P`: `*const
    /// u8` or `*mut u8`). The launch keeps the window alive but is not ordered after other
    /// ranks' kernels on the window: a release or host access waits for every rank's kernels
    /// of this process (`LocalWindow::ranks_uses`), but a launch does not, as their kernels
    /// hold the window while they wait at barriers for this rank, so ordering after
    /// them would deadlock. The caller's protocol orders the access (the collectives: a rank
    /// leaves a collective only after every peer has finished with its slot).
    pub(crate) fn slot_ptr<P>(&self, offset: usize, bytes: usize) -> Result<TrackedPtr<'_, P>> {
        let addr = self.local_addr(offset, bytes)?;
        Ok(TrackedPtr::held(addr, &self.shared.dev, &self.shared.uses))
    }

    /// Reads words of this rank's buffer that kernels may be updating atomically right now
    /// (for diagnosis: each word is some value it held). Does not wait.
    pub(crate) fn peek_words(&self, offset: usize, dst: &mut [u32]) -> Result<()> {
        let addr = self.check_range::<u32>(offset, dst.len())?;
        // SAFETY: bounds-checked, 4-byte aligned (checked) live memory of this rank's buffer;
        // kernels access the words peeked (barrier inboxes) only with atomics.
        unsafe { self.device().backend_device().read_atomic_words(addr, dst) }
    }

    /// This rank's use records of the window (a launch holds them; a release or host access
    /// waits for every rank's of this process).
    pub(crate) fn uses(&self) -> &Arc<Uses> {
        &self.shared.uses
    }

    pub(crate) fn comm_id(&self) -> u64 {
        self.shared.comm_id
    }
}

impl Sealed for &Window {}

impl LaunchArg for &Window {
    type Param = DevWindow;
    fn param(&self) -> DevWindow {
        self.dev_window
    }
    fn track(&self, t: &mut LaunchTracking) {
        t.expect_device(&self.shared.dev, "window");
        t.holds.push(self.shared.uses.clone());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::lifetime::HostFlag;

    /// Each rank notes its kernels in its own records, and a host access or a release of any
    /// rank's handle waits for every rank's kernels of the process (any of them may write into
    /// any slot).
    #[test]
    fn a_host_access_waits_for_every_local_ranks_kernels() {
        let dev = Device::open_with(crate::Backend::Cpu, 0).unwrap();
        let comms = Communicator::init_all(&[dev.clone(), dev.clone()]).unwrap();
        let bufs = comms.iter().map(|c| c.mem_alloc(4096)).collect::<Result<Vec<_>>>().unwrap();
        let w = register_window(&comms, bufs).unwrap();
        assert!(!Arc::ptr_eq(w[0].uses(), w[1].uses()), "each rank notes its own kernels");
        let kernel = Arc::new(HostFlag::default());
        // A launch of rank 0's (on stream 1) that holds the window.
        w[0].uses().record(&Completion::new(kernel.clone(), 1), false);
        for (r, win) in w.iter().enumerate() {
            assert_eq!(win.shared.local.pending().len(), 1, "rank {r}'s host access waits for rank 0's kernel");
            assert_eq!(win.shared.local.pending_for_free().len(), 1, "rank {r}'s release waits for it");
        }
        kernel.raise();
        assert!(w[1].shared.local.pending().is_empty(), "not once it has finished");
        // A handle rebuilt for the proxy shares the rank's records.
        let again = lookup(w[1].comm_id(), 1, w[1].dev_window.id).expect("a live window");
        assert!(Arc::ptr_eq(again.uses(), w[1].uses()));
    }
}
