// fp32 linear layers for decode-sized steps (up to a few hundred rows: decode and verification): y = x W^T (+ b), W streamed once.
//
// A BLAS GEMM packs W for every call, which at a few rows costs as much as the multiply, while the step is bound
// by streaming W from memory. Every output element is the fused multiply-adds of its K products in k order from
// zero, then plus its bias: the same operations whatever the layout, tile, row count or thread, so a row's result
// does not depend on the other rows of the step (speculative verification gives plain decode's numbers) and the
// output is bit-identical for any thread count. Two layouts reach those sums (L = Vec::size()):
// - x rows in the lanes, from kFewRows + 1 rows: x is packed once a call as x^T in groups of L rows, a k's L
//   values one vector, and each W element, broadcast, feeds every group of a tile: 2 groups x 6 W rows (12
//   accumulators, 8 loads per 12 FMAs), 3 x 4 for the first three of an odd count (24 rows 1.14x, 40 and 56
//   1.05-1.07x a lone last group in 1 x 6), or 1 x 8 with one group (8 W rows: rows a multiple of 4 KB apart
//   share an L1 set of 8 ways). W streams once in its own order, x^T (at
//   most 64 rows) stays in L2, and no sum crosses the lanes. The next block's W is asked for during the second and
//   third passes over a block (the only one with 1-3 groups): SmolLM2's decode step's linears 1.14x at batch 8,
//   1.25x at 16, 1.11x at 32, none at 64 (compute-bound there).
// - W rows in the lanes, up to kFewRows rows: L W rows transposed L k at a time in registers, each x value
//   broadcast (x rows in the lanes would leave most lanes idle there). Each k step asks for as many lines of the
//   thread's next L W rows as it reads: over 30 layers' weights, 1.03-1.09x at 1 row, 1.10-1.13x at 2, 1.23-1.30x
//   at 3 (the L rows are L streams at once, more than the hardware's prefetchers start on their own).
// small_bmm runs one such product a head (latent attention's absorbed products), the threads splitting the heads.
// Summing each output's lanes at the end instead (dot products of 3 x rows and 4 W rows, this op's earlier
// tiles) ran 0.85-0.9x at 64 rows; keeping L sums a phase apart and one order for both layouts cost the x-row
// layout its gain (0.87x).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "small_linear.h"
#include "small_linear_tiles.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <vector>

namespace batchgen_cpu {
namespace {

// W rows in the lanes up to 6 rows: at 4-6 rows 1.07-1.4x x rows in the lanes (one partly empty group; the 8
// transposed W vectors, 6 sums and a broadcast take 15 of AVX2's 16 registers); even at 7, 0.84x at 8.
constexpr int64_t kFewRows = 6;
// Rows one pass over W takes: larger steps run 64 at a time, x^T staying in L2, W's re-reads (from L3 for a
// layer of SmolLM2) hidden under the multiplies (1.05-1.3x F.linear at 96-256 rows, 1.4-1.8x the vocabulary
// head multiplied in slices).
constexpr int64_t kChunkRows = 64;

// ---- W rows in the lanes (few rows) ----

// L W rows (from w, K apart) at k .. k + L transposed in registers: t[u] holds w[j][k + u] in lane j.
inline void transpose_rows(const float* w, int64_t K, int64_t k, at::vec::VectorizedN<float, L>& t) {
  for (int64_t j = 0; j < L; ++j) t[j] = Vec::loadu(w + j * K + k);
#if defined(CPU_CAPABILITY_AVX512)
  at::vec::transpose_block(t, L, L);
#else
  at::vec::transpose_block(t);
#endif
}

// out rows [0, R) x columns [n0, n0 + L); `next` (or nullptr): the W rows the thread takes next.
template <int R>
void output_lanes(const Linear& a, int64_t n0, const char* next) {
  const int64_t K = a.K;
  const float* w = a.w + n0 * K;
  constexpr int64_t kLines = L * L * int64_t{sizeof(float)} / 64;  // W read a k step, asked for ahead as much
  Vec acc[R];
  for (int i = 0; i < R; ++i) acc[i] = Vec(0.f);
  auto step = [&](int64_t k, const Vec& wv) {
    for (int i = 0; i < R; ++i) acc[i] = at::vec::fmadd(Vec(a.x[i * a.x_row + k]), wv, acc[i]);
  };
  int64_t k = 0;
  at::vec::VectorizedN<float, L> t;
  for (; k + L <= K; k += L) {
    if (next != nullptr)
      for (int64_t u = 0; u < kLines; ++u, next += 64) __builtin_prefetch(next);
    transpose_rows(w, K, k, t);
    for (int64_t u = 0; u < L; ++u) step(k + u, t[u]);
  }
  alignas(64) float column[L];
  for (; k < K; ++k) {
    for (int64_t j = 0; j < L; ++j) column[j] = w[j * K + k];
    step(k, Vec::loadu(column));
  }
  for (int i = 0; i < R; ++i) {
    acc[i].store(column);
    for (int64_t j = 0; j < L; ++j) a.out[i * a.out_row + n0 + j] = with_bias(a, column[j], n0 + j);
  }
}

// Output column n of every row, one product at a time (the columns past the last whole group of lanes).
void one_column(const Linear& a, int64_t n) {
  const float* w = a.w + n * a.K;
  for (int64_t m = 0; m < a.M; ++m) {
    float sum = 0.f;
    for (int64_t k = 0; k < a.K; ++k) sum = std::fma(a.x[m * a.x_row + k], w[k], sum);
    a.out[m * a.out_row + n] = with_bias(a, sum, n);
  }
}

void few_rows(const Linear& a) {
  const int64_t blocks = a.N / L, grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, a.K * L));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    with_constant<kFewRows>(a.M, [&](auto rows) {
      for (int64_t b = begin; b < end; ++b)
        output_lanes<rows>(a, b * L, b + 1 < end ? reinterpret_cast<const char*>(a.w + (b + 1) * L * a.K) : nullptr);
    });
  });
  for (int64_t n = blocks * L; n < a.N; ++n) one_column(a, n);
}

