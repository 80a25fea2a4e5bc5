//! GPU groups: the ranks of one communicator that share a GPU in this process run their
//! collectives in one kernel (`ferrolink_device::kernels::coll::coll_gpu_group_launch`, or
//! the persistent `coll_gpu_group`; device side at `ferrolink_device::coll::group`).
//!
//! Each member's call brings its operation and device communicator (its *entry*) to the
//! call's *meeting*: for a shared launch the entries travel in the launch's parameter (no
//! CTA reads host memory: one read of host memory from an SM took about 18 µs on the H200);
//! for the persistent kernel each member writes its entry into the group's ring slot for
//! the call (host-mapped memory: no stream work to hand it over). Each member marks its
//! *arrival* on its stream (after its earlier work, such as staging copies: an event). The
//! last to arrive makes the stream doing the work wait for the arrivals, then either
//! launches the kernel for every member (one launch for the GPU instead of one per rank) or,
//! in persistent mode, hands the operation to the running kernel with a copy of the ring
//! slot, a stream write of its sequence number and a stream wait for its completion word; it
//! publishes the completion of that work, and every member's stream *follows* it
//! (`Stream::follow`).
//!
//! # The launcher
//! A shared launch is queued by the group's *launcher thread* ([`Launcher`]), not by a
//! member: the last member to arrive hands the complete meeting over and returns as the
//! others do, so the members' own work is off the path of the launches
//! (`FERROLINK_GROUP_LAUNCHER=last` makes the last member launch in its call instead, as
//! the persistent kernel's hand-overs always are). Calls that queue up for the launcher run
//! in one launch, one after the other.
//!
//! # Members return before the shared launch
//! A shared launch goes on the group's own *launch stream*, so every member knows where its
//! call's launch will go before it is queued. A member returns at once:
//! it records a [`PendingLaunch`] completion, under the launch stream's id, into everything
//! its part uses (before it returns, so nothing it uses is freed before the launch that
//! uses it), and its stream follows it. That completion is pending until the last member has
//! queued the launch, then stands for the launch's event; a stream that waits for it (the
//! member's next other work, or another stream using the same memory) or a host wait first
//! waits on the host for the launch to be queued. The members' next calls arrive with it and
//! the launch stream already follows it: in a loop of collectives the host makes one launch
//! per call and no event calls, and no member waits for another's launch. Errors of the
//! launch surface as the communicator's asynchronous error (it is aborted), at the members'
//! `synchronize`, as NCCL reports a failed group call. On the H200, 8 ranks whose members
//! waited on the host for the launch spent about 31 µs per call waiting (2026-12-03).
//!
//! A member that waits (a hand-over to the persistent kernel) or one whose pending
//! completion is waited for gives the work up on the communicator's timeout (an error naming
//! the ranks that did not come, which aborts the communicator) or on an abort, but only while
//! the last member has not taken it: [`Outcome`] decides under one mutex whether the work runs
//! with every member's part or never runs, so a given-up launch's memory may go.
//!
//! The work stream of a hand-over is part 0's stream when part 0 waits for the work, so that
//! consecutive calls use one stream; following is lazy (a stream queues the event wait only
//! before other work), and a member whose stream queued nothing since the last call arrives
//! with that call's completion (no new event). With an event recorded and waited for per
//! member, 8 ranks on the H200 spent about 70 µs of driver calls per collective.
//!
//! Why events and a meeting on the host: every dependency between the members' streams is
//! then one that CUDA's scheduler knows. A stream that waits on a memory value for work that
//! another stream has still to reach may deadlock when the two share a hardware queue. On
//! the H200 (2026-12-01), ranks posting a write and a value wait each on their own stream, or
//! launching a kernel each, hung with `CUDA_DEVICE_MAX_CONNECTIONS=1`, and some calls hung
//! with 8 or 32 queues. Here the only value wait follows its own write on one stream, and the
//! persistent kernel it waits for is already running.
//!
//! Members that wait meet on the host: ranks sharing a GPU must call from threads of their
//! own (as [`crate::run_ranks`] does). A wait past the communicator's timeout is an error
//! naming the ranks that did not come, and aborts the communicator; an abort ends every wait;
//! a wait logs who it waits for at the progress interval.
//!
//! # Ordering
//! A shared launch's entries go into its meeting's slot, each member's into its own cell
//! ([`LaunchSlot`], whose note has the argument); the last member takes the meeting out and
//! queues it for the launcher under the launcher's queue mutex (or, with
//! `FERROLINK_GROUP_LAUNCHER=last`, keeps it), and whoever launches gathers the entries after
//! taking it and the driver copies them into the launch's parameter. The last member of a
//! meeting queues it before it arrives at the next one, so the queue is in launch order. A
//! member's pending completion is noted in its resources before its call returns, at the
//! launch's place in the launch stream's order (a resource keeps the later of two: members
//! note them out of order); the launch stream orders every launch after the members'
//! arrivals (event waits), and work of another stream on a member's memory waits for the
//! launch's event (the pending completion settles to it, or, if that launch never runs, to
//! the launch stream's work so far: [`LaunchLog`]). In persistent mode, a member writes its
//! ring entry (plain stores to host memory) before it arrives; the last member, after taking
//! the meetings' mutex (which every member took after writing), submits the copy of the slot
//! into the kernel's ring and then the write of the sequence number, so every entry was
//! written before the copy that reads it was submitted, and the GPU reads host memory as the
//! host wrote it before a submission. A ring slot is rewritten only after the work that read
//! it has completed (its completion, kept per slot, is waited for). The device side's
//! argument is at `ferrolink_device::coll::group::serve`.

use crate::comm::Communicator;
use crate::comm::control::CommControl;
use crate::mem::window::Window;
use crate::runtime::backend::{EventBackend, EventState};
use crate::runtime::host_mapped::HostMapped;
use crate::runtime::launch::LaunchConfig;
use crate::runtime::launch::{LaunchArg, LaunchTracking};
use crate::runtime::lifetime::{Completion, StreamId, lock};
use crate::runtime::memory::DeviceBuffer;
use crate::runtime::module::Module;
use crate::runtime::phases::{self, Phase};
use crate::runtime::stream::Stream;
use crate::{Error, Result};
use ferrolink_device::DevComm;
use ferrolink_device::coll::group::{
    COMPLETED_OFFSET, CollOp, GridSync, GroupLaunch, LocalRanks, MAX_LAUNCH_ENTRIES, MAX_LAUNCH_OPERATIONS,
    MAX_LOCAL_RANKS, RANK_OP_STRIDE, RankOp, SEQ_OFFSET,
};
use ferrolink_device::kernels::coll::{coll_gpu_group_launch, coll_ll_group_launch};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

/// Slots of a group's ring: how many operations the host may run ahead of the GPU.
pub(crate) const RING_SLOTS: usize = 32;

/// How long a waiting member spins before it sleeps on the condition variable: a meeting of
/// threads that call together ends within microseconds. `FERROLINK_GROUP_SPIN_US` sets it
/// (0: sleep at once, leaving the CPUs to the member that launches).
fn spin() -> Duration {
    static SPIN: OnceLock<Duration> = OnceLock::new();
    *SPIN.get_or_init(|| {
        let us = std::env::var("FERROLINK_GROUP_SPIN_US").ok().and_then(|v| v.parse().ok()).unwrap_or(200);
        Duration::from_micros(us)
    })
}

/// The group's ring of operation slots: written by the host in host-mapped memory, copied
/// slot by slot into device memory by the stream that hands the operation to the persistent
/// kernel (in the same submission as the hand-over), where the kernel reads it: a read of
/// host memory from an SM took about 18 µs per operation on the H200.
struct Ring {
    mem: HostMapped,
    /// The kernel's copy (same layout).
    device: DeviceBuffer<u8>,
    /// Entries per slot (the group's members).
    parts: usize,
    /// Per slot: the completion of the last work that read it.
    last_use: Mutex<Vec<Option<Completion>>>,
    /// Where the CTAs of a shared launch of several calls meet between them (a
    /// [`GridSync`]; one launch of the group runs at a time).
    grid_sync: Mutex<DeviceBuffer<u64>>,
    /// The entries of shared launches that carry more calls than their parameter holds.
    entries: LaunchEntries,
}

/// Blocks of [`LaunchEntries`]: how many launches with entries in device memory may be queued
/// and not yet finished before the launcher waits for the oldest.
const ENTRY_BLOCKS: usize = 4;

/// Where the launcher puts the entries of a shared launch of more calls than the launch's
/// parameter holds ([`GroupLaunch::entries`]; at 8 ranks the parameter's 16 entries are 2
/// calls): it writes them into a block of host-mapped memory, and a stream of the entries' own
/// copies the block into device memory; the launch stream waits for that copy (an event), then
/// launches (one driver copy for the calls of the launch, where a parameter large enough for
/// them made every launch slower, PERF.md issue 12 twentieth part). The kernel reads them
/// from device memory (a read of host memory from an SM took about 18 µs on the H200). On the
/// launch stream itself the copy ran only after the previous launch's kernel, between two
/// kernels: 12.5 µs per launch of 61,440 bytes on an H100, where the copy on a stream of its
/// own, issued while earlier launches run, took nothing from the launch stream
/// (`benches/cuda/entries_copy_launch.cu`, PERF.md call 17).
///
/// Ordering: a block is rewritten only after the launch that copied it has finished (its
/// completion, kept per block, is waited for first), so neither the copy's read of the host
/// block nor the kernel's reads of the device block see a later launch's entries; the host's
/// writes come before the submission of the copy that reads them; the copy's write of the
/// device block comes after the launch that last read it (the host waited for it before the
/// submission) and before the launch that reads it (the launch stream waits for the copy's
/// event); the launch's completion, which the block's uses hold, comes after the copy.
struct LaunchEntries {
    mem: HostMapped,
    device: DeviceBuffer<u8>,
    /// Where the blocks' copies go (made with the group's ring, on the group's device): a
    /// stream that waits for nothing and that no kernel uses, so that a copy runs as soon as
    /// the host submits it.
    copies: Stream,
    /// Bytes per block: [`MAX_LAUNCH_OPERATIONS`] calls of `parts` entries.
    block_bytes: usize,
    /// The next block to use, and per block the completion of the launch that last read it.
    blocks: Mutex<(usize, Vec<Option<Completion>>)>,
}

/// A block of [`LaunchEntries`] written for one launch: the copy that brings it to the device,
/// `(dst, src, bytes)`, and the block's index.
pub(crate) struct StagedEntries {
    copy: (u64, u64, usize),
    block: usize,
}

/// Where the launcher's gathering puts a batch's entries: entry `j * count + p` is part `p`
/// of the batch's call `j` (its `base` is `j * count`). Written straight where the launch
/// reads them: a launch's parameter is 7.7 KB, and a copy of one per call (one per gathered
/// call, then merged) was launcher time at every call.
enum EntrySink<'a> {
    /// The gathered call's own parameter (entry `p`).
    Own,
    /// The first call's parameter, which carries the batch.
    Param { launch: &'a mut GroupLaunch, base: usize },
    /// A block of [`LaunchEntries`] (a batch of more entries than a parameter holds).
    Block { entries: &'a LaunchEntries, block: usize, base: usize },
}

/// Whether the entries of shared launches are copied on a stream of their own
/// ([`LaunchEntries`]); `FERROLINK_GROUP_ENTRY_STREAM=0` copies them on the launch stream,
/// before the launch, as before 2026-12-07 (for comparisons, or a process whose streams
/// outnumber the hardware queues: the entries' stream is one more).
fn entries_stream() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("FERROLINK_GROUP_ENTRY_STREAM").ok().as_deref().map(str::trim) != Some("0"))
}

impl LaunchEntries {
    fn new(dev: &crate::Device, parts: usize) -> Result<LaunchEntries> {
        let block_bytes = MAX_LAUNCH_OPERATIONS * parts.max(1) * RANK_OP_STRIDE;
        let mem = HostMapped::alloc(dev, ENTRY_BLOCKS * block_bytes)?;
        let device = dev.alloc::<u8>(ENTRY_BLOCKS * block_bytes)?;
        let copies = Stream::new(dev)?;
        Ok(LaunchEntries { mem, device, copies, block_bytes, blocks: Mutex::new((0, vec![None; ENTRY_BLOCKS])) })
    }

    /// Queues `staged`'s copy on the entries' stream and makes `launch` (the launch stream)
    /// wait for it; `false` where the launch stream captures a graph (a capture waits for no
    /// work outside it) or `FERROLINK_GROUP_ENTRY_STREAM=0`: the caller then queues the copy
    /// on the launch stream itself.
    ///
    /// # Safety
    /// `staged` is a block that the launcher acquired and wrote for the launch that `launch`
    /// queues next (so the launch that last read it has finished, and its host block is
    /// rewritten only after that next launch has: `LaunchEntries`' ordering).
    unsafe fn copy_before(&self, staged: &StagedEntries, launch: &Stream) -> Result<bool> {
        if launch.is_capturing() || !entries_stream() {
            return Ok(false);
        }
        let (dst, src, bytes) = staged.copy;
        // Not a tracked copy: the device buffer's uses are those of all four blocks, so a
        // tracked write would wait for the launches still reading the other blocks, and the
        // copy would run after them again. This block's own last reader has finished (the
        // caller's contract); the copy is noted below.
        // SAFETY: the block's ranges lie in this group's host and device blocks (`staged`),
        // noted below as used by the copy (so neither is freed before it has run); no other
        // work touches the block meanwhile (the caller's contract).
        let copied = unsafe { self.copies.copy_then_record(dst, src, bytes) }?;
        self.mem.uses.record(&copied, false);
        self.device.uses().record(&copied, true);
        // Its last use until the launch's replaces it: if the launch then fails, the block
        // is still rewritten only after the copy has read it.
        self.used(staged.block, &copied);
        launch.wait_for(&copied)?;
        Ok(true)
    }

    /// The next block, once the launch that last read it has finished: the launcher's to
    /// fill ([`LaunchEntries::put`]) for one launch.
    fn acquire(&self) -> usize {
        let (block, last) = {
            let mut b = lock(&self.blocks);
            let block = b.0;
            b.0 = (block + 1) % ENTRY_BLOCKS;
            (block, b.1[block].take())
        };
        if let Some(c) = last {
            c.wait();
        }
        block
    }

