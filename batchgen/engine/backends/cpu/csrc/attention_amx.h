// Causal prefill attention in AMX tiles (bf16), on CPUs with amx_bf16: attention.cpp's packed step, computed
// 16 query rows at a time with the keys as the tiles' rows, so that nothing of a block but one step of 32 keys
// ever leaves the tiles and the registers.
//
// Per (sequence, KV head) the keys are packed as rows [pos][D] and the values transposed, [D][32 keys] per run of
// 32 keys. A tile of 16 query rows (all query heads of the KV head, token after token) is packed transposed, Q^T
// in VNNI pairs, and walks its keys 32 at a time:
//   S^T (32 keys x 16 rows, two fp32 tiles) = K (A tiles, straight from the packed rows) . Q^T;
//   the two tiles are stored (2 KiB, L1) and read back a key at a time: each vector holds one key's score for
//   the 16 rows, so the online softmax's max, sum and rescale are lane-wise (no horizontal reductions), and
//   the probabilities are written as P^T in VNNI pairs (1 KiB), the B tile of
//   O^T (D x 16 rows) += V^T (A tiles of 16 dims x 32 keys) . P^T, accumulated in tiles across all steps when
//   D <= 64 (four tiles), else in L1 through one tile per 16 dims.
// A row's running max moves only when a step's scores exceed it by kRescaleLog2 doublings, as in the brgemm
// path, so the output tiles are rescaled (stored, scaled, reloaded) only then. Scores, softmax and the
// accumulation are fp32; probabilities are rounded to bf16 for P.V, as the brgemm path does.
// The next step's scores are issued before this step's softmax. Measured here, the tile multiplies and 512-bit
// vector work hardly overlap (they share a port): a step costs its 8 multiplies plus its softmax, which the
// exponential's integer-exponent form (exp2_fast) and lane-wise reductions keep short.
#pragma once

#include "amx.h"

#if defined(BATCHGEN_AMX)

#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <limits>

#include "varlen.h"
#include "vec.h"

