// The primitives' CPU evaluation, the instruction-set choice and the row-splitting thread pool.
#include "packed.h"

#include <sched.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/common/utils.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/version.h"

namespace zoo {

// ------------------------------------------------------------------------------------ instruction sets
Isa best_isa() {
#if defined(__x86_64__) && defined(ZOO_X86_KERNELS)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return Isa::avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) return Isa::avx2;
#endif
  return Isa::portable;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    default: return "portable";
  }
}

int isa_lanes(Isa isa) {
  switch (isa) {
    case Isa::avx512: return 16;
    case Isa::avx2: return 8;
    default: return 1;
  }
}

std::vector<std::string> available_isas() {
  std::vector<std::string> out;
  for (int i = static_cast<int>(best_isa()); i >= 0; --i) out.push_back(isa_name(static_cast<Isa>(i)));
  return out;
}

Isa parse_isa(const std::string& name) {
  if (name.empty()) return best_isa();
  for (int i = static_cast<int>(best_isa()); i >= 0; --i)
    if (name == isa_name(static_cast<Isa>(i))) return static_cast<Isa>(i);
  std::ostringstream msg;
  msg << "isa='" << name << "' is not available here; this CPU and build run:";
  for (auto& n : available_isas()) msg << " " << n;
  throw std::invalid_argument(msg.str());
}

struct IsaKernels {
  RowsFn rows;
  DequantFn dequantize;
};

static IsaKernels kernels_for(Isa isa) {
#if defined(__x86_64__) && defined(ZOO_X86_KERNELS)
  if (isa == Isa::avx512) return {avx512::rows, avx512::dequantize};
  if (isa == Isa::avx2) return {avx2::rows, avx2::dequantize};
#endif
  return {portable::rows, portable::dequantize};
}

// ------------------------------------------------------------------------------------ thread pool
// A job is a number of chunks (row ranges) that the calling thread and the workers take one at a
// time from a shared counter. The caller never waits for a worker that has not started: on a
// shared machine a worker may not get a core for a whole time slice, and then the caller simply
// takes every chunk itself. Workers spin 20 us after a job (back-to-back products, such as a
// layer's query, key and value projections, then find them awake), then sleep on the generation
// counter: spinning longer took a core from MKL's and MLX's own threads between the products
// (270M 8-bit decode 29 tok/s with 200 us against 35-40 with 0-20 us, interleaved in one
// process). A call that finds the pool in use (another MLX stream in the middle of a product)
// runs its chunks alone.
struct Job {
  void (*fn)(void*, int);
  void* ctx;
  int chunks;
  std::atomic<int> next{0};
  std::atomic<int> done{0};

