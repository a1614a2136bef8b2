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
    the token's count in the completion and the presence penalty (once it appears) are taken off. Only the
    (row, token) pairs seen are touched: no (rows, vocab) temporaries."""
    if not penalties:
        return
    device, (num_rows, vocab) = logits.device, logits.shape

    def per_row(values: list[float], default: float) -> torch.Tensor:
        out = torch.full((num_rows,), default, device=device)
        out[to_device([p.row for p in penalties], device, torch.int64)] = to_device(values, device, torch.float32)
        return out

    def keys(lists: list[list[int]]) -> torch.Tensor:  # row * vocab + token of every token listed
        at, ids = _rows_and_ids(lists, device)
        return to_device([p.row * vocab for p in penalties], device, torch.int64)[at] + ids

    output, counts = torch.unique(keys([p.completion_ids for p in penalties]), return_counts=True)
    if any(p.repetition != 1 for p in penalties):
        seen = torch.unique(torch.cat((output, keys([p.prompt_ids for p in penalties]))))
        rows, ids = seen // vocab, seen % vocab
        x, factor = logits[rows, ids], per_row([p.repetition for p in penalties], 1.0)[rows]
        logits[rows, ids] = torch.where(x > 0, x / factor, x * factor)
    rows, ids = output // vocab, output % vocab
    logits[rows, ids] -= (per_row([p.frequency for p in penalties], 0.0)[rows] * counts
                          + per_row([p.presence for p in penalties], 0.0)[rows])


def ban_tokens(logits: torch.Tensor, banned: Sequence[BannedTokens]) -> None:
    """Sets the banned tokens' logits to -inf, in place (ids outside the vocabulary, which no row can sample, are
    passed over)."""
    vocab = logits.shape[1]
    banned = [BannedTokens(b.row, [t for t in b.token_ids if 0 <= t < vocab]) for b in banned]
    if banned:
        rows, ids = _rows_and_ids([b.token_ids for b in banned], logits.device)
        logits[to_device([b.row for b in banned], logits.device, torch.int64)[rows], ids] = float("-inf")
