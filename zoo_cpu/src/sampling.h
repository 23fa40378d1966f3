// MLX primitives for a sampler's work over a vocabulary row on the CPU, where MLX's ops sort or
// draw over every word: at 262,144 words its sort for top-p takes ~25 ms on two cores, its
// Gumbel draw ~4-6 ms, the whole decode step of a small model ~14.
//
// - TopK: the k largest values of each row's last axis, from the largest down, and their indices:
//   a sampler's candidates (top_k) without sorting the row (MLX's argpartition: ~3 ms).
// - LogSoftmax: x - max - log(sum e^(x - max)) of each row: three passes on the threads, where
//   MLX's max, exp, sum, log and subtract are one-thread passes of ~1.3 ms together.
// - KeepFloor: the smallest value top-p and min-p keep of a row of normalised log-probabilities,
//   read off the row's most likely words (a few hundred, more only when the nucleus is wider).
// - Categorical: a draw from softmax(x * scale) over the values at or above a floor, by the
//   inverse CDF of one uniform number a row (block sums on the threads, then one block's running
//   sum): two passes over the row.
//
// float32 in; the per-instruction-set passes are prefill_impl.h's.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "prefill.h"

namespace zoo {

namespace mx = mlx::core;

// The k largest values of x [..., V] (float32) along the last axis, from the largest down, and
// their indices (uint32): {values [..., k], indices [..., k]}. Ties go to the lower index; NaN
// counts as -inf. 1 <= k <= V.
std::vector<mx::array> top_k(const mx::array& x, int k, mx::StreamOrDevice s = {});

// x - logsumexp(x) along the last axis of x [..., V] (float32), the maximum taken out first.
mx::array log_softmax(const mx::array& x, const std::string& isa = "", mx::StreamOrDevice s = {});

// For normalised log-probabilities x [..., V]: the smallest value each row keeps [..., 1] under
// top-p (0 < top_p < 1: the words from the most likely down while the mass of those before stays
// below top_p, summed in that order; every word equal to the last one kept is kept too) and
// min-p (min_p > 0: at least the row's largest + log(min_p)). 0 or 1 switches a filter off; with
// both off every value is kept (-inf). NaN counts as -inf.
mx::array keep_floor(const mx::array& x, float top_p, float min_p, const std::string& isa = "",
                     mx::StreamOrDevice s = {});

// One index a row of x [..., V] drawn from softmax(x * scale) over the values at or above the
// row's floor ([..., 1]; none: every value), by the inverse CDF of u [...] (uniform in [0, 1)).
// NaN and values below the floor weigh 0; a row with no weight draws the first of its largest
// values (index 0 when it has none). scale > 0. Output [...] uint32.
mx::array categorical(const mx::array& x, const mx::array& u, float scale, const std::optional<mx::array>& floor,
                      const std::string& isa = "", mx::StreamOrDevice s = {});

class TopK : public mx::Primitive {
 public:
  TopK(mx::Stream stream, int k) : mx::Primitive(stream), k_(k) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  bool is_equivalent(const mx::Primitive& other) const override;
  const char* name() const override { return "TopK"; }

 private:
  int k_;
};

class LogSoftmax : public PrefillPrimitive {
 public:
  using PrefillPrimitive::PrefillPrimitive;
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "LogSoftmax"; }
};

class KeepFloor : public PrefillPrimitive {  // settings: top_p, min_p
 public:
  using PrefillPrimitive::PrefillPrimitive;
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  const char* name() const override { return "KeepFloor"; }
};

class Categorical : public PrefillPrimitive {  // settings: scale, floored (0/1)
 public:
  using PrefillPrimitive::PrefillPrimitive;
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  const char* name() const override { return "Categorical"; }
};

}  // namespace zoo
