//! Persistent mode: one long-lived kernel per GPU runs the collectives of the communicator's
//! ranks on it (NCCL-style persistent kernels; the book chapter's device-side work queue).
//!
//! [`Communicator::start_persistent`] (collective) launches, on a stream of its own, a kernel
//! of a few CTAs per rank (the last rank of a GPU to start launches it for all of the GPU's
//! ranks in its process; the grid is checked with the occupancy API to fit on the GPU at
//! once). From then on each collective call writes the rank's operation into the GPU group's
//! ring in host-mapped memory, and one stream hands it over: a copy of the ring slot into
//! the kernel's ring in device memory, then one `cuStreamBatchMemOp` with a write of its
//! sequence number into the kernel's sync block and a wait for its completion word (greater
//! or equal). With one rank per GPU that stream is the rank's own, and the rank posts at
//! once, with no meeting (`GpuGroup::hand_over_alone`); ranks
//! sharing a GPU meet on the host and the last of them posts, ordered after the others'
//! streams by events, which then wait for it by an event (see `coll::group` for why). No
//! kernel launch: the stream's later work (and the host, through the stream) sees the result
//! when the kernel has finished it. Staging copies for device buffers stay kernels on the
//! stream, as without persistent mode. [`Communicator::stop_persistent`] ends the kernel; an
//! abort of the communicator ends it too, and releases a stream waiting on it (its work then
//! reports the abort).
//!
//! Small calls run with the LL protocol here too when asked for
//! ([`Collective::proto`](super::Collective::proto), `FERROLINK_PROTO=ll`; the tuner keeps the
//! simple protocol here, which was as fast on an H200): the start makes each rank an LL buffer of
//! its own for the kernel (`ll::buffer_bytes(lsa_size)`, zeroed, with the kernel's device
//! communicator, whose barrier epochs are the flags), when the kernel has at most
//! `ll::MAX_CTAS` CTAs per rank.
//!
//! ```
//! # fn main() -> ferrolink::Result<()> {
//! use ferrolink::coll::ReduceOp;
//! use ferrolink::{Communicator, Device, run_ranks};
//! let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
//! let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
//! let sums = run_ranks(&comms, |c| {
//!     c.start_persistent(Default::default())?;
//!     let send = c.device().alloc_from(&[c.rank() as f32 + 1.0; 5])?;
//!     let mut recv = c.device().alloc::<f32>(5)?;
//!     c.all_reduce(&send, &mut recv, ReduceOp::Sum)?; // no launch: the kernel runs it
//!     let out = recv.to_vec()?;
//!     c.stop_persistent()?;
//!     Ok(out)
//! })?;
//! assert_eq!(sums[0], vec![3.0; 5]);
//! # Ok(()) }
//! ```

use super::group::{self, GpuGroup, Part, Purpose, Wait, Work};
use crate::comm::Communicator;
use crate::devcomm::{DevCommHandle, DevCommRequirements};
use crate::mem::window::Window;
use crate::runtime::launch::{LaunchArg, LaunchConfig, LaunchTracking};
use crate::runtime::lifetime::lock;
use crate::runtime::stream::Stream;
use crate::{Error, Result};
use ferrolink_device::coll::CollArgs;
use ferrolink_device::coll::group::{self as device_group, CollOp, GroupSync, MAX_LOCAL_RANKS, RankOp};
use ferrolink_device::coll::{ll, proto};
use ferrolink_device::kernels::coll::coll_gpu_group;
use std::sync::Arc;
use std::time::Duration;

/// CTAs of the persistent kernel by default (each a 256-thread CTA on an SM of its own).
///
/// ```
/// use ferrolink::coll::{DEFAULT_PERSISTENT_CTAS, MAX_CTAS, PersistentConfig};
/// assert!(DEFAULT_PERSISTENT_CTAS <= MAX_CTAS);
/// assert_eq!(PersistentConfig::default().ctas, None); // DEFAULT_PERSISTENT_CTAS, or fewer if the GPU holds fewer
/// ```
pub const DEFAULT_PERSISTENT_CTAS: u32 = 16;

