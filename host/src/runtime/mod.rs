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

/// The environment variable that sets how many hardware queues the CUDA driver gives a
/// context's streams (8 unless set, 32 at most), read when the driver makes the context.
///
/// ```
/// use ferrolink::runtime::CUDA_STREAM_QUEUES_VAR;
/// // A launcher gives the ranks it starts the most queues (as `ferrolink-run` does):
/// let mut rank = std::process::Command::new("my-rank");
/// rank.env(CUDA_STREAM_QUEUES_VAR, "32");
/// assert!(rank.get_envs().any(|(k, v)| k == CUDA_STREAM_QUEUES_VAR && v == Some("32".as_ref())));
/// ```
pub const CUDA_STREAM_QUEUES_VAR: &str = "CUDA_DEVICE_MAX_CONNECTIONS";

/// Sets [`CUDA_STREAM_QUEUES_VAR`] to 32, the most, unless the environment sets it: with
/// fewer, the GIN proxy's stream copies (TCP and copy-engine transports) may share a hardware
/// queue with a kernel waiting for them, and never run. `ferrolink-run` sets it for the ranks
/// it starts; a program started otherwise (torchrun, srun, mpirun) calls this first thing in
/// `main`, or its launch sets the variable. Whether it was set by this call.
///
/// ```
/// // First thing in `main`:
/// // SAFETY: no other thread exists yet.
/// unsafe { ferrolink::runtime::set_most_cuda_stream_queues() };
/// // ... then open devices, communicators ...
/// ```
///
/// # Safety
/// It writes the process's environment: no other thread may read or write the environment
/// while it runs (std's own reads are safe, C code's `getenv` is not), so call it before the
/// program starts threads. It has no effect on a CUDA context made before it.
pub unsafe fn set_most_cuda_stream_queues() -> bool {
    if std::env::var_os(CUDA_STREAM_QUEUES_VAR).is_some() {
        return false;
    }
    // SAFETY: the caller's contract (no concurrent access to the environment).
    unsafe { std::env::set_var(CUDA_STREAM_QUEUES_VAR, "32") };
    true
}

/// Devices `backend` has here: the GPUs the driver sees on CUDA (0 without a driver); on the
/// emulator there is no limit, and any ordinal opens a fresh emulated device.
///
/// ```
/// use ferrolink::{Backend, runtime::device_count};
/// # fn main() -> ferrolink::Result<()> {
/// assert_eq!(device_count(Backend::Cpu)?, usize::MAX); // no limit
/// if Backend::Cuda.check_available().is_err() {
///     assert_eq!(device_count(Backend::Cuda)?, 0);
/// }
/// # Ok(()) }
/// ```
pub fn device_count(backend: Backend) -> crate::Result<usize> {
    backend::device_count(backend)
}

/// The context current on the calling thread, as a raw `CUcontext` value (0 if none): for
/// checking that ferrolink restores the caller's context. CUDA only: an error where the
/// CUDA backend is not available.
///
/// ```
/// # fn main() -> ferrolink::Result<()> {
/// use ferrolink::Backend;
/// if Backend::Cuda.check_available().is_err() {
///     assert!(ferrolink::runtime::cuda_current_context().is_err()); // no driver here
///     return Ok(());
/// }
/// let dev = ferrolink::Device::open_with(Backend::Cuda, 0)?;
/// let before = ferrolink::runtime::cuda_current_context()?;
/// let buf = dev.alloc_from(&[1u8; 256])?;
/// assert_eq!(buf.to_vec()?, [1u8; 256]);
/// assert_eq!(ferrolink::runtime::cuda_current_context()?, before); // left as it was
/// # Ok(()) }
/// ```
pub fn cuda_current_context() -> crate::Result<usize> {
    // Without a driver the call itself would panic in the driver's loader.
    Backend::Cuda.check_available()?;
    backend::cuda::driver::current_context().map(|c| c as usize)
}
