// Paged decode attention with the scores in AMX tiles (bf16 caches, CPUs with amx_bf16): decode.cpp's work items
// (sequence, KV head, split), the G query heads of the KV head in the lanes of one vector.
//
// A chunk of 16 keys is one A tile read in place from the paged cache (16 rows of a block, the cache's row
// stride apart), multiplied by Q^T (B: the heads' words in lanes 0..G-1) into S^T, 16 keys x 16 lanes. Stored
// (1 KiB) and read back a key at a time, each vector holds one key's score for every head, so the online
// softmax's max, sum and rescale are lane-wise, with no horizontal reductions; the portable path's per-head sums
// of 16 products cost more than the rest of its step. P.V stays in fp32 vector FMAs (each value row converted
// once and multiplied by every head's broadcast probability). The result is the portable path's partial: the
// unnormalised output, each head's max (natural log units) and sum, merged in split order as before.
#pragma once

#include "amx.h"

#if defined(BATCHGEN_AMX)

#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <limits>

#include "paged.h"
#include "vec.h"

namespace batchgen_cpu {
namespace amx {

// Whether a decode step runs here: 32 dims per A tile, a chunk of 16 keys within one block, at most 16 heads per
// KV head (the lanes), and no soft cap (the portable path applies it).
inline bool supports_decode(int64_t head_dim, int64_t block_size, int64_t group, double softcap) {
  return head_dim % 32 == 0 && head_dim <= kMaxDim && block_size % kRows == 0 && group <= kRows &&
         softcap == 0.0 && tiles_permitted();
}

// A thread's scratch: Q^T words (lanes past the group stay zero), a chunk's scores and probabilities (a key per
// row, a head per lane). The output goes straight to the item's partial.
struct alignas(64) DecodeScratch {
  uint32_t qt[kMaxDim / 2 * kRows] = {};
  float s[kRows * kRows];
  float p[kRows * kRows];
};

// o[g] += sum over keys i in [lo, hi) of p[i][g0 + g] * row_i, for HB heads and V = 16 * DV dims from `dim`.
template <int HB, int DV>
inline void accumulate_values(float* o, int64_t D, const float* p, int g0, const at::BFloat16* const* rows, int lo,
                              int hi, int64_t dim) {
  __m512 acc[HB][DV];
  for (int g = 0; g < HB; ++g)
    for (int j = 0; j < DV; ++j) acc[g][j] = _mm512_loadu_ps(o + (g0 + g) * D + dim + 16 * j);
  for (int i = lo; i < hi; ++i) {
    __m512 v[DV];
    for (int j = 0; j < DV; ++j) v[j] = bf16x16_to_ps(rows[i] + dim + 16 * j);
    for (int g = 0; g < HB; ++g) {
      const __m512 pg = _mm512_set1_ps(p[i * kRows + g0 + g]);
      for (int j = 0; j < DV; ++j) acc[g][j] = _mm512_fmadd_ps(pg, v[j], acc[g][j]);
    }
  }
  for (int g = 0; g < HB; ++g)
    for (int j = 0; j < DV; ++j) _mm512_storeu_ps(o + (g0 + g) * D + dim + 16 * j, acc[g][j]);
}

// o (G, D) += P . V over the chunk's keys [lo, hi): heads 4 at a time, dims 64 at a time (16 accumulators).
inline void chunk_values(float* o, int64_t G, int64_t D, const float* p, const at::BFloat16* const* rows, int lo,
                         int hi) {
  for (int g0 = 0; g0 < G; g0 += 4) {
    const int64_t heads = std::min<int64_t>(4, G - g0);
    for (int64_t dim = 0; dim < D; dim += 64) {
      const int64_t dv = std::min<int64_t>(4, (D - dim) / 16);
      with_constant<4>(heads, [&](auto hb) {
        if (dv == 4) accumulate_values<hb, 4>(o, D, p, g0, rows, lo, hi, dim);
        else accumulate_values<hb, 2>(o, D, p, g0, rows, lo, hi, dim);  // D % 32 == 0: a tail of 32 dims
      });
    }
  }
}

// One item: keys [first, last) of row `seq` for KV head `head`, the G heads of q at q (head_stride apart). The
// keys' rows are at k_rows(pos) and v_rows(pos) (16 positions from a multiple of 16 lie in one block, row_stride
// elements apart). Writes o (G, D) unnormalised, each head's max m (natural log) and sum l.
template <typename Rows>
void decode_item(const at::BFloat16* q, int64_t head_stride, int64_t G, int64_t D, float scale, int64_t first,
                 int64_t last, int64_t row_stride, Rows&& rows_at, DecodeScratch& w, float* o, float* m_out,
                 float* l_out) {
  for (int64_t g = 0; g < G; ++g) {
    const auto* words = reinterpret_cast<const uint32_t*>(q + g * head_stride);
    for (int64_t i = 0; i < D / 2; ++i) w.qt[i * kRows + g] = words[i];
  }
  std::memset(o, 0, sizeof(float) * G * D);
  const __m512 scale2 = _mm512_set1_ps(scale * kLog2e), ones = _mm512_set1_ps(1.f);
  __m512 m = _mm512_setzero_ps(), l = _mm512_setzero_ps();
  const at::BFloat16* values[kRows];
  for (int64_t c0 = first / kRows * kRows; c0 < last; c0 += kRows) {
    const at::BFloat16* k_rows = rows_at(c0, false);
    _tile_zero(0);
    for (int64_t kk = 0; kk < D / 32; ++kk) {
      _tile_loadd(1, w.qt + kk * 16 * kRows, 64);
      _tile_loadd(2, k_rows + kk * 32, row_stride * 2);
      _tile_dpbf16ps(0, 2, 1);
    }
    _tile_stored(0, w.s, 64);
    const int lo = static_cast<int>(std::max(first, c0) - c0), hi = static_cast<int>(std::min(last, c0 + kRows) - c0);
    const at::BFloat16* v_rows = rows_at(c0, true);
    if (c0 + kRows < last) {  // the next chunk's rows, from anywhere in the cache, fetched while this one computes
      const at::BFloat16* next_k = rows_at(c0 + kRows, false);
      const at::BFloat16* next_v = rows_at(c0 + kRows, true);
      for (int i = 0; i < kRows; ++i) {
        prefetch(next_k + i * row_stride, D * 2);
        prefetch(next_v + i * row_stride, D * 2);
      }
    }
    for (int i = lo; i < hi; ++i) values[i] = v_rows + i * row_stride;

    __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int i = lo; i < hi; ++i) top = _mm512_max_ps(top, _mm512_load_ps(w.s + i * kRows));
    top = _mm512_mul_ps(top, scale2);
    // A head's max moves only when the chunk passes it by kRescaleLog2 doublings (then its output so far is
    // rescaled), so p stays below 2^8 and the rescaling is rare. The item's first chunk sets every head's max.
    __m512 alpha = ones;
    if (c0 <= first) m = top;
    else alpha = raise_max(m, top, o, G, D, D);
    __m512 sum = _mm512_setzero_ps();
    for (int i = lo; i < hi; ++i) {
      const __m512 p = exp2_fast(_mm512_fmsub_ps(_mm512_load_ps(w.s + i * kRows), scale2, m));
      sum = _mm512_add_ps(sum, p);
      _mm512_store_ps(w.p + i * kRows, p);
    }
    l = _mm512_fmadd_ps(l, alpha, sum);
    chunk_values(o, G, D, w.p, values, lo, hi);
  }
  alignas(64) float mv[kRows], lv[kRows];
  _mm512_store_ps(mv, _mm512_div_ps(m, _mm512_set1_ps(kLog2e)));
  _mm512_store_ps(lv, l);
  for (int64_t g = 0; g < G; ++g) {
    m_out[g] = mv[g];
    l_out[g] = lv[g];
  }
}

}  // namespace amx
}  // namespace batchgen_cpu

#endif
