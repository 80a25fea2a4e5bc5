//! Host memory that kernels read and write at a device address (pinned and mapped on CUDA):
//! control blocks, abort flags, error and wait records. The host reads it even after a
//! kernel fault has broken the device's context.

use crate::Result;
use crate::runtime::backend::HostMappedMemory;
use crate::runtime::device::Device;
use crate::runtime::lifetime::{self, Untracked, Uses};
use std::sync::Arc;

/// A block of host-mapped memory; retired (not freed at once) when dropped.
pub(crate) struct HostMapped {
    mem: Option<Box<dyn HostMappedMemory>>,
    bytes: usize,
    pub(crate) uses: Arc<Uses>,
    untracked: Arc<Untracked>,
    /// The device's allocation counts (tests only).
    #[cfg(test)]
    counts: Arc<Counts>,
}

/// How many host-mapped blocks a device has allocated and dropped (handed to be freed): tests
/// check with it that GIN allocates no pinned memory while kernels may run.
#[cfg(test)]
#[derive(Debug, Default)]
pub(crate) struct Counts {
    allocs: std::sync::atomic::AtomicUsize,
    frees: std::sync::atomic::AtomicUsize,
}

impl HostMapped {
    /// `bytes` of zeroed host-mapped memory for `dev`.
    pub(crate) fn alloc(dev: &Device, bytes: usize) -> Result<HostMapped> {
        let mem = dev.backend_device().alloc_host_mapped(bytes)?;
        #[cfg(test)]
        dev.0.host_mapped_counts.allocs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(HostMapped {
            mem: Some(mem),
            bytes,
            uses: Arc::default(),
            untracked: dev.0.untracked.clone(),
            #[cfg(test)]
            counts: dev.0.host_mapped_counts.clone(),
        })
    }

    /// Host-mapped blocks allocated on `dev` so far.
    #[cfg(test)]
    pub(crate) fn allocs(dev: &Device) -> usize {
        dev.0.host_mapped_counts.allocs.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Host-mapped blocks of `dev` dropped (handed to be freed) so far.
    #[cfg(test)]
    pub(crate) fn frees(dev: &Device) -> usize {
        dev.0.host_mapped_counts.frees.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn mem(&self) -> &dyn HostMappedMemory {
        self.mem.as_deref().expect("present until drop")
    }

    /// The host's address of the block.
    pub(crate) fn host_ptr(&self) -> *mut u8 {
        self.mem().host_ptr()
    }

    /// The address kernels use.
    pub(crate) fn device_addr(&self) -> u64 {
        self.mem().device_addr()
    }

    /// Bytes in the block.
    pub(crate) fn len(&self) -> usize {
        self.bytes
    }
}

impl Drop for HostMapped {
    fn drop(&mut self) {
        let mut waits = self.uses.pending_for_free();
        waits.extend(self.untracked.pending_for_free());
        if let Some(mem) = self.mem.take() {
            #[cfg(test)]
            self.counts.frees.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            lifetime::retire(waits, Box::new(mem), "host-mapped memory");
        }
    }
}
