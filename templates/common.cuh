// lum/templates/common.cuh — shared device helpers, pasted verbatim at the top of every generated
// CUDA module (NVRTC gets no include path). Needs no CUDA header: NVRTC 13 only offers cuda_fp16.h /
// cuda_bf16.h after extracting them to disk (nvrtcInstallBundledHeaders + -I), so 16-bit floats are
// stored as raw 16-bit words here and converted by the functions below, bit-exactly
// (round-to-nearest-even, as numpy / ml_dtypes; NaNs stay NaN, payload bits may differ).
//
// The conversions are LUM_HD (host+device) plain C++ so the test suite can also compile this file
// with a host C++ compiler and check them exhaustively against numpy/ml_dtypes. On the device they
// use single PTX cvt instructions (documented RNE); define LUM_SOFT_CVT to force the portable
// integer versions everywhere.
#ifndef LUM_COMMON_CUH
#define LUM_COMMON_CUH

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define LUM_HD __host__ __device__ __forceinline__
#define LUM_D __device__ __forceinline__
#else
#include <cstring>
#define LUM_HD inline
#define LUM_D inline
#endif

typedef unsigned short lum_f16;   // IEEE binary16, raw bits
typedef unsigned short lum_bf16;  // bfloat16, raw bits (upper half of a binary32)
typedef unsigned char lum_bool;   // 0 or 1, one byte (numpy bool)

// ------------------------------------------------------------------------------ bit casts
LUM_HD unsigned int lum_f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  unsigned int u; std::memcpy(&u, &f, 4); return u;
#endif
}
LUM_HD float lum_bits_f32(unsigned int u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f; std::memcpy(&f, &u, 4); return f;
#endif
}
#define LUM_INF_F32 (lum_bits_f32(0x7f800000u))
#define LUM_LLONG_MIN (-9223372036854775807LL - 1LL)

// ------------------------------------------------------------------------------ f16 / bf16, portable
LUM_HD float lum_soft_f16_to_f32(unsigned short h) {
  const unsigned int sign = (unsigned int)(h & 0x8000u) << 16;
  const unsigned int exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in binary32
    const float v = (float)man * 5.9604644775390625e-8f;
    return lum_bits_f32(lum_f32_bits(v) | sign);
  }
  if (exp == 31) return lum_bits_f32(sign | 0x7f800000u | (man << 13));  // inf / nan (payload kept)
  return lum_bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

LUM_HD unsigned short lum_soft_f32_to_f16(float f) {
  const unsigned int x = lum_f32_bits(f);
  const unsigned short sign = (unsigned short)((x >> 16) & 0x8000u);
  const unsigned int u = x & 0x7fffffffu;
  if (u > 0x7f800000u) {  // NaN: keep the top payload bits, force quiet
    return (unsigned short)(sign | 0x7e00u | ((u >> 13) & 0x3ffu));
  }
  if (u >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);  // >= 65520 (or inf): inf
  if (u >= 0x38800000u) {  // normal f16 (>= 2^-14): rebias, round the 13 dropped bits to nearest even
    unsigned int h = (u >> 13) - (112u << 10);
    const unsigned int rem = u & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry into the exponent is right
    return (unsigned short)(sign | h);
  }
  if (u <= 0x33000000u) return sign;  // <= 2^-25: rounds (ties to even) to zero
  // subnormal f16: value = m * 2^(e-150) with the implicit bit; result units are 2^-24
  const unsigned int e = u >> 23, m = (u & 0x7fffffu) | 0x800000u;
  const unsigned int shift = 126u - e;  // 14..24 here
  unsigned int h = m >> shift;
  const unsigned int rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (h & 1u))) ++h;
  return (unsigned short)(sign | h);
}

LUM_HD float lum_soft_bf16_to_f32(unsigned short h) { return lum_bits_f32((unsigned int)h << 16); }

LUM_HD unsigned short lum_soft_f32_to_bf16(float f) {
  unsigned int u = lum_f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x0040u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even (overflow lands on inf, as it must)
  return (unsigned short)(u >> 16);
}

