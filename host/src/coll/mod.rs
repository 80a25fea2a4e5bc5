//! Collectives per rank, NCCL-shaped, on the rank's stream: all-reduce, reduce-scatter,
//! all-gather, broadcast, reduce and all-to-all, for `f32`, `f16`, `bf16`, `f64`, `i32`, `i64`,
//! `u8` and `u32` with sum, prod, min, max and avg, in place or out of place.
//!
//! They run as one kernel per call written on the public device API (`ferrolink_device::coll`,
//! LSA barriers and windows): every rank launches the same grid, CTA `b` meets its peers at
//! LSA barrier `b`, reads (or, two-shot, writes) their memory directly, and meets them again.
//! Inputs and outputs are any device buffers; those in registered windows
//! ([`Input::Window`], [`Output::Window`]) are used where they are (zero copy), the others are
//! staged through the communicator's own windows (a device copy before and after). Small
//! one-shot calls inside one LSA domain use the LL protocol instead ([`proto::LL`]: each rank
//! stores its data with a flag in every word straight into its peers' LL buffers, which
//! they poll; no barrier, and the input is read where it is; see [`Collective::proto`]).
//!
//! Across LSA domains (several nodes, or `FERROLINK_LSA` on one) the collectives run through
//! GIN instead (`ferrolink_device::coll::run_gin`): one-shot (each rank puts what each peer
//! needs into the peer's gather window, then computes from its copies), or, for all-reduce,
//! reduce-scatter and all-gather, a ring ([`algo::RING`]: each rank puts only to the next;
//! the tuner's pick for large messages over more than two ranks), or, for all-reduce, a
//! binary tree ([`algo::TREE`], when asked for), or hierarchically ([`algo::HIERARCHICAL`]:
//! LSA reduce-scatter inside each domain, the pieces all-reduced across domains through GIN,
//! LSA all-gather).
//!
//! ```
//! # fn main() -> ferrolink::Result<()> {
//! use ferrolink::coll::ReduceOp;
//! use ferrolink::{Communicator, Device, run_ranks};
//! let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
//! let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
//! let sums = run_ranks(&comms, |c| {
//!     let send = c.device().alloc_from(&[c.rank() as f32 + 1.0; 5])?;
//!     let mut recv = c.device().alloc::<f32>(5)?;
//!     c.all_reduce(&send, &mut recv, ReduceOp::Sum)?;
//!     recv.to_vec()
//! })?;
//! assert_eq!(sums[1], vec![3.0; 5]);
//! # Ok(()) }
//! ```

use crate::comm::Communicator;
use crate::devcomm::{DevCommHandle, DevCommRequirements};
use crate::mem::window::Window;
use crate::ops::launch_copy;
use crate::runtime::launch::LaunchArg;
use crate::runtime::launch::LaunchConfig;
use crate::runtime::memory::{DeviceBuffer, TrackedPtr};
use crate::runtime::phases::{self, Phase};
pub use crate::runtime::phases::{HostPhase, host_phases, reset_host_phases};
use crate::{Error, Result};
use ferrolink_device::coll::CollArgs;
use ferrolink_device::coll::group::{CollOp, RankOp};
use ferrolink_device::coll::ll;
pub use ferrolink_device::coll::{CollElem, CollKind, DataType, RedOp as ReduceOp, algo, proto};
use ferrolink_device::kernels::coll::{coll_gin, coll_gpu_group_launch, coll_ll, coll_ll_group_launch, coll_lsa};
use ferrolink_device::kernels::copy::ferrolink_copy;
pub use half::{bf16, f16};
pub use p2p::{MAX_GROUP_OPS, P2pConfig, P2pGroup};
pub use persistent::{DEFAULT_PERSISTENT_CTAS, PersistentConfig};
use std::sync::Arc;

/// The value of environment variable `$name` (a literal), read once per process: a read of
/// the environment takes the process's environment lock and copies the value, and 8 ranks'
/// threads reading four settings at every call shared that lock (as NCCL, the settings are
/// the process's, read at their first use).
macro_rules! setting {
    ($name:literal) => {{
        static VALUE: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
        VALUE.get_or_init(|| std::env::var($name).ok()).as_deref()
    }};
}

pub(crate) mod group;
pub mod p2p;
pub mod persistent;

/// Up to how many bytes of `count` elements per sender the tuner picks the LL protocol
/// inside one LSA domain (see [`Collective::proto`]).
///
/// ```
/// use ferrolink::coll::LL_TUNED_BYTES;
/// use ferrolink::device_api::coll::ll;
/// // Within what LL can carry; up to 4096 f32 per rank by default.
/// assert!(LL_TUNED_BYTES <= ll::MAX_BYTES);
/// assert_eq!(LL_TUNED_BYTES / std::mem::size_of::<f32>(), 4096);
/// ```
pub const LL_TUNED_BYTES: usize = 16 << 10;

/// The most CTAs a collective's grid has (each needs an LSA barrier of its own).
///
/// ```
/// # use ferrolink::coll::{DEFAULT_PERSISTENT_CTAS, MAX_CTAS, PersistentConfig};
/// # use ferrolink::{Communicator, Device};
/// # fn main() -> ferrolink::Result<()> {
/// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// assert!(DEFAULT_PERSISTENT_CTAS <= MAX_CTAS);
/// let comms = Communicator::init_all(&[dev])?;
/// let too_many = PersistentConfig { ctas: Some(MAX_CTAS + 1), ..Default::default() };
/// assert!(comms[0].start_persistent(too_many).is_err());
/// # Ok(()) }
/// ```
pub const MAX_CTAS: u32 = 128;