    /// Writes `op` as entry `index` of block `block` (acquired by the caller, the launcher).
    fn put(&self, block: usize, index: usize, op: &RankOp) {
        let at = block * self.block_bytes + index * RANK_OP_STRIDE;
        let bytes = bytemuck::bytes_of(op);
        assert!(
            block < ENTRY_BLOCKS
                && (index + 1) * RANK_OP_STRIDE <= self.block_bytes
                && at + bytes.len() <= self.mem.len(),
            "an entry inside its block"
        );
        // SAFETY: the range lies inside the host block (checked); no copy reads it now (the
        // launch that last copied it has finished: `acquire` waited for it) and only the
        // launcher that acquired the block writes it (blocks are handed out under the lock,
        // one launch each).
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.mem.host_ptr().add(at), bytes.len()) };
    }

    /// Block `block` with its first `entries` entries written: its device address and the
    /// copy to queue before the launch.
    fn staged(&self, block: usize, entries: usize) -> (u64, StagedEntries) {
        let base = block * self.block_bytes;
        let bytes = entries * RANK_OP_STRIDE;
        assert!(bytes <= self.block_bytes, "a block of launch entries holds the calls");
        let dst = self.device.addr() + base as u64;
        (dst, StagedEntries { copy: (dst, self.mem.device_addr() + base as u64, bytes), block })
    }

    /// Notes that launch `c` read block `block` (it is rewritten only after `c`).
    fn used(&self, block: usize, c: &Completion) {
        lock(&self.blocks).1[block] = Some(c.clone());
    }
}

impl Ring {
    fn new(dev: &crate::Device, parts: usize) -> Result<Ring> {
        let bytes = RING_SLOTS * parts * RANK_OP_STRIDE;
        let mem = HostMapped::alloc(dev, bytes)?;
        let device = dev.alloc::<u8>(bytes)?;
        let words = std::mem::size_of::<GridSync>() / 8;
        let grid_sync = Mutex::new(dev.alloc_from(&vec![0u64; words])?);
        let entries = LaunchEntries::new(dev, parts)?;
        Ok(Ring { mem, device, parts, last_use: Mutex::new(vec![None; RING_SLOTS]), grid_sync, entries })
    }

    /// Zeroes the grid sync (recovery: an aborted launch may have left arrivals counted).
    /// Waits for the launches that used it.
    fn reset_grid_sync(&self) -> Result<()> {
        let mut g = lock(&self.grid_sync);
        let words = g.len();
        g.copy_from_host(&vec![0u64; words])
    }

    /// The copy of operation `seq`'s slot into the kernel's ring: `(dst, src, bytes)`.
    fn slot_copy(&self, seq: u64) -> (u64, u64, usize) {
        let bytes = self.parts * RANK_OP_STRIDE;
        let at = (seq % RING_SLOTS as u64) as usize * bytes;
        (self.device.addr() + at as u64, self.mem.device_addr() + at as u64, bytes)
    }

    /// Writes `entry` as part `part` of operation `seq`'s slot, once the work that last
    /// read the slot has completed.
    fn write(&self, seq: u64, part: usize, entry: &RankOp) {
        let slot = (seq % RING_SLOTS as u64) as usize;
        let previous = lock(&self.last_use)[slot].clone();
        if let Some(c) = previous {
            c.wait();
        }
        assert!(part < self.parts, "a part of the ring");
        let at = (slot * self.parts + part) * RANK_OP_STRIDE;
        assert!(at + std::mem::size_of::<RankOp>() <= self.mem.len() && self.mem.host_ptr().align_offset(16) == 0);
        // SAFETY: the entry lies inside the block (checked), 16-byte aligned (the block is,
        // and the stride is a multiple of 16); no kernel reads it now (the slot's last
        // reader has completed) and only this member writes its entry of a slot.
        unsafe { (self.mem.host_ptr().add(at) as *mut RankOp).write_volatile(*entry) };
    }
}

/// Why the members meet.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub(crate) enum Purpose {
    /// One operation, launched for all (the entries travel in the launch's parameter).
    Launch,
    /// One operation handed to the persistent kernel (the entries go through the ring).
    Handover,
    /// The start of persistent mode.
    Persistent,
}

/// One member's part of a meeting ([`GpuGroup::meet`]).
pub(crate) struct Part<'a> {
    /// The rank (world).
    pub(crate) rank: usize,
    /// Its entry of the operation (none for the start of persistent mode, or a rank that
    /// runs the call otherwise).
    pub(crate) entry: Option<RankOp>,
    /// Its device communicator as a shared launch's entry refers to it ([`CommImage`]: the
    /// same as the entry's), if it keeps one.
    pub(crate) comm_image: Option<Arc<CommImage>>,
    /// Whether the kernel serves it (false: the rank runs this call otherwise, captured).
    pub(crate) served: bool,
    /// Its device communicator's control block (where its CTAs look for an abort).
    pub(crate) control: u64,
    /// Its persistent kernel's sync block and its device address (start of persistent
    /// mode): the kernel uses part 0's, which the group then keeps (every member's posts
    /// write it, whichever member goes first).
    pub(crate) sync: Option<(Window, u64)>,
    /// Its CTAs.
    pub(crate) ctas: u32,
    /// What the work uses for it.
    pub(crate) uses: LaunchTracking,
    /// Its stream, when the work must come after the stream's earlier work.
    pub(crate) stream: Option<&'a Stream>,
    /// Whether the stream must come after the work (`None`: return at once, the stream
    /// not following it): for a shared launch the member returns at once all the same, its
    /// stream following the launch to come; else it waits for the work. The group's
    /// communicator (this one) gives the waits their timeout and abort.
    pub(crate) wait: Option<&'a Communicator>,
}

/// Where a meeting's work stands ([`Outcome`]).
#[derive(Default)]
enum Progress {
    /// The last member has not taken it yet.
    #[default]
    Waiting,
    /// The last member is queuing it (a bounded stretch of host work: no one gives up now).
    Launching,
    /// Queued: its completion.
    Queued(Completion),
    /// It will not run: why (the last member failed, or a waiting member gave up on a
    /// timeout or an abort before the last took it).
    Failed(Error),
}

/// What the members learn from the last: the completion of the work, or why there is none.
///
/// A member that gives up (timeout, abort) does so only while the work is `Waiting`, under
/// the same mutex under which the last member takes it (`Launching`): so either the work is
/// queued with every member's part, or it never runs, and a member that returned before it
/// was queued ([`PendingLaunch`]) can tell which before its memory is freed.
// (Aligned: every member clones the `Arc` of its meeting's outcome, whose counts then stay
// off the lines that the launcher locks and writes.)
#[derive(Default)]
#[repr(align(128))]
struct Outcome {
    ready: AtomicBool,
    progress: Mutex<Progress>,
    published: Condvar,
    /// Threads asleep on `published` (changed under `progress`'s lock): a publication with
    /// none skips the wake-up, a system call even with no one to wake (usually none: a
    /// shared launch's members do not wait).
    sleepers: AtomicUsize,
}

/// One look at an [`Outcome`].
enum Look {
    Waiting,
    Launching,
    Done(Result<Completion>),
}

impl Outcome {
    fn look(&self) -> Look {
        match &*lock(&self.progress) {
            Progress::Waiting => Look::Waiting,
            Progress::Launching => Look::Launching,
            Progress::Queued(c) => Look::Done(Ok(c.clone())),
            Progress::Failed(e) => Look::Done(Err(e.clone())),
        }
    }

    /// The last member takes the work, counted in `log` as under way; an error if a waiting
    /// member gave up on it already, or for a shared launch (`launch`) if the communicator is
    /// aborted (then it never runs: see [`LaunchLog`]).
    fn claim(&self, log: &LaunchLog, launch: bool) -> Result<()> {
        let mut p = lock(&self.progress);
        match &*p {
            Progress::Waiting => {
                // Counted before the abort is read, both SeqCst: a failed pending completion
                // that sees no launch under way (`LaunchLog::settled`) was failed after an
                // abort, which this then sees.
                log.launching.fetch_add(1, Ordering::SeqCst);
                if launch && log.control.is_aborted() {
                    log.launched(None);
                    let e = log.control.error().unwrap_or_else(|| Error::Aborted("the communicator".into()));
                    *p = Progress::Failed(e.clone());
                    self.published(p);
                    return Err(e);
                }
                *p = Progress::Launching;
                Ok(())
            }
            Progress::Failed(e) => Err(e.clone()),
            Progress::Launching | Progress::Queued(_) => {
                Err(Error::InvalidArgument("a GPU group's meeting was taken twice".into()))
            }
        }
    }

    fn set(&self, value: Result<Completion>) {
        let mut p = lock(&self.progress);
        *p = match value {
            Ok(c) => Progress::Queued(c),
            Err(e) => Progress::Failed(e),
        };
        self.published(p);
    }

    /// Tells the waiters that `p` (the progress, locked) is final now. A sleeper counted
    /// itself under the lock before it looked at the progress, so it either saw the final
    /// value or is counted here.
    fn published(&self, p: std::sync::MutexGuard<'_, Progress>) {
        let sleepers = self.sleepers.load(Ordering::Relaxed);
        drop(p);
        self.ready.store(true, Ordering::Release);
        if sleepers > 0 {
            self.published.notify_all();
        }
    }

    /// Gives the work up with `why` unless the last member has taken it: whether this call
    /// gave it up.
    fn abandon(&self, why: &Error) -> bool {
        let mut p = lock(&self.progress);
        if !matches!(*p, Progress::Waiting) {
            return false;
        }
        *p = Progress::Failed(why.clone());
        self.published(p);
        true
    }

    /// Sleeps until the outcome changes or `d` passes.
    fn sleep(&self, d: Duration) {
        let p = lock(&self.progress);
        if matches!(*p, Progress::Waiting | Progress::Launching) {
            self.sleepers.fetch_add(1, Ordering::Relaxed);
            let p = self.published.wait_timeout(p, d).unwrap_or_else(|e| e.into_inner()).0;
            self.sleepers.fetch_sub(1, Ordering::Relaxed);
            drop(p);
        }
    }
}

/// What the group's launch stream has been given: the launches under way (taken by a last
/// member, not queued yet) and the completion of the last one queued. A pending completion
/// whose work will not run stands for the launch stream's work so far ([`LaunchLog::settled`]):
/// a resource holds one completion per stream, and the one it holds for the launch stream may
/// be a later call's, which replaced an earlier launch that still uses the resource.
///
/// Why that covers every launch that may use the resource: work fails unqueued only after the
/// communicator is aborted (a member gives up on a timeout or an abort; a last member's
/// failure aborts it first), and an aborted communicator's meetings are no longer taken
/// ([`Outcome::claim`]); so once no launch is under way, every launch that will ever run is
/// queued, in order, and the last one's completion comes after all of them.
#[repr(align(128))] // (as `Outcome`: the launcher's and members' counts of it change)
struct LaunchLog {
    control: Arc<CommControl>,
    launching: AtomicUsize,
    last: Mutex<Option<Completion>>,
    idle: Condvar,
    /// Threads asleep on `idle` (changed under `last`'s lock): a launch wakes them only if
    /// some are (usually none; a wake-up is a system call on the launching member's path).
    idle_sleepers: AtomicUsize,
}

impl LaunchLog {
    /// A taken launch is over: queued with completion `c`, or not.
    fn launched(&self, c: Option<Completion>) {
        let mut last = lock(&self.last);
        if let Some(c) = c {
            *last = Some(c);
        }
        self.launching.fetch_sub(1, Ordering::SeqCst);
        let sleepers = self.idle_sleepers.load(Ordering::Relaxed);
        drop(last);
        if sleepers > 0 {
            self.idle.notify_all();
        }
    }

    /// The completion of the launch stream's work so far, once no launch is under way
    /// (`None` with `block` while one is; `Some(None)`: nothing was ever launched).
    fn settled(&self, block: bool) -> Option<Option<Completion>> {
        let mut last = lock(&self.last);
        while self.launching.load(Ordering::SeqCst) > 0 {
            if !block {
                return None;
            }
            // A last member queuing a launch: host work that ends (20 ms: a check, not a
            // deadline).
            self.idle_sleepers.fetch_add(1, Ordering::Relaxed);
            last = self.idle.wait_timeout(last, Duration::from_millis(20)).unwrap_or_else(|e| e.into_inner()).0;
            self.idle_sleepers.fetch_sub(1, Ordering::Relaxed);
        }
        Some(last.clone())
    }
}

/// The completion that a member of a shared launch returns with before the last member has
/// queued the launch ([`GpuGroup::meet`]): recorded into everything the member's part uses
/// and followed by its stream, under the group's launch stream's id and at the launch's
/// number in that stream's order. It is pending until the launch is queued, then that
/// launch's event; a stream or host wait for it first waits on the host for the launch to be
/// queued (at most the communicator's timeout: then the member gives the work up, which
/// aborts the communicator with the ranks it waited for). If the work does not run (the last
/// member failed, or a member gave up), it stands for the launch stream's work so far
/// ([`LaunchLog`]).
struct PendingLaunch {
    /// The member's link to its group.
    link: Arc<MemberLink>,
    seq: u64,
    outcome: Arc<Outcome>,
    since: Instant,
}

/// What a member's pending launches refer to: its group and rank. One per member, made at
/// its first shared launch, so that a pending launch per call clones a count of the
/// member's own rather than the group's, which every member of the GPU would change at
/// every call. (Aligned: members change their links' counts at every call.)
#[repr(align(128))]
struct MemberLink {
    /// Weak: open meetings hold their members' arrivals, which may be pending completions.
    group: Weak<GpuGroup>,
    log: Arc<LaunchLog>,
    rank: usize,
}

impl PendingLaunch {
    /// What it stands for: the launch's completion, or with the work given up the launch
    /// stream's work so far (`Some(None)`: nothing); `None` while unknown (without `block`).
    fn resolve(&self, block: bool) -> Option<Option<Completion>> {
        let outcome = match self.link.group.upgrade() {
            Some(g) => g.await_outcome(self.link.rank, Purpose::Launch, self.seq, &self.outcome, self.since, block),
            None => {
                // No last member can come (a last member holds the group): give it up.
                self.outcome.abandon(&Error::Aborted("the GPU group is gone".into()));
                Some(match self.outcome.look() {
                    Look::Done(r) => r,
                    Look::Waiting | Look::Launching => unreachable!("a group that is gone launches nothing"),
                })
            }
        };
        match outcome? {
            Ok(c) => Some(Some(c)),
            Err(_) => self.link.log.settled(block),
        }
    }
}

