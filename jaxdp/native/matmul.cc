// Products for XLA:CPU that read the weights where they lie: one layer of a layer stack, one expert of that
// layer, one head of MLA's kv_b_proj, never copied out first (XLA:CPU copies a dynamic slice, or a weight it
// must transpose, before its products read it). jaxdp/native/__init__.py builds this file and says where the
// model uses each.
//
// GroupedMatmul: x [M, K] f32 | bf16, w [L, E, K, N] (or [L, K, N]: E = 1; [K, N]: L = E = 1) f32 | bf16, layer int32 [],
//   sizes int32 [E], attribute kblocks -> y [kblocks, M, N] f32 (any N): the first sizes[0] rows times w[layer, 0], the
//   next sizes[1] times w[layer, 1], ...; rows past them 0. With kblocks > 1 (K a multiple of it), y[j] is the partial
//   product over K's block j alone, [j K / kblocks, (j + 1) K / kblocks): computed as the product of those columns of
//   x by those rows of w would be, so a device that holds only that block gets the same bits (the fixed reduction
//   tree of --enable-deterministic-inference, jaxdp.ops.rows.block_sum). Tasks of (block, group, 64 columns).
// HeadMatmul: x [B, H, K], w [L, A, H, X], layer, attributes offset, width, contract_a -> y [B, H, N] f32: per
//   head, x times columns [offset, offset + width) of w[layer, :, h, :] (contract A) or their transpose
//   (contract B). Tasks of (head, 64 columns) or (head, 16 rows of w). Every kernel here sums each row's products
//   in an order that does not depend on the other rows (batch-invariant: docs/determinism.md).
// MlaDecode: MLA's absorbed decode over the paged latent cache (`decode`).
// CacheWrite: a step's rows into their cache slots, in place (`CacheWrite`).
// The calling thread and XLA's intra-op pool take the tasks from one counter (`parallel_for`).

#include <algorithm>
#include <cmath>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
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

inline float to_f32(float v) { return v; }

inline float to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline void store(float* p, v16f v) { std::memcpy(p, &v, sizeof v); }

// R rows of x (f32, row stride ldx) times w's columns [0, V * 16) (row stride ldw) over K: into y (row stride ldy).
template <int R, int V, typename W>
void tile(const float* x, const W* w, float* y, int64_t K, int64_t ldx, int64_t ldw, int64_t ldy) {
  v16f acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = v16f{};
  for (int64_t k = 0; k < K; ++k) {
    const W* wk = w + k * ldw;
    for (int v = 0; v < V; ++v) __builtin_prefetch(wk + 8 * ldw + v * kVec);
    v16f wv[V];
    for (int v = 0; v < V; ++v) wv[v] = load(wk + v * kVec);
    for (int r = 0; r < R; ++r) {
      v16f xr = v16f{} + x[r * ldx + k];
      for (int v = 0; v < V; ++v) acc[r][v] += xr * wv[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) store(y + r * ldy + v * kVec, acc[r][v]);
}

template <int V, typename W>
void rows_tile(const float* x, const W* w, float* y, int64_t rows, int64_t K, int64_t ldx, int64_t ldw,
               int64_t ldy) {
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows) tile<kRows, V>(x + r * ldx, w, y + r * ldy, K, ldx, ldw, ldy);
  const float* xr = x + r * ldx;
  float* yr = y + r * ldy;
  switch (rows - r) {
    case 5: tile<5, V>(xr, w, yr, K, ldx, ldw, ldy); break;
    case 4: tile<4, V>(xr, w, yr, K, ldx, ldw, ldy); break;
    case 3: tile<3, V>(xr, w, yr, K, ldx, ldw, ldy); break;
    case 2: tile<2, V>(xr, w, yr, K, ldx, ldw, ldy); break;
    case 1: tile<1, V>(xr, w, yr, K, ldx, ldw, ldy); break;
    default: break;
  }
}

// Columns [0, width) that are not a whole vector (fewer than 16): each sum along K in order, one at a time.
template <typename W>
void tail(const float* x, const W* w, float* y, int64_t rows, int64_t width, int64_t K, int64_t ldx, int64_t ldw,
          int64_t ldy) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < width; ++j) {
      float acc = 0;
      for (int64_t k = 0; k < K; ++k) acc = std::fma(x[r * ldx + k], to_f32(w[k * ldw + j]), acc);
      y[r * ldy + j] = acc;
    }
}

