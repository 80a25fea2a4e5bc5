//! Launching kernels: launch shapes, typed arguments and modules.

use crate::cuda::RawModule;
use crate::device::{Device, DeviceImpl};
use crate::{Error, Result};
use cudarc::driver::sys;
use std::collections::{HashMap, HashSet};
use std::ffi::c_void;
use std::sync::Mutex;
use std::time::Duration;

/// Grid and block shape of a launch, its dynamic shared memory, and (emulator only) its
/// timeout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchConfig {
    /// CTAs per axis.
    pub grid: (u32, u32, u32),
    /// Threads per CTA per axis.
    pub block: (u32, u32, u32),
    /// Bytes of dynamic shared memory per CTA ([`ferrolink_device::arch::dynamic_shared_mem`]).
    pub shared_mem_bytes: u32,
    /// On the CPU emulator, fail the launch with a timeout error after this long
    /// (default: [`ferrolink_device::emulator::default_timeout`]). Ignored on CUDA.
    pub emulator_timeout: Option<Duration>,
}

impl LaunchConfig {
    /// A 1-D launch of `grid` CTAs of `block` threads.
    pub const fn linear(grid: u32, block: u32) -> LaunchConfig {
        LaunchConfig { grid: (grid, 1, 1), block: (block, 1, 1), shared_mem_bytes: 0, emulator_timeout: None }
    }

    /// The same launch with `bytes` of dynamic shared memory per CTA.
    pub const fn with_shared_mem(mut self, bytes: u32) -> LaunchConfig {
        self.shared_mem_bytes = bytes;
        self
    }

    /// The same launch with an emulator timeout.
    pub const fn with_emulator_timeout(mut self, timeout: Duration) -> LaunchConfig {
        self.emulator_timeout = Some(timeout);
        self
    }

    /// Threads in one CTA.
    pub fn block_threads(&self) -> u64 {
        u64::from(self.block.0) * u64::from(self.block.1) * u64::from(self.block.2)
    }

    /// Rejects shapes no backend can run: empty axes, more than 1024 threads per CTA, more
    /// than 227 KiB of dynamic shared memory, grids beyond CUDA's limits.
    pub fn validate(&self, kernel: &str) -> Result<()> {
        let (g, b) = (self.grid, self.block);
        let bad = |why: String| Err(Error::InvalidArgument(format!("launch of `{kernel}`: {why}")));
        if g.0 == 0 || g.1 == 0 || g.2 == 0 || b.0 == 0 || b.1 == 0 || b.2 == 0 {
            return bad(format!("every grid and block dimension must be at least 1 (grid {g:?}, block {b:?})"));
        }
        if self.block_threads() > 1024 || b.2 > 64 {
            return bad(format!("block {b:?} exceeds 1024 threads per CTA (or 64 along z)"));
        }
        if g.1 > 65535 || g.2 > 65535 || g.0 > i32::MAX as u32 {
            return bad(format!("grid {g:?} exceeds CUDA's limits (2^31-1, 65535, 65535)"));
        }
        if self.shared_mem_bytes > 227 * 1024 {
            return bad(format!("{} bytes of dynamic shared memory exceed 227 KiB", self.shared_mem_bytes));
        }
        Ok(())
    }
}

/// A type that can be passed to a kernel by value.
///
/// # Safety
/// The type's size and layout must match the PTX parameter rustc's nvptx backend emits for
/// it (true for primitive integers, floats, raw pointers, and `#[repr(C)]` structs of them
/// without padding that matters), and its values must be meaningful on the device (no host
/// pointers on CUDA).
pub unsafe trait KernelParam: Copy + 'static {}

macro_rules! kernel_params {
    ($($t:ty),*) => { $(
        // SAFETY: a primitive passed as the PTX scalar of the same width.
        unsafe impl KernelParam for $t {}
    )* };
}
kernel_params!(u8, u16, u32, u64, usize, i8, i16, i32, i64, isize, f32, f64);
// SAFETY: pointers are passed as `.u64` device addresses.
unsafe impl<T: 'static> KernelParam for *const T {}
// SAFETY: as above.
unsafe impl<T: 'static> KernelParam for *mut T {}

// SAFETY: `#[repr(C)]` Pod structs of u32/u64 fields, passed as `.param .align 8 .b8 [N]`
// (checked in the PTX: DevComm is 80 bytes, DevWindow 32); device addresses inside.
unsafe impl KernelParam for ferrolink_device::DevComm {}
// SAFETY: as above.
unsafe impl KernelParam for ferrolink_device::DevWindow {}

/// A tuple of [`KernelParam`]s: the arguments of one launch, matching the kernel's
/// declared parameter types exactly (the [`ferrolink_device::kernel::Kernel`] type says which).
pub trait KernelArgs: Copy + 'static {
    /// Calls `f` with one pointer per argument, as `cuLaunchKernel` wants them.
    fn with_param_ptrs<R>(&mut self, f: impl FnOnce(&mut [*mut c_void]) -> R) -> R;
}

