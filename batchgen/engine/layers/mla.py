"""Multi-head latent attention (DeepSeek-V2/V3) over a paged cache of one latent row per token.

A token's keys and values are compressed into a latent c (``kv_lora_rank`` values, RMS-normed) and
one rotary key k_pe that all heads share; the paged cache holds the row ``[c | k_pe]`` (576 values
for DeepSeek-V3) instead of per-head K and V. Head h's keys and values are ``k_nope = W_UK[h] c``
and ``v = W_UV[h] c``, the two halves of ``kv_b_proj``.

Prefill expands: the K/V of each prefilling sequence's cached prefix and new tokens are computed
from their latent rows, then a varlen causal attention runs over them (q/k head dim nope + rope,
v head dim ``v_head_dim``). Decode absorbs: ``q_nope W_UK[h]`` is a query in latent space, so the
attention is MQA directly over the cached rows (one KV head of width ``kv_lora_rank + rope``, values
its first ``kv_lora_rank`` dims), and ``W_UV[h]`` maps the result back per head. A sequence with a few new
tokens (a speculative verification: drafts after the last token) decodes too, row by row, each row over its
context up to itself: expanding its whole context's K/V would cost far more than its few queries.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Sequence

import torch
from torch import nn

from batchgen.engine.backends.interface import AttentionMetadata, KernelSet, LatentPrefill
from batchgen.engine.config import ModelConfig
from batchgen.engine.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, divide
from batchgen.engine.layers.norm import RMSNorm
from batchgen.engine.layers.rotary import pairwise_to_half_order, yarn_softmax_scale
from batchgen.engine.loading.model_source import as_tensor
from batchgen.engine.parallel.group import SINGLE, CommGroup
from batchgen.engine.transfer import to_device

LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm and kv_a_layernorm with the default eps
MAX_ABSORBED_QUERIES = 8  # new tokens of a sequence up to which its rows take the absorbed (decode) path


@dataclass
class LatentDecode:
    """The rows of a mixed step that take the absorbed path: every new token of the sequences with at most
    ``MAX_ABSORBED_QUERIES``, each with its sequence's block table and its own context length."""

    tokens: torch.Tensor  # rows in the step
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    max_context: int


@dataclass
class MLAMetadata(AttentionMetadata):
    """A step's attention metadata with its split into absorbed decodes and expanded prefills."""

    prefill: LatentPrefill | None = None
    decode: LatentDecode | None = None

    @classmethod
    def for_step(cls, meta: AttentionMetadata, block_size: int) -> "MLAMetadata":
        """Plans a step once for every MLA layer; a decode-only step needs no plan."""
        planned = cls(**{f.name: getattr(meta, f.name) for f in fields(meta)})
        if meta.decode_only:
            return planned
        q_lens = meta.query_lens
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        decodes = [i for i, n in enumerate(q_lens) if n <= MAX_ABSORBED_QUERIES]
        prefills = [i for i, n in enumerate(q_lens) if n > MAX_ABSORBED_QUERIES]
        dev = meta.block_tables.device
        if decodes:
            seq_of_row = [i for i in decodes for _ in range(q_lens[i])]
            lens = meta.row_context_lens(decodes)
            planned.decode = LatentDecode(
                to_device([starts[i] + j for i in decodes for j in range(q_lens[i])], dev, torch.int64),
                meta.block_tables[to_device(seq_of_row, dev, torch.int64)], to_device(lens, dev, torch.int32),
                max(lens))
        if prefills:
            planned.prefill = _plan_prefill(meta, prefills, starts, block_size, whole_step=not decodes)
        return planned