// ------------------------------------------------------------------------------ f16 / bf16, used by kernels
LUM_HD float lum_f16_to_f32(unsigned short h) {
#if defined(__CUDA_ARCH__) && !defined(LUM_SOFT_CVT)
  float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
#else
  return lum_soft_f16_to_f32(h);
#endif
}
LUM_HD unsigned short lum_f32_to_f16(float f) {
#if defined(__CUDA_ARCH__) && !defined(LUM_SOFT_CVT)
  unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
#else
  return lum_soft_f32_to_f16(f);
#endif
}
LUM_HD float lum_bf16_to_f32(unsigned short h) { return lum_soft_bf16_to_f32(h); }
LUM_HD unsigned short lum_f32_to_bf16(float f) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 800) && !defined(LUM_SOFT_CVT)
  unsigned short h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
#else
  return lum_soft_f32_to_bf16(f);
#endif
}

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
// ------------------------------------------------------------------------------ index helpers
// Expr.to_c() prints floor-div / ceil-div / mod / min / max with these (round toward -inf, like Python).
template <typename A, typename B>
LUM_D auto lum_floordiv(A a, B b) -> decltype(a / b) {
  typedef decltype(a / b) T;
  const T q = (T)a / (T)b;
  return ((T)a % (T)b != 0 && (((T)a < 0) != ((T)b < 0))) ? q - 1 : q;
}
template <typename A, typename B>
LUM_D auto lum_ceildiv(A a, B b) -> decltype(a / b) { return -lum_floordiv(-a, b); }
template <typename A, typename B>
LUM_D auto lum_mod(A a, B b) -> decltype(a % b) {
  typedef decltype(a % b) T;
  const T r = (T)a % (T)b;
  return (r != 0 && ((r < 0) != ((T)b < 0))) ? r + (T)b : r;
}
template <typename A, typename B>
LUM_D auto lum_min(A a, B b) -> decltype(a + b) { return a < b ? (decltype(a + b))a : (decltype(a + b))b; }
template <typename A, typename B>
LUM_D auto lum_max(A a, B b) -> decltype(a + b) { return a < b ? (decltype(a + b))b : (decltype(a + b))a; }

// ------------------------------------------------------------------------------ value helpers
// Floored modulo as numpy's np.mod: the result takes the divisor's sign; x % 0 is nan (floats), 0 (ints).
LUM_D float lum_fmod_floor(float a, float b) {
  float m = fmodf(a, b);
  if (b == 0.0f) return m;
  if (m != 0.0f) { if ((b < 0.0f) != (m < 0.0f)) m += b; }
  else m = copysignf(0.0f, b);
  return m;
}
LUM_D double lum_fmod_floor(double a, double b) {
  double m = fmod(a, b);
  if (b == 0.0) return m;
  if (m != 0.0) { if ((b < 0.0) != (m < 0.0)) m += b; }
  else m = copysign(0.0, b);
  return m;
}
LUM_D long long lum_imod_floor(long long a, long long b) {
  if (b == 0) return 0;
  if (b == -1) return 0;  // avoids LLONG_MIN % -1
  const long long r = a % b;
  return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}

// Reductions. Max propagates NaN (as numpy's max does).
struct LumSum {
  template <typename T> LUM_D static T apply(T a, T b) { return a + b; }
};
struct LumMax {
  LUM_D static float apply(float a, float b) { return (a > b || a != a) ? a : b; }
  LUM_D static double apply(double a, double b) { return (a > b || a != a) ? a : b; }
  LUM_D static long long apply(long long a, long long b) { return a > b ? a : b; }
};

// Reduce across WIDTH consecutive lanes (WIDTH a power of two <= 32); every lane gets the result.
// All 32 lanes of the warp must call it.
template <typename Op, int WIDTH, typename T>
LUM_D T lum_warp_reduce(T v) {
#pragma unroll
  for (int o = WIDTH / 2; o > 0; o >>= 1) v = Op::apply(v, __shfl_xor_sync(0xffffffffu, v, o, WIDTH));
  return v;
}

// Reduce across a group of GROUP consecutive threads (a power of two <= blockDim.x); every thread of the
// group gets the result, combined in the same order in each. Every thread of the block must call it
// (GROUP > 32 goes through shared memory `smem` of blockDim.x / 32 entries and __syncthreads).
template <typename Op, int GROUP, typename T>
LUM_D T lum_group_reduce(T v, T* smem) {
  v = lum_warp_reduce<Op, (GROUP < 32 ? GROUP : 32)>(v);
  if (GROUP > 32) {
    __syncthreads();                       // an earlier call's readers are done with smem
    if ((threadIdx.x & 31u) == 0) smem[threadIdx.x / 32] = v;
    __syncthreads();
    const int first = (int)(threadIdx.x / GROUP) * (GROUP / 32);
    v = smem[first];
#pragma unroll
    for (int k = 1; k < GROUP / 32; ++k) v = Op::apply(v, smem[first + k]);
  }
  return v;
}