namespace batchgen_cpu {
namespace amx {

using bf16 = at::BFloat16;

constexpr int kKeys = 32;  // keys per P^T tile (a bf16 pair per row) and per packed run of V^T

// Whether a step runs here: bf16 pairs of 32 dims per A tile, and q's rows within 32-bit byte offsets of its
// start (the query rows are addressed by them).
inline bool supports(int64_t head_dim, int64_t q_bytes) {
  return head_dim % 32 == 0 && head_dim <= kMaxDim && q_bytes < (int64_t{1} << 31) && tiles_permitted();
}

// 16 words (32 bits) at the 16 addresses in lo (8) and hi (8).
inline __m512i gather16(__m512i lo, __m512i hi) {
  const __m256i a = _mm512_i64gather_epi32(lo, nullptr, 1), b = _mm512_i64gather_epi32(hi, nullptr, 1);
  return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
}

// Block b of sequence s, KV head h: keys as rows of D at keys[pos * D], and values transposed in runs of 32 keys,
// vt[(pos / 32) * 32 * D + d * 32 + pos % 32] (an A tile of 16 dims is then 1 KiB in a row, where rows a whole
// context apart would fall in one L1 set); zero past the context.
inline void pack_block(const Step<bf16>& a, const Seq& s, int64_t h, int64_t b, bf16* keys, bf16* vt) {
  const int64_t N = s.kv_block, D = a.head_dim, first = b * N;
  const int64_t count = std::min(N, s.prefix + s.q_len - first);
  for (int64_t n = 0; n < N; ++n)
    std::memcpy(keys + (first + n) * D, n < count ? kv_row(a, s, h, first + n, false) : zero_row(), D * 2);
  // Word w of 32 keys' value rows (dims 2w and 2w + 1, the rows anywhere) in two gathers, then the even and the
  // odd halves of the 32 words are the two dims' runs of 32 keys.
  alignas(64) int16_t even_idx[32], odd_idx[32];
  for (int i = 0; i < 32; ++i) {
    even_idx[i] = 2 * i;
    odd_idx[i] = 2 * i + 1;
  }
  const __m512i even = _mm512_load_si512(even_idx), odd = _mm512_load_si512(odd_idx), word = _mm512_set1_epi64(4);
  for (int64_t n0 = 0; n0 < N; n0 += kKeys) {
    alignas(64) int64_t rows[kKeys];
    for (int i = 0; i < kKeys; ++i)
      rows[i] = reinterpret_cast<int64_t>(n0 + i < count ? kv_row(a, s, h, first + n0 + i, true) : zero_row());
    __m512i r0 = _mm512_load_si512(rows), r1 = _mm512_load_si512(rows + 8);
    __m512i r2 = _mm512_load_si512(rows + 16), r3 = _mm512_load_si512(rows + 24);
    bf16* dst = vt + (first + n0) * D;
    for (int64_t w = 0; w < D / 2; ++w) {
      const __m512i lo = gather16(r0, r1), hi = gather16(r2, r3);
      _mm512_storeu_si512(dst + 2 * w * kKeys, _mm512_permutex2var_epi16(lo, even, hi));
      _mm512_storeu_si512(dst + (2 * w + 1) * kKeys, _mm512_permutex2var_epi16(lo, odd, hi));
      r0 = _mm512_add_epi64(r0, word);
      r1 = _mm512_add_epi64(r1, word);
      r2 = _mm512_add_epi64(r2, word);
      r3 = _mm512_add_epi64(r3, word);
    }
  }
}

// A thread's scratch: Q^T words, a step's scores (a key per row), P^T pairs, O^T (a dim per row), and one 16-dim
// slice of a step's P.V where O^T does not fit the tiles.
struct alignas(64) Scratch {
  uint32_t qt[kMaxDim / 2 * kRows];
  float s[kKeys * kRows];
  uint32_t p[kKeys / 2 * kRows];
  float o[kMaxDim * kRows];
  float slice[kRows * kRows];
};

// The lanes (query rows) that see key `pos`.
inline __mmask16 sees(__m512i lanes_limit, int64_t pos) {
  return _mm512_cmpgt_epi32_mask(lanes_limit, _mm512_set1_epi32(static_cast<int>(pos)));
}

// The largest visible score of each row over a step's keys (scores s, a key per row, from key k0).
inline __m512 step_max(const float* s, int64_t k0, __m512i lanes_limit) {
  __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int i = 0; i < kKeys; ++i) top = _mm512_mask_max_ps(top, sees(lanes_limit, k0 + i), top, _mm512_load_ps(s + i * kRows));
  return top;
}

// p = 2^(s * scale2 - shift) over a step's keys (0 where a row does not see the key), written as P^T in VNNI
// pairs (a word per row: keys 2j and 2j + 1); returns each row's sum of p, and in `top` its largest visible
// s * scale2.
template <bool Masked>
inline __m512 exp_step(const float* s, int64_t k0, __m512i lanes_limit, __m512 scale2, __m512 shift, uint32_t* p,
                       __m512& top) {
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                              23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  __m512 sum = _mm512_setzero_ps(), x_max = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int i = 0; i < kKeys; i += 2) {
    const __m512 x0 = _mm512_load_ps(s + i * kRows), x1 = _mm512_load_ps(s + (i + 1) * kRows);
    __m512 p0 = exp2_fast(_mm512_fmsub_ps(x0, scale2, shift)), p1 = exp2_fast(_mm512_fmsub_ps(x1, scale2, shift));
    if constexpr (Masked) {
      const __mmask16 v0 = sees(lanes_limit, k0 + i), v1 = sees(lanes_limit, k0 + i + 1);
      x_max = _mm512_mask_max_ps(_mm512_mask_max_ps(x_max, v0, x_max, x0), v1, x_max, x1);
      p0 = _mm512_maskz_mov_ps(v0, p0);
      p1 = _mm512_maskz_mov_ps(v1, p1);
    } else {
      x_max = _mm512_max_ps(x_max, _mm512_max_ps(x0, x1));
    }
    sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
    const __m512i pair = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);  // [p0 | p1] as bf16
    _mm512_store_si512(p + (i / 2) * kRows, _mm512_permutexvar_epi16(interleave, pair));
  }
  top = _mm512_mul_ps(x_max, scale2);
  return sum;
}

// The output tiles 0..3 by a run-time index: the intrinsics name a tile in their assembly text, so each needs
// its own literal (the switch folds away in the unrolled loops below).
#define BATCHGEN_OUT_TILE(t, op) \
  switch (t) {                   \
    case 0: op(0); break;        \
    case 1: op(1); break;        \
    case 2: op(2); break;        \
    default: op(3);              \
  }
