// The prefill kernels, written once over GCC/Clang vector extensions of W floats (see prefill.h).
//
// Included by prefill_avx512.cpp, prefill_avx2.cpp and prefill_portable.cpp inside their own
// namespaces, each compiled with its own instruction-set flags and defining W (floats a vector)
// and MR (query rows a product tile holds: MR x 2 accumulators must fit the vector registers).
// Everything here has internal linkage, so no function compiled for a wider instruction set can
// be picked by the linker for a narrower one.

namespace {

typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
constexpr int NB = 2 * W;  // keys (or output columns) a tile holds: two vectors

inline vf load(const float* p) {
  vf v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, vf v) { __builtin_memcpy(p, &v, sizeof v); }
inline vf splat(float s) { return vf{} + s; }  // constants (folded); hot loops multiply by a scalar
inline vf vmin(vf a, vf b) { return a < b ? a : b; }
inline vf vmax(vf a, vf b) { return a > b ? a : b; }
inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
inline float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < W; ++i) m = v[i] > m ? v[i] : m;
  return m;
}
inline float hsum(vf v) {
  float s = 0.0f;
  for (int i = 0; i < W; ++i) s += v[i];
  return s;
}

// x[0:n] *= f.
inline void scale_row(float* x, int64_t n, float f) {
  const int64_t full = n / W * W;
  const vf v = splat(f);
  for (int64_t j = 0; j < full; j += W) store(x + j, load(x + j) * v);
  for (int64_t j = full; j < n; ++j) x[j] *= f;
}

// e^x for x <= 0 (a softmax's shifted scores): Cephes' expf as cache/cpu_math.py computes it,
// exactly 0 below e^-87.3 (and for -inf).
inline vf exp_nonpositive(vf x) {
  const vf low = splat(-87.3f);
  const vf c = vmax(vmin(x, splat(88.3f)), low);
  const vf n = (c * splat(1.44269504088896341f) + splat(12582912.0f)) - splat(12582912.0f);
  const vf r = c - n * splat(0.693359375f) - n * splat(-2.12194440e-4f);
  vf p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * (r * r) + r + splat(1.0f);
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  return x >= low ? p * (vf)bits : vf{};
}

// tanh by Eigen's rational [13/6] approximation, clamped to +-7.905 (cache/cpu_math.py's _tanh).
inline vf tanh_rational(vf x) {
  const float clamp = 7.90531110763549805f;
  x = vmax(vmin(x, splat(clamp)), splat(-clamp));
  const vf x2 = x * x;
  vf p = splat(-2.76076847742355e-16f);
  p = p * x2 + splat(2.00018790482477e-13f);
  p = p * x2 + splat(-8.60467152213735e-11f);
  p = p * x2 + splat(5.12229709037114e-08f);
  p = p * x2 + splat(1.48572235717979e-05f);
  p = p * x2 + splat(6.37261928875436e-04f);
  p = p * x2 + splat(4.89352455891786e-03f);
  vf q = splat(1.19825839466702e-06f);
  q = q * x2 + splat(1.18534705686654e-04f);
  q = q * x2 + splat(2.26843463243900e-03f);
  q = q * x2 + splat(4.89352518554385e-03f);
  return x * p / q;
}

inline float tanh_rational(float x) {
  vf v = splat(x);
  return tanh_rational(v)[0];
}

inline vf gelu_gate(vf gate, vf up) {
  const vf inner = splat(0.7978845608028654f) * (gate + splat(0.044715f) * gate * gate * gate);
  return splat(0.5f) * gate * (splat(1.0f) + tanh_rational(inner)) * up;
}

// tile[r, :] (+)= a_r[0:kc] . panel[0:kc, :] for M rows of a (lda apart: query rows, weight rows, rows
// of x) and the first V vectors of columns (NB for V = 2; V = 1: a panel that holds at most W
// activation rows, half the work) of kc panel rows ldb apart (NB: a packed panel, see pack_keys; a
// weight stored transposed: its row stride); tile rows ldt apart, added to when accumulate.
template <int M, int V = 2>
inline void panel_tile(const float* a, int64_t lda, const float* panel, int64_t kc, float* tile, int64_t ldt,
                       int64_t ldb = NB, bool accumulate = false) {
  vf acc[M][V];
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < V; ++c) acc[r][c] = accumulate ? load(tile + r * ldt + c * W) : vf{};
  for (int64_t d = 0; d < kc; ++d) {
    vf b[V];
    for (int c = 0; c < V; ++c) b[c] = load(panel + d * ldb + c * W);
    for (int r = 0; r < M; ++r) {
      const float x = a[r * lda + d];
      for (int c = 0; c < V; ++c) acc[r][c] += b[c] * x;
    }
  }
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < V; ++c) store(tile + r * ldt + c * W, acc[r][c]);
}

// S[r, j] = q_r . k_j for M query rows (ldq apart) and the keys of packed panels [0, jb1); S rows lds apart.
template <int M>
inline void scores_tile(const float* q, int64_t ldq, const float* panels, int64_t D, int64_t jb1, float* s, int64_t lds) {
  for (int64_t jb = 0; jb < jb1; ++jb) panel_tile<M>(q, ldq, panels + jb * D * NB, D, s + jb * NB, lds);
}

