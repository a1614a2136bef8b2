// Fused paged decode attention on CPU: one query token per sequence, keys and values read in place from the
// paged cache through the block tables (no gather into contiguous tensors).
//
// Work items are (sequence, KV head, split) (paged.h). A thread takes a split of a row with all its KV heads
// (one KV head at a time where rows are too few to keep every thread busy) and walks it twice in chunks of
// positions, each chunk's cache rows (every KV head side by side) read once: first all the scores, in paged.h's
// register tiles, then each head's softmax over the split, then the values, each output's sums held in registers
// over a chunk. A split is at most a few hundred keys, so its scores stay in L1 and no running rescale is needed.
// The next chunk's lines are asked for a few at a time as a chunk is worked on. Scores, softmax and accumulation
// are fp32; the output is bit-identical for any thread count. On CPUs with amx_bf16, bf16 queries' items take
// decode_tiles.h's path instead (no soft cap): both products in AMX tiles, a task's KV heads side by side in the
// lanes (the same partials and merge). Elsewhere with AVX512-BF16, bf16 queries over a bf16 (or fp8) cache take
// decode_dots.h's tiles in the same two passes: products by vdpbf16ps, the probabilities rounded to bf16. The
// cache holds q's dtype, fp8 (e4m3, e5m2: rows widened as they are read, to bf16 for the dot tiles, half the bytes
// of bf16 from memory) or, under fp32 queries, bf16 (half the bytes of fp32).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "decode_ahead.h"
#include "decode_dots.h"
#include "decode_tiles.h"
#include "decode_values.h"
#include "fp8.h"
#include "paged.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <utility>
#include <vector>

namespace batchgen_cpu {
namespace {

template <typename T, typename C>  // queries and output in T, the cache in C
struct Decode {
  const T* q; int64_t q_row, q_head;
  const C* k_cache; const C* v_cache; int64_t cache_block, cache_row, block_size;
  const int32_t* tables; int64_t tables_row;
  Heads group;  // the G query heads of a KV head, keys and values head_dim wide
  T* out; int64_t out_row;  // (B, Hq, head_dim)
};

// A thread's scratch, overwritten by each split before it is read: the queries (`span` KV heads' groups: fp32,
// or bf16 for the dot tiles), each key's row offset, the scores (a row per query head, `stride` apart: the longest
// split), the dot tiles' probabilities in bf16 and a chunk's rows of an fp8 cache widened to fp32, or to bf16
// for the dot tiles (fp32 and bf16 rows are read in place).
struct SplitScratch {
  int64_t stride;
  std::vector<float> q32, scores, rows32;
  std::vector<at::BFloat16> q16, p16, rows16;
  std::vector<int64_t> offsets;
  SplitScratch(const Heads& h, int64_t span, int64_t longest, bool dots)
      : stride((longest + Vec::size() - 1) / Vec::size() * Vec::size()), q32(dots ? 0 : span * h.count * h.key_width),
        scores(span * h.count * stride), rows32(kChunk * h.key_width), q16(dots ? span * h.count * h.key_width : 0),
        p16(dots ? span * h.count * stride : 0), rows16(dots ? kChunk * h.key_width : 0), offsets(longest) {}
  template <typename Q>
  Q* queries() {
    if constexpr (std::is_same_v<Q, float>) return q32.data();
    else return q16.data();
  }
};

// s[g][c] = q_g . row_c for a group's heads (fp32 queries, or bf16 for the dot tiles) and n rows (fp32 or bf16);
// head g's scores at s + g * stride.
template <typename Q, typename R>
inline void group_scores(const Heads& h, const Q* q, const R* const* rows, int64_t n, float* s, int64_t stride,
                         Ahead& ahead) {
  const int64_t W = h.key_width;
  in_tiles<std::is_same_v<Q, float> ? kScoreHeads : kDotHeads>(h.count, [&](auto heads, int64_t g) {
    in_tiles<kScoreRows>(n, [&](auto keys, int64_t c) {
      score_tile<heads, keys>(q + g * W, W, rows + c, s + g * stride + c, stride, ahead);
    });
  });
}

// A score row of n keys becomes its probabilities e^(scaled score - max), in two passes: the scale is positive,
// so the largest scaled score is the largest score scaled. Returns (max, sum).
inline std::pair<float, float> softmax_row(float* s, int64_t n, float scale, float cap) {
  constexpr int64_t L = Vec::size();
  if (cap > 0.f) {
    at::vec::map([scale, cap](Vec x) { return Vec(cap) * (x * Vec(scale / cap)).tanh(); }, s, s, n);
    scale = 1.f;
  }
  Vec top(kNegInf);
  int64_t c = 0;
  for (; c + L <= n; c += L) top = larger(top, Vec::loadu(s + c));
  float mx = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return larger(x, y); }, top);
  for (; c < n; ++c) mx = std::max(mx, s[c]);
  mx *= scale;
  Vec sum(0.f);
  for (c = 0; c + L <= n; c += L) {
    const Vec p = exp_nonpositive(Vec::loadu(s + c) * Vec(scale) - Vec(mx));
    p.store(s + c);
    sum = sum + p;
  }
  if (c < n) {  // the tail's lanes past n add nothing
    const Vec p = Vec::set(Vec(0.f), exp_nonpositive(Vec::loadu(s + c, n - c) * Vec(scale) - Vec(mx)), n - c);
    p.store(s + c, n - c);
    sum = sum + p;
  }
  return {mx, at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, sum)};
}

