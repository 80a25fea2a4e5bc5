//! Window registration ([`register_window`], like `ncclCommWindowRegister`): every LSA peer's
//! allocation mapped into one flat virtual range per GPU, slot `p` at `base + p * stride`,
//! with access granted to that GPU; kernels reach a peer's slot with
//! [`DevWindow::lsa_ptr`](ferrolink_device::DevWindow::lsa_ptr).
//!
//! # Lifetimes
//! A [`Window`] owns its mappings and the buffers registered in it. Launches that pass
//! `&window` record their use of it; host copies wait for those kernels; and when the last
//! handle (every rank's [`Window`], and every `DevCommHandle` it was added to) is dropped,
//! the flat ranges and buffers are retired: unmapped and released once the kernels that used
//! the window have finished (and any untracked launch on its devices), without waiting
//! for the devices.

use crate::comm::{Communicator, check_all_ranks};
use crate::mem::symmetric::SymBuffer;
use crate::runtime::backend::AddressRange;
use crate::runtime::device::Device;
use crate::runtime::launch::{LaunchArg, LaunchTracking, sealed::Sealed};
use crate::runtime::lifetime::{self, Completion, Uses};
use crate::{Error, Result};
use bytemuck::Pod;
use ferrolink_device::DevWindow;
use std::sync::Arc;

/// The memory of a window: retired as one piece (flat ranges first, then the buffers).
type WindowMemory = (Vec<Box<dyn AddressRange>>, Vec<SymBuffer>);

struct WindowShared {
    comm_id: u64,
    /// Serializes host reads and writes of the window's buffers: handles are `Clone` and
    /// `Send`, and on the CPU backend two unsynchronized host copies into one slot would be a
    /// data race on host memory.
    host_access: std::sync::Mutex<()>,
    devices: Vec<Device>,
    /// Each rank's buffer address (its local mapping).
    addrs: Vec<u64>,
    memory: Option<WindowMemory>,
    uses: Arc<Uses>,
}

impl WindowShared {
    /// Everything a host access or the release must wait for: every kernel that used the
    /// window, and untracked launches on its devices.
    fn pending(&self) -> Vec<Completion> {
        let mut w = self.uses.pending();
        for d in &self.devices {
            w.extend(d.0.untracked.pending());
        }
        w
    }
}

impl Drop for WindowShared {
    fn drop(&mut self) {
        if let Some(memory) = self.memory.take() {
            lifetime::retire(self.pending(), Box::new(memory), "window");
        }
    }
}

/// One rank's handle to a registered window. Clone it freely; the window lives until its
/// last handle is dropped (see the [module docs](self)).
#[derive(Clone)]
pub struct Window {
    shared: Arc<WindowShared>,
    rank: usize,
    dev: Device,
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
    let mut flat: Vec<Box<dyn AddressRange>> = Vec::new();
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
            let b = dev.backend_device();
            let mut range = b.vmm_reserve(lsa * stride, b.vmm_granularity()?)?;
            for (slot, p) in ranks.clone().enumerate() {
                range.map(slot * stride, &*buffers[p].phys)?;
            }
            range.grant_access(&[&**b])?;
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
    let addrs = buffers.iter().map(SymBuffer::addr).collect();
    let shared = Arc::new(WindowShared {
        comm_id: comms[0].shared.id,
        host_access: std::sync::Mutex::new(()),
        devices,
        addrs,
        memory: Some((flat, buffers)),
        uses: Arc::default(),
    });
    Ok(comms
        .iter()
        .map(|c| Window {
            shared: shared.clone(),
            rank: c.rank(),
            dev: c.device().clone(),
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
    /// The kernel argument for this rank, as a raw value (an untracked launch: prefer
    /// passing `&window`, which keeps the window alive until the kernel ends).
    pub fn dev_window(&self) -> DevWindow {
        self.dev_window
    }

    /// This handle's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The device of this handle's rank.
    pub fn device(&self) -> &Device {
        &self.dev
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
        Ok(self.shared.addrs[self.rank] + offset as u64)
    }

    /// Writes `src` into this rank's buffer at byte `offset` (bounds-checked). Waits first
    /// for the kernels that used the window (peers write into this slot too).
    pub fn copy_from_host<T: Pod>(&self, offset: usize, src: &[T]) -> Result<()> {
        let addr = self.check_range::<T>(offset, src.len())?;
        let _exclusive = self.shared.host_access.lock().unwrap_or_else(|e| e.into_inner());
        lifetime::wait_all(&self.shared.pending(), "Window::copy_from_host")?;
        // SAFETY: the range was bounds-checked against this rank's live buffer; no kernel
        // uses the window (waited above) and the lock excludes other host copies.
        unsafe { self.dev.backend_device().write(addr, bytemuck::cast_slice(src)) }
    }

    /// Fills `bytes` bytes of this rank's buffer at `offset` with zeros, as
    /// [`Window::copy_from_host`] does with data.
    pub fn zero(&self, offset: usize, bytes: usize) -> Result<()> {
        let addr = self.check_range::<u8>(offset, bytes)?;
        let _exclusive = self.shared.host_access.lock().unwrap_or_else(|e| e.into_inner());
        lifetime::wait_all(&self.shared.pending(), "Window::zero")?;
        // SAFETY: as in `copy_from_host`.
        unsafe { self.dev.backend_device().memset_zero(addr, bytes) }
    }

    /// Reads this rank's buffer at byte `offset` into `dst` (bounds-checked). Waits first for
    /// the kernels that used the window.
    pub fn copy_to_host<T: Pod>(&self, offset: usize, dst: &mut [T]) -> Result<()> {
        let addr = self.check_range::<T>(offset, dst.len())?;
        let _exclusive = self.shared.host_access.lock().unwrap_or_else(|e| e.into_inner());
        lifetime::wait_all(&self.shared.pending(), "Window::copy_to_host")?;
        // SAFETY: as in `copy_from_host`.
        unsafe { self.dev.backend_device().read(addr, bytemuck::cast_slice_mut(dst)) }
    }

    /// `len` elements of this rank's buffer at `offset`, as a `Vec`.
    pub fn read<T: Pod>(&self, offset: usize, len: usize) -> Result<Vec<T>> {
        let mut v = vec![T::zeroed(); len];
        self.copy_to_host(offset, &mut v)?;
        Ok(v)
    }

    /// Reads words of this rank's buffer that kernels may be updating atomically right now
    /// (for diagnosis: each word is some value it held). Does not wait.
    pub(crate) fn peek_words(&self, offset: usize, dst: &mut [u32]) -> Result<()> {
        let addr = self.check_range::<u32>(offset, dst.len())?;
        // SAFETY: bounds-checked, 4-byte aligned (checked) live memory of this rank's buffer;
        // kernels access the words peeked (barrier inboxes) only with atomics.
        unsafe { self.dev.backend_device().read_atomic_words(addr, dst) }
    }

    pub(crate) fn uses(&self) -> &Arc<Uses> {
        &self.shared.uses
    }

    pub(crate) fn comm_id(&self) -> u64 {
        self.shared.comm_id
    }
}

impl Sealed for &Window {}

impl LaunchArg for &Window {
    type Param = DevWindow;
    fn param(&self) -> DevWindow {
        self.dev_window
    }
    fn track(&self, t: &mut LaunchTracking) {
        t.expect_device(&self.dev, "window");
        t.holds.push(self.shared.uses.clone());
    }
}
