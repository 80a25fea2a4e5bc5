//! [`Device`]: one GPU, or one emulated device on the CPU.

use crate::runtime::backend::{self, DeviceBackend, DeviceKey};
use crate::runtime::lifetime::{self, Untracked, lock};
use crate::runtime::memory::DeviceBuffer;
use crate::runtime::module::Module;
use crate::runtime::stream::{Stream, StreamCore};
use crate::{Backend, Error, Result};
use bytemuck::Pod;
use std::sync::{Arc, Mutex, OnceLock, Weak};

// (Aligned: every launch and buffer clones the `Arc` of its device, from every rank thread;
// the counts then stay off the lines of the fields that those threads only read.)
#[repr(align(128))]
pub(crate) struct DeviceInner {
    // Declared first so that it is dropped first, while the device is otherwise whole.
    builtin: OnceLock<Module>,
    builtin_loading: Mutex<()>,
    pub(crate) backend: Arc<dyn DeviceBackend>,
    ordinal: usize,
    /// Completions of launches whose memory use is not tracked (raw addresses).
    pub(crate) untracked: Arc<Untracked>,
    /// The device's live streams, for [`Device::synchronize`].
    streams: Mutex<Vec<Weak<StreamCore>>>,
    /// How many host-mapped blocks it has allocated and freed (tests only).
    #[cfg(test)]
    pub(crate) host_mapped_counts: Arc<crate::runtime::host_mapped::Counts>,
}

