// The 4-bit product of jaxspec's q4 format: per row, blocks of 32 inputs, each a 4-bit code q in
// [0, 15] with a half-precision scale d and minimum m (w = q d + m: llama.cpp's Q4_1 values, not
// rotated), times activations quantized here per token and block, as llama.cpp's Q8_1 does: a
// block's scale s = max|x| / 127 (1 for an all-zero block), codes c = clamp(rint(x / s)):
//   y[o, n] = sum_b (d[o, b] s[b, n]) (q . c)_b + m[o, b] (s[b, n] sum_b c)
// Each block's integer dot is exact; the blocks are then added in input order, one fused
// multiply-add for the scale and one for the minimum per block, on every path: a result's bits do
// not depend on N, on the thread count or on the instruction set.
//
// W comes packed at load (jaxspec.cpu.packing.pack_q4): codes [G, NB, 256] bytes, a group of 16
// rows per block as 4 vectors of 64 bytes; byte 4 j + b of vector v holds row j's inputs
// 8 v + b (low nibble) and 8 v + 4 + b (high nibble), so masking and shifting a vector gives two
// [16 rows x 4 inputs] words for one broadcast token word each. Scales and minimums [G, NB, 16].
// Paths: VNNI's dpbusd multiplies the codes (unsigned) by the token's (signed) directly; AVX2
// (and AVX-512 without VNNI) use maddubs, whose pair sums (at most 2 x 15 x 127) fit int16.
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "common.h"