// Columns [0, width) (at most 64; past the last multiple of 16, `tail`) of rows x (stride ldx) times w (row stride
// ldw) over K. A row's result does not depend on the rows beside it: each is summed along K in order.
template <typename W>
void panel(const float* x, const W* w, float* y, int64_t rows, int64_t width, int64_t K, int64_t ldx,
           int64_t ldw, int64_t ldy) {
  int64_t vec = width / kVec * kVec;
  switch (vec / kVec) {
    case 4: rows_tile<4>(x, w, y, rows, K, ldx, ldw, ldy); break;
    case 3: rows_tile<3>(x, w, y, rows, K, ldx, ldw, ldy); break;
    case 2: rows_tile<2>(x, w, y, rows, K, ldx, ldw, ldy); break;
    case 1: rows_tile<1>(x, w, y, rows, K, ldx, ldw, ldy); break;
    default: break;
  }
  if (vec < width) tail(x, w + vec, y + vec, rows, width - vec, K, ldx, ldw, ldy);
}

// The sums of the lanes of a[0..15], lane j of the result holding a[j]'s: four rounds, each adding the even
// and the odd chunks (8, 4, 2, 1 lanes) of two vectors laid end to end.
inline v16f lane_sums(v16f* a) {
  typedef int32_t v16i __attribute__((vector_size(64)));
  const v16i e8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const v16i o8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  const v16i e4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const v16i o4 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
  const v16i e2 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const v16i o2 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
  const v16i e1 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  const v16i o1 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
  for (int n = 8; n >= 1; n /= 2) {
    const v16i& e = n == 8 ? e8 : n == 4 ? e4 : n == 2 ? e2 : e1;
    const v16i& o = n == 8 ? o8 : n == 4 ? o4 : n == 2 ? o2 : o1;
    for (int i = 0; i < n; ++i) a[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], e) +
                                       __builtin_shuffle(a[2 * i], a[2 * i + 1], o);
  }
  return a[0];
}

// y[m, j] = sum_k x[m, k] * w[j, k] for j in [0, 16): rows of w contiguous over K (a multiple of 16), row
// stride ldw; x rows stride ldx, y rows stride ldy.
template <typename W>
void dot_rows(const float* x, const W* w, float* y, int64_t rows, int64_t K, int64_t ldx, int64_t ldw,
              int64_t ldy) {
  for (int64_t m = 0; m < rows; ++m) {
    v16f acc[16];
    for (int j = 0; j < 16; ++j) acc[j] = v16f{};
    for (int64_t k = 0; k < K; k += kVec) {
      v16f xv = load(x + m * ldx + k);
      for (int j = 0; j < 16; ++j) acc[j] += xv * load(w + j * ldw + k);
    }
    store(y + m * ldy, lane_sums(acc));
  }
}

// Tasks 0 .. count - 1 run by the calling thread and XLA's intra-op pool, taking them from one counter: the call
// returns once every task ran, whether or not the pool picked any up (a helper that starts late finds none).
struct Tasks {
  std::function<void(int64_t)> run;
  int64_t count = 0;
  std::atomic<int64_t> next{0}, done{0};

