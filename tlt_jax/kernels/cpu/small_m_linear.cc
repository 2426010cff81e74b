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
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>

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

__attribute__((target("avx2,fma"))) inline float HSum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  __m128 sh = _mm_movehdup_ps(lo);
  __m128 s = _mm_add_ps(lo, sh);
  sh = _mm_movehl_ps(sh, s);
  s = _mm_add_ss(s, sh);
  return _mm_cvtss_f32(s);
}

// AVX2 + FMA micro-kernel: 4 weight rows x MR activation rows (4 * MR accumulators in registers), K in
// steps of 8, the K % 8 tail in scalar code.
template <int MR>
__attribute__((target("avx2,fma"), always_inline)) inline void Tile4(const float* x, const float* w, float* y,
                                                                      int64_t k_dim, int64_t n_dim) {
  const int64_t k8 = k_dim & ~int64_t{7};
  const float* wr[4] = {w, w + k_dim, w + 2 * k_dim, w + 3 * k_dim};
  __m256 acc[4][MR];
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j)
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) acc[j][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < k8; k += 8) {
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
      float s = HSum(acc[j][r]);
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
    for (; m + 3 <= m_rows; m += 3) Tile4<3>(x + m * k_dim, wn, y + m * n_dim + n, k_dim, n_dim);
    if (m_rows - m == 2) Tile4<2>(x + m * k_dim, wn, y + m * n_dim + n, k_dim, n_dim);
    if (m_rows - m == 1) Tile4<1>(x + m * k_dim, wn, y + m * n_dim + n, k_dim, n_dim);
  }
  if (n < n1) BlockGeneric(x, w, y, m_rows, k_dim, n_dim, n, n1);  // N tail (< 4 rows)
}

using BlockFn = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t, int64_t);

BlockFn SelectBlock() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return BlockAvx2;
  return BlockGeneric;
}

// One call's work, shared (by reference count) between the calling thread and the helpers: a helper that
// arrives after the call has returned finds no chunk left and only drops its reference.
struct Job {
  const float* x;
  const float* w;
  float* y;
  int64_t m_rows, k_dim, n_dim, chunk_rows, num_chunks;
  BlockFn block;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Work() {
    for (;;) {
      const int64_t c = next.fetch_add(1, std::memory_order_relaxed);
      if (c >= num_chunks) return;
      const int64_t n0 = c * chunk_rows;
      block(x, w, y, m_rows, k_dim, n_dim, n0, std::min(n_dim, n0 + chunk_rows));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Helpers stay warm between calls. Waking a sleeping pool thread costs tens of microseconds, about the time
// one of a decode step's ~120 small matmuls takes; so a helper, once scheduled, spins for a short while
// looking for the next published job before it gives its pool thread back.
struct Board {
  std::atomic<uint64_t> epoch{0};
  std::atomic<int> spinning{0};
  std::atomic_flag lock = ATOMIC_FLAG_INIT;
  std::shared_ptr<Job> current;

  std::shared_ptr<Job> Get() {
    while (lock.test_and_set(std::memory_order_acquire)) _mm_pause();
    std::shared_ptr<Job> j = current;
    lock.clear(std::memory_order_release);
    return j;
  }
  void Set(std::shared_ptr<Job> j) {
    while (lock.test_and_set(std::memory_order_acquire)) _mm_pause();
    current.swap(j);
    lock.clear(std::memory_order_release);
  }  // the old job (if any) is released here, outside the lock
};

Board& board() {
  static Board* b = new Board();  // never destroyed: helpers may outlive static destruction
  return *b;
}

int64_t SpinMicros() {
  static const int64_t us = [] {
    const char* env = std::getenv("TLT_SMALL_M_LINEAR_SPIN_US");
    return env ? std::max<int64_t>(0, std::atoll(env)) : int64_t{50};
  }();
  return us;
}

void HelperLoop() {
  Board& b = board();
  using Clock = std::chrono::steady_clock;
  const auto spin = std::chrono::microseconds(SpinMicros());
  uint64_t seen = ~uint64_t{0};
  auto idle_since = Clock::now();
  for (int64_t i = 0;; ++i) {
    const uint64_t e = b.epoch.load(std::memory_order_acquire);
    if (e != seen) {
      seen = e;
      if (std::shared_ptr<Job> j = b.Get()) j->Work();
      idle_since = Clock::now();
      continue;
    }
    if ((i & 63) == 0 && Clock::now() - idle_since > spin) break;
    _mm_pause();
  }
  b.spinning.fetch_sub(1, std::memory_order_acq_rel);
}

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
  auto job = std::make_shared<Job>();
  job->x = x.typed_data();
  job->w = w.typed_data();
  job->y = y->typed_data();
  job->m_rows = m_rows;
  job->k_dim = k_dim;
  job->n_dim = n_dim;
  job->chunk_rows = chunk_rows;
  job->num_chunks = (n_dim + chunk_rows - 1) / chunk_rows;
  job->block = block;

  const int want = static_cast<int>(std::min(threads, job->num_chunks) - 1);
  if (want > 0) {
    Board& b = board();
    b.Set(job);
    b.epoch.fetch_add(1, std::memory_order_acq_rel);
    int s = b.spinning.load(std::memory_order_acquire);
    while (s < want) {
      if (b.spinning.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel)) {
        pool.Schedule([] { HelperLoop(); });
        ++s;
      }
    }
  }
  job->Work();
  // Only chunks already claimed by running helpers can be outstanding: this wait never depends on a task
  // that has not started.
  while (job->done.load(std::memory_order_acquire) < job->num_chunks) _mm_pause();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TltSmallMLinear, SmallMLinearImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
