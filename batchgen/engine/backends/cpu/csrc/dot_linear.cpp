// The bf16 linear layer, y = x W^T (+ b), on CPUs with AVX512-BF16. W is packed once (prepack.py's
// pack_dot_weight) in blocks of 48 output columns, each block's inputs in pairs, [N/48][K/2][48][2], with zero
// columns past N (b likewise, in fp32). A tile multiplies up to 8 rows of x by one block: at each pair of inputs
// it loads the block's 3 vectors (48 columns x 2 inputs) and, for each row, broadcasts the row's pair and adds the
// products by vdpbf16ps into 24 fp32 sums. A block is read front to back, which the hardware prefetchers keep up
// with, so weights streamed from memory keep pace with the products where oneDNN's prepacked linear waits for
// them. Every output is the sum of one lane over the input pairs in order: the same for any row count, tile or
// thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "decode_dots.h"

#include <algorithm>
#include <cstring>

namespace batchgen_cpu {
namespace {

constexpr int64_t kBlock = 48;  // output columns a block of the packed weight holds
constexpr int64_t kTileRows = 8;
// Rows of x multiplied by every block in turn before the next rows (prefill-sized steps; a decode step's rows are
// one chunk): a block is read from memory once a chunk. Against oneDNN at 2,048-8,192 rows, 3 MB ran 1.00-1.03x
// what chunks of 256 KB ran.
constexpr int64_t kChunkBytes = 3 << 20;

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
constexpr int kVectors = kBlock / 16;

// out rows [0, MR) x the block's `cols` columns = x's MR rows (K apart, K/2 pairs) times the block, plus bias.
template <int MR>
void block_tile(const at::BFloat16* x, int64_t x_stride, int64_t pairs, const at::BFloat16* block,
                const float* bias, at::BFloat16* out, int64_t out_stride, int64_t cols) {
  __m512 acc[MR][kVectors];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < kVectors; ++j) acc[m][j] = _mm512_setzero_ps();
  const int32_t* rows[MR];
  for (int m = 0; m < MR; ++m) rows[m] = reinterpret_cast<const int32_t*>(x + m * x_stride);
  for (int64_t p = 0; p < pairs; ++p) {
    const at::BFloat16* w = block + p * 2 * kBlock;
    __m512bh wv[kVectors];
#pragma GCC unroll 4
    for (int j = 0; j < kVectors; ++j) wv[j] = load_bh(w + 32 * j);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m512bh pair = as_bh(_mm512_set1_epi32(rows[m][p]));
#pragma GCC unroll 4
      for (int j = 0; j < kVectors; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], pair, wv[j]);
    }
  }
  using BVec = at::vec::Vectorized<at::BFloat16>;
  using FVec = at::vec::Vectorized<float>;
  for (int m = 0; m < MR; ++m) {
    FVec v[kVectors];
    for (int j = 0; j < kVectors; ++j)
      v[j] = bias ? FVec(_mm512_add_ps(acc[m][j], _mm512_loadu_ps(bias + 16 * j))) : FVec(acc[m][j]);
    at::BFloat16* o = out + m * out_stride;
    // torch's rounding (subnormals kept), as the GEMM's bf16 output rounds
    const BVec first = at::vec::convert_from_float<at::BFloat16>(v[0], v[1]);
    const BVec last = at::vec::convert_from_float<at::BFloat16>(v[2], FVec(0.f));
    if (cols == kBlock) {
      first.store(o);
      last.store(o + 32, 16);
    } else {
      first.store(o, static_cast<int>(std::min<int64_t>(cols, 32)));
      if (cols > 32) last.store(o + 32, static_cast<int>(cols - 32));
    }
  }
}
#endif

void dot_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                const at::Tensor& out) {
  TORCH_CHECK(kDotTiles, "dot_linear needs a CPU with AVX512-BF16 (and the kernels built for it)");
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 4 && out.dim() == 2, "x (M, K), packed (N/48, K/2, 48, 2), out (M, N)");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 &&
              out.scalar_type() == at::kBFloat16, "dot_linear takes bfloat16 x, weight and out");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), blocks = packed.size(0);
  TORCH_CHECK(packed.is_contiguous() && packed.size(1) * 2 == K && packed.size(2) == kBlock && packed.size(3) == 2,
              "the packed weight does not match x's ", K, " inputs");
  TORCH_CHECK(out.size(0) == M && (N + kBlock - 1) / kBlock == blocks, "out must be (M, N) for the packed weight");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1, "x's and out's rows must be contiguous");
  TORCH_CHECK(K >= 2, "dot_linear takes at least one pair of inputs");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                        bias->numel() == blocks * kBlock), "bias must be fp32, zero-padded to the packed blocks");
  if (M == 0 || N == 0) return;
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  const at::BFloat16* xp = x.const_data_ptr<at::BFloat16>();
  const at::BFloat16* wp = packed.const_data_ptr<at::BFloat16>();
  const float* bp = bias ? bias->const_data_ptr<float>() : nullptr;
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t x_stride = x.stride(0), out_stride = out.stride(0), pairs = K / 2;
  // Chunks of equal rows (in whole tiles), so that the threads' equal shares of (chunk, block) items are equal work.
  const int64_t most = std::max<int64_t>(kTileRows, kChunkBytes / (2 * K)), chunks = (M + most - 1) / most;
  const int64_t chunk = ((M + chunks - 1) / chunks + kTileRows - 1) / kTileRows * kTileRows;
  at::parallel_for(0, chunks * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t c = item / blocks, b = item % blocks;
      const at::BFloat16* block = wp + b * pairs * 2 * kBlock;
      const int64_t cols = std::min(kBlock, N - b * kBlock);
      const float* block_bias = bp ? bp + b * kBlock : nullptr;
      for (int64_t m0 = c * chunk; m0 < std::min(M, (c + 1) * chunk); m0 += kTileRows) {
        const at::BFloat16* rows = xp + m0 * x_stride;
        at::BFloat16* dst = op + m0 * out_stride + b * kBlock;
        with_constant<kTileRows>(std::min(kTileRows, M - m0), [&](auto mr) {
          block_tile<mr>(rows, x_stride, pairs, block, block_bias, dst, out_stride, cols);
        });
      }
    }
  });
#endif
}

bool dot_linear_built() { return kDotTiles; }

}  // namespace
}  // namespace batchgen_cpu

TORCH_LIBRARY_FRAGMENT(batchgen_cpu, m) {
  m.def("dot_linear(Tensor x, Tensor packed, Tensor? bias, Tensor(a!) out) -> ()");
  m.def("dot_linear_built() -> bool");
}

TORCH_LIBRARY_IMPL(batchgen_cpu, CPU, m) {
  m.impl("dot_linear", &batchgen_cpu::dot_linear);
}

TORCH_LIBRARY_IMPL(batchgen_cpu, CompositeExplicitAutograd, m) {
  m.impl("dot_linear_built", &batchgen_cpu::dot_linear_built);
}