// out[r, c0 : c0 + NB] (+)= sum_j P[r, j] v[j, c0 : c0 + NB] over keys [0, n), for M rows.
template <int M>
inline void values_tile(const float* p, int64_t ldp, const float* v, int64_t ldv, int64_t n, int64_t c0,
                        float* out, int64_t ldo, bool accumulate) {
  vf acc[M][2];
  for (int r = 0; r < M; ++r) {
    acc[r][0] = accumulate ? load(out + r * ldo + c0) : vf{};
    acc[r][1] = accumulate ? load(out + r * ldo + c0 + W) : vf{};
  }
  for (int64_t j = 0; j < n; ++j) {
    const vf b0 = load(v + j * ldv + c0), b1 = load(v + j * ldv + c0 + W);
    for (int r = 0; r < M; ++r) {
      const float a = p[r * ldp + j];
      acc[r][0] += b0 * a;
      acc[r][1] += b1 * a;
    }
  }
  for (int r = 0; r < M; ++r) {
    store(out + r * ldo + c0, acc[r][0]);
    store(out + r * ldo + c0 + W, acc[r][1]);
  }
}

// Query row i of head h (batch row b) in attention's output, [B, L, Hq, Dv]: rows of one head
// out_stride(a) apart.
inline float* out_row(const AttentionArgs& a, int64_t b, int64_t h, int64_t i) {
  return a.out + ((b * a.L + i) * a.Hq + h) * a.Dv;
}
inline int64_t out_stride(const AttentionArgs& a) { return a.Hq * a.Dv; }

// out[r, :] (+)= sum_j P[r, j] v[j, :] over keys [0, n) for M rows (P rows ldp apart, out rows out_stride(a) apart).
template <int M>
inline void values_rows(const AttentionArgs& a, const float* p, int64_t ldp, const float* v, int64_t n, float* out,
                        bool accumulate) {
  const int64_t full = a.Dv / NB * NB;
  const int64_t ldo = out_stride(a);
  for (int64_t c0 = 0; c0 < full; c0 += NB) values_tile<M>(p, ldp, v, a.v_stride[2], n, c0, out, ldo, accumulate);
  for (int64_t c = full; c < a.Dv; ++c)  // columns past the last whole tile
    for (int r = 0; r < M; ++r) {
      float acc = accumulate ? out[r * ldo + c] : 0.0f;
      for (int64_t j = 0; j < n; ++j) acc += p[r * ldp + j] * v[j * a.v_stride[2] + c];
      out[r * ldo + c] = acc;
    }
}

// y[m, n0 + r] (+)= tile[r, m - m0] for the tile's rows r < rows (ldt apart) and activation rows m < M.
inline void write_tile(const float* tile, int64_t ldt, int rows, int64_t m0, int64_t M, int64_t n0, float* y,
                       int64_t ldy, bool accumulate) {
  const int64_t ms = M - m0 < ldt ? M - m0 : ldt;
  for (int64_t c = 0; c < ms; ++c) {
    float* out = y + (m0 + c) * ldy + n0;
    if (accumulate)
      for (int r = 0; r < rows; ++r) out[r] += tile[r * ldt + c];
    else
      for (int r = 0; r < rows; ++r) out[r] = tile[r * ldt + c];
  }
}

}  // namespace

// y[:, n0:n1] = x w[n0:n1]^T for x packed into panels of NB rows (pack_keys: each K x NB), in
// blocks of KC inputs, K cut into equal blocks of at most kLinearInputs (a block of MC panels stays
// in the core's L2 while the weight rows pass; each block's tile is written out, transposed, once).
void linear_rows(const float* w, int64_t K, const float* panels, int64_t M, int64_t n0, int64_t n1, float* y,
                 int64_t ldy) {
  constexpr int64_t MC = 8;  // panels a block
  const int64_t blocks = K > kLinearInputs ? (K + kLinearInputs - 1) / kLinearInputs : 1;
  const int64_t KC = (K + blocks - 1) / blocks;
  const int64_t npanels = (M + NB - 1) / NB;
  float tile[MRL * NB];
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t kc = K - k0 < KC ? K - k0 : KC;
    for (int64_t p0 = 0; p0 < npanels; p0 += MC) {
      const int64_t p1 = p0 + MC < npanels ? p0 + MC : npanels;
      for (int64_t n = n0; n < n1; n += MRL) {
        const int rows = static_cast<int>(n1 - n < MRL ? n1 - n : MRL);
        for (int64_t p = p0; p < p1; ++p) {
          const float* panel = panels + p * K * NB + k0 * NB;
          const int64_t ldt = M - p * NB <= W ? W : NB;  // W: the panel's second vector holds no rows
          if (ldt == W && rows == MRL) {
            panel_tile<MRL, 1>(w + n * K + k0, K, panel, kc, tile, W);
          } else if (ldt == W) {
            for (int r = 0; r < rows; ++r) panel_tile<1, 1>(w + (n + r) * K + k0, K, panel, kc, tile + r * W, W);
          } else if (rows == MRL) {
            panel_tile<MRL>(w + n * K + k0, K, panel, kc, tile, NB);
          } else {
            for (int r = 0; r < rows; ++r) panel_tile<1>(w + (n + r) * K + k0, K, panel, kc, tile + r * NB, NB);
          }
          write_tile(tile, ldt, rows, p * NB, M, n, y, ldy, k0 > 0);
        }
      }
    }
  }
}

// Floats of a weight row a dot tile prefetches ahead into L2 (a decode product streams its weight).
constexpr int64_t kDotAhead = 4096;

// Weight rows a dot tile takes for M rows of x: NR x M accumulators, M rows of x and one weight
// vector fit the registers.
constexpr int dot_rows(int M) { return W >= 16 ? (M <= 2 ? 4 : M <= 4 ? 3 : 2) : (M <= 2 ? 3 : M <= 4 ? 2 : 1); }

