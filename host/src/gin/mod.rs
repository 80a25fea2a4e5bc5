//! GIN on the host: the resources behind a device communicator's [`DevGin`] (signal slots,
//! counters, the proxy's rings), the proxy thread that executes the rings' descriptors, and the
//! transports it drives (copy engine, TCP, RDMA verbs; docs/gin.md). The device side and the
//! ordering argument are in `ferrolink_device::gin`.
//!
//! Per peer, a rank uses the **direct** backend (an LSA peer: the kernel stores into the
//! peer's mapped window; no CPU) or the **proxy**, with a transport: the **copy engine** where
//! the peer's memory is mapped here (an LSA peer with `FERROLINK_GIN=proxy`), else **TCP**.
//! `FERROLINK_GIN=direct|proxy` and `FERROLINK_GIN_TRANSPORT=ce|tcp` override the choice.

pub(crate) mod copy_watch;
mod deliver;
pub(crate) mod proxy;
pub(crate) mod staging;
pub(crate) mod transport;

use crate::comm::Communicator;
use crate::comm::control::{CommControl, StalledWait, WaitOn};
use crate::mem::window::Window;
use crate::runtime::backend::StreamBackend;
use crate::runtime::device::Device;
use crate::runtime::host_mapped::HostMapped;
use crate::runtime::lifetime::lock;
use crate::runtime::memory::DeviceBuffer;
use crate::runtime::stream::Stream;
use crate::{Error, Result};
use copy_watch::CopyWatch;
use ferrolink_device::gin::{DevGin, GinDescriptor, flags};
use staging::StagingPool;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use transport::{Deliver, TransportKind};

/// How peers are reached (`FERROLINK_GIN`).
///
/// ```
/// # use ferrolink::{Communicator, DevCommRequirements, Device, GinMode};
/// # fn main() -> ferrolink::Result<()> {
/// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// # let comms = Communicator::init_all(&[dev.clone(), dev])?;
/// let reqs = DevCommRequirements { gin_signal_count: 1, gin_mode: Some(GinMode::Proxy), ..Default::default() };
/// let handles = ferrolink::create_dev_comms(&comms, &reqs)?;
/// assert!(handles[0].uses_proxy()); // even to its LSA peer
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GinMode {
    /// LSA peers directly, the others through the proxy (the default).
    Auto,
    /// Every peer through the proxy (LSA peers with the copy engine).
    Proxy,
}

impl GinMode {
    /// `FERROLINK_GIN`: `direct`, `auto` or unset (LSA peers directly), or `proxy`.
    ///
    /// ```
    /// use ferrolink::GinMode;
    /// // SAFETY: no other thread of this program reads or writes the environment meanwhile.
    /// unsafe { std::env::set_var("FERROLINK_GIN", "proxy") };
    /// assert_eq!(GinMode::from_env()?, GinMode::Proxy);
    /// // SAFETY: as above.
    /// unsafe { std::env::set_var("FERROLINK_GIN", "fast") };
    /// assert!(GinMode::from_env().is_err());
    /// # Ok::<(), ferrolink::Error>(())
    /// ```
    pub fn from_env() -> Result<GinMode> {
        match std::env::var("FERROLINK_GIN").as_deref() {
            Err(_) | Ok("") | Ok("direct") | Ok("auto") => Ok(GinMode::Auto),
            Ok("proxy") => Ok(GinMode::Proxy),
            Ok(other) => {
                Err(Error::InvalidArgument(format!("FERROLINK_GIN={other:?}: use `direct` (or `auto`) or `proxy`")))
            }
        }
    }
}

