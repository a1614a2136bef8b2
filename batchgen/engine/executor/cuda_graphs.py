"""CUDA graphs for decode steps, mixed prefill+decode steps and speculative verify steps: fixed shapes, padded
inputs, one replay."""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch

from batchgen.engine.backends.triton.decode_attention import decode_rows
from batchgen.engine.backends.triton.prefill_attention import prefill_tile_capacity, prefill_work
from batchgen.engine.backends.interface import AttentionMetadata
from batchgen.engine.transfer import to_device

log = logging.getLogger(__name__)

MAX_MIXED_GRAPH_TOKENS = 16384  # covers the pipeline's default step budget


def decode_graph_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8, up to and including max_num_seqs."""
    sizes = {n for n in (1, 2, 4) if n <= max_num_seqs} | set(range(8, max_num_seqs + 1, 8))
    return sorted(sizes | {max_num_seqs})


def mixed_graph_sizes(max_num_batched_tokens: int) -> list[int]:
    """Powers of two from 16 tokens, and the step budget itself, up to MAX_MIXED_GRAPH_TOKENS."""
    top = min(max_num_batched_tokens, MAX_MIXED_GRAPH_TOKENS)
    return sorted({1 << i for i in range(4, 15) if 1 << i < top} | {top})


def verify_graph_sizes(max_num_seqs: int, num_speculative_tokens: int, max_num_batched_tokens: int) -> list[int]:
    """Tokens of a verify step (every sequence decoding, some with drafts): powers of two from 8, and the most
    such a step holds (each sequence and all its drafts, within the step budget); none without speculation."""
    if num_speculative_tokens <= 0:
        return []
    top = min(max_num_seqs * (num_speculative_tokens + 1), max_num_batched_tokens, MAX_MIXED_GRAPH_TOKENS)
    return sorted({1 << i for i in range(3, 15) if 1 << i < top} | {top})


Outputs = tuple[torch.Tensor, torch.Tensor | None]  # a forward's logits and the hidden states its model kept


class _Replay:
    """A captured CUDA graph; elsewhere the same padded forward re-run eagerly, so tests can check it."""

    def __init__(self, forward: Callable[[], Outputs], capture: bool, pool=None):
        self.forward = forward
        self.graph: torch.cuda.CUDAGraph | None = None
        if capture:
            forward()  # compiles the kernels outside the capture
            torch.cuda.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):
                self.output = forward()

    def __call__(self) -> Outputs:
        if self.graph is None:
            return self.forward()
        self.graph.replay()
        return self.output


@dataclass
class _StaticInputs:
    """Device buffers every graph reads; each step's inputs are copied in before a replay."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    logits_rows: torch.Tensor
    prefill_work: torch.Tensor
    decode_rows: torch.Tensor

    @classmethod
    def allocate(cls, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device) -> "_StaticInputs":
        def buf(*shape, dtype=torch.int64, fill=0):
            return torch.full(shape, fill, dtype=dtype, device=device)

        return cls(input_ids=buf(max_tokens), positions=buf(max_tokens), slot_mapping=buf(max_tokens, fill=-1),
                   cu_seqlens_q=buf(max_seqs + 1, dtype=torch.int32),
                   context_lens=buf(max_seqs, dtype=torch.int32),
                   block_tables=buf(max_seqs, max_blocks, dtype=torch.int32, fill=-1),
                   logits_rows=buf(max_seqs),
                   prefill_work=buf(prefill_tile_capacity(max_tokens, max_seqs), 2, dtype=torch.int32, fill=-1),
                   decode_rows=buf(max_seqs, 2, dtype=torch.int32, fill=-1))


