// The sampler's primitives' argument checks and CPU evaluation (see sampling.h).
#include "sampling.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "packed.h"

namespace zoo {

// ------------------------------------------------------------------------------------ the ops
namespace {

// x's shape without its last axis (then with `last` appended when last > 0).
mx::Shape rows_shape(const mx::array& x, int last = 0) {
  mx::Shape shape(x.shape().begin(), x.shape().end() - 1);
  if (last > 0) shape.push_back(last);
  return shape;
}

std::string text_of(const mx::Shape& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

void check_rows(const char* op, const mx::array& x) {
  check_float32(op, {{"x", &x}});
  if (x.ndim() < 1 || x.shape(-1) < 1) fail(op, "x must have a last axis of at least one value, got " + shape_of(x));
}

}  // namespace

std::vector<mx::array> top_k(const mx::array& x, int k, mx::StreamOrDevice s) {
  const char* op = "top_k";
  auto stream = cpu_only(op, s);
  check_rows(op, x);
  if (k < 1 || k > x.shape(-1))
    fail(op, "k must be in [1, " + std::to_string(x.shape(-1)) + "] (x's last axis), got " + std::to_string(k));
  const auto shape = rows_shape(x, k);
  return mx::array::make_arrays({shape, shape}, {mx::float32, mx::uint32}, std::make_shared<TopK>(stream, k), {x});
}

mx::array log_softmax(const mx::array& x, const std::string& isa, mx::StreamOrDevice s) {
  const char* op = "log_softmax";
  auto stream = cpu_only(op, s);
  check_rows(op, x);
  return mx::array(x.shape(), mx::float32, std::make_shared<LogSoftmax>(stream, parse_isa(isa)), {x});
}

mx::array keep_floor(const mx::array& x, float top_p, float min_p, const std::string& isa, mx::StreamOrDevice s) {
  const char* op = "keep_floor";
  auto stream = cpu_only(op, s);
  check_rows(op, x);
  if (!(top_p >= 0.0f && top_p <= 1.0f)) fail(op, "top_p must be in [0, 1] (0 or 1: off), got " + std::to_string(top_p));
  if (!(min_p >= 0.0f && min_p <= 1.0f)) fail(op, "min_p must be in [0, 1] (0: off), got " + std::to_string(min_p));
  return mx::array(rows_shape(x, 1), mx::float32, std::make_shared<KeepFloor>(stream, parse_isa(isa), std::vector{top_p, min_p}),
                   {x});
}

mx::array categorical(const mx::array& x, const mx::array& u, float scale, const std::optional<mx::array>& floor,
                      const std::string& isa, mx::StreamOrDevice s) {
  const char* op = "categorical";
  auto stream = cpu_only(op, s);
  check_rows(op, x);
  check_float32(op, {{"u", &u}});
  if (u.shape() != rows_shape(x))
    fail(op, "u must be " + text_of(rows_shape(x)) + " (one number a row of x " + shape_of(x) + "), got " +
                 shape_of(u));
  if (!(scale > 0.0f && std::isfinite(scale))) fail(op, "scale must be a finite number > 0, got " + std::to_string(scale));
  std::vector<mx::array> inputs{x, u};
  if (floor) {
    check_float32(op, {{"floor", &*floor}});
    if (floor->shape() != rows_shape(x, 1))
      fail(op, "floor must be " + text_of(rows_shape(x, 1)) + " (one value a row of x " + shape_of(x) +
                   "), got " + shape_of(*floor));
    inputs.push_back(*floor);
  }
  return mx::array(rows_shape(x), mx::uint32,
                   std::make_shared<Categorical>(stream, parse_isa(isa), std::vector{scale, floor ? 1.0f : 0.0f}),
                   std::move(inputs));
}

// ------------------------------------------------------------------------------------ evaluation
namespace {

// Values a float sum of weights takes (64 a lane at AVX-512) before the sums are added in double:
// a float sum over a whole 262,144-word row is off by a few parts in a million.
constexpr int64_t kSumBlock = 1024;

// A row's k best (value, index) pairs: a heap whose top is the worst kept, and the scan that fills
// it. Written here rather than taken from the standard library's partial sorts: the scan skips
// 16 values at a time by one compare each against the worst kept (nearly every logit of a
// vocabulary), which keeps the read at memory speed.
using Candidate = std::pair<float, uint32_t>;
inline bool better(const Candidate& a, const Candidate& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

struct TopKJob {
  const float* x;
  int64_t V, k, parts;
  std::vector<Candidate>* found;  // one list a chunk (row, part)
};

void top_k_chunk(void* ctx, int chunk) {
  const auto& j = *static_cast<const TopKJob*>(ctx);
  const int64_t row = chunk / j.parts, part = chunk % j.parts;
  const int64_t i0 = j.V * part / j.parts, i1 = j.V * (part + 1) / j.parts;
  const float* x = j.x + row * j.V;
  auto& heap = j.found[chunk];
  heap.clear();
  int64_t i = i0;
  for (; i < i1 && static_cast<int64_t>(heap.size()) < j.k; ++i) {
    const float v = x[i];
    heap.emplace_back(v == v ? v : -INFINITY, static_cast<uint32_t>(i));
    std::push_heap(heap.begin(), heap.end(), better);
  }
  float worst = heap.empty() ? INFINITY : heap.front().first;
  auto offer = [&](int64_t at) {
    if (!(x[at] > worst)) return;  // later indices lose ties; NaN never enters
    std::pop_heap(heap.begin(), heap.end(), better);
    heap.back() = {x[at], static_cast<uint32_t>(at)};
    std::push_heap(heap.begin(), heap.end(), better);
    worst = heap.front().first;
  };
  constexpr int64_t kBlock = 16;
  for (; i + kBlock <= i1; i += kBlock) {
    int above = 0;
    for (int64_t b = 0; b < kBlock; ++b) above |= x[i + b] > worst;
    if (above)
      for (int64_t b = 0; b < kBlock; ++b) offer(i + b);
  }
  for (; i < i1; ++i) offer(i);
}

// Parts of a row a pass over it splits into: one a thread once a part pays for the hand-off.
int64_t row_parts(int64_t V) { return V >= 8192 ? threads() : 1; }

// The k best candidates of each of `rows` rows of x [rows, V], from the best down, into best
// [rows * k], the parts of each row on the threads.
void best_candidates(const float* x, int64_t rows, int64_t V, int64_t k, std::vector<Candidate>& best) {
  const int64_t parts = row_parts(V);
  std::vector<std::vector<Candidate>> found(rows * parts);
  TopKJob job{x, V, k, parts, found.data()};
  parallel_chunks(static_cast<int>(rows * parts), top_k_chunk, &job);
  best.resize(rows * k);
  std::vector<Candidate> all;
  for (int64_t r = 0; r < rows; ++r) {
    all.clear();
    for (int64_t p = 0; p < parts; ++p) all.insert(all.end(), found[r * parts + p].begin(), found[r * parts + p].end());
    std::partial_sort(all.begin(), all.begin() + k, all.end(), better);
    std::copy(all.begin(), all.begin() + k, best.begin() + r * k);
  }
}

// Top-p's first candidates: a trained model's top-p 0.95 nucleus is mostly a few dozen words.
constexpr int64_t kNucleusFirst = 256;
// A wider nucleus is narrowed by halving a range of values until this many are left in it.
constexpr int64_t kNucleusGather = 4096;

// The mass of a row's values at or above a floor (and their count), on the threads.
struct MassJob {
  Kernels kn;
  const float* x;
  int64_t V, parts;
  float top, floor;
  std::vector<double> mass;
  std::vector<int64_t> count;
};

void mass_chunk(void* ctx, int part) {
  auto& j = *static_cast<MassJob*>(ctx);
  const int64_t i0 = j.V * part / j.parts, i1 = j.V * (part + 1) / j.parts;
  double mass = 0.0;
  int64_t count = 0;
  for (int64_t b = i0; b < i1; b += kSumBlock) {
    int64_t n = 0;
    mass += j.kn.exp_weights(j.x + b, std::min(kSumBlock, i1 - b), j.top, 1.0f, j.floor, nullptr, &n);
    count += n;
  }
  j.mass[part] = mass, j.count[part] = count;
}

// e^top times the mass of x's values at or above floor, and their count.
std::pair<double, int64_t> mass_at_or_above(MassJob& job, float floor) {
  job.floor = floor;
  parallel_chunks(static_cast<int>(job.parts), mass_chunk, &job);
  double mass = 0.0;
  int64_t count = 0;
  for (int64_t p = 0; p < job.parts; ++p) mass += job.mass[p], count += job.count[p];
  return {mass * std::exp(static_cast<double>(job.top)), count};
}

// The last of `sorted` (from the largest down) that top-p keeps, given the mass `above` of the
// row's values before them (-1 when the first is not kept), and the mass up to and including it:
// the words are kept while the mass before each stays below top_p.
std::pair<int64_t, double> last_kept(const float* sorted, int64_t n, double above, float top_p) {
  int64_t kept = 0;
  for (; kept < n && above < top_p; ++kept) above += std::exp(static_cast<double>(sorted[kept]));
  return {kept - 1, above};
}

// One row's keep_floor (see sampling.h). Top-p reads the row's kNucleusFirst most likely words;
// when their mass is below top_p, it narrows a range of values [lo, hi) with the mass at or above
// lo at least top_p and at or above hi below it (so the last word kept lies in it) until at most
// kNucleusGather values lie in it, and walks those from the largest down.
float row_floor(const Kernels& kn, const float* x, int64_t V, float top_p, float min_p, std::vector<Candidate>& best) {
  const bool nucleus = top_p > 0.0f && top_p < 1.0f;
  best_candidates(x, 1, V, nucleus ? std::min(V, kNucleusFirst) : 1, best);
  const float top = best[0].first;
  float floor = -INFINITY;
  if (nucleus) {
    std::vector<float> sorted(best.size());
    for (size_t c = 0; c < best.size(); ++c) sorted[c] = best[c].first;
    const auto [last, mass] = last_kept(sorted.data(), sorted.size(), 0.0, top_p);
    if (mass >= top_p || static_cast<int64_t>(best.size()) == V || top == -INFINITY) {  // the nucleus is in them
      floor = sorted[last];
    } else {
      const int64_t parts = row_parts(V);
      MassJob job{kn, x, V, parts, top, 0.0f, std::vector<double>(parts), std::vector<int64_t>(parts)};
      // Every value below lo0 together weighs at most V e^lo0 = (1 - top_p) / 2 of a normalised row.
      float lo = static_cast<float>(std::log((1.0 - top_p) / (2.0 * V))), hi = std::nextafter(top, INFINITY);
      auto [lo_mass, lo_count] = mass_at_or_above(job, lo);
      if (lo_mass < top_p || lo >= top) lo = -INFINITY, lo_count = V;  // not normalised: every value
      double hi_mass = 0.0;
      int64_t hi_count = 0;
      while (lo_count - hi_count > kNucleusGather && lo > -INFINITY) {
        const float mid = lo + (hi - lo) / 2;
        if (!(mid > lo && mid < hi)) break;  // one float apart: the values left are equal
        const auto [mass, count] = mass_at_or_above(job, mid);
        if (mass >= top_p)
          lo = mid, lo_count = count;
        else
          hi = mid, hi_mass = mass, hi_count = count;
      }
      sorted.clear();
      for (int64_t i = 0; i < V; ++i)
        if (x[i] >= lo && x[i] < hi) sorted.push_back(x[i]);
      std::sort(sorted.begin(), sorted.end(), std::greater<float>());
      const int64_t last_gathered = last_kept(sorted.data(), sorted.size(), hi_mass, top_p).first;
      floor = last_gathered >= 0 ? sorted[last_gathered] : hi;
    }
  }
  if (min_p > 0.0f) floor = std::max(floor, top + static_cast<float>(std::log(static_cast<double>(min_p))));
  return floor;
}

// Each row's largest value (NaN ignored) of x [rows, V], its parts on the threads.
struct MaxJob {
  Kernels kn;
  const float* x;
  int64_t V, parts;
  std::vector<float> tops;  // [rows, parts]
};

void max_chunk(void* ctx, int chunk) {
  auto& j = *static_cast<MaxJob*>(ctx);
  const int64_t row = chunk / j.parts, part = chunk % j.parts;
  const int64_t i0 = j.V * part / j.parts, i1 = j.V * (part + 1) / j.parts;
  j.tops[chunk] = i1 > i0 ? j.kn.row_max(j.x + row * j.V + i0, i1 - i0) : -INFINITY;
}

std::vector<float> row_maxima(const Kernels& kn, const float* x, int64_t rows, int64_t V) {
  const int64_t parts = row_parts(V);
  MaxJob job{kn, x, V, parts, std::vector<float>(rows * parts)};
  parallel_chunks(static_cast<int>(rows * parts), max_chunk, &job);
  std::vector<float> tops(rows);
  for (int64_t r = 0; r < rows; ++r)
    tops[r] = *std::max_element(job.tops.begin() + r * parts, job.tops.begin() + (r + 1) * parts);
  return tops;
}

// A log-softmax's passes over parts of its rows after the maxima: sums of e^(x - max), x - shift.
struct SoftmaxJob {
  Kernels kn;
  const float* x;
  float* out;
  int64_t V, parts;
  bool subtract;               // the second pass
  std::vector<float> shifts;   // [rows]: max, then max + log(sum)
  std::vector<double> sums;    // [rows, parts]
};

void softmax_chunk(void* ctx, int chunk) {
  auto& j = *static_cast<SoftmaxJob*>(ctx);
  const int64_t row = chunk / j.parts, part = chunk % j.parts;
  const int64_t i0 = j.V * part / j.parts, i1 = j.V * (part + 1) / j.parts;
  const float* x = j.x + row * j.V;
  if (!j.subtract) {  // float sums of short blocks, added in double
    double sum = 0.0;
    for (int64_t b = i0; b < i1; b += kSumBlock)
      sum += j.kn.exp_weights(x + b, std::min(kSumBlock, i1 - b), j.shifts[row], 1.0f, -INFINITY, nullptr, nullptr);
    j.sums[chunk] = sum;
  } else {
    float* o = j.out + row * j.V;
    const float shift = j.shifts[row];
    for (int64_t i = i0; i < i1; ++i) o[i] = x[i] - shift;
  }
}

// Categorical's blocks: sums of weights on the threads, then one block's weights in turn.
constexpr int64_t kDrawBlock = 4096;

struct DrawJob {
  Kernels kn;
  const float* x;
  int64_t V, blocks, parts;  // blocks a row, parts a row
  float scale;
  const float* top;    // [rows]
  const float* floor;  // [rows]
  float* sums;         // [rows, blocks]
};

void draw_chunk(void* ctx, int chunk) {
  const auto& j = *static_cast<const DrawJob*>(ctx);
  const int64_t row = chunk / j.parts, part = chunk % j.parts;
  const int64_t b0 = j.blocks * part / j.parts, b1 = j.blocks * (part + 1) / j.parts;
  const float* x = j.x + row * j.V;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n = std::min(kDrawBlock, j.V - b * kDrawBlock);
    j.sums[row * j.blocks + b] =
        j.kn.exp_weights(x + b * kDrawBlock, n, j.top[row], j.scale, j.floor[row], nullptr, nullptr);
  }
}

}  // namespace

void TopK::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(inputs[0]);
  for (auto& o : outputs) {
    o.set_data(mx::allocator::malloc(o.nbytes()));
    encoder.set_output_array(o);
  }
  encoder.dispatch([x = inputs[0], k = static_cast<int64_t>(k_), values = outputs[0].data<float>(),
                    ids = outputs[1].data<uint32_t>()]() {
    std::vector<float> xc;
    const int64_t V = x.shape(-1), rows = static_cast<int64_t>(x.size()) / V;
    std::vector<Candidate> best;
    best_candidates(dense(x, xc), rows, V, k, best);
    for (int64_t c = 0; c < rows * k; ++c) {
      values[c] = best[c].first;
      ids[c] = best[c].second;
    }
  });
}

void TopK::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("TopK runs on MLX's CPU device only");
}

