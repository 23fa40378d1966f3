// The packed kernels, written once over a vector type V (see qmm.h for the arithmetic and the
// activations' order).
//
// Included by qmm_avx512.cpp, qmm_avx2.cpp and qmm_portable.cpp, each inside its own namespace
// and compiled with its own instruction-set flags. Everything here has internal linkage and uses
// no standard-library templates, so no function compiled for a wider instruction set can be
// picked by the linker for a narrower one.
//
// V provides: L (floats a vector), F (the vector), I (L 32-bit words), zero, load, store, set1,
// fma(a, b, c) = a*b + c, sum (horizontal) and sums<NR> (NR of them, each in sum's order),
// words(p) (4L weight bytes as L words), words_part(p, n) (the first n words, the rest zero),
// field<BITS, J>(w) (the J-th BITS-bit field of every word, as floats), load_part, f16_part and
// bf16_part (n <= L float32, float16 or bfloat16 values as floats, the rest zero; not in the
// plain C++ build), spread(s, first, P, shift) (lane i: lane (first + i P) >> shift of s, the
// scale of its group), u8(p) and u4n(p, a, b) (L bytes -> L values, 2L nibbles in storage order,
// for dequantizing), and NR<BITS, MT>, the weight rows a tile of MT activation rows takes (the
// fastest measured, docs/speed.md).

namespace {

using F = V::F;
using I = V::I;

// Scales and biases as stored: float32, or the 16 bits of a bfloat16 or float16.
struct Bf16 {
  uint16_t bits;
  static constexpr bool brain = true;
};
struct F16 {
  uint16_t bits;
  static constexpr bool brain = false;
};

// Dequantization's scalar path (the plain C++ build converts every scale with these).
inline float bits_to_float(uint32_t u) {
  float f;
  __builtin_memcpy(&f, &u, sizeof f);
  return f;
}
inline float as_float(float v) { return v; }
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

// n <= L scales or biases as floats, the other lanes zero (W is V; a parameter so that the plain
// C++ build, whose V has no vector conversions, never names them).
template <class S, class W = V>
inline F scales(const S* p, int n) {
  if constexpr (W::L == 1) {
    return as_float(*p);
  } else if constexpr (sizeof(S) == 4) {
    return W::load_part(p, n);
  } else {
    const auto* h = reinterpret_cast<const uint16_t*>(p);
    return S::brain ? W::bf16_part(h, n) : W::f16_part(h, n);
  }
}

// fn.template operator()<J>() for J = 0 .. N - 1, unrolled.
template <int J, int N, class Fn>
__attribute__((always_inline)) inline void unroll(Fn& fn) {
  if constexpr (J < N) {
    fn.template operator()<J>();
    unroll<J + 1, N>(fn);
  }
}

inline int log2_of(int group) { return group == 32 ? 5 : group == 64 ? 6 : 7; }

// Software prefetch of the weight rows, one cache line with each block a row reads, at two
// distances: kPrefetchBytes ahead into L2 (prefetcht1) and kPrefetchNearBytes ahead into L1
// (prefetcht0); the scales and biases of the rows kPrefetchBytes ahead go to L2 a tile at a time.
// A decode product streams each weight once from memory and the hardware prefetchers alone fall
// far short (docs/speed.md, "Prefetch distance": the distances and hints were measured).
constexpr int64_t kPrefetchBytes = 16384;
constexpr int64_t kPrefetchNearBytes = 2048;

inline void prefetch_l2(const void* start, int64_t bytes) {
  const char* p = static_cast<const char*>(start);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 2);
}

// One tile: NR weight rows (row pointer w, scale and bias rows sc and bi) times MT activation rows.
//
// A block is L words of weights (4L bytes: P = 32 / BITS values a word); the activations come in
// the same order (qmm.h), so field J of every word meets one plain load of them. A block's values
// sum per lane into acc, which is then scaled lane by lane (each lane lies in one group; when a
// group spans whole blocks, by one broadcast scale) into tot. Scales and biases are converted L
// groups at a time; the biases meet the activations' group sums lane by lane in tot as well, so
// one horizontal sum a row ends it.
template <int BITS, int MT, int NR, class S, bool UNIFORM>
inline void tile(const Prepared& a, int64_t m0, const PackedWeights& p, const uint8_t* w, const S* sc, const S* bi,
                 float* y, int64_t ldy) {
  constexpr int P = 32 / BITS;
  constexpr int64_t BW = V::L * P;  // values a block
  const int64_t rb = p.row_bytes(), G = p.groups(), K = p.K;
  const int shift = log2_of(p.group);
  const int64_t full = K / BW;                            // whole blocks a row
  const int tail_words = static_cast<int>((K % BW) / P);  // words of the last, partial block
  const int64_t blocks_per_chunk = V::L * p.group / BW;   // a chunk: the blocks of L groups
  const float* x = a.x + m0 * a.x_stride;
  const float* xs = a.sums + m0 * a.sums_stride;
  F tot[NR][MT];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MT; ++m) tot[r][m] = V::zero();
  F s[NR];               // a chunk's scales
  float s1[NR][V::L];    // the same, to broadcast from (UNIFORM)

  auto block = [&](int64_t t, int64_t t0, bool whole) __attribute__((always_inline)) {
    I q[NR];
    for (int r = 0; r < NR; ++r) {
      const uint8_t* src = w + r * rb + t * 4 * V::L;
      __builtin_prefetch(src + kPrefetchBytes, 0, 2);
      __builtin_prefetch(src + kPrefetchNearBytes, 0, 3);
      q[r] = whole ? V::words(src) : V::words_part(src, tail_words);
    }
    F acc[NR][MT];
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < MT; ++m) acc[r][m] = V::zero();
    const float* xb = x + t * BW;
    auto field = [&]<int J>() __attribute__((always_inline)) {
      F xv[MT];
      for (int m = 0; m < MT; ++m) xv[m] = V::load(xb + m * a.x_stride + J * V::L);
      for (int r = 0; r < NR; ++r) {
        const F v = V::template field<BITS, J>(q[r]);
        for (int m = 0; m < MT; ++m) acc[r][m] = V::fma(v, xv[m], acc[r][m]);
      }
    };
    unroll<0, P>(field);
    const int first = static_cast<int>((t - t0) * BW);
    for (int r = 0; r < NR; ++r) {
      const F sv = UNIFORM ? V::set1(s1[r][first >> shift]) : V::spread(s[r], first, P, shift);
      for (int m = 0; m < MT; ++m) tot[r][m] = V::fma(acc[r][m], sv, tot[r][m]);
    }
  };

  for (int64_t g0 = 0; g0 < G; g0 += V::L) {
    const int n = static_cast<int>(G - g0 < V::L ? G - g0 : V::L);
    for (int r = 0; r < NR; ++r) {
      s[r] = scales(sc + r * G + g0, n);
      if (UNIFORM) V::store(s1[r], s[r]);
      const F b = scales(bi + r * G + g0, n);
      for (int m = 0; m < MT; ++m) tot[r][m] = V::fma(b, V::load(xs + m * a.sums_stride + g0), tot[r][m]);
    }
    const int64_t t0 = g0 / V::L * blocks_per_chunk;
    const int64_t t1 = t0 + blocks_per_chunk < full ? t0 + blocks_per_chunk : full;
    for (int64_t t = t0; t < t1; ++t) block(t, t0, true);
    if (tail_words && t1 == full && full < t0 + blocks_per_chunk) block(full, t0, false);
  }
  for (int m = 0; m < MT; ++m) {
    F col[NR];
    for (int r = 0; r < NR; ++r) col[r] = tot[r][m];
    V::template sums<NR>(col, y + m * ldy);
  }
}