/// A rank's GIN resources, as its proxy and its receivers use them.
pub(crate) struct GinRank {
    pub(crate) comm_id: u64,
    pub(crate) rank: usize,
    pub(crate) nranks: usize,
    pub(crate) lsa_size: usize,
    pub(crate) device: Device,
    pub(crate) contexts: u32,
    pub(crate) depth: u32,
    pub(crate) signal_count: u32,
    pub(crate) counter_count: u32,
    /// Per peer: `None` for the direct backend, else the proxy's transport.
    pub(crate) kinds: Vec<Option<TransportKind>>,
    /// The rings, the consumed words and the proxy's counters, in host memory mapped for the
    /// device.
    host: HostMapped,
    consumed_off: usize,
    counters_off: usize,
    records_off: usize,
    /// This rank's handle of the signal window (slots `[id][src]`).
    pub(crate) signals: Window,
    /// Device words (produced, signal bases, counters, counter bases) and GIN barrier epochs:
    /// owned here so that they live as long as the rank's GIN.
    _device_words: DeviceBuffer<u64>,
    _barrier_epochs: DeviceBuffer<u64>,
    /// What receivers have added to each `(src, signal)` slot (written whole, after the data).
    pub(crate) received: Mutex<HashMap<(usize, u32), u64>>,
    pub(crate) control: Weak<CommControl>,
    /// The TCP addresses of every rank's receiver (`None`: it has none); set once every rank
    /// has said, before the proxy starts.
    pub(crate) tcp_peers: std::sync::OnceLock<Vec<Option<std::net::SocketAddr>>>,
    /// This rank's TCP receiver, while it lives.
    tcp_receiver: Mutex<Option<transport::tcp::TcpReceiver>>,
    /// The TCP transport's pinned staging (its senders' blocks and its receivers' buffers),
    /// made here before anything can use GIN, freed with the rank's GIN: allocating or
    /// freeing pinned memory while kernels run may wait for them (see [`staging`]). `None`
    /// where no peer is reached by TCP.
    pub(crate) staging: Option<Arc<StagingPool>>,
    /// The stream on which receivers write what they deliver (data, then signals) into this
    /// rank's device memory, made here and used by nothing else: the device's shared copy
    /// stream may hold work that waits for an SM (the fill of a fresh allocation), and while
    /// kernels that wait for this rank's deliveries hold every SM, a delivery queued behind
    /// such work would never run (seen on an H200: four ranks in LSA domains of two).
    pub(crate) deliveries: Arc<dyn StreamBackend>,
    /// The copy-engine transport's one stream (to every peer it reaches), made here for the
    /// same reason as `deliveries`; `None` where no peer is reached through the copy engine.
    /// One stream, not one per peer: streams beyond the driver's hardware queues share them,
    /// and a copy queued in a hardware queue behind a kernel that waits for it never runs
    /// (see [`copy_watch`]).
    pub(crate) copies: Option<Stream>,
    /// The proxy threads' stream copies under way (deliveries, staging), named by the
    /// watchdog when one does not finish (see [`copy_watch`]).
    pub(crate) copy_watch: Arc<CopyWatch>,
    /// This rank's verbs connections, while they live.
    #[cfg(feature = "verbs")]
    verbs: Mutex<Option<transport::verbs::VerbsSetup>>,
    /// Asks the proxy thread to end.
    pub(crate) stop: std::sync::atomic::AtomicBool,
    /// The device view (addresses of the words the host reads for debugging).
    pub(crate) layout: DevGin,
    /// Peers whose connections ended without a goodbye, and how.
    pub(crate) lost: Mutex<Vec<(usize, String)>>,
}

impl GinRank {
    fn host_word(&self, byte_offset: usize) -> &AtomicU64 {
        debug_assert!(byte_offset + 8 <= self.host.len() && byte_offset.is_multiple_of(8));
        // SAFETY: an aligned word inside the live host-mapped block; the device and the host
        // access it only with atomics.
        unsafe { AtomicU64::from_ptr(self.host.host_ptr().add(byte_offset) as *mut u64) }
    }

    /// Word `w` (0..8) of descriptor slot `slot` of ring `ring`.
    pub(crate) fn ring_word(&self, ring: usize, slot: u64, w: usize) -> &AtomicU64 {
        let desc = (ring * self.depth as usize + slot as usize) * std::mem::size_of::<GinDescriptor>();
        self.host_word(desc + 8 * w)
    }

    /// The consumed word of ring `ring`.
    pub(crate) fn consumed(&self, ring: usize) -> &AtomicU64 {
        self.host_word(self.consumed_off + 8 * ring)
    }

