//! The runtime: devices and their backends, streams and events, device memory, modules,
//! launches, and the event-tracked lifetimes that tie them together.
//!
//! Layers (the wgpu-style safety ladder): `backend` is the unchecked interface each
//! backend implements (CUDA through the driver, or the CPU emulator), with all FFI in
//! `backend/cuda/driver.rs`; the types here ([`Device`], [`Stream`], [`DeviceBuffer`],
//! [`Module`]) validate and track, and are the same on both backends.

pub(crate) mod backend;
pub mod backend_kind;
pub mod device;
pub(crate) mod group;
pub(crate) mod host_mapped;
pub mod launch;
pub mod lifetime;
pub mod memory;
pub mod module;
pub(crate) mod phases;
pub mod stream;

pub use backend_kind::Backend;
pub use device::Device;
pub use launch::{KernelArgs, KernelParam, LaunchArg, LaunchArgs, LaunchConfig};
pub use lifetime::{pending_retirements, retired_total};
pub use memory::DeviceBuffer;
pub use module::Module;
pub use stream::{Event, Graph, Stream};

/// Devices `backend` has here: the GPUs the driver sees on CUDA (0 without a driver); on the
/// emulator there is no limit, and any ordinal opens a fresh emulated device.
pub fn device_count(backend: Backend) -> crate::Result<usize> {
    backend::device_count(backend)
}

/// The context current on the calling thread, as a raw `CUcontext` value (0 if none): for
/// checking that ferrolink restores the caller's context. CUDA only.
pub fn cuda_current_context() -> crate::Result<usize> {
    backend::cuda::driver::current_context().map(|c| c as usize)
}
