//! The device crate of docs/device-api.md (its `my-kernels`): the guide's kernels and device
//! helpers, extracted from the guide by the build script, so that `tests/guide.rs` compiles
//! them to PTX and runs the guide's host code against them on every backend.
#![no_std]
#![cfg_attr(target_arch = "nvptx64", feature(abi_ptx))]

include!(concat!(env!("OUT_DIR"), "/guide_kernels.rs"));
