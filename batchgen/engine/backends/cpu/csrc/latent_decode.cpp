// Fused paged decode of multi-head latent attention (DeepSeek's MLA, absorbed form) on CPU: one query token
// per sequence and H query heads over ONE shared latent head, read in place from the paged latent cache.
//
// A cache row is [latent (R) | k_pe (P)]: the key is the whole row, the value its first `value_dim` (R) dims.
// Work items are (sequence, split of split_keys keys) (paged.h); all H heads share one pass over a split's
// rows (MQA: the group is every head). The split is walked in chunks of kChunk rows: each row is loaded (and,
// from bf16, converted) once, and serves the chunk's scores and then its values while still in cache, with an
// online softmax across chunks; scores and values run in register tiles of several heads. Scores, softmax
// and accumulation are fp32; the merge of a sequence's splits runs in split order, so the output is
// bit-identical for any thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "paged.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

namespace batchgen_cpu {
namespace {

constexpr int64_t kChunk = 16;  // rows a chunk holds: 16 x 576 fp32 is 36 KiB

template <typename T>
struct Latent {
  const T* q; int64_t q_row, q_head;  // (B, H, W)
  const T* cache; int64_t cache_block, cache_row, block_size;  // (blocks, block_size, W)
  const int32_t* tables; int64_t tables_row;
  int64_t heads, width, value_dim;
  float scale;
};

// A thread's scratch, overwritten by each item before it is read.
struct Scratch {
  std::vector<float> q32, rows, scores, rescale;  // (H, W), (kChunk, W) converted rows, (H, kChunk), (H,)
  Scratch(int64_t heads, int64_t width)
      : q32(heads * width), rows(kChunk * width), scores(heads * kChunk), rescale(heads) {}
};

// The row as fp32: itself for an fp32 cache, else converted into buf.
template <typename T>
inline const float* as_float(const T* row, float* buf, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return row;
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

// Folds chunk scores s (H, n) into each head's running max m and sum l: s becomes p = e^(s - m_new), and
// rescale[h] = e^(m_old - m_new) is what the head's output so far must be multiplied by.
inline void online_softmax(float* s, int64_t n, int64_t heads, float* m, float* l, float* rescale) {
  for (int64_t h = 0; h < heads; ++h) {
    float* row = s + h * kChunk;
    const float mx = std::max(m[h], *std::max_element(row, row + n));
    at::vec::map([mx](Vec x) { return (x - Vec(mx)).exp(); }, row, row, n);
    rescale[h] = std::exp(m[h] - mx);  // 0 for the first chunk (m = -inf)
    l[h] = l[h] * rescale[h] + at::vec::reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, row, n);
    m[h] = mx;
  }
}

// Register tiles: scores of 2 heads x 4 rows (each loaded vector of q and of a row feeds several FMAs), values
// of 4 heads x 16 dims (each row vector feeds 4 heads).
constexpr int kScoreHeads = 2, kScoreRows = 4, kValueHeads = 4;

// s[h][c] = scale q_h . row_c for HB heads from q and KB rows.
template <int HB, int KB>
inline void score_tile(const float* q, int64_t W, const float* const* rows, float* s, float scale) {
  Vec acc[HB][KB];
  for (int hb = 0; hb < HB; ++hb)
    for (int kb = 0; kb < KB; ++kb) acc[hb][kb] = Vec(0.f);
  int64_t d = 0;
  for (; d + Vec::size() <= W; d += Vec::size()) {
    Vec k[KB];
    for (int kb = 0; kb < KB; ++kb) k[kb] = Vec::loadu(rows[kb] + d);
    for (int hb = 0; hb < HB; ++hb) {
      const Vec qv = Vec::loadu(q + hb * W + d);
      for (int kb = 0; kb < KB; ++kb) acc[hb][kb] = at::vec::fmadd(qv, k[kb], acc[hb][kb]);
    }
  }
  for (int hb = 0; hb < HB; ++hb)
    for (int kb = 0; kb < KB; ++kb) {
      float sum = sum_of(acc[hb][kb]);
      for (int64_t t = d; t < W; ++t) sum += q[hb * W + t] * rows[kb][t];
      s[hb * kChunk + kb] = sum * scale;
    }
}

// scores (H, kChunk) of the chunk's n rows, in tiles of heads x rows with smaller ones at the edges.
template <int HB>
inline void score_heads(const float* q, int64_t W, const float* const* rows, int64_t n, float* s, float scale) {
  int64_t c = 0;
  for (; c + kScoreRows <= n; c += kScoreRows) score_tile<HB, kScoreRows>(q, W, rows + c, s + c, scale);
  for (; c < n; ++c) score_tile<HB, 1>(q, W, rows + c, s + c, scale);
}

inline void scores_of(const float* q32, int64_t heads, int64_t W, const float* const* rows, int64_t n, float* s,
                      float scale) {
  int64_t h = 0;
  for (; h + kScoreHeads <= heads; h += kScoreHeads)
    score_heads<kScoreHeads>(q32 + h * W, W, rows, n, s + h * kChunk, scale);
  for (; h < heads; ++h) score_heads<1>(q32 + h * W, W, rows, n, s + h * kChunk, scale);
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

// o (H, V) = rescale o + sum_c p_c v_c over the chunk's rows.
inline void accumulate_values(float* o, const float* p, const float* rescale, const float* const* rows, int64_t n,
                              int64_t heads, int64_t V) {
  int64_t h = 0;
  for (; h + kValueHeads <= heads; h += kValueHeads)
    value_tile<kValueHeads>(o + h * V, V, p + h * kChunk, rescale + h, rows, n);
  for (; h < heads; ++h) value_tile<1>(o + h * V, V, p + h * kChunk, rescale + h, rows, n);
}

// One split of one sequence, all heads: o (H, V) unnormalised, with each head's max m and sum l.
template <typename T>
void attend_split(const Latent<T>& a, const Item& it, Scratch& w, float* o, float* m, float* l) {
  const int64_t H = a.heads, W = a.width, V = a.value_dim;
  for (int64_t h = 0; h < H; ++h) {
    const T* src = a.q + it.seq * a.q_row + h * a.q_head;
    for (int64_t d = 0; d < W; ++d) w.q32[h * W + d] = static_cast<float>(src[d]);
  }
  std::fill(o, o + H * V, 0.f);
  std::fill(m, m + H, kNegInf);
  std::fill(l, l + H, 0.f);
  const int32_t* table = a.tables + it.seq * a.tables_row;
  const float* rows[kChunk];
  for (int64_t first = it.first; first < it.last; first += kChunk) {
    const int64_t last = std::min(it.last, first + kChunk), n = last - first;
    for_each_row(table, a.block_size, a.cache_block, a.cache_row, first, last, [&](int64_t pos, int64_t row) {
      const int64_t c = pos - first;
      rows[c] = as_float(a.cache + row, w.rows.data() + c * W, W);
    });
    scores_of(w.q32.data(), H, W, rows, n, w.scores.data(), a.scale);
    online_softmax(w.scores.data(), n, H, m, l, w.rescale.data());
    accumulate_values(o, w.scores.data(), w.rescale.data(), rows, n, H, V);
  }
}

void latent_decode_attention(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& block_tables,
                             const at::Tensor& context_lens, int64_t value_dim, double scale, int64_t split_keys,
                             const at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be (B, H, R + P) with contiguous rows");
  TORCH_CHECK(cache.dim() == 3 && cache.is_contiguous() && cache.size(2) == q.size(2),
              "the latent cache must be contiguous (blocks, block_size, R + P), rows as wide as q's");
  const int64_t B = q.size(0), H = q.size(1), W = q.size(2);
  TORCH_CHECK(value_dim > 0 && value_dim <= W, "value_dim ", value_dim, " outside 1..", W);
  TORCH_CHECK(out.is_contiguous() && out.dim() == 3 && out.size(0) == B && out.size(1) == H &&
              out.size(2) == value_dim, "out must be contiguous (B, H, value_dim)");
  const auto scalar = q.scalar_type();
  TORCH_CHECK(cache.scalar_type() == scalar && out.scalar_type() == scalar, "q, cache and out must share one dtype");
  auto ctx = context_lens.to(at::kLong).contiguous();
  auto tables = block_tables.to(at::kInt).contiguous();
  TORCH_CHECK(ctx.numel() == B, "one context length per row");
  const DecodePlan plan = plan_decode(ctx, tables, cache.size(1), cache.size(0), 1, split_keys,
                                      [](int64_t) { return int64_t{0}; });
  const int64_t num_items = plan.items.size();
  Partials partials(num_items, H, value_dim);

  dispatch(scalar, "latent_decode_attention", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const Latent<T> a{q.const_data_ptr<T>(), q.stride(0), q.stride(1), cache.const_data_ptr<T>(), cache.stride(0),
                      cache.stride(1), cache.size(1), tables.const_data_ptr<int32_t>(), tables.size(1), H, W,
                      value_dim, static_cast<float>(scale)};
    at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
      Scratch scratch(H, W);
      for (int64_t i = begin; i < end; ++i)
        attend_split(a, plan.items[i], scratch, partials.o_of(i), partials.m_of(i), partials.l_of(i));
    });
    T* out_p = out.data_ptr<T>();
    at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> acc(value_dim);
      for (int64_t b = begin; b < end; ++b)
        merge_splits(partials, plan.first_item[b], plan.first_item[b + 1] - plan.first_item[b],
                     out_p + b * H * value_dim, acc.data());
    });
  });
}

}  // namespace
}  // namespace batchgen_cpu

TORCH_LIBRARY_FRAGMENT(batchgen_cpu, m) {
  m.def("latent_decode_attention(Tensor q, Tensor cache, Tensor block_tables, Tensor context_lens, int value_dim, "
        "float scale, int split_keys, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(batchgen_cpu, CPU, m) {
  m.impl("latent_decode_attention", &batchgen_cpu::latent_decode_attention);
}
