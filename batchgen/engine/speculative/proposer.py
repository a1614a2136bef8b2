"""What a speculative method implements: draft tokens for a sequence from what it has seen."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol, Sequence


class Proposer(Protocol):
    """Drafts up to ``k`` tokens that may follow a sequence; the target model verifies them.

    The engine calls ``add_request`` once per request when it is queued, ``propose`` before a step in which
    the cost model gives the sequence ``k`` > 0 draft tokens (``tokens`` is its prompt followed by its
    completion so far; a proposer that drafts a step's sequences together also has ``propose_batch``, see
    :func:`propose_batch`), and ``finish`` once the request has finished (``tokens`` then holds its whole
    completion), so that a proposer can learn from it and drop what it kept for the request. A proposer
    built with ``num_speculative_tokens`` never needs to return more tokens than that.

    A proposer that drafts from the target's hidden states sets ``needs_hidden_states`` and has
    ``observe_step(rows, hidden)``, called right after each target step with the positions it computed and kept
    (``mtp.ComputedRows``) and their hidden states (steps then do not overlap).

    The speculator charges a proposer's time per drafted token in the cost model: a call's wall time, or its
    ``steady_seconds`` where it sets one after each call (the part that drafting costs each step, one-off work
    such as a draft model's first pass over a new prompt left out).

    A proposer that samples its drafts (a draft model at the request's temperature) sets ``draft_probs`` after
    each call: by seq_id, the distribution each draft token was drawn from, (len(draft), vocab) on the device;
    the target then verifies those drafts by rejection sampling. The others' drafts are deterministic.
    """

    def add_request(self, seq_id: int, prompt: Sequence[int]) -> None: ...

    def propose(self, seq_id: int, tokens: Sequence[int], k: int) -> list[int]: ...

    def finish(self, seq_id: int, tokens: Sequence[int], num_prompt_tokens: int) -> None: ...


@dataclass(frozen=True)
class DraftSampling:
    """How a request samples (temperature > 0, no grammar), for a proposer that samples its drafts the same way:
    its settings, seed and the output index of the first draft."""

    temperature: float
    top_k: int
    top_p: float
    seed: int
    output_index: int


class DraftRequest(NamedTuple):
    """One sequence to draft for: ``propose``'s arguments, and how the request samples (None: greedy or with
    a grammar, whose drafts stay deterministic)."""

    seq_id: int
    tokens: Sequence[int]
    k: int
    sampling: DraftSampling | None = None


def propose_batch(proposer: Proposer, requests: list[DraftRequest]) -> list[list[int]]:
    """Drafts of a step's sequences, in order: the proposer's own ``propose_batch`` where it has one (a draft
    model runs them as one batch), else ``propose`` once per sequence."""
    batch = getattr(proposer, "propose_batch", None)
    if batch is not None:
        return batch(requests)
    return [proposer.propose(r.seq_id, r.tokens, r.k) for r in requests]
