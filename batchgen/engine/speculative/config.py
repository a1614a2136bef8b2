"""``speculative_config``: which proposer drafts tokens for the target to verify, and its settings (vLLM's keys)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from batchgen.engine.speculative.suffix import SuffixOptions

BUILT_METHODS = ("ngram", "suffix", "draft_model", "mtp")
NGRAM_KEYS = ("prompt_lookup_min", "prompt_lookup_max")
DRAFT_MODEL_KEYS = ("model", "draft_sampling")  # the draft: a folder, GGUF file or built-in name; how it drafts
DRAFT_SAMPLING = ("coupled", "probabilistic", "greedy")  # draft_model's "draft_sampling", the default first
PLANNED_METHODS = ("eagle", "eagle3", "medusa")
OWN_KEYS = {"ngram": "num_speculative_tokens, prompt_lookup_min, prompt_lookup_max",
            "mtp": "num_speculative_tokens"}  # methods that take no options: all their keys
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """The parsed ``speculative_config`` dict.

    ``num_speculative_tokens`` is the most draft tokens one sequence verifies in a step; the cost model picks
    0 .. that many per sequence and step. ``prompt_lookup_min`` / ``prompt_lookup_max`` bound the n-gram the
    ``ngram`` method matches. The ``suffix`` method's own keys (``options``: max_tree_depth, max_spec_factor,
    max_spec_offset, min_token_prob, max_cached_tokens, max_cached_nodes, cache_prompts) go to its proposer;
    the ``draft_model`` method's ``model`` (the draft's folder, GGUF file or built-in name) and ``draft_sampling``
    (``"probabilistic"``, the default: rows with temperature > 0 sample their drafts and verify them by rejection
    sampling; ``"greedy"``: argmax drafts for every row) are in ``options`` too.
    ``mtp`` (a DeepSeek-V3-style checkpoint's multi-token-prediction layer) takes only ``num_speculative_tokens``.
    """

    method: str
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, config: dict[str, Any] | None) -> "SpeculativeConfig | None":
        """None for an empty dict (speculation off); a clear ValueError for anything this engine cannot run."""
        if not config:
            return None
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a mapping, got {type(config).__name__}")
        options = dict(config)
        method = options.pop("method", None)
        if method is None:
            raise ValueError(f"speculative_config needs a 'method': one of {', '.join(BUILT_METHODS)}")
        if method in PLANNED_METHODS:
            raise ValueError(f"speculative_config method {method!r} is not supported yet; "
                             f"supported: {', '.join(BUILT_METHODS)}")
        if method not in BUILT_METHODS:
            raise ValueError(f"unknown speculative_config method {method!r}; supported: {', '.join(BUILT_METHODS)}")
        ints = {f.name: options.pop(f.name) for f in fields(cls) if f.type in (int, "int") and f.name in options}
        for key, value in ints.items():
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"speculative_config {key!r} must be an integer, got {value!r}")
        if method in OWN_KEYS and options:
            raise ValueError(f"unknown speculative_config key(s) for method {method!r}: "
                             f"{', '.join(map(repr, sorted(options)))}; known: {OWN_KEYS[method]}")
        misplaced = sorted(set(ints) & set(NGRAM_KEYS)) if method != "ngram" else []
        if misplaced:
            raise ValueError(f"speculative_config {', '.join(map(repr, misplaced))}: keys of method 'ngram', "
                             f"not {method!r}")
        if method == "suffix":
            SuffixOptions.parse(options)  # its own keys, refused here if unknown
        if method == "draft_model":
            _check_draft_model_options(options)
        parsed = cls(method=method, options=options, **ints)
        parsed._check()
        return parsed

    def _check(self) -> None:
        k = self.num_speculative_tokens
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config num_speculative_tokens must be 1..{MAX_SPECULATIVE_TOKENS}, got {k}")
        if self.prompt_lookup_min < 1:
            raise ValueError(f"speculative_config prompt_lookup_min must be >= 1, got {self.prompt_lookup_min}")
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(f"speculative_config prompt_lookup_max ({self.prompt_lookup_max}) must be >= "
                             f"prompt_lookup_min ({self.prompt_lookup_min})")


def _check_draft_model_options(options: dict[str, Any]) -> None:
    unknown = sorted(set(options) - set(DRAFT_MODEL_KEYS))
    if unknown:
        raise ValueError(f"unknown speculative_config key(s) for method 'draft_model': "
                         f"{', '.join(map(repr, unknown))}; known: num_speculative_tokens, "
                         f"{', '.join(DRAFT_MODEL_KEYS)}")
    model = options.get("model")
    if not isinstance(model, str) or not model.strip():
        raise ValueError("speculative_config method 'draft_model' needs 'model': the path or built-in name of a "
                         f"small model with the target's tokenizer, got {model!r}")
    sampling = options.get("draft_sampling", DRAFT_SAMPLING[0])
    if sampling not in DRAFT_SAMPLING:
        raise ValueError(f"speculative_config 'draft_sampling' must be one of {', '.join(map(repr, DRAFT_SAMPLING))}, "
                         f"got {sampling!r}")
