// MLX primitives for a prefill on the CPU, where MLX's own CPU kernels run element-wise work on
// one core and attention as separate products around a softmax:
//
// - PrefillAttention: softmax(q k^T * scale + mask) v for a chunk of queries, fused and split over
//   the extension's threads: per (batch, query heads of one kv head, block of kBlockRows query
//   rows), key block by key block, the scores against keys packed once per kv head (GQA: the
//   query heads of a kv head share them), the masked float32 softmax (online: Cephes' exp, as
//   cache/cpu_math.py, with a running maximum and sum), and the product with the values. A causal
//   block computes only the keys up to its last query.
// - GeluGate: gelu_tanh(gate) * up (Eigen's rational tanh, as cache/cpu_math.py), split over the
//   threads.
//
// float32 in and out. One source (prefill_impl.h) is compiled for AVX-512, AVX2 + FMA and plain
// vector code; best_isa() (qmm.h) picks one at run time, as for the packed products.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "mlx/backend/common/utils.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "packed.h"
#include "qmm.h"

namespace zoo {

namespace mx = mlx::core;

constexpr int64_t kBlockRows = 32;  // query rows a block (one job of a thread) attends
constexpr int64_t kGroupHeads = 8;  // query heads (of one kv head) a job attends at most
constexpr int64_t kAttendKeys = 256;  // keys a block of query rows attends at a time (a multiple of every NB)
constexpr int64_t kDotMaxRows = 8;    // rows of x a product takes unpacked (linear_dots); more: panels
constexpr int64_t kLinearInputs = 768;  // inputs a GEMM block takes at most (256: 12% slower, docs/speed.md)

// Rows a decode attention weighs values over at a time (and dequantizes quantized rows into its
// scratch at a time): 64 measured best (docs/long_context.md).
constexpr int64_t kDecodeBlockRows = 64;

// A run of rows of mx.quantize's planes: codes (uint8 view of the packed words), one scale and bias
// a group; each row `ld_*` elements after the one before.
struct QuantizedRows {
  const uint8_t* codes;
  const float* scales;
  const float* biases;
  int64_t ld_codes, ld_scales, ld_biases;
  QuantizedRows from(int64_t row) const {
    return {codes + row * ld_codes, scales + row * ld_scales, biases + row * ld_biases, ld_codes, ld_scales, ld_biases};
  }
};

// Raw views of one attention call: strides in elements, the last axis of q, k, v contiguous.
struct AttentionArgs {
  const float* q;          // [B, Hq, L, D]; q_stride: batch, head, row
  int64_t q_stride[3];
  const float* k;          // [B, Hkv, T, D]
  int64_t k_stride[3];
  const float* v;          // [B, Hkv, T, Dv]
  int64_t v_stride[3];
  const uint8_t* mask;     // bool, True = attend: batch, query row, key (nullptr: none)
  int64_t mask_stride[3];
  float* out;              // [B, L, Hq, Dv], contiguous (positions first: see prefill_attention)
  int64_t B, Hq, Hkv, L, T, D, Dv;
  float scale;
  bool causal;             // the last query aligned with the last key (MLX's "causal")
};

#define ZOO_PREFILL_KERNELS                                                                                   \
  void pack_keys(const float* k, int64_t k_row_stride, int64_t T, int64_t D, int64_t jb0, int64_t jb1,        \
                 float* panels);                                                                              \
  int key_block();                                                                                            \
  void attention_block(const AttentionArgs& a, int64_t b, int64_t h0, int64_t h1, int64_t i0, int64_t i1,     \
                       const float* panels, float* scratch);                                                  \
  void gelu_gate(const float* up, const float* gate, int64_t i0, int64_t i1, float* out);                    \
  void linear_rows(const float* w, int64_t K, const float* panels, int64_t M, int64_t n0, int64_t n1, float* y, \
                   int64_t ldy);                                                                              \
  void linear_dots(const float* w, int64_t K, const float* x, int64_t M, int64_t n0, int64_t n1, float* y,     \
                   int64_t ldy);                                                                              \
  void linear_few_transposed(const float* wt, int64_t ldw, int64_t K, const float* x, int64_t M, int64_t n0,  \
                             int64_t n1, float* y, int64_t ldy);                                              \
  void rms_norm_rows(const float* x, const float* w, int64_t D, float eps, int64_t r0, int64_t r1, float* y); \
  void rotate_rows(const float* x, const int64_t x_stride[3], int64_t H, int64_t L, int64_t D, const float* cos, \
                   const float* sin, int64_t cs_batch, int64_t r0, int64_t r1, float* out);                    \
  void decode_attention_part(const float* q, int64_t G, int64_t D, const float* k, int64_t ldk, const float* v,  \
                             int64_t ldv, int64_t Dv, int64_t n, const uint8_t* mask, float scale, float* s,      \
                             float* out, float* top, float* sum);                                             \
  void decode_attention_part_quantized(const float* q, int64_t G, int64_t D, const QuantizedRows& k,             \
                                       const QuantizedRows& v, int64_t Dv, int64_t n, int bits, int64_t group,   \
                                       const uint8_t* mask, float scale, float* s, float* rows, float* out,      \
                                       float* top, float* sum);                                                  \
  float row_max(const float* x, int64_t n);                                                                   \
  float exp_weights(const float* x, int64_t n, float top, float scale, float floor, float* w, int64_t* count);

namespace prefill_portable {
ZOO_PREFILL_KERNELS
}
namespace prefill_avx2 {
ZOO_PREFILL_KERNELS
}
namespace prefill_avx512 {
ZOO_PREFILL_KERNELS
}
#undef ZOO_PREFILL_KERNELS

// One instruction set's kernels (the functions above), for the primitives here and in decode.h.
struct Kernels {
  void (*pack_keys)(const float*, int64_t, int64_t, int64_t, int64_t, int64_t, float*);
  int (*key_block)();
  void (*attention_block)(const AttentionArgs&, int64_t, int64_t, int64_t, int64_t, int64_t, const float*, float*);
  void (*gelu_gate)(const float*, const float*, int64_t, int64_t, float*);
  void (*linear_rows)(const float*, int64_t, const float*, int64_t, int64_t, int64_t, float*, int64_t);
  // y[:, n0:n1] = x w[n0:n1]^T for a few rows of x (at most kDotMaxRows), unpacked.
  void (*linear_dots)(const float*, int64_t, const float*, int64_t, int64_t, int64_t, float*, int64_t);
  // A few rows' product against a weight stored transposed, wt [K, N] with rows ldw apart, read once.
  void (*linear_few_transposed)(const float*, int64_t, int64_t, const float*, int64_t, int64_t, int64_t, float*, int64_t);
  void (*rms_norm_rows)(const float*, const float*, int64_t, float, int64_t, int64_t, float*);
  void (*rotate_rows)(const float*, const int64_t*, int64_t, int64_t, int64_t, const float*, const float*, int64_t,
                      int64_t, int64_t, float*);
  // One part of a decode query's attention (G query heads of one kv head, n key rows): the scaled,
  // masked scores, their max (top), e^(s - top) summed (sum) and sum_j e_j v_j (out, unnormalised).
  void (*decode_attention_part)(const float*, int64_t, int64_t, const float*, int64_t, const float*, int64_t, int64_t,
                                int64_t, const uint8_t*, float, float*, float*, float*, float*);
  // decode_attention_part over quantized planes (8 or 4 bits): rows [kDecodeBlockRows, max(D, Dv)]
  // of scratch for a block of dequantized rows.
  void (*decode_attention_part_quantized)(const float*, int64_t, int64_t, const QuantizedRows&, const QuantizedRows&,
                                          int64_t, int64_t, int, int64_t, const uint8_t*, float, float*, float*,
                                          float*, float*, float*);
  // A sampler's passes over a vocabulary row: its largest value (NaN ignored), and the sum of
  // e^((x - top) * scale) over the values at or above a floor (each weight stored, and the values
  // counted, when asked).
  float (*row_max)(const float*, int64_t);
  float (*exp_weights)(const float*, int64_t, float, float, float, float*, int64_t*);
};
Kernels vector_kernels(Isa isa);

// Shared by the primitives' argument checks and evaluation (prefill.cpp, decode.cpp).
std::string shape_of(const mx::array& a);
[[noreturn]] void fail(const std::string& op, const std::string& what);
mx::Stream cpu_only(const char* op, mx::StreamOrDevice s);
void check_float32(const char* op, std::initializer_list<std::pair<const char*, const mx::array*>> arrays);
// A rank-4 array of T as base pointer and (batch, head, row) strides, its last axis contiguous
// (copied into ``copy`` when it is not).
template <class T>
const T* rows_of(const mx::array& a, int64_t stride[3], std::vector<T>& copy) {
  if (a.strides(3) == 1 || a.shape(3) == 1) {
    for (int i = 0; i < 3; ++i) stride[i] = a.shape(i) == 1 ? 0 : a.strides(i);
    return a.data<T>();
  }
  copy.resize(a.size());
  copy_row_major(a.data<T>(), a.shape(), a.strides(), copy.data());
  stride[2] = a.shape(3);
  stride[1] = stride[2] * a.shape(2);
  stride[0] = stride[1] * a.shape(1);
  return copy.data();
}
// The elements of ``a`` in row-major order: its own buffer when row-contiguous, else a copy made in
// ``copy`` (called in the evaluation, once the data is there: the ops take their inputs as they
// come, since a contiguous() node for each would cost a decode step as much as the kernel).
template <class T>
const T* dense(const mx::array& a, std::vector<T>& copy) {
  const T* data = reinterpret_cast<const T*>(a.data<void>());
  if (a.flags().row_contiguous) return data;
  copy.resize(a.size());
  copy_row_major(data, a.shape(), a.strides(), copy.data());
  return copy.data();
}
// A norm's weight as the kernels multiply by it: ``w`` itself, or ``w + shift`` (Gemma 2/3's
// ``1 + weight``) made once a call in ``out``; a null weight stays null.
inline const float* shifted(const float* w, int64_t D, float shift, std::vector<float>& out) {
  if (!w || shift == 0.0f) return w;
  out.resize(D);
  for (int64_t d = 0; d < D; ++d) out[d] = w[d] + shift;
  return out.data();
}
// The output allocated and the encoder of the primitive's stream told what it reads and writes.
mx::cpu::CommandEncoder& output_encoder(mx::Stream stream, const std::vector<mx::array>& inputs, mx::array& out);

// softmax(q k^T * scale + mask) v; q [B, Hq, L, D], k [B, Hkv, T, D], v [B, Hkv, T, Dv] float32,
// Hq a multiple of Hkv, T >= L when causal. mask: none, or bool [L, T] / [B or 1, 1, L, T].
// The result [B, Hq, L, Dv] is a view of a [B, L, Hq, Dv] array.
mx::array prefill_attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                            const std::optional<mx::array>& mask, bool causal, const std::string& isa = "",
                            mx::StreamOrDevice s = {});