/// Where a collective reads this rank's input.
///
/// ```
/// # use ferrolink::coll::{CollKind, Collective, Input, Output, ReduceOp};
/// # use ferrolink::{Communicator, Device, run_ranks};
/// # fn main() -> ferrolink::Result<()> {
/// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// let comms = Communicator::init_all(&[dev.clone(), dev])?;
/// let sums = run_ranks(&comms, |c| {
///     // Zero copy: peers read this rank's input in its window.
///     let win = c.register_window(c.mem_alloc(4 * 4)?)?;
///     win.copy_from_host(0, &[c.rank() as i32 + 1; 4])?;
///     c.barrier()?; // every rank's input written before any kernel reads it
///     let mut recv = c.device().alloc::<i32>(4)?;
///     let call = Collective::new(CollKind::AllReduce, 4);
///     c.collective(&call, Input::Window(&win, 0), Output::Buffer(&mut recv))?;
///     recv.to_vec()
/// })?;
/// assert_eq!(sums[0], [3; 4]);
/// # Ok(()) }
/// ```
pub enum Input<'a, T: bytemuck::Pod> {
    /// A device buffer (staged through the communicator's window when not in one).
    Buffer(&'a DeviceBuffer<T>),
    /// Elements at byte `offset` of this rank's buffer of a registered window (zero copy).
    /// Peers read it there: every rank passes the same window at the same offset (or every
    /// rank a buffer or in place); the call check (`Collective::check`) says which rank
    /// differs.
    Window(&'a Window, usize),
    /// The output holds the input (NCCL's `sendbuff == recvbuff`, with NCCL's offsets for
    /// all-gather and reduce-scatter: this rank's part of the output).
    InPlace,
}

/// Where a collective writes this rank's output.
///
/// ```
/// # use ferrolink::coll::{CollKind, Collective, Input, Output, ReduceOp};
/// # use ferrolink::{Communicator, Device, run_ranks};
/// # fn main() -> ferrolink::Result<()> {
/// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// let comms = Communicator::init_all(&[dev.clone(), dev])?;
/// let gathered = run_ranks(&comms, |c| {
///     let win = c.register_window(c.mem_alloc(2 * 4)?)?;
///     let send = c.device().alloc_from(&[c.rank() as u32 + 7])?;
///     let call = Collective::new(CollKind::AllGather, 1);
///     c.collective(&call, Input::Buffer(&send), Output::Window(&win, 0))?;
///     c.synchronize()?;
///     win.read::<u32>(0, 2)
/// })?;
/// assert_eq!(gathered[1], [7, 8]);
/// # Ok(()) }
/// ```
pub enum Output<'a, T: bytemuck::Pod> {
    /// A device buffer.
    Buffer(&'a mut DeviceBuffer<T>),
    /// Elements at byte `offset` of this rank's buffer of a registered window.
    Window(&'a Window, usize),
}

/// One collective call: what it does and with how many elements (NCCL's counts: see
/// [`CollKind`]).
///
/// ```
/// # use ferrolink::coll::{CollKind, Collective, Input, Output, ReduceOp};
/// # use ferrolink::{Communicator, Device, run_ranks};
/// # fn main() -> ferrolink::Result<()> {
/// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// let comms = Communicator::init_all(&[dev.clone(), dev])?;
/// let call = Collective { op: ReduceOp::Max, ..Collective::new(CollKind::AllReduce, 3) };
/// let out = run_ranks(&comms, |c| {
///     let r = c.rank() as i64;
///     let mut buf = c.device().alloc_from(&[10 * r, -r, 5])?;
///     c.collective(&call, Input::InPlace, Output::Buffer(&mut buf))?;
///     buf.to_vec()
/// })?;
/// assert_eq!(out[0], [10, 0, 5]);
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Collective {
    /// Which collective.
    pub kind: CollKind,
    /// Elements: per rank's input for all-reduce, broadcast, reduce and all-gather; per rank's
    /// output for reduce-scatter; per peer for all-to-all.
    pub count: usize,
    /// The reduction (reductions only; ignored otherwise).
    pub op: ReduceOp,
    /// The root rank (broadcast and reduce; ignored otherwise).
    pub root: usize,
    /// Forces an algorithm ([`algo`]) where it applies (two-shot: all-reduce inside one LSA
    /// domain; ring: all-reduce, reduce-scatter and all-gather across domains; tree:
    /// all-reduce across domains; hierarchical: all-reduce, reduce-scatter and all-gather
    /// across domains of two ranks or more); `None`, or an algorithm that does not apply, lets the tuner pick (by size and
    /// topology; `FERROLINK_ALGO=one_shot|two_shot|ring|tree|hierarchical` overrides it the
    /// same way).
    pub algo: Option<u32>,
    /// Forces a protocol ([`proto`]) where it applies (LL: one-shot all-reduce,
    /// reduce-scatter, all-gather and all-to-all inside one LSA domain, up to
    /// `ferrolink_device::coll::ll::MAX_BYTES` of `count` elements, in a grid the GPU holds
    /// beside its other ranks' or, in persistent mode, within the kernel's CTAs per rank when
    /// it has at most `ll::MAX_CTAS`; simple: everywhere); `None`, or a
    /// protocol that does not apply, lets the tuner pick (LL up to [`LL_TUNED_BYTES`];
    /// `FERROLINK_PROTO=simple|ll` overrides it the same way). LL is a one-shot: with
    /// another algorithm the simple protocol runs.
    pub proto: Option<u32>,
    /// Whether to compare this call with every rank's first (an all-gather on the host);
    /// `None`: in debug builds, or with `FERROLINK_COLL_CHECK=1`.
    pub check: Option<bool>,
}

impl Collective {
    /// `kind` over `count` elements with sum, root 0 and the tuner's algorithm.
    ///
    /// ```
    /// use ferrolink::coll::{CollKind, Collective, ReduceOp};
    /// let c = Collective::new(CollKind::Broadcast, 8);
    /// assert_eq!((c.count, c.op, c.root, c.algo, c.proto), (8, ReduceOp::Sum, 0, None, None));
    /// ```
    pub fn new(kind: CollKind, count: usize) -> Collective {
        Collective { kind, count, op: ReduceOp::Sum, root: 0, algo: None, proto: None, check: None }
    }

    /// (elements of the input, elements of the output) per rank, for `nranks` ranks.
    ///
    /// ```
    /// use ferrolink::coll::{CollKind, Collective};
    /// assert_eq!(Collective::new(CollKind::ReduceScatter, 4).lengths(3), (12, 4));
    /// assert_eq!(Collective::new(CollKind::AllGather, 4).lengths(3), (4, 12));
    /// ```
    pub fn lengths(&self, nranks: usize) -> (usize, usize) {
        let c = self.count;
        match self.kind {
            CollKind::AllReduce | CollKind::Broadcast | CollKind::Reduce => (c, c),
            CollKind::ReduceScatter => (c * nranks, c),
            CollKind::AllGather => (c, c * nranks),
            CollKind::AllToAll => (c * nranks, c * nranks),
        }
    }

    /// The element offset of the input inside the output for [`Input::InPlace`] on `rank`.
    fn in_place_offset(&self, rank: usize) -> usize {
        match self.kind {
            CollKind::AllGather => rank * self.count,
            _ => 0,
        }
    }

    fn name(&self) -> &'static str {
        match self.kind {
            CollKind::AllReduce => "all_reduce",
            CollKind::ReduceScatter => "reduce_scatter",
            CollKind::AllGather => "all_gather",
            CollKind::Broadcast => "broadcast",
            CollKind::Reduce => "reduce",
            CollKind::AllToAll => "all_to_all",
        }
    }
}

/// The communicator's collective resources, made by the first collective call (every rank
/// makes them in the same call: the calls are collective).
pub(crate) struct CollState {
    handle: Option<DevCommHandle>,
    /// The handle's device communicator as shared launches' entries refer to it (made with
    /// the handle: its value never changes).
    comm_image: Option<Arc<group::CommImage>>,
    /// Staging for inputs (`send`) and outputs (`recv`), grown (collectively) on demand.
    send: Option<Window>,
    recv: Option<Window>,
    /// Across LSA domains: where the peers' data lands (a slot per rank).
    gather: Option<Window>,
    /// The LL protocol's buffer (`ll::buffer_bytes`), made by the first LL call and
    /// remade, zeroed, with every new device communicator: its lines carry flags from the
    /// communicator's barrier epochs, which start again from 0 in a new one (or after a
    /// recovery), so a line of the old sequence could carry a new call's flag.
    ll: Option<Window>,
    /// Every LL buffer made (the current one too): a CUDA graph may hold an older one with
    /// its device communicator, and `recover` resets every device communicator's epochs, so
    /// each is zeroed then (see [`after_recover`]). One per renewal of the device
    /// communicator, 2 MiB each at 8 ranks.
    ll_made: Vec<Window>,
    /// An upper bound on the epoch that any collective barrier of the current device
    /// communicator has reached (each call advances its barriers by two, an LL call by one):
    /// an LL call that could take it to its limit ([`FlagEpochs`]) renews the device
    /// communicator and the LL buffer first, so that a flag never wraps to one that a stale
    /// line still carries (`ferrolink_device::coll::ll`, *Freshness*). Every rank counts the
    /// same calls, so every rank renews in the same call. Replays of a captured graph are
    /// not counted.
    ll_epochs: FlagEpochs,
    /// The ranks of this communicator on this rank's GPU in this process.
    pub(crate) group: Arc<group::GpuGroup>,
}

impl CollState {
    /// The state of the first collective call.
    fn new(comm: &Communicator) -> Result<CollState> {
        let group = group::GpuGroup::of(comm);
        if group.members.len() > 1 {
            // The ring now, before any of the group's kernels runs.
            group.prepare(comm.device())?;
        }
        Ok(CollState {
            handle: None,
            comm_image: None,
            send: None,
            recv: None,
            gather: None,
            ll: None,
            ll_made: Vec::new(),
            ll_epochs: FlagEpochs::new(),
            group,
        })
    }

    /// Replaces the device communicator (after the staging windows changed), with a new,
    /// zeroed LL buffer if `with_ll` (else none: see [`CollState::ll`]).
    fn renew_handle(&mut self, comm: &Communicator, with_ll: bool) -> Result<()> {
        self.ll = None;
        self.ll_epochs.counted = 0;
        if with_ll {
            let bytes = ll::buffer_bytes(comm.lsa_size());
            // Zero-filled (`mem_alloc`): no line carries a flag yet.
            let win = comm.register_window(comm.mem_alloc(bytes)?)?;
            self.ll_made.push(win.clone());
            self.ll = Some(win);
        }
        let mut req = DevCommRequirements { lsa_barrier_count: MAX_CTAS, ..Default::default() };
        if comm.lsa_size() != comm.nranks() {
            // `coll_gin`: a signal and a (hybrid) barrier per CTA, on one context.
            req.gin_context_count = 1;
            req.gin_signal_count = MAX_CTAS;
            req.gin_barrier_count = MAX_CTAS;
        }
        let handle = comm.create_dev_comm(&req)?;
        self.comm_image = Some(Arc::new(group::CommImage(handle.dev_comm())));
        self.handle = Some(handle);
        Ok(())
    }
}

/// The epoch bound at which an LL call renews the device communicator and its LL buffer
/// ([`CollState::ll_epochs`]): half the 32-bit flag's range, far from its wrap, and about 10^9
/// calls (hours of back-to-back calls) between renewals, which cost one collective window
/// registration.
const LL_EPOCH_LIMIT: u64 = 1 << 31;

/// An upper bound on the epochs that a device communicator's collective barriers have
/// reached, which are the LL flags: each call advances them by two, an LL call by one. An LL
/// call may run on them while one more stays below `limit`; else the communicator (and its LL
/// buffer) must be renewed first, or, where nothing can be renewed (persistent mode), the
/// simple protocol runs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FlagEpochs {
    /// Epochs counted since the communicator was made (or recovered).
    pub(crate) counted: u64,
    /// [`LL_EPOCH_LIMIT`] (lowered by tests).
    pub(crate) limit: u64,
}

impl FlagEpochs {
    /// None counted, [`LL_EPOCH_LIMIT`].
    pub(crate) const fn new() -> Self {
        FlagEpochs { counted: 0, limit: LL_EPOCH_LIMIT }
    }

    /// Whether one more LL call stays below the limit.
    pub(crate) fn ll_fits(&self) -> bool {
        self.counted + 1 < self.limit
    }