// A row's stores into shared memory, at their physical index in the op's output less b (an attention
// stage's query rows, builder/attention_stage.py).
struct LumSink {
  float* p;
  long long b;
  LUM_D float& operator[](long long i) const { return p[i - b]; }
};

// N consecutive elements moved as one (aligned) memory access.
template <typename T, int N>
struct alignas(sizeof(T) * N) lum_vec { T v[N]; };

// True when p is aligned to `bytes` (a power of two).
LUM_D bool lum_aligned(const void* p, unsigned bytes) {
  return ((unsigned long long)p & (unsigned long long)(bytes - 1u)) == 0ull;
}

// Load N consecutive elements of T at p as stored, in accesses of at most 16 bytes (p aligned to
// min(16, N * sizeof(T)) bytes). Converted only where used, a caller can issue several such loads
// before it waits on any.
template <int N, typename T>
LUM_D void lum_load_raw(const T* p, T (&out)[N]) {
  constexpr int P = (int)(16 / sizeof(T)) < N ? (int)(16 / sizeof(T)) : N;  // elements per access
  static_assert(N % P == 0, "N must be a multiple of the access width");
#pragma unroll
  for (int q = 0; q < N / P; ++q) {
    const lum_vec<T, P> v = *reinterpret_cast<const lum_vec<T, P>*>(p + q * P);
#pragma unroll
    for (int e = 0; e < P; ++e) out[q * P + e] = v.v[e];
  }
}

#if defined(__CUDA_ARCH__)
// An L2 evict-first cache policy (for the cache_hint of a load or copy of data read once: a GEMV's weights).
LUM_D unsigned long long lum_evict_first_policy() {
  unsigned long long lum_policy;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(lum_policy));
  return lum_policy;
}
// The shared-state-space address of a generic pointer into shared memory (for cp.async, ldmatrix).
LUM_D unsigned lum_shared_addr(const void* p) {
  unsigned a;
  asm("{ .reg .u64 lum_t; cvta.to.shared.u64 lum_t, %1; cvt.u32.u64 %0, lum_t; }" : "=r"(a) : "l"(p));
  return a;
}
#endif

// lum_load_raw for data each step reads once and nothing rereads (a decode GEMV's weights): its 16-byte
// accesses carry an L2 evict-first policy and skip L1, so that streaming gigabytes of weights through the
// L2 does not evict the small tensors the next kernels and the next step read again (norm weights, the KV
// cache, activations). Read-only data only (ld.global.nc); other widths load as lum_load_raw. Volatile: the
// load stays where it is written (not moved across a wait that orders nothing it reads: a probe's, whose
// point is where the load is issued; benchmarks/layer_probe.cu).
template <int N, typename T, bool Volatile = false>
LUM_D void lum_load_stream(const T* p, T (&out)[N]) {
#if defined(__CUDA_ARCH__)
  constexpr int P = (int)(16 / sizeof(T));
  if constexpr (N % P == 0 && P * sizeof(T) == 16) {
    const unsigned long long lum_policy = lum_evict_first_policy();
#pragma unroll
    for (int q = 0; q < N / P; ++q) {
      lum_vec<unsigned, 4> w;
      if constexpr (Volatile)
        asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                     : "=r"(w.v[0]), "=r"(w.v[1]), "=r"(w.v[2]), "=r"(w.v[3]) : "l"(p + q * P), "l"(lum_policy));
      else
        asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
            : "=r"(w.v[0]), "=r"(w.v[1]), "=r"(w.v[2]), "=r"(w.v[3]) : "l"(p + q * P), "l"(lum_policy));
      const lum_vec<T, P> v = *reinterpret_cast<const lum_vec<T, P>*>(&w);
#pragma unroll
      for (int e = 0; e < P; ++e) out[q * P + e] = v.v[e];
    }
    return;
  }
#endif
  lum_load_raw<N>(p, out);                         // other widths, and the host emulation (tests)
}

