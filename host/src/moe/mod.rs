//! MoE dispatch and combine (expert parallelism) across the ranks of a communicator: every
//! token row goes to the ranks of the experts it is routed to, packed per expert, and the
//! experts' results come back as each token's weighted sum.
//!
//! A [`Moe`] (made collectively by [`Communicator::moe`]) owns the windows and the device
//! communicator the two kernels use (`ferrolink_device::moe`, written on the public GIN API:
//! stores through the LSA mapping inside a domain, the GIN proxy across domains, so the same
//! calls serve one node and many). Per step, on the rank's stream:
//!
//! 1. [`Moe::dispatch`] takes this rank's tokens `x [T, hidden]` (bf16, or fp8 with a scale
//!    per 128 channels: [`Tokens`]) and their routing
//!    `topk_idx [T, top_k]` (`i32`; `-1`: no expert) and fills every rank's receive buffer
//!    `[experts_per_rank][capacity][hidden]` ([`Moe::received`]): expert `e`'s rows packed
//!    in the order (source rank, token, k), with [`Moe::recv_counts`] rows per local expert.
//!    The layout (counts per expert and per rank, each entry's place) is computed by the
//!    same kernel.
//! 2. The experts run on those rows (the caller's kernels), writing their results into the
//!    same rows (zero copy: [`Moe::received`] is a window a kernel may write) or into a
//!    buffer of the same shape.
//! 3. [`Moe::combine`] sends each result back to its token's rank and writes `out [T,
//!    hidden]` = `sum_k topk_weights[t, k] * result(t, k)`, accumulated in `f32` in `k`
//!    order and rounded once to bf16.
//!
//! **Capacity.** Each local expert has `capacity` rows ([`MoeConfig::capacity`]). By
//! default there is room for every token of every rank (`max_tokens * nranks`), so nothing is
//! dropped when each token names distinct experts. With less, the entries whose place is
//! past the capacity are **dropped**: never written, counted ([`Moe::dropped`]), and they add
//! nothing to the combine (the others still do): no silent corruption, no error. The rows
//! kept are the first in (source rank, token, k) order.
//!
//! Calls are collective and alternate: every rank calls `dispatch`, then `combine`, then
//! `dispatch` again (an error otherwise). An expert index outside `0..num_experts` (other
//! than -1) is reported by the kernel as a fault naming the entry.
//!
//! ```
//! # fn main() -> ferrolink::Result<()> {
//! use ferrolink::moe::{MoeConfig, bf16};
//! use ferrolink::{Communicator, Device, run_ranks};
//! let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
//! let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
//! let cfg = MoeConfig { num_experts: 4, hidden: 8, top_k: 2, max_tokens: 3, capacity: None };
//! let outs = run_ranks(&comms, |c| {
//!     let mut moe = c.moe(cfg)?;
//!     let dev = c.device();
//!     // Token t of rank r is all (r * 3 + t); it goes to experts t and 3 - t.
//!     let x: Vec<bf16> = (0..3 * 8).map(|i| bf16::from_f32((c.rank() * 3 + i / 8) as f32)).collect();
//!     let idx: Vec<i32> = (0..3).flat_map(|t| [t, 3 - t]).collect();
//!     moe.dispatch(&dev.alloc_from(&x)?, &dev.alloc_from(&idx)?)?;
//!     // The experts would run here; their result is their input (in place).
//!     let mut out = dev.alloc::<bf16>(3 * 8)?;
//!     moe.combine(None, &dev.alloc_from(&[0.5f32; 6])?, &mut out)?;
//!     out.to_vec()
//! })?;
//! // Each token comes back twice with weight 0.5: itself.
//! assert_eq!(outs[1][8].to_f32(), 4.0);
//! # Ok(()) }
//! ```

use crate::comm::Communicator;
use crate::devcomm::{DevCommHandle, DevCommRequirements};
use crate::mem::window::Window;
use crate::ops::{launch_copy, staging_copy_config};
use crate::runtime::launch::{LaunchArg, LaunchConfig, LaunchTracking};
use crate::runtime::memory::{DeviceBuffer, TrackedPtr};
use crate::{Error, Result};
use ferrolink_device::kernel::KernelParam;
use ferrolink_device::kernels::copy::ferrolink_copy;
use ferrolink_device::kernels::moe::{moe_combine, moe_dispatch};
use ferrolink_device::moe::{self as dev_moe, MoeArgs, MoeState};
pub use half::bf16;
use std::sync::atomic::AtomicBool;

mod fused;
mod low_latency;
mod tokens;
pub use fused::FusedTarget;
pub use low_latency::MoeLowLatency;
pub use tokens::{FP8_SCALE_BLOCK, Tokens, fp8_row_bytes};

/// The shape of a [`Moe`]: the same on every rank (checked when it is made).
///
/// ```
/// # fn main() -> ferrolink::Result<()> {
/// use ferrolink::moe::MoeConfig;
/// # use ferrolink::{Communicator, Device, run_ranks};
/// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
/// let cfg = MoeConfig { num_experts: 4, hidden: 8, top_k: 2, max_tokens: 3, capacity: Some(2) };
/// let made = run_ranks(&comms, |c| {
///     // 3 experts do not split over 2 ranks; rows move as 16-byte vectors (12 bf16 are not).
///     assert!(c.moe(MoeConfig { num_experts: 3, ..cfg }).is_err());
///     assert!(c.moe(MoeConfig { hidden: 12, ..cfg }).is_err());
///     Ok(c.moe(cfg).is_ok())
/// })?;
/// assert_eq!(made, [true, true]);
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeConfig {
    /// Experts in all: a multiple of the ranks (`num_experts / nranks` per rank, expert `e`
    /// on rank `e / (num_experts / nranks)`).
    pub num_experts: usize,
    /// Elements (bf16) per token: a multiple of 8.
    pub hidden: usize,
    /// Experts per token.
    pub top_k: usize,
    /// The most tokens a rank dispatches in one call.
    pub max_tokens: usize,
    /// Rows per local expert in the receive buffer; `None`: `max_tokens * nranks` (nothing
    /// is dropped when each token names distinct experts). Entries past it are dropped and
    /// counted ([`Moe::dropped`]).
    pub capacity: Option<usize>,
}