    /// Counts a call (`ll`: with the LL protocol).
    pub(crate) fn count(&mut self, ll: bool) {
        self.counted += if ll { 1 } else { 2 };
    }
}

/// The collectives' state of `comm`, made by the first call.
pub(crate) fn coll_state<'a>(comm: &Communicator, guard: &'a mut Option<CollState>) -> Result<&'a mut CollState> {
    if guard.is_none() {
        *guard = Some(CollState::new(comm)?);
    }
    Ok(guard.as_mut().expect("made above"))
}

/// [`Communicator::recover`]'s step for the collectives: puts the ranks sharing `comm`'s GPU
/// back in step and zeroes the LL buffers, persistent mode's included (nothing before the
/// first collective call).
pub(crate) fn after_recover(comm: &Communicator) -> Result<()> {
    if let Some(state) = crate::runtime::lifetime::lock(&comm.shared.coll).as_mut() {
        state.group.resync();
        // The barrier epochs (the LL flags) start again from 0: the next LL call makes a
        // zeroed buffer, and with it a new device communicator (see `CollState::ll`); every
        // earlier buffer is zeroed, as a captured graph may replay an LL call on it with its
        // device communicator, whose epochs were reset too. No kernel runs now (the caller
        // drained this rank's stream, and no rank calls before the next barrier).
        state.ll = None;
        for w in &state.ll_made {
            w.zero(0, w.size())?;
        }
    }
    // The persistent kernel's LL buffer likewise (its device communicator was reset too).
    comm.persistent_after_recover()
}

impl Communicator {
    /// Out-of-place all-reduce of `send` into `recv` (same length) with `op`.
    ///
    /// ```
    /// # use ferrolink::coll::ReduceOp;
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let comms = Communicator::init_all(&[dev.clone(), dev])?;
    /// let maxima = run_ranks(&comms, |c| {
    ///     let r = c.rank() as i32;
    ///     let send = c.device().alloc_from(&[r, 10 - r])?;
    ///     let mut recv = c.device().alloc::<i32>(2)?;
    ///     c.all_reduce(&send, &mut recv, ReduceOp::Max)?;
    ///     recv.to_vec()
    /// })?;
    /// assert_eq!(maxima, [[1, 10], [1, 10]]);
    /// # Ok(()) }
    /// ```
    pub fn all_reduce<T: CollElem>(
        &self,
        send: &DeviceBuffer<T>,
        recv: &mut DeviceBuffer<T>,
        op: ReduceOp,
    ) -> Result<()> {
        let c = Collective { op, ..Collective::new(CollKind::AllReduce, send.len()) };
        self.collective(&c, Input::Buffer(send), Output::Buffer(recv))
    }

    /// In-place all-reduce of `buf` with `op`.
    ///
    /// ```
    /// # use ferrolink::coll::ReduceOp;
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let comms = Communicator::init_all(&[dev.clone(), dev])?;
    /// let sums = run_ranks(&comms, |c| {
    ///     let mut buf = c.device().alloc_from(&[c.rank() as f64 + 1.0; 4])?;
    ///     c.all_reduce_in_place(&mut buf, ReduceOp::Sum)?;
    ///     buf.to_vec()
    /// })?;
    /// assert_eq!(sums[1], [3.0; 4]);
    /// # Ok(()) }
    /// ```
    pub fn all_reduce_in_place<T: CollElem>(&self, buf: &mut DeviceBuffer<T>, op: ReduceOp) -> Result<()> {
        let c = Collective { op, ..Collective::new(CollKind::AllReduce, buf.len()) };
        self.collective(&c, Input::InPlace, Output::Buffer(buf))
    }

    /// Reduce-scatter: `recv` (its length is the count) gets the reduction of part
    /// `rank` of every rank's `send` (`nranks` times as long).
    ///
    /// ```
    /// # use ferrolink::coll::ReduceOp;
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let comms = Communicator::init_all(&[dev.clone(), dev])?;
    /// let parts = run_ranks(&comms, |c| {
    ///     let r = 10 * c.rank() as u32;
    ///     let send = c.device().alloc_from(&[r, r + 1, r + 2, r + 3])?; // two parts of two
    ///     let mut recv = c.device().alloc::<u32>(2)?;
    ///     c.reduce_scatter(&send, &mut recv, ReduceOp::Sum)?;
    ///     recv.to_vec()
    /// })?;
    /// assert_eq!(parts, [[10, 12], [14, 16]]); // 0 + 10, 1 + 11 | 2 + 12, 3 + 13
    /// # Ok(()) }
    /// ```
    pub fn reduce_scatter<T: CollElem>(
        &self,
        send: &DeviceBuffer<T>,
        recv: &mut DeviceBuffer<T>,
        op: ReduceOp,
    ) -> Result<()> {
        let c = Collective { op, ..Collective::new(CollKind::ReduceScatter, recv.len()) };
        self.collective(&c, Input::Buffer(send), Output::Buffer(recv))
    }

    /// All-gather: `recv` (`nranks` times `send`'s length) gets every rank's `send`, in rank
    /// order.
    ///
    /// ```
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let comms = Communicator::init_all(&[dev.clone(), dev])?;
    /// let all = run_ranks(&comms, |c| {
    ///     let send = c.device().alloc_from(&[c.rank() as u32; 2])?;
    ///     let mut recv = c.device().alloc::<u32>(4)?;
    ///     c.all_gather(&send, &mut recv)?;
    ///     recv.to_vec()
    /// })?;
    /// assert_eq!(all[0], [0, 0, 1, 1]);
    /// # Ok(()) }
    /// ```
    pub fn all_gather<T: CollElem>(&self, send: &DeviceBuffer<T>, recv: &mut DeviceBuffer<T>) -> Result<()> {
        let c = Collective::new(CollKind::AllGather, send.len());
        self.collective(&c, Input::Buffer(send), Output::Buffer(recv))
    }

    /// Broadcast of the root's `send` into every rank's `recv` (`send` is read on the root
    /// only, but every rank passes one of the same length).
    ///
    /// ```
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let comms = Communicator::init_all(&[dev.clone(), dev])?;
    /// let got = run_ranks(&comms, |c| {
    ///     let send = c.device().alloc_from(&[100 * c.rank() as i32 + 5; 3])?;
    ///     let mut recv = c.device().alloc::<i32>(3)?;
    ///     c.broadcast(&send, &mut recv, 1)?; // rank 1's
    ///     recv.to_vec()
    /// })?;
    /// assert_eq!(got, [[105; 3], [105; 3]]);
    /// # Ok(()) }
    /// ```
    pub fn broadcast<T: CollElem>(
        &self,
        send: &DeviceBuffer<T>,
        recv: &mut DeviceBuffer<T>,
        root: usize,
    ) -> Result<()> {
        let c = Collective { root, ..Collective::new(CollKind::Broadcast, send.len()) };
        self.collective(&c, Input::Buffer(send), Output::Buffer(recv))
    }

    /// Reduce of every rank's `send` into the root's `recv` with `op` (other ranks' `recv` is
    /// left as it is).
    ///
    /// ```
    /// # use ferrolink::coll::ReduceOp;
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let comms = Communicator::init_all(&[dev.clone(), dev])?;
    /// let got = run_ranks(&comms, |c| {
    ///     let send = c.device().alloc_from(&[c.rank() as f32 + 2.0; 3])?;
    ///     let mut recv = c.device().alloc_from(&[-1.0f32; 3])?;
    ///     c.reduce(&send, &mut recv, ReduceOp::Prod, 0)?;
    ///     recv.to_vec()
    /// })?;
    /// assert_eq!(got[0], [6.0; 3]); // 2 * 3 on the root
    /// assert_eq!(got[1], [-1.0; 3]); // left as it was
    /// # Ok(()) }
    /// ```
    pub fn reduce<T: CollElem>(
        &self,
        send: &DeviceBuffer<T>,
        recv: &mut DeviceBuffer<T>,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        let c = Collective { op, root, ..Collective::new(CollKind::Reduce, send.len()) };
        self.collective(&c, Input::Buffer(send), Output::Buffer(recv))
    }

    /// All-to-all: block `p` of `send` (each `send.len() / nranks` elements) goes to rank `p`,
    /// into block `rank` of its `recv`.
    ///
    /// ```
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let comms = Communicator::init_all(&[dev.clone(), dev])?;
    /// let got = run_ranks(&comms, |c| {
    ///     let r = 10 * c.rank() as u32;
    ///     let send = c.device().alloc_from(&[r, r, r + 1, r + 1])?; // block p for rank p
    ///     let mut recv = c.device().alloc::<u32>(4)?;
    ///     c.all_to_all(&send, &mut recv)?;
    ///     recv.to_vec()
    /// })?;
    /// assert_eq!(got, [[0, 0, 10, 10], [1, 1, 11, 11]]);
    /// # Ok(()) }
    /// ```
    pub fn all_to_all<T: CollElem>(&self, send: &DeviceBuffer<T>, recv: &mut DeviceBuffer<T>) -> Result<()> {
        let n = self.nranks();
        if !send.len().is_multiple_of(n) {
            return Err(Error::InvalidArgument(format!(
                "all_to_all: the send buffer's {} elements do not split into {n} equal blocks",
                send.len()
            )));
        }
        let c = Collective::new(CollKind::AllToAll, send.len() / n);
        self.collective(&c, Input::Buffer(send), Output::Buffer(recv))
    }

