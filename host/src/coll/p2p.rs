//! Point-to-point sends and receives with NCCL's group semantics, and all-to-all-v on them.
//!
//! A [`P2pGroup`] collects sends and receives ([`P2pGroup::send`], [`P2pGroup::recv`]) and
//! [`P2pGroup::launch`] queues them as one kernel on the rank's stream (NCCL's
//! `ncclGroupStart` … `ncclGroupEnd`): the operations of a group progress together, so a
//! rank may send to and receive from the same peer, or many peers, in one group. Messages
//! between a pair of ranks match in the order each side queued them (NCCL's rule); a send's
//! length must equal its receive's. [`Communicator::send`] and [`Communicator::recv`] are
//! groups of one.
//!
//! The kernel (`ferrolink_device::p2p`) is written on the public GIN API: a peer in the LSA
//! domain is written directly through the LSA mapping, any other through the GIN proxy
//! (copy engine, TCP or RDMA), so sends and receives work across nodes too. Data travels
//! through per-pair channels of slots in a receive window ([`P2pConfig`]), one copy into the
//! peer's slot and one out of it.
//!
//! The resources are made collectively, once, by [`Communicator::enable_p2p`] (window
//! registration is collective; sends and receives are not): every rank calls it before its
//! first send or receive. [`Communicator::all_to_allv`] (collective) makes them itself.
//!
//! ```
//! # fn main() -> ferrolink::Result<()> {
//! use ferrolink::{Communicator, Device, run_ranks};
//! let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
//! let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
//! let got = run_ranks(&comms, |c| {
//!     c.enable_p2p(None)?;
//!     let peer = 1 - c.rank();
//!     let send = c.device().alloc_from(&[c.rank() as u32 + 10; 100])?;
//!     let mut recv = c.device().alloc::<u32>(100)?;
//!     // Both ranks send and receive in one group: no deadlock whatever the order.
//!     let mut g = c.p2p_group();
//!     g.send(&send, peer)?;
//!     g.recv(&mut recv, peer)?;
//!     g.launch()?;
//!     recv.to_vec()
//! })?;
//! assert_eq!(got[0], vec![11; 100]);
//! assert_eq!(got[1], vec![10; 100]);
//! # Ok(()) }
//! ```

use crate::comm::Communicator;
use crate::devcomm::{DevCommHandle, DevCommRequirements};
use crate::mem::window::Window;
use crate::runtime::launch::{LaunchArg, LaunchArgs, LaunchConfig, LaunchTracking};
use crate::runtime::lifetime::lock;
use crate::runtime::memory::{DeviceBuffer, TrackedPtr};
use crate::{Backend, Error, Result};
use bytemuck::Pod;
use ferrolink_device::DevComm;
use ferrolink_device::kernels::p2p::p2p_group;
use ferrolink_device::p2p::{P2P_OP_WORDS, P2pArgs, P2pOp, op_kind};
use ferrolink_device::window::DevWindow;

/// The most operations one group holds (the device table is made up front: making memory
/// while peers' kernels run may wait for them).
///
/// ```
/// # fn main() -> ferrolink::Result<()> {
/// use ferrolink::coll::MAX_GROUP_OPS;
/// # use ferrolink::{Communicator, Device};
/// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// # let comm = Communicator::init_all(&[dev.clone()])?.remove(0);
/// let buf = dev.alloc::<u8>(1)?;
/// let mut g = comm.p2p_group();
/// for _ in 0..MAX_GROUP_OPS {
///     g.send(&buf, 0)?;
/// }
/// // One more is refused as it is queued (the group is dropped unlaunched: nothing ran).
/// assert!(g.send(&buf, 0).is_err());
/// # Ok(()) }
/// ```
pub const MAX_GROUP_OPS: usize = 4096;

/// The shape of the point-to-point channels (the same on every rank).
///
/// Memory per rank: two windows of `nranks × slots × chunk_bytes` (receive slots, and
/// staging for peers reached through the GIN proxy), the first with the group table after
/// its slots.
///
/// ```
/// # fn main() -> ferrolink::Result<()> {
/// use ferrolink::coll::P2pConfig;
/// # use ferrolink::{Communicator, Device};
/// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// # let comm = Communicator::init_all(&[dev])?.remove(0);
/// // 1000-byte slots do not split into 3 channels of 16-byte vectors.
/// let bad = P2pConfig { channels: 3, slots: 2, chunk_bytes: 1000 };
/// assert!(comm.enable_p2p(Some(bad)).is_err());
/// comm.enable_p2p(Some(P2pConfig { channels: 3, slots: 2, chunk_bytes: 48 << 10 }))?;
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct P2pConfig {
    /// Channels per pair of ranks: each moves its part of every chunk on a CTA of its own.
    pub channels: u32,
    /// Slots per sender in a receiver's window (chunks in flight per pair).
    pub slots: u32,
    /// Bytes per slot: a multiple of `16 × channels`.
    pub chunk_bytes: u32,
}

