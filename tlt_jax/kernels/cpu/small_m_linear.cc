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

// AVX2 + FMA micro-kernel: 4 weight rows x MR activation rows (4 * MR accumulators in registers), K in
// steps of 8, the K % 8 tail in scalar code.
template <int MR>
__attribute__((target("avx2,fma"), always_inline)) inline void Tile4(const float* x, const float* w, float* y,
                                                                      int64_t k_dim, int64_t n_dim,
                                                                      const float* next) {
  const int64_t k8 = k_dim & ~int64_t{7};
  const float* wr[4] = {w, w + k_dim, w + 2 * k_dim, w + 3 * k_dim};
  __m256 acc[4][MR];
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j)
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) acc[j][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < k8; k += 8) {
    if (next != nullptr && (k & 15) == 0) {
      // Software prefetch of the next tile's rows at the same offset (4 * K floats ahead): decoding is
      // bound by DRAM latency as much as bandwidth, and the hardware prefetcher alone leaves it idle.
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) _mm_prefetch(reinterpret_cast<const char*>(next + j * k_dim + k), _MM_HINT_T0);
    }
    __m256 xv[MR];
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) xv[r] = _mm256_loadu_ps(x + r * k_dim + k);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m256 v = _mm256_loadu_ps(wr[j] + k);
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) acc[j][r] = _mm256_fmadd_ps(xv[r], v, acc[j][r]);
    }
  }
  for (int j = 0; j < 4; ++j) {
    for (int r = 0; r < MR; ++r) {
      float s = tlt::HSum(acc[j][r]);
      for (int64_t k = k8; k < k_dim; ++k) s += x[r * k_dim + k] * wr[j][k];
      y[r * n_dim + j] = s;
    }
  }
}

// Rows n0..n1 of the output for every activation row. The 4 weight rows of a tile (4 * K * 4 bytes,
// <= 24 KiB for K <= 1536) stay in L1 while the activation rows pass over them in groups of 3, so each
// weight byte comes from memory once.
__attribute__((target("avx2,fma"))) void BlockAvx2(const float* x, const float* w, float* y, int64_t m_rows,
                                                   int64_t k_dim, int64_t n_dim, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    const float* wn = w + n * k_dim;
    int64_t m = 0;
    const float* next = n + 8 <= n1 ? wn + 4 * k_dim : nullptr;  // prefetched during the first pass only
    for (; m + 3 <= m_rows; m += 3) {
      Tile4<3>(x + m * k_dim, wn, y + m * n_dim + n, k_dim, n_dim, m == 0 ? next : nullptr);
    }
    if (m_rows - m == 2) Tile4<2>(x + m * k_dim, wn, y + m * n_dim + n, k_dim, n_dim, m == 0 ? next : nullptr);
    if (m_rows - m == 1) Tile4<1>(x + m * k_dim, wn, y + m * n_dim + n, k_dim, n_dim, m == 0 ? next : nullptr);
  }
  if (n < n1) BlockGeneric(x, w, y, m_rows, k_dim, n_dim, n, n1);  // N tail (< 4 rows)
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
