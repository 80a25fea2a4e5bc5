//! Device memory.

use crate::runtime::backend::DeviceBackend;
use crate::runtime::device::Device;
use crate::runtime::launch::{LaunchArg, LaunchTracking, sealed::Sealed};
use crate::runtime::lifetime::{self, Completion, Uses};
use crate::{Error, Result};
use bytemuck::Pod;
use std::marker::PhantomData;
use std::sync::Arc;

/// `len` elements of `T` in device memory (host memory on the CPU backend), 256-byte aligned.
///
/// Its uses are tracked: a launch that takes `&buf` or `&mut buf` records a read or a write.
/// Host access waits for the uses that conflict with it (and for untracked launches on the
/// device), never for the whole device; dropping the buffer never waits: its memory is freed
/// once the kernels that use it have finished.
pub struct DeviceBuffer<T: Pod> {
    dev: Device,
    addr: u64,
    len: usize,
    uses: Arc<Uses>,
    _t: PhantomData<T>,
}

impl<T: Pod> std::fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer").field("addr", &format_args!("{:#x}", self.addr)).field("len", &self.len).finish()
    }
}

/// The free of a retired buffer.
struct FreeDeviceMemory {
    backend: Arc<dyn DeviceBackend>,
    addr: u64,
    bytes: usize,
}

impl Drop for FreeDeviceMemory {
    fn drop(&mut self) {
        // SAFETY: allocated by `malloc_zeroed(bytes)` on this backend device, freed once;
        // retirement runs this only after every kernel that may use it has finished.
        if let Err(e) = unsafe { self.backend.free(self.addr, self.bytes) } {
            tracing::warn!(target: "ferrolink::runtime", error = %e, "freeing device memory failed");
        }
    }
}

impl<T: Pod> DeviceBuffer<T> {
    pub(crate) fn zeroed(dev: &Device, len: usize) -> Result<Self> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| Error::InvalidArgument(format!("{len} elements overflow the address space")))?;
        lifetime::collect();
        let addr = dev.backend_device().malloc_zeroed(bytes)?;
        Ok(DeviceBuffer { dev: dev.clone(), addr, len, uses: Arc::default(), _t: PhantomData })
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    /// The device this buffer lives on.
    pub fn device(&self) -> &Device {
        &self.dev
    }

    /// The device address, as a raw kernel argument (an untracked launch: prefer passing
    /// `&buffer`). Not dereferenceable on the host (on CUDA).
    pub fn as_kernel_ptr(&self) -> *const T {
        self.addr as *const T
    }

    /// The device address, as a raw mutable kernel argument (prefer `&mut buffer`).
    pub fn as_kernel_mut_ptr(&mut self) -> *mut T {
        self.addr as *mut T
    }

    /// The raw device address.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    pub(crate) fn uses(&self) -> &Arc<Uses> {
        &self.uses
    }

    /// What a host write must wait for: every pending use, and untracked launches.
    fn before_write(&self) -> Vec<Completion> {
        let mut w = self.uses.pending();
        w.extend(self.dev.0.untracked.pending());
        w
    }

    /// What a host read must wait for: pending writes, and untracked launches.
    fn before_read(&self) -> Vec<Completion> {
        let mut w = self.uses.pending_writes();
        w.extend(self.dev.0.untracked.pending());
        w
    }

    /// Copies `src` into the buffer (lengths must match). Waits for the kernels that use the
    /// buffer first.
    pub fn copy_from_host(&mut self, src: &[T]) -> Result<()> {
        if src.len() != self.len {
            return Err(Error::InvalidArgument(format!(
                "copy_from_host: source has {} elements, buffer has {}",
                src.len(),
                self.len
            )));
        }
        lifetime::wait_all(&self.before_write(), "copy_from_host")?;
        // SAFETY: the buffer owns `self.bytes()` bytes at `addr`; `&mut self` excludes other
        // host access and every device use has finished (waited above).
        unsafe { self.dev.backend_device().write(self.addr, bytemuck::cast_slice(src)) }
    }

    /// Copies the buffer into `dst` (lengths must match). Waits for the kernels that write
    /// the buffer first.
    pub fn copy_to_host(&self, dst: &mut [T]) -> Result<()> {
        if dst.len() != self.len {
            return Err(Error::InvalidArgument(format!(
                "copy_to_host: destination has {} elements, buffer has {}",
                dst.len(),
                self.len
            )));
        }
        lifetime::wait_all(&self.before_read(), "copy_to_host")?;
        // SAFETY: the buffer owns `self.bytes()` bytes at `addr`; no device write is pending
        // (waited above) and `&self` excludes host writes.
        unsafe { self.dev.backend_device().read(self.addr, bytemuck::cast_slice_mut(dst)) }
    }

    /// The buffer's contents as a `Vec`. Waits for the kernels that write the buffer first.
    pub fn to_vec(&self) -> Result<Vec<T>> {
        let mut v = vec![T::zeroed(); self.len];
        self.copy_to_host(&mut v)?;
        Ok(v)
    }
}

