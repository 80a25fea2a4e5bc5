// NCCL collective baseline in the form of nccl-tests: the figures `ferrolink-perf <coll>` is
// compared with, measured with NCCL in the same GPU run. One process drives every GPU it uses
// (ncclCommInitAll, one non-blocking stream per GPU, ncclGroupStart/End around the per-GPU
// calls), sweeps sizes, and prints one nccl-tests style line per size:
//   size count type redop root | out-of-place time algbw busbw #wrong | in-place ...
//
// Collectives: all_reduce, all_gather, reduce_scatter, broadcast (root 0), reduce (root 0),
// all_to_all (ncclSend/ncclRecv to every peer in one group), sendrecv (rank r sends to r+1 and
// receives from r-1). all_to_all and sendrecv have no in-place column.
//
// Sizes are total bytes as nccl-tests counts them: all_reduce/broadcast/reduce/sendrecv move
// count*size; all_gather receives (resp. reduce_scatter sends) `bytes`, count per rank =
// bytes/size/nranks; all_to_all sends `bytes` per rank, bytes/size/nranks to each peer.
// Sizes whose per-rank count rounds down to 0 are skipped.
// Time: wall clock around `iters` back-to-back group launches after `warmup` ones, all
// streams synchronized before and after (as nccl-tests), divided by `iters`.
// algbw = bytes/time; busbw = algbw * (all_reduce 2(n-1)/n; all_gather, reduce_scatter,
// all_to_all (n-1)/n; broadcast, reduce, sendrecv 1), as in nccl-tests' PERFORMANCE.md.
// #wrong: with -c (default 1) each size is first run once on known small-integer data and
// the elements off the expected value are counted on the GPU; -c 0 prints N/A. The exit
// status is 1 when any element was wrong.
//
// NCCL_NVLS_ENABLE is left to the caller (the GPU run sets it to 0); no multicast is used here.
//
// Build (on the GPU machine, NCCL from the nvidia-nccl wheel):
//   NV=$(python3 -c "import nvidia.nccl as m; print(list(m.__path__)[0])")
//   nvcc -O3 -std=c++17 -arch=sm_90 -I$NV/include nccl_coll_ref.cu -o nccl_coll_ref -L$NV/lib -l:libnccl.so.2
// Run (one line; -g ngpus defaults to every visible GPU, -c 0 skips the check):
//   LD_LIBRARY_PATH=$NV/lib:/usr/local/nvidia/lib64 NCCL_NVLS_ENABLE=0 ./nccl_coll_ref all_reduce -b 8 -e 256M -f 2 -d bf16 -o sum -n 20 -w 5
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <chrono>
#include <string>
#include <vector>
#include <cuda_runtime.h>
#include <nccl.h>

