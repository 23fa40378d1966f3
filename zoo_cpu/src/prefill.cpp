// The prefill primitives' CPU evaluation: argument checks, the instruction-set choice, and the
// split of the work into jobs for the extension's thread pool (packed.cpp).
#include "prefill.h"

#include <initializer_list>
#include <sstream>
#include <utility>
#include <stdexcept>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/common/utils.h"
#include "mlx/backend/cpu/encoder.h"
#include "packed.h"

namespace zoo {

#define ZOO_KERNELS_OF(ns)                                                                                             \
  Kernels{ns::pack_keys,   ns::key_block,             ns::attention_block, ns::gelu_gate,   ns::linear_rows,           \
          ns::linear_dots, ns::linear_few_transposed, ns::rms_norm_rows,   ns::rotate_rows, ns::decode_attention_part, \
          ns::decode_attention_part_quantized,        ns::row_max,         ns::exp_weights}

Kernels vector_kernels(Isa isa) {
#if defined(__x86_64__) && defined(ZOO_X86_KERNELS)
  if (isa == Isa::avx512) return ZOO_KERNELS_OF(prefill_avx512);
  if (isa == Isa::avx2) return ZOO_KERNELS_OF(prefill_avx2);
#endif
  return ZOO_KERNELS_OF(prefill_portable);
}
#undef ZOO_KERNELS_OF

std::string shape_of(const mx::array& a) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < a.ndim(); ++i) s << (i ? ", " : "") << a.shape(i);
  s << "]";
  return s.str();
}

[[noreturn]] void fail(const std::string& op, const std::string& what) { throw std::invalid_argument(op + ": " + what); }

mx::Stream cpu_only(const char* op, mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) fail(op, "runs on MLX's CPU device only; this stream is on another device");
  return stream;
}

void check_float32(const char* op, std::initializer_list<std::pair<const char*, const mx::array*>> arrays) {
  for (const auto& [name, a] : arrays) {
    if (a->dtype() != mx::float32) {
      std::ostringstream s;
      s << name << " must be float32, got " << a->dtype();
      fail(op, s.str());
    }
  }
}

// A rank-4 float32 array as base pointer and (batch, head, row) strides with a contiguous last
// axis; an array whose last axis is strided is copied (rare: the graphs' views keep it contiguous).
// The output allocated and the encoder of the primitive's stream told what it reads and writes.
mx::cpu::CommandEncoder& output_encoder(mx::Stream stream, const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream);
  for (const auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  return encoder;
}

