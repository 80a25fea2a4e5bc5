#!/usr/bin/env bash
# The GIN part of the GPU bundle on nvidia-h200-x2 (scripts/gpu-bundle.sh copies it as gin.sh),
# in priority order under an overall deadline (DEADLINE seconds, default 530), each step with
# its own limit, so that one hang costs a step, not the lease. STEPS picks and orders the
# steps (default: ref perf2 perfdom test-gin ex perf1 lsa):
#   ref      CUDA C++ latency references (ref/gin_latency_ref.cu, nvcc) — the floors
#   perf2    ferrolink-perf gin as two processes (LSA node: direct, CE and TCP forced)
#   perfdom  the same with every process its own LSA domain (FERROLINK_LSA=process: TCP)
#   test-gin tests/gin.rs on CUDA;  ex  examples 07 and 08 as 2-process jobs
#   perf1    ferrolink-perf gin in one process over two GPUs;  lsa  test-lsa/core/device/guide
#   test-coll tests/coll.rs on CUDA;  test-p2p  tests/p2p.rs on CUDA
#   vranks   all_reduce of 4 KiB by 8 virtual ranks on GPU 0 (one process), -c 1
#   persist  ferrolink-perf all_reduce --persistent (PERSIST_ARGS, with -g), one process over the GPUs
#   coll     NCCL's collectives (ref/nccl_coll_ref.cu, nvcc) and `ferrolink-perf <coll>` with the
#            same arguments (COLL_ARGS), one process over the GPUs; then all_reduce as one
#            process per GPU
# The open targets of issues 12 and 13 on nvidia-h200-x2, in one call: STEPS=targets, which is
# "lat moell moe bw" (each rank one process per GPU under ferrolink-run, NCCL in the same run):
#   lat      all_reduce <= 64 KiB: ncclAllReduce, ferrolink host-launched, ferrolink
#            --persistent; ROUNDS (default 2) rounds, alternating, so noise shows
#   moell    MoE low-latency, 128 tokens x 7168 bf16, top-8 of 64 experts (MOELL_ARGS)
#   moe      MoE normal mode, 4096 tokens (MOE_ARGS); then the PyTorch path (ref/moe_all_to_all.py) with
#            the same routing under torch.distributed.run
#   bw       busbw from 64 MiB: NCCL and ferrolink, all_reduce all_gather reduce_scatter
#            all_to_all (BW_ARGS), ferrolink one process per GPU
# Output: $OUT/summary.txt (what passed, the figures) and $OUT/run.log (everything).
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
[ -d "$here/bin" ] || python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' "$here/bin.txz" "$here"
out="${OUT:-$here/gpu-out}"; mkdir -p "$out"
export LD_LIBRARY_PATH="/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}" NCCL_NVLS_ENABLE=0 FERROLINK_BOOTSTRAP_TIMEOUT=60
# As ferrolink-run sets for its ranks: the GIN proxy's stream copies need hardware queues of
# their own (host/src/gin/copy_watch.rs).
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
export FERROLINK_REQUIRE_GPU=1 FERROLINK_TEST_BACKENDS=cuda FERROLINK_TIMEOUT=${FERROLINK_TIMEOUT:-40} FERROLINK_PROGRESS_SECS=5
bin="$here/bin"; sum="$out/summary.txt"; log="$out/run.log"
start=$(date +%s)
{ echo "bundle commit: $(cat "$here/COMMIT")"; echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"; nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader; } > "$sum"
step() { # limit name cmd...
  local lim="$1" name="$2"; shift 2
  local el=$(( $(date +%s) - start ))
  if [ $(( el + 20 )) -gt "${DEADLINE:-530}" ]; then echo "SKIP $name (deadline, at ${el}s)" | tee -a "$sum"; return; fi
  [ $(( el + lim )) -gt "${DEADLINE:-530}" ] && lim=$(( ${DEADLINE:-530} - el ))
  echo "===== $name" >> "$log"
  local t0=$(date +%s)
  if timeout -k 5 "$lim" "$@" > "$here/last.log" 2>&1; then res=PASS; else res="FAIL($?)"; fi
  cat "$here/last.log" >> "$log"
  echo "$res $name ($(( $(date +%s) - t0 ))s)" | tee -a "$sum"
  [ "$res" = PASS ] || grep -E "panicked|error|Error|waits|failed" "$here/last.log" | head -12 | sed 's/^/  ! /' >> "$sum"
}
gin_out() { sed -n '/== gin/,$p' "$here/last.log" | sed 's/^/    /' >> "$sum"; }
nccl_ref() { # builds ref/nccl_coll_ref once (NCCL 2.28.9 from the nvidia-nccl-cu13 package)
  NV=$(python3 -c "import nvidia.nccl as m; print(list(m.__path__)[0])")
  [ -x "$here/ref/nccl_coll_ref" ] && return
  local nvcc; nvcc="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
  step 120 "nvcc nccl_coll_ref" "$nvcc" -O3 -std=c++17 -arch=sm_90 -I"$NV/include" -o "$here/ref/nccl_coll_ref" "$here/ref/nccl_coll_ref.cu" -L"$NV/lib" -l:libnccl.so.2
}
rows() { grep -vE "^#|WARN|^$|device:|note:" "$here/last.log" | sed "s/^/    $1 /" >> "$sum"; }
ranks2=("$bin/ferrolink-run" -n 2 --devices 0,1) # one process per GPU (timeout runs it: no function)
steps="${STEPS:-ref perf2 perfdom test-gin ex perf1 lsa}"
[ "$steps" = targets ] && steps="lat moell moe bw"
for s in $steps; do case $s in
ref) nvcc="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
  step 90 "nvcc gin_latency_ref" "$nvcc" -O3 -arch=sm_90 -o "$here/ref/gin_latency_ref" "$here/ref/gin_latency_ref.cu" -lcuda
  step 60 "gin_latency_ref" "$here/ref/gin_latency_ref"
  grep "reference" "$here/last.log" | sed 's/^/    /' >> "$sum" ;;