// x [..., K] @ w[N, K]^T in float32 (an nn.Linear's product without its bias), through the packed GEMM;
// with transposed, w is a weight's transposed storage [K, N] (the output head's) and the product
// x @ w goes through the few-row kernel (meant for a few rows of x: each weight row is read once,
// every row of x against it while it is in the core's caches).
mx::array prefill_linear(const mx::array& x, const mx::array& w, const std::string& isa = "", bool transposed = false,
                         mx::StreamOrDevice s = {});

// residual + x * (mean(x^2) + eps)^-1/2 * (weight + shift) over the last axis, float32 (weight [D] or
// none; shift 1 for Gemma 2/3's ``1 + weight``; residual of x's shape or none).
mx::array rms_norm(const mx::array& x, const std::optional<mx::array>& weight, float eps, float shift,
                   const std::optional<mx::array>& residual, const std::string& isa = "", mx::StreamOrDevice s = {});

// RoPE by tables: x [B, H, L, D] float32, cos and sin [L, D/2] or [B, 1, L, D/2] float32.
mx::array rope_rotate(const mx::array& x, const mx::array& cos, const mx::array& sin, const std::string& isa = "",
                      mx::StreamOrDevice s = {});

// gelu_tanh(gate) * up, both float32 of one shape; without gate, up holds rows of [up | gate]
// (the joined output of one product) and the result has half its last axis.
mx::array gelu_gate(const mx::array& up, const std::optional<mx::array>& gate, const std::string& isa = "",
                    mx::StreamOrDevice s = {});

