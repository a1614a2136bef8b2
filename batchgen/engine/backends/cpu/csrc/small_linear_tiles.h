// small_linear.cpp's x rows in the lanes: the op's operands, the stride of its packed x^T groups, and the
// register tiles that multiply groups of x^T against W rows (1 x 8, 2 x 6, 3 x 4), the next W block asked for.
#pragma once

#include "vec.h"

#include <algorithm>
#include <cstdint>

namespace batchgen_cpu {
namespace {

constexpr int64_t L = Vec::size();
// W rows a tile takes: of 2 groups, of 3, of 1; kWideCols: a column block of an odd group count of 3 or more
// (three 3 x 4 tiles, then two 2 x 6 a pair of groups).
constexpr int kTileCols = 6, kTripleCols = 4, kOneCols = 8, kWideCols = 12;

struct Linear {
  const float* x; int64_t x_row;
  const float* w; int64_t K, N;
  const float* bias;  // or nullptr
  float* out; int64_t out_row, M;
};

inline float with_bias(const Linear& a, float sum, int64_t n) { return a.bias != nullptr ? sum + a.bias[n] : sum; }

// Floats from one group of packed x^T to the next: K L and a cache line more, so that at a given k the groups (a
// multiple of 4 KB apart for K a multiple of 128) do not share an L1 set with each other and with the W rows.
inline int64_t group_stride(int64_t K) { return K * L + 16; }

// Writes a tile's sums: acc[i][j] holds column n0 + j of group g0 + i's rows.
template <int MV, int NR>
inline void store_tile(const Linear& a, const Vec (&acc)[MV][NR], int64_t g0, int64_t n0) {
  alignas(64) float sums[L];
  for (int i = 0; i < MV; ++i)
    for (int j = 0; j < NR; ++j) {
      acc[i][j].store(sums);
      for (int64_t l = 0, m = (g0 + i) * L; l < L && m < a.M; ++l, ++m)
        a.out[m * a.out_row + n0 + j] = with_bias(a, sums[l], n0 + j);
    }
}

// A share of the lines of the W block the thread takes next, asked for into L2 over a pass, a few every 16 k,
// so that the block's own first pass finds them there rather than waiting on memory.
struct Ahead {
  const char* line = nullptr;
  const char* end = nullptr;
  int64_t per_step = 0;
  Ahead() = default;
  Ahead(const float* block, int64_t floats, int64_t share, int64_t shares, int64_t K) {
    const int64_t lines = floats * int64_t{sizeof(float)} / 64, steps = (K + 15) / 16;
    line = reinterpret_cast<const char*>(block) + share * lines / shares * 64;
    end = reinterpret_cast<const char*>(block) + (share + 1) * lines / shares * 64;
    per_step = ((end - line) / 64 + steps - 1) / steps;
  }
  void step() {
    for (int64_t u = 0; u < per_step && line < end; ++u, line += 64) __builtin_prefetch(line, 0, 2);
  }
};

// One group against NR (up to kOneCols) W rows, every row at each k. Where K is a multiple of 1,024 the rows at a
// given k are a multiple of 4 KB apart and share one L1 set of 8 ways: 8 rows fit it, where 12 evicted one another
// before their 16 values were used (2-3x slower at 7-8 rows of x for K 1,024-4,096). Taken a line of k at a time
// by each half of 12 rows instead, the tile kept only 6 sums in flight: 8 rows side by side ran 1.04-1.15x that.
template <int NR>
void one_group(const Linear& a, const float* xt, int64_t n0, Ahead ahead) {
  const float* w = a.w + n0 * a.K;
  Vec acc[NR];
#pragma GCC unroll 16
  for (int j = 0; j < NR; ++j) acc[j] = Vec(0.f);
  for (int64_t k0 = 0; k0 < a.K; k0 += 16) {
    ahead.step();
    for (int64_t k = k0, k1 = std::min(a.K, k0 + 16); k < k1; ++k) {
      const Vec xv = Vec::loadu(xt + k * L);
#pragma GCC unroll 16
      for (int j = 0; j < NR; ++j) acc[j] = at::vec::fmadd(xv, Vec(w[j * a.K + k]), acc[j]);
    }
  }
  Vec sums[1][NR];
  for (int j = 0; j < NR; ++j) sums[0][j] = acc[j];
  store_tile<1, NR>(a, sums, 0, n0);
}

// Groups [g0, g0 + MV) x columns [n0, n0 + NR).
template <int MV, int NR>
void row_lanes(const Linear& a, const float* xt, int64_t g0, int64_t n0, Ahead ahead) {
  const int64_t K = a.K;
  const float* xg = xt + g0 * group_stride(K);
  const float* w = a.w + n0 * K;
  Vec acc[MV][NR];
#pragma GCC unroll 16
  for (int i = 0; i < MV; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) acc[i][j] = Vec(0.f);
  for (int64_t k = 0; k < K; ++k) {
    if (k % 16 == 0) ahead.step();
    Vec xv[MV];
#pragma GCC unroll 16
    for (int i = 0; i < MV; ++i) xv[i] = Vec::loadu(xg + i * group_stride(K) + k * L);
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) {
      const Vec b(w[j * K + k]);
#pragma GCC unroll 16
      for (int i = 0; i < MV; ++i) acc[i][j] = at::vec::fmadd(xv[i], b, acc[i][j]);
    }
  }
  store_tile<MV, NR>(a, acc, g0, n0);
}

// The 2 x 6 tile with its accumulators named: held in an array, GCC kept some in memory (0.93x at 64 rows).
template <>
void row_lanes<2, kTileCols>(const Linear& a, const float* xt, int64_t g0, int64_t n0, Ahead ahead) {
  const int64_t K = a.K;
  const float* x0 = xt + g0 * group_stride(K);
  const float* x1 = x0 + group_stride(K);
  const float* w = a.w + n0 * K;
  Vec a00(0.f), a01(0.f), a02(0.f), a03(0.f), a04(0.f), a05(0.f);
  Vec a10(0.f), a11(0.f), a12(0.f), a13(0.f), a14(0.f), a15(0.f);
  for (int64_t k = 0; k < K; ++k) {
    if (k % 16 == 0) ahead.step();
    const Vec u = Vec::loadu(x0 + k * L), v = Vec::loadu(x1 + k * L);
#define BATCHGEN_COLUMN(j)               \
  {                                      \
    const Vec b(w[j * K + k]);           \
    a0##j = at::vec::fmadd(u, b, a0##j); \
    a1##j = at::vec::fmadd(v, b, a1##j); \
  }
    BATCHGEN_COLUMN(0) BATCHGEN_COLUMN(1) BATCHGEN_COLUMN(2) BATCHGEN_COLUMN(3) BATCHGEN_COLUMN(4)
    BATCHGEN_COLUMN(5)
#undef BATCHGEN_COLUMN
  }
  const Vec acc[2][kTileCols] = {{a00, a01, a02, a03, a04, a05}, {a10, a11, a12, a13, a14, a15}};
  store_tile<2, kTileCols>(a, acc, g0, n0);
}

// The 3 x 4 tile, its accumulators named like the 2 x 6 tile's: the 3 loads, 1 broadcast and 12 sums use all 16
// AVX2 registers.
template <>
void row_lanes<3, kTripleCols>(const Linear& a, const float* xt, int64_t g0, int64_t n0, Ahead ahead) {
  const int64_t K = a.K;
  const float* x0 = xt + g0 * group_stride(K);
  const float* x1 = x0 + group_stride(K);
  const float* x2 = x1 + group_stride(K);
  const float* w = a.w + n0 * K;
  Vec a00(0.f), a01(0.f), a02(0.f), a03(0.f), a10(0.f), a11(0.f), a12(0.f), a13(0.f);
  Vec a20(0.f), a21(0.f), a22(0.f), a23(0.f);
  for (int64_t k = 0; k < K; ++k) {
    if (k % 16 == 0) ahead.step();
    const Vec u = Vec::loadu(x0 + k * L), v = Vec::loadu(x1 + k * L), t = Vec::loadu(x2 + k * L);
#define BATCHGEN_COLUMN(j)               \
  {                                      \
    const Vec b(w[j * K + k]);           \
    a0##j = at::vec::fmadd(u, b, a0##j); \
    a1##j = at::vec::fmadd(v, b, a1##j); \
    a2##j = at::vec::fmadd(t, b, a2##j); \
  }
    BATCHGEN_COLUMN(0) BATCHGEN_COLUMN(1) BATCHGEN_COLUMN(2) BATCHGEN_COLUMN(3)
#undef BATCHGEN_COLUMN
  }
  const Vec acc[3][kTripleCols] = {{a00, a01, a02, a03}, {a10, a11, a12, a13}, {a20, a21, a22, a23}};
  store_tile<3, kTripleCols>(a, acc, g0, n0);
}

// Groups [g0, g0 + MV) against columns [n0, n0 + W) in tiles of NR columns (the last one narrower); tile t of
// the pass gets ahead(t).
template <int MV, int NR, int W, typename A>
void pass_tiles(const Linear& a, const float* xt, int64_t g0, int64_t n0, A&& ahead, int t = 0) {
  if constexpr (W > 0) {
    constexpr int n = W < NR ? W : NR;
    row_lanes<MV, n>(a, xt, g0, n0, ahead(t));
    pass_tiles<MV, NR, W - n>(a, xt, g0, n0 + n, ahead, t + 1);
  }
}

}  // namespace
}  // namespace batchgen_cpu
