// Decode and verify attention over a row's K/V cache: out[b, t, k, g] = softmax(q . K^T) V over the
// slots query (t, g) sees, for T new tokens per row (1 for a step, k + 1 for a verify, a tree's
// nodes) against float32 buffers [B, K, S, H].
//
// Which slots a query sees is one rule for a chain and a tree (flash_decode.mask_visible): slot s
// is seen when s < start[b], or when s - start[b] < M and visible[b, t, s - start[b]]; a causal
// step or verify passes start = the row's length and visible = "m <= t".
//
// Each query is computed alone, from the list of the slots it sees in slot order: their scores,
// the max, exp and sum, then the weighted values, each in that order. So a query's result depends
// on the slots it sees and nothing else: the same bits in a 1-token step, a 5-token verify, a tree
// verify (whose accepted path is later moved to contiguous slots in the same order), any batch,
// any thread count. Unseen slots are skipped, not masked, so a step reads only the row's length.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "common.h"

namespace jaxspec_cpu {
namespace {

// expf for x <= 0 as a fixed sequence of fused multiply-adds (Cephes' range reduction and
// polynomial, about 1 ulp), written once per path with the same operations, so every path gets
// the same bits. Below -87.3 the result (under float's smallest normal) is 0.
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;
constexpr float kExpFloor = -87.33654f;
constexpr float kExpTerms[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

float exp_scalar(float x) {
  if (!(x >= kExpFloor)) return 0.0f;
  const float n = std::nearbyint(x * kLog2e);
  float r = std::fma(n, -kLn2High, x);
  r = std::fma(n, -kLn2Low, r);
  float p = kExpTerms[0];
  for (int i = 1; i < 6; ++i) p = std::fma(p, r, kExpTerms[i]);
  const float y = std::fma(p, r * r, r) + 1.0f;
  return y * std::ldexp(1.0f, static_cast<int>(n));
}

__attribute__((target("avx2,fma"))) __m256 exp_avx2(__m256 x) {
  const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(kExpFloor), _CMP_GE_OQ);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2High), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Low), r);
  __m256 p = _mm256_set1_ps(kExpTerms[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpTerms[i]));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  // 2^n for n in [-126, 127] (x >= -87.3 keeps n >= -126), by its exponent bits.
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(bits)), keep);
}

__attribute__((target("avx512f"))) __m512 exp_avx512(__m512 x) {
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpFloor), _CMP_GE_OQ);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2High), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Low), r);
  __m512 p = _mm512_set1_ps(kExpTerms[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpTerms[i]));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(keep, y, _mm512_castsi512_ps(bits));
}

// The scalar path (and any head width the vector paths' lanes do not divide): one query against
// the `count` slots it sees (`slots`, ascending), out[H] = softmax(q . K) V, every loop in slot
// order. `scores` is scratch for `count` floats.
void query_scalar(const float* q, const float* keys, const float* values, const int32_t* slots, int64_t count,
                  int64_t head_dim, float* scores, float* out) {
  float top = -INFINITY;
  for (int64_t i = 0; i < count; ++i) {
    const float* key = keys + slots[i] * head_dim;
    float dot = 0.0f;
    for (int64_t h = 0; h < head_dim; ++h) dot = std::fma(q[h], key[h], dot);
    scores[i] = dot;
    top = std::fmax(top, dot);
  }
  float sum = 0.0f;
  for (int64_t i = 0; i < count; ++i) sum += (scores[i] = exp_scalar(scores[i] - top));
  for (int64_t h = 0; h < head_dim; ++h) {
    float acc = 0.0f;
    for (int64_t i = 0; i < count; ++i) acc = std::fma(scores[i], values[slots[i] * head_dim + h], acc);
    out[h] = count ? acc / sum : 0.0f;
  }
}

// The vector paths take the `group` queries of one (row, token, kv head) together: each key and
// value row is loaded once for all of them, and their multiply-add chains interleave. A query's
// own arithmetic is fixed: its dot with a key in one chain per vector of H then one lane sum, the
// exps vectorized over consecutive entries of its score list, its output one chain per vector of
// H over the slots in order. Scratch: scores [G, count], sums [G].

__attribute__((target("avx2,fma"))) float lane_sum_avx2(__m256 v) {
  // Lanes summed as (0+4, 1+5, 2+6, 3+7), then pairs, then the last two: one fixed order.
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
}

// exp(score - max) in place over one query's scores; returns their sum.
__attribute__((target("avx2,fma"))) float softmax_avx2(float* scores, int64_t count) {
  float top = -INFINITY;
  for (int64_t i = 0; i < count; ++i) top = std::fmax(top, scores[i]);
  const __m256 top8 = _mm256_set1_ps(top);
  __m256 sums = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(scores + i), top8));
    _mm256_storeu_ps(scores + i, e);
    sums = _mm256_add_ps(sums, e);
  }
  float sum = lane_sum_avx2(sums);
  for (; i < count; ++i) sum += (scores[i] = exp_scalar(scores[i] - top));
  return sum;
}

__attribute__((target("avx512f"))) float softmax_avx512(float* scores, int64_t count) {
  float top = -INFINITY;
  for (int64_t i = 0; i < count; ++i) top = std::fmax(top, scores[i]);
  const __m512 top16 = _mm512_set1_ps(top);
  __m512 sums = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) {
    const __m512 e = exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(scores + i), top16));
    _mm512_storeu_ps(scores + i, e);
    sums = _mm512_add_ps(sums, e);
  }
  float sum = _mm512_reduce_add_ps(sums);
  for (; i < count; ++i) sum += (scores[i] = exp_scalar(scores[i] - top));
  return sum;
}

// q . k for GN queries q [GN, H] against each seen key -> scores [GN, count]. H a multiple of the lanes.
template <int GN>
__attribute__((target("avx2,fma"))) void scores_avx2(const float* q, const float* keys, const int32_t* slots,
                                                     int64_t count, int64_t head_dim, float* scores) {
  for (int64_t i = 0; i < count; ++i) {
    const float* key = keys + slots[i] * head_dim;
    __m256 acc[GN];
    for (int g = 0; g < GN; ++g) acc[g] = _mm256_setzero_ps();
    for (int64_t h = 0; h < head_dim; h += 8) {
      const __m256 k = _mm256_loadu_ps(key + h);
      for (int g = 0; g < GN; ++g) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * head_dim + h), k, acc[g]);
    }
    for (int g = 0; g < GN; ++g) scores[g * count + i] = lane_sum_avx2(acc[g]);
  }
}

// Four slots' 16-lane dots summed at once: each output lane is one slot's lanes summed in one
// fixed tree (halves, then adjacent pairs twice, then 128-bit halves), whatever the other three
// hold, so a slot's score does not depend on its neighbours in the block.
__attribute__((target("avx512f"))) __m256 fold_avx512(__m512 a) {  // lanes i + (i + 8)
  return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

__attribute__((target("avx512f"))) __m128 lane_sums4_avx512(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const auto fold = fold_avx512;
  const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(fold(a0), fold(a1)), _mm256_hadd_ps(fold(a2), fold(a3)));
  return _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
}

template <int GN>
__attribute__((target("avx512f"))) void scores_avx512(const float* q, const float* keys, const int32_t* slots,
                                                      int64_t count, int64_t head_dim, float* scores) {
  for (int64_t i = 0; i < count; i += 4) {
    const int64_t here = std::min<int64_t>(4, count - i);
    __m512 acc[GN][4];
    for (int g = 0; g < GN; ++g)
      for (int s = 0; s < 4; ++s) acc[g][s] = _mm512_setzero_ps();
    for (int64_t h = 0; h < head_dim; h += 16) {
      for (int s = 0; s < here; ++s) {
        const __m512 k = _mm512_loadu_ps(keys + slots[i + s] * head_dim + h);
        for (int g = 0; g < GN; ++g) acc[g][s] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * head_dim + h), k, acc[g][s]);
      }
    }
    for (int g = 0; g < GN; ++g) {
      float dots[4];
      _mm_storeu_ps(dots, lane_sums4_avx512(acc[g][0], acc[g][1], acc[g][2], acc[g][3]));
      for (int s = 0; s < here; ++s) scores[g * count + i + s] = dots[s];
    }
  }
}

