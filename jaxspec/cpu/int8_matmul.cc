// The W8A8 skinny product of jaxspec's int8 format:
//   y[O, N] = (W8[O, I] . X8[I, N]) * s_w[O] * s_x[N]
// (jaxspec.models.quant: per-row int8 weights; the activations are quantized per token here).
//
// Each token column of x [I, N] (float32) is rotated into the weight's basis (common.h
// `rotate_in_place`, `quant.hadamard`'s arithmetic) and quantized on its own, with
// `quant.quantize_tokens`' arithmetic: scale = max|x| / 127 (1 for an all-zero token), code =
// clamp(rint(x / scale), -127, 127). The integer dot is exact, so every path gives the same int32
// and, through one float epilogue per element ((dot * s_w) * s_x), the same bits: at every N,
// thread count and instruction set, and the bits of XLA's W8A8 product (`quant._w8a8`).
//
// W comes packed at load (jaxspec.cpu.packing.pack_int8): [G, K, 64] with K = ceil(I / 4), a
// group of 16 output rows times 4 consecutive inputs per 64 bytes, so one broadcast of a token's 4
// codes multiplies into 16 row accumulators. Paths:
// - VNNI multiplies unsigned by signed bytes: tokens go in offset (code + 128) and the packing's
//   per-row correction, 128 * sum(W8[o]), comes off at the end.
// - AVX-512BW and AVX2 use the sign trick of maddubs (|w| times x carrying w's sign), whose pair
//   sums stay within int16 since codes are within +-127, then madd into int32.
#include <immintrin.h>

#include <cmath>
#include <vector>

#include "common.h"

namespace jaxspec_cpu {
namespace {

constexpr int kTileGroups = 4;
constexpr int64_t kGroupBytes = kGroupRows * 4;

struct QuantizedTokens {
  int64_t words = 0;            // K: 4-code words per token
  std::vector<float> scales;    // [N]
  std::vector<int8_t> codes;    // [N, 4K], zero past I
  std::vector<uint8_t> offset;  // [N, 4K] code + 128 (VNNI path)
};

QuantizedTokens quantize_tokens(const float* x, int64_t in, int64_t tokens, bool offset) {
  QuantizedTokens q;
  q.words = (in + 3) / 4;
  q.scales.assign(tokens, 1.0f);
  q.codes.assign(static_cast<size_t>(tokens * q.words * 4), 0);
  std::vector<float> column(static_cast<size_t>(in));
  for (int64_t n = 0; n < tokens; ++n) {
    for (int64_t i = 0; i < in; ++i) column[i] = x[i * tokens + n];
    rotate_in_place(column.data(), in);
    q.scales[n] = quantize_int8(column.data(), in, 1, q.codes.data() + n * q.words * 4);
  }
  if (offset) {
    q.offset.resize(q.codes.size());
    for (size_t k = 0; k < q.codes.size(); ++k) q.offset[k] = static_cast<uint8_t>(q.codes[k] + 128);
  }
  return q;
}

// Each tile leaves dots [GT][NT][16]: groups [0, GT) of `packed` times tokens [n0, n0 + NT).
template <int GT, int NT>
void tile_scalar(const int8_t* packed, const QuantizedTokens& q, int64_t n0, const int32_t*,
                 int32_t (*dots)[NT][kGroupRows]) {
  for (int g = 0; g < GT; ++g)
    for (int n = 0; n < NT; ++n) {
      const int8_t* x = q.codes.data() + (n0 + n) * q.words * 4;
      for (int64_t j = 0; j < kGroupRows; ++j) {
        int32_t dot = 0;
        for (int64_t k = 0; k < q.words; ++k) {
          const int8_t* w = packed + (g * q.words + k) * kGroupBytes + 4 * j;
          for (int b = 0; b < 4; ++b) dot += int32_t{w[b]} * int32_t{x[4 * k + b]};
        }
        dots[g][n][j] = dot;
      }
    }
}

template <int GT, int NT>
__attribute__((target("avx2"))) void tile_avx2(const int8_t* packed, const QuantizedTokens& q, int64_t n0,
                                               const int32_t*, int32_t (*dots)[NT][kGroupRows]) {
  __m256i lo[GT][NT], hi[GT][NT];  // rows 0-7 and 8-15 of each group
  for (int g = 0; g < GT; ++g)
    for (int n = 0; n < NT; ++n) lo[g][n] = hi[g][n] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t k = 0; k < q.words; ++k) {
    __m256i wlo[GT], whi[GT], alo[GT], ahi[GT];
    for (int g = 0; g < GT; ++g) {
      const int8_t* w = packed + (g * q.words + k) * kGroupBytes;
      wlo[g] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
      whi[g] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32));
      alo[g] = _mm256_sign_epi8(wlo[g], wlo[g]);
      ahi[g] = _mm256_sign_epi8(whi[g], whi[g]);
    }
    for (int n = 0; n < NT; ++n) {
      const __m256i xv = _mm256_set1_epi32(load_word(q.codes.data() + ((n0 + n) * q.words + k) * 4));
      for (int g = 0; g < GT; ++g) {
        const __m256i plo = _mm256_maddubs_epi16(alo[g], _mm256_sign_epi8(xv, wlo[g]));
        const __m256i phi = _mm256_maddubs_epi16(ahi[g], _mm256_sign_epi8(xv, whi[g]));
        lo[g][n] = _mm256_add_epi32(lo[g][n], _mm256_madd_epi16(plo, ones));
        hi[g][n] = _mm256_add_epi32(hi[g][n], _mm256_madd_epi16(phi, ones));
      }
    }
  }
  for (int g = 0; g < GT; ++g)
    for (int n = 0; n < NT; ++n) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dots[g][n]), lo[g][n]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dots[g][n] + 8), hi[g][n]);
    }
}

