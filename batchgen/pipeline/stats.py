"""Row and token counts per part, each run's figures, and the job stats over all runs written to stats.json and
_SUCCESS."""
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


def run_entry(*, run: Counts, started_at: str, wall_s: float, generate_s: float, limit: int | None,
              interrupted: bool, dtype: str, engine: dict[str, Any] | None = None,
              executor: dict[str, Any] | None = None) -> dict[str, Any]:
    """One run's own figures, for stats.json's ``runs``: what it committed, its times and its rates.

    ``wall_s`` is the run from start to finish (model load included); its tokens-per-second rates divide its
    tokens by ``generate_s``, the time from the first request to the last result. ``dtype`` is the one the model
    ran in ("auto" resolved); ``engine`` holds its engine totals (see ``LLM.metrics``), ``executor``
    how it ran (its kind and, on Ray, each replica's rows and throughput).
    """
    return {"started_at": started_at, "finished_at": utc_now(), "wall_s": round(wall_s, 3),
            "generate_s": round(generate_s, 3), "limit": limit, "interrupted": interrupted, "dtype": dtype,
            **run.to_dict(), "prompt_tokens_per_s": _rate(run.prompt_tokens, generate_s),
            "generated_tokens_per_s": _rate(run.completion_tokens, generate_s), "engine": engine or {},
            "executor": executor or {"kind": "local"}}


def job_stats(*, totals: Counts, runs: list[dict[str, Any]], this_run: Counts, limit: int | None, job: str,
              model: str, spec: dict[str, Any], identity: dict[str, Any], complete: bool) -> dict[str, Any]:
    """The job's stats over every run that committed rows into its output folder (``runs``, oldest first);
    ``this_run`` and ``limit`` are the latest run's (which may have committed nothing).

    The totals are sums over every committed part; the top-level rates and times come from the runs that
    computed something (engine time), the engine figures from the latest of them (``plan --rates-from``).
    """
    computing = [r for r in runs if r.get("generate_s")]
    generate_s = sum(r["generate_s"] for r in computing)
    last = (computing or runs or [{}])[-1]
    return {
        "job": job,
        "model": model,
        "dtype": last.get("dtype", ""),
        **totals.to_dict(),
        "prefix_cache_hit_rate": round(totals.cached_prompt_tokens / totals.prompt_tokens, 4)
        if totals.prompt_tokens else 0.0,
        "wall_s": round(sum(r.get("wall_s", 0.0) for r in runs), 3),
        "generate_s": round(generate_s, 3),
        "prompt_tokens_per_s": _rate(sum(r.get("prompt_tokens", 0) for r in computing), generate_s),
        "generated_tokens_per_s": _rate(sum(r.get("completion_tokens", 0) for r in computing), generate_s),
        "started_at": runs[0]["started_at"] if runs else "",
        "finished_at": runs[-1]["finished_at"] if runs else "",
        "job_digest": identity.get("digest"),
        "resumed": totals.rows > this_run.rows,  # earlier runs committed rows (a failed run lists no entry)
        "complete": complete,
        "limit": limit,
        "this_run": this_run.to_dict(),
        "engine": last.get("engine") or {},
        "executor": last.get("executor") or {"kind": "local"},
        "runs": runs,
        "identity": identity.get("values", {}),
        "spec": spec,
    }
