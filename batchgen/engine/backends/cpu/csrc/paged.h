// Pieces the paged decode ops share (decode.cpp: per-head K/V; latent_decode.cpp: MLA's latent rows): work
// items of fixed key splits with their checks, the walk over a row's blocks, the score tiles, the merge of a
// row's splits, and (the latent op's) chunked pass over a split's rows with an online softmax.
//
// A split is a fixed run of `split_keys` keys (flash-decoding), so long contexts spread over the threads and
// short ones cost one item. Each item writes its partial result (unnormalised fp32 output, running max, sum)
// to slots indexed by the item, never by the thread; the merge combines a row's splits in split order. Nothing
// depends on which thread ran what, nor on how many there are: the output is bit-identical for any thread count.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include "fp8.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

namespace batchgen_cpu {

// The per-head op's two passes (decode.cpp), for any head layout whose values are the first `value_width`
// dims of a cache row: q (B, Hq, D), caches (blocks, block_size, Hkv, D), out (B, Hq, value_width). The latent
// op hands its bf16 rows to it where the CPU has the dot tiles (k_cache and v_cache one cache).
void decode_rows(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& block_tables, const at::Tensor& context_lens, double scale, int64_t sliding_window,
                 double softcap, int64_t split_keys, int64_t value_width, bool tiles, const at::Tensor& out);

struct Item {
  int64_t seq, head, first, last;  // keys [first, last) of sequence `seq` for KV head `head`
};

struct DecodePlan {
  // Row b's: [first_item[b], first_item[b + 1]), split after split and the KV heads within each, so the items
  // one thread runs in turn read the same blocks (each row of a block holds every KV head).
  std::vector<Item> items;
  std::vector<int64_t> first_item;
};

// Every row's items (row, KV head, split), after checking its context length and the blocks it reads: done
// before any parallel region, which an exception must not leave. `first_key(len)`: a sliding window's start.
template <typename FirstKey>
DecodePlan plan_decode(const at::Tensor& context_lens, const at::Tensor& tables, int64_t block_size,
                       int64_t num_blocks, int64_t kv_heads, int64_t split_keys, FirstKey&& first_key) {
  const int64_t B = context_lens.numel(), width = tables.size(1);
  TORCH_CHECK(split_keys > 0, "split_keys must be positive");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) >= B, "one context length and block table per row");
  const int32_t* ctx = context_lens.const_data_ptr<int32_t>();
  const int32_t* tab = tables.const_data_ptr<int32_t>();
  DecodePlan plan;
  plan.first_item.resize(B + 1);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = ctx[b];
    TORCH_CHECK(len >= 1 && len <= width * block_size, "context length ", len, " of row ", b, " outside 1..",
                width * block_size);
    const int64_t first = first_key(len);
    for (int64_t blk = first / block_size; blk <= (len - 1) / block_size; ++blk) {
      const int32_t id = tab[b * width + blk];
      TORCH_CHECK(id >= 0 && id < num_blocks, "row ", b, " reads block ", id, " outside the cache");
    }
    plan.first_item[b] = plan.items.size();
    for (int64_t s = first; s < len; s += split_keys)
      for (int64_t h = 0; h < kv_heads; ++h) plan.items.push_back({b, h, s, std::min(len, s + split_keys)});
  }
  plan.first_item[B] = plan.items.size();
  return plan;
}

// Calls f(pos, offset of the key's row in the cache) for positions [first, last), one table look-up a block.
template <typename F>
inline void for_each_row(const int32_t* table, int64_t block_size, int64_t cache_block, int64_t cache_row,
                         int64_t first, int64_t last, F&& f) {
  for (int64_t pos = first; pos < last;) {
    const int64_t block = table[pos / block_size], in_block = pos % block_size;
    const int64_t end = std::min(last, pos - in_block + block_size);
    const int64_t base = block * cache_block + in_block * cache_row;
    for (int64_t r = 0; pos < end; ++pos, ++r) f(pos, base + r * cache_row);
  }
}

