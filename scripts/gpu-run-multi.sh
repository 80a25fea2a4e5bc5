#!/usr/bin/env bash
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
# Multi-GPU and multi-process runs of the GPU bundle (kind nvidia-h200-x2 or larger), after
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
# run.sh: the two-rank figures in one process and as two processes (same run, alternating),
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
# the examples as one-process-per-GPU jobs, a refused second process on one GPU without MPS,
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
# then under MPS the multi-process tests and 4-process jobs on 2 GPUs, and the GIN figures and
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
# examples. Logs to $OUT: multi-summary.txt and multi.log. PAIR=0, JOBS=0, MPS=0 or GIN=0 skip
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
# a part.
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
set -uo pipefail
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
[ -d "$here/bin" ] || python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' "$here/bin.txz" "$here" # gpu-bundle.sh packs the binaries
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
out="${OUT:-$here/gpu-out}"
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
mkdir -p "$out"
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
export LD_LIBRARY_PATH="/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}"
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
export NCCL_NVLS_ENABLE=0 FERROLINK_BOOTSTRAP_TIMEOUT=60
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
summary="$out/multi-summary.txt"
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
log="$out/multi.log"
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
bin="$here/bin"
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
gpus=$(nvidia-smi -L | wc -l)
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
{
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
  echo "bundle commit: $(cat "$here/COMMIT")"
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
  nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
  nvidia-smi topo -m
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
} > "$summary"
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
status=0
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
step() { # name, command...
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
  local name="$1"; shift
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
  echo "===== $name" >> "$log"
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
  if timeout "${STEP_TIMEOUT:-240}" "$@" > "$here/last.log" 2>&1; then res=PASS; else res=FAIL; status=1; fi
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
  cat "$here/last.log" >> "$log"
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
  echo "$res $name" | tee -a "$summary"
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
}
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
if [ "$gpus" -lt 2 ]; then echo "needs 2 GPUs, found $gpus" | tee -a "$summary"; exit 1; fi
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"

# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
if [ "${GIN:-1}" = 1 ]; then
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
  echo "== GIN: figures between GPUs 0 and 1 (one process, then one process per GPU), examples as jobs" | tee -a "$summary"
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
  step "gin one-process" "$bin/ferrolink-perf" gin ${GIN_ARGS:-}
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
  sed -n '/== gin/,$p' "$here/last.log" | sed 's/^/    /' | tee -a "$summary"
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
  step "gin two-process" "$bin/ferrolink-run" -n 2 --devices 0,1 "$bin/ferrolink-perf" gin ${GIN_ARGS:-}
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
  sed -n '/== gin/,$p' "$here/last.log" | sed 's/^/    /' | tee -a "$summary"
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
  step "gin two-process, each its own LSA domain (TCP)" env FERROLINK_LSA=process "$bin/ferrolink-run" -n 2 --devices 0,1 "$bin/ferrolink-perf" gin --paths tcp ${GIN_ARGS:-}
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
  sed -n '/== gin/,$p' "$here/last.log" | sed 's/^/    /' | tee -a "$summary"
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
  for ex in 07_gin_ping_pong 08_all_to_all; do
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
    step "ferrolink-run -n 2 --devices 0,1 $ex" "$bin/ferrolink-run" -n 2 --devices 0,1 "$bin/example-$ex"
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
    grep -E "round trips|intact" "$here/last.log" | sed 's/^/    /' | tee -a "$summary"
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
    step "FERROLINK_LSA=process ferrolink-run -n 2 --devices 0,1 $ex" env FERROLINK_LSA=process "$bin/ferrolink-run" -n 2 --devices 0,1 "$bin/example-$ex"
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
    grep -E "round trips|intact" "$here/last.log" | sed 's/^/    /' | tee -a "$summary"
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
  done
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
fi
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"

# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
[ "${PAIR:-1}" = 1 ] && echo "== pair figures: one process over GPUs 0 and 1, then one process per GPU (alternating)" | tee -a "$summary"
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
for i in $( [ "${PAIR:-1}" = 1 ] && echo 1 2 3 ); do
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
  step "pair one-process #$i" "$bin/ferrolink-perf" pair
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
  grep -E "barrier|put" "$here/last.log" | sed 's/^/    /' | tee -a "$summary"
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
  step "pair two-process #$i" "$bin/ferrolink-run" -n 2 --devices 0,1 "$bin/ferrolink-perf" pair
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
  grep -E "barrier|put" "$here/last.log" | sed 's/^/    /' | tee -a "$summary"
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
done
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"

# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
[ "${JOBS:-1}" = 1 ] && echo "== examples as jobs of one process per GPU" | tee -a "$summary"
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
for ex in $( [ "${JOBS:-1}" = 1 ] && echo 02_ring 03_allreduce 05_fused 06_barrier ); do
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
  step "ferrolink-run -n 2 --devices 0,1 $ex" "$bin/ferrolink-run" -n 2 --devices 0,1 "$bin/example-$ex"
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
done
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"

# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
if [ "${MPS:-1}" != 1 ]; then echo "exit status: $status" | tee -a "$summary"; exit $status; fi
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
echo "== two processes on one GPU without MPS must be refused with a reason" | tee -a "$summary"
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
if timeout 60 "$bin/ferrolink-run" -n 2 --devices 0,0 "$bin/example-02_ring" > "$here/last.log" 2>&1; then
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
  echo "FAIL: the job ran without MPS" | tee -a "$summary"; status=1
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
elif grep -q "MPS" "$here/last.log"; then
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
  echo "PASS refused: $(grep -m1 -o 'ranks [0-9] and [0-9] run in different processes[^:]*' "$here/last.log")" | tee -a "$summary"
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
else
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
  echo "FAIL: refused without naming MPS" | tee -a "$summary"; cat "$here/last.log" >> "$log"; status=1
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
fi
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"

# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
echo "== under MPS: the multi-process tests and 4 processes on 2 GPUs" | tee -a "$summary"
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
mkdir -p /tmp/mps /tmp/mpslog
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
nvidia-cuda-mps-control -d && sleep 1
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
step "test-multiprocess (cuda, MPS)" env FERROLINK_TEST_BACKENDS=cuda FERROLINK_REQUIRE_GPU=1 "$bin/test-multiprocess" --test-threads=1
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
grep -E "^test result" "$here/last.log" | sed 's/^/    /' | tee -a "$summary"
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
for ex in 02_ring 03_allreduce 06_barrier; do
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
  step "ferrolink-run -n 4 --devices 0,1,0,1 $ex (MPS)" "$bin/ferrolink-run" -n 4 --devices 0,1,0,1 "$bin/example-$ex"
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
done
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
echo quit | nvidia-cuda-mps-control
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
echo "exit status: $status" | tee -a "$summary"
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
exit $status
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
