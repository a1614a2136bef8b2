"""Job telemetry: engine steps and finished rows in a bounded number of time buckets, time per stage."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, fields
from typing import Any, Callable, Iterable, Iterator, TypeVar

from batchgen.engine.core.metrics import EngineMetrics, StepRecord
from batchgen.pipeline.rows import ResultRow

T = TypeVar("T")

# At most this many buckets of 12 counters are held, so telemetry.json stays a few tens of KB whatever
# the job's length: 23 KiB for a 10-hour job of 300,000 steps and a million rows, which
# tests/test_telemetry.py checks against the bound TELEMETRY_MAX_BYTES.
MAX_BUCKETS = 512
FIRST_BUCKET_S = 0.1
TELEMETRY_MAX_BYTES = 256 * 1024
BUCKET_FIELDS = ("steps", "busy_s", "seqs", "prefill_tokens", "decode_tokens", "padded_tokens",
                 "generated_tokens", "prefix_cache_queries", "prefix_cache_hits", "preemptions",
                 "rows", "error_rows")
# What a step does over its whole duration: spread over the buckets it spans, so that a bucket's amount over its
# width is the rate in that bucket (a long prefill step is not a spike in the bucket where it ends). The other
# fields count events, at the time they happen.
SPREAD_FIELDS = ("busy_s", "prefill_tokens", "decode_tokens", "padded_tokens", "generated_tokens")
# Pipeline stages, in the order a row meets them. read and render_tokenize run in the prefetch thread,
# overlapping the others; queue_wait is the engine loop waiting for prepared (and sorted) rows.
STAGES = ("startup", "read", "render_tokenize", "queue_wait", "engine", "write")


class TimeBuckets:
    """Sums of counters per fixed-width time bucket.

    A time past the last bucket doubles the width and merges neighbours, so between ``max_buckets / 2``
    and ``max_buckets`` buckets describe the whole job, however long it runs.
    """

    def __init__(self, fields: Iterable[str], max_buckets: int = MAX_BUCKETS, width_s: float = FIRST_BUCKET_S):
        if max_buckets < 2 or max_buckets % 2:
            raise ValueError(f"max_buckets must be an even number >= 2, got {max_buckets}")
        self.max_buckets = max_buckets
        self.width_s = width_s
        self.columns: dict[str, list[float]] = {f: [] for f in fields}
        self.num_buckets = 0

    def add(self, t: float, values: dict[str, float]) -> None:
        """Adds ``values`` (a subset of the fields) to the bucket holding time ``t`` (seconds, >= 0)."""
        index = int(max(t, 0.0) // self.width_s)
        while index >= self.max_buckets:
            self._coarsen()
            index = int(max(t, 0.0) // self.width_s)
        if index >= self.num_buckets:
            for column in self.columns.values():
                column.extend([0] * (index + 1 - self.num_buckets))
            self.num_buckets = index + 1
        for name, value in values.items():
            self.columns[name][index] += value

    def add_span(self, start: float, end: float, values: dict[str, float]) -> None:
        """Spreads ``values`` over the time ``[start, end)``, each bucket getting the share of the span it
        covers; integer amounts stay integers (rounded cumulatively, so their total is exact)."""
        start = max(start, 0.0)
        if end <= start:
            self.add(end, values)
            return
        self.add(end, {})  # grows (or coarsens) the buckets to hold the whole span first
        width, done = self.width_s, dict.fromkeys(values, 0)
        for index in range(int(start // width), min(int(end // width), self.num_buckets - 1) + 1):
            covered = 1.0 if (index + 1) * width >= end else ((index + 1) * width - start) / (end - start)
            for name, value in values.items():
                upto = round(value * covered) if isinstance(value, int) else value * covered
                self.columns[name][index] += upto - done[name]
                done[name] = upto

    def _coarsen(self) -> None:
        self.width_s *= 2
        for name, column in self.columns.items():
            if len(column) % 2:
                column.append(0)
            self.columns[name] = [column[i] + column[i + 1] for i in range(0, len(column), 2)]
        self.num_buckets = (self.num_buckets + 1) // 2

    def to_dict(self) -> dict[str, Any]:
        return {"bucket_s": self.width_s,
                "columns": {name: [round(v, 4) if isinstance(v, float) else v for v in column]
                            for name, column in self.columns.items()}}

    @classmethod
    def from_dict(cls, data: dict[str, Any], max_buckets: int = MAX_BUCKETS) -> TimeBuckets:
        columns = data["columns"]
        out = cls(columns, max_buckets, data["bucket_s"])
        out.columns = {name: list(column) for name, column in columns.items()}
        out.num_buckets = max((len(c) for c in columns.values()), default=0)
        return out

    def merge(self, other: TimeBuckets) -> None:
        """Adds ``other``'s counts, measured from the same start (another process's share of one job)."""
        other = TimeBuckets.from_dict(other.to_dict(), self.max_buckets)
        while self.width_s < other.width_s * (1 - 1e-9):
            self._coarsen()
        while other.width_s < self.width_s * (1 - 1e-9):
            other._coarsen()
        if other.num_buckets > self.num_buckets:
            for column in self.columns.values():
                column.extend([0] * (other.num_buckets - self.num_buckets))
            self.num_buckets = other.num_buckets
        for name, column in other.columns.items():
            for i, value in enumerate(column):
                self.columns[name][i] += value


class StageClock:
    """Seconds spent per stage, each stage's time exclusive of the stages measured inside it on the same
    thread (the engine loop pulls its input from inside ``generate_stream``; that wait is not engine time)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.seconds: dict[str, float] = {s: 0.0 for s in STAGES}
        self._lock = threading.Lock()
        self._local = threading.local()

    def add(self, stage: str, seconds: float) -> None:
        with self._lock:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds

    @contextmanager
    def measure(self, stage: str) -> Iterator[None]:
        stack: list[float] = self._local.__dict__.setdefault("stack", [])
        stack.append(0.0)  # time of the stages nested in this one
        start = self.clock()
        try:
            yield
        finally:
            elapsed = self.clock() - start
            nested = stack.pop()
            if stack:
                stack[-1] += elapsed
            self.add(stage, elapsed - nested)

    def timed(self, items: Iterable[T], stage: str) -> Iterator[T]:
        """Yields from ``items``, counting the time spent producing each item as ``stage``."""
        it = iter(items)
        while True:
            with self.measure(stage):
                try:
                    item = next(it)
                except StopIteration:
                    return
            yield item

    def wrap(self, fn: Callable[[T], None], stage: str) -> Callable[[T], None]:
        def measured(arg: T) -> None:
            with self.measure(stage):
                fn(arg)
        return measured


