// fp32 y = x W^T (+ b) for decode-sized steps (small_linear.cpp), for the ops that multiply a few rows by a weight of
// their own (the experts): each output the fused multiply-adds of its K products in k order from zero, so a row's
// result does not depend on the other rows.
#pragma once

#include <ATen/ATen.h>

namespace batchgen_cpu {

// The most rows that take small_linear rather than a GEMM (prepack.py's SMALL_ROWS).
constexpr int64_t kSmallRows = 256;

// out (M, N) = x (M, K) weight (N, K)^T (+ bias): float32, weight contiguous, x and out with contiguous rows.
void small_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                  const at::Tensor& out);

}  // namespace batchgen_cpu
