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
///
/// ```
/// # use ferrolink::LaunchConfig;
/// # use ferrolink_device::kernels::copy::ferrolink_copy;
/// # fn main() -> ferrolink::Result<()> {
/// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// # let stream = dev.create_stream()?;
/// let src = dev.alloc_from(&[3u8; 64])?;
/// let mut dst = dev.alloc::<u8>(64)?;
/// let args = (&mut dst, &src, 64usize);
/// // SAFETY: the copy kernel's contract: 64 bytes each, no overlap.
/// unsafe { stream.launch(dev.builtin_module()?, &ferrolink_copy, LaunchConfig::linear(1, 32), args)? };
/// drop(src); // does not wait: freed once the kernel has run
/// assert_eq!(dst.to_vec()?, vec![3u8; 64]); // waits for the kernel that writes `dst`
/// # Ok(()) }
/// ```
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
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// assert_eq!(dev.alloc::<u32>(10)?.len(), 10);
    /// # Ok(()) }
    /// ```
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no elements.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// assert!(dev.alloc::<u32>(0)?.is_empty());
    /// assert!(!dev.alloc::<u32>(1)?.is_empty());
    /// # Ok(()) }
    /// ```
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size in bytes.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// assert_eq!(dev.alloc::<u32>(10)?.bytes(), 40);
    /// # Ok(()) }
    /// ```
    pub fn bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    /// The device this buffer lives on.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// assert!(dev.alloc::<u8>(4)?.device().same_as(&dev));
    /// # Ok(()) }
    /// ```
    pub fn device(&self) -> &Device {
        &self.dev
    }

    /// The device address, as a raw kernel argument (an untracked launch: prefer passing
    /// `&buffer`). Not dereferenceable on the host (on CUDA).
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let buf = dev.alloc::<u32>(4)?;
    /// assert_eq!(buf.as_kernel_ptr() as u64, buf.addr());
    /// # Ok(()) }
    /// ```
    pub fn as_kernel_ptr(&self) -> *const T {
        self.addr as *const T
    }

    /// The device address, as a raw mutable kernel argument (prefer `&mut buffer`).
    ///
    /// ```
    /// # use ferrolink::LaunchConfig;
    /// # use ferrolink_device::kernels::copy::ferrolink_copy;
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let stream = dev.create_stream()?;
    /// let src = dev.alloc_from(&[8u8; 64])?;
    /// let mut dst = dev.alloc::<u8>(64)?;
    /// // SAFETY: the copy kernel's contract (64 bytes each, no overlap); the raw pointers are
    /// // untracked, so both buffers must live until the stream is synchronized below.
    /// unsafe {
    ///     let args = (dst.as_kernel_mut_ptr(), src.as_kernel_ptr(), 64usize);
    ///     stream.launch(dev.builtin_module()?, &ferrolink_copy, LaunchConfig::linear(1, 32), args)?
    /// };
    /// stream.synchronize()?;
    /// assert_eq!(dst.to_vec()?, vec![8u8; 64]);
    /// # Ok(()) }
    /// ```
    pub fn as_kernel_mut_ptr(&mut self) -> *mut T {
        self.addr as *mut T
    }

    /// The raw device address.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let buf = dev.alloc::<u64>(4)?;
    /// assert_ne!(buf.addr(), 0);
    /// assert_eq!(buf.addr() % 256, 0); // 256-byte aligned
    /// # Ok(()) }
    /// ```
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
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let mut buf = dev.alloc::<i32>(3)?;
    /// buf.copy_from_host(&[-1, 0, 1])?;
    /// assert_eq!(buf.to_vec()?, [-1, 0, 1]);
    /// assert!(buf.copy_from_host(&[1, 2]).is_err()); // lengths differ
    /// # Ok(()) }
    /// ```
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
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let buf = dev.alloc_from(&[1.5f64, 2.5])?;
    /// let mut out = [0.0; 2];
    /// buf.copy_to_host(&mut out)?;
    /// assert_eq!(out, [1.5, 2.5]);
    /// # Ok(()) }
    /// ```
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
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let buf = dev.alloc_from(&[7u8, 8, 9])?;
    /// assert_eq!(buf.to_vec()?, vec![7, 8, 9]);
    /// # Ok(()) }
    /// ```
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
    ///
    /// ```
    /// # use ferrolink::LaunchConfig;
    /// # use ferrolink_device::kernels::copy::ferrolink_copy;
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let stream = dev.create_stream()?;
    /// let src: Vec<u8> = (0..64).collect();
    /// let src = dev.alloc_from(&src)?;
    /// let mut dst = dev.alloc::<u8>(16)?;
    /// let args = (&mut dst, src.at(48)?, 16usize);
    /// // SAFETY: the copy kernel's contract: 16 bytes from element 48 of `src` (64 bytes) into
    /// // `dst` (16 bytes), no overlap.
    /// unsafe { stream.launch(dev.builtin_module()?, &ferrolink_copy, LaunchConfig::linear(1, 32), args)? };
    /// assert_eq!(dst.to_vec()?, (48..64).collect::<Vec<u8>>());
    /// assert!(src.at(65).is_err()); // past the end
    /// # Ok(()) }
    /// ```
    pub fn at(&self, index: usize) -> Result<TrackedPtr<'_, *const T>> {
        self.tracked(index.saturating_mul(std::mem::size_of::<T>()), false)
    }

    /// Element `index` as a launch argument (`*mut T`) that tracks a write of the whole buffer.
    ///
    /// ```
    /// # use ferrolink::LaunchConfig;
    /// # use ferrolink_device::kernels::copy::ferrolink_copy;
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let stream = dev.create_stream()?;
    /// let src = dev.alloc_from(&[1u8; 8])?;
    /// let mut dst = dev.alloc::<u8>(16)?;
    /// let args = (dst.at_mut(8)?, &src, 8usize);
    /// // SAFETY: the copy kernel's contract: 8 bytes into elements 8..16 of `dst` (16 bytes), no overlap.
    /// unsafe { stream.launch(dev.builtin_module()?, &ferrolink_copy, LaunchConfig::linear(1, 32), args)? };
    /// assert_eq!(dst.to_vec()?, [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1]);
    /// # Ok(()) }
    /// ```
    pub fn at_mut(&mut self, index: usize) -> Result<TrackedPtr<'_, *mut T>> {
        self.tracked(index.saturating_mul(std::mem::size_of::<T>()), true)
    }

    /// Byte `offset` as a launch argument (`*const u8`) that tracks a read of the whole buffer.
    ///
    /// ```
    /// # use ferrolink::LaunchConfig;
    /// # use ferrolink_device::kernels::copy::ferrolink_copy;
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let stream = dev.create_stream()?;
    /// let src = dev.alloc_from(&[10u32, 20, 30, 40])?;
    /// let mut dst = dev.alloc::<u32>(2)?;
    /// let args = (dst.bytes_at_mut(0)?, src.bytes_at(8)?, 8usize);
    /// // SAFETY: the copy kernel's contract: the last 8 bytes of `src` (16 bytes) into `dst`
    /// // (8 bytes), no overlap.
    /// unsafe { stream.launch(dev.builtin_module()?, &ferrolink_copy, LaunchConfig::linear(1, 32), args)? };
    /// assert_eq!(dst.to_vec()?, [30, 40]);
    /// # Ok(()) }
    /// ```
    pub fn bytes_at(&self, offset: usize) -> Result<TrackedPtr<'_, *const u8>> {
        self.tracked(offset, false)
    }

    /// Byte `offset` as a launch argument (`*mut u8`) that tracks a write of the whole buffer.
    ///
    /// ```
    /// # use ferrolink::LaunchConfig;
    /// # use ferrolink_device::kernels::copy::ferrolink_copy;
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let stream = dev.create_stream()?;
    /// let src = dev.alloc_from(&[u32::MAX])?;
    /// let mut dst = dev.alloc::<u32>(3)?;
    /// let args = (dst.bytes_at_mut(4)?, src.bytes_at(0)?, 4usize);
    /// // SAFETY: the copy kernel's contract: 4 bytes into bytes 4..8 of `dst` (12 bytes), no overlap.
    /// unsafe { stream.launch(dev.builtin_module()?, &ferrolink_copy, LaunchConfig::linear(1, 32), args)? };
    /// assert_eq!(dst.to_vec()?, [0, u32::MAX, 0]);
    /// assert!(dst.bytes_at_mut(13).is_err()); // past the end
    /// # Ok(()) }
    /// ```
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
///
/// ```
/// # use ferrolink::LaunchConfig;
/// # use ferrolink_device::kernels::copy::ferrolink_copy;
/// # fn main() -> ferrolink::Result<()> {
/// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// # let stream = dev.create_stream()?;
/// let src = dev.alloc_from(&[6u8; 32])?;
/// let mut dst = dev.alloc::<u8>(64)?;
/// let args = (dst.at_mut(32)?, &src, 32usize);
/// // SAFETY: the copy kernel's contract: 32 bytes into the second half of `dst`, no overlap.
/// unsafe { stream.launch(dev.builtin_module()?, &ferrolink_copy, LaunchConfig::linear(1, 32), args)? };
/// drop(src); // tracked: freed once the kernel has run
/// // A host read of `dst` waits for the kernel, which wrote part of it.
/// assert_eq!(dst.to_vec()?[31..33], [0, 6]);
/// # Ok(()) }
/// ```
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
