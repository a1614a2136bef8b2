"""The torch reference ops: RMSNorm, rotary, gated activations, mixture of experts, speculative verification."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from batchgen.engine.sampling.sampler import seeded_uniform


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm (fp32 statistics). With ``residual``: adds it first and returns (normed, new residual)."""
    if residual is not None:
        x = residual = x + residual
    return F.rms_norm(x, (x.shape[-1],), weight, eps), residual


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary, in place, on q (T, Hq, D) and k (T, Hkv, D); cache rows are [cos | sin], D/2 each."""
    cos, sin = cos_sin_cache[positions].to(q.dtype).chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    for x in (q, k):
        x1, x2 = x.chunk(2, dim=-1)
        x1_sin = x1 * sin
        rotated_first = x1 * cos - x2 * sin
        x2.mul_(cos).add_(x1_sin)
        x1.copy_(rotated_first)
    return q, k


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for a fused [gate | up] projection output."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GELU(gate) (tanh approximation) * up for a fused [gate | up] projection output (GeGLU)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, skip_negative: bool = False) -> torch.Tensor:
    """Mixture of SwiGLU experts: out[t] = sum_k topk_weights[t, k] * expert_e(x[t]), e = topk_ids[t, k].

    x (T, H); w13 (E, 2I, H), gate rows then up rows; w2 (E, H, I); topk_weights float32 (T, k);
    topk_ids (T, k) in [0, E), or -1 with ``skip_negative`` for a pair another expert-parallel rank
    computes (it adds nothing here). The (token, expert) pairs are sorted by expert and every expert
    that got tokens runs one GEMM over its gathered rows; the weighted rows are summed back per token
    in float32.
    """
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.flatten()
    shift = int(skip_negative)  # bin 0 counts the skipped pairs, which sort first and are dropped
    counts = torch.bincount(flat_ids + shift if shift else flat_ids, minlength=w13.shape[0] + shift).tolist()
    order = torch.argsort(flat_ids, stable=True)[sum(counts[:shift]):]
    tokens = order // top_k
    rows = x[tokens]
    expert_out = torch.empty(rows.shape[0], w2.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for expert, n in enumerate(counts[shift:]):
        if n:
            span = slice(start, start + n)
            expert_out[span] = F.linear(silu_and_mul(F.linear(rows[span], w13[expert])), w2[expert])
            start += n
    weighted = expert_out.float() * topk_weights.flatten()[order, None]
    out = torch.zeros(num_tokens, w2.shape[1], dtype=torch.float32, device=x.device)
    return out.index_add_(0, tokens, weighted).to(x.dtype)


def acceptance_rule(drafts: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Which drafts (R, K) the target accepts, given the tokens it sampled at their positions (R, K)."""
    return drafts == targets


def accept_drafts(sampled: torch.Tensor, logprobs: torch.Tensor | None, starts: torch.Tensor, lens: torch.Tensor,
                  drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Speculative verification's bookkeeping. Row r's positions are ``sampled[starts[r] .. starts[r] + lens[r]]``
    (its last real token, then each of its ``lens[r]`` drafts, ``drafts[r, :lens[r]]``; the rest of the (R, K)
    row is padding). Returns the tokens sampled at each row's positions (R, K + 1; past ``lens[r]``, padding
    with the row's first), how many it keeps (R,: the drafts equal to the token sampled at their position, up to
    the first that is not, plus one) and their logprobs (R, K + 1) when ``logprobs`` is given."""
    width = drafts.shape[1] + 1
    j = torch.arange(width, device=sampled.device)
    valid = j[None, :] <= lens[:, None]
    index = torch.where(valid, starts[:, None] + j[None, :], starts[:, None])
    tokens = sampled[index]
    kept = acceptance_rule(drafts, tokens[:, :-1]) & valid[:, 1:]
    counts = kept.long().cumprod(dim=1).sum(dim=1) + 1
    return tokens, counts, logprobs[index] if logprobs is not None else None


def probabilistic_acceptance(uniforms: torch.Tensor, target_probs: torch.Tensor,
                             draft_probs: torch.Tensor) -> torch.Tensor:
    """Leviathan et al.'s rule: a draft sampled from q is kept when u < min(1, p / q), u uniform on (0, 1)."""
    return uniforms * draft_probs < target_probs


def reject_drafts(sampled: torch.Tensor, probs: torch.Tensor, draft_probs: torch.Tensor, q_starts: torch.Tensor,
                  uniforms: torch.Tensor, residual_seeds: torch.Tensor, steps: torch.Tensor, starts: torch.Tensor,
                  lens: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative verification of sampled drafts (rejection sampling), beside deterministic ones.

    Positions, ``sampled``, ``starts``, ``lens`` and ``drafts`` are as in :func:`accept_drafts`; ``probs`` (N, V)
    is the target's distribution at each position and ``uniforms`` (N,) its acceptance noise. Row r's drafts were
    sampled from ``draft_probs[q_starts[r] + j]`` (one row per draft); ``q_starts[r]`` < 0 marks deterministic
    drafts, kept while they equal ``sampled`` (:func:`acceptance_rule`). A sampled draft d is kept under
    :func:`probabilistic_acceptance`; at the first rejection the token is drawn from max(0, p - q) renormalized
    (p where that is all zero), with the noise ``seeded_uniform(residual_seeds, steps)`` of its position; with
    every draft kept, the next token is the one ``sampled`` after them. Returns each row's tokens (R, K + 1;
    past the kept ones, padding) and how many it keeps (R,), as :func:`accept_drafts`."""
    k = drafts.shape[1]
    j = torch.arange(k + 1, device=sampled.device)
    valid = j[None, :] <= lens[:, None]
    index = torch.where(valid, starts[:, None] + j[None, :], starts[:, None])
    tokens, at, in_draft = sampled[index], index[:, :k], valid[:, 1:]
    has_q, d = q_starts >= 0, drafts.clamp(min=0)
    q_rows = torch.where(has_q[:, None] & in_draft, q_starts[:, None] + j[None, :k], 0)
    kept = torch.where(has_q[:, None], probabilistic_acceptance(uniforms[at], probs[at, d], draft_probs[q_rows, d]),
                       acceptance_rule(drafts, tokens[:, :-1])) & in_draft
    counts = kept.long().cumprod(dim=1).sum(dim=1) + 1
    first = counts - 1  # the first rejected draft's position, or lens[r]: the token after every draft
    rejected = has_q & (first < lens)
    pos = index.gather(1, first[:, None])[:, 0]
    residual = (probs[pos] - draft_probs[torch.where(rejected, q_starts + first, 0)]).clamp_(min=0)
    residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, probs[pos])
    noise = seeded_uniform(residual_seeds[pos], steps[pos], probs.shape[1])
    resampled = (residual / -noise.log()).argmax(dim=1)  # the exponential race, as the sampler draws
    out = torch.where(has_q[:, None] & (j[None, :] < first[:, None]), torch.cat([d, tokens[:, k:]], dim=1), tokens)
    last = torch.where(rejected, resampled, out.gather(1, first[:, None])[:, 0])
    return out.scatter(1, first[:, None], last[:, None]), counts
