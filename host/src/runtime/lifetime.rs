//! Event-tracked lifetimes (cudarc's model): no `Drop` frees memory a kernel may still use,
//! and none waits for the whole device.
//!
//! * Every launch records a `Completion` on its stream: one event, shared by everything
//!   the launch used.
//! * Every resource (buffer, window, device communicator, module, host-mapped block) keeps
//!   its `Uses`: the latest completion of each stream that used it, split into reads and
//!   writes. Streams run in order, so the latest completion of a stream covers its earlier
//!   uses.
//! * A launch whose arguments hold raw device addresses (pointers, or `DevComm`/`DevWindow`
//!   values copied out of their handles) cannot say what it uses; its completion goes to the
//!   device's `Untracked` list, and every resource of that device freed later also waits
//!   for it. Launches that pass handles are tracked exactly.
//! * Dropping a resource hands its memory to `retire` with the completions it must wait
//!   for. Retirement frees at once if they have all passed, else keeps the memory on a
//!   process-wide list that a background thread (and every later call into the runtime)
//!   services without blocking, by querying the events.
//!
//! Work that failed (a faulted stream, an emulator timeout) counts as finished: it no longer
//! runs, so its memory may go.

use crate::runtime::backend::{EventBackend, EventState};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

/// A process-unique stream number.
pub(crate) type StreamId = u64;

