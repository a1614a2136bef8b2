// What the AMX kernels share (attention_amx.h's prefill, decode_tiles.h's decode of both decode ops; bf16, CPUs
// with amx_bf16): the build test that defines BATCHGEN_AMX, the OS's permission, the one tile shape, an
// exponential for the vector work between the tiles' multiplies, a zero row and a 16 x 16 word transpose.
#pragma once

#if defined(CPU_CAPABILITY_AVX512) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define BATCHGEN_AMX 1

#include <ATen/native/CPUBlas.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <c10/util/BFloat16.h>

#include <cstdint>

#include "vec.h"

namespace batchgen_cpu {
namespace amx {

constexpr int kRows = 16;  // rows of a tile, lanes of an fp32 vector
constexpr int kMaxDim = 256;  // the widest head either attention kernel takes (ops.MAX_HEAD_DIM)
constexpr int64_t kZeroRowWidth = 1024;  // the widest row a kernel reads zeros for (a head, or MLA's latent)
static_assert(kMaxDim <= kZeroRowWidth);

// What rows outside a sequence's context read: zeros, so they add nothing where they meet a zero probability.
inline const c10::BFloat16* zero_row() {
  alignas(64) static const c10::BFloat16 zeros[kZeroRowWidth] = {};
  return zeros;
}

// Linux hands a process the AMX tile state only once it asks for it (arch_prctl ARCH_REQ_XCOMP_PERM).
inline bool tiles_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// All eight tiles 16 rows of 64 bytes: an fp32 16 x 16 block, or a bf16 16 x 32 one (both kernels' only shape).
inline void configure_tiles() {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = kRows;
  }
  _tile_loadconfig(&config);
}

// A thread's tiles for a run of work items: configured on creation, released after (and torch's brgemm told so:
// it keeps the last palette it set per thread and would not set it again).
struct TileSession {
  TileSession() { configure_tiles(); }
  ~TileSession() { at::native::cpublas::brgemm_release(true); }
  TileSession(const TileSession&) = delete;
  TileSession& operator=(const TileSession&) = delete;
};

// 2^x for x <= 127, about 0 from -126 down: the integer part added to the exponent bits, 2^f (|f| <= 1/2) by
// exp2_ps's degree-3 polynomial. Plain adds, FMAs and one shift instead of exp2_ps's rounding and scaling
// instructions: the softmax alone ran 1.2x faster with it here.
inline __m512 exp2_fast(__m512 x) {
  const __m512 magic = _mm512_set1_ps(12582912.f);  // 1.5 * 2^23: adding it rounds x to an integer in the low bits
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
  const __m512 shifted = _mm512_add_ps(x, magic);
  const __m512 f = _mm512_sub_ps(x, _mm512_sub_ps(shifted, magic));
  constexpr const float* c = Exp2Poly<3>::c;
  __m512 poly = _mm512_fmadd_ps(_mm512_set1_ps(c[3]), f, _mm512_set1_ps(c[2]));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(c[1]));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(c[0]));
  return _mm512_castsi512_ps(
      _mm512_add_epi32(_mm512_castps_si512(poly), _mm512_slli_epi32(_mm512_castps_si512(shifted), 23)));
}

// Rows of 16 words in r[0..15] transposed in place: r[i] word j <- r[j] word i.
inline void transpose16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // r[4k + j]'s 128-bit lane L now holds rows 4k..4k+3 of column 4L + j: a 4 x 4 transpose of lanes is left.
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

}  // namespace amx
}  // namespace batchgen_cpu

#endif
