"""CPU decode steps replayed from their recorded ops (op_replay): one recording per batch size, made by the second
step of that size, so a decode step skips the Python of ~300 op calls (a third of a one-row step on 2 cores); the
replays run their ops from C++ where the CPU kernels are built (backends/cpu/program.py)."""
from __future__ import annotations

import logging
from collections import Counter
from typing import Callable

import torch

from batchgen.engine.backends.cpu.program import compile_steps
from batchgen.engine.backends.interface import AttentionMetadata
from batchgen.engine.executor.op_replay import HostOnly, NotReplayable, Recording, record

log = logging.getLogger(__name__)

Outputs = tuple[torch.Tensor, torch.Tensor | None]  # a forward's logits and the hidden states its model kept


class DecodeReplays:
    """Decode steps (one new token per sequence, every row sampling) of any batch size up to ``max_num_seqs``,
    run from buffers that each step's inputs are copied into: the first two steps of a size run eagerly, the
    second while its ops are recorded (recording costs a few eager steps), later ones replay them. No padding: on CPU a padded row costs its full share of the
    matmuls. The recordings' intermediates share one arena, as large as the largest recording needs.

    A forward that reads a tensor or per-step metadata on the host cannot be replayed: the recording stops,
    that step runs eagerly and so does every later one (``refused`` says why). Same interface as
    :class:`~batchgen.engine.executor.cuda_graphs.GraphRunner`: ``pick`` then ``run``.
    """

    def __init__(self, model: Callable, max_num_seqs: int, max_model_len: int, block_size: int):
        self.model = model
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(max_num_seqs, dtype=torch.int64)
        self.positions = torch.zeros(max_num_seqs, dtype=torch.int64)
        self.slot_mapping = torch.full((max_num_seqs,), -1, dtype=torch.int64)
        self.context_lens = torch.zeros(max_num_seqs, dtype=torch.int32)
        self.block_tables = torch.full((max_num_seqs, max_blocks), -1, dtype=torch.int32)
        self.rows = torch.arange(max_num_seqs + 1)
        self.cu_seqlens = self.rows.to(torch.int32)
        self.max_model_len = max_model_len
        self.recordings: dict[int, Recording] = {}
        self.seen: Counter[int] = Counter()  # decode steps per size
        self.arena = torch.UntypedStorage(0)
        self.replays: Counter[tuple[str, int]] = Counter()
        self.refused: str | None = None

    def pick(self, meta: AttentionMetadata, num_tokens: int, num_logits_rows: int | None = None,
             verify: bool = False) -> tuple[str, int] | None:
        """("decode", batch) for a decode step in which every row samples; None for the others (run eagerly)."""
        if self.refused or verify or not meta.decode_only or num_tokens != meta.num_seqs \
                or num_logits_rows != num_tokens or num_tokens > self.input_ids.shape[0]:
            return None
        self.seen[num_tokens] += 1
        if num_tokens not in self.recordings and self.seen[num_tokens] == 1:
            return None  # a size seen once (a batch's tail) is not worth the recording
        return "decode", num_tokens

    def _metadata(self, size: int) -> AttentionMetadata:
        # cu_seqlens_k as cu_seqlens_q: decode attention reads the context lengths and block tables instead.
        return AttentionMetadata(
            cu_seqlens_q=self.cu_seqlens[: size + 1], cu_seqlens_k=self.cu_seqlens[: size + 1],
            context_lens=self.context_lens[:size], max_seqlen_q=1, max_seqlen_k=self.max_model_len,
            slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
            query_lens=HostOnly(size), context_lens_list=HostOnly(size),  # type: ignore[arg-type]
            decode_only=True, has_cached_prefix=True)

    def _forward(self, size: int) -> Callable[[], Outputs]:
        meta, rows = self._metadata(size), self.rows[:size]
        ids, positions = self.input_ids[:size], self.positions[:size]
        if not getattr(self.model, "keep_hidden_states", False):
            return lambda: (self.model(ids, positions, meta, rows), None)
        return lambda: (self.model(ids, positions, meta, rows), self.model.take_hidden_states())

    def run(self, key: tuple[str, int], input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata, logits_rows: torch.Tensor) -> Outputs:
        """Copies the step into the buffers and replays its size's recording (recording it first if there is
        none); the logits and, where the model keeps them, a copy of the hidden states."""
        _, size = key
        self.input_ids[:size] = input_ids
        self.positions[:size] = positions
        self.slot_mapping[:size] = meta.slot_mapping
        self.context_lens[:size] = meta.context_lens
        self.block_tables[:size, : meta.block_tables.shape[1]] = meta.block_tables
        recording = self.recordings.get(size)
        if recording is None:
            outputs = self._record(size)
            if outputs is None:  # refused: this step (whose keys the recording may have stored already) eagerly
                return self.model(input_ids, positions, meta, logits_rows), self.model.take_hidden_states()
            logits, hidden = outputs
        else:
            logits, hidden = recording.replay()
            self.replays[key] += 1
        return logits, None if hidden is None else hidden.clone()

    def _record(self, size: int) -> Outputs | None:
        try:
            outputs, recording = record(self._forward(size))
        except NotReplayable as exc:
            self.refused = str(exc)
            log.info("CPU decode replays off: %s", exc)
            return None
        if recording.arena_bytes > self.arena.nbytes():
            self.arena = torch.UntypedStorage(recording.arena_bytes)
            for other in self.recordings.values():
                other.bind(self.arena, compile_steps)
        recording.bind(self.arena, compile_steps)
        self.recordings[size] = recording
        return outputs
