// Small-M linear layer for XLA:CPU: y[m, n] = sum_k x[m, k] * w[n, k], for M = 1..~32 rows.
//
// Why this exists: XLA:CPU lowers an M=1 dot to a single-threaded GEMV and routes small M>1 dots to a
// GEMM that packs the (large) weight operand first, so batch-1 decoding and speculative verification of a
// few tokens reach only 35-60% of the memory bandwidth of a 2-core machine (docs/benchmarks.md). Decoding at
// small M is bound by reading the weights once; this kernel streams each weight row once, multiplies it
// against all M activation rows while it is in L1, and splits the output rows over XLA's intra-op thread
// pool. Exact fp32 arithmetic (fused multiply-add; the summation order differs from XLA's, so results agree
// to rounding, not bit for bit).
//
// Weights come as float32 or bfloat16 (`TltSmallMLinearBf16`): a bfloat16 is the upper half of a float32, so
// it widens exactly and the arithmetic stays fp32, while the bytes streamed per weight halve. The engine
// stores the drafter's weights that way on CPU (a draft step is bound by reading them).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Weight element types: how to widen one element, and 8 at once, to float32.
struct F32W {
  using T = float;
  static float At(const float* p, int64_t k) { return p[k]; }
  __attribute__((target("avx2,fma"), always_inline)) static inline __m256 Load8(const float* p) {
    return _mm256_loadu_ps(p);
  }
};

struct Bf16W {
  using T = uint16_t;  // XLA's FFI maps BF16 buffers to uint16_t: the float32's upper 16 bits
  static float At(const uint16_t* p, int64_t k) {
    const uint32_t u = static_cast<uint32_t>(p[k]) << 16;
    float f;
    std::memcpy(&f, &u, sizeof(f));
    return f;
  }
  __attribute__((target("avx2,fma"), always_inline)) static inline __m256 Load8(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
};

// Generic kernel: any CPU. The compiler vectorises the inner loop for the baseline ISA.
template <typename W>
void BlockGeneric(const float* x, const typename W::T* w, float* y, int64_t m_rows, int64_t k_dim,
                  int64_t n_dim, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const typename W::T* wr = w + n * k_dim;
    for (int64_t m = 0; m < m_rows; ++m) {
      const float* xr = x + m * k_dim;
      float acc = 0.f;
      for (int64_t k = 0; k < k_dim; ++k) acc += xr[k] * W::At(wr, k);
      y[m * n_dim + n] = acc;
    }
  }
}

// AVX2 + FMA micro-kernel: NR weight rows x MR activation rows (NR * MR accumulators in registers), K in
// steps of 8, the K % 8 tail in scalar code. `next` (or null) is the next tile's first weight row: its rows
// are prefetched at the same offset while this tile streams.
template <typename W, int NR, int MR>
__attribute__((target("avx2,fma"), always_inline)) inline void Tile(const float* x, const typename W::T* w,
                                                                     float* y, int64_t k_dim, int64_t n_dim,
                                                                     const typename W::T* next) {
  using T = typename W::T;
  constexpr int64_t kLine = 64 / sizeof(T);  // elements per cache line: one prefetch each
  const int64_t k8 = k_dim & ~int64_t{7};
  const T* wr[NR];
#pragma GCC unroll 4
  for (int j = 0; j < NR; ++j) wr[j] = w + j * k_dim;
  __m256 acc[NR][MR];
#pragma GCC unroll 4
  for (int j = 0; j < NR; ++j)
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) acc[j][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < k8; k += 8) {
    if (next != nullptr && (k & (kLine - 1)) == 0) {
      // Software prefetch of the next tile's rows at the same offset: decoding is bound by DRAM latency as
      // much as bandwidth, and the hardware prefetcher alone leaves it idle.
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) _mm_prefetch(reinterpret_cast<const char*>(next + j * k_dim + k), _MM_HINT_T0);
    }
    __m256 xv[MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) xv[r] = _mm256_loadu_ps(x + r * k_dim + k);
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      const __m256 v = W::Load8(wr[j] + k);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) acc[j][r] = _mm256_fmadd_ps(xv[r], v, acc[j][r]);
    }
  }
  for (int j = 0; j < NR; ++j) {
    for (int r = 0; r < MR; ++r) {
      float s = tlt::HSum(acc[j][r]);
      for (int64_t k = k8; k < k_dim; ++k) s += x[r * k_dim + k] * W::At(wr[j], k);
      y[r * n_dim + j] = s;
    }
  }
}