namespace {

// Packed panels for one call, kept by the evaluating thread for the next call up to kKeepFloats:
// a prefill makes a few such buffers a layer, and a fresh multi-megabyte allocation is handed back
// to the kernel on free and page-faulted in again on every call.
constexpr size_t kKeepFloats = size_t{4} << 20;  // 16 MB

struct Panels {
  std::vector<float> temporary;
  float* get(size_t floats) {
    thread_local std::vector<float> kept;
    if (floats <= kKeepFloats) {
      if (kept.size() < floats) kept.resize(floats);
      return kept.data();
    }
    temporary.resize(floats);
    return temporary.data();
  }
};

struct PackJob {
  const AttentionArgs* a;
  Kernels kn;
  float* panels;
  int64_t panels_per_head;  // key panels of one (batch, kv head)
  int64_t per_chunk;        // panels a chunk packs
  int64_t chunks_per_head;
};

void pack_chunk(void* ctx, int chunk) {
  const auto& j = *static_cast<const PackJob*>(ctx);
  const auto& a = *j.a;
  const int64_t head = chunk / j.chunks_per_head, part = chunk % j.chunks_per_head;
  const int64_t b = head / a.Hkv, hk = head % a.Hkv;
  const int64_t jb0 = part * j.per_chunk;
  const int64_t jb1 = jb0 + j.per_chunk < j.panels_per_head ? jb0 + j.per_chunk : j.panels_per_head;
  const int64_t panel_floats = a.D * j.kn.key_block();
  // The kernel writes panels jb0.. relative to the head's first panel.
  j.kn.pack_keys(a.k + b * a.k_stride[0] + hk * a.k_stride[1], a.k_stride[2], a.T, a.D, jb0, jb1,
                 j.panels + head * j.panels_per_head * panel_floats);
}

struct AttendJob {
  const AttentionArgs* a;
  Kernels kn;
  const float* panels;
  int64_t head_floats;  // floats of one (batch, kv head)'s panels
  int64_t blocks;       // row blocks of one (batch, query head)
  int64_t group;        // query heads a job attends (of one kv head)
  int64_t scratch_floats;
};

// Chunk c: the heaviest blocks (a causal chunk's last rows see the most keys) go first, every
// (batch, head group) of one block index together, so the threads finish close together.
void attend_chunk(void* ctx, int chunk) {
  const auto& j = *static_cast<const AttendJob*>(ctx);
  const auto& a = *j.a;
  const int64_t groups = a.Hq / j.group, jobs = a.B * groups;
  const int64_t block = j.blocks - 1 - chunk / jobs, bg = chunk % jobs;
  const int64_t b = bg / groups, h0 = (bg % groups) * j.group;
  const int64_t i0 = block * kBlockRows, i1 = i0 + kBlockRows < a.L ? i0 + kBlockRows : a.L;
  thread_local std::vector<float> scratch;
  if (static_cast<int64_t>(scratch.size()) < j.scratch_floats) scratch.resize(j.scratch_floats);
  const int64_t hk = h0 / (a.Hq / a.Hkv);
  j.kn.attention_block(a, b, h0, h0 + j.group, i0, i1, j.panels + (b * a.Hkv + hk) * j.head_floats, scratch.data());
}

// Query heads a job attends: all the heads of a kv head (up to kGroupHeads), which then read its
// keys and values once per block of rows, where there are jobs enough for the threads (two per
// thread); else one head a job (a few query rows: a verify block, a short chunk).
int64_t head_group(const AttentionArgs& a, int64_t blocks) {
  const int64_t per_kv = a.Hq / a.Hkv;
  int64_t group = per_kv < kGroupHeads ? per_kv : kGroupHeads;
  while (per_kv % group != 0) --group;
  return a.B * a.Hkv * blocks >= 2 * static_cast<int64_t>(threads()) ? group : 1;
}

void run_attention(AttentionArgs a, Isa isa) {
  const Kernels kn = vector_kernels(isa);
  const int64_t nb = kn.key_block();
  const int64_t panels_per_head = (a.T + nb - 1) / nb;
  const int64_t head_floats = panels_per_head * nb * a.D;
  Panels buffer;
  float* panels = buffer.get(a.B * a.Hkv * head_floats);
  const int64_t per_chunk = 8;
  PackJob pack{&a, kn, panels, panels_per_head, per_chunk, (panels_per_head + per_chunk - 1) / per_chunk};
  parallel_chunks(static_cast<int>(a.B * a.Hkv * pack.chunks_per_head), pack_chunk, &pack);
  const int64_t blocks = (a.L + kBlockRows - 1) / kBlockRows;
  const int64_t group = head_group(a, blocks);
  const int64_t keys = panels_per_head * nb < kAttendKeys ? panels_per_head * nb : kAttendKeys;  // a block's scores
  AttendJob attend{&a, kn, panels, head_floats, blocks, group, kBlockRows * keys};
  parallel_chunks(static_cast<int>(a.B * (a.Hq / group) * blocks), attend_chunk, &attend);
}

struct GeluJob {
  Kernels kn;
  const float* up;
  const float* gate;  // null: up holds rows of [up | gate], `width` values each
  float* out;
  int64_t n;  // outputs
  int64_t width;
  int chunks;
};

void gelu_chunk(void* ctx, int chunk) {
  const auto& j = *static_cast<const GeluJob*>(ctx);
  if (j.gate) {
    const int64_t i0 = j.n * chunk / j.chunks, i1 = j.n * (chunk + 1) / j.chunks;
    j.kn.gelu_gate(j.up, j.gate, i0, i1, j.out);
    return;
  }
  const int64_t rows = j.n / j.width, r0 = rows * chunk / j.chunks, r1 = rows * (chunk + 1) / j.chunks;
  for (int64_t r = r0; r < r1; ++r) {
    const float* row = j.up + 2 * r * j.width;
    j.kn.gelu_gate(row, row + j.width, 0, j.width, j.out + r * j.width);
  }
}

constexpr int64_t kGeluChunk = 1 << 14;  // elements below which a chunk is not worth a thread

// Row-wise work (norms, RoPE) in chunks of rows: about kRowChunk floats a chunk, at most 8 chunks.
constexpr int64_t kRowChunk = 1 << 14;

int row_chunks(int64_t rows, int64_t row_floats) {
  const int64_t wanted = rows * row_floats / kRowChunk;
  const int64_t n = wanted < 1 ? 1 : (wanted > 8 ? 8 : wanted);
  return static_cast<int>(n < rows ? n : (rows > 0 ? rows : 1));
}

struct NormJob {
  Kernels kn;
  const float* x;
  const float* w;
  const float* residual;  // added to the normed rows, or null
  float* y;
  int64_t rows, D;
  float eps;
  int chunks;
};

void norm_chunk(void* ctx, int chunk) {
  const auto& j = *static_cast<const NormJob*>(ctx);
  const int64_t r0 = j.rows * chunk / j.chunks, r1 = j.rows * (chunk + 1) / j.chunks;
  j.kn.rms_norm_rows(j.x, j.w, j.D, j.eps, r0, r1, j.y);
  if (j.residual)
    for (int64_t i = r0 * j.D; i < r1 * j.D; ++i) j.y[i] += j.residual[i];
}

struct RotateJob {
  Kernels kn;
  const float* x;
  int64_t x_stride[3];
  const float* cos;
  const float* sin;
  int64_t cs_batch;
  float* out;
  int64_t rows, H, L, D;
  int chunks;
};

void rotate_chunk(void* ctx, int chunk) {
  const auto& j = *static_cast<const RotateJob*>(ctx);
  j.kn.rotate_rows(j.x, j.x_stride, j.H, j.L, j.D, j.cos, j.sin, j.cs_batch, j.rows * chunk / j.chunks,
                   j.rows * (chunk + 1) / j.chunks, j.out);
}

// x [M, K] @ w[N, K]^T: x packed into panels of key_block() rows (as keys are), then the weight's
// rows split over the threads in chunks of kLinearRows, each chunk against every panel.
constexpr int64_t kLinearRows = 48;

struct LinearJob {
  Kernels kn;
  const float* x;
  const float* w;
  float* panels;
  float* y;
  int64_t M, K, N;
  int64_t per_pack;  // panels a packing chunk makes
  bool transposed;   // w is [K, N]: the few-row kernel
  int64_t columns = 0;  // transposed: output columns a chunk takes
};

void linear_pack_chunk(void* ctx, int chunk) {
  const auto& j = *static_cast<const LinearJob*>(ctx);
  const int64_t npanels = (j.M + j.kn.key_block() - 1) / j.kn.key_block();
  const int64_t jb0 = chunk * j.per_pack, jb1 = jb0 + j.per_pack < npanels ? jb0 + j.per_pack : npanels;
  j.kn.pack_keys(j.x, j.K, j.M, j.K, jb0, jb1, j.panels);
}

// Up to kDotMaxRows rows of x take no panels: each weight row against every row of x (linear_dots).
void linear_chunk(void* ctx, int chunk) {
  const auto& j = *static_cast<const LinearJob*>(ctx);
  const int64_t n0 = chunk * kLinearRows, n1 = n0 + kLinearRows < j.N ? n0 + kLinearRows : j.N;
  if (j.M <= kDotMaxRows)
    j.kn.linear_dots(j.w, j.K, j.x, j.M, n0, n1, j.y, j.N);
  else
    j.kn.linear_rows(j.w, j.K, j.panels, j.M, n0, n1, j.y, j.N);
}

// A weight stored transposed (a few rows of x): chunks of kTransposedColumns output columns, each
// wide enough for the kernel's row streams (the rows of the weight are far apart), no packing; of
// half the columns (rounded up to whole tiles) where that is fewer, so that both cores take a narrow output
// (a canvas against DiffusionGemma's [V, H] table: 256 columns).
constexpr int64_t kTransposedColumns = 4096;

void transposed_chunk(void* ctx, int chunk) {
  const auto& j = *static_cast<const LinearJob*>(ctx);
  const int64_t n0 = chunk * j.columns, n1 = n0 + j.columns < j.N ? n0 + j.columns : j.N;
  j.kn.linear_few_transposed(j.w, j.N, j.K, j.x, j.M, n0, n1, j.y, j.N);
}

void run_linear(LinearJob j) {
  if (j.transposed) {
    const int64_t nb = j.kn.key_block(), half = ((j.N + 1) / 2 + nb - 1) / nb * nb;
    j.columns = half < kTransposedColumns ? half : kTransposedColumns;
    parallel_chunks(static_cast<int>((j.N + j.columns - 1) / j.columns), transposed_chunk, &j);
    return;
  }
  Panels buffer;
  if (j.M > kDotMaxRows) {
    const int64_t nb = j.kn.key_block();
    const int64_t npanels = (j.M + nb - 1) / nb;
    j.panels = buffer.get(npanels * nb * j.K);
    j.per_pack = 2;
    parallel_chunks(static_cast<int>((npanels + j.per_pack - 1) / j.per_pack), linear_pack_chunk, &j);
  }
  parallel_chunks(static_cast<int>((j.N + kLinearRows - 1) / kLinearRows), linear_chunk, &j);
}

}  // namespace

