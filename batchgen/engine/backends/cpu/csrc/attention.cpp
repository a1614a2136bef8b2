// Fused causal attention for a packed, variable-length prefill step on CPU.
//
// Each sequence's queries attend to its cached prefix (read from the paged KV cache) and to its own new
// keys, causally. Per (sequence, KV head) the keys and values are packed once into the layout the
// batch-reduce GEMM wants (VNNI pairs for bf16); every query head of the GQA group then runs against
// them as extra rows of one GEMM. Scores and the output accumulate in fp32 with an online softmax; key
// blocks wholly above the causal diagonal are never computed. The GEMMs are oneDNN's brgemm micro-kernels
// behind at::native::cpublas (AMX or AVX512-BF16 for bf16, AVX-512/AVX2 FMA for fp32), the same entry
// points torch's own CPU flash attention uses; they are internal API, so this file is compiled against
// the installed torch's headers and the build is keyed by its version. On CPUs with amx_bf16, bf16 steps
// run in attention_amx.h's AMX tiles instead (the same work items), unless the caller asks for brgemm.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include "attention_amx.h"
#include "softmax_rows.h"
#include "varlen.h"
#include "vec.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <vector>


#if !defined(CPUBLAS_BRGEMM_BF16BF16F32) || !defined(CPUBLAS_BRGEMM_F32F32F32)
#error "this torch's at::native::cpublas lacks the bf16/fp32 brgemm entry points this kernel calls"
#endif

