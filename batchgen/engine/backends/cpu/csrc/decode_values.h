// The decode op's value pass: a split's probabilities times its cache rows added into each query head's output,
// every sum in registers over a chunk (fp32 tiles, or decode_dots.h's paired spans for the dot tiles).
#pragma once

#include "decode_ahead.h"
#include "decode_dots.h"
#include "paged.h"
#include "vec.h"

#include <cmath>

namespace batchgen_cpu {

// o[h][d0, d0 + NV vectors) = (fresh ? 0 : o) + sum_c p[h][c] row_c[d0...] for HB heads (p's rows `stride` apart):
// every sum in registers across all n rows (fp32, or bf16 widened as loaded), one row after another.
template <int HB, int NV, typename R>
inline void value_span(float* o, int64_t V, int64_t d0, const float* p, int64_t stride, const R* const* rows,
                       int64_t n, bool fresh, Ahead& ahead_ref) {
  constexpr int L = Vec::size();
  Ahead ahead = ahead_ref;  // in registers over the loop
  Vec acc[HB][NV];
  for (int hb = 0; hb < HB; ++hb)
    for (int j = 0; j < NV; ++j) acc[hb][j] = fresh ? Vec(0.f) : Vec::loadu(o + hb * V + d0 + j * L);
  for (int64_t c = 0; c < n; ++c) {
    ahead();
    const R* row = rows[c] + d0;
    Vec pc[HB];
    for (int hb = 0; hb < HB; ++hb) pc[hb] = Vec(p[hb * stride + c]);
    for (int j = 0; j < NV; ++j) {
      const Vec v = load_vec(row + j * L);
      for (int hb = 0; hb < HB; ++hb) acc[hb][j] = at::vec::fmadd(pc[hb], v, acc[hb][j]);
    }
  }
  ahead_ref = ahead;
  for (int hb = 0; hb < HB; ++hb)
    for (int j = 0; j < NV; ++j) acc[hb][j].store(o + hb * V + d0 + j * L);
}

// Value tiles: 3 heads x 4 vectors (12 sums; AVX2 has 16 registers).
constexpr int kSpanHeads = 3, kSpanVectors = 4;

// o (a group's heads, value_width) (+)= p . rows over n rows.
template <typename R>
inline void group_values(const Heads& h, float* o, const float* p, int64_t stride, const R* const* rows,
                         int64_t n, bool fresh, Ahead& ahead) {
  constexpr int L = Vec::size();
  const int64_t V = h.value_width;
  in_tiles<kSpanHeads>(h.count, [&](auto heads, int64_t g) {
    float* og = o + g * V;
    const float* pg = p + g * stride;
    int64_t d = 0;
    for (; d + kSpanVectors * L <= V; d += kSpanVectors * L)
      value_span<heads, kSpanVectors>(og, V, d, pg, stride, rows, n, fresh, ahead);
    if (const int64_t whole = (V - d) / L; whole > 0) {
      with_constant<kSpanVectors - 1>(whole, [&](auto nv) {
        value_span<heads, nv>(og, V, d, pg, stride, rows, n, fresh, ahead);
      });
      d += whole * L;
    }
    for (; d < V; ++d)  // head dims not a multiple of the vector: the rest one product at a time (fma: as score_tile's)
      for (int hb = 0; hb < heads; ++hb) {
        float acc = fresh ? 0.f : og[hb * V + d];
        for (int64_t c = 0; c < n; ++c) acc = std::fma(pg[hb * stride + c], static_cast<float>(rows[c][d]), acc);
        og[hb * V + d] = acc;
      }
  });
}

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
// The dot tiles' o (+)= p . rows: bf16 probabilities (a zero after an odd n) and rows, value_width a multiple of 32.
inline void group_values(const Heads& h, float* o, const at::BFloat16* p, int64_t stride,
                         const at::BFloat16* const* rows, int64_t n, bool fresh, Ahead& ahead) {
  const int64_t V = h.value_width;
  in_tiles<kDotHeads>(h.count, [&](auto heads, int64_t g) {
    int64_t d = 0;
    for (; d + 64 <= V; d += 64)
      paired_value_span<heads, 2>(o + g * V, V, d, p + g * stride, stride, rows, n, fresh, ahead);
    if (d < V) paired_value_span<heads, 1>(o + g * V, V, d, p + g * stride, stride, rows, n, fresh, ahead);
  });
}
#endif

}  // namespace batchgen_cpu