/// How [`Communicator::start_persistent`] sets persistent mode up.
///
/// ```
/// # use ferrolink::coll::{PersistentConfig, ReduceOp};
/// # use ferrolink::{Communicator, Device, run_ranks};
/// # fn main() -> ferrolink::Result<()> {
/// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// let comms = Communicator::init_all(&[dev])?;
/// // A kernel of two CTAs with 1 MiB of staging each way; one of no CTAs is refused.
/// assert!(comms[0].start_persistent(PersistentConfig { ctas: Some(0), ..Default::default() }).is_err());
/// comms[0].start_persistent(PersistentConfig { ctas: Some(2), staging_bytes: 1 << 20 })?;
/// comms[0].stop_persistent()?;
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PersistentConfig {
    /// CTAs of the kernel (`None`: [`DEFAULT_PERSISTENT_CTAS`], at most the GPU's SMs over
    /// the ranks sharing it).
    pub ctas: Option<u32>,
    /// Bytes of staging (each of the collectives' send and receive windows) made at the
    /// start: while the kernel runs nothing can be allocated (an allocation may wait for the
    /// device to idle, which a persistent kernel never does), so calls from device buffers
    /// needing more are errors. Windows (zero copy) need none. (The LL buffer, made at the
    /// start too when `ctas` is at most `ll::MAX_CTAS`, is apart from it: see the [module
    /// docs](self).)
    pub staging_bytes: usize,
}

/// What persistent mode offers a collective call: the kernel's CTAs per rank and, while an
/// LL call may run, the kernel's LL buffer.
pub(crate) struct PersistentCall {
    /// CTAs per rank (parts of every operation).
    pub(crate) ctas: u32,
    /// This rank's LL buffer for the kernel, while LL calls may run (made at the start, and
    /// its flags, the kernel communicator's barrier epochs, far from their wrap).
    pub(crate) ll: Option<Window>,
}

impl Default for PersistentConfig {
    fn default() -> Self {
        PersistentConfig { ctas: None, staging_bytes: 16 << 20 }
    }
}

/// One rank's part of its GPU's persistent kernel.
pub(crate) struct PersistentState {
    ctas: u32,
    group: Arc<GpuGroup>,
    rank: usize,
    /// This rank's sync block (a window slot; the kernel uses part 0's, which the group
    /// keeps while the kernel runs).
    sync: Window,
    /// The kernel's stream, on the rank that launched it (kept: the kernel runs on it until
    /// every rank of the GPU has stopped).
    _kernel_stream: Option<Stream>,
    /// The rank's stream: a drop in persistent mode queues the shutdown there, after the
    /// rank's collectives.
    comm_stream: Stream,
    /// The kernel's device communicator for this rank (alive until stopped).
    handle: DevCommHandle,
    /// The kernel's LL buffer for this rank (zeroed when made; the kernel keeps it), if the
    /// kernel has few enough CTAs per rank for LL calls (`ll::MAX_CTAS`).
    ll: Option<Window>,
    /// An upper bound of the epochs of the kernel communicator's barriers (the LL flags),
    /// counted per operation; LL calls stop at its limit (nothing can be renewed while the kernel
    /// runs: simple-protocol calls then), far from the flags' wrap.
    ll_epochs: super::FlagEpochs,
    /// Whether the shutdown is queued (the drop must not queue another).
    stopped: bool,
}