std::vector<mx::Shape> TopK::output_shapes(const std::vector<mx::array>& inputs) {
  const auto shape = rows_shape(inputs[0], k_);
  return {shape, shape};
}

bool TopK::is_equivalent(const mx::Primitive& other) const { return k_ == static_cast<const TopK&>(other).k_; }

void LogSoftmax::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& encoder = output_encoder(stream(), inputs, out);
  encoder.dispatch([x = inputs[0], isa = isa_, o = out.data<float>()]() {
    std::vector<float> xc;
    const int64_t V = x.shape(-1), rows = static_cast<int64_t>(x.size()) / V;
    const int64_t parts = row_parts(V);
    const Kernels kn = vector_kernels(isa);
    const float* data = dense(x, xc);
    SoftmaxJob job{kn, data, o, V, parts, false, row_maxima(kn, data, rows, V), std::vector<double>(rows * parts)};
    const int chunks = static_cast<int>(rows * parts);
    parallel_chunks(chunks, softmax_chunk, &job);
    for (int64_t r = 0; r < rows; ++r) {
      double sum = 0.0;
      for (int64_t p = 0; p < parts; ++p) sum += job.sums[r * parts + p];
      job.shifts[r] = static_cast<float>(job.shifts[r] + std::log(sum));
    }
    job.subtract = true;
    parallel_chunks(chunks, softmax_chunk, &job);
  });
}

