"""Continuous batching: picks each step's tokens under a token budget, preempting when the cache is full."""
from __future__ import annotations

from collections import deque
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from batchgen.engine.core.block_manager import BlockManager
from batchgen.engine.core.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from batchgen.engine.kv_store.tiers import PrefixTiers, Restore


@dataclass
class ScheduledSeq:
    """``num_new_tokens`` of ``seq`` are computed this step; ``sample`` when they reach its last token.
    ``drafts`` (speculative decoding) follow its last token and count in ``num_new_tokens``."""

    seq: Sequence
    num_new_tokens: int
    sample: bool
    drafts: list[int] = field(default_factory=list)


@dataclass
class ScheduledStep:
    """One step's work and what scheduling it cost: preempted sequences, prefix-cache lookups of admissions."""

    seqs: list[ScheduledSeq] = field(default_factory=list)
    preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens of the sequences admitted this step
    prefix_cache_hits: int = 0  # of those, tokens whose KV the prefix cache already held (any tier)
    restores: list["Restore"] = field(default_factory=list)  # blocks the lower prefix tiers fill this step
    saves: list[tuple[int, int, tuple[int, ...]]] = field(default_factory=list)  # blocks it completes


class Scheduler:
    """Running sequences first (decodes and unfinished prompt chunks), then new prompts, in chunks.

    Running sequences keep their order; when blocks run out the newest running sequence is preempted:
    its blocks are freed and it is recomputed later (its cached prefix blocks may survive). A request whose
    grammar is still compiling waits aside and joins the waiting queue once it is ready.
    """

    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int, tiers: "PrefixTiers | None" = None):
        self.block_manager = block_manager
        self.tiers = tiers  # host and store tiers below the device prefix cache
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.waiting_for_grammar: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        if seq.grammar is not None and seq.grammar.matcher is None:  # started by promote_compiled
            seq.status = SequenceStatus.WAITING_FOR_GRAMMAR
            self.waiting_for_grammar.append(seq)
        else:
            self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.waiting_for_grammar)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.waiting_for_grammar)

    def promote_compiled(self) -> list[Sequence]:
        """Queues the requests whose grammar has compiled; returns (finished) those whose grammar failed."""
        failed: list[Sequence] = []
        pending: list[Sequence] = []
        for seq in self.waiting_for_grammar:
            if not seq.grammar.is_ready:
                pending.append(seq)
            elif seq.grammar.start():
                seq.status = SequenceStatus.WAITING
                self.waiting.append(seq)
            else:
                seq.status = SequenceStatus.FINISHED
                failed.append(seq)
        self.waiting_for_grammar = pending
        return failed

    def wait_for_grammars(self, timeout: float) -> None:
        """Blocks until some pending grammar has compiled (or ``timeout``): for when nothing else can run."""
        if self.waiting_for_grammar:
            wait([s.grammar.future for s in self.waiting_for_grammar], timeout, return_when=FIRST_COMPLETED)

    def schedule(self, drafts: dict[int, list[int]] | None = None) -> ScheduledStep:
        """The next step; ``drafts`` (by seq_id) are draft tokens to verify after decoding sequences' last
        token, each cut to what the token budget leaves (and dropped for a sequence that is preempted)."""
        drafts = drafts or {}
        budget = self.max_num_batched_tokens
        step = ScheduledStep()
        scheduled = step.seqs
        i = ending = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_known_tokens < seq.num_tokens and seq.reached_length(self.max_model_len):
                i += 1  # its token in flight is its last: nothing left to compute, its slot frees up
                ending += 1
                continue
            seq_drafts = drafts.get(seq.seq_id, [])[:max(0, budget - 1)]
            if not self._make_room(seq, min(seq.num_tokens - seq.num_computed_tokens + len(seq_drafts), budget),
                                   step):
                break
            scheduled.append(self._schedule_chunk(seq, budget, seq_drafts))
            budget -= scheduled[-1].num_new_tokens
            i += 1
        if self.tiers is not None:
            self.tiers.prefetch(self.waiting, self.block_manager)
        while (not step.preemptions and self.waiting and budget > 0
               and len(self.running) - ending < self.max_num_seqs
               and self.block_manager.can_admit(self.waiting[0])
               and (self.tiers is None or self.tiers.ready(self.waiting[0], busy=bool(scheduled)))):
            seq = self.waiting.popleft()
            self.block_manager.admit(seq)
            if self.tiers is not None:
                step.restores.append(self.tiers.restore(seq, self.block_manager))
            step.prefix_cache_hits += seq.num_computed_tokens
            step.prefix_cache_queries += seq.num_tokens
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(self._schedule_chunk(seq, budget))
            budget -= scheduled[-1].num_new_tokens
        step.saves = self.block_manager.take_completed()
        return step

    def _schedule_chunk(self, seq: Sequence, budget: int, drafts: list[int] | None = None) -> ScheduledSeq:
        self.block_manager.release_out_of_window(seq)
        n = min(seq.num_tokens - seq.num_computed_tokens, budget)
        end = seq.num_computed_tokens + n
        drafts = drafts if drafts and end == seq.num_tokens and n == 1 else []
        self.block_manager.allocate(seq, end + len(drafts))
        # A block holding a placeholder (or a draft token) is hashed at a later step, once its token ids are known.
        self.block_manager.mark_scheduled(seq, min(end, seq.num_known_tokens))
        return ScheduledSeq(seq, n + len(drafts), sample=end == seq.num_tokens, drafts=drafts)

    def _make_room(self, seq: Sequence, num_new_tokens: int, step: ScheduledStep) -> bool:
        """Preempt the newest running sequences until ``seq``'s next chunk fits; False if ``seq`` itself had to go."""
        self.block_manager.release_out_of_window(seq)  # blocks out of the window make room first
        need = seq.num_computed_tokens + num_new_tokens
        while self.block_manager.blocks_needed(seq, need) > self.block_manager.num_free_blocks:
            victim = self.running.pop()
            self._preempt(victim)
            step.preemptions += 1
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free_seq(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.FINISHED
        self.block_manager.free_seq(seq)

    def drop_finished(self) -> None:
        """Forgets finished sequences: running ones, and preempted ones whose last token (in flight) ended them."""
        self.running = [s for s in self.running if not s.is_finished]
        if any(s.is_finished for s in self.waiting):
            self.waiting = deque(s for s in self.waiting if not s.is_finished)

    def abort_all(self) -> int:
        """Drops every unfinished request and frees its blocks; returns how many there were."""
        seqs = self.running + list(self.waiting) + self.waiting_for_grammar
        for seq in self.running:
            self.block_manager.free_seq(seq)
        for seq in seqs:
            seq.status = SequenceStatus.FINISHED
        self.running, self.waiting, self.waiting_for_grammar = [], deque(), []
        return len(seqs)
