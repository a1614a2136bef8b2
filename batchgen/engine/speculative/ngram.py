"""Prompt lookup ("ngram"): drafts the tokens that followed an earlier occurrence of the sequence's last n tokens."""
from __future__ import annotations

from typing import Sequence

import numpy as np


def longest_match_continuation(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens following the earliest occurrence of the longest suffix n-gram (min_n <= n <= max_n)
    that also ends earlier in ``tokens``; [] when no such n-gram recurs. vLLM's rule for its ngram method."""
    total = len(tokens)
    if total < min_n + 1 or k <= 0:
        return []
    # Candidate match ends: earlier positions holding the last token; then extend each match backwards.
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    if len(ends) == 0:
        return []
    lengths = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for m in range(1, max_n):
        at = ends - m
        alive &= at >= 0
        alive[alive] &= tokens[at[alive]] == tokens[total - 1 - m]
        if not alive.any():
            break
        lengths += alive
    best = int(lengths.max())
    if best < min_n:
        return []
    end = int(ends[np.argmax(lengths == best)])  # the earliest of the longest matches
    return tokens[end + 1:end + 1 + k].tolist()


class NgramProposer:
    """Prompt lookup over the sequence's own prompt and output: no model, no state kept between steps."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int = 2, prompt_lookup_max: int = 4):
        self.num_speculative_tokens = num_speculative_tokens
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def add_request(self, seq_id: int, prompt: Sequence[int]) -> None:
        pass

    def propose(self, seq_id: int, tokens: Sequence[int], k: int) -> list[int]:
        k = min(k, self.num_speculative_tokens)
        return longest_match_continuation(np.asarray(tokens, dtype=np.int64), self.min_n, self.max_n, k)

    def finish(self, seq_id: int, tokens: Sequence[int], num_prompt_tokens: int) -> None:
        pass
