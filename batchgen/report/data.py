"""What the report shows, read from a job's output folder: stats, telemetry and the rows' token columns."""
from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

from batchgen.io import OutputError, OutputFolder, redact
from batchgen.io.manifest import STATS, SUCCESS, TELEMETRY, ManifestEntry
from batchgen.pipeline.stats import Counts


class ReportError(Exception):
    """The folder cannot be reported on; the message is one line, safe to show."""


ERROR_TYPE = pl.Struct({"code": pl.String, "message": pl.String})
# The result columns the report reads: a part's output text and carried columns are never loaded.
ROW_SCHEMA = {"prompt_tokens": pl.Int64, "completion_tokens": pl.Int64, "finish_reason": pl.String,
              "error": ERROR_TYPE}


@dataclass(frozen=True)
class ExpertLoads:
    """One run's expert-parallel load balancing report (stats.json ``engine.eplb``, see ``EplbReport``):
    ``loads`` (MoE layers, logical experts) are the tokens routed to each expert in the latest window;
    ``rank_loads_before`` / ``rank_loads_after`` (MoE layers, expert-parallel ranks) the tokens each rank
    computes on them with the contiguous placement and with the one in use (None where stats.json has none)."""

    loads: np.ndarray
    balancedness_before: float | None
    balancedness_after: float | None
    rebalances: int
    moved_bytes: int
    steps: int
    rank_loads_before: np.ndarray | None = None
    rank_loads_after: np.ndarray | None = None


def expert_loads(engine: dict[str, Any] | None) -> ExpertLoads | None:
    """The ``eplb`` report of an engine figures dict, or None where the run did not balance experts."""
    report = (engine or {}).get("eplb")
    if not report:
        return None
    loads = _matrix(report, "layers", "expert loads", np.int64)
    ranks = {key: _matrix(report, key, "rank loads", np.float64) if report.get(key) else None
             for key in ("rank_loads_before", "rank_loads_after")}
    for key, table in ranks.items():
        if table is not None and table.shape[0] != loads.shape[0]:
            raise ReportError(f"stats.json engine.eplb.{key} has {table.shape[0]} layers, "
                              f"engine.eplb.layers {loads.shape[0]}")
    return ExpertLoads(loads=loads,
                       balancedness_before=report.get("balancedness_before"),
                       balancedness_after=report.get("balancedness_after"),
                       rebalances=int(report.get("rebalances") or 0),
                       moved_bytes=int(report.get("moved_bytes") or 0), steps=int(report.get("steps") or 0),
                       **ranks)


def _matrix(report: dict[str, Any], key: str, what: str, dtype: type) -> np.ndarray:
    """``report[key]``: one list of token counts per layer, all of one length."""
    layers = report.get(key) or []
    widths = {len(row) if isinstance(row, list) else -1 for row in layers}
    if len(widths) > 1 or -1 in widths:
        raise ReportError(f"stats.json engine.eplb.{key} is not a matrix: one list of {what} per layer, "
                          f"all of one length (found lengths {sorted(widths - {-1})})")
    try:
        return np.asarray(layers, dtype=dtype).reshape(len(layers), widths.pop() if widths else 0)
    except (TypeError, ValueError):
        raise ReportError(f"stats.json engine.eplb.{key} holds something other than token counts") from None


@dataclass
class ReportData:
    """``rows`` has one row per committed output row: id, prompt_tokens, completion_tokens, finish_reason,
    error_code, error_message and part (its file name). ``eplb`` is the latest run's expert loads (None
    without EPLB), ``run_eplb`` each run's (stats.json ``runs``, oldest first; None where it had none)."""

    path: str
    stats: dict[str, Any]
    stats_found: bool
    complete: bool
    telemetry: dict[str, Any] | None
    rows: pl.DataFrame
    parts: int
    eplb: ExpertLoads | None = None
    run_eplb: list[ExpertLoads | None] = field(default_factory=list)


def _native_rows(folder: OutputFolder, entry: ManifestEntry, id_column: str) -> pl.DataFrame:
    data, part = folder.read_part(entry), entry.part
    schema = {id_column: pl.String, **ROW_SCHEMA}
    if entry.format == "jsonl":
        df = pl.read_ndjson(io.BytesIO(data), schema=schema)
    else:
        df = pl.read_parquet(io.BytesIO(data), columns=list(schema)).cast(schema)  # type: ignore[arg-type]
    return df.select(
        pl.col(id_column).alias("id"), "prompt_tokens", "completion_tokens", "finish_reason",
        pl.col("error").struct.field("code").alias("error_code"),
        pl.col("error").struct.field("message").alias("error_message"),
        pl.lit(part).alias("part"))


