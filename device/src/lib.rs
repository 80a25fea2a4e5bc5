//! # ferrolink-device
//!
//! The device half of ferrolink: everything a GPU kernel calls. The same source compiles
//!
//! * for `nvptx64-nvidia-cuda`, where it becomes PTX (built by `ferrolink-builder`), and
//! * for the host, where every primitive has an implementation on the CPU emulator
//!   ([`emulator`]), so kernels run on host threads in CI and on machines without a GPU.
//!
//! Layers, bottom up:
//! * [`arch`] — thread indices, warp operations, scoped atomics and fences, timers, vector
//!   memory access, dynamic shared memory. On nvptx each is a few lines of inline PTX.
//! * [`kernel!`] — declares a kernel once; it becomes a PTX entry point on the GPU and a
//!   typed [`kernel::Kernel`] descriptor that the host crate launches on either backend.
//! * [`coop`], [`comm`], [`window`], [`barrier`], [`lsa`] — the LSA device API: cooperation
//!   scopes, the device communicator and teams, symmetric window pointers, LSA barrier
//!   sessions, and copy/reduce helpers over peers' memory.
//! * [`kernels`] — the built-in kernels (vectorized copy, LSA kernels, self tests).
//!
//! `#[repr(C)]` types shared by host and device are defined here, once.
#![no_std]
#![cfg_attr(target_arch = "nvptx64", allow(internal_features))]
#![cfg_attr(
    target_arch = "nvptx64",
    feature(abi_ptx, asm_experimental_arch, core_intrinsics, gpu_intrinsics, gpu_launch_sized_workgroup_mem)
)]

#[cfg(not(target_arch = "nvptx64"))]
extern crate std;

pub mod arch;
pub mod barrier;
pub mod coll;
pub mod comm;
pub mod coop;
#[cfg(not(target_arch = "nvptx64"))]
pub mod emulator;
pub mod gin;
pub mod graph;
pub mod kernel;
pub mod kernels;
pub mod lsa;
pub mod moe;
pub mod p2p;
pub mod window;

pub use barrier::{BarrierError, BarrierOrder, LsaBarrierSession};
pub use comm::{DevComm, DevControl, DevErrorRecord, LsaBarrierHandle, Team, WaitRecord};
pub use coop::{Coop, CoopCta, CoopThread, CoopWarp};
pub use gin::{DevGin, Gin, GinBarrierSession, GinDescriptor, LocalAction, RemoteAction};
pub use graph::{DeviceGraph, GraphLaunchError, GraphLaunchMode};
pub use window::{DevWindow, SymPtr};
