// The decode primitives' argument checks and CPU evaluation (see decode.h).
#include "decode.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "mlx/allocator.h"
#include "packed.h"

namespace zoo {

// ------------------------------------------------------------------------------------ the ops
std::vector<mx::array> decode_heads(const mx::array& projected, int heads, int kv_heads, bool has_v, int head_dim,
                                    const std::optional<mx::array>& q_weight, const std::optional<mx::array>& k_weight,
                                    float shift, float eps, bool v_norm, const mx::array& cos, const mx::array& sin,
                                    const std::string& isa, mx::StreamOrDevice s) {
  const char* op = "decode_heads";
  auto stream = cpu_only(op, s);
  check_float32(op, {{"projected", &projected}, {"cos", &cos}, {"sin", &sin}});
  if (heads < 1 || kv_heads < 0 || head_dim < 2 || head_dim % 2 != 0 || (kv_heads > 0 && heads % kv_heads != 0))
    fail(op, "heads " + std::to_string(heads) + ", kv_heads " + std::to_string(kv_heads) + " and head_dim " +
                 std::to_string(head_dim) + " do not make attention heads (an even head_dim, heads a multiple of kv_heads)");
  const int64_t width = static_cast<int64_t>(heads + kv_heads * (has_v ? 2 : 1)) * head_dim;
  if (projected.ndim() != 3 || projected.shape(1) != 1 || projected.shape(2) != width)
    fail(op, "projected must be [B, 1, " + std::to_string(width) + "] (queries, keys, values side by side), got " +
                 shape_of(projected));
  const mx::Shape table{1, head_dim / 2};
  if (cos.shape() != table || sin.shape() != table)
    fail(op, "cos and sin must be [1, " + std::to_string(head_dim / 2) + "], got " + shape_of(cos) + " and " + shape_of(sin));
  std::vector<mx::array> inputs{projected, cos, sin};
  for (const auto& [name, w] : {std::pair{"q_weight", &q_weight}, std::pair{"k_weight", &k_weight}}) {
    if (!*w) continue;
    check_float32(op, {{name, &**w}});
    if ((*w)->ndim() != 1 || (*w)->shape(0) != head_dim)
      fail(op, std::string(name) + " must be [" + std::to_string(head_dim) + "], got " + shape_of(**w));
    inputs.push_back(**w);
  }
  if (!(eps >= 0.0f)) fail(op, "eps must be >= 0, got " + std::to_string(eps));
  const std::vector<float> settings{static_cast<float>(heads), static_cast<float>(kv_heads), has_v ? 1.0f : 0.0f,
                                    static_cast<float>(head_dim), q_weight ? 1.0f : 0.0f, k_weight ? 1.0f : 0.0f,
                                    shift, eps, v_norm ? 1.0f : 0.0f};
  auto primitive = std::make_shared<DecodeHeads>(stream, parse_isa(isa), settings);
  const int B = projected.shape(0);
  std::vector<mx::Shape> shapes{{B, heads, 1, head_dim}};
  if (kv_heads > 0) shapes.insert(shapes.end(), 2, mx::Shape{B, kv_heads, 1, head_dim});
  return mx::array::make_arrays(std::move(shapes), std::vector<mx::Dtype>(shapes.size(), mx::float32), primitive,
                                std::move(inputs));
}

mx::array decode_attention(const mx::array& q, const mx::array& keys, const mx::array& values, const mx::array& start,
                           int size, float scale, const std::optional<mx::array>& mask, const std::string& isa,
                           mx::StreamOrDevice s) {
  const char* op = "decode_attention";
  auto stream = cpu_only(op, s);
  check_float32(op, {{"q", &q}, {"keys", &keys}, {"values", &values}});
  if (q.ndim() != 4 || keys.ndim() != 4 || values.ndim() != 4 || q.shape(2) != 1)
    fail(op, "q must be [B, Hq, 1, D] and keys, values [B, Hkv, T, D]; got " + shape_of(q) + ", " + shape_of(keys) +
                 ", " + shape_of(values));
  const int B = q.shape(0), Hq = q.shape(1), D = q.shape(3), Hkv = keys.shape(1), T = keys.shape(2);
  if (keys.shape(0) != B || values.shape(0) != B || values.shape(1) != Hkv || values.shape(2) != T || keys.shape(3) != D)
    fail(op, "keys " + shape_of(keys) + " and values " + shape_of(values) + " do not match q " + shape_of(q));
  if (Hkv < 1 || Hq % Hkv != 0)
    fail(op, "query heads " + std::to_string(Hq) + " are not a multiple of kv heads " + std::to_string(Hkv));
  if (size < 1 || size > T) fail(op, "size must be in [1, " + std::to_string(T) + "] (the planes' rows), got " + std::to_string(size));
  if (start.dtype() != mx::int32 || start.size() != 1) fail(op, "start must be one int32, got " + shape_of(start));
  if (!(scale > 0.0f)) fail(op, "scale must be > 0, got " + std::to_string(scale));
  std::vector<mx::array> inputs{q, keys, values, start};
  if (mask) {
    const auto& m = *mask;
    if (m.dtype() != mx::bool_ || m.ndim() != 2 || (m.shape(0) != 1 && m.shape(0) != B) || m.shape(1) != size)
      fail(op, "mask must be bool [1 or B, size] with size " + std::to_string(size) + ", got " + shape_of(m));
    inputs.push_back(m);
  }
  const std::vector<float> settings{scale, static_cast<float>(size), mask ? 1.0f : 0.0f};
  return mx::array({B, Hq, 1, values.shape(3)}, mx::float32,
                   std::make_shared<DecodeAttention>(stream, parse_isa(isa), settings), std::move(inputs));
}

mx::array decode_attention_quantized(const mx::array& q, const mx::array& k_packed, const mx::array& k_scales,
                                     const mx::array& k_biases, const mx::array& v_packed, const mx::array& v_scales,
                                     const mx::array& v_biases, const mx::array& start, int size, float scale,
                                     const std::optional<mx::array>& mask, int bits, int group_size,
                                     const std::string& isa, mx::StreamOrDevice s) {
  const char* op = "decode_attention_quantized";
  auto stream = cpu_only(op, s);
  check_float32(op, {{"q", &q}, {"k_scales", &k_scales}, {"k_biases", &k_biases}, {"v_scales", &v_scales},
                     {"v_biases", &v_biases}});
  if (bits != 4 && bits != 8) fail(op, "bits must be 4 or 8, got " + std::to_string(bits));
  if (group_size != 32 && group_size != 64 && group_size != 128)
    fail(op, "group_size must be 32, 64 or 128, got " + std::to_string(group_size));
  if (q.ndim() != 4 || q.shape(2) != 1) fail(op, "q must be [B, Hq, 1, D], got " + shape_of(q));
  const int B = q.shape(0), Hq = q.shape(1), D = q.shape(3);
  for (const auto& [name, a] : {std::pair{"k_packed", &k_packed}, std::pair{"k_scales", &k_scales},
                                std::pair{"k_biases", &k_biases}, std::pair{"v_packed", &v_packed},
                                std::pair{"v_scales", &v_scales}, std::pair{"v_biases", &v_biases}})
    if (a->ndim() != 4 || a->shape(0) != B || a->shape(1) != k_packed.shape(1) || a->shape(2) != k_packed.shape(2))
      fail(op, std::string(name) + " must be [" + std::to_string(B) + ", Hkv, T, ...] like k_packed " +
                   shape_of(k_packed) + ", got " + shape_of(*a));
  if (k_packed.dtype() != mx::uint32 || v_packed.dtype() != mx::uint32)
    fail(op, "k_packed and v_packed must be uint32 words (mx.quantize's), got " + shape_of(k_packed) + " and " +
                 shape_of(v_packed));
  const int Hkv = k_packed.shape(1), T = k_packed.shape(2), Dv = v_scales.shape(3) * group_size;
  if (D % group_size != 0 || k_packed.shape(3) != D * bits / 32 || k_scales.shape(3) != D / group_size ||
      k_biases.shape(3) != D / group_size)
    fail(op, "keys of head dim " + std::to_string(D) + " at " + std::to_string(bits) + " bits, group " +
                 std::to_string(group_size) + " need packed [..., " + std::to_string(D * bits / 32) +
                 "] and scales, biases [..., " + std::to_string(D / group_size) + "], got " + shape_of(k_packed) +
                 ", " + shape_of(k_scales) + ", " + shape_of(k_biases));
  if (v_packed.shape(3) != Dv * bits / 32 || v_biases.shape(3) != v_scales.shape(3))
    fail(op, "values " + shape_of(v_packed) + ", " + shape_of(v_scales) + ", " + shape_of(v_biases) +
                 " are not one head dim at " + std::to_string(bits) + " bits, group " + std::to_string(group_size));
  if (Hkv < 1 || Hq % Hkv != 0)
    fail(op, "query heads " + std::to_string(Hq) + " are not a multiple of kv heads " + std::to_string(Hkv));
  if (size < 1 || size > T) fail(op, "size must be in [1, " + std::to_string(T) + "] (the planes' rows), got " + std::to_string(size));
  if (start.dtype() != mx::int32 || start.size() != 1) fail(op, "start must be one int32, got " + shape_of(start));
  if (!(scale > 0.0f)) fail(op, "scale must be > 0, got " + std::to_string(scale));
  std::vector<mx::array> inputs{q, k_packed, k_scales, k_biases, v_packed, v_scales, v_biases, start};
  if (mask) {
    const auto& m = *mask;
    if (m.dtype() != mx::bool_ || m.ndim() != 2 || (m.shape(0) != 1 && m.shape(0) != B) || m.shape(1) != size)
      fail(op, "mask must be bool [1 or B, size] with size " + std::to_string(size) + ", got " + shape_of(m));
    inputs.push_back(m);
  }
  const std::vector<float> settings{scale, static_cast<float>(size), mask ? 1.0f : 0.0f, static_cast<float>(bits),
                                    static_cast<float>(group_size)};
  return mx::array({B, Hq, 1, Dv}, mx::float32, std::make_shared<DecodeAttentionQuantized>(stream, parse_isa(isa), settings),
                   std::move(inputs));
}

mx::array decode_attention_rows(const mx::array& q, const std::vector<mx::array>& planes, const std::vector<int>& starts,
                                const std::vector<int>& sizes, float scale, int bits, int group_size,
                                const std::string& isa, mx::StreamOrDevice s) {
  const char* op = "decode_attention_rows";
  auto stream = cpu_only(op, s);
  check_float32(op, {{"q", &q}});
  if (q.ndim() != 4 || q.shape(2) != 1) fail(op, "q must be [B, Hq, 1, D], got " + shape_of(q));
  if (bits != 0 && bits != 4 && bits != 8) fail(op, "bits must be 0 (float planes), 4 or 8, got " + std::to_string(bits));
  if (bits && group_size != 32 && group_size != 64 && group_size != 128)
    fail(op, "group_size must be 32, 64 or 128, got " + std::to_string(group_size));
  const int B = q.shape(0), Hq = q.shape(1), D = q.shape(3), per_row = bits ? 6 : 2;
  if (static_cast<int>(planes.size()) != B * per_row || static_cast<int>(starts.size()) != B ||
      static_cast<int>(sizes.size()) != B)
    fail(op, "q's " + std::to_string(B) + " rows need " + std::to_string(B * per_row) + " planes (" +
                 std::to_string(per_row) + " a row) and " + std::to_string(B) + " starts and sizes, got " +
                 std::to_string(planes.size()) + " planes, " + std::to_string(starts.size()) + " starts, " +
                 std::to_string(sizes.size()) + " sizes");
  int Hkv = -1, Dv = -1;
  for (int r = 0; r < B; ++r) {
    const mx::array* p = planes.data() + r * per_row;
    const std::string row = "row " + std::to_string(r) + ": ";
    for (int i = 0; i < per_row; ++i)
      if (p[i].ndim() != 4 || p[i].shape(0) != 1 || p[i].shape(1) != p[0].shape(1) || p[i].shape(2) != p[0].shape(2))
        fail(op, row + "planes must be [1, Hkv, T, ...] of one Hkv and T, got " + shape_of(p[i]) + " beside " + shape_of(p[0]));
    const int heads = p[0].shape(1), T = p[0].shape(2);
    int k_dim, v_dim;
    if (!bits) {
      check_float32(op, {{"keys", &p[0]}, {"values", &p[1]}});
      k_dim = p[0].shape(3), v_dim = p[1].shape(3);
    } else {
      check_float32(op, {{"k_scales", &p[1]}, {"k_biases", &p[2]}, {"v_scales", &p[4]}, {"v_biases", &p[5]}});
      if (p[0].dtype() != mx::uint32 || p[3].dtype() != mx::uint32)
        fail(op, row + "packed planes must be uint32 words (mx.quantize's)");
      k_dim = p[1].shape(3) * group_size, v_dim = p[4].shape(3) * group_size;
      for (const int at : {0, 3})
        if (p[at].shape(3) * 32 != (at ? v_dim : k_dim) * bits || p[at + 2].shape(3) != p[at + 1].shape(3))
          fail(op, row + "planes " + shape_of(p[at]) + ", " + shape_of(p[at + 1]) + ", " + shape_of(p[at + 2]) +
                       " are not one head dim at " + std::to_string(bits) + " bits, group " + std::to_string(group_size));
    }
    if (k_dim != D) fail(op, row + "keys of head dim " + std::to_string(k_dim) + " for q " + shape_of(q));
    if (r == 0) Hkv = heads, Dv = v_dim;
    if (heads != Hkv || v_dim != Dv || Hkv < 1 || Hq % Hkv != 0)
      fail(op, row + "planes " + shape_of(p[0]) + " of value head dim " + std::to_string(v_dim) + " do not fit row 0's " +
                   std::to_string(Hkv) + " kv heads and value head dim " + std::to_string(Dv) + " (q heads " +
                   std::to_string(Hq) + ", a multiple of them)");
    if (starts[r] < 0 || sizes[r] < 1 || starts[r] + sizes[r] > T)
      fail(op, row + "run [" + std::to_string(starts[r]) + ", " + std::to_string(starts[r] + sizes[r]) +
                   ") is not a non-empty run of its planes' " + std::to_string(T) + " rows");
  }
  if (!(scale > 0.0f)) fail(op, "scale must be > 0, got " + std::to_string(scale));
  std::vector<mx::array> inputs{q};
  inputs.insert(inputs.end(), planes.begin(), planes.end());
  return mx::array({B, Hq, 1, Dv}, mx::float32,
                   std::make_shared<DecodeAttentionRows>(stream, parse_isa(isa), scale, bits, group_size, starts, sizes),
                   std::move(inputs));
}

// ------------------------------------------------------------------------------------ evaluation
namespace {

// rms_norm then RoPE of one head row (x -> out), through a scratch row.
void norm_rotate(const Kernels& kn, const float* x, const float* w, int64_t D, float eps, const float* cos,
                 const float* sin, float* scratch, float* out) {
  static const int64_t zero[3] = {0, 0, 0};
  kn.rms_norm_rows(x, w, D, eps, 0, 1, scratch);
  kn.rotate_rows(scratch, zero, 1, 1, D, cos, sin, 0, 0, 1, out);
}

// One decode attention: parts of the run on the threads, each writing its (top, sum, out).
// What both decode attention jobs share: the run, its mask and the parts' partial results.
struct RunJob {
  const float* q;
  const uint8_t* mask;
  int64_t mask_batch;  // mask floats between batch rows (0: one row for all)
  int64_t B, Hkv, G, D, Dv, start, size, parts;
  float scale;
  float* out;  // [chunks, G, Dv]
  float* top;  // [chunks, G]
  float* sum;  // [chunks, G]
};

struct AttentionJob : RunJob {
  Kernels kn;
  const float* k;
  const float* v;
  int64_t k_stride[3], v_stride[3];
};

void attention_chunk(void* ctx, int chunk) {
  const auto& j = *static_cast<const AttentionJob*>(ctx);
  const int64_t head = chunk / j.parts, part = chunk % j.parts;
  const int64_t b = head / j.Hkv, hk = head % j.Hkv;
  const int64_t r0 = j.size * part / j.parts, r1 = j.size * (part + 1) / j.parts;
  thread_local std::vector<float> scores;
  if (static_cast<int64_t>(scores.size()) < j.G * (r1 - r0)) scores.resize(j.G * (r1 - r0));
  const int64_t row = j.start + r0;
  j.kn.decode_attention_part(j.q + (b * j.Hkv + hk) * j.G * j.D, j.G, j.D,
                             j.k + b * j.k_stride[0] + hk * j.k_stride[1] + row * j.k_stride[2], j.k_stride[2],
                             j.v + b * j.v_stride[0] + hk * j.v_stride[1] + row * j.v_stride[2], j.v_stride[2], j.Dv,
                             r1 - r0, j.mask ? j.mask + b * j.mask_batch + r0 : nullptr, j.scale, scores.data(),
                             j.out + chunk * j.G * j.Dv, j.top + chunk * j.G, j.sum + chunk * j.G);
}

constexpr int64_t kPartRows = 128;  // rows below which a part of the run is not worth a thread
constexpr int64_t kMaxParts = 8;

// The number of parts a run of `size` rows is split into (per batch row and kv head).
int64_t parts_of(int64_t size) {
  const int64_t wanted = size / kPartRows;
  return wanted < 1 ? 1 : (wanted > kMaxParts ? kMaxParts : wanted);
}

// Merge the parts of each query row into o [heads, G, Dv]: weights e^(top_p - max), over the
// weighted sums. out [heads * parts, G, Dv], top and sum [heads * parts, G].
void merge_parts(float* o, const float* out, const float* top, const float* sum, int64_t heads, int64_t parts,
                 int64_t G, int64_t Dv) {
  for (int64_t head = 0; head < heads; ++head)
    for (int64_t g = 0; g < G; ++g) {
      float m = -INFINITY;
      for (int64_t p = 0; p < parts; ++p) m = std::fmax(m, top[(head * parts + p) * G + g]);
      float* dst = o + (head * G + g) * Dv;
      for (int64_t c = 0; c < Dv; ++c) dst[c] = 0.0f;
      if (m == -INFINITY) continue;  // every key masked: the cache never asks for this
      float total = 0.0f;
      for (int64_t p = 0; p < parts; ++p) {
        const int64_t at = (head * parts + p) * G + g;
        if (top[at] == -INFINITY) continue;
        const float f = std::exp(top[at] - m);
        total += f * sum[at];
        const float* part = out + at * Dv;
        for (int64_t c = 0; c < Dv; ++c) dst[c] += f * part[c];
      }
      const float inv = 1.0f / total;
      for (int64_t c = 0; c < Dv; ++c) dst[c] *= inv;
    }
}

// The run of `job` (its q, shapes and planes set) attended into o: `start` clamped into the planes'
// T rows (so that no value can be read past them), the mask read, the parts on the threads.
template <class Job>
void attend_in_parts(Job& j, void (*part)(void*, int), const mx::array& start, const mx::array* mask, int64_t T,
                     int64_t size, float scale, float* o) {
  const int64_t first = start.data<int32_t>()[0];
  j.start = first < 0 ? 0 : (first > T - size ? T - size : first);
  j.size = size;
  j.scale = scale;
  std::vector<uint8_t> mc;
  if (mask) {
    j.mask = dense(*mask, mc);
    j.mask_batch = mask->shape(0) > 1 ? size : 0;
  }
  j.parts = parts_of(size);
  const int64_t chunks = j.B * j.Hkv * j.parts;
  std::vector<float> partial(chunks * j.G * (j.Dv + 2));
  j.out = partial.data();
  j.top = j.out + chunks * j.G * j.Dv;
  j.sum = j.top + chunks * j.G;
  parallel_chunks(static_cast<int>(chunks), part, &j);
  merge_parts(o, j.out, j.top, j.sum, j.B * j.Hkv, j.parts, j.G, j.Dv);
}

// One decode attention over quantized planes (mx.quantize's layout: codes packed low bits first
// in uint32 words along the head dim, one scale and bias per group): the same parts and merge as
// the float job; the kernel dequantizes a block of rows at a time into a scratch of its thread.
struct QuantizedJob : RunJob {
  Kernels kn;
  int bits;
  const uint32_t *kp, *vp;
  const float *ks, *kb, *vs, *vb;
  int64_t kp_stride[3], ks_stride[3], kb_stride[3], vp_stride[3], vs_stride[3], vb_stride[3];
  int64_t group;
};

void quantized_chunk(void* ctx, int chunk) {
  const auto& j = *static_cast<const QuantizedJob*>(ctx);
  const int64_t head = chunk / j.parts, part = chunk % j.parts;
  const int64_t b = head / j.Hkv, hk = head % j.Hkv;
  const int64_t r0 = j.size * part / j.parts, r1 = j.size * (part + 1) / j.parts, n = r1 - r0;
  thread_local std::vector<float> scratch;
  const int64_t width = j.D > j.Dv ? j.D : j.Dv;
  if (static_cast<int64_t>(scratch.size()) < j.G * n + kDecodeBlockRows * width)
    scratch.resize(j.G * n + kDecodeBlockRows * width);
  const int64_t row = j.start + r0;
  const auto plane = [&](const uint32_t* codes, const int64_t* cs, const float* scales, const int64_t* ss,
                         const float* biases, const int64_t* bs) {
    return QuantizedRows{reinterpret_cast<const uint8_t*>(codes + b * cs[0] + hk * cs[1] + row * cs[2]),
                         scales + b * ss[0] + hk * ss[1] + row * ss[2], biases + b * bs[0] + hk * bs[1] + row * bs[2],
                         cs[2] * static_cast<int64_t>(sizeof(uint32_t)), ss[2], bs[2]};
  };
  j.kn.decode_attention_part_quantized(j.q + head * j.G * j.D, j.G, j.D, plane(j.kp, j.kp_stride, j.ks, j.ks_stride, j.kb, j.kb_stride),
                                       plane(j.vp, j.vp_stride, j.vs, j.vs_stride, j.vb, j.vb_stride), j.Dv, n, j.bits,
                                       j.group, j.mask ? j.mask + b * j.mask_batch + r0 : nullptr, j.scale,
                                       scratch.data(), scratch.data() + j.G * n, j.out + chunk * j.G * j.Dv,
                                       j.top + chunk * j.G, j.sum + chunk * j.G);
}

// A ragged batch's rows attended together: one job per row (B = 1, its q, planes and run), the
// chunks of every row's parts numbered one after another and run on the threads at once.
template <class Job>
struct RowsJob {
  std::vector<Job> rows;
  std::vector<int> first;  // each row's first chunk
  void (*part)(void*, int);
};

template <class Job>
void rows_chunk(void* ctx, int chunk) {
  auto& j = *static_cast<RowsJob<Job>*>(ctx);
  const auto r = std::upper_bound(j.first.begin(), j.first.end(), chunk) - j.first.begin() - 1;
  j.part(&j.rows[r], chunk - j.first[r]);
}

// The rows' jobs (q and planes set) given their runs and parts, run, and merged into o [B, Hq, 1, Dv].
template <class Job>
void attend_rows(RowsJob<Job>& rj, const std::vector<int>& starts, const std::vector<int>& sizes, float scale, float* o) {
  const int64_t B = rj.rows.size();
  int64_t chunks = 0;
  rj.first.resize(B);
  for (int64_t r = 0; r < B; ++r) {
    Job& j = rj.rows[r];
    j.mask = nullptr, j.mask_batch = 0, j.B = 1, j.start = starts[r], j.size = sizes[r], j.scale = scale;
    j.parts = parts_of(j.size);
    rj.first[r] = static_cast<int>(chunks);
    chunks += j.Hkv * j.parts;
  }
  const int64_t G = rj.rows[0].G, Dv = rj.rows[0].Dv;
  std::vector<float> partial(chunks * G * (Dv + 2));
  float *top = partial.data() + chunks * G * Dv, *sum = top + chunks * G;
  for (int64_t r = 0; r < B; ++r) {
    Job& j = rj.rows[r];
    j.out = partial.data() + rj.first[r] * G * Dv, j.top = top + rj.first[r] * G, j.sum = sum + rj.first[r] * G;
  }
  parallel_chunks(static_cast<int>(chunks), rows_chunk<Job>, &rj);
  for (int64_t r = 0; r < B; ++r) {
    const Job& j = rj.rows[r];
    merge_parts(o + r * j.Hkv * G * Dv, j.out, j.top, j.sum, j.Hkv, j.parts, G, Dv);
  }
}

}  // namespace

void DecodeHeads::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) encoder.set_input_array(a);
  for (auto& o : outputs) {
    o.set_data(mx::allocator::malloc(o.nbytes()));
    encoder.set_output_array(o);
  }
  const int64_t H = settings_[0], Hkv = settings_[1], D = settings_[3];
  const bool has_v = settings_[2] != 0.0f, q_weighted = settings_[4] != 0.0f, k_weighted = settings_[5] != 0.0f;
  const bool v_norm = settings_[8] != 0.0f;
  const float shift = settings_[6], eps = settings_[7];
  encoder.dispatch([inputs, kn = vector_kernels(isa_), B = static_cast<int64_t>(inputs[0].shape(0)), H, Hkv, D, has_v,
                    v_norm, shift, eps, q_weighted, k_weighted, q = outputs[0].data<float>(),
                    k = Hkv > 0 ? outputs[1].data<float>() : nullptr, v = Hkv > 0 ? outputs[2].data<float>() : nullptr]() {
    std::vector<float> xc, cc, sc, qc, kc, q_shifted, k_shifted, scratch(D);
    const float* x = dense(inputs[0], xc);
    const float* cos = dense(inputs[1], cc);
    const float* sin = dense(inputs[2], sc);
    const float* wq = q_weighted ? shifted(dense(inputs[3], qc), D, shift, q_shifted) : nullptr;
    const float* wk = k_weighted ? shifted(dense(inputs[q_weighted ? 4 : 3], kc), D, shift, k_shifted) : nullptr;
    float* row = scratch.data();
    const int64_t width = (H + Hkv * (has_v ? 2 : 1)) * D;
    for (int64_t b = 0; b < B; ++b) {
      const float* xb = x + b * width;
      for (int64_t h = 0; h < H; ++h) norm_rotate(kn, xb + h * D, wq, D, eps, cos, sin, row, q + (b * H + h) * D);
      for (int64_t h = 0; h < Hkv; ++h) {
        const float* raw_k = xb + (H + h) * D;
        norm_rotate(kn, raw_k, wk, D, eps, cos, sin, row, k + (b * Hkv + h) * D);
        const float* raw_v = has_v ? xb + (H + Hkv + h) * D : raw_k;
        float* vo = v + (b * Hkv + h) * D;
        if (v_norm)
          kn.rms_norm_rows(raw_v, nullptr, D, eps, 0, 1, vo);
        else
          for (int64_t d = 0; d < D; ++d) vo[d] = raw_v[d];
      }
    }
  });
}

