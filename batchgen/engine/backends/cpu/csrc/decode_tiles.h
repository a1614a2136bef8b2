// Both paged decode ops' items with both products in AMX tiles (bf16 caches, CPUs with amx_bf16): decode.cpp's
// grouped-query items (a sequence's split for one or more KV heads) and latent_decode.cpp's MLA items (a split
// for the one latent head). An item's query heads sit in the lanes of a tile, 16 a group, in parts: a part's
// heads attend one span of the key rows and output one span of the value rows. MLA has one part (every head
// on the whole latent row, the values its prefix); grouped-query attention one part per KV head of the item
// (its GQA group; the rows hold every KV head side by side, so a part's Q^T is zero outside its head's dims and
// the multiply sums exact zeros there: a head's result is the same alone or beside others).
//
// An item walks its keys in blocks of up to 256, and each block in two passes, per group of 16 heads:
//   scores: S^T (16 keys x 16 heads a tile, four tiles in flight) = K . Q^T, K's A tiles read in place from the
//   paged cache (16 rows of a block, the cache's row stride apart), Q^T packed once per item in VNNI words with
//   the heads in the lanes. Stored and read back a key at a time, the scores' softmax is lane-wise (no
//   horizontal reductions), against the block's exact max; the probabilities, bf16 word pairs of keys, are
//   transposed into P tiles (16 heads x 32 keys);
//   values: O (16 heads x R, fp32) += P . V, 64 value dims at a time held in four tiles over the whole block
//   (loaded and stored once a block, not once per 32 keys), V's B tiles packed per 32 keys from the rows' dims
//   in a 4 KiB buffer that stays in L1 (rows outside the item packed as zeros, so a stale cache row never meets
//   a zero probability). The packing interleaves two rows' dims within 128-bit lanes (one instruction per 32
//   dims, not a cross-lane permute), so O's columns are those dims in lane order; the item's output puts them
//   back in order.
// An fp8 cache's rows are widened to bf16 (exactly): keys 64 rows at a time into the scratch, where the A tiles
// read them; values as they are packed. A head's max moves only when a block passes it by kRescaleLog2 doublings, as in the other paths. Scores,
// softmax and accumulation are fp32; probabilities are rounded to bf16 for P.V, as the prefill tiles do. The
// result is the portable path's partial (unnormalised output, max in natural-log units, sum).
#pragma once

#include "amx.h"
#include "fp8.h"

#if defined(BATCHGEN_AMX)

#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>

namespace batchgen_cpu {
namespace amx {

constexpr int64_t kBlockKeys = 256;  // keys a block: their scores (16 KiB) and P tiles (8 KiB) stay in L1
constexpr int64_t kMaxValues = kZeroRowWidth;  // the widest value row taken: rows outside the item read zeros

// An item's query heads: `count` of them in parts of `part_heads`; part p's heads meet dims
// [p key_width, (p + 1) key_width) of the key rows and output dims [p value_width, (p + 1) value_width) of the
// value rows (both multiples of 32).
struct TileHeads {
  int64_t count, part_heads, key_width, value_width;
  int64_t parts() const { return (count + part_heads - 1) / part_heads; }
  int64_t row_width() const { return parts() * key_width; }  // W: the key rows' dims the tiles read
  int64_t values() const { return parts() * value_width; }  // R: the value rows' dims, O's width
  int64_t groups() const { return (count + kRows - 1) / kRows; }  // lane groups of 16 heads
};

// Whether an item runs here: rows of whole 32-dim A tiles, values of whole 32-dim packing steps, 16-row
// sub-blocks within one cache block.
inline bool supports_tiles(const TileHeads& h, int64_t block_size) {
  return h.key_width % 32 == 0 && h.value_width % 32 == 0 && h.values() <= kMaxValues &&
         block_size % kRows == 0 && tiles_permitted();
}

// Grouped-query decode: KV heads of `head_dim`, `group` query heads each, `kv_heads` of them an item; no soft cap
// (the portable path applies it).
inline TileHeads grouped_heads(int64_t group, int64_t head_dim, int64_t kv_heads) {
  return {group * kv_heads, group, head_dim, head_dim};
}

// KV heads a grouped-query item can take: as many as fill the 16 lanes (at least one), and the value rows'
// width allows.
inline int64_t kv_heads_per_item(int64_t group, int64_t head_dim, int64_t kv_heads) {
  const int64_t lanes = std::max<int64_t>(1, kRows / group), width = std::max<int64_t>(1, kMaxValues / head_dim);
  return std::max<int64_t>(1, std::min({kv_heads, lanes, width}));
}

// A thread's scratch, sized for the call's heads and widths (and, `widened`, for a block's rows of an fp8 cache
// as bf16); every item overwrites what it reads.
class TileScratch {
 public:
  explicit TileScratch(const TileHeads& h, bool widened = false)
      : groups_(h.groups()),
        qt_(alloc<uint32_t>(groups_ * h.row_width() / 2 * kRows)),
        o_(alloc<float>(groups_ * kRows * h.values())),
        m_(alloc<float>(groups_ * kRows)),
        l_(alloc<float>(groups_ * kRows)),
        keys_(alloc<at::BFloat16>(widened ? 4 * kRows * h.row_width() : 0)) {}