#define CUDA_CHECK(x)                                                                   \
  do {                                                                                  \
    cudaError_t e_ = (x);                                                               \
    if (e_ != cudaSuccess) {                                                            \
      std::fprintf(stderr, "%s:%d: CUDA error: %s\n", __FILE__, __LINE__,               \
                   cudaGetErrorString(e_));                                             \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)
#define NCCL_CHECK(x)                                                                   \
  do {                                                                                  \
    ncclResult_t r_ = (x);                                                              \
    if (r_ != ncclSuccess) {                                                            \
      std::fprintf(stderr, "%s:%d: NCCL error: %s\n", __FILE__, __LINE__,               \
                   ncclGetErrorString(r_));                                             \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

enum Coll { kAllReduce, kAllGather, kReduceScatter, kBroadcast, kReduce, kAllToAll, kSendRecv };
static const char* const kCollNames[] = {"all_reduce", "all_gather", "reduce_scatter", "broadcast",
                                         "reduce",     "all_to_all", "sendrecv"};

// ---- data for the simple check: small integers, exact in every type ----------------------
// What one launch on one rank sees: the collective, element type and op, and the count that
// was passed to NCCL (per peer / per rank for all_gather, reduce_scatter, all_to_all).
struct Shape {
  int coll, dtype, op, nranks, rank, root;
  size_t count;
};

// Element i of rank r's send buffer: 1..5, or 1..2 under prod (so 8 ranks stay below 2^8).
__host__ __device__ inline double value(int op, int rank, size_t i) {
  return op == ncclProd ? double(1 + (size_t(rank) + i) % 2) : double(1 + (size_t(rank) * 3 + i) % 5);
}

__host__ __device__ inline double reduced(const Shape& s, size_t i) {
  double acc = value(s.op, 0, i);
  for (int k = 1; k < s.nranks; ++k) {
    double x = value(s.op, k, i);
    switch (s.op) {
      case ncclProd: acc *= x; break;
      case ncclMin: acc = fmin(acc, x); break;
      case ncclMax: acc = fmax(acc, x); break;
      default: acc += x; break;  // sum, avg
    }
  }
  bool is_int = s.dtype == ncclInt32 || s.dtype == ncclInt64 || s.dtype == ncclUint8;
  if (s.op == ncclAvg) acc = is_int ? floor(acc / s.nranks) : acc / s.nranks;
  if (s.dtype == ncclUint8) acc = fmod(acc, 256.0);
  return acc;
}

// Expected element i of the output buffer of rank s.rank.
__host__ __device__ inline double expected(const Shape& s, size_t i) {
  switch (s.coll) {
    case kAllReduce:
    case kReduce: return reduced(s, i);
    case kReduceScatter: return reduced(s, size_t(s.rank) * s.count + i);
    case kBroadcast: return value(s.op, s.root, i);
    case kAllGather: return value(s.op, int(i / s.count), i % s.count);
    case kAllToAll: return value(s.op, int(i / s.count), size_t(s.rank) * s.count + i % s.count);
    default: return value(s.op, (s.rank + s.nranks - 1) % s.nranks, i);  // sendrecv
  }
}

__host__ __device__ inline uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
__host__ __device__ inline float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
// float -> IEEE half bits; exact for the small integers stored here (no rounding needed).
__host__ __device__ inline uint16_t to_half(float f) {
  uint32_t u = float_bits(f);
  uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  if ((u & 0x7fffffffu) == 0) return sign;
  int e = int((u >> 23) & 0xffu) - 127 + 15;
  if (e >= 31) return uint16_t(sign | 0x7c00u);
  if (e <= 0) return sign;  // not reached by the stored values
  return uint16_t(sign | (uint32_t(e) << 10) | ((u >> 13) & 0x3ffu));
}
__host__ __device__ inline double from_half(uint16_t h) {
  int e = (h >> 10) & 0x1f;
  int m = h & 0x3ff;
  double mag = e == 0 ? ldexp(double(m), -24)
             : e == 31 ? double(bits_float(m ? 0x7fc00000u : 0x7f800000u))  // NaN / inf
                       : ldexp(double(1024 + m), e - 25);
  return (h & 0x8000) ? -mag : mag;
}

__host__ __device__ inline void store(void* p, size_t i, int dtype, double v) {
  switch (dtype) {
    case ncclFloat32: static_cast<float*>(p)[i] = float(v); break;
    case ncclFloat64: static_cast<double*>(p)[i] = v; break;
    case ncclFloat16: static_cast<uint16_t*>(p)[i] = to_half(float(v)); break;
    case ncclBfloat16: static_cast<uint16_t*>(p)[i] = uint16_t(float_bits(float(v)) >> 16); break;
    case ncclInt32: static_cast<int32_t*>(p)[i] = int32_t(v); break;
    case ncclInt64: static_cast<int64_t*>(p)[i] = int64_t(v); break;
    default: static_cast<uint8_t*>(p)[i] = uint8_t(v); break;  // uint8
  }
}
__host__ __device__ inline double load(const void* p, size_t i, int dtype) {
  switch (dtype) {
    case ncclFloat32: return static_cast<const float*>(p)[i];
    case ncclFloat64: return static_cast<const double*>(p)[i];
    case ncclFloat16: return from_half(static_cast<const uint16_t*>(p)[i]);
    case ncclBfloat16: return bits_float(uint32_t(static_cast<const uint16_t*>(p)[i]) << 16);
    case ncclInt32: return double(static_cast<const int32_t*>(p)[i]);
    case ncclInt64: return double(static_cast<const int64_t*>(p)[i]);
    default: return double(static_cast<const uint8_t*>(p)[i]);
  }
}

__global__ void fill_kernel(void* p, size_t n, Shape s) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    store(p, i, s.dtype, value(s.op, s.rank, i));
}
__global__ void check_kernel(const void* p, size_t n, Shape s, double tol, unsigned long long* wrong) {
  unsigned long long bad = 0;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    double want = expected(s, i), got = load(p, i, s.dtype);
    if (!(fabs(got - want) <= tol * fmax(1.0, fabs(want)))) ++bad;  // NaN counts as wrong
  }
  if (bad) atomicAdd(wrong, bad);
}

// ---- options ------------------------------------------------------------------------------
static size_t parse_bytes(const char* s) {
  char* end = nullptr;
  double v = std::strtod(s, &end);
  switch (*end) {
    case 'K': case 'k': v *= 1024.0; break;
    case 'M': case 'm': v *= 1024.0 * 1024.0; break;
    case 'G': case 'g': v *= 1024.0 * 1024.0 * 1024.0; break;
    default: break;
  }
  return size_t(v);
}
struct Type { const char* names[4]; ncclDataType_t dt; size_t size; };
static const Type kTypes[] = {
    {{"float", "f32", "float32", nullptr}, ncclFloat32, 4},
    {{"half", "f16", "float16", nullptr}, ncclFloat16, 2},
    {{"bfloat16", "bf16", nullptr, nullptr}, ncclBfloat16, 2},
    {{"double", "f64", "float64", nullptr}, ncclFloat64, 8},
    {{"int32", "i32", "int", nullptr}, ncclInt32, 4},
    {{"int64", "i64", nullptr, nullptr}, ncclInt64, 8},
    {{"uint8", "u8", nullptr, nullptr}, ncclUint8, 1},
};
static const char* const kOpNames[] = {"sum", "prod", "max", "min", "avg"};  // ncclRedOp_t order
static const ncclRedOp_t kOps[] = {ncclSum, ncclProd, ncclMax, ncclMin, ncclAvg};

[[noreturn]] static void usage(const char* why) {
  std::fprintf(stderr,
               "nccl_coll_ref: %s\nusage: nccl_coll_ref <all_reduce|all_gather|reduce_scatter|"
               "broadcast|reduce|all_to_all|sendrecv> [-b minbytes] [-e maxbytes] [-f factor]\n"
               "       [-d float|half|bfloat16|double|int32|int64|uint8] [-o sum|prod|min|max|avg]\n"
               "       [-n iters] [-w warmup] [-g ngpus] [-c check]\n",
               why);
  std::exit(1);
}

// ---- the benchmark ------------------------------------------------------------------------
struct Bench {
  Coll coll;
  ncclDataType_t dt;
  ncclRedOp_t op;
  size_t elt;
  int n, root = 0;
  std::vector<int> devs;
  std::vector<ncclComm_t> comms;
  std::vector<cudaStream_t> streams;
  std::vector<char*> send, recv;
  std::vector<unsigned long long*> wrong;

  bool has_inplace() const { return coll != kAllToAll && coll != kSendRecv; }
  // Count passed to NCCL for a size in bytes (per rank / per peer where nccl-tests says so).
  size_t count_for(size_t bytes) const {
    bool per_rank = coll == kAllGather || coll == kReduceScatter || coll == kAllToAll;
    return per_rank ? bytes / elt / n : bytes / elt;
  }
  size_t send_count(size_t c) const { return coll == kReduceScatter || coll == kAllToAll ? c * n : c; }
  size_t recv_count(size_t c) const { return coll == kAllGather || coll == kAllToAll ? c * n : c; }
  size_t alg_bytes(size_t c) const { return std::max(send_count(c), recv_count(c)) * elt; }
  double bus_factor() const {
    switch (coll) {
      case kAllReduce: return 2.0 * (n - 1) / n;
      case kAllGather: case kReduceScatter: case kAllToAll: return double(n - 1) / n;
      default: return 1.0;
    }
  }
  // Send and receive pointers of rank r; in place as nccl-tests places them.
  void ptrs(int r, bool inplace, size_t c, char** sp, char** rp) const {
    *sp = send[r];
    *rp = recv[r];
    if (!inplace) return;
    if (coll == kAllGather) *sp = recv[r] + size_t(r) * c * elt;
    else if (coll == kReduceScatter) *rp = send[r] + size_t(r) * c * elt;
    else *rp = send[r];
  }
  void launch(bool inplace, size_t c) const {
    NCCL_CHECK(ncclGroupStart());
    for (int r = 0; r < n; ++r) {
      char *s, *d;
      ptrs(r, inplace, c, &s, &d);
      ncclComm_t comm = comms[r];
      cudaStream_t st = streams[r];
      switch (coll) {
        case kAllReduce: NCCL_CHECK(ncclAllReduce(s, d, c, dt, op, comm, st)); break;
        case kAllGather: NCCL_CHECK(ncclAllGather(s, d, c, dt, comm, st)); break;
        case kReduceScatter: NCCL_CHECK(ncclReduceScatter(s, d, c, dt, op, comm, st)); break;
        case kBroadcast: NCCL_CHECK(ncclBroadcast(s, d, c, dt, root, comm, st)); break;
        case kReduce: NCCL_CHECK(ncclReduce(s, d, c, dt, op, root, comm, st)); break;
        case kAllToAll:
          for (int p = 0; p < n; ++p) {
            NCCL_CHECK(ncclSend(s + size_t(p) * c * elt, c, dt, p, comm, st));
            NCCL_CHECK(ncclRecv(d + size_t(p) * c * elt, c, dt, p, comm, st));
          }
          break;
        case kSendRecv:
          NCCL_CHECK(ncclSend(s, c, dt, (r + 1) % n, comm, st));
          NCCL_CHECK(ncclRecv(d, c, dt, (r + n - 1) % n, comm, st));
          break;
      }
    }
    NCCL_CHECK(ncclGroupEnd());
  }
  void sync() const {
    for (int r = 0; r < n; ++r) {
      CUDA_CHECK(cudaSetDevice(devs[r]));
      CUDA_CHECK(cudaStreamSynchronize(streams[r]));
    }
  }
  Shape shape(int r, size_t c) const { return Shape{int(coll), int(dt), int(op), n, r, root, c}; }
  // Fill the inputs, run once, count the outputs off the expected values (all ranks).
  unsigned long long check(bool inplace, size_t c) const {
    for (int r = 0; r < n; ++r) {
      char *s, *d;
      ptrs(r, inplace, c, &s, &d);
      CUDA_CHECK(cudaSetDevice(devs[r]));
      CUDA_CHECK(cudaMemsetAsync(d, 0xff, recv_count(c) * elt, streams[r]));
      CUDA_CHECK(cudaMemsetAsync(wrong[r], 0, sizeof(unsigned long long), streams[r]));
      fill_kernel<<<1024, 256, 0, streams[r]>>>(s, send_count(c), shape(r, c));
      CUDA_CHECK(cudaGetLastError());
    }
    launch(inplace, c);
    double tol = dt == ncclBfloat16 ? 2e-2 : dt == ncclFloat16 ? 5e-3 : dt == ncclFloat32 ? 1e-5 : 1e-12;
    unsigned long long total = 0;
    for (int r = 0; r < n; ++r) {
      if (coll == kReduce && r != root) continue;  // only the root's output is defined
      char *s, *d;
      ptrs(r, inplace, c, &s, &d);
      CUDA_CHECK(cudaSetDevice(devs[r]));
      check_kernel<<<1024, 256, 0, streams[r]>>>(d, recv_count(c), shape(r, c), tol, wrong[r]);
      CUDA_CHECK(cudaGetLastError());
      unsigned long long w = 0;
      CUDA_CHECK(cudaMemcpyAsync(&w, wrong[r], sizeof w, cudaMemcpyDeviceToHost, streams[r]));
      CUDA_CHECK(cudaStreamSynchronize(streams[r]));
      total += w;
    }
    sync();
    return total;
  }
  // Microseconds per operation.
  double time_us(bool inplace, size_t c, int iters, int warmup) const {
    for (int i = 0; i < warmup; ++i) launch(inplace, c);
    sync();
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) launch(inplace, c);
    sync();
    auto t1 = std::chrono::steady_clock::now();
    return std::chrono::duration<double, std::micro>(t1 - t0).count() / iters;
  }
};

