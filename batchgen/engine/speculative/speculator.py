"""The engine's side of speculative decoding: asks the cost model for draft lengths, the proposer for drafts,
and keeps the acceptance estimates and each step's counts."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterable

import torch

from batchgen.engine.config import EngineConfig
from batchgen.engine.core.scheduler import ScheduledSeq
from batchgen.engine.core.sequence import Sequence, SequenceStatus
from batchgen.engine.executor.step import StepInput, StepOutput
from batchgen.engine.sampling.structured import draft_bitmask_rows
from batchgen.engine.speculative.config import SpeculativeConfig
from batchgen.engine.speculative.draft_model import build_draft_proposer
from batchgen.engine.speculative.mtp import ComputedRows, build_mtp_proposer
from batchgen.engine.speculative.ngram import NgramProposer
from batchgen.engine.speculative.policy import (AcceptanceTracker, DraftCost, ProbeSchedule, StepCostModel,
                                                choose_draft_lengths, probe_draft_lengths)
from batchgen.engine.speculative.proposer import DraftRequest, DraftSampling, Proposer, propose_batch
from batchgen.engine.speculative.suffix import SuffixProposer

log = logging.getLogger(__name__)


def build_proposer(config: SpeculativeConfig, target: Any = None,
                   engine_factory: Callable[[EngineConfig], Any] | None = None) -> Proposer:
    """The proposer of ``config.method``, given the settings it takes; a draft model's engine is built by
    ``engine_factory`` beside the ``target`` engine."""
    if config.method == "ngram":
        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "suffix":
        return SuffixProposer(config.num_speculative_tokens, **config.options)
    if config.method == "draft_model":
        if target is None or engine_factory is None:
            raise ValueError("speculative method 'draft_model' needs the target engine to build its draft engine")
        return build_draft_proposer(config, target, engine_factory)
    if config.method == "mtp":
        if target is None:
            raise ValueError("speculative method 'mtp' needs the target engine: it drafts with the target's model")
        return build_mtp_proposer(config, target)
    raise ValueError(f"speculative method {config.method!r} has no proposer in this build")


def build_speculator(target: Any, engine_factory: Callable[[EngineConfig], Any]) -> "Speculator | None":
    """The ``target`` engine's speculator, from its ``speculative_config``; None when speculation is off."""
    config = SpeculativeConfig.from_dict(target.config.speculative_config)
    if config is None:
        return None
    return Speculator(config, target.max_model_len, target.model_config.vocab_size,
                      build_proposer(config, target, engine_factory))


def draft_sampling(seq: Sequence) -> DraftSampling | None:
    """How a proposer may sample the sequence's next drafts; None for greedy rows and rows with a grammar (their
    drafts are cut where the grammar disallows one, which only the deterministic rule allows)."""
    p = seq.params
    if p.temperature == 0 or seq.grammar is not None:
        return None
    return DraftSampling(p.temperature, p.top_k, p.top_p, seq.seed, seq.num_completion_tokens)


