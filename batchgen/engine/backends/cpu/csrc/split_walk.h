// One split walked in chunks of kChunk fp32 rows with an online softmax (the latent decode op): each chunk's
// scores in paged.h's register tiles, then its values, the outputs rescaled as the running max moves.
#pragma once

#include "paged.h"
#include "vec.h"

#include <algorithm>
#include <cmath>

namespace batchgen_cpu {

// scores (heads, kChunk) of the chunk's n rows, scaled and (with a softcap) capped.
inline void chunk_scores(const Heads& h, const float* q32, const float* const* rows, int64_t n, float* s) {
  const int64_t W = h.key_width;
  in_tiles<kScoreHeads>(h.count, [&](auto heads, int64_t g) {
    in_tiles<kScoreRows>(n, [&](auto keys, int64_t c) {
      score_tile<heads, keys>(q32 + g * W, W, rows + c, s + g * kChunk + c);
    });
  });
  const float scale = h.scale, cap = h.softcap;
  for (int64_t g = 0; g < h.count; ++g) {
    float* row = s + g * kChunk;
    if (cap > 0.f)
      at::vec::map([scale, cap](Vec x) { return Vec(cap) * (x * Vec(scale / cap)).tanh(); }, row, row, n);
    else
      at::vec::map([scale](Vec x) { return x * Vec(scale); }, row, row, n);
  }
}

// Folds chunk scores s (H, n) into each head's running max m and sum l: s becomes p = e^(s - m_new), and
// rescale[h] = e^(m_old - m_new) is what the head's output so far must be multiplied by.
inline void online_softmax(float* s, int64_t n, int64_t heads, float* m, float* l, float* rescale) {
  for (int64_t h = 0; h < heads; ++h) {
    float* row = s + h * kChunk;
    const float mx = std::max(m[h], at::vec::reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); },
                                                               row, n));
    at::vec::map([mx](Vec x) { return (x - Vec(mx)).exp(); }, row, row, n);
    rescale[h] = std::exp(m[h] - mx);  // 0 for the first chunk (m = -inf)
    l[h] = l[h] * rescale[h] + at::vec::reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, row, n);
    m[h] = mx;
  }
}

// o[h] = rescale[h] o[h] + sum_c p[h][c] row_c[:V] for HB heads, 16 dims of each held in registers at a time.
template <int HB>
inline void value_tile(float* o, int64_t V, const float* p, const float* rescale, const float* const* rows,
                       int64_t n) {
  int64_t d = 0;
  for (; d + kStep <= V; d += kStep) {
    Vec acc[HB][2];
    for (int hb = 0; hb < HB; ++hb) {
      acc[hb][0] = Vec::loadu(o + hb * V + d) * Vec(rescale[hb]);
      acc[hb][1] = Vec::loadu(o + hb * V + d + Vec::size()) * Vec(rescale[hb]);
    }
    for (int64_t c = 0; c < n; ++c) {
      const Vec v0 = Vec::loadu(rows[c] + d), v1 = Vec::loadu(rows[c] + d + Vec::size());
      for (int hb = 0; hb < HB; ++hb) {
        const Vec pc(p[hb * kChunk + c]);
        acc[hb][0] = at::vec::fmadd(pc, v0, acc[hb][0]);
        acc[hb][1] = at::vec::fmadd(pc, v1, acc[hb][1]);
      }
    }
    for (int hb = 0; hb < HB; ++hb) {
      acc[hb][0].store(o + hb * V + d);
      acc[hb][1].store(o + hb * V + d + Vec::size());
    }
  }
  for (; d < V; ++d)
    for (int hb = 0; hb < HB; ++hb) {
      float acc = o[hb * V + d] * rescale[hb];
      for (int64_t c = 0; c < n; ++c) acc += p[hb * kChunk + c] * rows[c][d];
      o[hb * V + d] = acc;
    }
}

// Starts one split's o (heads, value_width), max m and sum l: nothing attended yet.
inline void start_split(const Heads& h, float* o, float* m, float* l) {
  std::fill(o, o + h.count * h.value_width, 0.f);
  std::fill(m, m + h.count, kNegInf);
  std::fill(l, l + h.count, 0.f);
}

// Folds a chunk's n rows (keys[c], values[c]: fp32) into o, m and l; q32 holds the heads' fp32 queries.
inline void attend_chunk(const Heads& h, const float* q32, Scratch& w, const float* const* keys,
                         const float* const* values, int64_t n, float* o, float* m, float* l) {
  const int64_t V = h.value_width;
  chunk_scores(h, q32, keys, n, w.scores.data());
  online_softmax(w.scores.data(), n, h.count, m, l, w.rescale.data());
  in_tiles<kValueHeads>(h.count, [&](auto heads, int64_t g) {
    value_tile<heads>(o + g * V, V, w.scores.data() + g * kChunk, w.rescale.data() + g, values, n);
  });
}

// The rows [first, last) of one split: o (heads, value_width) unnormalised, with each head's max m and sum l.
// chunk(first, last, keys, values) points keys[c] and values[c] at the fp32 rows of position first + c;
// ahead(first, last) prefetches those rows.
template <typename Chunk, typename Ahead>
void attend_rows(const Heads& h, Scratch& w, int64_t first, int64_t last, Chunk&& chunk, Ahead&& ahead, float* o,
                 float* m, float* l) {
  start_split(h, o, m, l);
  const float* keys[kChunk];
  const float* values[kChunk];
  for (int64_t c0 = first; c0 < last; c0 += kChunk) {
    const int64_t c1 = std::min(last, c0 + kChunk), n = c1 - c0;
    chunk(c0, c1, keys, values);
    if (c1 < last) ahead(c1, std::min(last, c1 + kChunk));
    attend_chunk(h, w.q32.data(), w, keys, values, n, o, m, l);
  }
}

}  // namespace batchgen_cpu
