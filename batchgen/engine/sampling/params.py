"""Per-request sampling parameters: the one declaration of every sampling field, its default and its limits."""
from __future__ import annotations

import numbers
import operator
from dataclasses import dataclass, field
from typing import Any

# Bounds of the numeric fields, checked here and turned into the job spec's field constraints.
PARAM_LIMITS: dict[str, dict[str, float]] = {
    "max_tokens": {"ge": 1},
    "temperature": {"ge": 0},
    "top_p": {"gt": 0, "le": 1},
    "top_k": {"ge": -1, "le": 2**31 - 1},  # -1 (vLLM's off) is taken as 0
    "seed": {"ge": -(2**63), "le": 2**63 - 1},  # an int64 on the device
    "presence_penalty": {"ge": -2, "le": 2},  # OpenAI's and vLLM's range
    "frequency_penalty": {"ge": -2, "le": 2},
    "repetition_penalty": {"gt": 0},
    "min_tokens": {"ge": 0},
}
_COMPARE = {"ge": (operator.ge, ">="), "gt": (operator.gt, ">"), "le": (operator.le, "<=")}
CONSTRAINTS = ("json_schema", "regex", "choice")


@dataclass
class SamplingParams:
    """How to sample one request. ``temperature=0`` is greedy; ``top_k=0`` and ``top_p=1`` disable those filters.

    vLLM's spellings of "off" are taken too: ``top_k=-1``, ``stop=None``, ``stop_token_ids=None``,
    ``logprobs=None`` (and ``logprobs=0``, the sampled token's alone).

    ``seed`` makes sampling reproducible per request: the same seed gives the same tokens whether the
    request runs alone or in any batch. ``logprobs=True`` reports the raw log-probability (temperature 1,
    before top-k/top-p and any grammar) of each generated token.

    Penalties, as vLLM applies them to the logits before temperature: ``presence_penalty`` is taken off every
    token the completion already holds, ``frequency_penalty`` times each one's count; ``repetition_penalty``
    divides the positive logits (multiplies the negative ones) of every token in the prompt or the completion.
    ``min_tokens``: the end-of-sequence token, ``stop_token_ids`` and ``stop`` strings cannot end a completion
    before it holds that many tokens (the first two are not sampled meanwhile).

    At most one of ``json_schema`` (a JSON Schema as a mapping or JSON text), ``regex`` and ``choice`` (a
    list of allowed strings) constrains the output; the request then stops when the grammar is complete.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    json_schema: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [] if self.stop is None else self.stop
        self.stop_token_ids = [] if self.stop_token_ids is None else self.stop_token_ids
        if self.top_k == -1:  # vLLM's "off"
            self.top_k = 0
        for name in ("max_tokens", "top_k", "min_tokens") + (("seed",) if self.seed is not None else ()):
            if not _is_int(getattr(self, name)):
                raise ValueError(f"{name} must be an integer{' or None' if name == 'seed' else ''}, "
                                 f"got {getattr(self, name)!r}")
            setattr(self, name, int(getattr(self, name)))  # NumPy's integers too
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), numbers.Real):
                raise ValueError(f"{name} must be a number, got {getattr(self, name)!r}")
            setattr(self, name, float(getattr(self, name)))
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, (list, tuple, set, frozenset)) or not all(
                _is_int(t) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        if self.logprobs is None:  # vLLM's default
            self.logprobs = False
        elif _is_int(self.logprobs) and self.logprobs == 0:  # vLLM's 0: the sampled token's alone
            self.logprobs = True
        if not isinstance(self.logprobs, bool):
            raise ValueError(f"logprobs must be True or False (the sampled token's log-probability; top-N "
                             f"alternatives are not offered), got {self.logprobs!r}")
        for name, limits in PARAM_LIMITS.items():
            value = getattr(self, name)
            for kind, bound in limits.items():
                holds, symbol = _COMPARE[kind]
                if value is not None and not holds(value, bound):
                    raise ValueError(f"{name} must be {symbol} {bound}, got {value}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        given = [name for name in CONSTRAINTS if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"at most one of json_schema, regex, choice may be set, got {', '.join(given)}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("choice must be a non-empty list of non-empty strings")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.min_tokens and given:
            raise ValueError(f"min_tokens does not combine with {given[0]}: the grammar decides where the output ends")

    @property
    def penalized(self) -> bool:
        """Whether a penalty changes the logits: they then depend on the tokens so far."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def constrained(self) -> bool:
        return any(getattr(self, name) is not None for name in CONSTRAINTS)


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