impl P2pConfig {
    /// The default for `backend` and `nranks` ranks. CUDA: 32 channels of 2 slots, the slots
    /// `64 MiB / nranks / 2` (between 512 KiB and 4 MiB), so that a window is at most about
    /// 64 MiB (and 8 MiB per peer when there are few); measured on two H200s (docs/PERF.md),
    /// 128 KiB per channel and step is where sendrecv reaches NVLink's rate. The CPU
    /// emulator: 2 channels of 4 slots of 16 KiB (small, so that tests cross many chunks).
    ///
    /// ```
    /// use ferrolink::{Backend, coll::P2pConfig};
    /// let cpu = P2pConfig::default_for(Backend::Cpu, 2);
    /// assert_eq!((cpu.channels, cpu.slots, cpu.chunk_bytes), (2, 4, 16 << 10));
    /// // CUDA: 4 MiB slots for 2 ranks, 512 KiB for 64.
    /// assert_eq!(P2pConfig::default_for(Backend::Cuda, 2).chunk_bytes, 4 << 20);
    /// assert_eq!(P2pConfig::default_for(Backend::Cuda, 64).chunk_bytes, 512 << 10);
    /// ```
    pub fn default_for(backend: Backend, nranks: usize) -> P2pConfig {
        let profile = crate::runtime::backend::launch_profile(backend);
        let chunk_bytes = profile.p2p_chunk_bytes.unwrap_or_else(|| {
            ((64usize << 20) / nranks.max(1) / 2).clamp(512 << 10, 4 << 20).next_power_of_two() as u32
        });
        P2pConfig { channels: profile.p2p_channels, slots: profile.p2p_slots, chunk_bytes }
    }

    /// [`P2pConfig::default_for`] with `FERROLINK_P2P_CHANNELS`, `FERROLINK_P2P_SLOTS` and
    /// `FERROLINK_P2P_CHUNK` (bytes, `K`/`M` suffixes) applied where set (every rank must see
    /// the same values).
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// use ferrolink::{Backend, coll::P2pConfig};
    /// // SAFETY: a doctest runs in a process of its own, and no other thread of it runs yet.
    /// unsafe { std::env::set_var("FERROLINK_P2P_CHUNK", "64K") };
    /// assert_eq!(P2pConfig::from_env(Backend::Cpu, 2)?.chunk_bytes, 64 << 10);
    /// // SAFETY: as above.
    /// unsafe { std::env::set_var("FERROLINK_P2P_SLOTS", "many") };
    /// assert!(P2pConfig::from_env(Backend::Cpu, 2).is_err());
    /// # Ok(()) }
    /// ```
    pub fn from_env(backend: Backend, nranks: usize) -> Result<P2pConfig> {
        let mut c = P2pConfig::default_for(backend, nranks);
        let get = |name: &str| -> Result<Option<u32>> {
            let Ok(v) = std::env::var(name) else { return Ok(None) };
            let (digits, scale) = match v.trim().strip_suffix(['K', 'k']) {
                Some(d) => (d, 1u64 << 10),
                None => match v.trim().strip_suffix(['M', 'm']) {
                    Some(d) => (d, 1 << 20),
                    None => (v.trim(), 1),
                },
            };
            digits
                .parse::<u64>()
                .ok()
                .and_then(|x| u32::try_from(x * scale).ok())
                .map(Some)
                .ok_or_else(|| Error::InvalidArgument(format!("{name}={v}: not a size")))
        };
        if let Some(v) = get("FERROLINK_P2P_CHANNELS")? {
            c.channels = v;
        }
        if let Some(v) = get("FERROLINK_P2P_SLOTS")? {
            c.slots = v;
        }
        if let Some(v) = get("FERROLINK_P2P_CHUNK")? {
            c.chunk_bytes = v;
        }
        Ok(c)
    }

    fn check(&self) -> Result<()> {
        if self.channels == 0 || self.slots == 0 || self.chunk_bytes == 0 {
            return Err(Error::InvalidArgument(format!("enable_p2p: {self:?} has a zero")));
        }
        if !self.chunk_bytes.is_multiple_of(16 * self.channels) {
            return Err(Error::InvalidArgument(format!(
                "enable_p2p: chunk_bytes {} is not a multiple of 16 x {} channels",
                self.chunk_bytes, self.channels
            )));
        }
        Ok(())
    }
}

/// One rank's point-to-point resources.
pub(crate) struct P2pState {
    cfg: P2pConfig,
    handle: DevCommHandle,
    send: Window,
    recv: Window,
    /// Where, in this rank's part of `recv` after the slots, lie the operations of the group
    /// in flight (`P2pOp`s as words, written in stream order) and the kernel's per-unit chunk
    /// counts (window memory: the driver's stream writes refuse pool memory).
    table_at: usize,
    progress_at: usize,
    progress_words: usize,
    /// Chunks queued so far to each peer, and from each peer (the pairs' sequence numbers).
    sent: Vec<u64>,
    received: Vec<u64>,
    /// Groups launched (their generation numbers).
    launches: u64,
}