impl EventBackend for PendingLaunch {
    fn query(&self) -> EventState {
        match self.resolve(false) {
            None => EventState::Pending,
            Some(Some(c)) => c.event().query(),
            Some(None) => EventState::Done,
        }
    }
    fn synchronize(&self) -> Result<()> {
        match self.resolve(true) {
            Some(Some(c)) => c.event().synchronize(),
            Some(None) => Ok(()),
            None => unreachable!("a blocking wait resolves"),
        }
    }
    fn elapsed_ms_since(&self, _start: &dyn EventBackend) -> Result<f32> {
        Err(crate::runtime::backend::untimed_completion())
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn stand_in(&self) -> Option<Result<Option<Arc<dyn EventBackend>>>> {
        Some(Ok(self.resolve(true).flatten().map(|c| c.event().clone())))
    }
}

/// A member's device communicator as its shared launches' entries refer to it: the same value
/// from call to call until the communicator's resources are renewed, so the launcher reads it
/// from the member's allocation, where it stays in the launcher's cache (aligned: the count
/// changes at every call, the value never). A copy in every arrival moved its 288 bytes from
/// the member's core to the launcher's at every call.
#[repr(align(128))]
pub(crate) struct CommImage(pub(crate) DevComm);

/// A member's entry of a shared launch as it comes to the meeting: the operation, and the
/// device communicator by reference (a [`RankOp`] once gathered).
struct LaunchEntry {
    op: CollOp,
    comm: Arc<CommImage>,
}

impl LaunchEntry {
    fn rank_op(&self) -> RankOp {
        RankOp { op: self.op, comm: self.comm.0 }
    }
}

/// One member's share of a meeting, made before it arrives (a shared launch's goes into the
/// member's cell of the meeting's slot, other meetings' are pushed under the meetings' lock).
struct Arrival {
    part: usize,
    /// A shared launch's entry (other meetings' entries go through the ring).
    entry: Option<LaunchEntry>,
    served: bool,
    control: u64,
    sync: Option<(Window, u64)>,
    ctas: u32,
    /// What the work uses for this member; `None` for a member of a shared launch, which
    /// tracks its part itself (and registers its observers with the launch stream).
    uses: Option<LaunchTracking>,
    /// Part 0's stream, when part 0 waits for the work: the work goes there.
    launch_stream: Option<Stream>,
    /// What the work waits for: the member's arrival and, for a shared launch, other
    /// streams' uses of its part's resources.
    events: Vec<Completion>,
}

struct Meeting {
    arrivals: Vec<Arrival>,
    outcome: Arc<Outcome>,
}

/// What the last member to arrive does the work with ([`GpuGroup::meet`]); dropped without
/// [`Gathered::publish`], it tells the waiting members that the work failed.
pub(crate) struct Gathered {
    /// The persistent kernel's parameter (ring, parts, grid).
    pub(crate) ranks: LocalRanks,
    /// A shared launch's parameter (parts, grid, entries); `None` for a later call of a batch
    /// (its entries went into the first's, [`EntrySink`]) and for other work.
    launch: Option<Box<GroupLaunch>>,
    /// What the stream doing the work waits for first: the members' arrivals and, for a
    /// shared launch, other streams' pending uses of the members' resources.
    pub(crate) events: Vec<Completion>,
    /// Where a hand-over to the persistent kernel goes: part 0's stream when part 0 waits for
    /// it (then the same stream call after call, and the members' streams, which follow it
    /// lazily, owe no event waits), else the last member's. (A shared launch goes on the
    /// group's launch stream.)
    launch_stream: Option<Stream>,
    /// What the work uses for every member (`None`: nothing, or taken; a shared launch's
    /// members track their parts themselves). An option, not an empty tracking: an empty one
    /// clones the device's handle, whose count the members' threads change at every call.
    pub(crate) uses: Option<LaunchTracking>,
    /// The sync block the members brought (start of persistent mode), part 0's.
    pub(crate) sync: Option<(Window, u64)>,
    outcome: Option<Arc<Outcome>>,
    /// The members' communicator's control (aborted when the work fails unqueued: members
    /// may have returned expecting it).
    control: Arc<CommControl>,
    /// The group and the meeting's number and purpose: dropped, the meeting is over
    /// (members waiting to run further ahead may go on).
    group: Arc<GpuGroup>,
    seq: u64,
    purpose: Purpose,
    /// Whether the group's launch log has counted the end of this work.
    counted: bool,
    /// Later meetings whose calls run in the same launch (published with this one).
    batch: Vec<Gathered>,
    /// Whether every call of the launch is an LL call inside one LSA domain, when the
    /// launcher knows it of a launch of several (else the parameter's entries say).
    ll_only: Option<bool>,
    /// The launch's entries, when they lie in device memory ([`LaunchEntries`]).
    staged: Option<StagedEntries>,
}

impl Gathered {
    /// Publishes the work's completion (or its failure) to the waiting members.
    pub(crate) fn publish(mut self, result: &Result<Completion>) {
        if self.purpose == Purpose::Launch
            && let Ok(c) = result
        {
            self.counted = true;
            self.group.log.launched(Some(c.clone()));
        }
        if let Some(o) = self.outcome.take() {
            o.set(result.clone());
        }
        for g in std::mem::take(&mut self.batch) {
            g.publish(result);
        }
    }

    /// The kernel's parameter and what the members' parts use, for work that nobody waits
    /// for through the meeting (the start of persistent mode).
    pub(crate) fn into_parts(mut self, dev: &crate::Device) -> (LocalRanks, LaunchTracking, Option<(Window, u64)>) {
        self.outcome = None;
        let uses = self.uses.take().unwrap_or_else(|| LaunchTracking::new(dev));
        (self.ranks, uses, self.sync.take())
    }

    /// Drops the work that nobody needs (no member is served): no error.
    pub(crate) fn discard(mut self) {
        if let Some(o) = self.outcome.take() {
            o.set(Err(Error::Aborted("no rank of this GPU needed the shared collective".into())));
        }
    }

    /// Whether no member is served (every one runs the call otherwise): nothing to run.
    pub(crate) fn nothing_served(&self) -> bool {
        let count = (self.ranks.count as usize).min(MAX_LOCAL_RANKS);
        (0..count).all(|p| self.ranks.skip & (1 << p) != 0)
    }
}

impl Drop for Gathered {
    fn drop(&mut self) {
        if let Some(o) = self.outcome.take() {
            let e = Error::Aborted("the rank that ran this GPU's shared collective failed before queuing it".into());
            // The abort first: see `LaunchLog`.
            self.control.abort(e.clone());
            o.set(Err(e));
        }
        // After publishing (`publish`, `discard` and `into_parts` consume the value).
        if !self.counted {
            self.group.log.launched(None);
        }
        self.group.meeting_over(self.seq);
    }
}

/// Work taken by a last member ([`Outcome::claim`]) before [`Gathered`] owns it: dropped held
/// (a panic while gathering), it fails the work as `Gathered`'s drop would.
struct Taken<'g> {
    group: &'g GpuGroup,
    outcome: Arc<Outcome>,
    seq: u64,
    held: bool,
}

impl Taken<'_> {
    fn release(mut self) {
        self.held = false;
    }
}

impl Drop for Taken<'_> {
    fn drop(&mut self) {
        if self.held {
            let e = Error::Aborted("the rank that ran this GPU's shared collective failed while gathering it".into());
            self.group.control.abort(e.clone());
            self.outcome.set(Err(e));
            self.group.log.launched(None);
            self.group.meeting_over(self.seq);
        }
    }
}

/// A group kernel's parameter as a launch argument ([`LocalRanks`] for the persistent
/// kernel, [`GroupLaunch`] for a shared launch); what the launch uses is tracked through the
/// launch's extra tracking (every member's part).
/// (It refers to the parameter, which is copied once, into the launch's arguments.)
pub(crate) struct GroupParam<'p, P>(pub(crate) &'p P);

impl<P> crate::runtime::launch::sealed::Sealed for &GroupParam<'_, P> {}

impl<P: ferrolink_device::kernel::KernelParam> LaunchArg for &GroupParam<'_, P> {
    type Param = P;
    fn param(&self) -> P {
        *self.0
    }
    fn track(&self, _t: &mut LaunchTracking) {}
}

/// A field that many threads write, alone on its cache lines (two 64-byte lines: adjacent-line
/// prefetch pairs them), so that writing it does not evict what they only read.
#[derive(Default)]
#[repr(align(128))]
struct Hot<T>(T);

impl<T> std::ops::Deref for Hot<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

/// The ranks of one communicator on one GPU in this process.
#[repr(align(128))] // (as `Outcome`: its counts change at every launch)
pub(crate) struct GpuGroup {
    /// Their world ranks, ascending: a rank's place here is its part of the kernel.
    pub(crate) members: Vec<usize>,
    /// How many CTAs of the group's kernel the GPU holds at once (occupancy API; `None`: no
    /// limit), once asked.
    pub(crate) resident: OnceLock<Option<u64>>,
    /// Threads per CTA of the LL kernels ([`super::ll_threads`]), once asked.
    pub(crate) ll_threads: OnceLock<u32>,
    /// Made once, by the first member to need it (it may allocate: before any kernel runs).
    ring: OnceLock<Arc<Ring>>,
    /// The meetings of hand-overs to the persistent kernel and of its start (each member's
    /// call takes it): on cache lines of its own (`Hot`), apart from the fields the members
    /// only read.
    meetings: Hot<Mutex<HashMap<(Purpose, u64), Meeting>>>,
    /// The meetings of shared launches, by sequence number modulo [`LAUNCH_SLOTS`].
    launch_slots: Vec<LaunchSlot>,
    /// The members' communicator's control (its timeout, its abort).
    control: Arc<CommControl>,
    /// What the launch stream has been given (see [`LaunchLog`]).
    log: Arc<LaunchLog>,
    /// The persistent kernel's sync block and its device address, while it runs.
    pub(crate) persistent_sync: Mutex<Option<(Window, u64)>>,
    /// Where shared launches go ([`GpuGroup::launch_stream`]), once made, and its id (read
    /// by every member's call: kept here, not read from the stream's state, which the
    /// launching member writes).
    launch_stream: OnceLock<(Stream, StreamId)>,
    /// Serializes the making of the ring and of the launch stream.
    making: Mutex<()>,
    /// The meetings of numbers up to this one are over (their work queued, failed or not
    /// needed): members do not run more than [`RUN_AHEAD`] calls beyond it.
    meetings_over: Hot<AtomicU64>,
    /// The highest number of a shared launch's meeting that every member came to (raised by
    /// its last member before it resets the meeting's slot; [`GpuGroup::missing`]).
    last_complete: Hot<AtomicU64>,
    /// Where a member that is too far ahead sleeps ([`GpuGroup::within_reach`]), and how many
    /// do (a meeting's end wakes them only if some do).
    reach: Mutex<()>,
    reach_wake: Condvar,
    reach_sleepers: AtomicUsize,
    /// The least number of the last meeting over that a sleeper waits for (`u64::MAX`: none).
    reach_target: AtomicU64,
    /// Each member's next sequence number (its calls' count: the same on every member), each
    /// on cache lines of its own (every member writes its own at every call).
    seqs: Vec<Hot<AtomicU64>>,
    /// The thread that queues the shared launches ([`Launcher`]), and the device it launches
    /// on (set by the first shared launch's members).
    launcher: Launcher,
    launch_dev: OnceLock<crate::Device>,
    /// Per member: the observers it registered with the launch stream, each on cache lines
    /// of its own.
    observed: Vec<Hot<Mutex<Vec<ObserverRef>>>>,
    /// Per member: its [`MemberLink`].
    links: Vec<Hot<OnceLock<Arc<MemberLink>>>>,
}

/// Slots of shared launches' meetings: twice the run-ahead bound, so that a slot's meeting
/// is over before any member comes to the slot's next one (see [`LaunchSlot`]).
const LAUNCH_SLOTS: usize = 2 * RUN_AHEAD as usize;
const _: () = assert!(LAUNCH_SLOTS as u64 > RUN_AHEAD && MAX_LOCAL_RANKS <= 32);

/// Where the members of a shared launch meet ([`Purpose::Launch`]; meetings whose number is the
/// slot's index modulo [`LAUNCH_SLOTS`], in turn): each member puts its arrival in its own cell
/// and raises its bit, so members arriving together share no lock (under one mutex for all
/// meetings, 8 ranks spent 3.5–4.4 µs per call arriving on an H100, PERF.md 2026-12-07 call 9);
/// the member whose bit completes the set takes the meeting.
///
/// Ordering: a member takes its handle on the meeting's outcome from its cell and writes its
/// arrival there (each cell's mutex is taken by that member and then by the last one only),
/// then raises its bit with acquire-release; the last member's raise reads every bit, so it
/// acquires every cell; it takes the arrivals and puts a handle on the next meeting's outcome
/// in each cell (so no member shares a lock or a count to get its outcome: under a
/// read-write lock and a shared count, 8 members' arrivals took 0.74 µs per call on an H100),
/// then clears the bits for the next meeting. No member comes to that next meeting (number `seq + LAUNCH_SLOTS`) before the
/// reset: a member makes call `s` only once `meetings_over`, the highest number of a meeting
/// over, reaches `s - RUN_AHEAD` ([`GpuGroup::within_reach`]), which is above `seq`; and no
/// meeting after `seq` completes (so none is launched and raises `meetings_over`) before
/// meeting `seq`'s last member, which resets the slot before it arrives at any later meeting,
/// has arrived there. That needs every meeting to complete: a member that fails before it
/// arrives aborts the communicator, whose `recover` empties the slots ([`LaunchSlot::drain`]),
/// and a member that finds its own bit still set (an earlier meeting left half full) refuses
/// the call and aborts. Meetings are
/// queued for the launcher in order without a shared lock too: the last member of meeting
/// `seq` queues it before its call returns, so before its own arrival at meeting `seq + 1`,
/// which the last member of `seq + 1` has read (its raise acquires every bit) before it queues
/// that one.
// (Aligned: the members of the next meeting write the neighbouring slot while the last
// member of this one resets it.)
#[repr(align(128))]
struct LaunchSlot {
    /// Bit `p`: member `p`'s arrival is in `cells[p]`.
    arrived: AtomicU32,
    /// Per member, its arrival (written by the member, taken by the last) and its handle on
    /// the meeting's outcome (taken by the member, put there by the last member of the slot's
    /// previous meeting).
    cells: Vec<Hot<Mutex<SlotCell>>>,
}

/// A member's cell of a [`LaunchSlot`].
struct SlotCell {
    arrival: Option<Arrival>,
    outcome: Option<Arc<Outcome>>,
}

impl LaunchSlot {
    fn new(members: usize) -> LaunchSlot {
        let outcome: Arc<Outcome> = Arc::default();
        LaunchSlot {
            arrived: AtomicU32::new(0),
            cells: (0..members)
                .map(|_| Hot(Mutex::new(SlotCell { arrival: None, outcome: Some(outcome.clone()) })))
                .collect(),
        }
    }

