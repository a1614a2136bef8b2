// The decode op's reads ahead: the next chunk's cache lines asked for while the current chunk is worked on.
#pragma once

#include "vec.h"

#include <algorithm>
#include <cstdint>

namespace batchgen_cpu {

// The next chunk's cache lines, asked for a few at a time as the current chunk's work steps along: all at once
// they would fill the miss queues and stall that work (on a cold step here, 1.3x slower), and reading a chunk
// head by head is no order the hardware's prefetchers follow. Each step of a tile reads 4 x Vec::size() values of
// the cache (a score step 4 rows' next vector, a value step a row's 4 vectors), so as many lines keep pace: 2 for
// fp32 on AVX2, 4 on AVX-512, 2 for bf16 there (AVX-512 bf16 rows at 4 lines a step ran 0.91x, at 1 0.88x).
// Where the next chunk does not continue the current one in memory (its block is not the next one), its lines
// are asked for into L2 only: the hardware's streams then run on past the block into lines the row does not
// need, and L1 fills meant for this chunk's rows would wait behind them. Over tables of scattered blocks the op
// ran 1.20-1.39x faster (bf16, 1.25x fp32; 30 cold caches, AVX512-BF16), over blocks in order unchanged.
inline int64_t ahead_lines(int64_t elem_bytes) { return std::max<int64_t>(1, 4 * Vec::size() * elem_bytes / 64); }

class Ahead {
 public:
  Ahead(const void* cache, const int64_t* rows, int64_t count, int64_t elem_bytes, int64_t row_bytes,
        bool to_l2 = false)
      : cache_(static_cast<const char*>(cache)), rows_(rows), count_(count), elem_(elem_bytes),
        lines_((row_bytes + 63) / 64), per_step_(ahead_lines(elem_bytes)), to_l2_(to_l2) {}
  void operator()() {
    for (int64_t k = 0; k < per_step_ && row_ < count_; ++k) {
      const char* line = cache_ + rows_[row_] * elem_ + line_ * 64;
      if (to_l2_) __builtin_prefetch(line, 0, 1);
      else __builtin_prefetch(line);
      if (++line_ == lines_) line_ = 0, ++row_;
    }
  }

 private:
  const char* cache_;
  const int64_t* rows_;
  int64_t count_, elem_, lines_, per_step_, row_ = 0, line_ = 0;
  bool to_l2_;
};

}  // namespace batchgen_cpu