// Asks for the cache lines of `bytes` bytes at p: a chunk's rows are fetched while the one before is computed
// (the blocks lie anywhere in the cache, so the hardware prefetchers cannot guess the next one).
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(c + b);
}

// Partial results, one slot per (item, query head): `dim` output values, max and sum. The outputs start zeroed
// unless every item writes its own before anything reads them (`zeroed` false: no fill of a few hundred KiB a call).
struct Partials {
  int64_t heads, dim;
  std::unique_ptr<float[]> o;
  std::vector<float> m, l;
  Partials(int64_t items, int64_t heads_, int64_t dim_, bool zeroed = true)
      : heads(heads_), dim(dim_), o(zeroed ? new float[items * heads_ * dim_]() : new float[items * heads_ * dim_]),
        m(items * heads_), l(items * heads_) {}
  float* o_of(int64_t item) { return o.get() + item * heads * dim; }
  float* m_of(int64_t item) { return m.data() + item * heads; }
  float* l_of(int64_t item) { return l.data() + item * heads; }
};

// dst[0, D) = o / l in T.
template <typename T>
inline void store_normalised(const float* o, float l, int64_t D, T* dst) {
  const float inv = 1.f / l;
  int64_t d = 0;
  for (; d + kStep <= D; d += kStep)
    store2(dst + d, Vec::loadu(o + d) * Vec(inv), Vec::loadu(o + d + Vec::size()) * Vec(inv));
  for (; d < D; ++d) dst[d] = static_cast<T>(o[d] * inv);
}

// Combines the items i0 + s * stride for s in [0, splits) in split order, out = sum_s e^(m_s - M) o_s /
// sum_s e^(m_s - M) l_s, into dst (heads rows of dim). acc: dim floats of scratch. One split's result is its own
// o / l exactly (weight e^0 = 1), as store_normalised writes it.
template <typename T>
void merge_splits(const Partials& p, int64_t i0, int64_t stride, int64_t splits, T* dst, float* acc) {
  const int64_t D = p.dim;
  for (int64_t g = 0; g < p.heads; ++g) {
    float mx = kNegInf;
    for (int64_t s = 0; s < splits; ++s) mx = std::max(mx, p.m[(i0 + s * stride) * p.heads + g]);
    float denom = 0.f;
    std::fill(acc, acc + D, 0.f);
    for (int64_t s = 0; s < splits; ++s) {
      const int64_t slot = (i0 + s * stride) * p.heads + g;
      const float w = std::exp(p.m[slot] - mx);
      denom += w * p.l[slot];
      at::vec::map2([w](Vec x, Vec y) { return at::vec::fmadd(Vec(w), y, x); }, acc, acc, p.o.get() + slot * D, D);
    }
    store_normalised(acc, denom, D, dst + g * D);
  }
}

// ---- Score tiles (both ops; the latent op walks a split in chunks of kChunk rows: split_walk.h) ----
// Scores run in register tiles of heads x rows, so each vector loaded feeds several FMAs. The latent op loads
// each chunk's rows (from bf16, converted) once for the chunk's scores and then its values while still in cache,
// with an online softmax across the chunks and values in tiles of heads x 16 dims (decode.cpp walks a split in
// two passes instead). Which tile a score or an output lands in changes no rounding: every one sums its
// products in the same order whatever the tile.

constexpr int64_t kChunk = 16;  // rows a chunk holds: 16 x 576 fp32 (MLA) is 36 KiB

// The query heads of an item and how they attend: keys key_width wide, values value_width.
struct Heads {
  int64_t count, key_width, value_width;
  float scale, softcap;  // softcap 0: none
};

// A thread's scratch, overwritten by each item before it is read: fp32 queries, a chunk's rows converted to fp32
// (bf16 and fp8 caches), its scores (heads, kChunk) and each head's rescale.
struct Scratch {
  std::vector<float> q32, keys, scores, rescale;
  explicit Scratch(const Heads& h)
      : q32(h.count * h.key_width), keys(kChunk * h.key_width), scores(h.count * kChunk), rescale(h.count) {}
};