    /// Runs `coll` on this rank's stream with `input` and `output` (the general form of the
    /// methods above). Every rank of the communicator must make the same call (same kind,
    /// count, type, op and root; in debug builds, or with `FERROLINK_COLL_CHECK=1`, a mismatch
    /// is an error naming the ranks). Returns when the work is queued.
    ///
    /// ```
    /// # use ferrolink::coll::{CollKind, Collective, Input, Output, ReduceOp, expected_output};
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let comms = Communicator::init_all(&[dev.clone(), dev])?;
    /// let call = Collective { op: ReduceOp::Avg, ..Collective::new(CollKind::AllReduce, 4) };
    /// let input = |r: usize, i: usize| (4 * r + i) as f32;
    /// let out = run_ranks(&comms, |c| {
    ///     let send = c.device().alloc_from(&(0..4).map(|i| input(c.rank(), i)).collect::<Vec<_>>())?;
    ///     let mut recv = c.device().alloc::<f32>(4)?;
    ///     c.collective(&call, Input::Buffer(&send), Output::Buffer(&mut recv))?;
    ///     recv.to_vec()
    /// })?;
    /// assert_eq!(out[1], [2.0, 3.0, 4.0, 5.0]); // (i + (4 + i)) / 2
    /// assert_eq!(Some(out[1].clone()), expected_output(&call, 2, 1, input));
    /// # Ok(()) }
    /// ```
    pub fn collective<T: CollElem>(&self, coll: &Collective, input: Input<'_, T>, output: Output<'_, T>) -> Result<()> {
        phases::begin();
        let n = self.nranks();
        let name = coll.name();
        // Across LSA domains: one-shot through GIN (`coll_gin`).
        // (Persistent mode never starts across domains: `start_persistent` refuses.)
        let across = self.lsa_size() != n;
        if matches!(coll.kind, CollKind::Broadcast | CollKind::Reduce) && coll.root >= n {
            return Err(Error::InvalidArgument(format!("{name}: root {} is not a rank of {n}", coll.root)));
        }
        // An average divides by the rank count in the element type, as NCCL does: a count the
        // type cannot hold would wrap the divisor (u8 over 256 ranks: a division by 0).
        let reduces = !matches!(coll.kind, CollKind::AllGather | CollKind::Broadcast | CollKind::AllToAll);
        if reduces && coll.op == ReduceOp::Avg && T::DTYPE == DataType::U8 && n > usize::from(u8::MAX) {
            return Err(Error::InvalidArgument(format!(
                "{name}: an average of u8 over {n} ranks (at most 255: the count is the divisor, in u8)"
            )));
        }
        let size = std::mem::size_of::<T>();
        let (in_len, out_len) = coll.lengths(n);
        let out_elems = match &output {
            Output::Buffer(b) => b.len(),
            Output::Window(w, off) => w.size().saturating_sub(*off) / size,
        };
        if out_elems < out_len {
            return Err(Error::InvalidArgument(format!(
                "{name} of {} x {}: the output holds {out_elems} elements, {out_len} needed",
                coll.count,
                T::DTYPE.name()
            )));
        }
        match &input {
            Input::Buffer(b) if b.len() < in_len => {
                return Err(Error::InvalidArgument(format!(
                    "{name} of {} x {}: the input holds {} elements, {in_len} needed",
                    coll.count,
                    T::DTYPE.name(),
                    b.len()
                )));
            }
            Input::Window(w, off) if w.size().saturating_sub(*off) / size < in_len => {
                return Err(Error::InvalidArgument(format!(
                    "{name}: the input window holds {} bytes from offset {off}, {} needed",
                    w.size(),
                    in_len * size
                )));
            }
            Input::InPlace if matches!(coll.kind, CollKind::ReduceScatter | CollKind::AllToAll) => {
                return Err(Error::InvalidArgument(format!("{name}: in place is not supported (give an input)")));
            }
            _ => {}
        }
        // The algorithm and protocol before the check: ranks that pick differently (another
        // `FERROLINK_ALGO` or `FERROLINK_PROTO`) would run different kernels.
        let algo = self.pick_algo(coll, size, across)?;
        let persistent = self.persistent_call();
        let persistent_ctas = persistent.as_ref().map(|p| p.ctas);
        let proto = self.pick_proto(coll, size, algo, across, persistent.as_ref())?;
        let ll = proto == proto::LL;
        if coll.check.unwrap_or_else(check_calls) {
            // The input's place: peers read it there (a window's id, from 1, and the offset),
            // or 0 when it is staged into the communicator's own window.
            let place = match &input {
                Input::Window(w, off) => (u64::from(w.dev_window().id) + 1, *off as u64),
                _ => (0, 0),
            };
            self.check_same_call(coll, T::DTYPE, place, (algo, proto))?;
        }
        if coll.count == 0 {
            return Ok(());
        }
        let (in_bytes, out_bytes) = (in_len * size, out_len * size);
        // The module before anything else: loading it may wait for the device's running
        // kernels, and after the set-up below peers' kernels may be waiting for this rank.
        let module = self.device().builtin_module()?;
        let mut guard = crate::runtime::lifetime::lock(&self.shared.coll);
        let state = coll_state(self, &mut guard)?;
        let stream = self.stream();
        let dev = self.device();
        // The input: in a window where it is, else staged into the send window (LL reads it
        // where it is, whatever the memory: peers never read it).
        let staged_in = !matches!(input, Input::Window(..)) && !ll;
        // In persistent mode nothing may be allocated (the kernel never lets the device idle).
        let fixed = persistent_ctas.is_some();
        let mut grew = false;
        if staged_in {
            grew |= grow(self, &mut state.send, in_bytes, fixed)?;
        }
        // The output: the kernel writes it directly unless two-shot (peers write it: it must
        // lie in a window) or in place from a window across LSA domains (staged by a copy
        // first; kept apart from the output as before `run_gin` reads it): then through the
        // receive window, copied out after. In place over LSA the kernel stages the input
        // from the output itself, each CTA before it writes those bytes (`stage_input`).
        let in_place_window = matches!((&input, &output), (Input::InPlace, Output::Window(..)));
        let out_via_recv =
            !ll && ((in_place_window && across) || (algo == algo::TWO_SHOT && !matches!(output, Output::Window(..))));
        if out_via_recv {
            grew |= grow(self, &mut state.recv, out_bytes, fixed)?;
        }
        if across {
            // Each rank's data for this rank, one slot per rank.
            grew |= grow(self, &mut state.gather, n * coll.count * size, fixed)?;
        }
        // The device communicator after the windows (windows first, as for every device
        // communicator); a replaced one stays alive until its kernels have run. An LL call
        // without an LL buffer makes one, and a new device communicator with it (the
        // flags restart: see `CollState::ll`), as does one whose flags could come near their
        // wrap (`CollState::ll_epochs`); any other renewal drops it.
        // In persistent mode the kernel's device communicator and LL buffer serve the call
        // (`persistent::PersistentCall`), and they count the epochs.
        let own_ll = ll && !fixed;
        let ll_renews = own_ll && !state.ll_epochs.ll_fits();
        if grew || state.handle.is_none() || (own_ll && state.ll.is_none()) || ll_renews {
            state.renew_handle(self, own_ll)?;
        }
        if !fixed {
            state.ll_epochs.count(ll);
        }
        let handle = state.handle.as_ref().expect("made above");
        let copy_cfg = |bytes: usize| crate::ops::staging_copy_config(dev, bytes);
        // Split the output (no borrow of `output` outlives this).
        let (out_window, mut out_buf): (Option<(&Window, usize)>, Option<&mut DeviceBuffer<T>>) = match output {
            Output::Window(w, off) => (Some((w, off)), None),
            Output::Buffer(b) => (None, Some(b)),
        };
        // Stage the input: over LSA the kernel copies it into the send window (its CTAs copy
        // what the same CTAs of the peers read: `stage_input`), saving a launch per call,
        // from a buffer or in place in a buffer; else a copy first.
        let mut stage_from: Option<(u64, Option<TrackedPtr<'_, *const u8>>)> = None;
        let ll_win = if fixed { persistent.as_ref().and_then(|p| p.ll.as_ref()) } else { state.ll.as_ref() };
        let (send_win, send_off): (&Window, usize) = match input {
            // LL: the kernel reads the input where it is (`args.input`); no send window.
            Input::Buffer(b) if ll => {
                let p = b.bytes_at(0)?;
                stage_from = Some((p.param() as u64, Some(p)));
                (ll_win.expect("grown above"), 0)
            }
            Input::Window(w, off) if ll => {
                let p = w.slot_ptr::<*const u8>(off, in_bytes)?;
                stage_from = Some((p.param() as u64, Some(p)));
                (w, 0)
            }
            Input::Window(w, off) => (w, off),
            Input::Buffer(b) if !across => {
                let p = b.bytes_at(0)?;
                stage_from = Some((p.param() as u64, Some(p)));
                (state.send.as_ref().expect("grown above"), 0)
            }
            Input::InPlace if !across || ll => {
                // The output's own tracking (a write) covers the read.
                let at = coll.in_place_offset(self.rank()) * size;
                let addr = match (&out_buf, out_window) {
                    (Some(b), _) => b.bytes_at(at)?.param() as u64,
                    (None, Some((w, off))) => w.slot_ptr::<*const u8>(off + at, in_bytes)?.param() as u64,
                    (None, None) => unreachable!("an output is a buffer or a window"),
                };
                stage_from = Some((addr, None));
                (if ll { ll_win } else { state.send.as_ref() }.expect("grown above"), 0)
            }
            Input::Buffer(b) => {
                let s = state.send.as_ref().expect("grown above");
                launch_copy(
                    stream,
                    &ferrolink_copy,
                    s.slot_ptr(0, in_bytes)?,
                    b.bytes_at(0)?,
                    in_bytes,
                    copy_cfg(in_bytes),
                )?;
                (s, 0)
            }
            Input::InPlace => {
                let s = state.send.as_ref().expect("grown above");
                let at = coll.in_place_offset(self.rank()) * size;
                let src = match (&out_buf, out_window) {
                    (Some(b), _) => b.bytes_at(at)?,
                    (None, Some((w, off))) => w.slot_ptr(off + at, in_bytes)?,
                    (None, None) => unreachable!("an output is a buffer or a window"),
                };
                launch_copy(stream, &ferrolink_copy, s.slot_ptr(0, in_bytes)?, src, in_bytes, copy_cfg(in_bytes))?;
                (s, 0)
            }
        };
        let recv_staging = state.recv.as_ref();
        let group = &state.group;
        let shared_launch = persistent_ctas.is_none() && group.members.len() > 1 && group.fits() && shared_launches();
        let (recv_win, recv_offset): (&Window, usize) = match (out_via_recv, out_window) {
            // LL: the buffer; the kernel writes the output through `recv`.
            _ if ll => (ll_win.expect("grown above"), 0),
            (true, _) => (recv_staging.expect("grown above"), 0),
            (false, Some((w, off))) => (w, off),
            // Unused by the kernel (it writes through `recv`): any window.
            (false, None) => (send_win, 0),
        };
        // Every rank's CTAs must be resident at once (they wait for each other). The kernel
        // takes up to 254 registers per thread, so one 256-thread CTA per SM: the ranks that
        // share this GPU share its SMs.
        let ctas = match persistent_ctas {
            Some(p) => p,
            None if ll => ll::grid(coll.count * size) as u32,
            None if across => gin_grid(out_bytes.max(in_bytes))?,
            None => grid(dev, out_bytes.max(in_bytes)).min((dev.sm_count() / self.ranks_sharing_gpu() as u32).max(1)),
        };
        let args = CollArgs {
            kind: coll.kind as u32,
            algo,
            dtype: T::DTYPE as u32,
            op: coll.op as u32,
            root: coll.root as u32,
            barrier: 0,
            proto,
            reserved: 0,
            count: coll.count as u64,
            send_offset: send_off as u64,
            recv_offset: recv_offset as u64,
            input: stage_from.as_ref().map_or(0, |(addr, _)| *addr),
        };
        let ll_kernel = ll && ll_kernels();
        let cfg = LaunchConfig::linear(
            ctas,
            if ll_kernel { ll_threads(dev, module, &group.ll_threads) } else { threads(dev) },
        );
        {
            let out_ptr: TrackedPtr<'_, *mut u8> = match (&mut out_buf, out_via_recv || out_window.is_some()) {
                (_, true) if !out_via_recv && ll => {
                    let (w, off) = out_window.expect("an output window");
                    w.slot_ptr(off, out_bytes)?
                }
                (_, true) => recv_win.slot_ptr(recv_offset, out_bytes)?,
                (Some(b), false) => b.bytes_at_mut(0)?,
                (None, false) => unreachable!("an output is a buffer or a window"),
            };
            let mut uses = crate::runtime::launch::LaunchTracking::new(dev);
            if let Some((_, Some(p))) = &stage_from {
                p.track(&mut uses);
            }
            send_win.track(&mut uses);
            recv_win.track(&mut uses);
            out_ptr.track(&mut uses);
            let gather = if across { Some(state.gather.as_ref().expect("grown above")) } else { None };
            let op = CollOp {
                args,
                send: send_win.param(),
                recv_win: recv_win.param(),
                recv: out_ptr.param() as u64,
                gather: gather.map(|g| g.param()).unwrap_or_default(),
            };
            if let Some(g) = gather {
                g.track(&mut uses);
            }
            // A launch of this rank's own (no GPU group, or a call being captured); the
            // kernel reads the input it stages through an address in `args`. (Its tracking
            // made only then: a shared launch's members share the device, whose handle every
            // tracking clones, and 8 ranks on one GPU make a call every few microseconds.)
            let stage_from = &stage_from;
            let launch_own = move || -> Result<()> {
                let mut own_extra = crate::runtime::launch::LaunchTracking::new(dev);
                if let Some((_, Some(p))) = stage_from {
                    p.track(&mut own_extra);
                }
                if let Some(gather) = gather {
                    // SAFETY: `coll_gin`'s contract: every rank launches the same args and
                    // grid (the call is collective); the input lies at `send_off` of every
                    // rank's slot of `send_win` (lengths checked) and nothing writes it until
                    // the kernel ends on every rank (its final barrier); `gather` holds
                    // `nranks * count` elements (grown above) and only this stream's
                    // collectives use it, one at a time; the output holds `out_bytes`
                    // (checked) and overlaps no input; GIN context 0, signals and hybrid
                    // barriers 0..ctas (MAX_CTAS of each made by `renew_handle`) serve one
                    // collective at a time on this stream.
                    unsafe { stream.launch(module, &coll_gin, cfg, (handle, send_win, gather, args, out_ptr)) }
                } else if ll_kernel {
                    // The call as a shared launch's entry; what it uses tracked here (the
                    // parameter carries no tracking).
                    let mut uses = own_extra;
                    handle.track(&mut uses);
                    recv_win.track(&mut uses);
                    out_ptr.track(&mut uses);
                    let rank_op = RankOp { op, comm: handle.dev_comm() };
                    let entry = group::GroupParam(&rank_op);
                    let cfg = group::kernel_config(cfg.grid.0, cfg.block.0);
                    // SAFETY: `coll_ll`'s contract (`coll_lsa`'s for an LL call, below): every
                    // rank launches the same args and grid (the call is collective); the
                    // kernel reads the input at `args.input` only (a tracked buffer or window
                    // slot, or the output in place); `op.recv_win` is this communicator's LL
                    // buffer, zeroed when made with this device communicator (or at
                    // `recover`, which also resets its epochs, the flags); the output holds
                    // `out_bytes` (checked); barriers 0..ctas of the default set (MAX_CTAS of
                    // them) are used by this stream only, one collective at a time; shared
                    // memory per `kernel_config`.
                    unsafe { stream.launch_tracked(module, &coll_ll, cfg, (&entry,), uses).map(drop) }
                } else {
                    // SAFETY: the kernel's contract: every rank launches the same args and
                    // grid (the call is collective; the debug check verifies it); the input
                    // lies at `send_off` of every rank's slot of `send_win` (lengths checked),
                    // or is staged there from `args.input` (a tracked buffer holding it, or
                    // the output itself in place, for the kinds that allow in place), and
                    // nothing writes it until the kernel ends on every rank (its exit
                    // barrier); the output holds `out_bytes` (checked) and overlaps no input
                    // in the send window (in place, the input is staged into the staging
                    // window, never read from the output by peers); with LL (`args.proto`), the
                    // kernel reads the input at `args.input` only (a tracked buffer or window
                    // slot, or the output in place) and `recv_win` is this communicator's LL
                    // buffer, zeroed when made with this device communicator (or at
                    // `recover`, which also resets its epochs, the flags); barriers 0..ctas of the default set
                    // (MAX_CTAS of them) are used by this stream only, one collective at a
                    // time.
                    unsafe {
                        stream
                            .launch_tracked(
                                module,
                                &coll_lsa,
                                cfg,
                                (handle, send_win, recv_win, args, out_ptr),
                                own_extra,
                            )
                            .map(drop)
                    }
                }
            };
            phases::mark(Phase::Prepare);
            if persistent_ctas.is_some() {
                // Persistent mode: the GPU's persistent kernel runs it.
                let queued = self.enqueue_persistent(op, uses)?;
                debug_assert!(queued, "persistent mode was on when the grid was chosen");
            } else if shared_launch {
                // Ranks sharing this GPU in this process: one kernel for all of them, launched
                // by the last to get here (see `group`); across LSA domains too (the ranks'
                // kernels wait for each other: launched apart, on streams that may share a
                // hardware queue, they could deadlock).
                let threads = threads(dev);
                let resident = *group.resident.get_or_init(|| {
                    module.resident_ctas(&coll_gpu_group_launch, group::kernel_config(1, threads)).ok().flatten()
                });
                group.check_resident(ctas, resident, name)?;
                handle.track(&mut uses);
                let comm = handle.dev_comm();
                // A call captured into a graph is replayed with the sequence number it had
                // when captured: it runs as a launch of its own (every rank of the GPU
                // captures it alike); it still meets the others, so that a rank that runs it
                // now is not left waiting.
                let capturing = stream.is_capturing();
                let seq = group.next_seq(self.rank());
                let part = group::Part {
                    rank: self.rank(),
                    entry: (!capturing).then_some(RankOp { op, comm }),
                    comm_image: state.comm_image.clone(),
                    served: !capturing,
                    control: comm.control,
                    sync: None,
                    ctas,
                    uses,
                    stream: (!capturing).then_some(stream),
                    wait: (!capturing).then_some(self),
                };
                if let Some(g) = group.meet(dev, group::Purpose::Launch, seq, part)? {
                    if g.nothing_served() {
                        g.discard();
                    } else {
                        // On the group's launch stream; a capturing stream does not follow it.
                        group.run(g, stream, !capturing, seq, group::Work::Launch { module, threads })?;
                    }
                }
                if capturing {
                    launch_own()?;
                }
            } else {
                launch_own()?;
            }
        }
        phases::begin();
        // (A reduce leaves non-root outputs as they are.)
        if out_via_recv && !(coll.kind == CollKind::Reduce && coll.root != self.rank()) {
            let r = recv_staging.expect("grown above");
            let src = r.slot_ptr(0, out_bytes)?;
            let dst = match (out_buf, out_window) {
                (Some(b), _) => b.bytes_at_mut(0)?,
                (None, Some((w, off))) => w.slot_ptr(off, out_bytes)?,
                (None, None) => unreachable!("an output is a buffer or a window"),
            };
            launch_copy(stream, &ferrolink_copy, dst, src, out_bytes, copy_cfg(out_bytes))?;
        }
        phases::mark(Phase::Finish);
        Ok(())
    }

