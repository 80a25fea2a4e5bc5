//! MoE dispatch and combine in low-latency mode ([`MoeLowLatency`]).

use super::tokens::RowShape;
use super::{MoeConfig, Tokens, TrackedArgs, bf16, check_config, kernel_shape, new_window};
use crate::comm::Communicator;
use crate::devcomm::{DevCommHandle, DevCommRequirements};
use crate::mem::window::Window;
use crate::ops::{launch_copy, staging_copy_config};
use crate::runtime::launch::{LaunchArg, LaunchConfig};
use crate::runtime::memory::DeviceBuffer;
use crate::{Error, Result};
use ferrolink_device::kernels::copy::ferrolink_copy;
use ferrolink_device::kernels::moe::{moe_ll_combine, moe_ll_dispatch};
use ferrolink_device::moe::low_latency::{
    self as ll, LowLatencyState, MoeLowLatencyArgs, counts_bytes, phase, scratch_bytes,
};

/// MoE dispatch and combine for small batches (decoding), made collectively by
/// [`Communicator::moe_low_latency`]: every (local expert, source rank) pair has a fixed
/// region of `max_tokens` rows, so no count exchange precedes the data (each rank's counts
/// travel with its rows); the buffers alternate by call; and each call can be split into a
/// *send* and a *receive* (the receive hook) so that the caller's kernels run while the rows
/// travel.
///
/// Received rows: local expert `l`'s rows from rank `s` lie at [`MoeLowLatency::region`]`(l,
/// s)` of [`MoeLowLatency::received`], [`MoeLowLatency::recv_counts`]`[l * nranks + s]` of
/// them (the order of one source's rows in its region is not fixed; each row is its
/// token's). The combine sums, per token, `topk_weights[t, k]` times the result of each of
/// its entries, in `f32` in `k` order, rounded once to bf16: the same output as
/// [`super::Moe::combine`]. Nothing is dropped; a rank with more than `max_tokens` entries
/// to one expert (a token naming an expert twice) is a kernel fault that says so.
///
/// Calls go in the order dispatch (or `dispatch_send` then `dispatch_recv`), then combine
/// (or `combine_send` then `combine_recv`), on every rank (checked here).
///
/// ```
/// # fn main() -> ferrolink::Result<()> {
/// use ferrolink::moe::{MoeConfig, bf16};
/// use ferrolink::{Communicator, Device, run_ranks};
/// let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
/// let cfg = MoeConfig { num_experts: 4, hidden: 8, top_k: 2, max_tokens: 3, capacity: None };
/// let outs = run_ranks(&comms, |c| {
///     let mut ll = c.moe_low_latency(cfg)?;
///     let dev = c.device();
///     let x: Vec<bf16> = (0..3 * 8).map(|i| bf16::from_f32((c.rank() * 3 + i / 8) as f32)).collect();
///     let idx: Vec<i32> = (0..3).flat_map(|t| [t, 3 - t]).collect();
///     let (x, idx) = (dev.alloc_from(&x)?, dev.alloc_from(&idx)?);
///     ll.dispatch_send(&x, &idx)?;
///     // ... compute that does not need the rows runs here ...
///     ll.dispatch_recv()?;
///     let mut out = dev.alloc::<bf16>(3 * 8)?;
///     ll.combine(None, &dev.alloc_from(&[0.5f32; 6])?, &mut out)?;
///     out.to_vec()
/// })?;
/// assert_eq!(outs[1][8].to_f32(), 4.0);
/// # Ok(()) }
/// ```
pub struct MoeLowLatency {
    comm: Communicator,
    cfg: MoeConfig,
    handle: DevCommHandle,
    /// This rank's token rows (copied in by the dispatch).
    send: Window,
    /// `[2][experts_per_rank][nranks][max_tokens]` rows.
    recv: Window,
    /// `[num_experts][max_tokens]` rows: this rank's results coming back.
    ret: Window,
    /// Counts received (`[2][nranks][experts_per_rank]`) and this rank's own.
    counts: Window,
    ret_index: DeviceBuffer<u32>,
    recv_counts: DeviceBuffer<i32>,
    state: DeviceBuffer<u64>,
    /// Dispatches so far.
    epoch: u64,
    stage: Stage,
    /// [`Communicator::recover`] calls when this was made: after another, calls are refused.
    recoveries: u64,
}

/// Where a rank is in its calls (each holds the tokens of the dispatch).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    Idle,
    DispatchSent(usize),
    Received(usize),
    CombineSent(usize),
}

