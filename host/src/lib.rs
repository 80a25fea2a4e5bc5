//! # ferrolink
//!
//! Device-initiated GPU communication for Rust — the host runtime.
//!
//! Kernels are written in Rust in a `no_std` device crate (ours is
//! [`ferrolink_device`]) and run on one of two [`Backend`]s:
//! * [`Backend::Cuda`] — a real GPU through the CUDA driver (loaded at run time; the crate
//!   builds and its CPU tests run on machines without CUDA);
//! * [`Backend::Cpu`] — the CPU emulator: the same kernel source on host threads.
//!
//! ```
//! use ferrolink::{Device, LaunchConfig};
//! use ferrolink_device::kernels::copy::ferrolink_copy;
//!
//! # fn main() -> Result<(), ferrolink::Error> {
//! let dev = Device::open(0)?;                 // CUDA when present, else the emulator
//! let stream = dev.create_stream()?;
//! let src = dev.alloc_from(&[1u8, 2, 3, 4, 5])?;
//! let mut dst = dev.alloc::<u8>(5)?;
//! ferrolink::ops::copy(&stream, &mut dst, &src)?; // safe wrapper around the copy kernel
//! stream.synchronize()?;
//! assert_eq!(dst.to_vec()?, vec![1, 2, 3, 4, 5]);
//! # Ok(()) }
//! ```
//!
//! Layers (the wgpu-style safety ladder): [`cuda`] wraps the driver calls we use
//! (unsafe FFI stays there); [`Device`], [`Stream`], [`DeviceBuffer`], [`Module`] are checked
//! objects valid on both backends; [`ops`] holds safe operations built on kernels.
//!
//! Communication: [`Communicator::init_all`] creates the ranks (several may share one GPU),
//! [`Communicator::mem_alloc`] and [`register_window`] build symmetric windows, and
//! [`create_dev_comms`] gives each rank the [`ferrolink_device::DevComm`] its kernels use for
//! LSA barriers and window access (docs/device-api.md).

pub mod backend;
pub mod comm;
mod cpu;
mod cpu_vmm;
pub mod cuda;
pub mod devcomm;
pub mod device;
pub mod error;
pub mod launch;
pub mod memory;
pub mod ops;
pub mod perf;
pub mod stream;
pub mod testing;
pub mod window;

pub use backend::Backend;
pub use comm::{Communicator, launch_all};
pub use devcomm::{DevCommHandle, DevCommRequirements, create_dev_comms, reset_barriers};
pub use device::Device;
pub use error::{Error, Result};
pub use ferrolink_device as device_api;
pub use launch::{KernelArgs, KernelParam, LaunchConfig, Module};
pub use memory::DeviceBuffer;
pub use stream::{Event, Stream};
pub use window::{SymBuffer, Window, register_window};

/// Free bytes of device memory on `dev` (CUDA only; for leak checks in tests and tools).
pub fn cuda_mem_free(dev: &Device) -> Result<usize> {
    match &dev.0.imp {
        device::DeviceImpl::Cuda(d) => Ok(cuda::mem_info(d)?.0),
        device::DeviceImpl::Cpu(_) => Err(Error::InvalidArgument("cuda_mem_free needs a CUDA device".into())),
    }
}

/// The PTX of the built-in `ferrolink-device` kernels, built by `ferrolink-builder` for sm_90.
pub const DEVICE_PTX: &str = include_str!(env!("FERROLINK_DEVICE_PTX"));