// One split of a row for `span` consecutive KV heads (items it[0..span), consecutive in the plan: the same row
// and keys, heads it[0].head onwards), in two passes over its keys, each in chunks of positions whose cache rows
// (every KV head side by side) are read once for all the heads, in the cache's own order. First every score; then
// each query head's softmax over the whole split (no running rescale); then the values, each chunk's added to
// the outputs. Meanwhile the start of the next chunk's rows is asked for (keys, then values, then the first keys
// of `after`, the thread's next task, and its queries; null: none). KV head it[h].head's heads go into item i0 +
// h's partial, computed as it would be alone: how the heads are grouped changes no rounding. A row of one split
// (`whole`) then writes its output itself, as the merge of one split would (no merge pass for it).
// Q: the queries' and probabilities' type the tiles take, fp32, or bf16 for the dot tiles.
template <typename Q, typename T, typename C>
void attend_split(const Decode<T, C>& a, const Item* it, const Item* after, int64_t span, bool whole,
                  SplitScratch& w, Partials& partials, int64_t i0) {
  const int64_t G = a.group.count, D = a.group.key_width, n = it[0].last - it[0].first, S = w.stride;
  Heads heads = a.group;
  heads.count = span * G;
  Q* q = w.queries<Q>();
  load_queries(a.q + it[0].seq * a.q_row + it[0].head * G * a.q_head, a.q_head, heads, q);
  auto offsets = [&](const Item& item, int64_t count, int64_t* out) {  // the first `count` keys' rows of item
    for_each_row(a.tables + item.seq * a.tables_row, a.block_size, a.cache_block, a.cache_row, item.first,
                 item.first + count, [&](int64_t pos, int64_t row) { out[pos - item.first] = row + item.head * D; });
  };
  int64_t* rows = w.offsets.data();
  offsets(it[0], n, rows);
  int64_t next[kChunk];  // the first keys' rows of `after`
  const int64_t next_count = after ? std::min(kChunk, after->last - after->first) : 0;
  if (after) offsets(*after, next_count, next);
  const int64_t row_bytes = span * D * sizeof(C);
  // What a chunk [c0, c0 + kChunk) asks for meanwhile: the same cache's next chunk (into L2 only where it does
  // not follow this one in memory), else `last` (count rows).
  auto ahead_of = [&](const C* cache, int64_t c0, const C* last_cache, const int64_t* last, int64_t count) {
    const int64_t next = c0 + kChunk;
    if (next >= n) return Ahead(last_cache, last, count, sizeof(C), row_bytes);
    const bool seam = rows[next] != rows[next - 1] + a.cache_row;
    return Ahead(cache, rows + next, std::min(kChunk, n - next), sizeof(C), row_bytes, seam);
  };
  // KV head h's rows of a chunk as the tiles read them: fp32 and bf16 in place, fp8 widened first (to R).
  using R = std::conditional_t<kFp8<C>, std::conditional_t<std::is_same_v<Q, float>, float, at::BFloat16>, C>;
  const R* chunk[kChunk];
  auto chunk_rows = [&](const C* cache, int64_t c0, int64_t m, int64_t h) {
    for (int64_t c = 0; c < m; ++c) {
      const C* row = cache + rows[c0 + c] + h * D;
      if constexpr (kFp8<C> && std::is_same_v<R, float>) {
        chunk[c] = as_float(row, w.rows32.data() + c * D, D);
      } else if constexpr (kFp8<C>) {  // exactly: every fp8 value is a bf16 one
        widen_fp8(row, w.rows16.data() + c * D, D);
        chunk[c] = w.rows16.data() + c * D;
      } else {
        chunk[c] = row;
      }
    }
  };
  float* scores = w.scores.data();
  for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
    const int64_t m = std::min(kChunk, n - c0);
    Ahead ahead = ahead_of(a.k_cache, c0, a.v_cache, rows, std::min(kChunk, n));
    for (int64_t h = 0; h < span; ++h) {
      chunk_rows(a.k_cache, c0, m, h);
      group_scores(a.group, q + h * G * D, chunk, m, scores + h * G * S + c0, S, ahead);
    }
  }
  for (int64_t h = 0; h < span; ++h)
    for (int64_t g = 0; g < G; ++g) {
      const auto [mx, sum] = softmax_row(scores + (h * G + g) * S, n, a.group.scale, a.group.softcap);
      partials.m_of(i0 + h)[g] = mx;
      partials.l_of(i0 + h)[g] = sum;
      if constexpr (!std::is_same_v<Q, float>)
        round_probabilities(scores + (h * G + g) * S, n, w.p16.data() + (h * G + g) * S);
    }
  const Q* probs;
  if constexpr (std::is_same_v<Q, float>) probs = scores;
  else probs = w.p16.data();
  if (after)  // the next task's queries: `span` KV heads' groups from its first head
    for (int64_t g = 0; g < span * G; ++g)
      prefetch(a.q + after->seq * a.q_row + (after->head * G + g) * a.q_head, D * sizeof(T));
  for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
    const int64_t m = std::min(kChunk, n - c0);
    Ahead ahead = ahead_of(a.v_cache, c0, a.k_cache, next, next_count);
    for (int64_t h = 0; h < span; ++h) {
      chunk_rows(a.v_cache, c0, m, h);
      group_values(a.group, partials.o_of(i0 + h), probs + h * G * S + c0, S, chunk, m, c0 == 0, ahead);
    }
  }
  const int64_t V = a.group.value_width;
  if (whole)
    for (int64_t h = 0; h < span; ++h)
      for (int64_t g = 0; g < G; ++g)
        store_normalised(partials.o_of(i0 + h) + g * V, partials.l_of(i0 + h)[g], V,
                         a.out + it[0].seq * a.out_row + ((it[0].head + h) * G + g) * V);
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

}  // namespace