    /// Makes the collectives' resources now (collective): staging windows of at least
    /// `staging_bytes` each and the device communicator (persistent mode makes them before
    /// its kernel starts).
    pub(crate) fn prepare_collectives(&self, staging_bytes: usize) -> Result<()> {
        let mut guard = crate::runtime::lifetime::lock(&self.shared.coll);
        let state = coll_state(self, &mut guard)?;
        let mut grew = grow(self, &mut state.send, staging_bytes, false)?;
        grew |= grow(self, &mut state.recv, staging_bytes, false)?;
        if grew || state.handle.is_none() {
            state.renew_handle(self, false)?;
        }
        Ok(())
    }

    /// Ranks of this communicator on this rank's GPU (itself included): they share its SMs.
    pub(crate) fn ranks_sharing_gpu(&self) -> usize {
        let me = &self.shared.peers[self.rank()];
        self.shared.peers.iter().filter(|p| p.node == me.node && p.uuid == me.uuid).count().max(1)
    }

    /// The algorithm for `coll` ([`algo`]). The tuner: inside one LSA domain, all-reduce is
    /// one-shot below 256 KiB, else two-shot; across domains of two ranks or more (`L`),
    /// reduce-scatter and all-gather are hierarchical, and all-reduce unless it is the ring's
    /// size (below) over more than `2L + 1` domains; otherwise across
    /// domains over more than two ranks, all-reduce is a ring from 256 KiB, reduce-scatter and
    /// all-gather from 1 MiB (of the whole input or output); everything else is one-shot. `coll.algo`, then
    /// `FERROLINK_ALGO`, override it where the algorithm applies (two-shot: all-reduce inside
    /// a domain; ring: all-reduce, reduce-scatter and all-gather across domains; tree:
    /// all-reduce across domains, never the tuner's pick, as it was not measured where it
    /// pays, over many nodes; one-shot: everywhere); elsewhere the tuner's pick runs.
    fn pick_algo(&self, coll: &Collective, size: usize, across: bool) -> Result<u32> {
        let forced = match coll.algo {
            Some(a) => Some(a),
            None => match setting!("FERROLINK_ALGO") {
                None | Some("") => None,
                Some(name) => Some(algo::from_name(name).ok_or_else(|| {
                    Error::InvalidArgument(format!("FERROLINK_ALGO={name}: expected one of {}", algo::NAMES.join(", ")))
                })?),
            },
        };
        if let Some(a) = forced.filter(|&a| a > algo::LAST) {
            let known: Vec<String> = algo::NAMES.iter().enumerate().map(|(i, n)| format!("{n} {i}")).collect();
            return Err(Error::InvalidArgument(format!(
                "{}: unknown algorithm {a} ({})",
                coll.name(),
                known.join(", ")
            )));
        }
        let kind = coll.kind;
        let applies = |a: u32| match a {
            algo::TWO_SHOT => !across && kind == CollKind::AllReduce,
            algo::RING => across && matches!(kind, CollKind::AllReduce | CollKind::ReduceScatter | CollKind::AllGather),
            algo::TREE => across && kind == CollKind::AllReduce,
            algo::HIERARCHICAL => {
                across
                    && self.lsa_size() > 1
                    && matches!(kind, CollKind::AllReduce | CollKind::ReduceScatter | CollKind::AllGather)
            }
            _ => true,
        };
        if let Some(a) = forced.filter(|&a| applies(a)) {
            return Ok(a);
        }
        // The bytes of the whole data: the input (all-reduce, reduce-scatter) or the output
        // (all-gather). Thresholds from the H200 (PERF.md, issue 12 eighth part): across
        // domains the ring matched one-shot at 256 KiB all-reduce and won from 1 MiB for all
        // three; over two ranks it sends no less than one-shot.
        let ring_ranks = self.nranks() > 2;
        let data = coll.count * size * if kind == CollKind::AllReduce { 1 } else { self.nranks() };
        // Hierarchical all-reduce sends `(domains - 1) / L` of the data across domains,
        // one-shot `nranks - L` times it, the ring about twice it: hierarchical unless the
        // ring's size applies and the ring sends less. Hierarchical reduce-scatter and
        // all-gather send `domains - 1` blocks across domains, one-shot `nranks - L`, the ring
        // `nranks - 1`: always fewer. On the H200 (PERF.md, issue 12 tenth and eleventh parts;
        // 4 ranks in domains of 2) they were the fastest at every size measured.
        let l = self.lsa_size();
        let hierarchical = across && l > 1;
        let ring_sends_less = self.nranks() / l.max(1) - 1 > 2 * l;
        Ok(match kind {
            CollKind::AllReduce if hierarchical && !(ring_ranks && ring_sends_less && data >= 256 << 10) => {
                algo::HIERARCHICAL
            }
            CollKind::ReduceScatter | CollKind::AllGather if hierarchical => algo::HIERARCHICAL,
            CollKind::AllReduce if !across && data >= 256 << 10 => algo::TWO_SHOT,
            CollKind::AllReduce if across && ring_ranks && data >= 256 << 10 => algo::RING,
            CollKind::ReduceScatter | CollKind::AllGather if across && ring_ranks && data >= 1 << 20 => algo::RING,
            _ => algo::ONE_SHOT,
        })
    }