void DecodeHeads::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("DecodeHeads runs on MLX's CPU device only");
}

std::vector<mx::Shape> DecodeHeads::output_shapes(const std::vector<mx::array>& inputs) {
  const int B = inputs[0].shape(0), H = settings_[0], Hkv = settings_[1], D = settings_[3];
  std::vector<mx::Shape> shapes{{B, H, 1, D}};
  if (Hkv > 0) shapes.insert(shapes.end(), 2, mx::Shape{B, Hkv, 1, D});
  return shapes;
}

bool DecodeHeads::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const DecodeHeads&>(other);
  return isa_ == o.isa_ && settings_ == o.settings_;
}

void DecodeAttention::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& encoder = output_encoder(stream(), inputs, out);
  encoder.dispatch([inputs, o = out.data<float>(), isa = isa_, scale = settings_[0],
                    size = static_cast<int64_t>(settings_[1]), masked = settings_[2] != 0.0f]() {
    const auto &q = inputs[0], &k = inputs[1], &v = inputs[2];
    AttentionJob j{};
    std::vector<float> kc, vc;
    j.k = rows_of(k, j.k_stride, kc);
    j.v = rows_of(v, j.v_stride, vc);
    j.kn = vector_kernels(isa);
    std::vector<float> qc;
    j.q = dense(q, qc);
    j.B = q.shape(0), j.Hkv = k.shape(1), j.G = q.shape(1) / k.shape(1), j.D = q.shape(3), j.Dv = v.shape(3);
    attend_in_parts(j, attention_chunk, inputs[3], masked ? &inputs[4] : nullptr, k.shape(2), size, scale, o);
  });
}

