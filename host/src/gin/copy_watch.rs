//! The proxy's stream copies under way, so that one that does not finish is named.
//!
//! # Why a copy of the proxy may never finish
//! The proxy's transports move data with stream copies: a TCP receiver writes what arrives
//! into the rank's memory on the rank's delivery stream, a TCP sender copies a put's source
//! into pinned staging on the staging stream, the copy-engine transport copies into the
//! peer's memory on the rank's copy stream. A kernel waiting for a signal may be waiting for
//! one of those copies. On CUDA, a context's streams share a bounded number of hardware
//! queues (`CUDA_DEVICE_MAX_CONNECTIONS`: 8 unless set, 32 at most), and work in one queue
//! starts in order: a copy whose stream shares a queue with a stream whose kernel is waiting
//! for that copy waits behind the kernel, and neither ever ends. Seen on an H100 (six virtual
//! ranks in LSA domains of two, 2026-12-06): a delivery's copy waited for 50 s until the run was
//! killed; with `CUDA_DEVICE_MAX_CONNECTIONS=32` the same test passed in 7 s.
//!
//! The GIN therefore makes few streams (one delivery stream, one staging stream and one copy
//! stream per rank, made with its GIN), warns when proxy transports run with fewer than the
//! most hardware queues, and names a copy that has not finished after [`STUCK_AFTER`] among
//! the watchdog's stalled waits, with the queues' setting (`ferrolink-run` sets it to 32 for
//! the ranks it starts).

use crate::comm::control::{StalledWait, WaitOn};
use crate::runtime::lifetime::lock;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How long a copy of the proxy runs before the watchdog names it: far above any copy's time
/// (microseconds to milliseconds).
pub(crate) const STUCK_AFTER: Duration = Duration::from_secs(2);

/// What a copy of the proxy is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CopyFor {
    /// A TCP receiver writing data or a signal that rank `from` sent.
    DeliveryFrom(usize),
    /// A TCP sender staging the source of a put to rank `to`.
    StagingTo(usize),
}

/// The copies under way of one rank's proxy threads.
#[derive(Default)]
pub(crate) struct CopyWatch {
    next: AtomicU64,
    under_way: Mutex<Vec<(u64, Instant, CopyFor)>>,
}

/// A copy under way; it is off the list when this is dropped.
pub(crate) struct CopyUnderWay<'a> {
    watch: &'a CopyWatch,
    id: u64,
}

impl Drop for CopyUnderWay<'_> {
    fn drop(&mut self) {
        lock(&self.watch.under_way).retain(|(id, ..)| *id != self.id);
    }
}

impl CopyWatch {
    /// Notes a copy that starts now, until the returned guard is dropped.
    pub(crate) fn begin(&self, what: CopyFor) -> CopyUnderWay<'_> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        lock(&self.under_way).push((id, Instant::now(), what));
        CopyUnderWay { watch: self, id }
    }

    /// The copies of rank `rank` under way for at least [`STUCK_AFTER`] at `now`, as stalled
    /// waits of the rank's proxy; `queues` is the device's hardware queues and their setting.
    pub(crate) fn stuck(&self, rank: usize, now: Instant, queues: Option<(usize, &'static str)>) -> Vec<StalledWait> {
        lock(&self.under_way)
            .iter()
            .filter(|(_, since, _)| now.saturating_duration_since(*since) >= STUCK_AFTER)
            .map(|&(id, since, what)| StalledWait {
                rank,
                cta: 0,
                on: WaitOn::ProxyCopy { id, what, running: now.saturating_duration_since(since), queues },
                missing: Vec::new(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_is_named_once_it_runs_past_the_limit_and_forgotten_when_it_ends() {
        let w = CopyWatch::default();
        let t0 = Instant::now();
        let g = w.begin(CopyFor::DeliveryFrom(3));
        let _other = w.begin(CopyFor::StagingTo(1));
        assert!(w.stuck(2, t0, Some((8, "Q"))).is_empty(), "nothing is stuck at once");
        let later = Instant::now() + STUCK_AFTER;
        let stuck = w.stuck(2, later, Some((8, "Q")));
        assert_eq!(stuck.len(), 2);
        let text = stuck[0].describe();
        assert!(text.contains("rank 2") && text.contains("rank 3") && text.contains("Q=8"), "{text}");
        assert_ne!(stuck[0].key(), stuck[1].key(), "each copy is its own wait");
        drop(g);
        let left = w.stuck(2, later, None);
        assert_eq!(left.len(), 1);
        assert!(matches!(left[0].on, WaitOn::ProxyCopy { what: CopyFor::StagingTo(1), .. }));
        assert!(!left[0].describe().contains("Q="), "{}", left[0].describe());
    }
}