/// Sends and receives queued together (NCCL's group): see the [module docs](self).
///
/// ```
/// # fn main() -> ferrolink::Result<()> {
/// # use ferrolink::{Communicator, Device, run_ranks};
/// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// let comms = Communicator::init_all(&[dev.clone(), dev.clone(), dev.clone()])?;
/// let got = run_ranks(&comms, |c| {
///     c.enable_p2p(None)?;
///     let (me, n) = (c.rank(), c.nranks());
///     let send = c.device().alloc_from(&[me as u32; 4])?;
///     let mut recv = c.device().alloc::<u32>(4)?;
///     // A ring shift: to the next rank and from the previous one, in one group.
///     let mut g = c.p2p_group();
///     g.send(&send, (me + 1) % n)?.recv(&mut recv, (me + n - 1) % n)?;
///     g.launch()?;
///     recv.to_vec()
/// })?;
/// assert_eq!(got, [[2; 4], [0; 4], [1; 4]]);
/// # Ok(()) }
/// ```
pub struct P2pGroup<'a> {
    comm: &'a Communicator,
    ops: Vec<P2pOp>,
    reads: Vec<TrackedPtr<'a, *const u8>>,
    writes: Vec<TrackedPtr<'a, *mut u8>>,
}

impl<'a> P2pGroup<'a> {
    fn check_peer(&self, peer: usize, what: &str) -> Result<()> {
        if peer >= self.comm.nranks() {
            return Err(Error::InvalidArgument(format!("{what}: peer {peer} is not a rank of {}", self.comm.nranks())));
        }
        if self.ops.len() >= MAX_GROUP_OPS {
            return Err(Error::InvalidArgument(format!("{what}: a group holds at most {MAX_GROUP_OPS} operations")));
        }
        Ok(())
    }

    /// Queues a send of all of `buf` to rank `peer` (which must queue a receive of the same
    /// length from this rank).
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// let got = run_ranks(&comms, |c| {
    ///     c.enable_p2p(None)?;
    ///     let data = c.device().alloc_from(&[1.5f32, 2.5])?;
    ///     let mut buf = c.device().alloc::<f32>(2)?;
    ///     let mut g = c.p2p_group();
    ///     // There is no rank 2 of 2.
    ///     assert!(g.send(&data, 2).is_err());
    ///     if c.rank() == 0 {
    ///         g.send(&data, 1)?;
    ///     } else {
    ///         g.recv(&mut buf, 0)?;
    ///     }
    ///     g.launch()?;
    ///     buf.to_vec()
    /// })?;
    /// assert_eq!(got[1], [1.5, 2.5]);
    /// # Ok(()) }
    /// ```
    pub fn send<T: Pod>(&mut self, buf: &'a DeviceBuffer<T>, peer: usize) -> Result<&mut Self> {
        self.send_slice(buf, 0, buf.len(), peer)
    }

    /// Queues a receive of all of `buf` from rank `peer`.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// let got = run_ranks(&comms, |c| {
    ///     c.enable_p2p(None)?;
    ///     let dev = c.device();
    ///     let (first, second) = (dev.alloc_from(&[1u64; 3])?, dev.alloc_from(&[2u64; 5])?);
    ///     let (mut a, mut b) = (dev.alloc::<u64>(3)?, dev.alloc::<u64>(5)?);
    ///     let mut g = c.p2p_group();
    ///     if c.rank() == 0 {
    ///         g.send(&first, 1)?.send(&second, 1)?;
    ///     } else {
    ///         // Messages from one peer match in the order each side queued them.
    ///         g.recv(&mut a, 0)?.recv(&mut b, 0)?;
    ///     }
    ///     g.launch()?;
    ///     Ok((a.to_vec()?, b.to_vec()?))
    /// })?;
    /// assert_eq!(got[1], (vec![1; 3], vec![2; 5]));
    /// # Ok(()) }
    /// ```
    pub fn recv<T: Pod>(&mut self, buf: &'a mut DeviceBuffer<T>, peer: usize) -> Result<&mut Self> {
        let len = buf.len();
        self.recv_slice(buf, 0, len, peer)
    }

