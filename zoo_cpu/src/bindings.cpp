// Python bindings of the packed kernels (module zoo_cpu._packed), in nanobind's "mlx" domain so
// that MLX's own array type is shared with mlx.core.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "packed.h"
#include "prefill.h"
#include "decode.h"
#include "sampling.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_packed, m) {
  m.doc() = "Packed 4/8-bit weight products on MLX's CPU device (gemma-mlx-zoo kernels)";
  m.def("packed_matmul", &zoo::packed_matmul, "x"_a, "w"_a, "scales"_a, "biases"_a, "group_size"_a, "bits"_a,
        "isa"_a = "", nb::kw_only(), "stream"_a = nb::none(),
        "x [..., K] @ dequantize(w, scales, biases).T in float32, w [N, K * bits / 32] uint32 (MLX's affine layout)");
  m.def("packed_dequantize", &zoo::packed_dequantize, "w"_a, "scales"_a, "biases"_a, "group_size"_a, "bits"_a,
        "isa"_a = "", nb::kw_only(), "stream"_a = nb::none(), "dequantize(w, scales, biases) as a float32 [N, K] array");
  m.def("prefill_attention", &zoo::prefill_attention, "q"_a, "k"_a, "v"_a, "scale"_a, "mask"_a = nb::none(),
        "causal"_a = false, "isa"_a = "", nb::kw_only(), "stream"_a = nb::none(),
        "softmax(q k^T * scale + mask) v in float32, fused and split over the threads (a prefill chunk's queries)");
  m.def("prefill_linear", &zoo::prefill_linear, "x"_a, "w"_a, "isa"_a = "", "transposed"_a = false, nb::kw_only(),
        "stream"_a = nb::none(),
        "x [..., K] @ w[N, K]^T in float32, split over the threads (an nn.Linear's product for many rows); "
        "transposed: x @ w for a weight stored transposed, w [K, N], a few rows of x reading it once");
  m.def("rms_norm", &zoo::rms_norm, "x"_a, "weight"_a = nb::none(), "eps"_a = 1e-6f, "shift"_a = 0.0f,
        "residual"_a = nb::none(), "isa"_a = "", nb::kw_only(), "stream"_a = nb::none(),
        "residual + x * (mean(x^2) + eps)^-1/2 * (weight + shift) over the last axis in float32, split over the threads");
  m.def("rope_rotate", &zoo::rope_rotate, "x"_a, "cos"_a, "sin"_a, "isa"_a = "", nb::kw_only(), "stream"_a = nb::none(),
        "RoPE by tables (x cos + rotate_half(x) sin) in float32, split over the threads");
  m.def("gelu_gate", &zoo::gelu_gate, "up"_a, "gate"_a = nb::none(), "isa"_a = "", nb::kw_only(), "stream"_a = nb::none(),
        "gelu_tanh(gate) * up in float32, split over the threads (no gate: up holds rows of [up | gate])");
  m.def("decode_heads", &zoo::decode_heads, "projected"_a, "heads"_a, "kv_heads"_a, "has_v"_a, "head_dim"_a,
        "q_weight"_a = nb::none(), "k_weight"_a = nb::none(), "shift"_a = 0.0f, "eps"_a = 1e-6f, "v_norm"_a = false,
        "cos"_a, "sin"_a, "isa"_a = "", nb::kw_only(), "stream"_a = nb::none(),
        "a decode step's projected [B, 1, N] as normed, rotated query heads (and key and value heads), float32");
  m.def("decode_attention", &zoo::decode_attention, "q"_a, "keys"_a, "values"_a, "start"_a, "size"_a, "scale"_a,
        "mask"_a = nb::none(), "isa"_a = "", nb::kw_only(), "stream"_a = nb::none(),
        "one query per row against rows [start, start + size) of the key and value planes, read in place, float32");
  m.def("decode_attention_quantized", &zoo::decode_attention_quantized, "q"_a, "k_packed"_a, "k_scales"_a,
        "k_biases"_a, "v_packed"_a, "v_scales"_a, "v_biases"_a, "start"_a, "size"_a, "scale"_a, "mask"_a = nb::none(),
        "bits"_a = 8, "group_size"_a = 64, "isa"_a = "", nb::kw_only(), "stream"_a = nb::none(),
        "decode_attention over mx.quantize's key and value planes (4 or 8 bits), the codes read in place");
  m.def("top_k", &zoo::top_k, "x"_a, "k"_a, nb::kw_only(), "stream"_a = nb::none(),
        "the k largest values of x's last axis from the largest down and their indices (uint32), float32");
  m.def("log_softmax", &zoo::log_softmax, "x"_a, "isa"_a = "", nb::kw_only(), "stream"_a = nb::none(),
        "x - logsumexp(x) along the last axis, float32, on the threads");
  m.def("keep_floor", &zoo::keep_floor, "x"_a, "top_p"_a, "min_p"_a, "isa"_a = "", nb::kw_only(), "stream"_a = nb::none(),
        "the smallest value top-p and min-p keep of each row of normalised log-probabilities [..., 1], float32");
  m.def("categorical", &zoo::categorical, "x"_a, "u"_a, "scale"_a, "floor"_a = nb::none(), "isa"_a = "", nb::kw_only(),
        "stream"_a = nb::none(),
        "one index a row drawn from softmax(x * scale) over the values at or above floor, by the inverse CDF of u");
  m.def("decode_attention_rows", &zoo::decode_attention_rows, "q"_a, "planes"_a, "starts"_a, "sizes"_a, "scale"_a,
        "bits"_a = 0, "group_size"_a = 64, "isa"_a = "", nb::kw_only(), "stream"_a = nb::none(),
        "one query per batch row over a run of that row's own key and value planes (float, or 4/8-bit quantized)");
  m.def("available_isas", &zoo::available_isas, "instruction sets this CPU and build run, widest first");
  m.def("threads", &zoo::threads, "threads the products split their rows over");
  m.def("set_threads", &zoo::set_threads, "n"_a, "split products over at most n threads (1 to the CPUs available)");
  m.def("built_for_mlx", &zoo::built_for_mlx, "the MLX version whose headers this extension was compiled with");
}
