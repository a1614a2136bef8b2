// Fused paged decode attention on CPU: one query token per sequence, keys and values read in place from the
// paged cache through the block tables (no gather into contiguous tensors).
//
// Work items are (sequence, KV head, split) (paged.h). A thread takes a split of a row with all its KV heads
// (one KV head at a time where rows are too few to keep every thread busy) and walks it in chunks of
// positions: each chunk's cache rows (every KV head side by side) are read once, and for each KV head its GQA
// group's query heads attend them together, with an online softmax and register tiles of several heads
// (paged.h's attend_chunk, shared with the latent op). Scores, softmax and accumulation are fp32; the output is
// bit-identical for any thread count. On CPUs with amx_bf16, bf16 queries' items take decode_tiles.h's path
// instead (no soft cap): both products in AMX tiles, a task's KV heads side by side in the lanes (the same
// partials and merge). The cache holds q's dtype or fp8 (e4m3, e5m2: rows widened as they are read, half the
// bytes of bf16 from memory).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "decode_tiles.h"
#include "paged.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

namespace batchgen_cpu {
namespace {

template <typename T, typename C>  // queries and output in T, the cache in C
struct Decode {
  const T* q; int64_t q_row, q_head;
  const C* k_cache; const C* v_cache; int64_t cache_block, cache_row, block_size;
  const int32_t* tables; int64_t tables_row;
  Heads group;  // the G query heads of a KV head, keys and values head_dim wide
};

// One split of a row for `span` consecutive KV heads (items it[0..span), consecutive in the plan: the same row
// and keys, heads it[0].head onwards), walked in chunks of positions: each chunk's cache rows are read once for
// all those heads, which sit side by side in a row of the cache, so the cache streams in its own order. KV head
// it[h].head's group of G query heads goes into item i0 + h's partial, computed as it would be alone: how the
// heads are grouped changes no rounding. The next chunk's lines are asked for a head's share at a time, spread
// over the chunk's work so the fetches overlap it rather than queue up at its start; the last chunk asks for
// the first of `after` (the thread's next task; null: none).
template <typename T, typename C>
void attend_split(const Decode<T, C>& a, const Item* it, const Item* after, int64_t span, Scratch& w,
                  Partials& partials, int64_t i0) {
  const int64_t G = a.group.count, D = a.group.key_width, first = it[0].first, last = it[0].last;
  const int64_t row_bytes = span * D * sizeof(C);
  Heads heads = a.group;
  heads.count = span * G;
  load_queries(a.q + it[0].seq * a.q_row + it[0].head * G * a.q_head, a.q_head, heads, w.q32.data());
  for (int64_t h = 0; h < span; ++h)
    start_split(a.group, partials.o_of(i0 + h), partials.m_of(i0 + h), partials.l_of(i0 + h));
  int64_t rows[kChunk], next[kChunk];  // where the chunk's and the next chunk's rows start (at the first head)
  auto offsets = [&](const Item& item, int64_t c0, int64_t* out) {
    const int64_t c1 = std::min(item.last, c0 + kChunk);
    for_each_row(a.tables + item.seq * a.tables_row, a.block_size, a.cache_block, a.cache_row, c0, c1,
                 [&](int64_t pos, int64_t row) { out[pos - c0] = row + item.head * D; });
    return c1 - c0;
  };
  offsets(it[0], first, next);
  const float* keys[kChunk];
  const float* values[kChunk];
  for (int64_t c0 = first; c0 < last; c0 += kChunk) {
    const int64_t c1 = std::min(last, c0 + kChunk), n = c1 - c0;
    std::copy(next, next + n, rows);
    const int64_t n_next = c1 < last ? offsets(it[0], c1, next) : after ? offsets(*after, after->first, next) : 0;
    for (int64_t h = 0; h < span; ++h) {
      for (int64_t c = h * n_next / span; c < (h + 1) * n_next / span; ++c) {
        prefetch(a.k_cache + next[c], row_bytes);
        prefetch(a.v_cache + next[c], row_bytes);
      }
      for (int64_t c = 0; c < n; ++c) {
        keys[c] = as_float(a.k_cache + rows[c] + h * D, w.keys.data() + c * D, D);
        values[c] = as_float(a.v_cache + rows[c] + h * D, w.values.data() + c * D, D);
      }
      attend_chunk(a.group, w.q32.data() + h * G * D, w, keys, values, n, partials.o_of(i0 + h),
                   partials.m_of(i0 + h), partials.l_of(i0 + h));
    }
  }
}

#if defined(BATCHGEN_AMX)
// One split of KV heads [it[0].head, + heads.parts()) in AMX tiles (decode_tiles.h), a part per KV head, into the
// partials of items i0 onwards (consecutive: their heads' slots follow one another).
template <typename C>
void attend_split_in_tiles(const Decode<at::BFloat16, C>& a, const amx::TileHeads& heads, const Item* it,
                           amx::TileScratch& w, Partials& partials, int64_t i0) {
  const int64_t G = a.group.count, D = a.group.key_width, h0 = it[0].head;
  const int32_t* table = a.tables + it[0].seq * a.tables_row;
  auto row_at = [&](const C* cache, int64_t pos) {  // position pos's row, from KV head h0
    return cache + table[pos / a.block_size] * a.cache_block + (pos % a.block_size) * a.cache_row + h0 * D;
  };
  amx::tile_item<C>(a.q + it[0].seq * a.q_row + h0 * G * a.q_head, a.q_head, heads, a.group.scale, it[0].first,
                 it[0].last, a.cache_row, [&](int64_t pos) { return row_at(a.k_cache, pos); },
                 [&](int64_t pos) { return row_at(a.v_cache, pos); }, w, partials.o_of(i0), partials.m_of(i0),
                 partials.l_of(i0));
}
#endif

void paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                            int64_t sliding_window, double softcap, int64_t split_keys, bool tiles,
                            const at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && q.stride(2) == 1 && out.is_contiguous(),
              "q must be (B, Hq, D) with contiguous head dims, out contiguous and of q's shape");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              v_cache.sizes() == k_cache.sizes(), "caches must be contiguous (blocks, block_size, Hkv, D)");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && Hq % Hkv == 0, "cache head_dim or head counts do not match q");
  const auto scalar = q.scalar_type(), cached = k_cache.scalar_type();
  TORCH_CHECK(out.scalar_type() == scalar && v_cache.scalar_type() == cached,
              "out must have q's dtype, the caches one");
  TORCH_CHECK(cached == scalar || cached == at::kFloat8_e4m3fn || cached == at::kFloat8_e5m2,
              "the caches must hold q's dtype or fp8 (e4m3fn, e5m2), got ", cached);
  auto ctx = context_lens.to(at::kLong).contiguous();
  auto tables = block_tables.to(at::kInt).contiguous();
  TORCH_CHECK(ctx.numel() == B, "one context length per row");
  const int64_t block_size = k_cache.size(1);
  const DecodePlan plan = plan_decode(ctx, tables, block_size, k_cache.size(0), Hkv, split_keys, [&](int64_t len) {
    return sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
  });
  const int64_t G = Hq / Hkv, num_items = plan.items.size();
  Partials partials(num_items, G, D);

  auto launch = [&](auto* tag, auto* cache_tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using C = std::remove_pointer_t<decltype(cache_tag)>;
    const Decode<T, C> a{q.const_data_ptr<T>(), q.stride(0), q.stride(1),
                         reinterpret_cast<const C*>(k_cache.const_data_ptr()),
                         reinterpret_cast<const C*>(v_cache.const_data_ptr()), k_cache.stride(0), k_cache.stride(1),
                         block_size, tables.const_data_ptr<int32_t>(), tables.size(1),
                         Heads{G, D, D, static_cast<float>(scale), static_cast<float>(softcap)}};
    // Rows enough to keep every thread busy with tasks of several KV heads; else a task takes one KV head.
    const bool wide_tasks = num_items / Hkv >= 2 * at::get_num_threads();
    bool in_tiles = false;
#if defined(BATCHGEN_AMX)
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      // A task: a split of a row for as many KV heads as fill the lanes.
      const int64_t per_task = wide_tasks ? amx::kv_heads_per_item(G, D, Hkv) : 1;
      const int64_t tasks_per_split = (Hkv + per_task - 1) / per_task;
      const amx::TileHeads widest = amx::grouped_heads(G, D, per_task);
      in_tiles = tiles && softcap == 0.0 && amx::supports_tiles(widest, block_size);
      if (in_tiles)
        at::parallel_for(0, num_items / Hkv * tasks_per_split, 1, [&](int64_t begin, int64_t end) {
          amx::TileSession session;
          auto scratch = std::make_unique<amx::TileScratch>(widest, kFp8<C>);
          for (int64_t t = begin; t < end; ++t) {
            const int64_t h0 = t % tasks_per_split * per_task, i0 = t / tasks_per_split * Hkv + h0;
            attend_split_in_tiles(a, amx::grouped_heads(G, D, std::min(per_task, Hkv - h0)), &plan.items[i0],
                                  *scratch, partials, i0);
          }
        });
    }
