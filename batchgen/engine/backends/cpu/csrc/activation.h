// SiLU on CPU vectors, and the SwiGLU product silu(gate) * up a row at a time (the silu_and_mul op's rows, the
// packed experts' activation and dot_gated_linear's blocks).
#pragma once

#include "vec.h"

#include <cmath>

namespace batchgen_cpu {

// x * sigmoid(x) in fp32 on AVX-512: exp2, and 1 / (1 + 2^e) by the 14-bit reciprocal estimate for bf16 (5 bits
// finer than its rounding; 2^e overflowing to inf gives 0, as the limit) or with a Newton step for fp32 (whose
// exponent is clamped so 1 + 2^e stays finite). fp32 on AVX2: the same exp2 and a division (Sleef's exp, an
// out-of-line call, took twice as long).
template <typename T>
inline Vec silu(const Vec& x) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 e = _mm512_max_ps(_mm512_mul_ps(x, _mm512_set1_ps(-kLog2e)), _mm512_set1_ps(-126.f));
  if constexpr (std::is_same_v<T, float>) {
    e = _mm512_min_ps(e, _mm512_set1_ps(126.f));
    return Vec(_mm512_mul_ps(x, reciprocal_ps(_mm512_add_ps(_mm512_set1_ps(1.f), exp2_ps<6>(e)))));
  }
  return Vec(_mm512_mul_ps(x, _mm512_rcp14_ps(_mm512_add_ps(_mm512_set1_ps(1.f), exp2_ps<3>(e)))));
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<T, float>) {
    const __m256 e = _mm256_min_ps(
        _mm256_max_ps(_mm256_mul_ps(x, _mm256_set1_ps(-kLog2e)), _mm256_set1_ps(-126.f)), _mm256_set1_ps(126.f));
    return Vec(_mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), exp2_ps<6>(e))));
  }
  return x / (Vec(1.f) + x.neg().exp_u20());
#else
  if constexpr (std::is_same_v<T, float>) return x / (Vec(1.f) + x.neg().exp());
  return x / (Vec(1.f) + x.neg().exp_u20());
#endif
}

// o[j] = silu(g[j]) * u[j] for j < n, in fp32, rounded to T once.
template <typename T>
inline void silu_mul_row(const T* g, const T* u, T* o, int64_t n) {
  int64_t j = 0;
  for (; j + kStep <= n; j += kStep) {
    Vec g0, g1, u0, u1;
    load2(g + j, g0, g1);
    load2(u + j, u0, u1);
    store2(o + j, silu<T>(g0) * u0, silu<T>(g1) * u1);
  }
  // One vector more before the scalar tail, so that a row cut in dot_linear's 48-column blocks (32 + 16) rounds
  // every value as the whole row does.
  if (j + Vec::size() <= n) {
    const Vec v = silu<T>(load_vec(g + j)) * load_vec(u + j);
    if constexpr (std::is_same_v<T, float>) v.store(o + j);
    else round_bf16(v, Vec(0.f)).store(o + j, Vec::size());
    j += Vec::size();
  }
  for (; j < n; ++j) {
    const float a = static_cast<float>(g[j]);
    o[j] = static_cast<T>(a / (1.f + std::exp(-a)) * static_cast<float>(u[j]));
  }
}

}  // namespace batchgen_cpu