/// The resources and the state of MoE dispatch and combine on one rank: see the
/// [module docs](self).
///
/// ```
/// # fn main() -> ferrolink::Result<()> {
/// # use ferrolink::moe::{MoeConfig, bf16};
/// # use ferrolink::{Communicator, Device, run_ranks};
/// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
/// let cfg = MoeConfig { num_experts: 4, hidden: 8, top_k: 2, max_tokens: 1, capacity: None };
/// run_ranks(&comms, |c| {
///     let mut moe = c.moe(cfg)?;
///     let dev = c.device();
///     let (x, idx) = (dev.alloc::<bf16>(8)?, dev.alloc_from(&[0i32, 2])?);
///     let (w, mut out) = (dev.alloc_from(&[0.5f32; 2])?, dev.alloc::<bf16>(8)?);
///     // Calls alternate: no combine without a dispatch, no dispatch before the last combine.
///     assert!(moe.combine(None, &w, &mut out).is_err());
///     moe.dispatch(&x, &idx)?;
///     assert!(moe.dispatch(&x, &idx).is_err());
///     moe.combine(None, &w, &mut out)?;
///     moe.dispatch(&x, &idx)?;
///     moe.combine(None, &w, &mut out)?;
///     c.synchronize()
/// })?;
/// # Ok(()) }
/// ```
pub struct Moe {
    comm: Communicator,
    cfg: MoeConfig,
    capacity: usize,
    handle: DevCommHandle,
    /// This rank's token rows (the dispatch's sources).
    send: Window,
    /// The rows received, `[experts_per_rank][capacity][hidden]`; the experts' results; then
    /// a `RowSource` per row (written by a dispatch given the weights).
    recv: Window,
    /// The results coming back, one row per entry of this rank.
    ret: Window,
    /// The count matrices, `u32 [2][nranks][columns]` (by call parity: a column per expert,
    /// then one per LSA domain when relaying), and this rank's own row.
    counts: Window,
    /// The relay's slots (rows crossing LSA domains once per token and domain), when
    /// `relay_domains` is not 0.
    relay: Option<Window>,
    /// LSA domains when the dispatch relays rows across them, else 0 (see
    /// [`Communicator::moe`]).
    relay_domains: usize,
    ret_index: DeviceBuffer<u32>,
    recv_counts: DeviceBuffer<i32>,
    state: DeviceBuffer<u64>,
    /// Dispatches so far.
    epoch: u64,
    /// Tokens of the dispatch waiting for its combine.
    pending: Option<usize>,
    /// Whether that dispatch wrote the rows' sources (it was given the weights).
    pending_sources: bool,
    /// Whether [`Moe::fused_target`] gave out the expert kernel's argument for that dispatch
    /// (then only [`Moe::finish_fused`] may end it). Atomic so that `Moe` stays `Sync`.
    expert_launched: AtomicBool,
    /// [`Communicator::recover`] calls when this was made: after another, calls are refused.
    recoveries: u64,
    /// The fused combine's accumulators (`f32 [max_tokens][hidden]`), once enabled.
    acc: Option<Window>,
    /// The fused combine's return and staging rows, once enabled where some rank is not
    /// reached directly.
    fused_returns: Option<fused::FusedReturns>,
}

impl Communicator {
    /// Makes this rank's MoE resources (collective: every rank calls it with the same
    /// configuration, checked). Memory per rank, in token rows of `2 * hidden` bytes:
    /// `max_tokens` (sources), `capacity * num_experts / nranks` (received, and 16 bytes
    /// more per row for its source), `max_tokens * top_k` (results coming back).
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// use ferrolink::moe::MoeConfig;
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// let cfg = MoeConfig { num_experts: 4, hidden: 8, top_k: 2, max_tokens: 3, capacity: None };
    /// let refused = run_ranks(&comms, |c| {
    ///     // Rank 1 asks for another top_k: both ranks get an error naming the difference.
    ///     let top_k = if c.rank() == 0 { 2 } else { 1 };
    ///     Ok(c.moe(MoeConfig { top_k, ..cfg }).is_err())
    /// })?;
    /// assert_eq!(refused, [true, true]);
    /// let moes = run_ranks(&comms, |c| c.moe(cfg))?;
    /// assert_eq!(moes[1].experts_per_rank(), 2);
    /// # Ok(()) }
    /// ```
    pub fn moe(&self, cfg: MoeConfig) -> Result<Moe> {
        let n = self.nranks();
        let capacity = cfg.capacity.unwrap_or(cfg.max_tokens * n);
        let lsa = self.lsa_size();
        let relay_wanted = std::env::var("FERROLINK_MOE_RELAY").map_or(true, |v| v != "0");
        let mut relay_domains = if relay_wanted && lsa > 1 && lsa < n && n.is_multiple_of(lsa) { n / lsa } else { 0 };
        check_config(self, &cfg, capacity, relay_domains, "moe")?;
        let row = 2 * cfg.hidden;
        let per_rank = cfg.num_experts / n;
        let columns = dev_moe::count_columns(cfg.num_experts, relay_domains);
        let sizes = [
            cfg.max_tokens * row,
            per_rank * capacity * (row + std::mem::size_of::<dev_moe::fused::RowSource>()),
            cfg.max_tokens * cfg.top_k * row,
            (2 * n + 1) * columns * 4,
        ];
        let mut windows = Vec::with_capacity(4);
        for bytes in sizes {
            windows.push(new_window(self, bytes)?);
        }
        let relay = if relay_domains > 0 {
            let layout = dev_moe::Relay::new(relay_domains, lsa, cfg.max_tokens, cfg.top_k, cfg.hidden);
            Some(new_window(self, layout.window_bytes())?)
        } else {
            None
        };
        let counts = windows.pop().expect("four");
        let ret = windows.pop().expect("four");
        let recv = windows.pop().expect("four");
        let send = windows.pop().expect("four");
        // The device communicator after the windows (as for every device communicator).
        let handle = self.create_dev_comm(&DevCommRequirements {
            gin_context_count: 1,
            gin_signal_count: dev_moe::signal::COUNT,
            ..DevCommRequirements::default()
        })?;
        // Every peer through the proxy (`FERROLINK_GIN=proxy`, the same on every rank): no
        // direct copies for a relay to make, so rows go straight (the window stays unused).
        if handle.uses_proxy() {
            relay_domains = 0;
        }
        let dev = self.device();
        Ok(Moe {
            comm: self.clone(),
            cfg,
            capacity,
            handle,
            send,
            recv,
            ret,
            counts,
            relay,
            relay_domains,
            // A ResultPlace (two u32) per entry.
            ret_index: dev.alloc(2 * cfg.max_tokens * cfg.top_k)?,
            recv_counts: dev.alloc(per_rank)?,
            state: dev.alloc(dev_moe::scratch_bytes(columns).div_ceil(8))?,
            epoch: 0,
            pending: None,
            pending_sources: false,
            expert_launched: AtomicBool::new(false),
            recoveries: self.recoveries(),
            acc: None,
            fused_returns: None,
        })
    }
}

