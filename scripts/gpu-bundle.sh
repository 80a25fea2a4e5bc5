#!/usr/bin/env bash
# Builds the GPU test bundle: release, stripped test binaries, examples and the perf tool,
# plus run.sh, into gpu-bundle/ (git-ignored, kept under the device tool's 64 MiB limit).
# docs/gpu-testing.md shows the `device` call that carries and runs it on the H200.
#   BUNDLE_TESTS="coll moe lib" bundles only those test binaries (names as in bin/test-NAME);
#   BUNDLE_EXAMPLES=0 leaves out the examples and ferrolink-run (a quicker build for a focused run).
#   BUNDLE_SYMS="coll moe" also packs those test binaries with their symbols (syms.txz), for
#   across.sh's stack dumps.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
source scripts/setup.sh
export FERROLINK_REQUIRE_PTXAS=1
# The bundle's builds take the built-in kernels fresh from device/ (.cargo/config.toml sets
# FERROLINK_BUILD_PTX=1 in this checkout); refuse to bundle a commit whose committed PTX, the
# one users of the crate get, differs from them.
bash scripts/check-ptx.sh
# ptxas takes minutes on the built-in module: the release builds below assemble the same PTX
# text, so they take the cubin that check-ptx's build just made (the builder reuses a cubin
# whose `.ptxas-input` equals the PTX it assembles, and assembles afresh otherwise).
ptx_deps=ferrolink-ptx/nvptx64-nvidia-cuda/release/deps
if ls target/debug/$ptx_deps/ferrolink_device-*.ptxas-log >/dev/null 2>&1; then
  mkdir -p target/release/$ptx_deps
  for f in target/debug/$ptx_deps/ferrolink_device-*.cubin target/debug/$ptx_deps/ferrolink_device-*.ptxas-input \
           target/debug/$ptx_deps/ferrolink_device-*.ptxas-log; do
    cp "$f" target/release/$ptx_deps/ # (the log last: it vouches for the cubin)
  done
fi
bundle="$root/gpu-bundle"
rm -rf "$bundle" && mkdir -p "$bundle/bin"

# Test executables of the workspace's integration tests, as cargo reports them, and the host
# crate's unit tests (`test-lib`: some run on both backends, as `for_each_backend` does).
targets=()
for name in ${BUNDLE_TESTS:-}; do
  if [ "$name" = lib ]; then targets+=(--lib); else targets+=(--test "$name"); fi
done
cargo test --release --workspace "${targets[@]}" --no-run --message-format=json 2>/dev/null \
  | python3 -c '
import json, sys
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"] \
       and m["profile"]["test"]:
        print(m["target"]["name"], m["executable"])
    elif m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "ferrolink" \
       and m["target"]["kind"] == ["lib"] and m["profile"]["test"]:
        print("lib", m["executable"])
' | while read -r name exe; do
  # The launcher's tests start the binary at its build path: they run in CI, not on the GPU.
  [ "$name" = launcher ] && continue
  if [ -n "${BUNDLE_TESTS:-}" ] && ! [[ " $BUNDLE_TESTS " == *" $name "* ]]; then continue; fi
  cp "$exe" "$bundle/bin/test-$name"
  if [[ " ${BUNDLE_SYMS:-} " == *" $name "* ]]; then
    mkdir -p "$bundle/syms" && cp "$exe" "$bundle/syms/sym-test-$name" && strip --strip-debug "$bundle/syms/sym-test-$name"
  fi
done

if [ "${BUNDLE_EXAMPLES:-1}" = 0 ]; then
  cargo build --release -p ferrolink-benches --bin ferrolink-perf --quiet
  cp target/release/ferrolink-perf "$bundle/bin/"
else
  cargo build --release --workspace --bins --examples --quiet
  cp target/release/ferrolink-perf target/release/ferrolink-run "$bundle/bin/"
  for ex in target/release/examples/*; do
    case "$ex" in *.d|*-*) continue ;; esac
    [ -x "$ex" ] && [ -f "$ex" ] && cp "$ex" "$bundle/bin/example-$(basename "$ex")"
  done
fi
strip "$bundle"/bin/*
cp scripts/gpu-run.sh "$bundle/run.sh"
cp scripts/gpu-run-multi.sh "$bundle/run-multi.sh"
cp scripts/gpu-run-gin.sh "$bundle/gin.sh"
cp scripts/gpu-run-across.sh "$bundle/across.sh"
mkdir -p "$bundle/ref" && cp benches/cuda/*.cu benches/torch/*.py "$bundle/ref/"
git rev-parse --short HEAD > "$bundle/COMMIT" 2>/dev/null || echo unknown > "$bundle/COMMIT"
git diff --quiet 2>/dev/null || echo "(+ uncommitted changes)" >> "$bundle/COMMIT"
ls -la "$bundle/bin"
# The binaries each embed the built-in PTX and its cubin (~10 MB a binary): xz with a window
# larger than the whole archive stores those repeated images once (58 MB with gzip, 7 MB so;
# 14 s). The run scripts unpack it on the GPU machine with Python's tarfile (no xz needed).
tar cf - -C "$bundle" bin | xz --lzma2=preset=2,dict=256MiB -T1 > "$bundle/bin.txz" && rm -rf "$bundle/bin"
if [ -d "$bundle/syms" ]; then
  tar cf - -C "$bundle/syms" . | xz --lzma2=preset=2,dict=256MiB -T1 > "$bundle/syms.txz" && rm -rf "$bundle/syms"
fi
du -sh "$bundle"
total=$(du -sb "$bundle" | cut -f1)
if [ "$total" -gt $((60 * 1024 * 1024)) ]; then
  echo "gpu-bundle is $total bytes: over the 60 MiB budget (device tool limit 64 MiB)" >&2
  exit 1
fi
