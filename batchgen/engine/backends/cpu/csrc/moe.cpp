// Mixture of SwiGLU experts in one call: the torch reference's algorithm (backends/torch/ops.py fused_moe: pairs
// sorted by expert, one pair of matmuls per expert that got tokens, the weighted rows summed back per token in
// fp32) with its loop over experts in C++. Python then makes no call per expert, and reads nothing on the host:
// a recorded CPU decode step (executor/op_replay.py) takes the whole layer as one op, and every replay routes
// its own tokens. The same ATen ops in the same order as the reference: the output is bit-identical to it,
// except where an expert gets few rows of bf16 on a CPU with AVX512-BF16 (decode steps): there its two matmuls
// read W once through decode_dots.h's dot-product tiles (fp32 sums in another order, then rounded to bf16 as the
// reference's are), where a GEMM would pack W first.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "decode_dots.h"
#include "vec.h"

#include <vector>

namespace batchgen_cpu {
namespace {

// At most this many rows take few_rows_linear: a layer of 64 experts (2048 x 768), against the GEMM, 2.5-2.8x at
// 1-16 tokens (a decode step's few rows an expert), 1.15x at 24 rows an expert, 1.05x at 48-96.
constexpr int64_t kFewRows = 128;

// The next lines of a run of bytes, `kLines` a call (register_tile calls twice a step of 32 bf16 dims: 4 W rows'
// 256 bytes, so 4 lines a step keep pace with the reads).
struct NextLines {
  static constexpr int kLines = 2;
  const char* p;
  int64_t left;
  void operator()() {
    for (int i = 0; i < kLines && left > 0; ++i, p += 64, left -= 64) __builtin_prefetch(p);
  }
};

// out (M, N) = a (M, K) W^T in bf16 for W (N, K), all bf16 and contiguous, K a multiple of 32, M <= kFewRows;
// false (nothing written) where the CPU has no dot tiles or the shapes do not fit. W four rows at a time, each
// of a's 4-row blocks multiplied while those rows are in L1, the threads over W's rows, each rounding its own
// columns to bf16 at the end. Every output is one tile's sum: the same for any thread count.
bool few_rows_linear(const at::Tensor& a, const at::Tensor& w, const at::Tensor& out) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  const int64_t M = a.size(0), K = a.size(1), N = w.size(0);
  if (a.scalar_type() != at::kBFloat16 || w.scalar_type() != at::kBFloat16 || M > kFewRows || K % 32 != 0 ||
      !a.is_contiguous() || !w.is_contiguous())
    return false;
  std::vector<float> y(M * N);
  const auto* x = a.const_data_ptr<at::BFloat16>();
  const auto* wp = w.const_data_ptr<at::BFloat16>();
  auto* dst = out.data_ptr<at::BFloat16>();
  float* yp = y.data();
  at::parallel_for(0, (N + 3) / 4, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = 4 * t, rows_here = std::min<int64_t>(4, N - n0);
      const at::BFloat16* rows[4];
      for (int64_t r = 0; r < rows_here; ++r) rows[r] = wp + (n0 + r) * K;
      // The first block of a asks for the thread's next 4 rows of W (they follow these in memory).
      NextLines next{reinterpret_cast<const char*>(wp + (n0 + 4) * K), t + 1 < end ? 4 * K * 2 : 0};
      NoAhead none;
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
  return false;
#endif
}

// out (a fresh tensor where undefined) = the reference's at::linear(a, w), through few_rows_linear where it
// takes them.
at::Tensor expert_linear(const at::Tensor& a, const at::Tensor& w, at::Tensor out = {}) {
  if (!out.defined()) out = at::empty({a.size(0), w.size(0)}, a.options());
  if (!few_rows_linear(a, w, out)) at::linear_out(out, a, w);
  return out;
}

void fused_moe(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& topk_weights,
               const at::Tensor& topk_ids, bool skip_negative, const at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && w13.dim() == 3 && w2.dim() == 3 && topk_ids.dim() == 2, "x (T, H), w13 (E, 2I, H), "
              "w2 (E, H, I), topk_ids (T, k)");
  const int64_t experts = w13.size(0), top_k = topk_ids.size(1);
  TORCH_CHECK(topk_ids.size(0) == x.size(0) && topk_weights.sizes() == topk_ids.sizes(), "one routing row per token");
  TORCH_CHECK(w2.size(0) == experts && w13.size(2) == x.size(1) && w2.size(2) * 2 == w13.size(1),
              "expert weights do not match x or each other");
  TORCH_CHECK(out.sizes() == at::IntArrayRef({x.size(0), w2.size(1)}) && out.scalar_type() == x.scalar_type(),
              "out must be (T, H) in x's dtype");
  const at::Tensor flat = topk_ids.flatten().to(at::kLong);
  const int64_t shift = skip_negative ? 1 : 0;  // bin 0 counts the skipped pairs (-1), which sort first
  const at::Tensor binned = shift ? flat + shift : flat;
  if (flat.numel() > 0) {  // checked here: an index outside the experts must not reach the matmuls
    const int64_t low = binned.min().item<int64_t>(), high = binned.max().item<int64_t>();
    TORCH_CHECK(low >= 0 && high < experts + shift, "expert ids must lie in [", -shift, ", ", experts, ")");
  }
  const at::Tensor counts_t = at::bincount(binned, {}, experts + shift);
  const int64_t* counts = counts_t.const_data_ptr<int64_t>();
  const at::Tensor order = at::argsort(flat, /*stable=*/true).slice(0, shift ? counts[0] : 0);
  const at::Tensor tokens = at::floor_divide(order, top_k);
  const at::Tensor rows = x.index({tokens});
  at::Tensor expert_out = at::empty({rows.size(0), w2.size(1)}, x.options());
  int64_t start = 0;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t n = counts[e + shift];
    if (n == 0) continue;
    const at::Tensor gate_up = expert_linear(rows.slice(0, start, start + n), w13[e]);
    const std::vector<at::Tensor> halves = gate_up.chunk(2, -1);
    expert_linear(at::silu(halves[0]) * halves[1], w2[e], expert_out.slice(0, start, start + n));
    start += n;
  }
  const at::Tensor weighted = expert_out.to(at::kFloat) * topk_weights.flatten().index({order}).unsqueeze(1);
  at::Tensor summed = at::zeros({x.size(0), w2.size(1)}, x.options().dtype(at::kFloat));
  out.copy_(summed.index_add_(0, tokens, weighted));
}

}  // namespace
}  // namespace batchgen_cpu

TORCH_LIBRARY_FRAGMENT(batchgen_cpu, m) {
  m.def("fused_moe(Tensor x, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, bool skip_negative, "
        "Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(batchgen_cpu, CPU, m) {
  m.impl("fused_moe", &batchgen_cpu::fused_moe);
}