/// Dynamic shared memory a CTA may use without opting in (CUDA's default limit).
const SHARED_LIMIT: usize = 48 << 10;

impl Moe {
    /// The configuration (with [`MoeConfig::capacity`] as used).
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # use ferrolink::moe::MoeConfig;
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// let cfg = MoeConfig { num_experts: 4, hidden: 8, top_k: 2, max_tokens: 3, capacity: None };
    /// let caps = run_ranks(&comms, |c| Ok(c.moe(cfg)?.config().capacity))?;
    /// // None became the default, max_tokens * nranks.
    /// assert_eq!(caps, [Some(6), Some(6)]);
    /// # Ok(()) }
    /// ```
    pub fn config(&self) -> MoeConfig {
        MoeConfig { capacity: Some(self.capacity), ..self.cfg }
    }

    /// LSA domains the dispatch relays rows across (each token crosses to another domain once,
    /// to its relay there, which copies it to the experts' ranks of that domain), or 0 when
    /// every row goes straight to its expert's rank: one domain, domains of one rank, every
    /// peer through the proxy (`FERROLINK_GIN=proxy`), or `FERROLINK_MOE_RELAY=0`.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # use ferrolink::moe::MoeConfig;
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// # let cfg = MoeConfig { num_experts: 4, hidden: 8, top_k: 2, max_tokens: 3, capacity: None };
    /// // Two ranks of one device are one LSA domain: every row goes straight to its expert.
    /// let relays = run_ranks(&comms, |c| Ok(c.moe(cfg)?.relay_domains()))?;
    /// assert_eq!(relays, [0, 0]);
    /// # Ok(()) }
    /// ```
    pub fn relay_domains(&self) -> usize {
        self.relay_domains
    }

    /// Experts on each rank.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # use ferrolink::moe::MoeConfig;
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// let cfg = MoeConfig { num_experts: 4, hidden: 8, top_k: 2, max_tokens: 3, capacity: None };
    /// // Experts 0 and 1 on rank 0, 2 and 3 on rank 1.
    /// let per = run_ranks(&comms, |c| Ok(c.moe(cfg)?.experts_per_rank()))?;
    /// assert_eq!(per, [2, 2]);
    /// # Ok(()) }
    /// ```
    pub fn experts_per_rank(&self) -> usize {
        self.cfg.num_experts / self.comm.nranks()
    }

