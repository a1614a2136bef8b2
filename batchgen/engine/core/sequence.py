"""A request's state inside the engine: its tokens, KV blocks and progress."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto
from typing import TYPE_CHECKING

from batchgen.engine.sampling.params import SamplingParams

if TYPE_CHECKING:
    import torch

    from batchgen.engine.sampling.structured import GrammarState


def placeholder(row: int) -> int:
    """Stands in for the token that sampling row ``row`` of the step in flight has not returned yet."""
    return -1 - row


def placeholder_row(token: int) -> int | None:
    """The sampling row a placeholder token stands for; None for a real token."""
    return -1 - token if token < 0 else None


class SequenceStatus(Enum):
    WAITING_FOR_GRAMMAR = auto()  # queued until its grammar has compiled
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass
class Sequence:
    """Tokens are the prompt followed by generated tokens; ``num_computed_tokens`` have KV in the cache
    (or are being computed by the step in flight).

    With overlapped scheduling the last token may be a placeholder (see :func:`placeholder`) for the token
    the step in flight samples: the next step is scheduled around it, and the device fills it in.
    """

    seq_id: int
    token_ids: list[int]
    params: SamplingParams
    seed: int
    num_prompt_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_hashed_blocks: int = 0  # leading blocks registered in the prefix cache
    num_released_blocks: int = 0  # leading blocks freed once out of every layer's sliding window
    full_blocks: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)  # (chained hash, tokens)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_preemptions: int = 0
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    grammar: GrammarState | None = None  # the output constraint's matcher, when the request has one
    # An engine-internal request option (a draft model's sampled drafts): the distribution each completion
    # token was sampled from, (vocab,) float32 rows on the device; None when the request does not keep them.
    probs: list[torch.Tensor] | None = None
    # Engine-internal too (a draft model's coupled drafts): the output index its sampling noise starts from, so
    # that completion token j draws the noise of index noise_offset + j (the target's at that position).
    noise_offset: int = 0

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids are known: all but a trailing placeholder for a token still in flight."""
        return self.num_tokens - (self.token_ids[-1] < 0)

    def reached_length(self, max_model_len: int) -> bool:
        """Whether the sequence has all the tokens its max_tokens, or the context, allow."""
        return self.num_completion_tokens >= self.params.max_tokens or self.num_tokens >= max_model_len

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED
