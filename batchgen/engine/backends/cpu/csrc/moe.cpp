// Mixture of SwiGLU experts in one call: the torch reference's algorithm (backends/torch/ops.py fused_moe: pairs
// sorted by expert, one pair of matmuls per expert that got tokens, the weighted rows summed back per token in
// fp32) with its loop over experts in C++. Python then makes no call per expert, and reads nothing on the host:
// a recorded CPU decode step (executor/op_replay.py) takes the whole layer as one op, and every replay routes
// its own tokens. The same ATen ops in the same order as the reference, except the matmuls of an expert that
// gets few rows (decode steps): they read W once, straight through, where a GEMM would pack W first. fp32 ones (up
// to 256 rows) run small_linear.cpp's op, whose sums take k in order, so a token's result does not depend on the
// expert's other tokens (the register tiles it replaced gave way to the GEMM past 128 rows; on AVX2, 64 experts of
// 2048 x 768, top-6: 1.01-1.03x at 1-64 tokens, 1.33x at 256, `benchmarks/moe_cpu.py --baseline`). bf16 ones, on
// CPUs with AVX512-BF16, run decode_dots.h's dot-product tiles, rounded to bf16 as the reference rounds. Their sums
// add in another order than the GEMM's; the rest is bit-identical to the reference. Where the engine packs bf16
// experts in dot_linear's blocks (AVX512-BF16 without AMX), fused_moe_packed takes the layer instead: every
// expert's projection in one loop of dot_blocks.h's tiles.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "decode_dots.h"
#include "dot_blocks.h"
#include "small_linear.h"
#include "vec.h"

#include <vector>

namespace batchgen_cpu {
namespace {

// At most this many rows take few_rows_linear: a bf16 layer of 64 experts (2048 x 768), against the GEMM, 1.7-2.8x
// at 1-16 tokens (a decode step's few rows an expert), 1.15x at 24 rows an expert, 1.05x at 48-96.
constexpr int64_t kFewRows = 128;

// The next lines of a run of bytes, two a call: as many as the dot tiles read of 4 W rows between two calls (twice
// a step of 32 dims, 256 bytes).
struct NextRows {
  const char* p;
  int64_t left;
  void operator()() {
    for (int i = 0; i < 2 && left > 0; ++i, p += 64, left -= 64) __builtin_prefetch(p);
  }
};

// out (M, N) = a (M, K) W^T for bf16 W (N, K), all contiguous, M <= kFewRows, K a multiple of 32, on CPUs with
// AVX512-BF16; false (nothing written) for anything else. W four rows at a time in decode_dots.h's dot tiles,
// each of a's 4-row blocks multiplied while those rows are in L1 (only the first asks for the thread's next W
// rows), the threads over W's rows, each rounding its own columns to bf16 at the end as the reference rounds.
// Every output is one tile's sum: the same for any thread count.
bool few_rows_linear(const at::Tensor& a, const at::Tensor& w, const at::Tensor& out) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  using T = at::BFloat16;
  const int64_t M = a.size(0), K = a.size(1), N = w.size(0);
  if (M > kFewRows || !a.is_contiguous() || !w.is_contiguous() || !out.is_contiguous() || K % 32 != 0) return false;
  std::vector<float> y(M * N);
  const T* x = a.const_data_ptr<T>();
  const T* wp = w.const_data_ptr<T>();
  T* dst = out.data_ptr<T>();
  float* yp = y.data();
  at::parallel_for(0, (N + 3) / 4, 8, [&](int64_t begin, int64_t end) {
    NoAhead none;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = 4 * t, rows_here = std::min<int64_t>(4, N - n0);
      const T* rows[4];
      for (int64_t r = 0; r < rows_here; ++r) rows[r] = wp + (n0 + r) * K;
      // The thread's next 4 rows of W follow these in memory.
      NextRows next{reinterpret_cast<const char*>(wp + (n0 + 4) * K), t + 1 < end ? 4 * K * int64_t{sizeof(T)} : 0};
      for (int64_t m0 = 0; m0 < M; m0 += 4)
        with_constant<4>(std::min<int64_t>(4, M - m0), [&](auto m) {
          with_constant<4>(rows_here, [&](auto kb) {
            if (m0 == 0) register_tile<m, kb, DotStep>(x, K, rows, yp + n0, N, next);
            else register_tile<m, kb, DotStep>(x + m0 * K, K, rows, yp + m0 * N + n0, N, none);
          });
        });
    }
    const int64_t first = 4 * begin, last = std::min(N, 4 * end);
    for (int64_t m = 0; m < M; ++m) {
      int64_t c = first;
      for (; c + kStep <= last; c += kStep)
        store2(dst + m * N + c, Vec::loadu(yp + m * N + c), Vec::loadu(yp + m * N + c + Vec::size()));
      for (; c < last; ++c) dst[m * N + c] = at::BFloat16(yp[m * N + c]);
    }
  });
  return true;
#else
  return false;  // no dot tiles in this build
#endif
}