    /// Rows per local expert in the receive buffer.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # use ferrolink::moe::MoeConfig;
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// let cfg = MoeConfig { num_experts: 4, hidden: 8, top_k: 2, max_tokens: 3, capacity: None };
    /// let caps = run_ranks(&comms, |c| {
    ///     Ok((c.moe(cfg)?.capacity(), c.moe(MoeConfig { capacity: Some(2), ..cfg })?.capacity()))
    /// })?;
    /// // By default, room for every token of both ranks.
    /// assert_eq!(caps, [(6, 2), (6, 2)]);
    /// # Ok(()) }
    /// ```
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The receive buffer: a window of this communicator holding `[experts_per_rank]
    /// [capacity][hidden]` bf16 from offset 0 (local expert `l`'s row `i` at byte `(l *
    /// capacity + i) * 2 * hidden`). After a dispatch, local expert `l`'s first
    /// `recv_counts[l]` rows are its tokens; the experts may write their results over them
    /// (then pass `None` to [`Moe::combine`]). Pass `moe.received()` to a kernel (a tracked
    /// use), or copy it out in stream order with [`Moe::copy_received`]. (A host read,
    /// [`Window::read`], waits for every kernel of this process that uses the window, the
    /// other ranks' too: with ranks on threads of one process it can wait for a peer's combine
    /// that waits for this rank.)
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # use ferrolink::moe::{MoeConfig, bf16};
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # use std::sync::Mutex;
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// let cfg = MoeConfig { num_experts: 4, hidden: 8, top_k: 2, max_tokens: 1, capacity: None };
    /// let moes = run_ranks(&comms, |c| {
    ///     let mut moe = c.moe(cfg)?;
    ///     // One token per rank, all `rank + 1`, to experts 0 (on rank 0) and 3 (on rank 1).
    ///     let x = c.device().alloc_from(&[bf16::from_f32(c.rank() as f32 + 1.0); 8])?;
    ///     moe.dispatch(&x, &c.device().alloc_from(&[0i32, 3])?)?;
    ///     Ok(Mutex::new(moe))
    /// })?;
    /// // No rank has queued its combine: a host read (it waits for every rank's kernels) is safe.
    /// let rows: Vec<bf16> = moes[0].lock().unwrap().received().read(0, 2 * 8)?;
    /// // Rank 0's local expert 0 (expert 0): rank 0's token in row 0, rank 1's in row 1.
    /// assert_eq!((rows[0].to_f32(), rows[8].to_f32()), (1.0, 2.0));
    /// # run_ranks(&comms, |c| {
    /// #     let mut out = c.device().alloc::<bf16>(8)?;
    /// #     moes[c.rank()].lock().unwrap().combine(None, &c.device().alloc_from(&[0.5f32; 2])?, &mut out)?;
    /// #     c.synchronize()
    /// # })?;
    /// # Ok(()) }
    /// ```
    pub fn received(&self) -> &Window {
        &self.recv
    }

    /// Copies the receive buffer (`experts_per_rank * capacity * hidden` bf16) into `dst`,
    /// on the rank's stream (after the dispatch, before the combine's sends read it).
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # use ferrolink::moe::{MoeConfig, bf16};
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// let cfg = MoeConfig { num_experts: 4, hidden: 8, top_k: 2, max_tokens: 1, capacity: None };
    /// let received = run_ranks(&comms, |c| {
    ///     let mut moe = c.moe(cfg)?;
    ///     let dev = c.device();
    ///     // One token per rank, all `rank + 1`, to experts 0 (on rank 0) and 3 (on rank 1).
    ///     let x = dev.alloc_from(&[bf16::from_f32(c.rank() as f32 + 1.0); 8])?;
    ///     moe.dispatch(&x, &dev.alloc_from(&[0i32, 3])?)?;
    ///     // [experts_per_rank][capacity][hidden], copied in stream order.
    ///     let mut rows = dev.alloc::<bf16>(moe.experts_per_rank() * moe.capacity() * 8)?;
    ///     moe.copy_received(&mut rows)?;
    ///     moe.combine(None, &dev.alloc_from(&[0.5f32; 2])?, &mut dev.alloc::<bf16>(8)?)?;
    ///     rows.to_vec()
    /// })?;
    /// // Rank 1's local expert 1 (expert 3): rank 0's token in row 0, rank 1's in row 1.
    /// let row = |i: usize| received[1][(2 + i) * 8].to_f32();
    /// assert_eq!((row(0), row(1)), (1.0, 2.0));
    /// # Ok(()) }
    /// ```
    pub fn copy_received(&self, dst: &mut DeviceBuffer<bf16>) -> Result<()> {
        let bytes = self.experts_per_rank() * self.capacity * 2 * self.cfg.hidden;
        if dst.len() * 2 != bytes {
            return Err(Error::InvalidArgument(format!(
                "moe copy_received: the buffer holds {} elements, the receive buffer {}",
                dst.len(),
                bytes / 2
            )));
        }
        let cfg = staging_copy_config(self.comm.device(), bytes);
        launch_copy(
            self.comm.stream(),
            &ferrolink_copy,
            dst.bytes_at_mut(0)?,
            self.recv.slot_ptr(0, bytes)?,
            bytes,
            cfg,
        )
    }

    /// Rows received per local expert by the last dispatch (`i32`, `experts_per_rank` of
    /// them, at most the capacity each). A host read of the buffer waits for the dispatch but
    /// does not report its failure: call [`Communicator::synchronize`] first (an aborted or
    /// timed-out dispatch leaves the counts of the call before).
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # use ferrolink::moe::{MoeConfig, bf16};
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// let cfg = MoeConfig { num_experts: 4, hidden: 8, top_k: 2, max_tokens: 2, capacity: None };
    /// let counts = run_ranks(&comms, |c| {
    ///     let mut moe = c.moe(cfg)?;
    ///     let dev = c.device();
    ///     // Two tokens per rank, to experts (0, 1) and (0, 2).
    ///     moe.dispatch(&dev.alloc::<bf16>(2 * 8)?, &dev.alloc_from(&[0i32, 1, 0, 2])?)?;
    ///     // The dispatch's errors first (a host read of the counts does not report them).
    ///     c.synchronize()?;
    ///     let counts = moe.recv_counts().to_vec()?;
    ///     moe.combine(None, &dev.alloc::<f32>(4)?, &mut dev.alloc::<bf16>(2 * 8)?)?;
    ///     Ok(counts)
    /// })?;
    /// // Experts 0, 1, 2 and 3 got 4, 2, 2 and 0 rows.
    /// assert_eq!(counts, [[4, 2], [2, 0]]);
    /// # Ok(()) }
    /// ```
    pub fn recv_counts(&self) -> &DeviceBuffer<i32> {
        &self.recv_counts
    }

    /// Entries (token, expert pairs) of this rank that the last dispatch dropped at capacity
    /// (waits for the rank's stream; its error, or the communicator's, if any).
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # use ferrolink::moe::{MoeConfig, bf16};
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// let cfg = MoeConfig { num_experts: 2, hidden: 8, top_k: 1, max_tokens: 1, capacity: Some(1) };
    /// let got = run_ranks(&comms, |c| {
    ///     let mut moe = c.moe(cfg)?;
    ///     let dev = c.device();
    ///     // Both ranks' tokens (all 1) go to expert 0, which has one row: rank 0's is kept.
    ///     moe.dispatch(&dev.alloc_from(&[bf16::ONE; 8])?, &dev.alloc_from(&[0i32])?)?;
    ///     let dropped = moe.dropped()?;
    ///     let mut out = dev.alloc::<bf16>(8)?;
    ///     moe.combine(None, &dev.alloc_from(&[1f32])?, &mut out)?;
    ///     Ok((dropped, out.to_vec()?[0].to_f32()))
    /// })?;
    /// // Rank 1's entry was dropped: it adds nothing to its token's sum.
    /// assert_eq!(got, [(0, 1.0), (1, 0.0)]);
    /// # Ok(()) }
    /// ```
    pub fn dropped(&self) -> Result<u64> {
        Ok(self.read_state()?.dropped)
    }

    /// Rows this rank received in the last dispatch (waits as [`Moe::dropped`]).
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # use ferrolink::moe::{MoeConfig, bf16};
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// let cfg = MoeConfig { num_experts: 4, hidden: 8, top_k: 2, max_tokens: 1, capacity: None };
    /// let rows = run_ranks(&comms, |c| {
    ///     let mut moe = c.moe(cfg)?;
    ///     let dev = c.device();
    ///     // Rank 0's token goes to experts 0 and 1, rank 1's to expert 0 only (-1: none).
    ///     let idx = if c.rank() == 0 { [0i32, 1] } else { [0, -1] };
    ///     moe.dispatch(&dev.alloc::<bf16>(8)?, &dev.alloc_from(&idx)?)?;
    ///     let rows = moe.received_rows()?;
    ///     moe.combine(None, &dev.alloc::<f32>(2)?, &mut dev.alloc::<bf16>(8)?)?;
    ///     Ok(rows)
    /// })?;
    /// // Experts 0 and 1 are rank 0's.
    /// assert_eq!(rows, [3, 0]);
    /// # Ok(()) }
    /// ```
    pub fn received_rows(&self) -> Result<u64> {
        Ok(self.read_state()?.received)
    }

    fn read_state(&self) -> Result<MoeState> {
        // The stream's and the communicator's errors first: an aborted dispatch wrote nothing.
        self.comm.synchronize()?;
        let words = self.state.to_vec()?;
        Ok(bytemuck::pod_read_unaligned(bytemuck::cast_slice(&words[..std::mem::size_of::<MoeState>() / 8])))
    }

    /// Sends this rank's tokens to their experts' ranks (collective): `x` holds `T` rows of
    /// `hidden` bf16 (`T <= max_tokens`), or fp8 rows with their scales ([`Tokens::fp8`]),
    /// `topk_idx` `T * top_k` experts (`-1`: none). Returns when the work is queued on the
    /// rank's stream; [`Moe::received`] and [`Moe::recv_counts`] are then filled in stream
    /// order (the kernel reads `x` itself: no copy before it).
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # use ferrolink::moe::{MoeConfig, bf16};
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// let cfg = MoeConfig { num_experts: 4, hidden: 8, top_k: 2, max_tokens: 2, capacity: None };
    /// let outs = run_ranks(&comms, |c| {
    ///     let mut moe = c.moe(cfg)?;
    ///     let dev = c.device();
    ///     // Rank 0 has two tokens, all 1 and all 2; rank 1 none.
    ///     let t = if c.rank() == 0 { 2 } else { 0 };
    ///     let x: Vec<bf16> = (0..t * 8).map(|i| bf16::from_f32((1 + i / 8) as f32)).collect();
    ///     let (idx, w) = ([1i32, 3, 2, -1], [0.25f32, 0.5, 0.5, 9.0]);
    ///     moe.dispatch(&dev.alloc_from(&x)?, &dev.alloc_from(&idx[..t * 2])?)?;
    ///     // The experts would run here (on rank 0 and 1); the identity leaves the rows as they are.
    ///     let mut out = dev.alloc::<bf16>(t * 8)?;
    ///     moe.combine(None, &dev.alloc_from(&w[..t * 2])?, &mut out)?;
    ///     out.to_vec()
    /// })?;
    /// // Token 0: (0.25 + 0.5) x 1; token 1: 0.5 x 2, its -1 entry adds nothing.
    /// assert_eq!((outs[0][0].to_f32(), outs[0][8].to_f32()), (0.75, 1.0));
    /// assert!(outs[1].is_empty());
    /// # Ok(()) }
    /// ```
    pub fn dispatch<'t>(&mut self, x: impl Into<Tokens<'t>>, topk_idx: &DeviceBuffer<i32>) -> Result<()> {
        self.dispatch_routed(x.into(), topk_idx, None)
    }

