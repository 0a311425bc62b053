// A grouped matrix product for XLA:CPU that reads the weights where they lie: one layer of a layer stack,
// one expert of that layer, never copied out first (XLA:CPU copies a dynamic slice before its products
// read it). The serving step's products on a CPU: the layers' Linear weights (one group of all rows) and
// the routed experts (rows sorted by expert, one group each). jaxdp/native/__init__.py builds it.
//
//   x [M, K] f32 | bf16, w [L, E, K, N] f32 | bf16, layer int32 [], sizes int32 [E]  ->  y [M, N] f32
//   (w [L, K, N]: E = 1)
//
// The first sizes[0] rows multiply w[layer, 0], the next sizes[1] w[layer, 1], ...; rows past them are 0.
// Work is split in tasks of (group, 64 columns); the calling thread and XLA's intra-op pool take tasks from
// one counter, so the call finishes whether or not the pool runs them.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v16f __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));

constexpr int64_t kVec = 16;          // floats in a v16f
constexpr int64_t kCols = 4 * kVec;   // columns a task computes
constexpr int64_t kRows = 6;          // rows the inner loop carries at once

inline v16f load(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline v16f load(const uint16_t* p) {  // bf16 -> f32: the bits shifted into the top half
  v16h h;
  std::memcpy(&h, p, sizeof h);
  v16u u = __builtin_convertvector(h, v16u) << 16;
  v16f v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

inline void store(float* p, v16f v) { std::memcpy(p, &v, sizeof v); }

// R rows of x (f32, row stride K) times w's columns [n0, n0 + V * 16) (row stride N): into y (row stride N).
template <int R, int V, typename W>
void tile(const float* x, const W* w, float* y, int64_t K, int64_t N) {
  v16f acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = v16f{};
  for (int64_t k = 0; k < K; ++k) {
    const W* wk = w + k * N;
    __builtin_prefetch(wk + 8 * N);
    v16f wv[V];
    for (int v = 0; v < V; ++v) wv[v] = load(wk + v * kVec);
    for (int r = 0; r < R; ++r) {
      v16f xr = v16f{} + x[r * K + k];
      for (int v = 0; v < V; ++v) acc[r][v] += xr * wv[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) store(y + r * N + v * kVec, acc[r][v]);
}

template <int V, typename W>
void rows_tile(const float* x, const W* w, float* y, int64_t rows, int64_t K, int64_t N) {
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows) tile<kRows, V>(x + r * K, w, y + r * N, K, N);
  switch (rows - r) {
    case 5: tile<5, V>(x + r * K, w, y + r * N, K, N); break;
    case 4: tile<4, V>(x + r * K, w, y + r * N, K, N); break;
    case 3: tile<3, V>(x + r * K, w, y + r * N, K, N); break;
    case 2: tile<2, V>(x + r * K, w, y + r * N, K, N); break;
    case 1: tile<1, V>(x + r * K, w, y + r * N, K, N); break;
    default: break;
  }
}

struct Job {
  const float* x;       // [M, K] f32
  const void* w;        // layer's [E, K, N]
  bool bf16;
  float* y;             // [M, N]
  int64_t K, N, blocks; // blocks: column tasks per group
  std::vector<int64_t> first, rows;  // per group: first row, rows (groups with rows only)
  std::vector<float> x32;            // x converted, when it came in bf16
  std::vector<int64_t> expert;       // per group: its expert
  std::atomic<int64_t> next{0}, done{0};
  int64_t tasks = 0;

  template <typename W>
  void run_task(int64_t t) const {
    int64_t g = t / blocks, n0 = (t % blocks) * kCols;
    const W* wg = static_cast<const W*>(w) + expert[g] * K * N + n0;
    const float* xg = x + first[g] * K;
    float* yg = y + first[g] * N + n0;
    int64_t width = std::min(kCols, N - n0);
    switch (width / kVec) {
      case 4: rows_tile<4>(xg, wg, yg, rows[g], K, N); break;
      case 3: rows_tile<3>(xg, wg, yg, rows[g], K, N); break;
      case 2: rows_tile<2>(xg, wg, yg, rows[g], K, N); break;
      default: rows_tile<1>(xg, wg, yg, rows[g], K, N); break;
    }
  }

  void work() {
    for (int64_t t; (t = next.fetch_add(1)) < tasks;) {
      if (bf16) run_task<uint16_t>(t); else run_task<float>(t);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error GroupedMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> layer,
                         ffi::Buffer<ffi::S32> sizes, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || (wd.size() != 3 && wd.size() != 4))
    return ffi::Error::InvalidArgument("x [M, K] and w [L, E, K, N] or [L, K, N] expected");
  bool grouped = wd.size() == 4;  // [L, K, N]: one group
  int64_t M = xd[0], K = xd[1], L = wd[0], E = grouped ? wd[1] : 1, N = wd.back();
  if (wd[wd.size() - 2] != K || N % kVec || sizes.element_count() != E)
    return ffi::Error::InvalidArgument("shapes do not match (or N is not a multiple of 16)");
  bool x16 = x.element_type() == ffi::BF16, w16 = w.element_type() == ffi::BF16;
  if ((!x16 && x.element_type() != ffi::F32) || (!w16 && w.element_type() != ffi::F32))
    return ffi::Error::InvalidArgument("x and w must be float32 or bfloat16");
  int64_t l = std::clamp<int64_t>(layer.typed_data()[0], 0, L - 1);

  auto job = std::make_shared<Job>();
  job->bf16 = w16;
  job->K = K;
  job->N = N;
  job->blocks = (N + kCols - 1) / kCols;
  job->w = static_cast<const char*>(w.untyped_data()) + l * E * K * N * (w16 ? 2 : 4);
  job->y = y->typed_data();
  if (x16) {
    job->x32.resize(M * K);
    const uint16_t* xs = static_cast<const uint16_t*>(x.untyped_data());
    for (int64_t i = 0; i < M * K; ++i) {
      uint32_t u = uint32_t(xs[i]) << 16;
      std::memcpy(&job->x32[i], &u, 4);
    }
    job->x = job->x32.data();
  } else {
    job->x = static_cast<const float*>(x.untyped_data());
  }
  int64_t row = 0;
  for (int64_t e = 0; e < E && row < M; ++e) {
    int64_t n = std::min<int64_t>(std::max(sizes.typed_data()[e], 0), M - row);
    if (n) {
      job->first.push_back(row);
      job->rows.push_back(n);
      job->expert.push_back(e);
    }
    row += n;
  }
  std::memset(job->y + row * N, 0, (M - row) * N * sizeof(float));
  job->tasks = static_cast<int64_t>(job->first.size()) * job->blocks;

  int64_t helpers = std::min<int64_t>(pool.num_threads(), job->tasks - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([job] { job->work(); });
  job->work();
  while (job->done.load(std::memory_order_acquire) < job->tasks) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxdpGroupedMatmul, GroupedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