    /// Queues a send of `count` elements of `buf` from element `offset` to rank `peer`
    /// (NCCL's pointer and count).
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// let got = run_ranks(&comms, |c| {
    ///     c.enable_p2p(None)?;
    ///     let data = c.device().alloc_from(&[0u16, 1, 2, 3, 4, 5, 6, 7])?;
    ///     let mut buf = c.device().alloc::<u16>(3)?;
    ///     let mut g = c.p2p_group();
    ///     // Elements 6..9 are not all in the buffer.
    ///     assert!(g.send_slice(&data, 6, 3, 1).is_err());
    ///     if c.rank() == 0 {
    ///         g.send_slice(&data, 2, 3, 1)?;
    ///     } else {
    ///         g.recv(&mut buf, 0)?;
    ///     }
    ///     g.launch()?;
    ///     buf.to_vec()
    /// })?;
    /// assert_eq!(got[1], [2, 3, 4]);
    /// # Ok(()) }
    /// ```
    pub fn send_slice<T: Pod>(
        &mut self,
        buf: &'a DeviceBuffer<T>,
        offset: usize,
        count: usize,
        peer: usize,
    ) -> Result<&mut Self> {
        self.check_peer(peer, "send")?;
        check_slice(buf.len(), offset, count, "send")?;
        let size = std::mem::size_of::<T>();
        let ptr = buf.bytes_at(0)?;
        self.push(op_kind::SEND, peer, ptr.param() as u64 + (offset * size) as u64, count * size);
        self.reads.push(ptr);
        Ok(self)
    }

    /// Queues a receive of `count` elements into `buf` from element `offset`, from rank `peer`.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// let got = run_ranks(&comms, |c| {
    ///     c.enable_p2p(None)?;
    ///     let data = c.device().alloc_from(&[5i32, 6])?;
    ///     let mut buf = c.device().alloc_from(&[-1i32; 4])?;
    ///     let mut g = c.p2p_group();
    ///     if c.rank() == 0 {
    ///         g.send(&data, 1)?;
    ///     } else {
    ///         // Into elements 2 and 3; the others stay as they were.
    ///         g.recv_slice(&mut buf, 2, 2, 0)?;
    ///     }
    ///     g.launch()?;
    ///     buf.to_vec()
    /// })?;
    /// assert_eq!(got[1], [-1, -1, 5, 6]);
    /// # Ok(()) }
    /// ```
    pub fn recv_slice<T: Pod>(
        &mut self,
        buf: &'a mut DeviceBuffer<T>,
        offset: usize,
        count: usize,
        peer: usize,
    ) -> Result<&mut Self> {
        self.check_peer(peer, "recv")?;
        check_slice(buf.len(), offset, count, "recv")?;
        let size = std::mem::size_of::<T>();
        let ptr = buf.bytes_at_mut(0)?;
        self.push(op_kind::RECV, peer, ptr.param() as u64 + (offset * size) as u64, count * size);
        self.writes.push(ptr);
        Ok(self)
    }

    /// Queues receives into several slices of one buffer, each `(offset, count, peer)`: `count`
    /// elements from element `offset`, from rank `peer` (NCCL's receives into pointers within
    /// one buffer, such as a gather from several peers, which [`P2pGroup::recv_slice`] cannot
    /// express: it borrows its buffer for the whole group). The slices must lie in the buffer
    /// and not overlap (empty ones may lie anywhere in it); each is matched with its peer's send
    /// as a [`P2pGroup::recv_slice`] queued in this order would be.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone(), dev.clone()])?;
    /// // Rank 0 gathers two elements from each of ranks 1 and 2 into one buffer.
    /// let got = run_ranks(&comms, |c| {
    ///     c.enable_p2p(None)?;
    ///     let mine = c.device().alloc_from(&[10 * c.rank() as u32, 10 * c.rank() as u32 + 1])?;
    ///     let mut all = c.device().alloc::<u32>(4)?;
    ///     let mut g = c.p2p_group();
    ///     if c.rank() == 0 {
    ///         g.recv_slices(&mut all, &[(0, 2, 1), (2, 2, 2)])?;
    ///     } else {
    ///         g.send(&mine, 0)?;
    ///     }
    ///     g.launch()?;
    ///     all.to_vec()
    /// })?;
    /// assert_eq!(got[0], [10, 11, 20, 21]);
    /// # let c = &comms[0];
    /// # c.enable_p2p(None)?;
    /// # let mut buf = c.device().alloc::<u32>(4)?;
    /// let mut g = comms[0].p2p_group();
    /// assert!(g.recv_slices(&mut buf, &[(0, 3, 1), (2, 2, 2)]).is_err()); // elements 2 and 3 twice
    /// # Ok(()) }
    /// ```
    pub fn recv_slices<T: Pod>(
        &mut self,
        buf: &'a mut DeviceBuffer<T>,
        parts: &[(usize, usize, usize)],
    ) -> Result<&mut Self> {
        if self.ops.len() + parts.len() > MAX_GROUP_OPS {
            return Err(Error::InvalidArgument(format!(
                "recv_slices: {} more operations would pass the group's {MAX_GROUP_OPS}",
                parts.len()
            )));
        }
        let mut ranges = Vec::with_capacity(parts.len());
        for &(offset, count, peer) in parts {
            self.check_peer(peer, "recv_slices")?;
            check_slice(buf.len(), offset, count, "recv_slices")?;
            if count > 0 {
                ranges.push((offset, offset + count, peer));
            }
        }
        ranges.sort_unstable();
        if let Some(w) = ranges.windows(2).find(|w| w[1].0 < w[0].1) {
            return Err(Error::InvalidArgument(format!(
                "recv_slices: the slice from rank {} (elements {}..{}) overlaps the one from rank {} (elements {}..{})",
                w[0].2, w[0].0, w[0].1, w[1].2, w[1].0, w[1].1
            )));
        }
        let size = std::mem::size_of::<T>();
        let ptr = buf.bytes_at_mut(0)?;
        let base = ptr.param() as u64;
        for &(offset, count, peer) in parts {
            self.push(op_kind::RECV, peer, base + (offset * size) as u64, count * size);
        }
        self.writes.push(ptr);
        Ok(self)
    }