    /// [`Moe::dispatch`], and every row put also gets its source: the token's rank, index,
    /// `k` and weight (`topk_weights`, `f32`, `T * top_k`), in the receive window after the
    /// rows (`ferrolink_device::moe::fused::RowSource`). For experts that send their results
    /// back themselves: the fused combine ([`Moe::fused_target`], [`Moe::finish_fused`]).
    /// The [`Moe::combine`] may follow it as after a dispatch.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # use ferrolink::moe::{MoeConfig, bf16};
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// let cfg = MoeConfig { num_experts: 4, hidden: 8, top_k: 2, max_tokens: 1, capacity: None };
    /// let outs = run_ranks(&comms, |c| {
    ///     let mut moe = c.moe(cfg)?;
    ///     let dev = c.device();
    ///     let x = dev.alloc_from(&[bf16::from_f32(4.0); 8])?;
    ///     let (idx, w) = (dev.alloc_from(&[0i32, 3])?, dev.alloc_from(&[0.25f32, 0.5])?);
    ///     moe.dispatch_with_sources(&x, &idx, &w)?;
    ///     // No expert kernel took the fused target: the plain combine ends the call.
    ///     let mut out = dev.alloc::<bf16>(8)?;
    ///     moe.combine(None, &w, &mut out)?;
    ///     out.to_vec()
    /// })?;
    /// assert_eq!(outs[0][0].to_f32(), 3.0);
    /// # Ok(()) }
    /// ```
    pub fn dispatch_with_sources<'t>(
        &mut self,
        x: impl Into<Tokens<'t>>,
        topk_idx: &DeviceBuffer<i32>,
        topk_weights: &DeviceBuffer<f32>,
    ) -> Result<()> {
        self.dispatch_routed(x.into(), topk_idx, Some(topk_weights))
    }

    fn dispatch_routed(
        &mut self,
        x: Tokens<'_>,
        topk_idx: &DeviceBuffer<i32>,
        topk_weights: Option<&DeviceBuffer<f32>>,
    ) -> Result<()> {
        not_recovered(&self.comm, self.recoveries, "moe dispatch")?;
        let (hidden, k) = (self.cfg.hidden, self.cfg.top_k);
        let rows = x.shape(hidden, "moe dispatch")?;
        let tokens = rows.tokens;
        if topk_weights.is_some() && rows.scale_units != 0 {
            return Err(Error::InvalidArgument(
                "moe dispatch_with_sources: the fused combine's experts read bf16 rows (FusedCombineArgs::row): \
                 dispatch bf16 tokens, or fp8 with dispatch and combine"
                    .into(),
            ));
        }
        if tokens > self.cfg.max_tokens {
            return Err(Error::InvalidArgument(format!(
                "moe dispatch: {tokens} tokens, more than max_tokens {}",
                self.cfg.max_tokens
            )));
        }
        if topk_idx.len() != tokens * k {
            return Err(Error::InvalidArgument(format!(
                "moe dispatch: topk_idx holds {} entries, {tokens} tokens x top_k {k} = {} needed",
                topk_idx.len(),
                tokens * k
            )));
        }
        if let Some(w) = topk_weights
            && w.len() != tokens * k
        {
            return Err(Error::InvalidArgument(format!(
                "moe dispatch: topk_weights holds {} weights, {tokens} tokens x top_k {k} = {} needed",
                w.len(),
                tokens * k
            )));
        }
        if self.pending.is_some() {
            return Err(Error::InvalidArgument(
                "moe dispatch: the last dispatch has not been combined (calls alternate: dispatch, combine)".into(),
            ));
        }
        let comm = self.comm.clone();
        let dev = comm.device();
        let module = dev.builtin_module()?;
        let stream = comm.stream();
        let entries = tokens * k;
        let (threads, cap_ctas) = self.shape();
        let grid = entries.div_ceil(ENTRIES_PER_CTA).clamp(1, cap_ctas.min(dev_moe::MAX_CTAS));
        // Whole tokens per CTA (the relay counts and sends a token once per domain).
        let chunk = tokens.div_ceil(grid).max(1) * k;
        let columns = dev_moe::count_columns(self.cfg.num_experts, self.relay_domains);
        let shared = dev_moe::dispatch_shared_bytes(columns, chunk);
        if shared > SHARED_LIMIT {
            return Err(Error::InvalidArgument(format!(
                "moe dispatch: {entries} entries over {grid} CTAs need {shared} bytes of shared memory per CTA, more \
                 than {SHARED_LIMIT}: dispatch fewer tokens per call"
            )));
        }
        self.epoch += 1;
        let args = MoeArgs {
            tokens: tokens as u32,
            top_k: k as u32,
            num_experts: self.cfg.num_experts as u32,
            capacity: self.capacity as u32,
            hidden: hidden as u32,
            chunk: chunk as u32,
            x_units: rows.x_units,
            scale_units: rows.scale_units,
            epoch: self.epoch,
            relay_domains: self.relay_domains as u32,
            max_tokens: self.cfg.max_tokens as u32,
            ..MoeArgs::default()
        };
        let mut reads = Vec::new();
        let mut writes = Vec::new();
        let mut args = args;
        if tokens > 0 {
            (args.x, args.scales) = x.addresses(&mut reads)?;
        }
        if entries > 0 {
            let idx = topk_idx.bytes_at(0)?;
            args.topk_idx = idx.param() as u64;
            reads.push(idx);
            let ret = self.ret_index.bytes_at_mut(0)?;
            args.ret_index = ret.param() as u64;
            writes.push(ret);
            if let Some(w) = topk_weights {
                let w = w.bytes_at(0)?;
                args.topk_weights = w.param() as u64;
                reads.push(w);
            }
        }
        let counts = self.recv_counts.bytes_at_mut(0)?;
        args.recv_counts = counts.param() as u64;
        writes.push(counts);
        let state = self.state.bytes_at_mut(0)?;
        args.state = state.param() as u64;
        writes.push(state);
        let tracked = TrackedArgs { args, reads: &reads, writes: &writes };
        // Without a relay the kernel touches no relay window: the counts stand in its place.
        let relay = self.relay.as_ref().unwrap_or(&self.counts);
        let launch = (&self.handle, &self.send, &self.recv, &self.counts, relay, &tracked);
        let cfg = LaunchConfig::linear(grid as u32, threads).with_shared_mem(shared as u32);
        // SAFETY: `moe_dispatch`'s contract: every rank launches it with the same
        // configuration (checked when the Moe was made) and grid shape rules, the windows of
        // this Moe (made together on every rank, so with the same ids) sized for it, the
        // token rows (`x`, checked for `tokens` rows of this shape, tracked), `topk_idx`,
        // `ret_index`, `recv_counts`, the state and the weights if any (with the receive
        // window's room for the rows' sources) sized for `tokens` (checked) and tracked
        // by this launch; the device communicator and its signals are this Moe's only; the
        // epoch counts its dispatches and calls alternate (checked).
        let queued = unsafe { stream.launch(module, &moe_dispatch, cfg, launch) };
        if let Err(e) = queued {
            self.epoch -= 1;
            return Err(e);
        }
        tracing::debug!(target: "ferrolink::moe", rank = comm.rank(), epoch = self.epoch, tokens, grid, "dispatch queued");
        self.pending = Some(tokens);
        self.pending_sources = topk_weights.is_some();
        *self.expert_launched.get_mut() = false;
        Ok(())
    }

    /// Brings the experts' results back (collective): `expert_out` holds them in the receive
    /// buffer's shape (`None`: they were written over [`Moe::received`], zero copy), and
    /// `out` gets `T` rows of `hidden` bf16 (`T` of the last dispatch), each the sum over its
    /// entries of `topk_weights[t, k]` (`f32`, `T * top_k`) times the result; dropped entries
    /// and `-1` add nothing.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # use ferrolink::moe::{MoeConfig, bf16};
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// let cfg = MoeConfig { num_experts: 4, hidden: 8, top_k: 2, max_tokens: 1, capacity: None };
    /// let outs = run_ranks(&comms, |c| {
    ///     let mut moe = c.moe(cfg)?;
    ///     let dev = c.device();
    ///     // One token per rank, all `rank + 1`, to experts 0 and 3 with weights 0.25 and 0.5.
    ///     let x = dev.alloc_from(&[bf16::from_f32(c.rank() as f32 + 1.0); 8])?;
    ///     let (idx, w) = (dev.alloc_from(&[0i32, 3])?, dev.alloc_from(&[0.25f32, 0.5])?);
    ///     moe.dispatch(&x, &idx)?;
    ///     // The experts (here on the host) double their rows, into a buffer of the same shape.
    ///     let mut rows = dev.alloc::<bf16>(moe.experts_per_rank() * moe.capacity() * 8)?;
    ///     moe.copy_received(&mut rows)?;
    ///     let y: Vec<bf16> = rows.to_vec()?.iter().map(|v| bf16::from_f32(2.0 * v.to_f32())).collect();
    ///     let mut out = dev.alloc::<bf16>(8)?;
    ///     moe.combine(Some(&dev.alloc_from(&y)?), &w, &mut out)?;
    ///     out.to_vec()
    /// })?;
    /// // (0.25 + 0.5) x 2 x (rank + 1).
    /// assert_eq!((outs[0][0].to_f32(), outs[1][0].to_f32()), (1.5, 3.0));
    /// # Ok(()) }
    /// ```
    pub fn combine(
        &mut self,
        expert_out: Option<&DeviceBuffer<bf16>>,
        topk_weights: &DeviceBuffer<f32>,
        out: &mut DeviceBuffer<bf16>,
    ) -> Result<()> {
        not_recovered(&self.comm, self.recoveries, "moe combine")?;
        let Some(tokens) = self.pending else {
            return Err(Error::InvalidArgument("moe combine: no dispatch to combine".into()));
        };
        if *self.expert_launched.get_mut() {
            return Err(Error::InvalidArgument(
                "moe combine: fused_target was taken for this dispatch (its experts add into the tokens' ranks): \
                 end it with finish_fused"
                    .into(),
            ));
        }
        let (hidden, k) = (self.cfg.hidden, self.cfg.top_k);
        if topk_weights.len() != tokens * k || out.len() != tokens * hidden {
            return Err(Error::InvalidArgument(format!(
                "moe combine: the last dispatch had {tokens} tokens: topk_weights must hold {} (it holds {}), out {} \
                 (it holds {})",
                tokens * k,
                topk_weights.len(),
                tokens * hidden,
                out.len()
            )));
        }
        let recv_bytes = self.experts_per_rank() * self.capacity * 2 * hidden;
        let comm = self.comm.clone();
        let dev = comm.device();
        let module = dev.builtin_module()?;
        let stream = comm.stream();
        if let Some(src) = expert_out {
            if src.len() * 2 != recv_bytes {
                return Err(Error::InvalidArgument(format!(
                    "moe combine: expert_out holds {} elements, the receive buffer's shape is {} x {} x {hidden}",
                    src.len(),
                    self.experts_per_rank(),
                    self.capacity
                )));
            }
            let cfg = staging_copy_config(dev, recv_bytes);
            launch_copy(
                stream,
                &ferrolink_copy,
                self.recv.slot_ptr(0, recv_bytes)?,
                src.bytes_at(0)?,
                recv_bytes,
                cfg,
            )?;
        }
        let (threads, cap_ctas) = self.shape();
        let mut args = self.result_args(tokens);
        let mut reads = Vec::new();
        let mut writes = Vec::new();
        if tokens > 0 {
            let w = topk_weights.bytes_at(0)?;
            args.topk_weights = w.param() as u64;
            reads.push(w);
            let r = self.ret_index.bytes_at(0)?;
            args.ret_index = r.param() as u64;
            reads.push(r);
            let o = out.bytes_at_mut(0)?;
            args.out = o.param() as u64;
            writes.push(o);
        }
        let counts = self.recv_counts.bytes_at(0)?;
        args.recv_counts = counts.param() as u64;
        reads.push(counts);
        let state = self.state.bytes_at(0)?;
        args.state = state.param() as u64;
        reads.push(state);
        let tracked = TrackedArgs { args, reads: &reads, writes: &writes };
        // Without a relay the kernel touches no relay window: the counts stand in its place.
        let relay = self.relay.as_ref().unwrap_or(&self.counts);
        let launch = (&self.handle, &self.recv, &self.ret, &self.counts, relay, &tracked);
        let shared = dev_moe::combine_shared_bytes(self.cfg.num_experts);
        let cfg = LaunchConfig::linear(cap_ctas as u32, threads).with_shared_mem(shared as u32);
        // SAFETY: `moe_combine`'s contract: after this Moe's dispatch on this stream (pending,
        // checked), with its windows, the weights and the output sized for its tokens
        // (checked) and tracked, the expert results in `recv` (written by the caller's
        // kernels, or copied just before).
        unsafe { stream.launch(module, &moe_combine, cfg, launch)? };
        tracing::debug!(target: "ferrolink::moe", rank = comm.rank(), epoch = self.epoch, tokens, "combine queued");
        self.pending = None;
        Ok(())
    }

    fn shape(&self) -> (u32, usize) {
        kernel_shape(&self.comm)
    }

    /// The arguments of a kernel that brings the last dispatch's results back (the combine,
    /// the fused combine's finish), before its addresses: `tokens` tokens of bf16 results.
    fn result_args(&self, tokens: usize) -> MoeArgs {
        let hidden = self.cfg.hidden;
        MoeArgs {
            tokens: tokens as u32,
            top_k: self.cfg.top_k as u32,
            num_experts: self.cfg.num_experts as u32,
            capacity: self.capacity as u32,
            hidden: hidden as u32,
            chunk: 1,
            // Results move as bf16 rows.
            x_units: (hidden / 8) as u32,
            epoch: self.epoch,
            relay_domains: self.relay_domains as u32,
            max_tokens: self.cfg.max_tokens as u32,
            ..MoeArgs::default()
        }
    }
}

