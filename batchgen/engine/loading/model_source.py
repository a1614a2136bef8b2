"""A model resolved to its parts: HF-style config, a weight iterator and a tokenizer."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Union

import torch

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class LazyTensor:
    """A checkpoint tensor read only when loaded: whole, or narrowed first so only a slice is read.

    Wraps a safetensors slice handle; ``narrow`` and ``select`` compose like ``torch.Tensor``'s, so a
    tensor- or expert-parallel rank's weight loader reads just its shard.
    """

    def __init__(self, handle: Any, shape: tuple[int, ...] | None = None,
                 index: tuple[slice, ...] | None = None, dims: tuple[int, ...] | None = None):
        self.handle = handle
        full = tuple(handle.get_shape())
        self.index = index if index is not None else tuple(slice(0, n) for n in full)
        self.shape = torch.Size(shape if shape is not None else full)
        self.dims = dims if dims is not None else tuple(range(len(full)))  # stored dim of each visible dim
        self.dtype = _SAFETENSORS_DTYPES.get(handle.get_dtype())

    def narrow(self, dim: int, start: int, length: int) -> "LazyTensor":
        dim %= len(self.shape)
        if start < 0 or start + length > self.shape[dim]:
            raise IndexError(f"narrow({dim}, {start}, {length}) out of range for shape {tuple(self.shape)}")
        index = list(self.index)
        stored = self.dims[dim]
        index[stored] = slice(index[stored].start + start, index[stored].start + start + length)
        shape = list(self.shape)
        shape[dim] = length
        return type(self)(self.handle, tuple(shape), tuple(index), self.dims)

    def select(self, dim: int, i: int) -> "LazyTensor":
        """Like ``torch.Tensor.select``: index ``i`` of ``dim``, that dimension dropped."""
        dim %= len(self.shape)
        one = self.narrow(dim, i + self.shape[dim] if i < 0 else i, 1)
        shape, dims = list(one.shape), list(one.dims)
        del shape[dim], dims[dim]
        return type(self)(self.handle, tuple(shape), one.index, tuple(dims))

    def load(self) -> torch.Tensor:
        if not self.index:  # a scalar has no slices
            return self.handle[...]
        return self.handle[self.index].reshape(self.shape)

    def __repr__(self) -> str:
        return f"LazyTensor(shape={tuple(self.shape)}, dtype={self.dtype})"


Weight = Union[torch.Tensor, LazyTensor]


def as_tensor(weight: Weight) -> torch.Tensor:
    """The weight's values as a torch tensor (reads a lazy one)."""
    return weight.load() if isinstance(weight, LazyTensor) else weight


@dataclass
class ModelSource:
    """Everything the engine needs from a model folder or a GGUF file.

    ``config`` uses Hugging Face ``config.json`` keys. ``weights()`` yields ``(hf_name, weight)`` pairs with
    Hugging Face parameter names (``model.layers.0.self_attn.q_proj.weight``, ...), in floating point; a
    weight is a tensor or a ``LazyTensor`` (read it with ``as_tensor``, after narrowing to what you need).
    ``generation_config`` holds ``generation_config.json`` keys (eos_token_id, ...), possibly empty.
    """

    config: dict
    weights: Callable[[], Iterator[tuple[str, Weight]]]
    tokenizer: "object"  # batchgen.engine.tokenizer.ModelTokenizer
    generation_config: dict = field(default_factory=dict)
    name: str = ""
    path: str = ""  # the local folder or file it was read from (what worker processes load again)
