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
// Run:   ./copies_under_held_sms [bytes]     (one GPU)
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

__global__ void hold(volatile int* stop, int* started) {
  if (threadIdx.x == 0) atomicAdd(started, 1);
  while (*stop == 0) {
  }
}

int main(int argc, char** argv) {
  size_t bytes = argc > 1 ? strtoull(argv[1], nullptr, 0) : 4096;
  CK(cudaSetDevice(0));
  int sms = 0, per_sm = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, hold, 1024, 0));
  int ctas = sms * per_sm;
  printf("SMs %d, hold CTAs %d (%d of 1024 threads per SM), %zu bytes per operation\n", sms, ctas, per_sm, bytes);

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
      {"cuStreamWriteValue64", [&] {
         CUresult r = cuStreamWriteValue64((CUstream)os, (CUdeviceptr)dev_b, 7, 0);
         if (r != CUDA_SUCCESS) { fprintf(stderr, "cuStreamWriteValue64: %d\n", (int)r); exit(1); }
       }},
  };
  for (auto& op : ops) {
    *stop_h = 0;
    *started_h = 0;
    hold<<<ctas, 1024, 0, hs>>>(stop_d, started_d);
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
