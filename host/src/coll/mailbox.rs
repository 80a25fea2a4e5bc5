//! Mailboxes and GPU groups: how collectives reach the mailbox kernel
//! (`ferrolink_device::kernels::coll::coll_mailboxes`).
//!
//! Each rank owns a [`RankMailbox`] in device memory. A collective call queues, on the rank's
//! stream and in its order, stream memory writes of the operation (and of the rank's device
//! communicator, when it changed) followed by the operation's sequence number, then a stream
//! wait until the kernel publishes that number as completed: one `cuStreamBatchMemOp`.
//!
//! The ranks of one communicator that share a GPU in this process form a [`GpuGroup`]: one
//! kernel serves all their mailboxes. Without persistent mode the last of them to make a call
//! launches that kernel for the call on its own stream (one launch per GPU instead of one per
//! rank: what a one-process, several-ranks-per-GPU job pays per collective); in persistent
//! mode the last to start launches it once, on a stream of its own, and it runs until every
//! rank has stopped. Either way every CTA of the kernel must be resident at once (ranks' parts
//! wait for each other): the grid is checked with the occupancy API first.
//!
//! Ordering: the rank's stream reaches its writes only after its earlier work (staging
//! copies), so a CTA that sees the sequence number (acquire) sees inputs that are ready; the
//! stream's later work waits for `completed`, which the kernel releases after the operation's
//! exit barrier. The protocol on the device side is documented at
//! `ferrolink_device::coll::persistent::serve`.

use crate::comm::Communicator;
use crate::devcomm::DevCommHandle;
use crate::mem::window::Window;
use crate::runtime::launch::{LaunchArg, LaunchTracking};
use crate::runtime::lifetime::{Uses, lock};
use crate::runtime::stream::Stream;
use crate::runtime::stream::StreamObserver;
use crate::{Error, Result};
use ferrolink_device::coll::persistent::{
    ABORTED, COMM_OFFSET, COMPLETED_OFFSET, CollOp, LocalRanks, MAX_LOCAL_RANKS, Mailbox, SEQ_OFFSET,
};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};

/// A stream write: `(device address, value, bytes)`.
pub(crate) type StreamWrite = (u64, u64, u32);

/// One rank's part of a meeting of its GPU's ranks ([`GpuGroup::arrive`]).
pub(crate) struct Part<'a> {
    /// The rank (world).
    pub(crate) rank: usize,
    /// Its mailbox.
    pub(crate) mailbox: &'a RankMailbox,
    /// Whether the kernel serves it (false: the rank runs this call otherwise, captured).
    pub(crate) served: bool,
    /// Its device communicator's control block (where its CTAs look for an abort).
    pub(crate) control: u64,
    /// Its CTAs.
    pub(crate) ctas: u32,
    /// What the kernel must keep alive for it (its communicator).
    pub(crate) keep: LaunchTracking,
}

/// One rank's mailbox (a window of one slot per rank, each rank using its own).
pub(crate) struct RankMailbox {
    window: Window,
    /// The next operation's sequence number.
    pub(crate) next: u64,
    /// Which device communicator the mailbox holds (its generation), if any.
    comm_gen: Option<u64>,
}

impl RankMailbox {
    /// Makes a zeroed mailbox (collective: a window registration).
    pub(crate) fn new(comm: &Communicator) -> Result<RankMailbox> {
        let size = std::mem::size_of::<Mailbox>();
        let window = comm.register_window(comm.mem_alloc(size)?)?;
        window.zero(0, size)?;
        Ok(RankMailbox { window, next: 1, comm_gen: None })
    }

    /// The mailbox's device address.
    pub(crate) fn addr(&self) -> Result<u64> {
        Ok(self.window.slot_ptr::<*mut u8>(0, std::mem::size_of::<Mailbox>())?.param() as u64)
    }

    /// Writes `handle`'s device communicator into the mailbox from the host (before any
    /// kernel serves it: host writes wait for this process's kernels on the window).
    pub(crate) fn store_comm(&mut self, handle: &DevCommHandle, generation: u64) -> Result<()> {
        self.window.copy_from_host(COMM_OFFSET, bytemuck::bytes_of(&handle.dev_comm()))?;
        self.comm_gen = Some(generation);
        Ok(())
    }

