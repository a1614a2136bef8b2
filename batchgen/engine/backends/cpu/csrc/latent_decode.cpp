// Fused paged decode of multi-head latent attention (DeepSeek's MLA, absorbed form) on CPU: one query token
// per sequence and H query heads over ONE shared latent head, read in place from the paged latent cache.
//
// A cache row is [latent (R) | k_pe (P)]: the key is the whole row, the value its first `value_dim` (R) dims.
// Work items are (sequence, split of split_keys keys) (paged.h); all H heads share one pass over a split's
// rows (MQA: the group is every head). The split is walked in chunks of kChunk rows: each row is loaded (and,
// from bf16, converted) once, and serves the chunk's scores and then its values while still in cache, with an
// online softmax across chunks; scores and values run in register tiles of several heads. Scores, softmax
// and accumulation are fp32; the merge of a sequence's splits runs in split order, so the output is
// bit-identical for any thread count. On CPUs with amx_bf16, bf16 caches' items run both products in tiles
// (decode_tiles.h); elsewhere with AVX512-BF16, bf16 rows of widths that are multiples of 32 go to the per-head
// op's two passes and dot-product tiles (decode.cpp's decode_rows: one KV head, its values its rows' prefix).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "decode_dots.h"
#include "decode_tiles.h"
#include "paged.h"
#include "split_walk.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

