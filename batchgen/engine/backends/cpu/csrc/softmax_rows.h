// The online softmax of attention.cpp's score blocks, a row at a time: p = 2^(s * scale2 - m) over the row's
// keys, its running max m and sum l updated, and the factor that rescales the row's output (scale_row).
#pragma once

#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace batchgen_cpu {
namespace {

#if defined(CPU_CAPABILITY_AVX512)
// p = 2^(s * scale2 - shift) over the first `valid` columns of a score row, zero from there to the next
// multiple of 32 (returned); their sum goes to `sum` and the largest of those s to `raw_max`.
template <typename T>
inline int64_t exp_row(const float* s, T* p, int64_t valid, float scale2, float shift, float& sum, float& raw_max) {
  constexpr int Degree = kExpDegree<T>;
  const __m512 vscale = _mm512_set1_ps(scale2), vshift = _mm512_set1_ps(-shift);
  __m512 vsum = _mm512_setzero_ps(), vmax = _mm512_set1_ps(kNegInf);
  int64_t j = 0;
  for (; j < valid; j += 32) {
    __mmask16 k0 = 0xffff, k1 = 0xffff;
    if (j + 32 > valid) {
      int64_t left = valid - j;
      k0 = (__mmask16)(left >= 16 ? 0xffff : (1u << left) - 1);
      k1 = (__mmask16)(left <= 16 ? 0 : (1u << (left - 16)) - 1);
    }
    __m512 x0 = _mm512_loadu_ps(s + j), x1 = _mm512_loadu_ps(s + j + 16);
    vmax = _mm512_mask_max_ps(_mm512_mask_max_ps(vmax, k0, vmax, x0), k1, vmax, x1);
    __m512 e0 = _mm512_maskz_mov_ps(k0, exp2_ps<Degree>(_mm512_fmadd_ps(x0, vscale, vshift)));
    __m512 e1 = _mm512_maskz_mov_ps(k1, exp2_ps<Degree>(_mm512_fmadd_ps(x1, vscale, vshift)));
    vsum = _mm512_add_ps(vsum, _mm512_add_ps(e0, e1));
    store2(p + j, Vec(e0), Vec(e1));
  }
  sum = _mm512_reduce_add_ps(vsum);
  raw_max = _mm512_reduce_max_ps(vmax);
  return j;
}

// Online-softmax update of one row of a score block: p = 2^(s * scale2 - m) over the first `valid` columns
// (zero after them, up to `width`), running max m and sum l updated. Returns the factor the row's output
// accumulator must be scaled by (1 when the max did not move).
template <typename T>
inline float softmax_row(const float* s, T* p, int64_t valid, int64_t width, float scale2, float& m, float& l) {
  if (valid <= 0) {
    std::memset(p, 0, sizeof(T) * width);
    return 1.f;
  }
  float sum, raw_max;
  int64_t j;
  if (m != kNegInf) {
    // One pass against the running max, the block's max found on the way: it stands unless that max moves m
    // (rare once a row has seen a block). Then the row is done again; exponents above 2^127 meanwhile are
    // inf at worst, and overwritten.
    j = exp_row(s, p, valid, scale2, m, sum, raw_max);
    if (raw_max * scale2 <= m + kRescaleLog2) {
      if (j < width) std::memset(p + j, 0, sizeof(T) * (width - j));
      l += sum;
      return 1.f;
    }
  } else {
    __m512 vmax = _mm512_set1_ps(kNegInf);
    for (j = 0; j + 16 <= valid; j += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + j));
    if (j < valid) {
      __mmask16 k = (__mmask16)((1u << (valid - j)) - 1);
      vmax = _mm512_mask_max_ps(vmax, k, vmax, _mm512_maskz_loadu_ps(k, s + j));
    }
    raw_max = _mm512_reduce_max_ps(vmax);
  }
  const float m_new = raw_max * scale2;
  const float alpha = std::exp2(m - m_new);  // 0 on the first block (m = -inf)
  j = exp_row(s, p, valid, scale2, m_new, sum, raw_max);
  if (j < width) std::memset(p + j, 0, sizeof(T) * (width - j));
  l = l * alpha + sum;
  m = m_new;
  return alpha;
}
#else
// The portable form of the AVX-512 softmax_row above (torch's fast exp; same lazy rescaling).
template <typename T>
inline float softmax_row(const float* s, T* p, int64_t valid, int64_t width, float scale2, float& m, float& l) {
  constexpr int64_t W = 2 * Vec::size();
  if (valid <= 0) {
    std::memset(p, 0, sizeof(T) * width);
    return 1.f;
  }
  Vec vmax(kNegInf);
  int64_t j = 0;
  for (; j + Vec::size() <= valid; j += Vec::size()) vmax = at::vec::maximum(vmax, Vec::loadu(s + j));
  if (j < valid) vmax = at::vec::maximum(vmax, Vec::set(Vec(kNegInf), Vec::loadu(s + j), valid - j));
  float block_max = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, vmax) * scale2;
  float m_new = block_max > m + kRescaleLog2 ? block_max : m;
  float alpha = m_new == m ? 1.f : std::exp2(m - m_new);
  const Vec vscale(scale2 / kLog2e), vshift(-m_new / kLog2e), zero(0.f);
  Vec vsum(0.f);
  for (j = 0; j < valid; j += W) {
    Vec e0 = at::vec::fmadd(Vec::loadu(s + j), vscale, vshift).exp_u20();
    Vec e1 = at::vec::fmadd(Vec::loadu(s + j + Vec::size()), vscale, vshift).exp_u20();
    if (j + W > valid) {
      int64_t left = valid - j;
      e0 = Vec::set(zero, e0, std::min<int64_t>(left, Vec::size()));
      e1 = Vec::set(zero, e1, std::max<int64_t>(left - Vec::size(), 0));
    }
    vsum = vsum + e0 + e1;
    store2(p + j, e0, e1);
  }
  if (j < width) std::memset(p + j, 0, sizeof(T) * (width - j));
  l = l * alpha + at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, vsum);
  m = m_new;
  return alpha;
}
#endif

inline void scale_row(float* x, int64_t n, float factor) {
  at::vec::map([factor](Vec v) { return v * Vec(factor); }, x, x, n);
}

}  // namespace
}  // namespace batchgen_cpu