// out (a fresh tensor where undefined) = the reference's at::linear(a, w): fp32 steps of up to kSmallRows rows
// through small_linear (each row's sums in k order, whatever the expert's other rows), bf16 ones through
// few_rows_linear where it takes them.
at::Tensor expert_linear(const at::Tensor& a, const at::Tensor& w, at::Tensor out = {}) {
  if (!out.defined()) out = at::empty({a.size(0), w.size(0)}, a.options());
  const bool fp32 = a.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat;
  if (fp32 && a.size(0) <= kSmallRows && w.is_contiguous() && a.stride(1) == 1 && out.stride(1) == 1)
    small_linear(a, w, c10::nullopt, out);
  else if (!(a.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 && few_rows_linear(a, w, out)))
    at::linear_out(out, a, w);
  return out;
}

// A step's routed pairs sorted by expert, as the reference sorts them: `rows` (P, H) the tokens' rows in that
// order, `counts[shift + e]` expert e's pairs (bin 0 counts the pairs skipped, -1, which sort first).
struct Routed {
  at::Tensor counts_t, order, tokens, rows;
  int64_t shift;
  const int64_t* counts() const { return counts_t.const_data_ptr<int64_t>(); }
};

Routed route(const at::Tensor& x, const at::Tensor& topk_ids, int64_t experts, bool skip_negative) {
  const at::Tensor flat = topk_ids.flatten().to(at::kLong);
  const int64_t shift = skip_negative ? 1 : 0;
  const at::Tensor binned = shift ? flat + shift : flat;
  if (flat.numel() > 0) {  // checked here: an index outside the experts must not reach the matmuls
    const int64_t low = binned.min().item<int64_t>(), high = binned.max().item<int64_t>();
    TORCH_CHECK(low >= 0 && high < experts + shift, "expert ids must lie in [", -shift, ", ", experts, ")");
  }
  Routed r;
  r.shift = shift;
  r.counts_t = at::bincount(binned, {}, experts + shift);
  r.order = at::argsort(flat, /*stable=*/true).slice(0, shift ? r.counts()[0] : 0);
  r.tokens = at::floor_divide(r.order, topk_ids.size(1));
  r.rows = x.index({r.tokens});
  return r;
}

// out = each token's experts' outputs (expert_out, in the routed order) weighted and summed in fp32.
void combine(const at::Tensor& expert_out, const Routed& r, const at::Tensor& topk_weights, const at::Tensor& out) {
  const at::Tensor weighted = expert_out.to(at::kFloat) * topk_weights.flatten().index({r.order}).unsqueeze(1);
  at::Tensor summed = at::zeros(out.sizes(), out.options().dtype(at::kFloat));
  out.copy_(summed.index_add_(0, r.tokens, weighted));
}

void check_routing(const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                   const at::Tensor& out, int64_t hidden) {
  TORCH_CHECK(x.dim() == 2 && topk_ids.dim() == 2, "x (T, H), topk_ids (T, k)");
  TORCH_CHECK(topk_ids.size(0) == x.size(0) && topk_weights.sizes() == topk_ids.sizes(), "one routing row per token");
  TORCH_CHECK(out.sizes() == at::IntArrayRef({x.size(0), hidden}) && out.scalar_type() == x.scalar_type(),
              "out must be (T, H) in x's dtype");
}

void fused_moe(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& topk_weights,
               const at::Tensor& topk_ids, bool skip_negative, const at::Tensor& out) {
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3, "w13 (E, 2I, H), w2 (E, H, I)");
  const int64_t experts = w13.size(0);
  TORCH_CHECK(w2.size(0) == experts && w13.size(2) == x.size(-1) && w2.size(2) * 2 == w13.size(1),
              "expert weights do not match x or each other");
  check_routing(x, topk_weights, topk_ids, out, w2.size(1));
  const Routed r = route(x, topk_ids, experts, skip_negative);
  at::Tensor expert_out = at::empty({r.rows.size(0), w2.size(1)}, x.options());
  for (int64_t e = 0, start = 0; e < experts; ++e) {
    const int64_t n = r.counts()[e + r.shift];
    if (n == 0) continue;
    const at::Tensor gate_up = expert_linear(r.rows.slice(0, start, start + n), w13[e]);
    const std::vector<at::Tensor> halves = gate_up.chunk(2, -1);
    expert_linear(at::silu(halves[0]) * halves[1], w2[e], expert_out.slice(0, start, start + n));
    start += n;
  }
  combine(expert_out, r, topk_weights, out);
}

// Rows of x [first, first + rows) that go through expert `expert`'s weight together.
struct Piece {
  int64_t expert, first, rows;
};

// An expert's routed rows in pieces of at most kChunkBytes of x (K inputs), as dot_linear chunks its rows.
std::vector<Piece> pieces_of(const Routed& r, int64_t experts, int64_t K) {
  const int64_t most = std::max<int64_t>(kTileRows, kChunkBytes / (2 * K) / kTileRows * kTileRows);
  std::vector<Piece> pieces;
  for (int64_t e = 0, start = 0; e < experts; ++e) {
    const int64_t end = start + r.counts()[e + r.shift];
    for (int64_t first = start; first < end; first += most) pieces.push_back({e, first, std::min(most, end - first)});
    start = end;
  }
  return pieces;
}