    /// The proxy's word of counter `id`.
    pub(crate) fn counter(&self, id: u32) -> &AtomicU64 {
        self.host_word(self.counters_off + 8 * id as usize)
    }

    /// A device word (8-byte aligned, written by kernels with atomics), read from the host:
    /// two 4-byte atomic reads, repeated until the high half is stable (never torn).
    fn device_word(&self, addr: u64) -> Result<u64> {
        let mut w = [0u32; 2];
        loop {
            // SAFETY: `addr` is one of this rank's live GIN words (8-byte aligned device or
            // host-mapped memory, owned by `self`), accessed by kernels only atomically.
            unsafe { self.device.backend_device().read_atomic_words(addr, &mut w)? };
            let first = w;
            // SAFETY: as above.
            unsafe { self.device.backend_device().read_atomic_words(addr, &mut w)? };
            if first[1] == w[1] {
                return Ok(u64::from(w[0]) | (u64::from(w[1]) << 32));
            }
        }
    }

    /// Signal `id` as kernels read it (`Gin::read_signal`), for debugging: a snapshot.
    pub(crate) fn signal_value(&self, id: u32) -> Result<u64> {
        let user = self.layout.barrier_signal_first;
        if id >= user {
            return Err(Error::InvalidArgument(format!(
                "GIN signal {id} is out of range: the device communicator has {user} signals (gin_signal_count)"
            )));
        }
        let mut sum = 0u64;
        for src in 0..self.nranks {
            let addr = self.signals.local_addr((id as usize * self.nranks + src) * 8, 8)?;
            sum = sum.wrapping_add(self.device_word(addr)?);
        }
        Ok(sum.wrapping_sub(self.device_word(self.layout.signal_base + u64::from(id) * 8)?))
    }

    /// Counter `id` as kernels read it (`Gin::read_counter`), for debugging: a snapshot.
    pub(crate) fn counter_value(&self, id: u32) -> Result<u64> {
        if id >= self.counter_count {
            return Err(Error::InvalidArgument(format!(
                "GIN counter {id} is out of range: the device communicator has {} counters",
                self.counter_count
            )));
        }
        let d = self.device_word(self.layout.counters + u64::from(id) * 8)?;
        let h = self.counter(id).load(Ordering::Acquire);
        let b = self.device_word(self.layout.counter_base + u64::from(id) * 8)?;
        Ok(d.wrapping_add(h).wrapping_sub(b))
    }

