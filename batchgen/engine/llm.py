"""The public entry point: ``LLM(model).generate(prompts, params)`` and its streaming form."""
from __future__ import annotations

import copy
import threading
from dataclasses import fields
from typing import Any, Iterable, Iterator, Sequence as Seq

from tqdm import tqdm

from batchgen.engine.config import EngineConfig
from batchgen.engine.flops import engine_figures, engine_peak_flops
from batchgen.engine.core.llm_engine import LLMEngine
from batchgen.engine.core.metrics import EngineMetrics
from batchgen.engine.models.base import ModelProfile
from batchgen.engine.core.outputs import RequestOutput
from batchgen.engine.sampling.params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Offline generation over a model folder, a GGUF file or a built-in name.

    ``dtype="auto"`` runs bf16 where the hardware computes it natively and fp32 on CPUs that would
    emulate bf16 (fp16 on GPUs without bf16); ``llm.config.dtype_choice`` says which and why.

    >>> llm = LLM("smollm2-135m-instruct", device="cpu")
    >>> llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))[0].text

    ``tensor_parallel_size``, ``data_parallel_size`` and ``enable_expert_parallel`` (see EngineConfig)
    spread the model over several devices, one worker process each; ``close()`` (or leaving a ``with``
    block) stops them, and they stop on their own when this process exits.
    """

    def __init__(self, model: str, **engine_options: Any):
        """``engine_options`` are EngineConfig's fields (``dtype``, ``device``, ``max_num_batched_tokens``, ...)."""
        self.config = EngineConfig(model=model, **engine_options)
        self.engine = LLMEngine(self.config)
        self.tokenizer = self.engine.tokenizer

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        return cls(**{f.name: getattr(config, f.name) for f in fields(config)})

    def close(self) -> None:
        """Stops the engine's worker processes (if any); the LLM cannot generate afterwards."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def profile(self) -> ModelProfile:
        """The model's parameter and FLOP profile (active parameters, attention FLOPs per key, weight format)."""
        return self.engine.executor.profile

    def metrics(self, wall_s: float | None = None, counters: EngineMetrics | None = None) -> dict[str, Any]:
        """The engine's counters since its last ``reset_metrics`` (or ``counters``, totals a caller summed from
        step records) and the figures derived from them, as plain data: rates, budget use, achieved FLOP/s and
        ``mfu`` (None where the GPU's peak is unknown) over ``wall_s`` (default: the steps' own time). ``["eplb"]`` is
        the expert load balancer's report (balancedness before/after, rebalances, moved bytes, per-layer loads)
        with ``enable_eplb``, else None."""
        m = self.engine.metrics if counters is None else with_settings(counters, self.engine.metrics)
        wall = m.prefill_time_s + m.decode_time_s if wall_s is None else wall_s
        return engine_figures(m, wall, self.engine.token_budget, self.profile(), engine_peak_flops(self.config))

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def _token_ids(self, prompt: Prompt) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def generate(self, prompts: Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generates for every prompt; outputs come back in the prompts' order. A single prompt (a string, or
        one list of token ids) is a batch of one."""
        if hasattr(prompts, "tolist"):  # a NumPy or torch array of token ids (one prompt, or a row per prompt)
            prompts = prompts.tolist()
        if isinstance(prompts, str) or (len(prompts) > 0 and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]  # type: ignore[list-item]
        params = params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        elif len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        outputs: list[RequestOutput | None] = [None] * len(prompts)
        bar = tqdm(total=len(prompts), disable=not use_tqdm, desc="generate")
        for index, out in self.generate_stream((i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))):
            outputs[index] = out
            bar.update(1)
        bar.close()
        return outputs  # type: ignore[return-value]

    def chat(self, messages: Seq[dict] | Seq[Seq[dict]], params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = False, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Generates a reply to a conversation (a list of ``{"role", "content"}`` messages) or to each of several,
        through the model's chat template, as vLLM's ``LLM.chat``."""
        chats = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer.apply_chat_template(list(chat), add_generation_prompt=add_generation_prompt)
                   for chat in chats]
        return self.generate(prompts, params, use_tqdm)

    def generate_stream(self, requests: Iterable[tuple[Any, Prompt, SamplingParams]],
                        max_pending: int | None = None, cancel: threading.Event | None = None
                        ) -> Iterator[tuple[Any, RequestOutput]]:
        """Yields ``(key, output)`` as each request finishes, pulling requests lazily; once ``cancel`` is set
        (checked before every step) the unfinished requests are aborted and the stream ends.

        At most ``max_pending`` requests (default: twice ``max_num_seqs`` per replica) are inside the engine at once, so
        the caller's iterator is read only as fast as the engine can take work, and the engine is never idle
        while requests remain.
        """
        limit = max_pending or 2 * self.config.max_num_seqs * self.config.data_parallel_size
        source = iter(requests)
        keys: dict[int, Any] = {}
        exhausted = False
        try:
            while True:
                while not exhausted and self.engine.num_unfinished < limit:
                    item = next(source, None)
                    if item is None:
                        exhausted = True
                        break
                    key, prompt, params = item
                    added = self.engine.add_request(self._token_ids(prompt), params)
                    if isinstance(added, RequestOutput):
                        yield key, added
                    else:
                        keys[added.seq_id] = key
                if not self.engine.has_unfinished():
                    if exhausted:
                        return
                    continue
                if cancel is not None and cancel.is_set():
                    return
                for out in self.engine.step():
                    yield keys.pop(out.request_id), out
        finally:
            if keys:  # the caller stopped early or a step failed: leave the engine empty for the next stream
                self.engine.abort_all()


def with_settings(counters: EngineMetrics, engine: EngineMetrics) -> EngineMetrics:
    """Totals a caller summed from step records, with the engine's states that no step record carries
    (the speculative method and its cost model's fit)."""
    merged = copy.copy(counters)
    merged.adopt_states(engine.states())
    return merged
