"""A data-parallel engine replica (a scheduler over its own KV cache), and what its steps take from the lower
prefix tiers."""
from __future__ import annotations

import torch

from batchgen.engine.config import EngineConfig
from batchgen.engine.core.block_manager import BlockManager
from batchgen.engine.core.scheduler import ScheduledStep, Scheduler
from batchgen.engine.core.sequence import Sequence
from batchgen.engine.executor.step import StepInput
from batchgen.engine.kv_store import PrefixTiers


class Replica:
    """One data-parallel engine replica: a scheduler over its own KV cache, and the prompt tokens of the
    requests it holds (what new requests are balanced on)."""

    def __init__(self, config: EngineConfig, num_blocks: int, max_model_len: int, window: int | None = None,
                 tiers: PrefixTiers | None = None):
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching, window=window,
                                          record_completed=tiers is not None, max_model_len=max_model_len)
        self.scheduler = Scheduler(self.block_manager, config.max_num_batched_tokens, config.max_num_seqs,
                                   max_model_len, tiers)
        self.prompt_tokens = 0

    def add(self, seq: Sequence) -> None:
        self.prompt_tokens += seq.num_prompt_tokens
        self.scheduler.add(seq)

    def finish(self, seq: Sequence) -> None:
        self.prompt_tokens -= seq.num_prompt_tokens
        self.scheduler.finish(seq)

    def abort_all(self) -> int:
        self.prompt_tokens = 0
        return self.scheduler.abort_all()

    def promote_compiled(self) -> list[Sequence]:
        """Queues the requests whose grammar compiled; returns those whose grammar failed (finished)."""
        failed = self.scheduler.promote_compiled()
        self.prompt_tokens -= sum(seq.num_prompt_tokens for seq in failed)
        return failed


def attach_tier_blocks(step: ScheduledStep, inputs: StepInput) -> None:
    """Writes the blocks the lower prefix tiers restore and the blocks to save into what the executor runs."""
    rows = [row for r in step.restores for row in r.rows]
    if rows:
        inputs.restore_blocks = [b for r in step.restores for b in r.block_ids]
        inputs.restore_kv = torch.stack(rows)
    inputs.save_blocks = [block_id for block_id, _, _ in step.saves]


def tier_hits(steps: list[ScheduledStep]) -> dict[str, int]:
    """Tokens the steps' admissions took from each lower prefix tier, under StepRecord's field names."""
    return {"prefix_cache_host_hits": sum(r.host_tokens for s in steps for r in s.restores),
            "prefix_cache_store_hits": sum(r.store_tokens for s in steps for r in s.restores)}
