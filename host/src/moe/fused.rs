//! The fused combine: the experts' kernels add their weighted results straight into the
//! tokens' ranks (`ferrolink_device::moe::fused`: the protocol and its ordering).
//!
//! Per step, on every rank: [`Moe::dispatch_with_sources`] (the rows and, per row, where it
//! came from and its weight); the caller's expert kernel with [`Moe::fused_target`] and
//! [`Moe::dev_comm`] as arguments, which computes each received row and adds `weight * y`
//! into the token's accumulator on its rank (`FusedCombineArgs::add`, `row_added`); then
//! [`Moe::finish_fused`], which waits for every add of this rank's tokens and writes `out`.
//! Set up once with [`Moe::enable_fused`]. examples/11_moe_fused.rs is a whole program.

use super::{Moe, TrackedArgs, bf16, kernel_shape, new_window};
use crate::devcomm::DevCommHandle;
use crate::mem::window::Window;
use crate::runtime::launch::{LaunchArg, LaunchConfig, LaunchTracking};
use crate::runtime::memory::{DeviceBuffer, TrackedPtr};
use crate::{Error, Result};
use ferrolink_device::kernels::moe::moe_fused_finish;
use ferrolink_device::moe::fused::FusedCombineArgs;
use std::sync::atomic::Ordering;

/// What the caller's expert kernel gets for the fused combine of one call (a launch argument:
/// the kernel parameter `FusedCombineArgs`, with the windows and counts it names tracked).
/// Made by [`Moe::fused_target`].
///
/// ```
/// # fn main() -> ferrolink::Result<()> {
/// # use ferrolink::moe::{MoeConfig, bf16};
/// # use ferrolink::{Communicator, Device, LaunchConfig, run_ranks};
/// use ferrolink_device::kernels::moe::moe_expert_mlp_fused;
/// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
/// let cfg = MoeConfig { num_experts: 2, hidden: 8, top_k: 1, max_tokens: 1, capacity: None };
/// let outs = run_ranks(&comms, |c| {
///     let mut moe = c.moe(cfg)?;
///     moe.enable_fused()?;
///     let dev = c.device();
///     // Rank r's token (all 1) goes to expert r with weight 0.25.
///     let x = dev.alloc_from(&[bf16::ONE; 8])?;
///     let (idx, w) = (dev.alloc_from(&[c.rank() as i32])?, dev.alloc_from(&[0.25f32])?);
///     moe.dispatch_with_sources(&x, &idx, &w)?;
///     let target = moe.fused_target()?;
///     // One target per call: the expert launch takes it by value.
///     assert!(moe.fused_target().is_err());
///     // y = W2 relu(W1 x) with one hidden unit and every weight 1: 8 in every channel.
///     let ones = dev.alloc_from(&[1f32; 8])?;
///     let launch = LaunchConfig::linear(1, 32).with_shared_mem(4);
///     // SAFETY: the kernel's contract: this call's target and the Moe's device communicator,
///     // the weights of one local expert of 1 x 8 (tracked), a warp with 4 bytes of shared memory.
///     unsafe {
///         let args = (moe.dev_comm(), target, &ones, &ones, 1u32);
///         c.stream().launch(dev.builtin_module()?, &moe_expert_mlp_fused, launch, args)?;
///     }
///     let mut out = dev.alloc::<bf16>(8)?;
///     moe.finish_fused(&mut out)?;
///     out.to_vec()
/// })?;
/// assert!(outs.iter().flatten().all(|v| v.to_f32() == 2.0));
/// # Ok(()) }
/// ```
pub struct FusedTarget<'a> {
    args: FusedCombineArgs,
    recv: &'a Window,
    acc: &'a Window,
    returns: Option<&'a FusedReturns>,
    counts: TrackedPtr<'a, *const u8>,
}

/// The fused combine's windows for results that cross LSA domains (made by
/// [`Moe::enable_fused`] when some rank is not reached directly).
pub(super) struct FusedReturns {
    /// `f32 [max_tokens * top_k][hidden]`: results put back into this rank, a row per entry.
    ret: Window,
    /// `f32 [(nranks - direct) * max_tokens * top_k][hidden]`: this rank's results for
    /// tokens of ranks not reached directly, a row per (rank, token, k), put from here.
    stage: Window,
}

impl crate::runtime::launch::sealed::Sealed for FusedTarget<'_> {}

