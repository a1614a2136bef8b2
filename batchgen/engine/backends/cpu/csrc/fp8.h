// fp8 (e4m3, e5m2) values widened to fp32 or bf16 and rounded back, for the kernels that keep fp8 KV caches.
#pragma once

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <cstdint>
#include <type_traits>

#include "vec.h"

namespace batchgen_cpu {

// fp8 caches: one byte a value, unscaled; the kernels widen rows to fp32 (or bf16 for AMX) as they read them.
template <typename C>
constexpr bool kFp8 = std::is_same_v<C, c10::Float8_e4m3fn> || std::is_same_v<C, c10::Float8_e5m2>;

#if defined(CPU_CAPABILITY_AVX512)
// 16 e5m2 values: each byte is the top half of an fp16, whose conversion is exact and takes subnormals.
inline __m512 fp8x16_to_ps(const c10::Float8_e5m2* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 8));
}

// 16 e4m3 values in integer steps (no subnormal fp32 ever arises, so no slow assists, and DAZ cannot flush):
// a normal number's exponent and mantissa shift into fp32's fields, its exponent rebased from bias 7 to 127;
// a subnormal is its mantissa times 2^-9.
inline __m512 fp8x16_to_ps(const c10::Float8_e4m3fn* p) {
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i magnitude = _mm512_and_si512(bytes, _mm512_set1_epi32(0x7f));
  const __m512i sign = _mm512_slli_epi32(_mm512_xor_si512(bytes, magnitude), 24);
  __m512 x = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(magnitude, 20), _mm512_set1_epi32(120 << 23)));
  const __mmask16 subnormal = _mm512_cmplt_epi32_mask(magnitude, _mm512_set1_epi32(8));
  x = _mm512_mask_mul_ps(x, subnormal, _mm512_cvtepi32_ps(magnitude), _mm512_set1_ps(1.f / 512));
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(x), sign));
}
#endif

#if defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)
// 8 fp8 values, each byte moved into an fp16 and converted by F16C (exact, subnormals included). e5m2 is the top
// half of an fp16. e4m3's exponent and mantissa shift one bit right of where fp16 keeps them, so the fp16 reads
// it as 2^-8 times its value (its subnormals as fp16 subnormals): one exact multiply by 256 rebases it.
inline __m256 fp8x8_to_ps(const c10::Float8_e5m2* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(bytes), 8));
}

inline __m256 fp8x8_to_ps(const c10::Float8_e4m3fn* p) {
  const __m128i high = _mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 8);
  const __m128i half = _mm_and_si128(_mm_srai_epi16(high, 1), _mm_set1_epi16(static_cast<int16_t>(0xbf80)));
  return _mm256_mul_ps(_mm256_cvtph_ps(half), _mm256_set1_ps(256.f));
}

// 8 fp32 values, each within the format's finite range or NaN, to fp8 bytes at dst: c10's rounding (to nearest
// even) in 32-bit integer steps. Below the smallest normal, a float add of a magic number aligns the value to the
// subnormal step; above it, the exponent is rebased and the mantissa rounded by adding half an ulp less one plus
// the kept mantissa's last bit.
template <typename C>
inline void ps_to_fp8x8(__m256 x, C* dst) {
  constexpr bool e4m3 = std::is_same_v<C, c10::Float8_e4m3fn>;
  constexpr int kBias = e4m3 ? 7 : 15, kShift = e4m3 ? 20 : 21;  // 23 - mantissa bits
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i sign = _mm256_and_si256(bits, _mm256_set1_epi32(INT32_MIN));
  const __m256i a = _mm256_xor_si256(bits, sign);
  const __m256i magic = _mm256_set1_epi32((127 - kBias + kShift + 1) << 23);
  const __m256i small = _mm256_sub_epi32(
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(magic))), magic);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, kShift), _mm256_set1_epi32(1));
  const __m256i rebased = _mm256_sub_epi32(a, _mm256_set1_epi32(((127 - kBias) << 23) - (1 << (kShift - 1)) + 1));
  const __m256i normal = _mm256_srli_epi32(_mm256_add_epi32(rebased, odd), kShift);
  const __m256i is_small = _mm256_cmpgt_epi32(_mm256_set1_epi32((127 - kBias + 1) << 23), a);
  const __m256i is_nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7f800000));
  __m256i r = _mm256_blendv_epi8(normal, small, is_small);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7f), is_nan);
  r = _mm256_or_si256(r, _mm256_srli_epi32(sign, 24));
  const __m256i low_bytes = _mm256_shuffle_epi8(
      r, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                          0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
  const __m128i packed = _mm_unpacklo_epi32(_mm256_castsi256_si128(low_bytes), _mm256_extracti128_si256(low_bytes, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), packed);
}
#endif

