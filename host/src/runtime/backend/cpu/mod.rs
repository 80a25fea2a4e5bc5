//! The CPU backend: device memory is aligned host memory, a stream is a worker thread that
//! runs its operations in order, kernels run on the emulator
//! ([`ferrolink_device::emulator`]), and VMM is emulated with memfds ([`vmm`]).

mod stream;
pub(crate) mod vmm;

use super::{AddressRange, DeviceBackend, DeviceKey, HostMappedMemory, ModuleBackend, PhysicalMemory, StreamBackend};
use crate::{Backend, Error, Result};
use std::alloc::Layout;
use std::any::Any;
use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};

/// The emulator's launch figures: few, narrow CTAs (every CTA's threads are host threads,
/// and every rank's kernels share the host's cores), small point-to-point slots so that tests
/// cross many, and a 60 s timeout.
pub(crate) const LAUNCH_PROFILE: super::LaunchProfile = super::LaunchProfile {
    coll_threads: 8,
    ll_threads: 8,
    coll_bytes_per_cta: 1 << 20,
    waiting_ctas: Some(4),
    moe_threads: 64,
    moe_ctas: Some(2),
    copy_threads: 64,
    copy_ctas: Some(8),
    staging_copy: Some((1, 8)),
    p2p_channels: 2,
    p2p_slots: 4,
    p2p_chunk_bytes: Some(16 << 10),
    default_timeout_secs: 60.0,
};

/// Alignment of CPU-backend allocations: the same 256 bytes `cuMemAlloc` guarantees.
const ALLOC_ALIGN: usize = 256;

/// An emulated device.
pub(crate) struct CpuDevice {
    id: u64,
}

impl CpuDevice {
    pub(crate) fn new() -> CpuDevice {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        CpuDevice { id: NEXT.fetch_add(1, Ordering::Relaxed) }
    }
}

fn layout(bytes: usize) -> Result<Layout> {
    Layout::from_size_align(bytes.max(1), ALLOC_ALIGN)
        .map_err(|_| Error::InvalidArgument(format!("allocation of {bytes} bytes is too large")))
}

fn alloc_zeroed(bytes: usize) -> Result<*mut u8> {
    let layout = layout(bytes)?;
    // SAFETY: `layout` has non-zero size.
    let p = unsafe { std::alloc::alloc_zeroed(layout) };
    if p.is_null() {
        return Err(Error::InvalidArgument(format!("out of host memory allocating {bytes} bytes")));
    }
    Ok(p)
}

/// # Safety
/// `p` came from `alloc_zeroed(bytes)` and is not used after this.
unsafe fn dealloc(p: *mut u8, bytes: usize) {
    let layout = layout(bytes).expect("the layout was valid at allocation");
    // SAFETY: the caller's contract.
    unsafe { std::alloc::dealloc(p, layout) }
}

impl DeviceBackend for CpuDevice {
    fn kind(&self) -> Backend {
        Backend::Cpu
    }

    fn key(&self) -> DeviceKey {
        DeviceKey::Cpu(self.id)
    }

    fn name(&self) -> String {
        "CPU emulator".into()
    }

    fn sm_count(&self) -> u32 {
        std::thread::available_parallelism().map_or(1, |n| n.get() as u32)
    }

    fn uuid(&self) -> [u8; 16] {
        let mut u = [0u8; 16];
        u[..4].copy_from_slice(b"FLEM");
        u[4..8].copy_from_slice(&std::process::id().to_le_bytes());
        u[8..16].copy_from_slice(&self.id.to_le_bytes());
        u
    }

    fn can_access_uuid(&self, uuid: &[u8; 16]) -> Result<bool> {
        // Every emulated device of this machine: memory crosses processes as memfds.
        Ok(uuid[..4] == *b"FLEM")
    }

    fn check_multi_process(&self) -> Result<()> {
        Ok(()) // emulated kernels are host threads: processes always run at once
    }

    fn mem_info(&self) -> Result<(usize, usize)> {
        Err(Error::InvalidArgument("device memory figures exist only on CUDA devices".into()))
    }

    fn malloc_zeroed(&self, bytes: usize) -> Result<u64> {
        Ok(alloc_zeroed(bytes)? as u64)
    }

