// The bf16 linear layer, y = x W^T (+ b), on CPUs with AVX512-BF16, over W packed once in dot_blocks.h's blocks
// (b likewise, in fp32): items of (chunk of rows, block), a thread's blocks read front to back, which the hardware
// prefetchers keep up with, so weights streamed from memory keep pace with the products where oneDNN's prepacked
// linear waits for them. Every output is the sum of one lane over the input pairs in order: the same for any row
// count, tile or thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "dot_blocks.h"

#include <algorithm>
#include <cstring>

namespace batchgen_cpu {
namespace {

void dot_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                const at::Tensor& out) {
  TORCH_CHECK(kDotTiles, "dot_linear needs a CPU with AVX512-BF16 (and the kernels built for it)");
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 4 && out.dim() == 2, "x (M, K), packed (N/48, K/2, 48, 2), out (M, N)");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 &&
              out.scalar_type() == at::kBFloat16, "dot_linear takes bfloat16 x, weight and out");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), blocks = packed.size(0);
  TORCH_CHECK(packed.is_contiguous() && packed.size(1) * 2 == K && packed.size(2) == kBlock && packed.size(3) == 2,
              "the packed weight does not match x's ", K, " inputs");
  TORCH_CHECK(out.size(0) == M && (N + kBlock - 1) / kBlock == blocks, "out must be (M, N) for the packed weight");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1, "x's and out's rows must be contiguous");
  TORCH_CHECK(K >= 2, "dot_linear takes at least one pair of inputs");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                        bias->numel() == blocks * kBlock), "bias must be fp32, zero-padded to the packed blocks");
  if (M == 0 || N == 0) return;
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  const at::BFloat16* xp = x.const_data_ptr<at::BFloat16>();
  const at::BFloat16* wp = packed.const_data_ptr<at::BFloat16>();
  const float* bp = bias ? bias->const_data_ptr<float>() : nullptr;
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t x_stride = x.stride(0), out_stride = out.stride(0), pairs = K / 2;
  const RowChunks chunks = row_chunks(M, K);
  at::parallel_for(0, chunks.count * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t c = item / blocks, b = item % blocks;
      const at::BFloat16* block = wp + b * pairs * 2 * kBlock;
      const int64_t cols = std::min(kBlock, N - b * kBlock);
      const float* block_bias = bp ? bp + b * kBlock : nullptr;
      const int64_t m0 = c * chunks.rows;
      block_rows(xp + m0 * x_stride, x_stride, std::min(M, m0 + chunks.rows) - m0, pairs, block, block_bias,
                 op + m0 * out_stride + b * kBlock, out_stride, cols);
    }
  });
#endif
}

// out (M, I) = silu(x W_gate^T + b_gate) * (x W_up^T + b_up): a gated MLP's gate|up projection and its activation in
// one loop. packed holds gate block b then up block b, [2 ceil(I/48)][K/2][48][2] (prepack.py's pack_dot_gated);
// bias likewise, fp32. The same values as dot_linear's gate|up then the silu_and_mul op, without the 2I-wide rows
// between them.
void dot_gated_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                      const at::Tensor& out) {
  TORCH_CHECK(kDotTiles, "dot_gated_linear needs a CPU with AVX512-BF16 (and the kernels built for it)");
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 4 && out.dim() == 2,
              "x (M, K), packed (2 I/48, K/2, 48, 2), out (M, I)");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 &&
              out.scalar_type() == at::kBFloat16, "dot_gated_linear takes bfloat16 x, weight and out");
  const int64_t M = x.size(0), K = x.size(1), I = out.size(1), blocks = packed.size(0) / 2;
  TORCH_CHECK(packed.is_contiguous() && packed.size(1) * 2 == K && packed.size(2) == kBlock && packed.size(3) == 2,
              "the packed weight does not match x's ", K, " inputs");
  TORCH_CHECK(packed.size(0) % 2 == 0 && out.size(0) == M && (I + kBlock - 1) / kBlock == blocks,
              "out must be (M, I) for the packed gate and up blocks");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1, "x's and out's rows must be contiguous");
  TORCH_CHECK(K >= 2, "dot_gated_linear takes at least one pair of inputs");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                        bias->numel() == 2 * blocks * kBlock), "bias must be fp32, zero-padded to the packed blocks");
  if (M == 0 || I == 0) return;
  const at::BFloat16* xp = x.const_data_ptr<at::BFloat16>();
  const at::BFloat16* wp = packed.const_data_ptr<at::BFloat16>();
  const float* bp = bias ? bias->const_data_ptr<float>() : nullptr;
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t x_stride = x.stride(0), out_stride = out.stride(0), pairs = K / 2, block_elems = pairs * 2 * kBlock;
  const RowChunks chunks = row_chunks(M, K);
  at::parallel_for(0, chunks.count * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t c = item / blocks, b = item % blocks, m0 = c * chunks.rows;
      const int64_t rows = std::min(M, m0 + chunks.rows) - m0;
      const at::BFloat16* gate = wp + 2 * b * block_elems;
      gated_block_rows(xp + m0 * x_stride, x_stride, rows, pairs, gate, gate + block_elems,
                       bp ? bp + 2 * b * kBlock : nullptr, bp ? bp + (2 * b + 1) * kBlock : nullptr,
                       op + m0 * out_stride + b * kBlock, out_stride, std::min(kBlock, I - b * kBlock));
    }
  });
}

