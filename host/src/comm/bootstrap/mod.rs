//! Bootstrap: how the ranks of a job find each other and exchange small messages on the host,
//! before and beside the device (NCCL's bootstrap). Every collective host call of a
//! communicator (`register_window`, `create_dev_comm`, `split`, …) is a few bootstrap
//! exchanges.
//!
//! One trait, [`Bootstrap`]: tagged point-to-point messages between ranks. The collectives
//! (all-gather, all-to-all, barrier, sub-groups) are written once on top of it
//! ([`BootstrapExt`]). Two implementations:
//! * [`in_process`]: the ranks are threads of one process (`Communicator::init_all`);
//! * [`tcp`]: one rank per process, on any machines, from a [`UniqueId`] (a root address, a
//!   random magic and a random secret) that the program passes around itself, or that a
//!   launcher's environment describes (`Communicator::from_env`).
//!
//! The TCP protocol's logic (frames, handshake, rendezvous) is a sans-IO core in [`proto`],
//! unit-tested with simulated peers and fuzzed; the socket code only moves bytes.
//!
//! Tags: each collective takes the next tag from [`Bootstrap::next_tag`], a counter every rank
//! advances in the same order (collectives are called in the same order on every rank), so
//! messages of two collectives never mix. A sub-group's tags live in their own namespace.

pub mod in_process;
pub mod proto;
pub mod tcp;

pub use proto::UniqueId;

use crate::{Error, Result};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Tagged messages between the ranks of a job, and the collectives built on them. A message
/// sent with `(to, tag)` is received by rank `to`'s `recv(from, tag)`; messages between one
/// pair with one tag arrive in order. The collectives have default implementations on the
/// messages; an implementation may provide faster ones (the in-process bootstrap does).
///
/// ```
/// # fn main() -> ferrolink::Result<()> {
/// use ferrolink::comm::bootstrap::{Bootstrap, in_process::InProcessBootstrap};
/// use std::time::Duration;
///
/// /// Written once for any bootstrap: every rank's number, gathered.
/// fn gather_ranks(b: &dyn Bootstrap) -> ferrolink::Result<Vec<Vec<u8>>> {
///     b.all_gather(&[b.rank() as u8])
/// }
///
/// let group = InProcessBootstrap::group(3, Duration::from_secs(10));
/// let results = std::thread::scope(|s| {
///     let ranks: Vec<_> = group.iter().map(|b| s.spawn(move || gather_ranks(&**b))).collect();
///     ranks.into_iter().map(|h| h.join().unwrap()).collect::<ferrolink::Result<Vec<_>>>()
/// })?;
/// assert!(results.iter().all(|g| *g == vec![vec![0], vec![1], vec![2]]));
/// # Ok(()) }
/// ```
pub trait Bootstrap: Send + Sync {
    /// This rank.
    fn rank(&self) -> usize;
    /// Ranks in the job.
    fn nranks(&self) -> usize;
    /// How long a receive may wait.
    fn timeout(&self) -> Duration;
    /// Sends `data` to rank `to` under `tag` (does not wait for the receiver).
    fn send(&self, to: usize, tag: u64, data: &[u8]) -> Result<()>;
    /// Receives the next message from rank `from` under `tag`, waiting at most
    /// [`Bootstrap::timeout`]; the error names `from`.
    fn recv(&self, from: usize, tag: u64) -> Result<Vec<u8>>;
    /// The next collective's tag (see the module docs).
    fn next_tag(&self) -> u64;
    /// A short description for errors ("TCP bootstrap, root 10.0.0.1:29501").
    fn describe(&self) -> String;

    /// Gathers every rank's `data` (sizes may differ): element `r` is rank `r`'s. If ranks
    /// never send, the error names all of them.
    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        let tag = self.next_tag();
        let (me, n) = (self.rank(), self.nranks());
        for to in (0..n).filter(|&r| r != me) {
            self.send(to, tag, data)?;
        }
        let mut out = Vec::with_capacity(n);
        let mut missing = Vec::new();
        let mut first_err = None;
        for from in 0..n {
            if from == me {
                out.push(data.to_vec());
                continue;
            }
            match self.recv(from, tag) {
                Ok(d) => out.push(d),
                Err(e) => {
                    missing.push(from);
                    first_err.get_or_insert(e);
                    out.push(Vec::new());
                }
            }
        }
        match first_err {
            None => Ok(out),
            Some(e) => Err(Error::Bootstrap(format!(
                "rank {me}: {} never answered an all-gather within {:?} ({}; first error: {e})",
                ranks_phrase(&missing),
                self.timeout(),
                self.describe()
            ))),
        }
    }

    /// Sends `data[r]` to rank `r` and returns what every rank sent to this one.
    fn all_to_all(&self, data: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>> {
        let (me, n) = (self.rank(), self.nranks());
        if data.len() != n {
            return Err(Error::InvalidArgument(format!("all_to_all: {} messages for {n} ranks", data.len())));
        }
        let tag = self.next_tag();
        for (to, d) in data.iter().enumerate().filter(|(r, _)| *r != me) {
            self.send(to, tag, d)?;
        }
        let mut out = Vec::with_capacity(n);
        for (from, d) in data.into_iter().enumerate() {
            out.push(if from == me { d } else { self.recv(from, tag)? });
        }
        Ok(out)
    }

    /// Returns when every rank has called it.
    fn barrier(&self) -> Result<()> {
        self.all_gather(&[]).map(drop)
    }
}