    fn push(&mut self, kind: u32, peer: usize, addr: u64, bytes: usize) {
        let after = self.ops.iter().rposition(|o| o.kind == kind && o.peer as usize == peer).map_or(0, |i| i + 1);
        self.ops.push(P2pOp {
            kind,
            peer: peer as u32,
            buf: addr,
            bytes: bytes as u64,
            seq: 0,
            after: after as u32,
            _pad: 0,
        });
    }

    /// Queues the group on the rank's stream as one kernel (NCCL's `ncclGroupEnd`); returns
    /// when it is queued. An empty group queues nothing.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # use ferrolink::{Communicator, Device};
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comm = Communicator::init_all(&[dev.clone()])?.remove(0);
    /// let buf = dev.alloc::<u32>(4)?;
    /// // An empty group queues nothing (and needs no resources).
    /// comm.p2p_group().launch()?;
    /// // Any other needs Communicator::enable_p2p first.
    /// let mut g = comm.p2p_group();
    /// g.send(&buf, 0)?;
    /// assert!(g.launch().is_err());
    /// # Ok(()) }
    /// ```
    pub fn launch(self) -> Result<()> {
        let P2pGroup { comm, mut ops, reads, writes } = self;
        if ops.is_empty() {
            return Ok(());
        }
        // The kernel's table and scratch hold MAX_GROUP_OPS operations (every way of queuing
        // checks it; this keeps the table's bound next to the launch).
        if ops.len() > MAX_GROUP_OPS {
            return Err(Error::InvalidArgument(format!(
                "a group of {} operations: at most {MAX_GROUP_OPS}",
                ops.len()
            )));
        }
        if comm.stream().is_capturing() {
            return Err(Error::InvalidArgument(
                "send/recv/all_to_allv cannot be captured into a graph: their sequence numbers are counted on \
                 the host, so a replay would not match the peers' (capture collectives instead)"
                    .into(),
            ));
        }
        let module = comm.device().builtin_module()?;
        let mut guard = lock(&comm.shared.p2p);
        let state = guard.as_mut().ok_or_else(|| {
            Error::InvalidArgument(
                "send/recv: the point-to-point resources are not made; every rank calls \
                 Communicator::enable_p2p first (window registration is collective)"
                    .into(),
            )
        })?;
        let cfg = state.cfg;
        let args = P2pArgs {
            nops: ops.len() as u32,
            channels: cfg.channels,
            slots: cfg.slots,
            chunk: cfg.chunk_bytes,
            data_signal: 0,
            ack_signal: cfg.channels,
            generation: state.launches as u32,
            _pad: 0,
        };
        // Progress words carry their launch's generation, so earlier launches' words read as
        // 0. Generation 0 (the first launch, and again after 2^32) clears the scratch first,
        // in stream order: no word of an unknown generation is ever read.
        state.launches += 1;
        let stream = comm.stream();
        if args.generation == 0 {
            let zeros = vec![0u64; state.progress_words];
            stream.write_words(state.recv.slot_ptr(state.progress_at, zeros.len() * 8)?, &zeros)?;
        }
        // Sequence numbers: each pair's chunks in the order the operations were queued
        // (counted here, kept only once the group is queued: a failed call changes nothing).
        let (mut sent, mut received) = (state.sent.clone(), state.received.clone());
        for o in &mut ops {
            let count = if o.kind == op_kind::SEND { &mut sent } else { &mut received };
            o.seq = count[o.peer as usize];
            count[o.peer as usize] += args.chunks(o.bytes);
        }
        let words: Vec<u64> = ops.iter().flat_map(|o| bytemuck::cast::<P2pOp, [u64; P2P_OP_WORDS]>(*o)).collect();
        stream.write_words(state.recv.slot_ptr(state.table_at, words.len() * 8)?, &words)?;
        let dev = comm.device();
        let units = ops.len() as u32 * cfg.channels;
        // Every CTA must be resident (units wait for peers' units): the ranks sharing this
        // GPU share its SMs.
        let cap = dev.resident_ctas(dev.launch_profile().waiting_ctas, comm.ranks_sharing_gpu());
        let threads = super::threads(dev);
        let cfg_launch = LaunchConfig::linear(units.min(cap), threads);
        let launch = GroupLaunch {
            handle: &state.handle,
            send: &state.send,
            recv: &state.recv,
            args,
            table: state.recv.slot_ptr(state.table_at, words.len() * 8)?,
            progress: state.recv.slot_ptr(state.progress_at, units as usize * 8)?,
            reads: &reads,
            writes: &writes,
        };
        // SAFETY: the kernel's contract: the table holds `nops` operations (written just
        // before, in stream order) and the scratch `nops * channels` words (sized for
        // MAX_GROUP_OPS at set-up); every buffer holds its operation's bytes and is tracked
        // by this launch (kept alive, and ordered after and before other work on it); the
        // windows and signals are the point-to-point ones, used only by this stream's group
        // kernels, one at a time; every rank made them with the same configuration.
        unsafe { stream.launch(module, &p2p_group, cfg_launch, launch)? };
        state.sent = sent;
        state.received = received;
        Ok(())
    }
}

