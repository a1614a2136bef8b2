"""Linear layers and the embedding/LM head, each owning how checkpoint tensors load into its weights.

Every parameter carries ``weight_loader(param, loaded, shard_id=None)``, which copies a checkpoint
tensor (whole, or one shard of a fused projection) into its place, reading only this tensor-parallel
rank's slice. Parameters of fused projections list the ``shard_ids`` a checkpoint must provide. With
the default ``tp_rank=0, tp_size=1`` nothing is split and no collective runs.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from batchgen.engine.model_source import Weight, as_tensor


def check_shape(loaded: Weight, expected: Sequence[int]) -> None:
    """A checkpoint tensor must have the whole (unsplit) shape the parameter stands for."""
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"shape {tuple(loaded.shape)} does not fit the parameter's {tuple(expected)}")


def copy_weight(target: torch.Tensor, loaded: Weight) -> None:
    """Copies ``loaded`` into ``target``; shapes must agree."""
    check_shape(loaded, target.shape)
    target.copy_(as_tensor(loaded))


def default_weight_loader(param: nn.Parameter, loaded: Weight, shard_id: Any = None) -> None:
    """Loads a whole, unsplit parameter (norms, buffers of plain modules)."""
    if shard_id is not None:
        raise ValueError(f"parameter has no shard {shard_id!r}")
    copy_weight(param.data, loaded)


def divide(size: int, parts: int, what: str) -> int:
    if size % parts:
        raise ValueError(f"{what} {size} is not divisible by the tensor-parallel size {parts}")
    return size // parts


def new_parameter(shape: Sequence[int], loader, dtype: torch.dtype | None = None,
                  shard_ids: tuple = ()) -> nn.Parameter:
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader
    param.shard_ids = shard_ids
    return param


class LinearBase(nn.Module):
    """``y = x W^T (+ b)`` with W split along ``tp_dim`` (0: output rows, 1: input columns, None: whole)."""

    tp_dim: int | None = None

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp_rank: int = 0,
                 tp_size: int = 1, params_dtype: torch.dtype | None = None, shard_ids: tuple = ()):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.local_out, self.local_in = self.local_shape()
        self.weight = new_parameter((self.local_out, self.local_in), self.weight_loader, params_dtype, shard_ids)
        self.weight.tp_dim = self.tp_dim
        self.bias = None
        if bias:
            self.bias = new_parameter((self.local_out,), self.weight_loader, params_dtype, shard_ids)
            self.bias.tp_dim = 0 if self.tp_dim == 0 else None

    def local_shape(self) -> tuple[int, int]:
        """(output rows, input columns) of this rank's weight."""
        out, inp = self.output_size, self.input_size
        if self.tp_dim == 0:
            out = divide(out, self.tp_size, "output size")
        elif self.tp_dim == 1:
            inp = divide(inp, self.tp_size, "input size")
        return out, inp

    def weight_loader(self, param: nn.Parameter, loaded: Weight, shard_id: Any = None) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shard {shard_id!r}")
        if param.tp_dim is not None:
            size = param.shape[param.tp_dim]
            full = list(param.shape)
            full[param.tp_dim] *= self.tp_size
            check_shape(loaded, full)
            loaded = loaded.narrow(param.tp_dim, self.tp_rank * size, size)
        copy_weight(param.data, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias)


