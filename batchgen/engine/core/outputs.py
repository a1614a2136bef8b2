"""What the engine returns for each request."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class RequestOutput:
    """The finished result of one request.

    ``finish_reason`` is "stop" (EOS, a stop id or a stop string), "length" (max_tokens or the model's
    context) or "error" (the request alone failed; ``error`` says why). ``grammar_complete`` says, for a
    request with a json_schema/regex/choice constraint, whether its text is a whole match (False when
    max_tokens or a stop string cut it short); None without a constraint.
    """

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[float] | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (device, host or store)
    error: str | None = None
    grammar_complete: bool | None = None
    probs: "list[torch.Tensor] | None" = None  # engine-internal (keep_probs): each token's sampling distribution
