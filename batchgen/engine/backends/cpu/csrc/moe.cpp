// Mixture of SwiGLU experts in one call: the torch reference's algorithm (backends/torch/ops.py fused_moe: pairs
// sorted by expert, one pair of matmuls per expert that got tokens, the weighted rows summed back per token in
// fp32) with its loop over experts in C++. Python then makes no call per expert, and reads nothing on the host:
// a recorded CPU decode step (executor/op_replay.py) takes the whole layer as one op, and every replay routes
// its own tokens. The same ATen ops in the same order as the reference: the output is bit-identical to it.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

namespace batchgen_cpu {
namespace {

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
    const at::Tensor gate_up = at::linear(rows.slice(0, start, start + n), w13[e]);
    const std::vector<at::Tensor> halves = gate_up.chunk(2, -1);
    expert_out.slice(0, start, start + n).copy_(at::linear(at::silu(halves[0]) * halves[1], w2[e]));
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
