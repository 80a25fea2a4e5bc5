#!/usr/bin/env bash
# Installs what building ferrolink needs and exports FERROLINK_PTXAS. Source it or run it;
# it is idempotent and quick once done. Once it has run, plain cargo commands in this checkout
# find ptxas without the export: .cargo/config.toml sets FERROLINK_PTXAS to the same
# .tools/cuda/bin/ptxas, and ferrolink-builder also looks for .tools/cuda/bin/ptxas above the
# device crate.
#  - the nightly toolchain's rust-src (for -Z build-std=core when compiling device code to PTX)
#  - ptxas for sm_90, unpacked from the nvidia-cuda-nvcc wheel on PyPI into .tools/
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if ! rustup run nightly rustc --version >/dev/null 2>&1; then
  echo "setup: installing the nightly toolchain (device code compiles with it)" >&2
  rustup toolchain install nightly --profile minimal
fi
sysroot="$(rustup run nightly rustc --print sysroot)"
if [ ! -f "$sysroot/lib/rustlib/src/rust/library/core/Cargo.toml" ]; then
  echo "setup: adding rust-src to the nightly toolchain" >&2
  rustup component add rust-src --toolchain nightly
fi

ptxas="$root/.tools/cuda/bin/ptxas"
if [ ! -x "$ptxas" ]; then
  echo "setup: fetching ptxas (nvidia-cuda-nvcc 13.0 wheel from PyPI)" >&2
  mkdir -p "$root/.tools/wheels" "$root/.tools/cuda/bin"
  python3 -m pip download --quiet --no-deps --only-binary=:all: \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$root/.tools/wheels" "nvidia-cuda-nvcc==13.0.*"
  wheel="$(ls "$root"/.tools/wheels/nvidia_cuda_nvcc-13.0*.whl | head -n1)"
  python3 - "$wheel" "$ptxas" <<'PY'
import sys, zipfile, os, shutil
wheel, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    name = next(n for n in z.namelist() if n.endswith("/bin/ptxas"))
    with z.open(name) as src, open(dest, "wb") as out:
        shutil.copyfileobj(src, out)
os.chmod(dest, 0o755)
PY
  rm -rf "$root/.tools/wheels"
fi
export FERROLINK_PTXAS="$ptxas"
