"""Multi-token prediction (``"mtp"``): DeepSeek-V3's MTP layer drafts from the target's own hidden states.

Right after each target step the proposer catches up: for every position i the target just computed (a prompt
chunk, a decode, or a verification's last real token and its accepted drafts) it runs the MTP layer on
(token i + 1, the target's hidden state i), writing the layer's KV and keeping, for a sequence about to decode,
the layer's output at its last position. The step's hidden states are consumed at once, so they never pile up.
``propose`` drafts from that output (the shared head runs only there, so a step the cost model leaves undrafted
pays the layer alone) and chains the layer on: each further draft is the MTP layer run on the previous draft with
its own output hidden state. Drafts are argmax tokens, deterministic, so the target's acceptance stays lossless.

The layer's KV lives in its own paged cache, in the target's layout (block size, latent rows), with its own
blocks per sequence; the positions a chain wrote for rejected drafts are overwritten by the next catch-up. A
sequence the cache has no room for drafts nothing. A sequence whose first positions the target did not compute
(a prefix-cache hit) starts the layer's cache at the first one it did: the layer attends to the positions it saw.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from batchgen.engine.executor.step import StepInput
from batchgen.engine.speculative.config import SpeculativeConfig
from batchgen.engine.speculative.proposer import DraftRequest


@dataclass(frozen=True)
class ComputedRows:
    """``count`` positions from ``start`` of a sequence that the target's step computed and kept, at packed rows
    ``row ..`` of the step's hidden states; ``tokens`` holds the sequence's tokens after the step."""

    seq_id: int
    tokens: Sequence[int]
    start: int
    count: int
    row: int
    decoding: bool  # the sequence's next step decodes (it may draft)


@dataclass
class MtpState:
    """One sequence's MTP cache blocks and, when it may draft, the MTP output to draft from."""

    blocks: list[int] = field(default_factory=list)
    first: int = 0  # the first position its cache holds (slot index = position - first)
    end: int = 0  # positions first .. end - 1 are held
    for_length: int = -1  # the sequence length ``hidden`` drafts for
    hidden: torch.Tensor | None = None  # the MTP output at the last caught-up position


class BlockPool:
    """The MTP cache's free blocks."""

    def __init__(self, num_blocks: int):
        self.free = list(range(num_blocks - 1, -1, -1))

    def grow(self, blocks: list[int], needed: int) -> bool:
        """Extends ``blocks`` to ``needed`` blocks; False (and unchanged) when the pool has too few."""
        missing = needed - len(blocks)
        if missing > len(self.free):
            return False
        for _ in range(max(0, missing)):
            blocks.append(self.free.pop())
        return True

    def release(self, blocks: list[int]) -> None:
        self.free += reversed(blocks)
        blocks.clear()