  void take() {
    int c;
    while ((c = next.fetch_add(1, std::memory_order_relaxed)) < chunks) {
      fn(ctx, c);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

class Pool {
 public:
  static Pool& get() {
    static Pool* pool = new Pool(cpus());  // never destroyed: workers may still sleep at exit
    return *pool;
  }

  int size() const { return active_.load(std::memory_order_relaxed); }
  void set_size(int n) { active_.store(n < 1 ? 1 : (n > total_ ? total_ : n), std::memory_order_relaxed); }

  void run(int chunks, void (*fn)(void*, int), void* ctx) {
    Job job;
    job.fn = fn;
    job.ctx = ctx;
    job.chunks = chunks;
    std::unique_lock<std::mutex> lock(mutex_, std::try_to_lock);
    if (chunks <= 1 || size() == 1 || !lock.owns_lock()) {
      job.take();
      return;
    }
    job_.store(&job, std::memory_order_seq_cst);
    generation_.fetch_add(1, std::memory_order_seq_cst);
    generation_.notify_all();
    job.take();
    while (job.done.load(std::memory_order_acquire) < chunks) pause();  // chunks a worker is still on
    // Close the job: a worker either registered before this (and is waited for) or sees no job.
    job_.store(nullptr, std::memory_order_seq_cst);
    while (inside_.load(std::memory_order_seq_cst) != 0) pause();
  }

 private:
  explicit Pool(int n) : total_(n), active_(n) {
    for (int id = 1; id < n; ++id) std::thread([this, id] { work(id); }).detach();
  }

  static int cpus() {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set) > 0 ? CPU_COUNT(&set) : 1;
    unsigned n = std::thread::hardware_concurrency();
    return n > 0 ? static_cast<int>(n) : 1;
  }

  static void pause() {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }

  void work(int id) {
    uint64_t seen = generation_.load(std::memory_order_acquire);
    for (;;) {
      const auto start = std::chrono::steady_clock::now();
      uint64_t now;
      int spins = 0;
      while ((now = generation_.load(std::memory_order_acquire)) == seen) {
        if (++spins % 64 == 0 && std::chrono::steady_clock::now() - start > kSpin) {
          generation_.wait(seen, std::memory_order_acquire);
          spins = 0;
        } else {
          pause();
        }
      }
      seen = now;
      if (id >= size()) continue;
      inside_.fetch_add(1, std::memory_order_seq_cst);
      if (Job* job = job_.load(std::memory_order_seq_cst)) job->take();
      inside_.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  static constexpr std::chrono::microseconds kSpin{20};
  const int total_;
  std::atomic<int> active_;
  std::mutex mutex_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<Job*> job_{nullptr};
  std::atomic<int> inside_{0};
};

int threads() { return Pool::get().size(); }
void set_threads(int n) { Pool::get().set_size(n); }
void parallel_chunks(int chunks, void (*fn)(void*, int), void* ctx) { Pool::get().run(chunks, fn, ctx); }

// Rows are split into chunks of whole 16-row blocks, about kChunksPerThread per thread; products
// under kSplitBytes of weights (the 270M's key and value projections) stay on the calling thread.
constexpr int64_t kSplitBytes = 1 << 18;
constexpr int64_t kChunksPerThread = 4;

static int chunks_for(const PackedWeights& p, int64_t rows_of_x) {
  const int64_t work = p.N * p.row_bytes() * (rows_of_x < 1 ? 1 : rows_of_x);
  const int64_t threads = Pool::get().size();
  if (work < kSplitBytes || threads == 1) return 1;
  const int64_t blocks = (p.N + 15) / 16;
  const int64_t n = threads * kChunksPerThread;
  return static_cast<int>(blocks < n ? blocks : n);
}

static void chunk_bounds(int64_t N, int chunks, int chunk, int64_t& n0, int64_t& n1) {
  const int64_t blocks = (N + 15) / 16;
  n0 = (blocks * chunk / chunks) * 16;
  n1 = (blocks * (chunk + 1) / chunks) * 16;
  if (n1 > N) n1 = N;
}

// A product or a dequantization over rows [n0, n1) of the weight, run chunk by chunk.
struct MatmulJob {
  Prepared a;
  PackedWeights p;
  RowsFn fn;
  float* y;
  int chunks;
  void run(int64_t n0, int64_t n1) const { fn(a, p, n0, n1, y); }
};

struct DequantJob {
  PackedWeights p;
  DequantFn fn;
  float* out;
  int chunks;
  void run(int64_t n0, int64_t n1) const { fn(p, n0, n1, out); }
};

template <class J>
static void run_chunk(void* ctx, int chunk) {
  const auto* job = static_cast<const J*>(ctx);
  int64_t n0, n1;
  chunk_bounds(job->p.N, job->chunks, chunk, n0, n1);
  if (n0 < n1) job->run(n0, n1);
}

// The activations in the kernels' order (see Prepared), zero-padded, and their group sums.
static Prepared prepare_x(const float* x, int64_t M, const PackedWeights& p, int lanes, std::vector<float>& xp,
                          std::vector<float>& sums) {
  const int64_t K = p.K, G = p.groups(), P = 32 / p.bits, block = lanes * P;
  const int64_t ks = (K + block - 1) / block * block, gs = (G + lanes - 1) / lanes * lanes;
  sums.assign(M * gs, 0.0f);
  xp.assign(M * ks, 0.0f);
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * K;
    for (int64_t g = 0; g < G; ++g) {
      float s = 0.0f;
      for (int64_t k = g * p.group; k < (g + 1) * p.group; ++k) s += xm[k];
      sums[m * gs + g] = s;
    }
    float* out = xp.data() + m * ks;
    for (int64_t b = 0; b < K; b += block)
      for (int64_t i = 0; i < lanes && b + i * P < K; ++i)
        for (int64_t j = 0; j < P; ++j) out[b + j * lanes + i] = xm[b + i * P + j];
  }
  return Prepared{xp.data(), sums.data(), M, ks, gs};
}

static void run_matmul(const float* x, int64_t M, const PackedWeights& p, Isa isa, float* y) {
  std::vector<float> xp, sums;
  MatmulJob job{prepare_x(x, M, p, isa_lanes(isa), xp, sums), p, kernels_for(isa).rows, y, chunks_for(p, M)};
  Pool::get().run(job.chunks, run_chunk<MatmulJob>, &job);
}

// ------------------------------------------------------------------------------------ the ops
static void check_packed(const char* op, const mx::array& w, const mx::array& scales, const mx::array& biases,
                         int group_size, int bits, int64_t& N, int64_t& K) {
  std::ostringstream msg;
  msg << op << ": ";
  if (bits != 4 && bits != 8) {
    msg << "bits=" << bits << " is not supported (4 or 8)";
    throw std::invalid_argument(msg.str());
  }
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    msg << "group_size=" << group_size << " is not supported (32, 64 or 128)";
    throw std::invalid_argument(msg.str());
  }
  if (w.dtype() != mx::uint32 || w.ndim() != 2) {
    msg << "the packed weight must be a 2-D uint32 array, got " << w.ndim() << "-D " << w.dtype();
    throw std::invalid_argument(msg.str());
  }
  N = w.shape(0);
  K = static_cast<int64_t>(w.shape(1)) * 32 / bits;
  const mx::Shape expected{static_cast<int>(N), static_cast<int>(K / group_size)};
  if (K % group_size != 0 || scales.shape() != expected || biases.shape() != expected) {
    msg << "a weight of " << N << " rows of " << K << " " << bits << "-bit values in groups of " << group_size
        << " needs scales and biases of shape [" << N << ", " << K / group_size << "], got [";
    for (auto d : scales.shape()) msg << d << ",";
    msg << "] and [";
    for (auto d : biases.shape()) msg << d << ",";
    msg << "]";
    throw std::invalid_argument(msg.str());
  }
}

static mx::Stream cpu_stream(const char* op, mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) {
    throw std::invalid_argument(std::string(op) + " runs on MLX's CPU device only; this stream is on another device");
  }
  return stream;
}

// A weight, scale or bias array as the kernels read it: row-contiguous, in ``dtype``. Parameters
// already evaluated in that layout are taken as they are: a decode step makes ~130 products, and
// each extra graph node costs time on every step.
static mx::array as_read(const mx::array& a, mx::Dtype dtype, mx::Stream stream) {
  auto b = mx::astype(a, dtype, stream);
  if (b.is_available() && b.flags().row_contiguous) return b;
  return mx::contiguous(b, false, stream);
}

// Scales and biases are read in their own dtype when it is float32, bfloat16 or float16 (both the
// same), else as float32.
static mx::Dtype scale_dtype(const mx::array& scales, const mx::array& biases) {
  const auto d = scales.dtype();
  const bool read_as_is = d == mx::float32 || d == mx::bfloat16 || d == mx::float16;
  return read_as_is && biases.dtype() == d ? d : mx::float32;
}

mx::array packed_matmul(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                        int group_size, int bits, const std::string& isa, mx::StreamOrDevice s) {
  int64_t N, K;
  check_packed("packed_matmul", w, scales, biases, group_size, bits, N, K);
  if (x.ndim() < 1 || x.shape(-1) != K) {
    std::ostringstream msg;
    msg << "packed_matmul: x's last axis must be the weight's input size " << K << ", got shape [";
    for (auto d : x.shape()) msg << d << ",";
    msg << "]";
    throw std::invalid_argument(msg.str());
  }
  auto stream = cpu_stream("packed_matmul", s);
  auto out_shape = x.shape();
  out_shape.back() = static_cast<int>(N);
  // x keeps its shape and strides: eval_cpu reads any layout (and copies only a strided one).
  return mx::array(std::move(out_shape), mx::float32,
                   std::make_shared<PackedMatmul>(stream, group_size, bits, parse_isa(isa)),
                   {mx::astype(x, mx::float32, stream), as_read(w, mx::uint32, stream),
                    as_read(scales, scale_dtype(scales, biases), stream),
                    as_read(biases, scale_dtype(scales, biases), stream)});
}

mx::array packed_dequantize(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size,
                            int bits, const std::string& isa, mx::StreamOrDevice s) {
  int64_t N, K;
  check_packed("packed_dequantize", w, scales, biases, group_size, bits, N, K);
  auto stream = cpu_stream("packed_dequantize", s);
  return mx::array({static_cast<int>(N), static_cast<int>(K)}, mx::float32,
                   std::make_shared<PackedDequantize>(stream, group_size, bits, parse_isa(isa)),
                   {as_read(w, mx::uint32, stream), as_read(scales, scale_dtype(scales, biases), stream),
                    as_read(biases, scale_dtype(scales, biases), stream)});
}

static PackedWeights weights_of(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size,
                                int bits) {
  const auto type = scales.dtype() == mx::bfloat16 ? ScaleType::bf16
                    : scales.dtype() == mx::float16 ? ScaleType::f16
                                                     : ScaleType::f32;
  return PackedWeights{reinterpret_cast<const uint8_t*>(w.data<uint32_t>()), scales.data<void>(), biases.data<void>(),
                       w.shape(0), static_cast<int64_t>(w.shape(1)) * 32 / bits, group_size, bits, type};
}

void PackedMatmul::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& x = inputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  const auto p = weights_of(inputs[1], inputs[2], inputs[3], group_size_, bits_);
  const int64_t M = p.K > 0 ? static_cast<int64_t>(x.size()) / p.K : 0;
  const bool strided = !x.flags().row_contiguous;
  encoder.dispatch([x = x.data<float>(), M, p, isa = isa_, y = out.data<float>(), strided,
                    shape = strided ? x.shape() : mx::Shape{}, strides = strided ? x.strides() : mx::Strides{}]() {
    if (M == 0 || p.N == 0) return;
    if (!strided) {
      run_matmul(x, M, p, isa, y);
      return;
    }
    std::vector<float> dense(M * p.K);
    copy_row_major(x, shape, strides, dense.data());
    run_matmul(dense.data(), M, p, isa, y);
  });
}