impl Communicator {
    /// Starts persistent mode (collective: every rank calls it with the same `cfg`).
    /// Collectives then run in this GPU's persistent kernel, handed over by stream memory
    /// operations instead of launched. See the [module docs](self).
    ///
    /// ```
    /// # use ferrolink::coll::{PersistentConfig, ReduceOp};
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let comms = Communicator::init_all(&[dev.clone(), dev])?;
    /// let maxima = run_ranks(&comms, |c| {
    ///     c.start_persistent(PersistentConfig::default())?; // every rank, the same config
    ///     let mut buf = c.device().alloc_from(&[c.rank() as i64, 7 - c.rank() as i64])?;
    ///     c.all_reduce_in_place(&mut buf, ReduceOp::Max)?; // run by the kernel
    ///     let out = buf.to_vec()?;
    ///     c.stop_persistent()?;
    ///     Ok(out)
    /// })?;
    /// assert_eq!(maxima[1], [1, 7]);
    /// # Ok(()) }
    /// ```
    pub fn start_persistent(&self, cfg: PersistentConfig) -> Result<()> {
        let ctas = cfg.ctas;
        let n = self.nranks();
        if self.lsa_size() != n {
            return Err(Error::InvalidArgument(
                "start_persistent: persistent collectives need one LSA domain (as the collectives do)".into(),
            ));
        }
        let dev = self.device();
        let most = dev.resident_ctas(dev.launch_profile().waiting_ctas, self.ranks_sharing_gpu());
        let ctas = ctas.unwrap_or(DEFAULT_PERSISTENT_CTAS.min(most));
        if ctas == 0 || ctas > most.min(super::MAX_CTAS) {
            return Err(Error::InvalidArgument(format!(
                "start_persistent: {ctas} CTAs; between 1 and {} here (every CTA must stay resident beside \
                 the other ranks' on this GPU)",
                most.min(super::MAX_CTAS)
            )));
        }
        if self.is_persistent() {
            return Err(Error::InvalidArgument("start_persistent: already started".into()));
        }
        // Everything before the launch: the module, the collectives' resources, the ring,
        // the sync block (zeroed), the device communicator, the stream (making any of them
        // may wait for running kernels). The collectives' lock is taken (and released)
        // before this one's, in the order `collective` takes them: no deadlock between
        // threads of one rank.
        let step =
            |what: &str| tracing::debug!(target: "ferrolink::coll", rank = self.rank(), "start_persistent: {what}");
        let module = dev.builtin_module()?;
        step("module loaded");
        self.prepare_collectives(cfg.staging_bytes)?;
        // The kernel keeps the collectives' staging windows and device communicator too, so
        // that none is freed while it runs: a rank dropped in persistent mode frees its
        // resources before the GPU's last rank has queued the shutdown, and on the H200
        // freeing memory while the kernel ran blocked the driver (the test that drops
        // communicators in persistent mode hung until they were kept).
        let mut held = LaunchTracking::new(dev);
        let group = {
            let mut coll = lock(&self.shared.coll);
            let state = super::coll_state(self, &mut coll)?;
            for w in state.send.iter().chain(state.recv.iter()) {
                w.track(&mut held);
            }
            if let Some(h) = state.handle.as_ref() {
                h.track(&mut held);
            }
            state.group.clone()
        };
        group.prepare(dev)?;
        step("collectives' resources made");
        if !group.fits() {
            return Err(Error::InvalidArgument(format!(
                "start_persistent: {} ranks of this communicator share this GPU in this process; one persistent \
                 kernel serves at most {MAX_LOCAL_RANKS}",
                group.members.len()
            )));
        }
        let threads = super::threads(dev);
        let resident = module.resident_ctas(&coll_gpu_group, group::kernel_config(1, threads))?;
        group.check_resident(ctas, resident, "start_persistent")?;
        let mut guard = lock(&self.shared.persistent);
        if guard.is_some() {
            return Err(Error::InvalidArgument("start_persistent: already started".into()));
        }
        let size = std::mem::size_of::<GroupSync>();
        let sync = self.register_window(self.mem_alloc(size)?)?;
        sync.zero(0, size)?;
        let sync_addr = sync.slot_ptr::<*mut u8>(0, size)?.param() as u64;
        // The kernel's LL buffer, zeroed (`mem_alloc`), with a new device communicator: no
        // line carries a flag of its barriers yet (the buffer is this kernel's alone).
        let ll_buffer = if ctas as usize <= ll::MAX_CTAS {
            Some(self.register_window(self.mem_alloc(ll::buffer_bytes(self.lsa_size()))?)?)
        } else {
            None
        };
        let handle = self.create_dev_comm(&DevCommRequirements { lsa_barrier_count: ctas, ..Default::default() })?;
        step("sync block, LL buffer and device communicator made");
        let stream = dev.create_stream()?;
        self.barrier()?;
        // The kernel keeps every member's communicator and sync block, and the ring, until
        // it ends (keepers: the members' own streams use them meanwhile).
        (&handle).track(&mut held);
        (&sync).track(&mut held);
        if let Some(w) = &ll_buffer {
            w.track(&mut held);
        }
        let mut keep = LaunchTracking::new(dev);
        keep.keeps.extend(held.reads.into_iter().chain(held.writes).chain(held.holds).chain(held.keeps));
        let seq = group.next_seq(self.rank());
        let part = Part {
            rank: self.rank(),
            entry: None,
            comm_image: None,
            served: true,
            control: handle.dev_comm().control,
            sync: Some((sync.clone(), sync_addr)),
            ctas,
            uses: keep,
            stream: None,
            wait: None,
        };
        let kernel_stream = match group.meet(dev, Purpose::Persistent, seq, part)? {
            Some(g) => {
                let (ranks, mut uses, kernel_sync) = g.into_parts(dev);
                // The kernel runs until stopped: no emulator time limit.
                let cfg = LaunchConfig {
                    emulator_timeout: Some(Duration::from_secs(10 * 365 * 24 * 3600)),
                    ..group::kernel_config(ranks.count * ranks.ctas_per_rank, threads)
                };
                group.keep_ring(&mut uses);
                let param = group::GroupParam(&ranks);
                // SAFETY: the kernel's contract: the sync block (part 0's) is zeroed and
                // written only by the group's meetings; every operation's ring entries are
                // written before its sequence number (`GpuGroup::meet`), each with its rank's
                // live communicator (control blocks in `ranks`), unchanged until it completes;
                // the launch keeps the communicators, sync blocks and ring until the kernel
                // ends; every rank runs the same operations (collective calls) with the same
                // `ctas`; the communicators' barriers 0..ctas are the kernel's.
                let launched = unsafe { stream.launch_tracked(module, &coll_gpu_group, cfg, (&param, seq + 1), uses) };
                if let Err(e) = launched {
                    self.shared.control.abort(e.clone());
                    return Err(e);
                }
                *lock(&group.persistent_sync) = kernel_sync;
                tracing::debug!(target: "ferrolink::coll", rank = self.rank(), ctas, parts = ranks.count,
                    "persistent kernel launched");
                Some(stream)
            }
            None => None,
        };
        *guard = Some(PersistentState {
            ctas,
            group,
            rank: self.rank(),
            sync,
            _kernel_stream: kernel_stream,
            comm_stream: self.stream().share(),
            handle,
            ll: ll_buffer,
            ll_epochs: super::FlagEpochs::new(),
            stopped: false,
        });
        Ok(())
    }

