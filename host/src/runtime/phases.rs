//! Where the host's time in collective calls goes, by phase (`FERROLINK_HOST_PHASES=1`; see
//! [`host_phases`], public as `ferrolink::coll::host_phases`). Here, in the runtime, because
//! the launch path's phases (track, driver, record) are marked in `Stream`. A thread's phases
//! are consecutive: [`begin`] starts the first, each [`mark`] ends one and starts the next.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

/// A phase of a collective call on the host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    /// From the call to the meeting (or its own launch): checks, state, staging.
    Prepare,
    /// A member of a shared launch that is the run-ahead bound of calls (`RUN_AHEAD`, 64)
    /// beyond its GPU group's last queued launch, waiting for the launches to catch up: time
    /// the host spends because something after it (the launcher, or the GPU) is slower, not
    /// work of its own.
    RunAhead,
    /// A member of a shared launch: its stream's arrival, and ordering the launch after
    /// other streams' uses of what its part uses (it tracks its own part, outside the meeting).
    Uses,
    /// Bringing its entry to the meeting (the meeting's slot, or lock).
    Arrive,
    /// The last member of a shared launch's meeting: queuing it for the launcher thread and
    /// waking that thread.
    HandOver,
    /// A member of a shared launch: noting the launch to come in what its part uses.
    Note,
    /// A member of a shared launch: making its stream follow the launch to come (it does not
    /// wait). A member that is not last, for other work: waiting for the last one's work.
    AwaitLast,
    /// The launcher, for a launch of more calls than its parameter holds: waiting until the
    /// launch that last read the block of device memory its entries will go into has
    /// finished on the GPU (`ENTRY_BLOCKS` launches back): time the GPU bounds, not the host.
    EntriesWait,
    /// The launcher (the GPU group's launcher thread, or the last member with
    /// `FERROLINK_GROUP_LAUNCHER=last`; the last member for other work): taking the meeting
    /// and gathering the members' entries into the launch.
    Gather,
    /// The launcher thread, for a launch of several calls: putting their entries into one
    /// launch (in the parameter, or staged in device memory when it does not hold them).
    Merge,
    /// The launcher: making the work stream wait for the members' arrivals (and, for a
    /// launch with its entries in device memory, queuing their copy on the entries' stream
    /// and making the launch stream wait for it).
    StreamWaits,
    /// Ordering the launch after other streams' uses of what it uses (event waits).
    Track,
    /// The driver's launch (or hand-over) itself.
    Driver,
    /// Recording the launch's completion event and noting it in what it uses.
    Record,
    /// The launcher, when a member (the last one): making its own stream follow the work's
    /// completion (the launcher thread has no stream of its own: nothing to do).
    Follow,
    /// The launcher: publishing the completion to the members.
    Publish,
    /// After the work is queued, to the call's return (copies out, the stream's following).
    Finish,
}

const PHASES: [Phase; 17] = [
    Phase::Prepare,
    Phase::RunAhead,
    Phase::Uses,
    Phase::Arrive,
    Phase::HandOver,
    Phase::Note,
    Phase::AwaitLast,
    Phase::EntriesWait,
    Phase::Gather,
    Phase::Merge,
    Phase::StreamWaits,
    Phase::Track,
    Phase::Driver,
    Phase::Record,
    Phase::Follow,
    Phase::Publish,
    Phase::Finish,
];

impl Phase {
    fn name(self) -> &'static str {
        match self {
            Phase::Prepare => "prepare",
            Phase::RunAhead => "run-ahead",
            Phase::Uses => "uses",
            Phase::Arrive => "arrive",
            Phase::HandOver => "hand-over",
            Phase::AwaitLast => "await-last",
            Phase::Note => "note",
            Phase::EntriesWait => "entries-wait",
            Phase::Gather => "gather",
            Phase::Merge => "merge",
            Phase::StreamWaits => "stream-waits",
            Phase::Track => "track",
            Phase::Driver => "driver",
            Phase::Record => "record",
            Phase::Follow => "follow",
            Phase::Publish => "publish",
            Phase::Finish => "finish",
        }
    }
}

/// Sums per phase, of one thread or of the threads that ended. Per thread (on cache lines
/// of its own) so that timing does not add the contention it measures: 8 rank threads
/// adding to shared sums at every mark would.
#[repr(align(128))]
struct Sums {
    nanos: [AtomicU64; PHASES.len()],
    calls: [AtomicU64; PHASES.len()],
}

impl Sums {
    const fn new() -> Sums {
        Sums { nanos: [const { AtomicU64::new(0) }; PHASES.len()], calls: [const { AtomicU64::new(0) }; PHASES.len()] }
    }

    fn add_to(&self, into: &Sums) {
        for i in 0..PHASES.len() {
            into.nanos[i].fetch_add(self.nanos[i].load(Ordering::Relaxed), Ordering::Relaxed);
            into.calls[i].fetch_add(self.calls[i].load(Ordering::Relaxed), Ordering::Relaxed);
        }
    }

    fn zero(&self) {
        for i in 0..PHASES.len() {
            self.nanos[i].store(0, Ordering::Relaxed);
            self.calls[i].store(0, Ordering::Relaxed);
        }
    }
}

/// The sums of the threads that timed a phase and still run, and of those that ended.
struct Registry {
    live: Vec<Arc<Sums>>,
    ended: Sums,
}

static REGISTRY: Mutex<Registry> = Mutex::new(Registry { live: Vec::new(), ended: Sums::new() });

/// A thread's own sums, registered while it runs; added to the ended threads' at its end.
struct ThreadSums(Arc<Sums>);

impl ThreadSums {
    fn new() -> ThreadSums {
        let mine = Arc::new(Sums::new());
        crate::runtime::lifetime::lock(&REGISTRY).live.push(mine.clone());
        ThreadSums(mine)
    }
}

impl Drop for ThreadSums {
    fn drop(&mut self) {
        // Under the registry's lock: a reader sees the sums once, live or ended.
        let mut r = crate::runtime::lifetime::lock(&REGISTRY);
        self.0.add_to(&r.ended);
        r.live.retain(|s| !Arc::ptr_eq(s, &self.0));
    }
}

fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("FERROLINK_HOST_PHASES").ok().as_deref() == Some("1"))
}

thread_local! {
    /// When this thread's current phase began (timing on).
    static SINCE: std::cell::Cell<Option<Instant>> = const { std::cell::Cell::new(None) };
    /// This thread's sums (made at its first mark).
    static MINE: ThreadSums = ThreadSums::new();
}

/// Starts timing this thread's next phase (the start of a call, or of its tail).
pub(crate) fn begin() {
    if enabled() {
        SINCE.with(|s| s.set(Some(Instant::now())));
    }
}

/// Ends this thread's current phase as `phase` (the time since [`begin`] or the last mark)
/// and starts the next; nothing when timing is off or nothing began.
pub(crate) fn mark(phase: Phase) {
    if !enabled() {
        return;
    }
    SINCE.with(|s| {
        if let Some(t) = s.get() {
            let now = Instant::now();
            let i = phase as usize;
            MINE.with(|m| {
                m.0.nanos[i].fetch_add((now - t).as_nanos() as u64, Ordering::Relaxed);
                m.0.calls[i].fetch_add(1, Ordering::Relaxed);
            });
            s.set(Some(now));
        }
    });
}

/// One phase's sums ([`host_phases`]).
///
/// ```
/// use ferrolink::coll::host_phases;
/// // The perf tool's table (all zero unless FERROLINK_HOST_PHASES=1):
/// for p in host_phases() {
///     println!("{:>12}: {} calls, {:.2} us each", p.name, p.calls, p.mean_us());
/// }
/// assert!(host_phases().iter().any(|p| p.name == "driver"));
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct HostPhase {
    /// The phase: `prepare` (checks, state and staging before the meeting or launch),
    /// `run-ahead` (a member of a shared launch waiting because it is that many calls ahead
    /// of its GPU's launches: the launches, not this thread, bound the rate), `uses` (a
    /// member of a shared launch ordering it after other streams' uses of its part's
    /// resources), `arrive` (bringing the entry to the GPU group's meeting), `hand-over` (the
    /// meeting's last member queuing it for the launcher thread), `note` (a member of a
    /// shared launch noting the launch to come in its part's resources), `await-last` (a
    /// member making its stream follow the shared launch to come, or waiting for the last
    /// one's work), `entries-wait` (the launcher's, for a launch of more calls than its
    /// parameter holds: waiting for the GPU to finish the launch that last read the device
    /// memory its entries go into; time the GPU bounds), `gather` (the launcher's: taking the
    /// meetings, gathering each one's entries), `merge` (the launcher thread's: one launch of
    /// several calls), `stream-waits` (its stream's waits, and the copy of device entries),
    /// `track`, `driver` and `record` (a launch: ordering after other streams, the driver
    /// call, the completion event), `follow` and `publish` (the launcher's), `finish` (after
    /// the work is queued).
    pub name: &'static str,
    /// Times it was timed (summed over every rank thread).
    pub calls: u64,
    /// Microseconds spent in it, summed.
    pub total_us: f64,
}