// out[g, h0 : h0 + NV vectors] = sum_j p[g, j] v[slot_j, ...] / sums[g], for GN queries.
template <int GN, int NV>
__attribute__((target("avx2,fma"))) void values_avx2(const float* values, const int32_t* slots, int64_t count,
                                                     int64_t head_dim, int64_t h0, const float* probs,
                                                     const float* sums, float* out) {
  __m256 acc[GN][NV];
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < NV; ++c) acc[g][c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < count; ++j) {
    const float* row = values + slots[j] * head_dim + h0;
    __m256 v[NV];
    for (int c = 0; c < NV; ++c) v[c] = _mm256_loadu_ps(row + 8 * c);
    for (int g = 0; g < GN; ++g) {
      const __m256 p = _mm256_set1_ps(probs[g * count + j]);
      for (int c = 0; c < NV; ++c) acc[g][c] = _mm256_fmadd_ps(p, v[c], acc[g][c]);
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < NV; ++c)
      _mm256_storeu_ps(out + g * head_dim + h0 + 8 * c,
                       count ? _mm256_div_ps(acc[g][c], _mm256_set1_ps(sums[g])) : _mm256_setzero_ps());
}

template <int GN, int NV>
__attribute__((target("avx512f"))) void values_avx512(const float* values, const int32_t* slots, int64_t count,
                                                       int64_t head_dim, int64_t h0, const float* probs,
                                                       const float* sums, float* out) {
  __m512 acc[GN][NV];
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < NV; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < count; ++j) {
    const float* row = values + slots[j] * head_dim + h0;
    __m512 v[NV];
    for (int c = 0; c < NV; ++c) v[c] = _mm512_loadu_ps(row + 16 * c);
    for (int g = 0; g < GN; ++g) {
      const __m512 p = _mm512_set1_ps(probs[g * count + j]);
      for (int c = 0; c < NV; ++c) acc[g][c] = _mm512_fmadd_ps(p, v[c], acc[g][c]);
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < NV; ++c)
      _mm512_storeu_ps(out + g * head_dim + h0 + 16 * c,
                       count ? _mm512_div_ps(acc[g][c], _mm512_set1_ps(sums[g])) : _mm512_setzero_ps());
}

// Queries per block (registers: GN x 4 accumulators) and vectors of H per block of the output.
constexpr int64_t kQueryBlock512 = 4, kQueryBlock256 = 2, kValueVectors = 4;

// Runs `call(std::integral_constant<int, N>{})` for a runtime n in [1, 4].
template <typename Call>
void with_count(int64_t n, Call&& call) {
  switch (n) {
    case 1: return call(std::integral_constant<int, 1>{});
    case 2: return call(std::integral_constant<int, 2>{});
    case 3: return call(std::integral_constant<int, 3>{});
    default: return call(std::integral_constant<int, 4>{});
  }
}

// One (row, token, kv head) on a vector path: q [G, H] (scaled), out [G, H].
void head_vector(bool wide, const float* q, const float* keys, const float* values, const int32_t* slots,
                 int64_t count, int64_t group, int64_t head_dim, float* scores, float* sums, float* out) {
  const int64_t query_block = wide ? kQueryBlock512 : kQueryBlock256, lanes = wide ? 16 : 8;
  for (int64_t g0 = 0; g0 < group; g0 += query_block)
    with_count(std::min(query_block, group - g0), [&](auto gn) {
      constexpr int GN = decltype(gn)::value;
      if (wide) scores_avx512<GN>(q + g0 * head_dim, keys, slots, count, head_dim, scores + g0 * count);
      else scores_avx2<GN>(q + g0 * head_dim, keys, slots, count, head_dim, scores + g0 * count);
    });
  for (int64_t g = 0; g < group; ++g)
    sums[g] = wide ? softmax_avx512(scores + g * count, count) : softmax_avx2(scores + g * count, count);
  for (int64_t g0 = 0; g0 < group; g0 += query_block)
    for (int64_t h0 = 0; h0 < head_dim; h0 += kValueVectors * lanes)
      with_count(std::min(query_block, group - g0), [&](auto gn) {
        with_count(std::min(kValueVectors, (head_dim - h0) / lanes), [&](auto nv) {
          constexpr int GN = decltype(gn)::value, NV = decltype(nv)::value;
          if (wide)
            values_avx512<GN, NV>(values, slots, count, head_dim, h0, scores + g0 * count, sums + g0, out + g0 * head_dim);
          else
            values_avx2<GN, NV>(values, slots, count, head_dim, h0, scores + g0 * count, sums + g0, out + g0 * head_dim);
        });
      });
}

// Below this many multiply-adds a call stays on one thread: handing out work costs more.
constexpr int64_t kThreadedWork = 1 << 18;