namespace batchgen_cpu {
namespace {

template <typename T>
constexpr bool kVnni = !std::is_same_v<T, float>;  // 16-bit operands go in pairs along the reduced dim

// K block -> B of S = Q K^T: [D][N] (fp32) or [D/2][N][2] (bf16 VNNI). Keys past the context are zero.
// Either way a transpose of 32-bit words (a bf16 pair or one fp32): word w of key n goes to [w][n].
template <typename T>
void pack_keys(const Step<T>& a, const Seq& s, int64_t h, int64_t first, int64_t count, T* dst) {
  const int64_t N = s.kv_block, words = a.head_dim * static_cast<int64_t>(sizeof(T)) / 4;
  auto* d32 = reinterpret_cast<uint32_t*>(dst);
  if (count < N) std::memset(dst, 0, sizeof(T) * a.head_dim * N);
  int64_t n = 0;
#if defined(CPU_CAPABILITY_AVX512)
  // 16 keys at a time: gather word w of each (their rows are anywhere: cache blocks or new rows), store
  // the 16 words contiguously. Scalar stores down a column thrash the cache at this stride.
  for (; n + 16 <= count; n += 16) {
    alignas(64) int64_t rows[16];
    for (int i = 0; i < 16; ++i) rows[i] = reinterpret_cast<int64_t>(kv_row(a, s, h, first + n + i, false));
    __m512i lo = _mm512_load_si512(rows), hi = _mm512_load_si512(rows + 8);
    const __m512i next_word = _mm512_set1_epi64(4);
    for (int64_t w = 0; w < words; ++w) {
      __m256i a0 = _mm512_i64gather_epi32(lo, nullptr, 1), a1 = _mm512_i64gather_epi32(hi, nullptr, 1);
      _mm512_storeu_si512(d32 + w * N + n, _mm512_inserti64x4(_mm512_castsi256_si512(a0), a1, 1));
      lo = _mm512_add_epi64(lo, next_word);
      hi = _mm512_add_epi64(hi, next_word);
    }
  }
#endif
  for (; n < count; ++n) {
    const auto* s32 = reinterpret_cast<const uint32_t*>(kv_row(a, s, h, first + n, false));
    for (int64_t w = 0; w < words; ++w) d32[w * N + n] = s32[w];
  }
}

// V block -> B of O += P V: [N][D] (fp32) or [N/2][D][2] (bf16 VNNI). Rows past the context are zero.
template <typename T>
void pack_values(const Step<T>& a, const Seq& s, int64_t h, int64_t first, int64_t count, T* dst) {
  const int64_t D = a.head_dim, N = s.kv_block;
  if (count < N) std::memset(dst, 0, sizeof(T) * D * N);
  if constexpr (kVnni<T>) {
    static_assert(sizeof(T) == 2);
    for (int64_t n = 0; n < count; n += 2) {  // rows n and n+1 interleaved, one 32-bit word per column
      const auto* even = reinterpret_cast<const uint16_t*>(kv_row(a, s, h, first + n, true));
      const auto* odd = n + 1 < count ? reinterpret_cast<const uint16_t*>(kv_row(a, s, h, first + n + 1, true)) : nullptr;
      auto* d32 = reinterpret_cast<uint32_t*>(dst) + (n / 2) * D;
      if (odd) {
        for (int64_t d = 0; d < D; ++d) d32[d] = uint32_t(even[d]) | (uint32_t(odd[d]) << 16);
      } else {
        for (int64_t d = 0; d < D; ++d) d32[d] = uint32_t(even[d]);
      }
    }
  } else {
    for (int64_t n = 0; n < count; ++n) std::memcpy(dst + n * D, kv_row(a, s, h, first + n, true), sizeof(T) * D);
  }
}

// Per-thread scratch for one query block of up to `rows` rows against key blocks of up to `width` keys.
template <typename T>
struct Scratch {
  std::vector<T> q, p;
  std::vector<float> s, o, m, l;
  Scratch(int64_t rows, int64_t D, int64_t width)
      : q(rows * D), p(rows * width), s(rows * width), o(rows * D), m(rows), l(rows) {}
};

// One work item: query rows [t0, t1) of sequence `s`, all query heads of KV head h (row (t - t0) * G + g
// is query head h * G + g at token t).
template <typename T>
void attend_block(const Step<T>& a, const Seq& s, int64_t h, int64_t t0, int64_t t1, const T* keys,
                  const T* values, Scratch<T>& w) {
  const int64_t G = a.group, D = a.head_dim, N = s.kv_block;
  const int64_t M = (t1 - t0) * G;
  for (int64_t t = t0; t < t1; ++t) {
    const T* src = a.q + (s.q_start + t) * a.q_row + h * G * a.q_head;
    for (int64_t g = 0; g < G; ++g)
      std::memcpy(w.q.data() + ((t - t0) * G + g) * D, src + g * a.q_head, sizeof(T) * D);
  }
  std::fill(w.m.begin(), w.m.begin() + M, kNegInf);
  std::fill(w.l.begin(), w.l.begin() + M, 0.f);
  const float scale2 = a.scale * kLog2e;
  const int64_t blocks = (s.prefix + t1 - 1) / N + 1;  // the last query sees keys 0 .. prefix + t1 - 1
  for (int64_t b = 0; b < blocks; ++b) {
    // The diagonal block computes only the key columns its last query sees (rounded up to 32).
    const int64_t width = b + 1 < blocks ? N : std::min<int64_t>(N, (s.prefix + t1 - b * N + 31) / 32 * 32);
    at::native::cpublas::brgemm(M, width, D, D, N, N, false, w.q.data(), keys + b * N * D, w.s.data(), kVnni<T>);
    for (int64_t r = 0; r < M; ++r) {
      int64_t valid = std::min<int64_t>(width, s.prefix + t0 + r / G + 1 - b * N);
      float alpha = softmax_row(w.s.data() + r * N, w.p.data() + r * N, valid, width, scale2, w.m[r], w.l[r]);
      if (b > 0 && alpha != 1.f) scale_row(w.o.data() + r * D, D, alpha);
    }
    at::native::cpublas::brgemm(M, D, width, N, D, D, b > 0, w.p.data(), values + b * N * D, w.o.data(), kVnni<T>);
  }
  for (int64_t r = 0; r < M; ++r) {
    int64_t t = t0 + r / G, head = h * G + r % G;
    float inv = 1.f / w.l[r];
    T* dst = a.out + (s.q_start + t) * a.out_row + head * a.out_head;
    at::vec::map([inv](Vec v) { return v * Vec(inv); }, dst, w.o.data() + r * D, D);
  }
}

// The brgemm path's pieces: block b of (s, h) packed for the GEMMs (K^T and V, VNNI pairs for bf16) at its
// place in the (sequence, KV head)'s area, and a thread's worker over the fp32 score blocks.
template <typename T>
void pack_for_brgemm(const Step<T>& a, const Seq& s, int64_t h, int64_t b, T* keys, T* values) {
  const int64_t first = b * s.kv_block, count = std::min(s.kv_block, s.prefix + s.q_len - first);
  const int64_t offset = b * s.kv_block * a.head_dim;
  pack_keys(a, s, h, first, count, keys + offset);
  pack_values(a, s, h, first, count, values + offset);
}

template <typename T>
struct BrgemmWorker {
  Scratch<T> scratch;
  BrgemmWorker(int64_t rows, int64_t D, int64_t width) : scratch(rows, D, width) {}
  ~BrgemmWorker() {
    if constexpr (kVnni<T>) at::native::cpublas::brgemm_release(true);
  }
  void operator()(const Step<T>& a, const Seq& s, int64_t h, int64_t t0, int64_t t1, const T* keys, const T* values) {
    attend_block(a, s, h, t0, t1, keys, values, scratch);
  }
};

#if defined(BATCHGEN_AMX)
// The AMX path's worker: its tiles configured for the thread's items.
struct AmxWorker {
  amx::TileSession tiles;
  std::unique_ptr<amx::Scratch> scratch = std::make_unique<amx::Scratch>();
  void operator()(const Step<at::BFloat16>& a, const Seq& s, int64_t h, int64_t t0, int64_t t1,
                  const at::BFloat16* keys, const at::BFloat16* values) {
    amx::attend_item(a, s, h, t0, t1, keys, values, *scratch);
  }
};
#endif

// Packs every (sequence, KV head)'s keys and values with pack(a, s, h, block, keys, values), then runs the
// query blocks' work items on workers made by make_worker() (one a thread, living through its items).
template <typename T, typename Pack, typename MakeWorker>
void run(const Step<T>& a, const std::vector<Seq>& seqs, int64_t q_block, Pack&& pack, MakeWorker&& make_worker) {
  const int64_t H = a.num_kv_heads, D = a.head_dim;
  int64_t per_head = 0;
  for (const Seq& s : seqs) per_head = std::max(per_head, s.packed + s.num_kv_blocks * s.kv_block * D);
  // Packed keys and values: [KV head][per_head], each sequence's blocks at its `packed` offset. The
  // buffers live on between calls (every layer of a step needs the same sizes): fresh pages each call
  // cost the kernel's page zeroing. Every element a call reads is written first.
  static thread_local std::vector<T> keys, values;
  if (keys.size() < static_cast<size_t>(H * per_head)) {
    keys.resize(H * per_head);
    values.resize(H * per_head);
  }
  // Pointers, not the vectors, go into the parallel regions: there `keys` would name the worker's own copy.
  T* const packed_keys = keys.data();
  T* const packed_values = values.data();
  std::vector<std::pair<int64_t, int64_t>> pack_items;  // (seq, block)
  for (int64_t i = 0; i < (int64_t)seqs.size(); ++i)
    for (int64_t b = 0; b < seqs[i].num_kv_blocks; ++b) pack_items.emplace_back(i, b);
  const int64_t num_pack = pack_items.size();
  at::parallel_for(0, H * num_pack, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / num_pack;
      auto [i, b] = pack_items[item % num_pack];
      const int64_t offset = h * per_head + seqs[i].packed;
      pack(a, seqs[i], h, b, packed_keys + offset, packed_values + offset);
    }
  });

