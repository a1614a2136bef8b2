"""The kernel interfaces every backend implements: step metadata, (latent) attention backends, the kernel set."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol

import torch
from torch import nn


@dataclass
class AttentionMetadata:
    """Describes one packed step: B sequences, T new tokens in total.

    Sequence i owns new tokens ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` and attends to
    ``context_lens[i]`` keys: its cached prefix followed by its new tokens, so
    ``context_lens[i] - query_len[i]`` tokens are read from the paged cache.
    """

    cu_seqlens_q: torch.Tensor  # int32 (B+1,)
    cu_seqlens_k: torch.Tensor  # int32 (B+1,), prefix sums of context_lens
    context_lens: torch.Tensor  # int32 (B,)
    max_seqlen_q: int
    max_seqlen_k: int
    slot_mapping: torch.Tensor  # int64 (T,): flat cache slot (block * block_size + offset)
    block_tables: torch.Tensor  # int32 (B, max_blocks), padded with -1
    query_lens: list[int]  # host copies, to avoid device syncs in the torch backend
    context_lens_list: list[int]
    # Derived from the lengths unless given: a padded graph step fixes them for every replay.
    decode_only: bool | None = None
    has_cached_prefix: bool | None = None
    prefill_work: torch.Tensor | None = None  # Triton's query-tile list, built by the first layer
    # Triton's decode slots of a mixed step (sequence, query row), built with prefill_work, which then
    # leaves those sequences out; None: the prefill kernel computes every row.
    decode_rows: torch.Tensor | None = None
    memo: dict[str, Any] = field(default_factory=dict)  # per-step data a backend derives once, for every layer

    def __post_init__(self) -> None:
        if self.decode_only is None:
            self.decode_only = self.max_seqlen_q == 1
        if self.has_cached_prefix is None:
            self.has_cached_prefix = any(c != q for c, q in zip(self.context_lens_list, self.query_lens))

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    def row_context_lens(self, seqs: Iterable[int]) -> list[int]:
        """The keys each new token of ``seqs`` attends to, row by row: the j-th of a sequence's n new tokens
        sees its context less the n - 1 - j tokens after it (causal within the step)."""
        return [self.context_lens_list[i] - self.query_lens[i] + 1 + j for i in seqs for j in range(self.query_lens[i])]


class AttentionBackend(Protocol):
    """Stores new K/V into the paged cache and computes causal attention for a packed step.

    Shapes: q (T, Hq, D); k, v (T, Hkv, D); caches (num_blocks, block_size, Hkv, D).
    Hq must be a multiple of Hkv (GQA). Returns (T, Hq, D).

    ``sliding_window``: a query at position p sees only the keys at positions p - sliding_window < j <= p
    (blocks wholly before that may have been freed: a backend must not read them). ``softcap``: the
    scaled scores s become softcap * tanh(s / softcap) before the softmax.
    """

    name: str

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None: ...

    def as_stored(self, k: torch.Tensor, v: torch.Tensor,
                  cache_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """k and v as a cache of ``cache_dtype`` gives them back (:func:`batchgen.engine.dtype.as_stored`)."""
        ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor: ...


@dataclass
class LatentPrefill:
    """The sequences of a step that prefill (more than one new token), packed for the expanded path."""

    tokens: torch.Tensor | None  # rows of their new tokens in the step; None: every row of the step
    context_slots: torch.Tensor  # int64 (sum of context_lens,): cache slot of each context token, packed
    cu_seqlens_q: torch.Tensor  # int32 (n+1,)
    cu_seqlens_k: torch.Tensor  # int32 (n+1,), prefix sums of context_lens
    query_lens: list[int]
    context_lens: list[int]
    memo: dict[str, Any] = field(default_factory=dict)  # per-step data a backend derives once (tile lists)


class MLABackend(Protocol):
    """Stores latent rows and computes the two attention forms of a step.

    Shapes: cache (num_blocks, block_size, R + P); q of decode (B, H, R + P); prefill q (T, H, N + P),
    k_nope (Tk, H, N), v (Tk, H, V), k_pe (Tk, P), all possibly strided views with unit last stride.
    """

    name: str

    def store_latent(self, latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None: ...

    def decode(self, q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
               context_lens: torch.Tensor, max_context: int, value_dim: int, scale: float) -> torch.Tensor:
        """MQA of q over each sequence's cached rows; values are the rows' first value_dim dims."""
        ...

    def prefill(self, q: torch.Tensor, k_nope: torch.Tensor, v: torch.Tensor, k_pe: torch.Tensor,
                plan: LatentPrefill, scale: float) -> torch.Tensor:
        """Causal attention of each sequence's new tokens over its whole context (queries at the end)."""
        ...


def keep_weights(model: nn.Module) -> None:
    """The default ``KernelSet.prepare_model``: weights stay as loaded."""


@dataclass
class KernelSet:
    """The implementations a model calls; torch everywhere, fused C++ on CPU, or Triton kernels on the GPU
    path (:mod:`batchgen.engine.backends.select` builds one). ``prepare_model`` runs once after the weights
    are loaded (e.g. to prepack them).

    Each function has the signature of its torch reference in :mod:`batchgen.engine.backends.torch.ops`, e.g.
    ``fused_moe(x, w13, w2, topk_weights, topk_ids, skip_negative=False)``.
    """

    attention: AttentionBackend
    rms_norm: Callable
    apply_rotary: Callable
    silu_and_mul: Callable
    gelu_tanh_and_mul: Callable
    fused_moe: Callable
    mla: MLABackend  # latent attention
    accept_drafts: Callable  # speculative verification: the tokens each row keeps (see torch.ops.accept_drafts)
    reject_drafts: Callable  # the same with sampled drafts: rejection sampling (see torch.ops.reject_drafts)
    row_argmax: Callable  # each row's first largest value, for sampling (see sampling.sampler.row_argmax)
    prepare_model: Callable[[nn.Module], None] = keep_weights
    # y = x @ dequant(weight)^T (+ bias) with FP8 weights and scales; None: the set has no FP8 GEMM.
    fp8_linear: Callable | None = None
