#!/usr/bin/env bash
# Fails when the committed built-in PTX (host/ptx/ferrolink_device.ptx, what crates using
# ferrolink compile in on stable Rust) differs from a fresh build of device/. Run by
# scripts/test.sh (CI) and scripts/gpu-bundle.sh. The nightly's PTX output is deterministic
# (the same bytes from different target directories and checkout paths), so the files are
# compared byte for byte, with no normalization.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
committed=host/ptx/ferrolink_device.ptx
fresh="$(bash scripts/update-ptx.sh --fresh-path)"
entries() { grep -o '\.entry [A-Za-z0-9_$]*' "$1" | cut -d' ' -f2 | sort; }

if [ ! -f "$committed" ]; then
  echo "error: $committed is missing: run scripts/update-ptx.sh and commit $committed" >&2
  exit 1
fi
if cmp -s "$fresh" "$committed"; then
  echo "built-in PTX matches a fresh build of device/ ($(entries "$committed" | wc -l) kernels)"
  exit 0
fi
{
  echo "error: the committed built-in PTX is stale: run scripts/update-ptx.sh and commit $committed"
  echo "  committed: $committed"
  echo "  fresh:     ${fresh#"$root"/}"
  git diff --no-index --shortstat "$committed" "$fresh" | sed 's/^ */  /' || true
  added="$(comm -13 <(entries "$committed") <(entries "$fresh") | tr '\n' ' ')"
  removed="$(comm -23 <(entries "$committed") <(entries "$fresh") | tr '\n' ' ')"
  [ -z "$added" ] || echo "  kernels only in the fresh build: $added"
  [ -z "$removed" ] || echo "  kernels only in the committed file: $removed"
} >&2
exit 1
