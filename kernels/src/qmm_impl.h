// The packed kernels, written once over a vector type V (see qmm.h for the arithmetic).
//
// Included by qmm_avx512.cpp, qmm_avx2.cpp and qmm_portable.cpp, each inside its own namespace
// and compiled with its own instruction-set flags. Everything here has internal linkage and uses
// no standard-library templates, so no function compiled for a wider instruction set can be
// picked by the linker for a narrower one.
//
// V provides: L (floats a vector), F (the vector), zero, load, store, set1, fma(a, b, c) = a*b + c,
// sum (horizontal), f16(p) and bf16(p) (L half-precision values -> L floats; not in the plain C++
// build), u8(p) (L bytes -> L floats), u4(p, lo, hi) (L bytes -> their low and high
// nibbles as floats), u4n(p, a, b) (L bytes -> 2L nibbles in storage order: a the first L), and
// NR4, the weight rows a tile of 4 activation rows takes (2 where 16 accumulators leave registers
// to spare: FMA latency times the FMA ports needs about 8 independent sums).

namespace {

using F = V::F;

// Scales and biases as float: float32 as is, bfloat16 by a shift, float16 by its bit fields (no
// F16C instruction needed; one conversion a group).
struct Bf16 {
  uint16_t bits;
  static constexpr bool brain = true;
};
struct F16 {
  uint16_t bits;
  static constexpr bool brain = false;
};

inline float as_float(float v) { return v; }

inline float bits_to_float(uint32_t u) {
  float f;
  __builtin_memcpy(&f, &u, sizeof f);
  return f;
}

inline float as_float(Bf16 v) { return bits_to_float(static_cast<uint32_t>(v.bits) << 16); }

inline float as_float(F16 v) {
  const uint32_t sign = static_cast<uint32_t>(v.bits & 0x8000) << 16;
  const uint32_t exponent = (v.bits >> 10) & 0x1f;
  const uint32_t mantissa = v.bits & 0x3ff;
  if (exponent == 0x1f) return bits_to_float(sign | 0x7f800000 | (mantissa << 13));  // inf, nan
  if (exponent != 0) return bits_to_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
  // zero and subnormals: mantissa * 2^-24
  const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
  return sign ? -magnitude : magnitude;
}

// n scales or biases as float32 into out: half precision converted a vector at a time (W is V; a
// parameter so that the plain C++ build, whose V has no such conversions, never names them).
template <class S, class W = V>
inline void widen(const S* in, int64_t n, float* out) {
  int64_t i = 0;
  if constexpr (W::L > 1 && sizeof(S) == 2) {
    const auto* h = reinterpret_cast<const uint16_t*>(in);
    for (; i + W::L <= n; i += W::L) W::store(out + i, S::brain ? W::bf16(h + i) : W::f16(h + i));
  }
  for (; i < n; ++i) out[i] = as_float(in[i]);
}

// Groups whose scales and biases a tile converts at a time (into float arrays on the stack).
constexpr int64_t kGroupBlock = 64;

// One tile: NR weight rows (from row pointer w, scale/bias rows sc/bi) times MT activation rows.
template <int BITS, int MT, int NR, class S>
inline void tile(const float* xp, const float* xs, int64_t K, int64_t G, int group,
                 const uint8_t* w, int64_t row_bytes, const S* sc, const S* bi,
                 float* y, int64_t ldy) {
  F tot[NR][MT];
  float bias[NR][MT];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MT; ++m) tot[r][m] = V::zero(), bias[r][m] = 0.0f;
  float scale[NR][kGroupBlock];
  for (int64_t g = 0; g < G; ++g) {
    const int64_t gb = g % kGroupBlock;
    if (gb == 0) {
      const int64_t n = G - g < kGroupBlock ? G - g : kGroupBlock;
      float b[kGroupBlock];
      for (int r = 0; r < NR; ++r) {
        widen(sc + r * G + g, n, scale[r]);
        widen(bi + r * G + g, n, b);
        for (int m = 0; m < MT; ++m) {
          float t = 0.0f;
          for (int64_t i = 0; i < n; ++i) t += b[i] * xs[m * G + g + i];
          bias[r][m] += t;
        }
      }
    }
    F acc[NR][MT];
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < MT; ++m) acc[r][m] = V::zero();
    const int64_t k0 = g * group;
    if (BITS == 8) {
      for (int64_t k = k0; k < k0 + group; k += V::L) {
        F q[NR];
        for (int r = 0; r < NR; ++r) q[r] = V::u8(w + r * row_bytes + k);
        for (int m = 0; m < MT; ++m) {
          const F xv = V::load(xp + m * K + k);
          for (int r = 0; r < NR; ++r) acc[r][m] = V::fma(q[r], xv, acc[r][m]);
        }
      }
    } else {
      for (int64_t k = k0; k < k0 + group; k += 2 * V::L) {
        F lo[NR], hi[NR];
        for (int r = 0; r < NR; ++r) V::u4(w + r * row_bytes + k / 2, lo[r], hi[r]);
        for (int m = 0; m < MT; ++m) {
          const F xe = V::load(xp + m * K + k);
          const F xo = V::load(xp + m * K + k + V::L);
          for (int r = 0; r < NR; ++r) {
            acc[r][m] = V::fma(lo[r], xe, acc[r][m]);
            acc[r][m] = V::fma(hi[r], xo, acc[r][m]);
          }
        }
      }
    }
    for (int r = 0; r < NR; ++r) {
      const F s = V::set1(scale[r][gb]);
      for (int m = 0; m < MT; ++m) tot[r][m] = V::fma(acc[r][m], s, tot[r][m]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MT; ++m) y[m * ldy + r] = V::sum(tot[r][m]) + bias[r][m];
}

// Software prefetch this many bytes of weight rows ahead (and the scales and biases of those
// rows): a decode product streams each weight once from memory, and the hardware prefetchers
// alone kept one core at ~9 GB/s on the 270M's head, against ~27 GB/s with this (docs/speed.md).
constexpr int64_t kPrefetchBytes = 8192;

inline void prefetch(const void* start, int64_t bytes) {
  const char* p = static_cast<const char*>(start);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off);
}