/// Entries per dispatch CTA (more CTAs for more tokens, up to the resident limit).
const ENTRIES_PER_CTA: usize = 32;

/// A kernel's argument struct with the buffers its addresses name, tracked by the launch.
struct TrackedArgs<'s, 'a, A> {
    args: A,
    reads: &'s [TrackedPtr<'a, *const u8>],
    writes: &'s [TrackedPtr<'a, *mut u8>],
}

impl<A> crate::runtime::launch::sealed::Sealed for &TrackedArgs<'_, '_, A> {}

impl<A: KernelParam + Copy> LaunchArg for &TrackedArgs<'_, '_, A> {
    type Param = A;
    fn param(&self) -> A {
        self.args
    }
    fn track(&self, t: &mut LaunchTracking) {
        for r in self.reads {
            r.track(t);
        }
        for w in self.writes {
            w.track(t);
        }
    }
}

/// Refuses a call on a MoE object made before a [`Communicator::recover`] (`made_at`: the
/// communicator's recoveries then): the failed call may have left rows and signal adds in
/// flight, which the object's epochs and targets would count as the next call's.
fn not_recovered(comm: &Communicator, made_at: u64, call: &str) -> Result<()> {
    if comm.recoveries() == made_at {
        return Ok(());
    }
    Err(Error::InvalidArgument(format!(
        "{call}: the communicator was recovered (Communicator::recover) after this MoE object was made; its \
         signals may count the failed call's rows: make a new one (collective)"
    )))
}