// y[m, r] = w[r] . x[m] for NR weight rows (K apart) and M rows of x (K apart), y rows ldy apart:
// vectors along K, one horizontal sum per output. Each output's sum runs in the same order whatever
// NR and M, so a row of x gets the same bits in any batch.
template <int M, int NR>
inline void dots_tile(const float* w, int64_t K, const float* x, float* y, int64_t ldy) {
  const int64_t full = K / W * W;
  vf acc[NR][M];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = vf{};
  for (int64_t d = 0; d < full; d += W) {
    vf xv[M];
    for (int m = 0; m < M; ++m) xv[m] = load(x + m * K + d);
    for (int r = 0; r < NR; ++r) {
      __builtin_prefetch(w + r * K + d + kDotAhead, 0, 2);
      const vf wv = load(w + r * K + d);
      for (int m = 0; m < M; ++m) acc[r][m] += wv * xv[m];
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < M; ++m) {
      float t = hsum(acc[r][m]);
      for (int64_t d = full; d < K; ++d) t += w[r * K + d] * x[m * K + d];
      y[m * ldy + r] = t;
    }
}

template <int M>
inline void dots_rows(const float* w, int64_t K, const float* x, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  constexpr int NR = dot_rows(M);
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) dots_tile<M, NR>(w + n * K, K, x, y + n, ldy);
  for (; n < n1; ++n) dots_tile<M, 1>(w + n * K, K, x, y + n, ldy);
}

// Rows of x a few-row tile holds: 2 G accumulators, two weight vectors and a broadcast fit the registers.
constexpr int GF = W >= 16 ? 8 : 4;

// y[:, n0:n1] = x wt[:, n0:n1] for the M rows of x [M, K] (contiguous) and a weight stored transposed,
// wt [K, N] with rows ldw apart (the output head's layout): blocks of KC weight rows, each streamed
// along [n0, n1) in tiles of NB columns, every row of x against a tile while it is in the core's
// caches, y accumulated across the blocks (it stays in the core's caches for a chunk of columns); the
// weight read once. KC is 8 sequential streams up to 4 rows; above, 24, which adds y's reloads a third
// as often. Above 2 rows each tile's KC rows are prefetched four tiles ahead into L2 (at 2 rows the
// hardware prefetchers keep up; docs/speed.md, "A batch's few rows").
void linear_few_transposed(const float* wt, int64_t ldw, int64_t K, const float* x, int64_t M, int64_t n0, int64_t n1,
                           float* y, int64_t ldy) {
  const int64_t KC = M > GF ? 512 : M > 4 ? 24 : 8;
  const int64_t full = n0 + (n1 - n0) / NB * NB;
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t kc = K - k0 < KC ? K - k0 : KC;
    const bool accumulate = k0 > 0;
    for (int64_t c0 = n0; c0 < full; c0 += NB) {
      if (M > 2 && M <= GF)
        for (int64_t k = 0; k < kc; ++k)
          for (int64_t line = 0; line < NB; line += 16) __builtin_prefetch(wt + (k0 + k) * ldw + c0 + 4 * NB + line, 0, 2);
      for (int64_t m0 = 0; m0 < M; m0 += GF) {
        const float* w = wt + k0 * ldw + c0;
        const float* xm = x + m0 * K + k0;
        float* ym = y + m0 * ldy + c0;
        switch (M - m0 < GF ? M - m0 : GF) {
          case 1: panel_tile<1>(xm, K, w, kc, ym, ldy, ldw, accumulate); break;
          case 2: panel_tile<2>(xm, K, w, kc, ym, ldy, ldw, accumulate); break;
          case 3: panel_tile<3>(xm, K, w, kc, ym, ldy, ldw, accumulate); break;
          case 4: panel_tile<4>(xm, K, w, kc, ym, ldy, ldw, accumulate); break;
          case 5: panel_tile<GF < 5 ? GF : 5>(xm, K, w, kc, ym, ldy, ldw, accumulate); break;
          case 6: panel_tile<GF < 6 ? GF : 6>(xm, K, w, kc, ym, ldy, ldw, accumulate); break;
          case 7: panel_tile<GF < 7 ? GF : 7>(xm, K, w, kc, ym, ldy, ldw, accumulate); break;
          default: panel_tile<GF>(xm, K, w, kc, ym, ldy, ldw, accumulate); break;
        }
      }
    }
    for (int64_t c = full; c < n1; ++c)  // columns past the last whole tile
      for (int64_t m = 0; m < M; ++m) {
        float s = accumulate ? y[m * ldy + c] : 0.0f;
        for (int64_t k = 0; k < kc; ++k) s += x[m * K + k0 + k] * wt[(k0 + k) * ldw + c];
        y[m * ldy + c] = s;
      }
  }
}

// y[:, n0:n1] = x w[n0:n1]^T for M <= kDotMaxRows (8) rows of x [M, K] (contiguous), no packing: each
// weight row streamed once against every row of x (a panel of the GEMM above would be mostly zero
// padding at these rows, and its time that of 16).
void linear_dots(const float* w, int64_t K, const float* x, int64_t M, int64_t n0, int64_t n1, float* y,
                 int64_t ldy) {
  switch (M) {
    case 1: dots_rows<1>(w, K, x, n0, n1, y, ldy); break;
    case 2: dots_rows<2>(w, K, x, n0, n1, y, ldy); break;
    case 3: dots_rows<3>(w, K, x, n0, n1, y, ldy); break;
    case 4: dots_rows<4>(w, K, x, n0, n1, y, ldy); break;
    case 5: dots_rows<5>(w, K, x, n0, n1, y, ldy); break;
    case 6: dots_rows<6>(w, K, x, n0, n1, y, ldy); break;
    case 7: dots_rows<7>(w, K, x, n0, n1, y, ldy); break;
    default: dots_rows<8>(w, K, x, n0, n1, y, ldy); break;
  }
}

// The two-source shuffle of a and b by constant indices I (index e: element e of a, W + e: of b),
// spelled for GCC and for Clang (whose __builtin_shuffle does not exist).
template <int... I>
inline vf shuffle2(vf a, vf b) {
#if defined(__clang__)
  return __builtin_shufflevector(a, b, I...);
#else
  return __builtin_shuffle(a, b, vi{I...});
#endif
}