    /// The signal waits kernels reported slow that have not finished (see
    /// `ferrolink_device::gin::GinWaitRecord`), with who has not done their part.
    pub(crate) fn stalled_waits(&self) -> Result<Vec<StalledWait>> {
        use ferrolink_device::gin::{GinWaitRecord, wait_state};
        let mut out = Vec::new();
        for id in 0..self.signal_count {
            let base = self.records_off + id as usize * std::mem::size_of::<GinWaitRecord>();
            let word = |i: usize| {
                // SAFETY: an aligned word of the live host-mapped block (the record of signal
                // `id`), accessed by the device and the host with atomics only.
                unsafe { std::sync::atomic::AtomicU32::from_ptr(self.host.host_ptr().add(base + 4 * i) as *mut u32) }
            };
            // Acquire: the fields were written before `state` (release on the device).
            let state = word(3).load(Ordering::Acquire);
            if state == wait_state::IDLE {
                continue;
            }
            let w: Vec<u32> = (0..8).map(|i| word(i).load(Ordering::Relaxed)).collect();
            let target = u64::from(w[0]) | (u64::from(w[1]) << 32);
            let cta = w[2];
            let mut slots = Vec::with_capacity(self.nranks);
            for src in 0..self.nranks {
                let addr = self.signals.local_addr((id as usize * self.nranks + src) * 8, 8)?;
                slots.push(self.device_word(addr)?);
            }
            if state == wait_state::PEER_SIGNAL {
                // One sender's part of the signal (point-to-point channels).
                let src = w[4] as usize;
                let value = slots.get(src).copied().unwrap_or(0);
                if value.wrapping_sub(target) as i64 >= 0 {
                    continue;
                }
                out.push(StalledWait {
                    rank: self.rank,
                    cta,
                    on: WaitOn::GinSignal { signal: id, target, value, from: vec![(src, value)] },
                    missing: vec![src],
                });
                continue;
            }
            if state == wait_state::BARRIER {
                let (first, stride, size, epoch) = (w[4] as usize, w[5].max(1) as usize, w[6] as usize, w[7]);
                let index = id - self.layout.barrier_signal_first;
                let expected = self.layout.barrier_epochs + (u64::from(index) * (1 + self.nranks as u64) + 1) * 8;
                let mut missing = Vec::new();
                for p in (0..size).map(|m| first + m * stride).filter(|&p| p != self.rank && p < self.nranks) {
                    let want = self.device_word(expected + p as u64 * 8)?;
                    if (slots[p].wrapping_sub(want) as i64) < 0 {
                        missing.push(p);
                    }
                }
                if missing.is_empty() {
                    continue;
                }
                out.push(StalledWait { rank: self.rank, cta, on: WaitOn::GinBarrier { index, epoch }, missing });
            } else {
                let value = self.signal_value(id).unwrap_or(0);
                if value.wrapping_sub(target) as i64 >= 0 {
                    continue;
                }
                let from = slots.iter().enumerate().filter(|(_, v)| **v != 0).map(|(r, v)| (r, *v)).collect();
                out.push(StalledWait {
                    rank: self.rank,
                    cta,
                    on: WaitOn::GinSignal { signal: id, target, value, from },
                    missing: Vec::new(),
                });
            }
        }
        // The proxy's own copies that do not finish (a wait above may be waiting for one).
        out.extend(self.copy_watch.stuck(
            self.rank,
            std::time::Instant::now(),
            self.device.backend_device().stream_queues(),
        ));
        // A lost peer never signals again: a stalled wait will not end by itself.
        if let (Some(w), Some((peer, why))) = (out.first(), lock(&self.lost).first()) {
            self.fail(format!("rank {peer} is gone ({why}) while {}", w.describe()));
        }
        Ok(out)
    }

    /// This rank's handle of window `id`, if it lives.
    pub(crate) fn window(&self, id: u32) -> Option<Window> {
        crate::mem::window::lookup(self.comm_id, self.rank, id)
    }

    /// Aborts the communicator with `why` (a proxy or transport failure).
    pub(crate) fn fail(&self, why: String) {
        tracing::error!(target: "ferrolink::gin", rank = self.rank, "{why}");
        if let Some(c) = self.control.upgrade() {
            c.abort(Error::Aborted(format!("GIN on rank {}: {why}", self.rank)));
        }
    }
}

/// Owns a rank's GIN for its device communicator: dropping it (after the kernels that used
/// it) stops the TCP receiver and asks the proxy to end; the proxy first executes what the
/// rings still hold and waits for its transports, so nothing in flight loses its memory.
pub(crate) struct GinOwner(pub(crate) Arc<GinRank>);

impl Drop for GinOwner {
    fn drop(&mut self) {
        self.0.stop.store(true, Ordering::SeqCst);
        drop(lock(&self.0.tcp_receiver).take());
        #[cfg(feature = "verbs")]
        drop(lock(&self.0.verbs).take());
    }
}

/// What GIN needs, from the device communicator's requirements.
#[derive(Clone, Copy, Debug)]
pub(crate) struct GinShape {
    pub(crate) contexts: u32,
    pub(crate) signals: u32,
    pub(crate) counters: u32,
    pub(crate) depth: u32,
    pub(crate) barriers: u32,
    pub(crate) mode: Option<GinMode>,
    pub(crate) transport: Option<TransportKind>,
}