    /// Whether persistent mode is on.
    ///
    /// ```
    /// # use ferrolink::coll::{PersistentConfig, ReduceOp};
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let comms = Communicator::init_all(&[dev])?;
    /// assert!(!comms[0].is_persistent());
    /// comms[0].start_persistent(PersistentConfig::default())?;
    /// assert!(comms[0].is_persistent());
    /// comms[0].stop_persistent()?;
    /// assert!(!comms[0].is_persistent());
    /// # Ok(()) }
    /// ```
    pub fn is_persistent(&self) -> bool {
        lock(&self.shared.persistent).is_some()
    }

    /// Ends persistent mode (collective): queues the shutdown on this rank's stream after its
    /// collectives, and waits until the kernel has ended.
    ///
    /// ```
    /// # use ferrolink::coll::{PersistentConfig, ReduceOp};
    /// # use ferrolink::{Communicator, Device, run_ranks};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let comms = Communicator::init_all(&[dev.clone(), dev])?;
    /// let sums = run_ranks(&comms, |c| {
    ///     c.start_persistent(PersistentConfig::default())?;
    ///     let mut buf = c.device().alloc_from(&[c.rank() as u32 + 1; 3])?;
    ///     c.all_reduce_in_place(&mut buf, ReduceOp::Sum)?;
    ///     c.stop_persistent()?; // after the all-reduce: the kernel has run it
    ///     assert!(c.stop_persistent().is_err()); // not on any more
    ///     buf.to_vec()
    /// })?;
    /// assert_eq!(sums[0], [3; 3]);
    /// # Ok(()) }
    /// ```
    pub fn stop_persistent(&self) -> Result<()> {
        let state = lock(&self.shared.persistent).take();
        let Some(mut state) = state else {
            return Err(Error::InvalidArgument("stop_persistent: persistent mode is not on".into()));
        };
        let queued = post(Some(self), &state, shutdown(&state.handle), LaunchTracking::new(self.device()));
        // Queued or not, the drop must not queue another shutdown.
        state.stopped = true;
        queued?;
        self.stream().synchronize()?;
        if state.group.part_of(self.rank()) == 0 {
            log_kernel_times(&state.sync);
        }
        Ok(())
    }