  struct Item { int64_t seq, h, t0, t1, cost; };
  std::vector<Item> items;
  for (int64_t i = 0; i < (int64_t)seqs.size(); ++i)
    for (int64_t t0 = 0; t0 < seqs[i].q_len; t0 += q_block) {
      int64_t t1 = std::min(seqs[i].q_len, t0 + q_block);
      int64_t cost = (t1 - t0) * ((seqs[i].prefix + t1 - 1) / seqs[i].kv_block + 1) * seqs[i].kv_block;
      for (int64_t h = 0; h < H; ++h) items.push_back({i, h, t0, t1, cost});
    }
  // Handed out one at a time, a KV head's items in a row (its packed keys and values, up to a few MB, stay
  // in the caches while every query block reads them), largest first within the head: causal blocks differ
  // in cost by up to the sequence length, and the cheapest come last to even out the threads' finish.
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) {
    return x.h != y.h ? x.h < y.h : x.cost > y.cost;
  });
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), items.size());
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    auto attend = make_worker();
    for (int64_t k = next.fetch_add(1); k < (int64_t)items.size(); k = next.fetch_add(1)) {
      const Item& it = items[k];
      const Seq& s = seqs[it.seq];
      const int64_t offset = it.h * per_head + s.packed;
      attend(a, s, it.h, it.t0, it.t1, packed_keys + offset, packed_values + offset);
    }
  });
}

// Query tokens per work item: about `q_rows` GEMM rows, fewer when that would leave threads idle.
int64_t pick_q_block(const std::vector<Seq>& seqs, int64_t q_rows, int64_t group, int64_t heads) {
  int64_t q_block = std::max<int64_t>(1, q_rows / group);
  const int64_t wanted = 4 * at::get_num_threads();
  while (q_block * group > 16) {
    int64_t items = 0;
    for (const Seq& s : seqs) items += heads * ((s.q_len + q_block - 1) / q_block);
    if (items >= wanted) break;
    q_block = std::max<int64_t>(1, q_block / 2);
  }
  return q_block;
}

