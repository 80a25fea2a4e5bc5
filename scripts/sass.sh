#!/usr/bin/env bash
# Prints the SASS (sm_90 machine code) of one kernel of a built device crate, to see what
# ptxas made of it (fences, votes, divergence handling): docs/gpu-testing.md, lesson (i).
#   bash scripts/sass.sh <kernel> [cubin]
# The cubin defaults to the newest one the builder left for ferrolink-device (build first:
# `cargo build --release -p ferrolink` with ptxas set up). cuobjdump comes from the
# nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm wheels on PyPI, unpacked into .tools/ on
# first use.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
kernel="${1:?usage: scripts/sass.sh <kernel> [cubin]}"
cubin="${2:-$(ls -t "$root"/target/*/ferrolink-ptx/nvptx64-nvidia-cuda/release/deps/ferrolink_device-*.cubin 2>/dev/null | head -n1)}"
[ -n "$cubin" ] && [ -f "$cubin" ] || { echo "sass: no cubin found; build with ptxas first (source scripts/setup.sh)" >&2; exit 1; }

bin="$root/.tools/cuda/bin"
for tool in cuobjdump nvdisasm; do
  [ -x "$bin/$tool" ] && continue
  echo "sass: fetching $tool (nvidia-cuda-$tool wheel from PyPI)" >&2
  mkdir -p "$root/.tools/wheels" "$bin"
  python3 -m pip download --quiet --no-deps --only-binary=:all: \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$root/.tools/wheels" "nvidia-cuda-$tool"
  wheel="$(ls "$root"/.tools/wheels/nvidia_cuda_"$tool"-*.whl | head -n1)"
  python3 - "$wheel" "$tool" "$bin/$tool" <<'PY'
import sys, zipfile, os, shutil
wheel, tool, dest = sys.argv[1], sys.argv[2], sys.argv[3]
with zipfile.ZipFile(wheel) as z:
    name = next(n for n in z.namelist() if n.endswith("/bin/" + tool))
    with z.open(name) as src, open(dest, "wb") as out:
        shutil.copyfileobj(src, out)
os.chmod(dest, 0o755)
PY
  rm -rf "$root/.tools/wheels"
done
echo "# $kernel in $cubin" >&2
PATH="$bin:$PATH" "$bin/cuobjdump" -sass -fun "$kernel" "$cubin" | grep -E '/\*[0-9a-f]{4,}\*/' | sed -E 's@ */\* 0x[0-9a-f]+ \*/@@; s/ +$//'
