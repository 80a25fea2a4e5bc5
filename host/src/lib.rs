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
//!
//! # fn main() -> Result<(), ferrolink::Error> {
//! let dev = Device::open(0)?;                 // CUDA when present, else the emulator
//! let stream = dev.create_stream()?;
//! let src = dev.alloc_from(&[1u8, 2, 3, 4, 5])?;
//! let mut dst = dev.alloc::<u8>(5)?;
//! ferrolink::ops::copy(&stream, &mut dst, &src)?; // queued; tracked
//! assert_eq!(dst.to_vec()?, vec![1, 2, 3, 4, 5]); // waits for the copy, not for the device
//! # Ok(()) }
//! ```
//!
//! The crate is laid out by concept:
//! * [`runtime`] — devices and their backends, streams, events, device memory, modules,
//!   launches, and the event-tracked lifetimes that make every `Drop` safe without waiting
//!   for a device (the unsafe FFI lives in one file of the CUDA backend);
//! * [`comm`] — communicators, their topology, abort, asynchronous errors, the watchdog and
//!   recovery;
//! * [`mem`] — symmetric memory and windows;
//! * [`devcomm`] — device communicators: the [`ferrolink_device::DevComm`] kernels use for
//!   LSA barriers and window access, and the resources behind it;
//! * [`ops`] — safe operations built on the built-in kernels; [`testing`] — running a test on
//!   every backend; [`log`] — `FERROLINK_LOG`.
//!
//! Communication: [`Communicator::init_all`] creates the ranks (several may share one GPU),
//! [`Communicator::mem_alloc`] and [`register_window`] build symmetric windows, and
//! [`create_dev_comms`] gives each rank its device communicator (docs/device-api.md).
#![warn(missing_docs)]

pub mod coll;
pub mod comm;
pub mod devcomm;
pub mod error;
pub mod gin;
pub mod log;
pub mod mem;
pub mod moe;
pub mod ops;
pub mod runtime;
pub mod testing;

pub use comm::bootstrap::UniqueId;
pub use comm::topology::LsaMode;
pub use comm::{CommConfig, Communicator, launch_all, recover, run_ranks};
pub use devcomm::{
    DevCommHandle, DevCommRequirements, DevResource, ResourceId, ResourceRequest, create_dev_comms, reset_barriers,
};
pub use error::{Error, Result};
pub use ferrolink_device as device_api;
pub use gin::GinMode;
pub use gin::transport::TransportKind;
pub use mem::{SymBuffer, Window, register_window};
pub use runtime::{
    Backend, Device, DeviceBuffer, Event, Graph, KernelArgs, KernelParam, LaunchArg, LaunchArgs, LaunchConfig, Module,
    Stream,
};

/// The PTX of the built-in `ferrolink-device` kernels, built by `ferrolink-builder` for sm_90.
///
/// ```
/// # fn main() -> ferrolink::Result<()> {
/// assert!(ferrolink_device::kernel::ptx_entry_names(ferrolink::DEVICE_PTX).any(|e| e == "ferrolink_copy"));
/// // What `Device::builtin_module` loads:
/// let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// assert!(dev.load_module(ferrolink::DEVICE_PTX)?.has_kernel("ferrolink_copy"));
/// # Ok(()) }
/// ```
pub const DEVICE_PTX: &str = include_str!(env!("FERROLINK_DEVICE_PTX"));

/// [`DEVICE_PTX`] assembled for sm_90 by `ptxas`, when the crate was built with
/// `FERROLINK_BUILD_PTX=1` and ptxas was found; empty otherwise. When present the built-in
/// module loads from it on Hopper GPUs instead of being compiled by the driver on first use
/// (about 85 s on an H200 whose compute cache is empty; later runs hit the driver's cache).
///
/// ```
/// use ferrolink::DEVICE_CUBIN;
/// // Empty, or an ELF image for the GPU.
/// assert!(DEVICE_CUBIN.is_empty() || DEVICE_CUBIN.starts_with(b"\x7fELF"));
/// ```
pub const DEVICE_CUBIN: &[u8] = include_bytes!(env!("FERROLINK_DEVICE_PTX_CUBIN"));
