// Vector helpers shared by the kernels: fp32 math on bf16 or fp32 data, 2 * Vec::size() elements a step,
// with AVX-512 (and AVX512-BF16) instructions where the build targets them, at::vec's portable ones else.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <type_traits>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace batchgen_cpu {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kStep = 2 * Vec::size();  // one Vectorized<BFloat16>, two of float
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#if defined(CPU_CAPABILITY_AVX512)
inline __m512 bf16x16_to_ps(const void* p) {  // bf16 is the top half of an fp32
  __m256i raw = _mm256_loadu_si256(static_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#endif

// One vector of fp32 from Vec::size() values of a row: fp32 as it is, bf16 widened in the register (exactly),
// so the tiles read a bf16 cache's rows in place.
inline Vec load_vec(const float* p) { return Vec::loadu(p); }

inline Vec load_vec(const at::BFloat16* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(bf16x16_to_ps(p));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return Vec(_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
#else
  float buf[Vec::size()];
  for (int i = 0; i < Vec::size(); ++i) buf[i] = static_cast<float>(p[i]);
  return Vec::loadu(buf);
#endif
}

// Whether the store and decode ops take a cache of `cached` for k, v and q of `scalar`: the same, fp8, or bf16
// under fp32 (ops.takes_cache, which routes steps to them, says the same).
inline bool takes_cache(at::ScalarType scalar, at::ScalarType cached) {
  return cached == scalar || cached == at::kFloat8_e4m3fn || cached == at::kFloat8_e5m2 ||
         (cached == at::kBFloat16 && scalar == at::kFloat);
}

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

// lo, hi rounded to bf16 as torch rounds them (to nearest even, subnormals kept, NaN as 0xffff). With AVX512-BF16,
// by vcvtne2ps2bf16 (one instruction for 32 values, where torch's rounding takes about fifteen), unless a value is
// NaN or subnormal, which that instruction would quiet or flush to zero: the same bits either way.
inline at::vec::Vectorized<at::BFloat16> round_bf16(const Vec& lo, const Vec& hi) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__) && defined(__AVX512DQ__)
  constexpr int kNanOrSubnormal = 0x01 | 0x20 | 0x80;  // quiet NaN, subnormal, signalling NaN
  if (!(_mm512_fpclass_ps_mask(lo, kNanOrSubnormal) | _mm512_fpclass_ps_mask(hi, kNanOrSubnormal)))
    return at::vec::Vectorized<at::BFloat16>(reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
#endif
  return at::vec::convert_from_float<at::BFloat16>(lo, hi);
}

template <typename T>
inline void store2(T* p, const Vec& lo, const Vec& hi) {
  if constexpr (std::is_same_v<T, float>) {
    lo.store(p);
    hi.store(p + Vec::size());
  } else {
    round_bf16(lo, hi).store(p);
  }
}

// store2, and lo and hi become the values stored (rounded to T): a row's sum kept in T and read on in registers.
template <typename T>
inline void store2_rounded(T* p, Vec& lo, Vec& hi) {
  if constexpr (std::is_same_v<T, float>) {
    store2(p, lo, hi);
  } else {
    const at::vec::Vectorized<T> rounded = round_bf16(lo, hi);
    rounded.store(p);
    std::tie(lo, hi) = at::vec::convert_to_float<T>(rounded);
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
#if defined(CPU_CAPABILITY_AVX512)
// a's lanes and b's folded in half side by side: by 256-bit halves, 128-bit quarters, then (kWithin: inside each
// 128-bit lane) pairs and single lanes, as the shuffle immediates lo and hi pick them.
template <int kLo, int kHi, bool kWithin = false>
inline __m512 fold(__m512 a, __m512 b) {
  if constexpr (kWithin) return _mm512_add_ps(_mm512_shuffle_ps(a, b, kLo), _mm512_shuffle_ps(a, b, kHi));
  else return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, kLo), _mm512_shuffle_f32x4(a, b, kHi));
}
// Lane sums of 16 vectors in one tree: lane 4 i + j of the result is the sum of v[4 j + i]. Each vector's lanes
// add in one order (l + 8, then + 4, + 2, + 1: at::vec's reduce_all's) whichever vectors share the tree with it.
__attribute__((always_inline)) inline __m512 lane_sums_of16(const __m512* v) {
  auto four = [v](int i) {  // v[i..i + 4) to 4 lanes each
    return fold<0x88, 0xDD>(fold<0x44, 0xEE>(v[i], v[i + 1]), fold<0x44, 0xEE>(v[i + 2], v[i + 3]));
  };
  const __m512 s0 = four(0), s1 = four(4), s2 = four(8), s3 = four(12);
  return fold<0x88, 0xDD, true>(fold<0x44, 0xEE, true>(s0, s1), fold<0x44, 0xEE, true>(s2, s3));
}
__attribute__((always_inline)) inline __m128 quarter_of(__m512 v, int i) {  // i: a constant once inlined
  return i == 0 ? _mm512_extractf32x4_ps(v, 0) : i == 1 ? _mm512_extractf32x4_ps(v, 1)
       : i == 2 ? _mm512_extractf32x4_ps(v, 2) : _mm512_extractf32x4_ps(v, 3);
}
#endif
template <int N>
inline void sums_of(const Vec* v, float* out) {
  for (int i = 0; i < N; ++i) out[i] = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, v[i]);
}
#endif

// s[h * stride + c] = the sum of v[h * C + c]'s lanes, for H x C vectors: on AVX2 with C = 4 each head's four
// sums go out as one vector (a scalar read of a vector just stored would wait for the store), in sums_of's order.
template <int H, int C>
inline void store_sums(const Vec* v, float* s, int64_t stride) {
#if defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)
  if constexpr (C == 4) {
    int h = 0;
    for (; h + 2 <= H; h += 2) {
      const __m256 both = sums_of8(v + h * C);
      _mm_storeu_ps(s + h * stride, _mm256_castps256_ps128(both));
      _mm_storeu_ps(s + (h + 1) * stride, _mm256_extractf128_ps(both, 1));
    }
    if (h < H) _mm_storeu_ps(s + h * stride, sums_of4(v + h * C));
    return;
  }
#endif
  float sums[H * C];
  sums_of<H * C>(v, sums);
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < C; ++c) s[h * stride + c] = sums[h * C + c];
}

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