  void work() {
    for (int64_t t; (t = next.fetch_add(1)) < count;) {
      run(t);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

void parallel_for(ffi::ThreadPool& pool, int64_t count, std::function<void(int64_t)> run) {
  auto tasks = std::make_shared<Tasks>();
  tasks->run = std::move(run);
  tasks->count = count;
  int64_t helpers = std::min<int64_t>(pool.num_threads(), count - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([tasks] { tasks->work(); });
  tasks->work();
  while (tasks->done.load(std::memory_order_acquire) < count) std::this_thread::yield();
}

// x as float32: its own data, or converted into `buffer` when it came in bf16.
const float* as_f32(const ffi::AnyBuffer& x, std::vector<float>& buffer) {
  if (x.element_type() == ffi::F32) return static_cast<const float*>(x.untyped_data());
  size_t n = x.element_count();
  buffer.resize(n);
  const uint16_t* h = static_cast<const uint16_t*>(x.untyped_data());
  for (size_t i = 0; i < n; ++i) {
    uint32_t u = uint32_t(h[i]) << 16;
    std::memcpy(&buffer[i], &u, 4);
  }
  return buffer.data();
}

bool is_float(const ffi::AnyBuffer& a) { return a.element_type() == ffi::F32 || a.element_type() == ffi::BF16; }

// w's layer `layer`, as W (float or bf16 bits), `per_layer` elements a layer.
template <typename W>
const W* layer_of(const ffi::AnyBuffer& w, int64_t L, int64_t layer, int64_t per_layer) {
  return static_cast<const W*>(w.untyped_data()) + std::clamp<int64_t>(layer, 0, L - 1) * per_layer;
}

template <typename W>
void grouped(ffi::ThreadPool& pool, const float* x, const W* w, const int32_t* sizes, float* y, int64_t M,
             int64_t E, int64_t K, int64_t N, int64_t kblocks) {
  std::vector<int64_t> first, rows, expert;  // the groups with rows
  int64_t row = 0;
  for (int64_t e = 0; e < E && row < M; ++e) {
    int64_t n = std::min<int64_t>(std::max(sizes[e], 0), M - row);
    if (n) {
      first.push_back(row);
      rows.push_back(n);
      expert.push_back(e);
    }
    row += n;
  }
  for (int64_t j = 0; j < kblocks; ++j) std::memset(y + (j * M + row) * N, 0, (M - row) * N * sizeof(float));
  int64_t blocks = (N + kCols - 1) / kCols, groups = static_cast<int64_t>(first.size()), Kb = K / kblocks;
  parallel_for(pool, kblocks * groups * blocks, [&](int64_t t) {
    int64_t j = t / (groups * blocks), g = t / blocks % groups, n0 = (t % blocks) * kCols;
    panel(x + first[g] * K + j * Kb, w + (expert[g] * K + j * Kb) * N + n0, y + (j * M + first[g]) * N + n0, rows[g],
          std::min(kCols, N - n0), Kb, K, N, N);
  });
}

ffi::Error GroupedMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> layer,
                         ffi::Buffer<ffi::S32> sizes, ffi::ResultBuffer<ffi::F32> y, int64_t kblocks) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() < 2 || wd.size() > 4)
    return ffi::Error::InvalidArgument("x [M, K] and w [L, E, K, N], [L, K, N] or [K, N] expected");
  int64_t M = xd[0], K = xd[1], L = wd.size() > 2 ? wd[0] : 1, E = wd.size() == 4 ? wd[1] : 1, N = wd.back();
  if (wd[wd.size() - 2] != K || static_cast<int64_t>(sizes.element_count()) != E)
    return ffi::Error::InvalidArgument("jaxdp_grouped_matmul: x [" + std::to_string(M) + ", " + std::to_string(K) +
                                       "], w's last dims [" + std::to_string(wd[wd.size() - 2]) + ", " +
                                       std::to_string(N) + "], " + std::to_string(sizes.element_count()) +
                                       " sizes for " + std::to_string(E) + " groups: shapes do not match");
  if (kblocks < 1 || K % kblocks || static_cast<int64_t>(y->element_count()) != kblocks * M * N)
    return ffi::Error::InvalidArgument("jaxdp_grouped_matmul: K (" + std::to_string(K) + ") is not a multiple of " +
                                       std::to_string(kblocks) + " blocks, or y is not [blocks, M, N]");
  if (!is_float(x) || !is_float(w)) return ffi::Error::InvalidArgument("x and w must be float32 or bfloat16");
  std::vector<float> buffer;
  const float* x32 = as_f32(x, buffer);
  int64_t l = layer.typed_data()[0], per_layer = E * K * N;
  if (w.element_type() == ffi::BF16)
    grouped(pool, x32, layer_of<uint16_t>(w, L, l, per_layer), sizes.typed_data(), y->typed_data(), M, E, K, N,
            kblocks);
  else
    grouped(pool, x32, layer_of<float>(w, L, l, per_layer), sizes.typed_data(), y->typed_data(), M, E, K, N,
            kblocks);
  return ffi::Error::Success();
}

// MLA's per-head products with kv_b_proj's layer w [A, H, X], columns [offset, offset + width) of X:
//   contract A (W_UV): y[b, h, :width] = x[b, h, :A] @ w[:, h, offset:offset + width]
//   contract B (W_UK): y[b, h, :A] = x[b, h, :width] @ w[:, h, offset:offset + width]^T
template <typename W>
void heads(ffi::ThreadPool& pool, const float* x, const W* w, float* y, int64_t B, int64_t A, int64_t H, int64_t X,
           int64_t offset, int64_t width, bool contract_a) {
  if (contract_a) {
    int64_t blocks = (width + kCols - 1) / kCols;
    parallel_for(pool, H * blocks, [&](int64_t t) {
      int64_t h = t / blocks, n0 = (t % blocks) * kCols;
      panel(x + h * A, w + h * X + offset + n0, y + h * width + n0, B, std::min(kCols, width - n0), A, H * A,
            H * X, H * width);
    });
  } else {  // dot products along w's rows, 16 at a time: each row's sums in one order whatever the rows (a
    // transposed panel for many rows summed in another order, so a row's result depended on the step's size)
    int64_t blocks = A / kVec;
    parallel_for(pool, H * blocks, [&](int64_t t) {
      int64_t h = t / blocks, a0 = (t % blocks) * kVec;
      dot_rows(x + h * width, w + a0 * H * X + h * X + offset, y + h * A + a0, B, width, H * width, H * X, H * A);
    });
  }
}

ffi::Error HeadMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> layer,
                      ffi::ResultBuffer<ffi::F32> y, int64_t offset, int64_t width, int64_t contract_a) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 3 || wd.size() != 4) return ffi::Error::InvalidArgument("x [B, H, K] and w [L, A, H, X] expected");
  int64_t B = xd[0], H = xd[1], L = wd[0], A = wd[1], X = wd[3];
  bool ok = wd[2] == H && offset >= 0 && offset + width <= X && width % kVec == 0 && A % kVec == 0 &&
            xd[2] == (contract_a ? A : width);
  if (!ok) return ffi::Error::InvalidArgument("shapes do not match (or width or A is not a multiple of 16)");
  if (!is_float(x) || !is_float(w)) return ffi::Error::InvalidArgument("x and w must be float32 or bfloat16");
  std::vector<float> buffer;
  const float* x32 = as_f32(x, buffer);
  int64_t l = layer.typed_data()[0], per_layer = A * H * X;
  if (w.element_type() == ffi::BF16)
    heads(pool, x32, layer_of<uint16_t>(w, L, l, per_layer), y->typed_data(), B, A, H, X, offset, width,
          contract_a);
  else
    heads(pool, x32, layer_of<float>(w, L, l, per_layer), y->typed_data(), B, A, H, X, offset, width, contract_a);
  return ffi::Error::Success();
}