std::vector<mx::Shape> DecodeAttention::output_shapes(const std::vector<mx::array>& inputs) {
  return {{inputs[0].shape(0), inputs[0].shape(1), 1, inputs[2].shape(3)}};
}


void DecodeAttentionQuantized::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& encoder = output_encoder(stream(), inputs, out);
  encoder.dispatch([inputs, o = out.data<float>(), isa = isa_, scale = settings_[0],
                    size = static_cast<int64_t>(settings_[1]), masked = settings_[2] != 0.0f, bits = static_cast<int>(settings_[3]),
                    group = static_cast<int64_t>(settings_[4])]() {
    const auto& q = inputs[0];
    QuantizedJob j{};
    std::vector<float> qc, ksc, kbc, vsc, vbc;
    std::vector<uint32_t> kpc, vpc;
    j.q = dense(q, qc);
    j.kp = rows_of(inputs[1], j.kp_stride, kpc);
    j.ks = rows_of(inputs[2], j.ks_stride, ksc);
    j.kb = rows_of(inputs[3], j.kb_stride, kbc);
    j.vp = rows_of(inputs[4], j.vp_stride, vpc);
    j.vs = rows_of(inputs[5], j.vs_stride, vsc);
    j.vb = rows_of(inputs[6], j.vb_stride, vbc);
    j.B = q.shape(0), j.Hkv = inputs[1].shape(1), j.G = q.shape(1) / j.Hkv, j.D = q.shape(3);
    j.group = group, j.Dv = inputs[5].shape(3) * group;
    j.kn = vector_kernels(isa), j.bits = bits;
    attend_in_parts(j, quantized_chunk, inputs[7], masked ? &inputs[8] : nullptr, inputs[1].shape(2), size,
                    scale, o);
  });
}