void decode_rows(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& block_tables, const at::Tensor& context_lens, double scale, int64_t sliding_window,
                 double softcap, int64_t split_keys, int64_t value_width, bool tiles, const at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && out.is_contiguous() && out.dim() == 3 && out.size(0) == q.size(0) &&
              out.size(1) == q.size(1) && out.size(2) == value_width,
              "q must be (B, Hq, D) with contiguous head dims, out contiguous (B, Hq, value width)");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              v_cache.sizes() == k_cache.sizes(), "caches must be contiguous (blocks, block_size, Hkv, D)");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(2), V = value_width;
  TORCH_CHECK(k_cache.size(3) == D && Hq % Hkv == 0, "cache head_dim or head counts do not match q");
  TORCH_CHECK(V > 0 && V <= D, "value width ", V, " outside 1..", D);
  const auto scalar = q.scalar_type(), cached = k_cache.scalar_type();
  TORCH_CHECK(out.scalar_type() == scalar && v_cache.scalar_type() == cached,
              "out must have q's dtype, the caches one");
  TORCH_CHECK(takes_cache(scalar, cached),
              "the caches must hold q's dtype, fp8 (e4m3fn, e5m2) or bf16 under fp32 q, got ", cached);
  auto ctx = context_lens.to(at::kInt).contiguous();  // as the engine passes them: no copy a layer
  auto tables = block_tables.to(at::kInt).contiguous();
  TORCH_CHECK(ctx.numel() == B, "one context length per row");
  const int64_t block_size = k_cache.size(1);
  const DecodePlan plan = plan_decode(ctx, tables, block_size, k_cache.size(0), Hkv, split_keys, [&](int64_t len) {
    return sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
  });
  const int64_t G = Hq / Hkv, num_items = plan.items.size();
  int64_t longest = 0;
  for (const Item& item : plan.items) longest = std::max(longest, item.last - item.first);

  auto launch = [&](auto* tag, auto* cache_tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using C = std::remove_pointer_t<decltype(cache_tag)>;
    const Decode<T, C> a{q.const_data_ptr<T>(), q.stride(0), q.stride(1),
                         reinterpret_cast<const C*>(k_cache.const_data_ptr()),
                         reinterpret_cast<const C*>(v_cache.const_data_ptr()), k_cache.stride(0), k_cache.stride(1),
                         block_size, tables.const_data_ptr<int32_t>(), tables.size(1),
                         Heads{G, D, V, static_cast<float>(scale), static_cast<float>(softcap)},
                         out.data_ptr<T>(), Hq * V};
    // Rows enough to keep every thread busy with tasks of several KV heads; else a task takes one KV head.
    const bool wide_tasks = num_items / Hkv >= 2 * at::get_num_threads();
    Partials partials(num_items, G, V, /*zeroed=*/false);  // every item writes all of its own
    bool in_tiles = false;
#if defined(BATCHGEN_AMX)
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      // A task: a split of a row for as many KV heads as fill the lanes.
      const int64_t per_task = wide_tasks ? amx::kv_heads_per_item(G, D, Hkv) : 1;
      const int64_t tasks_per_split = (Hkv + per_task - 1) / per_task;
      const amx::TileHeads widest = amx::grouped_heads(G, D, per_task);
      in_tiles = tiles && softcap == 0.0 && V == D && amx::supports_tiles(widest, block_size);
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
    // A task: a split of a row with all its KV heads.
    auto run_splits = [&](auto* query_tag) {
      using Q = std::remove_pointer_t<decltype(query_tag)>;
      const int64_t span = wide_tasks ? Hkv : 1;
      at::parallel_for(0, num_items / span, 1, [&](int64_t begin, int64_t end) {
        // Scratch a call's items overwrite before reading: private to this call, its contents never carried over.
        SplitScratch scratch(a.group, span, longest, !std::is_same_v<Q, float>);
        for (int64_t t = begin; t < end; ++t) {
          const int64_t seq = plan.items[t * span].seq;
          attend_split<Q>(a, &plan.items[t * span], t + 1 < end ? &plan.items[(t + 1) * span] : nullptr, span,
                          plan.first_item[seq + 1] - plan.first_item[seq] == Hkv, scratch, partials, t * span);
        }
      });
    };
    // bf16 queries over a bf16 or fp8 cache take the dot tiles where the CPU has them; the rest fp32 tiles.
    constexpr bool kDots = kDotTiles && std::is_same_v<T, at::BFloat16> && (std::is_same_v<C, at::BFloat16> || kFp8<C>);
    if (!in_tiles) {
      if constexpr (kDots) {
        if (D % 32 == 0 && V % 32 == 0) run_splits(static_cast<at::BFloat16*>(nullptr));
        else run_splits(static_cast<float*>(nullptr));
      } else {
        run_splits(static_cast<float*>(nullptr));
      }
    }
    // Combine each (row, KV head)'s splits in split order: the rows of several splits (after the AMX tiles, all).
    std::vector<int64_t> to_merge;
    for (int64_t b = 0; b < B; ++b)
      if (in_tiles || plan.first_item[b + 1] - plan.first_item[b] > Hkv) to_merge.push_back(b);
    if (to_merge.empty()) return;
    at::parallel_for(0, static_cast<int64_t>(to_merge.size()) * Hkv, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> acc(V);
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t b = to_merge[bh / Hkv], h = bh % Hkv;
        const int64_t splits = (plan.first_item[b + 1] - plan.first_item[b]) / Hkv;
        merge_splits(partials, plan.first_item[b] + h, Hkv, splits, a.out + (b * Hq + h * G) * V, acc.data());
      }
    });
  };
  dispatch(scalar, "paged_decode_attention", [&](auto* tag) {
    if (cached == at::kFloat8_e4m3fn) launch(tag, static_cast<c10::Float8_e4m3fn*>(nullptr));
    else if (cached == at::kFloat8_e5m2) launch(tag, static_cast<c10::Float8_e5m2*>(nullptr));
    else if (cached == at::kBFloat16) launch(tag, static_cast<at::BFloat16*>(nullptr));
    else launch(tag, tag);
  });
}

namespace {

void paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                            int64_t sliding_window, double softcap, int64_t split_keys, bool tiles,
                            const at::Tensor& out) {
  TORCH_CHECK(out.sizes() == q.sizes(), "out must have q's shape");
  decode_rows(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, softcap, split_keys, q.size(2),
              tiles, out);
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
