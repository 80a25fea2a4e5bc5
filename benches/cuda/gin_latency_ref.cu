// Reference put-with-signal ping-pong latencies in CUDA C++ between GPUs 0 and 1 (one process,
// peer access on): the floors that `ferrolink-perf gin`'s latency figures are judged against,
// measured in the same GPU run. One thread per GPU; GPU 0 puts 8 bytes and signals, GPU 1
// waits for the signal and answers the same way; half the round trip is printed.
//
//   store+fence+signal : st 8 B into the peer, fence.acq_rel.sys, red.add to the peer's
//                        signal (what a strong put-with-signal must do over NVLink; ferrolink's
//                        direct backend does this)
//   signal only        : the red.release.sys.add alone (no data: the floor of any signal)
//   LL packet          : 8 B of data and a flag in one 16-byte store, polled on the line
//                        (NCCL's LL / MSCCL++'s LL16: no fence, but not a separate signal)
//   proxy memops       : the kernel posts to a word in pinned host memory; a host thread per
//                        GPU spins on it and queues cuStreamWriteValue64 (data, then signal)
//                        into the peer's memory (the floor of a CPU proxy without a copy)
//   proxy memcpy       : as above with cuMemcpyAsync of the 8 bytes, then the signal write
//                        (the floor of a CPU proxy over the copy engine)
//   relaxed poll+fence.acquire / .acq_rel : store+fence+signal, but the waiter polls two
//                        words relaxed (signal and base) and fences once (ferrolink's wait)
//   loaded source      : store+fence+signal with the data loaded from memory first
//   data in the next line / 512 KiB away : store+fence+signal with the data 128 bytes or
//                        512 KiB from the signal word (the modes above share one line)
//
// Build: nvcc -O3 -arch=sm_90 -o gin_latency_ref gin_latency_ref.cu -lcuda
// Run:   ./gin_latency_ref [iters]      (needs two GPUs with peer access)
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <cuda.h>
#include <cuda_runtime.h>