// out (heads, key_width: fp32, or bf16 for the bf16 dot tiles) from `heads` rows of q, head_stride apart.
template <typename T, typename Q>
inline void load_queries(const T* q, int64_t head_stride, const Heads& h, Q* out) {
  for (int64_t g = 0; g < h.count; ++g) {
    if constexpr (std::is_same_v<T, Q>)
      std::memcpy(out + g * h.key_width, q + g * head_stride, h.key_width * sizeof(Q));
    else
      for (int64_t d = 0; d < h.key_width; ++d) out[g * h.key_width + d] = static_cast<Q>(q[g * head_stride + d]);
  }
}

// The row as fp32: itself for an fp32 cache, else converted into buf.
template <typename T>
inline const float* as_float(const T* row, float* buf, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return row;
  } else if constexpr (kFp8<T>) {
    widen_fp8(row, buf, n);
    return buf;
  } else {
    int64_t d = 0;
    for (; d + kStep <= n; d += kStep) {
      Vec lo, hi;
      load2(row + d, lo, hi);
      lo.store(buf + d);
      hi.store(buf + d + Vec::size());
    }
    for (; d < n; ++d) buf[d] = static_cast<float>(row[d]);
    return buf;
  }
}

// f(tile size as a constant, first) over [0, count) in tiles of Max, the last one smaller.
template <int Max, typename F>
inline void in_tiles(int64_t count, F&& f) {
  int64_t i = 0;
  for (; i + Max <= count; i += Max) f(std::integral_constant<int, Max>{}, i);
  if (i < count) with_constant<Max - 1>(count - i, [&](auto size) { f(size, i); });
}

// Register tiles: scores of 3 heads x 4 rows (12 sums; the rows are read from L1 by the FMAs), values of 4 heads
// x 16 dims (AVX2 has 16 vector registers).
constexpr int kScoreHeads = 3, kScoreRows = 4, kValueHeads = 4;

// Work that may go along with a tile's steps: none.
struct NoAhead {
  void operator()() const {}
};

// Head dims not a multiple of the vector: a tile's products from dim d on added one at a time, each an explicit
// fma so that fp32 and bf16 rows round alike whatever the compiler contracts.
template <int HB, int KB, typename R>
inline void add_tail_products(const float* q, int64_t W, const R* const* rows, float* s, int64_t stride, int64_t d) {
  for (int hb = 0; hb < HB; ++hb)
    for (int kb = 0; kb < KB; ++kb) {
      float sum = s[hb * stride + kb];
      for (int64_t t = d; t < W; ++t) sum = std::fma(q[hb * W + t], static_cast<float>(rows[kb][t]), sum);
      s[hb * stride + kb] = sum;
    }
}

#if defined(CPU_CAPABILITY_AVX512)
// s[h * stride + c] = the lane sum of acc[4 c + h] for a tile of HB heads x KB rows (lane_sums_of16's order).
template <int HB, int KB>
__attribute__((always_inline)) inline void store_tile_sums(const __m512* acc, float* s, int64_t stride) {
  const __m512 sums = lane_sums_of16(acc);
  const __mmask8 lanes = (1 << KB) - 1;
#pragma GCC unroll 4
  for (int hb = 0; hb < HB; ++hb) _mm_mask_storeu_ps(s + hb * stride, lanes, quarter_of(sums, hb));
}

// How an AVX-512 register tile multiplies: fp32 queries by rows widened to fp32 (FMAs, 16 dims a step), or
// (decode_dots.h) bf16 by bf16 (vdpbf16ps, 32 dims a step, asking ahead twice: the lines of two fp32 steps).
struct FmaStep {
  static constexpr int kDims = 16, kAheads = 1;
  static __m512 queries(const float* q) { return _mm512_loadu_ps(q); }
  template <typename R>
  static __m512 row(const R* r) { return load_vec(r); }
  static __m512 madd(__m512 acc, __m512 q, __m512 r) { return _mm512_fmadd_ps(q, r, acc); }
};