// ------------------------------------------------------------------------------------ the ops
mx::array prefill_attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                            const std::optional<mx::array>& mask, bool causal, const std::string& isa,
                            mx::StreamOrDevice s) {
  const char* op = "prefill_attention";
  auto stream = cpu_only(op, s);
  check_float32(op, {{"q", &q}, {"k", &k}, {"v", &v}});
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4)
    fail(op, "q, k and v must be rank 4 [B, H, L, D], got " + shape_of(q) + ", " + shape_of(k) + ", " + shape_of(v));
  const int B = q.shape(0), Hq = q.shape(1), L = q.shape(2), D = q.shape(3);
  const int Hkv = k.shape(1), T = k.shape(2);
  if (k.shape(0) != B || v.shape(0) != B || v.shape(1) != Hkv || v.shape(2) != T || k.shape(3) != D)
    fail(op, "k " + shape_of(k) + " and v " + shape_of(v) + " do not match q " + shape_of(q) +
                 " (k [B, Hkv, T, D], v [B, Hkv, T, Dv])");
  if (Hkv < 1 || Hq % Hkv != 0) fail(op, "query heads " + std::to_string(Hq) + " are not a multiple of kv heads " + std::to_string(Hkv));
  if (causal && T < L) fail(op, "a causal read needs at least as many keys as queries, got T=" + std::to_string(T) + " < L=" + std::to_string(L));
  if (!(scale > 0.0f)) fail(op, "scale must be > 0, got " + std::to_string(scale));
  std::vector<mx::array> inputs{q, k, v};
  if (mask) {
    const auto& m = *mask;
    const bool rank2 = m.ndim() == 2 && m.shape(0) == L && m.shape(1) == T;
    const bool rank4 = m.ndim() == 4 && (m.shape(0) == B || m.shape(0) == 1) && m.shape(1) == 1 && m.shape(2) == L &&
                       m.shape(3) == T;
    if (m.dtype() != mx::bool_ || !(rank2 || rank4))
      fail(op, "mask must be bool [L, T] or [B or 1, 1, L, T] with L=" + std::to_string(L) + ", T=" +
                   std::to_string(T) + ", got " + shape_of(m));
    inputs.push_back(m);
  }
  const std::vector<float> settings{scale, causal ? 1.0f : 0.0f, mask ? 1.0f : 0.0f};
  // Computed positions first, [B, L, Hq, Dv], and handed back as its [B, Hq, L, Dv] view: the
  // layer's move of the heads back beside each position then needs no copy.
  const mx::array out({B, L, Hq, static_cast<int>(v.shape(3))}, mx::float32,
                      std::make_shared<PrefillAttention>(stream, parse_isa(isa), settings), std::move(inputs));
  return mx::transpose(out, {0, 2, 1, 3}, stream);
}

