"""What crosses the executor boundary each step: a plain StepInput in, a plain StepOutput back.

Nothing here refers to a live ``Sequence``: the engine (rank 0) decides what runs and how it is
sampled, and writes it down; the workers holding weights and KV cache compute and sample from that
alone. Positions and KV slots follow from the lengths and block tables, so they are derived where the
tensors are built.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, Sequence

import torch

from batchgen.engine.sampling.penalties import BannedTokens, RowPenalties
from batchgen.engine.sampling.sampler import SamplingBatch, TokenBitmask
from batchgen.engine.core.sequence import placeholder_row
from batchgen.engine.transfer import to_device

if TYPE_CHECKING:
    from batchgen.engine.core.scheduler import ScheduledSeq
    from batchgen.engine.core.sequence import Sequence as SeqState


@dataclass
class SamplingRows:
    """Per sampling row (the sequences whose last new token is sampled, in step order): its settings."""

    temperatures: list[float] = field(default_factory=list)
    top_ks: list[int] = field(default_factory=list)
    top_ps: list[float] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)  # decided by the engine, never by a worker
    steps: list[int] = field(default_factory=list)  # index of the token each row generates
    logprobs: list[bool] = field(default_factory=list)
    keep_probs: list[bool] = field(default_factory=list)  # rows whose sampling distribution comes back
    penalties: list[RowPenalties] = field(default_factory=list)  # the rows that have any
    banned: list[BannedTokens] = field(default_factory=list)  # rows short of their min_tokens

    def __len__(self) -> int:
        return len(self.seeds)

    def append(self, temperature: float, top_k: int, top_p: float, seed: int, step: int, logprobs: bool,
               keep_probs: bool = False) -> None:
        self.temperatures.append(temperature)
        self.top_ks.append(top_k)
        self.top_ps.append(top_p)
        self.seeds.append(seed)
        self.steps.append(step)
        self.logprobs.append(logprobs)
        self.keep_probs.append(keep_probs)

    def to_batch(self, device: torch.device, bitmask: TokenBitmask | None) -> SamplingBatch:
        return SamplingBatch(
            temperatures=to_device(self.temperatures, device, torch.float32),
            top_ks=to_device(self.top_ks, device, torch.int64),
            top_ps=to_device(self.top_ps, device, torch.float32),
            seeds=to_device(self.seeds, device, torch.int64),
            steps=to_device(self.steps, device, torch.int64),
            want_logprobs=any(self.logprobs),
            all_greedy=all(t == 0 for t in self.temperatures),
            any_top_k_or_p=any(k > 0 or p < 1 for k, p in zip(self.top_ks, self.top_ps)),
            bitmask=bitmask,
            penalties=self.penalties,
            banned=self.banned,
        )


@dataclass
class StepInput:
    """One replica's step: the new tokens of each scheduled sequence, packed in order.

    Sequence i computes ``query_lens[i]`` new tokens and then attends to ``context_lens[i]`` keys (its
    cached prefix and the new tokens); its KV lives in the blocks of ``block_tables[i]``. The sequences in
    ``sample_seqs`` sample a next token from their last new token, with the settings of ``sampling`` (one
    row each, same order) and, for rows with a grammar, ``bitmask``. A new token still being sampled by
    the previous step is a ``deferred`` one. ``dp_num_tokens`` holds every
    data-parallel replica's token count when MoE layers exchange tokens between replicas (else empty);
    a replica with nothing to do then still runs an empty step to take part in the exchange.
    """

    input_ids: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    sample_seqs: list[int] = field(default_factory=list)
    sampling: SamplingRows = field(default_factory=SamplingRows)
    bitmask: TokenBitmask | None = None
    dp_num_tokens: tuple[int, ...] = ()
    # Overlapped scheduling: input_ids[deferred_positions[j]] is the token the previous step sampled in
    # its row deferred_rows[j], unknown when this step was written; the executor fills it in on the device.
    deferred_positions: list[int] = field(default_factory=list)
    deferred_rows: list[int] = field(default_factory=list)
    # Prefix tiers: restore_kv's byte rows go into restore_blocks before the model runs; save_blocks are
    # copied out after it (StepOutput.saved_kv), the blocks this step completes.
    restore_blocks: list[int] = field(default_factory=list)
    restore_kv: torch.Tensor | None = None
    save_blocks: list[int] = field(default_factory=list)
    # Speculative decoding: per sampling row, the draft tokens that end its new tokens (input_ids holds them
    # after the row's last real token); every one of those positions is sampled and verified, and the
    # bitmask's rows then index those positions (a row's last real token, then each of its drafts, in order).
    drafts: list[list[int]] = field(default_factory=list)
    # Per sampling row: the distribution each of its drafts was sampled from ((len(drafts[i]), vocab) float32,
    # on the device), verified with Leviathan et al.'s rule; None for deterministic drafts (kept while they
    # equal the token the target samples at their position) and for a row without drafts.
    draft_probs: list[torch.Tensor | None] = field(default_factory=list)

    @property
    def has_drafts(self) -> bool:
        return any(self.drafts)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


@dataclass
class StepOutput:
    """A step's sampled tokens per sampling row (one, or with draft tokens the accepted drafts and the token
    after them) and, when any row asked, their log-probabilities (the same shape).

    ``prepare_s`` of ``compute_s`` went to building the step's tensors on the host; ``compute_s`` and ``comm_s`` split the worker's time in the step (collectives, waiting for slower
    ranks included, count as communication); ``padded_tokens`` were computed only to fit a CUDA graph.
    ``eplb``: the expert load balancer's report, on the steps that evaluated the placement (else None).
    """

    tokens: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] | None = None
    padded_tokens: int = 0
    compute_s: float = 0.0
    comm_s: float = 0.0
    prepare_s: float = 0.0
    eplb: dict | None = None
    saved_kv: torch.Tensor | None = None  # (len(save_blocks), block bytes) uint8: the saved blocks' KV
    # In-process executors, for a model that keeps them: every computed row's last hidden state before the
    # final norm (num_tokens, hidden), on the device, for the proposer to read at once (speculative "mtp").
    hidden_states: torch.Tensor | None = None
    # In-process executors, when a sampling row keeps its probabilities (``SamplingRows.keep_probs``): every
    # sampling row's distribution (rows, vocab) float32, on the device.
    probs: torch.Tensor | None = None


@dataclass
class FinishedStep:
    """A submitted step that already ran (an executor that does not overlap steps)."""

    outputs: list[StepOutput | None]

    def result(self) -> list[StepOutput | None]:
        return self.outputs


def build_step_input(scheduled: Sequence["ScheduledSeq"], bitmask: TokenBitmask | None = None,
                     draft_probs: Mapping[int, torch.Tensor] | None = None,
                     eos_ids: frozenset[int] = frozenset()) -> StepInput:
    """Writes down a scheduled step; reads the sequences, never changes them. ``draft_probs`` (by seq_id):
    the distributions sampled drafts came from (the first ``len(drafts)`` rows of each are verified); ``eos_ids``
    are not sampled by a row short of its ``min_tokens``."""
    draft_probs = draft_probs or {}
    step = StepInput(bitmask=bitmask)
    ids, sampling = step.input_ids, step.sampling
    for i, s in enumerate(scheduled):
        seq = s.seq
        start = seq.num_computed_tokens
        end = start + s.num_new_tokens
        ids += seq.token_ids[start:min(end, seq.num_tokens)]
        row = placeholder_row(ids[-1])
        if row is not None:  # only the last token can be in flight
            step.deferred_positions.append(len(ids) - 1)
            step.deferred_rows.append(row)
            ids[-1] = 0
        ids += s.drafts
        step.query_lens.append(s.num_new_tokens)
        step.context_lens.append(end)
        step.block_tables.append(list(seq.block_table))
        if s.sample:
            p = seq.params
            step.sample_seqs.append(i)
            sampling.append(p.temperature, p.top_k, p.top_p, seq.seed, seq.num_completion_tokens + seq.noise_offset,
                            p.logprobs, seq.probs is not None)
            _add_token_rules(sampling, seq, eos_ids)
            step.drafts.append(list(s.drafts))
            q = draft_probs.get(seq.seq_id) if s.drafts else None
            step.draft_probs.append(q[:len(s.drafts)] if q is not None else None)
    return step


def _add_token_rules(sampling: SamplingRows, seq: "SeqState", eos_ids: frozenset[int]) -> None:
    """The last sampling row's penalties and, short of its min_tokens, the tokens that would end it."""
    p, row = seq.params, len(sampling) - 1
    if p.penalized:  # the engine does not overlap such a row's steps: its tokens are all known here
        prompt = seq.token_ids[:seq.num_prompt_tokens] if p.repetition_penalty != 1 else []
        sampling.penalties.append(RowPenalties(row, p.presence_penalty, p.frequency_penalty, p.repetition_penalty,
                                               seq.completion_token_ids, prompt))
    if seq.num_completion_tokens < p.min_tokens:
        ends = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
        sampling.banned.append(BannedTokens(row, sorted(ends)))
