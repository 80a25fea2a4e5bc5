//! The TCP transport's pinned staging memory: a fixed pool of host-mapped blocks of one size,
//! made when the rank's GIN is created (before its proxy starts, before any kernel can use
//! it) and freed when the rank's GIN is dropped.
//!
//! # Why a pool
//! On CUDA, allocating or freeing page-locked host memory (`cuMemHostAlloc`, `cuMemFreeHost`)
//! may wait for the device's running kernels. GIN kernels spin on signals that the transport
//! delivers, so a sender or receiver thread that allocated (or freed) pinned memory while they
//! ran could wait for kernels that wait for it: a deadlock (seen on two H200s). So nothing is
//! allocated or freed while the rank's GIN lives: the transport's threads take blocks from the
//! pool ([`StagingPool::take`]), and a [`StagingBlock`] goes back to the pool when dropped. When
//! the pool is empty they use ordinary (pageable) memory instead, which never waits for the
//! device.

use super::copy_watch::CopyWatch;
use crate::Result;
use crate::runtime::backend::StreamBackend;
use crate::runtime::device::Device;
use crate::runtime::host_mapped::HostMapped;
use crate::runtime::lifetime::lock;
use std::sync::{Arc, Mutex, Weak};

/// A fixed set of pinned host blocks of one size.
pub(crate) struct StagingPool {
    free: Mutex<Vec<HostMapped>>,
    block_bytes: usize,
    count: usize,
    /// The streams that copy sources into blocks, made now too (a stream made while kernels
    /// run may wait for them, as an allocation may): connections share them round robin.
    streams: Vec<Arc<dyn StreamBackend>>,
    /// The rank's copies under way: senders note their waits for `streams` here.
    pub(crate) watch: Arc<CopyWatch>,
}

impl StagingPool {
    /// `count` blocks of `block_bytes` host-mapped bytes of `dev`, allocated now, and
    /// `streams` (at least one) copy streams, whose copies senders note in `watch`.
    pub(crate) fn new(
        dev: &Device,
        count: usize,
        block_bytes: usize,
        streams: usize,
        watch: Arc<CopyWatch>,
    ) -> Result<Arc<StagingPool>> {
        let free = (0..count).map(|_| HostMapped::alloc(dev, block_bytes)).collect::<Result<Vec<_>>>()?;
        let streams = (0..streams.max(1))
            .map(|_| dev.backend_device().create_stream().map(Arc::from))
            .collect::<Result<Vec<Arc<dyn StreamBackend>>>>()?;
        Ok(Arc::new(StagingPool { free: Mutex::new(free), block_bytes, count, streams, watch }))
    }

    /// The copy stream for connection `i` (shared with every `streams.len()`-th one).
    pub(crate) fn copy_stream(&self, i: usize) -> Arc<dyn StreamBackend> {
        self.streams[i % self.streams.len()].clone()
    }

    /// A free block, if there is one (never allocates, never waits).
    pub(crate) fn take(self: &Arc<Self>) -> Option<StagingBlock> {
        let mem = lock(&self.free).pop()?;
        Some(StagingBlock { mem: Some(mem), pool: Arc::downgrade(self) })
    }

    /// Takes a block from the pool behind `pool`, if it lives and has one.
    pub(crate) fn take_from(pool: &Weak<StagingPool>) -> Option<StagingBlock> {
        pool.upgrade()?.take()
    }

    /// The size of every block.
    pub(crate) fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// Blocks in the pool, handed out or not.
    pub(crate) fn count(&self) -> usize {
        self.count
    }

    /// Blocks in the pool now (not handed out).
    #[cfg(test)]
    pub(crate) fn available(&self) -> usize {
        lock(&self.free).len()
    }
}

/// A block taken from a [`StagingPool`]; it goes back to the pool when dropped (or, once the
/// pool is gone, that is at teardown, it is freed).
pub(crate) struct StagingBlock {
    mem: Option<HostMapped>,
    pool: Weak<StagingPool>,
}

impl std::ops::Deref for StagingBlock {
    type Target = HostMapped;

    fn deref(&self) -> &HostMapped {
        self.mem.as_ref().expect("present until drop")
    }
}

impl Drop for StagingBlock {
    fn drop(&mut self) {
        let Some(mem) = self.mem.take() else { return };
        // The holder has finished with it: no device copy into or out of it is pending
        // (the sender waits for its copy stream before it drops its blocks; the receiver's
        // copies are synchronous).
        if let Some(pool) = self.pool.upgrade() {
            lock(&pool.free).push(mem);
        }
        // Else the rank's GIN is gone (teardown): `mem` is freed here.
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Backend;

    #[test]
    fn the_pool_hands_out_its_blocks_and_takes_them_back() {
        let dev = Device::open_with(Backend::Cpu, 0).unwrap();
        let pool = StagingPool::new(&dev, 3, 4096, 1, Default::default()).unwrap();
        let allocs = HostMapped::allocs(&dev);
        assert_eq!((pool.count(), pool.available(), pool.block_bytes()), (3, 3, 4096));
        let mut held: Vec<StagingBlock> = std::iter::from_fn(|| pool.take()).collect();
        assert_eq!(held.len(), 3, "at most its blocks");
        assert!(held.iter().all(|b| b.len() == 4096));
        assert!(pool.take().is_none() && StagingPool::take_from(&Arc::downgrade(&pool)).is_none());
        let addrs: std::collections::HashSet<u64> = held.iter().map(|b| b.device_addr()).collect();
        assert_eq!(addrs.len(), 3, "distinct blocks");
        drop(held.pop());
        assert_eq!(pool.available(), 1);
        let again = pool.take().expect("a returned block is handed out again");
        assert!(addrs.contains(&again.device_addr()));
        drop(again);
        drop(held);
        assert_eq!(pool.available(), 3);
        // Taking and returning blocks neither allocates nor frees.
        assert_eq!(HostMapped::allocs(&dev), allocs);
        assert_eq!(HostMapped::frees(&dev), 0);
        // A block out when the pool goes is freed when it is dropped.
        let out = pool.take().unwrap();
        let weak = Arc::downgrade(&pool);
        drop(pool);
        assert_eq!(HostMapped::frees(&dev), 2);
        assert!(StagingPool::take_from(&weak).is_none());
        drop(out);
        assert_eq!(HostMapped::frees(&dev), 3);
    }
}
