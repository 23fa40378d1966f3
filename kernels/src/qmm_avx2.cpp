// The packed kernels for AVX2 + FMA + F16C: 8 floats a vector. Built with -mavx2 -mfma -mf16c.
#include <immintrin.h>

#include "qmm.h"

namespace zoo::avx2 {
namespace {
struct V {
  static constexpr int NR4 = 1;
  static constexpr int L = 8;
  using F = __m256;
  static F zero() { return _mm256_setzero_ps(); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F a) { _mm256_storeu_ps(p, a); }
  static F set1(float s) { return _mm256_set1_ps(s); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(F a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static __m128i load16(const uint16_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
  static F f16(const uint16_t* p) { return _mm256_cvtph_ps(load16(p)); }
  static F bf16(const uint16_t* p) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(load16(p)), 16)); }
  static __m128i load8(const uint8_t* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }
  static F u8(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(load8(p))); }
  static void u4(const uint8_t* p, F& lo, F& hi) {
    const __m256i v = _mm256_cvtepu8_epi32(load8(p));
    lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
    hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
  }
  static void u4n(const uint8_t* p, F& a, F& b) {
    const __m128i v = load8(p);
    const __m128i mask = _mm_set1_epi8(15);
    const __m128i nibbles = _mm_unpacklo_epi8(_mm_and_si128(v, mask), _mm_and_si128(_mm_srli_epi16(v, 4), mask));
    a = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(nibbles));
    b = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(nibbles, 8)));
  }
};
}  // namespace
#include "qmm_impl.h"
}  // namespace zoo::avx2