// One stage of an in-register transpose of W vectors: swaps the off-diagonal B x B blocks of each
// 2B x 2B block (rows r and r + B exchange halves). Stages B = W/2 ... 1 make t[i][j] = t[j][i].
template <int B, int... E>
inline void swap_blocks(vf& a, vf& b, std::integer_sequence<int, E...>) {
  const vf x = a, y = b;
  a = shuffle2<(E & B ? W + E - B : E)...>(x, y);
  b = shuffle2<(E & B ? W + E : E + B)...>(x, y);
}

template <int B>
inline void transpose_from(vf* t) {
  for (int r = 0; r < W; ++r)
    if (!(r & B)) swap_blocks<B>(t[r], t[r + B], std::make_integer_sequence<int, W>{});
  if constexpr (B > 1) transpose_from<B / 2>(t);
}

// Keys [j0, j1) (whole panels) of one (batch, kv head) into panels of D x NB floats, zero past T:
// W keys by W inputs at a time, loaded as vectors, transposed in registers, stored as whole
// vectors (a scalar copy wrote each panel line NB times).
void pack_keys(const float* k, int64_t k_row_stride, int64_t T, int64_t D, int64_t jb0, int64_t jb1, float* panels) {
  const int64_t full = D / W * W;
  for (int64_t jb = jb0; jb < jb1; ++jb) {
    for (int64_t c0 = 0; c0 < NB; c0 += W) {
      float* b = panels + jb * D * NB + c0;
      const int64_t first = jb * NB + c0, keys = T - first < W ? (T > first ? T - first : 0) : W;
      for (int64_t d0 = 0; d0 < full; d0 += W) {
        vf t[W];
        for (int c = 0; c < W; ++c) t[c] = c < keys ? load(k + (first + c) * k_row_stride + d0) : vf{};
        if constexpr (W > 1) transpose_from<W / 2>(t);
        for (int d = 0; d < W; ++d) store(b + (d0 + d) * NB, t[d]);
      }
      for (int64_t d = full; d < D; ++d)  // inputs past the last whole vector
        for (int c = 0; c < W; ++c) b[d * NB + c] = c < keys ? k[(first + c) * k_row_stride + d] : 0.0f;
    }
  }
}

int key_block() { return NB; }

// Key panels a block of query rows takes at a time (kAttendKeys): their packed keys and values, the
// rows' scores and the group's queries and outputs stay in the core's L2 while the block reads
// them (a whole long run does not: 32k keys of 256 floats are 32 MB each for keys and values, and
// 4 MB of scores a block; 512 keys were slower with four heads a job).
constexpr int64_t kKeyPanels = kAttendKeys / NB;