@dataclass
class SpecCounts:
    """One step's speculation, under StepRecord's field names: the policy's decisions and what was verified."""

    spec_decode_seqs: int = 0  # decoding sequences the cost model looked at
    spec_drafting_seqs: int = 0  # of those, given k > 0
    spec_planned_tokens: int = 0  # the k it gave them, summed
    spec_probe_steps: int = 0  # steps that drafted only to time a verification (the cost model gave none)
    spec_draft_rows: int = 0  # sequences that verified at least one draft token
    spec_draft_tokens: int = 0  # draft tokens verified
    spec_accepted_tokens: int = 0  # of those, kept

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class Speculator:
    """Chooses ``k`` per decoding sequence and step, gets the drafts and learns from their verification."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, vocab_size: int,
                 proposer: Proposer | None = None):
        self.config, self.max_model_len, self.vocab_size = config, max_model_len, vocab_size
        self.proposer = proposer if proposer is not None else build_proposer(config)
        self.cost = StepCostModel()
        self.acceptance = AcceptanceTracker()
        self.draft_cost = DraftCost()
        self.probes = ProbeSchedule()
        self._plan: dict[int, int] = {}
        self.grammar_masks: dict[int, torch.Tensor] = {}  # the latest proposals' masks, by seq_id (see propose)
        self._mask_s = 0.0  # seconds spent computing them, not yet handed to a step (take_mask_seconds)
        self.counts = SpecCounts()
        self.draft_probs: dict[int, Any] = {}  # the latest drafts' distributions, by seq_id, where sampled

    def add_request(self, seq: Sequence) -> None:
        self.proposer.add_request(seq.seq_id, seq.token_ids[:seq.num_prompt_tokens])

    @property
    def needs_hidden_states(self) -> bool:
        """Whether the proposer reads each step's hidden states (``observe_step``): steps then do not overlap."""
        return bool(getattr(self.proposer, "needs_hidden_states", False))

    def observe_step(self, scheduled: list[ScheduledSeq], step: StepInput, out: StepOutput) -> None:
        """Hands a proposer that reads them the hidden states of the positions the step computed and kept (its
        sequences' tokens already applied): a verifying row's last real token and its accepted drafts."""
        observe = getattr(self.proposer, "observe_step", None)
        if observe is None or out.hidden_states is None:
            return
        rows, at = [], 0
        for s, q, context in zip(scheduled, step.query_lens, step.context_lens, strict=True):
            seq, start = s.seq, context - q
            count = min(q, seq.num_computed_tokens - start)
            if not seq.is_finished and count > 0:
                rows.append(ComputedRows(seq.seq_id, seq.token_ids, start, count, at,
                                         decoding=seq.num_computed_tokens == seq.num_tokens - 1))
            at += q
        observe(rows, out.hidden_states)

    def finish(self, seq: Sequence) -> None:
        self.proposer.finish(seq.seq_id, seq.token_ids, seq.num_prompt_tokens)
        self.acceptance.drop(seq.seq_id)

    def drop_all(self) -> None:
        """Every request was aborted: a proposer that keeps device state per request (``drop_all``) frees it."""
        drop = getattr(self.proposer, "drop_all", None)
        if drop is not None:
            drop()

    def _cap(self, seq: Sequence) -> int:
        """Most drafts the sequence may verify: its output and the context must hold them all."""
        return max(0, min(self.config.num_speculative_tokens,
                          seq.params.max_tokens - seq.num_completion_tokens - 1,
                          self.max_model_len - seq.num_tokens))

    def plan(self, running: Iterable[Sequence]) -> bool:
        """Decides the next step's draft lengths; True when some sequence drafts (the step then cannot
        overlap the one before: its proposals need that step's tokens)."""
        decoding = [s for s in running if s.status == SequenceStatus.RUNNING and s.num_computed_tokens == s.num_tokens - 1]
        a, b = self.cost.coefficients()
        rates, caps = [self.acceptance.rate(s.seq_id) for s in decoding], [self._cap(s) for s in decoding]
        ks = choose_draft_lengths(rates, caps, a, b, self.draft_cost.per_token(len(decoding)),
                                  self.cost.verify_overhead(), [self.acceptance.supply(s.seq_id) for s in decoding])
        c = self.counts
        if any(ks):
            self.probes.drafted()
        elif any(caps) and self.probes.probe():
            ks = probe_draft_lengths(rates, caps)
            c.spec_probe_steps += 1
        self._plan = {s.seq_id: k for s, k in zip(decoding, ks, strict=True) if k > 0}
        c.spec_decode_seqs += len(decoding)
        c.spec_drafting_seqs += len(self._plan)
        c.spec_planned_tokens += sum(self._plan.values())
        return bool(self._plan)

    def propose(self, running: Iterable[Sequence]) -> dict[int, list[int]]:
        """Drafts of the planned sequences still running (by seq_id); none for a sequence the proposer has
        nothing for. A grammar row keeps only the drafts its grammar allows, and the masks of their positions
        stay in ``grammar_masks`` for the verifying step (which needs the same ones). Where the proposer
        sampled the drafts, their distributions are in ``draft_probs``."""
        drafting = [(seq, self._plan.get(seq.seq_id, 0)) for seq in running]
        drafting = [(seq, k) for seq, k in drafting if k and not seq.is_finished and seq.token_ids[-1] >= 0]
        self._plan, self.grammar_masks, self.draft_probs = {}, {}, {}
        if not drafting:
            return {}
        start = time.perf_counter()
        batch = propose_batch(self.proposer, [DraftRequest(seq.seq_id, seq.token_ids, k, draft_sampling(seq))
                                              for seq, k in drafting])
        sampled = getattr(self.proposer, "draft_probs", {})
        seconds = getattr(self.proposer, "steady_seconds", None)  # its own account of one-off work, if it keeps one
        self.draft_cost.observe(max(k for _, k in drafting), seconds if seconds is not None else
                                time.perf_counter() - start)
        drafts = {}
        for (seq, k), proposed in zip(drafting, batch, strict=True):
            proposed = proposed[:k]
            if proposed and seq.grammar is not None:  # keep what the grammar allows
                mask_start = time.perf_counter()
                bits, kept = draft_bitmask_rows(seq.grammar, proposed, self.vocab_size)
                self._mask_s += time.perf_counter() - mask_start
                proposed = proposed[:kept]
                if proposed:
                    self.grammar_masks[seq.seq_id] = bits
            self.acceptance.offered(seq.seq_id, k, len(proposed))
            if proposed:
                drafts[seq.seq_id] = proposed
                if seq.seq_id in sampled:
                    self.draft_probs[seq.seq_id] = sampled[seq.seq_id][:len(proposed)]
        return drafts

    def take_mask_seconds(self) -> float:
        """The seconds the latest proposals spent on grammar masks (the verifying step's masks: its cost, not the
        proposer's), handed over once."""
        seconds, self._mask_s = self._mask_s, 0.0
        return seconds

    def verified(self, seq_id: int, proposed: int, accepted: int) -> None:
        self.acceptance.observe(seq_id, proposed, accepted)
        c = self.counts
        c.spec_draft_rows += 1
        c.spec_draft_tokens += proposed
        c.spec_accepted_tokens += accepted

    def take_counts(self) -> dict[str, int]:
        counts, self.counts = self.counts, SpecCounts()
        return counts.as_dict()

    def step_done(self, prefill_tokens: int, tokens: int, seconds: float, verifying: bool = False) -> None:
        """Fits the cost model on steps that computed no prompt tokens (decodes and verifications)."""
        if prefill_tokens == 0:
            self.cost.observe(tokens, seconds, verifying)

    def close(self) -> None:
        """Stops what the proposer runs (a draft model's engine)."""
        close = getattr(self.proposer, "close", None)
        if close is not None:
            close()

    def figures(self) -> dict[str, float]:
        """The cost model's current fit, for the metrics."""
        a, b = self.cost.coefficients()
        return {"cost_fitted": self.cost.fitted, "cost_base_ms": round(a * 1e3, 4),
                "cost_ms_per_token": round(b * 1e3, 5),
                "cost_verify_ms": round(self.cost.verify_overhead() * 1e3, 4),
                "draft_ms_per_step": round(self.draft_cost.seconds_per_step * 1e3, 5),
                "method_acceptance_rate": round(self.acceptance.method_rate, 4)}