# The fields of an OpenAI Batch output line (io.openai_batch.result_line / error_line) the report reads.
OPENAI_LINE_SCHEMA = {
    "custom_id": pl.String,
    "response": pl.Struct({"body": pl.Struct({
        "choices": pl.List(pl.Struct({"finish_reason": pl.String})),
        "usage": pl.Struct({"prompt_tokens": pl.Int64, "completion_tokens": pl.Int64})})}),
    "error": ERROR_TYPE,
    "usage": pl.Struct({"prompt_tokens": pl.Int64, "completion_tokens": pl.Int64}),  # error lines: tokens spent
}


def _openai_rows(folder: OutputFolder, entry: ManifestEntry, id_column: str) -> pl.DataFrame:
    """Result lines carry their usage and finish reason; error lines (the part's errors file) the tokens they
    spent, beside the API's fields."""
    body = pl.col("response").struct.field("body")
    usage = pl.coalesce(body.struct.field("usage"), pl.col("usage"))
    frames = [pl.read_ndjson(io.BytesIO(folder.read_part(entry, name)), schema=OPENAI_LINE_SCHEMA).select(
        pl.col("custom_id").alias("id"),
        usage.struct.field("prompt_tokens").fill_null(0).alias("prompt_tokens"),
        usage.struct.field("completion_tokens").fill_null(0).alias("completion_tokens"),
        body.struct.field("choices").list.first().struct.field("finish_reason").alias("finish_reason"),
        pl.col("error").struct.field("code").alias("error_code"),
        pl.col("error").struct.field("message").alias("error_message"),
        pl.lit(entry.part).alias("part")) for name in entry.files]
    return pl.concat(frames) if frames else _empty_rows()


_PART_READERS = {"jsonl": _native_rows, "parquet": _native_rows, "openai": _openai_rows}


def check_part_rows(path: str, entry: ManifestEntry, read: int) -> None:
    """Raises ReportError when a part's files hold another number of rows than its manifest entry records: they
    were changed after the part was committed, and what they show is not what the job wrote."""
    if read != len(entry.row_ids):
        raise ReportError(redact(f"{path}/{entry.part} holds {read} rows, but the manifest records "
                                 f"{len(entry.row_ids)} committed in it: the part was changed after it was "
                                 f"committed"))


def _empty_rows() -> pl.DataFrame:
    return pl.DataFrame(schema={"id": pl.String, "prompt_tokens": pl.Int64, "completion_tokens": pl.Int64,
                                "finish_reason": pl.String, "error_code": pl.String,
                                "error_message": pl.String, "part": pl.String})


def load_report_data(path: str, storage_options: dict[str, Any] | None = None) -> ReportData:
    """Reads the folder (local or any fsspec URL); raises ReportError when it holds no job output.

    Row and token totals come from the committed parts' manifest entries; stats.json (which may be missing, or
    behind them: a job still running, or one killed) gives the rest.
    """
    try:
        folder = OutputFolder(path, storage_options)
        entries = folder.entries()
        stats = folder.read_json(STATS)
        complete = folder.read_json(SUCCESS) is not None
        telemetry = folder.read_json(TELEMETRY)
        if not entries and stats is None:
            raise ReportError(redact(f"{path} holds no job output (no committed parts and no {STATS})"))
        id_column = ((stats or {}).get("spec") or {}).get("input", {}).get("id_column") or "id"
        frames = [_PART_READERS[e.format](folder, e, id_column) for e in entries]
        for entry, frame in zip(entries, frames, strict=True):
            check_part_rows(path, entry, frame.height)
    except OutputError as e:
        raise ReportError(str(e)) from None
    except (pl.exceptions.PolarsError, OSError) as e:
        raise ReportError(redact(f"cannot read the parts of {path}: {type(e).__name__}: {e}")) from None
    rows = pl.concat(frames) if frames else _empty_rows()
    stats_found = stats is not None
    # The totals are the committed parts', whatever stats.json says: a run killed after committing more parts
    # (SIGKILL) left it behind them.
    stats = {**(stats or {"job": redact(path)}), **Counts.total(e.stats for e in entries).to_dict()}
    return ReportData(path=redact(path), stats=stats, stats_found=stats_found, complete=complete,
                      telemetry=telemetry, rows=rows, parts=len(entries), eplb=expert_loads(stats.get("engine")),
                      run_eplb=[expert_loads(run.get("engine")) for run in stats.get("runs") or []])