// One block of query rows [i0, i1) of query heads [h0, h1) of one batch row, heads that share one kv
// head (at most kGroupHeads): over the keys the block may see, kKeyPanels panels at a time, for
// each head in turn (so a key block is read from memory once for all of them) scores against the
// packed keys, the masked scores' running maximum and sum (an online softmax in float32: earlier
// blocks' sums and outputs rescaled by e^(old max - new max)), and the product with the values
// added to the out rows, which the sums divide at the end.
void attention_block(const AttentionArgs& a, int64_t b, int64_t h0, int64_t h1, int64_t i0, int64_t i1,
                     const float* panels, float* s) {
  const int64_t hk = h0 / (a.Hq / a.Hkv);
  const int64_t rows = i1 - i0;
  // The keys this block may see, [first, seen): causal rows see up to their own position (the
  // last query aligned with the last key), other reads all T keys; a mask narrows that to the
  // first and last key any row of the block sees (a sliding window's band skips the panels
  // outside it). No visible key at all: NaN rows, as MLX gives.
  int64_t first = 0, seen = a.causal ? imin(a.T, a.T - a.L + i1) : a.T;
  if (a.mask && a.mask_stride[2] == 1) {
    int64_t lo = seen, hi = 0;
    for (int64_t i = i0; i < i1; ++i) {
      const uint8_t* m = a.mask + b * a.mask_stride[0] + i * a.mask_stride[1];
      const void* left = std::memchr(m, 1, lo);  // MLX's bools are bytes of 0 or 1
      if (left) lo = static_cast<const uint8_t*>(left) - m;
      for (int64_t j = seen - 1; j >= hi; --j)
        if (m[j]) {
          hi = j + 1;
          break;
        }
    }
    if (lo >= hi) {
      for (int64_t h = h0; h < h1; ++h)
        for (int64_t i = i0; i < i1; ++i)
          for (int64_t c = 0; c < a.Dv; ++c) out_row(a, b, h, i)[c] = __builtin_nanf("");
      return;
    }
    first = lo, seen = hi;
  }
  const int64_t jb_first = first / NB, jb1 = (seen + NB - 1) / NB;
  const int64_t lds = imin(jb1 - jb_first, kKeyPanels) * NB;
  const int64_t ldo = out_stride(a);
  const float* v = a.v + b * a.v_stride[0] + hk * a.v_stride[1];
  const float ninf = -__builtin_inff();
  float top[kGroupHeads][kBlockRows], sum[kGroupHeads][kBlockRows];
  for (int64_t g = 0; g < h1 - h0; ++g)
    for (int64_t rr = 0; rr < rows; ++rr) top[g][rr] = ninf, sum[g][rr] = 0.0f;

  for (int64_t jb0 = jb_first; jb0 < jb1; jb0 += kKeyPanels) {
    const bool later = jb0 > jb_first;  // earlier blocks' sums and outputs to rescale and add to
    const int64_t nb = imin(jb1 - jb0, kKeyPanels), k0 = jb0 * NB, k1 = imin(seen, k0 + nb * NB);
    const int64_t width = nb * NB;
    const float* kp = panels + jb0 * a.D * NB;
    const float* vb = v + k0 * a.v_stride[2];
    for (int64_t h = h0; h < h1; ++h) {
      const float* q = a.q + b * a.q_stride[0] + h * a.q_stride[1] + i0 * a.q_stride[2];
      float* out = out_row(a, b, h, i0);
      float* head_top = top[h - h0];
      float* head_sum = sum[h - h0];
      // Scores: MR rows a tile, then the remainder.
      int64_t r = 0;
      for (; r + MR <= rows; r += MR) scores_tile<MR>(q + r * a.q_stride[2], a.q_stride[2], kp, a.D, nb, s + r * lds, lds);
      for (; r < rows; ++r) scores_tile<1>(q + r * a.q_stride[2], a.q_stride[2], kp, a.D, nb, s + r * lds, lds);

      // Softmax rows over this block's keys: scale, mask (-inf), the new maximum, e^(x - max).
      for (int64_t rr = 0; rr < rows; ++rr) {
        float* row = s + rr * lds;
        const int64_t i = i0 + rr;
        const int64_t visible = imin(a.causal ? imin(a.T, a.T - a.L + i + 1) : a.T, k1) - k0;  // may be <= 0
        const int64_t shown = visible > 0 ? visible : 0;
        if (a.mask) {
          const uint8_t* m = a.mask + b * a.mask_stride[0] + i * a.mask_stride[1] + k0 * a.mask_stride[2];
          for (int64_t j = 0; j < shown; ++j) row[j] = m[j * a.mask_stride[2]] ? row[j] * a.scale : ninf;
        } else {
          scale_row(row, shown, a.scale);
        }
        for (int64_t j = shown; j < width; ++j) row[j] = ninf;
        vf mx = splat(head_top[rr]);
        for (int64_t j = 0; j < width; j += W) mx = vmax(mx, load(row + j));
        const float new_top = hmax(mx);
        // e^(old - new) for the earlier blocks (0 while every score so far was masked: -inf - -inf
        // gives NaN, which exp_nonpositive maps to 0, as it does e^-inf).
        const float shrink = exp_nonpositive(splat(head_top[rr] - new_top))[0];
        const vf t = splat(new_top);
        vf add = vf{};
        for (int64_t j = 0; j < width; j += W) {
          const vf e = exp_nonpositive(load(row + j) - t);
          store(row + j, e);
          add += e;
        }
        if (later) scale_row(out + rr * ldo, a.Dv, shrink);
        head_sum[rr] = head_sum[rr] * shrink + hsum(add);
        head_top[rr] = new_top;
      }

      // Values: out (+)= P v over the block's keys.
      r = 0;
      for (; r + MR <= rows; r += MR) values_rows<MR>(a, s + r * lds, lds, vb, k1 - k0, out + r * ldo, later);
      for (; r < rows; ++r) values_rows<1>(a, s + r * lds, lds, vb, k1 - k0, out + r * ldo, later);
    }
  }
  for (int64_t h = h0; h < h1; ++h)  // each row over its sum (0 when no key was visible: NaN)
    for (int64_t rr = 0; rr < rows; ++rr)
      scale_row(out_row(a, b, h, i0 + rr), a.Dv, 1.0f / sum[h - h0][rr]);
}

// Rows [r0, r1) of x [R, D]: y = x * (mean(x^2) + eps)^-1/2 * w (w may be null: no weight).
void rms_norm_rows(const float* x, const float* w, int64_t D, float eps, int64_t r0, int64_t r1, float* y) {
  const int64_t full = D / W * W;
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = x + r * D;
    float* yr = y + r * D;
    vf acc = vf{};
    for (int64_t d = 0; d < full; d += W) {
      const vf v = load(xr + d);
      acc += v * v;
    }
    float ss = hsum(acc);
    for (int64_t d = full; d < D; ++d) ss += xr[d] * xr[d];
    const float inv = 1.0f / __builtin_sqrtf(ss / static_cast<float>(D) + eps);
    for (int64_t d = 0; d < full; d += W) store(yr + d, w ? load(xr + d) * inv * load(w + d) : load(xr + d) * inv);
    for (int64_t d = full; d < D; ++d) yr[d] = w ? xr[d] * inv * w[d] : xr[d] * inv;
  }
}

// RoPE by tables for rows [r0, r1) of x [B, H, L, D] (row r = (b, h, l)): out = x cos + rotate_half(x) sin,
// dim i paired with i + D/2; cos and sin [L, D/2] of batch b at cs + b * cs_batch.
void rotate_rows(const float* x, const int64_t x_stride[3], int64_t H, int64_t L, int64_t D, const float* cos,
                 const float* sin, int64_t cs_batch, int64_t r0, int64_t r1, float* out) {
  const int64_t half = D / 2, full = half / W * W;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t b = r / (H * L), h = (r / L) % H, l = r % L;
    const float* xr = x + b * x_stride[0] + h * x_stride[1] + l * x_stride[2];
    const float* c = cos + b * cs_batch + l * half;
    const float* s = sin + b * cs_batch + l * half;
    float* o = out + r * D;
    for (int64_t i = 0; i < full; i += W) {
      const vf x1 = load(xr + i), x2 = load(xr + half + i), cv = load(c + i), sv = load(s + i);
      store(o + i, x1 * cv - x2 * sv);
      store(o + half + i, x2 * cv + x1 * sv);
    }
    for (int64_t i = full; i < half; ++i) {
      const float x1 = xr[i], x2 = xr[half + i];
      o[i] = x1 * c[i] - x2 * s[i];
      o[half + i] = x2 * c[i] + x1 * s[i];
    }
  }
}

