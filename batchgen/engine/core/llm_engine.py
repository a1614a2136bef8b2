"""The engine loop: admits requests, schedules steps, hands them to the executor and finishes sequences."""
from __future__ import annotations

import itertools
import logging
import random
import time
from dataclasses import dataclass
from typing import Callable

from batchgen.engine.config import EngineConfig
from batchgen.engine.core.block_manager import BlockManager
from batchgen.engine.core.metrics import EngineMetrics, StepRecord
from batchgen.engine.core.outputs import RequestOutput
from batchgen.engine.core.replica import Replica, attach_tier_blocks, tier_hits
from batchgen.engine.core.scheduler import ScheduledSeq, ScheduledStep, Scheduler
from batchgen.engine.core.sequence import Sequence, placeholder
from batchgen.engine.kv_store import build_prefix_tiers
from batchgen.engine.executor import StepInput, StepOutput, SubmittedStep, build_step_input, make_executor
from batchgen.engine.loading.loader import load_model_source
from batchgen.engine.models.registry import model_config
from batchgen.engine.sampling.params import SamplingParams
from batchgen.engine.sampling.sampler import TokenBitmask
from batchgen.engine.sampling.stopping import finish_reason, output_text
from batchgen.engine.speculative.speculator import build_speculator
from batchgen.engine.sampling.structured import (
    EXTRA_HINT, GrammarCompiler, GrammarState, grammar_key, step_token_bitmask, structured_available,
)

log = logging.getLogger(__name__)

GRAMMAR_WAIT_S = 0.05  # how long an idle step waits for a grammar to compile before returning


@dataclass
class InFlightStep:
    """A submitted step: what was scheduled, and the engine's host time for it so far."""

    steps: list[ScheduledStep]
    inputs: list[StepInput | None]
    submitted: SubmittedStep
    submitted_at: float
    host_s: float  # scheduling, writing the step down, and (once done) applying its tokens
    mask_s: float
    prefill_tokens: int

    @property
    def needs_tokens(self) -> bool:
        """Whether the next step needs this one's tokens written down: a grammar's bitmask, a penalty's counts."""
        return any(i is not None and (i.bitmask is not None or i.sampling.penalties) for i in self.inputs)

    @property
    def has_drafts(self) -> bool:
        return any(i is not None and i.has_drafts for i in self.inputs)


