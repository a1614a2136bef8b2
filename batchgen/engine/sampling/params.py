"""Per-request sampling parameters: the one declaration of every sampling field, its default and its limits."""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

# Bounds of the numeric fields, checked here and turned into the job spec's field constraints.
PARAM_LIMITS: dict[str, dict[str, float]] = {
    "max_tokens": {"ge": 1},
    "temperature": {"ge": 0},
    "top_p": {"gt": 0, "le": 1},
    "top_k": {"ge": 0},
    "seed": {"ge": -(2**63), "le": 2**63 - 1},  # an int64 on the device
}
_COMPARE = {"ge": (operator.ge, ">="), "gt": (operator.gt, ">"), "le": (operator.le, "<=")}
CONSTRAINTS = ("json_schema", "regex", "choice")


@dataclass
class SamplingParams:
    """How to sample one request. ``temperature=0`` is greedy; ``top_k=0`` and ``top_p=1`` disable those filters.

    ``seed`` makes sampling reproducible per request: the same seed gives the same tokens whether the
    request runs alone or in any batch. ``logprobs=True`` reports the raw log-probability (temperature 1,
    before top-k/top-p and any grammar) of each generated token.

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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
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

    @property
    def constrained(self) -> bool:
        return any(getattr(self, name) is not None for name in CONSTRAINTS)
