// One-pass CPU versions of the decoder's elementwise work: RMSNorm (with the residual add), neox rotary,
// SiLU-and-mul, the paged KV store, and greedy sampling's row argmax. Each reads and writes its tensors once
// and computes in fp32, rounding to the tensor's dtype once at the end (torch's ops round after every step in bf16).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "activation.h"
#include "fp8.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace batchgen_cpu {
namespace {

constexpr int64_t W = kStep;


// Rows of a 2-D or 3-D tensor whose last dim is contiguous: row r is at data + offset(r).
struct Rows {
  int64_t count, inner, stride_outer, stride_inner, width;
  explicit Rows(const at::Tensor& x) {
    TORCH_CHECK(x.dim() == 2 || x.dim() == 3, "expected a 2-D or 3-D tensor");
    TORCH_CHECK(x.stride(-1) == 1, "the last dim must be contiguous");
    width = x.size(-1);
    inner = x.dim() == 3 ? x.size(1) : 1;
    count = x.size(0) * inner;
    stride_outer = x.stride(0);
    stride_inner = x.dim() == 3 ? x.stride(1) : 0;
  }
  int64_t offset(int64_t r) const { return (r / inner) * stride_outer + (r % inner) * stride_inner; }
};

template <typename T>
void rms_norm_rows(const T* x, const T* residual, const T* weight, T* out, T* residual_out, const Rows& xr,
                   const Rows& rr, const Rows& orr, const Rows& ror, float eps) {
  const int64_t n = xr.width;
  at::parallel_for(0, xr.count, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xp = x + xr.offset(r);
      T* op = out + orr.offset(r);
      const T* src = residual ? residual_out + ror.offset(r) : xp;
      Vec acc(0.f);
      float tail = 0.f;
      int64_t j = 0;
      if (residual) {  // the sum is rounded to T first, as the model's residual stream is kept in T, then squared
        const T* rp = residual + rr.offset(r);
        T* sp = residual_out + ror.offset(r);
        for (; j + W <= n; j += W) {
          Vec a0, a1, b0, b1;
          load2(xp + j, a0, a1);
          load2(rp + j, b0, b1);
          a0 = a0 + b0;
          a1 = a1 + b1;
          store2_rounded(sp + j, a0, a1);
          acc = at::vec::fmadd(a0, a0, acc);
          acc = at::vec::fmadd(a1, a1, acc);
        }
        for (; j < n; ++j) {
          sp[j] = static_cast<T>(static_cast<float>(xp[j]) + static_cast<float>(rp[j]));
          tail += static_cast<float>(sp[j]) * static_cast<float>(sp[j]);
        }
      } else {
        for (; j + W <= n; j += W) {
          Vec a0, a1;
          load2(src + j, a0, a1);
          acc = at::vec::fmadd(a0, a0, acc);
          acc = at::vec::fmadd(a1, a1, acc);
        }
        for (; j < n; ++j) tail += static_cast<float>(src[j]) * static_cast<float>(src[j]);
      }
      const float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc) + tail;
      const float inv = 1.f / std::sqrt(sum / n + eps);
      const Vec vinv(inv);
      for (j = 0; j + W <= n; j += W) {
        Vec a0, a1, w0, w1;
        load2(src + j, a0, a1);
        load2(weight + j, w0, w1);
        store2(op + j, a0 * vinv * w0, a1 * vinv * w1);
      }
      for (; j < n; ++j) op[j] = static_cast<T>(static_cast<float>(src[j]) * inv * static_cast<float>(weight[j]));
    }
  });
}

// out = x / rms(x) * weight; with residual: residual_out = x + residual first, normed instead of x.
void rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual, const at::Tensor& weight, double eps,
              const at::Tensor& out, const std::optional<at::Tensor>& residual_out) {
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(-1), "weight must match the last dim");
  TORCH_CHECK(out.sizes() == x.sizes() && residual.has_value() == residual_out.has_value(), "bad shapes");
  Rows xr(x), orr(out), rr = residual ? Rows(*residual) : xr, ror = residual_out ? Rows(*residual_out) : xr;
  TORCH_CHECK(!residual || (residual->sizes() == x.sizes() && residual_out->sizes() == x.sizes()), "bad residual shapes");
  dispatch(x.scalar_type(), "rms_norm", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    TORCH_CHECK(weight.scalar_type() == x.scalar_type() && out.scalar_type() == x.scalar_type(), "dtypes differ");
    rms_norm_rows<T>(x.const_data_ptr<T>(), residual ? residual->const_data_ptr<T>() : nullptr,
                     weight.const_data_ptr<T>(), out.data_ptr<T>(), residual_out ? residual_out->data_ptr<T>() : nullptr,
                     xr, rr, orr, ror, static_cast<float>(eps));
  });
}

