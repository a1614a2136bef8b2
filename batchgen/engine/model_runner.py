"""Runs one scheduled step: packs tokens, runs the model, samples the next tokens."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from batchgen.engine.config import EngineConfig, ModelConfig
from batchgen.engine.kv_cache import kv_budget_bytes
from batchgen.engine.layers.attention import AttentionMetadata
from batchgen.engine.layers.ops import default_backend, fused_moe, make_kernel_set
from batchgen.engine.model_source import ModelSource
from batchgen.engine.models.registry import build_model
from batchgen.engine.sampler import SamplingBatch, TokenBitmask, sample
from batchgen.engine.scheduler import ScheduledSeq

if TYPE_CHECKING:
    from batchgen.engine.cuda_graphs import GraphRunner

log = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model weights and the KV cache on one device."""

    def __init__(self, engine: EngineConfig, model_cfg: ModelConfig, source: ModelSource, max_model_len: int):
        self.engine, self.model_cfg = engine, model_cfg
        self.device, self.dtype = engine.torch_device(), engine.torch_dtype
        self.block_size = engine.block_size
        backend = engine.attention_backend or default_backend(self.device)
        self.kernels = make_kernel_set(backend)
        self.model = build_model(model_cfg, self.kernels, max_model_len, self.dtype, self.device)
        self.model.load_weights(source.weights())
        self.profile = self.model.profile()
        self.kv_layout = self.model.kv_layout()
        self.kernels.prepare_model(self.model)  # after the profile: it may replace modules (prepacking)
        self.num_blocks = self._allocate_kv_cache()
        log.info("model %s: %s on %s, attention backend %s; %s", source.name, engine.dtype_choice.name,
                 self.device, self.kernels.attention.name, self.profile.summary())
        self.graphs = self._graph_runner(backend, max_model_len)
        self.padded_tokens = 0  # tokens the last step computed only to fit a CUDA graph's shape

    def _allocate_kv_cache(self) -> int:
        """Sizes the cache from the memory budget, allocates it in the model's layout and binds it."""
        engine = self.engine
        # Peak activations of a full step (the widest MLP/MoE intermediate per token, at 4 bytes) and
        # the float32 logits of every sequence with the sampler's working copies (4 of them).
        reserve = engine.max_num_batched_tokens * self.profile.activation_values_per_token * 4 \
            + engine.max_num_seqs * self.model_cfg.vocab_size * 4 * 4
        per_block = self.kv_layout.bytes_per_block(self.block_size, self.dtype)
        num_blocks = max(1, kv_budget_bytes(engine, self.device, reserve) // per_block)
        self.model.bind_kv_cache(self.kv_layout.allocate(num_blocks, self.block_size, self.dtype, self.device))
        log.info("KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB), %d bytes per token (%s)",
                 num_blocks, self.block_size, num_blocks * self.block_size, num_blocks * per_block / 2**20,
                 self.kv_layout.bytes_per_token(self.dtype), self.kv_layout.describe())
        return num_blocks

    def _graph_runner(self, backend: str, max_model_len: int) -> "GraphRunner | None":
        mode, on_cuda = self.engine.cuda_graphs, self.device.type == "cuda"
        if mode == "off" or (mode == "auto" and not (on_cuda and backend == "triton")):
            return None
        if backend != "triton":
            raise ValueError("cuda_graphs='emulate' needs attention_backend='triton'")
        if mode == "auto" and self.kernels.fused_moe is fused_moe and self.model_cfg.moe is not None:
            log.info("CUDA graphs off: the torch mixture-of-experts path sizes its GEMMs on the host")
            return None
        from batchgen.engine.cuda_graphs import GraphRunner  # imports triton

        with torch.inference_mode():
            return GraphRunner(self.model, self.engine.max_num_seqs, self.engine.max_num_batched_tokens,
                               max_model_len, self.block_size, self.device, capture=mode == "auto")

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def prepare(self, scheduled: list[ScheduledSeq]):
        """Packs the step into flat tensors: no padding between sequences."""
        input_ids: list[int] = []
        query_lens, context_lens, starts, logits_rows = [], [], [], []
        for s in scheduled:
            start = s.seq.num_computed_tokens
            end = start + s.num_new_tokens
            input_ids += s.seq.token_ids[start:end]
            query_lens.append(s.num_new_tokens)
            context_lens.append(end)
            starts.append(start)
            if s.sample:
                logits_rows.append(len(input_ids) - 1)
        max_blocks = max(len(s.seq.block_table) for s in scheduled)
        tables = [s.seq.block_table + [-1] * (max_blocks - len(s.seq.block_table)) for s in scheduled]
        dev = self.device
        q_lens = torch.tensor(query_lens, dtype=torch.int64)
        seq_index = torch.repeat_interleave(torch.arange(len(scheduled)), q_lens)
        cu_q = torch.zeros(len(scheduled) + 1, dtype=torch.int64)
        torch.cumsum(q_lens, 0, out=cu_q[1:])
        positions = torch.arange(len(input_ids)) - cu_q[seq_index] + torch.tensor(starts)[seq_index]
        block_tables = torch.tensor(tables, dtype=torch.int32)
        slots = block_tables[seq_index, positions // self.block_size].long() * self.block_size \
            + positions % self.block_size
        ctx = torch.tensor(context_lens, dtype=torch.int32)
        cu_k = torch.zeros(len(scheduled) + 1, dtype=torch.int32)
        torch.cumsum(ctx, 0, out=cu_k[1:])
        meta = AttentionMetadata(
            cu_seqlens_q=cu_q.to(torch.int32).to(dev), cu_seqlens_k=cu_k.to(dev), context_lens=ctx.to(dev),
            max_seqlen_q=max(query_lens), max_seqlen_k=max(context_lens), slot_mapping=slots.to(dev),
            block_tables=block_tables.to(dev), query_lens=query_lens, context_lens_list=context_lens)
        return (torch.tensor(input_ids, device=dev), positions.to(dev), meta,
                torch.tensor(logits_rows, device=dev, dtype=torch.int64))

    def sampling_batch(self, scheduled: list[ScheduledSeq], bitmask: TokenBitmask | None = None) -> SamplingBatch:
        seqs = [s.seq for s in scheduled if s.sample]
        params = [s.params for s in seqs]
        dev = self.device
        return SamplingBatch(
            temperatures=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev),
            top_ks=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=dev),
            top_ps=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev),
            seeds=torch.tensor([s.seed for s in seqs], dtype=torch.int64, device=dev),
            steps=torch.tensor([s.num_completion_tokens for s in seqs], dtype=torch.int64, device=dev),
            want_logprobs=any(p.logprobs for p in params),
            all_greedy=all(p.temperature == 0 for p in params),
            any_top_k_or_p=any(p.top_k > 0 or p.top_p < 1 for p in params),
            bitmask=bitmask,
        )

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledSeq], bitmask: TokenBitmask | None = None
            ) -> tuple[list[int], list[float] | None]:
        """One forward over the packed step; returns sampled tokens for the rows that sample.

        ``bitmask`` restricts the next token of the sampling rows that have a grammar.
        """
        input_ids, positions, meta, logits_rows = self.prepare(scheduled)
        graph = self.graphs.pick(meta, len(input_ids)) if self.graphs is not None else None
        self.padded_tokens = graph[1] - len(input_ids) if graph is not None else 0
        if graph is not None:
            logits = self.graphs.run(graph, input_ids, positions, meta, logits_rows)
        else:
            logits = self.model(input_ids, positions, meta, logits_rows)
        if len(logits_rows) == 0:  # only non-final prompt chunks this step
            return [], None
        tokens, logprobs = sample(logits, self.sampling_batch(scheduled, bitmask))
        return tokens.tolist(), (logprobs.tolist() if logprobs is not None else None)