/// A new [`StreamId`].
pub(crate) fn next_stream_id() -> StreamId {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Poisoning only means a thread panicked while holding the lock; these lists stay valid.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A recorded point of a stream.
#[derive(Clone)]
pub(crate) struct Completion {
    event: Arc<dyn EventBackend>,
    stream: StreamId,
    /// Its place in its stream's order where completions of the stream may be noted out of
    /// that order (a GPU group's launch stream, whose completions the members note, each
    /// when its call returns: the launch's number); 0 elsewhere.
    order: u64,
}

impl Completion {
    pub(crate) fn new(event: Arc<dyn EventBackend>, stream: StreamId) -> Completion {
        Completion { event, stream, order: 0 }
    }

    /// A completion at place `order` of its stream (see [`Completion::new`]'s `order`).
    pub(crate) fn ordered(event: Arc<dyn EventBackend>, stream: StreamId, order: u64) -> Completion {
        Completion { event, stream, order }
    }

    /// Its stream and place in it packed into one word, for an ordered completion whose
    /// stream number and order fit (24 and 40 bits); 0 otherwise (no place to compare).
    fn place(&self) -> u64 {
        if self.order == 0 || self.order >= 1 << 40 || self.stream >= 1 << 24 {
            return 0;
        }
        self.stream << 40 | self.order
    }

    /// The stream it was recorded on.
    pub(crate) fn stream(&self) -> StreamId {
        self.stream
    }

    /// The backend event.
    pub(crate) fn event(&self) -> &Arc<dyn EventBackend> {
        &self.event
    }

    /// Whether the work before it no longer runs (finished, or its stream failed).
    pub(crate) fn finished(&self) -> bool {
        !matches!(self.event.query(), EventState::Pending)
    }

    /// Waits until [`Completion::finished`].
    pub(crate) fn wait(&self) {
        // A failure means the work stopped: that is all a waiter for memory needs.
        let _ = self.event.synchronize();
    }
}

/// Keeps, per stream, the latest of a list of completions: `c` replaces its stream's entry
/// unless that entry is later in the stream's order (`order`: a GPU group's members note its
/// launches' completions out of order, a member that runs ahead before one that lags). It
/// does not query the others' events: a launch records into every resource it uses, and an
/// event query per entry per launch made a host-bound launch loop (8 ranks sharing a window)
/// about 3 % slower. The list stays bounded by the number of streams; finished entries are
/// dropped when it is read.
/// Of two completions at the same place of an ordered stream (two members of one shared
/// launch noting it), the one kept first stays: they stand for the same work, and replacing it
/// would only drop another thread's count.
fn remember(list: &mut Vec<Completion>, c: &Completion) {
    if list.iter().any(|x| x.stream == c.stream && (x.order > c.order || (c.order > 0 && x.order == c.order))) {
        return;
    }
    list.retain(|x| x.stream != c.stream);
    list.push(c.clone());
}

#[derive(Default)]
struct UsesInner {
    reads: Vec<Completion>,
    writes: Vec<Completion>,
    /// Holders that may queue work on the resource later (captured graphs): only freeing
    /// waits for them, not host accesses.
    keepers: Vec<Completion>,
}

/// The streams' uses of one resource.
#[derive(Default)]
pub(crate) struct Uses {
    inner: Mutex<UsesInner>,
    /// The place ([`Completion::place`]) of the ordered completion last noted as a read, and
    /// as a write: the members of a GPU group's shared launch all note the same launch in the
    /// windows their process's ranks share, and all but the first find it noted here without
    /// taking the lock that 8 threads would otherwise take at every call.
    ///
    /// Ordering: stored (Release) under the lock after the list holds an entry for that place
    /// (or a later place of its stream, which covers it); a recorder that loads it (Acquire)
    /// and skips its own noting therefore happens after that entry was kept, and so does its
    /// thread's later lock of the list (a free or a host access waiting for the work). Entries
    /// leave the list only when a later place of their stream replaces them or their work has
    /// finished; then every completion at that place has finished too (they stand for the
    /// same launch).
    newest_read: AtomicU64,
    newest_write: AtomicU64,
}

impl Uses {
    /// Records that the work before `c` reads (or, with `write`, writes) the resource.
    pub(crate) fn record(&self, c: &Completion, write: bool) {
        let place = c.place();
        let newest = if write { &self.newest_write } else { &self.newest_read };
        if place != 0 && newest.load(Ordering::Acquire) == place {
            return;
        }
        let mut u = lock(&self.inner);
        remember(if write { &mut u.writes } else { &mut u.reads }, c);
        if place != 0 {
            newest.store(place, Ordering::Release);
        }
    }

    /// Completions of uses that may still run (reads and writes); forgets finished ones.
    pub(crate) fn pending(&self) -> Vec<Completion> {
        let mut u = lock(&self.inner);
        u.reads.retain(|c| !c.finished());
        u.writes.retain(|c| !c.finished());
        u.reads.iter().chain(&u.writes).cloned().collect()
    }

    /// Completions of writes that may still run; forgets finished ones.
    pub(crate) fn pending_writes(&self) -> Vec<Completion> {
        let mut u = lock(&self.inner);
        u.writes.retain(|c| !c.finished());
        u.writes.clone()
    }

    /// Completions of uses by streams other than `stream` that may still run (writes only
    /// with `writes_only`); forgets finished ones. Uses by `stream` itself are neither
    /// returned nor queried: its own order covers them, and in a loop of launches on one
    /// stream (a GPU group's shared launch records into every member's resources) an event
    /// query per resource per launch is host time that grows with the resources.
    pub(crate) fn pending_from_others(&self, stream: StreamId, writes_only: bool) -> Vec<Completion> {
        let mut u = lock(&self.inner);
        let UsesInner { reads, writes, .. } = &mut *u;
        let mut out = Vec::new();
        let lists: [&mut Vec<Completion>; 2] = [writes, reads];
        for list in lists.into_iter().take(if writes_only { 1 } else { 2 }) {
            list.retain(|c| c.stream == stream || !c.finished());
            out.extend(list.iter().filter(|c| c.stream != stream).cloned());
        }
        out
    }

    /// Records a keeper: something that may queue work using the resource until `c`
    /// finishes (a captured graph, until it is dropped).
    pub(crate) fn record_keeper(&self, c: &Completion) {
        remember(&mut lock(&self.inner).keepers, c);
    }

    /// What freeing the resource waits for: [`Uses::pending`] and live keepers.
    pub(crate) fn pending_for_free(&self) -> Vec<Completion> {
        let mut w = self.pending();
        let mut u = lock(&self.inner);
        u.keepers.retain(|c| !c.finished());
        w.extend(u.keepers.iter().cloned());
        w
    }
}

/// An event the host raises: a [`Completion`] that keepers (captured graphs) hold until
/// they are dropped.
#[derive(Default)]
pub(crate) struct HostFlag {
    raised: Mutex<bool>,
    wake: Condvar,
}

impl HostFlag {
    /// Marks it reached (wakes waiters).
    pub(crate) fn raise(&self) {
        *lock(&self.raised) = true;
        self.wake.notify_all();
    }
}

impl EventBackend for HostFlag {
    fn query(&self) -> EventState {
        if *lock(&self.raised) { EventState::Done } else { EventState::Pending }
    }
    fn synchronize(&self) -> crate::Result<()> {
        let mut raised = lock(&self.raised);
        while !*raised {
            raised = self.wake.wait(raised).unwrap_or_else(|e| e.into_inner());
        }
        Ok(())
    }
    fn elapsed_ms_since(&self, _start: &dyn EventBackend) -> crate::Result<f32> {
        Err(crate::Error::InvalidArgument("a host flag carries no time".into()))
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// The completions of a device's untracked launches, the latest per stream, and the keepers
/// (captured graphs holding untracked work).
#[derive(Default)]
pub(crate) struct Untracked(Mutex<HashMap<StreamId, Completion>>, Mutex<Vec<Completion>>);

impl Untracked {
    /// Records an untracked launch (replacing that stream's earlier one; no event queries,
    /// as in `remember`).
    pub(crate) fn record(&self, c: &Completion) {
        let mut m = lock(&self.0);
        // As `remember`: the later in the stream's order stays.
        if m.get(&c.stream).is_none_or(|x| x.order <= c.order) {
            m.insert(c.stream, c.clone());
        }
    }

    /// Untracked launches that may still run; forgets finished ones.
    pub(crate) fn pending(&self) -> Vec<Completion> {
        let mut m = lock(&self.0);
        m.retain(|_, c| !c.finished());
        m.values().cloned().collect()
    }

    /// Records a keeper (see [`Uses::record_keeper`]).
    pub(crate) fn record_keeper(&self, c: &Completion) {
        remember(&mut lock(&self.1), c);
    }

    /// What freeing memory that untracked launches may use waits for: [`Untracked::pending`]
    /// and live keepers.
    pub(crate) fn pending_for_free(&self) -> Vec<Completion> {
        let mut w = self.pending();
        let mut k = lock(&self.1);
        k.retain(|c| !c.finished());
        w.extend(k.iter().cloned());
        w
    }
}

/// Waits on the host until every completion in `waits` has passed. Refused inside a group
/// launch when some has not: the work may wait for ranks launched after this call.
pub(crate) fn wait_all(waits: &[Completion], what: &str) -> crate::Result<()> {
    if crate::runtime::group::in_group_launch() && !waits.iter().all(Completion::finished) {
        return Err(crate::Error::InvalidArgument(format!(
            "{what} inside launch_all would wait for kernels that may wait for ranks not yet launched \
             (a deadlock): do host accesses after launch_all"
        )));
    }
    for c in waits {
        c.wait();
    }
    Ok(())
}

/// Something whose drop frees memory: what a resource hands to [`retire`].
pub(crate) type Payload = Box<dyn Send>;

struct Retiring {
    waits: Vec<Completion>,
    payload: Payload,
    what: &'static str,
}

struct Graveyard {
    items: Mutex<Vec<Retiring>>,
    wake: Condvar,
    retired: AtomicU64,
}

fn graveyard() -> &'static Graveyard {
    static G: OnceLock<Graveyard> = OnceLock::new();
    G.get_or_init(|| {
        std::thread::Builder::new()
            .name("ferrolink-reaper".into())
            .spawn(reaper)
            .expect("starting ferrolink's retirement thread");
        Graveyard { items: Mutex::new(Vec::new()), wake: Condvar::new(), retired: AtomicU64::new(0) }
    })
}

/// How often the reaper looks at pending retirements.
const REAP_INTERVAL: Duration = Duration::from_millis(2);

fn reaper() {
    let g = graveyard();
    loop {
        {
            let items = lock(&g.items);
            let items = if items.is_empty() {
                g.wake.wait(items).unwrap_or_else(|e| e.into_inner())
            } else {
                g.wake.wait_timeout(items, REAP_INTERVAL).unwrap_or_else(|e| e.into_inner()).0
            };
            drop(items);
        }
        collect();
    }
}

/// Frees `payload` once every completion in `waits` has passed: at once if they all have,
/// else later, without blocking the caller. `what` names the resource in logs.
pub(crate) fn retire(waits: Vec<Completion>, payload: Payload, what: &'static str) {
    // A persistent collective that its stream has not waited for yet: queue that wait now,
    // or the free would wait for the stream's next work.
    for c in &waits {
        if let Err(e) = crate::runtime::stream::settle_deferred(c.event()) {
            tracing::warn!(target: "ferrolink::runtime", what, error = %e, "could not queue a stream's deferred wait");
        }
    }
    if waits.iter().all(Completion::finished) {
        drop(payload);
        graveyard().retired.fetch_add(1, Ordering::Relaxed);
        return;
    }
    tracing::trace!(target: "ferrolink::runtime", what, pending = waits.len(), "deferring a free until its kernels finish");
    let g = graveyard();
    lock(&g.items).push(Retiring { waits, payload, what });
    g.wake.notify_one();
}

/// Frees every retired resource whose completions have passed (never waits for a kernel).
/// Returns how many are still pending.
pub(crate) fn collect() -> usize {
    let g = graveyard();
    let ready: Vec<Retiring> = {
        let mut items = lock(&g.items);
        for r in items.iter_mut() {
            r.waits.retain(|c| !c.finished());
        }
        let (ready, pending): (Vec<_>, Vec<_>) =
            std::mem::take(&mut *items).into_iter().partition(|r| r.waits.is_empty());
        *items = pending;
        ready
    };
    // Free outside the lock: a free may take the group lock or call the driver.
    for r in ready {
        tracing::trace!(target: "ferrolink::runtime", what = r.what, "freeing retired memory");
        drop(r.payload);
        g.retired.fetch_add(1, Ordering::Relaxed);
    }
    lock(&g.items).len()
}

/// Retired resources whose kernels have not finished yet (after freeing those that have).
///
/// ```
/// use ferrolink::runtime::pending_retirements;
/// # fn main() -> ferrolink::Result<()> {
/// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// # let stream = dev.create_stream()?;
/// let (src, mut dst) = (dev.alloc_from(&[1u8; 4096])?, dev.alloc::<u8>(4096)?);
/// ferrolink::ops::copy(&stream, &mut dst, &src)?;
/// drop(src); // retired: freed once the copy has run
/// stream.synchronize()?;
/// assert_eq!(pending_retirements(), 0); // the copy has run: freed now
/// # Ok(()) }
/// ```
pub fn pending_retirements() -> usize {
    collect()
}

/// Resources freed by retirement so far in this process.
///
/// ```
/// use ferrolink::runtime::retired_total;
/// # fn main() -> ferrolink::Result<()> {
/// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// let before = retired_total();
/// drop(dev.alloc::<u8>(64)?); // no kernel used it: freed at once
/// assert!(retired_total() > before);
/// # Ok(()) }
/// ```
pub fn retired_total() -> u64 {
    graveyard().retired.load(Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flag() -> Arc<HostFlag> {
        Arc::new(HostFlag::default())
    }

    #[test]
    fn a_use_noted_out_of_its_streams_order_does_not_hide_a_later_one() {
        let uses = Uses::default();
        let (later, earlier) = (flag(), flag());
        // A member that ran ahead noted launch 7 of stream 3, then a lagging one launch 5.
        uses.record(&Completion::ordered(later.clone(), 3, 7), false);
        uses.record(&Completion::ordered(earlier.clone(), 3, 5), false);
        earlier.raise();
        assert_eq!(uses.pending().len(), 1, "launch 7 still counts");
        later.raise();
        assert!(uses.pending().is_empty());
        // Unordered completions (order 0) replace as before.
        let (a, b) = (flag(), flag());
        uses.record(&Completion::new(a.clone(), 4), true);
        uses.record(&Completion::new(b.clone(), 4), true);
        b.raise();
        assert!(uses.pending_writes().is_empty(), "the latest of stream 4 has passed");
    }

    #[test]
    fn members_noting_one_launch_keep_the_first_and_a_later_launch_replaces_it() {
        let uses = Uses::default();
        let (first, second, next) = (flag(), flag(), flag());
        // Two members of launch 9 of stream 5 note it: the first stays (the second finds its
        // place noted), so the list holds the first member's completion alone.
        uses.record(&Completion::ordered(first.clone(), 5, 9), false);
        uses.record(&Completion::ordered(second.clone(), 5, 9), false);
        assert_eq!(Arc::strong_count(&second), 1, "the second member's completion was not kept");
        assert_eq!(uses.pending().len(), 1);
        // The place is per list: a write of launch 9 is noted apart.
        uses.record(&Completion::ordered(second.clone(), 5, 9), true);
        assert_eq!(uses.pending_writes().len(), 1);
        // Launch 10 replaces launch 9's entry, fast path or not.
        uses.record(&Completion::ordered(next.clone(), 5, 10), false);
        // A lagging member's note of launch 9 after launch 10 is not kept.
        let late = flag();
        uses.record(&Completion::ordered(late.clone(), 5, 9), false);
        assert_eq!(Arc::strong_count(&late), 1, "launch 10 covers launch 9");
        first.raise();
        assert_eq!(uses.pending().len(), 2, "launch 10's read and launch 9's write still count");
        second.raise();
        next.raise();
        assert!(uses.pending().is_empty());
    }

    #[test]
    fn places_that_do_not_pack_take_the_lock_every_time() {
        let uses = Uses::default();
        let (a, b) = (flag(), flag());
        // A stream number past 24 bits: no place, so every note goes to the list (the later
        // order still wins).
        let stream = 1 << 30;
        uses.record(&Completion::ordered(a.clone(), stream, 3), false);
        uses.record(&Completion::ordered(b.clone(), stream, 4), false);
        a.raise();
        assert_eq!(uses.pending().len(), 1, "launch 4 still counts");
        b.raise();
        assert!(uses.pending().is_empty());
    }
}
