//! The in-process bootstrap: ranks are threads of one process (`Communicator::init_all`, and
//! tests). Messages go through a shared mailbox; nothing is serialized beyond the bytes.

use super::Bootstrap;
use crate::runtime::lifetime::lock;
use crate::{Error, Result};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// (from, to, tag)
type Key = (usize, usize, u64);

/// One all-gather in progress: every rank's contribution, and how many have taken the result.
struct Round {
    slots: Vec<Option<Arc<Vec<u8>>>>,
    filled: usize,
    taken: usize,
}

struct Group {
    nranks: usize,
    timeout: Duration,
    mail: Mutex<HashMap<Key, VecDeque<Vec<u8>>>>,
    arrived: Condvar,
    /// All-gathers by tag: one slot per rank, so that a thousand threads gather in O(n) with
    /// one wake-up each (messages to every peer would be n² and wake everyone n times).
    rounds: Mutex<HashMap<u64, Round>>,
    round_done: Condvar,
}

/// One rank's view of an in-process group.
///
/// ```
/// # fn main() -> ferrolink::Result<()> {
/// use ferrolink::comm::bootstrap::{Bootstrap, in_process::InProcessBootstrap};
/// let group = InProcessBootstrap::group(2, std::time::Duration::from_millis(10));
/// group[0].send(1, 5, b"hi")?; // does not wait for the receiver
/// assert_eq!(group[1].recv(0, 5)?, b"hi");
/// // Nothing more under that tag: the receive gives up after the timeout, naming the sender.
/// let err = group[1].recv(0, 5).unwrap_err();
/// assert!(err.to_string().contains("no message from rank 0"), "{err}");
/// # Ok(()) }
/// ```
pub struct InProcessBootstrap {
    group: Arc<Group>,
    rank: usize,
    seq: AtomicU64,
}

impl InProcessBootstrap {
    /// A group of `nranks` ranks whose receives wait at most `timeout`; element `r` is rank
    /// `r`'s bootstrap.
    ///
    /// ```
    /// use ferrolink::comm::bootstrap::{Bootstrap, in_process::InProcessBootstrap};
    /// let group = InProcessBootstrap::group(3, std::time::Duration::from_secs(10));
    /// assert_eq!(group.len(), 3);
    /// assert!(group.iter().enumerate().all(|(r, b)| b.rank() == r && b.nranks() == 3));
    /// ```
    pub fn group(nranks: usize, timeout: Duration) -> Vec<Arc<InProcessBootstrap>> {
        let group = Arc::new(Group {
            nranks,
            timeout,
            mail: Mutex::new(HashMap::new()),
            arrived: Condvar::new(),
            rounds: Mutex::new(HashMap::new()),
            round_done: Condvar::new(),
        });
        (0..nranks)
            .map(|rank| Arc::new(InProcessBootstrap { group: group.clone(), rank, seq: AtomicU64::new(0) }))
            .collect()
    }
}

impl Bootstrap for InProcessBootstrap {
    fn rank(&self) -> usize {
        self.rank
    }

    fn nranks(&self) -> usize {
        self.group.nranks
    }

    fn timeout(&self) -> Duration {
        self.group.timeout
    }

    fn send(&self, to: usize, tag: u64, data: &[u8]) -> Result<()> {
        if to >= self.group.nranks {
            return Err(Error::InvalidArgument(format!("send to rank {to} of {}", self.group.nranks)));
        }
        lock(&self.group.mail).entry((self.rank, to, tag)).or_default().push_back(data.to_vec());
        self.group.arrived.notify_all();
        Ok(())
    }

