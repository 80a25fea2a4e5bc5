#!/usr/bin/env bash
# Runs the CPU emulator's Miri check: device/tests/emulator_miri.rs (dynamic shared memory
# across a CTA barrier, warp shuffles, arch atomics on host words passed by pointer, a failed
# thread stopping the others) under Miri, which reports undefined behaviour: aliasing
# violations (Stacked Borrows), data races, use after free, leaks.
#
# Installs the nightly's miri component and Miri's sysroot first if missing (downloads from
# the rustup dist server once). Extra arguments go to the test binary, e.g. a test name.
# MIRIFLAGS from the environment is appended: e.g. MIRIFLAGS=-Zmiri-many-seeds=0..8 to try
# several thread schedules, or -Zmiri-tree-borrows.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

if ! rustup run nightly rustc --version >/dev/null 2>&1; then
  echo "miri: installing the nightly toolchain" >&2
  rustup toolchain install nightly --profile minimal
fi
if ! rustup component list --toolchain nightly --installed 2>/dev/null | grep -q '^miri'; then
  echo "miri: adding the miri component to the nightly toolchain" >&2
  rustup component add miri rust-src --toolchain nightly
fi
# Builds Miri's sysroot once (about a minute); quick and quiet afterwards.
cargo +nightly miri setup >/dev/null

# No Miri flag is needed: the emulator's clock (Instant), its condvar timeouts and the std
# hash maps' seeds all work under Miri's default isolation, and nothing leaks.
export MIRIFLAGS="${MIRIFLAGS:-}"
start=$(date +%s)
echo "== cargo +nightly miri test -p ferrolink-device --test emulator_miri ${MIRIFLAGS:+(MIRIFLAGS=$MIRIFLAGS)}"
cargo +nightly miri test -p ferrolink-device --test emulator_miri -- "$@"
echo "miri: passed in $(( $(date +%s) - start )) s"
