//! Symmetric allocations: device memory from the VMM allocator, exportable and mappable into
//! every peer's window.

use crate::comm::Communicator;
use crate::runtime::backend::{AddressRange, PhysicalMemory};
use crate::runtime::device::Device;
use crate::runtime::lifetime;
use crate::{Error, Result};
use std::sync::Arc;

/// The VMM granularity of `dev`: sizes and strides of symmetric memory are multiples of it.
///
/// ```
/// # use ferrolink::{Communicator, Device};
/// # fn main() -> ferrolink::Result<()> {
/// let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// let g = ferrolink::mem::granularity(&dev)?;
/// assert!(g.is_power_of_two());
/// let comm = Communicator::init_all(&[dev])?.remove(0);
/// assert_eq!(comm.mem_alloc(g + 1)?.allocated(), 2 * g);
/// # Ok(()) }
/// ```
pub fn granularity(dev: &Device) -> Result<usize> {
    dev.backend_device().vmm_granularity()
}

/// One rank's symmetric allocation: device memory from the VMM allocator, exportable,
/// granularity-sized, mapped for its device, zero-filled. Created by
/// [`Communicator::mem_alloc`]; registered into a [`crate::Window`] with
/// [`crate::register_window`]. Dropping it never waits: it is unmapped and released once the
/// kernels that may use it have finished.
///
/// ```
/// # use ferrolink::{Communicator, Device};
/// # fn main() -> ferrolink::Result<()> {
/// let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// let comms = Communicator::init_all(&[dev.clone(), dev])?;
/// let bufs = comms.iter().map(|c| c.mem_alloc(100)).collect::<ferrolink::Result<Vec<_>>>()?;
/// assert!(bufs.iter().all(|b| b.len() == 100 && b.allocated() >= 100));
/// let windows = ferrolink::register_window(&comms, bufs)?; // one buffer per rank
/// assert_eq!(windows[1].size(), 100);
/// # Ok(()) }
/// ```
pub struct SymBuffer {
    dev: Device,
    /// The local mapping; taken on drop (unmapped before the physical memory is released).
    local: Option<Box<dyn AddressRange>>,
    pub(crate) phys: Arc<dyn PhysicalMemory>,
    base: u64,
    len: usize,
}

impl std::fmt::Debug for SymBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SymBuffer").field("addr", &format_args!("{:#x}", self.base)).field("len", &self.len).finish()
    }
}

impl SymBuffer {
    fn alloc(dev: &Device, len: usize) -> Result<SymBuffer> {
        if len == 0 {
            return Err(Error::InvalidArgument(
                "mem_alloc: size 0; symmetric buffers must hold at least one byte".into(),
            ));
        }
        lifetime::collect();
        let b = dev.backend_device();
        let g = b.vmm_granularity()?;
        let size = len
            .checked_next_multiple_of(g)
            .ok_or_else(|| Error::InvalidArgument(format!("mem_alloc: {len} bytes is too large")))?;
        let phys: Arc<dyn PhysicalMemory> = Arc::from(b.vmm_create(size)?);
        let mut local = b.vmm_reserve(size, g)?;
        local.map(0, &*phys)?;
        local.grant_access(&[&**b])?;
        let base = local.base();
        let buf = SymBuffer { dev: dev.clone(), local: Some(local), phys, base, len };
        if !b.vmm_memory_is_zeroed() {
            // SAFETY: the range is mapped, accessible to the device, `size` bytes, and unused.
            unsafe { b.memset_zero(base, size)? };
        }
        Ok(buf)
    }

    /// The local mapping's device address.
    ///
    /// ```
    /// # use ferrolink::{Communicator, Device};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// let (a, b) = (comms[0].mem_alloc(64)?, comms[0].mem_alloc(64)?);
    /// assert_ne!(a.addr(), b.addr());
    /// assert_eq!(a.addr() % ferrolink::mem::granularity(&dev)? as u64, 0);
    /// # Ok(()) }
    /// ```
    pub fn addr(&self) -> u64 {
        self.base
    }

    /// Requested size in bytes.
    ///
    /// ```
    /// # use ferrolink::{Communicator, Device};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// assert_eq!(comms[0].mem_alloc(100)?.len(), 100);
    /// # Ok(()) }
    /// ```
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: symmetric buffers are never empty.
    ///
    /// ```
    /// # use ferrolink::{Communicator, Device};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// assert!(!comms[0].mem_alloc(1)?.is_empty());
    /// assert!(comms[0].mem_alloc(0).is_err()); // no empty buffer to begin with
    /// # Ok(()) }
    /// ```
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes actually allocated (a multiple of the granularity).
    ///
    /// ```
    /// # use ferrolink::{Communicator, Device};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// let g = ferrolink::mem::granularity(&dev)?;
    /// assert_eq!(comms[0].mem_alloc(100)?.allocated(), g);
    /// # Ok(()) }
    /// ```
    pub fn allocated(&self) -> usize {
        self.phys.size()
    }

    /// The device the memory lives on.
    ///
    /// ```
    /// # use ferrolink::{Communicator, Device};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// assert!(comms[1].mem_alloc(64)?.device().same_as(&dev));
    /// # Ok(()) }
    /// ```
    pub fn device(&self) -> &Device {
        &self.dev
    }
}

impl Drop for SymBuffer {
    fn drop(&mut self) {
        // Kernels reach a lone SymBuffer only through its raw address (untracked launches);
        // inside a window, the window keeps it until the window's kernels finished.
        let waits = self.dev.0.untracked.pending_for_free();
        let payload = (self.local.take(), self.phys.clone());
        lifetime::retire(waits, Box::new(payload), "symmetric buffer");
    }
}

impl Communicator {
    /// Allocates `bytes` of symmetric memory on this rank's device (NCCL's `ncclMemAlloc`):
    /// rounded up to the VMM granularity, exportable, zero-filled. Register one per rank with
    /// [`crate::register_window`].
    ///
    /// ```
    /// # use ferrolink::{Communicator, Device};
    /// # fn main() -> ferrolink::Result<()> {
    /// let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
    /// let buf = comms[0].mem_alloc(1000)?;
    /// assert_eq!(buf.len(), 1000);
    /// assert_eq!(buf.allocated(), ferrolink::mem::granularity(&dev)?); // rounded up
    /// # Ok(()) }
    /// ```
    pub fn mem_alloc(&self, bytes: usize) -> Result<SymBuffer> {
        SymBuffer::alloc(self.device(), bytes)
    }
}
