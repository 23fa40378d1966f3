// The packed kernels in plain C++ (one float a "vector"), for CPUs without AVX2 and other
// architectures; the compiler may vectorise them for the baseline instruction set.
#include "qmm.h"

namespace zoo::portable {
namespace {
struct V {
  static constexpr int NR4 = 1;
  static constexpr int L = 1;
  using F = float;
  static F zero() { return 0.0f; }
  static F load(const float* p) { return *p; }
  static void store(float* p, F a) { *p = a; }
  static F set1(float s) { return s; }
  static F fma(F a, F b, F c) { return a * b + c; }
  static float sum(F a) { return a; }
  static F u8(const uint8_t* p) { return static_cast<float>(*p); }
  static void u4(const uint8_t* p, F& lo, F& hi) {
    lo = static_cast<float>(*p & 15);
    hi = static_cast<float>(*p >> 4);
  }
  static void u4n(const uint8_t* p, F& a, F& b) { u4(p, a, b); }
};
}  // namespace
#include "qmm_impl.h"
}  // namespace zoo::portable