mx::array gelu_gate(const mx::array& up, const std::optional<mx::array>& gate, const std::string& isa,
                    mx::StreamOrDevice s) {
  const char* op = "gelu_gate";
  auto stream = cpu_only(op, s);
  check_float32(op, {{"up", &up}});
  if (!gate) {  // one array of rows [up | gate]
    if (up.ndim() < 1 || up.shape(-1) % 2 != 0)
      fail(op, "without gate, up must hold [up | gate] along an even last axis, got " + shape_of(up));
    auto shape = up.shape();
    shape.back() /= 2;
    return mx::array(std::move(shape), mx::float32, std::make_shared<GeluGate>(stream, parse_isa(isa)), {up});
  }
  check_float32(op, {{"gate", &*gate}});
  if (up.shape() != gate->shape()) fail(op, "up " + shape_of(up) + " and gate " + shape_of(*gate) + " must have one shape");
  return mx::array(up.shape(), mx::float32, std::make_shared<GeluGate>(stream, parse_isa(isa)), {up, *gate});
}

mx::array prefill_linear(const mx::array& x, const mx::array& w, const std::string& isa, bool transposed,
                         mx::StreamOrDevice s) {
  const char* op = "prefill_linear";
  auto stream = cpu_only(op, s);
  check_float32(op, {{"x", &x}, {"w", &w}});
  const int k_axis = transposed ? 0 : 1;
  if (w.ndim() != 2 || x.ndim() < 1 || x.shape(-1) != w.shape(k_axis))
    fail(op, std::string("x [..., K] and w ") + (transposed ? "[K, N]" : "[N, K]") + " do not match: x " + shape_of(x) +
                 ", w " + shape_of(w));
  auto shape = x.shape();
  shape.back() = w.shape(1 - k_axis);
  return mx::array(std::move(shape), mx::float32,
                   std::make_shared<PrefillLinear>(stream, parse_isa(isa), std::vector<float>{transposed ? 1.0f : 0.0f}),
                   {mx::contiguous(x, false, stream), mx::contiguous(w, false, stream)});
}

