"""Counters the engine keeps while it runs: tokens and time by step kind, prefix-cache hits."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class EngineMetrics:
    """Prefill steps compute at least one prompt chunk; decode steps compute one token per sequence."""

    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_time_s: float = 0.0
    decode_time_s: float = 0.0
    prompt_tokens_computed: int = 0  # prompt tokens run through the model (cache hits excluded)
    tokens_generated: int = 0
    decode_tokens: int = 0  # tokens computed in decode-only steps
    preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0
    grammar_steps: int = 0  # steps that built a grammar bitmask
    grammar_mask_time_s: float = 0.0  # time spent filling those bitmasks

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "prefix_cache_hit_rate": self.prefix_cache_hit_rate}
