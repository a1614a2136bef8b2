// fp32 linear layers for a few rows (decode and verification steps): y = x W^T (+ b), W streamed once.
//
// A BLAS GEMM packs W for every call, which at a few rows costs as much as the multiply, while the step is bound
// by streaming W from memory. Here a tile of 4 weight rows is loaded once per k-step and feeds the dot products
// of 3 input rows at once (register accumulators, reduced at the end). Every output element is one dot
// product summed in the same order whatever the tile, the row count or the thread, so a row's result does not
// depend on the other rows of the step (speculative verification gives plain decode's numbers) and the output
// is bit-identical for any thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "vec.h"

#include <algorithm>

namespace batchgen_cpu {
namespace {

// A tile: 3 input rows x 4 W rows, 12 accumulators and 7 loads per 12 FMAs (of 16 AVX2 registers). Measured
// against 6 x 2 at 1-16 rows: as fast at 1-2 rows, 1.3x faster at 5 and 8.
constexpr int64_t kTileRows = 3, kTileCols = 4;

struct Rows {
  const float* x; int64_t x_row;
  const float* w; int64_t K;
  const float* bias;  // or nullptr
  float* out; int64_t out_row;
};

inline float hsum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

// out[m0 .. m0+MR) x [n0 .. n0+NR): each element the dot product of one x row and one W row. With Ahead, the
// pass also asks for its share (`share` of `shares`) of the lines of the W tile at `ahead`.
template <int MR, int NR, bool Ahead = false>
inline void tile(const Rows& a, int64_t m0, int64_t n0, const float* ahead = nullptr, int64_t share = 0,
                 int64_t shares = 1) {
  constexpr int64_t S = Vec::size();
  const int64_t K = a.K, body = K - K % S;
  Vec acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = Vec(0.f);
  const float* w = a.w + n0 * K;
  const float* x = a.x + m0 * a.x_row;
  // A few lines each k-step.
  const int64_t lines = NR * K / 16, first = share * lines / shares, last = (share + 1) * lines / shares;
  const int64_t per_step = Ahead ? (last - first + body / S - 1) / std::max<int64_t>(1, body / S) : 0;
  const float* line = ahead + 16 * first;
  const float* const end = ahead + 16 * last;
  for (int64_t k = 0; k < body; k += S) {
    if constexpr (Ahead)
      for (int64_t u = 0; u < per_step && line < end; ++u, line += 16) __builtin_prefetch(line, 0, 2);
    Vec wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = Vec::loadu(w + j * K + k);
    for (int i = 0; i < MR; ++i) {
      const Vec xv = Vec::loadu(x + i * a.x_row + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = at::vec::fmadd(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) {
      float s = hsum(acc[i][j]);
      for (int64_t k = body; k < K; ++k) s += x[i * a.x_row + k] * w[j * K + k];
      if (a.bias != nullptr) s += a.bias[n0 + j];
      a.out[(m0 + i) * a.out_row + n0 + j] = s;
    }
  }
}

// One pass: `rows` (1 to kTileRows) input rows from m0 against W rows [n0, n0 + NR).
template <int NR, bool Ahead>
void pass(const Rows& a, int64_t rows, int64_t m0, int64_t n0, const float* ahead, int64_t share, int64_t shares) {
  if (rows == kTileRows) tile<kTileRows, NR, Ahead>(a, m0, n0, ahead, share, shares);
  else if (rows == 2) tile<2, NR, Ahead>(a, m0, n0, ahead, share, shares);
  else tile<1, NR, Ahead>(a, m0, n0, ahead, share, shares);
}

// All rows against W rows [n0, n0 + NR): passes of up to kTileRows rows, the W tile hot in L1 after the first.
// `ahead`: the W tile this thread takes next (or nullptr), asked for into L2 during the second and third passes,
// which read only L1, so that the next tile's first pass finds its lines in L2 rather than waiting on memory
// (1.15-1.29x at 4-16 rows, 1.05x at 64; asked for during the first pass, which waits on its own lines, it
// gained nothing).
template <int NR>
void column_tile(const Rows& a, int64_t M, int64_t n0, const float* ahead = nullptr) {
  const int64_t shares = ahead == nullptr ? 0 : std::min<int64_t>(2, (M - 1) / kTileRows);
  for (int64_t m = 0, p = 0; m < M; m += kTileRows, ++p) {
    const int64_t rows = std::min(kTileRows, M - m);
    if (p >= 1 && p <= shares) pass<NR, true>(a, rows, m, n0, ahead, p - 1, shares);
    else pass<NR, false>(a, rows, m, n0, nullptr, 0, 1);
  }
}

void small_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                  const at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && out.dim() == 2, "small_linear takes 2-D x, weight and out");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "small_linear takes float32 tensors");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K && weight.is_contiguous(), "weight must be contiguous (N, K) with x's K");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1 && out.size(0) == M && out.size(1) == N,
              "x and out need contiguous rows, out of shape (M, N)");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "bias must be float32 of N elements");
    b = bias->const_data_ptr<float>();
  }
  if (M == 0 || N == 0) return;
  const Rows a{x.const_data_ptr<float>(), x.stride(0), weight.const_data_ptr<float>(), K, b,
               out.data_ptr<float>(), out.stride(0)};
  const int64_t tiles = N / kTileCols;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, K * kTileCols));  // 128 KB of W
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      column_tile<kTileCols>(a, M, t * kTileCols, t + 1 < end ? a.w + (t + 1) * kTileCols * K : nullptr);
  });
  for (int64_t n = tiles * kTileCols; n < N; ++n) column_tile<1>(a, M, n);
}

}  // namespace
}  // namespace batchgen_cpu

TORCH_LIBRARY_FRAGMENT(batchgen_cpu, m) {
  m.def("small_linear(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(batchgen_cpu, CPU, m) {
  m.impl("small_linear", &batchgen_cpu::small_linear);
}
