// Vector helpers shared by the kernels: fp32 math on bf16 or fp32 data, 2 * Vec::size() elements a step,
// with AVX-512 (and AVX512-BF16) instructions where the build targets them, at::vec's portable ones else.
#pragma once

#include <ATen/cpu/vec/vec.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <tuple>
#include <type_traits>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace batchgen_cpu {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kStep = 2 * Vec::size();  // one Vectorized<BFloat16>, two of float

#if defined(CPU_CAPABILITY_AVX512)
inline __m512 bf16x16_to_ps(const void* p) {  // bf16 is the top half of an fp32
  __m256i raw = _mm256_loadu_si256(static_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#endif

template <typename T>
inline void load2(const T* p, Vec& lo, Vec& hi) {
  if constexpr (std::is_same_v<T, float>) {
    lo = Vec::loadu(p);
    hi = Vec::loadu(p + Vec::size());
  } else {
#if defined(CPU_CAPABILITY_AVX512)
    lo = Vec(bf16x16_to_ps(p));
    hi = Vec(bf16x16_to_ps(p + 16));
#else
    std::tie(lo, hi) = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(p));
#endif
  }
}

template <typename T>
inline void store2(T* p, const Vec& lo, const Vec& hi) {
  if constexpr (std::is_same_v<T, float>) {
    lo.store(p);
    hi.store(p + Vec::size());
  } else {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
    _mm512_storeu_si512(p, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));  // round to nearest even, as c10 does
#else
    at::vec::convert_from_float<T>(lo, hi).store(p);
#endif
  }
}

// out[i] = the sum of v[i]'s lanes, for N vectors. On AVX2 all sums add in one order (pairs, pairs of pairs,
// then the two halves), eight (or four) vectors' at once, so a vector's sum rounds alike however many are
// summed with it.
#if defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)
inline __m128 sums_of4(const Vec* v) {  // [sum v0, sum v1, sum v2, sum v3]
  const __m256 quads = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  return _mm_add_ps(_mm256_castps256_ps128(quads), _mm256_extractf128_ps(quads, 1));
}

inline __m256 sums_of8(const Vec* v) {  // [sum v0, ..., sum v7]
  const __m256 lo = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 hi = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

template <int N>
inline void sums_of(const Vec* v, float* out) {
  int i = 0;
  for (; i + 8 <= N; i += 8) _mm256_storeu_ps(out + i, sums_of8(v + i));
  for (; i + 4 <= N; i += 4) _mm_storeu_ps(out + i, sums_of4(v + i));
  for (; i < N; ++i) {
    const __m256 pairs = _mm256_hadd_ps(v[i], v[i]);
    const __m256 quads = _mm256_hadd_ps(pairs, pairs);
    out[i] = _mm_cvtss_f32(_mm_add_ps(_mm256_castps256_ps128(quads), _mm256_extractf128_ps(quads, 1)));
  }
}
#else
template <int N>
inline void sums_of(const Vec* v, float* out) {
  for (int i = 0; i < N; ++i) out[i] = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, v[i]);
}
#endif

#if defined(CPU_CAPABILITY_AVX512)
// 2^f for f in [-0.5, 0.5] as a polynomial: degree 6 Taylor in f ln2 (~1e-7 relative, as fp32 needs), or a
// degree-3 minimax fit (7.5e-5 relative, 26x below bf16's rounding: two fewer FMAs per 16 scores).
template <int Degree>
struct Exp2Poly;
template <>
struct Exp2Poly<6> {
  static constexpr float c[7] = {1.f, 0.693147181f, 0.240226507f, 0.0555041087f, 0.00961812911f,
                                 0.00133335581f, 0.000154035304f};
};
template <>
struct Exp2Poly<3> {
  static constexpr float c[4] = {0.999928071f, 0.693260998f, 0.242611172f, 0.055171627f};
};

// 2^x: x = n + f with f in [-0.5, 0.5]; 2^f by the polynomial above, 2^n exactly with scalef.
template <int Degree>
inline __m512 exp2_ps(__m512 x) {
  constexpr const float* c = Exp2Poly<Degree>::c;
  __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_sub_ps(x, n);
  __m512 poly = _mm512_set1_ps(c[Degree]);
  for (int k = Degree - 1; k >= 0; --k) poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(c[k]));
  return _mm512_scalef_ps(poly, n);
}

// 1 / x to ~1e-8 relative: the 14-bit estimate and one Newton step.
inline __m512 reciprocal_ps(__m512 x) {
  __m512 r = _mm512_rcp14_ps(x);
  return _mm512_mul_ps(r, _mm512_fnmadd_ps(x, r, _mm512_set1_ps(2.f)));
}
#endif

// The prefill attention paths keep scores in log2 units (scale * log2(e) folded into one multiply) so the
// exponential is exp2. A row's running max only moves when a block's max exceeds it by more than kRescaleLog2
// doublings: the accumulators need rescaling far less often, and p = 2^(x - m) stays below 2^8 (exact enough in
// fp32 sums and in bf16, which keeps 8 exponent bits).
constexpr float kRescaleLog2 = 8.f;
constexpr float kLog2e = 1.4426950408889634f;

// Runs f(T* tag) with the tensors' element type, float or at::BFloat16; any other type is an error of `name`.
template <typename F>
void dispatch(at::ScalarType type, const char* name, F&& f) {
  if (type == at::kFloat) {
    f(static_cast<float*>(nullptr));
  } else if (type == at::kBFloat16) {
    f(static_cast<at::BFloat16*>(nullptr));
  } else {
    TORCH_CHECK(false, name, " takes float32 or bfloat16, got ", type);
  }
}

template <typename T>
constexpr int kExpDegree = std::is_same_v<T, float> ? 6 : 3;

}  // namespace batchgen_cpu
