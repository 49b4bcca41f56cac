// AVX2 + FMA + F16C kernels (gemv_impl.h with 8-lane traits). Chosen at run time where the CPU has them.
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include "gemv.h"

namespace smk {
namespace avx2 {

#include "i4_x86.h"

struct V {
  using T = __m256;
  static constexpr int L = 8, R = 4, B = 48;
  // R·O accumulators + O weight vectors + x within 16 registers (4 rows: 12 + 3 + 1)
  static constexpr int O_of(int r) { return r >= 4 ? 3 : r == 3 ? 4 : r == 2 ? 6 : 8; }
  static inline T zero() { return _mm256_setzero_ps(); }
  static inline T loadx(const float* p) { return _mm256_loadu_ps(p); }
  static inline T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static inline void prefetch(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }
  static inline float hsum(T v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  // int4 by whole 32-weight chunks (one group of 32, or half a group of 64): 16 bytes decoded at once
  static constexpr bool I4_32 = true;
  using Q = __m256i;  // 32 weights as signed bytes n − 8, in order
  static inline Q i4_decode(const uint8_t* p) { return i4_decode32(p); }
  static inline T bcast_half(uint16_t h) { return _mm256_set1_ps(_cvtsh_ss(h)); }
  template <int q>
  static inline T i4_chunk(Q d, T s) {  // weights [8q, 8q + 8) of the chunk, times the group scale
    __m128i h = q < 2 ? _mm256_castsi256_si128(d) : _mm256_extracti128_si256(d, 1);
    if (q & 1) h = _mm_srli_si128(h, 8);
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(h)), s);
  }
  template <int FMT>
  static inline T load(const uint8_t* row, const uint16_t* rs, int64_t k, int gs) {
    if constexpr (FMT == F32) {
      return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + k);
    } else if constexpr (FMT == BF16) {
      __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * k));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else if constexpr (FMT == F16) {
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * k)));
    } else if constexpr (FMT == I8) {
      return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k))));
    } else {
      static_assert(FMT != I4, "int4 rows go through i4_decode / i4_chunk (gemv_impl.h), whole 32-weight chunks");
      return zero();
    }
  }
};

#include "gemv_impl.h"

}  // namespace avx2

KernelFn kernel_avx2() { return &avx2::kernel; }

}  // namespace smk
