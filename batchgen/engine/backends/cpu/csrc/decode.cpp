// Fused paged decode attention on CPU: one query token per sequence, keys and values read in place from the
// paged cache through the block tables (no gather into contiguous tensors).
//
// Work items are (sequence, KV head, split) (paged.h); every query head of the GQA group runs in the same pass
// over its KV head's keys. Scores, softmax and accumulation are fp32; the output is bit-identical for any
// thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "paged.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace batchgen_cpu {
namespace {

template <typename T>
struct Decode {
  const T* q; int64_t q_row, q_head;
  const T* k_cache; const T* v_cache; int64_t cache_block, cache_row, block_size;
  const int32_t* tables; int64_t tables_row;
  int64_t group, head_dim;
  float scale, softcap;  // softcap 0: none
};

// Calls f(pos, key row, value row) for positions [first, last) of KV head `head`.
template <typename T, typename F>
inline void for_each_key(const Decode<T>& a, int64_t seq, int64_t head, int64_t first, int64_t last, F&& f) {
  const int64_t offset = head * a.head_dim;
  for_each_row(a.tables + seq * a.tables_row, a.block_size, a.cache_block, a.cache_row, first, last,
               [&](int64_t pos, int64_t row) { f(pos, a.k_cache + row + offset, a.v_cache + row + offset); });
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
      float s = dot(q32 + g * D, key, D) * a.scale;
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
  const auto scalar = q.scalar_type();
  TORCH_CHECK(k_cache.scalar_type() == scalar && v_cache.scalar_type() == scalar && out.scalar_type() == scalar,
              "q, caches and out must share one dtype");
  auto ctx = context_lens.to(at::kLong).contiguous();
  auto tables = block_tables.to(at::kInt).contiguous();
  TORCH_CHECK(ctx.numel() == B, "one context length per row");
  const int64_t block_size = k_cache.size(1);
  const DecodePlan plan = plan_decode(ctx, tables, block_size, k_cache.size(0), Hkv, split_keys, [&](int64_t len) {
    return sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
  });
  const int64_t G = Hq / Hkv, num_items = plan.items.size();
  Partials partials(num_items, G, D);

  auto launch = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const Decode<T> a{q.const_data_ptr<T>(), q.stride(0), q.stride(1), k_cache.const_data_ptr<T>(),
                      v_cache.const_data_ptr<T>(), k_cache.stride(0), k_cache.stride(1), block_size,
                      tables.const_data_ptr<int32_t>(), tables.size(1), G, D, static_cast<float>(scale),
                      static_cast<float>(softcap)};
    at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
      // Scratch a call's items overwrite before reading: private to this call, its contents never carried over.
      std::vector<float> q32(G * D), scores(G * split_keys);
      for (int64_t i = begin; i < end; ++i)
        attend_split(a, plan.items[i], q32.data(), scores.data(), partials.o_of(i), partials.m_of(i),
                     partials.l_of(i));
    });
    // Combine each (row, KV head)'s splits in split order.
    T* out_p = out.data_ptr<T>();
    at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> acc(D);
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t b = bh / Hkv, h = bh % Hkv;
        const int64_t splits = (plan.first_item[b + 1] - plan.first_item[b]) / Hkv;
        merge_splits(partials, plan.first_item[b] + h * splits, splits, out_p + (b * Hq + h * G) * D, acc.data());
      }
    });
  };
  dispatch(scalar, "paged_decode_attention", launch);
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
