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

// One query against the `count` slots it sees (`slots`, ascending): out[H] = softmax(q . K) V.
// `scores` is scratch for `count` floats. Every loop runs in slot order, vectorized across H (the
// dot's lanes then summed in one fixed order) or across consecutive entries of `scores`.
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

__attribute__((target("avx2,fma"))) void query_avx2(const float* q, const float* keys, const float* values,
                                                    const int32_t* slots, int64_t count, int64_t head_dim,
                                                    float* scores, float* out) {
  const int64_t wide = head_dim - head_dim % 8;
  float top = -INFINITY;
  for (int64_t i = 0; i < count; ++i) {
    const float* key = keys + slots[i] * head_dim;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t h = 0; h < wide; h += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + h), _mm256_loadu_ps(key + h), acc);
    // Lanes summed as (0+4, 1+5, 2+6, 3+7), then pairs, then the last two: one fixed order.
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    float dot = _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
    for (int64_t h = wide; h < head_dim; ++h) dot = std::fma(q[h], key[h], dot);
    scores[i] = dot;
    top = std::fmax(top, dot);
  }
  const __m256 top8 = _mm256_set1_ps(top);
  __m256 sums = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(scores + i), top8));
    _mm256_storeu_ps(scores + i, e);
    sums = _mm256_add_ps(sums, e);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, sums);
  float sum = 0.0f;
  for (float lane : lanes) sum += lane;
  for (; i < count; ++i) sum += (scores[i] = exp_scalar(scores[i] - top));
  for (int64_t h = 0; h < wide; h += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t j = 0; j < count; ++j)
      acc = _mm256_fmadd_ps(_mm256_set1_ps(scores[j]), _mm256_loadu_ps(values + slots[j] * head_dim + h), acc);
    _mm256_storeu_ps(out + h, count ? _mm256_div_ps(acc, _mm256_set1_ps(sum)) : _mm256_setzero_ps());
  }
  for (int64_t h = wide; h < head_dim; ++h) {
    float acc = 0.0f;
    for (int64_t j = 0; j < count; ++j) acc = std::fma(scores[j], values[slots[j] * head_dim + h], acc);
    out[h] = count ? acc / sum : 0.0f;
  }
}

__attribute__((target("avx512f"))) void query_avx512(const float* q, const float* keys, const float* values,
                                                     const int32_t* slots, int64_t count, int64_t head_dim,
                                                     float* scores, float* out) {
  const int64_t wide = head_dim - head_dim % 16;
  float top = -INFINITY;
  for (int64_t i = 0; i < count; ++i) {
    const float* key = keys + slots[i] * head_dim;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t h = 0; h < wide; h += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + h), _mm512_loadu_ps(key + h), acc);
    float dot = _mm512_reduce_add_ps(acc);
    for (int64_t h = wide; h < head_dim; ++h) dot = std::fma(q[h], key[h], dot);
    scores[i] = dot;
    top = std::fmax(top, dot);
  }
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
  for (int64_t h = 0; h < wide; h += 16) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t j = 0; j < count; ++j)
      acc = _mm512_fmadd_ps(_mm512_set1_ps(scores[j]), _mm512_loadu_ps(values + slots[j] * head_dim + h), acc);
    _mm512_storeu_ps(out + h, count ? _mm512_div_ps(acc, _mm512_set1_ps(sum)) : _mm512_setzero_ps());
  }
  for (int64_t h = wide; h < head_dim; ++h) {
    float acc = 0.0f;
    for (int64_t j = 0; j < count; ++j) acc = std::fma(scores[j], values[slots[j] * head_dim + h], acc);
    out[h] = count ? acc / sum : 0.0f;
  }
}

void query(int64_t isa, const float* q, const float* keys, const float* values, const int32_t* slots, int64_t count,
           int64_t head_dim, float* scores, float* out) {
  switch (isa) {
    case kAvx512:
    case kAvx512Vnni: return query_avx512(q, keys, values, slots, count, head_dim, scores, out);
    case kAvx2: return query_avx2(q, keys, values, slots, count, head_dim, scores, out);
    default: return query_scalar(q, keys, values, slots, count, head_dim, scores, out);
  }
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
  const int64_t work = batch * steps * kv_heads * group * capacity * head_dim;
  // A unit is one (row, token): its slot list is shared by the K * G queries it holds.
  parallel_units(pool, batch * steps, 1, work < kThreadedWork ? 1 : threads, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> slots(static_cast<size_t>(capacity));
    std::vector<float> scores(static_cast<size_t>(capacity)), scaled(static_cast<size_t>(head_dim));
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t b = unit / steps, t = unit % steps;
      const int64_t count = visible_slots(b, t, slots.data());
      for (int64_t k = 0; k < kv_heads; ++k) {
        const int64_t cache_offset = (b * kv_heads + k) * capacity * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const int64_t offset = (((b * steps + t) * kv_heads + k) * group + g) * head_dim;
          for (int64_t h = 0; h < head_dim; ++h) scaled[h] = query_data[offset + h] * scale;
          query(isa, scaled.data(), key_data + cache_offset, value_data + cache_offset, slots.data(), count, head_dim,
                scores.data(), result + offset);
        }
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