// out[i] = gelu_tanh(gate[i]) * up[i] for i in [i0, i1).
void gelu_gate(const float* up, const float* gate, int64_t i0, int64_t i1, float* out) {
  int64_t i = i0;
  for (; i + W <= i1; i += W) store(out + i, gelu_gate(load(gate + i), load(up + i)));
  for (; i < i1; ++i) {
    const float g = gate[i];
    const float inner = 0.7978845608028654f * (g + 0.044715f * g * g * g);
    out[i] = 0.5f * g * (1.0f + tanh_rational(inner)) * up[i];
  }
}

// Sums each of the W vectors t[0 .. W) across its lanes at once: afterwards lane e of t[0] holds
// the sum of t[e]'s lanes. Each stage adds the block-swapped halves of a pair (swap_blocks), so that
// a vector carries the partial sums of two rows side by side (an in-register transpose, summed).
template <int B>
inline void sum_across(vf* t) {
  for (int r = 0; r < B; ++r) {
    vf a = t[r], b = t[r + B];
    swap_blocks<B>(a, b, std::make_integer_sequence<int, W>{});
    t[r] = a + b;
  }
  if constexpr (B > 1) sum_across<B / 2>(t);
}

// The lanes of v summed in the order sum_across sums each of its vectors (so that a row's score
// does not depend on whether it falls in a whole block of rows or in the rows after the last one).
inline float sum_tree(vf v) {
  for (int b = W / 2; b >= 1; b /= 2)
    for (int i = 0; i < b; ++i) v[i] = v[i] + v[i + b];
  return v[0];
}

// Decode attention streams every key and value row once from memory: the rows kDecodeAhead bytes
// ahead are prefetched into L2 (the hardware prefetchers alone read them at half the rate), and
// the values go kValueRows rows at a time.
constexpr int64_t kDecodeAhead = 16384 / sizeof(float);  // floats
constexpr int64_t kValueRows = kDecodeBlockRows;

// Prefetches the row kDecodeAhead floats past `row` (n floats), a cache line at a time.
inline void prefetch_ahead(const float* row, int64_t n) {
  for (int64_t d = 0; d < n; d += 64 / sizeof(float)) __builtin_prefetch(row + kDecodeAhead + d, 0, 2);
}

// s[g * n + j] = scale * q_g . k_j for the GB query heads from g0 and the W / GB key rows from j0
// (D a multiple of W): one accumulator per (row, head), each key vector loaded once for the GB
// heads, the W dot products summed across their lanes together (a horizontal sum each was most
// of a row's time).
template <int GB>
inline void scores_block(const float* q, int64_t D, const float* k, int64_t ldk, int64_t g0, int64_t j0, int64_t lds,
                         float scale, float* s) {
  constexpr int RB = W / GB;
  vf acc[W];
  for (int a = 0; a < W; ++a) acc[a] = vf{};
  for (int r = 0; r < RB; ++r) prefetch_ahead(k + (j0 + r) * ldk, D);
  for (int64_t d = 0; d < D; d += W) {
    vf qv[GB];
    for (int g = 0; g < GB; ++g) qv[g] = load(q + (g0 + g) * D + d);
    for (int r = 0; r < RB; ++r) {
      const vf kv = load(k + (j0 + r) * ldk + d);
      for (int g = 0; g < GB; ++g) acc[r * GB + g] += qv[g] * kv;
    }
  }
  if constexpr (W > 1) sum_across<W / 2>(acc);
  const vf sums = acc[0] * scale;
  for (int r = 0; r < RB; ++r)
    for (int g = 0; g < GB; ++g) s[(g0 + g) * lds + j0 + r] = sums[r * GB + g];
}

// The scores of the GB heads from g0 over rows [0, n) into s[g * lds + j]: whole blocks of W / GB
// rows, then row by row.
template <int GB>
inline void scores_heads(const float* q, int64_t D, const float* k, int64_t ldk, int64_t g0, int64_t n, float scale,
                         float* s, int64_t lds) {
  constexpr int RB = W / GB;
  int64_t j = 0;
  if (D % W == 0)
    for (; j + RB <= n; j += RB) scores_block<GB>(q, D, k, ldk, g0, j, lds, scale, s);
  const int64_t full = D / W * W;
  for (; j < n; ++j)
    for (int64_t g = g0; g < g0 + GB; ++g) {
      const float* qg = q + g * D;
      const float* kj = k + j * ldk;
      vf acc = vf{};
      for (int64_t d = 0; d < full; d += W) acc += load(qg + d) * load(kj + d);
      float t = sum_tree(acc);
      for (int64_t d = full; d < D; ++d) t += qg[d] * kj[d];
      s[g * lds + j] = t * scale;
    }
}

// The scores of all G query heads over rows [0, n), in groups of 8, 4, 2 or 1 heads (at most W / 2,
// so that a group's accumulators and query vectors fit the registers).
inline void scores_all(const float* q, int64_t G, int64_t D, const float* k, int64_t ldk, int64_t n, float scale,
                       float* s, int64_t lds) {
  int64_t g = 0;
  if constexpr (W >= 16)
    for (; g + 8 <= G; g += 8) scores_heads<8>(q, D, k, ldk, g, n, scale, s, lds);
  if constexpr (W >= 8)
    for (; g + 4 <= G; g += 4) scores_heads<4>(q, D, k, ldk, g, n, scale, s, lds);
  for (; g + 2 <= G; g += 2) scores_heads<2>(q, D, k, ldk, g, n, scale, s, lds);
  for (; g < G; ++g) scores_heads<1>(q, D, k, ldk, g, n, scale, s, lds);
}

