// Small-M linear layer for XLA:CPU: y[m, n] = sum_k x[m, k] * w[n, k], for M = 1..~32 rows.
//
// Why this exists: XLA:CPU lowers an M=1 dot to a single-threaded GEMV and routes small M>1 dots to a
// GEMM that packs the (large) weight operand first, so batch-1 decoding and speculative verification of a
// few tokens reach only 35-60% of the memory bandwidth of a 2-core machine (docs/benchmarks.md). Decoding at
// small M is bound by reading the weights once; this kernel streams each weight row once, multiplies it
// against all M activation rows while it is in L1, and splits the output rows over XLA's intra-op thread
// pool. Exact fp32 arithmetic (fused multiply-add; the summation order differs from XLA's, so results agree
// to rounding, not bit for bit).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Generic kernel: any CPU. The compiler vectorises the inner loop for the baseline ISA.
void BlockGeneric(const float* x, const float* w, float* y, int64_t m_rows, int64_t k_dim, int64_t n_dim,
                  int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const float* wr = w + n * k_dim;
    for (int64_t m = 0; m < m_rows; ++m) {
      const float* xr = x + m * k_dim;
      float acc = 0.f;
      for (int64_t k = 0; k < k_dim; ++k) acc += xr[k] * wr[k];
      y[m * n_dim + n] = acc;
    }
  }
}

// AVX2 + FMA micro-kernel: NR weight rows x MR activation rows (NR * MR accumulators in registers), K in
// steps of 8, the K % 8 tail in scalar code. `next` (or null) is the next tile's first weight row: its rows
// are prefetched at the same offset while this tile streams.
template <int NR, int MR>
__attribute__((target("avx2,fma"), always_inline)) inline void Tile(const float* x, const float* w, float* y,
                                                                     int64_t k_dim, int64_t n_dim,
                                                                     const float* next) {
  const int64_t k8 = k_dim & ~int64_t{7};
  const float* wr[NR];
#pragma GCC unroll 4
  for (int j = 0; j < NR; ++j) wr[j] = w + j * k_dim;
  __m256 acc[NR][MR];
#pragma GCC unroll 4
  for (int j = 0; j < NR; ++j)
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) acc[j][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < k8; k += 8) {
    if (next != nullptr && (k & 15) == 0) {
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
      const __m256 v = _mm256_loadu_ps(wr[j] + k);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) acc[j][r] = _mm256_fmadd_ps(xv[r], v, acc[j][r]);
    }
  }
  for (int j = 0; j < NR; ++j) {
    for (int r = 0; r < MR; ++r) {
      float s = tlt::HSum(acc[j][r]);
      for (int64_t k = k8; k < k_dim; ++k) s += x[r * k_dim + k] * wr[j][k];
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
template <int NR>
__attribute__((target("avx2,fma"), always_inline)) inline void Rows(const float* x, const float* w, float* y,
                                                                       int64_t m_rows, int64_t k_dim,
                                                                       int64_t n_dim, int64_t n, int64_t n1) {
  constexpr int kMaxMr = NR == 4 ? 3 : 6;
  for (; n + NR <= n1; n += NR) {
    const float* wn = w + n * k_dim;
    const float* next = n + 2 * NR <= n1 ? wn + NR * k_dim : nullptr;
    for (int64_t m = 0; m < m_rows; m += kMaxMr) {
      const float* xm = x + m * k_dim;
      float* ym = y + m * n_dim + n;
      const float* pf = m == 0 ? next : nullptr;  // prefetched during the first pass only
      // cases above kMaxMr never run for this NR; their `: 1` only keeps them from instantiating big tiles
      switch (std::min<int64_t>(kMaxMr, m_rows - m)) {
        case 1: Tile<NR, 1>(xm, wn, ym, k_dim, n_dim, pf); break;
        case 2: Tile<NR, 2>(xm, wn, ym, k_dim, n_dim, pf); break;
        case 3: Tile<NR, 3>(xm, wn, ym, k_dim, n_dim, pf); break;
        case 4: Tile<NR, (kMaxMr >= 4 ? 4 : 1)>(xm, wn, ym, k_dim, n_dim, pf); break;
        case 5: Tile<NR, (kMaxMr >= 5 ? 5 : 1)>(xm, wn, ym, k_dim, n_dim, pf); break;
        default: Tile<NR, (kMaxMr >= 6 ? 6 : 1)>(xm, wn, ym, k_dim, n_dim, pf); break;
      }
    }
  }
}

// Rows n0..n1 of the output for every activation row: each weight byte comes from memory once.
__attribute__((target("avx2,fma"))) void BlockAvx2(const float* x, const float* w, float* y, int64_t m_rows,
                                                   int64_t k_dim, int64_t n_dim, int64_t n0, int64_t n1) {
  // The vector tiles cover whole blocks of 4 rows whatever NR is, so the rows left to the scalar tail (whose
  // summation order differs) do not depend on M: a row's result is the same bit for bit at any M.
  const int64_t n4 = n0 + ((n1 - n0) & ~int64_t{3});
  if (m_rows <= 3) {
    Rows<4>(x, w, y, m_rows, k_dim, n_dim, n0, n4);
  } else {
    Rows<2>(x, w, y, m_rows, k_dim, n_dim, n0, n4);
  }
  if (n4 < n1) BlockGeneric(x, w, y, m_rows, k_dim, n_dim, n4, n1);  // N tail (< 4 rows)
}

using BlockFn = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t, int64_t);

BlockFn SelectBlock() { return tlt::HasAvx2Fma() ? BlockAvx2 : BlockGeneric; }

ffi::Error SmallMLinearImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
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

  static const BlockFn block = SelectBlock();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // About 8 chunks per thread for balance, each a multiple of 4 rows (the kernel's row block).
  int64_t chunk_rows = (n_dim + 8 * threads - 1) / (8 * threads);
  chunk_rows = std::max<int64_t>(16, (chunk_rows + 3) & ~int64_t{3});
  const int64_t num_chunks = (n_dim + chunk_rows - 1) / chunk_rows;
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  tlt::ParallelFor(pool, num_chunks, [=](int64_t c) {
    const int64_t n0 = c * chunk_rows;
    block(xp, wp, yp, m_rows, k_dim, n_dim, n0, std::min(n_dim, n0 + chunk_rows));
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TltSmallMLinear, SmallMLinearImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
