//! The CPU backend's emulation of CUDA VMM: a physical allocation is a `memfd`, a reserved
//! range is a `PROT_NONE` anonymous mapping, and mapping maps the memfd into it with
//! `MAP_SHARED | MAP_FIXED`. So, as on the GPU, one allocation appears at several virtual
//! addresses (a rank's own buffer and its slot in every window's flat range), and a store
//! through one is seen through the others. All of this module's unsafe code is FFI.

use super::super::{AddressRange, DeviceBackend, PhysicalMemory, mixed_backends};
use crate::{Error, Result};
use std::any::Any;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// The CPU backend's "VMM granularity": the same 2 MiB as the H200's, so that sizes and
/// alignments behave the same on both backends.
pub(crate) const GRANULARITY: usize = 2 << 20;

fn os_err(what: &str) -> Error {
    Error::InvalidArgument(format!("{what} failed: {}", std::io::Error::last_os_error()))
}

/// A memfd of `size` bytes (zero-filled by the kernel).
#[derive(Debug)]
pub(crate) struct CpuPhysical {
    fd: OwnedFd,
    pub(crate) size: usize,
}

impl CpuPhysical {
    pub(crate) fn create(size: usize) -> Result<CpuPhysical> {
        // SAFETY: the name is a valid C string; flags are valid.
        let raw = unsafe { libc::memfd_create(c"ferrolink-vmm".as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(os_err("memfd_create"));
        }
        // SAFETY: `raw` is a fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: `fd` is a valid memfd.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), size as libc::off_t) } != 0 {
            return Err(os_err("ftruncate"));
        }
        Ok(CpuPhysical { fd, size })
    }
}

/// A reserved address range; mappings into it are replaced by the reservation again on
/// unmap, and the whole range is unmapped on drop.
#[derive(Debug)]
pub(crate) struct CpuRange {
    pub(crate) base: u64,
    pub(crate) size: usize,
}

impl CpuRange {
    /// Reserves `size` bytes aligned to `align` (a power of two).
    pub(crate) fn reserve(size: usize, align: usize) -> Result<CpuRange> {
        let span = size + align;
        // SAFETY: an anonymous PROT_NONE reservation; no existing mapping is touched.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                span,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(os_err("mmap (address reservation)"));
        }
        let start = p as usize;
        let base = start.next_multiple_of(align);
        // SAFETY: trimming the unaligned head and the tail of our own reservation.
        unsafe {
            if base > start {
                libc::munmap(p, base - start);
            }
            let end = base + size;
            if start + span > end {
                libc::munmap(end as *mut libc::c_void, start + span - end);
            }
        }
        Ok(CpuRange { base: base as u64, size })
    }

    fn map_memfd(&self, offset: usize, phys: &CpuPhysical) -> Result<()> {
        if offset.checked_add(phys.size).is_none_or(|end| end > self.size) {
            return Err(Error::InvalidArgument(format!(
                "mapping {} bytes at offset {offset} overruns a {}-byte range",
                phys.size, self.size
            )));
        }
        // SAFETY: the target lies inside our reservation (checked above); MAP_FIXED replaces
        // only our own PROT_NONE pages there.
        let p = unsafe {
            libc::mmap(
                (self.base as usize + offset) as *mut libc::c_void,
                phys.size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                phys.fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(os_err("mmap (map memfd into range)"));
        }
        Ok(())
    }
}

impl CpuPhysical {
    /// A memfd another process exported, checked to hold at least `size` bytes.
    pub(crate) fn from_fd(fd: OwnedFd, size: usize) -> Result<CpuPhysical> {
        // SAFETY: `st` is written by fstat on a valid descriptor we own.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `fd` is a valid open descriptor; `st` is valid for writes.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(os_err("fstat (imported memory)"));
        }
        if (st.st_size as u64) < size as u64 {
            return Err(Error::InvalidArgument(format!(
                "imported memory holds {} bytes, not the {size} its owner announced",
                st.st_size
            )));
        }
        Ok(CpuPhysical { fd, size })
    }
}

impl PhysicalMemory for CpuPhysical {
    fn size(&self) -> usize {
        self.size
    }
    fn export_fd(&self) -> Result<OwnedFd> {
        self.fd.try_clone().map_err(|e| Error::InvalidArgument(format!("duplicating a memfd failed: {e}")))
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl AddressRange for CpuRange {
    fn base(&self) -> u64 {
        self.base
    }
    fn map(&mut self, offset: usize, phys: &dyn PhysicalMemory) -> Result<()> {
        let phys = phys.as_any().downcast_ref::<CpuPhysical>().ok_or_else(|| mixed_backends("mapping memory"))?;
        self.map_memfd(offset, phys)
    }
    fn grant_access(&self, _devices: &[&dyn DeviceBackend]) -> Result<()> {
        // Host memory: every emulated device already reaches it.
        Ok(())
    }
}

impl Drop for CpuRange {
    fn drop(&mut self) {
        // SAFETY: the range is ours; the runtime retires ranges only after the kernels that
        // used them finished.
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.size) };
    }
}
