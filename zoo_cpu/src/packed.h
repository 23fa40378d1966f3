// MLX primitives over packed 4/8-bit weights on the CPU: PackedMatmul (x @ dequantize(w).T for
// few rows, read at memory bandwidth) and PackedDequantize (the float32 weight, for products with
// many rows that then go through the BLAS). Both take MLX's affine layout as nn.QuantizedLinear
// and nn.QuantizedEmbedding store it: float32 activations, scales and biases in float32, bfloat16
// or float16 (read as stored), float32 results.
#pragma once

#include <cstring>
#include <string>

#include "mlx/backend/common/utils.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "qmm.h"

namespace zoo {

namespace mx = mlx::core;

// x [..., K] @ dequantize(w, scales, biases).T -> [..., N] in float32; w [N, K * bits / 32] uint32.
// isa: "" for the best this CPU runs, else "avx512", "avx2" or "portable" (tests compare them).
mx::array packed_matmul(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                        int group_size, int bits, const std::string& isa = "", mx::StreamOrDevice s = {});

// dequantize(w, scales, biases) -> [N, K] float32, vectorised and split over the kernel's threads.
mx::array packed_dequantize(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size,
                            int bits, const std::string& isa = "", mx::StreamOrDevice s = {});

// The instruction sets this CPU and build run, widest first ("avx512", "avx2", "portable").
std::vector<std::string> available_isas();
// Threads the products split rows over (the CPUs this process may run on, unless set).
int threads();
void set_threads(int n);
// The MLX version the extension was compiled against (its headers).
std::string built_for_mlx();
// The instruction set an ``isa`` argument names ("" for the best), or std::invalid_argument.
Isa parse_isa(const std::string& name);
// Chunks [0, chunks) of fn(ctx, chunk) on the calling thread and the pool's workers (the prefill
// kernels split their work this way too).
void parallel_chunks(int chunks, void (*fn)(void*, int), void* ctx);
// The elements of an array (``src`` with ``shape`` and ``strides``) in row-major order into
// ``out``: a row of the last axis at a time, its location found once (a division per axis) and the
// row copied whole when its elements are adjacent, as a transposed view's rows are (element by
// element, the divisions cost an encoder more than its norms: docs/embedding.md).
template <class T>
void copy_row_major(const T* src, const mx::Shape& shape, const mx::Strides& strides, T* out) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  const int64_t last = shape.empty() ? 1 : shape.back(), step = shape.empty() ? 1 : strides.back();
  if (n == 0) return;
  for (int64_t r = 0; r < n / last; ++r) {
    const T* row = src + mx::elem_to_loc(r * last, shape, strides);
    T* to = out + r * last;
    if (step == 1)
      std::memcpy(to, row, last * sizeof(T));
    else
      for (int64_t i = 0; i < last; ++i) to[i] = row[i * step];
  }
}

// What both primitives share: the layout (group size, bits), the kernels' instruction set, and no GPU.
class PackedPrimitive : public mx::UnaryPrimitive {
 public:
  PackedPrimitive(mx::Stream stream, int group_size, int bits, Isa isa)
      : mx::UnaryPrimitive(stream), group_size_(group_size), bits_(bits), isa_(isa) {}
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  bool is_equivalent(const mx::Primitive& other) const override;

 protected:
  int group_size_;
  int bits_;
  Isa isa_;
};

class PackedMatmul : public PackedPrimitive {
 public:
  using PackedPrimitive::PackedPrimitive;
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  const char* name() const override { return "PackedMatmul"; }
};

class PackedDequantize : public PackedPrimitive {
 public:
  using PackedPrimitive::PackedPrimitive;
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  const char* name() const override { return "PackedDequantize"; }
};

}  // namespace zoo
