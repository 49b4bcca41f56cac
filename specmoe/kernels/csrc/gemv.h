// specmoe native CPU kernels: y = x · Wᵀ (+ bias) for a few rows of fp32 x and W in its stored format.
//
// The per-ISA kernels (gemv_avx2.cpp, gemv_avx512.cpp, gemv_ref.cpp) instantiate gemv_impl.h with their own
// vector traits; this header is what they share with the torch bindings (ops.cpp). No torch header here: the
// ISA files are compiled with `#pragma GCC target` and must not instantiate torch's inline code.
#pragma once
#include <cstdint>
#include <cstring>
#include <utility>

namespace smk {

enum Fmt : int { F32 = 0, BF16 = 1, F16 = 2, I8 = 3, I4 = 4 };

// One weight matrix [N, K] (output channels as rows) in its stored format.
struct Weight {
  int fmt = F32;
  const uint8_t* w = nullptr;     // row o starts at w + o * ld_bytes
  int64_t ld_bytes = 0;
  const float* row_scale = nullptr;  // I8: one fp32 scale per output row (w = q · s)
  const uint16_t* gscale = nullptr;  // I4: one fp16 scale per `group` weights along a row (w = (n − 8) · s)
  int64_t group = 32;
  int gshift = 5;                    // log2(group)
  const void* bias = nullptr;        // [N] or null
  int bias_fmt = F32;                // F32 / BF16 / F16
};

// y[r·ldy + o] = Σ_k x[r·ldx + k] · W[o, k] (+ bias[o]) for r < m, o in [o0, o1). Each (r, o) is accumulated in
// the same order whatever m, o0, o1: a row's result does not depend on the rows or threads sharing the call.
using KernelFn = void (*)(const float* x, int64_t ldx, int64_t m, const Weight& W, int64_t K, int64_t o0,
                          int64_t o1, float* y, int64_t ldy);

KernelFn kernel_ref();     // portable scalar code (the fallback, and the reference the self-test compares to)
KernelFn kernel_avx2();    // AVX2 + FMA + F16C
KernelFn kernel_avx512();  // AVX-512 F/BW/VL

inline float bf16_to_float(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float half_to_float(uint16_t h) {  // IEEE binary16 → binary32, exact (subnormals, inf, nan)
  uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, u;
  if (exp == 0) {
    if (mant == 0) {
      u = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do { ++e; mant <<= 1; } while (!(mant & 0x400));
      u = sign | uint32_t(127 - 15 - e) << 23 | (mant & 0x3ff) << 13;
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | mant << 13;
  } else {
    u = sign | (exp + 127 - 15) << 23 | mant << 13;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float scalar_bias(const Weight& W, int64_t o) {
  if (!W.bias) return 0.f;
  switch (W.bias_fmt) {
    case BF16: return bf16_to_float(static_cast<const uint16_t*>(W.bias)[o]);
    case F16: return half_to_float(static_cast<const uint16_t*>(W.bias)[o]);
    default: return static_cast<const float*>(W.bias)[o];
  }
}

// One weight W[o, k] as fp32 (tails and the scalar path): `row` the row's bytes, `rs` its I4 group scales. I8's row
// scale is applied after the sum; I4's group scale here (w = (n − 8) · s, exact in fp32).
template <int FMT>
inline float wscalar(const uint8_t* row, const uint16_t* rs, int64_t k, int gs) {
  if constexpr (FMT == F32) {
    float f;
    std::memcpy(&f, row + 4 * k, 4);
    return f;
  } else if constexpr (FMT == BF16 || FMT == F16) {
    uint16_t h;
    std::memcpy(&h, row + 2 * k, 2);
    return FMT == BF16 ? bf16_to_float(h) : half_to_float(h);
  } else if constexpr (FMT == I8) {
    return float(int8_t(row[k]));
  } else {
    uint8_t b = row[k >> 1];
    int n = (k & 1) ? (b >> 4) : (b & 15);
    return float(n - 8) * half_to_float(rs[k >> gs]);
  }
}

}  // namespace smk
