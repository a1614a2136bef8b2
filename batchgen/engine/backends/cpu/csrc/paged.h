// Pieces the paged decode ops share (decode.cpp: per-head K/V; latent_decode.cpp: MLA's latent rows): work
// items of fixed key splits with their checks, the walk over a row's blocks, and the merge of a row's splits.
//
// A split is a fixed run of `split_keys` keys (flash-decoding), so long contexts spread over the threads and
// short ones cost one item. Each item writes its partial result (unnormalised fp32 output, running max, sum)
// to slots indexed by the item, never by the thread; the merge combines a row's splits in split order. Nothing
// depends on which thread ran what, nor on how many there are: the output is bit-identical for any thread count.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include "vec.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace batchgen_cpu {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Item {
  int64_t seq, head, first, last;  // keys [first, last) of sequence `seq` for KV head `head`
};

struct DecodePlan {
  std::vector<Item> items;  // row b's: [first_item[b], first_item[b + 1]), KV head after KV head
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
  const int64_t* ctx = context_lens.const_data_ptr<int64_t>();
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
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t s = first; s < len; s += split_keys) plan.items.push_back({b, h, s, std::min(len, s + split_keys)});
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

inline float sum_of(Vec v) {
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, v);
}

// q . k over n values, fp32 q and k of either dtype.
template <typename T>
inline float dot(const float* q, const T* k, int64_t n) {
  Vec acc0(0.f), acc1(0.f);
  int64_t d = 0;
  for (; d + kStep <= n; d += kStep) {
    Vec k0, k1;
    load2(k + d, k0, k1);
    acc0 = at::vec::fmadd(Vec::loadu(q + d), k0, acc0);
    acc1 = at::vec::fmadd(Vec::loadu(q + d + Vec::size()), k1, acc1);
  }
  float tail = 0.f;
  for (; d < n; ++d) tail += q[d] * static_cast<float>(k[d]);
  return sum_of(acc0 + acc1) + tail;
}

// Partial results, one slot per (item, query head): `dim` output values, max and sum.
struct Partials {
  int64_t heads, dim;
  std::vector<float> o, m, l;
  Partials(int64_t items, int64_t heads_, int64_t dim_)
      : heads(heads_), dim(dim_), o(items * heads_ * dim_), m(items * heads_), l(items * heads_) {}
  float* o_of(int64_t item) { return o.data() + item * heads * dim; }
  float* m_of(int64_t item) { return m.data() + item * heads; }
  float* l_of(int64_t item) { return l.data() + item * heads; }
};

// Combines items [i0, i0 + splits) in split order, out = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s, into
// dst (heads rows of dim). acc: dim floats of scratch.
template <typename T>
void merge_splits(const Partials& p, int64_t i0, int64_t splits, T* dst, float* acc) {
  const int64_t D = p.dim;
  for (int64_t g = 0; g < p.heads; ++g) {
    float mx = kNegInf;
    for (int64_t s = 0; s < splits; ++s) mx = std::max(mx, p.m[(i0 + s) * p.heads + g]);
    float denom = 0.f;
    std::fill(acc, acc + D, 0.f);
    for (int64_t s = 0; s < splits; ++s) {
      const int64_t slot = (i0 + s) * p.heads + g;
      const float w = std::exp(p.m[slot] - mx);
      denom += w * p.l[slot];
      at::vec::map2([w](Vec x, Vec y) { return at::vec::fmadd(Vec(w), y, x); }, acc, acc, p.o.data() + slot * D, D);
    }
    const float inv = 1.f / denom;
    T* row = dst + g * D;
    int64_t d = 0;
    for (; d + kStep <= D; d += kStep)
      store2(row + d, Vec::loadu(acc + d) * Vec(inv), Vec::loadu(acc + d + Vec::size()) * Vec(inv));
    for (; d < D; ++d) row[d] = static_cast<T>(acc[d] * inv);
  }
}

}  // namespace batchgen_cpu
