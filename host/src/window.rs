//! Symmetric memory: VMM allocations ([`SymBuffer`], like `ncclMemAlloc`) and collective
//! window registration ([`register_window`], like `ncclCommWindowRegister`).
//!
//! Registration maps every LSA peer's allocation into one flat virtual range per GPU,
//! slot `p` at `base + p * stride`, with access granted to that GPU; kernels reach a peer's
//! slot with [`DevWindow::lsa_ptr`](ferrolink_device::DevWindow::lsa_ptr).
//!
//! # Lifetimes
//! A [`Window`] owns its mappings and the buffers registered in it. Dropping the last handle
//! of a window (every rank's [`Window`] and every `DevCommHandle` it was added to) first
//! waits for all work on the ranks' devices, then unmaps the flat ranges, frees their
//! address reservations, and finally unmaps and releases the buffers. A kernel therefore
//! cannot outlive the memory its `DevWindow` points to, as long as the kernel was launched
//! before the drop; launching with a `DevWindow` copied out of a dropped window is the one
//! thing the types cannot stop, and [`Stream::launch`](crate::Stream::launch) is `unsafe`
//! for that reason.

use crate::comm::{Communicator, check_all_ranks};
use crate::cpu_vmm::{self, CpuPhysical, CpuRange};
use crate::cuda::{AddressRange, PhysicalAllocation};
use crate::device::DeviceImpl;
use crate::{Device, Error, Result};
use bytemuck::Pod;
use ferrolink_device::DevWindow;
use std::sync::Arc;

enum Physical {
    Cuda(PhysicalAllocation),
    Cpu(CpuPhysical),
}

/// A reserved address range with its mappings; unmapped and freed when dropped (also on the
/// error paths of allocation and registration).
enum Range {
    Cuda { range: Option<AddressRange>, dev: Device },
    Cpu(CpuRange),
}

impl Range {
    fn base(&self) -> u64 {
        match self {
            Range::Cuda { range, .. } => range.as_ref().map_or(0, |r| r.base),
            Range::Cpu(r) => r.base,
        }
    }
}

impl Drop for Range {
    fn drop(&mut self) {
        if let Range::Cuda { range, dev } = self
            && let Some(r) = range.take()
            && let DeviceImpl::Cuda(d) = &dev.0.imp
            && let Err(e) = r.release(d)
        {
            tracing::warn!(error = %e, "releasing a VMM mapping failed");
        }
    }
}

/// The VMM granularity of `dev`: sizes and strides are multiples of it.
pub fn granularity(dev: &Device) -> Result<usize> {
    match &dev.0.imp {
        DeviceImpl::Cuda(d) => d.vmm_granularity(),
        DeviceImpl::Cpu(_) => Ok(cpu_vmm::GRANULARITY),
    }
}

fn reserve(dev: &Device, size: usize, align: usize) -> Result<Range> {
    Ok(match &dev.0.imp {
        DeviceImpl::Cuda(d) => Range::Cuda { range: Some(AddressRange::reserve(d, size, align)?), dev: dev.clone() },
        DeviceImpl::Cpu(_) => Range::Cpu(CpuRange::reserve(size, align)?),
    })
}

fn map(dev: &Device, range: &mut Range, offset: usize, phys: &Physical) -> Result<()> {
    match (range, phys, &dev.0.imp) {
        (Range::Cuda { range: Some(r), .. }, Physical::Cuda(p), DeviceImpl::Cuda(d)) => r.map(d, offset, p),
        (Range::Cpu(r), Physical::Cpu(p), _) => r.map(offset, p),
        _ => Err(Error::InvalidArgument("window: buffers and devices of different backends".into())),
    }
}

/// Grants `dev` access to the whole (fully mapped) range.
fn grant_access(dev: &Device, range: &Range) -> Result<()> {
    match (range, &dev.0.imp) {
        (Range::Cuda { range: Some(r), .. }, DeviceImpl::Cuda(d)) => r.set_access(d, &[d]),
        _ => Ok(()),
    }
}

/// One rank's symmetric allocation: device memory from the VMM allocator, exportable,
/// granularity-sized, mapped for its device, zero-filled. Created by
/// [`Communicator::mem_alloc`]; registered into a [`Window`] with [`register_window`].
pub struct SymBuffer {
    dev: Device,
    // Dropped in this order: the mapping, then the physical memory.
    local: Range,
    phys: Physical,
    len: usize,
}

impl std::fmt::Debug for SymBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SymBuffer").field("addr", &format_args!("{:#x}", self.addr())).field("len", &self.len).finish()
    }
}

