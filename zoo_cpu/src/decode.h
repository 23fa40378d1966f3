// MLX primitives for a decode step on the CPU (one new position per row), each one graph node
// where MLX's ops take a dozen: a decode step is ~1,200 nodes, and each costs the CPU stream a
// task switch, so on a small model the node count, not the arithmetic, sets the step's time.
//
// - DecodeHeads: a layer's projected queries, keys and values [B, 1, N] split into heads, the
//   queries and keys RMS-normed (Gemma 2/3's 1 + weight by a shift) and rotated by RoPE tables,
//   the values optionally normed without a weight (Gemma 4); outputs q [B, Hq, 1, D] and, for a
//   layer with its own keys, k and v [B, Hkv, 1, D].
// - DecodeAttention: one query per row against a run of `size` rows of the cache's key and value
//   planes from a row given as an array (read in place: no slice of the planes is made), masked
//   by the cache's mask; parts of the run on the extension's threads, merged by their maxima.
// - DecodeAttentionQuantized: the same read over mx.quantize's planes (8- or 4-bit codes, a scale
//   and bias per group), the codes read in place: the bytes a decode step reads shrink with the
//   cache's, where MLX's quantized_matmul pair runs far below the bandwidth.
// - DecodeAttentionRows: a ragged batch's decode read in one node: one query per batch row, each
//   over a run of that row's own planes (each conversation's cache is a buffer of its own length),
//   float or quantized; every row's parts of its run on the threads together.
//
// float32 in and out; the per-instruction-set kernels are prefill_impl.h's.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "prefill.h"

namespace zoo {

namespace mx = mlx::core;

// projected [B, 1, (heads + kv_heads * (has_v ? 2 : 1)) * head_dim]: queries, keys, values side by
// side (kv_heads 0: queries only). The keys are the values when !has_v (before the key norm).
// cos, sin [1, head_dim / 2]. Returns {q} or {q, k, v}.
std::vector<mx::array> decode_heads(const mx::array& projected, int heads, int kv_heads, bool has_v, int head_dim,
                                    const std::optional<mx::array>& q_weight, const std::optional<mx::array>& k_weight,
                                    float shift, float eps, bool v_norm, const mx::array& cos, const mx::array& sin,
                                    const std::string& isa = "", mx::StreamOrDevice s = {});

// softmax(q k^T * scale + mask) v for q [B, Hq, 1, D] over rows [start, start + size) of
// keys [B, Hkv, T, D] and values [B, Hkv, T, Dv]; start an int32 scalar array (clamped into the
// planes), mask none or bool [1 or B, size] (True = attend). Output [B, Hq, 1, Dv].
mx::array decode_attention(const mx::array& q, const mx::array& keys, const mx::array& values, const mx::array& start,
                           int size, float scale, const std::optional<mx::array>& mask, const std::string& isa = "",
                           mx::StreamOrDevice s = {});

// decode_attention over planes quantized by mx.quantize (bits 4 or 8, group_size 32/64/128):
// k_packed [B, Hkv, T, D * bits / 32] uint32, k_scales and k_biases [B, Hkv, T, D / group_size]
// float32, the values likewise; the codes read in place. Output [B, Hq, 1, Dv].
mx::array decode_attention_quantized(const mx::array& q, const mx::array& k_packed, const mx::array& k_scales,
                                     const mx::array& k_biases, const mx::array& v_packed, const mx::array& v_scales,
                                     const mx::array& v_biases, const mx::array& start, int size, float scale,
                                     const std::optional<mx::array>& mask, int bits, int group_size,
                                     const std::string& isa = "", mx::StreamOrDevice s = {});

// One decode query per batch row over that row's own planes: q [B, Hq, 1, D]; `planes` holds, row
// after row, the row's key planes then its value planes: bits 0 (float) keys [1, Hkv, T_r, D] and
// values [1, Hkv, T_r, Dv]; bits 4 or 8 mx.quantize's (packed, scales, biases) for each, as
// decode_attention_quantized takes them. Row r attends rows [starts[r], starts[r] + sizes[r]) of
// its planes, unmasked (a decode read sees its whole run). Output [B, Hq, 1, Dv].
mx::array decode_attention_rows(const mx::array& q, const std::vector<mx::array>& planes, const std::vector<int>& starts,
                                const std::vector<int>& sizes, float scale, int bits, int group_size,
                                const std::string& isa = "", mx::StreamOrDevice s = {});

class DecodeHeads : public mx::Primitive {
 public:
  // settings: heads, kv_heads, has_v, head_dim, q weighted, k weighted, shift, eps, v_norm
  DecodeHeads(mx::Stream stream, Isa isa, std::vector<float> settings)
      : mx::Primitive(stream), isa_(isa), settings_(std::move(settings)) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  bool is_equivalent(const mx::Primitive& other) const override;
  const char* name() const override { return "DecodeHeads"; }

 private:
  Isa isa_;
  std::vector<float> settings_;
};

class DecodeAttention : public PrefillPrimitive {  // settings: scale, size, masked (0/1)
 public:
  using PrefillPrimitive::PrefillPrimitive;
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  const char* name() const override { return "DecodeAttention"; }
};

class DecodeAttentionQuantized : public PrefillPrimitive {  // settings: scale, size, masked, bits, group_size
 public:
  using PrefillPrimitive::PrefillPrimitive;
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  const char* name() const override { return "DecodeAttentionQuantized"; }
};

class DecodeAttentionRows : public mx::UnaryPrimitive {
 public:
  DecodeAttentionRows(mx::Stream stream, Isa isa, float scale, int bits, int group_size, std::vector<int> starts,
                      std::vector<int> sizes)
      : mx::UnaryPrimitive(stream), isa_(isa), scale_(scale), bits_(bits), group_(group_size),
        starts_(std::move(starts)), sizes_(std::move(sizes)) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  bool is_equivalent(const mx::Primitive& other) const override;
  const char* name() const override { return "DecodeAttentionRows"; }

 private:
  Isa isa_;
  float scale_;
  int bits_, group_;
  std::vector<int> starts_, sizes_;
};

}  // namespace zoo
