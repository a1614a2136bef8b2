"""The execution boundary: the engine hands an executor one StepInput per replica and gets StepOutputs back.

``SingleProcessExecutor`` runs the model in the engine's process (one device); ``MultiprocExecutor``
spawns a worker per rank for tensor and data parallelism. Both offer ``execute`` and ``submit`` (which
returns while the step runs, where the executor overlaps steps), ``shutdown``, the
whole model's ``profile`` and ``kv_layout``, ``rank_kv_layout`` (what one tensor-parallel rank's cache holds),
``kv_shards`` (the distinct rank caches a block's KV spans: 1 where every rank holds it whole), and
``num_blocks``, the KV blocks each replica may use.
"""
from __future__ import annotations

from typing import Protocol, Sequence

from batchgen.engine.config import EngineConfig, ModelConfig
from batchgen.engine.core.kv_cache import KVLayout
from batchgen.engine.executor.step import SamplingRows, StepInput, StepOutput, build_step_input
from batchgen.engine.loading.model_source import ModelSource
from batchgen.engine.models.base import ModelProfile


class SubmittedStep(Protocol):
    def result(self) -> list[StepOutput | None]:
        """Waits for the step; one output per replica."""
        ...


class StepExecutor(Protocol):
    num_blocks: int
    profile: ModelProfile
    kv_layout: KVLayout
    rank_kv_layout: KVLayout
    kv_shards: int

    def execute(self, steps: Sequence[StepInput | None]) -> list[StepOutput | None]:
        """Runs one step per replica (None: the replica sits it out) and returns their outputs."""
        ...

    def submit(self, steps: Sequence[StepInput | None]) -> SubmittedStep:
        """Starts ``execute``'s work and returns at once where the executor overlaps steps."""
        ...

    def shutdown(self) -> None: ...


def make_executor(config: EngineConfig, model_cfg: ModelConfig, source: ModelSource,
                  max_model_len: int) -> StepExecutor:
    """In-process for a single device; one worker process per device otherwise."""
    if config.world_size == 1:
        from batchgen.engine.executor.single import SingleProcessExecutor

        return SingleProcessExecutor(config, model_cfg, source, max_model_len)
    from batchgen.engine.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config, model_cfg, source.path, max_model_len)


__all__ = ["SamplingRows", "StepExecutor", "StepInput", "StepOutput", "SubmittedStep", "build_step_input",
           "make_executor"]
