// bf16 linear layers for a few rows (decode and verification steps, up to 64) on CPUs with amx_bf16:
// y = x W^T (+ b), W streamed once in its own row-major layout.
//
// W's rows are the A tiles (16 outputs x 32 of K, read in place: no repacked copy of the weights) and the step's
// rows the B tiles (X^T in VNNI pairs, packed per call, 16 rows a tile), so C^T (16 outputs x 16 rows) sums over K
// in the tiles; up to four row tiles (64 rows) share each A tile. A step of a few rows is bound by streaming W from
// memory (the tiles multiply a 16 x K block of W far faster than it arrives), and each thread streams whole
// contiguous blocks of 16 rows. Every output element is summed over K in one order whatever the other rows and
// the threads: a row's result does not depend on the step (speculative verification gives plain decode's
// numbers), and runs are bit-identical for any thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "amx.h"

#include <algorithm>
#include <vector>

namespace batchgen_cpu {
namespace {

constexpr int64_t kMaxRows = 64;

// Whether the AMX paths run here: built for a CPU with amx_bf16, and the tile state granted by the OS.
bool amx_tiles() {
#if defined(BATCHGEN_AMX)
  return amx::tiles_permitted();
#else
  return false;
#endif
}

using bf16 = at::BFloat16;

#if defined(BATCHGEN_AMX)

// One pass over K for `blocks` blocks of 16 outputs (from n0) and `groups` row groups (1 group and up to 4 blocks,
// or 2 groups and 1 or 2 blocks) in up to 4 accumulator tiles (tile b * groups + g), so that several multiplies are in flight; writes each C^T (16 outputs x
// 16 rows) to c + 256 * (b * groups + g). A tiles: W's blocks; B tiles: X^T's groups from xt (group_words apart).
inline void output_blocks(const bf16* w, int64_t K, int64_t n0, const uint32_t* xt, int64_t group_words, int blocks,
                          int groups, float* c) {
  const int tiles = blocks * groups;
  _tile_zero(0);
  if (tiles > 1) _tile_zero(1);
  if (tiles > 2) _tile_zero(2);
  if (tiles > 3) _tile_zero(3);
  const int64_t stride = K * 2;
  for (int64_t kk = 0; kk < K / 32; ++kk) {
    const bf16* a = w + n0 * K + kk * 32;
    const uint32_t* b = xt + kk * 16 * 16;
    if (groups == 1) {  // up to 4 blocks share X^T's tile (6); their W tiles rotate through 4, 5, 7
      _tile_loadd(6, b, 64);
      _tile_loadd(4, a, stride);
      _tile_dpbf16ps(0, 4, 6);
      if (blocks > 1) { _tile_loadd(5, a + 16 * K, stride); _tile_dpbf16ps(1, 5, 6); }
      if (blocks > 2) { _tile_loadd(7, a + 32 * K, stride); _tile_dpbf16ps(2, 7, 6); }
      if (blocks > 3) { _tile_loadd(4, a + 48 * K, stride); _tile_dpbf16ps(3, 4, 6); }
    } else if (blocks == 2) {  // 2 x 2: W tiles 4, 5; X^T tiles 6, 7
      _tile_loadd(4, a, stride);
      _tile_loadd(6, b, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(7, b + group_words, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_loadd(5, a + 16 * K, stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    } else {  // one block of 2 groups: X^T tiles 6 and 7
      _tile_loadd(4, a, stride);
      _tile_loadd(6, b, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(7, b + group_words, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
  }
  _tile_stored(0, c, 64);
  if (tiles > 1) _tile_stored(1, c + 256, 64);
  if (tiles > 2) _tile_stored(2, c + 512, 64);
  if (tiles > 3) _tile_stored(3, c + 768, 64);
}
#endif

void amx_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                const at::Tensor& out) {
  TORCH_CHECK(amx_tiles(), "amx_linear needs a CPU with amx_bf16 (and the kernels built for it)");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && out.dim() == 2, "x, weight and out must be 2-D");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 &&
              out.scalar_type() == at::kBFloat16, "amx_linear takes bfloat16 x, weight and out");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(M <= kMaxRows, "amx_linear takes at most ", kMaxRows, " rows, got ", M);
  TORCH_CHECK(weight.size(1) == K && weight.is_contiguous() && K % 32 == 0 && N % 16 == 0,
              "weight must be contiguous (N, K) with x's K, K a multiple of 32 and N of 16");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1 && out.size(0) == M && out.size(1) == N,
              "x and out need contiguous rows, out of shape (M, N)");
  TORCH_CHECK(x.stride(0) * M * 2 < (int64_t{1} << 31), "x spans more than 2 GiB");
  const bf16* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == N,
                "bias must be bfloat16 of N elements");
    b = bias->const_data_ptr<bf16>();
  }
  if (M == 0 || N == 0) return;
#if defined(BATCHGEN_AMX)
  const int64_t groups = (M + 15) / 16, words = K / 2;
  // X^T: group g's word i (k = 2i, 2i + 1) of its 16 rows at xt[(g * words + i) * 16]; rows past M zero.
  std::vector<uint32_t> xt(groups * words * 16);
  const bf16* xp = x.const_data_ptr<bf16>();
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t rows = std::min<int64_t>(16, M - g * 16);
    __m512i offsets = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                         _mm512_set1_epi32(static_cast<int>(x.stride(0) * 2)));
    offsets = _mm512_add_epi32(offsets, _mm512_set1_epi32(static_cast<int>(g * 16 * x.stride(0) * 2)));
    const __mmask16 real = static_cast<__mmask16>((1u << rows) - 1);
    for (int64_t i = 0; i < words; ++i) {
      _mm512_storeu_si512(xt.data() + (g * words + i) * 16,
                          _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), real, offsets, xp, 1));
      offsets = _mm512_add_epi32(offsets, _mm512_set1_epi32(4));
    }
  }
  const bf16* w = weight.const_data_ptr<bf16>();
  bf16* y = out.data_ptr<bf16>();
  const int64_t out_row = out.stride(0), group_words = words * 16;
  // Accumulators: 4 blocks of one group (up to 16 rows), else 2 blocks of 2 groups (the groups in passes of 2).
  const int blocks = groups == 1 ? 4 : 2;
  const int64_t units = N / (16 * blocks), tail = N / 16 % blocks;  // tail: blocks left over, one at a time
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / (16 * blocks * K * 2));  // 128 KiB of W a task
  at::parallel_for(0, units + tail, grain, [&](int64_t begin, int64_t end) {
    amx::TileSession session;
    alignas(64) float c[4 * 256];
    const __m512i down = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(16));
    for (int64_t u = begin; u < end; ++u) {
      const int here = u < units ? blocks : 1;
      const int64_t n0 = u < units ? u * 16 * blocks : (units * blocks + (u - units)) * 16;
      for (int64_t g0 = 0; g0 < groups; g0 += 2) {
        const int pass = static_cast<int>(std::min<int64_t>(2, groups - g0));
        output_blocks(w, K, n0, xt.data() + g0 * group_words, group_words, here, pass, c);
        for (int blk = 0; blk < here; ++blk) {
          const __m512 bias16 = b ? bf16x16_to_ps(b + n0 + 16 * blk) : _mm512_setzero_ps();
          for (int64_t row = g0 * 16; row < std::min<int64_t>(M, (g0 + pass) * 16); ++row) {
            const float* tile = c + 256 * (blk * pass + row / 16 - g0);  // row's column of its group's C^T
            const __m512 v = _mm512_add_ps(_mm512_i32gather_ps(down, tile + row % 16, 4), bias16);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + row * out_row + n0 + 16 * blk),
                                (__m256i)_mm512_cvtneps_pbh(v));
          }
        }
      }
    }
  });
#endif
}

}  // namespace
}  // namespace batchgen_cpu

TORCH_LIBRARY_FRAGMENT(batchgen_cpu, m) {
  m.def("amx_linear(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) out) -> ()");
  m.def("amx_tiles() -> bool");
}

TORCH_LIBRARY_IMPL(batchgen_cpu, CPU, m) {
  m.impl("amx_linear", &batchgen_cpu::amx_linear);
}

TORCH_LIBRARY_IMPL(batchgen_cpu, CompositeExplicitAutograd, m) {
  m.impl("amx_tiles", &batchgen_cpu::amx_tiles);
}
