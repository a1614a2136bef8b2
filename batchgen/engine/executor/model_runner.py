"""Runs one step on one rank: builds tensors from a StepInput, runs the model, samples the next tokens."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from batchgen.engine.backends.cpu.memory import keep_freed_memory, weights_on_huge_pages
from batchgen.engine.backends.interface import AttentionMetadata
from batchgen.engine.backends.select import backend_for, make_kernel_set
from batchgen.engine.backends.torch.ops import fused_moe
from batchgen.engine.config import EngineConfig, ModelConfig
from batchgen.engine.core.kv_cache import kv_budget_bytes
from batchgen.engine.dtype import check_kv_cache_dtype
from batchgen.engine.executor.cpu_replays import DecodeReplays
from batchgen.engine.executor.step import StepInput, StepOutput
from batchgen.engine.kv_store.block_io import gather_blocks, scatter_blocks
from batchgen.engine.loading.model_source import ModelSource
from batchgen.engine.models.registry import build_model
from batchgen.engine.parallel.balancer import EplbConfig, ExpertBalancer, with_load_balancing
from batchgen.engine.parallel.context import SINGLE_PROCESS, ParallelContext
from batchgen.engine.quantization import choose_weight_methods, load_checkpoint
from batchgen.engine.sampling.sampler import sample_rows
from batchgen.engine.speculative.config import SpeculativeConfig
from batchgen.engine.speculative.verify import AcceptedTokens, expand_sampling, verified_rows, verify
from batchgen.engine.transfer import to_device

if TYPE_CHECKING:
    from batchgen.engine.executor.cuda_graphs import GraphRunner

log = logging.getLogger(__name__)


class ModelRunner:
    """Owns this rank's share of the model weights and its KV cache on one device.

    Built in two stages: the weights load first and ``kv_blocks_available`` says how many KV blocks the
    memory budget leaves; the executor then calls ``allocate_kv_cache`` with the number every rank can
    hold (the minimum over ranks).
    """

    def __init__(self, engine: EngineConfig, model_cfg: ModelConfig, source: ModelSource, max_model_len: int,
                 parallel: ParallelContext = SINGLE_PROCESS, device: torch.device | None = None):
        parallel = with_load_balancing(parallel, engine.enable_eplb, engine.eplb_config)
        self.engine, self.model_cfg, self.parallel = engine, model_cfg, parallel
        self.device, self.dtype = device or engine.torch_device(), engine.torch_dtype
        self.kv_dtype = engine.kv_torch_dtype
        check_kv_cache_dtype(self.kv_dtype, self.device)
        self.block_size, self.max_model_len = engine.block_size, max_model_len
        if self.device.type == "cpu":
            keep_freed_memory()
        self.backend = backend_for(engine.attention_backend, self.device)
        self.kernels = make_kernel_set(self.backend)
        spec = SpeculativeConfig.from_dict(engine.speculative_config)
        self.model = build_model(model_cfg, self.kernels, max_model_len, self.dtype, self.device, parallel,
                                 self.weight_methods(), mtp=spec is not None and spec.method == "mtp")
        load_checkpoint(self.model, source.weights)
        self.profile = self.model.profile()
        self.kv_layout = self.model.kv_layout()
        self.balancer = ExpertBalancer(self.model, parallel, EplbConfig.from_dict(engine.eplb_config),
                                       self.profile.active_params) if parallel.balance_experts else None
        self.kernels.prepare_model(self.model)  # after the profile: it may replace modules (prepacking)
        if self.device.type == "cpu":
            weights_on_huge_pages(self.model)  # before anything (a recorded step) holds views of the weights
        log.info("model %s: %s on %s, attention backend %s; %s; weights %s", source.name, engine.dtype_choice.name,
                 self.device, self.kernels.attention.name, self.profile.summary(), self.profile.weight_format)
        self.num_blocks = 0
        self.kv_cache: list[list[torch.Tensor]] = []
        self.graphs: GraphRunner | DecodeReplays | None = None
        self.samples = parallel.tp.is_first  # the first tensor-parallel rank gathers the logits and samples
        self._last_tokens: torch.Tensor | None = None  # the latest step's sampled tokens, on the device

    def weight_methods(self):
        """How the layers hold a quantized checkpoint's weights on this device (None: unquantized)."""
        return choose_weight_methods(self.model_cfg.quantization, self.kernels, self.device, self.dtype,
                                     self.engine.fp8_weights)

    def kv_blocks_available(self) -> int:
        """KV blocks the memory budget leaves on this rank's device."""
        engine = self.engine
        # Peak activations of a full step (the widest MLP/MoE intermediate per token, at 4 bytes) and
        # the float32 logits of every sequence with the sampler's working copies (4 of them).
        reserve = engine.max_num_batched_tokens * self.profile.activation_values_per_token * 4 \
            + engine.max_num_seqs * engine.logits_rows_per_seq * self.model_cfg.vocab_size * 4 * 4
        per_block = sum(layout.bytes_per_block(self.block_size, self.kv_dtype)
                        for layout in (self.kv_layout, self.model.proposer_kv_layout()))
        return max(1, kv_budget_bytes(engine, self.device, reserve) // per_block)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocates the cache in the model's layout, binds it, and captures CUDA graphs when they are on."""
        per_block = self.kv_layout.bytes_per_block(self.block_size, self.kv_dtype)
        self.kv_cache = self.kv_layout.allocate(num_blocks, self.block_size, self.kv_dtype, self.device)
        self.model.bind_kv_cache(self.kv_cache)
        self.num_blocks = num_blocks
        log.info("KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB), %s, %d bytes per token (%s)",
                 num_blocks, self.block_size, num_blocks * self.block_size, num_blocks * per_block / 2**20,
                 str(self.kv_dtype).removeprefix("torch."), self.kv_layout.bytes_per_token(self.kv_dtype),
                 self.kv_layout.describe())
        self.graphs = self._graph_runner()

    def _graph_runner(self) -> "GraphRunner | DecodeReplays | None":
        mode, on_cuda = self.engine.cuda_graphs, self.device.type == "cuda"
        if mode == "auto" and self.device.type == "cpu" and self.backend == "cpu":
            return self._cpu_replays()
        if mode == "off" or (mode == "auto" and not (on_cuda and self.backend == "triton")):
            return None
        if self.backend != "triton":
            raise ValueError("cuda_graphs='emulate' needs attention_backend='triton'")
        if mode == "auto" and self.kernels.fused_moe is fused_moe and self.model_cfg.moe is not None:
            log.info("CUDA graphs off: the torch mixture-of-experts path sizes its GEMMs on the host")
            return None
        if self.parallel.exchanges_tokens:
            log.info("CUDA graphs off: the expert exchange between replicas changes shape every step")
            return None
        from batchgen.engine.executor.cuda_graphs import GraphRunner  # imports triton

        with torch.inference_mode():
            return GraphRunner(self.model, self.engine.max_num_seqs, self.engine.max_num_batched_tokens,
                               self.max_model_len, self.block_size, self.device, capture=mode == "auto",
                               mixed="mixed" in self.model.graph_step_kinds,
                               num_speculative_tokens=self.engine.logits_rows_per_seq - 1)

    def _cpu_replays(self) -> DecodeReplays | None:
        """Recorded decode steps on CPU, for one process (collectives stay eager); mixture-of-experts models
        only through the CPU kernels' expert op (the torch path sizes its matmuls on the host)."""
        torch_experts = self.model_cfg.moe is not None and self.kernels.fused_moe is fused_moe
        if torch_experts or self.parallel.tp.size > 1 or self.parallel.exchanges_tokens:
            return None
        return DecodeReplays(self.model, self.engine.max_num_seqs, self.max_model_len, self.block_size)

    def prepare(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Packs the step into flat tensors: no padding between sequences. The index arithmetic runs in numpy,
        whose calls cost a few hundred nanoseconds where torch's cost microseconds (a decode step of one
        sequence took 0.45 ms in a dozen torch calls here)."""
        query_lens, context_lens, n = step.query_lens, step.context_lens, step.num_seqs
        q_lens = np.fromiter(query_lens, dtype=np.int64, count=n)
        ctx = np.fromiter(context_lens, dtype=np.int32, count=n)
        cu_q = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu_q[1:])
        seq_index = np.repeat(np.arange(n), q_lens)
        positions = np.arange(step.num_tokens) - cu_q[seq_index] + (ctx - q_lens)[seq_index]
        block_tables = padded_block_tables(step.block_tables)
        slots = block_tables.numpy()[seq_index, positions // self.block_size].astype(np.int64) * self.block_size \
            + positions % self.block_size
        cu_k = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(ctx, out=cu_k[1:])
        logits_rows = torch.from_numpy(cu_q[1:][np.asarray(step.sample_seqs, dtype=np.int64)] - 1)
        if step.has_drafts:
            logits_rows = verified_rows(logits_rows, step.drafts)
        to_dev = self._to_device
        meta = AttentionMetadata(
            cu_seqlens_q=to_dev(torch.from_numpy(cu_q.astype(np.int32))), cu_seqlens_k=to_dev(torch.from_numpy(cu_k)),
            context_lens=to_dev(torch.from_numpy(ctx)), max_seqlen_q=max(query_lens),
            max_seqlen_k=max(context_lens), slot_mapping=to_dev(torch.from_numpy(slots)),
            block_tables=to_dev(block_tables), query_lens=query_lens, context_lens_list=context_lens)
        input_ids = to_dev(torch.from_numpy(np.asarray(step.input_ids, dtype=np.int64)))
        if step.deferred_positions:
            self._fill_deferred(input_ids, step)
        return input_ids, to_dev(torch.from_numpy(positions)), meta, to_dev(logits_rows)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return to_device(t, self.device)

    def _fill_deferred(self, input_ids: torch.Tensor, step: StepInput) -> None:
        """Writes the previous step's sampled tokens into the places scheduled before they were known."""
        if self._last_tokens is None:
            raise RuntimeError("a step refers to sampled tokens of a previous step that sampled none")
        rows = self._to_device(torch.tensor(step.deferred_rows, dtype=torch.int64))
        input_ids[self._to_device(torch.tensor(step.deferred_positions, dtype=torch.int64))] = self._last_tokens[rows]

    def execute(self, step: StepInput) -> StepOutput:
        """One forward over the packed step; the sampling rows' next tokens (on the sampling rank)."""
        return self.launch(step).result()

    @torch.inference_mode()
    def launch(self, step: StepInput) -> "LaunchedStep":
        """Queues the step's work on the device; its sampled tokens stay there (for the next step's
        deferred tokens) until ``result`` copies them back, the step's one synchronisation. With expert
        load balancing the balancer files the step's expert loads afterwards (and may rebalance)."""
        launched = self._launch(step)
        if self.balancer is not None:
            launched.eplb = self.balancer.end_step(time.perf_counter() - launched.start)
        return launched

    def _launch(self, step: StepInput) -> "LaunchedStep":
        start = time.perf_counter()
        self.parallel.clock.reset()
        if step.dp_num_tokens:
            self.parallel.exchange.begin_step(step.dp_num_tokens)
        if step.num_seqs == 0:  # an idle replica's turn in the expert exchange
            self._run_empty()
            return LaunchedStep(self, start, 0.0)
        if step.restore_blocks:  # prefix blocks from a lower tier, before anything reads them
            scatter_blocks(self.kv_cache, step.restore_blocks, step.restore_kv)
        input_ids, positions, meta, logits_rows = self.prepare(step)
        prepare_s = time.perf_counter() - start
        graph = self.graphs.pick(meta, len(input_ids), len(logits_rows), verify=step.has_drafts) \
            if self.graphs is not None else None
        padded = graph[1] - len(input_ids) if graph is not None else 0
        if graph is not None:
            logits, hidden = self.graphs.run(graph, input_ids, positions, meta, logits_rows)
        else:
            logits = self.model(input_ids, positions, meta, logits_rows)
            hidden = self.model.take_hidden_states()
        saved = gather_blocks(self.kv_cache, step.save_blocks) if step.save_blocks else None
        if len(logits_rows) == 0 or not self.samples:  # only non-final prompt chunks, or not the sampling rank
            return LaunchedStep(self, start, prepare_s, padded=padded, saved_kv=saved, hidden=hidden)
        if step.has_drafts:
            return self._verify(step, logits, start, prepare_s, saved, hidden)
        sampled = sample_rows(logits, step.sampling.to_batch(self.device, step.bitmask), self.kernels.row_argmax)
        self._last_tokens = sampled.tokens
        launched = LaunchedStep(self, start, prepare_s, self._to_host(sampled.tokens),
                                self._to_host(sampled.logprobs), padded, saved_kv=saved, hidden=hidden,
                                probs=sampled.probs if any(step.sampling.keep_probs) else None)
        if self.device.type == "cuda":
            # Queued now, the copies wait for this step alone, not for the next step queued behind it.
            launched.copied = torch.cuda.Event()
            launched.copied.record()
        return launched

    def _verify(self, step: StepInput, logits: torch.Tensor, start: float, prepare_s: float,
                saved: torch.Tensor | None, hidden: torch.Tensor | None) -> "LaunchedStep":
        """Samples every verified position as plain decode would and keeps each row's accepted drafts. The
        engine applies such a step before scheduling the next, so no later step defers to its tokens."""
        batch = expand_sampling(step.sampling, step.drafts).to_batch(self.device, step.bitmask)
        self._last_tokens = None
        accepted = verify(logits, batch, step.drafts, step.draft_probs, self.kernels)
        launched = LaunchedStep(self, start, prepare_s, self._to_host(accepted.tokens),
                                self._to_host(accepted.logprobs), saved_kv=saved,
                                counts=self._to_host(accepted.counts), hidden=hidden)
        if self.device.type == "cuda":
            launched.copied = torch.cuda.Event()
            launched.copied.record()
        return launched

    def _to_host(self, t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None or self.device.type != "cuda":
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return host.copy_(t, non_blocking=True)

    def _run_empty(self) -> None:
        empty = torch.zeros(0, dtype=torch.int64, device=self.device)
        meta = AttentionMetadata(
            cu_seqlens_q=torch.zeros(1, dtype=torch.int32, device=self.device),
            cu_seqlens_k=torch.zeros(1, dtype=torch.int32, device=self.device),
            context_lens=torch.zeros(0, dtype=torch.int32, device=self.device), max_seqlen_q=0, max_seqlen_k=0,
            slot_mapping=empty, block_tables=torch.zeros(0, 1, dtype=torch.int32, device=self.device),
            query_lens=[], context_lens_list=[])
        self.model(empty, empty, meta, empty)



def padded_block_tables(tables: Sequence[Sequence[int]]) -> torch.Tensor:
    """The block tables as one int32 (len(tables), longest) tensor, padded with -1: one pass over the
    block ids in C (np.fromiter), no padded Python lists (256 sequences of 32K tokens: 512K ids a step)."""
    lens = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    width = int(lens.max()) if len(tables) else 0
    out = np.full((len(tables), width), -1, dtype=np.int32)
    out[np.arange(width) < lens[:, None]] = np.fromiter(chain.from_iterable(tables), dtype=np.int32,
                                                        count=int(lens.sum()))
    return torch.from_numpy(out)


@dataclass
class LaunchedStep:
    """A step whose work is queued on the device; ``result`` waits for its sampled tokens (on CUDA, for
    their copy to pinned host memory, queued right behind the step)."""

    runner: ModelRunner
    start: float
    prepare_s: float
    tokens: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    padded: int = 0
    copied: "torch.cuda.Event | None" = None  # on CUDA: when tokens and logprobs have reached the host
    eplb: dict | None = None  # the expert load balancer's report, on the steps that evaluated it
    saved_kv: torch.Tensor | None = None  # the step's save_blocks, copied out behind its forward
    counts: torch.Tensor | None = None  # a step verifying drafts: tokens kept per row (tokens is then padded)
    hidden: torch.Tensor | None = None  # the model's kept hidden states (keep_hidden_states), on the device
    probs: torch.Tensor | None = None  # the sampling rows' distributions, when a row keeps them (on the device)

    def result(self) -> StepOutput:
        runner = self.runner
        out = StepOutput(padded_tokens=self.padded, prepare_s=self.prepare_s, eplb=self.eplb,
                         saved_kv=self.saved_kv, hidden_states=self.hidden, probs=self.probs)
        if self.copied is not None:
            self.copied.synchronize()
        elif self.saved_kv is not None and runner.device.type == "cuda":
            torch.cuda.current_stream(runner.device).synchronize()
        if self.counts is not None:
            out.tokens, out.logprobs = AcceptedTokens(self.tokens, self.counts, self.logprobs).to_lists()
        elif self.tokens is not None:
            out.tokens = [[t] for t in self.tokens.tolist()]
            out.logprobs = [[p] for p in self.logprobs.tolist()] if self.logprobs is not None else None
        if runner.device.type == "cuda" and runner.parallel.clock.sync:
            torch.cuda.synchronize(runner.device)
        out.comm_s = runner.parallel.clock.reset()
        out.compute_s = time.perf_counter() - self.start - out.comm_s
        return out