// out[h * Dv + c] += sum_j s[h * n + j] v[j * ldv + c] for the HB heads from h0, rows [j0, j1)
// in order (masked ones skipped) and the CB vectors of columns from c0, summed in registers (a
// load and store of the outputs every few rows ran at a third of the rate, docs/long_context.md).
// The first column block prefetches whole rows.
template <int HB, int CB>
inline void values_block(const float* s, int64_t n, const float* v, int64_t ldv, int64_t Dv, const uint8_t* mask,
                         int64_t h0, int64_t j0, int64_t j1, int64_t c0, float* out) {
  vf acc[HB][CB];
  for (int h = 0; h < HB; ++h)
    for (int c = 0; c < CB; ++c) acc[h][c] = load(out + (h0 + h) * Dv + c0 + c * W);
  for (int64_t j = j0; j < j1; ++j) {
    if (c0 == 0) prefetch_ahead(v + j * ldv, Dv);
    if (mask && !mask[j]) continue;
    const float* vj = v + j * ldv + c0;
    vf vv[CB];
    for (int c = 0; c < CB; ++c) vv[c] = load(vj + c * W);
    for (int h = 0; h < HB; ++h) {
      const vf e = splat(s[(h0 + h) * n + j]);
      for (int c = 0; c < CB; ++c) acc[h][c] += vv[c] * e;
    }
  }
  for (int h = 0; h < HB; ++h)
    for (int c = 0; c < CB; ++c) store(out + (h0 + h) * Dv + c0 + c * W, acc[h][c]);
}

// The HB heads from h0 over rows [j0, j1): column blocks of CB vectors (HB x CB accumulators and CB
// value vectors within AVX-512's 32 registers, or the 16 of AVX2 and SSE), then single vectors,
// then the columns past the last whole vector.
template <int HB>
inline void values_heads(const float* s, int64_t n, const float* v, int64_t ldv, int64_t Dv, const uint8_t* mask,
                         int64_t h0, int64_t j0, int64_t j1, float* out) {
  constexpr int CB = W >= 16 ? (HB == 4 ? 4 : 8) : (HB == 4 ? 2 : 4);
  const int64_t full = Dv / W * W;
  int64_t c = 0;
  for (; c + CB * W <= full; c += CB * W) values_block<HB, CB>(s, n, v, ldv, Dv, mask, h0, j0, j1, c, out);
  for (; c < full; c += W) values_block<HB, 1>(s, n, v, ldv, Dv, mask, h0, j0, j1, c, out);
  for (; c < Dv; ++c)
    for (int64_t j = j0; j < j1; ++j) {
      if (mask && !mask[j]) continue;
      for (int64_t h = h0; h < h0 + HB; ++h) out[h * Dv + c] += s[h * n + j] * v[j * ldv + c];
    }
}

// The values of rows [0, n) (v, ldv apart) weighted by s[h * lds + j] into out [G, Dv], rows with
// mask[j] == 0 skipped, kValueRows rows at a time.
inline void values_all(const float* s, int64_t lds, int64_t G, const float* v, int64_t ldv, int64_t Dv, int64_t n,
                       const uint8_t* mask, float* out) {
  for (int64_t j0 = 0; j0 < n; j0 += kValueRows) {
    const int64_t j1 = imin(j0 + kValueRows, n);
    int64_t h = 0;
    if constexpr (W >= 8)
      for (; h + 4 <= G; h += 4) values_heads<4>(s, lds, v, ldv, Dv, mask, h, j0, j1, out);
    for (; h + 2 <= G; h += 2) values_heads<2>(s, lds, v, ldv, Dv, mask, h, j0, j1, out);
    for (; h < G; ++h) values_heads<1>(s, lds, v, ldv, Dv, mask, h, j0, j1, out);
  }
}

// A part's scores s [G, n] turned into e^(s - top): masked rows set to -inf first, each head's max
// in top[g] and sum in sum[g] (a head whose rows are all masked: top -inf, sum 0), out [G, Dv]
// zeroed for the weighted values.
inline void softmax_part(float* s, int64_t G, int64_t n, const uint8_t* mask, int64_t Dv, float* out, float* top,
                         float* sum) {
  const float ninf = -__builtin_inff();
  if (mask)
    for (int64_t j = 0; j < n; ++j)
      if (!mask[j])
        for (int64_t h = 0; h < G; ++h) s[h * n + j] = ninf;
  const int64_t nfull = n / W * W;
  for (int64_t h = 0; h < G; ++h) {
    float* row = s + h * n;
    vf mv = splat(ninf);
    for (int64_t j = 0; j < nfull; j += W) mv = vmax(mv, load(row + j));
    float m = hmax(mv);
    for (int64_t j = nfull; j < n; ++j) m = row[j] > m ? row[j] : m;
    top[h] = m;
    float* o = out + h * Dv;
    for (int64_t c = 0; c < Dv; ++c) o[c] = 0.0f;
    if (m == ninf) {
      sum[h] = 0.0f;
      continue;
    }
    vf acc = vf{};
    for (int64_t j = 0; j < nfull; j += W) {
      const vf e = exp_nonpositive(load(row + j) - splat(m));
      store(row + j, e);
      acc += e;
    }
    float total = hsum(acc);
    for (int64_t j = nfull; j < n; ++j) {
      row[j] = exp_nonpositive(splat(row[j] - m))[0];
      total += row[j];
    }
    sum[h] = total;
  }
}