static void print_time(double us) {
  if (us >= 10000.0) std::printf("  %8.0f", us);
  else if (us >= 100.0) std::printf("  %8.1f", us);
  else std::printf("  %8.2f", us);
}

int main(int argc, char** argv) {
  if (argc < 2 || argv[1][0] == '-') usage("the first argument names the collective");
  std::string name = argv[1];
  if (name.size() > 5 && name.compare(name.size() - 5, 5, "_perf") == 0) name.resize(name.size() - 5);
  int coll = -1;
  for (int i = 0; i < 7; ++i) {
    std::string k = kCollNames[i], bare;
    for (char ch : k) if (ch != '_') bare += ch;
    if (name == k || name == bare) coll = i;
  }
  if (coll < 0) usage("unknown collective");

  size_t minb = 32 * 1024 * 1024, maxb = minb;
  double factor = 2.0;
  int type = 0, opi = 0, iters = 20, warmup = 5, ngpus = -1, check = 1;
  for (int i = 2; i < argc; ++i) {
    const char* a = argv[i];
    if (a[0] != '-' || a[1] == 0) usage("bad argument");
    if (a[1] == 'h') usage("help");
    const char* v = a[2] ? a + 2 : (i + 1 < argc ? argv[++i] : nullptr);
    if (!v) usage("missing value");
    switch (a[1]) {
      case 'b': minb = parse_bytes(v); break;
      case 'e': maxb = parse_bytes(v); break;
      case 'f': factor = std::atof(v); break;
      case 'n': iters = std::atoi(v); break;
      case 'w': warmup = std::atoi(v); break;
      case 'g': ngpus = std::atoi(v); break;
      case 'c': check = std::atoi(v); break;
      case 'd': {
        type = -1;
        for (int t = 0; t < 7 && type < 0; ++t)
          for (const char* nm : kTypes[t].names)
            if (nm && std::strcmp(nm, v) == 0) type = t;
        if (type < 0) usage("unknown data type");
        break;
      }
      case 'o': {
        opi = -1;
        for (int o = 0; o < 5; ++o) if (std::strcmp(kOpNames[o], v) == 0) opi = o;
        if (opi < 0) usage("unknown reduction op");
        break;
      }
      default: usage("unknown option");
    }
  }
  if (iters < 1 || warmup < 0 || minb == 0 || maxb < minb) usage("bad -n/-w/-b/-e");

  int visible = 0;
  CUDA_CHECK(cudaGetDeviceCount(&visible));
  if (ngpus < 0) ngpus = visible;
  if (ngpus < 1 || ngpus > visible) usage("bad -g (more GPUs than visible?)");

  Bench b;
  b.coll = Coll(coll);
  b.dt = kTypes[type].dt;
  b.elt = kTypes[type].size;
  b.op = kOps[opi];
  b.n = ngpus;
  for (int r = 0; r < ngpus; ++r) b.devs.push_back(r);
  b.comms.resize(ngpus);
  NCCL_CHECK(ncclCommInitAll(b.comms.data(), ngpus, b.devs.data()));
  b.streams.resize(ngpus);
  b.send.resize(ngpus);
  b.recv.resize(ngpus);
  b.wrong.resize(ngpus);
  size_t buf = std::max(maxb, size_t(64));
  for (int r = 0; r < ngpus; ++r) {
    CUDA_CHECK(cudaSetDevice(b.devs[r]));
    CUDA_CHECK(cudaStreamCreateWithFlags(&b.streams[r], cudaStreamNonBlocking));
    CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&b.send[r]), buf));
    CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&b.recv[r]), buf));
    CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&b.wrong[r]), sizeof(unsigned long long)));
  }

  int version = 0;
  NCCL_CHECK(ncclGetVersion(&version));
  bool reduces = b.coll == kAllReduce || b.coll == kReduceScatter || b.coll == kReduce;
  bool rooted = b.coll == kBroadcast || b.coll == kReduce;
  std::printf("# nccl_coll_ref %s: NCCL %d, %d GPUs, %s, op %s, iters %d, warmup %d, check %d\n",
              kCollNames[coll], version, ngpus, kTypes[type].names[0], reduces ? kOpNames[opi] : "none",
              iters, warmup, check);
  for (int r = 0; r < ngpus; ++r) {
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, b.devs[r]));
    std::printf("#  rank %d: device %d [%04x:%02x:%02x] %s\n", r, b.devs[r], prop.pciDomainID,
                prop.pciBusID, prop.pciDeviceID, prop.name);
  }
  std::printf("#\n#%74s%s\n", "out-of-place", b.has_inplace() ? "                        in-place" : "");
  std::printf("#       size         count      type   redop    root      time   algbw   busbw  #wrong"
              "      time   algbw   busbw  #wrong\n");
  std::printf("#        (B)    (elements)                                 (us)  (GB/s)  (GB/s)        "
              "      (us)  (GB/s)  (GB/s)        \n");

  double bus_sum = 0;
  int bus_n = 0;
  unsigned long long wrong_total = 0;
  for (size_t bytes = minb; bytes <= maxb;) {
    size_t c = b.count_for(bytes);
    if (c > 0) {
      size_t ab = b.alg_bytes(c);
      std::printf("%12zu  %12zu  %8s  %6s  %6d", ab, ab / b.elt, kTypes[type].names[0],
                  reduces ? kOpNames[opi] : "none", rooted ? b.root : -1);
      for (int ip = 0; ip < (b.has_inplace() ? 2 : 1); ++ip) {
        unsigned long long w = check ? b.check(ip == 1, c) : 0;
        double us = b.time_us(ip == 1, c, iters, warmup);
        double alg = double(ab) / 1e3 / us;  // bytes/us/1e3 = GB/s
        print_time(us);
        std::printf("  %6.2f  %6.2f", alg, alg * b.bus_factor());
        if (check) std::printf("  %6llu", w);
        else std::printf("  %6s", "N/A");
        bus_sum += alg * b.bus_factor();
        ++bus_n;
        wrong_total += w;
      }
      std::printf("\n");
      std::fflush(stdout);
    }
    size_t next = size_t(double(bytes) * factor);
    if (next <= bytes) break;  // factor <= 1: one size only
    bytes = next;
  }
  std::printf("# Out of bounds values : %llu %s\n", wrong_total, check ? (wrong_total ? "FAILED" : "OK") : "(not checked)");
  std::printf("# Avg bus bandwidth    : %g\n#\n", bus_n ? bus_sum / bus_n : 0.0);

  for (int r = 0; r < ngpus; ++r) {
    CUDA_CHECK(cudaSetDevice(b.devs[r]));
    CUDA_CHECK(cudaFree(b.send[r]));
    CUDA_CHECK(cudaFree(b.recv[r]));
    CUDA_CHECK(cudaFree(b.wrong[r]));
    CUDA_CHECK(cudaStreamDestroy(b.streams[r]));
    NCCL_CHECK(ncclCommDestroy(b.comms[r]));
  }
  return wrong_total ? 1 : 0;
}