    /// The protocol for `coll` ([`proto`]) run with `algo`. LL applies to one-shot calls of
    /// all-reduce, reduce-scatter, all-gather and all-to-all (`ll::applies_to`) inside one
    /// LSA domain, up to `ll::MAX_BYTES` of `count` elements per sender, in a grid
    /// (`ll::grid`) that fits beside the GPU's other ranks' (`sm_count / ranks sharing the
    /// GPU` CTAs each), or in persistent mode within the kernel's CTAs per rank, while the
    /// kernel has its LL buffer (`persistent::PersistentCall::ll`); the tuner picks it up to
    /// [`LL_TUNED_BYTES`] outside persistent mode (in it, LL was no faster on an H200: the
    /// hand-over bounds the call; PERF.md, issue 12 nineteenth part). `coll.proto`, then
    /// `FERROLINK_PROTO`, override the tuner where the protocol applies.
    fn pick_proto(
        &self,
        coll: &Collective,
        size: usize,
        algo: u32,
        across: bool,
        persistent: Option<&persistent::PersistentCall>,
    ) -> Result<u32> {
        let forced = match coll.proto {
            Some(p) => Some(p),
            None => match setting!("FERROLINK_PROTO") {
                None | Some("") => None,
                Some(name) => Some(proto::from_name(name).ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "FERROLINK_PROTO={name}: expected one of {}",
                        proto::NAMES.join(", ")
                    ))
                })?),
            },
        };
        if let Some(p) = forced.filter(|&p| p > proto::LAST) {
            return Err(Error::InvalidArgument(format!(
                "{}: unknown protocol {p} (expected one of {})",
                coll.name(),
                proto::NAMES.join(", ")
            )));
        }
        let bytes = coll.count * size;
        let fits = match persistent {
            // The kernel's CTAs run every call, each with its barrier's flag (at most
            // `ll::MAX_CTAS` of them: else no LL buffer was made).
            Some(p) => p.ll.is_some() && ll::grid(bytes) <= p.ctas as usize,
            None => ll::grid(bytes) <= (self.device().sm_count() as usize / self.ranks_sharing_gpu()).max(1),
        };
        let ll_applies =
            algo == algo::ONE_SHOT && ll::applies_to(coll.kind) && !across && bytes <= ll::MAX_BYTES && fits;
        Ok(match forced {
            Some(proto::LL) if ll_applies => proto::LL,
            Some(proto::SIMPLE) => proto::SIMPLE,
            _ if ll_applies && bytes <= LL_TUNED_BYTES && persistent.is_none() => proto::LL,
            _ => proto::SIMPLE,
        })
    }

    /// Compares this call with every rank's (an all-gather on the host): an error naming the
    /// first rank whose call differs.
    /// `how` is the (algorithm, protocol) this rank picked.
    fn check_same_call(&self, coll: &Collective, dtype: DataType, input: (u64, u64), how: (u32, u32)) -> Result<()> {
        let mine = [
            coll.kind as u64,
            coll.count as u64,
            dtype as u64,
            coll.op as u64,
            coll.root as u64,
            input.0,
            input.1,
            u64::from(how.0),
            u64::from(how.1),
        ];
        let bytes: Vec<u8> = mine.iter().flat_map(|w| w.to_le_bytes()).collect();
        let all = self.all_gather_bytes(&bytes)?;
        for (r, theirs) in all.iter().enumerate() {
            if theirs != &bytes {
                let w = |b: &[u8], i: usize| u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
                let describe = |b: &[u8]| {
                    let input = match w(b, 5) {
                        0 => "a buffer (staged)".to_string(),
                        id => format!("window {} at offset {}", id - 1, w(b, 6)),
                    };
                    let name = |names: &[&'static str], i: u64| names.get(i as usize).copied().unwrap_or("?");
                    format!(
                        "{:?} of {} x {} (op {:?}, root {}, input in {input}, algorithm {}, protocol {})",
                        CollKind::from_code(w(b, 0) as u32),
                        w(b, 1),
                        DataType::from_code(w(b, 2) as u32).map_or("?", DataType::name),
                        ReduceOp::from_code(w(b, 3) as u32),
                        w(b, 4),
                        name(&algo::NAMES, w(b, 7)),
                        name(&proto::NAMES, w(b, 8))
                    )
                };
                return Err(Error::InvalidArgument(format!(
                    "mismatched collective calls: rank {} calls {} but rank {r} calls {}",
                    self.rank(),
                    describe(&bytes),
                    describe(theirs)
                )));
            }
        }
        Ok(())
    }
}

