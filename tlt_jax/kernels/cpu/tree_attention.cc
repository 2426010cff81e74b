// Tree attention for XLA:CPU (the contract of tlt_jax/kernels/tree_attention.py): the T new tokens of row b
// attend to the committed prefix [0, lengths[b]) and to the new tokens their tree mask allows, whose K/V are
// already in the cache at [lengths[b], lengths[b] + T).
//
// Why: XLA:CPU runs decode/verify attention as many tiny batched dots plus mask/softmax ops and a transposed
// copy of the V cache per layer: 3-5 GB/s, 112 of ~180 ms of a batch-16 decode step at cache 512
// (docs/benchmarks.md). This kernel reads each (row, KV head)'s keys and values once for all the G query heads
// of the group and all T new tokens, only up to the row's live length, with (row, KV head) pairs spread over
// XLA's intra-op thread pool. Softmax in float32; masked positions are skipped, not added as -inf.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Aliases: a type with a comma cannot appear inside the handler-definition macro.
using F32x4 = ffi::Buffer<ffi::F32, 4>;
using S32x1 = ffi::Buffer<ffi::S32, 1>;
using PREDx3 = ffi::Buffer<ffi::PRED, 3>;
using OutF32x4 = ffi::ResultBuffer<ffi::F32, 4>;

__attribute__((target("avx2,fma"))) float DotAvx2(const float* a, const float* b, int64_t d) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = tlt::HSum(acc);
  for (; i < d; ++i) s += a[i] * b[i];
  return s;
}

float DotGeneric(const float* a, const float* b, int64_t d) {
  float s = 0.f;
  for (int64_t i = 0; i < d; ++i) s += a[i] * b[i];
  return s;
}

__attribute__((target("avx2,fma"))) void AxpyAvx2(float alpha, const float* x, float* y, int64_t d) {
  const __m256 a = _mm256_set1_ps(alpha);
  int64_t i = 0;
  for (; i + 8 <= d; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(a, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < d; ++i) y[i] += alpha * x[i];
}

void AxpyGeneric(float alpha, const float* x, float* y, int64_t d) {
  for (int64_t i = 0; i < d; ++i) y[i] += alpha * x[i];
}

struct Shapes {
  int64_t b, t, hq, hkv, g, s, d;
};

// One (batch row, KV head): scores of its T*G query rows against the visible keys, softmax, weighted values.
void AttendOne(const Shapes& sh, int64_t bi, int64_t h, const float* q, const float* k, const float* v,
               const int32_t* lengths, const bool* mask, float* out) {
  const bool avx = tlt::HasAvx2Fma();
  auto dot = avx ? DotAvx2 : DotGeneric;
  auto axpy = avx ? AxpyAvx2 : AxpyGeneric;
  const int64_t len = std::clamp<int64_t>(lengths[bi], 0, sh.s);
  const int64_t n = std::min<int64_t>(sh.s, len + sh.t);  // keys that can be visible: prefix + tree
  const int64_t rows = sh.t * sh.g;
  const float scale = 1.0f / std::sqrt(static_cast<float>(sh.d));
  const float* kh = k + (bi * sh.hkv + h) * sh.s * sh.d;
  const float* vh = v + (bi * sh.hkv + h) * sh.s * sh.d;
  thread_local std::vector<float> scores;
  scores.assign(static_cast<size_t>(rows * std::max<int64_t>(n, 1)), 0.f);
  constexpr float kMasked = -std::numeric_limits<float>::infinity();
  // pass 1: every key once, against all query rows of this group (the rows' q stay in L1)
  for (int64_t j = 0; j < n; ++j) {
    const float* kj = kh + j * sh.d;
    for (int64_t t = 0; t < sh.t; ++t) {
      const bool vis = j < len || mask[(bi * sh.t + t) * sh.t + (j - len)];
      for (int64_t gi = 0; gi < sh.g; ++gi) {
        const float* qr = q + ((bi * sh.t + t) * sh.hq + h * sh.g + gi) * sh.d;
        scores[(t * sh.g + gi) * n + j] = vis ? dot(qr, kj, sh.d) * scale : kMasked;
      }
    }
  }
  // pass 2: softmax and the weighted sum of values, per query row
  for (int64_t t = 0; t < sh.t; ++t) {
    for (int64_t gi = 0; gi < sh.g; ++gi) {
      float* sr = scores.data() + (t * sh.g + gi) * n;
      float* o = out + ((bi * sh.t + t) * sh.hq + h * sh.g + gi) * sh.d;
      std::fill(o, o + sh.d, 0.f);
      float mx = kMasked;
      for (int64_t j = 0; j < n; ++j) mx = std::max(mx, sr[j]);
      if (mx == kMasked) {
        // Nothing visible (only padding rows): the reference's softmax over all-equal masked scores is
        // uniform over the whole cache bucket; match it.
        for (int64_t j = 0; j < sh.s; ++j) axpy(1.0f / static_cast<float>(sh.s), vh + j * sh.d, o, sh.d);
        continue;
      }
      float sum = 0.f;
      for (int64_t j = 0; j < n; ++j) {
        const float p = sr[j] == kMasked ? 0.f : std::exp(sr[j] - mx);
        sr[j] = p;
        sum += p;
      }
      const float inv = 1.0f / sum;
      for (int64_t j = 0; j < n; ++j)
        if (sr[j] != 0.f) axpy(sr[j] * inv, vh + j * sh.d, o, sh.d);
    }
  }
}

ffi::Error TreeAttentionImpl(ffi::ThreadPool pool, F32x4 q, F32x4 k, F32x4 v, S32x1 lengths, PREDx3 mask,
                             OutF32x4 out) {
  const auto qd = q.dimensions(), kd = k.dimensions();
  Shapes sh{qd[0], qd[1], qd[2], kd[1], 0, kd[2], qd[3]};
  if (kd[0] != sh.b || kd[3] != sh.d || sh.hkv == 0 || sh.hq % sh.hkv != 0)
    return ffi::Error::InvalidArgument("tree_attention: need q [B,T,Hq,D], k/v [B,Hkv,S,D] with Hkv | Hq");
  if (v.dimensions()[0] != sh.b || v.dimensions()[1] != sh.hkv || v.dimensions()[2] != sh.s ||
      v.dimensions()[3] != sh.d)
    return ffi::Error::InvalidArgument("tree_attention: v must have k's shape");
  if (lengths.dimensions()[0] != sh.b || mask.dimensions()[0] != sh.b || mask.dimensions()[1] != sh.t ||
      mask.dimensions()[2] != sh.t)
    return ffi::Error::InvalidArgument("tree_attention: need lengths [B] and tree_mask [B,T,T]");
  sh.g = sh.hq / sh.hkv;
  const float* qp = q.typed_data();
  const float* kp = k.typed_data();
  const float* vp = v.typed_data();
  const int32_t* lp = lengths.typed_data();
  const bool* mp = reinterpret_cast<const bool*>(mask.typed_data());
  float* op = out->typed_data();
  tlt::ParallelFor(pool, sh.b * sh.hkv, [=](int64_t c) {
    AttendOne(sh, c / sh.hkv, c % sh.hkv, qp, kp, vp, lp, mp, op);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TltTreeAttention, TreeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<F32x4>()
                                  .Arg<F32x4>()
                                  .Arg<F32x4>()
                                  .Arg<S32x1>()
                                  .Arg<PREDx3>()
                                  .Ret<F32x4>());