class MtpProposer:
    """Drafts with the target model's MTP layer (``model.mtp``), run by the target's model ``runner``."""

    needs_hidden_states = True

    def __init__(self, runner: Any, num_speculative_tokens: int, num_blocks: int):
        self.runner, self.model = runner, runner.model
        self.num_speculative_tokens, self.block_size = num_speculative_tokens, runner.block_size
        (self.cache,) = self.model.proposer_kv_layout().allocate(num_blocks, self.block_size, runner.kv_dtype,
                                                                 runner.device)
        self.model.mtp.self_attn.bind_cache(self.cache)
        self.pool = BlockPool(num_blocks)
        self.states: dict[int, MtpState] = {}
        self.steady_seconds: float | None = None
        self._catch_up_s = 0.0  # the latest catch-up's share for the decoding sequences

    # ---- the proposer interface ----------------------------------------------------------------------------
    def add_request(self, seq_id: int, prompt: Sequence[int]) -> None:
        self.states[seq_id] = MtpState()

    def finish(self, seq_id: int, tokens: Sequence[int], num_prompt_tokens: int) -> None:
        state = self.states.pop(seq_id, None)
        if state is not None:
            self.pool.release(state.blocks)

    def drop_all(self) -> None:
        for seq_id in list(self.states):
            self.finish(seq_id, (), 0)

    def propose(self, seq_id: int, tokens: Sequence[int], k: int) -> list[int]:
        return self.propose_batch([DraftRequest(seq_id, tokens, k)])[0]

    @torch.inference_mode()
    def propose_batch(self, requests: list[DraftRequest]) -> list[list[int]]:
        """Each request's draft after the latest catch-up, chained to up to ``k`` tokens; [] for a sequence the
        catch-up did not reach."""
        start = time.perf_counter()
        drafts: list[list[int]] = [[] for _ in requests]
        chains = []  # (row, state, k, index of the sequence's last token)
        for row, (seq_id, tokens, k, _) in enumerate(requests):
            state = self.states.get(seq_id)
            if state is not None and state.for_length == len(tokens) and k > 0:
                chains.append((row, state, min(k, self.num_speculative_tokens), len(tokens) - 1))
        live = [(row, state, last) for row, state, _, last in chains]
        current = {row: state.hidden for row, state, _ in live}  # each chain's latest MTP output
        for j in range(1, max((k for _, _, k, _ in chains), default=0) + 1):
            if not live:
                break
            hidden = torch.stack([current[row] for row, _, _ in live])
            for (row, _, _), token in zip(live, self.model.mtp_logits(hidden).argmax(dim=-1).tolist()):
                drafts[row].append(token)
            # Position last + j - 1 takes draft j (the catch-up's last position was last - 1): its output
            # predicts draft j + 1.
            live = [(row, state, last) for row, state, k, last in chains
                    if k > j and self._room(requests[row][0], last + j - state.first)]
            if live:
                step = StepInput(input_ids=[drafts[row][-1] for row, _, _ in live], query_lens=[1] * len(live),
                                 context_lens=[last + j - state.first for _, state, last in live],
                                 block_tables=[list(state.blocks) for _, state, _ in live])
                hidden = self._run(step, torch.stack([current[row] for row, _, _ in live]),
                                   [state.first for _, state, _ in live])
                current.update((row, hidden[i]) for i, (row, _, _) in enumerate(live))
        self.steady_seconds = time.perf_counter() - start + self._catch_up_s
        return drafts

    # ---- after each target step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def observe_step(self, rows: list[ComputedRows], hidden: torch.Tensor) -> None:
        """Runs the MTP layer over the positions the target just computed (see the module docstring)."""
        start = time.perf_counter()
        kept = []
        for r in rows:
            state = self.states.get(r.seq_id)
            if state is None:
                continue
            state.for_length, state.hidden = -1, None
            if not state.first <= r.start <= state.end:  # a prefix-cache hit, or recomputed from further back
                state.first = r.start
            state.end = r.start + r.count
            if self._room(r.seq_id, state.end - state.first):
                kept.append((r, state))
        if not kept:
            return
        step = StepInput(
            input_ids=[t for r, _ in kept for t in r.tokens[r.start + 1:r.start + r.count + 1]],
            query_lens=[r.count for r, _ in kept], context_lens=[state.end - state.first for _, state in kept],
            block_tables=[list(state.blocks) for _, state in kept])
        index = torch.cat([torch.arange(r.row, r.row + r.count) for r, _ in kept]).to(hidden.device)
        last_rows = self._run(step, hidden[index], [state.first for _, state in kept])
        for (r, state), out in zip(kept, last_rows):
            if r.decoding:
                state.for_length, state.hidden = len(r.tokens), out
        decoding = sum(r.decoding for r, _ in kept)
        self._catch_up_s = (time.perf_counter() - start) * decoding / len(kept)

    # ---- internals -----------------------------------------------------------------------------------------
    def _room(self, seq_id: int, positions: int) -> bool:
        """Whether the sequence's MTP blocks hold ``positions`` positions (grown as needed); a sequence the cache
        has no room for loses its blocks and drafts nothing until it finishes."""
        state = self.states.get(seq_id)
        if state is None:
            return False
        if self.pool.grow(state.blocks, -(-positions // self.block_size)):
            return True
        self.finish(seq_id, (), 0)
        return False

    def _run(self, step: StepInput, previous: torch.Tensor, firsts: list[int]) -> torch.Tensor:
        """The MTP layer over a packed step (each sequence's positions from its ``first``, which its cache holds at
        slot 0): the output hidden state of each sequence's last row."""
        step.sample_seqs = list(range(step.num_seqs))
        input_ids, slots, meta, rows = self.runner.prepare(step)
        positions = slots + torch.repeat_interleave(torch.tensor(firsts), torch.tensor(step.query_lens)).to(slots)
        return self.model.mtp_hidden_states(input_ids, previous, positions, meta)[rows]


def build_mtp_proposer(spec: SpeculativeConfig, target: Any) -> MtpProposer:
    """The MTP proposer on the ``target`` engine's own model (built with its MTP layer: one device only)."""
    runner = getattr(target.executor, "runner", None)
    if runner is None or getattr(runner.model, "mtp", None) is None:
        raise ValueError("speculative method 'mtp' needs the target model in this process, built with its "
                         "multi-token-prediction layer (one device: tensor_parallel_size and data_parallel_size 1)")
    # As many blocks as the target's cache (the KV budget counts them) and a chain's overhang for each sequence.
    extra = target.config.max_num_seqs * -(-spec.num_speculative_tokens // runner.block_size)
    return MtpProposer(runner, spec.num_speculative_tokens, runner.num_blocks + extra)