void KeepFloor::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& encoder = output_encoder(stream(), inputs, out);
  encoder.dispatch([x = inputs[0], isa = isa_, top_p = settings_[0], min_p = settings_[1], floors = out.data<float>()]() {
    std::vector<float> xc;
    const float* data = dense(x, xc);
    const int64_t V = x.shape(-1), rows = static_cast<int64_t>(x.size()) / V;
    const Kernels kn = vector_kernels(isa);
    std::vector<Candidate> best;
    for (int64_t r = 0; r < rows; ++r) floors[r] = row_floor(kn, data + r * V, V, top_p, min_p, best);
  });
}

std::vector<mx::Shape> KeepFloor::output_shapes(const std::vector<mx::array>& inputs) { return {rows_shape(inputs[0], 1)}; }

void Categorical::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& encoder = output_encoder(stream(), inputs, out);
  encoder.dispatch([inputs, isa = isa_, scale = settings_[0], ids = out.data<uint32_t>()]() {
    std::vector<float> xc, uc, fc;
    const mx::array& x = inputs[0];
    const int64_t V = x.shape(-1), rows = static_cast<int64_t>(x.size()) / V;
    const float* data = dense(x, xc);
    const float* u = dense(inputs[1], uc);
    std::vector<float> floors(rows, -INFINITY);
    if (inputs.size() > 2) std::copy_n(dense(inputs[2], fc), rows, floors.begin());
    const int64_t blocks = (V + kDrawBlock - 1) / kDrawBlock;
    const int64_t parts = std::min<int64_t>(blocks, threads());
    const Kernels kn = vector_kernels(isa);
    const std::vector<float> tops = row_maxima(kn, data, rows, V);
    std::vector<float> sums(rows * blocks);
    DrawJob job{kn, data, V, blocks, parts, scale, tops.data(), floors.data(), sums.data()};
    parallel_chunks(static_cast<int>(rows * parts), draw_chunk, &job);
    std::vector<float> weights(kDrawBlock);
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = data + r * V;
      const float* sum = sums.data() + r * blocks;
      double total = 0.0;
      for (int64_t b = 0; b < blocks; ++b) total += sum[b];
      if (!(total > 0.0)) {  // nothing weighs: the first of the largest values (index 0 when none)
        const float* first = std::find(row, row + V, tops[r]);
        ids[r] = first == row + V ? 0 : static_cast<uint32_t>(first - row);
        continue;
      }
      // The block the target falls in (the last one that weighs, should rounding pass them all),
      // then the word in it: the running sums in double, each weight as its block sum took it.
      const double target = std::clamp(static_cast<double>(u[r]), 0.0, 1.0) * total;
      double before = 0.0, block_start = 0.0;
      int64_t block = -1;
      for (int64_t b = 0; b < blocks; ++b) {
        if (sum[b] <= 0.0f) continue;
        block = b, block_start = before;
        if (before + sum[b] > target) break;
        before += sum[b];
      }
      before = block_start;
      const int64_t start = block * kDrawBlock, n = std::min(kDrawBlock, V - start);
      job.kn.exp_weights(row + start, n, tops[r], scale, floors[r], weights.data(), nullptr);
      int64_t pick = -1;
      for (int64_t i = 0; i < n; ++i) {
        if (weights[i] <= 0.0f) continue;
        pick = i;
        before += weights[i];
        if (before > target) break;
      }
      ids[r] = static_cast<uint32_t>(start + pick);
    }
  });
}

std::vector<mx::Shape> Categorical::output_shapes(const std::vector<mx::array>& inputs) { return {rows_shape(inputs[0])}; }

}  // namespace zoo