    /// The stream writes of operation `op` under the next sequence number (preceded by
    /// `handle`'s communicator when the mailbox does not hold generation `generation`), the
    /// sequence number's write last; and that number. Counts the number as used.
    pub(crate) fn message(
        &mut self,
        op: CollOp,
        handle: &DevCommHandle,
        generation: u64,
    ) -> Result<(Vec<StreamWrite>, u64)> {
        let base = self.addr()?;
        let word = |bytes: &[u8]| u64::from_le_bytes(bytes.try_into().expect("8 bytes"));
        let mut writes: Vec<StreamWrite> = Vec::with_capacity(64);
        if self.comm_gen != Some(generation) {
            let comm = handle.dev_comm();
            for (i, w) in bytemuck::bytes_of(&comm).chunks_exact(8).enumerate() {
                writes.push((base + (COMM_OFFSET + i * 8) as u64, word(w), 8));
            }
            self.comm_gen = Some(generation);
        }
        for (i, w) in bytemuck::bytes_of(&op).chunks_exact(8).enumerate() {
            writes.push((base + (i * 8) as u64, word(w), 8));
        }
        let seq = self.next;
        writes.push((base + SEQ_OFFSET as u64, seq, 8));
        self.next += 1;
        Ok((writes, seq))
    }

    /// Counts the next sequence number as used without a message (a captured call: it runs
    /// as a launch of its own, but keeps the count the same as its GPU's other ranks').
    pub(crate) fn skip(&mut self) -> u64 {
        self.next += 1;
        self.next - 1
    }

    /// The completion word's device address.
    pub(crate) fn completed_addr(&self) -> Result<u64> {
        Ok(self.addr()? + COMPLETED_OFFSET as u64)
    }

    /// Queues on `stream` the message `writes` and a wait for completion of `seq`, tracked by
    /// `t` (what the operation uses) and the mailbox itself.
    pub(crate) fn post(
        &self,
        stream: &Stream,
        mut t: LaunchTracking,
        writes: &[(u64, u64, u32)],
        seq: u64,
    ) -> Result<()> {
        (&self.window).track(&mut t);
        let completed = self.completed_addr()?;
        // SAFETY: aligned words of the live mailbox window (tracked: kept alive until the wait
        // has passed), written only by this rank's stream and, atomically, by the kernel; `t`
        // covers the operation's windows and output, which the kernel uses until `completed`
        // reaches `seq`.
        unsafe { stream.post(t, writes, Some((completed, seq))) }
    }

    /// Tracks the mailbox window in `t` (work that writes it).
    pub(crate) fn track(&self, t: &mut LaunchTracking) {
        (&self.window).track(t);
    }
}

/// The ranks of one communicator on one GPU in this process.
pub(crate) struct GpuGroup {
    /// Their world ranks, ascending: a rank's place here is its part of the kernel.
    pub(crate) members: Vec<usize>,
    /// How many CTAs of the mailbox kernel the GPU holds at once (occupancy API; `None`: no
    /// limit), once asked.
    pub(crate) resident: OnceLock<Option<u64>>,
    arrivals: Mutex<HashMap<(Purpose, u64), Arrival>>,
    side: Mutex<Option<Stream>>,
}

/// Why the members meet: a shared launch of one operation, or the start of persistent mode.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub(crate) enum Purpose {
    Operation,
    Persistent,
}

struct Arrival {
    count: usize,
    ranks: LocalRanks,
    ctas: u32,
    keep: Vec<Arc<Uses>>,
    observers: Vec<Weak<dyn StreamObserver>>,
}

/// The ranks a mailbox kernel serves, as a launch argument: the kernel parameter, and what
/// the members asked the launch to keep alive until the kernel ends (their mailboxes and
/// device communicators; what each operation uses besides is tracked by its rank's own
/// stream work).
pub(crate) struct ServedRanks {
    pub(crate) ranks: LocalRanks,
    keep: Vec<Arc<Uses>>,
    observers: Vec<Weak<dyn StreamObserver>>,
}

impl crate::runtime::launch::sealed::Sealed for &ServedRanks {}

