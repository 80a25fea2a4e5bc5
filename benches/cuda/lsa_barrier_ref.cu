// Reference LSA barrier in CUDA C++, the same shape as ferrolink's `lsa_barrier_bench`:
// `n` virtual ranks on one GPU, one single-warp CTA per rank, each on its own non-blocking
// stream; rank `me`'s inbox row holds one word per peer (rows padded to 128 bytes). Per
// round: __syncthreads, thread p stores the new epoch into peer p's inbox word for `me`,
// thread p spins on its own inbox word for peer p, __syncthreads.
//
// Two forms, measured side by side with ferrolink's kernel in the same GPU run
// (scripts/gpu-run.sh compiles this with nvcc when nvcc is there):
//   classic:        st.release.gpu / ld.acquire.gpu polls (what most hand-written barriers do)
//   fence-acquire:  st.release.gpu / ld.relaxed.gpu polls, then one fence.acquire.gpu
//
// Build: nvcc -O3 -arch=sm_90 -o lsa_barrier_ref lsa_barrier_ref.cu
// Run:   ./lsa_barrier_ref [rounds]     (prints microseconds per round, slowest rank)
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_runtime.h>

#define CHECK(x)                                                                      \
  do {                                                                                \
    cudaError_t e_ = (x);                                                             \
    if (e_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

static constexpr int kRowWords = 32;  // 128-byte inbox row per barrier

__device__ __forceinline__ unsigned long long global_timer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void store_release_gpu(unsigned* p, unsigned v) {
  asm volatile("st.release.gpu.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ unsigned load_acquire_gpu(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ unsigned load_relaxed_gpu(const unsigned* p) {
  unsigned v;
  asm volatile("ld.relaxed.gpu.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void fence_acquire_gpu() { asm volatile("fence.acquire.gpu;" ::: "memory"); }

template <bool kFenceAcquire>
__global__ void barrier_kernel(unsigned* inboxes, size_t rank_stride_words, int me, int n, int warmup,
                               int rounds, unsigned long long* out_ns) {
  const int t = threadIdx.x;
  unsigned* my_row = inboxes + me * rank_stride_words + blockIdx.x * kRowWords;
  unsigned* peer_word = t < n ? inboxes + t * rank_stride_words + blockIdx.x * kRowWords + me : nullptr;
  unsigned epoch = 0;
  unsigned long long t0 = 0;
  for (int i = 0; i < warmup + rounds; ++i) {
    if (i == warmup) t0 = global_timer();
    __syncthreads();
    ++epoch;
    if (t < n) {
      store_release_gpu(peer_word, epoch);
      if (kFenceAcquire) {
        while (static_cast<int>(load_relaxed_gpu(my_row + t) - epoch) < 0) {
        }
        fence_acquire_gpu();
      } else {
        while (static_cast<int>(load_acquire_gpu(my_row + t) - epoch) < 0) {
        }
      }
    }
    __syncthreads();
  }
  if (t == 0) out_ns[blockIdx.x] = global_timer() - t0;
}

template <bool kFenceAcquire>
static double run(int n, int ctas, int rounds) {
  const size_t stride_words = static_cast<size_t>(ctas) * kRowWords;
  unsigned* inboxes;
  unsigned long long* out;
  CHECK(cudaMalloc(&inboxes, n * stride_words * sizeof(unsigned)));
  CHECK(cudaMemset(inboxes, 0, n * stride_words * sizeof(unsigned)));
  CHECK(cudaMalloc(&out, n * ctas * sizeof(unsigned long long)));
  CHECK(cudaDeviceSynchronize());
  std::vector<cudaStream_t> streams(n);
  for (auto& s : streams) CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (int r = 0; r < n; ++r) {
    barrier_kernel<kFenceAcquire><<<ctas, 32, 0, streams[r]>>>(inboxes, stride_words, r, n, rounds / 10, rounds,
                                                               out + r * ctas);
    CHECK(cudaGetLastError());
  }
  CHECK(cudaDeviceSynchronize());
  std::vector<unsigned long long> ns(n * ctas);
  CHECK(cudaMemcpy(ns.data(), out, ns.size() * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
  unsigned long long worst = 0;
  for (auto v : ns) worst = v > worst ? v : worst;
  for (auto& s : streams) CHECK(cudaStreamDestroy(s));
  CHECK(cudaFree(inboxes));
  CHECK(cudaFree(out));
  return static_cast<double>(worst) / rounds / 1e3;
}

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 20000;
  if (rounds < 1) {
    std::fprintf(stderr, "rounds must be a positive number, got %s\n", argv[1]);
    return 2;
  }
  std::printf("== CUDA C++ reference LSA barrier: microseconds per round (slowest CTA), %d rounds, CTAs of 32 threads\n",
              rounds);
  std::printf("%6s %10s %14s %16s\n", "ranks", "CTAs/rank", "classic", "fence-acquire");
  for (int n : {2, 4, 8}) {
    for (int ctas : {1, 8, 32}) {
      const double classic = run<false>(n, ctas, rounds);
      const double fenced = run<true>(n, ctas, rounds);
      std::printf("%6d %10d %11.3f us %13.3f us\n", n, ctas, classic, fenced);
    }
  }
  return 0;
}