namespace batchgen_cpu {
namespace {

template <typename T>
struct Latent {
  const T* q; int64_t q_row, q_head;  // (B, H, W)
  const T* cache; int64_t cache_block, cache_row, block_size;  // (blocks, block_size, W)
  const int32_t* tables; int64_t tables_row;
  Heads heads;  // H heads, keys W wide, values their first value_dim
};

// One split of one sequence, all heads: o (H, V) unnormalised, with each head's max m and sum l.
template <typename T>
void attend_split(const Latent<T>& a, const Item& it, Scratch& w, float* o, float* m, float* l) {
  const int64_t W = a.heads.key_width;
  load_queries(a.q + it.seq * a.q_row, a.q_head, a.heads, w.q32.data());
  const int32_t* table = a.tables + it.seq * a.tables_row;
  auto chunk = [&](int64_t first, int64_t last, const float** keys, const float** values) {
    for_each_row(table, a.block_size, a.cache_block, a.cache_row, first, last, [&](int64_t pos, int64_t row) {
      const int64_t c = pos - first;
      keys[c] = values[c] = as_float(a.cache + row, w.keys.data() + c * W, W);  // the value: the row's prefix
    });
  };
  auto ahead = [&](int64_t first, int64_t last) {
    for_each_row(table, a.block_size, a.cache_block, a.cache_row, first, last,
                 [&](int64_t, int64_t row) { prefetch(a.cache + row, W * sizeof(T)); });
  };
  attend_rows(a.heads, w, it.first, it.last, chunk, ahead, o, m, l);
}

#if defined(BATCHGEN_AMX)
// One split of one sequence in AMX tiles (decode_tiles.h), all heads: one part, the latent row its keys and
// the row's prefix its values.
void attend_split_in_tiles(const Latent<at::BFloat16>& a, const amx::TileHeads& heads, const Item& it,
                           amx::TileScratch& w, float* o, float* m, float* l) {
  const int32_t* table = a.tables + it.seq * a.tables_row;
  auto row_at = [&](int64_t pos) {
    return a.cache + table[pos / a.block_size] * a.cache_block + (pos % a.block_size) * a.cache_row;
  };
  amx::tile_item<at::BFloat16>(a.q + it.seq * a.q_row, a.q_head, heads, a.heads.scale, it.first, it.last,
                               a.cache_row, row_at, row_at, w, o, m, l);
}
#endif

void latent_decode_attention(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& block_tables,
                             const at::Tensor& context_lens, int64_t value_dim, double scale, int64_t split_keys,
                             bool tiles, const at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be (B, H, R + P) with contiguous rows");
  TORCH_CHECK(cache.dim() == 3 && cache.is_contiguous() && cache.size(2) == q.size(2),
              "the latent cache must be contiguous (blocks, block_size, R + P), rows as wide as q's");
  const int64_t B = q.size(0), H = q.size(1), W = q.size(2);
  TORCH_CHECK(value_dim > 0 && value_dim <= W, "value_dim ", value_dim, " outside 1..", W);
  TORCH_CHECK(out.is_contiguous() && out.dim() == 3 && out.size(0) == B && out.size(1) == H &&
              out.size(2) == value_dim, "out must be contiguous (B, H, value_dim)");
  const auto scalar = q.scalar_type();
  TORCH_CHECK(cache.scalar_type() == scalar && out.scalar_type() == scalar, "q, cache and out must share one dtype");
  auto ctx = context_lens.to(at::kInt).contiguous();  // as the engine passes them: no copy a layer
  auto tables = block_tables.to(at::kInt).contiguous();
  TORCH_CHECK(ctx.numel() == B, "one context length per row");
  bool in_tiles = false;  // bf16 rows in AMX tiles
#if defined(BATCHGEN_AMX)
  const amx::TileHeads tile_heads{H, H, W, value_dim};
  in_tiles = tiles && scalar == at::kBFloat16 && amx::supports_tiles(tile_heads, cache.size(1));
#endif
  if (kDotTiles && scalar == at::kBFloat16 && !in_tiles && W % 32 == 0 && value_dim % 32 == 0) {
    // bf16 rows on a CPU with dot tiles (and no AMX tiles for them): the per-head op's two passes, one KV head
    // whose values are its keys' first value_dim dims.
    const at::Tensor rows = cache.unsqueeze(2);
    decode_rows(q, rows, rows, tables, ctx, scale, 0, 0.0, split_keys, value_dim, false, out);
    return;
  }
  const DecodePlan plan = plan_decode(ctx, tables, cache.size(1), cache.size(0), 1, split_keys,
                                      [](int64_t) { return int64_t{0}; });
  const int64_t num_items = plan.items.size();
  Partials partials(num_items, H, value_dim);

  dispatch(scalar, "latent_decode_attention", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const Latent<T> a{q.const_data_ptr<T>(), q.stride(0), q.stride(1), cache.const_data_ptr<T>(), cache.stride(0),
                      cache.stride(1), cache.size(1), tables.const_data_ptr<int32_t>(), tables.size(1),
                      Heads{H, W, value_dim, static_cast<float>(scale), 0.f}};
#if defined(BATCHGEN_AMX)
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      if (in_tiles)
        at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
          amx::TileSession session;
          auto scratch = std::make_unique<amx::TileScratch>(tile_heads);
          for (int64_t i = begin; i < end; ++i)
            attend_split_in_tiles(a, tile_heads, plan.items[i], *scratch, partials.o_of(i), partials.m_of(i),
                                  partials.l_of(i));
        });
    }
#endif
    if (!in_tiles)
      at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
        Scratch scratch(a.heads);
        for (int64_t i = begin; i < end; ++i)
          attend_split(a, plan.items[i], scratch, partials.o_of(i), partials.m_of(i), partials.l_of(i));
      });
    T* out_p = out.data_ptr<T>();
    at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> acc(value_dim);
      for (int64_t b = begin; b < end; ++b)
        merge_splits(partials, plan.first_item[b], 1, plan.first_item[b + 1] - plan.first_item[b],
                     out_p + b * H * value_dim, acc.data());
    });
  });
}

}  // namespace
}  // namespace batchgen_cpu

TORCH_LIBRARY_FRAGMENT(batchgen_cpu, m) {
  m.def("latent_decode_attention(Tensor q, Tensor cache, Tensor block_tables, Tensor context_lens, int value_dim, "
        "float scale, int split_keys, bool tiles, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(batchgen_cpu, CPU, m) {
  m.impl("latent_decode_attention", &batchgen_cpu::latent_decode_attention);
}