// ---- x rows in the lanes (more rows) ----

// x^T by groups of L rows, zeros past the last row: lane l of xt[(g K + k) L ..] is x[g L + l][k].
void pack_rows(const Linear& a, float* xt) {
  const int64_t K = a.K, groups = (a.M + L - 1) / L;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const float* x = a.x + g * L * a.x_row;
      float* dst = xt + g * group_stride(K);
      const int64_t rows = std::min(L, a.M - g * L);
      int64_t k = 0;
      if (rows == L)
        for (; k + L <= K; k += L) at::vec::transpose_mxn<float, L, L>(x + k, a.x_row, dst + k * L, L);
      for (; k < K; ++k)
        for (int64_t l = 0; l < L; ++l) dst[k * L + l] = l < rows ? x[l * a.x_row + k] : 0.f;
    }
  });
}

// Every group against columns [n0, n0 + W): an odd count of three or more starts with the first three groups in
// 3 x 4 tiles (a lone group's 1 x 6 tile ran at half the rate of a pair's), then pairs in 2 x 6 tiles. `next` (or
// nullptr): the `next_floats` of W the thread takes next, asked for during the second and third passes, or
// during the only one, a share to each of the pass's tiles.
template <int W>
void column_block(const Linear& a, const float* xt, int64_t groups, int64_t n0, const float* next,
                  int64_t next_floats) {
  const int64_t triple = groups % 2, passes = (groups - 3 * triple) / 2 + triple;
  const int64_t first = passes == 1 ? 0 : 1, count = next == nullptr ? 0 : std::min<int64_t>(2, passes - first);
  auto ahead_of_pass = [&](int64_t pass, int64_t tiles) {
    return [&, pass, tiles](int t) {
      const int64_t share = pass - first;
      return share >= 0 && share < count ? Ahead(next, next_floats, share * tiles + t, count * tiles, a.K) : Ahead();
    };
  };
  int64_t g = 0, pass = 0;
  if (triple) {
    pass_tiles<3, kTripleCols, W>(a, xt, 0, n0, ahead_of_pass(pass++, (W + kTripleCols - 1) / kTripleCols));
    g = 3;
  }
  for (; g + 2 <= groups; g += 2)
    pass_tiles<2, kTileCols, W>(a, xt, g, n0, ahead_of_pass(pass++, (W + kTileCols - 1) / kTileCols));
}