/// An error unless `count` elements from `offset` lie in a buffer of `len`.
fn check_slice(len: usize, offset: usize, count: usize, what: &str) -> Result<()> {
    if offset.checked_add(count).is_none_or(|end| end > len) {
        return Err(Error::InvalidArgument(format!(
            "{what}: {count} elements from element {offset} do not fit a buffer of {len}"
        )));
    }
    Ok(())
}

/// The group kernel's arguments, with every buffer of the group tracked.
struct GroupLaunch<'s, 'a> {
    handle: &'s DevCommHandle,
    send: &'s Window,
    recv: &'s Window,
    args: P2pArgs,
    table: TrackedPtr<'s, *const u64>,
    progress: TrackedPtr<'s, *mut u64>,
    reads: &'s [TrackedPtr<'a, *const u8>],
    writes: &'s [TrackedPtr<'a, *mut u8>],
}

impl LaunchArgs for GroupLaunch<'_, '_> {
    type Params = (DevComm, DevWindow, DevWindow, P2pArgs, *const u64, *mut u64);
    fn params(&self) -> Self::Params {
        (
            self.handle.param(),
            self.send.param(),
            self.recv.param(),
            self.args,
            self.table.param(),
            self.progress.param(),
        )
    }
    fn track(&self, t: &mut LaunchTracking) {
        self.handle.track(t);
        self.send.track(t);
        self.recv.track(t);
        self.table.track(t);
        self.progress.track(t);
        for r in self.reads {
            r.track(t);
        }
        for w in self.writes {
            w.track(t);
        }
    }
}

impl Communicator {
    /// Makes this rank's point-to-point resources (collective: every rank calls it, with the
    /// same configuration; `None`: [`P2pConfig::from_env`] for the device's backend). A second
    /// call with the same configuration does nothing; another configuration is an error.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// use ferrolink::coll::P2pConfig;
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// let cfg = P2pConfig { channels: 2, slots: 2, chunk_bytes: 8 << 10 };
    /// let refused = run_ranks(&comms, |c| {
    ///     c.enable_p2p(Some(cfg))?;
    ///     // Again with the same configuration: nothing to do. Another one is an error.
    ///     c.enable_p2p(Some(cfg))?;
    ///     Ok(c.enable_p2p(Some(P2pConfig { slots: 4, ..cfg })).is_err())
    /// })?;
    /// assert_eq!(refused, [true, true]);
    /// # Ok(()) }
    /// ```
    pub fn enable_p2p(&self, cfg: Option<P2pConfig>) -> Result<()> {
        let cfg = match cfg {
            Some(c) => c,
            None => P2pConfig::from_env(self.device().backend(), self.nranks())?,
        };
        cfg.check()?;
        let mut guard = lock(&self.shared.p2p);
        if let Some(s) = guard.as_ref() {
            if s.cfg == cfg {
                return Ok(());
            }
            return Err(Error::InvalidArgument(format!(
                "enable_p2p: already enabled with {:?}, now asked for {cfg:?}",
                s.cfg
            )));
        }
        let n = self.nranks();
        // Every rank must lay its windows and channels out alike (a per-process environment
        // variable could differ): compare before registering anything.
        let mine: Vec<u8> = [cfg.channels, cfg.slots, cfg.chunk_bytes].iter().flat_map(|v| v.to_le_bytes()).collect();
        for (r, theirs) in self.all_gather_bytes(&mine)?.iter().enumerate() {
            if *theirs != mine {
                let w = |i: usize| u32::from_le_bytes(theirs[i * 4..i * 4 + 4].try_into().expect("4 bytes"));
                return Err(Error::InvalidArgument(format!(
                    "enable_p2p: rank {} has {cfg:?} but rank {r} has channels {}, slots {}, chunk_bytes {} \
                     (FERROLINK_P2P_* must be the same everywhere)",
                    self.rank(),
                    w(0),
                    w(1),
                    w(2)
                )));
            }
        }
        let slots_bytes = n * cfg.slots as usize * cfg.chunk_bytes as usize;
        let table_at = slots_bytes;
        let progress_at = table_at + MAX_GROUP_OPS * P2P_OP_WORDS * 8;
        let progress_words = MAX_GROUP_OPS * cfg.channels as usize;
        let window_bytes = progress_at + progress_words * 8;
        // Windows first, then the device communicator (as for every device communicator).
        let send = self.register_window(self.mem_alloc(slots_bytes)?)?;
        let recv = self.register_window(self.mem_alloc(window_bytes)?)?;
        let handle = self.create_dev_comm(&DevCommRequirements {
            gin_context_count: cfg.channels,
            gin_signal_count: 2 * cfg.channels,
            ..DevCommRequirements::default()
        })?;
        *guard = Some(P2pState {
            cfg,
            handle,
            send,
            recv,
            table_at,
            progress_at,
            progress_words,
            sent: vec![0; n],
            received: vec![0; n],
            launches: 0,
        });
        Ok(())
    }

