// The packed kernels in plain C++ (one float a "vector", one 32-bit word a block), for CPUs
// without AVX2 and other architectures; the compiler may vectorise them for the baseline
// instruction set.
#include "qmm.h"

namespace zoo::portable {
namespace {
struct V {
  template <int BITS, int MT>
  static constexpr int NR = 1;
  static constexpr int L = 1;
  using F = float;
  using I = uint32_t;
  static F zero() { return 0.0f; }
  static F load(const float* p) { return *p; }
  static void store(float* p, F a) { *p = a; }
  static F set1(float s) { return s; }
  static F fma(F a, F b, F c) { return a * b + c; }
  static float sum(F a) { return a; }
  template <int NR>
  static void sums(const F* v, float* out) {
    for (int r = 0; r < NR; ++r) out[r] = sum(v[r]);
  }
  static I words(const uint8_t* p) {
    I w;
    __builtin_memcpy(&w, p, sizeof w);
    return w;
  }
  static I words_part(const uint8_t* p, int n) { return n > 0 ? words(p) : 0; }
  template <int BITS, int J>
  static F field(I w) { return static_cast<float>((w >> (BITS * J)) & ((1u << BITS) - 1)); }
  static F spread(F s, int, int, int) { return s; }
  static F u8(const uint8_t* p) { return static_cast<float>(*p); }
  static void u4n(const uint8_t* p, F& a, F& b) {
    a = static_cast<float>(*p & 15);
    b = static_cast<float>(*p >> 4);
  }
};
}  // namespace
#include "qmm_impl.h"
}  // namespace zoo::portable