// MLA's absorbed decode over the paged latent cache: per row b and head h, the scores of q [Kd] (latent and
// rope, scaled) against the row's first seq_lens[b] cache entries (pages through page_table[b]), softmax, and
// the weighted sum of their latents [Lk]. Tasks of (row, 8 heads); rows of no length give zeros.
template <typename C>
void decode(ffi::ThreadPool& pool, const float* q_lat, const float* q_rope, const C* kv, const int32_t* table,
            const int32_t* lens, float* out, int64_t B, int64_t H, int64_t Lk, int64_t R, int64_t P, int64_t S,
            int64_t N, float scale) {
  constexpr int64_t kHeads = 8, kGroup = 4;  // heads a task attends; heads whose sums the registers carry
  const int64_t Kd = Lk + R, blocks = (H + kHeads - 1) / kHeads;
  const std::vector<C> zeros(Kd, C{});  // the entry padding reads, past a row's length
  parallel_for(pool, B * blocks, [&](int64_t t) {
    int64_t b = t / blocks, h0 = (t % blocks) * kHeads, nh = std::min(kHeads, H - h0);
    int64_t n = std::clamp<int64_t>(lens[b], 0, N * S), n16 = (n + kVec - 1) / kVec * kVec;
    float* o = out + (b * H + h0) * Lk;
    std::memset(o, 0, nh * Lk * sizeof(float));
    if (n == 0) return;
    std::vector<const C*> rows(n16, zeros.data());
    for (int64_t c = 0; c < n; ++c)
      rows[c] = kv + (std::clamp<int64_t>(table[b * N + c / S], 0, P - 1) * S + c % S) * Kd;
    std::vector<float> q(nh * Kd), p(nh * n16);
    for (int64_t h = 0; h < nh; ++h)
      for (int64_t k = 0; k < Kd; ++k)
        q[h * Kd + k] = scale * (k < Lk ? q_lat[(b * H + h0 + h) * Lk + k] : q_rope[(b * H + h0 + h) * R + k - Lk]);
    for (int64_t c0 = 0; c0 < n16; c0 += kVec) {  // scores, 16 entries at a time (they stay in L1 across heads)
      for (int64_t h = 0; h < nh; ++h) {
        v16f acc[kVec];
        for (auto& a : acc) a = v16f{};
        for (int64_t k = 0; k < Kd; k += kVec) {
          v16f qv = load(q.data() + h * Kd + k);
          for (int j = 0; j < kVec; ++j) acc[j] += qv * load(rows[c0 + j] + k);
        }
        store(p.data() + h * n16 + c0, lane_sums(acc));
      }
    }
    for (int64_t h = 0; h < nh; ++h) {
      float* ph = p.data() + h * n16;
      float mx = *std::max_element(ph, ph + n), total = 0;
      for (int64_t c = 0; c < n; ++c) total += (ph[c] = std::exp(ph[c] - mx));
      for (int64_t c = 0; c < n; ++c) ph[c] /= total;
    }
    for (int64_t g = 0; g < nh; g += kGroup) {
      int64_t ng = std::min(kGroup, nh - g);
      for (int64_t k0 = 0; k0 < Lk; k0 += kCols) {  // 64 latent columns of kGroup heads at a time
        v16f acc[kGroup][4];
        for (auto& a : acc)
          for (auto& v : a) v = v16f{};
        for (int64_t c = 0; c < n; ++c) {
          v16f r[4];
          for (int v = 0; v < 4; ++v) r[v] = load(rows[c] + k0 + v * kVec);
          for (int64_t h = 0; h < ng; ++h) {
            v16f ph = v16f{} + p[(g + h) * n16 + c];
            for (int v = 0; v < 4; ++v) acc[h][v] += ph * r[v];
          }
        }
        for (int64_t h = 0; h < ng; ++h)
          for (int v = 0; v < 4; ++v) store(o + (g + h) * Lk + k0 + v * kVec, acc[h][v]);
      }
    }
  });
}

