//! Bootstrap: how the ranks of a job find each other and exchange small messages before and
//! beside the device (NCCL's bootstrap). Every collective host call of a communicator
//! (`register_window`, `create_dev_comm`, `split`, …) is a few bootstrap exchanges.
//!
//! One trait, [`Bootstrap`], three ways in:
//! * [`in_process`]: the ranks are threads of one process (`Communicator::init_all`);
//! * [`tcp`]: one rank per process, anywhere, from a [`UniqueId`] (a root address, a random
//!   magic and a random secret) that the program passes around itself, or that a launcher's
//!   environment describes (`Communicator::from_env`).
//!
//! The TCP protocol's logic (frames, handshake, rendezvous, ring schedules) is a sans-IO core
//! in [`proto`], unit-tested with simulated peers and fuzzed; the socket code only moves
//! bytes.

pub mod in_process;
pub mod proto;
pub mod tcp;

pub use proto::UniqueId;

use crate::Result;
use std::time::Duration;

/// The exchanges the host side of a job needs. Every rank calls each collective method in the
/// same order; a call returns when every rank has made it, or fails with an error that names
/// the ranks that never came (after [`Bootstrap::timeout`]).
pub trait Bootstrap: Send + Sync {
    /// This rank.
    fn rank(&self) -> usize;
    /// Ranks in the job.
    fn nranks(&self) -> usize;
    /// How long one exchange may wait for the slowest rank.
    fn timeout(&self) -> Duration;
    /// Gathers every rank's `data` (sizes may differ): element `r` is rank `r`'s.
    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>>;
    /// Sends `data[r]` to rank `r` and returns what every rank sent to this one.
    fn all_to_all(&self, data: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>> {
        // The generic form: every rank gathers every row and keeps its column. Bootstrap
        // messages are small; an implementation may route better.
        let n = self.nranks();
        if data.len() != n {
            return Err(crate::Error::InvalidArgument(format!("all_to_all: {} messages for {n} ranks", data.len())));
        }
        let row = proto::encode_blobs(&data);
        let rows = self.all_gather(&row)?;
        rows.iter()
            .enumerate()
            .map(|(from, r)| {
                let mut blobs = proto::decode_blobs(r, n)
                    .map_err(|e| crate::Error::Bootstrap(format!("all_to_all: rank {from}'s row: {e}")))?;
                Ok(std::mem::take(&mut blobs[self.rank()]))
            })
            .collect()
    }
    /// Returns when every rank has called it.
    fn barrier(&self) -> Result<()> {
        self.all_gather(&[]).map(drop)
    }
    /// A bootstrap over `members` (ranks of this one, in their new order; this rank among
    /// them), for a sub-communicator. Collective over exactly those members, which all pass
    /// the same `members` and `tag`; other ranks do not take part.
    fn subgroup(&self, members: &[usize], tag: u64) -> Result<Box<dyn Bootstrap>>;
}
