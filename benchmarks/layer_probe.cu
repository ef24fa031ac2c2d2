//! lum/benchmarks/layer_probe.cu — the kernel of benchmarks/layer_probe.py (templates/common.cuh and
//! benchmarks/probe.cuh are pasted before this file). A model's decode layers (gemma3-4b's or llama3-1b's
//! shapes: LpGemma, LpLlama), `layers` of them, as one persistent launch of one block an SM: eight consumer
//! warps compute, one producer warp streams every weight the block will use, in the order it will use them,
//! through a ring of S shared-memory stages of 40 KB (cp.async.bulk completing on the stage's `full`
//! mbarrier, reused once the consumers `empty` it: lp_bulk_5_<model>, lp_bulk_2_<model>; or 16-byte
//! cp.async by each lane of the producer warp: lp_async_5_<model>). A consumer lane holds its part of a
//! GEMV's input in registers (the same ≤ 80 floats for every row it computes), so shared memory carries only
//! the weights. Or with no ring (lp_reg_1_<model>): sixteen consumer warps and no producer, each warp loading
//! its piece of a chunk (half a row; an eighth of down's) straight into registers, as lum's GEMVs load
//! (16-byte loads, L2 evict-first), the next chunk's piece on its way during a chunk's dot: two pieces in
//! flight a lane, ≈ 80 KB an SM; the input is read from shared memory (the one stage holds o's and down's).
//!
//! A layer, in the order of its dependencies (each arrow: every block waits for a counter in global memory
//! that the blocks before it raised, an acquire after their release; gemma3-4b's sizes):
//!   qkv:     x = x2 + rms(d) of the layer before (x0 for the first), xn = rms(x), qkv = Wqkv · xn  (4096 rows)
//!   → attn:  query head h on block h % grid: q = rms(qkv[head]), softmax(q · Kᵀ / √HD) · V over P cached
//!            keys of its kv head (the cache a constant of the weight set)
//!   → o:     o = Wo · a  (2560 rows, K 2048)
//!   → gate-up: x2 = x + rms(o), xn2 = rms(x2), h = (Wg · xn2) · 2σ(Wu · xn2)  (10240 rows)
//!   → down:  d = Wd · h  (2560 rows, K 10240)
//! rms(v) = v · rsqrt(mean(v²) + 1e-6). Every block keeps x and x2 in shared memory (each computes the same
//! prologue from the same inputs); block 0 also stores them (xout, x2out) for the check. A GEMV's rows go a
//! chunk (one stage: 8 rows of qkv or o, 4 of gate and 4 of up, 2 of down) at a time to block c % grid.
//!
//! Modes (`mode`): LP_AHEAD: the producer never waits for a counter, so the next GEMVs' weights stream while
//! the consumers wait (as far as the ring reaches); LP_GATED: the producer waits for the same counter as its
//! consumers before a GEMV's first chunk (the bus idles across each dependency, as across a kernel
//! boundary); LP_STREAM: nobody waits for a counter (the ring's rate over the same bytes and work; values
//! not meaningful). Without a ring, LP_AHEAD loads each warp's first piece of a GEMV before the GEMV's wait,
//! LP_GATED after it. Waits give up after LP_SPIN_LIMIT polls and set *err (a bug, or blocks not co-resident).

// A model's layer: hidden size, q · k · v rows, q rows, head size, query and kv heads, FFN size.
struct LpGemma { static constexpr int K = 2560, NQKV = 4096, Q = 2048, HD = 256, HEADS = 8, KV_HEADS = 4, FF = 10240; };
struct LpLlama { static constexpr int K = 2048, NQKV = 3072, Q = 2048, HD = 64, HEADS = 32, KV_HEADS = 8, FF = 8192; };
constexpr int LP_CONSUMERS = 256;                         // eight warps (the ring's kernels)
constexpr int LP_THREADS = LP_CONSUMERS + 32;             // and the producer
constexpr int LP_MAX_WARPS = 16;                          // consumer warps of the kernels without a ring
constexpr int LP_STAGE_BYTES = 40960;
constexpr int LP_MAX_VECS = 10;                           // a lane's input vectors: K / 256, Q / 256, FF / 1024
enum { LP_C_QKV = 0, LP_C_ATT = 1, LP_C_O = 2, LP_C_GU = 3, LP_C_DN = 4, LP_COUNTERS = 5 };
enum { LP_W_QKV = 0, LP_W_O = 1, LP_W_G = 2, LP_W_U = 3, LP_W_D = 4, LP_W_KC = 5, LP_W_VC = 6, LP_WEIGHTS = 7 };
enum { LP_AHEAD = 0, LP_GATED = 1, LP_STREAM = 2 };
enum { LP_SRC_BULK = 0, LP_SRC_ASYNC = 1, LP_SRC_REG = 2 };   // what brings the weights: the ring's fill, or none
constexpr long long LP_SPIN_LIMIT = 1LL << 22;
// dynamic shared memory: the ring, then ys (a normed input; the attention's scratch), xs (x, then x2), red
// (2 × 16 partial sums), part (16: reductions), then the ring's 2 × S mbarriers
__host__ __device__ constexpr int lp_smem_bytes(int stages, int k) {
  return stages * LP_STAGE_BYTES + (2 * k + 3 * LP_MAX_WARPS) * 4 + 2 * stages * 8;
}
static_assert(lp_smem_bytes(5, LpGemma::K) <= 227 * 1024, "one block an SM: the opt-in shared memory of sm_90");