void varlen_causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cu_seqlens_q,
                             const at::Tensor& context_lens, const at::Tensor& block_tables, double scale,
                             int64_t kv_block, int64_t q_rows, bool tiles, const at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && out.sizes() == q.sizes(), "q/k/v/out must be (T, H, D)");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes(),
              "caches must be contiguous (blocks, block_size, Hkv, D)");
  const int64_t Hq = q.size(1), Hkv = k.size(1), D = q.size(2);
  TORCH_CHECK(Hq % Hkv == 0 && v.size(1) == Hkv && k.size(2) == D && v.size(2) == D && D % 2 == 0,
              "bad head counts or head_dim");
  TORCH_CHECK(k_cache.size(2) == Hkv && k_cache.size(3) == D, "cache shape does not match k");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 && out.stride(2) == 1, "head_dim must be contiguous");
  TORCH_CHECK(kv_block > 0 && kv_block % 32 == 0 && q_rows > 0, "kv_block must be a multiple of 32");
  auto scalar = q.scalar_type();
  TORCH_CHECK(k.scalar_type() == scalar && v.scalar_type() == scalar && k_cache.scalar_type() == scalar &&
              v_cache.scalar_type() == scalar && out.scalar_type() == scalar,
              "q, k, v, caches and out must share one dtype");
  auto cu = cu_seqlens_q.to(at::kLong).contiguous();
  auto ctx = context_lens.to(at::kLong).contiguous();
  auto tables = block_tables.to(at::kInt).contiguous();
  TORCH_CHECK(cu.numel() == ctx.numel() + 1 && tables.size(0) >= ctx.numel(), "one cu_seqlens_q/context_lens/block table entry per sequence");
  const int64_t* cu_p = cu.data_ptr<int64_t>();
  const int64_t* ctx_p = ctx.data_ptr<int64_t>();
  TORCH_CHECK(cu_p[ctx.numel()] <= q.size(0), "cu_seqlens_q runs past q");
  std::vector<Seq> seqs;
  int64_t packed = 0;
  for (int64_t i = 0; i < ctx.numel(); ++i) {
    int64_t q_len = cu_p[i + 1] - cu_p[i], prefix = ctx_p[i] - q_len;
    TORCH_CHECK(q_len >= 0 && prefix >= 0, "context_lens must be >= query lengths");
    TORCH_CHECK(prefix <= tables.size(1) * k_cache.size(1), "block table too short for the cached prefix");
    if (q_len == 0) continue;
    int64_t width = std::min(kv_block, (ctx_p[i] + 31) / 32 * 32);
    int64_t blocks = (ctx_p[i] + width - 1) / width;
    seqs.push_back({i, cu_p[i], q_len, prefix, width, blocks, packed});
    packed += blocks * width * D;
  }
  const int64_t group = Hq / Hkv;
  const int64_t q_block = pick_q_block(seqs, q_rows, group, Hkv);
  auto launch = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    Step<T> a{q.const_data_ptr<T>(), q.stride(0), q.stride(1),
              k.const_data_ptr<T>(), v.const_data_ptr<T>(), k.stride(0), v.stride(0), k.stride(1), v.stride(1),
              k_cache.const_data_ptr<T>(), v_cache.const_data_ptr<T>(), k_cache.stride(0), k_cache.stride(1),
              k_cache.size(1), tables.const_data_ptr<int32_t>(), tables.size(1),
              out.data_ptr<T>(), out.stride(0), out.stride(1),
              Hkv, group, D, static_cast<float>(scale)};
#if defined(BATCHGEN_AMX)
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      if (tiles && amx::supports(D, q.size(0) * q.stride(0) * q.element_size())) {
        run(a, seqs, q_block, amx::pack_block, [] { return AmxWorker(); });
        return;
      }
    }
#endif
    int64_t width = 32;
    for (const Seq& s : seqs) width = std::max(width, s.kv_block);
    run(a, seqs, q_block, pack_for_brgemm<T>, [&] { return BrgemmWorker<T>(group * q_block, D, width); });
  };
  dispatch(scalar, "varlen_causal_attention", launch);
}

}  // namespace
}  // namespace batchgen_cpu

TORCH_LIBRARY_FRAGMENT(batchgen_cpu, m) {
  m.def("varlen_causal_attention(Tensor q, Tensor k, Tensor v, Tensor k_cache, Tensor v_cache, Tensor cu_seqlens_q, "
        "Tensor context_lens, Tensor block_tables, float scale, int kv_block, int q_rows, bool tiles, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(batchgen_cpu, CPU, m) {
  m.impl("varlen_causal_attention", &batchgen_cpu::varlen_causal_attention);
}
