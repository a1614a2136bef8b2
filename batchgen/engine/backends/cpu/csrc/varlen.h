// The packed varlen prefill step both attention paths read (attention.cpp's brgemm blocks, attention_amx.h's
// AMX tiles): where its tensors live, its sequences, and the row of a key or value at a position.
#pragma once

#include <cstdint>

namespace batchgen_cpu {

// Where a step's tensors live; strides in elements.
template <typename T>
struct Step {
  const T* q; int64_t q_row, q_head;
  const T* k; const T* v; int64_t k_row, v_row, k_head, v_head;
  const T* k_cache; const T* v_cache; int64_t cache_block, cache_row, block_size;
  const int32_t* block_tables; int64_t tables_row;
  T* out; int64_t out_row, out_head;
  int64_t num_kv_heads, group, head_dim;
  float scale;
};

// One sequence of the step. Its keys are packed in blocks of `kv_block` (a multiple of 32, no more than
// its context needs) starting at element `packed` of each KV head's packed buffer.
struct Seq {
  int64_t index, q_start, q_len, prefix, kv_block, num_kv_blocks, packed;
};

// Row `pos` of the keys (or values) of sequence `s` for KV head `h`: prefix rows from the paged cache,
// the rest from this step's new rows.
template <typename T>
inline const T* kv_row(const Step<T>& a, const Seq& s, int64_t h, int64_t pos, bool value) {
  if (pos >= s.prefix) {
    int64_t row = s.q_start + pos - s.prefix;
    return value ? a.v + row * a.v_row + h * a.v_head : a.k + row * a.k_row + h * a.k_head;
  }
  int64_t block = a.block_tables[s.index * a.tables_row + pos / a.block_size];
  int64_t offset = block * a.cache_block + (pos % a.block_size) * a.cache_row + h * a.head_dim;
  return (value ? a.v_cache : a.k_cache) + offset;
}

}  // namespace batchgen_cpu
