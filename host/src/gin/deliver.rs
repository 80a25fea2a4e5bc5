//! A rank's receiving side: what transports deliver for it (data into its windows, signal
//! slots), written by synchronous copies on the rank's own delivery stream
//! ([`GinRank::deliveries`]).

use super::GinRank;
use super::copy_watch::CopyFor;
use super::staging::StagingBlock;
use super::transport::{Deliver, RemoteLocation};
use crate::mem::window::Window;
use crate::runtime::lifetime::lock;
use crate::{Error, Result};

impl GinRank {
    /// This rank's buffer of window `dst.window` and the device address of `bytes` at
    /// `dst.offset` in it (checked).
    pub(crate) fn location(&self, dst: RemoteLocation, bytes: usize) -> Result<(Window, u64)> {
        let w = self.window(dst.window).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "rank {}: GIN data for window {} which is not registered here",
                self.rank, dst.window
            ))
        })?;
        let addr = w.local_addr(dst.offset as usize, bytes)?;
        Ok((w, addr))
    }
}

impl Deliver for GinRank {
    fn fail(&self, why: String) {
        GinRank::fail(self, why);
    }

    fn peer_lost(&self, from: usize, why: String) {
        tracing::warn!(target: "ferrolink::gin", rank = self.rank, from, "rank {from} is gone: {why}");
        lock(&self.lost).push((from, why));
    }

    fn staging(&self, bytes: usize) -> Option<StagingBlock> {
        // From the pool only: allocating pinned memory now may wait for running kernels.
        let pool = self.staging.as_ref()?;
        if bytes > pool.block_bytes() {
            return None;
        }
        pool.take()
    }

    fn put(&self, from: usize, dst: RemoteLocation, data: &[u8]) -> Result<()> {
        let (_w, addr) = self.location(dst, data.len())?;
        let _under_way = self.copy_watch.begin(CopyFor::DeliveryFrom(from));
        // SAFETY: the range lies in this rank's live buffer of window `_w` (checked; `_w` keeps
        // it alive until the copy has run: `write_sync` waits for it); kernels read it only
        // after the signal that follows (the GIN contract).
        unsafe { self.deliveries.write_sync(addr, data) }
    }

    fn put_value(&self, from: usize, dst: RemoteLocation, value: u64, bytes: u32) -> Result<()> {
        let (_w, addr) = self.location(dst, bytes as usize)?;
        let le = value.to_le_bytes();
        let _under_way = self.copy_watch.begin(CopyFor::DeliveryFrom(from));
        // SAFETY: as in `put`.
        unsafe { self.deliveries.write_sync(addr, &le[..bytes as usize]) }
    }

    fn signal(&self, from: usize, id: u32, inc: u64) -> Result<()> {
        if id >= self.signal_count || from >= self.nranks {
            return Err(Error::InvalidArgument(format!(
                "rank {}: GIN signal {id} from rank {from} is out of range",
                self.rank
            )));
        }
        // The slot is written whole with its new total, under the lock, so that it only grows
        // even when several connections from `from` deliver at once.
        let mut received = lock(&self.received);
        let total = received.entry((from, id)).or_insert(0);
        *total = total.wrapping_add(inc);
        let addr = self.signals.local_addr((id as usize * self.nranks + from) * 8, 8)?;
        let _under_way = self.copy_watch.begin(CopyFor::DeliveryFrom(from));
        // SAFETY: an aligned word of this rank's signal window; kernels only read it (with
        // atomics) and only this receiver writes slot `[id][from]`; the data it announces was
        // written (synchronously, on the same stream) before.
        unsafe { self.deliveries.write_sync(addr, &total.to_le_bytes()) }
    }
}