impl SymBuffer {
    fn alloc(dev: &Device, len: usize) -> Result<SymBuffer> {
        if len == 0 {
            return Err(Error::InvalidArgument(
                "mem_alloc: size 0; symmetric buffers must hold at least one byte".into(),
            ));
        }
        let g = granularity(dev)?;
        let size = len
            .checked_next_multiple_of(g)
            .ok_or_else(|| Error::InvalidArgument(format!("mem_alloc: {len} bytes is too large")))?;
        let phys = match &dev.0.imp {
            DeviceImpl::Cuda(d) => Physical::Cuda(d.mem_create(size)?),
            DeviceImpl::Cpu(_) => Physical::Cpu(CpuPhysical::create(size)?),
        };
        let mut local = reserve(dev, size, g)?;
        map(dev, &mut local, 0, &phys)?;
        grant_access(dev, &local)?;
        let buf = SymBuffer { dev: dev.clone(), local, phys, len };
        if let DeviceImpl::Cuda(d) = &dev.0.imp {
            // SAFETY: the range is mapped, accessible to `d`, `size` bytes, and unused.
            unsafe { d.memset_zero(buf.addr(), size)? };
        }
        Ok(buf)
    }

    /// The local mapping's device address.
    pub fn addr(&self) -> u64 {
        self.local.base()
    }

    /// Requested size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: symmetric buffers are never empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes actually allocated (a multiple of the granularity).
    pub fn allocated(&self) -> usize {
        match &self.phys {
            Physical::Cuda(p) => p.size,
            Physical::Cpu(p) => p.size,
        }
    }

    /// The device the memory lives on.
    pub fn device(&self) -> &Device {
        &self.dev
    }
}

impl Drop for SymBuffer {
    fn drop(&mut self) {
        // Kernels may still use the memory: finish them; the fields then unmap and release.
        let _ = self.dev.synchronize();
    }
}

impl Communicator {
    /// Allocates `bytes` of symmetric memory on this rank's device (NCCL's `ncclMemAlloc`):
    /// rounded up to the VMM granularity, exportable, zero-filled. Register one per rank with
    /// [`register_window`].
    pub fn mem_alloc(&self, bytes: usize) -> Result<SymBuffer> {
        SymBuffer::alloc(self.device(), bytes)
    }
}

struct WindowShared {
    comm_id: u64,
    /// Serializes host reads and writes of the window's buffers: handles are `Clone` and
    /// `Send`, and on the CPU backend two unsynchronized host copies into one slot would be a
    /// data race on host memory.
    host_access: std::sync::Mutex<()>,
    devices: Vec<Device>,
    /// One flat range per GPU per LSA domain; held (never read) so that dropping the window
    /// unmaps and frees them.
    _flat: Vec<Range>,
    buffers: Vec<SymBuffer>,
}

impl Drop for WindowShared {
    fn drop(&mut self) {
        // Kernels may still use the window: finish them, then unmap the flat ranges, then
        // (field drop) the buffers' own mappings and physical memory.
        for d in &self.devices {
            if let Err(e) = d.synchronize() {
                tracing::warn!(error = %e, "device error while releasing a window");
            }
        }
        // The fields then drop in order: the flat ranges (unmapped and freed), then the buffers.
    }
}

/// One rank's handle to a registered window. Clone it freely; the window lives until its
/// last handle is dropped (see the [module docs](self)).
#[derive(Clone)]
pub struct Window {
    shared: Arc<WindowShared>,
    rank: usize,
    dev_window: DevWindow,
}

impl std::fmt::Debug for Window {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Window").field("rank", &self.rank).field("dev_window", &self.dev_window).finish()
    }
}

