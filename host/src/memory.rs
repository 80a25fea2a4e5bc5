//! Device memory.

use crate::device::{Device, DeviceImpl};
use crate::{Error, Result};
use bytemuck::Pod;
use std::marker::PhantomData;

/// `len` elements of `T` in device memory (host memory on the CPU backend), 256-byte aligned.
///
/// Host access ([`copy_from_host`](Self::copy_from_host), [`to_vec`](Self::to_vec), …) first
/// waits for all work on the device, so the host never races a kernel. Dropping a buffer also
/// waits for the device, so no queued kernel can outlive the memory it uses. Allocating does
/// not wait for running kernels.
///
/// With several ranks on one device, launch every rank's kernel before touching any buffer
/// from the host: a host access waits for all kernels, and a kernel that waits for a rank
/// whose launch comes after that access never finishes.
pub struct DeviceBuffer<T: Pod> {
    dev: Device,
    addr: u64,
    len: usize,
    _t: PhantomData<T>,
}

impl<T: Pod> std::fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer").field("addr", &format_args!("{:#x}", self.addr)).field("len", &self.len).finish()
    }
}

impl<T: Pod> DeviceBuffer<T> {
    pub(crate) fn zeroed(dev: &Device, len: usize) -> Result<Self> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| Error::InvalidArgument(format!("{len} elements overflow the address space")))?;
        let addr = match &dev.0.imp {
            DeviceImpl::Cuda(d) => {
                let p = d.malloc(bytes)?;
                // SAFETY: `p` is a fresh allocation of `bytes` bytes.
                unsafe { d.memset_zero(p, bytes)? };
                p
            }
            DeviceImpl::Cpu(d) => d.malloc(bytes)?,
        };
        Ok(DeviceBuffer { dev: dev.clone(), addr, len, _t: PhantomData })
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

    /// The device address, as a kernel argument. Not dereferenceable on the host (on CUDA).
    pub fn as_kernel_ptr(&self) -> *const T {
        self.addr as *const T
    }

    /// The device address, as a mutable kernel argument.
    pub fn as_kernel_mut_ptr(&mut self) -> *mut T {
        self.addr as *mut T
    }

    /// The raw device address.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Copies `src` into the buffer (lengths must match). Waits for the device first.
    pub fn copy_from_host(&mut self, src: &[T]) -> Result<()> {
        if src.len() != self.len {
            return Err(Error::InvalidArgument(format!(
                "copy_from_host: source has {} elements, buffer has {}",
                src.len(),
                self.len
            )));
        }
        // SAFETY: the buffer owns `self.bytes()` bytes at `addr`; `&mut self` excludes other
        // host access.
        unsafe { self.dev.write_bytes(self.addr, bytemuck::cast_slice(src)) }
    }

    /// Copies the buffer into `dst` (lengths must match). Waits for the device first.
    pub fn copy_to_host(&self, dst: &mut [T]) -> Result<()> {
        if dst.len() != self.len {
            return Err(Error::InvalidArgument(format!(
                "copy_to_host: destination has {} elements, buffer has {}",
                dst.len(),
                self.len
            )));
        }
        // SAFETY: the buffer owns `self.bytes()` bytes at `addr`.
        unsafe { self.dev.read_bytes(self.addr, bytemuck::cast_slice_mut(dst)) }
    }

    /// The buffer's contents as a `Vec`. Waits for the device first.
    pub fn to_vec(&self) -> Result<Vec<T>> {
        let mut v = vec![T::zeroed(); self.len];
        self.copy_to_host(&mut v)?;
        Ok(v)
    }
}

impl<T: Pod> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        // Queued kernels may still use the memory: wait for them (as cudaFree does).
        if let Err(e) = self.dev.synchronize() {
            tracing::warn!(error = %e, "device error while freeing a buffer");
        }
        let bytes = self.bytes();
        match &self.dev.0.imp {
            DeviceImpl::Cuda(d) => {
                // SAFETY: allocated by `malloc` on this device, freed once, device idle.
                if let Err(e) = unsafe { d.free(self.addr) } {
                    tracing::warn!(error = %e, "cuMemFree failed");
                }
            }
            // SAFETY: allocated by `malloc(bytes)`, freed once, all streams drained.
            DeviceImpl::Cpu(d) => unsafe { d.free(self.addr, bytes) },
        }
    }
}
