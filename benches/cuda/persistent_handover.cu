// Build and run on the GPU machine: nvcc -O3 -arch=sm_90 -o /tmp/h persistent_handover.cu -lcuda && /tmp/h
// What handing an operation to a persistent kernel costs per operation (ferrolink issue 12's
// persistent mode: a rank alone on its GPU writes its 432-byte entry into a ring slot in
// host-mapped memory, and its stream hands the operation over). A kernel of 1 or 16 CTAs serves
// N operations: thread 0 of each CTA waits until the sequence word shows the operation (and
// the previous one is complete), the CTA reads the entry (27 threads, 16 bytes each, at once)
// into shared memory, and the last CTA done publishes the operation's number in `completed`.
// The host, per operation, writes the entry and then queues, by mode:
//   copy   the driver's copy of the slot into a device ring (cuMemcpyDtoDAsync from the
//          mapped slot: what ferrolink queues now), then a cuStreamBatchMemOp writing `seq`;
//          the kernel reads the device slot;
//   mapped only the batch writing `seq`; the kernel reads the entry from the mapped slot;
//   none   only the batch writing `seq`; the kernel reads no entry (the floor).
// With `wait` the same batch also waits for `completed >= i - 8` (ferrolink's PIPELINE of a
// rank alone on its GPU). Prints µs per operation (from an event on the handing stream before
// the first hand-over to one after the kernel, which returns after operation N) and the
// host's µs per operation queued.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cuda.h>
#include <cuda_runtime.h>

constexpr int ENTRY = 432;
constexpr int CHUNKS = ENTRY / 16;
constexpr int N = 2000;
constexpr int PIPELINE = 8;

struct Sync {
  unsigned long long seq;
  unsigned long long pad0[15];
  unsigned long long completed;
  unsigned long long pad1[15];
  unsigned long long done;
};

__device__ unsigned long long load_sys(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ unsigned long long load_gpu(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__global__ void serve(Sync* sync, const uint4* ring, int read, unsigned long long* out) {
  __shared__ uint4 entry[CHUNKS];
  unsigned long long acc = 0;
  for (unsigned long long next = 1; next <= N; next++) {
    if (threadIdx.x == 0) {
      while (load_sys(&sync->seq) < next || (next > 1 && load_gpu(&sync->completed) + 1 < next)) {
        __nanosleep(64);
      }
      asm volatile("fence.acq_rel.sys;" ::: "memory");
    }
    __syncthreads();
    if (read && threadIdx.x < CHUNKS) {
      // One 16-byte volatile load per thread (as ferrolink's `arch::load_v4_volatile`).
      const uint4* src = ring + (size_t)next * CHUNKS + threadIdx.x;
      uint4 v;
      asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                   : "l"(src)
                   : "memory");
      entry[threadIdx.x] = v;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      acc += entry[0].x + entry[CHUNKS - 1].w;
      unsigned long long before;
      asm volatile("atom.acq_rel.gpu.global.add.u64 %0, [%1], 1;" : "=l"(before) : "l"(&sync->done) : "memory");
      if (before + 1 == gridDim.x) {
        asm volatile("st.relaxed.gpu.global.u64 [%0], 0;" ::"l"(&sync->done) : "memory");
        asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(&sync->completed), "l"(next) : "memory");
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) out[blockIdx.x] = acc;
}

#define CK(x) do { cudaError_t err_ = (x); if (err_ != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(err_)); exit(1); } } while (0)
#define CKD(x) do { CUresult err_ = (x); if (err_ != CUDA_SUCCESS) { printf("%s: CUresult %d\n", #x, (int)err_); exit(1); } } while (0)

int main() {
  const size_t ring_bytes = (size_t)(N + 1) * ENTRY;
  unsigned char* host;
  CK(cudaHostAlloc((void**)&host, ring_bytes, cudaHostAllocMapped));
  void* mapped;
  CK(cudaHostGetDevicePointer(&mapped, host, 0));
  unsigned char* dev;
  CK(cudaMalloc((void**)&dev, ring_bytes));
  Sync* sync;
  CK(cudaMalloc((void**)&sync, sizeof(Sync)));
  unsigned long long* out;
  CK(cudaMalloc((void**)&out, 4096));
  cudaStream_t st, ks;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&ks, cudaStreamNonBlocking));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  const char* modes[] = {"copy", "mapped", "none"};
  const int ctas_list[] = {1, 16};
  for (int round = 0; round < 2; round++) {
    for (int ctas : ctas_list) {
      for (int wait = 1; wait >= 0; wait--) {
        for (int m = 0; m < 3; m++) {
          CK(cudaMemset(sync, 0, sizeof(Sync)));
          CK(cudaDeviceSynchronize());
          const uint4* ring = m == 0 ? (const uint4*)dev : (const uint4*)mapped;
          serve<<<ctas, 256, 0, ks>>>(sync, ring, m != 2, out);
          CK(cudaGetLastError());
          // b ends with the kernel, after its last operation; a starts the hand-overs.
          CK(cudaEventRecord(b, ks));
          CK(cudaEventRecord(a, st));
          auto t0 = std::chrono::steady_clock::now();
          for (int i = 1; i <= N; i++) {
            unsigned char* slot = host + (size_t)i * ENTRY;
            memset(slot, i & 0xff, ENTRY);
            if (m == 0) {
              CKD(cuMemcpyDtoDAsync((CUdeviceptr)(dev + (size_t)i * ENTRY), (CUdeviceptr)((unsigned char*)mapped + (size_t)i * ENTRY),
                                    ENTRY, st));
            }
            CUstreamBatchMemOpParams p[2];
            memset(p, 0, sizeof(p));
            p[0].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
            p[0].writeValue.address = (CUdeviceptr)&sync->seq;
            p[0].writeValue.value64 = i;
            int ops = 1;
            if (wait && i > PIPELINE) {
              p[1].waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_64;
              p[1].waitValue.address = (CUdeviceptr)&sync->completed;
              p[1].waitValue.value64 = i - PIPELINE;
              p[1].waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
              ops = 2;
            }
            CKD(cuStreamBatchMemOp(st, ops, p, 0));
          }
          auto t1 = std::chrono::steady_clock::now();
          CK(cudaEventSynchronize(b));
          CK(cudaStreamSynchronize(st));
          float ms;
          CK(cudaEventElapsedTime(&ms, a, b));
          double host_us = std::chrono::duration<double, std::micro>(t1 - t0).count() / N;
          printf("round %d ctas %2d wait %d %-6s: %7.2f us per operation on the GPU, host %6.2f us queued per operation\n",
                 round, ctas, wait, modes[m], ms * 1000.0 / N, host_us);
        }
      }
    }
  }
  CK(cudaGetLastError());
  printf("ok\n");
}
