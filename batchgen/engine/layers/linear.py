"""Linear layers and the embedding/LM head, each owning how checkpoint tensors load into its weights.

Every parameter carries ``weight_loader(param, loaded, shard_id=None)``, which copies a checkpoint
tensor (whole, or one shard of a fused projection) into its place, reading only this tensor-parallel
rank's slice. Parameters of fused projections list the ``shard_ids`` a checkpoint must provide. Layers
take their tensor-parallel group as ``tp``; with the default group of one nothing is split and no
collective runs.

How a layer holds and multiplies its weight is its ``quant_method``: ``LinearMethod`` (one weight in the
model dtype) unless the model is built inside ``weight_methods(...)`` (see ``engine/quantization``).
A scale parameter says with ``group`` how many weight rows and columns one of its values covers
(None: the whole dimension), and the same loaders slice it: a tensor-parallel or fused shard of a
128x128-blocked weight takes the matching block rows, so its boundaries must fall on multiples of 128.
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.engine.dtype import FP8_DTYPES
from batchgen.engine.loading.model_source import Weight, as_tensor
from batchgen.engine.parallel.group import SINGLE, CommGroup


def check_shape(loaded: Weight, expected: Sequence[int]) -> None:
    """A checkpoint tensor must have the whole (unsplit) shape the parameter stands for."""
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"shape {tuple(loaded.shape)} does not fit the parameter's {tuple(expected)}")


def copy_weight(target: torch.Tensor, loaded: Weight) -> None:
    """Copies ``loaded`` into ``target``; shapes must agree, FP8 values never lose their scale, and integer
    values (a quantized export's) never pass for floats."""
    check_shape(loaded, target.shape)
    if loaded.dtype in FP8_DTYPES and target.dtype not in FP8_DTYPES:
        raise ValueError(f"the checkpoint stores it in {loaded.dtype} but has no scale tensor for it "
                         "(or no quantization_config)")
    if target.dtype.is_floating_point and not (loaded.dtype.is_floating_point or loaded.dtype.is_complex):
        raise ValueError(f"the checkpoint stores it as {loaded.dtype}: integers are a quantized weight's, and "
                         "batchgen reads no integer quantization (is the checkpoint's quantization_config missing?)")
    target.copy_(as_tensor(loaded))


def param_span(param: nn.Parameter, dim: int, start: int, length: int, total: int) -> tuple[int, int]:
    """Weight rows (or columns) [start, start + length) of ``total``, as (start, length) in ``param``'s values.

    A weight's values are its elements; a scale's values cover ``param.group[dim]`` elements each
    (None: one value for the whole dimension), so a shard must start on a group boundary and end on
    one or at the end.
    """
    group = getattr(param, "group", (1, 1))[dim]
    if group is None:
        return 0, 1
    if group == 1:
        return start, length
    if start % group or (length % group and start + length != total):
        raise ValueError(f"a shard of rows/columns {start}..{start + length} of {total} does not align to the "
                         f"{group}-element scale blocks: fused and tensor-parallel shards of block-quantized "
                         f"weights must be multiples of {group}")
    return start // group, -(-length // group)


def shard_span(param: nn.Parameter, start: int, length: int, total: int) -> tuple[int, int]:
    """Like ``param_span`` on dim 0, for the place of a fused shard starting at row ``start`` of this rank's
    ``total`` rows: a block scale kept per shard (``param.shard_starts``: shard start row -> its first scale
    row) gives each shard its own block rows, wherever the shard starts."""
    starts = getattr(param, "shard_starts", None)
    if starts and start in starts:
        return starts[start], param_span(param, 0, 0, length, length)[1]
    return param_span(param, 0, start, length, total)


def param_shape(param: nn.Parameter, weight_shape: Sequence[int]) -> tuple[int, ...]:
    """The shape ``param`` has for a weight (part) of ``weight_shape`` (scales: one value per group)."""
    return tuple(param_span(param, d, 0, n, n)[1] for d, n in enumerate(weight_shape))


def default_weight_loader(param: nn.Parameter, loaded: Weight, shard_id: Any = None) -> None:
    """Loads a whole, unsplit parameter (norms, buffers of plain modules)."""
    if shard_id is not None:
        raise ValueError(f"parameter has no shard {shard_id!r}")
    copy_weight(param.data, loaded)


def divide(size: int, parts: int, what: str) -> int:
    if size % parts:
        raise ValueError(f"{what} {size} is not divisible by the tensor-parallel size {parts}")
    return size // parts


_WEIGHT_METHODS: ContextVar[Any] = ContextVar("weight_methods", default=None)


@contextmanager
def weight_methods(methods: Any) -> Iterator[None]:
    """Layers built inside take their quant methods from ``methods.linear`` / ``methods.moe`` (None: unquantized)."""
    token = _WEIGHT_METHODS.set(methods)
    try:
        yield
    finally:
        _WEIGHT_METHODS.reset(token)


def current_weight_methods() -> Any:
    return _WEIGHT_METHODS.get()


def new_parameter(shape: Sequence[int], loader, dtype: torch.dtype | None = None,
                  shard_ids: tuple = ()) -> nn.Parameter:
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader
    param.shard_ids = shard_ids
    return param


class LinearMethod:
    """An unquantized linear layer: one ``weight`` in the model dtype, multiplied with ``F.linear``."""

    computes_in_fp8 = False

    def create_weights(self, layer: "LinearBase") -> None:
        layer.weight = new_parameter((layer.local_out, layer.local_in), layer.weight_loader, layer.params_dtype,
                                     layer.shard_ids)
        layer.weight.tp_dim = layer.tp_dim

    def apply(self, layer: "LinearBase", x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x.to(layer.weight.dtype), layer.weight, bias)

    def dense_weight(self, layer: "LinearBase") -> torch.Tensor:
        """The weight in the model dtype, for code that reads it directly (e.g. MLA absorbing kv_b_proj)."""
        return layer.weight

    def finish_loading(self, layer: nn.Module) -> None:
        """Runs once every checkpoint tensor is in place."""


UNQUANTIZED = LinearMethod()


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
        self.params_dtype, self.shard_ids = params_dtype or torch.get_default_dtype(), shard_ids
        methods = current_weight_methods()
        self.quant_method: LinearMethod = methods.linear if methods is not None else UNQUANTIZED
        self.quant_method.create_weights(self)
        self.bias = None
        if bias:
            self.bias = new_parameter((self.local_out,), self.weight_loader, self.params_dtype, shard_ids)
            self.bias.tp_dim = 0 if self.tp_dim == 0 else None

    def local_shape(self) -> tuple[int, int]:
        """(output rows, input columns) of this rank's weight."""
        out, inp = self.output_size, self.input_size
        if self.tp_dim == 0:
            out = divide(out, self.tp_size, "output size")
        elif self.tp_dim == 1:
            inp = divide(inp, self.tp_size, "input size")
        return out, inp

    def local_shard_rows(self) -> list[int]:
        """This rank's rows of each fused shard, in order (none: the layer is not fused)."""
        return []

    def shard_size(self, shard_id: Any) -> int:
        """Output rows of the whole (unsplit) weight, or of one of its fused shards."""
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shard {shard_id!r}")
        return self.output_size

    def weight_loader(self, param: nn.Parameter, loaded: Weight, shard_id: Any = None) -> None:
        self.shard_size(shard_id)  # no shards here
        full = (self.output_size, self.input_size)[: param.dim()]  # a bias has output rows only
        check_shape(loaded, param_shape(param, full))
        if param.tp_dim is not None:
            dim = param.tp_dim
            local = (self.local_out, self.local_in)[dim]
            loaded = loaded.narrow(dim, *param_span(param, dim, self.tp_rank * local, local, full[dim]))
        copy_weight(param.data, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


def matmul_params(module: nn.Module, fp8_only: bool = False) -> int:
    """Matmul weights a token passes through in ``module`` (whole layers, all ranks); a module may
    answer itself with ``active_params(fp8_only)`` (a mixture of experts counts only the experts a token
    uses). ``fp8_only``: only the weights multiplied in FP8."""
    own = getattr(module, "active_params", None)
    if callable(own):
        return own(fp8_only)
    if isinstance(module, LinearBase):
        return 0 if fp8_only and not module.quant_method.computes_in_fp8 else module.input_size * module.output_size
    return sum(matmul_params(child, fp8_only) for child in module.children())


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank (routers, small projections)."""


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank returns its slice of y."""

    tp_dim = 0


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial products are summed (all-reduce), the bias added once."""

    tp_dim = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x, self.bias if self.tp_rank == 0 else None)
        return self.tp.all_reduce(y)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections in one matmul (gate|up); shard i is ``output_sizes[i]`` rows."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False, tp: CommGroup = SINGLE,
                 params_dtype: torch.dtype | None = None):
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, tp, params_dtype, shard_ids=self.shard_names())

    def shard_names(self) -> tuple:
        return tuple(range(len(self.output_sizes)))

    def local_shard_rows(self) -> list[int]:
        return [self.shard_layout(s)[1] for s in self.shard_names()]

    def shard_layout(self, shard_id: Any) -> tuple[int, int, int]:
        """(offset in this rank's rows, rows, offset in the checkpoint tensor) of one shard."""
        local = [divide(s, self.tp_size, "output size") for s in self.output_sizes]
        return sum(local[:shard_id]), local[shard_id], self.tp_rank * local[shard_id]

    def shard_size(self, shard_id: Any) -> int:
        if shard_id is None:
            return self.output_size
        if shard_id not in self.shard_names():
            raise ValueError(f"{type(self).__name__} has no shard {shard_id!r}")
        return self.output_sizes[self.shard_names().index(shard_id)]

    def weight_loader(self, param: nn.Parameter, loaded: Weight, shard_id: Any = None) -> None:
        if shard_id is None:  # the checkpoint stores the fused projection: load it shard by shard
            check_shape(loaded, (param_shape(param, (self.output_size,))[0], *param.shape[1:]))
            start = 0
            for sid, size in zip(self.shard_names(), self.output_sizes):
                self.weight_loader(param, loaded.narrow(0, *param_span(param, 0, start, size, self.output_size)), sid)
                start += size
            return
        size = self.shard_size(shard_id)
        check_shape(loaded, (param_shape(param, (size,))[0], *param.shape[1:]))
        offset, rows, source_offset = self.shard_layout(shard_id)
        copy_weight(param.data.narrow(0, *shard_span(param, offset, rows, self.local_out)),
                    loaded.narrow(0, *param_span(param, 0, source_offset, rows, size)))


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
    samples, gathers them (the other ranks get their own slice back). Its ``quant_method`` multiplies, as a
    linear layer's does (a kernel set may give it another)."""

    quant_method: LinearMethod = UNQUANTIZED

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.tp.gather_last_dim(self.quant_method.apply(self, x, None))
        return logits[..., : self.num_embeddings]