#if defined(CPU_CAPABILITY_AVX512)
// 32 fp8 values as bf16 words (exact: fp8 values are bf16 values), in integer steps: a normal number's exponent
// and mantissa shift into bf16's fields and its exponent is rebased (e4m3: bias 7, e5m2: 15, bf16: 127); the
// few subnormals come from a table.
template <typename C>
inline __m512i fp8x32_to_bf16(const C* p) {
  constexpr bool e4m3 = std::is_same_v<C, c10::Float8_e4m3fn>;
  constexpr int mantissa = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15;
  static const __m512i subnormals = [] {  // m x 2^(1 - bias - mantissa) for the mantissas m below 2^mantissa
    alignas(64) uint16_t t[32] = {};
    for (int m = 0; m < (1 << mantissa); ++m) t[m] = c10::BFloat16(std::ldexp(float(m), 1 - bias - mantissa)).x;
    return _mm512_load_si512(t);
  }();
  const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i magnitude = _mm512_and_si512(bytes, _mm512_set1_epi16(0x7f));
  const __m512i sign = _mm512_slli_epi16(_mm512_xor_si512(bytes, magnitude), 8);
  __m512i x = _mm512_add_epi16(_mm512_slli_epi16(magnitude, 7 - mantissa), _mm512_set1_epi16((127 - bias) << 7));
  const __mmask32 subnormal = _mm512_cmplt_epu16_mask(magnitude, _mm512_set1_epi16(1 << mantissa));
  x = _mm512_mask_permutexvar_epi16(x, subnormal, magnitude, subnormals);
  return _mm512_or_si512(x, sign);
}
#endif

#if defined(__AVX512VBMI__)
// 64 fp8 values as bf16 words, the first 32 in `first`: the bf16 bits of the 128 non-negative codes are looked
// up, high and low bytes in two 128-byte tables (a byte permute reads a 7-bit index, the code less its sign),
// the sign is put back and the bytes interleaved: five instructions for 64 values.
template <typename C>
struct Fp8Table {
  __m512i high[2], low[2], first_words, second_words;
  Fp8Table() {
    alignas(64) uint8_t h[128], l[128], first[64], second[64];
    for (int code = 0; code < 128; ++code) {
      const uint16_t bits = c10::BFloat16(static_cast<float>(C(static_cast<uint8_t>(code), C::from_bits()))).x;
      h[code] = bits >> 8, l[code] = bits & 0xff;
    }
    for (int i = 0; i < 32; ++i) {  // word i: low byte from `low` (index bit 6 clear), high byte from `high`
      first[2 * i] = i, first[2 * i + 1] = 64 | i;
      second[2 * i] = 32 + i, second[2 * i + 1] = 64 | (32 + i);
    }
    for (int r = 0; r < 2; ++r) {
      high[r] = _mm512_load_si512(h + 64 * r);
      low[r] = _mm512_load_si512(l + 64 * r);
    }
    first_words = _mm512_load_si512(first);
    second_words = _mm512_load_si512(second);
  }
};

template <typename C>
inline void fp8x64_to_bf16(const C* p, __m512i& first, __m512i& second) {
  static const Fp8Table<C> t;
  const __m512i codes = _mm512_loadu_si512(p);
  const __m512i low = _mm512_permutex2var_epi8(t.low[0], codes, t.low[1]);
  __m512i high = _mm512_permutex2var_epi8(t.high[0], codes, t.high[1]);
  high = _mm512_ternarylogic_epi32(high, codes, _mm512_set1_epi8(static_cast<char>(0x80)), 0xf8);  // | sign
  first = _mm512_permutex2var_epi8(low, t.first_words, high);
  second = _mm512_permutex2var_epi8(low, t.second_words, high);
}
#endif

// n fp8 values widened to fp32 (or bf16, exactly) into dst.
template <typename C, typename T>
inline void widen_fp8(const C* src, T* dst, int64_t n) {
  int64_t d = 0;
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float>) {
    for (; d + 16 <= n; d += 16) _mm512_storeu_ps(dst + d, fp8x16_to_ps(src + d));
  } else {
#if defined(__AVX512VBMI__)
    for (; d + 64 <= n; d += 64) {
      __m512i first, second;
      fp8x64_to_bf16(src + d, first, second);
      _mm512_storeu_si512(dst + d, first);
      _mm512_storeu_si512(dst + d + 32, second);
    }
#endif
    for (; d + 32 <= n; d += 32) _mm512_storeu_si512(dst + d, fp8x32_to_bf16(src + d));
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<T, float>) {
    for (; d + 8 <= n; d += 8) _mm256_storeu_ps(dst + d, fp8x8_to_ps(src + d));
  }
#endif
  for (; d < n; ++d) dst[d] = static_cast<T>(static_cast<float>(src[d]));
}

}  // namespace batchgen_cpu