// 16 bytes from global memory at g to shared memory at s (both 16-byte aligned) without a register: an
// asynchronous copy (cp.async, sm_80+; through L2 only, with the weights' evict-first policy) that the
// issuing thread completes with lum_copy_wait_all. A GEMV preloads its first weights so (gemv.cu
// PRELOAD_SHARED), as many as its lanes have, where registers would hold a few. Host emulation: a memcpy.
LUM_D void lum_copy16_async(void* s, const void* g) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;"
               :: "r"(lum_shared_addr(s)), "l"(g), "l"(lum_evict_first_policy()) : "memory");
#elif defined(__CUDA_ARCH__)
  *reinterpret_cast<lum_vec<unsigned, 4>*>(s) = *reinterpret_cast<const lum_vec<unsigned, 4>*>(g);
#else
  std::memcpy(s, g, 16);
#endif
}
// Every lum_copy16_async this thread issued has landed and is visible to it.
LUM_D void lum_copy_wait_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

// ------------------------------------------------------------------------------ launch order
// Programmatic dependent launch (sm_90+). Every lum kernel begins with lum_pdl_trigger() (the next
// kernel of the stream may be scheduled once every block of this one has run it) and calls
// lum_pdl_wait() before its first access to global memory that an earlier kernel may have written or
// may still read (it returns once the previous grid has completed and its writes are visible; that
// grid waited for its own predecessor, so every earlier grid is covered). Between the two a kernel
// reads only the dyn buffer (host copies fill it before a graph runs) and, where its launch table
// says so (`early`), weights (a GEMV's preload into registers). Launched plainly, both are no-ops in effect.
LUM_D void lum_pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}
LUM_D void lum_pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// The first nbytes of p into L2, a 128-byte line a thread (no value read, no register held): a fused kernel's
// small constant leaves (an attention stage's norm weights and scalars) asked for before its wait, so that
// its reads after the wait find them in L2 (builder/attention_stage.py, $LUM_ATTENTION_STAGE_PREFETCH).
LUM_D void lum_prefetch_l2(const void* p, unsigned nbytes) {
#if defined(__CUDA_ARCH__)
  for (unsigned off = threadIdx.x * 128u; off < nbytes; off += blockDim.x * 128u)
    asm volatile("prefetch.global.L2 [%0];" :: "l"(static_cast<const char*>(p) + off));
#else
  (void)p; (void)nbytes;
#endif
}

// ------------------------------------------------------------------------------ stamps (probe builds only)
// A package built with $LUM_STAMPS=1 (benchmarks/profile_decode.py --stamps; builder/codegen.py module_source)
// defines LUM_STAMPS, the module's array lum_stamps and, around each kernel, LUM_STAMP_KERNEL (its index in the
// module) and LUM_STAMP_TAG (codegen.stamp_tag of its name). Then thread 0 of up to LUM_STAMP_BLOCKS evenly
// spaced blocks of each kernel records %globaltimer (ns) as the block starts (after lum_pdl_trigger) and as its
// wait for the kernel before returns (after lum_pdl_wait), with the block's index and SM. Each launch
// overwrites the one before, so after a step the array holds each kernel's last launch: a decoder layer's
// timeline, block by block. A package built without it has none of this (the section compiles to nothing).
#if defined(LUM_STAMPS) && defined(__CUDA_ARCH__)
LUM_D void lum_stamp(int kernel, unsigned long long tag, int event) {
  if (threadIdx.x | threadIdx.y | threadIdx.z) return;
  const unsigned block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const unsigned stride = (gridDim.x * gridDim.y * gridDim.z + LUM_STAMP_BLOCKS - 1) / LUM_STAMP_BLOCKS;
  if (block % stride) return;
  unsigned long long t;
  unsigned sm;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  unsigned long long* s = lum_stamps + ((unsigned long long)kernel * LUM_STAMP_BLOCKS + block / stride) * LUM_STAMP_FIELDS;
  s[0] = tag;
  s[1] = block;
  s[2] = sm;
  s[3 + event] = t;
}
// A macro does not expand inside its own expansion, so these call the functions above, then stamp.
#define lum_pdl_trigger() (lum_pdl_trigger(), lum_stamp(LUM_STAMP_KERNEL, LUM_STAMP_TAG, 0))
#define lum_pdl_wait() (lum_pdl_wait(), lum_stamp(LUM_STAMP_KERNEL, LUM_STAMP_TAG, 1))
#endif
// A template's own marks inside a block's work (events 2, 3, 4: the record's spare fields; decode attention's
// stage, keys and stores), the same clock; nothing without LUM_STAMPS.
#if defined(LUM_STAMPS) && defined(__CUDA_ARCH__)
#define LUM_STAMP_AT(event) lum_stamp(LUM_STAMP_KERNEL, LUM_STAMP_TAG, (event))
#else
#define LUM_STAMP_AT(event) ((void)0)
#endif
// A persistent kernel's item k (templates/persistent.cu) stamps as a kernel of its own: record slot
// LUM_STAMP_KERNEL + 1 + k (module_source reserves them), tag LUM_STAMP_TAG + 1 + k; events 0 (the block
// reached the item's wait), 1 (the wait returned), 2 (the block finished the item).
#if defined(LUM_STAMPS) && defined(__CUDA_ARCH__)
#define LUM_STAMP_ITEM(item, event) lum_stamp(LUM_STAMP_KERNEL + 1 + (item), LUM_STAMP_TAG + 1ull + (item), (event))
#else
#define LUM_STAMP_ITEM(item, event) ((void)0)
#endif

