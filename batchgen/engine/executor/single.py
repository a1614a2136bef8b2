"""The single-process executor: the model runner lives in the engine's own process (today's path)."""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import torch

from batchgen.engine.config import EngineConfig, ModelConfig
from batchgen.engine.executor.model_runner import LaunchedStep, ModelRunner
from batchgen.engine.executor.step import StepInput, StepOutput
from batchgen.engine.loading.model_source import ModelSource


class SingleProcessExecutor:
    """One replica, one device: each step is a direct call, nothing is copied or sent.

    With ``config.overlap`` a single "device stream" thread launches the steps in order, so that ``submit``
    returns while the step runs (on CUDA the thread only queues kernels; on CPU it computes them).
    """

    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, source: ModelSource, max_model_len: int):
        self.runner = ModelRunner(config, model_cfg, source, max_model_len)
        self.runner.allocate_kv_cache(self.runner.kv_blocks_available())
        self.num_blocks = self.runner.num_blocks
        self.profile, self.kv_layout = self.runner.profile, self.runner.kv_layout
        self.rank_kv_layout, self.kv_shards = self.kv_layout, 1
        self._stream = ThreadPoolExecutor(1, thread_name_prefix="device-stream", initializer=self._bind_device,
                                          initargs=(cuda_index(self.runner.device),)) if config.overlap else None

    @staticmethod
    def _bind_device(index: int | None) -> None:
        if index is not None:  # the current CUDA device is per thread
            torch.cuda.set_device(index)

    def execute(self, steps: Sequence[StepInput | None]) -> list[StepOutput | None]:
        return self.submit(steps).result()

    def submit(self, steps: Sequence[StepInput | None]) -> "InProcessStep":
        """Starts the step; the step submitted next may refer to its sampled tokens (``deferred_rows``)."""
        (step,) = steps
        if step is None:
            return InProcessStep(None)
        if self._stream is None:
            return InProcessStep(self.runner.launch(step))
        return InProcessStep(self._stream.submit(self.runner.launch, step))

    def shutdown(self) -> None:
        if self._stream is not None:
            self._stream.shutdown(wait=True)


def cuda_index(device: torch.device) -> int | None:
    """The CUDA device's index (a bare ``cuda`` means the calling thread's current one); None off CUDA."""
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


class InProcessStep:
    """A step in flight on the device; ``result`` waits for its outputs (one per replica)."""

    def __init__(self, launched: LaunchedStep | Future | None):
        self._launched = launched

    def result(self) -> list[StepOutput | None]:
        launched = self._launched
        if isinstance(launched, Future):
            launched = launched.result()
        return [launched.result() if launched is not None else None]