mx::array rms_norm(const mx::array& x, const std::optional<mx::array>& weight, float eps, float shift,
                   const std::optional<mx::array>& residual, const std::string& isa, mx::StreamOrDevice s) {
  const char* op = "rms_norm";
  auto stream = cpu_only(op, s);
  check_float32(op, {{"x", &x}});
  if (x.ndim() < 1) fail(op, "x must have at least one axis, got a scalar");
  std::vector<mx::array> inputs{x};
  if (weight) {
    check_float32(op, {{"weight", &*weight}});
    if (weight->ndim() != 1 || weight->shape(0) != x.shape(-1))
      fail(op, "weight must be [D] with D=" + std::to_string(x.shape(-1)) + " (x's last axis), got " + shape_of(*weight));
    inputs.push_back(*weight);
  } else if (shift != 0.0f) {
    fail(op, "shift applies to a weight; there is none");
  }
  if (residual) {
    check_float32(op, {{"residual", &*residual}});
    if (residual->shape() != x.shape()) fail(op, "residual " + shape_of(*residual) + " must have x's shape " + shape_of(x));
    inputs.push_back(*residual);
  }
  if (!(eps >= 0.0f)) fail(op, "eps must be >= 0, got " + std::to_string(eps));
  auto primitive = std::make_shared<RmsNorm>(
      stream, parse_isa(isa), std::vector<float>{eps, weight ? 1.0f : 0.0f, shift, residual ? 1.0f : 0.0f});
  return mx::array(x.shape(), mx::float32, std::move(primitive), std::move(inputs));
}

