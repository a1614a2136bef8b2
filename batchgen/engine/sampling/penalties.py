"""Penalties on tokens a row already holds, and tokens a row may not sample yet (``min_tokens``), on a step's logits.

Rows write down their tokens on the host (:class:`RowPenalties`, in the step that crosses to the workers); the
counts are built on the logits' device, where the vocabulary size is known.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from batchgen.engine.transfer import to_device


@dataclass
class RowPenalties:
    """A sampling row's penalties (see SamplingParams) and the tokens they count."""

    row: int
    presence: float
    frequency: float
    repetition: float
    completion_ids: list[int] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)  # only where ``repetition`` is not 1


@dataclass
class BannedTokens:
    """Tokens a sampling row may not sample this step: its end-of-sequence and stop ids before ``min_tokens``."""

    row: int
    token_ids: list[int]


def _rows_and_ids(lists: Sequence[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index of each token, token ids) of ``lists`` flattened, as int64 tensors on ``device``."""
    rows = [i for i, ids in enumerate(lists) for _ in ids]
    return to_device(rows, device, torch.int64), to_device([t for ids in lists for t in ids], device, torch.int64)


def apply_penalties(logits: torch.Tensor, penalties: Sequence[RowPenalties]) -> None:
    """Penalizes ``logits`` (fp32 (R, V)) in place, in the rows that have penalties, as vLLM does: the repetition
    penalty divides a seen token's positive logit and multiplies a negative one; then the frequency penalty times
    the token's count in the completion and the presence penalty (once it appears) are taken off."""
    if not penalties:
        return
    device, vocab = logits.device, logits.shape[1]
    rows = to_device([p.row for p in penalties], device, torch.int64)
    at, ids = _rows_and_ids([p.completion_ids for p in penalties], device)
    counts = torch.zeros(len(penalties), vocab, device=device)
    counts.index_put_((at, ids), torch.ones(len(ids), device=device), accumulate=True)
    x = logits[rows]
    repetition = to_device([p.repetition for p in penalties], device, torch.float32)[:, None]
    if bool((repetition != 1).any()):
        seen = counts > 0
        at, ids = _rows_and_ids([p.prompt_ids for p in penalties], device)
        seen[at, ids] = True
        x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
    frequency = to_device([p.frequency for p in penalties], device, torch.float32)[:, None]
    presence = to_device([p.presence for p in penalties], device, torch.float32)[:, None]
    logits[rows] = x - frequency * counts - presence * (counts > 0)


def ban_tokens(logits: torch.Tensor, banned: Sequence[BannedTokens]) -> None:
    """Sets the banned tokens' logits to -inf, in place."""
    if banned:
        rows, ids = _rows_and_ids([b.token_ids for b in banned], logits.device)
        logits[to_device([b.row for b in banned], logits.device, torch.int64)[rows], ids] = float("-inf")
