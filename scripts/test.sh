#!/usr/bin/env bash
# The test command: formatting, the PTX build with its checks and ptxas assembly for sm_90,
# clippy, rustdoc with warnings as errors, and every test (device tests on the CPU emulator
# here; on CUDA too where a GPU is).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
source scripts/setup.sh
export FERROLINK_REQUIRE_PTXAS=1

echo "== cargo fmt --check"
cargo fmt --all --check
echo "== build (device crate -> PTX, extern/entry checks, ptxas -arch=sm_90 with per-kernel resources)"
FERROLINK_PRINT_PTX_RESOURCES=1 cargo build --workspace --all-targets
echo "== cargo clippy"
cargo clippy --workspace --all-targets --quiet -- -D warnings
echo "== cargo doc (broken links and doc warnings are errors)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --quiet
echo "== cargo test"
cargo test --workspace 2>&1
