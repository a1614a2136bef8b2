"""Verification of draft tokens inside the target's step: which logits rows to compute, how each position is
sampled, and how many drafts each sequence keeps.

Every position of a drafted sequence is sampled exactly as plain decode would sample the token at that
index of the output (the same temperature, top-k/top-p, grammar mask and seeded noise for (seed, output
index)); a draft is kept while it equals the token sampled at its position, and the first position that
differs (or the one after the last draft) gives the step's last token. For a deterministic draft this is
the lossless rule: the draft d is kept with probability p(d), and on rejection the token sampled is
distributed as p with d removed and renormalized. Because the noise is the plain sampler's own, a seeded
request produces the same tokens with speculation on or off, greedy or not.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from batchgen.engine.backends.torch.ops import accept_drafts
from batchgen.engine.executor.step import SamplingRows
from batchgen.engine.transfer import to_device


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


def accept(sampled: torch.Tensor, logprobs: torch.Tensor | None, drafts: Sequence[Sequence[int]],
           kernel: Callable = accept_drafts) -> AcceptedTokens:
    """Keeps each row's drafts up to the first the target rejects, on the device (one copy back per step):
    ``kernel`` is the kernel set's ``accept_drafts`` (a Triton launch on the GPU path, torch ops elsewhere)."""
    device = sampled.device
    width = max(len(d) for d in drafts) + 1
    starts = to_device(first_rows(drafts), device, torch.int64)
    lens = to_device([len(d) for d in drafts], device, torch.int64)
    padded = to_device([list(d) + [-1] * (width - 1 - len(d)) for d in drafts], device, torch.int64)
    tokens, counts, kept_logprobs = kernel(sampled, logprobs, starts, lens, padded.reshape(len(drafts), width - 1))
    return AcceptedTokens(tokens, counts, kept_logprobs)