    /// A group of sends and receives to queue together: see [`P2pGroup`].
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # use ferrolink::{Communicator, Device};
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comm = Communicator::init_all(&[dev.clone()])?.remove(0);
    /// comm.enable_p2p(None)?;
    /// let (src, mut dst) = (dev.alloc_from(&[7u32; 4])?, dev.alloc::<u32>(4)?);
    /// let mut g = comm.p2p_group();
    /// // A message to itself (rank 0 of 1).
    /// g.send(&src, 0)?.recv(&mut dst, 0)?;
    /// g.launch()?;
    /// assert_eq!(dst.to_vec()?, [7; 4]);
    /// # Ok(()) }
    /// ```
    pub fn p2p_group(&self) -> P2pGroup<'_> {
        P2pGroup { comm: self, ops: Vec::new(), reads: Vec::new(), writes: Vec::new() }
    }

    /// Sends all of `buf` to rank `peer` (a group of one: the peer's matching receive may be
    /// in any group). Needs [`Communicator::enable_p2p`].
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// let got = run_ranks(&comms, |c| {
    ///     c.enable_p2p(None)?;
    ///     let mut buf = c.device().alloc_from(&[c.rank() as u8 + 5; 64])?;
    ///     if c.rank() == 0 {
    ///         c.send(&buf, 1)?;
    ///     } else {
    ///         c.recv(&mut buf, 0)?;
    ///     }
    ///     buf.to_vec()
    /// })?;
    /// assert_eq!(got[1], [5; 64]);
    /// # Ok(()) }
    /// ```
    pub fn send<T: Pod>(&self, buf: &DeviceBuffer<T>, peer: usize) -> Result<()> {
        let mut g = self.p2p_group();
        g.send(buf, peer)?;
        g.launch()
    }

    /// Receives all of `buf` from rank `peer` (a group of one).
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// let got = run_ranks(&comms, |c| {
    ///     c.enable_p2p(None)?;
    ///     let x = c.device().alloc_from(&[c.rank() as u32 + 1; 8])?;
    ///     let mut y = c.device().alloc::<u32>(8)?;
    ///     if c.rank() == 0 {
    ///         c.send(&x, 1)?;
    ///         c.recv(&mut y, 1)?;
    ///     } else {
    ///         // A ping-pong: rank 0's message goes back to it.
    ///         c.recv(&mut y, 0)?;
    ///         c.send(&y, 0)?;
    ///     }
    ///     y.to_vec()
    /// })?;
    /// assert_eq!(got, [[1; 8], [1; 8]]);
    /// # Ok(()) }
    /// ```
    pub fn recv<T: Pod>(&self, buf: &mut DeviceBuffer<T>, peer: usize) -> Result<()> {
        let mut g = self.p2p_group();
        g.recv(buf, peer)?;
        g.launch()
    }

    /// All-to-all with counts per peer (NCCL-style `alltoallv`, in elements): this rank sends
    /// `send[send_displs[p] ..][.. send_counts[p]]` to rank `p`, which receives it into
    /// `recv[recv_displs[me] ..][.. recv_counts[me]]`. Collective; makes the point-to-point
    /// resources on first use. Rank `p`'s `recv_counts[q]` must equal rank `q`'s
    /// `send_counts[p]` (checked across ranks in debug builds or with
    /// `FERROLINK_COLL_CHECK=1`); receive ranges must not overlap.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// let got = run_ranks(&comms, |c| {
    ///     let (r, n) = (c.rank(), c.nranks());
    ///     // Rank r sends r + 1 elements to each rank p, all 10 r + p ...
    ///     let send: Vec<u32> = (0..n).flat_map(|p| vec![(10 * r + p) as u32; r + 1]).collect();
    ///     let (send_counts, send_displs) = (vec![r + 1; n], [0, r + 1]);
    ///     // ... so it receives q + 1 elements from rank q.
    ///     let (recv_counts, recv_displs) = ([1, 2], [0, 1]);
    ///     let mut recv = c.device().alloc::<u32>(3)?;
    ///     let send = c.device().alloc_from(&send)?;
    ///     c.all_to_allv(&send, &send_counts, &send_displs, &mut recv, &recv_counts, &recv_displs)?;
    ///     recv.to_vec()
    /// })?;
    /// assert_eq!(got, [[0, 10, 10], [1, 11, 11]]);
    /// # Ok(()) }
    /// ```
    #[allow(clippy::too_many_arguments)]
    pub fn all_to_allv<T: Pod>(
        &self,
        send: &DeviceBuffer<T>,
        send_counts: &[usize],
        send_displs: &[usize],
        recv: &mut DeviceBuffer<T>,
        recv_counts: &[usize],
        recv_displs: &[usize],
    ) -> Result<()> {
        let n = self.nranks();
        for (what, v) in [
            ("send_counts", send_counts),
            ("send_displs", send_displs),
            ("recv_counts", recv_counts),
            ("recv_displs", recv_displs),
        ] {
            if v.len() != n {
                return Err(Error::InvalidArgument(format!("all_to_allv: {what} has {} entries, {n} needed", v.len())));
            }
        }
        let in_bounds = |counts: &[usize], displs: &[usize], len: usize, what: &str| -> Result<()> {
            for p in 0..n {
                if displs[p].checked_add(counts[p]).is_none_or(|end| end > len) {
                    return Err(Error::InvalidArgument(format!(
                        "all_to_allv: {what} block for rank {p} ({} elements at {}) is outside the buffer of {len}",
                        counts[p], displs[p]
                    )));
                }
            }
            Ok(())
        };
        in_bounds(send_counts, send_displs, send.len(), "send")?;
        in_bounds(recv_counts, recv_displs, recv.len(), "receive")?;
        if super::check_calls() {
            let mine: Vec<u8> = send_counts.iter().flat_map(|c| (*c as u64).to_le_bytes()).collect();
            let all = self.all_gather_bytes(&mine)?;
            for (p, theirs) in all.iter().enumerate() {
                let to_me = u64::from_le_bytes(theirs[self.rank() * 8..self.rank() * 8 + 8].try_into().expect("8"));
                if to_me != recv_counts[p] as u64 {
                    return Err(Error::InvalidArgument(format!(
                        "all_to_allv: rank {} expects {} elements from rank {p}, which sends it {to_me}",
                        self.rank(),
                        recv_counts[p]
                    )));
                }
            }
        }
        self.enable_p2p(None)?;
        let size = std::mem::size_of::<T>();
        let mut g = self.p2p_group();
        // Receives first, then sends, each from the next rank on: every rank starts with a
        // different peer (the kernel progresses all of them anyway).
        let me = self.rank();
        let receives: Vec<(usize, usize, usize)> = (0..n)
            .map(|k| (me + n - k) % n)
            .filter(|&p| recv_counts[p] > 0)
            .map(|p| (recv_displs[p], recv_counts[p], p))
            .collect();
        g.recv_slices(recv, &receives).map_err(|e| match e {
            Error::InvalidArgument(m) => Error::InvalidArgument(m.replacen("recv_slices", "all_to_allv", 1)),
            e => e,
        })?;
        let sptr = send.bytes_at(0)?;
        let base_s = sptr.param() as u64;
        for k in 0..n {
            let p = (me + k) % n;
            if send_counts[p] > 0 {
                g.check_peer(p, "all_to_allv")?;
                g.push(op_kind::SEND, p, base_s + (send_displs[p] * size) as u64, send_counts[p] * size);
            }
        }
        g.reads.push(sptr);
        g.launch()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_default_chunks_stay_between_512_kib_and_4_mib_and_split_into_channels() {
        for n in [1, 2, 3, 8, 17, 64, 1000] {
            let c = P2pConfig::default_for(Backend::Cuda, n);
            c.check().expect("a valid default");
            assert!((512 << 10..=4 << 20).contains(&c.chunk_bytes), "{n} ranks: {c:?}");
        }
        assert_eq!(P2pConfig::default_for(Backend::Cuda, 2).chunk_bytes, 4 << 20);
        assert_eq!(P2pConfig::default_for(Backend::Cuda, 64).chunk_bytes, 512 << 10);
    }
}
