// MLX primitives for a prefill on the CPU, where MLX's own CPU kernels run element-wise work on
// one core and attention as separate products around a softmax:
//
// - PrefillAttention: softmax(q k^T * scale + mask) v for a chunk of queries, fused and split over
//   the extension's threads: per (batch, query head, block of kBlockRows query rows) the scores
//   against keys packed once per kv head (GQA: the query heads of a kv head share them), the
//   masked float32 softmax (Cephes' exp, as cache/cpu_math.py), and the product with the values.
//   A causal block computes only the keys up to its last query.
// - GeluGate: gelu_tanh(gate) * up (Eigen's rational tanh, as cache/cpu_math.py), split over the
//   threads.
//
// float32 in and out. One source (prefill_impl.h) is compiled for AVX-512, AVX2 + FMA and plain
// vector code; best_isa() (qmm.h) picks one at run time, as for the packed products.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "qmm.h"

namespace zoo {

namespace mx = mlx::core;

constexpr int64_t kBlockRows = 32;  // query rows a block (one job of a thread) attends

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
  float* out;              // [B, Hq, L, Dv], contiguous
  int64_t B, Hq, Hkv, L, T, D, Dv;
  float scale;
  bool causal;             // the last query aligned with the last key (MLX's "causal")
};

#define ZOO_PREFILL_KERNELS                                                                                   \
  void pack_keys(const float* k, int64_t k_row_stride, int64_t T, int64_t D, int64_t jb0, int64_t jb1,        \
                 float* panels);                                                                              \
  int key_block();                                                                                            \
  void attention_block(const AttentionArgs& a, int64_t b, int64_t h, int64_t i0, int64_t i1,                  \
                       const float* panels, float* scratch);                                                  \
  void gelu_gate(const float* up, const float* gate, int64_t i0, int64_t i1, float* out);                    \
  void linear_rows(const float* w, int64_t K, const float* panels, int64_t M, int64_t n0, int64_t n1, float* y, \
                   int64_t ldy);                                                                              \
  void rms_norm_rows(const float* x, const float* w, int64_t D, float eps, int64_t r0, int64_t r1, float* y); \
  void rotate_rows(const float* x, const int64_t x_stride[3], int64_t H, int64_t L, int64_t D, const float* cos, \
                   const float* sin, int64_t cs_batch, int64_t r0, int64_t r1, float* out);

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

// softmax(q k^T * scale + mask) v; q [B, Hq, L, D], k [B, Hkv, T, D], v [B, Hkv, T, Dv] float32,
// Hq a multiple of Hkv, T >= L when causal. mask: none, or bool [L, T] / [B or 1, 1, L, T].
mx::array prefill_attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                            const std::optional<mx::array>& mask, bool causal, const std::string& isa = "",
                            mx::StreamOrDevice s = {});

// x [..., K] @ w[N, K]^T in float32 (an nn.Linear's product without its bias).
mx::array prefill_linear(const mx::array& x, const mx::array& w, const std::string& isa = "", mx::StreamOrDevice s = {});

// x * (mean(x^2) + eps)^-1/2 * weight over the last axis, float32 (weight [D] or none).
mx::array rms_norm(const mx::array& x, const std::optional<mx::array>& weight, float eps, const std::string& isa = "",
                   mx::StreamOrDevice s = {});

// RoPE by tables: x [B, H, L, D] float32, cos and sin [L, D/2] or [B, 1, L, D/2] float32.
mx::array rope_rotate(const mx::array& x, const mx::array& cos, const mx::array& sin, const std::string& isa = "",
                      mx::StreamOrDevice s = {});

// gelu_tanh(gate) * up, both float32 of one shape.
mx::array gelu_gate(const mx::array& up, const mx::array& gate, const std::string& isa = "", mx::StreamOrDevice s = {});

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
// output [..., N].
ZOO_PREFILL_PRIMITIVE(PrefillLinear,
                      std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;)
ZOO_PREFILL_PRIMITIVE(RmsNorm, )  // settings: eps, weighted (0/1)
ZOO_PREFILL_PRIMITIVE(RopeRotate, )
ZOO_PREFILL_PRIMITIVE(GeluGate, )
#undef ZOO_PREFILL_PRIMITIVE

}  // namespace zoo