mx::array rope_rotate(const mx::array& x, const mx::array& cos, const mx::array& sin, const std::string& isa,
                      mx::StreamOrDevice s) {
  const char* op = "rope_rotate";
  auto stream = cpu_only(op, s);
  check_float32(op, {{"x", &x}, {"cos", &cos}, {"sin", &sin}});
  if (x.ndim() != 4 || x.shape(3) % 2 != 0) fail(op, "x must be [B, H, L, D] with an even D, got " + shape_of(x));
  const int B = x.shape(0), L = x.shape(2), half = x.shape(3) / 2;
  const bool rank2 = cos.ndim() == 2 && cos.shape(0) == L && cos.shape(1) == half;
  const bool rank4 = cos.ndim() == 4 && cos.shape(0) == B && cos.shape(1) == 1 && cos.shape(2) == L && cos.shape(3) == half;
  if (!(rank2 || rank4) || sin.shape() != cos.shape())
    fail(op, "cos and sin must both be [L, D/2] or [B, 1, L, D/2] for x " + shape_of(x) + ", got " + shape_of(cos) +
                 " and " + shape_of(sin));
  return mx::array(x.shape(), mx::float32, std::make_shared<RopeRotate>(stream, parse_isa(isa)),
                   {x, mx::contiguous(cos, false, stream), mx::contiguous(sin, false, stream)});
}

// ------------------------------------------------------------------------------------ evaluation
void PrefillAttention::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& encoder = output_encoder(stream(), inputs, out);
  encoder.dispatch([inputs, out = out.data<float>(), isa = isa_, scale = settings_[0], causal = settings_[1] != 0.0f,
                    masked = settings_[2] != 0.0f]() {
    const auto &q = inputs[0], &k = inputs[1], &v = inputs[2];
    AttentionArgs a{};
    std::vector<float> qc, kc, vc;
    a.q = rows_of(q, a.q_stride, qc);
    a.k = rows_of(k, a.k_stride, kc);
    a.v = rows_of(v, a.v_stride, vc);
    a.B = q.shape(0), a.Hq = q.shape(1), a.L = q.shape(2), a.D = q.shape(3);
    a.Hkv = k.shape(1), a.T = k.shape(2), a.Dv = v.shape(3);
    a.scale = scale;
    a.causal = causal;
    a.out = out;
    if (masked) {
      const auto& m = inputs[3];
      a.mask = reinterpret_cast<const uint8_t*>(m.data<bool>());
      const int r = m.ndim() == 4 ? 2 : 0;  // the query-row axis
      a.mask_stride[0] = m.ndim() == 4 && m.shape(0) > 1 ? m.strides(0) : 0;
      a.mask_stride[1] = m.strides(r);
      a.mask_stride[2] = m.strides(r + 1);
    }
    if (a.B * a.Hq * a.L == 0 || a.Dv == 0) return;
    run_attention(a, isa);
  });
}

void GeluGate::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& encoder = output_encoder(stream(), inputs, out);
  const int64_t n = out.size(), width = out.ndim() ? out.shape(-1) : 1;
  const bool joined = inputs.size() == 1;
  const int64_t wanted = n / kGeluChunk, most = joined ? (width ? n / width : 1) : 8;
  const int chunks = static_cast<int>(wanted < 1 ? 1 : (wanted > 8 ? 8 : (wanted > most ? most : wanted)));
  encoder.dispatch([inputs, joined, job = GeluJob{vector_kernels(isa_), nullptr, nullptr, out.data<float>(), n, width,
                                                  chunks}]() mutable {
    if (job.n == 0) return;
    std::vector<float> up, gate;
    job.up = dense(inputs[0], up);
    if (!joined) job.gate = dense(inputs[1], gate);
    parallel_chunks(job.chunks, gelu_chunk, &job);
  });
}