impl Communicator {
    /// Makes this rank's low-latency MoE resources (collective: every rank calls it with the
    /// same configuration, checked; `capacity` must be `None`: every (expert, source) pair
    /// has `max_tokens` rows). Memory per rank, in rows of `2 * hidden` bytes: `max_tokens`
    /// (sources), `2 * num_experts * max_tokens` (received, two buffers of
    /// `experts_per_rank * nranks * max_tokens`), `num_experts * max_tokens` (results).
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// use ferrolink::moe::MoeConfig;
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// let cfg = MoeConfig { num_experts: 4, hidden: 8, top_k: 2, max_tokens: 2, capacity: None };
    /// let made = run_ranks(&comms, |c| {
    ///     // Every (expert, source) pair has max_tokens rows: there is no capacity to choose.
    ///     assert!(c.moe_low_latency(MoeConfig { capacity: Some(4), ..cfg }).is_err());
    ///     Ok(c.moe_low_latency(cfg).is_ok())
    /// })?;
    /// assert_eq!(made, [true, true]);
    /// # Ok(()) }
    /// ```
    pub fn moe_low_latency(&self, cfg: MoeConfig) -> Result<MoeLowLatency> {
        if cfg.capacity.is_some() {
            return Err(Error::InvalidArgument(format!(
                "moe_low_latency: capacity must be None: every (expert, source) pair has max_tokens rows ({cfg:?})"
            )));
        }
        check_config(self, &cfg, cfg.max_tokens, 0, "moe_low_latency")?;
        let rows = cfg.max_tokens * 2 * cfg.hidden;
        let send = new_window(self, rows)?;
        let recv = new_window(self, 2 * cfg.num_experts * rows)?;
        let ret = new_window(self, cfg.num_experts * rows)?;
        let counts = new_window(self, counts_bytes(cfg.num_experts))?;
        let handle = self.create_dev_comm(&DevCommRequirements {
            gin_context_count: 1,
            gin_signal_count: ll::signal::COUNT,
            ..DevCommRequirements::default()
        })?;
        let dev = self.device();
        Ok(MoeLowLatency {
            comm: self.clone(),
            cfg,
            handle,
            send,
            recv,
            ret,
            counts,
            // A ResultPlace (two u32) per entry.
            ret_index: dev.alloc(2 * cfg.max_tokens * cfg.top_k)?,
            recv_counts: dev.alloc(cfg.num_experts)?,
            state: dev.alloc(scratch_bytes(cfg.num_experts).div_ceil(8))?,
            epoch: 0,
            stage: Stage::Idle,
            recoveries: self.recoveries(),
        })
    }
}

impl MoeLowLatency {
    /// The configuration.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # use ferrolink::moe::MoeConfig;
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// let cfg = MoeConfig { num_experts: 4, hidden: 8, top_k: 2, max_tokens: 2, capacity: None };
    /// let same = run_ranks(&comms, |c| Ok(c.moe_low_latency(cfg)?.config() == cfg))?;
    /// assert_eq!(same, [true, true]);
    /// # Ok(()) }
    /// ```
    pub fn config(&self) -> MoeConfig {
        self.cfg
    }

    /// Experts on each rank.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # use ferrolink::moe::MoeConfig;
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// let cfg = MoeConfig { num_experts: 4, hidden: 8, top_k: 2, max_tokens: 2, capacity: None };
    /// let per = run_ranks(&comms, |c| Ok(c.moe_low_latency(cfg)?.experts_per_rank()))?;
    /// assert_eq!(per, [2, 2]);
    /// # Ok(()) }
    /// ```
    pub fn experts_per_rank(&self) -> usize {
        self.cfg.num_experts / self.comm.nranks()
    }

