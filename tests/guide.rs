//! The examples of docs/device-api.md, run: the build script extracts the guide's host
//! functions (`s1_scale_add`, …) and makes one test of each, which loads the PTX of the
//! guide's kernels (`guide-kernels`) and runs the function on every backend present. So the
//! guide's code is compiled, and checked by its own assertions, in CI (CPU emulator) and in
//! the GPU bundle (CUDA).

include!(concat!(env!("OUT_DIR"), "/guide_host.rs"));
