// The packed kernels for AVX-512 (F + BW): 16 floats a vector. Built with -mavx512f -mavx512bw -mfma.
#include <immintrin.h>

#include "qmm.h"

namespace zoo::avx512 {
namespace {
struct V {
  template <int BITS, int MT>
  static constexpr int NR = MT == 1 && BITS == 8 ? 8 : 4;
  static constexpr int L = 16;
  using F = __m512;
  using I = __m512i;
  static F zero() { return _mm512_setzero_ps(); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F a) { _mm512_storeu_ps(p, a); }
  static F set1(float s) { return _mm512_set1_ps(s); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(F a) { return _mm512_reduce_add_ps(a); }
  // The sums of NR <= 16 vectors, each added up in sum's order (lane i with i + 8, then i + 4,
  // i + 2, i + 1), but several vectors an instruction.
  template <int NR>
  static void sums(const F* v, float* out) {
    if constexpr (NR == 1) {
      out[0] = sum(v[0]);
    } else {
      constexpr int N1 = (NR + 1) / 2, N2 = (N1 + 1) / 2, N3 = (N2 + 1) / 2;
      const F z = zero();
      F t[N1], u[N2], w[N3];
      for (int i = 0; i < N1; ++i) {
        const F b = 2 * i + 1 < NR ? v[2 * i + 1] : z;
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], b, 0x44), _mm512_shuffle_f32x4(v[2 * i], b, 0xee));
      }
      for (int i = 0; i < N2; ++i) {
        const F b = 2 * i + 1 < N1 ? t[2 * i + 1] : z;
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], b, 0x88), _mm512_shuffle_f32x4(t[2 * i], b, 0xdd));
      }
      for (int i = 0; i < N3; ++i) {
        const F b = 2 * i + 1 < N2 ? u[2 * i + 1] : z;
        w[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], b, 0x44), _mm512_shuffle_ps(u[2 * i], b, 0xee));
      }
      const F b = N3 > 1 ? w[1] : z;
      alignas(64) float lanes[16];  // lane 4k + j: vector k + 4j
      _mm512_store_ps(lanes, _mm512_add_ps(_mm512_shuffle_ps(w[0], b, 0x88), _mm512_shuffle_ps(w[0], b, 0xdd)));
      for (int r = 0; r < NR; ++r) out[r] = lanes[4 * (r % 4) + r / 4];
    }
  }
  static __mmask16 first(int n) { return static_cast<__mmask16>((1u << n) - 1); }
  static F load_part(const float* p, int n) { return _mm512_maskz_loadu_ps(first(n), p); }
  static __m256i halves(const uint16_t* p, int n) {
    return _mm512_castsi512_si256(_mm512_maskz_loadu_epi16(static_cast<__mmask32>(first(n)), p));
  }
  static F f16_part(const uint16_t* p, int n) { return _mm512_cvtph_ps(halves(p, n)); }
  static F bf16_part(const uint16_t* p, int n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves(p, n)), 16));
  }
  static I words(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I words_part(const uint8_t* p, int n) { return _mm512_maskz_loadu_epi32(first(n), p); }
  // Field J: 8-bit fields by a byte shuffle within each 128-bit lane (or one mask or shift), 4-bit
  // fields by a shift and a 16-entry table lookup (vpermps reads only the low 4 bits of an index).
  template <int BITS, int J>
  static F field(I w) {
    if constexpr (BITS == 8) {
      if constexpr (J == 0) return _mm512_cvtepi32_ps(_mm512_and_si512(w, _mm512_set1_epi32(0xff)));
      if constexpr (J == 3) return _mm512_cvtepi32_ps(_mm512_srli_epi32(w, 24));
      const I pick = _mm512_setr4_epi32(static_cast<int>(0x80808000u | J), static_cast<int>(0x80808004u | J),
                                        static_cast<int>(0x80808008u | J), static_cast<int>(0x8080800cu | J));
      return _mm512_cvtepi32_ps(_mm512_shuffle_epi8(w, pick));
    } else {
      const F table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      return _mm512_permutexvar_ps(J == 0 ? w : _mm512_srli_epi32(w, 4 * J), table);
    }
  }
  static F spread(F s, int first, int P, int shift) {
    const I lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const I idx = _mm512_srli_epi32(_mm512_add_epi32(_mm512_mullo_epi32(lane, _mm512_set1_epi32(P)), _mm512_set1_epi32(first)), shift);
    return _mm512_permutexvar_ps(idx, s);
  }
  static F u8(const uint8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
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
