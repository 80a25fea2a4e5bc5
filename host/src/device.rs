//! [`Device`]: one GPU, or one emulated device on the CPU.

use crate::cpu::CpuDevice;
use crate::cuda::CudaDevice;
use crate::launch::Module;
use crate::memory::DeviceBuffer;
use crate::stream::Stream;
use crate::{Backend, Error, Result};
use bytemuck::Pod;
use std::sync::{Arc, OnceLock};

pub(crate) enum DeviceImpl {
    Cuda(CudaDevice),
    Cpu(CpuDevice),
}

pub(crate) struct DeviceInner {
    // Declared first so that it is dropped first: the module is unloaded while the device's
    // context is still retained (`imp` releases it).
    builtin: OnceLock<Module>,
    pub(crate) imp: DeviceImpl,
    ordinal: usize,
}

/// A device: a GPU on [`Backend::Cuda`], or an emulated GPU on [`Backend::Cpu`]. Cheap to
/// clone (shared handle). Buffers, streams and modules keep their device alive.
#[derive(Clone)]
pub struct Device(pub(crate) Arc<DeviceInner>);

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device").field("backend", &self.backend()).field("ordinal", &self.0.ordinal).finish()
    }
}

impl Device {
    /// Opens device `ordinal` on the default backend ([`Backend::from_env`]): CUDA when a
    /// driver and GPU are present, else the CPU emulator; `FERROLINK_BACKEND=cuda|cpu` forces one.
    pub fn open(ordinal: usize) -> Result<Device> {
        Device::open_with(Backend::from_env()?, ordinal)
    }

    /// Opens device `ordinal` on `backend`. On [`Backend::Cpu`] any ordinal names an
    /// independent emulated device.
    pub fn open_with(backend: Backend, ordinal: usize) -> Result<Device> {
        let imp = match backend {
            Backend::Cuda => DeviceImpl::Cuda(CudaDevice::open(ordinal)?),
            Backend::Cpu => DeviceImpl::Cpu(CpuDevice::new()),
        };
        tracing::debug!(%backend, ordinal, "opened device");
        Ok(Device(Arc::new(DeviceInner { builtin: OnceLock::new(), imp, ordinal })))
    }

    /// The backend this device runs on.
    pub fn backend(&self) -> Backend {
        match self.0.imp {
            DeviceImpl::Cuda(_) => Backend::Cuda,
            DeviceImpl::Cpu(_) => Backend::Cpu,
        }
    }

    /// The ordinal given at open.
    pub fn ordinal(&self) -> usize {
        self.0.ordinal
    }

    /// A human-readable name: the GPU's, or `CPU emulator`.
    pub fn name(&self) -> String {
        match &self.0.imp {
            DeviceImpl::Cuda(d) => d.name.clone(),
            DeviceImpl::Cpu(_) => "CPU emulator".into(),
        }
    }

    /// Streaming multiprocessors (on the emulator: the host's available parallelism).
    pub fn sm_count(&self) -> u32 {
        match &self.0.imp {
            DeviceImpl::Cuda(d) => d.sm_count,
            DeviceImpl::Cpu(_) => std::thread::available_parallelism().map_or(1, |n| n.get() as u32),
        }
    }

    /// Creates a stream. On CUDA it is non-blocking, so streams of different ranks on one
    /// GPU run concurrently.
    pub fn create_stream(&self) -> Result<Stream> {
        Stream::new(self)
    }

    /// Allocates `len` zeroed elements of device memory (256-byte aligned on both backends).
    pub fn alloc<T: Pod>(&self, len: usize) -> Result<DeviceBuffer<T>> {
        DeviceBuffer::zeroed(self, len)
    }

    /// Allocates device memory holding a copy of `data`.
    pub fn alloc_from<T: Pod>(&self, data: &[T]) -> Result<DeviceBuffer<T>> {
        let mut b = DeviceBuffer::zeroed(self, data.len())?;
        b.copy_from_host(data)?;
        Ok(b)
    }

    /// Loads a module of kernels from PTX (built by `ferrolink-builder`). On the CPU backend
    /// the PTX is not needed to run kernels, but it is checked to declare each launched entry.
    pub fn load_module(&self, ptx: &str) -> Result<Module> {
        Module::load(self, ptx)
    }

    /// The module of ferrolink's built-in kernels ([`crate::DEVICE_PTX`]), loaded on first use.
    pub fn builtin_module(&self) -> Result<&Module> {
        if let Some(m) = self.0.builtin.get() {
            return Ok(m);
        }
        let m = Module::load_builtin(self, crate::DEVICE_PTX)?;
        Ok(self.0.builtin.get_or_init(|| m))
    }

    /// Waits for all work on all streams of this device; returns the first error.
    pub fn synchronize(&self) -> Result<()> {
        if crate::cuda::in_group_launch() {
            return Err(Error::InvalidArgument(
                "waiting for the whole device inside launch_all would wait for ranks not yet \
                 launched (a deadlock): do host accesses, frees and synchronization after it"
                    .into(),
            ));
        }
        match &self.0.imp {
            DeviceImpl::Cuda(d) => d.synchronize(),
            DeviceImpl::Cpu(d) => d.synchronize(),
        }
    }

    /// Writes `src` to device address `addr`, after waiting for all work on the device; the
    /// data has landed when this returns.
    ///
    /// # Safety
    /// `[addr, addr + src.len())` is device memory of this device that the caller owns.
    pub(crate) unsafe fn write_bytes(&self, addr: u64, src: &[u8]) -> Result<()> {
        self.synchronize()?;
        match &self.0.imp {
            // SAFETY: the caller's contract; the device is idle.
            DeviceImpl::Cuda(d) => unsafe { d.htod(addr, src) },
            DeviceImpl::Cpu(_) => {
                // SAFETY: the caller's contract; no stream runs (synchronized above).
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), addr as *mut u8, src.len()) };
                Ok(())
            }
        }
    }

    /// Reads device address `addr` into `dst`, after waiting for all work on the device.
    ///
    /// # Safety
    /// As [`Device::write_bytes`].
    pub(crate) unsafe fn read_bytes(&self, addr: u64, dst: &mut [u8]) -> Result<()> {
        self.synchronize()?;
        match &self.0.imp {
            // SAFETY: the caller's contract; the device is idle.
            DeviceImpl::Cuda(d) => unsafe { d.dtoh(dst, addr) },
            DeviceImpl::Cpu(_) => {
                // SAFETY: the caller's contract; no stream runs.
                unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, dst.as_mut_ptr(), dst.len()) };
                Ok(())
            }
        }
    }

    /// Whether both handles name the same device: the same GPU on CUDA (two `Device`s opened
    /// on one GPU share its primary context, and windows must map it once, not through two
    /// aliasing ranges), the same emulated device on the CPU backend.
    pub(crate) fn same_as(&self, other: &Device) -> bool {
        match (&self.0.imp, &other.0.imp) {
            (DeviceImpl::Cuda(a), DeviceImpl::Cuda(b)) => a.raw_device() == b.raw_device(),
            _ => Arc::ptr_eq(&self.0, &other.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_builtin_module_does_not_keep_its_device_alive() {
        let dev = Device::open_with(Backend::Cpu, 0).unwrap();
        dev.builtin_module().unwrap();
        assert_eq!(Arc::strong_count(&dev.0), 1, "the built-in module must refer to its device weakly");
        let weak = Arc::downgrade(&dev.0);
        drop(dev);
        assert!(weak.upgrade().is_none(), "the device was not freed");
    }
}
