// The packed kernels for AVX2 + FMA + F16C: 8 floats a vector. Built with -mavx2 -mfma -mf16c.
#include <immintrin.h>

#include "qmm.h"

namespace zoo::avx2 {
namespace {
struct V {
  template <int BITS, int MT>
  static constexpr int NR = MT == 1 ? 4 : MT == 2 ? 2 : 1;
  static constexpr int L = 8;
  using F = __m256;
  using I = __m256i;
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
  template <int NR>
  static void sums(const F* v, float* out) {
    for (int r = 0; r < NR; ++r) out[r] = sum(v[r]);
  }
  // Lanes [0, n) set (the sign bit a masked load reads).
  static I first(int n) { return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); }
  static F load_part(const float* p, int n) { return _mm256_maskload_ps(p, first(n)); }
  // n half-precision values, the rest zero: pairs by a masked load of 32-bit words; an odd count
  // through a zeroed buffer (a word load would read past the array).
  static __m128i halves(const uint16_t* p, int n) {
    if (n % 2 == 0) return _mm256_castsi256_si128(_mm256_maskload_epi32(reinterpret_cast<const int*>(p), first(n / 2)));
    alignas(16) uint16_t buf[8] = {};
    for (int i = 0; i < n; ++i) buf[i] = p[i];
    return _mm_load_si128(reinterpret_cast<const __m128i*>(buf));
  }
  static F f16_part(const uint16_t* p, int n) { return _mm256_cvtph_ps(halves(p, n)); }
  static F bf16_part(const uint16_t* p, int n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves(p, n)), 16));
  }
  static I words(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I words_part(const uint8_t* p, int n) { return _mm256_maskload_epi32(reinterpret_cast<const int*>(p), first(n)); }
  // Field J: 8-bit fields by a byte shuffle within each 128-bit lane (or one mask or shift), 4-bit
  // fields by a shift and a mask.
  template <int BITS, int J>
  static F field(I w) {
    if constexpr (BITS == 8) {
      if constexpr (J == 0) return _mm256_cvtepi32_ps(_mm256_and_si256(w, _mm256_set1_epi32(0xff)));
      if constexpr (J == 3) return _mm256_cvtepi32_ps(_mm256_srli_epi32(w, 24));
      const I pick = _mm256_setr_epi32(static_cast<int>(0x80808000u | J), static_cast<int>(0x80808004u | J),
                                       static_cast<int>(0x80808008u | J), static_cast<int>(0x8080800cu | J),
                                       static_cast<int>(0x80808000u | J), static_cast<int>(0x80808004u | J),
                                       static_cast<int>(0x80808008u | J), static_cast<int>(0x8080800cu | J));
      return _mm256_cvtepi32_ps(_mm256_shuffle_epi8(w, pick));
    } else {
      const I nibble = J == 0 ? w : _mm256_srli_epi32(w, 4 * J);
      return _mm256_cvtepi32_ps(J == 7 ? nibble : _mm256_and_si256(nibble, _mm256_set1_epi32(15)));
    }
  }
  static F spread(F s, int first, int P, int shift) {
    const I lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const I idx = _mm256_srli_epi32(_mm256_add_epi32(_mm256_mullo_epi32(lane, _mm256_set1_epi32(P)), _mm256_set1_epi32(first)), shift);
    return _mm256_permutevar8x32_ps(s, idx);
  }
  static __m128i load8(const uint8_t* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }
  static F u8(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(load8(p))); }
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