def matmul_params(module: nn.Module) -> int:
    """Matmul weights a token passes through in ``module`` (whole layers, all ranks); a module may
    answer itself with ``active_params()`` (a mixture of experts counts only the experts a token uses)."""
    own = getattr(module, "active_params", None)
    if callable(own):
        return own()
    if isinstance(module, LinearBase):
        return module.input_size * module.output_size
    return sum(matmul_params(child) for child in module.children())


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank (routers, small projections)."""


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank returns its slice of y."""

    tp_dim = 0


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial products are summed (all-reduce), the bias added once."""

    tp_dim = 1

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp_rank: int = 0,
                 tp_size: int = 1, params_dtype: torch.dtype | None = None, tp_group: Any = None):
        super().__init__(input_size, output_size, bias, tp_rank, tp_size, params_dtype)
        self.tp_group = tp_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x.to(self.weight.dtype), self.weight, self.bias if self.tp_rank == 0 else None)
        if self.tp_size > 1:
            dist.all_reduce(y, group=self.tp_group)
        return y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections in one matmul (gate|up); shard i is ``output_sizes[i]`` rows."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False, tp_rank: int = 0,
                 tp_size: int = 1, params_dtype: torch.dtype | None = None):
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, tp_rank, tp_size, params_dtype,
                         shard_ids=self.shard_names())

    def shard_names(self) -> tuple:
        return tuple(range(len(self.output_sizes)))

    def shard_layout(self, shard_id: Any) -> tuple[int, int, int]:
        """(offset in this rank's rows, rows, offset in the checkpoint tensor) of one shard."""
        local = [divide(s, self.tp_size, "output size") for s in self.output_sizes]
        return sum(local[:shard_id]), local[shard_id], self.tp_rank * local[shard_id]

    def weight_loader(self, param: nn.Parameter, loaded: Weight, shard_id: Any = None) -> None:
        if shard_id is None:  # the checkpoint stores the fused projection: load it shard by shard
            check_shape(loaded, (self.output_size, *param.shape[1:]))
            start = 0
            for sid, size in zip(self.shard_names(), self.output_sizes):
                self.weight_loader(param, loaded.narrow(0, start, size), sid)
                start += size
            return
        if shard_id not in self.shard_names():
            raise ValueError(f"{type(self).__name__} has no shard {shard_id!r}")
        check_shape(loaded, (self.output_sizes[self.shard_names().index(shard_id)], *param.shape[1:]))
        offset, rows, source_offset = self.shard_layout(shard_id)
        copy_weight(param.data.narrow(0, offset, rows), loaded.narrow(0, source_offset, rows))


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v projections in one matmul; heads split across ranks, KV heads replicated when fewer than ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1, params_dtype: torch.dtype | None = None):
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp_size, "number of attention heads")
        if num_kv_heads >= tp_size:
            self.num_kv_heads, self.kv_rank = divide(num_kv_heads, tp_size, "number of KV heads"), tp_rank
        else:  # each KV head serves tp_size / num_kv_heads ranks
            self.num_kv_heads, self.kv_rank = 1, tp_rank // divide(tp_size, num_kv_heads, "KV replication")
        self.local_sizes = [self.num_heads * head_dim, self.num_kv_heads * head_dim, self.num_kv_heads * head_dim]
        super().__init__(hidden_size, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
                         bias, tp_rank, tp_size, params_dtype)

    def local_shape(self) -> tuple[int, int]:
        return sum(self.local_sizes), self.input_size

    def shard_names(self) -> tuple:
        return ("q", "k", "v")

    def shard_layout(self, shard_id: Any) -> tuple[int, int, int]:
        q, kv = self.local_sizes[0], self.local_sizes[1]
        return {"q": (0, q, self.tp_rank * q), "k": (q, kv, self.kv_rank * kv),
                "v": (q + kv, kv, self.kv_rank * kv)}[shard_id]


class VocabParallelEmbedding(nn.Module):
    """Token embeddings with the vocabulary split across ranks (padded to a multiple of tp_size)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_rank: int = 0, tp_size: int = 1,
                 tp_group: Any = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp_rank, self.tp_size, self.tp_group = tp_rank, tp_size, tp_group
        self.rows_per_rank = -(-num_embeddings // tp_size)
        self.vocab_start = tp_rank * self.rows_per_rank
        self.vocab_end = min(num_embeddings, self.vocab_start + self.rows_per_rank)
        self.weight = new_parameter((self.rows_per_rank, embedding_dim), self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: Weight, shard_id: Any = None) -> None:
        if tuple(loaded.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"shape {tuple(loaded.shape)} does not fit the embedding's "
                             f"{(self.num_embeddings, self.embedding_dim)}")
        rows = self.vocab_end - self.vocab_start
        copy_weight(param.data.narrow(0, 0, rows), loaded.narrow(0, self.vocab_start, rows))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        mine = (ids >= self.vocab_start) & (ids < self.vocab_end)
        out = F.embedding((ids - self.vocab_start) * mine, self.weight) * mine[:, None].to(self.weight.dtype)
        dist.all_reduce(out, group=self.tp_group)
        return out


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the vocabulary; each rank computes its vocabulary slice and they are gathered."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.weight)
        if self.tp_size > 1:
            parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
            dist.all_gather(parts, logits, group=self.tp_group)
            logits = torch.cat(parts, dim=-1)
        return logits[..., : self.num_embeddings]
