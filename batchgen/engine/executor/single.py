"""The single-process executor: the model runner lives in the engine's own process (today's path)."""
from __future__ import annotations

from typing import Sequence

from batchgen.engine.config import EngineConfig, ModelConfig
from batchgen.engine.executor.step import StepInput, StepOutput
from batchgen.engine.model_runner import ModelRunner
from batchgen.engine.model_source import ModelSource


class SingleProcessExecutor:
    """One replica, one device: each step is a direct call, nothing is copied or sent."""

    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, source: ModelSource, max_model_len: int):
        self.runner = ModelRunner(config, model_cfg, source, max_model_len)
        self.runner.allocate_kv_cache(self.runner.kv_blocks_available())
        self.num_blocks = self.runner.num_blocks
        self.profile, self.kv_layout = self.runner.profile, self.runner.kv_layout

    def execute(self, steps: Sequence[StepInput | None]) -> list[StepOutput | None]:
        (step,) = steps
        return [self.runner.execute(step) if step is not None else None]

    def shutdown(self) -> None:
        pass