perf2) step 150 "gin two-process (LSA node: direct, CE forced proxy, TCP forced)" "$bin/ferrolink-run" -n 2 --devices 0,1 "$bin/ferrolink-perf" gin ${GIN_ARGS:-}; gin_out ;;
perfdom) step 90 "gin two-process, own LSA domains (TCP)" env FERROLINK_LSA=process "$bin/ferrolink-run" -n 2 --devices 0,1 "$bin/ferrolink-perf" gin --paths tcp; gin_out ;;
test-gin) step 200 "test-gin (cuda)" "$bin/test-gin" --test-threads=1
  grep -E "^test |test result|panicked|failed on" "$here/last.log" | sed 's/^/    /' >> "$sum" ;;
perf1) step 120 "gin one-process" "$bin/ferrolink-perf" gin ${GIN_ARGS:-}; gin_out ;;
ex) for ex in 07_gin_ping_pong 08_all_to_all; do
  step 40 "ferrolink-run -n 2 $ex" "$bin/ferrolink-run" -n 2 --devices 0,1 "$bin/example-$ex"
  grep -E "round trips|intact|one way" "$here/last.log" | sed 's/^/    /' >> "$sum"
done ;;
lsa) for t in lsa core device guide; do
  step 90 "test-$t (cuda)" "$bin/test-$t" --test-threads=1
  grep -E "test result|panicked|failed on" "$here/last.log" | sed 's/^/    /' >> "$sum"
done ;;
test-coll) step 200 "test-coll (cuda)" "$bin/test-coll" --test-threads=1
  grep -E "^test |test result|panicked|failed on" "$here/last.log" | sed 's/^/    /' >> "$sum" ;;
test-p2p) step 150 "test-p2p (cuda)" "$bin/test-p2p" --test-threads=1
  grep -E "^test |test result|panicked|failed on" "$here/last.log" | sed 's/^/    /' >> "$sum" ;;
vranks) step 90 "all_reduce 4 KiB, 8 virtual ranks on one GPU" "$bin/ferrolink-perf" all_reduce -b 4K -e 64K -f 4 -d f32 -o sum -n 200 -w 20 -c 1 -g 1 --ranks-per-gpu 8
  grep -vE "WARN|^$" "$here/last.log" | sed "s/^/    vranks /" >> "$sum" ;;
