// Fused paged decode attention on CPU: one query token per sequence, keys and values read in place from the
// paged cache through the block tables (no gather into contiguous tensors).
//
// Work items are (sequence, KV head, split): a split is a fixed run of `split_keys` keys (flash-decoding), so
// long contexts spread over the threads and short ones cost one item. Every query head of the GQA group runs
// in the same pass over its KV head's keys. Each item writes its partial result (unnormalised fp32 output,
// running max, sum) to slots indexed by the item, never by the thread; a second pass combines the splits of
// each (sequence, KV head) in split order. Nothing depends on which thread ran what, nor on how many there
// are: the output is bit-identical for any thread count. Scores, softmax and accumulation are fp32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "vec.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace batchgen_cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

template <typename T>
struct Decode {
  const T* q; int64_t q_row, q_head;
  const T* k_cache; const T* v_cache; int64_t cache_block, cache_row, block_size;
  const int32_t* tables; int64_t tables_row;
  int64_t group, head_dim;
  float scale, softcap;  // softcap 0: none
};

struct Item {
  int64_t seq, head, first, last;  // keys [first, last) of sequence `seq` for KV head `head`
};

inline float sum_of(Vec v) {
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, v);
}

// Calls f(pos, key row, value row) for positions [first, last), walking the block table once per block.
template <typename T, typename F>
inline void for_each_key(const Decode<T>& a, int64_t seq, int64_t head, int64_t first, int64_t last, F&& f) {
  const int32_t* table = a.tables + seq * a.tables_row;
  for (int64_t pos = first; pos < last;) {
    const int64_t block = table[pos / a.block_size], in_block = pos % a.block_size;
    const int64_t end = std::min(last, pos - in_block + a.block_size);
    const int64_t base = block * a.cache_block + in_block * a.cache_row + head * a.head_dim;
    for (int64_t r = 0; pos < end; ++pos, ++r)
      f(pos, a.k_cache + base + r * a.cache_row, a.v_cache + base + r * a.cache_row);
  }
}

// One split of one KV head: o (G, D) = sum_j 2^... p_j v_j unnormalised, with the group's max m and sum l.
template <typename T>
void attend_split(const Decode<T>& a, const Item& it, float* q32, float* scores, float* o, float* m, float* l) {
  const int64_t G = a.group, D = a.head_dim, n = it.last - it.first;
  for (int64_t g = 0; g < G; ++g) {
    const T* src = a.q + it.seq * a.q_row + (it.head * G + g) * a.q_head;
    for (int64_t d = 0; d < D; ++d) q32[g * D + d] = static_cast<float>(src[d]);
  }
  for_each_key(a, it.seq, it.head, it.first, it.last, [&](int64_t pos, const T* key, const T*) {
    const int64_t j = pos - it.first;
    for (int64_t g = 0; g < G; ++g) {
      Vec acc0(0.f), acc1(0.f);
      const float* qg = q32 + g * D;
      int64_t d = 0;
      for (; d + kStep <= D; d += kStep) {
        Vec k0, k1;
        load2(key + d, k0, k1);
        acc0 = at::vec::fmadd(Vec::loadu(qg + d), k0, acc0);
        acc1 = at::vec::fmadd(Vec::loadu(qg + d + Vec::size()), k1, acc1);
      }
      float tail = 0.f;
      for (; d < D; ++d) tail += qg[d] * static_cast<float>(key[d]);
      float s = (sum_of(acc0 + acc1) + tail) * a.scale;
      if (a.softcap > 0.f) s = a.softcap * std::tanh(s / a.softcap);
      scores[g * n + j] = s;
    }
  });
  for (int64_t g = 0; g < G; ++g) {
    float* row = scores + g * n;
    const float mx = *std::max_element(row, row + n);
    at::vec::map([mx](Vec x) { return (x - Vec(mx)).exp(); }, row, row, n);
    const float sum = at::vec::reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, row, n);
    m[g] = mx;
    l[g] = sum;
    std::fill(o + g * D, o + (g + 1) * D, 0.f);
  }
  for_each_key(a, it.seq, it.head, it.first, it.last, [&](int64_t pos, const T*, const T* value) {
    const int64_t j = pos - it.first;
    int64_t d = 0;
    for (; d + kStep <= D; d += kStep) {
      Vec v0, v1;
      load2(value + d, v0, v1);
      for (int64_t g = 0; g < G; ++g) {
        const Vec p(scores[g * n + j]);
        float* og = o + g * D + d;
        at::vec::fmadd(p, v0, Vec::loadu(og)).store(og);
        at::vec::fmadd(p, v1, Vec::loadu(og + Vec::size())).store(og + Vec::size());
      }
    }
    for (; d < D; ++d) {
      const float x = static_cast<float>(value[d]);
      for (int64_t g = 0; g < G; ++g) o[g * D + d] += scores[g * n + j] * x;
    }
  });
}

void paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                            int64_t sliding_window, double softcap, int64_t split_keys, const at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && q.stride(2) == 1 && out.is_contiguous(),
              "q must be (B, Hq, D) with contiguous head dims, out contiguous and of q's shape");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              v_cache.sizes() == k_cache.sizes(), "caches must be contiguous (blocks, block_size, Hkv, D)");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && Hq % Hkv == 0, "cache head_dim or head counts do not match q");
  TORCH_CHECK(split_keys > 0, "split_keys must be positive");
  const auto scalar = q.scalar_type();
  TORCH_CHECK(k_cache.scalar_type() == scalar && v_cache.scalar_type() == scalar && out.scalar_type() == scalar,
              "q, caches and out must share one dtype");
  auto ctx = context_lens.to(at::kLong).contiguous();
  auto tables = block_tables.to(at::kInt).contiguous();
  TORCH_CHECK(ctx.numel() == B && tables.dim() == 2 && tables.size(0) >= B, "one context length and block table per row");
  const int64_t* ctx_p = ctx.const_data_ptr<int64_t>();
  const int32_t* tab_p = tables.const_data_ptr<int32_t>();
  const int64_t block_size = k_cache.size(1), num_blocks = k_cache.size(0);

  // Items and their checks, before any parallel region (an exception must not leave one).
  std::vector<Item> items;
  std::vector<int64_t> first_item(B + 1);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = ctx_p[b];
    TORCH_CHECK(len >= 1 && len <= tables.size(1) * block_size, "context length ", len, " of row ", b,
                " outside 1..", tables.size(1) * block_size);
    const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
    for (int64_t blk = first / block_size; blk <= (len - 1) / block_size; ++blk) {
      const int32_t id = tab_p[b * tables.size(1) + blk];
      TORCH_CHECK(id >= 0 && id < num_blocks, "row ", b, " reads block ", id, " outside the cache");
    }
    first_item[b] = items.size();
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t s = first; s < len; s += split_keys) items.push_back({b, h, s, std::min(len, s + split_keys)});
  }
  first_item[B] = items.size();
  const int64_t G = Hq / Hkv, num_items = items.size();
  // Partial results, one slot per work item.
  std::vector<float> partial_o(num_items * G * D), partial_m(num_items * G), partial_l(num_items * G);

  auto launch = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const Decode<T> a{q.const_data_ptr<T>(), q.stride(0), q.stride(1), k_cache.const_data_ptr<T>(),
                      v_cache.const_data_ptr<T>(), k_cache.stride(0), k_cache.stride(1), block_size,
                      tab_p, tables.size(1), G, D, static_cast<float>(scale), static_cast<float>(softcap)};
    at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
      // Scratch a call's items overwrite before reading: private to this call, its contents never carried over.
      std::vector<float> q32(G * D), scores(G * split_keys);
      for (int64_t i = begin; i < end; ++i)
        attend_split(a, items[i], q32.data(), scores.data(), partial_o.data() + i * G * D,
                     partial_m.data() + i * G, partial_l.data() + i * G);
    });
    // Combine each (row, KV head)'s splits in split order: out = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s.
    T* out_p = out.data_ptr<T>();
    at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> acc(D);
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t b = bh / Hkv, h = bh % Hkv;
        const int64_t splits = (first_item[b + 1] - first_item[b]) / Hkv;
        const int64_t i0 = first_item[b] + h * splits;
        for (int64_t g = 0; g < G; ++g) {
          float mx = kNegInf;
          for (int64_t s = 0; s < splits; ++s) mx = std::max(mx, partial_m[(i0 + s) * G + g]);
          float denom = 0.f;
          std::fill(acc.begin(), acc.end(), 0.f);
          for (int64_t s = 0; s < splits; ++s) {
            const int64_t slot = (i0 + s) * G + g;
            const float w = std::exp(partial_m[slot] - mx);
            denom += w * partial_l[slot];
            const float* o = partial_o.data() + slot * D;
            at::vec::map2([w](Vec x, Vec y) { return at::vec::fmadd(Vec(w), y, x); }, acc.data(), acc.data(), o, D);
          }
          const float inv = 1.f / denom;
          T* dst = out_p + (b * Hq + h * G + g) * D;
          int64_t d = 0;
          for (; d + kStep <= D; d += kStep)
            store2(dst + d, Vec::loadu(acc.data() + d) * Vec(inv), Vec::loadu(acc.data() + d + Vec::size()) * Vec(inv));
          for (; d < D; ++d) dst[d] = static_cast<T>(acc[d] * inv);
        }
      }
    });
  };
  if (scalar == at::kFloat) {
    launch(static_cast<float*>(nullptr));
  } else if (scalar == at::kBFloat16) {
    launch(static_cast<at::BFloat16*>(nullptr));
  } else {
    TORCH_CHECK(false, "paged_decode_attention takes float32 or bfloat16, got ", scalar);
  }
}

}  // namespace
}  // namespace batchgen_cpu

TORCH_LIBRARY_FRAGMENT(batchgen_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
        "float scale, int sliding_window, float softcap, int split_keys, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(batchgen_cpu, CPU, m) {
  m.impl("paged_decode_attention", &batchgen_cpu::paged_decode_attention);
}