/// The reduction of `values` (in rank order) with `op`, computed one element at a time on the
/// host as the kernels compute it (NCCL's semantics: see [`ReduceOp`]). For checking results.
///
/// # Panics
/// If `values` is empty: a reduction over no ranks has no value.
///
/// ```
/// use ferrolink::coll::{ReduceOp, reduce_values};
/// assert_eq!(reduce_values(&[3i32, -1, 4], ReduceOp::Sum), 6);
/// assert_eq!(reduce_values(&[3i32, -1, 4], ReduceOp::Min), -1);
/// assert_eq!(reduce_values(&[1.0f32, 2.0], ReduceOp::Avg), 1.5);
/// ```
pub fn reduce_values<T: CollElem>(values: &[T], op: ReduceOp) -> T {
    let n = values.len() as u32;
    let pre = |x: T| if op == ReduceOp::Avg { x.avg_pre(n) } else { x };
    let mut acc = pre(values[0]);
    for &v in &values[1..] {
        let v = pre(v);
        acc = match op {
            ReduceOp::Sum | ReduceOp::Avg => T::sum(acc, v),
            ReduceOp::Prod => T::prod(acc, v),
            ReduceOp::Min => T::min(acc, v),
            ReduceOp::Max => T::max(acc, v),
        };
    }
    if op == ReduceOp::Avg { acc.avg_post(n) } else { acc }
}

/// What rank `me` of `n` holds after `c` when rank `r`'s input element `i` is `input(r, i)`,
/// computed on the host (`None`: the output is left as it was — a reduce's non-roots). For
/// checking results.
///
/// ```
/// use ferrolink::coll::{CollKind, Collective, expected_output};
/// let c = Collective::new(CollKind::AllGather, 2);
/// let got = expected_output::<i32>(&c, 3, 0, |r, i| (10 * r + i) as i32);
/// assert_eq!(got, Some(vec![0, 1, 10, 11, 20, 21]));
/// ```
pub fn expected_output<T: CollElem>(
    c: &Collective,
    n: usize,
    me: usize,
    input: impl Fn(usize, usize) -> T,
) -> Option<Vec<T>> {
    let k = c.count;
    let reduced = |i: usize| reduce_values(&(0..n).map(|r| input(r, i)).collect::<Vec<T>>(), c.op);
    Some(match c.kind {
        CollKind::AllReduce => (0..k).map(reduced).collect(),
        CollKind::Reduce if me == c.root => (0..k).map(reduced).collect(),
        CollKind::Reduce => return None,
        CollKind::ReduceScatter => (0..k).map(|i| reduced(me * k + i)).collect(),
        CollKind::AllGather => (0..n * k).map(|j| input(j / k, j % k)).collect(),
        CollKind::Broadcast => (0..k).map(|i| input(c.root, i)).collect(),
        CollKind::AllToAll => (0..n * k).map(|j| input(j / k, me * k + j % k)).collect(),
    })
}

/// Whether ranks sharing a GPU in a process share one launch per collective
/// (`FERROLINK_SHARED_LAUNCH=1|0`, default on). Off, each rank launches its own kernel, and
/// the ranks' kernels must all be resident at once: on the H200 with
/// `CUDA_DEVICE_MAX_CONNECTIONS=1` they never were (their streams share one hardware queue,
/// 2026-12-01), so off is for comparisons only. Every rank of the process reads the same
/// variable, so they agree.
fn shared_launches() -> bool {
    setting!("FERROLINK_SHARED_LAUNCH") != Some("0")
}

/// Whether LL calls run in the LL kernels (`coll_ll`, `coll_ll_group_launch`: that
/// protocol's path alone, at [`ll_threads`]), as by default, or in the general ones at
/// [`threads`] (`FERROLINK_LL_KERNELS=0`, for comparisons). Read once per process.
pub(crate) fn ll_kernels() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("FERROLINK_LL_KERNELS").ok().as_deref() != Some("0"))
}

/// Whether calls are compared across ranks (debug builds, or `FERROLINK_COLL_CHECK=1`).
fn check_calls() -> bool {
    match setting!("FERROLINK_COLL_CHECK") {
        Some("1") => true,
        Some("0") => false,
        _ => cfg!(debug_assertions),
    }
}

/// Makes `win` hold at least `bytes` (a collective registration when it grows: every rank
/// grows in the same call, as the calls match); whether it grew. With `fixed` (persistent
/// mode) growing is an error.
fn grow(comm: &Communicator, win: &mut Option<Window>, bytes: usize, fixed: bool) -> Result<bool> {
    if win.as_ref().is_some_and(|w| w.size() >= bytes) {
        return Ok(false);
    }
    if fixed {
        return Err(Error::InvalidArgument(format!(
            "persistent mode: this collective needs {bytes} bytes of staging, more than the {} made at \
             start_persistent (PersistentConfig::staging_bytes); nothing can be allocated while the persistent \
             kernel runs: pass windows (zero copy), or restart with more staging",
            win.as_ref().map_or(0, Window::size)
        )));
    }
    let want = bytes.max(1 << 20).next_power_of_two();
    *win = Some(comm.register_window(comm.mem_alloc(want)?)?);
    Ok(true)
}

/// CTAs for a collective moving `bytes` per rank: about 16 KiB each, at most [`MAX_CTAS`].
fn grid(dev: &crate::Device, bytes: usize) -> u32 {
    (bytes.div_ceil(dev.launch_profile().coll_bytes_per_cta) as u32).clamp(1, MAX_CTAS)
}

/// Across LSA domains, the most CTAs per rank (`coll_gin`): each CTA puts its part to
/// every peer and raises a signal; through the proxy one ring per peer carries them all,
/// so more CTAs add descriptors, not bandwidth.
const GIN_MAX_CTAS: u32 = 8;

/// Across LSA domains, CTAs per rank for `bytes`: one per 256 KiB, at most [`GIN_MAX_CTAS`];
/// `FERROLINK_COLL_GIN_CTAS=N` (1..=MAX_CTAS) fixes it. (On the H200, 2026-12-01, 64 CTAs
/// per rank of 16 KiB each through the TCP proxy stalled waits for seconds.)
fn gin_grid(bytes: usize) -> Result<u32> {
    match setting!("FERROLINK_COLL_GIN_CTAS") {
        Some(v) => match v.parse::<u32>() {
            Ok(c) if (1..=MAX_CTAS).contains(&c) => Ok(c),
            _ => Err(Error::InvalidArgument(format!("FERROLINK_COLL_GIN_CTAS={v}: expected 1 to {MAX_CTAS}"))),
        },
        None => Ok((bytes.div_ceil(256 << 10) as u32).clamp(1, GIN_MAX_CTAS)),
    }
}

