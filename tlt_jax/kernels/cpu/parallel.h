// Parallel-for over XLA's intra-op thread pool for the CPU FFI kernels, with helpers that stay warm.
//
// Waking a sleeping pool thread costs tens of microseconds, about the time one of a decode step's ~120 small
// matmuls takes; so a helper, once scheduled, spins for a short while (TLT_CPU_KERNEL_SPIN_US, default 50)
// looking for the next published job before it gives its pool thread back. The calling thread always works
// on its own job too and only waits for chunks that a running helper has already claimed, so a call never
// depends on a pool task that has not started (no deadlock when the pool is busy or has one thread).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace tlt {

// One call's work, shared (by reference count) between the caller and the helpers: a helper that arrives
// after the call has returned finds no chunk left and only drops its reference.
struct Job {
  std::function<void(int64_t)> chunk;
  int64_t num_chunks = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Work() {
    for (;;) {
      const int64_t c = next.fetch_add(1, std::memory_order_relaxed);
      if (c >= num_chunks) return;
      chunk(c);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

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
  }  // the previous job (if any) is released here, outside the lock
};

inline Board& GetBoard() {
  static Board* b = new Board();  // never destroyed: helpers may outlive static destruction
  return *b;
}

inline int64_t SpinMicros() {
  static const int64_t us = [] {
    const char* env = std::getenv("TLT_CPU_KERNEL_SPIN_US");
    return env ? std::max<int64_t>(0, std::atoll(env)) : int64_t{50};
  }();
  return us;
}

inline void HelperLoop() {
  Board& b = GetBoard();
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

// Runs chunk(c) for c in [0, num_chunks) on the calling thread and up to pool.num_threads() - 1 helpers.
inline void ParallelFor(xla::ffi::ThreadPool& pool, int64_t num_chunks, std::function<void(int64_t)> chunk) {
  if (num_chunks <= 0) return;
  auto job = std::make_shared<Job>();
  job->chunk = std::move(chunk);
  job->num_chunks = num_chunks;
  const int want = static_cast<int>(std::min<int64_t>(std::max<int64_t>(1, pool.num_threads()), num_chunks) - 1);
  if (want > 0) {
    Board& b = GetBoard();
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
  while (job->done.load(std::memory_order_acquire) < job->num_chunks) _mm_pause();
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

inline bool HasAvx2Fma() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return ok;
}

}  // namespace tlt