    /// Puts member `arrival.part`'s arrival in its cell and raises its bit (see [`LaunchSlot`]
    /// for the ordering); the member whose bit completes the set takes the meeting.
    fn arrive(&self, arrival: Arrival) -> SlotArrival {
        let p = arrival.part;
        let all = u32::MAX >> (32 - self.cells.len());
        let mut cell = lock(&self.cells[p]);
        if self.arrived.load(Ordering::Acquire) & 1 << p != 0 {
            // (Checked before the cell is written: the stale arrival stays for `drain`.)
            return SlotArrival::Stale;
        }
        let Some(outcome) = cell.outcome.take() else {
            // No handle without the bit: only a member that came twice to one meeting.
            return SlotArrival::Stale;
        };
        cell.arrival = Some(arrival);
        drop(cell);
        // AcqRel: the last member's read of every bit acquires every member's cell.
        let before = self.arrived.fetch_or(1 << p, Ordering::AcqRel);
        if before | 1 << p != all {
            return SlotArrival::Early(outcome);
        }
        // Every member has taken its handle: the cells get the next meeting's.
        let next: Arc<Outcome> = Arc::default();
        let mut arrivals = Vec::with_capacity(self.cells.len());
        for c in &self.cells {
            let mut c = lock(c);
            arrivals.extend(c.arrival.take());
            c.outcome = Some(next.clone());
        }
        if arrivals.len() != self.cells.len() {
            return SlotArrival::Lost(outcome);
        }
        SlotArrival::Last(Meeting { arrivals, outcome })
    }

    /// Readies the slot for its next meeting, after its last member took this one
    /// ([`SlotArrival::Last`]), before that member arrives at any later meeting (no member of
    /// the slot's next meeting comes before a meeting after this one is over, which needs
    /// that member's arrival: [`LaunchSlot`]). Until then the slot's bits say that every
    /// member came; after it, the group's `last_complete` does ([`GpuGroup::missing`]).
    fn reset(&self) {
        // (The cells hold the next meeting's outcome already: `arrive`.)
        self.arrived.store(0, Ordering::Release);
    }

    /// The members whose arrival is in (parts).
    fn arrived(&self) -> Vec<usize> {
        let bits = self.arrived.load(Ordering::Acquire);
        (0..self.cells.len()).filter(|p| bits & (1 << p) != 0).collect()
    }

    /// Empties a half-full meeting (recovery, while no member meets): its arrivals, and its
    /// outcome, which the caller gives up.
    fn drain(&self) -> Option<Meeting> {
        if self.arrived.swap(0, Ordering::AcqRel) == 0 {
            return None;
        }
        // The meeting's outcome: the handle of a member that had not come (the others took
        // theirs); each cell gets the next meeting's.
        let next: Arc<Outcome> = Arc::default();
        let (mut arrivals, mut outcome) = (Vec::new(), None);
        for c in &self.cells {
            let mut c = lock(c);
            arrivals.extend(c.arrival.take());
            outcome = outcome.or(c.outcome.replace(next.clone()));
        }
        Some(Meeting { arrivals, outcome: outcome.unwrap_or_default() })
    }
}

/// What a member's arrival at its [`LaunchSlot`] found.
enum SlotArrival {
    /// Others are still to come: the meeting's outcome.
    Early(Arc<Outcome>),
    /// This member completed the set: the meeting (the slot is to be [reset](LaunchSlot::reset)).
    Last(Meeting),
    /// The member's bit was still set: an earlier meeting of the slot was left half full.
    Stale,
    /// Every bit but not every cell was in: a recovery raced the meeting.
    Lost(Arc<Outcome>),
}

/// An observer that a member registered with the launch stream (held weakly, as the stream
/// holds it; compared by address).
type ObserverRef = Weak<dyn crate::runtime::stream::StreamObserver>;

/// Who queues a GPU group's shared launch ([`launcher_mode`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LauncherMode {
    /// A thread of the group's ([`Launcher`]).
    Thread,
    /// The last member to arrive, in its own call.
    Last,
}

/// `FERROLINK_GROUP_LAUNCHER`: `thread` (the default) or `last` (for comparisons).
fn launcher_mode() -> LauncherMode {
    static MODE: OnceLock<LauncherMode> = OnceLock::new();
    *MODE.get_or_init(|| match std::env::var("FERROLINK_GROUP_LAUNCHER").ok().as_deref().map(str::trim) {
        Some("last") => LauncherMode::Last,
        Some("thread") | Some("") | None => LauncherMode::Thread,
        Some(other) => {
            tracing::warn!(target: "ferrolink::coll", value = other, "FERROLINK_GROUP_LAUNCHER is `thread` or `last`; using `thread`");
            LauncherMode::Thread
        }
    })
}

/// `FERROLINK_GROUP_LL_MEETINGS=1`: the CTAs of a launch of several LL calls meet between
/// them even with one CTA per rank (as every other launch of several calls does; for
/// comparisons). Unset, they go on without meeting.
fn ll_grid_meetings() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("FERROLINK_GROUP_LL_MEETINGS").ok().as_deref().map(str::trim) == Some("1"))
}

/// How long the launcher thread waits for work before it ends (the next shared launch
/// starts another).
const LAUNCHER_IDLE_EXIT: Duration = Duration::from_millis(100);

/// A GPU group's launcher: the thread that queues its shared launches. The last member of a
/// meeting does not launch: it hands the complete meeting to the launcher and returns like the
/// others (each member's stream already follows the launch to come, [`PendingLaunch`]). The
/// launcher takes the meetings in order, gathers the entries, launches and publishes. So the
/// members' own work (preparing a call, arriving, noting the pending launch in what they use)
/// is off the path of the launches, which is then only the launcher's: on the H200, 8 ranks
/// took 13.8–16.0 µs per call with the launcher, 16.6–19.4 with the last member launching in
/// the same run (PERF.md, issue 12 seventeenth part).
///
/// Calls that have queued up go in one launch when they can ([`batchable`], at most
/// [`GpuGroup::batch_limit`]): the kernel runs them in order, its CTAs meeting between them
/// (`ferrolink_device::coll::group::serve_launch`); on the H200 that brought 2 and 4 ranks to
/// 6.9–8.4 µs per call, from 8.5–11.1 with one call per launch (PERF.md, same part).
///
/// The thread is made by the first hand-over and ends after [`LAUNCHER_IDLE_EXIT`] without
/// work (it holds the group meanwhile, so work handed over before the members' communicators
/// are dropped is still launched); if it cannot be made, the member that handed the meeting
/// over launches it. It spins for the members' spin time ([`spin`]) before it sleeps.
///
/// Ordering: a meeting is queued by the member that completes it before that member arrives
/// at the next meeting, which is complete only once it has ([`LaunchSlot`]), so the queue is
/// in launch order. A hand-over raises `pending` (SeqCst) and then reads
/// `asleep`; the launcher raises `asleep` (SeqCst) and then reads `pending` before it parks:
/// one of the two sees the other's write, so a queued meeting never waits for a sleeping
/// launcher (the `unpark` token covers a wake-up that comes before the park).
#[derive(Default)]
struct Launcher {
    queue: Hot<Mutex<LaunchQueue>>,
    pending: AtomicUsize,
    asleep: AtomicBool,
    /// Launches made that carried more than one call (diagnostics, tests).
    batched: AtomicU64,
    /// Of those, launches whose entries lay in device memory ([`LaunchEntries`]).
    device_entries: AtomicU64,
    /// Of those, launches of LL calls whose CTAs did not meet between the calls.
    unmet: AtomicU64,
    /// Tests: the launcher leaves the queue alone while set.
    #[cfg(test)]
    hold: AtomicBool,
}

#[derive(Default)]
struct LaunchQueue {
    ready: std::collections::VecDeque<(u64, Meeting)>,
    /// The launcher thread, while it runs.
    thread: Option<std::thread::Thread>,
    /// A thread is running (or being made).
    running: bool,
}

/// Whether complete meeting `m` may share a launch with others whose parts have `ctas` CTAs
/// each: every member served (none captured) with that grid, and the whole communicator in
/// this group (one LSA domain, on this GPU: the grid barrier between the calls orders them at
/// GPU scope only; `serve_launch`'s contract).
fn batchable(m: &Meeting, ctas: u32) -> bool {
    let members = m.arrivals.len();
    m.arrivals.iter().all(|a| {
        a.served
            && a.ctas == ctas
            && a.entry
                .as_ref()
                .is_some_and(|e| e.comm.0.lsa_size == e.comm.0.nranks && e.comm.0.nranks as usize == members)
    })
}

/// What a hand-over to the launcher asks for ([`GpuGroup::hand_over`]).
enum LauncherStart {
    /// Wake the thread if it sleeps.
    Wake,
    /// Make the thread.
    Spawn,
}

/// How the last member of a meeting runs the work ([`GpuGroup::run`]).
pub(crate) enum Work<'a> {
    /// Launch the kernel for this operation.
    Launch { module: &'a Module, threads: u32 },
    /// Hand the operation to the persistent kernel through its sync block (a device
    /// address, tracked as held by the work); `wait` says how the stream waits for it.
    Persistent { sync: (Window, u64), wait: Wait },
}

/// How a stream that hands an operation to the persistent kernel waits for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Wait {
    /// In the same batch (the other members' streams then wait for that batch).
    Now,
    /// Not at all (the shutdown queued by a drop).
    Never,
}

/// How many calls a member of a shared launch may make beyond the group's last meeting that
/// is over ([`GpuGroup::within_reach`]): members do not wait for the launches, and without a
/// bound a member faster than the one that launches would leave open meetings without end.
pub(crate) const RUN_AHEAD: u64 = 64;

/// The words of the persistent kernel's sync block `(window, address)` that a hand-over
/// writes and waits on, `(seq, completed)`; the block is noted in `uses`.
fn sync_words(sync: &(Window, u64), uses: &mut LaunchTracking) -> (u64, u64) {
    (&sync.0).track(uses);
    (sync.1 + SEQ_OFFSET as u64, sync.1 + COMPLETED_OFFSET as u64)
}

/// How many operations a rank alone on its GPU hands over before its stream waits for the
/// oldest ([`GpuGroup::hand_over_alone`]); under the ring's slots.
pub(crate) const PIPELINE: u64 = 8;

/// The launch shape of the group's kernel: `ctas` CTAs of `threads`, each with the shared
/// memory its rank's ring entry takes.
pub(crate) fn kernel_config(ctas: u32, threads: u32) -> LaunchConfig {
    LaunchConfig::linear(ctas, threads).with_shared_mem(RANK_OP_STRIDE as u32)
}

/// A group's key: the communicator's id and the GPU's UUID.
type GroupKey = (u64, [u8; 16]);

/// Groups alive in this process.
static GROUPS: Mutex<Vec<(GroupKey, Weak<GpuGroup>)>> = Mutex::new(Vec::new());

impl GpuGroup {
    /// The group of `comm`'s rank (made by the first of its members to ask).
    pub(crate) fn of(comm: &Communicator) -> Arc<GpuGroup> {
        let peers = &comm.shared.peers;
        let me = &peers[comm.rank()];
        let members: Vec<usize> = (0..peers.len())
            .filter(|&r| peers[r].node == me.node && peers[r].pid == me.pid && peers[r].uuid == me.uuid)
            .collect();
        let key = (comm.shared.id, me.uuid);
        let mut groups = lock(&GROUPS);
        groups.retain(|(_, g)| g.strong_count() > 0);
        if let Some(g) = groups.iter().find(|(k, _)| *k == key).and_then(|(_, g)| g.upgrade()) {
            return g;
        }
        let g = Arc::new(GpuGroup::new(members, comm.shared.control.clone()));
        groups.push((key, Arc::downgrade(&g)));
        g
    }

    fn new(members: Vec<usize>, control: Arc<CommControl>) -> GpuGroup {
        GpuGroup {
            resident: OnceLock::new(),
            ll_threads: OnceLock::new(),
            ring: OnceLock::new(),
            meetings: Hot(Mutex::new(HashMap::new())),
            launch_slots: (0..LAUNCH_SLOTS).map(|_| LaunchSlot::new(members.len())).collect(),
            log: Arc::new(LaunchLog {
                control: control.clone(),
                launching: AtomicUsize::new(0),
                last: Mutex::new(None),
                idle: Condvar::new(),
                idle_sleepers: AtomicUsize::new(0),
            }),
            control,
            persistent_sync: Mutex::new(None),
            launch_stream: OnceLock::new(),
            making: Mutex::new(()),
            seqs: (0..members.len()).map(|_| Hot(AtomicU64::new(1))).collect(),
            meetings_over: Hot(AtomicU64::new(0)),
            last_complete: Hot(AtomicU64::new(0)),
            reach: Mutex::new(()),
            reach_wake: Condvar::new(),
            reach_sleepers: AtomicUsize::new(0),
            reach_target: AtomicU64::new(u64::MAX),
            launcher: Launcher::default(),
            launch_dev: OnceLock::new(),
            observed: (0..members.len()).map(|_| Hot::default()).collect(),
            links: (0..members.len()).map(|_| Hot::default()).collect(),
            members,
        }
    }

    /// `rank`'s next sequence number (counted as used).
    pub(crate) fn next_seq(&self, rank: usize) -> u64 {
        self.seqs[self.part_of(rank)].fetch_add(1, Ordering::Relaxed)
    }

    /// Puts the members back in step after a failure ([`Communicator::recover`]): a call
    /// that failed on some members only (a timeout, an abort) used a sequence number on
    /// those alone, and may have left its meeting half full. Forgets every meeting and gives
    /// every member the same next sequence number, past all used (ring slots stay tracked by
    /// their last use). Idempotent; called by members while every member is inside
    /// `recover`, between its barriers, so that none meets meanwhile.
    pub(crate) fn resync(&self) {
        // A meeting still here was not taken by a last member: its work never runs.
        let why =
            Error::Aborted("the communicator was recovered before every rank sharing its GPU made this call".into());
        // Dropped after the lock: dropping what they hold may retire memory, which looks at
        // completions whose queries take the meetings' lock.
        let mut left: Vec<Meeting> = lock(&self.meetings).drain().map(|(_, m)| m).collect();
        left.extend(self.launch_slots.iter().filter_map(LaunchSlot::drain));
        // Meetings handed to the launcher and not taken yet (a recovery follows an abort, so
        // the launcher would not launch them either).
        let queued: Vec<Meeting> = lock(&self.launcher.queue).ready.drain(..).map(|(_, m)| m).collect();
        self.launcher.pending.fetch_sub(queued.len(), Ordering::SeqCst);
        left.extend(queued);
        for m in &left {
            m.outcome.abandon(&why);
        }
        drop(left);
        // An aborted launch of several calls may have left arrivals at its grid meeting.
        if let Some(r) = self.ring.get()
            && let Err(e) = r.reset_grid_sync()
        {
            tracing::warn!(target: "ferrolink::coll", error = %e, "could not reset a GPU group's grid sync");
        }
        // A failed launch stream (on the emulator: a kernel's timeout, panic or trap) is
        // replaced, as the members' own streams are.
        if let Some((s, _)) = self.launch_stream.get()
            && let Err(e) = s.recover()
        {
            tracing::warn!(target: "ferrolink::coll", error = %e, "could not recover a GPU group's launch stream");
        }
        let next = self.seqs.iter().map(|s| s.load(Ordering::Relaxed)).max().unwrap_or(1);
        for s in &self.seqs {
            s.store(next, Ordering::Relaxed);
        }
        self.meeting_over(next - 1);
    }