// ------------------------------------------------------------------ the few instructions the host emulates
// On the GPU: PTX. On the host (tests/cuda_emulation.py's resident runs, every block's threads coroutines of
// one scheduler): a named barrier, spinning that lets the other threads run, and an mbarrier kept in its
// 8 bytes of shared memory as (expected arrivals | pending << 8 | phase parity << 16, pending bytes).
#if defined(__CUDA_ARCH__)
template <int NW>   // the NW consumer warps only
__device__ __forceinline__ void lp_bar() { asm volatile("bar.sync 1, %0;" :: "r"(32 * NW) : "memory"); }
__device__ __forceinline__ void lp_pause() {}
__device__ __forceinline__ unsigned lp_load_acquire(const unsigned* c) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(c) : "memory");
  return v;
}
__device__ __forceinline__ unsigned lp_saddr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void lp_mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void lp_mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void lp_mbar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void lp_mbar_expect(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ bool lp_mbar_done(unsigned bar, unsigned parity) {
  unsigned done;
  asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
               : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  return done != 0;
}
__device__ __forceinline__ void lp_bulk(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
__device__ __forceinline__ void lp_async16(unsigned dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void lp_async_arrive(unsigned bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(bar) : "memory");
}
#else
template <int NW>
inline void lp_bar() { lum_named_barrier(1, 32 * NW); }
inline void lp_pause() { lum_spin_yield(); }
inline unsigned lp_load_acquire(const unsigned* c) { return *c; }
inline unsigned lp_saddr(const void* p) { return (unsigned)((const unsigned char*)p - lum_emu_dyn_smem()); }
inline unsigned* lp_mbar(unsigned bar) { return reinterpret_cast<unsigned*>(lum_emu_dyn_smem() + bar); }
inline void lp_mbar_init(unsigned bar, unsigned count) { lp_mbar(bar)[0] = count | count << 8; lp_mbar(bar)[1] = 0; }
inline void lp_mbar_init_fence() {}
inline void lp_mbar_complete_if_done(unsigned* m) {   // no arrival and no byte pending: the phase completes
  if (((m[0] >> 8) & 0xffu) == 0 && m[1] == 0) m[0] = ((m[0] & 0xffu) | (m[0] & 0xffu) << 8) | ((~m[0]) & 0x10000u);
}
inline void lp_mbar_arrive(unsigned bar) { unsigned* m = lp_mbar(bar); m[0] -= 1u << 8; lp_mbar_complete_if_done(m); }
inline void lp_mbar_expect(unsigned bar, unsigned bytes) { lp_mbar(bar)[1] += bytes; lp_mbar_arrive(bar); }
inline bool lp_mbar_done(unsigned bar, unsigned parity) { return ((lp_mbar(bar)[0] >> 16) & 1u) != parity; }
inline void lp_bulk(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
  std::memcpy(lum_emu_dyn_smem() + dst, src, bytes);
  unsigned* m = lp_mbar(bar);
  m[1] -= bytes;
  lp_mbar_complete_if_done(m);
}
inline void lp_async16(unsigned dst, const void* src) { std::memcpy(lum_emu_dyn_smem() + dst, src, 16); }
inline void lp_async_arrive(unsigned bar) { lp_mbar_arrive(bar); }   // the lane's copies are done already
#endif

// The sum (or the max) of every consumer thread's `s`, in every consumer thread (NW warps).
template <bool MAX, int NW>
__device__ __forceinline__ float lp_reduce(float s, float* part) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float t = __shfl_xor_sync(0xffffffffu, s, o);
    s = MAX ? fmaxf(s, t) : s + t;
  }
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = s;
  lp_bar<NW>();
  float t = part[0];
#pragma unroll
  for (int i = 1; i < NW; ++i) t = MAX ? fmaxf(t, part[i]) : t + part[i];
  lp_bar<NW>();
  return t;
}

