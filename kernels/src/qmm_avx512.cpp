// The packed kernels for AVX-512 (F + BW): 16 floats a vector. Built with -mavx512f -mavx512bw -mfma.
#include <immintrin.h>

#include "qmm.h"

namespace zoo::avx512 {
namespace {
struct V {
  static constexpr int NR4 = 2;
  static constexpr int L = 16;
  using F = __m512;
  static F zero() { return _mm512_setzero_ps(); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F a) { _mm512_storeu_ps(p, a); }
  static F set1(float s) { return _mm512_set1_ps(s); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(F a) { return _mm512_reduce_add_ps(a); }
  static __m256i load16(const uint16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static F f16(const uint16_t* p) { return _mm512_cvtph_ps(load16(p)); }
  static F bf16(const uint16_t* p) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(load16(p)), 16)); }
  static F u8(const uint8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static void u4(const uint8_t* p, F& lo, F& hi) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
  }
  static void u4n(const uint8_t* p, F& a, F& b) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i mask = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(v, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
    a = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)));
    b = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi)));
  }
};
}  // namespace
#include "qmm_impl.h"
}  // namespace zoo::avx512