void many_rows(const Linear& a, float* xt) {
  pack_rows(a, xt);
  const int64_t groups = (a.M + L - 1) / L, cols = groups == 1 ? kOneCols : groups % 2 == 1 ? kWideCols : kTileCols;
  const int64_t blocks = (a.N + cols - 1) / cols;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, a.K * cols));  // 128 KB of W
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * cols, width = std::min(cols, a.N - n0);
      const float* next = b + 1 < end ? a.w + (n0 + cols) * a.K : nullptr;
      const int64_t next_floats = next == nullptr ? 0 : std::min(cols, a.N - n0 - cols) * a.K;
      if (groups == 1)
        with_constant<kOneCols>(width, [&](auto nr) {
          one_group<nr>(a, xt, n0, next ? Ahead(next, next_floats, 0, 1, a.K) : Ahead());
        });
      else if (cols == kWideCols)
        with_constant<kWideCols>(width, [&](auto w) { column_block<w>(a, xt, groups, n0, next, next_floats); });
      else
        with_constant<kTileCols>(width, [&](auto w) { column_block<w>(a, xt, groups, n0, next, next_floats); });
    }
  });
}

// The calling thread's x^T, kept between calls (at most kChunkRows rows x K: no allocation a step).
std::vector<float>& thread_packed() {
  static thread_local std::vector<float> packed;
  return packed;
}

// Every row of `whole`, kChunkRows at a time.
void multiply(const Linear& whole) {
  std::vector<float>& packed = thread_packed();
  const int64_t most = std::min(whole.M, kChunkRows);
  if (most > kFewRows)
    packed.resize(std::max<size_t>(packed.size(), static_cast<size_t>((most + L - 1) / L * group_stride(whole.K))));
  for (int64_t m0 = 0; m0 < whole.M; m0 += kChunkRows) {
    Linear a = whole;
    a.x += m0 * a.x_row;
    a.out += m0 * a.out_row;
    a.M = std::min(kChunkRows, whole.M - m0);
    if (a.M <= kFewRows) few_rows(a);
    else many_rows(a, packed.data());
  }
}

void check_floats(const char* op, std::initializer_list<const at::Tensor*> tensors) {
  for (const at::Tensor* t : tensors) TORCH_CHECK(t->scalar_type() == at::kFloat, op, " takes float32 tensors");
}

}  // namespace

void small_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                  const at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && out.dim() == 2, "small_linear takes 2-D x, weight and out");
  check_floats("small_linear", {&x, &weight, &out});
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
  multiply(Linear{x.const_data_ptr<float>(), x.stride(0), weight.const_data_ptr<float>(), K, N, b,
                  out.data_ptr<float>(), out.stride(0), M});
}

// out (B, H, N) = per head h, x[:, h] (B, K) weight[h] (N, K)^T: latent attention's absorbed products in fp32.
// Each head's product is small_linear's (the same sums), so it is bit-identical to a head multiplied alone, for
// any thread count. With at least as many heads as threads the threads split the heads (each head's product then
// runs on its thread alone: ATen runs a parallel loop inside another one inline), else each head uses them all.
void small_bmm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& out) {
  TORCH_CHECK(x.dim() == 3 && weight.dim() == 3 && out.dim() == 3,
              "small_bmm takes x (B, H, K), weight (H, N, K) and out (B, H, N)");
  check_floats("small_bmm", {&x, &weight, &out});
  const int64_t B = x.size(0), H = x.size(1), K = x.size(2), N = weight.size(1);
  TORCH_CHECK(weight.size(0) == H && weight.size(2) == K && weight.stride(2) == 1 && weight.stride(1) == K,
              "weight must be (H, N, K) for x's heads and K, each head's (N, K) contiguous");
  TORCH_CHECK(x.stride(2) == 1 && out.stride(2) == 1 && out.size(0) == B && out.size(1) == H && out.size(2) == N,
              "x and out need contiguous rows, out of shape (B, H, N)");
  if (B == 0 || H == 0 || N == 0) return;
  const float* xp = x.const_data_ptr<float>();
  const float* wp = weight.const_data_ptr<float>();
  float* op = out.data_ptr<float>();
  auto head = [&](int64_t h) {
    multiply(Linear{xp + h * x.stride(1), x.stride(0), wp + h * weight.stride(0), K, N, nullptr,
                    op + h * out.stride(1), out.stride(0), B});
  };
  if (H >= at::get_num_threads())
    at::parallel_for(0, H, 1, [&](int64_t begin, int64_t end) {
      for (int64_t h = begin; h < end; ++h) head(h);
    });
  else
    for (int64_t h = 0; h < H; ++h) head(h);
}

}  // namespace batchgen_cpu

TORCH_LIBRARY_FRAGMENT(batchgen_cpu, m) {
  m.def("small_linear(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) out) -> ()");
  m.def("small_bmm(Tensor x, Tensor weight, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(batchgen_cpu, CPU, m) {
  m.impl("small_linear", &batchgen_cpu::small_linear);
  m.impl("small_bmm", &batchgen_cpu::small_bmm);
}