// out (P, N) = x (P, K) times, for each piece, its expert's packed weight (E, N/48 blocks, K/2, 48, 2); with
// `gated`, out (P, I) = silu(x gate) * (x up) for gate and up blocks in turn (E, 2 I/48, K/2, 48, 2). One parallel
// loop over (piece, block) items, piece by piece, so a thread's next items read rows it has just read.
void experts_in_blocks(const at::Tensor& x, const at::Tensor& packed, const std::vector<Piece>& pieces, bool gated,
                       const at::Tensor& out) {
  const int64_t K = x.size(1), N = out.size(1), blocks = packed.size(1) / (gated ? 2 : 1), pairs = K / 2;
  const int64_t block_elems = pairs * 2 * kBlock, expert_elems = packed.size(1) * block_elems;
  const at::BFloat16* xp = x.const_data_ptr<at::BFloat16>();
  const at::BFloat16* wp = packed.const_data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, static_cast<int64_t>(pieces.size()) * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const Piece& p = pieces[item / blocks];
      const int64_t b = item % blocks, cols = std::min(kBlock, N - b * kBlock);
      const at::BFloat16* expert = wp + p.expert * expert_elems;
      at::BFloat16* o = op + p.first * N + b * kBlock;
      if (gated) {
        const at::BFloat16* gate = expert + 2 * b * block_elems;
        gated_block_rows(xp + p.first * K, K, p.rows, pairs, gate, gate + block_elems, nullptr, nullptr, o, N, cols);
      } else {
        block_rows(xp + p.first * K, K, p.rows, pairs, expert + b * block_elems, nullptr, o, N, cols);
      }
    }
  });
}

// The mixture over bf16 experts packed in dot_linear's blocks (prepack.py, on CPUs with AVX512-BF16): w13
// (E, 2 ceil(I / 48), H / 2, 48, 2), gate block b then up block b (pack_dot_gated), w2 (E, ceil(H / 48), I / 2, 48,
// 2) (pack_dot_experts). The reference's algorithm: gate|up rounded to bf16 as a linear's output is, silu(gate) * up
// rounded once (the silu_and_mul op's rows), down, the weighted rows summed in fp32. Each projection of every
// expert runs in one parallel loop, the activation on each tile of gate|up (dot_blocks.h's gated_block_rows).
// Every output is the same for any thread count.
void fused_moe_packed(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2, int64_t intermediate,
                      const at::Tensor& topk_weights, const at::Tensor& topk_ids, bool skip_negative,
                      const at::Tensor& out) {
  TORCH_CHECK(kDotTiles, "fused_moe_packed needs a CPU with AVX512-BF16 (and the kernels built for it)");
  const int64_t I = intermediate, H = x.size(-1), experts = w13.size(0);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w13.scalar_type() == at::kBFloat16 &&
              w2.scalar_type() == at::kBFloat16, "fused_moe_packed takes bfloat16 x and experts");
  TORCH_CHECK(w13.dim() == 5 && w2.dim() == 5 && w13.is_contiguous() && w2.is_contiguous() && w2.size(0) == experts &&
              H % 2 == 0 && I % 2 == 0 && w13.size(1) == 2 * ((I + kBlock - 1) / kBlock) && w13.size(2) * 2 == H &&
              w2.size(1) == (H + kBlock - 1) / kBlock && w2.size(2) * 2 == I && w13.size(3) == kBlock &&
              w2.size(3) == kBlock, "packed experts must be (E, 2 I/48, H/2, 48, 2) and (E, H/48, I/2, 48, 2) for x's ",
              H, " inputs and ", I, " intermediate values");
  check_routing(x, topk_weights, topk_ids, out, H);
  const Routed r = route(x, topk_ids, experts, skip_negative);
  const int64_t P = r.rows.size(0);
  const at::Tensor act = at::empty({P, I}, x.options());
  experts_in_blocks(r.rows, w13, pieces_of(r, experts, H), /*gated=*/true, act);
  const at::Tensor expert_out = at::empty({P, H}, x.options());
  experts_in_blocks(act, w2, pieces_of(r, experts, I), /*gated=*/false, expert_out);
  combine(expert_out, r, topk_weights, out);
}

}  // namespace
}  // namespace batchgen_cpu

TORCH_LIBRARY_FRAGMENT(batchgen_cpu, m) {
  m.def("fused_moe(Tensor x, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, bool skip_negative, "
        "Tensor(a!) out) -> ()");
  m.def("fused_moe_packed(Tensor x, Tensor w13, Tensor w2, int intermediate, Tensor topk_weights, Tensor topk_ids, "
        "bool skip_negative, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(batchgen_cpu, CPU, m) {
  m.impl("fused_moe", &batchgen_cpu::fused_moe);
  m.impl("fused_moe_packed", &batchgen_cpu::fused_moe_packed);
}