// Rows [n0, n1) for MT activation rows starting at row m0: NR rows at a time, then one by one.
template <int BITS, int MT, int NR, class S>
inline void rows_mt(const Prepared& a, const PackedWeights& p, int64_t m0, int64_t n0, int64_t n1, float* y) {
  const int64_t K = p.K, G = p.groups(), rb = p.row_bytes();
  const float* xp = a.x + m0 * K;
  const float* xs = a.sums + m0 * G;
  const S* sc = static_cast<const S*>(p.scales);
  const S* bi = static_cast<const S*>(p.biases);
  float* ym = y + m0 * p.N;
  const int64_t ahead = (kPrefetchBytes + rb - 1) / rb;  // rows
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) {
    if (n + ahead + NR <= n1) {
      prefetch(p.w + (n + ahead) * rb, NR * rb);
      prefetch(sc + (n + ahead) * G, NR * G * static_cast<int64_t>(sizeof(S)));
      prefetch(bi + (n + ahead) * G, NR * G * static_cast<int64_t>(sizeof(S)));
    }
    tile<BITS, MT, NR, S>(xp, xs, K, G, p.group, p.w + n * rb, rb, sc + n * G, bi + n * G, ym + n, p.N);
  }
  for (; n < n1; ++n)
    tile<BITS, MT, 1, S>(xp, xs, K, G, p.group, p.w + n * rb, rb, sc + n * G, bi + n * G, ym + n, p.N);
}

// Weight rows outermost (read from memory once), activation rows in tiles of up to 4 inside,
// over blocks of 16 weight rows (they stay in L1 between the tiles).
template <int BITS, class S>
inline void rows_bits(const Prepared& a, const PackedWeights& p, int64_t n0, int64_t n1, float* y) {
  if (a.M == 1) {
    rows_mt<BITS, 1, 4, S>(a, p, 0, n0, n1, y);
    return;
  }
  const int64_t block = 16;
  for (int64_t b0 = n0; b0 < n1; b0 += block) {
    const int64_t b1 = b0 + block < n1 ? b0 + block : n1;
    int64_t m = 0;
    for (; m + 4 <= a.M; m += 4) rows_mt<BITS, 4, V::NR4, S>(a, p, m, b0, b1, y);
    switch (a.M - m) {
      case 3: rows_mt<BITS, 3, 1, S>(a, p, m, b0, b1, y); break;
      case 2: rows_mt<BITS, 2, 2, S>(a, p, m, b0, b1, y); break;
      case 1: rows_mt<BITS, 1, 4, S>(a, p, m, b0, b1, y); break;
      default: break;
    }
  }
}

template <int BITS, class S>
inline void dequant_bits(const PackedWeights& p, int64_t n0, int64_t n1, float* out) {
  const int64_t K = p.K, G = p.groups(), rb = p.row_bytes();
  const S* sc = static_cast<const S*>(p.scales);
  const S* bi = static_cast<const S*>(p.biases);
  const int64_t ahead = (kPrefetchBytes + rb - 1) / rb;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = p.w + n * rb;
    float* o = out + n * K;
    if (n + ahead < n1) prefetch(w + ahead * rb, rb);
    for (int64_t g = 0; g < G; ++g) {
      const F s = V::set1(as_float(sc[n * G + g]));
      const F b = V::set1(as_float(bi[n * G + g]));
      const int64_t k0 = g * p.group;
      if (BITS == 8) {
        for (int64_t k = k0; k < k0 + p.group; k += V::L) V::store(o + k, V::fma(V::u8(w + k), s, b));
      } else {
        for (int64_t k = k0; k < k0 + p.group; k += 2 * V::L) {
          F lo, hi;
          V::u4n(w + k / 2, lo, hi);
          V::store(o + k, V::fma(lo, s, b));
          V::store(o + k + V::L, V::fma(hi, s, b));
        }
      }
    }
  }
}

template <int BITS>
inline void rows_scaled(const Prepared& a, const PackedWeights& p, int64_t n0, int64_t n1, float* y) {
  switch (p.scale_type) {
    case ScaleType::bf16: rows_bits<BITS, Bf16>(a, p, n0, n1, y); break;
    case ScaleType::f16: rows_bits<BITS, F16>(a, p, n0, n1, y); break;
    default: rows_bits<BITS, float>(a, p, n0, n1, y); break;
  }
}

template <int BITS>
inline void dequant_scaled(const PackedWeights& p, int64_t n0, int64_t n1, float* out) {
  switch (p.scale_type) {
    case ScaleType::bf16: dequant_bits<BITS, Bf16>(p, n0, n1, out); break;
    case ScaleType::f16: dequant_bits<BITS, F16>(p, n0, n1, out); break;
    default: dequant_bits<BITS, float>(p, n0, n1, out); break;
  }
}

}  // namespace

void rows(const Prepared& a, const PackedWeights& p, int64_t n0, int64_t n1, float* y) {
  if (p.bits == 8)
    rows_scaled<8>(a, p, n0, n1, y);
  else
    rows_scaled<4>(a, p, n0, n1, y);
}

void dequantize(const PackedWeights& p, int64_t n0, int64_t n1, float* out) {
  if (p.bits == 8)
    dequant_scaled<8>(p, n0, n1, out);
  else
    dequant_scaled<4>(p, n0, n1, out);
}
