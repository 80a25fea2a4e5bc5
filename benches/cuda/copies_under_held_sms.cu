// Which stream operations still run while kernels hold every SM of the GPU? The GIN proxy's
// transports copy with them while the ranks' kernels spin waiting for those copies: an
// operation that needs an SM (the driver may run it as a kernel) waits until a CTA ends, and
// never runs if the kernels wait for it. A probe, not a benchmark: for each operation, a
// "hold" kernel of two 1024-thread CTAs per SM (every thread slot of an sm_90 SM) spins on a
// flag in pinned host memory; a host thread issues the operation on another non-blocking
// stream and synchronizes it; the main thread waits up to HOLD_MS for it, then releases the
// kernel and reports whether the operation finished while the SMs were held.
//
// Build: nvcc -O3 -arch=sm_90 -o copies_under_held_sms copies_under_held_sms.cu -lcuda
// Run:   ./copies_under_held_sms [bytes] [mode 0-3: how the hold kernel spins; see `hold`]
// The batch rows compare 64 copies issued one by one with the same copies as one
// `cuMemcpyBatchAsync` (CUDA 13 headers), each followed by one synchronize; "CE" rows set
// CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <thread>
#include <atomic>
#include <vector>
#include <cuda.h>
#include <cuda_runtime.h>

#define CK(x)                                                                          \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(1);                                                                         \
    }                                                                                  \
  } while (0)

static const int HOLD_MS = 300;

// How the hold kernel spins: 0 reads nothing (the global timer only), 1 every thread reads the
// host flag, 2 lane 0 of each warp reads it then sleeps 100 ns (as a GIN wait past its fast
// phase), 3 thread 0 of each CTA does. Every mode also ends at `deadline_ns` (a safety net;
// mode 0's only end).
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void read_timer(unsigned long long* out) { *out = global_ns(); }

__global__ void hold(volatile int* stop, int* started, int mode, unsigned long long deadline_ns) {
  if (threadIdx.x == 0) atomicAdd(started, 1);
  __shared__ int cta_done;
  for (;;) {
    if (mode == 0) {
      if (global_ns() >= deadline_ns) break;
    } else if (mode == 1) {
      if (*stop != 0 || global_ns() >= deadline_ns) break;
    } else if (mode == 2) {
      // The lane-0 poller decides for its warp (no lane leaves alone).
      int done = 0;
      if (threadIdx.x % 32 == 0) {
        done = *stop != 0 || global_ns() >= deadline_ns;
        __nanosleep(100);
      }
      if (__shfl_sync(0xffffffffu, done, 0)) break;
    } else {
      // Thread 0 decides for its CTA.
      if (threadIdx.x == 0) {
        cta_done = *stop != 0 || global_ns() >= deadline_ns;
        __nanosleep(100);
      }
      __syncthreads();
      int done = cta_done;
      __syncthreads();
      if (done) break;
    }
  }
}