persist) step 90 "ferrolink all_reduce --persistent" "$bin/ferrolink-perf" all_reduce ${PERSIST_ARGS:--b 1K -e 64K -f 4 -d bf16 -o sum -n 200 -w 20 -c 1 -g 2} --persistent
  grep -vE "^#|WARN|^$|device:" "$here/last.log" | sed "s/^/    persistent /" >> "$sum" ;;
coll) nccl_ref
  for c in ${COLLS:-all_reduce all_gather reduce_scatter all_to_all}; do
    a="${COLL_ARGS:--b 1K -e 256M -f 4 -d bf16 -o sum -n 20 -w 5 -c 1}"
    step 60 "nccl $c" env LD_LIBRARY_PATH="$NV/lib:$LD_LIBRARY_PATH" "$here/ref/nccl_coll_ref" $c $a -g 2
    grep -vE "^#|WARN|^$" "$here/last.log" | sed "s/^/    nccl      /" >> "$sum"
    step 90 "ferrolink $c" "$bin/ferrolink-perf" $c $a -g 2
    grep -vE "^#|WARN|^$" "$here/last.log" | sed "s/^/    ferrolink /" >> "$sum"
  done
  step 90 "ferrolink all_reduce, one process per GPU" "$bin/ferrolink-run" -n 2 --devices 0,1 "$bin/ferrolink-perf" all_reduce ${COLL_ARGS:--b 1K -e 256M -f 4 -d bf16 -o sum -n 20 -w 5 -c 1}
  grep -vE "#|WARN|^$" "$here/last.log" | sed "s/^/    ferrolink-2p /" >> "$sum" ;;
lat) nccl_ref
  a="${LAT_ARGS:--b 1K -e 64K -f 4 -d f32 -o sum -n 2000 -w 100 -c 1}"
  for r in $(seq "${ROUNDS:-2}"); do
    step 60 "nccl all_reduce, round $r" env LD_LIBRARY_PATH="$NV/lib:$LD_LIBRARY_PATH" "$here/ref/nccl_coll_ref" all_reduce $a -g 2; rows "nccl-$r        "
    step 60 "ferrolink all_reduce, one process per GPU, round $r" "${ranks2[@]}" "$bin/ferrolink-perf" all_reduce $a; rows "ferrolink-$r   "
    step 60 "ferrolink all_reduce --persistent, one process per GPU, round $r" "${ranks2[@]}" "$bin/ferrolink-perf" all_reduce $a --persistent; rows "persistent-$r  "
  done ;;
moell) step 90 "moe --low-latency, one process per GPU" "${ranks2[@]}" "$bin/ferrolink-perf" moe --low-latency ${MOELL_ARGS:---tokens 128 --hidden 7168 --experts 64 --top-k 8 -n 200 -w 20}; rows moe-ll ;;
moe) m="${MOE_ARGS:---tokens 4096 --hidden 7168 --experts 64 --top-k 8 -n 20 -w 5}"
  step 120 "moe 4096 tokens, one process per GPU" "${ranks2[@]}" "$bin/ferrolink-perf" moe $m; rows moe
  step 150 "PyTorch all_to_all_single, the same routing" python3 -m torch.distributed.run --standalone --nproc-per-node 2 "$here/ref/moe_all_to_all.py" $m; rows torch ;;
bw) nccl_ref
  a="${BW_ARGS:--b 64M -e 256M -f 2 -d bf16 -o sum -n 20 -w 5 -c 1}"
  for c in ${COLLS:-all_reduce all_gather reduce_scatter all_to_all}; do
    step 60 "nccl $c" env LD_LIBRARY_PATH="$NV/lib:$LD_LIBRARY_PATH" "$here/ref/nccl_coll_ref" $c $a -g 2; rows "nccl      "
    step 90 "ferrolink $c, one process per GPU" "${ranks2[@]}" "$bin/ferrolink-perf" $c $a; rows "ferrolink "
  done ;;
*) echo "unknown step $s" | tee -a "$sum" ;;
esac; done
echo "total $(( $(date +%s) - start ))s" | tee -a "$sum"