    /// The last member's share of meeting `seq`: makes the stream that does the work wait for
    /// the members' arrivals, runs `work` tracked by everything the members use, notes the
    /// slot's use and publishes the completion to the members. A shared launch goes on the
    /// group's launch stream; a hand-over to the persistent kernel on part 0's stream when
    /// part 0 waits for it, else on `caller`'s. `caller` follows the work unless `follow` is
    /// false (its stream is capturing a graph). A failure aborts the communicator (its other
    /// ranks would wait for this work).
    pub(crate) fn run(&self, g: Gathered, caller: &Stream, follow: bool, seq: u64, work: Work<'_>) -> Result<()> {
        self.run_on(g, caller.device(), Some((caller, follow)), seq, work)
    }

    /// Hands operation `seq` (`entry`, using `uses`) to the persistent kernel for the group's
    /// only member (a rank alone on its GPU), whose `stream` trails the kernel
    /// ([`Stream::post_deferred`]): what [`GpuGroup::meet`] and [`GpuGroup::run`] do for a group of
    /// one, without a meeting (nobody to meet or to publish to). The ring slot is written
    /// before the copy that reads it is submitted, as in a meeting; the stream follows the
    /// hand-over, and the slot keeps its completion. A failure to queue it aborts the
    /// communicator, as the last member's does: the kernel would wait for operation `seq`
    /// for ever.
    pub(crate) fn hand_over_alone(
        &self,
        stream: &Stream,
        seq: u64,
        entry: &RankOp,
        mut uses: LaunchTracking,
        sync: Result<(Window, u64)>,
    ) -> Result<()> {
        debug_assert_eq!(self.members.len(), 1, "a group of one");
        let result = (|| {
            let sync = sync?;
            let ring = self.ring(stream.device())?;
            ring.write(seq, 0, entry);
            phases::mark(Phase::Arrive);
            self.hold_ring(&mut uses);
            let (seq_word, completed_word) = sync_words(&sync, &mut uses);
            // SAFETY: as `run_on`'s hand-over: aligned words of the persistent kernel's live
            // sync block (held by `uses`), which only this member's stream writes; the slot of
            // both rings (held by `uses`, kept by the kernel), written above and rewritten only
            // after this operation completes (`slot_used`); `PIPELINE` < `RING_SLOTS`.
            unsafe { stream.post_deferred(uses, ring.slot_copy(seq), seq_word, completed_word, seq, PIPELINE) }
        })();
        phases::mark(Phase::Driver);
        match &result {
            Ok(c) => {
                stream.follow(c.clone());
                self.slot_used(seq, c);
            }
            Err(e) => self.control.abort(e.clone()),
        }
        self.meeting_over(seq);
        phases::mark(Phase::Publish);
        result.map(drop)
    }

    /// [`GpuGroup::run`] by the member `caller` (which follows the work if its flag says
    /// so), or by the group's launcher (`None`: a shared launch, which every member follows
    /// already).
    fn run_on(
        &self,
        mut g: Gathered,
        dev: &crate::Device,
        caller: Option<(&Stream, bool)>,
        seq: u64,
        work: Work<'_>,
    ) -> Result<()> {
        let mut uses = g.uses.take().unwrap_or_else(|| LaunchTracking::new(dev));
        let on = match (&work, caller) {
            (Work::Launch { .. }, _) => self.launch_stream(dev)?.share(),
            (Work::Persistent { .. }, Some((c, _))) => g.launch_stream.take().unwrap_or_else(|| c.share()),
            (Work::Persistent { .. }, None) => {
                return Err(Error::InvalidArgument(
                    "a hand-over to the persistent kernel needs a member's stream".into(),
                ));
            }
        };
        let stream = &on;
        let launch = matches!(work, Work::Launch { .. });
        if !launch {
            self.hold_ring(&mut uses);
        }
        let staged = g.staged.take();
        let result = (|| -> Result<Completion> {
            for e in &g.events {
                stream.wait_for(e)?;
            }
            // The entries' copy on their own stream where it can go (`LaunchEntries`).
            let mut copy = staged.as_ref().map(|s| s.copy);
            if let (Some(s), Some(r)) = (&staged, self.ring.get()) {
                // SAFETY: the launcher acquired and wrote the block for this launch, the next
                // on the launch stream (`launch_meetings`).
                if unsafe { r.entries.copy_before(s, stream) }? {
                    copy = None;
                }
            }
            phases::mark(Phase::StreamWaits);
            match work {
                Work::Launch { module, threads } => {
                    // The LL kernel, when every entry is an LL call: the general one's LL
                    // path alone, with the same contract for such entries.
                    let launch = g.launch.take().ok_or_else(|| {
                        Error::InvalidArgument("a shared launch without its parameter (a batch's later call)".into())
                    })?;
                    let ll_only = super::ll_kernels() && g.ll_only == Some(true);
                    let (kernel, threads) = if ll_only {
                        (&coll_ll_group_launch, super::ll_threads(dev, module, &self.ll_threads))
                    } else {
                        (&coll_gpu_group_launch, threads)
                    };
                    let cfg = kernel_config(launch.count * launch.ctas_per_rank, threads);
                    // Its place in the launch stream's order, as the members' completions (of
                    // several calls, the last one's).
                    let mut uses = uses;
                    uses.order = seq;
                    if launch.operations > 1
                        && let Some(r) = self.ring.get()
                    {
                        uses.holds.push(lock(&r.grid_sync).uses().clone());
                    }
                    let param = GroupParam(&*launch);
                    // SAFETY: `coll_gpu_group_launch`'s contract: every served member's entry
                    // is in the parameter (a live communicator and an operation whose windows
                    // and output hold this launch's completion: each member noted it, pending,
                    // before its call returned, in `meet`); every rank of the communicator
                    // makes this call (collective) with the same grid per rank; barriers
                    // 0..ctas of each rank's device communicator serve one collective at a
                    // time (shared launches run in order on the launch stream, after the
                    // members' arrivals, which follow their earlier work); shared
                    // memory per `kernel_config`. Entries in device memory: the copy before
                    // the launch writes them (on this stream, or on the entries' stream that
                    // this one waits for; the block, held by `uses`, is the launch's alone
                    // until it has finished: `LaunchEntries`).
                    let c = unsafe { stream.launch_tracked_after_copy(module, kernel, cfg, (&param,), uses, copy) }?;
                    if let (Some(s), Some(r)) = (&staged, self.ring.get()) {
                        r.entries.used(s.block, &c);
                    }
                    Ok(c)
                }
                Work::Persistent { sync, wait } => {
                    let mut uses = uses;
                    let (seq_word, completed_word) = sync_words(&sync, &mut uses);
                    let copy =
                        self.ring.get().map(|r| r.slot_copy(seq)).ok_or_else(|| {
                            Error::InvalidArgument("persistent mode: the GPU group has no ring".into())
                        })?;
                    let writes = [(seq_word, seq, 8u32)];
                    // SAFETY: aligned words of the persistent kernel's live sync block (a
                    // window slot that the kernel keeps and `uses` holds), written by streams
                    // only here, one meeting at a time; the kernel raises `completed` in order
                    // of operations; `uses` covers what the operation uses. The copy: the
                    // slot of both rings (the ring is held by `uses`, kept by the kernel);
                    // the host slot was written before this meeting ended and is rewritten
                    // only after this operation completes; the kernel reads the device slot
                    // only for this operation, after `seq` (written after the copy) shows it,
                    // and a stream runs at most `PIPELINE` (< RING_SLOTS) operations ahead.
                    unsafe {
                        match wait {
                            Wait::Now => stream.post(uses, Some(copy), &writes, Some((completed_word, seq))),
                            Wait::Never => stream.post(uses, Some(copy), &writes, None),
                        }
                    }
                }
            }
        })();
        if let (Ok(c), Some((caller, true))) = (&result, caller) {
            caller.follow(c.clone());
        }
        phases::mark(Phase::Follow);
        match &result {
            Ok(c) if !launch => self.slot_used(seq, c),
            Ok(_) => {}
            Err(e) => self.control.abort(e.clone()),
        }
        g.publish(&result);
        phases::mark(Phase::Publish);
        result.map(drop)
    }

    /// Makes the ring now (a call that may allocate: before any of the group's kernels
    /// runs).
    pub(crate) fn prepare(&self, dev: &crate::Device) -> Result<()> {
        self.ring(dev).map(drop)
    }

    fn ring(&self, dev: &crate::Device) -> Result<&Arc<Ring>> {
        if let Some(r) = self.ring.get() {
            return Ok(r);
        }
        let _making = lock(&self.making);
        if self.ring.get().is_none() {
            let r = Arc::new(Ring::new(dev, self.members.len())?);
            let _ = self.ring.set(r);
        }
        Ok(self.ring.get().expect("made above"))
    }

    /// The stream that the group's shared launches go on: one stream of the group's, so
    /// that every member knows where its call's launch goes before the last member queues it
    /// (its completion is recorded under this stream's id: see [`PendingLaunch`]), and
    /// consecutive launches follow each other with no event between them. Watched by the
    /// communicator's watchdog for failures, as a member's stream.
    pub(crate) fn launch_stream(&self, dev: &crate::Device) -> Result<&Stream> {
        self.launch_stream_and_id(dev).map(|(s, _)| s)
    }

    fn launch_stream_and_id(&self, dev: &crate::Device) -> Result<&(Stream, StreamId)> {
        if let Some(s) = self.launch_stream.get() {
            return Ok(s);
        }
        let _making = lock(&self.making);
        if self.launch_stream.get().is_none() {
            let s = dev.create_stream()?;
            let observer: ObserverRef =
                Arc::downgrade(&(self.control.clone() as Arc<dyn crate::runtime::stream::StreamObserver>));
            s.core().add_observer(observer);
            self.control.watch_stream(
                format!("the shared launch stream of ranks {:?} (one GPU)", self.members),
                Arc::downgrade(s.core()),
            );
            let id = s.id();
            let _ = self.launch_stream.set((s, id));
        }
        Ok(self.launch_stream.get().expect("made above"))
    }

    /// `rank`'s part in the kernel.
    pub(crate) fn part_of(&self, rank: usize) -> usize {
        self.members.iter().position(|&r| r == rank).expect("a member of its own group")
    }

    /// Whether one kernel can serve every member (at most [`MAX_LOCAL_RANKS`]).
    pub(crate) fn fits(&self) -> bool {
        self.members.len() <= MAX_LOCAL_RANKS
    }

    /// Tracks the ring in `t` as held by the work (it reads it).
    pub(crate) fn hold_ring(&self, t: &mut LaunchTracking) {
        if let Some(r) = self.ring.get() {
            t.holds.push(r.mem.uses.clone());
            t.holds.push(r.device.uses().clone());
        }
    }

    /// Tracks the ring in `t` as kept by long-lived work (the persistent kernel).
    pub(crate) fn keep_ring(&self, t: &mut LaunchTracking) {
        if let Some(r) = self.ring.get() {
            t.keeps.push(r.mem.uses.clone());
            t.keeps.push(r.device.uses().clone());
        }
    }