// Poll *c (acquire, GPU scope) until it reaches target; false (and *err set) if it never did.
__device__ __forceinline__ bool lp_spin(const unsigned* c, unsigned target, unsigned* err) {
  for (long long i = 0; i < LP_SPIN_LIMIT; ++i) {
    if (lp_load_acquire(c) >= target) return true;
    if ((i & 1023) == 1023 && *reinterpret_cast<volatile unsigned*>(err)) return false;   // another gave up
    lp_pause();
  }
  atomicExch(err, 1u);
  return false;
}

// The consumers wait for a counter (thread 0 polls, the rest meet it at the barrier).
template <int NW>
__device__ __forceinline__ void lp_wait_count(const unsigned* c, unsigned target, unsigned* err, int mode) {
  if (mode != LP_STREAM && threadIdx.x == 0) lp_spin(c, target, err);
  lp_bar<NW>();
}

// The consumers' stores so far are visible to whoever acquires `c` at its new count.
template <int NW>
__device__ __forceinline__ void lp_signal(unsigned* c, unsigned n) {
  lp_bar<NW>();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(c, n);
  }
}

__device__ __forceinline__ void lp_mbar_wait(unsigned bar, unsigned parity, unsigned* err) {
  for (long long i = 0; i < LP_SPIN_LIMIT; ++i) {
    if (lp_mbar_done(bar, parity)) return;
    if ((i & 1023) == 1023 && *reinterpret_cast<volatile unsigned*>(err)) return;
    lp_pause();
  }
  atomicExch(err, 1u);
}

// `bytes` of global memory at src into shared memory at dst, completing on the stage's mbarrier `bar`. BULK:
// one copy-engine request (cp.async.bulk; the producer's lane 0, after its expect_tx); else 16-byte
// cp.async by each of the producer warp's lanes, whose completion the barrier learns from each lane's
// cp.async.mbarrier.arrive.noinc after the stage's copies (the barrier counts 32 arrivals).
template <bool BULK>
__device__ __forceinline__ void lp_copy(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
  if (BULK) {
    lp_bulk(dst, src, bytes, bar);
    return;
  }
  const char* from = reinterpret_cast<const char*>(src);
  for (unsigned o = ((unsigned)threadIdx.x % 32) * 16; o < bytes; o += 512) lp_async16(dst + o, from + o);
}

// A lane's part of a GEMV input of VECS · 256 floats (elements (lane + 32 i) · 8 ... + 8, as lp_row reads
// the weights), into registers; GLOBAL: another block stored it (read at L2).
template <int VECS, bool GLOBAL>
__device__ __forceinline__ void lp_input(const float* v, float* xr) {
  const int lane = (int)threadIdx.x % 32;
#pragma unroll
  for (int i = 0; i < VECS; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float4* p = reinterpret_cast<const float4*>(v + (lane + 32 * i) * 8 + 4 * h);
      const float4 f = GLOBAL ? __ldcg(p) : *p;
      xr[i * 8 + 4 * h] = f.x; xr[i * 8 + 4 * h + 1] = f.y; xr[i * 8 + 4 * h + 2] = f.z; xr[i * 8 + 4 * h + 3] = f.w;
    }
  }
}

// One row's dot over VECS · 256 bf16 weights in shared memory against the lane's registers, in every lane.
template <int VECS>
__device__ __forceinline__ float lp_row(const unsigned short* w, const float* xr) {
  const int lane = (int)threadIdx.x % 32;
  float acc = 0.0f;
#pragma unroll
  for (int i = 0; i < VECS; ++i)
    acc = probe_dot8(acc, *reinterpret_cast<const uint4*>(w + (lane + 32 * i) * 8), xr + i * 8);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  return acc;
}

// A warp's piece of a GEMV chunk in registers: its lane's VECS 16-byte vectors (lane + 32 i, as lp_row and
// lp_input index them), loaded as lum's GEMVs load weights (no L1, L2 evict-first) but volatile: the compiler
// may not move them across the waits (gated-reg loads after its wait) nor hoist the next pieces early (which
// took registers the kernel does not have).
template <int VECS>
struct LpPiece { uint4 v[VECS]; };