    fn recv(&self, from: usize, tag: u64) -> Result<Vec<u8>> {
        if from >= self.group.nranks {
            return Err(Error::InvalidArgument(format!("receive from rank {from} of {}", self.group.nranks)));
        }
        let key = (from, self.rank, tag);
        let deadline = Instant::now() + self.group.timeout;
        let mut mail = lock(&self.group.mail);
        loop {
            if let Some(q) = mail.get_mut(&key)
                && let Some(m) = q.pop_front()
            {
                if q.is_empty() {
                    mail.remove(&key);
                }
                return Ok(m);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Bootstrap(format!(
                    "rank {}: no message from rank {from} within {:?} (in-process bootstrap)",
                    self.rank, self.group.timeout
                )));
            }
            mail = self.group.arrived.wait_timeout(mail, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    fn next_tag(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::Relaxed)
    }

    fn describe(&self) -> String {
        format!("in-process bootstrap of {} ranks", self.group.nranks)
    }

    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        let tag = self.next_tag();
        let n = self.group.nranks;
        let deadline = Instant::now() + self.group.timeout;
        let mut rounds = lock(&self.group.rounds);
        let round = rounds.entry(tag).or_insert_with(|| Round { slots: vec![None; n], filled: 0, taken: 0 });
        round.slots[self.rank] = Some(Arc::new(data.to_vec()));
        round.filled += 1;
        if round.filled == n {
            self.group.round_done.notify_all();
        }
        loop {
            let round = rounds.get_mut(&tag).expect("a round lives until every rank took it");
            if round.filled == n {
                // Take the shared slots under the lock, copy them out of it (a thousand ranks
                // copying a thousand slots each must not queue on one lock).
                let shared: Vec<Arc<Vec<u8>>> = round.slots.iter().map(|s| s.clone().expect("filled")).collect();
                round.taken += 1;
                if round.taken == n {
                    rounds.remove(&tag);
                }
                drop(rounds);
                return Ok(shared.iter().map(|s| s.as_ref().clone()).collect());
            }
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<usize> =
                    round.slots.iter().enumerate().filter(|(_, s)| s.is_none()).map(|(r, _)| r).collect();
                return Err(Error::Bootstrap(format!(
                    "rank {}: {} never answered an all-gather within {:?} (in-process bootstrap)",
                    self.rank,
                    super::ranks_phrase(&missing),
                    self.group.timeout
                )));
            }
            rounds = self.group.round_done.wait_timeout(rounds, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::bootstrap::Subgroup;

    fn run<R: Send>(n: usize, f: impl Fn(Arc<InProcessBootstrap>) -> R + Sync) -> Vec<R> {
        let group = InProcessBootstrap::group(n, Duration::from_secs(10));
        std::thread::scope(|s| {
            let handles: Vec<_> = group.into_iter().map(|b| s.spawn(|| f(b))).collect();
            handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
        })
    }

    #[test]
    fn all_gather_all_to_all_and_barrier_agree_on_every_rank() {
        for n in [1, 2, 3, 8] {
            let results = run(n, |b| {
                let me = b.rank();
                let g = b.all_gather(&[me as u8; 3]).unwrap();
                let sent: Vec<Vec<u8>> = (0..n).map(|to| vec![me as u8, to as u8]).collect();
                let got = b.all_to_all(sent).unwrap();
                b.barrier().unwrap();
                (g, got)
            });
            for (me, (g, got)) in results.into_iter().enumerate() {
                assert_eq!(g, (0..n).map(|r| vec![r as u8; 3]).collect::<Vec<_>>());
                assert_eq!(got, (0..n).map(|from| vec![from as u8, me as u8]).collect::<Vec<_>>());
            }
        }
    }

    #[test]
    fn a_rank_that_never_comes_is_named() {
        let group = InProcessBootstrap::group(3, Duration::from_millis(200));
        let (a, b) = (group[0].clone(), group[1].clone());
        let t = std::thread::spawn(move || b.all_gather(b"x"));
        let err = a.all_gather(b"y").unwrap_err().to_string();
        assert!(err.contains("rank 2 never answered"), "{err}");
        let err = t.join().unwrap().unwrap_err().to_string();
        assert!(err.contains("rank 2 never answered"), "{err}");
    }

    #[test]
    fn subgroups_exchange_only_among_their_members() {
        let results = run(6, |b| {
            let me = b.rank();
            let members: Vec<usize> = (0..6).filter(|r| r % 2 == me % 2).collect();
            let parent: Arc<dyn Bootstrap> = b;
            let sub = Subgroup::new(parent, members, 77).unwrap();
            let g = sub.all_gather(&[me as u8]).unwrap();
            // A nested sub-group: the first two members of each half.
            let nested = if sub.rank() < 2 {
                let inner = Subgroup::new(Arc::new(sub) as Arc<dyn Bootstrap>, vec![0, 1], 5).unwrap();
                Some(inner.all_gather(&[me as u8]).unwrap())
            } else {
                None
            };
            (g, nested)
        });
        for (me, (g, nested)) in results.into_iter().enumerate() {
            let want: Vec<Vec<u8>> = (0..6).filter(|r| r % 2 == me % 2).map(|r| vec![r as u8]).collect();
            assert_eq!(g, want);
            if let Some(n) = nested {
                assert_eq!(n, want[..2].to_vec());
            }
        }
    }
}
