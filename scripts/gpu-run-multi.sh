#!/usr/bin/env bash
# Multi-GPU and multi-process runs of the GPU bundle (kind nvidia-h200-x2 or larger), after
# run.sh: the two-rank figures in one process and as two processes (same run, alternating),
# the examples as one-process-per-GPU jobs, a refused second process on one GPU without MPS,
# then under MPS the multi-process tests and 4-process jobs on 2 GPUs, and the GIN figures and
# examples. Logs to $OUT: multi-summary.txt and multi.log. PAIR=0, JOBS=0, MPS=0 or GIN=0 skip
# a part.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
[ -d "$here/bin" ] || python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' "$here/bin.txz" "$here" # gpu-bundle.sh packs the binaries
out="${OUT:-$here/gpu-out}"
mkdir -p "$out"
export LD_LIBRARY_PATH="/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}"
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs). A run may set another value to see the hazard.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
export NCCL_NVLS_ENABLE=0 FERROLINK_BOOTSTRAP_TIMEOUT=60
summary="$out/multi-summary.txt"
log="$out/multi.log"
bin="$here/bin"
gpus=$(nvidia-smi -L | wc -l)
{
  echo "bundle commit: $(cat "$here/COMMIT")"
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
  nvidia-smi topo -m
} > "$summary"
status=0
step() { # name, command...
  local name="$1"; shift
  echo "===== $name" >> "$log"
  if timeout "${STEP_TIMEOUT:-240}" "$@" > "$here/last.log" 2>&1; then res=PASS; else res=FAIL; status=1; fi
  cat "$here/last.log" >> "$log"
  echo "$res $name" | tee -a "$summary"
}
if [ "$gpus" -lt 2 ]; then echo "needs 2 GPUs, found $gpus" | tee -a "$summary"; exit 1; fi

if [ "${GIN:-1}" = 1 ]; then
  echo "== GIN: figures between GPUs 0 and 1 (one process, then one process per GPU), examples as jobs" | tee -a "$summary"
  step "gin one-process" "$bin/ferrolink-perf" gin ${GIN_ARGS:-}
  sed -n '/== gin/,$p' "$here/last.log" | sed 's/^/    /' | tee -a "$summary"
  step "gin two-process" "$bin/ferrolink-run" -n 2 --devices 0,1 "$bin/ferrolink-perf" gin ${GIN_ARGS:-}
  sed -n '/== gin/,$p' "$here/last.log" | sed 's/^/    /' | tee -a "$summary"
  step "gin two-process, each its own LSA domain (TCP)" env FERROLINK_LSA=process "$bin/ferrolink-run" -n 2 --devices 0,1 "$bin/ferrolink-perf" gin --paths tcp ${GIN_ARGS:-}
  sed -n '/== gin/,$p' "$here/last.log" | sed 's/^/    /' | tee -a "$summary"
  for ex in 07_gin_ping_pong 08_all_to_all; do
    step "ferrolink-run -n 2 --devices 0,1 $ex" "$bin/ferrolink-run" -n 2 --devices 0,1 "$bin/example-$ex"
    grep -E "round trips|intact" "$here/last.log" | sed 's/^/    /' | tee -a "$summary"
    step "FERROLINK_LSA=process ferrolink-run -n 2 --devices 0,1 $ex" env FERROLINK_LSA=process "$bin/ferrolink-run" -n 2 --devices 0,1 "$bin/example-$ex"
    grep -E "round trips|intact" "$here/last.log" | sed 's/^/    /' | tee -a "$summary"
  done
fi

[ "${PAIR:-1}" = 1 ] && echo "== pair figures: one process over GPUs 0 and 1, then one process per GPU (alternating)" | tee -a "$summary"
for i in $( [ "${PAIR:-1}" = 1 ] && echo 1 2 3 ); do
  step "pair one-process #$i" "$bin/ferrolink-perf" pair
  grep -E "barrier|put" "$here/last.log" | sed 's/^/    /' | tee -a "$summary"
  step "pair two-process #$i" "$bin/ferrolink-run" -n 2 --devices 0,1 "$bin/ferrolink-perf" pair
  grep -E "barrier|put" "$here/last.log" | sed 's/^/    /' | tee -a "$summary"
done

[ "${JOBS:-1}" = 1 ] && echo "== examples as jobs of one process per GPU" | tee -a "$summary"
for ex in $( [ "${JOBS:-1}" = 1 ] && echo 02_ring 03_allreduce 05_fused 06_barrier ); do
  step "ferrolink-run -n 2 --devices 0,1 $ex" "$bin/ferrolink-run" -n 2 --devices 0,1 "$bin/example-$ex"
done

if [ "${MPS:-1}" != 1 ]; then echo "exit status: $status" | tee -a "$summary"; exit $status; fi
echo "== two processes on one GPU without MPS must be refused with a reason" | tee -a "$summary"
if timeout 60 "$bin/ferrolink-run" -n 2 --devices 0,0 "$bin/example-02_ring" > "$here/last.log" 2>&1; then
  echo "FAIL: the job ran without MPS" | tee -a "$summary"; status=1
elif grep -q "MPS" "$here/last.log"; then
  echo "PASS refused: $(grep -m1 -o 'ranks [0-9] and [0-9] run in different processes[^:]*' "$here/last.log")" | tee -a "$summary"
else
  echo "FAIL: refused without naming MPS" | tee -a "$summary"; cat "$here/last.log" >> "$log"; status=1
fi

echo "== under MPS: the multi-process tests and 4 processes on 2 GPUs" | tee -a "$summary"
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p /tmp/mps /tmp/mpslog
nvidia-cuda-mps-control -d && sleep 1
step "test-multiprocess (cuda, MPS)" env FERROLINK_TEST_BACKENDS=cuda FERROLINK_REQUIRE_GPU=1 "$bin/test-multiprocess" --test-threads=1
grep -E "^test result" "$here/last.log" | sed 's/^/    /' | tee -a "$summary"
for ex in 02_ring 03_allreduce 06_barrier; do
  step "ferrolink-run -n 4 --devices 0,1,0,1 $ex (MPS)" "$bin/ferrolink-run" -n 4 --devices 0,1,0,1 "$bin/example-$ex"
done
echo quit | nvidia-cuda-mps-control
echo "exit status: $status" | tee -a "$summary"
exit $status