// ------------------------------------------------------------------------------ thread block clusters
// Every thread of this block's cluster arrives, then waits for all the cluster's threads (sm_90: a hardware
// barrier, no memory round trip); release / acquire at cluster scope, so the stores this block made before
// it (global memory too) are visible to the cluster's blocks after it. Host emulation runs a grid's blocks
// one after another in index order, so there a cluster's last block is the only one past the barrier with
// every other block's stores done: LUM_CLUSTER_SHARE(n) is the number of a cluster's last blocks that may
// share work that reads the others' stores (n on the GPU, 1 emulated).
LUM_D void lum_cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#elif !defined(__CUDA_ARCH__)
  __syncthreads();
#endif
}
#if defined(__CUDA_ARCH__)
#define LUM_CLUSTER_SHARE(n) (n)
#else
#define LUM_CLUSTER_SHARE(n) 1
#endif

// ------------------------------------------------------------------------------ blocks counting done
// One block's arrival on a counter in global memory: an acquire-release add at GPU scope, so the stores
// this block's threads made before a __syncthreads are visible to whichever block counts last, and the
// last one sees all of them (no separate fences: a fence.sc is the slow way to the same order). Returns
// the count before this arrival. (templates/tail.cu, the attention combine of templates/attention.cu.)
LUM_D unsigned int lum_count_done(unsigned int* lum_c) {
#if defined(__CUDA_ARCH__)
  unsigned int lum_old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(lum_old) : "l"(lum_c) : "memory");
  return lum_old;
#else
  __threadfence();
  return atomicAdd(lum_c, 1u);
#endif
}
#if defined(__CUDA_ARCH__) || defined(LUM_EMU_RESIDENT)   // the GPU, or the emulator's resident runs
// A block's arrival once its threads are done with what a later item of a persistent kernel reads: every
// thread's stores before the __syncthreads, then thread 0's release (templates/persistent.cu).
LUM_D void lum_count_block(unsigned int* lum_c) {
  __syncthreads();
  if (threadIdx.x == 0) lum_count_done(lum_c);
}
// Every thread of the block, once the counter holds n: thread 0 polls with acquire loads at GPU scope, the
// others wait at the __syncthreads after it, so the stores the arrivals released are visible to every thread.
// A counter that never gets there (blocks not all resident: a grid larger than the GPU holds at once) traps
// after 2^22 polls (seconds) rather than hang the GPU. Host emulation: every block's threads interleave.
LUM_D void lum_wait_count(const unsigned int* lum_c, unsigned int n) {
  if (threadIdx.x == 0) {
#if defined(__CUDA_ARCH__)
    for (unsigned long long polls = 0;; ++polls) {
      unsigned int v;
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(lum_c) : "memory");
      if (v >= n) break;
      if (polls > (1ull << 22)) __trap();
    }
    __threadfence();
#else
    while (*(volatile const unsigned int*)lum_c < n) lum_spin_yield();
#endif
  }
  __syncthreads();
}
#endif
// A float another block of this grid stored (read at L2, past this SM's L1, after lum_count_done).
LUM_D float lum_load_cg(const float* p) {
#if defined(__CUDA_ARCH__)
  return __ldcg(p);
#else
  return *p;
#endif
}