// Rows [n0, n1) for MT activation rows starting at row m0: NR rows at a time, then one by one.
template <int BITS, int MT, int NR, class S, bool UNIFORM>
inline void rows_mt(const Prepared& a, const PackedWeights& p, int64_t m0, int64_t n0, int64_t n1, float* y) {
  const int64_t G = p.groups(), rb = p.row_bytes();
  const S* sc = static_cast<const S*>(p.scales);
  const S* bi = static_cast<const S*>(p.biases);
  float* ym = y + m0 * p.N;
  const int64_t ahead = (kPrefetchBytes + rb - 1) / rb;  // rows
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) {
    if (n + ahead + NR <= n1) {
      prefetch_l2(sc + (n + ahead) * G, NR * G * static_cast<int64_t>(sizeof(S)));
      prefetch_l2(bi + (n + ahead) * G, NR * G * static_cast<int64_t>(sizeof(S)));
    }
    tile<BITS, MT, NR, S, UNIFORM>(a, m0, p, p.w + n * rb, sc + n * G, bi + n * G, ym + n, p.N);
  }
  for (; n < n1; ++n) tile<BITS, MT, 1, S, UNIFORM>(a, m0, p, p.w + n * rb, sc + n * G, bi + n * G, ym + n, p.N);
}

// Weight rows outermost (read from memory once), activation rows in tiles of up to 4 inside,
// over blocks of 16 weight rows (they stay in L1 between the tiles).
template <int BITS, class S, bool UNIFORM>
inline void rows_bits(const Prepared& a, const PackedWeights& p, int64_t n0, int64_t n1, float* y) {
  if (a.M == 1) {
    rows_mt<BITS, 1, V::template NR<BITS, 1>, S, UNIFORM>(a, p, 0, n0, n1, y);
    return;
  }
  const int64_t block = 16;
  for (int64_t b0 = n0; b0 < n1; b0 += block) {
    const int64_t b1 = b0 + block < n1 ? b0 + block : n1;
    int64_t m = 0;
    for (; m + 4 <= a.M; m += 4) rows_mt<BITS, 4, V::template NR<BITS, 4>, S, UNIFORM>(a, p, m, b0, b1, y);
    switch (a.M - m) {
      case 3: rows_mt<BITS, 3, V::template NR<BITS, 3>, S, UNIFORM>(a, p, m, b0, b1, y); break;
      case 2: rows_mt<BITS, 2, V::template NR<BITS, 2>, S, UNIFORM>(a, p, m, b0, b1, y); break;
      case 1: rows_mt<BITS, 1, V::template NR<BITS, 1>, S, UNIFORM>(a, p, m, b0, b1, y); break;
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
    if (n + ahead < n1) prefetch_l2(w + ahead * rb, rb);
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

// Whether each block lies in one group (then its scale is one broadcast).
template <int BITS, class S>
inline void rows_grouped(const Prepared& a, const PackedWeights& p, int64_t n0, int64_t n1, float* y) {
  if (p.group >= V::L * 32 / BITS)
    rows_bits<BITS, S, true>(a, p, n0, n1, y);
  else
    rows_bits<BITS, S, false>(a, p, n0, n1, y);
}

template <int BITS>
inline void rows_scaled(const Prepared& a, const PackedWeights& p, int64_t n0, int64_t n1, float* y) {
  switch (p.scale_type) {
    case ScaleType::bf16: rows_grouped<BITS, Bf16>(a, p, n0, n1, y); break;
    case ScaleType::f16: rows_grouped<BITS, F16>(a, p, n0, n1, y); break;
    default: rows_grouped<BITS, float>(a, p, n0, n1, y); break;
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