    /// The receive window: two buffers of `[experts_per_rank][nranks][max_tokens][hidden]`
    /// bf16, used by alternate dispatches; a kernel may write the experts' results over the
    /// rows (then pass `None` to the combine). See [`MoeLowLatency::region`].
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # use ferrolink::moe::{MoeConfig, bf16};
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # use std::sync::Mutex;
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// let cfg = MoeConfig { num_experts: 4, hidden: 8, top_k: 2, max_tokens: 2, capacity: None };
    /// let lls = run_ranks(&comms, |c| {
    ///     let mut ll = c.moe_low_latency(cfg)?;
    ///     // One token per rank, all `rank + 1`, to experts 0 (on rank 0) and 3 (on rank 1).
    ///     let x = c.device().alloc_from(&[bf16::from_f32(c.rank() as f32 + 1.0); 8])?;
    ///     ll.dispatch(&x, &c.device().alloc_from(&[0i32, 3])?)?;
    ///     Ok(Mutex::new(ll))
    /// })?;
    /// // No rank has queued its combine: a host read (it waits for every rank's kernels) is safe.
    /// let ll = lls[1].lock().unwrap();
    /// // Rank 1's local expert 1 (expert 3), the row from rank 0.
    /// let row: Vec<bf16> = ll.received().read(ll.region(1, 0)?, 8)?;
    /// assert_eq!(row[0].to_f32(), 1.0);
    /// # drop(ll);
    /// # run_ranks(&comms, |c| {
    /// #     let mut out = c.device().alloc::<bf16>(8)?;
    /// #     lls[c.rank()].lock().unwrap().combine(None, &c.device().alloc_from(&[0.5f32; 2])?, &mut out)?;
    /// #     c.synchronize()
    /// # })?;
    /// # Ok(()) }
    /// ```
    pub fn received(&self) -> &Window {
        &self.recv
    }

    /// Byte offset in [`MoeLowLatency::received`] of the rows that the last dispatch
    /// received for local expert `l` from rank `src` (`recv_counts[l * nranks + src]` rows).
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # use ferrolink::moe::{MoeConfig, bf16};
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// let cfg = MoeConfig { num_experts: 4, hidden: 8, top_k: 2, max_tokens: 2, capacity: None };
    /// let steps = run_ranks(&comms, |c| {
    ///     let mut ll = c.moe_low_latency(cfg)?;
    ///     let dev = c.device();
    ///     // Only after a dispatch, and only for local experts and ranks that exist.
    ///     assert!(ll.region(0, 0).is_err());
    ///     ll.dispatch(&dev.alloc::<bf16>(8)?, &dev.alloc_from(&[0i32, 3])?)?;
    ///     assert!(ll.region(2, 0).is_err());
    ///     let step = ll.region(0, 1)? - ll.region(0, 0)?;
    ///     ll.combine(None, &dev.alloc::<f32>(2)?, &mut dev.alloc::<bf16>(8)?)?;
    ///     Ok(step)
    /// })?;
    /// // Each source's region holds max_tokens rows of 2 * hidden bytes.
    /// assert_eq!(steps, [2 * 2 * 8, 2 * 2 * 8]);
    /// # Ok(()) }
    /// ```
    pub fn region(&self, l: usize, src: usize) -> Result<usize> {
        let (per, n) = (self.experts_per_rank(), self.comm.nranks());
        if l >= per || src >= n || self.epoch == 0 {
            return Err(Error::InvalidArgument(format!(
                "moe_low_latency region: local expert {l} of {per}, rank {src} of {n}, after {} dispatches",
                self.epoch
            )));
        }
        let row = 2 * self.cfg.hidden;
        let rows = ll::RowLayout { per_rank: per, nranks: n, max_tokens: self.cfg.max_tokens, row_bytes: row };
        Ok(rows.recv_row(self.parity(), l, src, 0))
    }

    /// Rows received per (local expert, source rank) by the last dispatch: `i32
    /// [experts_per_rank][nranks]`. A host read waits for the receive but does not report its
    /// failure: call [`Communicator::synchronize`] first.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # use ferrolink::moe::{MoeConfig, bf16};
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// let cfg = MoeConfig { num_experts: 4, hidden: 8, top_k: 2, max_tokens: 1, capacity: None };
    /// let counts = run_ranks(&comms, |c| {
    ///     let mut ll = c.moe_low_latency(cfg)?;
    ///     let dev = c.device();
    ///     // Rank 0's token goes to experts 0 and 3, rank 1's to experts 1 and 3.
    ///     let idx = if c.rank() == 0 { [0i32, 3] } else { [1, 3] };
    ///     ll.dispatch(&dev.alloc::<bf16>(8)?, &dev.alloc_from(&idx)?)?;
    ///     // The dispatch's errors first (a host read of the counts does not report them).
    ///     c.synchronize()?;
    ///     let counts = ll.recv_counts().to_vec()?;
    ///     ll.combine(None, &dev.alloc::<f32>(2)?, &mut dev.alloc::<bf16>(8)?)?;
    ///     Ok(counts)
    /// })?;
    /// // [local expert][source rank]: rank 0 holds experts 0 and 1, rank 1 experts 2 and 3.
    /// assert_eq!(counts, [[1, 0, 0, 1], [0, 0, 1, 1]]);
    /// # Ok(()) }
    /// ```
    pub fn recv_counts(&self) -> &DeviceBuffer<i32> {
        &self.recv_counts
    }