// out (B, H, N) = per head h, x[:, h] (B, K) times head h's packed weight (H, N/48, K/2, 48, 2): the latent
// attention's absorbed products, one parallel loop over (head, block) items. x's and out's rows may be strided.
void dot_bmm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& out) {
  TORCH_CHECK(kDotTiles, "dot_bmm needs a CPU with AVX512-BF16 (and the kernels built for it)");
  TORCH_CHECK(x.dim() == 3 && packed.dim() == 5 && out.dim() == 3, "x (B, H, K), packed (H, N/48, K/2, 48, 2), "
              "out (B, H, N)");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 &&
              out.scalar_type() == at::kBFloat16, "dot_bmm takes bfloat16 x, weight and out");
  const int64_t B = x.size(0), H = x.size(1), K = x.size(2), N = out.size(2), blocks = packed.size(1);
  TORCH_CHECK(packed.is_contiguous() && packed.size(0) == H && packed.size(2) * 2 == K && packed.size(3) == kBlock &&
              packed.size(4) == 2, "the packed weight does not match x's ", H, " heads of ", K, " inputs");
  TORCH_CHECK(out.size(0) == B && out.size(1) == H && (N + kBlock - 1) / kBlock == blocks,
              "out must be (B, H, N) for the packed weight");
  TORCH_CHECK(x.stride(2) == 1 && out.stride(2) == 1, "x's and out's rows must be contiguous");
  if (B == 0 || N == 0) return;
  const at::BFloat16* xp = x.const_data_ptr<at::BFloat16>();
  const at::BFloat16* wp = packed.const_data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t pairs = K / 2, block_elems = pairs * 2 * kBlock;
  at::parallel_for(0, H * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / blocks, b = item % blocks;
      block_rows(xp + h * x.stride(1), x.stride(0), B, pairs, wp + item * block_elems, nullptr,
                 op + h * out.stride(1) + b * kBlock, out.stride(0), std::min(kBlock, N - b * kBlock));
    }
  });
}

bool dot_linear_built() { return kDotTiles; }

}  // namespace
}  // namespace batchgen_cpu

TORCH_LIBRARY_FRAGMENT(batchgen_cpu, m) {
  m.def("dot_linear(Tensor x, Tensor packed, Tensor? bias, Tensor(a!) out) -> ()");
  m.def("dot_gated_linear(Tensor x, Tensor packed, Tensor? bias, Tensor(a!) out) -> ()");
  m.def("dot_bmm(Tensor x, Tensor packed, Tensor(a!) out) -> ()");
  m.def("dot_linear_built() -> bool");
}

TORCH_LIBRARY_IMPL(batchgen_cpu, CPU, m) {
  m.impl("dot_linear", &batchgen_cpu::dot_linear);
  m.impl("dot_gated_linear", &batchgen_cpu::dot_gated_linear);
  m.impl("dot_bmm", &batchgen_cpu::dot_bmm);
}

TORCH_LIBRARY_IMPL(batchgen_cpu, CompositeExplicitAutograd, m) {
  m.impl("dot_linear_built", &batchgen_cpu::dot_linear_built);
}