// Load N consecutive elements of T at p as float (cvt: storage -> float), in accesses of at most 16
// bytes; p must be aligned to min(16, N * sizeof(T)) bytes.
template <int N, typename T, typename Cvt>
LUM_D void lum_load_f32(const T* p, float (&out)[N], Cvt cvt) {
  T raw[N];
  lum_load_raw<N>(p, raw);
#pragma unroll
  for (int e = 0; e < N; ++e) out[e] = cvt(raw[e]);
}

// ------------------------------------------------------------------------------ weights through a ring
// A persistent kernel (templates/persistent.cu, builder/persistent.py) streams its GEMVs' weights through a
// ring of shared-memory stages: one tile of a GEMV (its block tile's rows of B, for each product column
// segment of an epilogue) a stage, copied by one cp.async.bulk request per segment that completes on the
// stage's mbarrier (or, `async`, by warp 0's lanes in 16-byte cp.async copies, each lane's arrival counted
// once its copies land). Thread 0 (warp 0) issues the copies, in the order the block will use the tiles
// (each GEMV's tiles blockIdx.x, blockIdx.x + gridDim.x, … as gemv.cu's dot loop walks them, GEMV after
// GEMV); every thread waits for a stage's phase (lum_ring_acquire); once the block is done with it
// (lum_ring_release) thread 0 (warp 0) refills it with the tile `stages` ahead. So while the block waits
// for another's results (a dependency between two ops of the kernel) its next tiles are already on their
// way: the stream does not stop at the dependency, as it does at a kernel boundary. The ring's state and its
// stages are the kernel's dynamic shared memory: LumRing at offset 0, stage s at LUM_RING_HEADER + s *
// stage_bytes.
// Host emulation (tests/cuda_emulation.py): a copy lands at once; an mbarrier is (arrivals left | phase
// parity << 16, bytes pending) in its 8 bytes.
#if defined(__CUDA_ARCH__) || defined(LUM_EMU_RESIDENT)   // the GPU, or the emulator's resident runs
#define LUM_RING_MAX_ACC 4        // product column segments of a GEMV tile (codegen.GEMV_MAX_ACC)
#define LUM_RING_MAX_ITEMS 16     // GEMVs a kernel streams
#define LUM_RING_MAX_STAGES 8
#define LUM_RING_HEADER 1024      // bytes before stage 0 (LumRing, rounded up)
struct LumRingGemv {              // one GEMV's weights: B [n_rows (+ segments' offsets), row_bytes], rows a tile
  const unsigned char* w;
  unsigned row_bytes, rows, n_rows, nacc;
  unsigned acc_rows[LUM_RING_MAX_ACC];   // each segment's first row in B (gemv.cu ACC_COLS)
};
struct LumRing {
  unsigned long long bars[LUM_RING_MAX_STAGES];
  unsigned stage_bytes, stages, used, issued, item, tile, n_items;
  unsigned vb, vg;               // the block index and grid an item's body sees (lum_virtual_block)
  const unsigned* wait_c;        // register-fed items: the counter the body's wait polls (lum_item_wait) ...
  unsigned wait_n, wait_pdl;     // ... until it holds wait_n; wait_pdl: the wait for the previous launch instead
  unsigned async;                // 1: warp 0's lanes copy 16 bytes each (cp.async), 0: thread 0 a bulk copy
  LumRingGemv items[LUM_RING_MAX_ITEMS];
};
static_assert(sizeof(LumRing) <= LUM_RING_HEADER, "LumRing fits its header");