#define CHECK(x)                                                                      \
  do {                                                                                \
    cudaError_t e_ = (x);                                                             \
    if (e_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)
#define CHECK_CU(x)                                                  \
  do {                                                               \
    CUresult r_ = (x);                                               \
    if (r_ != CUDA_SUCCESS) {                                        \
      std::fprintf(stderr, "%s:%d: CUresult %d\n", __FILE__, __LINE__, (int)r_); \
      std::exit(1);                                                  \
    }                                                                \
  } while (0)

typedef unsigned long long u64;

// Lines are 1 MiB allocations: the far-data mode puts its data 512 KiB from the signal.
static constexpr size_t kLineBytes = 1 << 20;
static constexpr size_t kFarWords = (512 << 10) / 8;

__device__ __forceinline__ u64 global_timer() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ u64 ld_acquire_sys(const u64* p) {
  u64 v;
  asm volatile("ld.acquire.sys.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ u64 ld_relaxed_sys(const u64* p) {
  u64 v;
  asm volatile("ld.relaxed.sys.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void red_release_sys(u64* p, u64 v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void st_release_sys(u64* p, u64 v) {
  asm volatile("st.release.sys.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

enum Mode { kStoreFenceSignal = 0, kSignalOnly = 1, kLlPacket = 2, kProxy = 3, kRelaxedPollFence = 4, kRelaxedPollFenceAcqRel = 5, kLoadedSource = 6, kNextLine = 7, kFarData = 8 };

// The waits: an acquire load per poll (the reference), or relaxed polls of the signal word
// and of a second word (a per-signal base, as a rolling signal reads) then one fence.
__device__ __forceinline__ void wait_for(int mode, u64* local, u64 k) {
  if (mode == kLlPacket) {
    while (ld_relaxed_sys(&local[1]) != k) {
    }
  } else if (mode == kRelaxedPollFence || mode == kRelaxedPollFenceAcqRel) {
    while (ld_relaxed_sys(&local[2]) - ld_relaxed_sys(&local[5]) < k) {
    }
    if (mode == kRelaxedPollFence)
      asm volatile("fence.acquire.sys;" ::: "memory");
    else
      asm volatile("fence.acq_rel.sys;" ::: "memory");
  } else {
    while (ld_acquire_sys(&local[2]) < k) {
    }
  }
}

// `local` and `peer` are {data[2], signal, pad} lines on this GPU and on the peer (mapped).
// Proxy mode: `doorbell` is pinned host memory the host proxy polls (value = round + 1).
__global__ void ping_pong(int mode, int first, u64* local, u64* peer, u64* doorbell, int warmup, int iters,
                          u64* out_ns) {
  u64 t0 = 0;
  for (int i = 0; i < warmup + iters; ++i) {
    if (i == warmup) t0 = global_timer();
    const u64 k = (u64)i + 1;
    if (!first) wait_for(mode, local, k);
    switch (mode) {
      case kStoreFenceSignal:
      case kRelaxedPollFence:
      case kRelaxedPollFenceAcqRel:
        *(volatile u64*)&peer[0] = k;
        red_release_sys(&peer[2], 1);
        break;
      case kLoadedSource:
        *(volatile u64*)&peer[0] = *(volatile u64*)&local[4];
        red_release_sys(&peer[2], 1);
        break;
      case kNextLine:
        *(volatile u64*)&peer[16] = k;
        red_release_sys(&peer[2], 1);
        break;
      case kFarData:
        *(volatile u64*)&peer[kFarWords] = k;
        red_release_sys(&peer[2], 1);
        break;
      case kSignalOnly:
        red_release_sys(&peer[2], 1);
        break;
      case kLlPacket:
        asm volatile("st.volatile.global.v2.u64 [%0], {%1, %2};" ::"l"(peer), "l"(k), "l"(k) : "memory");
        break;
      default:
        st_release_sys(doorbell, k);
        break;
    }
    if (first) wait_for(mode, local, k);
  }
  if (first) *out_ns = global_timer() - t0;
}

// A host proxy for one GPU: each time the doorbell shows a new round, write the data and the
// signal into the peer's line (stream-ordered), by memops or by a copy + memop.
static void proxy(CUcontext ctx, volatile u64* doorbell, u64 total, CUdeviceptr peer_line, CUdeviceptr src,
                  bool memcpy_data, std::atomic<bool>* stop) {
  CHECK_CU(cuCtxSetCurrent(ctx));
  CUstream s;
  CHECK_CU(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  u64 seen = 0;
  while (seen < total && !stop->load(std::memory_order_relaxed)) {
    u64 v = *doorbell;
    if (v == seen) continue;
    seen = v;
    if (memcpy_data) {
      CHECK_CU(cuMemcpyAsync(peer_line, src, 8, s));
    } else {
      CHECK_CU(cuStreamWriteValue64(s, peer_line, v, 0));
    }
    CHECK_CU(cuStreamWriteValue64(s, peer_line + 16, v, 0));
  }
  CHECK_CU(cuStreamSynchronize(s));
  CHECK_CU(cuStreamDestroy(s));
}

// With GIN_REF_VMM=1 the lines are VMM allocations (cuMemCreate on their GPU, mapped, both
// GPUs given read-write access), as ferrolink's windows are; else cudaMalloc + peer access.
static bool use_vmm() {
  const char* v = std::getenv("GIN_REF_VMM");
  return v && v[0] == '1';
}

static u64* vmm_alloc(int dev, size_t bytes) {
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  size_t gran = 0;
  CHECK_CU(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  size_t size = (bytes + gran - 1) / gran * gran;
  CUmemGenericAllocationHandle h;
  CHECK_CU(cuMemCreate(&h, size, &prop, 0));
  CUdeviceptr va;
  CHECK_CU(cuMemAddressReserve(&va, size, gran, 0, 0));
  CHECK_CU(cuMemMap(va, size, 0, h, 0));
  CUmemAccessDesc access[2] = {};
  for (int d = 0; d < 2; ++d) {
    access[d].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access[d].location.id = d;
    access[d].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  }
  CHECK_CU(cuMemSetAccess(va, size, access, 2));
  return (u64*)va;
}

static double run(int mode, bool memcpy_data, int iters) {
  const int warmup = iters / 10;
  u64* line[2];
  u64* out;
  u64* doorbell[2];
  cudaStream_t stream[2];
  for (int d = 0; d < 2; ++d) {
    CHECK(cudaSetDevice(d));
    if (use_vmm())
      line[d] = vmm_alloc(d, kLineBytes);
    else
      CHECK(cudaMalloc(&line[d], kLineBytes));
    CHECK(cudaMemset(line[d], 0, kLineBytes));
    CHECK(cudaStreamCreateWithFlags(&stream[d], cudaStreamNonBlocking));
    CHECK(cudaHostAlloc(&doorbell[d], 64, cudaHostAllocMapped | cudaHostAllocPortable));
    *doorbell[d] = 0;
  }
  CHECK(cudaSetDevice(0));
  CHECK(cudaMalloc(&out, 8));
  CHECK(cudaDeviceSynchronize());
  std::atomic<bool> stop{false};
  std::thread proxies[2];
  if (mode == kProxy) {
    for (int d = 0; d < 2; ++d) {
      CUcontext ctx;
      CHECK(cudaSetDevice(d));
      CHECK_CU(cuCtxGetCurrent(&ctx));
      proxies[d] = std::thread(proxy, ctx, doorbell[d], (u64)(warmup + iters), (CUdeviceptr)line[1 - d],
                               (CUdeviceptr)line[d], memcpy_data, &stop);
    }
  }
  for (int d = 0; d < 2; ++d) {
    CHECK(cudaSetDevice(d));
    u64* db;
    CHECK(cudaHostGetDevicePointer(&db, doorbell[d], 0));
    ping_pong<<<1, 1, 0, stream[d]>>>(mode, d == 0, line[d], line[1 - d], db, warmup, iters, out);
    CHECK(cudaGetLastError());
  }
  for (int d = 0; d < 2; ++d) {
    CHECK(cudaSetDevice(d));
    CHECK(cudaStreamSynchronize(stream[d]));
  }
  stop = true;
  for (auto& p : proxies)
    if (p.joinable()) p.join();
  u64 ns = 0;
  CHECK(cudaSetDevice(0));
  CHECK(cudaMemcpy(&ns, out, 8, cudaMemcpyDeviceToHost));
  for (int d = 0; d < 2; ++d) {
    CHECK(cudaSetDevice(d));
    if (!use_vmm()) CHECK(cudaFree(line[d]));  // (VMM lines are left mapped: a benchmark)
    CHECK(cudaFreeHost(doorbell[d]));
    CHECK(cudaStreamDestroy(stream[d]));
  }
  CHECK(cudaSetDevice(0));
  CHECK(cudaFree(out));
  return (double)ns / iters / 2.0 / 1e3;
}

int main(int argc, char** argv) {
  int iters = argc > 1 ? std::atoi(argv[1]) : 10000;
  int n = 0;
  CHECK(cudaGetDeviceCount(&n));
  if (n < 2) {
    std::printf("gin_latency_ref: needs two GPUs (found %d): skipped\n", n);
    return 0;
  }
  for (int d = 0; d < 2; ++d) {
    CHECK(cudaSetDevice(d));
    CHECK(cudaDeviceEnablePeerAccess(1 - d, 0));
  }
  const char* names[] = {"store+fence+signal", "signal only", "LL packet", "proxy memops", "proxy memcpy",
                         "relaxed poll+fence.acquire", "relaxed poll+fence.acq_rel", "loaded source",
                         "data in the next line", "data 512 KiB away"};
  const int modes[] = {kStoreFenceSignal, kSignalOnly, kLlPacket, kProxy, kProxy, kRelaxedPollFence,
                       kRelaxedPollFenceAcqRel, kLoadedSource, kNextLine, kFarData};
  for (int m = 0; m < 10; ++m) {
    const int mode = modes[m];
    const int it = mode == kProxy ? iters / 4 : iters;
    double best = 1e30;
    for (int trial = 0; trial < 3; ++trial) {
      double us = run(mode, m == 4, it);
      if (us < best) best = us;
    }
    std::printf("gin reference ping-pong, 8 B, %-20s: %.2f us one way (best of 3 x %d)%s\n", names[m], best, it,
                use_vmm() ? ", VMM memory" : "");
  }
  return 0;
}
