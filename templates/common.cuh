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

// Store N consecutive elements of T at p from in, in accesses of at most 16 bytes (lum_load_raw's mirror; p
// aligned as there).
template <int N, typename T>
LUM_D void lum_store_raw(T* p, const T (&in)[N]) {
  constexpr int P = (int)(16 / sizeof(T)) < N ? (int)(16 / sizeof(T)) : N;
  static_assert(N % P == 0, "N must be a multiple of the access width");
#pragma unroll
  for (int q = 0; q < N / P; ++q) {
    lum_vec<T, P> v;
#pragma unroll
    for (int e = 0; e < P; ++e) v.v[e] = in[q * P + e];
    *reinterpret_cast<lum_vec<T, P>*>(p + q * P) = v;
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
// Ask L2 for the line holding p (no register, nothing waits for it): a weight a kernel reads after its wait,
// requested before it (gemv.cu AHEAD_EARLY). A no-op on the host.
LUM_D void lum_prefetch_l2(const void* p) {
#if defined(__CUDA_ARCH__)
  asm volatile("prefetch.global.L2 [%0];" :: "l"(p));
#endif
}
LUM_D void lum_pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Thread block clusters (sm_90+; templates/gemv_combine.cu): `v` stored at `p` (a __shared__ address of this
// block) in the shared memory of the cluster's block `rank`; every block of the cluster past its writes,
// acquiring theirs. sm_90 only: the host emulation runs a cluster's blocks one after another.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
LUM_D void lum_push_to(float* p, unsigned rank, float v) {
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(lum_shared_addr(p)), "r"(rank));
  asm volatile("st.shared::cluster.f32 [%0], %1;" :: "r"(remote), "f"(v) : "memory");
}
LUM_D void lum_cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
#endif

// ------------------------------------------------------------------------------ stamps (probe builds only)
// A package built with $LUM_STAMPS=1 (benchmarks/profile_decode.py --stamps; builder/codegen.py module_source)
// defines LUM_STAMPS, the module's array lum_stamps and, around each kernel, LUM_STAMP_KERNEL (its index in the
// module) and LUM_STAMP_TAG (codegen.stamp_tag of its name). Then thread 0 of up to LUM_STAMP_BLOCKS evenly
// spaced blocks of each kernel records %globaltimer (ns) as the block starts (after lum_pdl_trigger) and as its
// wait for the kernel before returns (after lum_pdl_wait), with the block's index and SM. Each launch
// overwrites the one before, so after a step the array holds each kernel's last launch: a decoder layer's
// timeline, block by block. A package built without it has none of this (the section compiles to nothing).
#if defined(LUM_STAMPS) && defined(__CUDA_ARCH__)
// Not inlined: inlined, its code took registers in the kernels it stamps and changed what it measured
// (gemma3-4b's gate-up 96 -> 117 registers, 5 -> 4 blocks an SM; benchmarks/kernel_sizes.py --stamps); called,
// every decode kernel of gemma3-4b and llama3-1b holds as many blocks an SM as in a plain build.
__device__ __noinline__ void lum_stamp(int kernel, unsigned long long tag, int event) {
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
// A template's own marks inside a block's work (events 2 to 6: the record's spare fields; decode attention's
// stage, keys and stores, and its stage's start and first query row), the same clock; nothing without LUM_STAMPS.
#if defined(LUM_STAMPS) && defined(__CUDA_ARCH__)
#define LUM_STAMP_AT(event) lum_stamp(LUM_STAMP_KERNEL, LUM_STAMP_TAG, (event))
#else
#define LUM_STAMP_AT(event) ((void)0)
#endif

// Load N consecutive elements of T at p as float (cvt: storage -> float), in accesses of at most 16
// bytes; p must be aligned to min(16, N * sizeof(T)) bytes.
template <int N, typename T, typename Cvt>
LUM_D void lum_load_f32(const T* p, float (&out)[N], Cvt cvt) {
  T raw[N];
  lum_load_raw<N>(p, raw);
#pragma unroll
  for (int e = 0; e < N; ++e) out[e] = cvt(raw[e]);
}

#endif  // CUDA

#endif  // LUM_COMMON_CUH
