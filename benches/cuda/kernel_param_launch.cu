// Build and run on the GPU machine: nvcc -O3 -arch=sm_90 -o /tmp/p kernel_param_launch.cu && /tmp/p
// How the size of a kernel's parameter changes back-to-back launch cost on this GPU
// (ferrolink issue 12: the shared launch of a GPU group carries a 6928-byte parameter), and
// the host's time in the launch call itself (what a launcher thread spends per launch).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>
#include <cuda_runtime.h>
template <int N> struct P { unsigned long long w[N / 8]; };
template <int N> __global__ void k(P<N> p, unsigned long long* out) {
  // Each CTA reads a 432-byte slice of the parameter (as coll_gpu_group_launch reads its entry).
  constexpr int words = N / 8;
  int base = (blockIdx.x * 54) % (words > 54 ? words - 54 : 1);
  unsigned long long s = 0;
  for (int i = threadIdx.x; i < 54 && base + i < words; i += blockDim.x) s += p.w[base + i];
  if (s == 12345) out[blockIdx.x] = s;
}
template <int N> void run(int ctas) {
  P<N> p = {};
  unsigned long long* out; cudaMalloc(&out, 4096);
  cudaStream_t st; cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  for (int i = 0; i < 200; i++) k<N><<<ctas, 256, 0, st>>>(p, out);
  cudaStreamSynchronize(st);
  const int iters = 2000;
  cudaEventRecord(a, st);
  for (int i = 0; i < iters; i++) { p.w[0] = i; k<N><<<ctas, 256, 0, st>>>(p, out); }
  cudaEventRecord(b, st);
  cudaEventSynchronize(b);
  float ms; cudaEventElapsedTime(&ms, a, b);
  // The host's time per launch call: each of 256 launches timed alone (fewer than the
  // stream's queue holds, so no call waits for room), after the GPU is idle.
  cudaStreamSynchronize(st);
  std::vector<double> host;
  for (int i = 0; i < 256; i++) {
    p.w[0] = i;
    auto t0 = std::chrono::steady_clock::now();
    k<N><<<ctas, 256, 0, st>>>(p, out);
    host.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  cudaStreamSynchronize(st);
  std::sort(host.begin(), host.end());
  printf("param %6d bytes, %3d CTAs: %.2f us per launch (GPU, back to back); host call median %.2f us, p90 %.2f us\n",
         N, ctas, ms * 1000 / iters, host[host.size() / 2], host[host.size() * 9 / 10]);
  cudaFree(out);
}
int main() {
  for (int ctas : {8, 16}) {
    run<64>(ctas); run<1024>(ctas); run<3136>(ctas); run<3456>(ctas); run<4096>(ctas); run<4608>(ctas); run<6928>(ctas);
    run<7712>(ctas); run<16384>(ctas);
  }
  printf("%s\n", cudaGetErrorString(cudaGetLastError()));
}
