"""Row and token counts per part, and the job stats written to stats.json and _SUCCESS."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:  # the report reads stats without importing the engine
    from batchgen.pipeline.rows import ResultRow


@dataclass
class Counts:
    """Sums over rows; the token counts of a part add up from its rows' columns."""

    rows: int = 0
    ok_rows: int = 0
    error_rows: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0

    def add_row(self, row: ResultRow) -> None:
        self.rows += 1
        self.ok_rows += row.ok
        self.error_rows += not row.ok
        self.prompt_tokens += row.prompt_tokens
        self.completion_tokens += row.completion_tokens
        self.cached_prompt_tokens += row.cached_tokens

    def add(self, other: Counts) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Counts:
        return cls(**{f.name: int(data.get(f.name) or 0) for f in fields(cls)})

    @classmethod
    def total(cls, parts: Iterable[dict[str, Any]]) -> Counts:
        out = cls()
        for part in parts:
            out.add(cls.from_dict(part))
        return out

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def _rate(n: int, seconds: float) -> float:
    return round(n / seconds, 2) if seconds > 0 else 0.0


def job_stats(*, totals: Counts, run: Counts, job: str, model: str, dtype: str, spec: dict[str, Any],
              spec_digest: str, started_at: str, wall_s: float, generate_s: float, resumed: bool, complete: bool,
              limit: int | None, engine: dict[str, Any] | None = None,
              executor: dict[str, Any] | None = None) -> dict[str, Any]:
    """The job's stats: totals over every committed part (earlier runs included), rates over this run.

    ``wall_s`` is this run from start to finish (model load included); the tokens-per-second rates divide
    this run's tokens by ``generate_s``, the time from the first request to the last result. ``dtype`` is the
    one the model ran in ("auto" resolved); ``engine`` holds this run's engine totals (see
    ``LLM.metrics``: ``batchgen.engine.flops.engine_figures``), ``executor`` how it ran (its kind and, on Ray, each replica's rows and
    throughput).
    """
    return {
        "job": job,
        "model": model,
        "dtype": dtype,
        **totals.to_dict(),
        "prefix_cache_hit_rate": round(totals.cached_prompt_tokens / totals.prompt_tokens, 4)
        if totals.prompt_tokens else 0.0,
        "wall_s": round(wall_s, 3),
        "generate_s": round(generate_s, 3),
        "prompt_tokens_per_s": _rate(run.prompt_tokens, generate_s),
        "generated_tokens_per_s": _rate(run.completion_tokens, generate_s),
        "started_at": started_at,
        "finished_at": utc_now(),
        "spec_digest": spec_digest,
        "resumed": resumed,
        "complete": complete,
        "limit": limit,
        "this_run": run.to_dict(),
        "engine": engine or {},
        "executor": executor or {"kind": "local"},
        "spec": spec,
    }