#if defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)
// 2^x for x in [-126, 126]: x = n + f with f in [-0.5, 0.5]; 2^f by the polynomial above, 2^n built in the
// exponent field (a normal number over that range).
template <int Degree>
inline __m256 exp2_ps(__m256 x) {
  constexpr const float* c = Exp2Poly<Degree>::c;
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 poly = _mm256_set1_ps(c[Degree]);
  for (int k = Degree - 1; k >= 0; --k) poly = _mm256_fmadd_ps(poly, f, _mm256_set1_ps(c[k]));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(poly, _mm256_castsi256_ps(two_n));
}
#endif

#if defined(CPU_CAPABILITY_AVX512)
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

// The lane-wise larger of two vectors, without at::vec::maximum's NaN check (a NaN score makes its row's
// probabilities NaN either way).
inline Vec larger(const Vec& a, const Vec& b) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(_mm512_max_ps(a, b));
#elif defined(CPU_CAPABILITY_AVX2)
  return Vec(_mm256_max_ps(a, b));
#else
  return at::vec::maximum(a, b);
#endif
}

// e^x for x <= 0 (a softmax's shifted scores): 2^(x log2 e) by the degree-6 polynomial (~1e-7 relative, inline:
// twice as fast as Sleef's out-of-line exp), 0 where that is below 2^-126.
inline Vec exp_nonpositive(const Vec& x) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(kLog2e));
  const __mmask16 normal = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-126.f), _CMP_GE_OQ);
  return Vec(_mm512_maskz_mov_ps(normal, exp2_ps<6>(_mm512_max_ps(t, _mm512_set1_ps(-126.f)))));
#else
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(kLog2e));
  const __m256 normal = _mm256_cmp_ps(t, _mm256_set1_ps(-126.f), _CMP_GE_OQ);
  return Vec(_mm256_and_ps(normal, exp2_ps<6>(_mm256_max_ps(t, _mm256_set1_ps(-126.f)))));
#endif
}

// Rows per thread of a parallel loop over rows of `width` elements: at least kMinChunk elements, so that a
// decode step's few rows run on the calling thread (a parallel region's fork and join cost more than they
// save there, and far more when other processes hold the cores).
constexpr int64_t kMinChunk = 1 << 16;
inline int64_t grain(int64_t width) { return std::max<int64_t>(1, kMinChunk / std::max<int64_t>(1, width)); }

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

// f(std::integral_constant<int, n>{}) for the run-time n in 1..N: a tile size or row count as a compile-time constant.
template <int N, typename F>
inline void with_constant(int64_t n, F&& f) {
  if constexpr (N >= 1) {
    if (n == N) f(std::integral_constant<int, N>{});
    else with_constant<N - 1>(n, f);
  }
}

}  // namespace batchgen_cpu