class LLMEngine:
    """Step-driven engine: ``add_request`` then ``step`` until ``has_unfinished`` is False.

    The engine schedules, decides seeds and grammar masks, and applies each step's sampled tokens; the
    ``executor`` (in this process, or worker processes for several devices) holds the weights and the
    KV cache and runs each step from a plain :class:`StepInput`. With ``data_parallel_size`` N there
    are N replicas (``replicas``), each scheduling its own requests; a new request goes to the replica
    holding the fewest prompt tokens.

    ``step_listeners`` are called with each step's :class:`StepRecord` right after the step, on the thread
    that runs it; they must be quick and must not call back into the engine. ``metrics`` holds the totals.
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        source = load_model_source(config.model, config.storage_options)
        self.model_config = model_config(source.config)
        self.tokenizer = source.tokenizer
        self.max_model_len = built_len = self.model_config.context_len(config.max_model_len)
        self.executor = make_executor(config, self.model_config, source, built_len)
        capacity = self.executor.num_blocks * config.block_size
        if capacity < self.max_model_len:
            log.warning("KV cache holds %d tokens (raise kv_cache_memory for more); max_model_len lowered from %d",
                        capacity, self.max_model_len)
            self.max_model_len = capacity
        window = self.executor.kv_layout.window  # every layer slides: blocks out of it are freed while running
        # Host and store tiers below the device prefix cache, shared by the replicas.
        self.prefix_tiers = build_prefix_tiers(config, source, self.model_config, self.executor.rank_kv_layout,
                                               built_len, self.executor.kv_shards)
        self.replicas = [Replica(config, self.executor.num_blocks, self.max_model_len, window, self.prefix_tiers)
                         for _ in range(config.data_parallel_size)]
        # Replicas whose MoE layers exchange tokens must all run every step, idle or not.
        self.lockstep = config.expert_parallel(self.model_config) and len(self.replicas) > 1
        self.eos_ids = frozenset(self._eos_ids(source))
        self._ids = itertools.count()
        self._seed_rng = random.Random()
        self.step_listeners: list[Callable[[StepRecord], None]] = []
        self._grammars: GrammarCompiler | None = None
        self.overlap = config.overlap
        if config.overlap_schedule == "on" and not self.overlap:
            log.info("overlapped scheduling off: worker ranks learn each step's tokens only through the engine")
        self._in_flight: InFlightStep | None = None
        self._last_done = 0.0  # when the latest step's tokens arrived
        self.speculator = build_speculator(self, LLMEngine)
        if self.speculator is not None and self.speculator.needs_hidden_states:
            self.overlap = False  # the proposer reads each step's hidden states before the next is planned
        self.reset_metrics()

    @property
    def scheduler(self) -> Scheduler:
        """The first replica's scheduler (the only one without data parallelism)."""
        return self.replicas[0].scheduler

    @property
    def block_manager(self) -> BlockManager:
        return self.replicas[0].block_manager

    @property
    def token_budget(self) -> int:
        """Tokens one step may compute over all replicas."""
        return self.config.max_num_batched_tokens * len(self.replicas)

    def _eos_ids(self, source) -> list[int]:
        eos = source.generation_config.get("eos_token_id", source.config.get("eos_token_id"))
        ids = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
        return list(ids) + list(getattr(self.tokenizer, "eos_token_ids", None) or [])

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    keep_probs: bool = False, noise_offset: int = 0) -> Sequence | RequestOutput:
        """Queues a request; a prompt the engine cannot take comes back at once as an error output.
        ``keep_probs`` (engine-internal: a draft model's sampled drafts) keeps each token's sampling distribution
        on the device, in ``RequestOutput.probs``; ``noise_offset`` (its coupled drafts) shifts the output index
        its seeded noise is drawn for."""
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
        elif self.speculator is not None and (params.penalized or params.min_tokens):
            error = "penalties and min_tokens are not taken with speculative decoding"
        if error:
            return RequestOutput(seq_id, list(prompt_token_ids), finish_reason="error", error=error)
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(62)
        seq = Sequence(seq_id, list(prompt_token_ids), params, seed=seed, probs=[] if keep_probs else None,
                       noise_offset=noise_offset)
        key = grammar_key(params)
        if key is not None:
            seq.grammar = GrammarState(self._grammar_compiler().submit(key))
        min(self.replicas, key=lambda r: r.prompt_tokens).add(seq)
        if self.speculator is not None:
            self.speculator.add_request(seq)
        return seq

    def _grammar_compiler(self) -> GrammarCompiler:
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.eos_ids)
        return self._grammars

    def abort_all(self) -> int:
        """Drops every unfinished request (a caller that stopped reading their outputs)."""
        self._drain()
        if self.speculator is not None:
            self.speculator.drop_all()
        return sum(r.abort_all() for r in self.replicas)

    def has_unfinished(self) -> bool:
        """Whether a request is unfinished or a step is still in flight (``step`` until it is not)."""
        return self._in_flight is not None or any(r.scheduler.has_unfinished() for r in self.replicas)

    @property
    def num_unfinished(self) -> int:
        return sum(r.scheduler.num_unfinished for r in self.replicas)

    def step(self) -> list[RequestOutput]:
        """Runs one scheduled step (of every replica that has work); returns the requests that finished.

        With overlapped scheduling the step is left running on the device and the previous step's tokens
        are applied while it runs: its sequences are scheduled around placeholders for those tokens, and a
        sequence found finished a step late drops the one extra token it computed.
        """
        finished: list[RequestOutput] = []
        for replica in self.replicas:
            finished += [self._grammar_failed(seq) for seq in replica.promote_compiled()]
        previous, self._in_flight = self._in_flight, None
        drafting = self.speculator is not None and self.speculator.plan(self._running())
        if previous is not None and (previous.needs_tokens or drafting):
            # A grammar's next bitmask or a penalty needs the token sampled before, a proposal the tokens before
            # it: no overlap for this step.
            finished += self._complete(previous)
            previous = None
        drafts = self.speculator.propose(self._running()) if drafting else None
        start = time.perf_counter()  # the proposer's time is its own cost in the policy, not the step's
        steps = [r.scheduler.schedule(drafts) for r in self.replicas]
        launched = self._launch(steps, start) if any(step.seqs for step in steps) else None
        if previous is not None:
            finished += self._complete(previous)
        if launched is None:
            if previous is None and not finished:  # only requests whose grammar is compiling: wait, don't spin
                next((r.scheduler for r in self.replicas if r.scheduler.waiting_for_grammar),
                     self.scheduler).wait_for_grammars(GRAMMAR_WAIT_S)
            return finished
        self._defer_sampled_tokens(launched)
        if self.overlap and not launched.has_drafts:  # the next proposals need a verifying step's tokens
            self._in_flight = launched
        else:
            finished += self._complete(launched)
        return finished

    def _running(self) -> list[Sequence]:
        return [seq for r in self.replicas for seq in r.scheduler.running]

    def _launch(self, steps: list[ScheduledStep], start: float) -> "InFlightStep":
        """Writes the replicas' steps down, advances their sequences' computed tokens and submits the step."""
        mask_start = time.perf_counter()
        bitmasks = [self._token_bitmask(step.seqs) for step in steps]
        launch_mask_s = time.perf_counter() - mask_start
        # The drafted positions' masks were computed while proposing (before ``start``): they count as masks.
        mask_s = launch_mask_s + (self.speculator.take_mask_seconds() if self.speculator is not None else 0.0)
        inputs = self._step_inputs(steps, bitmasks)
        if self.prefix_tiers is not None:
            for step, step_input in zip(steps, inputs):
                if step_input is not None:
                    attach_tier_blocks(step, step_input)
        seqs = [s for step in steps for s in step.seqs]
        prefill = sum(max(0, min(s.seq.num_prompt_tokens, s.seq.num_computed_tokens + s.num_new_tokens)
                          - s.seq.num_computed_tokens) for s in seqs)
        for s in seqs:
            s.seq.num_computed_tokens += s.num_new_tokens
        submitted_at = time.perf_counter()
        return InFlightStep(steps, inputs, self.executor.submit(inputs), submitted_at,
                            host_s=submitted_at - start - launch_mask_s, mask_s=mask_s, prefill_tokens=prefill)

    def _defer_sampled_tokens(self, launched: "InFlightStep") -> None:
        """Gives each sequence sampled in the launched step a placeholder for its token until it arrives."""
        for step in launched.steps:
            row = 0
            for s in step.seqs:
                if s.sample:
                    if not s.seq.is_finished:
                        s.seq.token_ids.append(placeholder(row))
                    row += 1

    def _complete(self, launched: "InFlightStep") -> list[RequestOutput]:
        """Waits for a launched step's tokens and applies them; returns the requests they finished."""
        outputs = launched.submitted.result()
        done = time.perf_counter()
        device_start = max(launched.submitted_at, self._last_done)  # overlapped steps share no device time
        self._last_done = done
        finished: list[RequestOutput] = []
        for replica, step, step_input, out in zip(self.replicas, launched.steps, launched.inputs, outputs):
            if step.saves and self.prefix_tiers is not None:
                self.prefix_tiers.save(step.saves, out.saved_kv)
            if step.seqs:
                finished += self._apply(replica, step.seqs, out)
                if self.speculator is not None:
                    self.speculator.observe_step(step.seqs, step_input, out)
        launched.host_s += time.perf_counter() - done
        self._record(launched, outputs, device_start, done - device_start)
        return finished

    def _drain(self) -> None:
        """Waits for the step in flight and drops its tokens (its sequences were aborted)."""
        launched, self._in_flight = self._in_flight, None
        if launched is not None:
            launched.submitted.result()

    def _step_inputs(self, steps: list[ScheduledStep], bitmasks: list[TokenBitmask | None]
                     ) -> list[StepInput | None]:
        """Each replica's step as the executor takes it; None for an idle replica, unless the replicas
        run in lockstep: then it runs an empty step, and every step carries all replicas' token counts."""
        probs = self.speculator.draft_probs if self.speculator is not None else None
        inputs = [build_step_input(step.seqs, mask, probs, self.eos_ids) if step.seqs else None
                  for step, mask in zip(steps, bitmasks)]
        if not self.lockstep:
            return inputs
        inputs = [i if i is not None else StepInput() for i in inputs]
        sizes = tuple(i.num_tokens for i in inputs)
        for i in inputs:
            i.dp_num_tokens = sizes
        return inputs

    def _apply(self, replica: Replica, scheduled: list[ScheduledSeq], out: StepOutput) -> list[RequestOutput]:
        """Puts the step's tokens in place of their placeholders (a verifying row: its accepted drafts and the
        token after them, up to the one that finishes it) and finishes the sequences they end."""
        finished = []
        sampled = [s for s in scheduled if s.sample]
        if len(out.tokens) != len(sampled):
            raise RuntimeError(f"the step sampled tokens for {len(out.tokens)} rows, not {len(sampled)} sequences")
        for row, s in enumerate(sampled):
            seq = s.seq
            if seq.is_finished:  # it ended a step late (or was aborted): this token is one too many
                continue
            tokens = out.tokens[row]
            seq.token_ids.pop()  # the placeholder
            if seq.probs is not None:  # a request that keeps them samples one token a step (it never drafts)
                seq.probs.append(out.probs[row])
            kept = 0
            for i, token in enumerate(tokens):
                seq.token_ids.append(token)
                kept += 1
                if seq.grammar is not None:
                    seq.grammar.advance(seq.token_ids, seq.num_prompt_tokens)
                if seq.params.logprobs:
                    seq.logprobs.append(out.logprobs[row][i])
                seq.finish_reason = finish_reason(seq, self.eos_ids, self.max_model_len, self.tokenizer)
                if seq.finish_reason:
                    break
            if s.drafts:  # accepted: the decode steps the kept tokens saved (a stop may end the row among them)
                self.speculator.verified(seq.seq_id, len(s.drafts), kept - 1)
            if seq.finish_reason:
                replica.finish(seq)
                if self.speculator is not None:
                    self.speculator.finish(seq)
                finished.append(self._output(seq))
            elif s.drafts:  # the rejected drafts' KV is overwritten later: their slots past the end go back
                seq.num_computed_tokens = seq.num_tokens - 1
                replica.block_manager.truncate(seq, seq.num_tokens)
        if finished:
            replica.scheduler.drop_finished()
        return finished

    def _token_bitmask(self, scheduled: list[ScheduledSeq]) -> TokenBitmask | None:
        """The grammar rows' allowed tokens at each verified position, or None when no sampling row has one."""
        sampling = [s for s in scheduled if s.sample]
        known = self.speculator.grammar_masks if self.speculator is not None else {}
        return step_token_bitmask([s.seq.grammar for s in sampling], [s.drafts for s in sampling],
                                  [known.get(s.seq.seq_id) for s in sampling], self.model_config.vocab_size)

    def _grammar_failed(self, seq: Sequence) -> RequestOutput:
        return RequestOutput(seq.seq_id, seq.token_ids[:seq.num_prompt_tokens], finish_reason="error",
                             error=seq.grammar.error)

    def reset_metrics(self) -> None:
        """Starts the counters in ``metrics`` afresh (e.g. after a warm-up); the expert load balancer's
        latest report stays (its placement stays in use)."""
        previous = getattr(self, "metrics", None)
        self.metrics = EngineMetrics()
        self.metrics.eplb = previous.eplb if previous is not None else None
        if self.speculator is not None:
            self.metrics.spec_method = self.speculator.config.method

    def shutdown(self) -> None:
        """Stops the executor's workers and the grammar compiler; the engine cannot run afterwards."""
        self._in_flight = None
        if self.prefix_tiers is not None:
            self.prefix_tiers.close()  # queued store writes land first, and count
            self.metrics.add_tier_counters(self.prefix_tiers.take_counters())
        self.executor.shutdown()
        if self.speculator is not None:
            self.speculator.close()
        if self._grammars is not None:
            self._grammars.close()

    def _record(self, launched: "InFlightStep", outputs: list[StepOutput | None], start: float,
                elapsed: float) -> None:
        """Counts the step of every replica and tells the listeners."""
        steps, inputs = launched.steps, launched.inputs
        seqs = [s for step in steps for s in step.seqs]
        prefill = launched.prefill_tokens
        grammar_rows = sum(len(i.bitmask.rows) for i in inputs if i is not None and i.bitmask is not None)
        ran = [o for o in outputs if o is not None]
        spec = self.speculator.take_counts() if self.speculator is not None else {}
        record = StepRecord(
            start_s=start, duration_s=elapsed, num_seqs=len(seqs), prefill_tokens=prefill,
            decode_tokens=sum(s.num_new_tokens for s in seqs) - prefill,
            sampled_tokens=sum(len(o.tokens) for o in ran) + spec.get("spec_accepted_tokens", 0),
            token_budget=self.token_budget,
            padded_tokens=sum(o.padded_tokens for o in ran),
            prefix_cache_queries=sum(step.prefix_cache_queries for step in steps),
            prefix_cache_hits=sum(step.prefix_cache_hits for step in steps),
            preemptions=sum(step.preemptions for step in steps),
            grammar_rows=grammar_rows, mask_time_s=launched.mask_s if grammar_rows else 0.0,
            comm_time_s=max((o.comm_s for o in ran), default=0.0),
            host_time_s=launched.host_s, prepare_time_s=max((o.prepare_s for o in ran), default=0.0),
            replica_tokens=tuple(i.num_tokens if i is not None else 0 for i in inputs)
            if len(inputs) > 1 else (), eplb=next((o.eplb for o in ran if o.eplb is not None), None),
            **self._tier_counts(steps), **spec)
        self.metrics.add_step(record)
        if self.speculator is not None:
            # A grammar row's masks are computed per verified position: drafting pays for them too.
            self.speculator.step_done(record.prefill_tokens, record.num_tokens,
                                      elapsed + launched.host_s + launched.mask_s, record.spec_draft_rows > 0)
            self.metrics.spec_policy = self.speculator.figures()
        for listener in self.step_listeners:
            listener(record)

    def _tier_counts(self, steps: list[ScheduledStep]) -> dict:
        """The lower prefix tiers' share of the step's record; also tells them what prefill costs."""
        tiers = self.prefix_tiers
        if tiers is None:
            return {}
        m = self.metrics
        if m.prompt_tokens_computed:
            tiers.seconds_per_token = m.prefill_time_s / m.prompt_tokens_computed
        return {**tier_hits(steps), **tiers.take_counters()}

    def _output(self, seq: Sequence) -> RequestOutput:
        text, cut = output_text(seq, self.tokenizer)
        # A stop string cuts the text the grammar matched: what is left is not a whole match.
        complete = seq.grammar.is_complete and not cut if seq.grammar is not None else None
        return RequestOutput(
            request_id=seq.seq_id, prompt_token_ids=seq.token_ids[:seq.num_prompt_tokens],
            token_ids=seq.completion_token_ids, text=text,
            finish_reason=seq.finish_reason, logprobs=list(seq.logprobs) if seq.params.logprobs else None,
            num_cached_tokens=seq.num_cached_tokens, grammar_complete=complete, probs=seq.probs)