/// Warns (once per process) where GIN reaches peers through the proxy's stream copies (TCP,
/// copy engine) on a device whose streams share fewer hardware queues than they can: a copy
/// that shares a queue with a kernel waiting for it never runs (see [`copy_watch`]).
fn warn_of_few_stream_queues(dev: &Device, rank: usize, kinds: &[Option<TransportKind>]) {
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let copies = kinds.iter().any(|k| matches!(k, Some(TransportKind::Tcp | TransportKind::CopyEngine)));
    let Some((queues, setting)) = dev.backend_device().stream_queues() else { return };
    if copies && queues < 32 && !WARNED.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            target: "ferrolink::gin",
            rank,
            "GIN through the proxy copies on streams, and this process's streams share {queues} hardware queues \
             ({setting}={queues}): a copy whose queue holds a kernel that waits for it never runs (a hang the \
             watchdog names). Set {setting}=32 before the process first uses CUDA (ferrolink-run does for the \
             ranks it starts)"
        );
    }
}

/// Creates this rank's GIN resources (collective: part of `create_dev_comm`): the signal
/// window, the device words, the rings, the TCP staging pool and receiver (every rank says
/// where it listens, or that it does not), and the proxy thread. No pinned memory is
/// allocated for GIN after this returns (see [`staging`]). Returns the [`DevGin`] and the
/// state to keep.
pub(crate) fn create(comm: &Communicator, shape: GinShape) -> Result<(DevGin, GinOwner)> {
    let n = comm.nranks();
    let dev = comm.device();
    let depth = shape.depth.max(1).next_power_of_two();
    let contexts = shape.contexts.max(1);
    let signal_count = shape.signals + shape.barriers;
    let counter_count = shape.counters.max(1);
    let mode = match shape.mode {
        Some(m) => m,
        None => GinMode::from_env()?,
    };
    let forced = match shape.transport {
        Some(t) => Some(t),
        None => TransportKind::from_env()?,
    };
    let lsa = comm.lsa_peers();
    let kinds: Vec<Option<TransportKind>> = (0..n)
        .map(|p| {
            let mapped = lsa.contains(&p);
            match (mapped, mode, forced) {
                (true, GinMode::Auto, _) => Ok(None),
                (true, GinMode::Proxy, k) => Ok(Some(k.unwrap_or(TransportKind::CopyEngine))),
                (false, _, Some(TransportKind::CopyEngine)) => Err(Error::InvalidArgument(format!(
                    "GIN transport `ce` (copy engine) cannot reach rank {p}: its memory is not mapped on rank {}'s \
                     device (another LSA domain); use `tcp`",
                    comm.rank()
                ))),
                (false, _, k) => Ok(Some(k.unwrap_or(TransportKind::Tcp))),
            }
        })
        .collect::<Result<_>>()?;
    // Host work first: the collectives below are the last before kernels may use GIN.
    let rings = contexts as usize * n;
    let queues_bytes = rings * depth as usize * std::mem::size_of::<GinDescriptor>();
    let consumed_off = queues_bytes;
    let counters_off = consumed_off + rings * 8;
    let records_off = (counters_off + counter_count as usize * 8).next_multiple_of(32);
    let host = HostMapped::alloc(
        dev,
        records_off + signal_count.max(1) as usize * std::mem::size_of::<ferrolink_device::gin::GinWaitRecord>(),
    )?;
    // The TCP transport's pinned staging, all of it now: later, kernels may be running, and
    // a pinned allocation or free may wait for them (while they wait for the transport).
    let copy_watch = Arc::new(CopyWatch::default());
    warn_of_few_stream_queues(dev, comm.rank(), &kinds);
    let tcp_rings = contexts as usize * kinds.iter().filter(|k| **k == Some(TransportKind::Tcp)).count();
    let uses_tcp = tcp_rings > 0;
    let staging = if uses_tcp {
        let blocks = transport::tcp::staging_blocks(tcp_rings);
        // One copy stream for all the rank's connections: every stream more may share a
        // hardware queue with a kernel's (see `copies`), and TCP, not the copy, bounds them.
        let pool = StagingPool::new(dev, blocks, transport::tcp::STAGING_BLOCK, 1, copy_watch.clone())?;
        tracing::debug!(target: "ferrolink::gin", rank = comm.rank(), blocks = pool.count(), bytes = pool.block_bytes(), "GIN TCP staging pool");
        Some(pool)
    } else {
        None
    };
    // Made now, as the staging: a stream made while kernels run may wait for them.
    let deliveries: Arc<dyn StreamBackend> = Arc::from(dev.backend_device().create_stream()?);
    let copies = kinds.contains(&Some(TransportKind::CopyEngine)).then(|| dev.create_stream()).transpose()?;
    // Device words: produced[rings] | signal_base[signals] | counters[counters] |
    // counter_base[counters] | consumed_seen[rings].
    let words = dev.alloc::<u64>(2 * rings + signal_count.max(1) as usize + 2 * counter_count as usize)?;
    let epochs = dev.alloc::<u64>(shape.barriers.max(1) as usize * (1 + n))?;
    let signals = comm.register_window(comm.mem_alloc((signal_count.max(1) as usize * n * 8).max(8))?)?;
    let words_addr = words.addr();
    let signal_slots = signal_count.max(1) as usize;
    let layout = DevGin {
        flags: flags::PRESENT | if mode == GinMode::Proxy { flags::FORCE_PROXY } else { 0 },
        context_count: contexts,
        signal_count,
        counter_count,
        queue_depth: depth,
        barrier_signal_first: shape.signals,
        barrier_count: shape.barriers,
        _reserved: 0,
        signals: signals.dev_window(),
        signal_base: words_addr + rings as u64 * 8,
        counters: words_addr + (rings + signal_slots) as u64 * 8,
        counters_host: host.device_addr() + counters_off as u64,
        counter_base: words_addr + (rings + signal_slots + counter_count as usize) as u64 * 8,
        queues: host.device_addr(),
        produced: words_addr,
        consumed: host.device_addr() + consumed_off as u64,
        consumed_seen: words_addr + (rings + signal_slots + 2 * counter_count as usize) as u64 * 8,
        barrier_epochs: epochs.addr(),
        wait_records: host.device_addr() + records_off as u64,
    };
    let gin = Arc::new(GinRank {
        comm_id: comm.shared.id,
        rank: comm.rank(),
        nranks: n,
        lsa_size: comm.lsa_size(),
        device: dev.clone(),
        contexts,
        depth,
        signal_count,
        counter_count,
        kinds: kinds.clone(),
        host,
        consumed_off,
        counters_off,
        records_off,
        signals,
        _device_words: words,
        _barrier_epochs: epochs,
        received: Mutex::new(HashMap::new()),
        control: Arc::downgrade(comm.control()),
        tcp_peers: std::sync::OnceLock::new(),
        tcp_receiver: Mutex::new(None),
        staging,
        deliveries,
        copies,
        copy_watch,
        #[cfg(feature = "verbs")]
        verbs: Mutex::new(None),
        stop: std::sync::atomic::AtomicBool::new(false),
        layout,
        lost: Mutex::new(Vec::new()),
    });
    // Every rank tells where its TCP receiver listens (an empty message: it has none).
    let mut addr_msg = Vec::new();
    if uses_tcp {
        let deliver: Weak<dyn Deliver> = Arc::downgrade(&(gin.clone() as Arc<dyn Deliver>));
        let (receiver, addr) = transport::tcp::TcpReceiver::start(comm.shared.id, comm.rank(), deliver)?;
        *lock(&gin.tcp_receiver) = Some(receiver);
        addr_msg = addr.to_string().into_bytes();
    }
    let all = comm.bootstrap().all_gather(&addr_msg)?;
    let tcp_peers = all
        .iter()
        .map(|a| if a.is_empty() { Ok(None) } else { String::from_utf8_lossy(a).parse().map(Some) })
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| Error::Bootstrap(format!("a rank's GIN address is malformed: {e}")))?;
    let _ = gin.tcp_peers.set(tcp_peers);
    // Every rank connects its verbs queue pairs (collective, even with no verbs peer).
    #[cfg(feature = "verbs")]
    {
        let verbs_peers: Vec<bool> = kinds.iter().map(|k| *k == Some(TransportKind::Verbs)).collect();
        *lock(&gin.verbs) = Some(transport::verbs::setup(comm, &gin, &verbs_peers)?);
    }
    if kinds.iter().any(Option::is_some) {
        proxy::start(&gin)?;
    }
    Ok((layout, GinOwner(gin)))
}
