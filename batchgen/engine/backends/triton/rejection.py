"""Rejection sampling of sampled drafts in one launch: each row's acceptance tests, its residual draw, its tokens."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 1024  # vocabulary entries a program reads at a time for the residual draw


@triton.jit
def _mix32(x):
    """The sampler's 32-bit hash (``sampling.sampler._mix32``) on int64 values holding uint32."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & 0xFFFFFFFF
    x = ((x >> 16) ^ x) * 0x45D9F3B & 0xFFFFFFFF
    return (x >> 16) ^ x


@triton.jit
def _reject_kernel(Sampled, Probs, DraftProbs, QStarts, Uniforms, ResidualSeeds, Steps, Starts, Lens, Drafts,
                   Tokens, Counts, K, V, stride_p, stride_q, BLOCK: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    start = tl.load(Starts + row)
    n = tl.load(Lens + row)
    q_start = tl.load(QStarts + row)
    has_q = q_start >= 0
    j = tl.arange(0, BLOCK)
    in_row = j < K + 1
    in_draft = j < n
    index = tl.where(j <= n, start + j, start)  # past the row's drafts: its first position, as padding
    tokens = tl.load(Sampled + index, mask=in_row, other=0)
    draft = tl.load(Drafts + row * K + j, mask=j < K, other=-1)
    d = tl.maximum(draft, 0)
    p_d = tl.load(Probs + index * stride_p + d, mask=in_draft, other=0.0)
    q_mask = in_draft & (q_start + j >= j)  # has_q, as a block (a scalar mask is refused)
    q_d = tl.load(DraftProbs + (q_start + j) * stride_q + d, mask=q_mask, other=0.0)
    u = tl.load(Uniforms + index, mask=in_draft, other=1.0)
    kept = tl.where(has_q, u * q_d < p_d, draft == tokens) & in_draft  # as ops.probabilistic_acceptance
    first = tl.min(tl.where(kept, BLOCK, j), axis=0).to(tl.int64)  # the first position not kept
    tl.store(Counts + row, first + 1)
    out = tl.where(has_q & (j < first), d, tokens)
    if has_q & (first < n):
        # The residual max(0, p - q) at the rejected position, drawn by the exponential race under the noise
        # sampler.seeded_uniform(seed, step) gives; p itself where the residual is all zero.
        pos = start + first
        seed = tl.load(ResidualSeeds + pos)
        h = _mix32(_mix32(seed & 0xFFFFFFFF) ^ ((seed >> 32) & 0xFFFFFFFF))
        h = _mix32(h ^ (tl.load(Steps + pos) & 0xFFFFFFFF))
        best_r, best_p = tl.full([], -1.0, tl.float32), tl.full([], -1.0, tl.float32)
        token_r, token_p = tl.full([], 0, tl.int64), tl.full([], 0, tl.int64)
        total = tl.full([], 0.0, tl.float32)
        for v0 in range(0, V, BLOCK_V):
            v = v0 + tl.arange(0, BLOCK_V)
            m = v < V
            p = tl.load(Probs + pos * stride_p + v, mask=m, other=0.0)
            q = tl.load(DraftProbs + (q_start + first) * stride_q + v, mask=m, other=0.0)
            r = tl.maximum(p - q, 0.0)
            total += tl.sum(r, axis=0)
            bits = _mix32(h ^ _mix32(v.to(tl.int64) * 2654435761 & 0xFFFFFFFF))
            e = -tl.log(tl.minimum(((bits.to(tl.float64) + 0.5) / 4294967296.0).to(tl.float32), 0.99999994))
            score_r, score_p = tl.where(m, r / e, -1.0), tl.where(m, p / e, -1.0)
            top_r, top_p = tl.max(score_r, axis=0), tl.max(score_p, axis=0)
            token_r = tl.where(top_r > best_r, v0 + tl.argmax(score_r, axis=0), token_r)
            token_p = tl.where(top_p > best_p, v0 + tl.argmax(score_p, axis=0), token_p)
            best_r, best_p = tl.maximum(best_r, top_r), tl.maximum(best_p, top_p)
        out = tl.where(j == first, tl.where(total > 0, token_r, token_p), out)
    tl.store(Tokens + row * (K + 1) + j, out, mask=in_row)


def reject_drafts(sampled: torch.Tensor, probs: torch.Tensor, draft_probs: torch.Tensor, q_starts: torch.Tensor,
                  uniforms: torch.Tensor, residual_seeds: torch.Tensor, steps: torch.Tensor, starts: torch.Tensor,
                  lens: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """As the torch reference (``backends.torch.ops.reject_drafts``), one program per row."""
    rows, k = drafts.shape
    tokens = torch.empty(rows, k + 1, dtype=sampled.dtype, device=sampled.device)
    counts = torch.empty(rows, dtype=torch.int64, device=sampled.device)
    if rows:
        probs, draft_probs = probs.contiguous(), draft_probs.contiguous()
        _reject_kernel[(rows,)](sampled, probs, draft_probs, q_starts, uniforms.contiguous(), residual_seeds, steps,
                                starts, lens, drafts.contiguous(), tokens, counts, k, probs.shape[1],
                                probs.stride(0), draft_probs.stride(0),
                                BLOCK=triton.next_power_of_2(k + 1),
                                BLOCK_V=min(BLOCK_V, triton.next_power_of_2(probs.shape[1])))
    return tokens, counts
