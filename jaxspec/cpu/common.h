// Shared by the native CPU kernels: the instruction-set paths, the split of output rows over
// XLA's intra-op thread pool, and the fixed-order lane reduction that makes a float result
// independent of how many token columns share a call.
#pragma once

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>

#include "xla/ffi/api/ffi.h"

namespace jaxspec_cpu {

namespace ffi = xla::ffi;

// Instruction-set paths, widest last. Python passes one as the `isa` attribute (chosen once at
// load, or forced by JAXSPEC_CPU_ISA); a handler refuses one the CPU lacks.
enum Isa : int64_t {
  kScalar = 0,
  kAvx2 = 1,       // AVX2 + FMA
  kAvx512 = 2,     // AVX-512 F + BW + VL
  kAvx512Vnni = 3, // AVX-512 F + BW + VL + VNNI
};

inline bool cpu_supports(int64_t isa) {
  __builtin_cpu_init();
  switch (isa) {
    case kScalar: return true;
    case kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl");
    case kAvx512Vnni:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    default: return false;
  }
}

inline ffi::Error check_isa(int64_t isa) {
  if (!cpu_supports(isa)) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "jaxspec cpu kernel: instruction set path " + std::to_string(isa) +
                          " is not supported by this CPU");
  }
  return ffi::Error::Success();
}

// Weights are repacked at load into groups of 16 output rows (jaxspec.cpu.packing), so one
// vector load holds a column slice of 16 rows and a broadcast token multiplies into 16 row
// accumulators at once: no horizontal sums, and every output element is accumulated in input
// order by one chain, whatever N, the tile or the thread.
constexpr int64_t kGroupRows = 16;

// Work goes to threads in chunks of `chunk` units (row groups), claimed from a shared counter:
// the caller works too, and only ever waits for chunks another thread has already claimed, so a
// pool whose threads are all busy cannot deadlock the call (a task that starts late finds
// nothing left). Which thread computes a unit never changes what is computed for it.
template <typename UnitRange>
void parallel_units(ffi::ThreadPool& pool, int64_t units, int64_t chunk, int64_t max_threads, UnitRange&& run) {
  const int64_t chunks = (units + chunk - 1) / chunk;
  int64_t threads = pool.num_threads();
  if (max_threads > 0 && max_threads < threads) threads = max_threads;
  if (threads < 1) threads = 1;
  if (threads > chunks) threads = chunks;
  if (threads <= 1) {
    run(int64_t{0}, units);
    return;
  }
  struct Shared {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto shared = std::make_shared<Shared>();
  // Helpers hold the shared counters (a late one outlives this call) but touch `run` only for a
  // chunk they claim, and every chunk is claimed and finished before this call returns.
  auto work = [shared, chunks, chunk, units, &run]() {
    for (int64_t claimed; (claimed = shared->next.fetch_add(1)) < chunks;) {
      const int64_t begin = claimed * chunk;
      run(begin, begin + chunk < units ? begin + chunk : units);
      shared->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 1; t < threads; ++t) {
    auto task = work;
    pool.Schedule(std::move(task));
  }
  work();
  while (shared->done.load(std::memory_order_acquire) < chunks) {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#else
    std::this_thread::yield();
#endif
  }
}

// The tiles of a kernel's loops, their sizes as compile-time constants so a tile's accumulators
// live in registers: `tile(std::integral_constant<int, NT>{}, n0)` for token tiles of up to 4
// (whole ones, then one of the rest), and `tile(std::integral_constant<int, GT>{}, g)` for group
// tiles of GT in [begin, end) then single groups. A tile computes each output as any other does.
template <typename Tile>
void for_token_tiles(int64_t tokens, Tile&& tile) {
  int64_t n0 = 0;
  for (; n0 + 4 <= tokens; n0 += 4) tile(std::integral_constant<int, 4>{}, n0);
  switch (tokens - n0) {
    case 1: tile(std::integral_constant<int, 1>{}, n0); break;
    case 2: tile(std::integral_constant<int, 2>{}, n0); break;
    case 3: tile(std::integral_constant<int, 3>{}, n0); break;
    default: break;
  }
}

template <int GT, typename Tile>
void for_group_tiles(int64_t begin, int64_t end, Tile&& tile) {
  int64_t g = begin;
  for (; g + GT <= end; g += GT) tile(std::integral_constant<int, GT>{}, g);
  for (; g < end; ++g) tile(std::integral_constant<int, 1>{}, g);
}

// A product's whole loop nest: groups split over the threads in chunks of GT, each chunk in group
// tiles, each group tile over every token tile: `tile(group_tile, token_tile, g, n0)`.
template <int GT, typename Tile>
void for_every_tile(ffi::ThreadPool& pool, int64_t groups, int64_t tokens, int64_t max_threads, Tile&& tile) {
  parallel_units(pool, groups, GT, max_threads, [&](int64_t begin, int64_t end) {
    for_group_tiles<GT>(begin, end, [&](auto group_tile, int64_t g) {
      for_token_tiles(tokens, [&](auto token_tile, int64_t n0) { tile(group_tile, token_tile, g, n0); });
    });
  });
}

// `quant.quantize_tokens`' arithmetic on `count` values read `stride` apart (a token's column, or
// a block of one): scale = max|v| / 127 (1 when all are zero), codes = clamp(rint(v / scale),
// -127, 127) into `codes`. Returns the scale. The int8 kernel quantizes whole tokens with it, the
// q4 kernel blocks of 32.
inline float quantize_int8(const float* values, int64_t count, int64_t stride, int8_t* codes) {
  float absmax = 0.0f;
  for (int64_t i = 0; i < count; ++i) absmax = std::fmax(absmax, std::fabs(values[i * stride]));
  const float scale = absmax > 0.0f ? absmax / 127.0f : 1.0f;
  for (int64_t i = 0; i < count; ++i) {
    const float code = std::nearbyint(values[i * stride] / scale);
    codes[i] = static_cast<int8_t>(std::fmin(std::fmax(code, -127.0f), 127.0f));
  }
  return scale;
}

// Four consecutive codes as one 32-bit word, for a broadcast against 4 packed inputs.
inline int32_t load_word(const void* bytes) {
  int32_t value;
  std::memcpy(&value, bytes, 4);
  return value;
}

// `quant.hadamard` on one token's inputs, in place and in its order of operations (so the same
// bits): the orthonormal Walsh-Hadamard transform over consecutive blocks of the largest power of
// two that divides the width, at most 64 (`quant.ROTATION_BLOCK`). The int8 and q4 weights are
// stored in that rotated basis; rotating here spares XLA a chain of small ops per product.
constexpr int64_t kRotationBlock = 64;

inline void rotate_in_place(float* v, int64_t width) {
  int64_t block = 1;
  while (block < kRotationBlock && width % (2 * block) == 0) block *= 2;
  if (block == 1) return;
  for (int64_t half = 1; half < block; half *= 2)
    for (int64_t start = 0; start < width; start += 2 * half)
      for (int64_t j = start; j < start + half; ++j) {
        const float a = v[j], b = v[j + half];
        v[j] = a + b;
        v[j + half] = a - b;
      }
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(block)));
  for (int64_t i = 0; i < width; ++i) v[i] *= scale;
}

// A group's 16 results for token column `n` into y [O, N] (rows past O are the packing's padding).
inline void store_group(const float* group_values, int64_t row0, int64_t out, int64_t tokens, int64_t n, float* y) {
  for (int64_t j = 0; j < kGroupRows && row0 + j < out; ++j) y[(row0 + j) * tokens + n] = group_values[j];
}

}  // namespace jaxspec_cpu