int main(int argc, char** argv) {
  size_t bytes = argc > 1 ? strtoull(argv[1], nullptr, 0) : 4096;
  int mode = argc > 2 ? atoi(argv[2]) : 1;
  static const char* modes[] = {"no memory reads (timer)", "every thread reads the host flag",
                                "lane 0 of each warp reads the host flag, 100 ns sleeps",
                                "thread 0 of each CTA reads the host flag, 100 ns sleeps"};
  if (mode < 0 || mode > 3) { fprintf(stderr, "mode 0..3\n"); return 2; }
  CK(cudaSetDevice(0));
  int sms = 0, per_sm = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, hold, 1024, 0));
  int ctas = sms * per_sm;
  printf("SMs %d, hold CTAs %d (%d of 1024 threads per SM), %zu bytes per operation, hold kernel: %s\n", sms, ctas,
         per_sm, bytes, modes[mode]);

  int *stop_h, *stop_d, *started_h, *started_d;
  CK(cudaHostAlloc(&stop_h, 4, cudaHostAllocMapped));
  CK(cudaHostAlloc(&started_h, 4, cudaHostAllocMapped));
  CK(cudaHostGetDevicePointer(&stop_d, stop_h, 0));
  CK(cudaHostGetDevicePointer(&started_d, started_h, 0));
  char *dev_a, *dev_b, *pinned, *pinned_d;
  CK(cudaMalloc(&dev_a, bytes));
  CK(cudaMalloc(&dev_b, bytes));
  CK(cudaHostAlloc(&pinned, bytes, cudaHostAllocMapped));
  CK(cudaHostGetDevicePointer(&pinned_d, pinned, 0));
  std::vector<char> pageable(bytes, 1);
  cudaStream_t hs, os;
  CK(cudaStreamCreateWithFlags(&hs, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&os, cudaStreamNonBlocking));
  // BATCH copies of `bytes` each (distinct ranges), issued one by one or as one batch.
  const int BATCH = 64;
  char *dev_many, *pinned_many, *pinned_many_d;
  CK(cudaMalloc(&dev_many, bytes * BATCH));
  CK(cudaHostAlloc(&pinned_many, bytes * BATCH, cudaHostAllocMapped));
  CK(cudaHostGetDevicePointer(&pinned_many_d, pinned_many, 0));
  std::vector<CUdeviceptr> to_host(BATCH), from_dev(BATCH), to_dev(BATCH), from_host(BATCH);
  std::vector<size_t> sizes(BATCH, bytes);
  for (int i = 0; i < BATCH; i++) {
    to_host[i] = (CUdeviceptr)(pinned_many_d + i * bytes);
    from_dev[i] = (CUdeviceptr)(dev_many + i * bytes);
    to_dev[i] = from_dev[i];
    from_host[i] = to_host[i];
  }
  // `flags`: 0, or CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE (copy engines rather than SMs).
  auto batch = [&](std::vector<CUdeviceptr>& dst, std::vector<CUdeviceptr>& src, unsigned flags) {
#if CUDA_VERSION >= 13000
    CUmemcpyAttributes attr = {};
    attr.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
    attr.flags = flags;
    size_t idx = 0;
    CUresult r = cuMemcpyBatchAsync(dst.data(), src.data(), sizes.data(), BATCH, &attr, &idx, 1, (CUstream)os);
    if (r != CUDA_SUCCESS) { fprintf(stderr, "cuMemcpyBatchAsync: %d\n", (int)r); exit(1); }
#else
    (void)dst; (void)src; (void)flags;
    fprintf(stderr, "batch copies need CUDA 13 headers\n");
    exit(1);
#endif
  };

  struct Op {
    const char* name;
    std::function<void()> issue;
  };
  std::vector<Op> ops = {
      {"memcpy DtoH into pinned host memory", [&] { CK(cudaMemcpyAsync(pinned, dev_a, bytes, cudaMemcpyDeviceToHost, os)); }},
      {"memcpy DtoD into pinned memory's device address", [&] { CK(cudaMemcpyAsync(pinned_d, dev_a, bytes, cudaMemcpyDeviceToDevice, os)); }},
      {"memcpy HtoD from pageable host memory", [&] { CK(cudaMemcpyAsync(dev_a, pageable.data(), bytes, cudaMemcpyHostToDevice, os)); }},
      {"memcpy HtoD from pinned host memory", [&] { CK(cudaMemcpyAsync(dev_a, pinned, bytes, cudaMemcpyHostToDevice, os)); }},
      {"memcpy DtoH into pageable host memory", [&] { CK(cudaMemcpyAsync(pageable.data(), dev_a, bytes, cudaMemcpyDeviceToHost, os)); }},
      {"memcpy DtoD within the device", [&] { CK(cudaMemcpyAsync(dev_b, dev_a, bytes, cudaMemcpyDeviceToDevice, os)); }},
      {"memset of device memory", [&] { CK(cudaMemsetAsync(dev_b, 0, bytes, os)); }},
      {"64 memcpy DtoD into pinned memory, one by one", [&] {
         for (int i = 0; i < BATCH; i++)
           CK(cudaMemcpyAsync((void*)to_host[i], (void*)from_dev[i], bytes, cudaMemcpyDeviceToDevice, os));
       }},
      {"64 copies DtoD into pinned memory, one batch", [&] { batch(to_host, from_dev, 0); }},
      {"64 copies DtoD into pinned memory, one batch, CE", [&] { batch(to_host, from_dev, 1); }},
      {"64 memcpy HtoD from pinned memory, one by one", [&] {
         for (int i = 0; i < BATCH; i++)
           CK(cudaMemcpyAsync((void*)to_dev[i], pinned_many + i * bytes, bytes, cudaMemcpyHostToDevice, os));
       }},
      {"64 copies from pinned memory to device, one batch", [&] { batch(to_dev, from_host, 0); }},
      {"64 copies from pinned memory to device, one batch, CE", [&] { batch(to_dev, from_host, 1); }},
      {"cuStreamWriteValue64", [&] {
         CUresult r = cuStreamWriteValue64((CUstream)os, (CUdeviceptr)dev_b, 7, 0);
         if (r != CUDA_SUCCESS) { fprintf(stderr, "cuStreamWriteValue64: %d\n", (int)r); exit(1); }
       }},
  };
  for (auto& op : ops) {
    *stop_h = 0;
    *started_h = 0;
    unsigned long long now_ns = 0;
    {
      // The GPU's global timer, read by a tiny kernel (the host has no view of it).
      unsigned long long* t_d;
      CK(cudaMalloc(&t_d, 8));
      read_timer<<<1, 1, 0, hs>>>(t_d);
      CK(cudaMemcpyAsync(&now_ns, t_d, 8, cudaMemcpyDeviceToHost, hs));
      CK(cudaStreamSynchronize(hs));
      CK(cudaFree(t_d));
    }
    hold<<<ctas, 1024, 0, hs>>>(stop_d, started_d, mode, now_ns + (HOLD_MS + 200) * 1000000ull);
    CK(cudaGetLastError());
    auto t0 = std::chrono::steady_clock::now();
    while (*(volatile int*)started_h < ctas) {
      if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(5)) {
        printf("the hold kernel did not become resident (%d of %d CTAs)\n", *(volatile int*)started_h, ctas);
        return 1;
      }
    }
    std::atomic<long> done_us{-1};
    auto start = std::chrono::steady_clock::now();
    std::thread t([&] {
      // The primary context current on this thread too: the runtime's calls make it so by
      // themselves, the driver's (the batch rows, cuStreamWriteValue64) do not, and without
      // it the batch failed with CUDA_ERROR_INVALID_VALUE (2026-12-07, H100).
      CK(cudaSetDevice(0));
      op.issue();
      CK(cudaStreamSynchronize(os));
      done_us = std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - start).count();
    });
    while (done_us < 0 && std::chrono::steady_clock::now() - start < std::chrono::milliseconds(HOLD_MS)) {
    }
    long held = done_us;
    __atomic_store_n(stop_h, 1, __ATOMIC_RELEASE);
    t.join();
    CK(cudaStreamSynchronize(hs));
    if (held >= 0) {
      printf("%-50s ran while the SMs were held: %ld us\n", op.name, held);
    } else {
      printf("%-50s WAITED for the SMs: not done after %d ms, done %ld us after the start once released\n", op.name,
             HOLD_MS, (long)done_us);
    }
  }
  return 0;
}
