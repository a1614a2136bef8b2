"""What the engine measures: one record per step, and running totals over the steps."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

# The lower prefix tiers (host memory, persistent store): tokens they served and the store's traffic.
PREFIX_TIER_FIELDS = (
    "prefix_cache_host_hits", "prefix_cache_store_hits", "prefix_store_bytes_read", "prefix_store_bytes_written",
    "prefix_store_load_time_s", "prefix_store_wait_time_s", "prefix_store_misses_absent",
    "prefix_store_misses_corrupt", "prefix_store_misses_foreign", "prefix_store_misses_error",
)
SPEC_FIELDS = ("spec_decode_seqs", "spec_drafting_seqs", "spec_planned_tokens", "spec_probe_steps",
               "spec_draft_rows", "spec_draft_tokens", "spec_accepted_tokens")


@dataclass(frozen=True)
class StepRecord:
    """One engine step, handed to step listeners (see ``LLMEngine.step_listeners``).

    ``start_s`` is ``time.perf_counter()`` when the model run began. ``prefill_tokens`` are prompt tokens
    computed, ``decode_tokens`` the other tokens computed (generated ones fed back, or recomputed after a
    preemption); together they are the step's tokens, at most ``token_budget``. ``padded_tokens`` were
    computed only to fit a captured CUDA graph's shape. ``grammar_rows`` sampled under a grammar's token
    bitmask, which took ``mask_time_s`` to build before the model run (not part of ``duration_s``).
    ``comm_time_s`` of ``duration_s`` went to collectives between devices (the slowest replica's sampling
    rank; 0 on one device). ``replica_tokens`` are the tokens each data-parallel replica computed.
    ``host_time_s`` is the engine's own time for the step outside the model (scheduling it, writing it down,
    applying its tokens), and ``prepare_time_s`` of ``duration_s`` the executor's building of its tensors:
    the host work that leaves the device idle unless steps overlap. ``eplb`` is the expert load balancer's
    report on the steps that evaluated the placement (``enable_eplb``; see ``EplbReport``), else None.
    With speculative decoding ``decode_tokens`` include the draft tokens verified (``spec_draft_tokens``),
    ``sampled_tokens`` the accepted ones, and the ``spec_*`` fields count the cost model's decisions.
    """

    start_s: float
    duration_s: float
    num_seqs: int
    prefill_tokens: int
    decode_tokens: int
    sampled_tokens: int
    token_budget: int
    padded_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions: int = 0
    grammar_rows: int = 0
    mask_time_s: float = 0.0
    comm_time_s: float = 0.0
    host_time_s: float = 0.0
    prepare_time_s: float = 0.0
    replica_tokens: tuple[int, ...] = ()
    eplb: dict | None = None
    # Of prefix_cache_hits, tokens loaded from the host tier and from the store; the store's traffic since
    # the previous step (read and write bytes, seconds reading, seconds the scheduler waited on loads) and
    # its misses by cause (absent, corrupt, foreign, error: each one recomputed).
    prefix_cache_host_hits: int = 0
    prefix_cache_store_hits: int = 0
    prefix_store_bytes_read: int = 0
    prefix_store_bytes_written: int = 0
    prefix_store_load_time_s: float = 0.0
    prefix_store_wait_time_s: float = 0.0
    prefix_store_misses_absent: int = 0
    prefix_store_misses_corrupt: int = 0
    prefix_store_misses_foreign: int = 0
    prefix_store_misses_error: int = 0
    # Speculative decoding (see SpecCounts): the cost model's decisions for this step and what it verified.
    spec_decode_seqs: int = 0
    spec_drafting_seqs: int = 0
    spec_planned_tokens: int = 0
    spec_probe_steps: int = 0
    spec_draft_rows: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def decode_only(self) -> bool:
        """Every sequence computed its last token (and its draft tokens), none a prompt or a recomputation."""
        return self.prefill_tokens == 0 and self.decode_tokens == self.num_seqs + self.spec_draft_tokens

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens


@dataclass
class EngineMetrics:
    """Totals over steps. Prefill steps compute at least one prompt token; decode steps one token per sequence."""

    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_time_s: float = 0.0
    decode_time_s: float = 0.0
    prompt_tokens_computed: int = 0  # prompt tokens run through the model (cache hits excluded)
    tokens_computed: int = 0  # every token run through the model, padding excluded
    padded_tokens: int = 0
    tokens_generated: int = 0
    decode_tokens: int = 0  # tokens computed in decode-only steps
    preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0
    grammar_steps: int = 0  # steps that built a grammar bitmask
    grammar_mask_time_s: float = 0.0  # time spent filling those bitmasks
    comm_time_s: float = 0.0  # of the step time, spent in collectives between devices
    replica_tokens: list[int] = field(default_factory=list)  # tokens computed by each data-parallel replica
    decode_host_time_s: float = 0.0  # engine host time of the decode steps, outside the model
    decode_prepare_time_s: float = 0.0  # of decode_time_s, building the steps' tensors on the host
    prefix_cache_host_hits: int = 0  # of prefix_cache_hits, tokens served by the host tier
    prefix_cache_store_hits: int = 0  # ... and by the persistent store
    prefix_store_bytes_read: int = 0
    prefix_store_bytes_written: int = 0
    prefix_store_load_time_s: float = 0.0  # reading and checking store objects (background threads)
    prefix_store_wait_time_s: float = 0.0  # the scheduler waiting for loads, nothing else to run
    prefix_store_misses_absent: int = 0
    prefix_store_misses_corrupt: int = 0
    prefix_store_misses_foreign: int = 0
    prefix_store_misses_error: int = 0
    spec_decode_seqs: int = 0  # decoding sequences the speculation cost model looked at, over the steps
    spec_drafting_seqs: int = 0  # ... that it gave draft tokens
    spec_planned_tokens: int = 0  # draft tokens it gave them
    spec_probe_steps: int = 0  # steps that drafted only to time a verification (the cost model gave none)
    spec_draft_rows: int = 0  # sequence-steps that verified draft tokens
    spec_draft_tokens: int = 0  # draft tokens proposed and verified
    spec_accepted_tokens: int = 0  # of those, accepted: each one a decode step its sequence did not run

    def __post_init__(self) -> None:
        # The expert load balancer's latest report (enable_eplb): a state, not a total, so not a field
        # (fields add up across processes).
        self.eplb: dict | None = None
        # The speculative method (a setting, not a total) and its cost model's latest fit.
        self.spec_method: str | None = None
        self.spec_policy: dict = {}

    def add_step(self, r: StepRecord) -> None:
        if r.decode_only:
            self.decode_steps += 1
            self.decode_time_s += r.duration_s
            self.decode_tokens += r.decode_tokens
            self.decode_host_time_s += r.host_time_s
            self.decode_prepare_time_s += r.prepare_time_s
        else:
            self.prefill_steps += 1
            self.prefill_time_s += r.duration_s
        self.prompt_tokens_computed += r.prefill_tokens
        self.tokens_computed += r.num_tokens
        self.padded_tokens += r.padded_tokens
        self.tokens_generated += r.sampled_tokens
        self.preemptions += r.preemptions
        self.prefix_cache_queries += r.prefix_cache_queries
        self.prefix_cache_hits += r.prefix_cache_hits
        self.grammar_steps += r.grammar_rows > 0
        self.grammar_mask_time_s += r.mask_time_s
        self.comm_time_s += r.comm_time_s
        for name in PREFIX_TIER_FIELDS + SPEC_FIELDS:
            setattr(self, name, getattr(self, name) + getattr(r, name))
        if len(self.replica_tokens) < len(r.replica_tokens):
            self.replica_tokens += [0] * (len(r.replica_tokens) - len(self.replica_tokens))
        for i, n in enumerate(r.replica_tokens):
            self.replica_tokens[i] += n
        if r.eplb is not None:
            self.eplb = r.eplb

    def states(self) -> dict:
        """What no total holds (the speculative method, its cost model's fit, the balancer's report), as plain
        data for :meth:`adopt_states` in another process or on a caller's totals."""
        return {"spec_method": self.spec_method, "spec_policy": dict(self.spec_policy), "eplb": self.eplb}

    def adopt_states(self, states: dict) -> None:
        """Takes ``states``' values where this one has none (totals summed from step records, or merged from
        replicas that run the same engine settings)."""
        self.spec_method = self.spec_method or states.get("spec_method")
        self.spec_policy = self.spec_policy or dict(states.get("spec_policy") or {})
        self.eplb = self.eplb if self.eplb is not None else states.get("eplb")

    def add_tier_counters(self, counters: dict[str, float]) -> None:
        """Store traffic after the last step (the writes the tiers' close waited for)."""
        for name, value in counters.items():
            setattr(self, name, getattr(self, name) + value)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "prefix_cache_hit_rate": self.prefix_cache_hit_rate, "eplb": self.eplb,
                "speculative": self.speculative}

    @property
    def speculative(self) -> dict | None:
        """Speculative decoding's figures under its method's name, or None where no run speculated."""
        if not self.spec_method:
            return None
        rows, drafted, accepted = self.spec_draft_rows, self.spec_draft_tokens, self.spec_accepted_tokens
        return {self.spec_method: {
            "proposed_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
            "mean_accepted_length": round(1 + accepted / rows, 4) if rows else None,
            "steps_saved": accepted, "draft_rows": rows,
            "decode_seqs_considered": self.spec_decode_seqs, "decode_seqs_drafting": self.spec_drafting_seqs,
            "drafting_share": round(self.spec_drafting_seqs / self.spec_decode_seqs, 4)
            if self.spec_decode_seqs else None,
            "planned_tokens": self.spec_planned_tokens, "probe_steps": self.spec_probe_steps, **self.spec_policy}}