    unsafe fn free(&self, addr: u64, bytes: usize) -> Result<()> {
        // SAFETY: the caller's contract (allocated by `malloc_zeroed(bytes)`, unused).
        unsafe { dealloc(addr as *mut u8, bytes) };
        Ok(())
    }

    unsafe fn write(&self, addr: u64, src: &[u8]) -> Result<()> {
        // SAFETY: the caller's contract: the range is ours and nothing else accesses it.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), addr as *mut u8, src.len()) };
        Ok(())
    }

    unsafe fn read(&self, addr: u64, dst: &mut [u8]) -> Result<()> {
        // SAFETY: the caller's contract: the range is valid and not written meanwhile (or
        // only by word-sized atomics, which a bytewise copy reads as some value each).
        unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    unsafe fn memset_zero(&self, addr: u64, bytes: usize) -> Result<()> {
        // SAFETY: the caller's contract: the range is ours and nothing else accesses it.
        unsafe { std::ptr::write_bytes(addr as *mut u8, 0, bytes) };
        Ok(())
    }

    unsafe fn read_atomic_words(&self, addr: u64, dst: &mut [u32]) -> Result<()> {
        for (i, w) in dst.iter_mut().enumerate() {
            // SAFETY: the caller's contract: live, aligned words that kernels (emulated
            // threads) access only atomically; so do we.
            *w = unsafe { std::sync::atomic::AtomicU32::from_ptr((addr as *mut u32).add(i)) }
                .load(std::sync::atomic::Ordering::Relaxed);
        }
        Ok(())
    }

    fn alloc_host_mapped(&self, bytes: usize) -> Result<Box<dyn HostMappedMemory>> {
        Ok(Box::new(CpuHostMemory { ptr: alloc_zeroed(bytes)?, bytes }))
    }

    fn create_stream(&self) -> Result<Box<dyn StreamBackend>> {
        Ok(Box::new(stream::CpuStream::new()?))
    }

    fn stream_queues(&self) -> Option<(usize, &'static str)> {
        None
    }

    fn load_module(
        &self,
        _ptx: &str,
        _cubin: Option<&[u8]>,
        _entries: &HashSet<String>,
        _device_runtime: bool,
    ) -> Result<Box<dyn ModuleBackend>> {
        // Kernels run from their host entries; the PTX only tells which entries exist.
        Ok(Box::new(CpuModule))
    }

    fn vmm_granularity(&self) -> Result<usize> {
        Ok(vmm::GRANULARITY)
    }

    fn vmm_memory_is_zeroed(&self) -> bool {
        true // a fresh memfd reads as zeros
    }

    fn vmm_create(&self, size: usize) -> Result<Box<dyn PhysicalMemory>> {
        Ok(Box::new(vmm::CpuPhysical::create(size)?))
    }

    fn vmm_reserve(&self, size: usize, align: usize) -> Result<Box<dyn AddressRange>> {
        Ok(Box::new(vmm::CpuRange::reserve(size, align)?))
    }

    fn vmm_import(&self, fd: std::os::fd::OwnedFd, size: usize) -> Result<Box<dyn PhysicalMemory>> {
        Ok(Box::new(vmm::CpuPhysical::from_fd(fd, size)?))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

struct CpuModule;

impl ModuleBackend for CpuModule {
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// "Host-mapped" memory on the emulator: plain host memory.
struct CpuHostMemory {
    ptr: *mut u8,
    bytes: usize,
}

// SAFETY: the allocation is owned by this value; the runtime accesses its words only
// atomically or through its own synchronization.
unsafe impl Send for CpuHostMemory {}
// SAFETY: as above.
unsafe impl Sync for CpuHostMemory {}

impl HostMappedMemory for CpuHostMemory {
    fn host_ptr(&self) -> *mut u8 {
        self.ptr
    }
    fn device_addr(&self) -> u64 {
        self.ptr as u64
    }
}

impl Drop for CpuHostMemory {
    fn drop(&mut self) {
        // SAFETY: allocated by `alloc_zeroed(bytes)`; the runtime retires host-mapped memory
        // only after the kernels that used it finished.
        unsafe { dealloc(self.ptr, self.bytes) }
    }
}