/// Registers one [`SymBuffer`] per rank as a window (collective; NCCL's
/// `ncclCommWindowRegister`). `comms` are all ranks in rank order and `buffers[r]` is rank
/// `r`'s buffer, on its device; all buffers have the same size. Returns each rank's handle.
pub fn register_window(comms: &[Communicator], buffers: Vec<SymBuffer>) -> Result<Vec<Window>> {
    check_all_ranks(comms, "register_window")?;
    if buffers.len() != comms.len() {
        return Err(Error::InvalidArgument(format!(
            "register_window: {} buffers for {} ranks (one per rank)",
            buffers.len(),
            comms.len()
        )));
    }
    let size = buffers[0].len();
    for (r, (c, b)) in comms.iter().zip(&buffers).enumerate() {
        if !b.device().same_as(c.device()) {
            return Err(Error::WrongDevice("register_window: a rank's buffer"));
        }
        if b.len() != size {
            return Err(Error::InvalidArgument(format!(
                "register_window: rank {r}'s buffer has {} bytes but rank 0's has {size}; window \
                 buffers must have the same size on every rank",
                b.len()
            )));
        }
    }
    let stride = buffers[0].allocated();
    let lsa = comms[0].lsa_size();
    let mut flat: Vec<Range> = Vec::new();
    // The flat base each rank's kernels use: one mapping per GPU per LSA domain, shared by
    // the virtual ranks of that GPU.
    let mut base_of = vec![0u64; comms.len()];
    for domain in (0..comms.len()).step_by(lsa) {
        let ranks = domain..domain + lsa;
        let mut domain_maps: Vec<(Device, u64)> = Vec::new();
        for r in ranks.clone() {
            let dev = comms[r].device();
            if let Some((_, base)) = domain_maps.iter().find(|(d, _)| d.same_as(dev)) {
                base_of[r] = *base;
                continue;
            }
            let g = granularity(dev)?;
            let mut range = reserve(dev, lsa * stride, g)?;
            for (slot, p) in ranks.clone().enumerate() {
                map(dev, &mut range, slot * stride, &buffers[p].phys)?;
            }
            grant_access(dev, &range)?;
            base_of[r] = range.base();
            domain_maps.push((dev.clone(), range.base()));
            flat.push(range);
        }
    }
    let mut devices: Vec<Device> = Vec::new();
    for c in comms {
        if !devices.iter().any(|d| d.same_as(c.device())) {
            devices.push(c.device().clone());
        }
    }
    let shared = Arc::new(WindowShared {
        comm_id: comms[0].shared.id,
        host_access: std::sync::Mutex::new(()),
        devices,
        _flat: flat,
        buffers,
    });
    Ok(comms
        .iter()
        .map(|c| Window {
            shared: shared.clone(),
            rank: c.rank(),
            dev_window: DevWindow {
                flat_base: base_of[c.rank()],
                stride: stride as u64,
                size: size as u64,
                lsa_rank: c.lsa_rank() as u32,
                lsa_size: lsa as u32,
            },
        })
        .collect())
}

impl Window {
    /// The kernel argument for this rank.
    pub fn dev_window(&self) -> DevWindow {
        self.dev_window
    }

    /// This handle's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Usable bytes per rank.
    pub fn size(&self) -> usize {
        self.dev_window.size as usize
    }

    fn check_range<T>(&self, offset: usize, len: usize) -> Result<u64> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .and_then(|b| b.checked_add(offset))
            .filter(|&end| end <= self.size());
        if bytes.is_none() || !offset.is_multiple_of(std::mem::align_of::<T>()) {
            return Err(Error::InvalidArgument(format!(
                "window access of {len} x {} bytes at offset {offset} is outside the {}-byte window \
                 or misaligned",
                std::mem::size_of::<T>(),
                self.size()
            )));
        }
        Ok(self.shared.buffers[self.rank].addr() + offset as u64)
    }

    /// Writes `src` into this rank's buffer at byte `offset` (bounds-checked; waits first for
    /// every device that maps the window).
    pub fn copy_from_host<T: Pod>(&self, offset: usize, src: &[T]) -> Result<()> {
        let addr = self.check_range::<T>(offset, src.len())?;
        let _exclusive = self.shared.host_access.lock().unwrap_or_else(|e| e.into_inner());
        self.synchronize_peers()?;
        // SAFETY: the range was bounds-checked against this rank's live buffer; the lock
        // excludes other host copies of this window.
        unsafe { self.shared.buffers[self.rank].device().write_bytes(addr, bytemuck::cast_slice(src)) }
    }

    /// Reads this rank's buffer at byte `offset` into `dst` (bounds-checked; waits first for
    /// every device that maps the window).
    pub fn copy_to_host<T: Pod>(&self, offset: usize, dst: &mut [T]) -> Result<()> {
        let addr = self.check_range::<T>(offset, dst.len())?;
        let _exclusive = self.shared.host_access.lock().unwrap_or_else(|e| e.into_inner());
        self.synchronize_peers()?;
        // SAFETY: as above.
        unsafe { self.shared.buffers[self.rank].device().read_bytes(addr, bytemuck::cast_slice_mut(dst)) }
    }

    /// `len` elements of this rank's buffer at `offset`, as a `Vec`.
    pub fn read<T: Pod>(&self, offset: usize, len: usize) -> Result<Vec<T>> {
        let mut v = vec![T::zeroed(); len];
        self.copy_to_host(offset, &mut v)?;
        Ok(v)
    }

    /// Waits for every device whose ranks map this window: a peer on another device may be
    /// writing this slot through its own mapping.
    fn synchronize_peers(&self) -> Result<()> {
        self.shared.devices.iter().try_for_each(Device::synchronize)
    }

    pub(crate) fn comm_id(&self) -> u64 {
        self.shared.comm_id
    }
}