impl HostPhase {
    /// Mean microseconds per timed call (0 when never timed).
    ///
    /// ```
    /// use ferrolink::coll::HostPhase;
    /// let phase = HostPhase { name: "driver", calls: 4, total_us: 10.0 };
    /// assert_eq!(phase.mean_us(), 2.5);
    /// assert_eq!(HostPhase { calls: 0, total_us: 0.0, ..phase }.mean_us(), 0.0);
    /// ```
    pub fn mean_us(&self) -> f64 {
        if self.calls == 0 { 0.0 } else { self.total_us / self.calls as f64 }
    }
}

/// The process's sums per phase of collective calls since the start or the last
/// [`reset_host_phases`], all zero unless `FERROLINK_HOST_PHASES=1`. When ranks share a
/// GPU, each call passes through a meeting of its members and one launch for all; whether
/// a call's host time is its own preparation, the meeting, or the launch is what decides
/// what to make faster. With the variable set, every collective call adds the time of each
/// of its phases to process-wide sums (the perf tool prints them after its table); unset, a
/// call costs one relaxed load more per phase.
///
/// ```
/// use ferrolink::coll::{host_phases, reset_host_phases};
/// reset_host_phases();
/// let phases = host_phases();
/// assert_eq!(phases[0].name, "prepare");
/// // Nothing was timed since the reset (no call, and timing is off unless the variable is set).
/// assert!(phases.iter().all(|p| p.calls == 0 && p.mean_us() == 0.0));
/// ```
pub fn host_phases() -> Vec<HostPhase> {
    let total = Sums::new();
    {
        let r = crate::runtime::lifetime::lock(&REGISTRY);
        r.ended.add_to(&total);
        for s in &r.live {
            s.add_to(&total);
        }
    }
    PHASES
        .iter()
        .map(|&p| HostPhase {
            name: p.name(),
            calls: total.calls[p as usize].load(Ordering::Relaxed),
            total_us: total.nanos[p as usize].load(Ordering::Relaxed) as f64 / 1e3,
        })
        .collect()
}

/// Sets every phase's sums back to zero.
///
/// ```
/// use ferrolink::coll::{host_phases, reset_host_phases};
/// reset_host_phases();
/// assert!(host_phases().iter().all(|p| p.calls == 0 && p.total_us == 0.0));
/// ```
pub fn reset_host_phases() {
    let r = crate::runtime::lifetime::lock(&REGISTRY);
    r.ended.zero();
    for s in &r.live {
        s.zero();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_s_sums_count_while_it_runs_and_after_it_ended_until_a_reset() {
        let i = Phase::Gather as usize;
        let gather = || host_phases()[i].calls;
        let before = gather();
        let (added, on_added) = std::sync::mpsc::channel::<()>();
        let (end, on_end) = std::sync::mpsc::channel::<()>();
        let t = std::thread::spawn(move || {
            MINE.with(|m| m.0.calls[i].fetch_add(3, Ordering::Relaxed));
            added.send(()).expect("the test waits");
            on_end.recv().expect("the test tells it to end");
        });
        on_added.recv().expect("the thread added");
        assert_eq!(gather(), before + 3, "a running thread's sums");
        end.send(()).expect("the thread waits");
        t.join().expect("no panic");
        assert_eq!(gather(), before + 3, "an ended thread's sums");
        reset_host_phases();
        assert_eq!(gather(), 0);
    }

    #[test]
    fn phases_are_named_in_order_and_means_divide() {
        let names: Vec<_> = host_phases().iter().map(|p| p.name).collect();
        assert_eq!(
            names,
            [
                "prepare",
                "run-ahead",
                "uses",
                "arrive",
                "hand-over",
                "note",
                "await-last",
                "entries-wait",
                "gather",
                "merge",
                "stream-waits",
                "track",
                "driver",
                "record",
                "follow",
                "publish",
                "finish"
            ]
        );
        let p = HostPhase { name: "launch", calls: 4, total_us: 10.0 };
        assert_eq!(p.mean_us(), 2.5);
        assert_eq!(HostPhase { calls: 0, ..p }.mean_us(), 0.0);
    }
}
