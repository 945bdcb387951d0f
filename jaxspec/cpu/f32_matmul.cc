// The float32 skinny product of decoding: y[O, N] = W[O, I] . x[I, N], x feature-major as the
// trunks carry activations, N token columns (1 for a step, k + 1 for a verify, more for a tree or
// a prefill).
//
// W comes packed at load (jaxspec.cpu.packing.pack_f32): [G, I, 16], a group of 16 output rows
// per vector, column by column. A tile of up to 4 groups (64 rows) is loaded once per column and
// multiplied into up to 4 broadcast tokens, so a 5-token verify streams W as often as a 1-token
// step. Each output element is one chain of fused multiply-adds in input order on every path, so
// its bits do not depend on N, on the thread count, on the tile, or on the instruction set.
#include <immintrin.h>

#include <cmath>
#include <vector>

#include "common.h"

namespace jaxspec_cpu {
namespace {

constexpr int kTileGroups = 4;

// x [I, N] -> token-major xt [N, I], so a token's inputs are contiguous.
std::vector<float> token_major(const float* x, int64_t in, int64_t tokens) {
  std::vector<float> xt(static_cast<size_t>(tokens * in));
  for (int64_t i = 0; i < in; ++i)
    for (int64_t n = 0; n < tokens; ++n) xt[n * in + i] = x[i * tokens + n];
  return xt;
}

// Each tile computes groups [g0, g0 + GT) for tokens [n0, n0 + NT) into acc [GT][NT][16].
template <int GT, int NT>
void tile_scalar(const float* packed, int64_t in, const float* xt, float (*acc)[NT][kGroupRows]) {
  for (int g = 0; g < GT; ++g)
    for (int n = 0; n < NT; ++n)
      for (int64_t j = 0; j < kGroupRows; ++j) acc[g][n][j] = 0.0f;
  for (int64_t i = 0; i < in; ++i)
    for (int g = 0; g < GT; ++g) {
      const float* w = packed + (g * in + i) * kGroupRows;
      for (int n = 0; n < NT; ++n) {
        const float xv = xt[n * in + i];
        for (int64_t j = 0; j < kGroupRows; ++j) acc[g][n][j] = std::fma(w[j], xv, acc[g][n][j]);
      }
    }
}

template <int GT, int NT>
__attribute__((target("avx2,fma"))) void tile_avx2(const float* packed, int64_t in, const float* xt,
                                                   float (*acc)[NT][kGroupRows]) {
  __m256 lo[GT][NT], hi[GT][NT];  // rows 0-7 and 8-15 of each group
  for (int g = 0; g < GT; ++g)
    for (int n = 0; n < NT; ++n) lo[g][n] = hi[g][n] = _mm256_setzero_ps();
  for (int64_t i = 0; i < in; ++i) {
    __m256 wlo[GT], whi[GT];
    for (int g = 0; g < GT; ++g) {
      wlo[g] = _mm256_loadu_ps(packed + (g * in + i) * kGroupRows);
      whi[g] = _mm256_loadu_ps(packed + (g * in + i) * kGroupRows + 8);
    }
    for (int n = 0; n < NT; ++n) {
      const __m256 xv = _mm256_broadcast_ss(xt + n * in + i);
      for (int g = 0; g < GT; ++g) {
        lo[g][n] = _mm256_fmadd_ps(wlo[g], xv, lo[g][n]);
        hi[g][n] = _mm256_fmadd_ps(whi[g], xv, hi[g][n]);
      }
    }
  }
  for (int g = 0; g < GT; ++g)
    for (int n = 0; n < NT; ++n) {
      _mm256_storeu_ps(acc[g][n], lo[g][n]);
      _mm256_storeu_ps(acc[g][n] + 8, hi[g][n]);
    }
}

template <int GT, int NT>
__attribute__((target("avx512f"))) void tile_avx512(const float* packed, int64_t in, const float* xt,
                                                    float (*acc)[NT][kGroupRows]) {
  __m512 sums[GT][NT];
  for (int g = 0; g < GT; ++g)
    for (int n = 0; n < NT; ++n) sums[g][n] = _mm512_setzero_ps();
  for (int64_t i = 0; i < in; ++i) {
    __m512 w[GT];
    for (int g = 0; g < GT; ++g) w[g] = _mm512_loadu_ps(packed + (g * in + i) * kGroupRows);
    for (int n = 0; n < NT; ++n) {
      const __m512 xv = _mm512_set1_ps(xt[n * in + i]);
      for (int g = 0; g < GT; ++g) sums[g][n] = _mm512_fmadd_ps(w[g], xv, sums[g][n]);
    }
  }
  for (int g = 0; g < GT; ++g)
    for (int n = 0; n < NT; ++n) _mm512_storeu_ps(acc[g][n], sums[g][n]);
}

template <int GT, int NT>
void tile(int64_t isa, const float* packed, int64_t in, const float* xt, float (*acc)[NT][kGroupRows]) {
  switch (isa) {
    case kAvx512:
    case kAvx512Vnni: return tile_avx512<GT, NT>(packed, in, xt, acc);
    case kAvx2: return tile_avx2<GT, NT>(packed, in, xt, acc);
    default: return tile_scalar<GT, NT>(packed, in, xt, acc);
  }
}

template <int GT, int NT>
void groups_times_tokens(int64_t isa, const float* packed, int64_t in, const float* xt, int64_t g0, int64_t n0,
                         int64_t out, int64_t tokens, float* y) {
  float acc[GT][NT][kGroupRows];
  tile<GT, NT>(isa, packed + g0 * in * kGroupRows, in, xt + n0 * in, acc);
  for (int g = 0; g < GT; ++g)
    for (int n = 0; n < NT; ++n) store_group(acc[g][n], (g0 + g) * kGroupRows, out, tokens, n0 + n, y);
}

ffi::Error F32MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> packed, ffi::Buffer<ffi::F32> x,
                         ffi::ResultBuffer<ffi::F32> y, int64_t isa, int64_t threads) {
  if (ffi::Error error = check_isa(isa); error.failure()) return error;
  const auto pd = packed.dimensions(), xd = x.dimensions(), yd = y->dimensions();
  if (pd.size() != 3 || pd[2] != kGroupRows || xd.size() != 2 || yd.size() != 2 || pd[1] != xd[0] ||
      yd[1] != xd[1] || yd[0] > pd[0] * kGroupRows || yd[0] <= (pd[0] - 1) * kGroupRows)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "f32_matmul: expected packed W[ceil(O/16), I, 16], x[I, N], y[O, N]");
  const int64_t groups = pd[0], in = pd[1], out = yd[0], tokens = xd[1];
  if (tokens == 0 || out == 0) return ffi::Error::Success();
  const std::vector<float> xt = token_major(x.typed_data(), in, tokens);
  const float* w = packed.typed_data();
  float* result = y->typed_data();
  for_every_tile<kTileGroups>(pool, groups, tokens, threads, [&](auto group_tile, auto token_tile, int64_t g, int64_t n0) {
    groups_times_tokens<decltype(group_tile)::value, decltype(token_tile)::value>(isa, w, in, xt.data(), g, n0, out,
                                                                                  tokens, result);
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxspec_cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxspec_f32_matmul, jaxspec_cpu::F32MatmulImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // packed W [G, I, 16]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // x [I, N]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // y [O, N]
                                  .Attr<int64_t>("isa")
                                  .Attr<int64_t>("threads"));