    /// Takes `part` of meeting `(purpose, seq)` (see the [module docs](self)). Returns
    /// `Some` to the last member to arrive, which does the work and publishes it (but for a
    /// shared launch with the launcher thread, the default: the last member queues the
    /// meeting for the launcher and gets `None` too). The others
    /// return at once without `wait`; for a shared launch ([`Purpose::Launch`]) at once too,
    /// their stream following the launch to come and their part's resources holding it
    /// ([`PendingLaunch`]); else once their stream waits for the work. Members must agree on
    /// `ctas` (every rank computes it from the same call): a mismatch is logged as an error
    /// and the kernel runs with the largest, so that nothing waits for ever (the barriers'
    /// timeouts report the mismatched ranks).
    pub(crate) fn meet(
        self: &Arc<Self>,
        dev: &crate::Device,
        purpose: Purpose,
        seq: u64,
        part: Part<'_>,
    ) -> Result<Option<Gathered>> {
        let since = Instant::now();
        let Part { rank, entry, comm_image, served, control, sync, ctas, uses, stream, wait } = part;
        let p = self.part_of(rank);
        // Whether a complete meeting goes to the launcher thread (a shared launch).
        let to_launcher = purpose == Purpose::Launch && launcher_mode() == LauncherMode::Thread;
        if purpose == Purpose::Launch {
            self.within_reach(rank, seq)?;
            phases::mark(Phase::RunAhead);
            if to_launcher {
                self.launch_dev.get_or_init(|| dev.clone());
            }
        }
        // A shared launch's member that fails before it arrives leaves its meeting half full
        // for good (no one waits on it to time out, later meetings go on): abort, so that the
        // communicator needs `recover`, which empties the meeting's slot (`LaunchSlot`).
        let fail_unarrived = |e: Error| {
            if purpose == Purpose::Launch {
                self.control.abort(e.clone());
            }
            e
        };
        let ring = self.ring(dev).map_err(fail_unarrived)?;
        if let Some(e) = &entry
            && purpose != Purpose::Launch
        {
            ring.write(seq, p, e);
        }
        // The arrival, outside the meeting's lock (the members record theirs at once; in a
        // loop of collectives it is the previous one's completion, recorded already). The
        // last member's counts too: the work goes on another stream.
        let mut events: Vec<Completion> = match stream {
            Some(s) if self.members.len() > 1 => vec![s.arrival().map_err(fail_unarrived)?],
            _ => Vec::new(),
        };
        let launch_stream = match stream {
            Some(s) if p == 0 && wait.is_some() && purpose != Purpose::Launch => Some(s.share()),
            _ => None,
        };
        // A member of a shared launch returns before it is queued, and does its part's
        // tracking itself, outside the meeting (the last member's launch then tracks nothing
        // per member): the launch waits for other streams' uses of its resources (its own
        // stream's are before its arrival), and it notes the launch's completion to come in
        // them ([`PendingLaunch`]) before it returns.
        let (uses, early) = match (purpose, stream, wait) {
            (Purpose::Launch, Some(s), Some(_)) => {
                let on = self.launch_stream_and_id(dev).map_err(fail_unarrived)?.1;
                if let Err(e) = uses.check() {
                    // The others would wait for this member: end their wait.
                    self.control.abort(e.clone());
                    return Err(e);
                }
                events.extend(uses.foreign_pending(on).into_iter().filter(|c| c.stream() != s.id()));
                // The launch stream follows its own launches: an arrival that is one of them
                // (in a loop of collectives, the previous call's) needs no wait, and the
                // launcher then takes in no completion of the member's.
                events.retain(|c| c.stream() != on);
                if events.is_empty() {
                    // Freed here, not by the launcher thread: a free into this thread's
                    // allocator arena from another thread takes that arena's lock.
                    events = Vec::new();
                }
                self.register_observers(dev, p, &uses).map_err(fail_unarrived)?;
                phases::mark(Phase::Uses);
                (None, Some((s, on, uses)))
            }
            _ => (Some(uses), None),
        };
        let entry = entry.filter(|_| purpose == Purpose::Launch).map(|e| {
            let comm = comm_image.unwrap_or_else(|| Arc::new(CommImage(e.comm)));
            debug_assert!(comm.0 == e.comm, "a member's comm image is its entry's device communicator");
            LaunchEntry { op: e.op, comm }
        });
        let arrival = Arrival { part: p, entry, served, control, sync, ctas, uses, launch_stream, events };
        let mut handed_over = None;
        let (outcome, complete) = if purpose == Purpose::Launch {
            // A shared launch's meeting: its slot, with no lock that the members share (see
            // `LaunchSlot`).
            let slot = &self.launch_slots[(seq % LAUNCH_SLOTS as u64) as usize];
            debug_assert!(self.members.len() <= MAX_LOCAL_RANKS, "shared launches need `fits`");
            let arrived = slot.arrive(arrival);
            phases::mark(Phase::Arrive);
            match arrived {
                SlotArrival::Early(outcome) => {
                    if wait.is_none() {
                        return Ok(None);
                    }
                    (Some(outcome), None)
                }
                SlotArrival::Last(m) => {
                    let taken = if to_launcher {
                        let outcome = m.outcome.clone();
                        // In order: see `LaunchSlot`.
                        handed_over = Some(self.hand_over(seq, m));
                        (Some(outcome), None)
                    } else {
                        (None, Some(m))
                    };
                    // Before this member arrives at any later meeting (`LaunchSlot::reset`).
                    self.last_complete.fetch_max(seq, Ordering::Release);
                    slot.reset();
                    taken
                }
                SlotArrival::Stale => {
                    let e = Error::Aborted(format!(
                        "rank {rank}'s collective call #{seq} found an unfinished earlier call in its meeting place (a rank \
                         failed before it arrived); recover the communicator"
                    ));
                    self.control.abort(e.clone());
                    return Err(e);
                }
                SlotArrival::Lost(outcome) => {
                    // A bit without its cell: only a `resync` racing a meeting leaves that.
                    let e =
                        Error::Aborted(format!("GPU group meeting #{seq} lost an arrival (a recovery during a call?)"));
                    self.control.abort(e.clone());
                    outcome.set(Err(e.clone()));
                    return Err(e);
                }
            }
        } else {
            let mut meetings = lock(&self.meetings);
            let m = meetings.entry((purpose, seq)).or_insert_with(|| Meeting {
                arrivals: Vec::with_capacity(self.members.len()),
                outcome: Arc::default(),
            });
            m.arrivals.push(arrival);
            let last = m.arrivals.len() == self.members.len();
            phases::mark(Phase::Arrive);
            if last && to_launcher {
                // Queued under the meetings' lock: in order (see `Launcher`).
                let m = meetings.remove(&(purpose, seq)).expect("the meeting arrived at");
                let outcome = m.outcome.clone();
                handed_over = Some(self.hand_over(seq, m));
                (Some(outcome), None)
            } else if last {
                (None, meetings.remove(&(purpose, seq)))
            } else if wait.is_none() {
                return Ok(None);
            } else {
                (Some(m.outcome.clone()), None)
            }
        };
        if let Some(start) = handed_over {
            self.wake_launcher(start);
            phases::mark(Phase::HandOver);
        }
        let mut outcome =
            Some(outcome.unwrap_or_else(|| complete.as_ref().expect("the last member's").outcome.clone()));
        if let Some((s, launch_stream, mine)) = early {
            let link = self.links[p]
                .get_or_init(|| Arc::new(MemberLink { group: Arc::downgrade(self), log: self.log.clone(), rank }));
            // (The outcome moved, not cloned: its count is one that every member changes.)
            let outcome = outcome.take().expect("taken once");
            let pending = PendingLaunch { link: link.clone(), seq, outcome, since };
            // At the launch's place in the launch stream's order: a resource keeps the later.
            let c = Completion::ordered(Arc::new(pending), launch_stream, seq);
            // Before returning: the caller may drop what the launch uses at once.
            mine.note(&c);
            phases::mark(Phase::Note);
            s.follow(c);
            if complete.is_some() {
                phases::mark(Phase::AwaitLast);
            }
        }
        if let Some(m) = complete {
            // Refused when a member gave up on this call already (the communicator is
            // aborted): then nothing runs.
            m.outcome.claim(&self.log, purpose == Purpose::Launch)?;
            // Until `Gathered` owns the work: a panic while gathering must not leave it taken
            // for ever (members would wait on it with no timeout).
            let taken = Taken { group: self, outcome: m.outcome.clone(), seq, held: true };
            let g = self.gather(purpose, seq, ring, m, EntrySink::Own);
            taken.release();
            phases::mark(Phase::Gather);
            return Ok(Some(g));
        }
        if purpose == Purpose::Launch {
            phases::mark(Phase::AwaitLast);
            return Ok(None);
        }
        let outcome = outcome.expect("only a shared launch's member takes it");
        let done = self.await_outcome(rank, purpose, seq, &outcome, since, true).expect("a blocking wait ends")?;
        stream.expect("a waiting member has a stream").follow(done);
        phases::mark(Phase::AwaitLast);
        Ok(None)
    }

    /// Registers member `part`'s observers (what explains its stream's failures) with the
    /// launch stream, as its launches' tracking would, when they changed since its last call
    /// (registering takes the launch stream's observer list, which the launcher reads).
    fn register_observers(&self, dev: &crate::Device, part: usize, uses: &LaunchTracking) -> Result<()> {
        let mut known = lock(&self.observed[part]);
        // (`Weak`s kept: their allocations are not reused while held, so equal is the same.)
        if known.len() == uses.observers.len() && known.iter().zip(&uses.observers).all(|(k, w)| Weak::ptr_eq(k, w)) {
            return Ok(());
        }
        let launch_stream = self.launch_stream(dev)?;
        for o in &uses.observers {
            launch_stream.core().add_observer(o.clone());
        }
        known.clone_from(&uses.observers);
        Ok(())
    }

    /// Queues complete meeting `seq` for the launcher (before its last member arrives at the
    /// next meeting); returns what [`GpuGroup::wake_launcher`] must do.
    fn hand_over(&self, seq: u64, m: Meeting) -> LauncherStart {
        let mut q = lock(&self.launcher.queue);
        q.ready.push_back((seq, m));
        // SeqCst: see `Launcher`.
        self.launcher.pending.fetch_add(1, Ordering::SeqCst);
        if q.running {
            LauncherStart::Wake
        } else {
            q.running = true;
            LauncherStart::Spawn
        }
    }

    /// Starts the launcher thread, or wakes it if it sleeps. If no thread can be made, this
    /// (the member's) thread launches what is queued.
    fn wake_launcher(self: &Arc<Self>, start: LauncherStart) {
        match start {
            LauncherStart::Wake => {
                if self.launcher.asleep.load(Ordering::SeqCst)
                    && let Some(t) = lock(&self.launcher.queue).thread.clone()
                {
                    t.unpark();
                }
            }
            LauncherStart::Spawn => {
                let group = self.clone();
                let made =
                    std::thread::Builder::new().name("ferrolink-launch".into()).spawn(move || group.launcher_main());
                if let Err(e) = made {
                    tracing::warn!(target: "ferrolink::coll", error = %e,
                        "could not start a GPU group's launcher thread; the member launches");
                    // `running` stays set until the queue is empty under its lock: one
                    // launcher at a time (work queued meanwhile is launched here too).
                    loop {
                        self.launch_queued();
                        let mut q = lock(&self.launcher.queue);
                        if q.ready.is_empty() {
                            q.running = false;
                            break;
                        }
                    }
                }
            }
        }
    }

    /// The launcher thread: launches queued meetings until it has had none for
    /// [`LAUNCHER_IDLE_EXIT`].
    fn launcher_main(self: Arc<Self>) {
        lock(&self.launcher.queue).thread = Some(std::thread::current());
        let mut idle_since = Instant::now();
        loop {
            if self.launch_queued() {
                idle_since = Instant::now();
                continue;
            }
            let idle = idle_since.elapsed();
            if idle < spin() {
                std::hint::spin_loop();
                continue;
            }
            if idle >= LAUNCHER_IDLE_EXIT {
                let mut q = lock(&self.launcher.queue);
                if q.ready.is_empty() {
                    q.running = false;
                    q.thread = None;
                    tracing::debug!(target: "ferrolink::coll", members = ?self.members,
                        launches_of_several_calls = self.batched_launches(), "a GPU group's launcher ends (idle)");
                    return;
                }
                continue;
            }
            // SeqCst: see `Launcher`.
            self.launcher.asleep.store(true, Ordering::SeqCst);
            if self.launcher.pending.load(Ordering::SeqCst) == 0 {
                std::thread::park_timeout(Duration::from_millis(10));
            }
            self.launcher.asleep.store(false, Ordering::SeqCst);
        }
    }