inline void zero_out(int t) {
#define OP(i) _tile_zero(i)
  BATCHGEN_OUT_TILE(t, OP)
#undef OP
}
inline void store_out(int t, float* p) {
#define OP(i) _tile_stored(i, p, 64)
  BATCHGEN_OUT_TILE(t, OP)
#undef OP
}
inline void load_out(int t, const float* p) {
#define OP(i) _tile_loadd(i, p, 64)
  BATCHGEN_OUT_TILE(t, OP)
#undef OP
}
inline void accumulate_out(int t) {  // tile t += tile 7 (A) . tile 6 (B)
#define OP(i) _tile_dpbf16ps(i, 7, 6)
  BATCHGEN_OUT_TILE(t, OP)
#undef OP
}
#undef BATCHGEN_OUT_TILE

// O^T (a dim per row, a query row per lane) times each query row's factor.
template <int OutTiles>
inline void rescale_output(Scratch& w, int64_t D, __m512 alpha) {
  for (int t = 0; t < OutTiles; ++t) store_out(t, w.o + t * 16 * kRows);
  for (int64_t d = 0; d < (OutTiles > 0 ? OutTiles * 16 : D); ++d)
    _mm512_store_ps(w.o + d * kRows, _mm512_mul_ps(_mm512_load_ps(w.o + d * kRows), alpha));
  for (int t = 0; t < OutTiles; ++t) load_out(t, w.o + t * 16 * kRows);
}