class GraphRunner:
    """Replays a captured forward for every step that fits a captured size; the caller runs the rest eagerly.

    Decode steps pad the batch to the next decode size; other steps pad the tokens to the next
    mixed size and the sequences to ``max_num_seqs`` (with ``mixed=False`` they run eagerly). Padded
    tokens write no KV (slot -1), padded sequences have no keys and no query tiles, and their logits
    rows are dropped. A mixed step's sequences of one new token run in the decode kernel's slots
    (``max_num_seqs`` of them, the unused ones skipped), the others in the prefill kernel's tiles.

    A verify step (speculation: every sequence decoding, with or without drafts, and no prompt tokens) needs
    the logits of every position it computes; its graphs are mixed steps whose logits rows are all their tokens,
    one graph per token size whatever the drafts per sequence. A verify step with prompt tokens runs eagerly.
    """

    def __init__(self, model: Callable, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 block_size: int, device: torch.device, capture: bool, mixed: bool = True,
                 num_speculative_tokens: int = 0):
        self.model, self.max_model_len, self.max_num_seqs = model, max_model_len, max_num_seqs
        self.decode_sizes = decode_graph_sizes(max_num_seqs)
        self.mixed_sizes = mixed_graph_sizes(max_num_batched_tokens) if mixed else []
        self.verify_sizes = verify_graph_sizes(max_num_seqs, num_speculative_tokens, max_num_batched_tokens) \
            if mixed else []
        max_blocks = -(-max_model_len // block_size)
        max_tokens = max(self.mixed_sizes[-1:] + self.decode_sizes[-1:] + self.verify_sizes[-1:])
        self.buf = _StaticInputs.allocate(max_tokens, max_num_seqs, max_blocks, device)
        # A decode step's query offsets and logits rows are 0..batch whatever the batch holds; a verify step's
        # logits rows are all its tokens.
        self.decode_rows = torch.arange(max(self.decode_sizes[-1] + 1, max_tokens), device=device)
        self.decode_cu_seqlens = self.decode_rows.to(torch.int32)
        pool = torch.cuda.graph_pool_handle() if capture else None
        self.graphs: dict[tuple[str, int], _Replay] = {}
        self.replays: Counter[tuple[str, int]] = Counter()
        # Largest first, so the smaller graphs reuse the largest one's memory pool.
        for size in reversed(self.decode_sizes):
            self.graphs["decode", size] = _Replay(self._forward("decode", size), capture, pool)
        for size in reversed(self.mixed_sizes):
            self.graphs["mixed", size] = _Replay(self._forward("mixed", size), capture, pool)
        for size in reversed(self.verify_sizes):
            self.graphs["verify", size] = _Replay(self._forward("verify", size), capture, pool)
        if capture:
            log.info("captured CUDA graphs: decode batches %s, mixed steps of %s tokens, verify steps of %s tokens",
                     self.decode_sizes, self.mixed_sizes, self.verify_sizes)

    def _metadata(self, kind: str, size: int) -> AttentionMetadata:
        b = self.buf
        seqs = size if kind == "decode" else self.max_num_seqs
        cu_seqlens = (self.decode_cu_seqlens if kind == "decode" else b.cu_seqlens_q)[: seqs + 1]
        return AttentionMetadata(
            cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
            context_lens=b.context_lens[:seqs], max_seqlen_q=1 if kind == "decode" else size,
            max_seqlen_k=self.max_model_len, slot_mapping=b.slot_mapping[:size],
            block_tables=b.block_tables[:seqs], query_lens=[], context_lens_list=[],
            decode_only=kind == "decode", has_cached_prefix=kind != "decode",
            prefill_work=None if kind == "decode" else b.prefill_work[: prefill_tile_capacity(size, seqs)],
            decode_rows=None if kind == "decode" else b.decode_rows)

    def _forward(self, kind: str, size: int) -> Callable[[], Outputs]:
        meta = self._metadata("mixed" if kind == "verify" else kind, size)
        rows = self.buf.logits_rows if kind == "mixed" else self.decode_rows[:size]
        ids, positions = self.buf.input_ids[:size], self.buf.positions[:size]
        if not getattr(self.model, "keep_hidden_states", False):
            return lambda: (self.model(ids, positions, meta, rows), None)
        # The hidden states a model keeps for a proposer (MTP) are outputs of the graph like its logits.
        return lambda: (self.model(ids, positions, meta, rows), self.model.take_hidden_states())

    def pick(self, meta: AttentionMetadata, num_tokens: int, num_logits_rows: int | None = None,
             verify: bool = False) -> tuple[str, int] | None:
        """The captured (kind, size) for this step, or None when it runs eagerly. A ``verify`` step replays
        only where it needs every position's logits (``num_logits_rows`` == ``num_tokens``: no prompt tokens)."""
        if verify:
            if num_logits_rows != num_tokens:
                return None
            sizes, need, kind = self.verify_sizes, num_tokens, "verify"
        elif meta.decode_only:
            sizes, need, kind = self.decode_sizes, meta.num_seqs, "decode"
        else:
            sizes, need, kind = self.mixed_sizes, num_tokens, "mixed"
        if not sizes or need > sizes[-1]:  # the scheduler never exceeds max_num_seqs
            return None
        return kind, next(s for s in sizes if s >= need)

    def run(self, key: tuple[str, int], input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata, logits_rows: torch.Tensor) -> Outputs:
        """Copies the step into the static buffers, replays the graph, returns the real logits rows and, where
        the model keeps them, the real tokens' hidden states (copied: the next replay overwrites the graph's)."""
        kind, size = key
        b, n, s = self.buf, input_ids.shape[0], meta.num_seqs
        b.input_ids[:n] = input_ids
        b.positions[:n] = positions
        b.slot_mapping[:n] = meta.slot_mapping
        b.slot_mapping[n:size] = -1
        b.context_lens[:s] = meta.context_lens
        width = meta.block_tables.shape[1]
        b.block_tables[:s, :width] = meta.block_tables
        if kind == "decode":
            b.context_lens[s:size] = 0
        else:
            b.cu_seqlens_q[: s + 1] = meta.cu_seqlens_q
            b.cu_seqlens_q[s + 1:] = n
            b.context_lens[s:] = 0
            if kind == "mixed":
                b.logits_rows[: len(logits_rows)] = logits_rows
                b.logits_rows[len(logits_rows):] = 0  # any real row: a stale one may lie past this step
            capacity = prefill_tile_capacity(size, self.max_num_seqs)
            work = prefill_work(meta.query_lens, meta.context_lens_list, capacity=capacity, skip_decodes=True)
            b.prefill_work[:capacity] = to_device(work, b.prefill_work.device)
            b.decode_rows[:] = to_device(decode_rows(meta.query_lens, capacity=self.max_num_seqs), b.decode_rows.device)
        self.replays[key] += 1
        logits, hidden = self.graphs[key]()
        return logits[: len(logits_rows)], None if hidden is None else hidden[:n].clone()
