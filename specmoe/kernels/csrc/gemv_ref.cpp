// The portable kernel (gemv_impl.h with one-lane traits): any CPU, and the reference the SIMD paths are
// self-tested against when the extension loads.
#include "gemv.h"

namespace smk {
namespace ref {

struct V {
  using T = float;
  static constexpr int L = 1, R = 1, B = 1;
  static constexpr int O_of(int) { return 1; }
  static inline T zero() { return 0.f; }
  static inline T loadx(const float* p) { return *p; }
  static inline T fma(T a, T b, T c) { return c + a * b; }
  static inline void prefetch(const uint8_t*) {}
  static inline float hsum(T v) { return v; }
  // int4 one weight at a time (load); the chunked path's members are named for gemv_impl.h but never used
  static constexpr bool I4_32 = false;
  using Q = float;
  static inline Q i4_decode(const uint8_t*) { return 0.f; }
  static inline T bcast_half(uint16_t) { return 0.f; }
  template <int q>
  static inline T i4_chunk(Q, T) { return 0.f; }
  template <int FMT>
  static inline T load(const uint8_t* row, const uint16_t* rs, int64_t k, int gs) {
    return wscalar<FMT>(row, rs, k, gs);
  }
};

#include "gemv_impl.h"

}  // namespace ref

KernelFn kernel_ref() { return &ref::kernel; }

}  // namespace smk