  uint32_t* qt(int64_t g, int64_t words) { return qt_.get() + g * words * kRows; }  // group g's Q^T words
  float* o(int64_t g, int64_t R) { return o_.get() + g * kRows * R; }  // group g's O (16 heads x R)
  float* m(int64_t g) { return m_.get() + g * kRows; }
  float* l(int64_t g) { return l_.get() + g * kRows; }
  at::BFloat16* keys() { return keys_.get(); }  // 64 key rows, widened (64 x W)
  alignas(64) float s[kBlockKeys * kRows];  // a block's S^T, a key per row
  alignas(64) uint32_t p[kBlockKeys / 32 * kRows * kRows];  // its P tiles: a head per row, 16 words of key pairs
  alignas(64) uint16_t v[4 * 32 * kRows];  // B tiles of 32 keys x 16 dims, four of them

 private:
  struct Free {
    void operator()(void* p) const { std::free(p); }
  };
  template <typename T>
  static std::unique_ptr<T[], Free> alloc(int64_t n) {
    if (n == 0) return nullptr;
    const size_t bytes = (static_cast<size_t>(n) * sizeof(T) + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, bytes);
    TORCH_CHECK(p != nullptr, "out of memory for the decode tiles' scratch");
    return std::unique_ptr<T[], Free>(static_cast<T*>(p));
  }
  int64_t groups_;
  std::unique_ptr<uint32_t[], Free> qt_;
  std::unique_ptr<float[], Free> o_, m_, l_;
  std::unique_ptr<at::BFloat16[], Free> keys_;
};

// The lazy rescale between blocks: where a head's (lane's) new max `top` passes its running max m by
// kRescaleLog2 doublings, m moves there and that head's output so far, row h of o (16 rows of `width` floats),
// is scaled by 2^(old m - new m). Returns the factors (1 where m stayed).
inline __m512 raise_max(__m512& m, __m512 top, float* o, int64_t width) {
  const __m512 ones = _mm512_set1_ps(1.f);
  const __mmask16 grow = _mm512_cmp_ps_mask(top, _mm512_add_ps(m, _mm512_set1_ps(kRescaleLog2)), _CMP_GT_OQ);
  if (!grow) return ones;
  const __m512 m_new = _mm512_mask_mov_ps(m, grow, top);
  const __m512 alpha = _mm512_mask_mov_ps(ones, grow, exp2_ps<6>(_mm512_sub_ps(m, m_new)));
  alignas(64) float factor[kRows];
  _mm512_store_ps(factor, alpha);
  for (int h = 0; h < kRows; ++h)
    if (factor[h] != 1.f)
      for (int64_t d = 0; d < width; d += 16)
        _mm512_storeu_ps(o + h * width + d, _mm512_mul_ps(_mm512_loadu_ps(o + h * width + d), _mm512_set1_ps(factor[h])));
  m = m_new;
  return alpha;
}

// Asks for the cache lines of `n` values from p.
template <typename C>
inline void prefetch_row(const C* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < n * static_cast<int64_t>(sizeof(C)); b += 64) _mm_prefetch(c + b, _MM_HINT_T0);
}

// S^T for N sub-blocks of 16 keys (rows at k[u], stride apart) into tiles 0..N-1, stored to s: tile 4 holds Q^T
// and 5-7 the K tiles (5 again for the fourth, once the first multiply has read it).
template <int N>
inline void block_scores(const uint32_t* qt, int64_t W, const at::BFloat16* const* k, int64_t stride, float* s) {
  _tile_zero(0);
  if constexpr (N > 1) _tile_zero(1);
  if constexpr (N > 2) _tile_zero(2);
  if constexpr (N > 3) _tile_zero(3);
  for (int64_t kk = 0; kk < W / 32; ++kk) {
    _tile_loadd(4, qt + kk * kRows * kRows, 64);
    _tile_loadd(5, k[0] + kk * 32, stride);
    _tile_dpbf16ps(0, 5, 4);
    if constexpr (N > 1) {
      _tile_loadd(6, k[1] + kk * 32, stride);
      _tile_dpbf16ps(1, 6, 4);
    }
    if constexpr (N > 2) {
      _tile_loadd(7, k[2] + kk * 32, stride);
      _tile_dpbf16ps(2, 7, 4);
    }
    if constexpr (N > 3) {
      _tile_loadd(5, k[3] + kk * 32, stride);
      _tile_dpbf16ps(3, 5, 4);
    }
  }
  _tile_stored(0, s, 64);
  if constexpr (N > 1) _tile_stored(1, s + kRows * kRows, 64);
  if constexpr (N > 2) _tile_stored(2, s + 2 * kRows * kRows, 64);
  if constexpr (N > 3) _tile_stored(3, s + 3 * kRows * kRows, 64);
}

// 32 values from p as bf16 words.
template <typename C>
inline __m512i load32(const C* p) {
  if constexpr (kFp8<C>) return fp8x32_to_bf16(p);
  else return _mm512_loadu_si512(p);
}

// O's dims [d0, d0 + 16 N) (tiles 0..N-1, N 2 or 4, loaded from and stored to o) += P . V over a block's
// chunks of 32 keys: P tile c at p + c * 256 (tile 4), V packed per chunk into v (tiles 5-7, 5 again).
// row(k): key k's value row (of C), or zeros where the key is outside the item.
template <int N, typename Row>
inline void block_values(float* o, int64_t R, int64_t d0, const uint32_t* p, int64_t chunks, Row&& row,
                         uint16_t* v) {
  using C = std::remove_cv_t<std::remove_pointer_t<decltype(row(0))>>;
  _tile_loadd(0, o + d0, R * 4);
  _tile_loadd(1, o + d0 + 16, R * 4);
  if constexpr (N > 2) {
    _tile_loadd(2, o + d0 + 32, R * 4);
    _tile_loadd(3, o + d0 + 48, R * 4);
  }
  for (int64_t c = 0; c < chunks; ++c) {
    for (int i = 0; i < kRows; ++i) {  // row i of the B tiles: keys 32c + 2i and + 1, their dims in pairs
      const auto* a = row(32 * c + 2 * i) + d0;
      const auto* b = row(32 * c + 2 * i + 1) + d0;
      __m512i x[N / 2], y[N / 2];
#if defined(__AVX512VBMI__)
      if constexpr (kFp8<C> && N == 4) {  // 64 values of a row widened at once
        fp8x64_to_bf16(a, x[0], x[1]);
        fp8x64_to_bf16(b, y[0], y[1]);
      } else
#endif
        for (int h = 0; h < N / 2; ++h) x[h] = load32(a + 32 * h), y[h] = load32(b + 32 * h);
      for (int h = 0; h < N / 2; ++h) {
        _mm512_store_si512(v + (2 * h) * 512 + i * 32, _mm512_unpacklo_epi16(x[h], y[h]));
        _mm512_store_si512(v + (2 * h + 1) * 512 + i * 32, _mm512_unpackhi_epi16(x[h], y[h]));
      }
    }
    _tile_loadd(4, p + c * kRows * kRows, 64);
    _tile_loadd(5, v, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, v + 512, 64);
    _tile_dpbf16ps(1, 4, 6);
    if constexpr (N > 2) {
      _tile_loadd(7, v + 1024, 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_loadd(5, v + 1536, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  _tile_stored(0, o + d0, R * 4);
  _tile_stored(1, o + d0 + 16, R * 4);
  if constexpr (N > 2) {
    _tile_stored(2, o + d0 + 32, R * 4);
    _tile_stored(3, o + d0 + 48, R * 4);
  }
}

// One item: keys [first, last) of one sequence; head j's query at q + j * head_stride (key_width values), the
// key and value rows of 16 positions from a multiple of 16 at key_at(pos) and value_at(pos) (row_stride elements
// of C apart: bf16, or fp8 with a scratch built `widened`). Writes head j's unnormalised output to
// o + j * value_width, its max (natural log) to m[j], sum to l[j].
template <typename C, typename KeyAt, typename ValueAt>
void tile_item(const at::BFloat16* q, int64_t head_stride, const TileHeads& heads, float scale, int64_t first,
               int64_t last, int64_t row_stride, KeyAt&& key_at, ValueAt&& value_at, TileScratch& w, float* o,
               float* m_out, float* l_out) {
  const int64_t H = heads.count, W = heads.row_width(), R = heads.values(), words = W / 2, G = heads.groups();
  const int64_t part_words = heads.key_width / 2;
  for (int64_t g = 0; g < G; ++g) {  // Q^T: word i of head g * 16 + h at qt[i * 16 + h]; zero outside its part
    uint32_t* qt = w.qt(g, words);
    for (int64_t i0 = 0; i0 < words; i0 += kRows) {  // 16 words (of one part) of the 16 heads, transposed
      const int64_t part = i0 / part_words;
      __m512i rows[kRows];
      for (int h = 0; h < kRows; ++h) {
        const int64_t head = g * kRows + h;
        rows[h] = head < H && head / heads.part_heads == part
                      ? _mm512_loadu_si512(q + head * head_stride + 2 * (i0 - part * part_words))
                      : _mm512_setzero_si512();
      }
      transpose16x16(rows);
      for (int j = 0; j < kRows; ++j) _mm512_store_si512(qt + (i0 + j) * kRows, rows[j]);
    }
    std::memset(w.o(g, R), 0, sizeof(float) * kRows * R);
  }
  const __m512 scale2 = _mm512_set1_ps(scale * kLog2e), ones = _mm512_set1_ps(1.f);
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                              23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const at::BFloat16* const zeros = zero_row();
  const int64_t start = first / kRows * kRows;
  for (int64_t b0 = start; b0 < last; b0 += kBlockKeys) {
    const int64_t lo = std::max(first, b0) - b0, hi = std::min(last, b0 + kBlockKeys) - b0;  // keys in the item
    const int64_t subs = (hi + kRows - 1) / kRows, chunks = (hi + 31) / 32;
    const C* k_cached[kBlockKeys / kRows];
    const C* v_cached[kBlockKeys / kRows];
    for (int64_t t = 0; t < subs; ++t) {
      k_cached[t] = key_at(b0 + t * kRows);
      v_cached[t] = value_at(b0 + t * kRows);
    }
    // The block's rows asked for at once, so their misses overlap each other (1.07x in a cold step's op).
    for (int64_t t = 0; t < subs; ++t)
      for (int r = 0; r < kRows; ++r) {
        prefetch_row(k_cached[t] + r * row_stride, W);
        if (v_cached[t] != k_cached[t]) prefetch_row(v_cached[t] + r * row_stride, R);
      }
    const C* const none = reinterpret_cast<const C*>(zeros);  // zero bytes are zeros in every format
    auto row = [&](int64_t k) {
      return k >= lo && k < hi ? v_cached[k / kRows] + (k % kRows) * row_stride : none;
    };
    for (int64_t g = 0; g < G; ++g) {
      const uint32_t* qt = w.qt(g, words);
      for (int64_t t = 0; t < subs; t += 4) {
        float* s = w.s + t * kRows * kRows;
        const int64_t n = std::min<int64_t>(4, subs - t);
        const at::BFloat16* k_rows[4];
        int64_t stride = row_stride;
        if constexpr (kFp8<C>) {
          for (int64_t u = 0; u < n; ++u) {
            k_rows[u] = w.keys() + u * kRows * W;
            for (int r = 0; r < kRows; ++r)
              widen_fp8(k_cached[t + u] + r * row_stride, w.keys() + (u * kRows + r) * W, W);
          }
          stride = W;
        } else {
          std::copy(k_cached + t, k_cached + t + n, k_rows);
        }
        switch (n) {
          case 1: block_scores<1>(qt, W, k_rows, stride * 2, s); break;
          case 2: block_scores<2>(qt, W, k_rows, stride * 2, s); break;
          case 3: block_scores<3>(qt, W, k_rows, stride * 2, s); break;
          default: block_scores<4>(qt, W, k_rows, stride * 2, s);
        }
      }

      // The softmax against the block's max, lane-wise (a head per lane).
      __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      for (int64_t i = lo; i < hi; ++i) top = _mm512_max_ps(top, _mm512_load_ps(w.s + i * kRows));
      top = _mm512_mul_ps(top, scale2);
      __m512 m = _mm512_load_ps(w.m(g));
      float* og = w.o(g, R);
      __m512 alpha = ones;
      if (b0 == start) m = top;  // the item's first block sets every head's max
      else alpha = raise_max(m, top, og, R);
      auto prob = [&](int64_t k) {
        return k >= lo && k < hi ? exp2_fast(_mm512_fmsub_ps(_mm512_load_ps(w.s + k * kRows), scale2, m))
                                 : _mm512_setzero_ps();
      };
      __m512 sum = _mm512_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c) {
        __m512i pairs[kRows];  // word h of pairs[i]: (p[2i][h], p[2i + 1][h]); transposed, P's rows
        for (int i = 0; i < kRows; ++i) {
          const __m512 p0 = prob(32 * c + 2 * i), p1 = prob(32 * c + 2 * i + 1);
          sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
          pairs[i] = _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
        }
        transpose16x16(pairs);
        for (int h = 0; h < kRows; ++h) _mm512_store_si512(w.p + c * kRows * kRows + h * kRows, pairs[h]);
      }
      _mm512_store_ps(w.m(g), m);
      _mm512_store_ps(w.l(g), b0 == start ? sum : _mm512_fmadd_ps(_mm512_load_ps(w.l(g)), alpha, sum));

      int64_t d0 = 0;
      for (; d0 + 64 <= R; d0 += 64) block_values<4>(og, R, d0, w.p, chunks, row, w.v);
      if (d0 < R) block_values<2>(og, R, d0, w.p, chunks, row, w.v);
    }
  }

  // Each 32 dims of O hold, by the packing's lane order, dims 0-3, 8-11, 16-19, 24-27, then 4-7, 12-15, 20-23,
  // 28-31. A head's output is its part's dims of its row.
  const __m512i first16 = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i last16 = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
  const int64_t V = heads.value_width;
  for (int64_t g = 0; g < G; ++g) {
    alignas(64) float mv[kRows], lv[kRows];
    _mm512_store_ps(mv, _mm512_div_ps(_mm512_load_ps(w.m(g)), _mm512_set1_ps(kLog2e)));
    _mm512_store_ps(lv, _mm512_load_ps(w.l(g)));
    for (int64_t h = 0; h < kRows && g * kRows + h < H; ++h) {
      const int64_t head = g * kRows + h;
      const float* src = w.o(g, R) + h * R + head / heads.part_heads * V;
      for (int64_t d = 0; d < V; d += 32) {
        const __m512 x = _mm512_load_ps(src + d), y = _mm512_load_ps(src + d + 16);
        _mm512_storeu_ps(o + head * V + d, _mm512_permutex2var_ps(x, first16, y));
        _mm512_storeu_ps(o + head * V + d + 16, _mm512_permutex2var_ps(x, last16, y));
      }
      m_out[head] = mv[h];
      l_out[head] = lv[h];
    }
  }
}

}  // namespace amx
}  // namespace batchgen_cpu

#endif