impl LaunchArg for &ServedRanks {
    type Param = LocalRanks;
    fn param(&self) -> LocalRanks {
        self.ranks
    }
    fn track(&self, t: &mut LaunchTracking) {
        // Keepers, not uses: the members' own streams post to these resources while the
        // kernel waits for them, so nothing may wait for the kernel through them.
        t.keeps.extend(self.keep.iter().cloned());
        t.observers.extend(self.observers.iter().cloned());
    }
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
        let g = Arc::new(GpuGroup {
            members,
            resident: OnceLock::new(),
            arrivals: Mutex::new(HashMap::new()),
            side: Mutex::new(None),
        });
        groups.push((key, Arc::downgrade(&g)));
        g
    }

    /// A stream of the group's for launches that cannot go on the caller's stream (it is
    /// capturing a graph while other members' calls must run now).
    pub(crate) fn side_stream(&self, dev: &crate::Device) -> Result<Stream> {
        let mut side = lock(&self.side);
        if side.is_none() {
            *side = Some(dev.create_stream()?);
        }
        Ok(side.as_ref().expect("made above").share())
    }

    /// After a failed launch of `served`: releases every served member's stream, which
    /// waits for its completion word, by writing [`ABORTED`] there from the group's side
    /// stream (those streams wait on the device, not on the host: without this they would
    /// wait for ever), and aborts the communicator so that their work reports it.
    pub(crate) fn release_after_failed_launch(&self, comm: &Communicator, served: &ServedRanks) {
        comm.abort();
        let count = (served.ranks.count as usize).min(MAX_LOCAL_RANKS);
        let side = match self.side_stream(comm.device()) {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(target: "ferrolink::coll", error = %e, "no stream to release the ranks of a failed launch");
                return;
            }
        };
        for &mailbox in served.ranks.mailboxes[..count].iter().filter(|&&m| m != 0) {
            // SAFETY: the completion word of a member's mailbox, 8-byte aligned: the window
            // lives in its rank's collective state (kept while the communicator lives), and
            // the write is untracked work, which freeing memory waits for; the word is
            // written only atomically (stream writes, the kernel's stores).
            if let Err(e) = unsafe { side.write_value_raw(mailbox + COMPLETED_OFFSET as u64, ABORTED, 8) } {
                tracing::error!(target: "ferrolink::coll", error = %e, "could not release a rank of a failed launch");
            }
        }
    }

    /// `rank`'s part in the kernel.
    pub(crate) fn part_of(&self, rank: usize) -> usize {
        self.members.iter().position(|&r| r == rank).expect("a member of its own group")
    }

    /// Whether one kernel can serve every member (at most [`MAX_LOCAL_RANKS`]).
    pub(crate) fn fits(&self) -> bool {
        self.members.len() <= MAX_LOCAL_RANKS
    }

    /// Notes that `part` has queued its share of meeting `(purpose, seq)`; returns the
    /// kernel's ranks when it was the last member to do so (it launches). Parts of one
    /// meeting must agree on `ctas` (every rank computes it from the same call): a mismatch
    /// is logged as an error and the kernel runs with the largest, so that nothing waits for
    /// ever (the barriers' timeouts report the mismatched ranks).
    pub(crate) fn arrive(&self, purpose: Purpose, seq: u64, part: Part<'_>) -> Result<Option<ServedRanks>> {
        let Part { rank, mailbox, served: mailbox_used, control, ctas, keep } = part;
        let part = self.part_of(rank);
        // A part without a mailbox (its rank runs this call in a graph being captured) is
        // skipped by the kernel.
        let addr = if mailbox_used { mailbox.addr()? } else { 0 };
        let mut keep = keep;
        mailbox.track(&mut keep);
        let mut arrivals = lock(&self.arrivals);
        let a = arrivals.entry((purpose, seq)).or_insert_with(|| Arrival {
            count: 0,
            ranks: LocalRanks { count: self.members.len() as u32, ..LocalRanks::default() },
            ctas,
            keep: Vec::new(),
            observers: Vec::new(),
        });
        a.ranks.mailboxes[part] = addr;
        a.keep.extend(keep.holds.into_iter().chain(keep.reads).chain(keep.writes));
        a.observers.extend(keep.observers);
        a.ranks.controls[part] = control;
        let mismatch = a.ctas != ctas;
        a.ctas = a.ctas.max(ctas);
        a.count += 1;
        if a.count < self.members.len() {
            return Ok(None);
        }
        let mut a = arrivals.remove(&(purpose, seq)).expect("present");
        a.ranks.ctas_per_rank = a.ctas;
        if mismatch {
            tracing::error!(target: "ferrolink::coll", ?purpose, seq, "ranks sharing a GPU asked for different grids");
        }
        if a.ranks.mailboxes.iter().all(|&m| m == 0) {
            return Ok(None);
        }
        Ok(Some(ServedRanks { ranks: a.ranks, keep: a.keep, observers: a.observers }))
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

    fn group_of(n: usize) -> GpuGroup {
        GpuGroup {
            members: (0..n).collect(),
            resident: OnceLock::new(),
            arrivals: Mutex::new(HashMap::new()),
            side: Mutex::new(None),
        }
    }

    #[test]
    fn a_grid_that_cannot_be_resident_is_an_error_naming_the_numbers() {
        let g = group_of(8);
        assert!(g.check_resident(16, Some(132), "all_reduce").is_ok());
        assert!(g.check_resident(1000, None, "all_reduce").is_ok(), "the emulator has no limit");
        let err = g.check_resident(17, Some(132), "all_reduce").unwrap_err().to_string();
        assert!(
            err.contains("8 ranks share this GPU") && err.contains("136 CTAs") && err.contains("holds 132"),
            "{err}"
        );
        assert!(group_of(MAX_LOCAL_RANKS).fits() && !group_of(MAX_LOCAL_RANKS + 1).fits());
    }
}