#if defined(__CUDA_ARCH__)
LUM_D LumRing* lum_ring() {
  extern __shared__ __align__(128) unsigned char lum_ring_smem[];
  return reinterpret_cast<LumRing*>(lum_ring_smem);
}
LUM_D void lum_mbar_init(unsigned long long* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(lum_shared_addr(bar)), "r"(count) : "memory");
}
LUM_D void lum_mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
LUM_D void lum_mbar_expect(unsigned long long* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
               :: "r"(lum_shared_addr(bar)), "r"(bytes) : "memory");
}
LUM_D bool lum_mbar_done(unsigned long long* bar, unsigned parity) {
  unsigned done;
  asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
               : "=r"(done) : "r"(lum_shared_addr(bar)), "r"(parity) : "memory");
  return done != 0;
}
// bytes (a multiple of 16, both addresses 16-byte aligned) from global g to shared s, completing on bar
LUM_D void lum_bulk_copy(void* s, const void* g, unsigned bytes, unsigned long long* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
               " [%0], [%1], %2, [%3], %4;"
               :: "r"(lum_shared_addr(s)), "l"(g), "r"(bytes), "r"(lum_shared_addr(bar)),
                  "l"(lum_evict_first_policy()) : "memory");
}
// An arrival on bar once every cp.async this thread issued has landed (counted among its expected arrivals).
LUM_D void lum_async_arrive(unsigned long long* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(lum_shared_addr(bar)) : "memory");
}
// Before an async-proxy copy overwrites a stage the block's threads read (generic proxy) before a barrier.
LUM_D void lum_ring_proxy_fence() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
#define lum_ring_spin() ((void)0)
#else
#define lum_ring_proxy_fence() ((void)0)
LUM_D LumRing* lum_ring() { return reinterpret_cast<LumRing*>(lum_emu_dyn_smem()); }
LUM_D unsigned* lum_mbar_words(unsigned long long* bar) { return reinterpret_cast<unsigned*>(bar); }
LUM_D void lum_mbar_init(unsigned long long* bar, unsigned count) {
  lum_mbar_words(bar)[0] = count | count << 8;      // expected arrivals, arrivals left, parity 0
  lum_mbar_words(bar)[1] = 0;
}
LUM_D void lum_mbar_init_fence() {}
LUM_D void lum_mbar_complete_if_done(unsigned* m) {   // no arrival and no byte pending: the phase completes
  if (((m[0] >> 8) & 0xffu) == 0 && m[1] == 0) m[0] = ((m[0] & 0xffu) | (m[0] & 0xffu) << 8) | ((~m[0]) & 0x10000u);
}
LUM_D void lum_mbar_expect(unsigned long long* bar, unsigned bytes) {
  unsigned* m = lum_mbar_words(bar);
  m[1] += bytes;
  m[0] -= 1u << 8;
  lum_mbar_complete_if_done(m);
}
LUM_D bool lum_mbar_done(unsigned long long* bar, unsigned parity) {
  return ((lum_mbar_words(bar)[0] >> 16) & 1u) != parity;
}
LUM_D void lum_bulk_copy(void* s, const void* g, unsigned bytes, unsigned long long* bar) {
  std::memcpy(s, g, bytes);
  unsigned* m = lum_mbar_words(bar);
  m[1] -= bytes;
  lum_mbar_complete_if_done(m);
}
LUM_D void lum_async_arrive(unsigned long long* bar) {   // the thread's copies have landed already
  unsigned* m = lum_mbar_words(bar);
  m[0] -= 1u << 8;
  lum_mbar_complete_if_done(m);
}
#define lum_ring_spin() lum_spin_yield()
#endif

