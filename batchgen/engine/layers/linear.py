"""Linear layers and the embedding/LM head, each owning how checkpoint tensors load into its weights.

Every parameter carries ``weight_loader(param, loaded, shard_id=None)``, which copies a checkpoint
tensor (whole, or one shard of a fused projection) into its place, reading only this tensor-parallel
rank's slice. Parameters of fused projections list the ``shard_ids`` a checkpoint must provide. Layers
take their tensor-parallel group as ``tp``; with the default group of one nothing is split and no
collective runs.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.engine.model_source import Weight, as_tensor
from batchgen.engine.parallel.group import SINGLE, CommGroup


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

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp: CommGroup = SINGLE,
                 params_dtype: torch.dtype | None = None, shard_ids: tuple = ()):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.tp = tp
        self.tp_rank, self.tp_size = tp.rank, tp.size
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x.to(self.weight.dtype), self.weight, self.bias if self.tp_rank == 0 else None)
        return self.tp.all_reduce(y)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections in one matmul (gate|up); shard i is ``output_sizes[i]`` rows."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False, tp: CommGroup = SINGLE,
                 params_dtype: torch.dtype | None = None):
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, tp, params_dtype, shard_ids=self.shard_names())

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
                 tp: CommGroup = SINGLE, params_dtype: torch.dtype | None = None):
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp.size, "number of attention heads")
        self.num_kv_heads, self.kv_rank = kv_head_shard(num_kv_heads, tp)
        self.local_sizes = [self.num_heads * head_dim, self.num_kv_heads * head_dim, self.num_kv_heads * head_dim]
        super().__init__(hidden_size, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
                         bias, tp, params_dtype)

    def local_shape(self) -> tuple[int, int]:
        return sum(self.local_sizes), self.input_size

    def shard_names(self) -> tuple:
        return ("q", "k", "v")

    def shard_layout(self, shard_id: Any) -> tuple[int, int, int]:
        q, kv = self.local_sizes[0], self.local_sizes[1]
        return {"q": (0, q, self.tp_rank * q), "k": (q, kv, self.kv_rank * kv),
                "v": (q + kv, kv, self.kv_rank * kv)}[shard_id]


def kv_head_shard(num_kv_heads: int, tp: CommGroup) -> tuple[int, int]:
    """(KV heads on this rank, index of its first KV head in units of that count): the KV heads are
    split over the ranks, or, when there are fewer than ranks, each is replicated on ``tp.size /
    num_kv_heads`` consecutive ranks."""
    if num_kv_heads >= tp.size:
        return divide(num_kv_heads, tp.size, "number of KV heads"), tp.rank
    return 1, tp.rank // divide(tp.size, num_kv_heads, "KV replication")


class VocabParallelEmbedding(nn.Module):
    """Token embeddings with the vocabulary split across ranks (padded to a multiple of tp.size)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: CommGroup = SINGLE):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp, self.tp_rank, self.tp_size = tp, tp.rank, tp.size
        self.rows_per_rank = -(-num_embeddings // tp.size)
        self.vocab_start = min(num_embeddings, tp.rank * self.rows_per_rank)
        self.vocab_end = min(num_embeddings, self.vocab_start + self.rows_per_rank)
        self.weight = new_parameter((self.rows_per_rank, embedding_dim), self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: Weight, shard_id: Any = None) -> None:
        if tuple(loaded.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"shape {tuple(loaded.shape)} does not fit the embedding's "
                             f"{(self.num_embeddings, self.embedding_dim)}")
        rows = self.vocab_end - self.vocab_start
        copy_weight(param.data.narrow(0, 0, rows), loaded.narrow(0, self.vocab_start, rows))
        param.data[rows:].zero_()  # the last rank's padding rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        mine = (ids >= self.vocab_start) & (ids < self.vocab_end)
        out = F.embedding((ids - self.vocab_start) * mine, self.weight) * mine[:, None].to(self.weight.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the vocabulary; each rank computes its vocabulary slice and the first rank, which
    samples, gathers them (the other ranks get their own slice back)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.tp.gather_last_dim(F.linear(x, self.weight))
        return logits[..., : self.num_embeddings]