/// Checks `cfg` (with the capacity in use) for `mode`'s kernels on this communicator, and
/// that every rank has the same shape (collective).
fn check_config(comm: &Communicator, cfg: &MoeConfig, capacity: usize, relay_domains: usize, mode: &str) -> Result<()> {
    let n = comm.nranks();
    let bad = |why: String| Err(Error::InvalidArgument(format!("{mode}: {why} ({cfg:?})")));
    if cfg.num_experts == 0 || !cfg.num_experts.is_multiple_of(n) {
        return bad(format!("num_experts must be a positive multiple of the {n} ranks"));
    }
    if cfg.hidden == 0 || !cfg.hidden.is_multiple_of(8) {
        return bad("hidden must be a positive multiple of 8 (rows move as 16-byte vectors)".into());
    }
    if cfg.top_k == 0 || cfg.max_tokens == 0 {
        return bad("top_k and max_tokens must be at least 1".into());
    }
    let entries = cfg.max_tokens.checked_mul(cfg.top_k);
    if capacity == 0 || u32::try_from(capacity).is_err() || entries.is_none_or(|e| u32::try_from(e).is_err()) {
        return bad("capacity must be at least 1, and capacity and max_tokens * top_k must fit 32 bits".into());
    }
    // Every CTA holds four arrays of num_experts words in shared memory (and its entries).
    if dev_moe::dispatch_shared_bytes(dev_moe::count_columns(cfg.num_experts, relay_domains), 1) > SHARED_LIMIT / 2 {
        return bad(format!("at most {} experts", SHARED_LIMIT / 2 / 16 - 1));
    }
    // The same shape everywhere: the windows and the kernels' cut depend on it.
    let mine: Vec<u8> = [cfg.num_experts, cfg.hidden, cfg.top_k, cfg.max_tokens, capacity, relay_domains]
        .iter()
        .flat_map(|v| (*v as u64).to_le_bytes())
        .collect();
    for (r, theirs) in comm.all_gather_bytes(&mine)?.iter().enumerate() {
        if *theirs != mine {
            let w = |i: usize| u64::from_le_bytes(theirs[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
            return bad(format!(
                "rank {} and rank {r} differ: rank {r} has num_experts {}, hidden {}, top_k {}, max_tokens {}, \
                 capacity {}, relay domains {} (FERROLINK_MOE_RELAY)",
                comm.rank(),
                w(0),
                w(1),
                w(2),
                w(3),
                w(4),
                w(5)
            ));
        }
    }
    Ok(())
}

/// Registers a window of `bytes` bytes of fresh device memory on every rank (collective).
fn new_window(comm: &Communicator, bytes: usize) -> Result<Window> {
    comm.register_window(comm.mem_alloc(bytes)?)
}

/// Threads per CTA and the most CTAs per MoE kernel: every CTA of every rank must be
/// resident at once (they wait for each other), so the ranks sharing a GPU share its SMs.
fn kernel_shape(comm: &Communicator) -> (u32, usize) {
    let dev = comm.device();
    let profile = dev.launch_profile();
    let ctas = dev.resident_ctas(profile.moe_ctas, comm.ranks_sharing_gpu()) as usize;
    (profile.moe_threads, ctas.clamp(1, dev_moe::MAX_CTAS))
}