// An item's body sees blockIdx and gridDim as these (templates/persistent.cu defines the two names so around
// each body): block vb of a grid of vg, one dimension.
LUM_D auto lum_virtual_block() { auto b = blockIdx; b.x = lum_ring()->vb; b.y = b.z = 0; return b; }
LUM_D auto lum_virtual_grid() { auto g = gridDim; g.x = lum_ring()->vg; g.y = g.z = 1; return g; }
// Block vb of a grid of vg, for the item body called next: every thread sees it after the barrier. A
// register-fed item (builder/persistent.py `reg`, `reg-shared`) waits inside its body, where its kernel
// waited for the one before (lum_pdl_wait, which the item's text calls lum_item_wait): its preload is then on
// its way across the wait, as it is across a kernel boundary. Its body's wait is for counter c to hold n (c
// null: no wait, the block waited already), or, pdl, for the previous launch (the first item).
LUM_D void lum_run_item(unsigned vb, unsigned vg, const unsigned* c = nullptr, unsigned n = 0u, unsigned pdl = 0u) {
  if (threadIdx.x == 0) {
    LumRing* r = lum_ring();
    r->vb = vb;
    r->vg = vg;
    r->wait_c = c;
    r->wait_n = n;
    r->wait_pdl = pdl;
  }
  __syncthreads();
}
// A register-fed item's dynamic shared memory (a GEMV's shared preload, `reg-shared`): after the header.
LUM_D unsigned char* lum_item_smem() { return reinterpret_cast<unsigned char*>(lum_ring()) + LUM_RING_HEADER; }
LUM_D void lum_item_wait() {
  const LumRing* r = lum_ring();
  if (r->wait_pdl) (lum_pdl_wait)();                 // parenthesized: the function, not the stamps' macro
  else if (r->wait_c) lum_wait_count(r->wait_c, r->wait_n);
}
LUM_D unsigned char* lum_ring_stage(LumRing* r, unsigned s) {
  return reinterpret_cast<unsigned char*>(r) + LUM_RING_HEADER + (unsigned long long)s * r->stage_bytes;
}
// The issuers (thread 0 of a bulk ring, warp 0 of an async one): the next tile of this block's walk into the
// stage after the last one issued, if any is left. Every issuer reads the cursor; thread 0 moves it.
LUM_D void lum_ring_issue(LumRing* r) {
  const unsigned lane = threadIdx.x, mask = r->async ? 0xffffffffu : 1u;
  while (r->item < r->n_items) {
    const LumRingGemv& g = r->items[r->item];
    const unsigned tiles = (g.n_rows + g.rows - 1u) / g.rows;
    const unsigned c = blockIdx.x + r->tile * gridDim.x;
    const bool here = c < tiles;
    if (here) {
      const unsigned s = r->issued % r->stages;
      const unsigned rows = g.n_rows - c * g.rows < g.rows ? g.n_rows - c * g.rows : g.rows;
      const unsigned bytes = rows * g.row_bytes;
      for (unsigned t = 0; t < g.nacc; ++t) {
        unsigned char* dst = lum_ring_stage(r, s) + (unsigned long long)t * g.rows * g.row_bytes;
        const unsigned char* src = g.w + ((unsigned long long)g.acc_rows[t] + (unsigned long long)c * g.rows) *
                                   g.row_bytes;
        if (r->async) {
          for (unsigned o = lane * 16u; o < bytes; o += 512u) lum_copy16_async(dst + o, src + o);
        } else {
          if (t == 0) {
            lum_ring_proxy_fence();
            lum_mbar_expect(&r->bars[s], bytes * g.nacc);
          }
          lum_bulk_copy(dst, src, bytes, &r->bars[s]);
        }
      }
      if (r->async) lum_async_arrive(&r->bars[s]);
    }
    __syncwarp(mask);                       // every issuer has read the cursor
    if (lane == 0) {
      if (here) {
        ++r->tile;
        ++r->issued;
      } else {
        ++r->item;
        r->tile = 0;
      }
    }
    __syncwarp(mask);
    if (here) return;
  }
}
// The issuers, once thread 0 has put the items in r->items: the ring's first `stages` tiles on their way.
// Weights depend on no kernel, so this may run before the wait for the kernel before.
LUM_D void lum_ring_start(LumRing* r, unsigned n_items, unsigned stages, unsigned stage_bytes, unsigned async) {
  const unsigned mask = async ? 0xffffffffu : 1u;
  if (threadIdx.x == 0) {
    r->n_items = n_items;
    r->stages = stages;
    r->stage_bytes = stage_bytes;
    r->async = async;
    r->used = r->issued = r->item = r->tile = 0;
    for (unsigned s = 0; s < stages; ++s) lum_mbar_init(&r->bars[s], async ? 32u : 1u);
    lum_mbar_init_fence();
  }
  __syncwarp(mask);
  for (unsigned s = 0; s < stages; ++s) lum_ring_issue(r);
}
// Every thread of the block: the stage holding the block's next tile, once it has landed.
LUM_D const unsigned char* lum_ring_acquire() {
  LumRing* r = lum_ring();
  const unsigned s = r->used % r->stages, parity = (r->used / r->stages) & 1u;
  for (unsigned long long polls = 0; !lum_mbar_done(&r->bars[s], parity); ++polls) {
    lum_ring_spin();
#if defined(__CUDA_ARCH__)
    if (polls > (1ull << 22)) __trap();     // a copy that never lands: an error, not a hang
#endif
  }
  return lum_ring_stage(r, s);
}
// Every thread of the block, done reading the stage lum_ring_acquire gave: the issuers refill it.
LUM_D void lum_ring_release() {
  __syncthreads();
  LumRing* r = lum_ring();
  if (threadIdx.x < (r->async ? 32u : 1u)) {
    lum_ring_issue(r);
    if (threadIdx.x == 0) ++r->used;
  }
  __syncthreads();
}
#endif  // the GPU, or the emulator's resident runs
#endif  // CUDA

#endif  // LUM_COMMON_CUH