/// Passed by value: a launch takes the target, so the one expert launch of a call cannot be
/// repeated with it (each row would be added twice).
impl LaunchArg for FusedTarget<'_> {
    type Param = FusedCombineArgs;
    fn param(&self) -> FusedCombineArgs {
        self.args
    }
    fn track(&self, t: &mut LaunchTracking) {
        self.recv.track(t);
        self.acc.track(t);
        if let Some(r) = self.returns {
            (&r.ret).track(t);
            (&r.stage).track(t);
        }
        self.counts.track(t);
    }
}

impl Moe {
    /// Makes the fused combine's accumulators, `f32 [max_tokens][hidden]` per rank
    /// (collective, once; host set-up: call it before the first dispatch, as other
    /// allocations). When some rank is not reached directly (another LSA domain, or
    /// `FERROLINK_GIN=proxy`), also the windows its results travel through: return rows of
    /// `f32 [max_tokens * top_k][hidden]` per rank, and staging rows of `f32 [(nranks -
    /// direct ranks) * max_tokens * top_k][hidden]` (every entry of every such rank may name
    /// an expert here). Results inside the domain are added in place and need neither.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # use ferrolink::moe::{MoeConfig, bf16};
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// let cfg = MoeConfig { num_experts: 2, hidden: 8, top_k: 1, max_tokens: 1, capacity: None };
    /// let refused = run_ranks(&comms, |c| {
    ///     let mut moe = c.moe(cfg)?;
    ///     moe.enable_fused()?;
    ///     // Once is enough: again, it does nothing.
    ///     moe.enable_fused()?;
    ///     let dev = c.device();
    ///     moe.dispatch(&dev.alloc::<bf16>(8)?, &dev.alloc_from(&[0i32])?)?;
    ///     // Not while a dispatch waits for its combine.
    ///     let refused = moe.enable_fused().is_err();
    ///     moe.combine(None, &dev.alloc::<f32>(1)?, &mut dev.alloc::<bf16>(8)?)?;
    ///     Ok(refused)
    /// })?;
    /// assert_eq!(refused, [true, true]);
    /// # Ok(()) }
    /// ```
    pub fn enable_fused(&mut self) -> Result<()> {
        if self.pending.is_some() {
            return Err(Error::InvalidArgument(
                "moe enable_fused: a dispatch is waiting for its combine: call enable_fused after the combine (or finish_fused)".into(),
            ));
        }
        if self.acc.is_some() {
            return Ok(());
        }
        let (n, cfg) = (self.comm.nranks(), self.cfg);
        let direct = self.direct_ranks();
        let acc = new_window(&self.comm, cfg.max_tokens * cfg.hidden * 4)?;
        if direct.len() < n {
            let entries = cfg.max_tokens * cfg.top_k;
            let ret = new_window(&self.comm, entries * cfg.hidden * 4)?;
            let stage = new_window(&self.comm, (n - direct.len()) * entries * cfg.hidden * 4)?;
            self.fused_returns = Some(FusedReturns { ret, stage });
        }
        self.acc = Some(acc);
        Ok(())
    }

    /// The world ranks this rank reaches directly (GIN's rule: its LSA domain, none when
    /// every peer goes through the proxy).
    fn direct_ranks(&self) -> std::ops::Range<usize> {
        let (rank, lsa) = (self.comm.rank(), self.comm.lsa_size());
        let first = rank - rank % lsa;
        if self.handle.uses_proxy() { first..first } else { first..first + lsa }
    }

    /// The device communicator of this `Moe`'s kernels: the expert kernel of the fused
    /// combine takes it beside [`Moe::fused_target`] (it raises the `FUSED` signal on it).
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # use ferrolink::moe::MoeConfig;
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// # let cfg = MoeConfig { num_experts: 2, hidden: 8, top_k: 1, max_tokens: 1, capacity: None };
    /// let moes = run_ranks(&comms, |c| c.moe(cfg))?;
    /// assert_eq!(moes[1].dev_comm().rank(), 1);
    /// # Ok(()) }
    /// ```
    pub fn dev_comm(&self) -> &DevCommHandle {
        &self.handle
    }