    /// Rows this rank received in the last dispatch (waits for the rank's stream; its error,
    /// or the communicator's, if any).
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # use ferrolink::moe::{MoeConfig, bf16};
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// let cfg = MoeConfig { num_experts: 4, hidden: 8, top_k: 2, max_tokens: 2, capacity: None };
    /// let rows = run_ranks(&comms, |c| {
    ///     let mut ll = c.moe_low_latency(cfg)?;
    ///     let dev = c.device();
    ///     // Rank 0 has two tokens, to experts (0, 2) and (1, 2); rank 1 none.
    ///     let t = if c.rank() == 0 { 2 } else { 0 };
    ///     ll.dispatch(&dev.alloc::<bf16>(t * 8)?, &dev.alloc_from(&[0i32, 2, 1, 2][..t * 2])?)?;
    ///     let rows = ll.received_rows()?;
    ///     ll.combine(None, &dev.alloc::<f32>(t * 2)?, &mut dev.alloc::<bf16>(t * 8)?)?;
    ///     Ok(rows)
    /// })?;
    /// assert_eq!(rows, [2, 2]);
    /// # Ok(()) }
    /// ```
    pub fn received_rows(&self) -> Result<u64> {
        self.comm.synchronize()?;
        let words = self.state.to_vec()?;
        let state: LowLatencyState =
            bytemuck::pod_read_unaligned(bytemuck::cast_slice(&words[..size_of::<LowLatencyState>() / 8]));
        Ok(state.received)
    }

    /// Copies the last dispatch's buffer (`experts_per_rank * nranks * max_tokens * hidden`
    /// bf16, as [`MoeLowLatency::region`] lays it out) into `dst`, on the rank's stream.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # use ferrolink::moe::{MoeConfig, bf16};
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// let cfg = MoeConfig { num_experts: 4, hidden: 8, top_k: 2, max_tokens: 1, capacity: None };
    /// let received = run_ranks(&comms, |c| {
    ///     let mut ll = c.moe_low_latency(cfg)?;
    ///     let dev = c.device();
    ///     // One token per rank, all `rank + 1`, to experts 0 (on rank 0) and 3 (on rank 1).
    ///     let x = dev.alloc_from(&[bf16::from_f32(c.rank() as f32 + 1.0); 8])?;
    ///     ll.dispatch(&x, &dev.alloc_from(&[0i32, 3])?)?;
    ///     // [experts_per_rank][nranks][max_tokens][hidden], copied in stream order.
    ///     let mut rows = dev.alloc::<bf16>(2 * 2 * 1 * 8)?;
    ///     ll.copy_received(&mut rows)?;
    ///     ll.combine(None, &dev.alloc_from(&[0.5f32; 2])?, &mut dev.alloc::<bf16>(8)?)?;
    ///     rows.to_vec()
    /// })?;
    /// // Rank 1's local expert 1 (expert 3): rank 0's row, then rank 1's.
    /// let row = |src: usize| received[1][(2 + src) * 8].to_f32();
    /// assert_eq!((row(0), row(1)), (1.0, 2.0));
    /// # Ok(()) }
    /// ```
    pub fn copy_received(&self, dst: &mut DeviceBuffer<bf16>) -> Result<()> {
        let bytes = self.half_bytes();
        if dst.len() * 2 != bytes || self.epoch == 0 {
            return Err(Error::InvalidArgument(format!(
                "moe_low_latency copy_received: the buffer holds {} elements, a receive buffer {} (after {} \
                 dispatches)",
                dst.len(),
                bytes / 2,
                self.epoch
            )));
        }
        let cfg = staging_copy_config(self.comm.device(), bytes);
        let from = self.recv.slot_ptr(self.parity() * bytes, bytes)?;
        launch_copy(self.comm.stream(), &ferrolink_copy, dst.bytes_at_mut(0)?, from, bytes, cfg)
    }

