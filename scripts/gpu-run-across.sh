#!/usr/bin/env bash
# The across-LSA-domain tests alone, on the GPU machine, with their progress lines: each test
# binary's `across_lsa` tests under a timeout, no MPS (a kill under MPS poisons the server),
# once per environment of ACROSS_ENVS (`;`-separated, `-` for none). When a run reaches its
# limit, the host threads' stacks are printed first (gdb or cuda-gdb, if either is there, on
# binaries from syms.txz, which keep their symbols) and nvidia-smi's view. Logs to $OUT.
#   ACROSS_TESTS (default "coll moe"), ACROSS_TIMEOUT (seconds per run, default 150),
#   ACROSS_FILTER (default across_lsa).
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="${OUT:-$here/gpu-out}"
mkdir -p "$out"
untar() { python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' "$@"; }
[ -d "$here/bin" ] || untar "$here/bin.txz" "$here"
[ -f "$here/syms.txz" ] && [ ! -d "$here/syms" ] && mkdir -p "$here/syms" && untar "$here/syms.txz" "$here/syms"
export LD_LIBRARY_PATH="/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}"
export FERROLINK_REQUIRE_GPU=1 FERROLINK_TEST_BACKENDS="${FERROLINK_TEST_BACKENDS:-cuda}"
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
export FERROLINK_PROGRESS_SECS="${FERROLINK_PROGRESS_SECS:-10}"
gdb="$(command -v gdb || command -v cuda-gdb || ls /usr/local/cuda/bin/cuda-gdb 2>/dev/null || true)"
summary="$out/across.txt"
echo "bundle commit: $(cat "$here/COMMIT" | tr '\n' ' ') date: $(date -u +%FT%TZ) debugger: ${gdb:-none}" | tee -a "$summary"
IFS=';' read -ra envs <<< "${ACROSS_ENVS:--}"
for t in ${ACROSS_TESTS:-coll moe}; do
  exe="$here/bin/test-$t"
  [ -x "$here/syms/sym-test-$t" ] && exe="$here/syms/sym-test-$t"
  for e in "${envs[@]}"; do
    tag="$t-$(echo "$e" | tr -c 'A-Za-z0-9=\n' _ | tr -d '\n')"
    log="$out/$tag.log"
    start=$(date +%s)
    # shellcheck disable=SC2086
    ( [ "$e" = - ] || export $e; exec "$exe" --test-threads=1 --nocapture "${ACROSS_FILTER:-across_lsa}" ) > "$log" 2>&1 &
    pid=$!
    limit=${ACROSS_TIMEOUT:-150}
    while kill -0 "$pid" 2>/dev/null && [ $(( $(date +%s) - start )) -lt "$limit" ]; do sleep 1; done
    if kill -0 "$pid" 2>/dev/null; then
      { echo "===== limit of ${limit}s reached: nvidia-smi"; nvidia-smi 2>&1 | head -n 30; } >> "$log"
      if [ -n "$gdb" ]; then
        echo "===== host threads" >> "$log"
        timeout 60 "$gdb" -batch -p "$pid" -ex "thread apply all bt 25" >> "$log" 2>&1
      fi
      kill -9 "$pid"; wait "$pid" 2>/dev/null; res="KILLED at ${limit}s"
    else
      wait "$pid" && res=PASS || res="FAIL rc $?"
    fi
    echo "$res $tag ($(( $(date +%s) - start )) s): $(grep -E '^test result:|passed at|passed in' "$log" | tr '\n' ' ' | tail -c 900)" | tee -a "$summary"
  done
done
