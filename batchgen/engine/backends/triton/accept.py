"""Speculative verification's bookkeeping in one launch: each row's sampled tokens and how many drafts it keeps."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _accept_kernel(Sampled, Logprobs, Starts, Lens, Drafts, Tokens, Counts, LogprobsOut, K,
                   BLOCK: tl.constexpr, HAS_LOGPROBS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    start = tl.load(Starts + row)
    n = tl.load(Lens + row)
    j = tl.arange(0, BLOCK)
    in_row = j < K + 1
    index = tl.where(j <= n, start + j, start)  # past the row's drafts: its first position, as padding
    tokens = tl.load(Sampled + index, mask=in_row, other=0)
    tl.store(Tokens + row * (K + 1) + j, tokens, mask=in_row)
    if HAS_LOGPROBS:
        tl.store(LogprobsOut + row * (K + 1) + j, tl.load(Logprobs + index, mask=in_row, other=0.0), mask=in_row)
    draft = tl.load(Drafts + row * K + j, mask=j < K, other=-1)
    kept = (draft == tokens) & (j < n)
    # The first position not kept (n at the latest: j = n is never a draft) is the number of drafts kept.
    tl.store(Counts + row, tl.min(tl.where(kept, BLOCK, j), axis=0).to(tl.int64) + 1)


def accept_drafts(sampled: torch.Tensor, logprobs: torch.Tensor | None, starts: torch.Tensor, lens: torch.Tensor,
                  drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """As the torch reference (``backends.torch.ops.accept_drafts``), one program per row."""
    rows, k = drafts.shape
    device = sampled.device
    tokens = torch.empty(rows, k + 1, dtype=sampled.dtype, device=device)
    counts = torch.empty(rows, dtype=torch.int64, device=device)
    kept_logprobs = torch.empty(rows, k + 1, dtype=logprobs.dtype, device=device) if logprobs is not None else None
    if rows:
        _accept_kernel[(rows,)](sampled, logprobs if logprobs is not None else sampled, starts, lens,
                                drafts.contiguous(), tokens, counts,
                                kept_logprobs if kept_logprobs is not None else tokens, k,
                                BLOCK=triton.next_power_of_2(k + 1), HAS_LOGPROBS=logprobs is not None)
    return tokens, counts, kept_logprobs
