#!/usr/bin/env bash
# The main job: builds ferrolink (device crate -> PTX) and runs the copy benchmark beside its
# baseline, on the GPU when one is present, else on the CPU emulator (it says which).
# Arguments go to `ferrolink-perf copy` (e.g. `--sizes 64M`, `--backend cpu`).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
source scripts/setup.sh

# The binary is picked by name only (no -p): cargo finds it in whichever default workspace
# member has it, so this keeps working if the perf tool moves to another crate. The build
# shows cargo's normal progress; the first one compiles the dependencies and the device
# crate to PTX, which takes a few minutes.
echo "demo: building ferrolink-perf (release; the first build takes a few minutes)" >&2
cargo build --release --bin ferrolink-perf
echo "demo: running the copy benchmark" >&2
# Already built, so --quiet hides only cargo's "Finished" and "Running" lines.
cargo run --release --quiet --bin ferrolink-perf -- copy "$@"