    /// Queues `op` (tracked by `uses`) for the persistent kernel, if persistent mode is on:
    /// `Ok(false)` if it is not.
    pub(crate) fn enqueue_persistent(&self, op: CollOp, uses: LaunchTracking) -> Result<bool> {
        let mut guard = lock(&self.shared.persistent);
        let Some(state) = guard.as_mut() else { return Ok(false) };
        if self.stream().is_capturing() {
            return Err(Error::InvalidArgument(
                "a collective in persistent mode cannot be captured into a graph: its sequence number is \
                 counted on the host, so a replay would not match the kernel's (stop_persistent first)"
                    .into(),
            ));
        }
        // Counted before the post, as `persistent_call` read it: an LL operation past the
        // bound could meet a stale line carrying its flag.
        let ll = op.args.proto == proto::LL;
        if ll && (state.ll.is_none() || !state.ll_epochs.ll_fits()) {
            return Err(Error::InvalidArgument(
                "persistent mode: an LL call without the kernel's LL buffer or past its flags' bound".into(),
            ));
        }
        state.ll_epochs.count(ll);
        post(Some(self), state, RankOp { op, comm: state.handle.dev_comm() }, uses)?;
        Ok(true)
    }

    /// What persistent mode offers the next collective call, if on.
    pub(crate) fn persistent_call(&self) -> Option<PersistentCall> {
        lock(&self.shared.persistent)
            .as_ref()
            .map(|s| PersistentCall { ctas: s.ctas, ll: s.ll.clone().filter(|_| s.ll_epochs.ll_fits()) })
    }

    /// [`Communicator::recover`]'s step for persistent mode: the kernel communicator's
    /// barrier epochs (the LL flags) start again from 0, so its LL buffer is zeroed (no kernel
    /// runs now: the caller drained this rank's stream, and no rank calls before the next
    /// barrier).
    pub(crate) fn persistent_after_recover(&self) -> Result<()> {
        if let Some(state) = lock(&self.shared.persistent).as_mut() {
            if let Some(w) = &state.ll {
                w.zero(0, w.size())?;
            }
            state.ll_epochs.counted = 0;
        }
        Ok(())
    }
}

/// Logs where the persistent kernel's CTA 0 spent its time (the sync block's sums, read
/// after the kernel ended): waiting for operations, reading them from the ring, running them.
fn log_kernel_times(sync: &Window) {
    let words = std::mem::size_of::<GroupSync>() / 8;
    let Ok(w) = sync.read::<u64>(0, words) else { return };
    let s: GroupSync = bytemuck::pod_read_unaligned(bytemuck::cast_slice(&w));
    if s.ops == 0 {
        return;
    }
    let mean = |ns: u64| ns as f64 / s.ops as f64 / 1e3;
    tracing::info!(target: "ferrolink::coll", ops = s.ops,
        "persistent kernel, CTA 0, µs per operation: waiting {:.2}, reading the ring {:.2}, running {:.2}",
        mean(s.waiting_ns), mean(s.reading_ns), mean(s.running_ns));
}