/// Threads per CTA of the LL kernels (`coll_ll`, `coll_ll_group_launch`), cached in `cache`:
/// the launch profile's `ll_threads` where the GPU holds as many CTAs of each LL kernel at that
/// width per SM as of its general counterpart (`coll_lsa`, `coll_gpu_group_launch`) at
/// [`threads`], so that a grid checked as resident for the general kernel is resident for the
/// LL one too; else [`threads`] (a later compiler giving the LL kernels more registers
/// costs speed, never a failed launch).
pub(crate) fn ll_threads(dev: &crate::Device, module: &crate::Module, cache: &std::sync::OnceLock<u32>) -> u32 {
    *cache.get_or_init(|| {
        let (wide, narrow) = (dev.launch_profile().ll_threads, threads(dev));
        if wide == narrow {
            return narrow;
        }
        let holds = |ll: Option<u64>, general: Option<u64>| match (ll, general) {
            (Some(l), Some(g)) => l >= g && l > 0,
            (None, None) => true,
            _ => false,
        };
        let cfg = |t| LaunchConfig::linear(1, t);
        let own = holds(
            module.resident_ctas(&coll_ll, group::kernel_config(1, wide)).ok().flatten(),
            module.resident_ctas(&coll_lsa, cfg(narrow)).ok().flatten(),
        );
        let shared = holds(
            module.resident_ctas(&coll_ll_group_launch, group::kernel_config(1, wide)).ok().flatten(),
            module.resident_ctas(&coll_gpu_group_launch, group::kernel_config(1, narrow)).ok().flatten(),
        );
        let chosen = if own && shared { wide } else { narrow };
        tracing::debug!(target: "ferrolink::coll", chosen, own, shared, "threads per CTA of the LL kernels");
        chosen
    })
}

/// Threads per CTA: 256 on the GPU (the kernel, one body for every type and reduction, uses
/// up to 254 registers per thread on sm_90: 256 threads is the most a CTA can hold).
pub(crate) fn threads(dev: &crate::Device) -> u32 {
    dev.launch_profile().coll_threads
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::lifetime::lock;
    use crate::testing::for_each_backend;
    use crate::{Communicator, run_ranks};

    /// An average of u8 over 256 ranks is refused at the call, before any rank waits for
    /// another (its divisor, the rank count, would wrap to 0 in u8).
    #[test]
    fn u8_averages_over_more_than_255_ranks_are_refused() {
        let dev = crate::Device::open_with(crate::Backend::Cpu, 0).unwrap();
        let comms = Communicator::init_all(&vec![dev.clone(); 256]).unwrap();
        let send = dev.alloc::<u8>(4).unwrap();
        let mut recv = dev.alloc::<u8>(4).unwrap();
        let err = comms[3].all_reduce(&send, &mut recv, ReduceOp::Avg).expect_err("256 ranks").to_string();
        assert!(err.contains("average of u8 over 256 ranks"), "{err}");
    }

    /// Calls that queue up for a GPU group's launcher (held here) run in one launch (or a few),
    /// one after the other: each round's in-place all-reduce reads the previous round's output,
    /// with the LL protocol and with the simple one. More calls than the launch's parameter
    /// holds: their entries go through device memory, and more than one launch takes (16
    /// calls at most) go in two. From one thread: members of a shared launch do not wait for it.
    #[test]
    fn queued_shared_calls_run_in_one_launch_in_order() {
        let var = |name: &str| std::env::var(name).ok().map(|v| v.trim().to_string());
        if var("FERROLINK_GROUP_LAUNCHER").as_deref() == Some("last")
            || var("FERROLINK_GROUP_BATCH").as_deref() == Some("1")
        {
            eprintln!("skipped: FERROLINK_GROUP_LAUNCHER=last or FERROLINK_GROUP_BATCH=1 launches one call at a time");
            return;
        }
        for_each_backend("queued_shared_calls_run_in_one_launch_in_order", |dev| {
            let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
            for (count, proto) in [(300usize, proto::LL), (5000, proto::SIMPLE)] {
                let call = Collective {
                    check: Some(false),
                    proto: Some(proto),
                    ..Collective::new(CollKind::AllReduce, count)
                };
                // The resources first (a call that may allocate: every rank at once).
                run_ranks(&comms, |c| {
                    let mut b = c.device().alloc_from(&vec![1.0f32; count])?;
                    c.collective::<f32>(&call, Input::InPlace, Output::Buffer(&mut b))?;
                    b.to_vec().map(drop)
                })?;
                let group = lock(&comms[0].shared.coll).as_ref().expect("made").group.clone();
                let (before, device_before, unmet_before) =
                    (group.batched_launches(), group.device_entry_launches(), group.unmet_launches());
                let mut bufs =
                    (0..2).map(|r| dev.alloc_from(&vec![r as f32 + 1.0; count])).collect::<crate::Result<Vec<_>>>()?;
                group.hold_launches(true);
                // More calls than a launch of two ranks carries in its parameter's 16 entries
                // (8), and than one launch carries (MAX_LAUNCH_OPERATIONS, 16).
                const ROUNDS: i32 = 20;
                for _round in 0..ROUNDS {
                    for (c, b) in comms.iter().zip(&mut bufs) {
                        c.collective::<f32>(&call, Input::InPlace, Output::Buffer(b))?;
                    }
                }
                group.hold_launches(false);
                // 1 + 2 = 3, then 6, 12, … on both ranks.
                for b in &bufs {
                    assert_eq!(b.to_vec()?, vec![3.0 * 2f32.powi(ROUNDS - 1); count], "{proto:?}");
                }
                assert!(group.batched_launches() > before, "{proto:?}: the calls were launched one by one");
                // 300 f32 of LL: one CTA per rank, so the LL kernel's CTAs go from call to
                // call without meeting (unless asked to meet, or LL runs in the general kernel).
                let unmet = group.unmet_launches() > unmet_before;
                let may_meet = var("FERROLINK_GROUP_LL_MEETINGS").as_deref() == Some("1")
                    || var("FERROLINK_LL_KERNELS").as_deref() == Some("0");
                assert_eq!(unmet, proto == proto::LL && !may_meet, "{proto:?}: launches without grid meetings");
                if var("FERROLINK_GROUP_DEVICE_ENTRIES").as_deref() != Some("0") {
                    assert!(
                        group.device_entry_launches() > device_before,
                        "{proto:?}: no launch carried its entries in device memory"
                    );
                }
            }
            Ok(())
        });
    }

    /// An LL call that could take the barrier epochs to the limit renews the device
    /// communicator and the LL buffer (a new, zeroed one: the flags restart), on every rank
    /// in the same call, and results stay right across renewals; calls of the simple
    /// protocol count twice.
    #[test]
    fn ll_renews_its_buffer_before_the_flags_could_wrap() {
        for_each_backend("ll_renews_its_buffer_before_the_flags_could_wrap", |dev| {
            let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
            let made = run_ranks(&comms, |c| {
                let ll = Collective { proto: Some(proto::LL), ..Collective::new(CollKind::AllReduce, 300) };
                let simple = Collective { proto: Some(proto::SIMPLE), ..ll };
                let send = c.device().alloc_from(&vec![c.rank() as f32 + 1.0; 300])?;
                let mut recv = c.device().alloc::<f32>(300)?;
                c.collective(&ll, Input::Buffer(&send), Output::Buffer(&mut recv))?;
                let made = |c: &Communicator| lock(&c.shared.coll).as_ref().map_or(0, |s| s.ll_made.len());
                assert_eq!(made(c), 1, "the first LL call makes the buffer");
                // From here: 1 (the call above), then renew when an LL call would reach 6.
                lock(&c.shared.coll).as_mut().expect("made").ll_epochs.limit = 6;
                let mut made_after = Vec::new();
                for i in 0..8 {
                    let c_ = if i == 3 { &simple } else { &ll };
                    recv.copy_from_host(&[0.0; 300])?;
                    c.collective(c_, Input::Buffer(&send), Output::Buffer(&mut recv))?;
                    assert_eq!(recv.to_vec()?, vec![3.0f32; 300], "call {i}");
                    made_after.push(made(c));
                }
                Ok(made_after)
            })?;
            // Epochs: 1 after the first call; LL calls 0..2 reach 2, 3, 4; the simple call 3
            // reaches 6; LL call 4 would reach 7 >= 6: renewed (then 1); calls 5..7 reach 2, 3, 4.
            let expected = vec![1, 1, 1, 1, 2, 2, 2, 2];
            assert_eq!(made, vec![expected.clone(), expected], "both ranks renew in the same call");
            Ok(())
        });
    }
}