// Neox rotary in place on q (T, Hq, D) and k (T, Hk, D); cos_sin_cache rows are [cos | sin], fp32.
template <typename T>
void rotate_heads(T* x, int64_t token, int64_t heads, int64_t s_token, int64_t s_head, int64_t half,
                  const float* cos, const float* sin) {
  for (int64_t h = 0; h < heads; ++h) {
    T* x1 = x + token * s_token + h * s_head;
    T* x2 = x1 + half;
    int64_t j = 0;
    for (; j + W <= half; j += W) {
      Vec a0, a1, b0, b1;
      load2(x1 + j, a0, a1);
      load2(x2 + j, b0, b1);
      Vec c0 = Vec::loadu(cos + j), c1 = Vec::loadu(cos + j + Vec::size());
      Vec s0 = Vec::loadu(sin + j), s1 = Vec::loadu(sin + j + Vec::size());
      store2(x1 + j, a0 * c0 - b0 * s0, a1 * c1 - b1 * s1);
      store2(x2 + j, b0 * c0 + a0 * s0, b1 * c1 + a1 * s1);
    }
    for (; j < half; ++j) {
      float a = static_cast<float>(x1[j]), b = static_cast<float>(x2[j]);
      x1[j] = static_cast<T>(a * cos[j] - b * sin[j]);
      x2[j] = static_cast<T>(b * cos[j] + a * sin[j]);
    }
  }
}

void apply_rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& positions,
                  const at::Tensor& cos_sin_cache) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2), "q, k must be (T, H, D)");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && q.scalar_type() == k.scalar_type(), "bad q/k layout");
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.is_contiguous() &&
              cos_sin_cache.size(1) == q.size(2), "cos_sin_cache must be fp32 (positions, D)");
  auto pos = positions.to(at::kLong).contiguous();
  TORCH_CHECK(pos.numel() == q.size(0), "one position per token");
  const int64_t* pp = pos.const_data_ptr<int64_t>();
  const int64_t D = q.size(2), half = D / 2, max_pos = cos_sin_cache.size(0);
  const float* table = cos_sin_cache.const_data_ptr<float>();
  for (int64_t t = 0; t < pos.numel(); ++t)
    TORCH_CHECK(pp[t] >= 0 && pp[t] < max_pos, "position ", pp[t], " outside the rotary table");
  dispatch(q.scalar_type(), "apply_rotary", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* qp = q.data_ptr<T>();
    T* kp = k.data_ptr<T>();
    at::parallel_for(0, q.size(0), grain((q.size(1) + k.size(1)) * D), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* cos = table + pp[t] * D;
        rotate_heads(qp, t, q.size(1), q.stride(0), q.stride(1), half, cos, cos + half);
        rotate_heads(kp, t, k.size(1), k.stride(0), k.stride(1), half, cos, cos + half);
      }
    });
  });
}

// out (T, I) = silu(x[:, :I]) * x[:, I:] for x (T, 2I).
void silu_and_mul(const at::Tensor& x, const at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.size(1) == 2 * out.size(1) && x.size(0) == out.size(0), "bad shapes");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1 && x.scalar_type() == out.scalar_type(), "bad layout");
  const int64_t n = out.size(1);
  dispatch(x.scalar_type(), "silu_and_mul", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* xp = x.const_data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, x.size(0), grain(3 * n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* g = xp + r * x.stride(0);
        silu_mul_row(g, g + n, op + r * out.stride(0), n);
      }
    });
  });
}