/// The collectives used to live in an extension trait; they are [`Bootstrap`]'s own methods
/// now (so that an implementation can provide faster ones). This name keeps old imports working.
pub use self::Bootstrap as BootstrapExt;

/// "rank 3", "ranks 1 and 6", "ranks 1, 4 and 6".
pub(crate) fn ranks_phrase(ranks: &[usize]) -> String {
    match ranks {
        [] => "no rank".into(),
        [one] => format!("rank {one}"),
        many => {
            let (last, rest) = many.split_last().expect("non-empty");
            let rest: Vec<String> = rest.iter().map(usize::to_string).collect();
            format!("ranks {} and {last}", rest.join(", "))
        }
    }
}

/// A bootstrap over some ranks of a parent one (a sub-communicator's), carried by the
/// parent's messages under tags of its own namespace.
///
/// ```
/// # fn main() -> ferrolink::Result<()> {
/// use ferrolink::comm::bootstrap::{Bootstrap, Subgroup, in_process::InProcessBootstrap};
/// use std::time::Duration;
/// let group = InProcessBootstrap::group(4, Duration::from_secs(10));
/// // The even ranks and the odd ranks each gather among themselves.
/// let results = std::thread::scope(|s| {
///     let ranks: Vec<_> = group
///         .into_iter()
///         .map(|b| {
///             s.spawn(move || {
///                 let me = b.rank();
///                 let members: Vec<usize> = (0..4).filter(|r| r % 2 == me % 2).collect();
///                 Subgroup::new(b, members, 1)?.all_gather(&[me as u8])
///             })
///         })
///         .collect();
///     ranks.into_iter().map(|h| h.join().unwrap()).collect::<ferrolink::Result<Vec<_>>>()
/// })?;
/// assert_eq!(results[0], [vec![0], vec![2]]);
/// assert_eq!(results[3], [vec![1], vec![3]]);
/// # Ok(()) }
/// ```
pub struct Subgroup {
    parent: Arc<dyn Bootstrap>,
    /// Parent ranks of the members, in the sub-group's rank order.
    members: Vec<usize>,
    rank: usize,
    /// The namespace: mixed into every tag.
    space: u64,
    seq: AtomicU64,
}

/// A sub-group's tag on its parent: `tag` mixed with the namespace by a 64-bit mixer
/// (splitmix64's), so that the tags of sub-groups (nested ones too) and the parent's own small
/// sequence numbers do not meet (a collision has a chance of about 2^-64).
fn mix_tag(space: u64, tag: u64) -> u64 {
    let mut z = space.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ tag.wrapping_add(0xD1B5_4A32_D192_ED03);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Subgroup {
    /// The sub-group of `members` (parent ranks in their new order; this rank among them).
    /// `space` must be the same on every member and differ from the namespaces of the
    /// parent's other live sub-groups that share members (the caller derives it from the
    /// parent's next tag).
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// use ferrolink::comm::bootstrap::{Bootstrap, Subgroup, in_process::InProcessBootstrap};
    /// let group = InProcessBootstrap::group(3, std::time::Duration::from_secs(1));
    /// let sub = Subgroup::new(group[2].clone(), vec![2, 0], 7)?;
    /// assert_eq!((sub.rank(), sub.nranks()), (0, 2)); // parent rank 2 comes first
    /// assert!(Subgroup::new(group[1].clone(), vec![2, 0], 7).is_err(), "rank 1 is not a member");
    /// # Ok(()) }
    /// ```
    pub fn new(parent: Arc<dyn Bootstrap>, members: Vec<usize>, space: u64) -> Result<Subgroup> {
        let me = parent.rank();
        let rank = members.iter().position(|&m| m == me).ok_or_else(|| {
            Error::InvalidArgument(format!("subgroup: rank {me} is not among the members {members:?}"))
        })?;
        Ok(Subgroup { parent, members, rank, space, seq: AtomicU64::new(0) })
    }
}

impl Bootstrap for Subgroup {
    fn rank(&self) -> usize {
        self.rank
    }
    fn nranks(&self) -> usize {
        self.members.len()
    }
    fn timeout(&self) -> Duration {
        self.parent.timeout()
    }
    fn send(&self, to: usize, tag: u64, data: &[u8]) -> Result<()> {
        let to = *self
            .members
            .get(to)
            .ok_or_else(|| Error::InvalidArgument(format!("send to rank {to} of {}", self.members.len())))?;
        self.parent.send(to, mix_tag(self.space, tag), data)
    }
    fn recv(&self, from: usize, tag: u64) -> Result<Vec<u8>> {
        let from = *self
            .members
            .get(from)
            .ok_or_else(|| Error::InvalidArgument(format!("recv from rank {from} of {}", self.members.len())))?;
        self.parent.recv(from, mix_tag(self.space, tag))
    }
    fn next_tag(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::Relaxed)
    }
    fn describe(&self) -> String {
        format!("sub-group of {} ranks over the {}", self.members.len(), self.parent.describe())
    }
}
