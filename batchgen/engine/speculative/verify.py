"""Verification of draft tokens inside the target's step: which logits rows to compute, how each position is
sampled, and how many drafts each sequence keeps.

Every position of a drafted sequence is sampled exactly as plain decode would sample the token at that
index of the output (the same temperature, top-k/top-p, grammar mask and seeded noise for (seed, output
index)); a draft is kept while it equals the token sampled at its position, and the first position that
differs (or the one after the last draft) gives the step's last token. For a deterministic draft this is
the lossless rule: the draft d is kept with probability p(d), and on rejection the token sampled is
distributed as p with d removed and renormalized. Because the noise is the plain sampler's own, a seeded
request produces the same tokens with speculation on or off, greedy or not.

Drafts sampled from a draft model's distribution q (its probabilities come with them) are verified with
Leviathan et al.'s rejection sampling instead: d is kept when u < min(1, p(d) / q(d)), and at the first
rejection the token is drawn from max(0, p - q) renormalized; the emitted tokens are distributed as p. The
noise then comes from the request's seed and output index under salts of its own, so the tokens are
reproducible for a seed but differ from spec off's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from batchgen.engine.backends.interface import KernelSet
from batchgen.engine.backends.torch.ops import accept_drafts
from batchgen.engine.executor.step import SamplingRows
from batchgen.engine.sampling.sampler import SamplingBatch, sample_rows, seeded_uniform
from batchgen.engine.transfer import to_device

# Salts on a request's seed for the noise of rejection sampling, apart from the plain sampler's own (the
# draft model's noise has its own, see draft_model.draft_seed).
ACCEPT_SALT = 0x2C1B3C6D5E8F9A07  # u of each draft's acceptance test
RESIDUAL_SALT = 0x1F83D9ABFB41BD6B  # the token drawn from the residual at the first rejection


def verified_rows(ends: torch.Tensor, drafts: Sequence[Sequence[int]]) -> torch.Tensor:
    """The packed rows whose logits a step needs: for a sampling row ending at packed row ``e`` with ``k``
    drafts, rows ``e - k .. e`` (its last real token and each draft)."""
    counts = torch.tensor([len(d) + 1 for d in drafts], dtype=torch.int64)
    offsets = torch.repeat_interleave(ends - counts + 1, counts)
    within = torch.arange(int(counts.sum())) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    return offsets + within


def expand_sampling(rows: SamplingRows, drafts: Sequence[Sequence[int]]) -> SamplingRows:
    """One sampling row per verified position: a row's settings, its output index advancing along its drafts."""
    out = SamplingRows()
    for i, d in enumerate(drafts):
        for j in range(len(d) + 1):
            out.append(rows.temperatures[i], rows.top_ks[i], rows.top_ps[i], rows.seeds[i], rows.steps[i] + j,
                       rows.logprobs[i])
    return out


def first_rows(drafts: Sequence[Sequence[int]]) -> list[int]:
    """Index of each sampling row's first expanded row."""
    starts, at = [], 0
    for d in drafts:
        starts.append(at)
        at += len(d) + 1
    return starts


@dataclass
class AcceptedTokens:
    """Per sampling row: the tokens sampled at each of its positions (padded) and how many it keeps."""

    tokens: torch.Tensor  # int64 (R, K + 1)
    counts: torch.Tensor  # int64 (R,): accepted drafts + 1
    logprobs: torch.Tensor | None  # float32 (R, K + 1)

    def to_lists(self) -> tuple[list[list[int]], list[list[float]] | None]:
        counts = self.counts.tolist()
        tokens = [row[:c] for row, c in zip(self.tokens.tolist(), counts)]
        if self.logprobs is None:
            return tokens, None
        return tokens, [row[:c] for row, c in zip(self.logprobs.tolist(), counts)]


def _spans(drafts: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Each row's first position, its number of drafts and its drafts padded with -1 to (R, K), on the device."""
    width = max(len(d) for d in drafts)
    starts = to_device(first_rows(drafts), device, torch.int64)
    lens = to_device([len(d) for d in drafts], device, torch.int64)
    padded = to_device([list(d) + [-1] * (width - len(d)) for d in drafts], device, torch.int64)
    return starts, lens, padded.reshape(len(drafts), width)


def accept(sampled: torch.Tensor, logprobs: torch.Tensor | None, drafts: Sequence[Sequence[int]],
           kernel: Callable = accept_drafts) -> AcceptedTokens:
    """Keeps each row's drafts up to the first the target rejects, on the device (one copy back per step):
    ``kernel`` is the kernel set's ``accept_drafts`` (a Triton launch on the GPU path, torch ops elsewhere)."""
    tokens, counts, kept_logprobs = kernel(sampled, logprobs, *_spans(drafts, sampled.device))
    return AcceptedTokens(tokens, counts, kept_logprobs)


def verify(logits: torch.Tensor, batch: SamplingBatch, drafts: Sequence[Sequence[int]],
           draft_probs: Sequence[torch.Tensor | None], kernels: KernelSet) -> AcceptedTokens:
    """Samples every verified position (``batch``: one row each) and keeps each row's accepted drafts: by the
    deterministic rule, or by rejection sampling for the rows whose drafts were sampled (``draft_probs``)."""
    sampled = sample_rows(logits, batch, kernels.row_argmax)
    if all(q is None for q in draft_probs):
        return accept(sampled.tokens, sampled.logprobs, drafts, kernels.accept_drafts)
    device = sampled.tokens.device
    q_starts, at = [], 0
    for d, q in zip(drafts, draft_probs, strict=True):
        q_starts.append(at if q is not None else -1)
        at += len(d) if q is not None else 0
    q = torch.cat([q for q in draft_probs if q is not None]).to(device)
    uniforms = seeded_uniform(batch.seeds ^ ACCEPT_SALT, batch.steps, 1)[:, 0]
    starts, lens, padded = _spans(drafts, device)
    tokens, counts = kernels.reject_drafts(sampled.tokens, sampled.probs, q, to_device(q_starts, device, torch.int64),
                                           uniforms, batch.seeds ^ RESIDUAL_SALT, batch.steps, starts, lens, padded)
    logprobs = None
    if batch.want_logprobs:
        j = torch.arange(tokens.shape[1], device=device)
        positions = torch.where(j[None, :] <= lens[:, None], starts[:, None] + j[None, :], starts[:, None])
        logprobs = sampled.logprobs_of(positions, tokens)
    return AcceptedTokens(tokens, counts, logprobs)