#endif
    if (!in_tiles) {
      // A task: a split of a row with all its KV heads.
      const int64_t span = wide_tasks ? Hkv : 1;
      at::parallel_for(0, num_items / span, 1, [&](int64_t begin, int64_t end) {
        // Scratch a call's items overwrite before reading: private to this call, its contents never carried over.
        Scratch scratch(a.group, true, span);
        for (int64_t t = begin; t < end; ++t)
          attend_split(a, &plan.items[t * span], t + 1 < end ? &plan.items[(t + 1) * span] : nullptr, span, scratch,
                       partials, t * span);
      });
    }
    // Combine each (row, KV head)'s splits in split order.
    T* out_p = out.data_ptr<T>();
    at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> acc(D);
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t b = bh / Hkv, h = bh % Hkv;
        const int64_t splits = (plan.first_item[b + 1] - plan.first_item[b]) / Hkv;
        merge_splits(partials, plan.first_item[b] + h, Hkv, splits, out_p + (b * Hq + h * G) * D, acc.data());
      }
    });
  };
  dispatch(scalar, "paged_decode_attention", [&](auto* tag) {
    if (cached == at::kFloat8_e4m3fn) launch(tag, static_cast<c10::Float8_e4m3fn*>(nullptr));
    else if (cached == at::kFloat8_e5m2) launch(tag, static_cast<c10::Float8_e5m2*>(nullptr));
    else launch(tag, tag);
  });
}

}  // namespace
}  // namespace batchgen_cpu

TORCH_LIBRARY_FRAGMENT(batchgen_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
        "float scale, int sliding_window, float softcap, int split_keys, bool tiles, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(batchgen_cpu, CPU, m) {
  m.impl("paged_decode_attention", &batchgen_cpu::paged_decode_attention);
}