// What the prefill primitives share: the instruction set, a few numeric settings compared by
// is_equivalent (scale, flags, eps), the output shape of the first input unless a kind says
// otherwise, and no GPU.
class PrefillPrimitive : public mx::UnaryPrimitive {
 public:
  PrefillPrimitive(mx::Stream stream, Isa isa, std::vector<float> settings = {})
      : mx::UnaryPrimitive(stream), isa_(isa), settings_(std::move(settings)) {}
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }
  bool is_equivalent(const mx::Primitive& other) const override;

 protected:
  Isa isa_;
  std::vector<float> settings_;
};

#define ZOO_PREFILL_PRIMITIVE(Name, extra)                                                     \
  class Name : public PrefillPrimitive {                                                        \
   public:                                                                                      \
    using PrefillPrimitive::PrefillPrimitive;                                                   \
    void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;               \
    const char* name() const override { return #Name; }                                         \
    extra                                                                                       \
  };

// settings: scale, causal (0/1), masked (0/1); output [B, Hq, L, Dv].
ZOO_PREFILL_PRIMITIVE(PrefillAttention,
                      std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;)
// settings: transposed (0/1); output [..., N].
ZOO_PREFILL_PRIMITIVE(PrefillLinear,
                      std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;)
ZOO_PREFILL_PRIMITIVE(RmsNorm, )  // settings: eps, weighted (0/1), shift, with a residual (0/1)
ZOO_PREFILL_PRIMITIVE(RopeRotate, )
ZOO_PREFILL_PRIMITIVE(GeluGate,
                      std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;)
#undef ZOO_PREFILL_PRIMITIVE

}  // namespace zoo