/// A device: a GPU on [`Backend::Cuda`], or an emulated GPU on [`Backend::Cpu`]. Cheap to
/// clone (shared handle). Buffers, streams and modules keep their device alive.
///
/// ```
/// # use ferrolink::{Backend, Device};
/// # fn main() -> ferrolink::Result<()> {
/// let buf = {
///     let dev = Device::open_with(Backend::Cpu, 0)?;
///     dev.alloc_from(&[1u32, 2, 3])?
/// }; // the last `Device` handle is gone...
/// assert_eq!(buf.to_vec()?, [1, 2, 3]); // ...but the buffer keeps its device alive
/// assert_eq!(buf.device().backend(), Backend::Cpu);
/// # Ok(()) }
/// ```
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
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// let dev = ferrolink::Device::open(0)?; // GPU 0, or the emulator without one
    /// assert_eq!(dev.backend(), ferrolink::Backend::from_env()?);
    /// # Ok(()) }
    /// ```
    pub fn open(ordinal: usize) -> Result<Device> {
        Device::open_with(Backend::from_env()?, ordinal)
    }

    /// Opens device `ordinal` on `backend`. On [`Backend::Cpu`] any ordinal names an
    /// independent emulated device.
    ///
    /// ```
    /// # use ferrolink::{Backend, Device};
    /// # fn main() -> ferrolink::Result<()> {
    /// let a = Device::open_with(Backend::Cpu, 0)?;
    /// let b = Device::open_with(Backend::Cpu, 1)?;
    /// assert!(!a.same_as(&b)); // two independent emulated devices
    /// # Ok(()) }
    /// ```
    pub fn open_with(backend: Backend, ordinal: usize) -> Result<Device> {
        crate::log::init();
        let imp = backend::open(backend, ordinal)?;
        tracing::debug!(target: "ferrolink::runtime", %backend, ordinal, name = %imp.name(), "opened device");
        Ok(Device(Arc::new(DeviceInner {
            builtin: OnceLock::new(),
            builtin_loading: Mutex::new(()),
            backend: imp,
            ordinal,
            untracked: Arc::default(),
            streams: Mutex::new(Vec::new()),
            #[cfg(test)]
            host_mapped_counts: Arc::default(),
        })))
    }

    /// The backend this device runs on.
    ///
    /// ```
    /// # use ferrolink::{Backend, Device};
    /// # fn main() -> ferrolink::Result<()> {
    /// let dev = Device::open_with(Backend::Cpu, 0)?;
    /// assert_eq!(dev.backend(), Backend::Cpu);
    /// # Ok(()) }
    /// ```
    pub fn backend(&self) -> Backend {
        self.0.backend.kind()
    }

    /// The ordinal given at open.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 3)?;
    /// assert_eq!(dev.ordinal(), 3);
    /// # Ok(()) }
    /// ```
    pub fn ordinal(&self) -> usize {
        self.0.ordinal
    }

    /// A human-readable name: the GPU's, or `CPU emulator`.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// assert_eq!(dev.name(), "CPU emulator");
    /// # Ok(()) }
    /// ```
    pub fn name(&self) -> String {
        self.0.backend.name()
    }

    /// Streaming multiprocessors (on the emulator: the host's available parallelism).
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    /// assert_eq!(dev.sm_count() as usize, cores);
    /// # Ok(()) }
    /// ```
    pub fn sm_count(&self) -> u32 {
        self.0.backend.sm_count()
    }

    /// The launch figures of this device's backend.
    pub(crate) fn launch_profile(&self) -> &'static backend::LaunchProfile {
        backend::launch_profile(self.backend())
    }

    /// The most CTAs per rank of a kernel whose CTAs must all be resident at once (they wait
    /// for each other), with `ranks_sharing` ranks on this device: the backend's `figure`, or,
    /// without one, the SMs shared evenly by those ranks.
    pub(crate) fn resident_ctas(&self, figure: Option<u32>, ranks_sharing: usize) -> u32 {
        figure.unwrap_or_else(|| (self.sm_count() / ranks_sharing.max(1) as u32).max(1))
    }

    /// Free and total device memory in bytes (CUDA only; for leak checks in tests and tools).
    ///
    /// ```no_run
    /// # fn main() -> ferrolink::Result<()> {
    /// // Needs a GPU: on the emulator `mem_info` returns an error.
    /// let dev = ferrolink::Device::open_with(ferrolink::Backend::Cuda, 0)?;
    /// let (free, total) = dev.mem_info()?;
    /// assert!(free <= total);
    /// # Ok(()) }
    /// ```
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.0.backend.mem_info()
    }

    /// Creates a stream. On CUDA it is non-blocking, so streams of different ranks on one
    /// GPU run concurrently.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let stream = dev.create_stream()?;
    /// assert!(stream.device().same_as(&dev));
    /// # Ok(()) }
    /// ```
    pub fn create_stream(&self) -> Result<Stream> {
        let s = Stream::new(self)?;
        let mut streams = lock(&self.0.streams);
        streams.retain(|w| w.strong_count() > 0);
        streams.push(Arc::downgrade(s.core()));
        Ok(s)
    }

    /// Allocates `len` zeroed elements of device memory (256-byte aligned on both backends).
    /// Never waits for running kernels.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let buf = dev.alloc::<f32>(16)?;
    /// assert_eq!(buf.to_vec()?, vec![0.0; 16]);
    /// assert_eq!(buf.addr() % 256, 0);
    /// # Ok(()) }
    /// ```
    pub fn alloc<T: Pod>(&self, len: usize) -> Result<DeviceBuffer<T>> {
        DeviceBuffer::zeroed(self, len)
    }

    /// Allocates device memory holding a copy of `data`.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let buf = dev.alloc_from(&[1u16, 2, 3])?;
    /// assert_eq!(buf.to_vec()?, [1, 2, 3]);
    /// # Ok(()) }
    /// ```
    pub fn alloc_from<T: Pod>(&self, data: &[T]) -> Result<DeviceBuffer<T>> {
        let mut b = DeviceBuffer::zeroed(self, data.len())?;
        b.copy_from_host(data)?;
        Ok(b)
    }

    /// Loads a module of kernels from PTX (built by `ferrolink-builder`). On the CPU backend
    /// the PTX is not needed to run kernels, but it is checked to declare each launched entry.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let ptx = ".version 8.6\n.target sm_90\n.address_size 64\n\n.visible .entry my_kernel()\n{\n\tret;\n}\n";
    /// let module = dev.load_module(ptx)?;
    /// assert!(module.has_kernel("my_kernel"));
    /// assert!(dev.load_module(".version 8.6\n").is_err()); // declares no kernel
    /// # Ok(()) }
    /// ```
    pub fn load_module(&self, ptx: &str) -> Result<Module> {
        Module::load(self, ptx, None)
    }

    /// Loads a module from PTX and the same PTX assembled ahead of time (`cubin`, e.g.
    /// the file named by ferrolink-builder's `PtxOutput::cubin_path`): on a GPU that can run the cubin
    /// it is used and the driver's PTX compilation (minutes for large modules on a machine
    /// with an empty compute cache) is skipped; elsewhere the PTX is compiled as by
    /// [`Device::load_module`]. The PTX names the kernels either way.
    ///
    /// ```no_run
    /// # fn main() -> ferrolink::Result<()> {
    /// let dev = ferrolink::Device::open(0)?;
    /// let ptx = std::fs::read_to_string("kernels.ptx").unwrap();
    /// let cubin = std::fs::read("kernels.cubin").unwrap();
    /// let module = dev.load_module_with_cubin(&ptx, &cubin)?;
    /// # let _ = module; Ok(()) }
    /// ```
    pub fn load_module_with_cubin(&self, ptx: &str, cubin: &[u8]) -> Result<Module> {
        Module::load(self, ptx, Some(cubin))
    }

    /// The module of ferrolink's built-in kernels ([`crate::DEVICE_PTX`]), loaded on first use.
    ///
    /// ```
    /// # use ferrolink_device::kernels::copy::ferrolink_copy;
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let module = dev.builtin_module()?;
    /// assert!(module.has_kernel(ferrolink_copy.name()));
    /// assert!(std::ptr::eq(module, dev.builtin_module()?)); // loaded once
    /// # Ok(()) }
    /// ```
    pub fn builtin_module(&self) -> Result<&Module> {
        if let Some(m) = self.0.builtin.get() {
            return Ok(m);
        }
        // One loader: ranks on threads ask at once, and a second copy loaded and unloaded
        // while the first rank's kernel already waits for the others would unload under the
        // driver's context lock, which waits for that kernel (a deadlock, seen on the H200).
        let _one = lock(&self.0.builtin_loading);
        if let Some(m) = self.0.builtin.get() {
            return Ok(m);
        }
        let cubin = (!crate::DEVICE_CUBIN.is_empty()).then_some(crate::DEVICE_CUBIN);
        let m = Module::load_builtin(self, crate::DEVICE_PTX, cubin)?;
        Ok(self.0.builtin.get_or_init(|| m))
    }

    /// Waits for all work on all live streams of this device; returns the first error. Only
    /// for explicit use: nothing in ferrolink calls it (drops and host copies wait for the
    /// work that used their memory, not for the device).
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let (a, b) = (dev.create_stream()?, dev.create_stream()?);
    /// let (ea, eb) = (a.record_event()?, b.record_event()?);
    /// dev.synchronize()?; // both streams
    /// assert!(ea.is_reached() && eb.is_reached());
    /// # Ok(()) }
    /// ```
    pub fn synchronize(&self) -> Result<()> {
        if crate::runtime::group::in_group_launch() {
            return Err(Error::InvalidArgument(
                "waiting for the whole device inside launch_all would wait for ranks not yet \
                 launched (a deadlock): do host accesses and synchronization after it"
                    .into(),
            ));
        }
        let streams: Vec<Arc<StreamCore>> = lock(&self.0.streams).iter().filter_map(Weak::upgrade).collect();
        let mut first = Ok(());
        for s in streams {
            if let (Err(e), true) = (s.synchronize(), first.is_ok()) {
                first = Err(e);
            }
        }
        lifetime::collect();
        first
    }

    /// Whether kernels of several processes can run on this device at the same time; the
    /// error says why not and what to do (on CUDA: MPS must be running).
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// // Emulated kernels are host threads: processes always run at once.
    /// assert!(dev.check_multi_process().is_ok());
    /// # Ok(()) }
    /// ```
    pub fn check_multi_process(&self) -> Result<()> {
        self.0.backend.check_multi_process()
    }

    /// Whether both handles name the same device: the same GPU on CUDA (two `Device`s opened
    /// on one GPU share its primary context, and windows must map it once, not through two
    /// aliasing ranges), the same emulated device on the CPU backend.
    ///
    /// ```
    /// # use ferrolink::{Backend, Device};
    /// # fn main() -> ferrolink::Result<()> {
    /// let dev = Device::open_with(Backend::Cpu, 0)?;
    /// assert!(dev.clone().same_as(&dev));
    /// // On the emulator every open makes a new device, whatever its ordinal.
    /// assert!(!Device::open_with(Backend::Cpu, 0)?.same_as(&dev));
    /// # Ok(()) }
    /// ```
    pub fn same_as(&self, other: &Device) -> bool {
        self.key() == other.key()
    }

    pub(crate) fn key(&self) -> DeviceKey {
        self.0.backend.key()
    }

    pub(crate) fn backend_device(&self) -> &Arc<dyn DeviceBackend> {
        &self.0.backend
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