ffi::Error AttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> keys,
                         ffi::Buffer<ffi::F32> values, ffi::Buffer<ffi::S32> start, ffi::Buffer<ffi::PRED> visible,
                         ffi::ResultBuffer<ffi::F32> out, float scale, int64_t isa, int64_t threads) {
  if (ffi::Error error = check_isa(isa); error.failure()) return error;
  const auto qd = q.dimensions(), kd = keys.dimensions(), vd = values.dimensions();
  const auto sd = start.dimensions(), md = visible.dimensions(), od = out->dimensions();
  if (qd.size() != 5 || kd.size() != 4 || vd.size() != 4 || sd.size() != 1 || md.size() != 3 || od.size() != 5 ||
      kd[0] != qd[0] || kd[1] != qd[2] || kd[3] != qd[4] || vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2] ||
      vd[3] != kd[3] || sd[0] != qd[0] || md[0] != qd[0] || md[1] != qd[1])
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "attention: expected q[B, T, K, G, H], keys and values [B, K, S, H], start[B], "
                      "visible[B, T, M]");
  for (size_t d = 0; d < 5; ++d)
    if (od[d] != qd[d]) return ffi::Error(ffi::ErrorCode::kInvalidArgument, "attention: out must be q's shape");
  const int64_t batch = qd[0], steps = qd[1], kv_heads = qd[2], group = qd[3], head_dim = qd[4];
  const int64_t capacity = kd[2], window = md[2];
  if (batch * steps * kv_heads * group * head_dim == 0) return ffi::Error::Success();
  const float* query_data = q.typed_data();
  const float* key_data = keys.typed_data();
  const float* value_data = values.typed_data();
  const int32_t* starts = start.typed_data();
  const bool* seen = visible.typed_data();
  float* result = out->typed_data();

  // Slots query t of row b sees: [0, start) then the window's visible ones, ascending.
  auto visible_slots = [&](int64_t b, int64_t t, int32_t* slots) -> int64_t {
    const int64_t first = std::min<int64_t>(std::max<int64_t>(starts[b], 0), capacity);
    int64_t count = 0;
    for (int64_t s = 0; s < first; ++s) slots[count++] = static_cast<int32_t>(s);
    const bool* row = seen + (b * steps + t) * window;
    for (int64_t m = 0; m < window && first + m < capacity; ++m)
      if (row[m]) slots[count++] = static_cast<int32_t>(first + m);
    return count;
  };
  // The widest vector path H fits (a multiple of its lanes), else the scalar one: a shape always
  // takes the same path on a machine, so its bits never depend on the call.
  const bool avx512 = (isa == kAvx512 || isa == kAvx512Vnni) && head_dim % 16 == 0;
  const bool avx2 = !avx512 && isa != kScalar && head_dim % 8 == 0;
  const int64_t work = batch * steps * kv_heads * group * capacity * head_dim;
  // A unit is one (row, token, kv head): its G queries read the same slots.
  parallel_units(pool, batch * steps * kv_heads, 1, work < kThreadedWork ? 1 : threads, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> slots(static_cast<size_t>(capacity));
    std::vector<float> scores(static_cast<size_t>(group * capacity)), sums(static_cast<size_t>(group));
    std::vector<float> scaled(static_cast<size_t>(group * head_dim));
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t b = unit / (steps * kv_heads), t = unit / kv_heads % steps, k = unit % kv_heads;
      const int64_t count = visible_slots(b, t, slots.data());
      const int64_t cache_offset = (b * kv_heads + k) * capacity * head_dim;
      const int64_t offset = ((b * steps + t) * kv_heads + k) * group * head_dim;  // the G query rows
      for (int64_t i = 0; i < group * head_dim; ++i) scaled[i] = query_data[offset + i] * scale;
      if (avx512 || avx2) {
        head_vector(avx512, scaled.data(), key_data + cache_offset, value_data + cache_offset, slots.data(), count,
                    group, head_dim, scores.data(), sums.data(), result + offset);
      } else {
        for (int64_t g = 0; g < group; ++g)
          query_scalar(scaled.data() + g * head_dim, key_data + cache_offset, value_data + cache_offset, slots.data(),
                       count, head_dim, scores.data(), result + offset + g * head_dim);
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxspec_cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxspec_attention, jaxspec_cpu::AttentionImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // q [B, T, K, G, H]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // keys [B, K, S, H]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // values [B, K, S, H]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // start [B]
                                  .Arg<xla::ffi::Buffer<xla::ffi::PRED>>()  // visible [B, T, M]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // out [B, T, K, G, H]
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("isa")
                                  .Attr<int64_t>("threads"));