void PackedDequantize::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  encoder.dispatch([p = weights_of(inputs[0], inputs[1], inputs[2], group_size_, bits_), isa = isa_,
                    o = out.data<float>()]() {
    if (p.N == 0) return;
    DequantJob job{p, kernels_for(isa).dequantize, o, chunks_for(p, 1)};
    Pool::get().run(job.chunks, run_chunk<DequantJob>, &job);
  });
}

void PackedPrimitive::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error(std::string(name()) + " runs on MLX's CPU device only");
}

std::vector<mx::Shape> PackedMatmul::output_shapes(const std::vector<mx::array>& inputs) {
  auto shape = inputs[0].shape();
  shape.back() = inputs[1].shape(0);
  return {shape};
}

std::vector<mx::Shape> PackedDequantize::output_shapes(const std::vector<mx::array>& inputs) {
  return {{inputs[0].shape(0), inputs[0].shape(1) * 32 / bits_}};
}

bool PackedPrimitive::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const PackedPrimitive&>(other);
  return std::string(name()) == o.name() && group_size_ == o.group_size_ && bits_ == o.bits_ && isa_ == o.isa_;
}

std::string built_for_mlx() {
  std::ostringstream v;
  v << MLX_VERSION_MAJOR << "." << MLX_VERSION_MINOR << "." << MLX_VERSION_PATCH;
  return v.str();
}

}  // namespace zoo