namespace jaxspec_cpu {
namespace {

// Groups per tile: 4 for one or two tokens (enough independent chains to hide the multiply-add
// latency), 2 beyond (registers: an accumulator per group and token).
constexpr int kTileGroups = 2;
constexpr int kTileGroupsNarrow = 4;
constexpr int64_t kBlock = 32;            // inputs per scale
constexpr int64_t kBlockBytes = 256;      // 16 rows x 32 nibbles
constexpr int64_t kVectorBytes = 64;

struct QuantizedTokens {
  int64_t blocks = 0;
  std::vector<int8_t> codes;         // [N, 32 NB], zero past I
  std::vector<float> block_scales;   // [N, NB]: s, each block's own
  std::vector<float> block_offsets;  // [N, NB]: s * (the sum of the block's codes), what a minimum multiplies
};

QuantizedTokens quantize_tokens(const float* x, int64_t in, int64_t tokens) {
  QuantizedTokens q;
  q.blocks = (in + kBlock - 1) / kBlock;
  q.codes.assign(static_cast<size_t>(tokens * q.blocks * kBlock), 0);
  q.block_scales.assign(static_cast<size_t>(tokens * q.blocks), 1.0f);
  q.block_offsets.assign(static_cast<size_t>(tokens * q.blocks), 0.0f);
  for (int64_t n = 0; n < tokens; ++n)
    for (int64_t b = 0; b < q.blocks; ++b) {
      const int64_t count = (b + 1) * kBlock < in ? kBlock : in - b * kBlock;
      int8_t* codes = q.codes.data() + (n * q.blocks + b) * kBlock;
      const float scale = quantize_int8(x + b * kBlock * tokens + n, count, tokens, codes);
      int32_t sum = 0;
      for (int64_t i = 0; i < count; ++i) sum += codes[i];
      q.block_scales[n * q.blocks + b] = scale;
      q.block_offsets[n * q.blocks + b] = scale * static_cast<float>(sum);
    }
  return q;
}

inline int32_t token_word(const QuantizedTokens& q, int64_t n, int64_t b, int64_t w) {
  return load_word(q.codes.data() + (n * q.blocks + b) * kBlock + 4 * w);
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal half: normalise
    exponent = 113;
    while (!(mantissa & 0x400u)) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
  }
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

struct Operands {
  int64_t isa, out, tokens, blocks;
  const uint8_t* codes;     // [G, NB, 256]
  const uint16_t* scales;   // [G, NB, 16] half
  const uint16_t* mins;     // [G, NB, 16] half
  const QuantizedTokens* q;
  float* y;
};

// Each tile leaves sums [GT][NT][16]: the outputs of GT groups for NT tokens.
template <int GT, int NT>
void tile_scalar(const Operands& op, int64_t g0, int64_t n0, float (*sums)[NT][kGroupRows]) {
  for (int g = 0; g < GT; ++g)
    for (int n = 0; n < NT; ++n)
      for (int64_t j = 0; j < kGroupRows; ++j) {
        float acc = 0.0f;
        for (int64_t b = 0; b < op.blocks; ++b) {
          const int64_t at = (g0 + g) * op.blocks + b;
          const uint8_t* block = op.codes + at * kBlockBytes;
          const int8_t* x = op.q->codes.data() + ((n0 + n) * op.blocks + b) * kBlock;
          int32_t dot = 0;
          for (int64_t v = 0; v < 4; ++v)
            for (int64_t k = 0; k < 4; ++k) {
              const uint8_t byte = block[v * kVectorBytes + 4 * j + k];
              dot += int32_t{byte & 0x0f} * x[8 * v + k] + int32_t{byte >> 4} * x[8 * v + 4 + k];
            }
          const int64_t token_block = (n0 + n) * op.blocks + b;
          const float scale = half_to_float(op.scales[at * kGroupRows + j]) * op.q->block_scales[token_block];
          acc = std::fma(static_cast<float>(dot), scale, acc);
          acc = std::fma(half_to_float(op.mins[at * kGroupRows + j]), op.q->block_offsets[token_block], acc);
        }
        sums[g][n][j] = acc;
      }
}

template <int GT, int NT>
__attribute__((target("avx2,fma,f16c"))) void tile_avx2(const Operands& op, int64_t g0, int64_t n0,
                                                        float (*sums)[NT][kGroupRows]) {
  __m256 lo[GT][NT], hi[GT][NT];  // rows 0-7 and 8-15
  for (int g = 0; g < GT; ++g)
    for (int n = 0; n < NT; ++n) lo[g][n] = hi[g][n] = _mm256_setzero_ps();
  const __m256i low_nibbles = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < op.blocks; ++b) {
    for (int g = 0; g < GT; ++g) {
      const int64_t at = (g0 + g) * op.blocks + b;
      const uint8_t* block = op.codes + at * kBlockBytes;
      __m256i dot_lo[NT], dot_hi[NT];
      for (int n = 0; n < NT; ++n) dot_lo[n] = dot_hi[n] = _mm256_setzero_si256();
      for (int64_t v = 0; v < 4; ++v) {
        for (int half = 0; half < 2; ++half) {  // rows 0-7, then 8-15
          const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + v * kVectorBytes + 32 * half));
          const __m256i first = _mm256_and_si256(packed, low_nibbles);
          const __m256i second = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_nibbles);
          for (int n = 0; n < NT; ++n) {
            const __m256i x_first = _mm256_set1_epi32(token_word(*op.q, n0 + n, b, 2 * v));
            const __m256i x_second = _mm256_set1_epi32(token_word(*op.q, n0 + n, b, 2 * v + 1));
            const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(first, x_first),
                                                   _mm256_maddubs_epi16(second, x_second));
            __m256i& dot = half ? dot_hi[n] : dot_lo[n];
            dot = _mm256_add_epi32(dot, _mm256_madd_epi16(pairs, ones));
          }
        }
      }
      const __m256 d_lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(op.scales + at * kGroupRows)));
      const __m256 d_hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(op.scales + at * kGroupRows + 8)));
      const __m256 m_lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(op.mins + at * kGroupRows)));
      const __m256 m_hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(op.mins + at * kGroupRows + 8)));
      for (int n = 0; n < NT; ++n) {
        const int64_t token_block = (n0 + n) * op.blocks + b;
        const __m256 token_scale = _mm256_set1_ps(op.q->block_scales[token_block]);
        const __m256 offset = _mm256_set1_ps(op.q->block_offsets[token_block]);
        lo[g][n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_lo[n]), _mm256_mul_ps(d_lo, token_scale), lo[g][n]);
        hi[g][n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_hi[n]), _mm256_mul_ps(d_hi, token_scale), hi[g][n]);
        lo[g][n] = _mm256_fmadd_ps(m_lo, offset, lo[g][n]);
        hi[g][n] = _mm256_fmadd_ps(m_hi, offset, hi[g][n]);
      }
    }
  }
  for (int g = 0; g < GT; ++g)
    for (int n = 0; n < NT; ++n) {
      _mm256_storeu_ps(sums[g][n], lo[g][n]);
      _mm256_storeu_ps(sums[g][n] + 8, hi[g][n]);
    }
}