/// The shutdown entry of a rank whose kernel communicator is `handle`.
fn shutdown(handle: &DevCommHandle) -> RankOp {
    let args = CollArgs { kind: device_group::SHUTDOWN, ..CollArgs::default() };
    RankOp { op: CollOp { args, ..CollOp::default() }, comm: handle.dev_comm() }
}

/// Hands `entry` to the persistent kernel as this rank's part of its next operation (a rank
/// alone on its GPU posts at once; else the group's meeting, whose last member posts). With `comm`, the rank's stream waits for the
/// operation (and the call for the other members); without (a drop), nothing waits.
fn post(comm: Option<&Communicator>, state: &PersistentState, entry: RankOp, uses: LaunchTracking) -> Result<()> {
    let group = &state.group;
    let seq = group.next_seq(state.rank);
    let running_sync = || {
        lock(&group.persistent_sync)
            .clone()
            .ok_or_else(|| Error::InvalidArgument("persistent mode: the GPU's persistent kernel is not running".into()))
    };
    // A rank alone on its GPU (one process per GPU) has nobody to meet: it hands its
    // operation over itself (through the meeting, such a call took 9-13 µs of host time
    // where the hand-over's driver calls take about 4: PERF.md calls 19 and 21). Its stream
    // trails the kernel, as below.
    let posted = if comm.is_some() && group.members.len() == 1 {
        group.hand_over_alone(&state.comm_stream, seq, &entry, uses, running_sync())?;
        true
    } else {
        meet_and_post(comm, state, seq, entry, uses, running_sync)?
    };
    if posted && entry.op.args.kind == device_group::SHUTDOWN {
        *lock(&group.persistent_sync) = None;
    }
    tracing::trace!(target: "ferrolink::coll", rank = state.rank, seq, kind = entry.op.args.kind, "posted to the persistent kernel");
    Ok(())
}

/// [`post`] through the group's meeting: ranks sharing a GPU, or a drop's shutdown (which
/// nothing waits for); whether this member posted (the last to arrive).
fn meet_and_post(
    comm: Option<&Communicator>,
    state: &PersistentState,
    seq: u64,
    entry: RankOp,
    uses: LaunchTracking,
    running_sync: impl Fn() -> Result<(Window, u64)>,
) -> Result<bool> {
    let group = &state.group;
    let part = Part {
        rank: state.rank,
        entry: Some(entry),
        comm_image: None,
        served: true,
        control: entry.comm.control,
        sync: None,
        ctas: state.ctas,
        uses,
        stream: Some(&state.comm_stream),
        wait: comm,
    };
    let Some(g) = group.meet(state.comm_stream.device(), Purpose::Handover, seq, part)? else { return Ok(false) };
    let sync = running_sync()?;
    // Ranks sharing a GPU wait in the post, which their streams wait for.
    let wait = if comm.is_some() { Wait::Now } else { Wait::Never };
    group.run(g, &state.comm_stream, true, seq, Work::Persistent { sync, wait })?;
    Ok(true)
}

