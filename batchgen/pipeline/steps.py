"""Expected engine steps for a job, from its prompt lengths: the scheduler's policy replayed on token counts."""
from __future__ import annotations

import heapq
from dataclasses import asdict, dataclass
from typing import Iterable


@dataclass
class StepEstimate:
    """Steps as ``EngineMetrics`` counts them: prefill steps compute prompt tokens, decode steps do not."""

    steps: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    prompt_tokens: int = 0
    decode_step_tokens: int = 0  # tokens computed in decode-only steps

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def estimate_steps(prompt_lens: Iterable[int | tuple[int, int]], completion_tokens: int, token_budget: int,
                   max_seqs: int) -> StepEstimate:
    """Replays ``Scheduler.schedule`` on token counts, prompts taken in order (each a length, or a pair of its
    length and the tokens it generates, where rows differ from ``completion_tokens``).

    Each step, running sequences decode one token each, the one prompt left unfinished by the last step
    continues, then new prompts are admitted while the budget and ``max_seqs`` allow, the last one
    chunked to fit. Assumes every row generates ``completion_tokens``, the KV cache never runs out (no
    preemption) and no prefix-cache hits; under those assumptions it counts what the engine would.
    Decode-only stretches are skipped in one go, so a long job takes O(rows log max_seqs).
    """
    est = StepEstimate()
    max_seqs = max(1, min(max_seqs, token_budget))
    decoding: list[int] = []  # heap: the step at whose start each decoding sequence has finished
    pending = (item if isinstance(item, tuple) else (item, completion_tokens) for item in prompt_lens)
    upcoming, generates = next(pending, (None, 0))
    partial = 0  # prompt tokens still to compute of the one prompt being chunked (0: none)
    partial_generates = 0
    step = 0

    def prompt_done(at: int, tokens: int) -> None:
        if tokens > 1:  # the first token is sampled by the prompt's last chunk
            heapq.heappush(decoding, at + tokens)

    while True:
        while decoding and decoding[0] <= step:
            heapq.heappop(decoding)
        if not partial and (upcoming is None or len(decoding) >= max_seqs):
            if not decoding:
                return est
            skip = decoding[0] - step
            est.steps += skip
            est.decode_steps += skip
            est.decode_step_tokens += skip * len(decoding)
            step += skip
            continue
        running, budget, prefill = len(decoding), token_budget - len(decoding), 0
        if partial:
            chunk = min(partial, budget)
            partial, budget, prefill = partial - chunk, budget - chunk, chunk
            running += 1
            if not partial:
                prompt_done(step, partial_generates)
        while not partial and upcoming is not None and budget > 0 and running < max_seqs:
            chunk = min(upcoming, budget)
            budget, prefill, running = budget - chunk, prefill + chunk, running + 1
            partial, partial_generates = upcoming - chunk, generates
            if not partial:
                prompt_done(step, generates)
            upcoming, generates = next(pending, (None, 0))
        est.steps += 1  # it computes prompt tokens: budget > 0 and a free slot, or a prompt left to chunk
        est.prefill_steps += 1
        est.prompt_tokens += prefill
        step += 1
