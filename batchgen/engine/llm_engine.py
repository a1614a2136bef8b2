"""The engine loop: admits requests, schedules steps, runs the model and finishes sequences."""
from __future__ import annotations

import itertools
import logging
import random
import time
from typing import Callable

from batchgen.engine.block_manager import BlockManager
from batchgen.engine.config import EngineConfig, ModelConfig
from batchgen.engine.loader import load_model_source
from batchgen.engine.metrics import EngineMetrics, StepRecord
from batchgen.engine.model_runner import ModelRunner
from batchgen.engine.outputs import RequestOutput
from batchgen.engine.sampling_params import SamplingParams
from batchgen.engine.sampler import TokenBitmask
from batchgen.engine.scheduler import ScheduledSeq, ScheduledStep, Scheduler
from batchgen.engine.sequence import Sequence
from batchgen.engine.stopping import finish_reason, output_text
from batchgen.engine.structured import (
    EXTRA_HINT, GrammarCompiler, GrammarState, grammar_key, structured_available, token_bitmask,
)

log = logging.getLogger(__name__)

GRAMMAR_WAIT_S = 0.05  # how long an idle step waits for a grammar to compile before returning


def model_context_len(cfg: ModelConfig, requested: int | None = None) -> int:
    """The longest sequence the engine runs: the model's context, or ``requested``."""
    limit = cfg.max_position_embeddings
    if requested is not None:
        if requested > limit:
            raise ValueError(f"max_model_len {requested} exceeds the model's limit of {limit} tokens")
        return requested
    return limit