    /// The argument of the caller's expert kernel for the fused combine of the last dispatch
    /// (which must have been [`Moe::dispatch_with_sources`], after [`Moe::enable_fused`]).
    /// Once per call, for the call's one expert launch (which takes the target by value):
    /// the kernel must report every received row once (`FusedCombineArgs::row_added`), or
    /// the token ranks' [`Moe::finish_fused`] times out. The call then ends with
    /// [`Moe::finish_fused`] ([`Moe::combine`] is refused: the adds go to the tokens' ranks).
    /// Every rank must take the same path in a call (the fused finish or the plain
    /// combine); this is not checked, and a rank whose rows were added by a peer's expert
    /// while it ran the plain combine is left with adds its later finishes count.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// use ferrolink::moe::{MoeConfig, bf16};
    /// use ferrolink::{Communicator, Device, LaunchConfig, run_ranks};
    /// use ferrolink_device::kernels::moe::moe_expert_mlp_fused;
    /// let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// let cfg = MoeConfig { num_experts: 2, hidden: 8, top_k: 1, max_tokens: 2, capacity: None };
    /// let outs = run_ranks(&comms, |c| {
    ///     let mut moe = c.moe(cfg)?;
    ///     moe.enable_fused()?;
    ///     let dev = c.device();
    ///     // Both tokens of each rank go to expert 1 (on rank 1) with weight 0.5.
    ///     let x = dev.alloc_from(&[bf16::from_f32(2.0); 16])?;
    ///     let (idx, w) = (dev.alloc_from(&[1i32, 1])?, dev.alloc_from(&[0.5f32; 2])?);
    ///     moe.dispatch_with_sources(&x, &idx, &w)?;
    ///     // The expert: y = W2 relu(W1 x), one hidden unit, W1 all 1 and W2 all 1 (x 8: 16).
    ///     let ones = dev.alloc_from(&[1f32; 8])?;
    ///     let target = moe.fused_target()?;
    ///     let cfg = LaunchConfig::linear(1, 32).with_shared_mem(4);
    ///     // SAFETY: the kernel's contract: the target and device communicator of this call,
    ///     // the weights of one expert of 1 x 8 (tracked).
    ///     unsafe {
    ///         let module = dev.builtin_module()?;
    ///         c.stream().launch(module, &moe_expert_mlp_fused, cfg, (moe.dev_comm(), target, &ones, &ones, 1u32))?;
    ///     }
    ///     let mut out = dev.alloc::<bf16>(16)?;
    ///     moe.finish_fused(&mut out)?;
    ///     c.synchronize()?;
    ///     out.to_vec()
    /// })?;
    /// // 0.5 * 16 for every element of every token.
    /// assert!(outs.iter().flatten().all(|v| v.to_f32() == 8.0));
    /// # Ok(()) }
    /// ```
    pub fn fused_target(&self) -> Result<FusedTarget<'_>> {
        let acc = self.fused_ready("fused_target")?;
        if self.expert_launched.swap(true, Ordering::Relaxed) {
            return Err(Error::InvalidArgument(
                "moe fused_target: already given for this dispatch (one expert launch per call, which reports \
                 every row once)"
                    .into(),
            ));
        }
        let direct = self.direct_ranks();
        let returns = self.fused_returns.as_ref();
        let args = FusedCombineArgs {
            recv: (&self.recv).param(),
            acc: acc.param(),
            ret: returns.map(|r| (&r.ret).param()).unwrap_or_default(),
            stage: returns.map(|r| (&r.stage).param()).unwrap_or_default(),
            recv_counts: 0,
            experts_per_rank: self.experts_per_rank() as u32,
            capacity: self.capacity as u32,
            hidden: self.cfg.hidden as u32,
            top_k: self.cfg.top_k as u32,
            max_tokens: self.cfg.max_tokens as u32,
            domain_first: direct.start as u32,
            domain_size: direct.len() as u32,
            _reserved: 0,
        };
        let counts = self.recv_counts.bytes_at(0)?;
        Ok(FusedTarget {
            args: FusedCombineArgs { recv_counts: counts.param() as u64, ..args },
            recv: &self.recv,
            acc,
            returns,
            counts,
        })
    }

    /// Ends the fused combine of the last dispatch (collective, after the expert kernel on
    /// this rank's stream): waits, on the stream, until every entry of this rank's tokens was
    /// added by its expert, then writes `out` (`T` rows of `hidden` bf16, `T` of the last
    /// dispatch): each token's sum of `weight * y` over its kept entries, accumulated in
    /// `f32` in arrival order and rounded once. Dropped entries and `-1` add nothing. A wait
    /// that cannot finish (an expert kernel that skipped rows) is a timeout naming the signal.
    /// Needs [`Moe::fused_target`] taken for this dispatch (for the expert kernel).
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # use ferrolink::moe::{MoeConfig, bf16};
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// let cfg = MoeConfig { num_experts: 2, hidden: 8, top_k: 1, max_tokens: 1, capacity: None };
    /// let outs = run_ranks(&comms, |c| {
    ///     let mut moe = c.moe(cfg)?;
    ///     moe.enable_fused()?;
    ///     let dev = c.device();
    ///     let x = dev.alloc_from(&[bf16::from_f32(3.0); 8])?;
    ///     let (idx, w) = (dev.alloc_from(&[1i32])?, dev.alloc_from(&[0.5f32])?);
    ///     moe.dispatch_with_sources(&x, &idx, &w)?;
    ///     // No expert kernel took fused_target() for this dispatch: nothing to wait for.
    ///     let mut out = dev.alloc::<bf16>(8)?;
    ///     assert!(moe.finish_fused(&mut out).is_err());
    ///     // The call ends with the plain combine instead (the identity experts: 0.5 x 3).
    ///     moe.combine(None, &w, &mut out)?;
    ///     out.to_vec()
    /// })?;
    /// assert_eq!(outs[0][0].to_f32(), 1.5);
    /// # Ok(()) }
    /// ```
    pub fn finish_fused(&mut self, out: &mut DeviceBuffer<bf16>) -> Result<()> {
        let acc = self.fused_ready("finish_fused")?.clone();
        if !*self.expert_launched.get_mut() {
            return Err(Error::InvalidArgument(
                "moe finish_fused: no expert kernel for this dispatch: launch one with fused_target() first (every \
                 rank's, as the other ranks' tokens wait for its adds)"
                    .into(),
            ));
        }
        let tokens = self.pending.expect("checked by fused_ready");
        let hidden = self.cfg.hidden;
        if out.len() != tokens * hidden {
            return Err(Error::InvalidArgument(format!(
                "moe finish_fused: the last dispatch had {tokens} tokens: out must hold {} (it holds {})",
                tokens * hidden,
                out.len()
            )));
        }
        let comm = self.comm.clone();
        let dev = comm.device();
        let module = dev.builtin_module()?;
        let mut args = self.result_args(tokens);
        // The kernel reads the dispatch's target and writes `fused_done` into the state.
        let state = self.state.bytes_at_mut(0)?;
        args.state = state.param() as u64;
        let mut writes = vec![state];
        if tokens > 0 {
            let o = out.bytes_at_mut(0)?;
            args.out = o.param() as u64;
            writes.push(o);
        }
        // The places of the dispatch's entries: which results came back as return rows.
        let places = self.ret_index.bytes_at(0)?;
        args.ret_index = places.param() as u64;
        let reads = [places];
        let tracked = TrackedArgs { args, reads: &reads, writes: &writes };
        // Without return rows (every rank reached directly) the kernel reads none: it is
        // given the accumulators in their place.
        let ret = self.fused_returns.as_ref().map_or(&acc, |r| &r.ret);
        let (threads, ctas) = kernel_shape(&comm);
        let cfg = LaunchConfig::linear(ctas as u32, threads);
        // SAFETY: `moe_fused_finish`'s contract: after this Moe's dispatch given the weights
        // on this stream (checked: pending with sources), the one expert kernel queued by
        // the caller before it (its argument was taken once: checked); `out` holds the
        // dispatch's tokens (checked); the state (written: `fused_done`), the places, `acc`
        // and the return rows (made whenever some rank is not reached directly) are this
        // Moe's; all tracked.
        unsafe { comm.stream().launch(module, &moe_fused_finish, cfg, (&self.handle, &acc, ret, &tracked))? };
        tracing::debug!(target: "ferrolink::moe", rank = comm.rank(), epoch = self.epoch, tokens, "fused finish queued");
        self.pending = None;
        *self.expert_launched.get_mut() = false;
        Ok(())
    }

    /// The accumulators, if the last dispatch may be finished by the fused combine.
    fn fused_ready(&self, what: &str) -> Result<&Window> {
        super::not_recovered(&self.comm, self.recoveries, &format!("moe {what}"))?;
        let Some(acc) = &self.acc else {
            return Err(Error::InvalidArgument(format!("moe {what}: call enable_fused first (collective, once)")));
        };
        if self.pending.is_none() {
            return Err(Error::InvalidArgument(format!(
                "moe {what}: no dispatch is waiting (call dispatch_with_sources)"
            )));
        }
        if !self.pending_sources {
            return Err(Error::InvalidArgument(format!(
                "moe {what}: the last dispatch was a plain dispatch: use dispatch_with_sources (the experts need each \
                 row's source and weight), or end this call with combine"
            )));
        }
        Ok(acc)
    }
}