    /// [`MoeLowLatency::dispatch_send`] and [`MoeLowLatency::dispatch_recv`] in one kernel.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # use ferrolink::moe::{MoeConfig, bf16};
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// let cfg = MoeConfig { num_experts: 4, hidden: 8, top_k: 2, max_tokens: 2, capacity: None };
    /// let outs = run_ranks(&comms, |c| {
    ///     let mut ll = c.moe_low_latency(cfg)?;
    ///     let dev = c.device();
    ///     // Two tokens per rank, all 1 and all 2; -1 names no expert.
    ///     let x: Vec<bf16> = (0..2 * 8).map(|i| bf16::from_f32((1 + i / 8) as f32)).collect();
    ///     ll.dispatch(&dev.alloc_from(&x)?, &dev.alloc_from(&[1i32, 3, 2, -1])?)?;
    ///     // The experts would run here; the identity leaves the rows as they are.
    ///     let mut out = dev.alloc::<bf16>(2 * 8)?;
    ///     ll.combine(None, &dev.alloc_from(&[0.25f32, 0.5, 0.5, 9.0])?, &mut out)?;
    ///     out.to_vec()
    /// })?;
    /// // Token 0: (0.25 + 0.5) x 1; token 1: 0.5 x 2, its -1 entry adds nothing.
    /// assert_eq!((outs[1][0].to_f32(), outs[1][8].to_f32()), (0.75, 1.0));
    /// # Ok(()) }
    /// ```
    pub fn dispatch<'t>(&mut self, x: impl Into<Tokens<'t>>, topk_idx: &DeviceBuffer<i32>) -> Result<()> {
        self.send_dispatch(x.into(), topk_idx, phase::BOTH)
    }

    /// Sends this rank's tokens (`x`: `T` rows of `hidden` bf16, `T <= max_tokens`, or fp8
    /// rows with their scales, [`Tokens::fp8`]; `topk_idx`: `T * top_k` experts, `-1`: none)
    /// to their experts' ranks, and its counts; returns when queued. The rows land while the
    /// stream runs other work; [`MoeLowLatency::dispatch_recv`] waits for them.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # use ferrolink::moe::{MoeConfig, bf16};
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// let cfg = MoeConfig { num_experts: 4, hidden: 8, top_k: 2, max_tokens: 1, capacity: None };
    /// let outs = run_ranks(&comms, |c| {
    ///     let mut ll = c.moe_low_latency(cfg)?;
    ///     let dev = c.device();
    ///     let (x, idx) = (dev.alloc_from(&[bf16::from_f32(2.0); 8])?, dev.alloc_from(&[0i32, 2])?);
    ///     let (w, mut out) = (dev.alloc_from(&[0.5f32; 2])?, dev.alloc::<bf16>(8)?);
    ///     ll.dispatch_send(&x, &idx)?;
    ///     // The rows are on their way: no combine before the receive.
    ///     assert!(ll.combine(None, &w, &mut out).is_err());
    ///     ll.dispatch_recv()?;
    ///     ll.combine(None, &w, &mut out)?;
    ///     out.to_vec()
    /// })?;
    /// assert_eq!(outs[0][0].to_f32(), 2.0);
    /// # Ok(()) }
    /// ```
    pub fn dispatch_send<'t>(&mut self, x: impl Into<Tokens<'t>>, topk_idx: &DeviceBuffer<i32>) -> Result<()> {
        self.send_dispatch(x.into(), topk_idx, phase::SEND)
    }

    /// The receive hook: waits (on the stream) for every rank's rows of this dispatch and
    /// writes [`MoeLowLatency::recv_counts`].
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # use ferrolink::moe::{MoeConfig, bf16};
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// let cfg = MoeConfig { num_experts: 4, hidden: 8, top_k: 2, max_tokens: 1, capacity: None };
    /// let counts = run_ranks(&comms, |c| {
    ///     let mut ll = c.moe_low_latency(cfg)?;
    ///     let dev = c.device();
    ///     // Nothing to receive before a dispatch_send.
    ///     assert!(ll.dispatch_recv().is_err());
    ///     // Every rank's token goes to experts 0 and 1 (both on rank 0).
    ///     ll.dispatch_send(&dev.alloc::<bf16>(8)?, &dev.alloc_from(&[0i32, 1])?)?;
    ///     ll.dispatch_recv()?;
    ///     c.synchronize()?;
    ///     let counts = ll.recv_counts().to_vec()?;
    ///     ll.combine(None, &dev.alloc::<f32>(2)?, &mut dev.alloc::<bf16>(8)?)?;
    ///     Ok(counts)
    /// })?;
    /// assert_eq!(counts, [[1, 1, 1, 1], [0, 0, 0, 0]]);
    /// # Ok(()) }
    /// ```
    pub fn dispatch_recv(&mut self) -> Result<()> {
        let Stage::DispatchSent(tokens) = self.stage else {
            return Err(self.out_of_order("dispatch_recv", "after dispatch_send"));
        };
        self.launch_dispatch(None, tokens, phase::RECV)?;
        self.stage = Stage::Received(tokens);
        Ok(())
    }

    /// [`MoeLowLatency::combine_send`] and [`MoeLowLatency::combine_recv`] in one kernel.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # use ferrolink::moe::{MoeConfig, bf16};
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// let cfg = MoeConfig { num_experts: 4, hidden: 8, top_k: 2, max_tokens: 1, capacity: None };
    /// let outs = run_ranks(&comms, |c| {
    ///     let mut ll = c.moe_low_latency(cfg)?;
    ///     let dev = c.device();
    ///     // One token per rank, all `rank + 1`, to experts 0 and 3 with weights 0.25 and 0.5.
    ///     let x = dev.alloc_from(&[bf16::from_f32(c.rank() as f32 + 1.0); 8])?;
    ///     let (idx, w) = (dev.alloc_from(&[0i32, 3])?, dev.alloc_from(&[0.25f32, 0.5])?);
    ///     ll.dispatch(&x, &idx)?;
    ///     // The experts (here on the host) double their rows, into a buffer of the same shape.
    ///     let mut rows = dev.alloc::<bf16>(2 * 2 * 1 * 8)?;
    ///     ll.copy_received(&mut rows)?;
    ///     let y: Vec<bf16> = rows.to_vec()?.iter().map(|v| bf16::from_f32(2.0 * v.to_f32())).collect();
    ///     let mut out = dev.alloc::<bf16>(8)?;
    ///     ll.combine(Some(&dev.alloc_from(&y)?), &w, &mut out)?;
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
        let Stage::Received(tokens) = self.stage else {
            return Err(self.out_of_order("combine", "after the dispatch's receive"));
        };
        self.stage_results(expert_out)?;
        self.launch_combine(Some((topk_weights, out)), tokens, phase::BOTH)?;
        self.stage = Stage::Idle;
        Ok(())
    }

    /// Sends the experts' results back (`expert_out` in the shape of
    /// [`MoeLowLatency::copy_received`], or `None`: written over [`MoeLowLatency::received`]).
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # use ferrolink::moe::{MoeConfig, bf16};
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// let cfg = MoeConfig { num_experts: 4, hidden: 8, top_k: 2, max_tokens: 1, capacity: None };
    /// let outs = run_ranks(&comms, |c| {
    ///     let mut ll = c.moe_low_latency(cfg)?;
    ///     let dev = c.device();
    ///     let x = dev.alloc_from(&[bf16::from_f32(c.rank() as f32 + 1.0); 8])?;
    ///     ll.dispatch(&x, &dev.alloc_from(&[1i32, 2])?)?;
    ///     // The experts ran over the received rows (here: the identity); send their results.
    ///     ll.combine_send(None)?;
    ///     // ... work that does not need the results runs here ...
    ///     let mut out = dev.alloc::<bf16>(8)?;
    ///     ll.combine_recv(&dev.alloc_from(&[0.5f32, 0.25])?, &mut out)?;
    ///     out.to_vec()
    /// })?;
    /// // (0.5 + 0.25) x (rank + 1).
    /// assert_eq!((outs[0][0].to_f32(), outs[1][0].to_f32()), (0.75, 1.5));
    /// # Ok(()) }
    /// ```
    pub fn combine_send(&mut self, expert_out: Option<&DeviceBuffer<bf16>>) -> Result<()> {
        let Stage::Received(tokens) = self.stage else {
            return Err(self.out_of_order("combine_send", "after the dispatch's receive"));
        };
        self.stage_results(expert_out)?;
        self.launch_combine(None, tokens, phase::SEND)?;
        self.stage = Stage::CombineSent(tokens);
        Ok(())
    }

    /// The combine's receive hook: waits for this rank's results and writes `out` (`T` rows
    /// of `hidden` bf16) as the weighted sums with `topk_weights` (`f32`, `T * top_k`).
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # use ferrolink::moe::{MoeConfig, bf16};
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// let cfg = MoeConfig { num_experts: 4, hidden: 8, top_k: 2, max_tokens: 1, capacity: None };
    /// let outs = run_ranks(&comms, |c| {
    ///     let mut ll = c.moe_low_latency(cfg)?;
    ///     let dev = c.device();
    ///     let (w, mut out) = (dev.alloc_from(&[1f32, 1.0])?, dev.alloc::<bf16>(8)?);
    ///     ll.dispatch(&dev.alloc_from(&[bf16::from_f32(3.0); 8])?, &dev.alloc_from(&[0i32, 3])?)?;
    ///     // Nothing to receive before combine_send.
    ///     assert!(ll.combine_recv(&w, &mut out).is_err());
    ///     ll.combine_send(None)?;
    ///     ll.combine_recv(&w, &mut out)?;
    ///     out.to_vec()
    /// })?;
    /// assert_eq!(outs[1][0].to_f32(), 6.0);
    /// # Ok(()) }
    /// ```
    pub fn combine_recv(&mut self, topk_weights: &DeviceBuffer<f32>, out: &mut DeviceBuffer<bf16>) -> Result<()> {
        let Stage::CombineSent(tokens) = self.stage else {
            return Err(self.out_of_order("combine_recv", "after combine_send"));
        };
        self.launch_combine(Some((topk_weights, out)), tokens, phase::RECV)?;
        self.stage = Stage::Idle;
        Ok(())
    }

    fn parity(&self) -> usize {
        (self.epoch % 2) as usize
    }

    /// Bytes of one of the two receive buffers.
    fn half_bytes(&self) -> usize {
        self.cfg.num_experts * self.cfg.max_tokens * 2 * self.cfg.hidden
    }

    fn out_of_order(&self, call: &str, when: &str) -> Error {
        Error::InvalidArgument(format!(
            "moe_low_latency {call}: only {when} (calls go dispatch_send, dispatch_recv, combine_send, \
             combine_recv, or dispatch then combine; this rank is at {:?})",
            self.stage
        ))
    }

    fn send_dispatch(&mut self, x: Tokens<'_>, topk_idx: &DeviceBuffer<i32>, ph: u32) -> Result<()> {
        let (hidden, k) = (self.cfg.hidden, self.cfg.top_k);
        if self.stage != Stage::Idle {
            return Err(self.out_of_order("dispatch", "after the last combine"));
        }
        let rows = x.shape(hidden, "moe_low_latency dispatch")?;
        let tokens = rows.tokens;
        if tokens > self.cfg.max_tokens {
            return Err(Error::InvalidArgument(format!(
                "moe_low_latency dispatch: {tokens} tokens, more than max_tokens {}",
                self.cfg.max_tokens
            )));
        }
        if topk_idx.len() != tokens * k {
            return Err(Error::InvalidArgument(format!(
                "moe_low_latency dispatch: topk_idx holds {} entries, {tokens} tokens x top_k {k} = {} needed",
                topk_idx.len(),
                tokens * k
            )));
        }
        self.epoch += 1;
        if let Err(e) = self.launch_dispatch(Some(SendRows { x, topk_idx, rows }), tokens, ph) {
            self.epoch -= 1;
            return Err(e);
        }
        self.stage = if ph == phase::BOTH { Stage::Received(tokens) } else { Stage::DispatchSent(tokens) };
        Ok(())
    }

    fn args(&self, tokens: usize, ph: u32) -> MoeLowLatencyArgs {
        MoeLowLatencyArgs {
            tokens: tokens as u32,
            top_k: self.cfg.top_k as u32,
            num_experts: self.cfg.num_experts as u32,
            max_tokens: self.cfg.max_tokens as u32,
            hidden: self.cfg.hidden as u32,
            phase: ph,
            // bf16 rows (a dispatch that sends sets its own).
            x_units: (self.cfg.hidden / 8) as u32,
            epoch: self.epoch,
            ..MoeLowLatencyArgs::default()
        }
    }

    /// Launches the dispatch kernel for phase `ph` of `tokens` tokens; `send`: the rows to
    /// send (every phase but the receive alone).
    fn launch_dispatch(&mut self, send: Option<SendRows<'_, '_>>, tokens: usize, ph: u32) -> Result<()> {
        super::not_recovered(&self.comm, self.recoveries, "moe_low_latency dispatch")?;
        let comm = self.comm.clone();
        let module = comm.device().builtin_module()?;
        let mut args = self.args(tokens, ph);
        let mut reads = Vec::new();
        let mut writes = Vec::new();
        if let Some(SendRows { x, topk_idx: idx, rows }) = send {
            (args.x_units, args.scale_units) = (rows.x_units, rows.scale_units);
            if tokens > 0 {
                (args.x, args.scales) = x.addresses(&mut reads)?;
                let idx = idx.bytes_at(0)?;
                args.topk_idx = idx.param() as u64;
                reads.push(idx);
                let ret = self.ret_index.bytes_at_mut(0)?;
                args.ret_index = ret.param() as u64;
                writes.push(ret);
            }
        }
        let counts = self.recv_counts.bytes_at_mut(0)?;
        args.recv_counts = counts.param() as u64;
        writes.push(counts);
        let state = self.state.bytes_at_mut(0)?;
        args.state = state.param() as u64;
        writes.push(state);
        let (threads, cap) = kernel_shape(&comm);
        // The receive alone is CTA 0's work; a send gets a CTA per token while there are
        // CTAs (its warps share the token's entries).
        let grid = if ph == phase::RECV { 1 } else { tokens.clamp(1, cap) };
        let tracked = TrackedArgs { args, reads: &reads, writes: &writes };
        let launch = (&self.handle, &self.send, &self.recv, &self.counts, &tracked);
        let cfg =
            LaunchConfig::linear(grid as u32, threads).with_shared_mem(ll::shared_bytes(self.cfg.num_experts) as u32);
        // SAFETY: `moe_ll_dispatch`'s contract: every rank launches it with the configuration
        // checked when this was made and this rank's tokens (checked against max_tokens),
        // the windows of this object (made together on every rank), `x`, `topk_idx`,
        // `ret_index`, `recv_counts` and the state sized for them and tracked; at most the
        // resident CTAs of this rank's share of the GPU; the signals are this object's only;
        // the epoch counts its dispatches and the halves go in order (checked by `stage`).
        unsafe { comm.stream().launch(module, &moe_ll_dispatch, cfg, launch) }
    }

    /// Copies the experts' results into this dispatch's receive buffer (when given).
    fn stage_results(&self, expert_out: Option<&DeviceBuffer<bf16>>) -> Result<()> {
        let Some(src) = expert_out else { return Ok(()) };
        let bytes = self.half_bytes();
        if src.len() * 2 != bytes {
            return Err(Error::InvalidArgument(format!(
                "moe_low_latency combine: expert_out holds {} elements, a receive buffer {} ({} x {} x {} x {})",
                src.len(),
                bytes / 2,
                self.experts_per_rank(),
                self.comm.nranks(),
                self.cfg.max_tokens,
                self.cfg.hidden
            )));
        }
        let cfg = staging_copy_config(self.comm.device(), bytes);
        let to = self.recv.slot_ptr(self.parity() * bytes, bytes)?;
        launch_copy(self.comm.stream(), &ferrolink_copy, to, src.bytes_at(0)?, bytes, cfg)
    }

    fn launch_combine(
        &mut self,
        sum: Option<(&DeviceBuffer<f32>, &mut DeviceBuffer<bf16>)>,
        tokens: usize,
        ph: u32,
    ) -> Result<()> {
        super::not_recovered(&self.comm, self.recoveries, "moe_low_latency combine")?;
        let (hidden, k) = (self.cfg.hidden, self.cfg.top_k);
        let comm = self.comm.clone();
        let module = comm.device().builtin_module()?;
        let mut args = self.args(tokens, ph);
        let mut reads = Vec::new();
        let mut writes = Vec::new();
        if let Some((weights, out)) = sum {
            if weights.len() != tokens * k || out.len() != tokens * hidden {
                return Err(Error::InvalidArgument(format!(
                    "moe_low_latency combine: the dispatch had {tokens} tokens: topk_weights must hold {} (it holds \
                     {}), out {} (it holds {})",
                    tokens * k,
                    weights.len(),
                    tokens * hidden,
                    out.len()
                )));
            }
            if tokens > 0 {
                let w = weights.bytes_at(0)?;
                args.topk_weights = w.param() as u64;
                reads.push(w);
                let r = self.ret_index.bytes_at(0)?;
                args.ret_index = r.param() as u64;
                reads.push(r);
                let o = out.bytes_at_mut(0)?;
                args.out = o.param() as u64;
                writes.push(o);
            }
        }
        let state = self.state.bytes_at(0)?;
        args.state = state.param() as u64;
        reads.push(state);
        let (threads, cap) = kernel_shape(&comm);
        let tracked = TrackedArgs { args, reads: &reads, writes: &writes };
        let launch = (&self.handle, &self.recv, &self.ret, &self.counts, &tracked);
        let cfg =
            LaunchConfig::linear(cap as u32, threads).with_shared_mem(ll::shared_bytes(self.cfg.num_experts) as u32);
        // SAFETY: `moe_ll_combine`'s contract: after this object's dispatch receive on this
        // stream (checked by `stage`), with its windows, the weights and the output sized
        // for its tokens (checked) and tracked, the experts' results in the receive buffer.
        unsafe { comm.stream().launch(module, &moe_ll_combine, cfg, launch) }
    }
}

/// What a dispatch that sends launches with: the tokens, their routing and their rows' shape
/// (checked).
struct SendRows<'t, 'i> {
    x: Tokens<'t>,
    topk_idx: &'i DeviceBuffer<i32>,
    rows: RowShape,
}