// First index of the largest value of each row of x (R, V) into out (R,), int64; a row holding NaN gives its first
// NaN, as torch's max does. Two passes over the row: a lane-wise max, then the first lane equal to it.
template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  Vec best(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + W <= n; j += W) {
    Vec a0, a1;
    load2(x + j, a0, a1);
    best = at::vec::maximum(best, at::vec::maximum(a0, a1));
  }
  float m = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, best);
  for (int64_t t = j; t < n; ++t) {
    const float v = static_cast<float>(x[t]);
    m = std::isnan(v) || std::isnan(m) ? std::numeric_limits<float>::quiet_NaN() : std::max(m, v);
  }
  if (std::isnan(m)) {
    for (int64_t t = 0; t < n; ++t)
      if (std::isnan(static_cast<float>(x[t]))) return t;
  }
  const Vec target(m);
  for (j = 0; j + W <= n; j += W) {
    Vec a0, a1;
    load2(x + j, a0, a1);
    const int lo = (a0 != target).zero_mask(), hi = (a1 != target).zero_mask();  // lanes equal to m
    if (lo | hi) return j + (lo ? __builtin_ctz(lo) : Vec::size() + __builtin_ctz(hi));
  }
  for (; j < n; ++j)
    if (static_cast<float>(x[j]) == m) return j;
  return 0;  // an empty row
}

void row_argmax(const at::Tensor& x, const at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be (rows, values) with contiguous rows");
  TORCH_CHECK(out.dim() == 1 && out.size(0) == x.size(0) && out.scalar_type() == at::kLong && out.is_contiguous(),
              "out must be int64 (rows,)");
  const int64_t n = x.size(1);
  dispatch(x.scalar_type(), "row_argmax", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* xp = x.const_data_ptr<T>();
    int64_t* op = out.data_ptr<int64_t>();
    at::parallel_for(0, x.size(0), grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * x.stride(0), n);
    });
  });
}

// k, v (T, Hkv, D) into the paged caches (blocks, block_size, Hkv, D) at flat slots; slot -1 is skipped.
// n values of T (fp32 or bf16) as a narrower cache stores them, rounded to nearest even as torch's cast rounds:
// bf16 as cast; fp8 clamped to the format's largest finite value first (NaN kept).
template <typename C, typename T>
void narrow_row(const T* src, C* dst, int64_t n) {
  if constexpr (std::is_same_v<C, at::BFloat16>) {
    int64_t d = 0;
    for (; d + kStep <= n; d += kStep) {
      Vec lo, hi;
      load2(src + d, lo, hi);
      store2(dst + d, lo, hi);
    }
    for (; d < n; ++d) dst[d] = C(static_cast<float>(src[d]));
    return;
  }
  const float limit = static_cast<float>(std::numeric_limits<C>::max());
  int64_t d = 0;
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 hi = _mm512_set1_ps(limit), lo = _mm512_set1_ps(-limit);
  for (; d + 16 <= n; d += 16) {
    __m512 x;
    if constexpr (std::is_same_v<T, float>) x = _mm512_loadu_ps(src + d);
    else x = bf16x16_to_ps(src + d);
    x = _mm512_max_ps(lo, _mm512_min_ps(hi, x));  // NaN passes: min and max return their second operand
    __m128i bytes;
    if constexpr (std::is_same_v<C, c10::Float8_e4m3fn>) bytes = at::vec::cvtfp32_fp8e4m3(x);
    else bytes = at::vec::cvtfp32_fp8e5m2(x);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + d), bytes);
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<T, float>) {
    const __m256 hi = _mm256_set1_ps(limit), lo = _mm256_set1_ps(-limit);
    for (; d + 8 <= n; d += 8)  // NaN passes: min and max return their second operand
      ps_to_fp8x8(_mm256_max_ps(lo, _mm256_min_ps(hi, _mm256_loadu_ps(src + d))), dst + d);
  }
#endif
  for (; d < n; ++d) {
    const float x = static_cast<float>(src[d]);
    dst[d] = C(std::isnan(x) ? x : std::clamp(x, -limit, limit));
  }
}

// out = x as an fp8 cache gives it back (narrow_row, then widened exactly): x (T, H, D) with contiguous heads,
// out contiguous, both fp32 or bf16; e5m2 or e4m3.
void round_through_fp8(const at::Tensor& x, bool e5m2, const at::Tensor& out) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2) && out.is_contiguous() &&
              out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type(), "bad shapes");
  const int64_t row = x.size(1) * x.size(2);
  dispatch(x.scalar_type(), "round_through_fp8", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    auto run = [&](auto* cache_tag) {
      using C = std::remove_pointer_t<decltype(cache_tag)>;
      at::parallel_for(0, x.size(0), grain(4 * row), [&](int64_t begin, int64_t end) {
        std::vector<C> bytes(row);
        for (int64_t t = begin; t < end; ++t) {
          narrow_row(x.const_data_ptr<T>() + t * x.stride(0), bytes.data(), row);
          widen_fp8(bytes.data(), out.data_ptr<T>() + t * row, row);
        }
      });
    };
    if (e5m2) run(static_cast<c10::Float8_e5m2*>(nullptr));
    else run(static_cast<c10::Float8_e4m3fn*>(nullptr));
  });
}