def _plan_prefill(meta: AttentionMetadata, seqs: list[int], starts: list[int], block_size: int,
                  whole_step: bool) -> LatentPrefill:
    dev = meta.block_tables.device
    q_lens = [meta.query_lens[i] for i in seqs]
    ctx_lens = [meta.context_lens_list[i] for i in seqs]
    tokens = None if whole_step else to_device(torch.cat([torch.arange(starts[i], starts[i + 1]) for i in seqs]), dev)
    cu_q, cu_k = (to_device(torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32), dev)
                  for lens in (q_lens, ctx_lens))
    total = sum(ctx_lens)
    seq = torch.repeat_interleave(torch.arange(len(seqs), device=dev), to_device(ctx_lens, dev, torch.int64),
                                  output_size=total)
    pos = torch.arange(total, device=dev) - cu_k[seq]
    tables = meta.block_tables[to_device(seqs, dev, torch.int64)]
    slots = tables[seq, pos // block_size].long() * block_size + pos % block_size
    return LatentPrefill(tokens, slots, cu_q, cu_k, q_lens, ctx_lens)


def _reorder_rows_on_load(param: nn.Parameter, order: torch.Tensor) -> None:
    """Checkpoint rows are permuted by ``order`` before the parameter's own loader takes them.

    A scale parameter of an FP8 weight follows: per-row scales are permuted alike; a per-tensor one
    needs nothing; 128-row block scales need nothing when the permutation keeps every row in its block
    (DeepSeek's rope rows, 64 aligned, do), and cannot be loaded otherwise.
    """
    group = getattr(param, "group", (1, 1))[0]
    if group is None:
        return
    if group > 1:
        rows = torch.arange(order.numel(), device=order.device)  # not the model's device (meta, when shaping)
        if not torch.equal(order // group, rows // group):
            raise ValueError(f"the rotary rows of this latent attention cross the {group}-row blocks of its FP8 "
                             "weight scales; such a checkpoint cannot be loaded")
        return
    load = param.weight_loader

    def loader(p: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        tensor = as_tensor(loaded)
        if tensor.dim() == 0 or (tensor.numel() == 1 and hasattr(p, "group")):  # a per-tensor scale
            return load(p, tensor, shard_id)
        if tensor.shape[0] != order.numel():
            raise ValueError(f"shape {tuple(tensor.shape)} does not fit the parameter's {order.numel()} rows")
        load(p, tensor[order], shard_id)

    param.weight_loader = loader


class AbsorbedProducts(nn.Module):
    """The absorbed decode's two products a head, over W_UK and W_UV (views of kv_b_proj's weight) by torch's
    bmm. A kernel set may give a layer its own (:func:`batchgen.engine.backends.cpu.prepack.prepack_absorbed`),
    a submodule whose repacked weights are buffers: the model's tensors like any other."""

    def query(self, layer: "MLAAttention", q_nope: torch.Tensor) -> torch.Tensor:
        """``q_nope W_UK[h]`` for each head h: (B, H, nope) -> (B, H, kv_lora_rank)."""
        return torch.bmm(q_nope.transpose(0, 1), layer.w_uk).transpose(0, 1)

    def values(self, layer: "MLAAttention", out: torch.Tensor) -> torch.Tensor:
        """``W_UV[h] out`` for each head h: (B, H, kv_lora_rank) -> (B, H, v_dim)."""
        # W_UV @ out^T per head, then back: bmm takes W_UV as it lies, where out @ W_UV^T had CPU's bmm copy the
        # transposed weight each call (1 ms a layer at 32 heads).
        return torch.bmm(layer.w_uv, out.permute(1, 2, 0)).permute(2, 0, 1)


BMM_PRODUCTS = AbsorbedProducts()


class MLAAttention(nn.Module):
    """The projections of DeepSeek's attention around the latent cache; names follow the checkpoints.

    ``pairwise_rope``: the checkpoint rotates adjacent pairs (DeepSeek's complex rope); its rotary
    rows are reordered at load so the rotate-half kernels apply. Under tensor parallelism each rank holds
    its heads' rows of q_b_proj (or q_proj) and kv_b_proj and their columns of o_proj; the latent
    projections, and so the cached latent rows, are whole on every rank.
    """

    def __init__(self, cfg: ModelConfig, kernels: KernelSet, pairwise_rope: bool, tp: CommGroup = SINGLE):
        super().__init__()
        mla, hidden, heads, bias = cfg.mla, cfg.hidden_size, cfg.num_heads, cfg.attention_bias
        self.total_heads, self.num_heads = heads, divide(heads, tp.size, "attention heads")
        self.kv_lora_rank = mla.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.qk_dim = self.nope_dim + self.rope_dim
        self.q_lora_rank = mla.q_lora_rank
        if mla.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, heads * self.qk_dim, tp=tp)
        else:
            self.q_a_proj = ReplicatedLinear(hidden, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS, kernels)
            self.q_b_proj = ColumnParallelLinear(mla.q_lora_rank, heads * self.qk_dim, tp=tp)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, mla.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS, kernels)
        self.kv_b_proj = ColumnParallelLinear(mla.kv_lora_rank, heads * (self.nope_dim + self.v_dim), tp=tp)
        # W_UK (H, nope, R) and W_UV (H, v, R) for the absorbed decode: views of kv_b_proj's weight, which
        # loads in place; they stay valid when a kernel set swaps kv_b_proj for a repacked layer.
        self.register_buffer("w_uk", None, persistent=False)
        self.register_buffer("w_uv", None, persistent=False)
        self._bind_absorbed_weights(self.kv_b_proj.weight)
        self.absorbed: AbsorbedProducts = BMM_PRODUCTS
        self.o_proj = RowParallelLinear(heads * self.v_dim, hidden, bias=bias, tp=tp)
        self.scale = self.qk_dim ** -0.5 * yarn_softmax_scale(cfg.rope_scaling)
        self.kernels, self.backend = kernels, kernels.mla
        self.cache: torch.Tensor | None = None
        if pairwise_rope:
            self._reorder_rotary_rows()

    def _reorder_rotary_rows(self) -> None:
        with torch.device("cpu"):  # indices into checkpoint tensors, whatever device the model is built on
            half_order = pairwise_to_half_order(self.rope_dim)
            head = torch.cat((torch.arange(self.nope_dim), self.nope_dim + half_order))
            q_rows = (torch.arange(self.total_heads)[:, None] * self.qk_dim + head).flatten()  # checkpoint rows
            latent = torch.cat((torch.arange(self.kv_lora_rank), self.kv_lora_rank + half_order))
        q_proj = self.q_proj if self.q_lora_rank is None else self.q_b_proj
        for param in (q_proj.weight, getattr(q_proj, "weight_scale", None)):
            if param is not None:
                _reorder_rows_on_load(param, q_rows)
        kv_a = self.kv_a_proj_with_mqa
        for param in (kv_a.weight, kv_a.bias, getattr(kv_a, "weight_scale", None)):
            if param is not None:
                _reorder_rows_on_load(param, latent)

    def after_loading(self) -> None:
        """W_UK and W_UV from kv_b_proj's weight as loaded: still views of it when it is in the model dtype,
        a dequantized copy when it stays FP8 (or was dequantized into a new tensor)."""
        self._bind_absorbed_weights(self.kv_b_proj.quant_method.dense_weight(self.kv_b_proj))

    def _bind_absorbed_weights(self, weight: torch.Tensor) -> None:
        w = weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        self.w_uk, self.w_uv = w[:, : self.nope_dim], w[:, self.nope_dim:]

    # ---- the paged-cache layer interface -----------------------------------------------------------
    def cache_token_shapes(self) -> tuple[tuple[int, ...], ...]:
        return ((self.kv_lora_rank + self.rope_dim,),)

    def bind_cache(self, tensors: Sequence[torch.Tensor]) -> None:
        (self.cache,) = tensors

    def flops_per_key(self) -> int:
        # The model's attention as written (QK^T over nope + rope dims, PV over v dims), whichever form runs.
        return 2 * self.num_heads * (self.qk_dim + self.v_dim)

    def activation_values_per_token(self) -> int:
        return self.num_heads * (self.nope_dim + self.v_dim + self.qk_dim)  # expanded K/V, plus K with k_pe

    # ---- the decoder layer's interface -------------------------------------------------------------
    @property
    def project_width(self) -> int:
        return self.num_heads * self.qk_dim + self.kv_lora_rank + self.rope_dim

    def project(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        """Rows ``[q (heads x (nope + rope)) | normed latent | k_pe]``, q_pe and k_pe rotated."""
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        latent = self.kv_a_proj_with_mqa(x)
        latent[:, : self.kv_lora_rank] = self.kv_a_layernorm(latent[:, : self.kv_lora_rank])
        q_pe = q.view(-1, self.num_heads, self.qk_dim)[..., self.nope_dim:]
        self.kernels.apply_rotary(q_pe, latent[:, None, self.kv_lora_rank:], positions, cos_sin)
        return torch.cat((q, latent), dim=-1)

    def attend(self, rows: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        assert self.cache is not None, "latent cache not bound"
        q_width = self.num_heads * self.qk_dim
        q = rows[:, :q_width].view(-1, self.num_heads, self.qk_dim)
        self.backend.store_latent(rows[:, q_width:], self.cache, meta.slot_mapping)
        if meta.decode_only:
            return self.decode(q, meta.block_tables, meta.context_lens, meta.max_seqlen_k).flatten(1)
        assert isinstance(meta, MLAMetadata), "a prefill step needs MLAMetadata.for_step"
        pre, dec = meta.prefill, meta.decode
        if dec is None:
            return self.prefill(q, pre).flatten(1)
        out = q.new_empty(q.shape[0], self.num_heads, self.v_dim)
        out[dec.tokens] = self.decode(q[dec.tokens], dec.block_tables, dec.context_lens, dec.max_context)
        if pre is not None:
            out[pre.tokens] = self.prefill(q[pre.tokens], pre)
        return out.flatten(1)

    # ---- the two forms ------------------------------------------------------------------------------
    def decode(self, q: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
               max_context: int) -> torch.Tensor:
        """Absorbed attention of one new token per sequence, (B, H, v_dim)."""
        q_nope, q_pe = q[..., : self.nope_dim], q[..., self.nope_dim:]
        q_latent = self.absorbed.query(self, q_nope)  # (B, H, R)
        out = self.backend.decode(torch.cat((q_latent, q_pe), dim=-1), self.cache, block_tables, context_lens,
                                  max_context, self.kv_lora_rank, self.scale)
        return self.absorbed.values(self, out)

    def prefill(self, q: torch.Tensor, plan: LatentPrefill) -> torch.Tensor:
        """Expanded attention of the prefilling sequences' new tokens, (T, H, v_dim)."""
        rows = self.cache.view(-1, self.cache.shape[-1])[plan.context_slots].to(q.dtype)
        kv = self.kv_b_proj(rows[:, : self.kv_lora_rank]).view(-1, self.num_heads, self.nope_dim + self.v_dim)
        return self.backend.prefill(q, kv[..., : self.nope_dim], kv[..., self.nope_dim:],
                                    rows[:, self.kv_lora_rank:], plan, self.scale)
