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
  template <int FMT>
  static inline T load(const uint8_t* row, const uint16_t* rs, int64_t k, int gs) {
    return wscalar<FMT>(row, rs, k, gs);
  }
};

#include "gemv_impl.h"

}  // namespace ref

KernelFn kernel_ref() { return &ref::kernel; }

}  // namespace smk