template <int GT, int NT>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void tile_vnni(const Operands& op, int64_t g0, int64_t n0,
                                                                        float (*sums)[NT][kGroupRows]) {
  __m512 acc[GT][NT];
  for (int g = 0; g < GT; ++g)
    for (int n = 0; n < NT; ++n) acc[g][n] = _mm512_setzero_ps();
  const __m512i low_nibbles = _mm512_set1_epi8(0x0f);
  for (int64_t b = 0; b < op.blocks; ++b) {
    for (int g = 0; g < GT; ++g) {
      const int64_t at = (g0 + g) * op.blocks + b;
      const uint8_t* block = op.codes + at * kBlockBytes;
      // Two integer chains per token (low and high nibbles), added at the block's end: exact, and
      // half the dependent multiply-adds in a row.
      __m512i dot[NT], dot_high[NT];
      for (int n = 0; n < NT; ++n) dot[n] = dot_high[n] = _mm512_setzero_si512();
      for (int64_t v = 0; v < 4; ++v) {
        const __m512i packed = _mm512_loadu_si512(block + v * kVectorBytes);
        const __m512i first = _mm512_and_si512(packed, low_nibbles);
        const __m512i second = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_nibbles);
        for (int n = 0; n < NT; ++n) {
          // The token's words broadcast straight from memory (an operand of the multiply-add).
          dot[n] = _mm512_dpbusd_epi32(dot[n], first, _mm512_set1_epi32(token_word(*op.q, n0 + n, b, 2 * v)));
          dot_high[n] = _mm512_dpbusd_epi32(dot_high[n], second, _mm512_set1_epi32(token_word(*op.q, n0 + n, b, 2 * v + 1)));
        }
      }
      for (int n = 0; n < NT; ++n) dot[n] = _mm512_add_epi32(dot[n], dot_high[n]);
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(op.scales + at * kGroupRows)));
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(op.mins + at * kGroupRows)));
      for (int n = 0; n < NT; ++n) {
        const int64_t token_block = (n0 + n) * op.blocks + b;
        const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(op.q->block_scales[token_block]));
        acc[g][n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[n]), scale, acc[g][n]);
        acc[g][n] = _mm512_fmadd_ps(m, _mm512_set1_ps(op.q->block_offsets[token_block]), acc[g][n]);
      }
    }
  }
  for (int g = 0; g < GT; ++g)
    for (int n = 0; n < NT; ++n) _mm512_storeu_ps(sums[g][n], acc[g][n]);
}

template <int GT, int NT>
void tile(const Operands& op, int64_t g0, int64_t n0, float (*sums)[NT][kGroupRows]) {
  switch (op.isa) {
    case kAvx512Vnni: return tile_vnni<GT, NT>(op, g0, n0, sums);
    case kAvx512:  // without VNNI a 512-bit maddubs gains little over 256 bits: the AVX2 code
    case kAvx2: return tile_avx2<GT, NT>(op, g0, n0, sums);
    default: return tile_scalar<GT, NT>(op, g0, n0, sums);
  }
}

template <int GT, int NT>
void groups_times_tokens(const Operands& op, int64_t g0, int64_t n0) {
  float sums[GT][NT][kGroupRows];
  tile<GT, NT>(op, g0, n0, sums);
  for (int g = 0; g < GT; ++g)
    for (int n = 0; n < NT; ++n) store_group(sums[g][n], (g0 + g) * kGroupRows, op.out, op.tokens, n0 + n, op.y);
}

ffi::Error Q4MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::F16> scales,
                        ffi::Buffer<ffi::F16> mins, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y, int64_t isa,
                        int64_t threads) {
  if (ffi::Error error = check_isa(isa); error.failure()) return error;
  const auto cd = codes.dimensions(), sd = scales.dimensions(), md = mins.dimensions();
  const auto xd = x.dimensions(), yd = y->dimensions();
  if (cd.size() != 3 || cd[2] != kBlockBytes || sd.size() != 3 || sd[0] != cd[0] || sd[1] != cd[1] ||
      sd[2] != kGroupRows || md.size() != 3 || md[0] != sd[0] || md[1] != sd[1] || md[2] != sd[2] || xd.size() != 2 ||
      yd.size() != 2 || cd[1] != (xd[0] + kBlock - 1) / kBlock || yd[1] != xd[1] || yd[0] > cd[0] * kGroupRows ||
      yd[0] <= (cd[0] - 1) * kGroupRows)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "q4_matmul: expected codes[ceil(O/16), ceil(I/32), 256], scales and mins "
                      "[ceil(O/16), ceil(I/32), 16], x[I, N], y[O, N]");
  const int64_t groups = cd[0], in = xd[0], tokens = xd[1];
  if (tokens == 0 || yd[0] == 0) return ffi::Error::Success();
  const QuantizedTokens q = quantize_tokens(x.typed_data(), in, tokens);
  const Operands op{isa, yd[0], tokens, cd[1], codes.typed_data(),
                    reinterpret_cast<const uint16_t*>(scales.typed_data()),
                    reinterpret_cast<const uint16_t*>(mins.typed_data()), &q, y->typed_data()};
  const auto tile = [&](auto group_tile, auto token_tile, int64_t g, int64_t n0) {
    groups_times_tokens<decltype(group_tile)::value, decltype(token_tile)::value>(op, g, n0);
  };
  if (tokens <= 2) {
    for_every_tile<kTileGroupsNarrow>(pool, groups, tokens, threads, tile);
  } else {
    for_every_tile<kTileGroups>(pool, groups, tokens, threads, tile);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxspec_cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxspec_q4_matmul, jaxspec_cpu::Q4MatmulImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()   // packed codes [G, NB, 256]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F16>>()  // block scales [G, NB, 16]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F16>>()  // block minimums [G, NB, 16]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // x [I, N]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // y [O, N]
                                  .Attr<int64_t>("isa")
                                  .Attr<int64_t>("threads"));
