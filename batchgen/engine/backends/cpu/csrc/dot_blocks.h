// dot_linear's packed blocks and the tile that multiplies rows of x by one (dot_linear.cpp; the expert op's packed
// experts in moe.cpp): W in blocks of 48 output columns, each block's inputs in pairs, [N/48][K/2][48][2], zero
// columns past N (prepack.py's pack_dot_weight). At each pair of inputs a tile loads the block's 3 vectors and, for
// each of its rows, broadcasts the row's pair and adds the products by vdpbf16ps into 24 fp32 sums: every output
// is one lane's sum over the pairs in order, whatever the tile, row count or thread count.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/vec.h>

#include "activation.h"
#include "decode_dots.h"

#include <algorithm>

namespace batchgen_cpu {

constexpr int64_t kBlock = 48;  // output columns a block of the packed weight holds
constexpr int64_t kTileRows = 8;  // rows of x a tile takes
// Rows of x multiplied by every block in turn before the next rows (prefill-sized steps; a decode step's rows are
// one chunk): a block is read from memory once a chunk. Against oneDNN at 2,048-8,192 rows, 3 MB ran 1.00-1.03x
// what chunks of 256 KB ran.
constexpr int64_t kChunkBytes = 3 << 20;

struct RowChunks {
  int64_t rows, count;
};

// M rows of K bf16 inputs in chunks of equal rows (whole tiles, at most kChunkBytes of x), so that the threads'
// equal shares of (chunk, block) items are equal work.
inline RowChunks row_chunks(int64_t M, int64_t K) {
  const int64_t most = std::max<int64_t>(kTileRows, kChunkBytes / (2 * K)), count = (M + most - 1) / most;
  return {((M + count - 1) / count + kTileRows - 1) / kTileRows * kTileRows, count};
}

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
    const BVec first = round_bf16(v[0], v[1]);
    const BVec last = round_bf16(v[2], FVec(0.f));
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

// out (M rows `out_stride` apart) = x (M rows `x_stride` apart, 2 * pairs inputs) times one block's `cols` columns
// (+ bias: the block's fp32 values, or null), M in tiles of kTileRows.
inline void block_rows(const at::BFloat16* x, int64_t x_stride, int64_t M, int64_t pairs, const at::BFloat16* block,
                       const float* bias, at::BFloat16* out, int64_t out_stride, int64_t cols) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  for (int64_t m0 = 0; m0 < M; m0 += kTileRows)
    with_constant<kTileRows>(std::min(kTileRows, M - m0), [&](auto mr) {
      block_tile<mr>(x + m0 * x_stride, x_stride, pairs, block, bias, out + m0 * out_stride, out_stride, cols);
    });
#endif
}

// out (M rows `out_stride` apart, `cols` columns) = silu(x gate) * (x up) for one gate block and its up block (+ their
// fp32 biases, or null), 8 rows at a time: each tile's gate and up products round to bf16 in L1, as dot_linear's
// output does, and silu_mul_row rounds their product once, as the silu_and_mul op does on a whole row.
inline void gated_block_rows(const at::BFloat16* x, int64_t x_stride, int64_t M, int64_t pairs,
                             const at::BFloat16* gate, const at::BFloat16* up, const float* gate_bias,
                             const float* up_bias, at::BFloat16* out, int64_t out_stride, int64_t cols) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  alignas(64) at::BFloat16 g[kTileRows * kBlock], u[kTileRows * kBlock];
  for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
    const int64_t rows = std::min(kTileRows, M - m0);
    with_constant<kTileRows>(rows, [&](auto mr) {
      block_tile<mr>(x + m0 * x_stride, x_stride, pairs, gate, gate_bias, g, kBlock, cols);
      block_tile<mr>(x + m0 * x_stride, x_stride, pairs, up, up_bias, u, kBlock, cols);
    });
    for (int64_t m = 0; m < rows; ++m)
      silu_mul_row(g + m * kBlock, u + m * kBlock, out + (m0 + m) * out_stride, cols);
  }
#endif
}

}  // namespace batchgen_cpu
