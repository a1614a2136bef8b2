// The decode op's tiles for bf16 queries over a bf16 cache on CPUs with AVX512-BF16 (head dims a multiple of
// 32): products by vdpbf16ps, so a cache row is read in place with no widening and each instruction does twice
// the products of an fp32 FMA. Scores pair two dims in a lane; values pair two keys in a lane (vpunpck{l,h}wd
// interleaves their rows), with the probabilities rounded to bf16 first, as torch's bf16 attention rounds them.
// Every sum is fp32 and adds in the same order whatever the tile, the split's neighbours or the thread count.
#pragma once

#include "paged.h"
#include "vec.h"

#include <cstring>

namespace batchgen_cpu {

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
constexpr bool kDotTiles = true;
constexpr int kDotHeads = 4;  // heads a score or value tile takes (4 x 4 scores; 4 heads x 64 dims of values)

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }

inline __m512bh load_bh(const at::BFloat16* p) { return as_bh(_mm512_loadu_si512(p)); }

struct DotStep {
  static constexpr int kDims = 32, kAheads = 2;
  static __m512bh queries(const at::BFloat16* q) { return load_bh(q); }
  static __m512bh row(const at::BFloat16* r) { return load_bh(r); }
  static __m512 madd(__m512 acc, __m512bh q, __m512bh r) { return _mm512_dpbf16_ps(acc, q, r); }
};

// s[h][c] = q_h . row_c for HB heads of q (bf16, W apart) and KB bf16 rows; W a multiple of 32.
template <int HB, int KB, typename Ahead>
inline void score_tile(const at::BFloat16* q, int64_t W, const at::BFloat16* const* rows, float* s, int64_t stride,
                       Ahead& ahead) {
  register_tile<HB, KB, DotStep>(q, W, rows, s, stride, ahead);
}

// o[h][d0, d0 + 32 NV) = (fresh ? 0 : o) + sum_c p[h][c] row_c[d0...] for HB heads (p bf16, rows `stride` apart,
// a zero after an odd n), keys two at a time: lane 4k + i of a `lo` sum holds dim 8k + i of its 32, of a `hi`
// sum dim 8k + 4 + i (k a 128-bit lane), put back in order as they are stored.
template <int HB, int NV, typename Ahead>
inline void paired_value_span(float* o, int64_t V, int64_t d0, const at::BFloat16* p, int64_t stride,
                       const at::BFloat16* const* rows, int64_t n, bool fresh, Ahead& ahead_ref) {
  Ahead ahead = ahead_ref;
  __m512 lo[HB][NV], hi[HB][NV];
#pragma GCC unroll 4
  for (int hb = 0; hb < HB; ++hb)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) lo[hb][j] = hi[hb][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < n; c += 2) {
    ahead();  // two rows' vectors: the lines of two of the fp32 tile's steps
    ahead();
    const at::BFloat16* r0 = rows[c] + d0;
    const at::BFloat16* r1 = (c + 1 < n ? rows[c + 1] : rows[c]) + d0;  // its probability is 0
    __m512bh pp[HB];
#pragma GCC unroll 4
    for (int hb = 0; hb < HB; ++hb) {
      int32_t pair;
      std::memcpy(&pair, p + hb * stride + c, sizeof(pair));
      pp[hb] = as_bh(_mm512_set1_epi32(pair));
    }
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      const __m512i a = _mm512_loadu_si512(r0 + 32 * j), b = _mm512_loadu_si512(r1 + 32 * j);
      const __m512bh l = as_bh(_mm512_unpacklo_epi16(a, b)), h = as_bh(_mm512_unpackhi_epi16(a, b));
#pragma GCC unroll 4
      for (int hb = 0; hb < HB; ++hb) {
        lo[hb][j] = _mm512_dpbf16_ps(lo[hb][j], pp[hb], l);
        hi[hb][j] = _mm512_dpbf16_ps(hi[hb][j], pp[hb], h);
      }
    }
  }
  ahead_ref = ahead;
  for (int hb = 0; hb < HB; ++hb)
    for (int j = 0; j < NV; ++j) {
      const __m512 first = _mm512_shuffle_f32x4(lo[hb][j], hi[hb][j], 0x44);  // lo q0 q1, hi q0 q1
      const __m512 second = _mm512_shuffle_f32x4(lo[hb][j], hi[hb][j], 0xEE);  // lo q2 q3, hi q2 q3
      float* out = o + hb * V + d0 + 32 * j;
      __m512 x = _mm512_shuffle_f32x4(first, first, 0xD8), y = _mm512_shuffle_f32x4(second, second, 0xD8);
      if (!fresh) x = _mm512_add_ps(_mm512_loadu_ps(out), x), y = _mm512_add_ps(_mm512_loadu_ps(out + 16), y);
      _mm512_storeu_ps(out, x);
      _mm512_storeu_ps(out + 16, y);
    }
}
#else
constexpr bool kDotTiles = false;
constexpr int kDotHeads = 1;
#endif

// n probabilities (fp32) rounded to bf16 into out, and a zero after them where n is odd (the pair of the last
// key). vcvtneps2bf16 flushes subnormals: probabilities below 1e-38, which no output can show.
inline void round_probabilities(const float* p, int64_t n, at::BFloat16* out) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  for (int64_t c = 0; c < n; c += 16) {
    const __mmask16 keep = n - c >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - c)) - 1);
    const __m256bh r = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(keep, p + c));
    _mm256_mask_storeu_epi16(out + c, keep, reinterpret_cast<const __m256i&>(r));
  }
#else  // (no dot tiles in this build: declared for the code that would call it)
  for (int64_t c = 0; c < n; ++c) out[c] = at::BFloat16(p[c]);
#endif
  if (n % 2) out[n] = at::BFloat16(0.f);
}

}  // namespace batchgen_cpu