impl Drop for PersistentState {
    fn drop(&mut self) {
        // Stopped already, or dropped in persistent mode: then queue the shutdown on the
        // rank's stream, after its collectives; nothing waits for it.
        if self.stopped {
            return;
        }
        tracing::debug!(target: "ferrolink::coll", rank = self.rank, "dropped in persistent mode: queuing the shutdown");
        if let Err(e) = post(None, self, shutdown(&self.handle), LaunchTracking::new(self.comm_stream.device())) {
            tracing::warn!(target: "ferrolink::coll", error = %e, "could not stop the persistent kernel");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coll::{CollKind, Collective, Input, Output};
    use crate::run_ranks;
    use crate::testing::for_each_backend;

    /// Epochs counted for the persistent kernel's communicator so far (see
    /// [`PersistentState::ll_epochs`]).
    fn counted(c: &Communicator) -> u64 {
        lock(&c.shared.persistent).as_ref().map_or(0, |s| s.ll_epochs.counted)
    }

    /// Persistent mode runs LL calls in the kernel's own LL buffer: chains of in-place
    /// all-reduces, each reading the previous one's output, LL and simple in turn, at one and
    /// at four LL CTAs (16 KiB), each checked; the epochs counted say which protocol ran (one
    /// per LL call, two per simple one). Near the (lowered) bound of the flags forced LL calls
    /// run simple; with two CTAs per rank a call needing four runs simple; after the stop, LL
    /// calls launch again on the communicator's own buffer.
    #[test]
    fn persistent_mode_runs_ll_calls_in_its_own_buffer() {
        for_each_backend("persistent_mode_runs_ll_calls_in_its_own_buffer", |dev| {
            for n in [2usize, 3] {
                let comms = Communicator::init_all(&vec![dev.clone(); n])?;
                let steps = run_ranks(&comms, |c| {
                    let me = c.rank();
                    // Element j of rank r starts at r + 1 + j % 7; every call sums the ranks.
                    let chain = |count: usize, protos: &[u32]| -> Result<Vec<u64>> {
                        let first: Vec<f32> = (0..count).map(|j| (me + 1 + j % 7) as f32).collect();
                        let mut expect: Vec<f32> = (0..count).map(|j| (n * (n + 1) / 2 + n * (j % 7)) as f32).collect();
                        let mut buf = c.device().alloc_from(&first)?;
                        let mut steps = Vec::new();
                        for (i, &p) in protos.iter().enumerate() {
                            let coll = Collective { proto: Some(p), ..Collective::new(CollKind::AllReduce, count) };
                            let before = counted(c);
                            c.collective(&coll, Input::InPlace, Output::Buffer(&mut buf))?;
                            assert_eq!(buf.to_vec()?, expect, "rank {me}, call {i} of {count} elements ({n} ranks)");
                            steps.push(counted(c) - before);
                            expect.iter_mut().for_each(|v| *v *= n as f32);
                        }
                        Ok(steps)
                    };
                    let (ll, simple) = (proto::LL, proto::SIMPLE);
                    c.start_persistent(PersistentConfig::default())?;
                    let mut steps = chain(1029, &[ll, ll, simple, ll, ll, simple, ll])?;
                    steps.extend(chain(4096, &[ll, simple, ll, ll])?);
                    // Two LL calls left below the bound, then the simple protocol.
                    let limit = counted(c) + 3;
                    lock(&c.shared.persistent).as_mut().expect("persistent").ll_epochs.limit = limit;
                    steps.extend(chain(300, &[ll, ll, ll, ll])?);
                    c.stop_persistent()?;
                    c.start_persistent(PersistentConfig { ctas: Some(2), ..Default::default() })?;
                    steps.extend(chain(4096, &[ll, ll])?);
                    steps.extend(chain(1029, &[ll, ll])?);
                    c.stop_persistent()?;
                    // Launched again: the communicator's own LL buffer (none made before).
                    let own = |c: &Communicator| lock(&c.shared.coll).as_ref().map_or(0, |s| s.ll_made.len());
                    assert_eq!(own(c), 0, "persistent LL calls use the kernel's buffer");
                    chain(300, &[ll, simple, ll])?;
                    assert_eq!(own(c), 1, "launched LL calls make the communicator's buffer");
                    Ok(steps)
                })?;
                let expected = vec![1, 1, 2, 1, 1, 2, 1, 1, 2, 1, 1, 1, 1, 2, 2, 2, 2, 1, 1];
                for (r, s) in steps.iter().enumerate() {
                    assert_eq!(s, &expected, "rank {r} of {n}: epochs per call (1: LL, 2: simple)");
                }
            }
            Ok(())
        });
    }
}
