#!/usr/bin/env bash
# Runs the GPU bundle on the GPU machine: every test binary on CUDA (a missing GPU fails),
# every example, then the perf suite. Logs go to $OUT (or ./gpu-out) as four files at most
# (tests.log, examples.log, perf.log, summary.txt: the device tool returns 8 files).
#   PERF=0 skips the perf suite; TESTS=0 skips the tests; PERF_ARGS replaces the perf
#   arguments (default `all`, e.g. PERF_ARGS="copy --sweep"); REF=0 skips the CUDA C++
#   reference benchmarks (ref/*.cu, built with nvcc where nvcc is found).
#   SANITIZE=1 runs the test binaries under compute-sanitizer instead (memcheck, racecheck,
#   synccheck; SANITIZE_TOOLS narrows the list), one log per tool (sanitize-<tool>.log), and
#   skips the rest unless asked.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
[ -d "$here/bin" ] || python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' "$here/bin.txz" "$here" # gpu-bundle.sh packs the binaries
out="${OUT:-$here/gpu-out}"
mkdir -p "$out"
export LD_LIBRARY_PATH="/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}"
export FERROLINK_REQUIRE_GPU=1
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
export FERROLINK_TEST_BACKENDS="${FERROLINK_TEST_BACKENDS:-cuda}"
summary="$out/summary.txt"
{
  echo "bundle commit: $(cat "$here/COMMIT")"
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader 2>&1 | head -n 4
} > "$summary"
status=0
if [ "${SANITIZE:-0}" = 1 ]; then
  cs="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck}; do
    log="$out/sanitize-$tool.log"
    for t in "$here"/bin/test-*; do
      name="$(basename "$t")"
      case "$name" in test-emulator*) continue ;; esac # host-only tests: no kernels
      echo "===== $tool $name" >> "$log"
      # The barrier-index case traps on purpose (in a child process): the sanitizer would
      # report that trap, so it is skipped here; its own run is in the plain test pass.
      if timeout "${SANITIZE_TIMEOUT:-300}" "$cs" --tool "$tool" --error-exitcode 99 --target-processes all \
           "$t" --test-threads=1 --skip barrier_index_outside_its_set ${TEST_ARGS:-} > "$here/last.log" 2>&1; then
        res=PASS
      else
        res=FAIL; status=1
      fi
      cat "$here/last.log" >> "$log"
      echo "$res $tool $name: $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|test result:" "$here/last.log" | tr '\n' ' ')" | tee -a "$summary"
    done
  done
  TESTS="${TESTS:-0}"; PERF="${PERF:-0}"; REF="${REF:-0}"
fi
if [ "${TESTS:-1}" = 1 ]; then
  for t in "$here"/bin/test-*; do
    name="$(basename "$t")"
    start=$(date +%s%N)
    log="$out/tests.log"
    echo "===== $name" >> "$log"
    # A hard limit per binary: a GPU-side deadlock must cost minutes of the lease, not all of it.
    if timeout "${TEST_TIMEOUT:-180}" "$t" --test-threads="${TEST_THREADS:-1}" ${TEST_ARGS:-} 2>&1 | tee "$here/last.log" >> "$log"; then res=PASS; else res=FAIL; status=1; fi
    ms=$(( ($(date +%s%N) - start) / 1000000 ))
    line=$(grep -E "^test result:" "$here/last.log" | tail -n1)
    echo "$res $name (${ms} ms): $line" | tee -a "$summary"
    [ "$res" = FAIL ] && grep -E "panicked|FAILED|failed on" "$here/last.log" | head -n 20 | tee -a "$summary"
  done
  for e in "$here"/bin/example-*; do
    [ -e "$e" ] || continue
    name="$(basename "$e")"
    if timeout 60 "$e" > "$here/last.log" 2>&1; then res=PASS; else res=FAIL; status=1; fi
    { echo "===== $name"; cat "$here/last.log"; } >> "$out/examples.log"
    echo "$res $name: $(tail -n1 "$here/last.log")" | tee -a "$summary"
  done
fi
if [ "${PERF:-1}" = 1 ]; then
  echo "== ferrolink-perf ${PERF_ARGS:-all}" | tee -a "$summary"
  timeout "${PERF_TIMEOUT:-240}" "$here/bin/ferrolink-perf" ${PERF_ARGS:-all} 2>&1 | tee -a "$out/perf.log" | tee -a "$summary" || status=1
fi
if [ "${REF:-1}" = 1 ]; then
  nvcc="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
  if [ -x "$nvcc" ]; then
    for src in "$here"/ref/*.cu; do
      [ -e "$src" ] || continue
      exe="$here/ref/$(basename "$src" .cu)"
      echo "== reference $(basename "$src") (nvcc -O3 -arch=sm_90)" | tee -a "$summary"
      if "$nvcc" -O3 -arch=sm_90 -o "$exe" "$src" -lcuda >> "$out/perf.log" 2>&1; then
        timeout 120 "$exe" 2>&1 | tee -a "$out/perf.log" | tee -a "$summary" || status=1
      else
        echo "nvcc failed (see perf.log)" | tee -a "$summary"; status=1
      fi
    done
  else
    echo "== reference benchmarks skipped: no nvcc" | tee -a "$summary"
  fi
fi
echo "exit status: $status" | tee -a "$summary"
exit $status