// One part of a decode query's attention: G query rows q [G, D] (the query heads of one kv head)
// against n key rows (k, ldk apart; v, ldv apart), keys with mask[j] == 0 left out (mask may be
// null; a masked row's key and value are never used, so its storage may hold anything). For each
// query row g: the scaled scores in s[g * n ..], their max top[g], e^(s - top) summed into sum[g],
// and out[g * Dv ..] = sum_j e_j v_j, not yet divided by the sum (the parts of one query are
// merged by the caller). A part whose keys are all masked has top -inf, sum 0.
void decode_attention_part(const float* q, int64_t G, int64_t D, const float* k, int64_t ldk, const float* v,
                           int64_t ldv, int64_t Dv, int64_t n, const uint8_t* mask, float scale, float* s, float* out,
                           float* top, float* sum) {
  scores_all(q, G, D, k, ldk, n, scale, s, n);
  softmax_part(s, G, n, mask, Dv, out, top, sum);
  values_all(s, n, G, v, ldv, Dv, n, mask, out);
}

// n rows of mx.quantize's codes (BITS 8 or 4: low bits first along the row; one scale and bias a
// group of `group` values) dequantized into out [n, D]. Plain loops over a group: the compiler
// widens the bytes a vector at a time there, where its conversion of a byte vector type goes one
// element at a time.
constexpr int64_t kCodesAhead = 64;  // rows of codes prefetched ahead
template <int BITS>
inline void dequantize_rows(const QuantizedRows& p, int64_t D, int64_t group, int64_t n, float* out) {
  for (int64_t j = 0; j < n; ++j) {
    const uint8_t* codes = p.codes + j * p.ld_codes;
    const float* scales = p.scales + j * p.ld_scales;
    const float* biases = p.biases + j * p.ld_biases;
    for (int64_t d = 0; d < D * BITS / 8; d += 64) __builtin_prefetch(codes + kCodesAhead * p.ld_codes + d, 0, 2);
    __builtin_prefetch(scales + kCodesAhead * p.ld_scales, 0, 2);
    __builtin_prefetch(biases + kCodesAhead * p.ld_biases, 0, 2);
    for (int64_t g0 = 0; g0 < D; g0 += group) {
      const float scale = scales[g0 / group], bias = biases[g0 / group];
      float* __restrict o = out + j * D + g0;
      if constexpr (BITS == 8) {
        const uint8_t* __restrict c = codes + g0;
        for (int64_t d = 0; d < group; ++d) o[d] = static_cast<float>(static_cast<int32_t>(c[d])) * scale + bias;
      } else {  // two codes a byte, the even one in the low nibble
        const uint8_t* __restrict c = codes + g0 / 2;
        for (int64_t d = 0; d < group / 2; ++d) {
          o[2 * d] = static_cast<float>(static_cast<int32_t>(c[d] & 0xF)) * scale + bias;
          o[2 * d + 1] = static_cast<float>(static_cast<int32_t>(c[d] >> 4)) * scale + bias;
        }
      }
    }
  }
}

// decode_attention_part over mx.quantize's planes: each block of kValueRows key rows dequantized
// into rows [kValueRows, D] (L1/L2-resident) and scored as float rows, then each block of value
// rows likewise weighted. The codes are read once and never dequantized beyond one block.
void decode_attention_part_quantized(const float* q, int64_t G, int64_t D, const QuantizedRows& k,
                                     const QuantizedRows& v, int64_t Dv, int64_t n, int bits, int64_t group,
                                     const uint8_t* mask, float scale, float* s, float* rows, float* out, float* top,
                                     float* sum) {
  const auto dequantize = bits == 8 ? dequantize_rows<8> : dequantize_rows<4>;
  for (int64_t j0 = 0; j0 < n; j0 += kValueRows) {
    const int64_t nb = imin(kValueRows, n - j0);
    dequantize(k.from(j0), D, group, nb, rows);
    scores_all(q, G, D, rows, D, nb, scale, s + j0, n);
  }
  softmax_part(s, G, n, mask, Dv, out, top, sum);
  for (int64_t j0 = 0; j0 < n; j0 += kValueRows) {
    const int64_t nb = imin(kValueRows, n - j0);
    dequantize(v.from(j0), Dv, group, nb, rows);
    values_all(s + j0, n, G, rows, Dv, Dv, nb, mask ? mask + j0 : nullptr, out);
  }
}

// The largest value of x[0, n), NaN ignored (-inf when there is none): a sampler's row maximum.
float row_max(const float* x, int64_t n) {
  const int64_t full = n / W * W;
  vf m = splat(-INFINITY);
  for (int64_t j = 0; j < full; j += W) m = vmax(load(x + j), m);  // a NaN loses the compare
  float top = hmax(m);
  for (int64_t j = full; j < n; ++j) top = x[j] > top ? x[j] : top;
  return top;
}

// The sum of e^((x - top) * scale) over x[0, n) at or above floor (the rest, NaN included, weigh
// 0), each weight stored in w and the values counted in count when those are not null: a
// sampler's inverse CDF over one block of a row, or top-p's mass above a floor. x <= top.
float exp_weights(const float* x, int64_t n, float top, float scale, float floor, float* w, int64_t* count) {
  const int64_t full = n / W * W;
  const vf t = splat(top), sc = splat(scale), fl = splat(floor);
  vf acc = vf{};
  vi kept = vi{};
  for (int64_t j = 0; j < full; j += W) {
    const vf v = load(x + j);
    const vi at_or_above = v >= fl;
    const vf e = at_or_above ? exp_nonpositive((v - t) * sc) : vf{};
    if (w) store(w + j, e);
    acc += e;
    kept -= at_or_above;  // true is -1
  }
  float total = hsum(acc);
  int64_t counted = 0;
  for (int i = 0; i < W; ++i) counted += kept[i];
  for (int64_t j = full; j < n; ++j) {
    const bool in = x[j] >= floor;
    const float e = in ? exp_nonpositive(splat((x[j] - top) * scale))[0] : 0.0f;
    if (w) w[j] = e;
    total += e;
    counted += in;
  }
  if (count) *count = counted;
  return total;
}