void store_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k_cache.is_contiguous() && v_cache.is_contiguous(), "bad shapes");
  TORCH_CHECK(k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3) && v_cache.sizes() == k_cache.sizes(), "cache shape");
  const auto cached = k_cache.scalar_type();
  const bool narrow = cached != k.scalar_type();
  TORCH_CHECK(v.scalar_type() == k.scalar_type() && v_cache.scalar_type() == cached &&
              takes_cache(k.scalar_type(), cached), "the caches must hold k's dtype, fp8, or bf16 under fp32 k");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(1) == v.size(2),
              "each token's heads must be contiguous");
  auto slots = slot_mapping.to(at::kLong).contiguous();
  TORCH_CHECK(slots.numel() == k.size(0), "one slot per token");
  const int64_t* sp = slots.const_data_ptr<int64_t>();
  const int64_t row = k.size(1) * k.size(2), num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t bytes = row * k_cache.element_size();
  const char* kp = static_cast<const char*>(k.const_data_ptr());
  const char* vp = static_cast<const char*>(v.const_data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t ks = k.stride(0) * k.element_size(), vs = v.stride(0) * v.element_size();
  // Checked before the parallel loop: an exception must not leave an OpenMP region.
  for (int64_t t = 0; t < k.size(0); ++t) TORCH_CHECK(sp[t] < num_slots, "slot ", sp[t], " outside the cache");
  if (narrow) {
    dispatch(k.scalar_type(), "store_kv", [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      auto run = [&](auto* cache_tag) {
        using C = std::remove_pointer_t<decltype(cache_tag)>;
        at::parallel_for(0, k.size(0), grain(4 * row), [&](int64_t begin, int64_t end) {
          for (int64_t t = begin; t < end; ++t) {
            if (sp[t] < 0) continue;
            narrow_row(reinterpret_cast<const T*>(kp + t * ks), reinterpret_cast<C*>(kc + sp[t] * bytes), row);
            narrow_row(reinterpret_cast<const T*>(vp + t * vs), reinterpret_cast<C*>(vc + sp[t] * bytes), row);
          }
        });
      };
      if (cached == at::kFloat8_e4m3fn) run(static_cast<c10::Float8_e4m3fn*>(nullptr));
      else if (cached == at::kFloat8_e5m2) run(static_cast<c10::Float8_e5m2*>(nullptr));
      else run(static_cast<at::BFloat16*>(nullptr));
    });
    return;
  }
  at::parallel_for(0, k.size(0), grain(2 * row), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (sp[t] < 0) continue;
      std::memcpy(kc + sp[t] * bytes, kp + t * ks, bytes);
      std::memcpy(vc + sp[t] * bytes, vp + t * vs, bytes);
    }
  });
}

}  // namespace
}  // namespace batchgen_cpu

TORCH_LIBRARY_FRAGMENT(batchgen_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps, Tensor(a!) out, Tensor(b!)? residual_out) -> ()");
  m.def("apply_rotary(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos_sin_cache) -> ()");
  m.def("silu_and_mul(Tensor x, Tensor(a!) out) -> ()");
  m.def("row_argmax(Tensor x, Tensor(a!) out) -> ()");
  m.def("store_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.def("round_through_fp8(Tensor x, bool e5m2, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(batchgen_cpu, CPU, m) {
  m.impl("rms_norm", &batchgen_cpu::rms_norm);
  m.impl("apply_rotary", &batchgen_cpu::apply_rotary);
  m.impl("silu_and_mul", &batchgen_cpu::silu_and_mul);
  m.impl("row_argmax", &batchgen_cpu::row_argmax);
  m.impl("store_kv", &batchgen_cpu::store_kv);
  m.impl("round_through_fp8", &batchgen_cpu::round_through_fp8);
}