// s[h][c] = q_h . row_c for HB heads (W apart) and KB rows in an AVX-512 register tile: each sum in a register of
// its own and the lane sums in lane_sums_of16's one tree. (Held in an array of Vectorized, whose address
// store_sums takes, every sum stayed on the stack: each FMA a load and a store. This tile ran the bf16 decode op
// 1.2-1.3x on a Zen 4 core.) Dims past the last whole step: add_tail_products.
template <int HB, int KB, typename Step, typename Q, typename R, typename Ahead>
inline void register_tile(const Q* q, int64_t W, const R* const* rows, float* s, int64_t stride, Ahead& ahead_ref) {
  static_assert(HB <= 4 && KB <= 4, "a tile of at most 4 x 4 sums");
  Ahead ahead = ahead_ref;
  __m512 acc[16];  // sum (h, c) at 4 c + h, as store_tile_sums takes them
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + Step::kDims <= W; d += Step::kDims) {
#pragma GCC unroll 2
    for (int i = 0; i < Step::kAheads; ++i) ahead();
    decltype(Step::queries(q)) qv[HB];
#pragma GCC unroll 4
    for (int hb = 0; hb < HB; ++hb) qv[hb] = Step::queries(q + hb * W + d);
#pragma GCC unroll 4
    for (int kb = 0; kb < KB; ++kb) {
      const auto r = Step::row(rows[kb] + d);
#pragma GCC unroll 4
      for (int hb = 0; hb < HB; ++hb) acc[4 * kb + hb] = Step::madd(acc[4 * kb + hb], qv[hb], r);
    }
  }
  ahead_ref = ahead;
  store_tile_sums<HB, KB>(acc, s, stride);
  if constexpr (std::is_same_v<Q, float>) add_tail_products<HB, KB>(q, W, rows, s, stride, d);
}
#endif

// s[h][c] = q_h . row_c for HB heads of q (W apart) and KB rows (fp32, or bf16 widened as loaded: load_vec); a
// head's scores `stride` apart in s. ahead() is called once a vector step.
template <int HB, int KB, typename R, typename Ahead = NoAhead>
inline void score_tile(const float* q, int64_t W, const R* const* rows, float* s, int64_t stride = kChunk,
                       Ahead&& ahead_ref = Ahead{}) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (!std::is_same_v<R, float> && HB <= 4 && KB <= 4) {  // fp32 rows: no faster in these tiles
    register_tile<HB, KB, FmaStep>(q, W, rows, s, stride, ahead_ref);
    return;
  }
#endif
  std::remove_reference_t<Ahead> ahead = ahead_ref;  // in registers over the loop
  Vec acc[HB][KB];
  for (int hb = 0; hb < HB; ++hb)
    for (int kb = 0; kb < KB; ++kb) acc[hb][kb] = Vec(0.f);
  int64_t d = 0;
  for (; d + Vec::size() <= W; d += Vec::size()) {
    ahead();
    if constexpr (std::is_same_v<R, float>) {  // each row vector an operand of the FMAs, read from L1
      for (int hb = 0; hb < HB; ++hb) {
        const Vec qv = Vec::loadu(q + hb * W + d);
        for (int kb = 0; kb < KB; ++kb) acc[hb][kb] = at::vec::fmadd(qv, Vec::loadu(rows[kb] + d), acc[hb][kb]);
      }
    } else {  // each row vector widened once, for all the heads (the same sums, in the same order)
      Vec qv[HB];
      for (int hb = 0; hb < HB; ++hb) qv[hb] = Vec::loadu(q + hb * W + d);
      for (int kb = 0; kb < KB; ++kb) {
        const Vec r = load_vec(rows[kb] + d);
        for (int hb = 0; hb < HB; ++hb) acc[hb][kb] = at::vec::fmadd(qv[hb], r, acc[hb][kb]);
      }
    }
  }
  ahead_ref = ahead;
  store_sums<HB, KB>(&acc[0][0], s, stride);
  add_tail_products<HB, KB>(q, W, rows, s, stride, d);
}

}  // namespace batchgen_cpu