// Tiles: 0-3 O^T (or tile 0 one 16-dim slice of it), 4-5 the scores, 6 the B operand (Q^T, then P^T), 7 the A
// operand (K, then V^T).
// Rows r0 .. r0 + 15 of a work item (rows past `rows` are padding): query head h * G + (r0 + r) % G of token
// t0 + (r0 + r) / G, over the keys and transposed values packed for (s, h). OutTiles: D / 16 where O^T lives in
// tiles 0-3 (D <= 64), else 0 (O^T in w.o).
template <int OutTiles>
void attend_tile(const Step<bf16>& a, const Seq& s, int64_t h, int64_t t0, int64_t r0, int64_t rows,
                 const bf16* keys, const bf16* vt, Scratch& w) {
  const int64_t G = a.group, D = a.head_dim;
  alignas(64) int32_t q_rows[kRows];  // byte offsets from a.q
  alignas(64) int32_t limit[kRows];
  for (int r = 0; r < kRows; ++r) {
    const int64_t row = r0 + std::min<int64_t>(r, rows - 1), t = t0 + row / G;
    q_rows[r] = static_cast<int32_t>(((s.q_start + t) * a.q_row + (h * G + row % G) * a.q_head) * 2);
    limit[r] = static_cast<int32_t>(s.prefix + t + 1);  // the keys the row sees; padding rows copy the last
  }
  // Q^T: word i (dims 2i, 2i + 1) of the 16 rows at qt[i * 16], padding rows zero; 32 dims of the 16 rows (a
  // vector each) transposed at a time, cheaper than gathering one word of the 16 rows at a time.
  for (int64_t i0 = 0; i0 < D / 2; i0 += kRows) {
    __m512i words[kRows];
    for (int r = 0; r < kRows; ++r)
      words[r] = r < rows ? _mm512_loadu_si512(reinterpret_cast<const char*>(a.q) + q_rows[r] + i0 * 4)
                          : _mm512_setzero_si512();
    transpose16x16(words);
    for (int j = 0; j < kRows; ++j) _mm512_store_si512(w.qt + (i0 + j) * kRows, words[j]);
  }
  const __m512i lanes_limit = _mm512_load_si512(limit);
  const int64_t all_see = limit[0], last = limit[kRows - 1];
  const __m512 scale2 = _mm512_set1_ps(a.scale * kLog2e), ones = _mm512_set1_ps(1.f);
  __m512 m = _mm512_setzero_ps(), l = _mm512_setzero_ps();  // set by the first step
  for (int t = 0; t < OutTiles; ++t) zero_out(t);
  if constexpr (OutTiles == 0) std::memset(w.o, 0, sizeof(float) * D * kRows);

  // S^T = K . Q^T for keys k0 .. k0 + 31: the first 16 in tile 4, the next 16 in tile 5.
  auto scores = [&](int64_t k0) {
    _tile_zero(4);
    _tile_zero(5);
    const bf16* k_rows = keys + k0 * D;
    for (int64_t kk = 0; kk < D / 32; ++kk) {
      _tile_loadd(6, w.qt + kk * 16 * kRows, 64);
      _tile_loadd(7, k_rows + kk * 32, D * 2);
      _tile_dpbf16ps(4, 7, 6);
      _tile_loadd(7, k_rows + 16 * D + kk * 32, D * 2);
      _tile_dpbf16ps(5, 7, 6);
    }
  };
  scores(0);
  for (int64_t k0 = 0; k0 < last; k0 += kKeys) {
    // This step's scores leave the tiles, and the next step's go in while the vector units run the softmax.
    _tile_stored(4, w.s, 64);
    _tile_stored(5, w.s + 16 * kRows, 64);
    if (k0 + kKeys < last) scores(k0 + kKeys);

    // The online softmax, lane-wise: keys at or past a row's limit count as absent.
    const bool masked = k0 + kKeys > all_see;
    auto exp_scores = [&](__m512 shift, __m512& top) {
      return masked ? exp_step<true>(w.s, k0, lanes_limit, scale2, shift, w.p, top)
                    : exp_step<false>(w.s, k0, lanes_limit, scale2, shift, w.p, top);
    };
    __m512 top;
    if (k0 == 0) {  // every row sees key 0: the first step sets every row's max
      m = _mm512_mul_ps(step_max(w.s, k0, lanes_limit), scale2);
      l = exp_scores(m, top);
    } else {
      // Against the running max first; where a row's scores pass it by kRescaleLog2 doublings the max moves,
      // and the step is done again (rare once a row has seen a few steps).
      __m512 sum = exp_scores(m, top);
      const __mmask16 grow = _mm512_cmp_ps_mask(top, _mm512_add_ps(m, _mm512_set1_ps(kRescaleLog2)), _CMP_GT_OQ);
      if (grow) {
        const __m512 m_new = _mm512_mask_mov_ps(m, grow, top);
        const __m512 alpha = _mm512_mask_mov_ps(ones, grow, exp2_ps<6>(_mm512_sub_ps(m, m_new)));
        rescale_output<OutTiles>(w, D, alpha);
        l = _mm512_mul_ps(l, alpha);
        m = m_new;
        sum = exp_scores(m, top);
      }
      l = _mm512_add_ps(l, sum);
    }

    // O^T += V^T . P^T
    _tile_loadd(6, w.p, 64);
    const bf16* v_runs = vt + k0 * D;
    if constexpr (OutTiles > 0) {
      for (int t = 0; t < OutTiles; ++t) {
        _tile_loadd(7, v_runs + t * 16 * kKeys, 64);
        accumulate_out(t);
      }
    } else {
      for (int64_t dt = 0; dt < D / 16; ++dt) {
        _tile_zero(0);
        _tile_loadd(7, v_runs + dt * 16 * kKeys, 64);
        _tile_dpbf16ps(0, 7, 6);
        _tile_stored(0, w.slice, 64);
        float* o = w.o + dt * 16 * kRows;
        for (int d = 0; d < 16; ++d)
          _mm512_store_ps(o + d * kRows, _mm512_add_ps(_mm512_load_ps(o + d * kRows), _mm512_load_ps(w.slice + d * kRows)));
      }
    }
  }

  for (int t = 0; t < OutTiles; ++t) store_out(t, w.o + t * 16 * kRows);
  alignas(64) float inv[kRows];
  _mm512_store_ps(inv, reciprocal_ps(l));
  bf16* dst[kRows];  // the output rows: row r is column r of O^T, 16 dims of the 16 rows transposed at a time
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = r0 + r, t = t0 + row / G;
    dst[r] = a.out + (s.q_start + t) * a.out_row + (h * G + row % G) * a.out_head;
  }
  for (int64_t d = 0; d < D; d += 16) {
    __m512i dims[kRows];
    for (int j = 0; j < kRows; ++j) dims[j] = _mm512_load_si512(w.o + (d + j) * kRows);
    transpose16x16(dims);
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 x = _mm512_mul_ps(_mm512_castsi512_ps(dims[r]), _mm512_set1_ps(inv[r]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst[r] + d), (__m256i)_mm512_cvtneps_pbh(x));
    }
  }
}

// Query rows [t0, t1) of sequence s (all G query heads of KV head h per token), 16 rows a tile.
inline void attend_item(const Step<bf16>& a, const Seq& s, int64_t h, int64_t t0, int64_t t1, const bf16* keys,
                        const bf16* vt, Scratch& w) {
  const int64_t rows = (t1 - t0) * a.group;
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const int64_t n = std::min<int64_t>(kRows, rows - r0);
    switch (a.head_dim) {
      case 32: attend_tile<2>(a, s, h, t0, r0, n, keys, vt, w); break;
      case 64: attend_tile<4>(a, s, h, t0, r0, n, keys, vt, w); break;
      default: attend_tile<0>(a, s, h, t0, r0, n, keys, vt, w);
    }
  }
}

}  // namespace amx
}  // namespace batchgen_cpu

#endif