void PrefillLinear::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& encoder = output_encoder(stream(), inputs, out);
  const auto& w = inputs[1];
  const bool transposed = settings_[0] != 0.0f;
  const int64_t K = w.shape(transposed ? 0 : 1), N = w.shape(transposed ? 1 : 0);
  const int64_t M = N > 0 ? static_cast<int64_t>(out.size()) / N : 0;
  encoder.dispatch([job = LinearJob{vector_kernels(isa_), inputs[0].data<float>(), w.data<float>(), nullptr,
                                    out.data<float>(), M, K, N, 0, transposed}]() {
    if (job.M == 0 || job.N == 0) return;
    if (job.K == 0) {
      for (int64_t i = 0; i < job.M * job.N; ++i) job.y[i] = 0.0f;
      return;
    }
    run_linear(job);
  });
}

void RmsNorm::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& encoder = output_encoder(stream(), inputs, out);
  const int64_t D = out.shape(-1), rows = D > 0 ? static_cast<int64_t>(out.size()) / D : 0;
  const bool weighted = settings_[1] != 0.0f, with_residual = settings_[3] != 0.0f;
  encoder.dispatch([inputs, weighted, with_residual, shift = settings_[2],
                    job = NormJob{vector_kernels(isa_), nullptr, nullptr, nullptr, out.data<float>(), rows, D, settings_[0],
                                  row_chunks(rows, D)}]() mutable {
    if (job.rows == 0) return;
    std::vector<float> x, w, w_shifted, residual;
    job.x = dense(inputs[0], x);
    if (weighted) job.w = shifted(dense(inputs[1], w), job.D, shift, w_shifted);
    if (with_residual) job.residual = dense(inputs.back(), residual);
    parallel_chunks(job.chunks, norm_chunk, &job);
  });
}

void RopeRotate::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& encoder = output_encoder(stream(), inputs, out);
  const auto& x = inputs[0];
  const auto& cos = inputs[1];
  const int64_t rows = static_cast<int64_t>(out.size()) / (out.shape(3) > 0 ? out.shape(3) : 1);
  encoder.dispatch([x, job = RotateJob{vector_kernels(isa_), nullptr, {0, 0, 0}, cos.data<float>(), inputs[2].data<float>(),
                                       cos.ndim() == 4 ? static_cast<int64_t>(cos.shape(2)) * cos.shape(3) : 0,
                                       out.data<float>(), rows, x.shape(1), x.shape(2), x.shape(3),
                                       row_chunks(rows, x.shape(3))}]() mutable {
    if (job.rows == 0 || job.D == 0) return;
    std::vector<float> copy;
    job.x = rows_of(x, job.x_stride, copy);
    parallel_chunks(job.chunks, rotate_chunk, &job);
  });
}

bool PrefillPrimitive::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const PrefillPrimitive&>(other);
  return std::string(name()) == o.name() && isa_ == o.isa_ && settings_ == o.settings_;
}

void PrefillPrimitive::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error(std::string(name()) + " runs on MLX's CPU device only");
}

std::vector<mx::Shape> PrefillAttention::output_shapes(const std::vector<mx::array>& inputs) {
  return {{inputs[0].shape(0), inputs[0].shape(2), inputs[0].shape(1), inputs[2].shape(3)}};  // [B, L, Hq, Dv]
}

std::vector<mx::Shape> GeluGate::output_shapes(const std::vector<mx::array>& inputs) {
  auto shape = inputs[0].shape();
  if (inputs.size() == 1) shape.back() /= 2;
  return {shape};
}

std::vector<mx::Shape> PrefillLinear::output_shapes(const std::vector<mx::array>& inputs) {
  auto shape = inputs[0].shape();
  shape.back() = inputs[1].shape(settings_[0] != 0.0f ? 1 : 0);
  return {shape};
}

}  // namespace zoo