std::vector<mx::Shape> DecodeAttentionQuantized::output_shapes(const std::vector<mx::array>& inputs) {
  return {{inputs[0].shape(0), inputs[0].shape(1), 1, inputs[5].shape(3) * static_cast<int>(settings_[4])}};
}

void DecodeAttentionRows::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& encoder = output_encoder(stream(), inputs, out);
  encoder.dispatch([inputs, o = out.data<float>(), isa = isa_, scale = scale_, bits = bits_,
                    group = static_cast<int64_t>(group_), starts = starts_, sizes = sizes_]() {
    const auto& q = inputs[0];
    const int64_t B = q.shape(0), Hq = q.shape(1), D = q.shape(3);
    std::vector<float> qc;
    const float* qd = dense(q, qc);
    std::vector<std::vector<float>> fc(inputs.size());  // copies of planes not row-contiguous
    std::vector<std::vector<uint32_t>> wc(inputs.size());
    if (!bits) {
      RowsJob<AttentionJob> rj{std::vector<AttentionJob>(B), {}, attention_chunk};
      for (int64_t r = 0; r < B; ++r) {
        const auto &k = inputs[1 + 2 * r], &v = inputs[2 + 2 * r];
        AttentionJob& j = rj.rows[r];
        j.kn = vector_kernels(isa);
        j.q = qd + r * Hq * D;
        j.k = rows_of(k, j.k_stride, fc[1 + 2 * r]);
        j.v = rows_of(v, j.v_stride, fc[2 + 2 * r]);
        j.Hkv = k.shape(1), j.G = Hq / j.Hkv, j.D = D, j.Dv = v.shape(3);
      }
      attend_rows(rj, starts, sizes, scale, o);
      return;
    }
    RowsJob<QuantizedJob> rj{std::vector<QuantizedJob>(B), {}, quantized_chunk};
    for (int64_t r = 0; r < B; ++r) {
      const int64_t at = 1 + 6 * r;
      QuantizedJob& j = rj.rows[r];
      j.q = qd + r * Hq * D;
      j.kp = rows_of(inputs[at], j.kp_stride, wc[at]);
      j.ks = rows_of(inputs[at + 1], j.ks_stride, fc[at + 1]);
      j.kb = rows_of(inputs[at + 2], j.kb_stride, fc[at + 2]);
      j.vp = rows_of(inputs[at + 3], j.vp_stride, wc[at + 3]);
      j.vs = rows_of(inputs[at + 4], j.vs_stride, fc[at + 4]);
      j.vb = rows_of(inputs[at + 5], j.vb_stride, fc[at + 5]);
      j.Hkv = inputs[at].shape(1), j.G = Hq / j.Hkv, j.D = D, j.group = group, j.Dv = inputs[at + 4].shape(3) * group;
      j.kn = vector_kernels(isa), j.bits = bits;
    }
    attend_rows(rj, starts, sizes, scale, o);
  });
}

void DecodeAttentionRows::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("DecodeAttentionRows runs on MLX's CPU device only");
}

std::vector<mx::Shape> DecodeAttentionRows::output_shapes(const std::vector<mx::array>& inputs) {
  const auto& last = inputs.back();  // the last row's values (float) or value biases (quantized)
  return {{inputs[0].shape(0), inputs[0].shape(1), 1, bits_ ? last.shape(3) * group_ : last.shape(3)}};
}

bool DecodeAttentionRows::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const DecodeAttentionRows&>(other);
  return isa_ == o.isa_ && scale_ == o.scale_ && bits_ == o.bits_ && group_ == o.group_ && starts_ == o.starts_ &&
         sizes_ == o.sizes_;
}

}  // namespace zoo
