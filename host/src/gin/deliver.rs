//! A rank's receiving side: what transports deliver for it (data into its windows, signal
//! slots), written on the rank's own delivery stream ([`GinRank::deliveries`]): a batch of
//! deliveries is queued in order and waited for once ([`Deliver::deliver`]); a single one
//! is a batch of one.
//!
//! # Ordering
//! Every delivery of the rank goes on its one delivery stream, which runs them in order. A
//! signal is a stream write of the slot's new total (`cuStreamWriteValue64`, after a memory
//! barrier, so after the copies queued before it on the stream have landed); kernels read the
//! slot with acquire loads, so the data a signal announces is visible to them once they see
//! it. Totals are computed and queued under one lock, so a slot's writes reach the stream in
//! increasing order even when several connections from one rank deliver at once.

use super::GinRank;
use super::copy_watch::CopyFor;
use super::staging::StagingBlock;
use super::transport::{Deliver, Delivery, RemoteLocation};
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

    // Single operations go the way of a batch of one.
    fn put(&self, from: usize, dst: RemoteLocation, data: &[u8]) -> Result<()> {
        self.deliver(from, data, None, &[Delivery::Put { dst, range: 0..data.len() }])
    }

    fn put_value(&self, from: usize, dst: RemoteLocation, value: u64, bytes: u32) -> Result<()> {
        let bytes = u8::try_from(bytes).ok().filter(|b| matches!(b, 1 | 2 | 4 | 8)).ok_or_else(|| {
            Error::InvalidArgument(format!("rank {}: a GIN value of {bytes} bytes (1, 2, 4 or 8)", self.rank))
        })?;
        self.deliver(from, &[], None, &[Delivery::PutValue { dst, le: value.to_le_bytes(), bytes }])
    }

    fn signal(&self, from: usize, id: u32, inc: u64) -> Result<()> {
        self.deliver(from, &[], None, &[Delivery::Signal { id, inc }])
    }

    fn deliver(&self, from: usize, buf: &[u8], buf_device: Option<u64>, ops: &[Delivery]) -> Result<()> {
        let _under_way = self.copy_watch.begin(CopyFor::DeliveryFrom(from));
        // The windows written, kept alive until their copies have run.
        let mut windows: Vec<Window> = Vec::new();
        let queued = self.queue_deliveries(from, buf, buf_device, ops, &mut windows);
        // Wait also after a failure: what was queued reads `buf` and `ops`, which the caller
        // may reuse once this returns.
        let landed = self.deliveries.synchronize();
        drop(windows);
        queued.and(landed)
    }
}

/// Copies `(dst, src, bytes)` to queue as one batch.
type Copies = Vec<(u64, u64, usize)>;

/// The most puts in one batch of copies: a buffer of many tiny puts goes as several.
const MAX_BATCH_COPIES: usize = 256;

impl GinRank {
    /// Queues `ops` on the delivery stream, in order, keeping the windows they write in
    /// `windows`; stops at the first that fails. From pinned memory (`buf_device`), the puts
    /// between two signals go as batches of copies (one submission: each costs about 0.2 ms
    /// while the ranks' kernels hold every SM) of at most [`MAX_BATCH_COPIES`], cut where a
    /// put's destination overlaps one already in the batch (a batch's copies run in no
    /// order).
    fn queue_deliveries(
        &self,
        from: usize,
        buf: &[u8],
        buf_device: Option<u64>,
        ops: &[Delivery],
        windows: &mut Vec<Window>,
    ) -> Result<()> {
        let mut batch: Copies = Vec::new();
        let flush = |batch: &mut Copies| -> Result<()> {
            // SAFETY: each copy reads `buf` (pinned, the caller's until the stream has run
            // them: `deliver` waits) and writes a checked range of a window kept in `windows`;
            // the destinations do not overlap each other (checked as they were added) nor the
            // sources (host memory); kernels read them only after the signal that follows.
            let r = unsafe { self.deliveries.copy_batch(batch) };
            batch.clear();
            r
        };
        let queued = (|| {
            for op in ops {
                self.queue_delivery(from, buf, buf_device, op, windows, &mut batch, &flush)?;
            }
            Ok(())
        })();
        // The puts batched before a failure go too: they came before the failed operation.
        let flushed = flush(&mut batch);
        queued.and(flushed)
    }

    /// Queues `op` ([`GinRank::queue_deliveries`]), adding a put from pinned memory to `batch`.
    #[allow(clippy::too_many_arguments)]
    fn queue_delivery(
        &self,
        from: usize,
        buf: &[u8],
        buf_device: Option<u64>,
        op: &Delivery,
        windows: &mut Vec<Window>,
        batch: &mut Copies,
        flush: &dyn Fn(&mut Copies) -> Result<()>,
    ) -> Result<()> {
        match op {
            Delivery::Put { dst, range } => {
                let data = &buf[range.clone()];
                let (w, addr) = self.location(*dst, data.len())?;
                windows.push(w);
                if let Some(base) = buf_device {
                    let end = addr + data.len() as u64;
                    // A bounded batch keeps this check short (it is linear in the batch).
                    if batch.len() >= MAX_BATCH_COPIES || batch.iter().any(|&(d, _, n)| addr < d + n as u64 && d < end)
                    {
                        flush(batch)?;
                    }
                    batch.push((addr, base + range.start as u64, data.len()));
                    return Ok(());
                }
                // SAFETY: the range lies in this rank's live buffer of window `w` (checked;
                // `w` is kept in `windows` until the caller has synchronized the stream);
                // `data` is the caller's, which it keeps until then (`deliver` waits);
                // kernels read the range only after the signal that follows (the GIN
                // contract).
                unsafe { self.deliveries.write_async(addr, data)? };
            }
            Delivery::PutValue { dst, le, bytes } => {
                flush(batch)?;
                let (w, addr) = self.location(*dst, usize::from(*bytes))?;
                // SAFETY: as for a put; `le` lies in `ops`, kept by the caller until the
                // stream has run the copy.
                unsafe { self.deliveries.write_async(addr, &le[..usize::from(*bytes)])? };
                windows.push(w);
            }
            Delivery::Signal { id, inc } => {
                flush(batch)?;
                self.queue_signal(from, *id, *inc)?
            }
        }
        Ok(())
    }

    /// Queues the write of signal `id`'s slot for sender `from`, with `inc` added to its total,
    /// after everything queued on the delivery stream before.
    fn queue_signal(&self, from: usize, id: u32, inc: u64) -> Result<()> {
        if id >= self.signal_count || from >= self.nranks {
            return Err(Error::InvalidArgument(format!(
                "rank {}: GIN signal {id} from rank {from} is out of range",
                self.rank
            )));
        }
        // The slot is written whole with its new total, queued under the lock, so that it
        // only grows even when several connections from `from` deliver at once.
        let mut received = lock(&self.received);
        let total = received.entry((from, id)).or_insert(0);
        *total = total.wrapping_add(inc);
        let addr = self.signals.local_addr((id as usize * self.nranks + from) * 8, 8)?;
        // SAFETY: an aligned word of this rank's signal window (communicator memory, which
        // allows stream writes), live as long as the rank; kernels only read it (with atomics)
        // and only this receiver writes slot `[id][from]`; the stream writes it after the
        // data queued before it (module docs).
        unsafe { self.deliveries.write_value(addr, *total, 8) }
    }
}