class LLMEngine:
    """Step-driven engine: ``add_request`` then ``step`` until ``has_unfinished`` is False.

    ``step_listeners`` are called with each step's :class:`StepRecord` right after the step, on the thread
    that runs it; they must be quick and must not call back into the engine. ``metrics`` holds the totals.
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        source = load_model_source(config.model, config.storage_options)
        self.model_config = ModelConfig.from_hf(source.config)
        self.tokenizer = source.tokenizer
        self.max_model_len = model_context_len(self.model_config, config.max_model_len)
        self.runner = ModelRunner(config, self.model_config, source, self.max_model_len)
        if self.runner.kv_capacity_tokens < self.max_model_len:
            log.warning("KV cache holds %d tokens; max_model_len lowered from %d",
                        self.runner.kv_capacity_tokens, self.max_model_len)
            self.max_model_len = self.runner.kv_capacity_tokens
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size,
                                          config.enable_prefix_caching, window=self.runner.kv_layout.window)
        self.scheduler = Scheduler(self.block_manager, config.max_num_batched_tokens, config.max_num_seqs)
        self.eos_ids = frozenset(self._eos_ids(source))
        self._ids = itertools.count()
        self._seed_rng = random.Random()
        self.step_listeners: list[Callable[[StepRecord], None]] = []
        self._grammars: GrammarCompiler | None = None
        self.reset_metrics()

    def _eos_ids(self, source) -> list[int]:
        eos = source.generation_config.get("eos_token_id", source.config.get("eos_token_id"))
        ids = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
        return list(ids) + list(getattr(self.tokenizer, "eos_token_ids", None) or [])

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams) -> Sequence | RequestOutput:
        """Queues a request; a prompt the engine cannot take comes back at once as an error output."""
        seq_id = next(self._ids)
        error = None
        if not prompt_token_ids:
            error = "empty prompt"
        elif len(prompt_token_ids) > self.max_model_len:
            error = (f"prompt has {len(prompt_token_ids)} tokens, more than max_model_len "
                     f"{self.max_model_len}")
        elif max(prompt_token_ids) >= self.model_config.vocab_size or min(prompt_token_ids) < 0:
            error = f"prompt has token ids outside the vocabulary (0..{self.model_config.vocab_size - 1})"
        elif params.constrained and not structured_available():
            error = EXTRA_HINT
        if error:
            return RequestOutput(seq_id, list(prompt_token_ids), finish_reason="error", error=error)
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(62)
        seq = Sequence(seq_id, list(prompt_token_ids), params, seed=seed)
        key = grammar_key(params)
        if key is not None:
            seq.grammar = GrammarState(self._grammar_compiler().submit(key))
        self.scheduler.add(seq)
        return seq

    def _grammar_compiler(self) -> GrammarCompiler:
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.eos_ids)
        return self._grammars

    def abort_all(self) -> int:
        """Drops every unfinished request (a caller that stopped reading their outputs)."""
        return self.scheduler.abort_all()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_unfinished(self) -> int:
        return self.scheduler.num_unfinished

    def step(self) -> list[RequestOutput]:
        """Runs one scheduled step; returns the requests that finished in it."""
        finished = [self._grammar_failed(seq) for seq in self.scheduler.promote_compiled()]
        step = self.scheduler.schedule()
        scheduled = step.seqs
        if not scheduled:
            if not finished:  # only requests whose grammar is compiling: wait a little instead of spinning
                self.scheduler.wait_for_grammars(GRAMMAR_WAIT_S)
            return finished
        mask_start = time.perf_counter()
        bitmask = self._token_bitmask(scheduled)
        start = time.perf_counter()
        tokens, logprobs = self.runner.run(scheduled, bitmask)
        self._record(step, start, time.perf_counter() - start, bitmask, start - mask_start)
        row = 0
        for s in scheduled:
            seq = s.seq
            seq.num_computed_tokens += s.num_new_tokens
            if not s.sample:
                continue
            seq.token_ids.append(tokens[row])
            if seq.grammar is not None:
                seq.grammar.advance(seq.token_ids, seq.num_prompt_tokens)
            if seq.params.logprobs:
                seq.logprobs.append(logprobs[row])
            row += 1
            reason = finish_reason(seq, self.eos_ids, self.max_model_len, self.tokenizer)
            if reason:
                seq.finish_reason = reason
                self.scheduler.finish(seq)
                finished.append(self._output(seq))
        if finished:
            self.scheduler.drop_finished()
        return finished

    def _token_bitmask(self, scheduled: list[ScheduledSeq]) -> TokenBitmask | None:
        """The grammar rows' allowed tokens, or None when no sampling row has a grammar."""
        sampling = [s.seq for s in scheduled if s.sample]
        rows = [i for i, seq in enumerate(sampling) if seq.grammar is not None]
        if not rows:
            return None
        return token_bitmask([sampling[i].grammar for i in rows], rows, self.model_config.vocab_size)

    def _grammar_failed(self, seq: Sequence) -> RequestOutput:
        return RequestOutput(seq.seq_id, seq.token_ids[:seq.num_prompt_tokens], finish_reason="error",
                             error=seq.grammar.error)

    def reset_metrics(self) -> None:
        """Starts the counters in ``metrics`` afresh (e.g. after a warm-up)."""
        self.metrics = EngineMetrics()

    def _record(self, step: ScheduledStep, start: float, elapsed: float, bitmask: TokenBitmask | None,
                mask_s: float) -> None:
        """Counts the step (before its sequences advance) and tells the listeners."""
        prefill = sum(max(0, min(s.seq.num_prompt_tokens, s.seq.num_computed_tokens + s.num_new_tokens)
                          - s.seq.num_computed_tokens) for s in step.seqs)
        record = StepRecord(
            start_s=start, duration_s=elapsed, num_seqs=len(step.seqs), prefill_tokens=prefill,
            decode_tokens=sum(s.num_new_tokens for s in step.seqs) - prefill,
            sampled_tokens=sum(s.sample for s in step.seqs), token_budget=self.scheduler.max_num_batched_tokens,
            padded_tokens=self.runner.padded_tokens, prefix_cache_queries=step.prefix_cache_queries,
            prefix_cache_hits=step.prefix_cache_hits, preemptions=step.preemptions,
            grammar_rows=len(bitmask.rows) if bitmask is not None else 0,
            mask_time_s=mask_s if bitmask is not None else 0.0)
        self.metrics.add_step(record)
        for listener in self.step_listeners:
            listener(record)

    def _output(self, seq: Sequence) -> RequestOutput:
        return RequestOutput(
            request_id=seq.seq_id, prompt_token_ids=seq.token_ids[:seq.num_prompt_tokens],
            token_ids=seq.completion_token_ids, text=output_text(seq, self.tokenizer),
            finish_reason=seq.finish_reason, logprobs=list(seq.logprobs) if seq.params.logprobs else None,
            num_cached_tokens=seq.num_cached_tokens,
            grammar_complete=seq.grammar.is_complete if seq.grammar is not None else None)