macro_rules! kernel_args {
    ($($name:ident : $idx:tt),*) => {
        impl<$($name: KernelParam),*> KernelArgs for ($($name,)*) {
            #[allow(unused_mut)]
            fn with_param_ptrs<R>(&mut self, f: impl FnOnce(&mut [*mut c_void]) -> R) -> R {
                let mut ptrs: [*mut c_void; 0 $(+ { let _ = $idx; 1 })*] =
                    [$(&mut self.$idx as *mut $name as *mut c_void),*];
                f(&mut ptrs)
            }
        }
    };
}
kernel_args!();
kernel_args!(A: 0);
kernel_args!(A: 0, B: 1);
kernel_args!(A: 0, B: 1, C: 2);
kernel_args!(A: 0, B: 1, C: 2, D: 3);
kernel_args!(A: 0, B: 1, C: 2, D: 3, E: 4);
kernel_args!(A: 0, B: 1, C: 2, D: 3, E: 4, F: 5);
kernel_args!(A: 0, B: 1, C: 2, D: 3, E: 4, F: 5, G: 6);
kernel_args!(A: 0, B: 1, C: 2, D: 3, E: 4, F: 5, G: 6, H: 7);
kernel_args!(A: 0, B: 1, C: 2, D: 3, E: 4, F: 5, G: 6, H: 7, I: 8);
kernel_args!(A: 0, B: 1, C: 2, D: 3, E: 4, F: 5, G: 6, H: 7, I: 8, J: 9);
kernel_args!(A: 0, B: 1, C: 2, D: 3, E: 4, F: 5, G: 6, H: 7, I: 8, J: 9, K: 10);
kernel_args!(A: 0, B: 1, C: 2, D: 3, E: 4, F: 5, G: 6, H: 7, I: 8, J: 9, K: 10, L: 11);

#[derive(Clone, Copy)]
pub(crate) struct CudaFunction(pub(crate) sys::CUfunction, pub(crate) crate::cuda::FunctionLimits);
// SAFETY: function handles may be used from any thread with their context current.
unsafe impl Send for CudaFunction {}
// SAFETY: as above.
unsafe impl Sync for CudaFunction {}

pub(crate) enum ModuleImpl {
    Cuda { module: RawModule, functions: Mutex<HashMap<String, CudaFunction>> },
    Cpu,
}

/// How a module refers to its device: a user's module keeps the device alive; the device's
/// own built-in module (stored inside the device) refers back weakly, or the two would keep
/// each other alive forever (the device, its context retain and the module would leak).
enum DeviceLink {
    Owner(Device),
    Builtin(std::sync::Weak<crate::device::DeviceInner>),
}

/// A module of kernels loaded from PTX (see [`Device::load_module`]). On the CPU backend the
/// kernels run from their host entries, and the PTX tells which entries the module declares.
pub struct Module {
    link: DeviceLink,
    pub(crate) imp: ModuleImpl,
    entries: HashSet<String>,
}

impl std::fmt::Debug for Module {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Module").field("entries", &self.entries).finish()
    }
}

impl Module {
    pub(crate) fn load(dev: &Device, ptx: &str) -> Result<Module> {
        Module::load_linked(dev, ptx, DeviceLink::Owner(dev.clone()))
    }

    /// Loads the device's built-in module, which the device itself stores.
    pub(crate) fn load_builtin(dev: &Device, ptx: &str) -> Result<Module> {
        Module::load_linked(dev, ptx, DeviceLink::Builtin(std::sync::Arc::downgrade(&dev.0)))
    }

    fn load_linked(dev: &Device, ptx: &str, link: DeviceLink) -> Result<Module> {
        let entries: HashSet<String> = ferrolink_device::kernel::ptx_entry_names(ptx).map(str::to_string).collect();
        if entries.is_empty() {
            return Err(Error::InvalidArgument("the PTX declares no kernel entry (.entry)".into()));
        }
        let imp = match &dev.0.imp {
            DeviceImpl::Cuda(d) => {
                let module = d.load_ptx(ptx)?;
                // Resolve every entry now. Under CUDA's lazy loading (the default since 12.2) a
                // function is loaded onto the GPU on first lookup, and that load can wait for
                // running kernels: a kernel launched to signal a running kernel would deadlock
                // behind it (seen on the H200: the waiter timed out first).
                let mut functions = HashMap::new();
                for name in &entries {
                    let f = module.function(d, name)?;
                    functions.insert(name.clone(), CudaFunction(f, crate::cuda::function_limits(d, f)?));
                }
                ModuleImpl::Cuda { module, functions: Mutex::new(functions) }
            }
            DeviceImpl::Cpu(_) => ModuleImpl::Cpu,
        };
        Ok(Module { link, imp, entries })
    }

    /// The device the module was loaded on, if it is still alive.
    pub(crate) fn device(&self) -> Option<Device> {
        match &self.link {
            DeviceLink::Owner(d) => Some(d.clone()),
            DeviceLink::Builtin(w) => w.upgrade().map(Device),
        }
    }

    /// Whether the module was loaded on `dev`.
    pub(crate) fn belongs_to(&self, dev: &Device) -> bool {
        self.device().is_some_and(|d| d.same_as(dev))
    }

    /// Whether the module declares a kernel entry called `name`.
    pub fn has_kernel(&self, name: &str) -> bool {
        self.entries.contains(name)
    }

    pub(crate) fn cuda_function(&self, name: &str) -> Result<CudaFunction> {
        let ModuleImpl::Cuda { module, functions } = &self.imp else { unreachable!("cuda_function on a CPU module") };
        let mut map = functions.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = map.get(name) {
            return Ok(*f);
        }
        let dev = self.device().ok_or(Error::WrongDevice("module (its device was dropped)"))?;
        let DeviceImpl::Cuda(d) = &dev.0.imp else { unreachable!("CUDA module on a CPU device") };
        let raw = module.function(d, name)?;
        let f = CudaFunction(raw, crate::cuda::function_limits(d, raw)?);
        map.insert(name.to_string(), f);
        Ok(f)
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        // Kernels from this module may still be queued: let them finish before unloading.
        // (The built-in module is dropped with its device, when no work can be queued.)
        if let Some(d) = self.device() {
            let _ = d.synchronize();
        }
    }
}
