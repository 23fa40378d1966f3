// Packed 4- and 8-bit products on the CPU over MLX's affine layout (no MLX types in here).
//
// MLX stores a quantized [N, K] weight as uint32 words along K, 32 / bits values a word, lowest
// bits first (so on a little-endian CPU: 8-bit rows are plain uint8 rows, 4-bit rows hold value
// 2i in the low nibble of byte i and 2i + 1 in its high nibble), and per group of `group` inputs
// one scale s and one bias b: w = s * q + b. A product row is then
//
//   y[m, n] = sum_g s[n, g] * (sum_{k in g} x[m, k] q[n, k]) + sum_g b[n, g] * (sum_{k in g} x[m, k])
//
// so the inner loop only converts q to float and multiplies it with float32 activations (scales
// and biases may be stored in bfloat16 or float16; they are converted once a group): the
// result is the float32 product with the dequantized weight, up to summation order (no rounding
// of the activations, unlike kernels that quantize them to int8 for integer dot products).
//
// One source (qmm_impl.h) is compiled three times, for AVX-512, AVX2 + FMA and plain C++, each in
// its own translation unit with its own flags and its own names; best_isa() picks one at run time.
#pragma once

#include <cstddef>
#include <cstdint>

namespace zoo {

// How scales and biases are stored: float32, or as the checkpoint keeps them (bfloat16 or float16,
// read as they are: converting them on load would add 2 bytes a group to every token's reads).
enum class ScaleType { f32 = 0, bf16 = 1, f16 = 2 };

struct PackedWeights {
  const uint8_t* w;      // row n starts at w + n * row_bytes()
  const void* scales;    // [N, G] of scale_type
  const void* biases;    // [N, G] of scale_type
  int64_t N;
  int64_t K;
  int group;
  int bits;
  ScaleType scale_type;
  int64_t row_bytes() const { return K * bits / 8; }
  int64_t groups() const { return K / group; }
};

// Activations prepared once per call (prepare_x in packed.cpp) in the kernels' order: the kernels
// read the weights in blocks of L 32-bit words (L the vector width, P = 32 / bits values a word)
// and take field j of every word at once, so each block of P L values is stored as its values
// j, P + j, 2P + j, ... for j = 0 .. P - 1 (no shuffle of the weights then lines them up); rows are
// zero-padded to whole blocks, and their group sums to whole vectors of L.
struct Prepared {
  const float* x;       // [M, x_stride]
  const float* sums;    // [M, sums_stride]
  int64_t M;
  int64_t x_stride;     // K rounded up to a multiple of L * 32 / bits
  int64_t sums_stride;  // K / group rounded up to a multiple of L
};

enum class Isa { portable = 0, avx2 = 1, avx512 = 2 };

// The widest instruction set this CPU runs (and the build has), and its name.
Isa best_isa();
const char* isa_name(Isa isa);
int isa_lanes(Isa isa);

// Rows [n0, n1) of y [M, N] from prepared activations; x_prepared holds M * K floats.
using RowsFn = void (*)(const Prepared&, const PackedWeights&, int64_t n0, int64_t n1, float* y);
// Rows [n0, n1) of the dequantized weight, out [N, K].
using DequantFn = void (*)(const PackedWeights&, int64_t n0, int64_t n1, float* out);

namespace portable {
void rows(const Prepared&, const PackedWeights&, int64_t, int64_t, float*);
void dequantize(const PackedWeights&, int64_t, int64_t, float*);
}  // namespace portable
namespace avx2 {
void rows(const Prepared&, const PackedWeights&, int64_t, int64_t, float*);
void dequantize(const PackedWeights&, int64_t, int64_t, float*);
}  // namespace avx2
namespace avx512 {
void rows(const Prepared&, const PackedWeights&, int64_t, int64_t, float*);
void dequantize(const PackedWeights&, int64_t, int64_t, float*);
}  // namespace avx512

}  // namespace zoo