impl<T: Pod> DeviceBuffer<T> {
    fn tracked<P>(&self, byte_offset: usize, write: bool) -> Result<TrackedPtr<'_, P>> {
        if byte_offset > self.bytes() {
            return Err(Error::InvalidArgument(format!(
                "offset {byte_offset} is past the end of a {}-byte buffer",
                self.bytes()
            )));
        }
        Ok(TrackedPtr {
            addr: self.addr + byte_offset as u64,
            buf: self.as_untyped(),
            write,
            hold: false,
            _p: PhantomData,
        })
    }

    fn as_untyped(&self) -> UntypedBuffer<'_> {
        UntypedBuffer { dev: &self.dev, uses: &self.uses }
    }

    /// Element `index` as a launch argument (`*const T`) that tracks a read of the whole
    /// buffer. `index` may equal `len` (an empty tail).
    pub fn at(&self, index: usize) -> Result<TrackedPtr<'_, *const T>> {
        self.tracked(index.saturating_mul(std::mem::size_of::<T>()), false)
    }

    /// Element `index` as a launch argument (`*mut T`) that tracks a write of the whole buffer.
    pub fn at_mut(&mut self, index: usize) -> Result<TrackedPtr<'_, *mut T>> {
        self.tracked(index.saturating_mul(std::mem::size_of::<T>()), true)
    }

    /// Byte `offset` as a launch argument (`*const u8`) that tracks a read of the whole buffer.
    pub fn bytes_at(&self, offset: usize) -> Result<TrackedPtr<'_, *const u8>> {
        self.tracked(offset, false)
    }

    /// Byte `offset` as a launch argument (`*mut u8`) that tracks a write of the whole buffer.
    pub fn bytes_at_mut(&mut self, offset: usize) -> Result<TrackedPtr<'_, *mut u8>> {
        self.tracked(offset, true)
    }
}

/// What a [`TrackedPtr`] needs of its buffer, whatever its element type.
#[derive(Clone, Copy)]
struct UntypedBuffer<'a> {
    dev: &'a Device,
    uses: &'a Arc<Uses>,
}

/// A pointer into a [`DeviceBuffer`] that a launch tracks as a use of the whole buffer (see
/// [`DeviceBuffer::at`], [`DeviceBuffer::bytes_at_mut`]): for kernels that take a pointer to
/// part of a buffer. `P` is the kernel parameter: `*const T` (a read) or `*mut T` (a write;
/// made from a `&mut` borrow).
pub struct TrackedPtr<'a, P> {
    addr: u64,
    buf: UntypedBuffer<'a>,
    write: bool,
    /// Kept alive only, not ordered against other streams' uses (memory that a protocol of
    /// its own orders: a window slot that peers' kernels use under barriers).
    hold: bool,
    _p: PhantomData<P>,
}

impl<'a, P> TrackedPtr<'a, P> {
    /// A pointer at `addr` into memory whose uses `uses` records (a window's buffer, shared
    /// by the ranks of this process), on `dev`: the launch keeps the memory alive but is not
    /// ordered after other streams' uses of it (peers' kernels hold the window for as long
    /// as they run; ordering against them is the window protocol's, e.g. barriers).
    pub(crate) fn held(addr: u64, dev: &'a Device, uses: &'a Arc<Uses>) -> TrackedPtr<'a, P> {
        TrackedPtr { addr, buf: UntypedBuffer { dev, uses }, write: false, hold: true, _p: PhantomData }
    }

    fn track_into(&self, t: &mut LaunchTracking) {
        t.expect_device(self.buf.dev, "buffer");
        let list = if self.hold {
            &mut t.holds
        } else if self.write {
            &mut t.writes
        } else {
            &mut t.reads
        };
        list.push(self.buf.uses.clone());
    }
}

impl<T: 'static> Sealed for TrackedPtr<'_, *const T> {}

impl<T: 'static> LaunchArg for TrackedPtr<'_, *const T> {
    type Param = *const T;
    fn param(&self) -> *const T {
        self.addr as *const T
    }
    fn track(&self, t: &mut LaunchTracking) {
        self.track_into(t)
    }
}

impl<T: 'static> Sealed for TrackedPtr<'_, *mut T> {}

impl<T: 'static> LaunchArg for TrackedPtr<'_, *mut T> {
    type Param = *mut T;
    fn param(&self) -> *mut T {
        self.addr as *mut T
    }
    fn track(&self, t: &mut LaunchTracking) {
        self.track_into(t)
    }
}

impl<T: Pod> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        let payload =
            FreeDeviceMemory { backend: self.dev.backend_device().clone(), addr: self.addr, bytes: self.bytes() };
        let mut waits = self.uses.pending_for_free();
        waits.extend(self.dev.0.untracked.pending_for_free());
        lifetime::retire(waits, Box::new(payload), "device buffer");
    }
}

impl<T: Pod> Sealed for &DeviceBuffer<T> {}

impl<T: Pod> LaunchArg for &DeviceBuffer<T> {
    type Param = *const T;
    fn param(&self) -> *const T {
        self.addr as *const T
    }
    fn track(&self, t: &mut LaunchTracking) {
        t.expect_device(&self.dev, "buffer");
        t.reads.push(self.uses.clone());
    }
}

impl<T: Pod> Sealed for &mut DeviceBuffer<T> {}

impl<T: Pod> LaunchArg for &mut DeviceBuffer<T> {
    type Param = *mut T;
    fn param(&self) -> *mut T {
        self.addr as *mut T
    }
    fn track(&self, t: &mut LaunchTracking) {
        t.expect_device(&self.dev, "buffer");
        t.writes.push(self.uses.clone());
    }
}