class Telemetry:
    """What one run of a job did over time: engine steps (from the engine's step listeners), finished
    rows, and time per stage. Totals of this run's steps are in ``metrics``."""

    def __init__(self, token_budget: int, start: float | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.start = clock() if start is None else start
        self.token_budget = token_budget
        self.buckets = TimeBuckets(BUCKET_FIELDS)
        self.stages = StageClock(clock)
        self.metrics = EngineMetrics()

    def on_step(self, r: StepRecord) -> None:
        self.metrics.add_step(r)
        start, end = r.start_s - self.start, r.start_s + r.duration_s - self.start
        self.buckets.add(end, {"steps": 1, "seqs": r.num_seqs, "prefix_cache_queries": r.prefix_cache_queries,
                               "prefix_cache_hits": r.prefix_cache_hits, "preemptions": r.preemptions})
        self.buckets.add_span(start, end, {
            "busy_s": r.duration_s, "prefill_tokens": r.prefill_tokens, "decode_tokens": r.decode_tokens,
            "padded_tokens": r.padded_tokens, "generated_tokens": r.sampled_tokens})

    def on_row(self, row: ResultRow) -> None:
        self.buckets.add(self.clock() - self.start, {"rows": 1, "error_rows": int(not row.ok)})

    @contextmanager
    def listening(self, listeners: list[Callable[[StepRecord], None]]) -> Iterator[None]:
        """Receives the engine's step records (``LLMEngine.step_listeners``) for the duration."""
        listeners.append(self.on_step)
        try:
            yield
        finally:
            listeners.remove(self.on_step)

    def to_dict(self) -> dict[str, Any]:
        return {"time_buckets": self.buckets.to_dict(), "token_budget": self.token_budget,
                "stages_s": {k: round(v, 4) for k, v in self.stages.seconds.items()}}

    def state(self) -> dict[str, Any]:
        """What :meth:`absorb` takes: the telemetry and the engine totals (plain data, to cross processes)."""
        return {**self.to_dict(), "metrics": asdict(self.metrics), "metric_states": self.metrics.states()}

    def absorb(self, state: dict[str, Any]) -> None:
        """Adds another process's share of the job (its :meth:`state`, timed from the same start)."""
        self.buckets.merge(TimeBuckets.from_dict(state["time_buckets"]))
        for stage, seconds in state["stages_s"].items():
            self.stages.add(stage, seconds)
        for f in fields(EngineMetrics):
            setattr(self.metrics, f.name, getattr(self.metrics, f.name) + state["metrics"][f.name])
        self.metrics.adopt_states(state.get("metric_states") or {})