    /// Launches the queued meetings, in order, several in one launch where they can be
    /// ([`GpuGroup::batch_limit`]); whether there were any.
    fn launch_queued(self: &Arc<Self>) -> bool {
        if self.launcher.pending.load(Ordering::SeqCst) == 0 {
            return false;
        }
        #[cfg(test)]
        if self.launcher.hold.load(Ordering::SeqCst) {
            return false;
        }
        let limit = self.batch_limit();
        loop {
            // Meetings given up: dropped after the queue's lock, as in `resync` (dropping what
            // their arrivals hold may retire memory, which queries completions).
            let (batch, popped, refused) = {
                let mut q = lock(&self.launcher.queue);
                let Some(first) = q.ready.pop_front() else { return true };
                let ctas = first.1.arrivals.first().map_or(0, |a| a.ctas);
                let mut batch = vec![first];
                if batchable(&batch[0].1, ctas) {
                    while batch.len() < limit && q.ready.front().is_some_and(|(_, m)| batchable(m, ctas)) {
                        batch.push(q.ready.pop_front().expect("looked at"));
                    }
                }
                let popped = batch.len();
                // Taken while still under the queue's lock: `resync` (recovery) drains the
                // queue under it, so a meeting is either given up there or taken here
                // before the recovery can end, never taken after it.
                let (batch, given_up): (Vec<_>, Vec<_>) = batch.into_iter().partition(|(seq, m)| {
                    match m.outcome.claim(&self.log, true) {
                        Ok(()) => true,
                        Err(e) => {
                            // A member gave the call up, or the communicator was aborted.
                            tracing::debug!(target: "ferrolink::coll", seq, error = %e, "a shared launch was given up");
                            false
                        }
                    }
                });
                (batch, popped, given_up)
            };
            drop(refused);
            self.launcher.pending.fetch_sub(popped, Ordering::SeqCst);
            if batch.is_empty() {
                continue;
            }
            phases::begin();
            let first = batch[0].0;
            let launched = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.launch_meetings(batch)));
            if launched.is_err() {
                // (`Taken` and `Gathered` have failed the meetings: the members know.)
                let e = Error::Aborted(format!("the launcher of a GPU group panicked while launching call #{first}"));
                self.control.abort(e);
            }
        }
    }

    /// How many launches carried more than one call so far.
    pub(crate) fn batched_launches(&self) -> u64 {
        self.launcher.batched.load(Ordering::Relaxed)
    }

    /// How many launches so far carried their entries in device memory ([`LaunchEntries`]).
    #[cfg(test)]
    pub(crate) fn device_entry_launches(&self) -> u64 {
        self.launcher.device_entries.load(Ordering::Relaxed)
    }

    /// How many launches so far ran several LL calls with no grid meeting between them.
    #[cfg(test)]
    pub(crate) fn unmet_launches(&self) -> u64 {
        self.launcher.unmet.load(Ordering::Relaxed)
    }

    /// Tests: makes the launcher leave queued calls alone (`true`) or take them again.
    #[cfg(test)]
    pub(crate) fn hold_launches(&self, hold: bool) {
        self.launcher.hold.store(hold, Ordering::SeqCst);
    }

    /// How many calls one shared launch may carry: [`MAX_LAUNCH_OPERATIONS`] (their entries
    /// in device memory when the parameter's [`MAX_LAUNCH_ENTRIES`] do not hold them, see
    /// [`LaunchEntries`]; `FERROLINK_GROUP_DEVICE_ENTRIES=0`: only as many as the parameter
    /// holds), at most `FERROLINK_GROUP_BATCH` (1: one call per launch).
    fn batch_limit(&self) -> usize {
        static LIMIT: OnceLock<(usize, bool)> = OnceLock::new();
        let (wanted, device) = *LIMIT.get_or_init(|| {
            let var = |name: &str| std::env::var(name).ok().map(|v| v.trim().to_string());
            let wanted = var("FERROLINK_GROUP_BATCH").and_then(|v| v.parse().ok()).unwrap_or(usize::MAX);
            (wanted, var("FERROLINK_GROUP_DEVICE_ENTRIES").as_deref() != Some("0"))
        });
        let in_param = MAX_LAUNCH_ENTRIES / self.members.len().max(1);
        let most = if device { MAX_LAUNCH_OPERATIONS.max(in_param) } else { in_param };
        most.min(wanted).max(1)
    }

    /// The launcher's share of complete meetings `batch` (in order, claimed): what the last member
    /// does with the last-member launcher ([`GpuGroup::meet`], then [`GpuGroup::run`]), for
    /// all of them in one launch whose CTAs meet between the calls.
    fn launch_meetings(self: &Arc<Self>, batch: Vec<(u64, Meeting)>) {
        let dev = self.launch_dev.get().expect("set by the members before a hand-over");
        let Ok(ring) = self.ring(dev) else {
            // (Made before any call.) Each `Taken` fails its call.
            for (seq, m) in batch {
                drop(Taken { group: self, outcome: m.outcome.clone(), seq, held: true });
            }
            return;
        };
        let count = self.members.len();
        let operations = batch.len();
        // More entries than the parameter holds: they go through a block of device memory.
        let block = (operations > 1 && operations * count > MAX_LAUNCH_ENTRIES).then(|| {
            let block = ring.entries.acquire();
            phases::mark(Phase::EntriesWait);
            block
        });
        let mut gathered: Vec<(u64, Gathered)> = Vec::with_capacity(operations);
        // (Each meeting was claimed when it was taken from the queue.)
        for (seq, m) in batch {
            let taken = Taken { group: self, outcome: m.outcome.clone(), seq, held: true };
            // The batch's meetings are all served (`batchable`), so none is dropped below and
            // call `j` of the launch is the `j`th gathered.
            let base = gathered.len() * count;
            let sink = match (block, gathered.first_mut()) {
                (Some(block), _) => EntrySink::Block { entries: &ring.entries, block, base },
                (None, Some((_, first))) => {
                    EntrySink::Param { launch: first.launch.as_mut().expect("the first call's parameter"), base }
                }
                (None, None) => EntrySink::Own,
            };
            let g = self.gather(Purpose::Launch, seq, ring, m, sink);
            taken.release();
            if g.nothing_served() {
                g.discard();
            } else {
                gathered.push((seq, g));
            }
        }
        phases::mark(Phase::Gather);
        let mut gathered = gathered.into_iter();
        // (A block acquired and left unused is free again: `acquire` took its last use.)
        let Some((mut seq, mut first)) = gathered.next() else { return };
        let rest: Vec<(u64, Gathered)> = gathered.collect();
        if !rest.is_empty() {
            let operations = 1 + rest.len();
            debug_assert!(block.is_some() || operations * count <= MAX_LAUNCH_ENTRIES);
            let sync = lock(&ring.grid_sync).addr();
            first.ll_only = Some(first.ll_only == Some(true) && rest.iter().all(|(_, g)| g.ll_only == Some(true)));
            if let Some(block) = block {
                let (addr, staged) = ring.entries.staged(block, operations * count);
                first.launch.as_mut().expect("the first call's parameter").entries = addr;
                first.staged = Some(staged);
                let uses = first.uses.get_or_insert_with(|| LaunchTracking::new(dev));
                uses.holds.push(ring.entries.mem.uses.clone());
                uses.holds.push(ring.entries.device.uses().clone());
                self.launcher.device_entries.fetch_add(1, Ordering::Relaxed);
            }
            let mut batch = Vec::with_capacity(rest.len());
            for (s, mut g) in rest {
                first.events.append(&mut g.events);
                if let Some(theirs) = g.uses.take() {
                    match first.uses.as_mut() {
                        Some(u) => u.absorb(theirs),
                        None => first.uses = Some(theirs),
                    }
                }
                seq = s;
                batch.push(g);
            }
            self.launcher.batched.fetch_add(1, Ordering::Relaxed);
            // LL calls of one CTA per rank in the LL kernel go on from call to call without
            // the grid meeting (`serve_launch`'s ordering note says why that suffices).
            let launch = first.launch.as_mut().expect("the first call's parameter");
            let unmet =
                first.ll_only == Some(true) && super::ll_kernels() && launch.ctas_per_rank == 1 && !ll_grid_meetings();
            if unmet {
                self.launcher.unmet.fetch_add(1, Ordering::Relaxed);
            }
            launch.operations = operations as u32;
            launch.grid_sync = if unmet { 0 } else { sync };
            first.batch = batch;
            phases::mark(Phase::Merge);
        } else {
            // (A block is taken for batches of several calls, all served: never for one.)
            assert!(block.is_none(), "a batch's entries in a block belong to a launch of several calls");
        }
        let result = dev.builtin_module().and_then(|module| {
            self.run_on(first, dev, None, seq, Work::Launch { module, threads: super::threads(dev) })
        });
        if let Err(e) = result {
            // (`run_on` aborted the communicator: the members see it.)
            tracing::debug!(target: "ferrolink::coll", seq, error = %e, "a shared launch failed");
        }
    }

    /// Notes that meeting `seq`'s work was queued (or failed, or was not needed), and wakes
    /// the members waiting to run further ahead.
    fn meeting_over(&self, seq: u64) {
        // SeqCst with `within_reach`: either a sleeper set its target before this reads it
        // (and is woken under the lock it holds until it sleeps), or it sees `seq`. Only a
        // reached target wakes (a wake-up is a system call on the launching member's path).
        let over = self.meetings_over.fetch_max(seq, Ordering::SeqCst).max(seq);
        if self.reach_sleepers.load(Ordering::SeqCst) > 0 && over >= self.reach_target.load(Ordering::SeqCst) {
            let _g = lock(&self.reach);
            self.reach_target.store(u64::MAX, Ordering::SeqCst);
            self.reach_wake.notify_all();
        }
    }

    /// Waits until `rank`'s call `seq` is at most [`RUN_AHEAD`] beyond the meetings that are
    /// over. An abort ends the wait with its error; the communicator's timeout with an error
    /// naming the ranks that have not made the oldest open call (and aborts the communicator).
    fn within_reach(&self, rank: usize, seq: u64) -> Result<()> {
        if seq <= self.meetings_over.load(Ordering::SeqCst).saturating_add(RUN_AHEAD) {
            return Ok(());
        }
        // Once it waits, until it is half as far ahead: members that run ahead then sleep
        // once per RUN_AHEAD / 2 calls, not at every meeting's end.
        let target = seq.saturating_sub(RUN_AHEAD / 2);
        let reached = || self.meetings_over.load(Ordering::SeqCst) >= target;
        let config = self.control.config();
        let since = Instant::now();
        let mut next_report = config.progress_interval;
        let mut g = lock(&self.reach);
        self.reach_sleepers.fetch_add(1, Ordering::SeqCst);
        let result = loop {
            // (Set again at every look: a wake-up clears it.)
            self.reach_target.fetch_min(target, Ordering::SeqCst);
            if reached() {
                break Ok(());
            }
            if self.control.is_aborted() {
                break Err(self.control.error().unwrap_or_else(|| Error::Aborted("the communicator".into())));
            }
            let waited = since.elapsed();
            let over = config.timeout.is_some_and(|t| waited >= t);
            if over || waited >= next_report {
                let oldest = self.meetings_over.load(Ordering::SeqCst) + 1;
                let missing = self.missing(Purpose::Launch, oldest);
                let whom = if missing.is_empty() {
                    "the launcher thread of the ranks sharing its GPU to queue".to_string()
                } else {
                    format!("ranks {missing:?} sharing its GPU to make")
                };
                let why = format!(
                    "rank {rank} is {RUN_AHEAD} collective calls ahead of its GPU's shared launches and waits for \
                     {whom} call #{oldest} (waited {:.1}s)",
                    waited.as_secs_f64()
                );
                if over {
                    let err = Error::WaitTimeout(format!("{why}, over the communicator's timeout (FERROLINK_TIMEOUT)"));
                    self.control.abort(err.clone());
                    break Err(err);
                }
                tracing::warn!(target: "ferrolink::coll", "{why}");
                while next_report <= waited {
                    next_report += config.progress_interval;
                }
            }
            g = self.reach_wake.wait_timeout(g, Duration::from_millis(20)).unwrap_or_else(|e| e.into_inner()).0;
        };
        self.reach_sleepers.fetch_sub(1, Ordering::SeqCst);
        drop(g);
        result
    }

    /// The last member's gathering of meeting `(purpose, seq)`'s arrivals into the work's
    /// parameters (outside the meetings' lock).
    fn gather(
        self: &Arc<Self>,
        purpose: Purpose,
        seq: u64,
        ring: &Ring,
        m: Meeting,
        mut sink: EntrySink<'_>,
    ) -> Gathered {
        let mut ranks = LocalRanks {
            ring: ring.device.addr(),
            slots: RING_SLOTS as u32,
            count: self.members.len() as u32,
            ..LocalRanks::default()
        };
        // The parameter: a call's own, or the first of a batch's (which carries the batch).
        let first = match sink {
            EntrySink::Own => true,
            EntrySink::Param { .. } => false,
            EntrySink::Block { base, .. } => base == 0,
        };
        let mut launch = (purpose == Purpose::Launch && first).then(Box::<GroupLaunch>::default);
        // Whether every served entry is an LL call inside one LSA domain (`GroupLaunch::ll_only`).
        let mut ll_only = true;
        let mut events = Vec::with_capacity(m.arrivals.len());
        let (mut uses, mut sync, mut launch_stream): (Option<LaunchTracking>, Option<(Window, u64)>, _) =
            (None, None, None);
        let ctas = m.arrivals.iter().map(|a| a.ctas).max().unwrap_or(0);
        if m.arrivals.iter().any(|a| a.ctas != ctas) {
            tracing::error!(target: "ferrolink::coll", ?purpose, seq, "ranks sharing a GPU asked for different grids");
        }
        for a in m.arrivals {
            ranks.controls[a.part] = a.control;
            if let Some(e) = &a.entry
                && purpose == Purpose::Launch
            {
                let op = e.rank_op();
                ll_only &= op.op.args.proto == ferrolink_device::coll::proto::LL && op.comm.lsa_size == op.comm.nranks;
                match &mut sink {
                    EntrySink::Own => launch.as_mut().expect("made for its own entries").set(a.part, &op),
                    EntrySink::Param { launch, base } => launch.set(*base + a.part, &op),
                    EntrySink::Block { entries, block, base } => entries.put(*block, *base + a.part, &op),
                }
            }
            if !a.served {
                ranks.skip |= 1 << a.part;
            }
            // The sync block: part 0's, else the first brought.
            if let Some((window, addr)) = a.sync
                && (sync.is_none() || a.part == 0)
            {
                ranks.sync = addr;
                sync = Some((window, addr));
            }
            match (uses.as_mut(), a.uses) {
                (Some(u), Some(mine)) => u.absorb(mine),
                (None, mine) => uses = mine,
                (Some(_), None) => {}
            }
            launch_stream = launch_stream.or(a.launch_stream);
            events.extend(a.events);
        }
        ranks.ctas_per_rank = ctas;
        if let Some(launch) = launch.as_mut() {
            (launch.count, launch.ctas_per_rank, launch.skip) = (ranks.count, ranks.ctas_per_rank, ranks.skip);
        }
        Gathered {
            ranks,
            launch,
            events,
            launch_stream,
            uses,
            sync,
            outcome: Some(m.outcome),
            control: self.control.clone(),
            group: self.clone(),
            seq,
            purpose,
            counted: false,
            batch: Vec::new(),
            ll_only: (purpose == Purpose::Launch).then_some(ll_only),
            staged: None,
        }
    }

    /// Notes that the work `c` read the ring slot of operation `seq` (the slot is rewritten
    /// only after it).
    pub(crate) fn slot_used(&self, seq: u64, c: &Completion) {
        if let Some(r) = self.ring.get() {
            lock(&r.last_use)[(seq % RING_SLOTS as u64) as usize] = Some(c.clone());
        }
    }

    /// The outcome of meeting `(purpose, seq)` for `rank`, waiting since `since`: with
    /// `block`, waits on the host for it (logging who it waits for at the progress
    /// interval), else `None` while the work is not queued yet. While the last member has not
    /// taken the work, an abort of the communicator gives it up, and so does the
    /// communicator's timeout (which also aborts it, naming the ranks that did not come).
    fn await_outcome(
        &self,
        rank: usize,
        purpose: Purpose,
        seq: u64,
        o: &Outcome,
        since: Instant,
        block: bool,
    ) -> Option<Result<Completion>> {
        if block {
            let start = Instant::now();
            while !o.ready.load(Ordering::Acquire) && start.elapsed() < spin() {
                std::hint::spin_loop();
            }
        }
        let config = self.control.config();
        let mut next_report = config.progress_interval;
        loop {
            match o.look() {
                Look::Done(r) => return Some(r),
                Look::Launching => {}
                Look::Waiting if self.control.is_aborted() => {
                    let e = self.control.error().unwrap_or_else(|| Error::Aborted("the communicator".into()));
                    o.abandon(&e);
                    continue;
                }
                Look::Waiting => {
                    let waited = since.elapsed();
                    let over = config.timeout.is_some_and(|t| waited >= t);
                    if over || (block && waited >= next_report) {
                        let missing = self.missing(purpose, seq);
                        let why = if missing.is_empty() {
                            format!(
                                "rank {rank} waits on the host for the launcher thread of the ranks sharing its GPU \
                                 to queue collective call #{seq} (waited {:.1}s)",
                                waited.as_secs_f64()
                            )
                        } else {
                            format!(
                                "rank {rank} waits on the host for ranks {missing:?} sharing its GPU to make \
                                 collective call #{seq} ({purpose:?}) (waited {:.1}s): ranks sharing a GPU meet on \
                                 the host, so each must call from a thread of its own (as run_ranks does)",
                                waited.as_secs_f64()
                            )
                        };
                        if over {
                            let err = Error::WaitTimeout(format!(
                                "{why}, over the communicator's timeout (FERROLINK_TIMEOUT)"
                            ));
                            // The abort first (see `LaunchLog`); it ends the other waits too.
                            self.control.abort(err.clone());
                            o.abandon(&err);
                            continue;
                        }
                        tracing::warn!(target: "ferrolink::coll", "{why}");
                        while next_report <= waited {
                            next_report += config.progress_interval;
                        }
                    }
                }
            }
            if !block {
                return None;
            }
            o.sleep(Duration::from_millis(20));
        }
    }

    /// The members that have not arrived at meeting `(purpose, seq)` (world ranks). For a
    /// live communicator (its callers look after an abort first): after one, a member that
    /// failed may leave a meeting half full while later meetings complete.
    fn missing(&self, purpose: Purpose, seq: u64) -> Vec<usize> {
        let arrived: Vec<usize> = if purpose == Purpose::Launch {
            // (The oldest open meeting's slot holds no other meeting: `LaunchSlot`.) The bits
            // first: reading a reset's zeroes acquires the `last_complete` raised before it.
            let arrived = self.launch_slots[(seq % LAUNCH_SLOTS as u64) as usize].arrived();
            if seq <= self.last_complete.load(Ordering::Acquire) {
                return Vec::new(); // every member came (its slot may be reset already)
            }
            arrived
        } else {
            let meetings = lock(&self.meetings);
            meetings.get(&(purpose, seq)).map(|m| m.arrivals.iter().map(|a| a.part).collect()).unwrap_or_default()
        };
        (0..self.members.len()).filter(|p| !arrived.contains(p)).map(|p| self.members[p]).collect()
    }

    /// Checks that `ctas` CTAs per member fit on the GPU at once, given `resident` (the
    /// occupancy API's answer for the whole GPU).
    pub(crate) fn check_resident(&self, ctas: u32, resident: Option<u64>, what: &str) -> Result<()> {
        let grid = u64::from(ctas) * self.members.len() as u64;
        match resident {
            Some(most) if grid > most => Err(Error::InvalidArgument(format!(
                "{what}: {} ranks share this GPU, {ctas} CTAs each: {grid} CTAs must run at once (they wait for \
                 each other) but the GPU holds {most} of this kernel (occupancy API); use fewer CTAs or fewer \
                 ranks per GPU",
                self.members.len()
            ))),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn control() -> Arc<CommControl> {
        Arc::new(CommControl::new(7, crate::CommConfig::from_env(crate::Backend::Cpu).unwrap()))
    }

    /// Part `part`'s arrival with nothing in it but `control` (to tell meetings apart).
    fn bare_arrival(part: usize, control: u64) -> Arrival {
        Arrival {
            part,
            entry: None,
            served: true,
            control,
            sync: None,
            ctas: 1,
            uses: None,
            launch_stream: None,
            events: Vec::new(),
        }
    }

    fn pending(group: &Arc<GpuGroup>, outcome: &Arc<Outcome>, since: Instant) -> PendingLaunch {
        PendingLaunch {
            link: Arc::new(MemberLink { group: Arc::downgrade(group), log: group.log.clone(), rank: 1 }),
            seq: 5,
            outcome: outcome.clone(),
            since,
        }
    }

    #[test]
    fn the_ll_kernel_runs_a_launch_only_when_every_served_entry_is_an_ll_call_inside_one_domain() {
        let entry = |proto: u32, lsa_size: u32, nranks: u32| {
            let mut e = RankOp::default();
            (e.op.args.proto, e.comm.lsa_size, e.comm.nranks) = (proto, lsa_size, nranks);
            e
        };
        let mut launch = GroupLaunch { count: 2, ctas_per_rank: 1, operations: 2, ..GroupLaunch::default() };
        for i in 0..4 {
            launch.set(i, &entry(ferrolink_device::coll::proto::LL, 2, 2));
        }
        assert_eq!(*launch.entry(3), entry(ferrolink_device::coll::proto::LL, 2, 2), "an entry reads back as set");
        assert!(launch.ll_only());
        // A simple-protocol call in the second operation: the general kernel.
        launch.set(3, &entry(ferrolink_device::coll::proto::SIMPLE, 2, 2));
        assert!(!launch.ll_only());
        // ... unless its part is not served by the launch (its rank runs it otherwise).
        launch.skip = 1 << 1;
        assert!(launch.ll_only());
        // An LL entry across LSA domains is not the LL kernel's.
        launch.skip = 0;
        launch.set(3, &entry(ferrolink_device::coll::proto::LL, 1, 2));
        assert!(!launch.ll_only());
        // Entries past the launch's operations are not looked at.
        launch.operations = 1;
        assert!(launch.ll_only());
    }

    #[test]
    fn a_meeting_is_either_launched_with_every_part_or_given_up() {
        let g = Arc::new(GpuGroup::new(vec![0, 1], control()));
        let ordered = |f: &Arc<crate::runtime::lifetime::HostFlag>, seq| Completion::ordered(f.clone(), 3, seq);
        // Given up first: the last member may not take it; the pending completion stands
        // for the launch stream's work so far (none yet: done, nothing to wait for).
        let o = Arc::new(Outcome::default());
        let p = pending(&g, &o, Instant::now());
        assert!(matches!(p.query(), EventState::Pending));
        assert!(o.abandon(&Error::Aborted("test".into())));
        assert!(o.claim(&g.log, true).is_err(), "taken after it was given up");
        assert!(matches!(p.query(), EventState::Done));
        assert!(matches!(p.stand_in(), Some(Ok(None))));
        // While another launch is under way, and until that launch has run, it is pending:
        // a resource's entry for the launch stream may be this call's, which replaced the
        // other launch's.
        let other = Arc::new(Outcome::default());
        other.claim(&g.log, true).expect("taken while waiting");
        assert!(matches!(p.query(), EventState::Pending), "a launch is under way");
        let ran = Arc::new(crate::runtime::lifetime::HostFlag::default());
        g.log.launched(Some(ordered(&ran, 4)));
        other.set(Ok(ordered(&ran, 4)));
        assert!(matches!(p.query(), EventState::Pending), "the launch has not run");
        ran.raise();
        assert!(matches!(p.query(), EventState::Done));
        // Taken first: no member gives it up any more; once queued, the completion is the
        // launch's.
        let o = Arc::new(Outcome::default());
        let p = pending(&g, &o, Instant::now());
        o.claim(&g.log, true).expect("taken while waiting");
        assert!(!o.abandon(&Error::Aborted("test".into())), "given up while being queued");
        assert!(matches!(p.query(), EventState::Pending));
        let flag = Arc::new(crate::runtime::lifetime::HostFlag::default());
        g.log.launched(Some(ordered(&flag, 5)));
        o.set(Ok(ordered(&flag, 5)));
        assert!(matches!(p.query(), EventState::Pending), "the launch has not run");
        flag.raise();
        assert!(matches!(p.query(), EventState::Done));
        assert!(matches!(p.stand_in(), Some(Ok(Some(_)))));
        p.synchronize().expect("the launch ran");
        // An aborted communicator's meetings are not taken any more.
        g.control.abort(Error::Aborted("test".into()));
        assert!(Arc::new(Outcome::default()).claim(&g.log, true).is_err());
        assert_eq!(g.log.launching.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_member_runs_at_most_run_ahead_calls_beyond_the_meetings_over() {
        let mut config = crate::CommConfig::from_env(crate::Backend::Cpu).unwrap();
        config.timeout = Some(Duration::from_millis(100));
        let control = Arc::new(CommControl::new(7, config));
        let g = Arc::new(GpuGroup::new(vec![0, 1], control.clone()));
        g.within_reach(0, RUN_AHEAD).expect("within reach of meeting 0");
        // A member waiting to make call RUN_AHEAD + 2 goes on once it is half as far ahead:
        // when meeting RUN_AHEAD / 2 + 2 is over, not meeting 2.
        std::thread::scope(|s| {
            let waiter = s.spawn(|| g.within_reach(0, RUN_AHEAD + 2));
            // Once it sleeps (not before: then the wake-up would go untested).
            while g.reach_sleepers.load(Ordering::SeqCst) == 0 {
                std::thread::yield_now();
            }
            g.meeting_over(2);
            assert!(!waiter.is_finished(), "half as far ahead is not reached yet");
            g.meeting_over(RUN_AHEAD / 2 + 2);
            waiter.join().expect("no panic").expect("woken by the meeting's end");
        });
        // No meeting ends: the communicator's timeout names the ranks of the oldest open call.
        let far = RUN_AHEAD / 2 + 2 + RUN_AHEAD + 1;
        let err = g.within_reach(1, far).expect_err("no meeting ends").to_string();
        let oldest = format!("call #{}", RUN_AHEAD / 2 + 3);
        assert!(
            err.contains("rank 1 is 64 collective calls ahead")
                && err.contains("ranks [0, 1]")
                && err.contains(&oldest),
            "{err}"
        );
        assert!(control.is_aborted(), "the timeout aborts the communicator");
    }

    #[test]
    fn a_pending_launch_past_the_timeout_is_given_up_naming_the_missing_ranks() {
        let mut config = crate::CommConfig::from_env(crate::Backend::Cpu).unwrap();
        config.timeout = Some(Duration::from_millis(50));
        let control = Arc::new(CommControl::new(7, config));
        let g = Arc::new(GpuGroup::new(vec![0, 1, 2], control.clone()));
        let o = Arc::new(Outcome::default());
        // Ranks 0 and 1 arrived; rank 2 did not.
        let arrived = |part| Arrival {
            part,
            entry: None,
            served: true,
            control: 0,
            sync: None,
            ctas: 1,
            uses: Some(LaunchTracking::new(&crate::Device::open_with(crate::Backend::Cpu, 0).expect("a CPU device"))),
            launch_stream: None,
            events: Vec::new(),
        };
        let slot = &g.launch_slots[5];
        for part in [0, 1, 2] {
            let mut cell = lock(&slot.cells[part]);
            // Ranks 0 and 1 took their handles on the outcome; rank 2's is still there.
            (cell.arrival, cell.outcome) = if part < 2 { (Some(arrived(part)), None) } else { (None, Some(o.clone())) };
        }
        slot.arrived.store(0b011, Ordering::Release);
        let p = pending(&g, &o, Instant::now());
        assert!(matches!(p.query(), EventState::Pending), "within the timeout");
        let late = pending(&g, &o, Instant::now() - Duration::from_millis(60));
        // The wait gives up (nothing to wait for: the launch will not run) and the timeout
        // aborts the communicator, whose error names the missing rank.
        late.synchronize().expect("a given-up launch leaves nothing to wait for");
        assert!(control.is_aborted(), "the timeout aborts the communicator");
        let err = control.error().expect("the timeout's error").to_string();
        assert!(err.contains("rank 1 waits on the host for ranks [2]") && err.contains("FERROLINK_TIMEOUT"), "{err}");
        assert!(matches!(p.query(), EventState::Done), "given up, and nothing was launched");
        assert!(o.claim(&g.log, true).is_err(), "the last member, arriving now, does not launch");
        // A meeting that every member came to misses no one, its slot reset or not; the next
        // one, which no member came to yet, misses every member.
        assert_eq!(g.missing(Purpose::Launch, 5), vec![2]);
        g.last_complete.store(5, Ordering::Release);
        assert!(g.missing(Purpose::Launch, 5).is_empty());
        assert_eq!(g.missing(Purpose::Launch, 6), vec![0, 1, 2]);
    }

    #[test]
    fn a_launch_slot_gives_its_meeting_to_the_member_completing_the_set_and_refuses_a_stale_bit() {
        let arrival = |part| bare_arrival(part, 0);
        let slot = LaunchSlot::new(3);
        let first = match slot.arrive(arrival(2)) {
            SlotArrival::Early(o) => o,
            _ => panic!("two members are still to come"),
        };
        assert!(matches!(slot.arrive(arrival(0)), SlotArrival::Early(ref o) if Arc::ptr_eq(o, &first)));
        assert_eq!(slot.arrived(), vec![0, 2]);
        // A member arriving again before the meeting is over (its earlier meeting left half
        // full): refused, the first arrival kept for `drain`.
        assert!(matches!(slot.arrive(arrival(0)), SlotArrival::Stale));
        assert_eq!(slot.arrived(), vec![0, 2]);
        let m = match slot.arrive(arrival(1)) {
            SlotArrival::Last(m) => m,
            _ => panic!("the third member completes the set"),
        };
        let mut parts: Vec<usize> = m.arrivals.iter().map(|a| a.part).collect();
        parts.sort_unstable();
        assert_eq!(parts, vec![0, 1, 2], "every arrival, once");
        assert!(Arc::ptr_eq(&m.outcome, &first), "the outcome that the members hold");
        assert_eq!(slot.arrived(), vec![0, 1, 2], "every member came, until the reset");
        slot.reset();
        assert!(slot.arrived().is_empty());
        // The slot's next meeting has an outcome of its own.
        let next = match slot.arrive(arrival(1)) {
            SlotArrival::Early(o) => o,
            _ => panic!("two members are still to come"),
        };
        assert!(!Arc::ptr_eq(&next, &first));
        let drained = slot.drain().expect("a half-full meeting drains");
        assert_eq!(drained.arrivals.len(), 1);
        assert!(Arc::ptr_eq(&drained.outcome, &next), "the drained meeting's outcome is the one its member holds");
        // After the drain, the slot's meeting has a fresh outcome again.
        assert!(matches!(slot.arrive(arrival(0)), SlotArrival::Early(ref o) if !Arc::ptr_eq(o, &next)));
        slot.drain();
        // A bit without its cell (a recovery racing the meeting): the meeting is lost.
        slot.arrived.store(0b011, Ordering::Release);
        assert!(matches!(slot.arrive(arrival(2)), SlotArrival::Lost(_)));
    }

    #[test]
    fn launch_slots_under_racing_members_give_every_meeting_all_its_arrivals_once() {
        // Members on threads of their own go through 1000 meetings over 8 slots, each at most
        // 4 meetings ahead of the last complete one (the run-ahead bound, scaled down); the
        // member completing a set checks it and resets the slot, as `meet` does.
        const MEMBERS: usize = 4;
        const SLOTS: u64 = 8;
        const AHEAD: u64 = SLOTS / 2;
        const MEETINGS: u64 = 1000;
        let slots: Vec<LaunchSlot> = (0..SLOTS).map(|_| LaunchSlot::new(MEMBERS)).collect();
        let complete = AtomicU64::new(0);
        let taken = AtomicU64::new(0);
        // Per meeting, the outcome its first member to look got (every member must get it).
        let outcomes: Vec<Mutex<Option<Arc<Outcome>>>> = (0..=MEETINGS).map(|_| Mutex::new(None)).collect();
        std::thread::scope(|s| {
            for part in 0..MEMBERS {
                let (slots, complete, taken, outcomes) = (&slots, &complete, &taken, &outcomes);
                let same = move |seq: u64, o: &Arc<Outcome>| {
                    let mut first = lock(&outcomes[seq as usize]);
                    let first = first.get_or_insert_with(|| o.clone());
                    assert!(Arc::ptr_eq(first, o), "meeting {seq}: member {part} got another outcome");
                };
                s.spawn(move || {
                    for seq in 1..=MEETINGS {
                        while seq > complete.load(Ordering::Acquire) + AHEAD {
                            std::thread::yield_now();
                        }
                        let slot = &slots[(seq % SLOTS) as usize];
                        match slot.arrive(bare_arrival(part, seq)) {
                            SlotArrival::Early(o) => same(seq, &o),
                            SlotArrival::Last(m) => {
                                same(seq, &m.outcome);
                                let mut parts: Vec<usize> = m.arrivals.iter().map(|a| a.part).collect();
                                parts.sort_unstable();
                                assert_eq!(parts, (0..MEMBERS).collect::<Vec<_>>(), "meeting {seq}");
                                assert!(m.arrivals.iter().all(|a| a.control == seq), "meeting {seq}: a stray arrival");
                                taken.fetch_add(1, Ordering::Relaxed);
                                complete.fetch_max(seq, Ordering::Release);
                                slot.reset();
                            }
                            SlotArrival::Stale => panic!("member {part} found its bit set at meeting {seq}"),
                            SlotArrival::Lost(_) => panic!("meeting {seq} lost an arrival"),
                        }
                    }
                });
            }
        });
        assert_eq!(taken.load(Ordering::Relaxed), MEETINGS, "every meeting taken once");
        assert!(slots.iter().all(|s| s.arrived().is_empty()), "every slot reset");
    }

    #[test]
    fn a_grid_that_cannot_be_resident_is_an_error_naming_the_numbers() {
        let g = GpuGroup::new((0..8).collect(), control());
        assert!(g.check_resident(16, Some(132), "all_reduce").is_ok());
        assert!(g.check_resident(1000, None, "all_reduce").is_ok(), "the emulator has no limit");
        let err = g.check_resident(17, Some(132), "all_reduce").unwrap_err().to_string();
        assert!(
            err.contains("8 ranks share this GPU") && err.contains("136 CTAs") && err.contains("holds 132"),
            "{err}"
        );
        assert!(
            GpuGroup::new((0..MAX_LOCAL_RANKS).collect(), control()).fits()
                && !GpuGroup::new((0..=MAX_LOCAL_RANKS).collect(), control()).fits()
        );
    }
}