ffi::Error MlaDecode(ffi::ThreadPool pool, ffi::AnyBuffer q_latent, ffi::AnyBuffer q_rope, ffi::AnyBuffer kv,
                     ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> lens, ffi::ResultBuffer<ffi::F32> out,
                     float scale) {
  auto qd = q_latent.dimensions(), rd = q_rope.dimensions(), kd = kv.dimensions(), td = table.dimensions();
  if (qd.size() != 3 || rd.size() != 3 || kd.size() != 3 || td.size() != 2)
    return ffi::Error::InvalidArgument("q_latent [B, H, Lk], q_rope [B, H, R], kv [P, S, Lk + R], table [B, N]");
  int64_t B = qd[0], H = qd[1], Lk = qd[2], R = rd[2], P = kd[0], S = kd[1], N = td[1];
  if (rd[0] != B || rd[1] != H || kd[2] != Lk + R || td[0] != B || lens.element_count() != static_cast<size_t>(B) ||
      Lk % kCols || R % kVec)
    return ffi::Error::InvalidArgument("jaxdp_mla_decode: shapes do not match (or Lk is not a multiple of 64, R of 16)");
  if (!is_float(q_latent) || !is_float(q_rope) || !is_float(kv))
    return ffi::Error::InvalidArgument("q and kv must be float32 or bfloat16");
  std::vector<float> qb, rb;
  const float* q32 = as_f32(q_latent, qb);
  const float* r32 = as_f32(q_rope, rb);
  if (kv.element_type() == ffi::BF16)
    decode(pool, q32, r32, static_cast<const uint16_t*>(kv.untyped_data()), table.typed_data(), lens.typed_data(),
           out->typed_data(), B, H, Lk, R, P, S, N, scale);
  else
    decode(pool, q32, r32, static_cast<const float*>(kv.untyped_data()), table.typed_data(), lens.typed_data(),
           out->typed_data(), B, H, Lk, R, P, S, N, scale);
  return ffi::Error::Success();
}

