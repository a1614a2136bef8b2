"""What a speculative method implements: draft tokens for a sequence from what it has seen."""
from __future__ import annotations

from typing import Protocol, Sequence


class Proposer(Protocol):
    """Drafts up to ``k`` tokens that may follow a sequence; the target model verifies them.

    The engine calls ``add_request`` once per request when it is queued, ``propose`` before a step in which
    the cost model gives the sequence ``k`` > 0 draft tokens (``tokens`` is its prompt followed by its
    completion so far), and ``finish`` once the request has finished (``tokens`` then holds its whole
    completion), so that a proposer can learn from it and drop what it kept for the request. A proposer
    built with ``num_speculative_tokens`` never needs to return more tokens than that.
    """

    def add_request(self, seq_id: int, prompt: Sequence[int]) -> None: ...

    def propose(self, seq_id: int, tokens: Sequence[int], k: int) -> list[int]: ...

    def finish(self, seq_id: int, tokens: Sequence[int], num_prompt_tokens: int) -> None: ...
