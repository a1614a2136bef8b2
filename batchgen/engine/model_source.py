"""A model resolved to its parts: HF-style config, a weight iterator and a tokenizer."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch


@dataclass
class ModelSource:
    """Everything the engine needs from a model folder or a GGUF file.

    ``config`` uses Hugging Face ``config.json`` keys. ``weights()`` yields ``(hf_name, tensor)`` pairs with
    Hugging Face parameter names (``model.layers.0.self_attn.q_proj.weight``, ...), in floating point.
    ``generation_config`` holds ``generation_config.json`` keys (eos_token_id, ...), possibly empty.
    """

    config: dict
    weights: Callable[[], Iterator[tuple[str, torch.Tensor]]]
    tokenizer: "object"  # batchgen.engine.tokenizer.Tokenizer
    generation_config: dict = field(default_factory=dict)
    name: str = ""