template <int VECS>
__device__ __forceinline__ void lp_fetch(const unsigned short* w, LpPiece<VECS>& r) {
  const int lane = (int)threadIdx.x % 32;
#pragma unroll
  for (int i = 0; i < VECS; ++i) {   // volatile: `gated-reg` keeps its loads after the wait, where written
    unsigned raw[4];
    lum_load_stream<4, unsigned, true>(reinterpret_cast<const unsigned*>(w + (lane + 32 * i) * 8), raw);
    r.v[i] = uint4{raw[0], raw[1], raw[2], raw[3]};
  }
}

// This warp's piece of this block's first chunk of a GEMV (piece_of(chunk): its weights) into `r`, if `load`.
template <int VECS, class PieceOf>
__device__ __forceinline__ void lp_first(LpPiece<VECS>& r, PieceOf piece_of, int chunks, bool load) {
  if (load && (int)blockIdx.x < chunks) lp_fetch(piece_of((int)blockIdx.x), r);
}

// Four floats of shared memory, loaded where they are used: a volatile load, which the compiler neither hoists
// out of a loop nor keeps in registers (a GEMV input held in registers beside two pieces spilled).
__device__ __forceinline__ float4 lp_lds4(const float* p) {
#if defined(__CUDA_ARCH__)
  float4 v;
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(lp_saddr(p)));
  return v;
#else
  return *reinterpret_cast<const float4*>(p);
#endif
}