template <int GT, int NT>
__attribute__((target("avx512f,avx512bw"))) void tile_avx512(const int8_t* packed, const QuantizedTokens& q,
                                                             int64_t n0, const int32_t*,
                                                             int32_t (*dots)[NT][kGroupRows]) {
  __m512i acc[GT][NT];
  for (int g = 0; g < GT; ++g)
    for (int n = 0; n < NT; ++n) acc[g][n] = _mm512_setzero_si512();
  const __m512i ones = _mm512_set1_epi16(1), zero = _mm512_setzero_si512();
  for (int64_t k = 0; k < q.words; ++k) {
    __m512i magnitude[GT];
    __mmask64 negative[GT];
    for (int g = 0; g < GT; ++g) {
      const __m512i w = _mm512_loadu_si512(packed + (g * q.words + k) * kGroupBytes);
      magnitude[g] = _mm512_abs_epi8(w);
      negative[g] = _mm512_movepi8_mask(w);
    }
    for (int n = 0; n < NT; ++n) {
      const __m512i xv = _mm512_set1_epi32(load_word(q.codes.data() + ((n0 + n) * q.words + k) * 4));
      for (int g = 0; g < GT; ++g) {
        const __m512i signed_x = _mm512_mask_sub_epi8(xv, negative[g], zero, xv);
        const __m512i pairs = _mm512_maddubs_epi16(magnitude[g], signed_x);
        acc[g][n] = _mm512_add_epi32(acc[g][n], _mm512_madd_epi16(pairs, ones));
      }
    }
  }
  for (int g = 0; g < GT; ++g)
    for (int n = 0; n < NT; ++n) _mm512_storeu_si512(dots[g][n], acc[g][n]);
}

template <int GT, int NT>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void tile_vnni(const int8_t* packed, const QuantizedTokens& q,
                                                                      int64_t n0, const int32_t* corrections,
                                                                      int32_t (*dots)[NT][kGroupRows]) {
  __m512i acc[GT][NT];
  for (int g = 0; g < GT; ++g)
    for (int n = 0; n < NT; ++n) acc[g][n] = _mm512_setzero_si512();
  for (int64_t k = 0; k < q.words; ++k) {
    __m512i w[GT];
    for (int g = 0; g < GT; ++g) w[g] = _mm512_loadu_si512(packed + (g * q.words + k) * kGroupBytes);
    for (int n = 0; n < NT; ++n) {
      const __m512i xv = _mm512_set1_epi32(load_word(q.offset.data() + ((n0 + n) * q.words + k) * 4));
      for (int g = 0; g < GT; ++g) acc[g][n] = _mm512_dpbusd_epi32(acc[g][n], xv, w[g]);
    }
  }
  for (int g = 0; g < GT; ++g) {
    const __m512i correction = _mm512_loadu_si512(corrections + g * kGroupRows);
    for (int n = 0; n < NT; ++n) _mm512_storeu_si512(dots[g][n], _mm512_sub_epi32(acc[g][n], correction));
  }
}

template <int GT, int NT>
void tile(int64_t isa, const int8_t* packed, const QuantizedTokens& q, int64_t n0, const int32_t* corrections,
          int32_t (*dots)[NT][kGroupRows]) {
  switch (isa) {
    case kAvx512Vnni: return tile_vnni<GT, NT>(packed, q, n0, corrections, dots);
    case kAvx512: return tile_avx512<GT, NT>(packed, q, n0, corrections, dots);
    case kAvx2: return tile_avx2<GT, NT>(packed, q, n0, corrections, dots);
    default: return tile_scalar<GT, NT>(packed, q, n0, corrections, dots);
  }
}

struct Operands {
  int64_t isa, out, tokens;
  const int8_t* packed;
  const float* scales;        // [16 G]
  const int32_t* corrections; // [16 G]
  const QuantizedTokens* q;
  float* y;
};

template <int GT, int NT>
void groups_times_tokens(const Operands& op, int64_t g0, int64_t n0) {
  int32_t dots[GT][NT][kGroupRows];
  const int64_t row0 = g0 * kGroupRows;
  tile<GT, NT>(op.isa, op.packed + g0 * op.q->words * kGroupBytes, *op.q, n0, op.corrections + row0, dots);
  float values[kGroupRows];
  for (int g = 0; g < GT; ++g)
    for (int n = 0; n < NT; ++n) {
      const float token_scale = op.q->scales[n0 + n];
      for (int64_t j = 0; j < kGroupRows; ++j)
        values[j] = static_cast<float>(dots[g][n][j]) * op.scales[row0 + g * kGroupRows + j] * token_scale;
      store_group(values, row0 + g * kGroupRows, op.out, op.tokens, n0 + n, op.y);
    }
}

ffi::Error Int8MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> packed, ffi::Buffer<ffi::F32> scales,
                          ffi::Buffer<ffi::S32> corrections, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y,
                          int64_t isa, int64_t threads) {
  if (ffi::Error error = check_isa(isa); error.failure()) return error;
  const auto pd = packed.dimensions(), sd = scales.dimensions(), cd = corrections.dimensions();
  const auto xd = x.dimensions(), yd = y->dimensions();
  if (pd.size() != 3 || pd[2] != kGroupBytes || sd.size() != 1 || sd[0] != pd[0] * kGroupRows || cd.size() != 1 ||
      cd[0] != sd[0] || xd.size() != 2 || yd.size() != 2 || pd[1] != (xd[0] + 3) / 4 || yd[1] != xd[1] ||
      yd[0] > sd[0] || yd[0] <= sd[0] - kGroupRows)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "int8_matmul: expected packed W[ceil(O/16), ceil(I/4), 64], scales[16 ceil(O/16)], "
                      "corrections[16 ceil(O/16)], x[I, N], y[O, N]");
  const int64_t groups = pd[0], in = xd[0], tokens = xd[1];
  if (tokens == 0 || yd[0] == 0) return ffi::Error::Success();
  const QuantizedTokens q = quantize_tokens(x.typed_data(), in, tokens, isa == kAvx512Vnni);
  const Operands op{isa, yd[0], tokens, packed.typed_data(), scales.typed_data(), corrections.typed_data(), &q,
                    y->typed_data()};
  for_every_tile<kTileGroups>(pool, groups, tokens, threads, [&](auto group_tile, auto token_tile, int64_t g, int64_t n0) {
    groups_times_tokens<decltype(group_tile)::value, decltype(token_tile)::value>(op, g, n0);
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxspec_cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxspec_int8_matmul, jaxspec_cpu::Int8MatmulImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S8>>()   // packed W [G, K, 64]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // row scales [16 G]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // 128 * row sums [16 G]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // x [I, N]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // y [O, N]
                                  .Attr<int64_t>("isa")
                                  .Attr<int64_t>("threads"));