// CacheWrite: rows [T, K] into the slots idx [T] of the cache [..., K] (its leading dims flattened: N slots; any
// element type, the rows' the cache's), the result aliasing the cache: only the rows' bytes are written (XLA:CPU's
// scatter into a bf16 cache converts the whole cache to float32 and back). A slot outside [0, N) is dropped.
// Should XLA not alias the result, the cache is copied into it first.
ffi::Error CacheWrite(ffi::AnyBuffer cache, ffi::Buffer<ffi::S32> idx, ffi::AnyBuffer rows,
                      ffi::Result<ffi::AnyBuffer> out) {
  auto cd = cache.dimensions(), rd = rows.dimensions();
  int64_t K = cd.size() ? cd.back() : 0, N = K ? static_cast<int64_t>(cache.element_count()) / K : 0;
  if (cd.size() < 2 || rd.size() != 2 || rd[1] != K || static_cast<int64_t>(idx.element_count()) != rd[0] ||
      cache.element_type() != rows.element_type() || out->element_type() != cache.element_type())
    return ffi::Error::InvalidArgument("jaxdp_cache_write: cache [..., K], idx [T] and rows [T, K] of its type expected");
  size_t row_bytes = cache.size_bytes() / std::max<int64_t>(N, 1);
  char* dst = static_cast<char*>(out->untyped_data());
  if (dst != cache.untyped_data()) std::memcpy(dst, cache.untyped_data(), cache.size_bytes());
  const char* src = static_cast<const char*>(rows.untyped_data());
  const int32_t* slot = idx.typed_data();
  for (int64_t t = 0; t < rd[0]; ++t)
    if (slot[t] >= 0 && slot[t] < N) std::memcpy(dst + slot[t] * row_bytes, src + t * row_bytes, row_bytes);
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
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("kblocks"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxdpHeadMatmul, HeadMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("offset")
                                  .Attr<int64_t>("width")
                                  .Attr<int64_t>("contract_a"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxdpMlaDecode, MlaDecode,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxdpCacheWrite, CacheWrite,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
