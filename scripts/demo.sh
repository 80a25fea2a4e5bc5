#!/usr/bin/env bash
# The main job: builds ferrolink (device crate -> PTX) and runs the copy benchmark beside its
# baseline, on the GPU when one is present, else on the CPU emulator (it says which).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
source scripts/setup.sh
cargo run --release --quiet -p ferrolink --bin ferrolink-perf -- copy "$@"