// Rows [n, n1) in tiles of NR weight rows, every activation row in ONE pass per tile when M <= kMaxMr
// (passes of kMaxMr rows otherwise). One pass matters: the next tile is prefetched while this one streams,
// and a second pass over a tile (from L1) leaves the memory system idle; the former 3 + 1 and 3 + 3 splits
// made the model's matmul chain 5% (M = 4) to 13% (M = 6) slower (docs/benchmarks.md). The NR * MR
// accumulators and the weight vector stay in the 16 AVX2 registers (at most 13); activation vectors beyond
// that are L1 loads.
template <typename W, int NR>
__attribute__((target("avx2,fma"), always_inline)) inline void Rows(const float* x, const typename W::T* w,
                                                                       float* y, int64_t m_rows, int64_t k_dim,
                                                                       int64_t n_dim, int64_t n, int64_t n1) {
  constexpr int kMaxMr = NR == 4 ? 3 : 6;
  for (; n + NR <= n1; n += NR) {
    const typename W::T* wn = w + n * k_dim;
    const typename W::T* next = n + 2 * NR <= n1 ? wn + NR * k_dim : nullptr;
    for (int64_t m = 0; m < m_rows; m += kMaxMr) {
      const float* xm = x + m * k_dim;
      float* ym = y + m * n_dim + n;
      const typename W::T* pf = m == 0 ? next : nullptr;  // prefetched during the first pass only
      // cases above kMaxMr never run for this NR; their `: 1` only keeps them from instantiating big tiles
      switch (std::min<int64_t>(kMaxMr, m_rows - m)) {
        case 1: Tile<W, NR, 1>(xm, wn, ym, k_dim, n_dim, pf); break;
        case 2: Tile<W, NR, 2>(xm, wn, ym, k_dim, n_dim, pf); break;
        case 3: Tile<W, NR, 3>(xm, wn, ym, k_dim, n_dim, pf); break;
        case 4: Tile<W, NR, (kMaxMr >= 4 ? 4 : 1)>(xm, wn, ym, k_dim, n_dim, pf); break;
        case 5: Tile<W, NR, (kMaxMr >= 5 ? 5 : 1)>(xm, wn, ym, k_dim, n_dim, pf); break;
        default: Tile<W, NR, (kMaxMr >= 6 ? 6 : 1)>(xm, wn, ym, k_dim, n_dim, pf); break;
      }
    }
  }
}

// Rows n0..n1 of the output for every activation row: each weight byte comes from memory once.
template <typename W>
__attribute__((target("avx2,fma"))) void BlockAvx2(const float* x, const typename W::T* w, float* y,
                                                   int64_t m_rows, int64_t k_dim, int64_t n_dim, int64_t n0,
                                                   int64_t n1) {
  // The vector tiles cover whole blocks of 4 rows whatever NR is, so the rows left to the scalar tail (whose
  // summation order differs) do not depend on M: a row's result is the same bit for bit at any M.
  const int64_t n4 = n0 + ((n1 - n0) & ~int64_t{3});
  if (m_rows <= 3) {
    Rows<W, 4>(x, w, y, m_rows, k_dim, n_dim, n0, n4);
  } else {
    Rows<W, 2>(x, w, y, m_rows, k_dim, n_dim, n0, n4);
  }
  if (n4 < n1) BlockGeneric<W>(x, w, y, m_rows, k_dim, n_dim, n4, n1);  // N tail (< 4 rows)
}

template <typename W>
using BlockFn = void (*)(const float*, const typename W::T*, float*, int64_t, int64_t, int64_t, int64_t,
                         int64_t);

template <typename W>
BlockFn<W> SelectBlock() {
  return tlt::HasAvx2Fma() ? BlockAvx2<W> : BlockGeneric<W>;
}

template <typename W, ffi::DataType WT>
ffi::Error SmallMLinearImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<WT> w,
                            ffi::ResultBuffer<ffi::F32> y) {
  const auto wd = w.dimensions();
  if (wd.size() < 2) return ffi::Error::InvalidArgument("small_m_linear: weight must be [..., N, K]");
  const int64_t n_dim = wd[wd.size() - 2];
  const int64_t k_dim = wd[wd.size() - 1];
  if (static_cast<int64_t>(w.element_count()) != n_dim * k_dim)
    return ffi::Error::InvalidArgument("small_m_linear: a batched weight is not supported (vmap over x only)");
  const auto xd = x.dimensions();
  if (xd.size() == 0 || xd[xd.size() - 1] != k_dim)
    return ffi::Error::InvalidArgument("small_m_linear: x's last dimension must equal the weight's K");
  const int64_t m_rows = static_cast<int64_t>(x.element_count()) / k_dim;
  if (static_cast<int64_t>(y->element_count()) != m_rows * n_dim)
    return ffi::Error::InvalidArgument("small_m_linear: output must hold M x N elements");
  if (m_rows == 0 || n_dim == 0) return ffi::Error::Success();

  static const BlockFn<W> block = SelectBlock<W>();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // About 8 chunks per thread for balance, each a multiple of 4 rows (the kernel's row block).
  int64_t chunk_rows = (n_dim + 8 * threads - 1) / (8 * threads);
  chunk_rows = std::max<int64_t>(16, (chunk_rows + 3) & ~int64_t{3});
  const int64_t num_chunks = (n_dim + chunk_rows - 1) / chunk_rows;
  const float* xp = x.typed_data();
  const typename W::T* wp = reinterpret_cast<const typename W::T*>(w.typed_data());
  float* yp = y->typed_data();
  tlt::ParallelFor(pool, num_chunks, [=](int64_t c) {
    const int64_t n0 = c * chunk_rows;
    block(xp, wp, yp, m_rows, k_dim, n_dim, n0, std::min(n_dim, n0 + chunk_rows));
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TltSmallMLinear, (SmallMLinearImpl<F32W, ffi::F32>),
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(TltSmallMLinearBf16, (SmallMLinearImpl<Bf16W, ffi::BF16>),
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