// Without a ring (LP_MAX_WARPS warps): this block's chunks of a GEMV (blockIdx.x, + gridDim.x, ...). Warp w
// takes the dot of its piece of each chunk against its input x (shared memory, the elements lp_input would
// give its lanes); the next chunk's piece is asked for before a chunk's dot, so two are in flight a lane
// (`a`, which lp_first filled with the first, and `b` by turns). After each chunk, once every warp's partial
// sum is in r[0..16) (a barrier), done(ch, r). Returns the chunks done.
template <int VECS, class PieceOf, class Done>
__device__ __forceinline__ int lp_reg_gemv(LpPiece<VECS>& a, int chunks, PieceOf piece_of, const float* x,
                                           float* red, Done done) {
  const int grid = (int)gridDim.x, warp = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32;
  LpPiece<VECS> b;
  int n = 0;
  auto finish = [&](int ch, const LpPiece<VECS>& w) {
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < VECS; ++i) {
      const float4 lo = lp_lds4(x + (lane + 32 * i) * 8), hi = lp_lds4(x + (lane + 32 * i) * 8 + 4);
      const float x8[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
      acc = probe_dot8(acc, w.v[i], x8);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    float* r = red + (n & 1) * LP_MAX_WARPS;   // by turns: a chunk's sums are read before the next barrier
    if (lane == 0) r[warp] = acc;
    lp_bar<LP_MAX_WARPS>();
    done(ch, r);
    ++n;
  };
  for (int ch = (int)blockIdx.x; ch < chunks; ch += 2 * grid) {
    const bool more = ch + grid < chunks;
    if (more) lp_fetch(piece_of(ch + grid), b);
    finish(ch, a);
    if (ch + 2 * grid < chunks) lp_fetch(piece_of(ch + 2 * grid), a);
    if (more) finish(ch + grid, b);
  }
  return n;
}

template <class M, int LP_STAGES, int SRC>
__device__ __forceinline__ void lp_layers(const unsigned long long* __restrict__ wp, const float* __restrict__ x0,
                                          float* act, float* xout, float* x2out, unsigned* cnt, unsigned* err,
                                          int layers, int P, int mode) {
  constexpr int LP_K = M::K, LP_NQKV = M::NQKV, LP_Q = M::Q, LP_HD = M::HD, LP_HEADS = M::HEADS, LP_FF = M::FF;
  constexpr bool BULK = SRC == LP_SRC_BULK, REG = SRC == LP_SRC_REG;
  constexpr int NW = REG ? LP_MAX_WARPS : LP_CONSUMERS / 32, NT = 32 * NW;   // consumer warps and threads
  constexpr int LP_CH_QKV = LP_NQKV / 8, LP_CH_O = LP_K / 8, LP_CH_GU = LP_FF / 4, LP_CH_DN = LP_K / 2;
  constexpr int LP_ACT = LP_NQKV + LP_Q + LP_K + LP_FF + LP_K;  // a layer's activations: qkv, a, o, h, d
  constexpr int LP_A = LP_NQKV, LP_O = LP_A + LP_Q, LP_H = LP_O + LP_K, LP_D = LP_H + LP_FF;
  static_assert(LP_K % 256 == 0 && LP_Q % 256 == 0 && LP_FF % 1024 == 0 && LP_HD % 8 == 0 && LP_HD <= NT);
  static_assert(LP_K / 256 <= LP_MAX_VECS && LP_Q / 256 <= LP_MAX_VECS && LP_FF / 1024 <= LP_MAX_VECS);
  static_assert(8 * LP_K * 2 <= LP_STAGE_BYTES && 8 * LP_Q * 2 <= LP_STAGE_BYTES && 2 * LP_FF * 2 <= LP_STAGE_BYTES);
  // chunks of GEMV g (0 qkv, 1 o, 2 gate-up, 3 down), a stage each, and a chunk's bytes
  auto chunks = [](int g) { return g == 0 ? LP_CH_QKV : g == 1 ? LP_CH_O : g == 2 ? LP_CH_GU : LP_CH_DN; };
  auto chunk_bytes = [](int g) -> unsigned { return g == 1 ? 8 * LP_Q * 2 : g == 3 ? 2 * LP_FF * 2 : 8 * LP_K * 2; };
#if defined(__CUDA_ARCH__)
  extern __shared__ __align__(128) unsigned char lp_smem[];
#else
  unsigned char* const lp_smem = lum_emu_dyn_smem();
#endif
  float* ys = reinterpret_cast<float*>(lp_smem + LP_STAGES * LP_STAGE_BYTES);
  float* xs = ys + LP_K;
  float* red = xs + LP_K;
  float* part = red + 2 * LP_MAX_WARPS;
  unsigned long long* full = reinterpret_cast<unsigned long long*>(part + LP_MAX_WARPS);
  unsigned long long* empty = full + LP_STAGES;
  const unsigned ring = lp_saddr(lp_smem);
  const int warp = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32;
  const int grid = (int)gridDim.x, block = (int)blockIdx.x;
  if (threadIdx.x == 0) {
    for (int s = 0; s < LP_STAGES; ++s) {
      lp_mbar_init(lp_saddr(full + s), BULK ? 1 : 32);
      lp_mbar_init(lp_saddr(empty + s), NW);
    }
    lp_mbar_init_fence();
  }
  __syncthreads();
  // what GEMV g of layer l waits for: (counter, target); a null counter for the first layer's qkv
  auto dep = [&](int l, int g, unsigned& target) -> const unsigned* {
    const int c = g == 0 ? (l - 1) * LP_COUNTERS + LP_C_DN
                         : l * LP_COUNTERS + (g == 1 ? LP_C_ATT : g == 2 ? LP_C_O : LP_C_GU);
    target = g == 0 ? LP_CH_DN : g == 1 ? LP_HEADS : g == 2 ? LP_CH_O : LP_CH_GU;
    return g == 0 && l == 0 ? nullptr : cnt + c;
  };

  if (warp == NW) {                             // the producer: weights only, in the consumers' order
    if (!REG && (!BULK || lane == 0)) {
      unsigned n = 0;                           // stages issued
      for (int l = 0; l < layers; ++l) {
        const unsigned long long* w = wp + (l & 1) * LP_WEIGHTS;
        const unsigned short* W[4] = {reinterpret_cast<const unsigned short*>(w[LP_W_QKV]),
                                      reinterpret_cast<const unsigned short*>(w[LP_W_O]),
                                      reinterpret_cast<const unsigned short*>(w[LP_W_G]),
                                      reinterpret_cast<const unsigned short*>(w[LP_W_D])};
        const unsigned short* Wu = reinterpret_cast<const unsigned short*>(w[LP_W_U]);
        for (int g = 0; g < 4; ++g) {
          unsigned target;
          const unsigned* c = dep(l, g, target);
          if (mode == LP_GATED && c != nullptr) {
            if (lane == 0) lp_spin(c, target, err);
            if (!BULK) __syncwarp();
          }
          for (int ch = block; ch < chunks(g); ch += grid, ++n) {
            const int s = (int)(n % LP_STAGES);
            if (n >= LP_STAGES)
              lp_mbar_wait(lp_saddr(empty + s), (n / LP_STAGES - 1) & 1, err);
            const unsigned fb = lp_saddr(full + s), dst = ring + s * LP_STAGE_BYTES;
            const unsigned bytes = chunk_bytes(g);
            if (BULK) lp_mbar_expect(fb, bytes);
            if (g == 0) lp_copy<BULK>(dst, W[0] + (size_t)ch * 8 * LP_K, bytes, fb);
            else if (g == 1) lp_copy<BULK>(dst, W[1] + (size_t)ch * 8 * LP_Q, bytes, fb);
            else if (g == 3) lp_copy<BULK>(dst, W[3] + (size_t)ch * 2 * LP_FF, bytes, fb);
            else {                                // 4 rows of the gate, then the same 4 of up
              lp_copy<BULK>(dst, W[2] + (size_t)ch * 4 * LP_K, bytes / 2, fb);
              lp_copy<BULK>(dst + bytes / 2, Wu + (size_t)ch * 4 * LP_K, bytes / 2, fb);
            }
            if (!BULK) lp_async_arrive(fb);
          }
        }
      }
    }
    return;
  }

  const int t = (int)threadIdx.x;
  const float eps = 1e-6f;
  unsigned n = 0;                               // stages consumed
  // a GEMV's stage: wait until its weights have landed (take), hand it back to the producer once this warp has
  // read it (give)
  auto take = [&]() -> const unsigned short* {
    const int s = (int)(n % LP_STAGES);
    lp_mbar_wait(lp_saddr(full + s), (n / LP_STAGES) & 1, err);
    return reinterpret_cast<const unsigned short*>(lp_smem + s * LP_STAGE_BYTES);
  };
  auto give = [&]() {
    __syncwarp();
    if (lane == 0) lp_mbar_arrive(lp_saddr(empty + n % LP_STAGES));
    ++n;
  };
  // xs ← base + rms(v) (v: LP_K floats another block stored), ys ← rms(xs); block 0 stores xs at out
  auto residual = [&](const float* v, float* out) {
    float e[LP_K / NT], s = 0.0f;
#pragma unroll
    for (int i = 0; i < LP_K / NT; ++i) {
      e[i] = v != nullptr ? __ldcg(v + t + i * NT) : x0[t + i * NT];
      s += e[i] * e[i];
    }
    const float r = v != nullptr ? rsqrtf(lp_reduce<false, NW>(s, part) / LP_K + eps) : 1.0f;
    s = 0.0f;
#pragma unroll
    for (int i = 0; i < LP_K / NT; ++i) {
      const int k = t + i * NT;
      e[i] = v != nullptr ? xs[k] + e[i] * r : e[i];
      s += e[i] * e[i];
    }
    const float r2 = rsqrtf(lp_reduce<false, NW>(s, part) / LP_K + eps);
#pragma unroll
    for (int i = 0; i < LP_K / NT; ++i) {
      const int k = t + i * NT;
      xs[k] = e[i];
      ys[k] = e[i] * r2;
      if (block == 0) out[k] = e[i];
    }
    lp_bar<NW>();
  };

  // without a ring: each warp's piece of a GEMV's first chunk is loaded before the GEMV's wait or after it
  const bool before_wait = REG && mode == LP_AHEAD, after_wait = REG && mode != LP_AHEAD;
  const int r8 = warp % 8, h2 = warp / 8;       // without a ring: a warp's row of 8 in a chunk, and its half
  // ... and the o and down GEMVs' input, which other blocks stored, copied into the one stage (qkv's and
  // gate-up's is ys)
  float* const xin = reinterpret_cast<float*>(lp_smem);
  auto stage_input = [&](const float* v, int n) {
    for (int k = t; k < n; k += NT) xin[k] = __ldcg(v + k);
    lp_bar<NW>();
  };
  for (int l = 0; l < layers; ++l) {
    float* a = act + (size_t)l * LP_ACT;
    const unsigned long long* w = wp + (l & 1) * LP_WEIGHTS;
    auto weights = [=](int i) { return reinterpret_cast<const unsigned short*>(w[i]); };
    unsigned target;
    const unsigned* c;
    // qkv
    auto qkv_piece = [=](int ch) { return weights(LP_W_QKV) + (size_t)(ch * 8 + r8) * LP_K + h2 * (LP_K / 2); };
    LpPiece<LP_K / 512> pk;
    lp_first(pk, qkv_piece, LP_CH_QKV, before_wait);
    if (l > 0) {
      c = dep(l, 0, target);
      lp_wait_count<NW>(c, target, err, mode);
      residual(a - LP_ACT + LP_D, xout + (size_t)l * LP_K);
    } else {
      residual(nullptr, xout);
    }
    lp_first(pk, qkv_piece, LP_CH_QKV, after_wait);
    float xr[LP_MAX_VECS * 8];
    int mine = 0;
    if constexpr (REG) {
      mine = lp_reg_gemv(pk, LP_CH_QKV, qkv_piece, ys + h2 * (LP_K / 2), red, [&](int ch, const float* r) {
        if (warp < 8 && lane == 0) a[ch * 8 + warp] = r[warp] + r[warp + 8];
      });
    } else {
      lp_input<LP_K / 256, false>(ys, xr);
      for (int ch = block; ch < LP_CH_QKV; ch += grid, ++mine) {
        const float v = lp_row<LP_K / 256>(take() + warp * LP_K, xr);
        give();
        if (lane == 0) a[ch * 8 + warp] = v;
      }
    }
    lp_signal<NW>(cnt + l * LP_COUNTERS + LP_C_QKV, mine);
    // attention: query head `head` on block head (and head + grid ...)
    for (int head = block; head < LP_HEADS; head += grid) {
      c = cnt + l * LP_COUNTERS + LP_C_QKV;
      lp_wait_count<NW>(c, LP_CH_QKV, err, mode);
      const float q = t < LP_HD ? __ldcg(a + head * LP_HD + t) : 0.0f;
      const float qn = q * rsqrtf(lp_reduce<false, NW>(q * q, part) / LP_HD + eps);
      if (t < LP_HD) ys[t] = qn;
      lp_bar<NW>();
      float* sc = ys + LP_HD;
      const size_t kv = (size_t)(head / (LP_HEADS / M::KV_HEADS)) * P * LP_HD;
      const unsigned short* kc = reinterpret_cast<const unsigned short*>(w[LP_W_KC]) + kv;
      const unsigned short* vc = reinterpret_cast<const unsigned short*>(w[LP_W_VC]) + kv;
      const float scale = rsqrtf((float)LP_HD);
      for (int j = warp; j < P; j += NW) {
        float d = 0.0f;
        if (lane * 8 < LP_HD) {
          const uint4 key = __ldg(reinterpret_cast<const uint4*>(kc + (size_t)j * LP_HD + lane * 8));
          d = probe_dot8(0.0f, key, ys + lane * 8);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
        if (lane == 0) sc[j] = d * scale;
      }
      lp_bar<NW>();
      float m = -LUM_INF_F32;
      for (int j = t; j < P; j += NT) m = fmaxf(m, sc[j]);
      m = lp_reduce<true, NW>(m, part);
      float sum = 0.0f;
      for (int j = t; j < P; j += NT) {
        sc[j] = __expf(sc[j] - m);
        sum += sc[j];
      }
      sum = lp_reduce<false, NW>(sum, part);       // its barriers publish sc
      if (t < LP_HD) {
        float acc = 0.0f;
#pragma unroll 8
        for (int j = 0; j < P; ++j) acc += sc[j] * __uint_as_float((unsigned)__ldg(vc + (size_t)j * LP_HD + t) << 16);
        a[LP_A + head * LP_HD + t] = acc / sum;
      }
      lp_signal<NW>(cnt + l * LP_COUNTERS + LP_C_ATT, 1);
    }
    // o
    auto o_piece = [=](int ch) { return weights(LP_W_O) + (size_t)(ch * 8 + r8) * LP_Q + h2 * (LP_Q / 2); };
    LpPiece<LP_Q / 512> po;
    lp_first(po, o_piece, LP_CH_O, before_wait);
    c = dep(l, 1, target);
    lp_wait_count<NW>(c, target, err, mode);
    lp_first(po, o_piece, LP_CH_O, after_wait);
    mine = 0;
    if constexpr (REG) {
      stage_input(a + LP_A, LP_Q);
      mine = lp_reg_gemv(po, LP_CH_O, o_piece, xin + h2 * (LP_Q / 2), red, [&](int ch, const float* r) {
        if (warp < 8 && lane == 0) a[LP_O + ch * 8 + warp] = r[warp] + r[warp + 8];
      });
    } else {
      lp_input<LP_Q / 256, true>(a + LP_A, xr);
      for (int ch = block; ch < LP_CH_O; ch += grid, ++mine) {
        const float v = lp_row<LP_Q / 256>(take() + warp * LP_Q, xr);
        give();
        if (lane == 0) a[LP_O + ch * 8 + warp] = v;
      }
    }
    lp_signal<NW>(cnt + l * LP_COUNTERS + LP_C_O, mine);
    // gate-up: 4 rows of the gate, then the same 4 of up
    auto gu_piece = [=](int ch) {
      return weights(r8 < 4 ? LP_W_G : LP_W_U) + (size_t)(ch * 4 + r8 % 4) * LP_K + h2 * (LP_K / 2);
    };
    lp_first(pk, gu_piece, LP_CH_GU, before_wait);
    c = dep(l, 2, target);
    lp_wait_count<NW>(c, target, err, mode);
    residual(a + LP_O, x2out + (size_t)l * LP_K);
    lp_first(pk, gu_piece, LP_CH_GU, after_wait);
    mine = 0;
    if constexpr (REG) {
      mine = lp_reg_gemv(pk, LP_CH_GU, gu_piece, ys + h2 * (LP_K / 2), red, [&](int ch, const float* r) {
        if (warp < 4 && lane == 0)
          a[LP_H + ch * 4 + warp] = (r[warp] + r[warp + 8]) * 2.0f / (1.0f + __expf(-(r[warp + 4] + r[warp + 12])));
      });
    } else {
      lp_input<LP_K / 256, false>(ys, xr);
      for (int ch = block; ch < LP_CH_GU; ch += grid, ++mine) {
        float* r = red + (mine & 1) * 8;
        const float v = lp_row<LP_K / 256>(take() + warp * LP_K, xr);
        give();
        if (lane == 0) r[warp] = v;
        lp_bar<NW>();
        if (warp < 4 && lane == 0) a[LP_H + ch * 4 + warp] = r[warp] * 2.0f / (1.0f + __expf(-r[warp + 4]));
      }
    }
    lp_signal<NW>(cnt + l * LP_COUNTERS + LP_C_GU, mine);
    // down: a chunk is 2 rows; with the ring a warp takes a quarter of one, without it an eighth
    auto down_piece = [=](int ch) {
      return weights(LP_W_D) + (size_t)(ch * 2 + h2) * LP_FF + r8 * (LP_FF / 8);
    };
    LpPiece<LP_FF / 2048> pd;
    lp_first(pd, down_piece, LP_CH_DN, before_wait);
    c = dep(l, 3, target);
    lp_wait_count<NW>(c, target, err, mode);
    lp_first(pd, down_piece, LP_CH_DN, after_wait);
    mine = 0;
    if constexpr (REG) {
      stage_input(a + LP_H, LP_FF);
      mine = lp_reg_gemv(pd, LP_CH_DN, down_piece, xin + r8 * (LP_FF / 8), red, [&](int ch, const float* r) {
        if (r8 == 0 && lane == 0) {
          float d = r[warp];
#pragma unroll
          for (int i = 1; i < 8; ++i) d += r[warp + i];
          a[LP_D + ch * 2 + h2] = d;
        }
      });
    } else {
      const int row = warp / 4, quarter = warp % 4;
      lp_input<LP_FF / 4 / 256, true>(a + LP_H + quarter * (LP_FF / 4), xr);
      for (int ch = block; ch < LP_CH_DN; ch += grid, ++mine) {
        float* r = red + (mine & 1) * 8;
        const float v = lp_row<LP_FF / 4 / 256>(take() + row * LP_FF + quarter * (LP_FF / 4), xr);
        give();
        if (lane == 0) r[warp] = v;
        lp_bar<NW>();
        if (quarter == 0 && lane == 0) a[LP_D + ch * 2 + row] = ((r[warp] + r[warp + 1]) + r[warp + 2]) + r[warp + 3];
      }
    }
    lp_signal<NW>(cnt + l * LP_COUNTERS + LP_C_DN, mine);
  }
  if (block == 0) {                             // the last layer's output
    lp_wait_count<NW>(cnt + (layers - 1) * LP_COUNTERS + LP_C_DN, LP_CH_DN, err, mode);
    residual(act + (size_t)(layers - 1) * LP_ACT + LP_D, xout + (size_t)layers * LP_K);
  }
}

#define LP_ENTRY(NAME, M, S, SRC)                                                                                \
  extern "C" __global__ void __launch_bounds__(SRC == LP_SRC_REG ? 32 * LP_MAX_WARPS : LP_THREADS, 1)          \
  NAME(const unsigned long long* __restrict__ wp, const float* __restrict__ x0, float* act, float* xout,           \
       float* x2out, unsigned* cnt, unsigned* err, int layers, int P, int mode) {                                 \
    lp_layers<M, S, SRC>(wp, x0, act, xout, x2out, cnt, err, layers, P, mode);                                 \
  }
LP_ENTRY(lp_bulk_5_gemma, LpGemma, 5, LP_SRC_BULK)
LP_ENTRY(lp_bulk_2_gemma, LpGemma, 2, LP_SRC_BULK)
LP_ENTRY(lp_async_5_gemma, LpGemma, 5, LP_SRC_ASYNC)
LP_ENTRY(lp_reg_1_gemma, LpGemma, 1, LP_SRC_REG)
LP_ENTRY(lp_bulk_5_llama, LpLlama, 5, LP_SRC_BULK)
LP_ENTRY(lp_bulk_2_llama, LpLlama, 2, LP_SRC_BULK)
LP_ENTRY(lp_async_5_llama, LpLlama, 5, LP_SRC_ASYNC)
LP_ENTRY(lp_reg_1_llama, LpLlama, 1, LP_SRC_REG)
