"""``batchgen show``: rows of an output folder (Parquet, JSONL or OpenAI Batch) as a table in the terminal."""
from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from typing import Any, Iterator

import polars as pl

from batchgen.io import OutputError, OutputFolder, redact
from batchgen.io.manifest import SUCCESS
from batchgen.io.parts import deserialize_rows
from batchgen.io.retry import retry
from batchgen.report.data import ReportError, check_part_rows

MAX_CELL_CHARS = 60
RESULT_FIELDS = ("output", "prompt_tokens", "completion_tokens", "finish_reason", "error", "id", "custom_id")


@dataclass
class ShowOptions:
    """Which rows and columns to show: the first ``limit`` rows (only error rows with ``errors``), the named
    ``columns`` (all when empty), text cut to ``max_chars`` characters."""

    limit: int = 20
    errors: bool = False
    columns: list[str] = field(default_factory=list)
    max_chars: int = MAX_CELL_CHARS


def _error_text(error: Any) -> str | None:
    if not error:
        return None
    return f"{error.get('code')}: {error.get('message')}" if isinstance(error, dict) else str(error)


def flat_row(record: dict[str, Any]) -> dict[str, Any]:
    """A row of any output format as flat columns: an OpenAI Batch line becomes custom_id, output,
    finish_reason, prompt_tokens, completion_tokens and error; a native row keeps its columns."""
    if "custom_id" not in record or "response" not in record:
        return {**record, "error": _error_text(record.get("error"))}
    body = (record.get("response") or {}).get("body") or {}
    choice = (body.get("choices") or [{}])[0]
    usage = body.get("usage") or {}
    output = (choice.get("message") or {}).get("content") if "message" in choice else choice.get("text")
    return {"custom_id": record["custom_id"], "output": output, "finish_reason": choice.get("finish_reason"),
            "prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": usage.get("completion_tokens"),
            "error": _error_text(record.get("error"))}


def iter_rows(path: str, storage_options: dict[str, Any] | None = None) -> Iterator[dict[str, Any]]:
    """The committed rows of the output folder, flat (see :func:`flat_row`), one part read at a time."""
    try:
        folder = OutputFolder(path, storage_options)
        entries = folder.entries()
        finished = not entries and folder.read_json(SUCCESS) is not None
        exists = bool(entries) or retry(lambda: folder.fs.exists(folder.root), what=f"stat {redact(path)}")
    except OutputError as e:
        raise ReportError(str(e)) from None
    if not exists:
        raise ReportError(redact(f"no such output folder: {path}"))
    if not entries and not finished:  # a finished job of no rows has none to show
        raise ReportError(redact(f"{path} holds no committed rows"))
    for entry in entries:
        records = []
        for name in entry.files:
            try:
                records += deserialize_rows(folder.read_part(entry, name), name.rsplit(".", 1)[-1])
            except Exception as e:  # noqa: BLE001 - one line for any unreadable part
                raise ReportError(redact(f"cannot read {path}/{name}: {type(e).__name__}: {e}")) from None
        check_part_rows(path, entry, len(records))
        yield from (flat_row(r) for r in records)


def _cell(value: Any, max_chars: int) -> Any:
    if isinstance(value, (dict, list)):
        value = str(value)
    if isinstance(value, str):
        value = " ".join(value.split())  # one line per row
        value = "".join(c if c.isprintable() else "\ufffd" for c in value)  # no terminal escape sequences
        return value if len(value) <= max_chars else value[: max_chars - 1] + "…"
    return value


def select_rows(path: str, options: ShowOptions, storage_options: dict[str, Any] | None = None) -> pl.DataFrame:
    """The rows ``options`` asks for, text cells cut; raises ReportError for a missing column."""
    rows: list[dict[str, Any]] = []
    for row in iter_rows(path, storage_options):
        if options.errors and not row.get("error"):
            continue
        rows.append(row)
        if len(rows) >= options.limit:
            break
    names = list(dict.fromkeys(k for row in rows for k in row))
    if options.columns:
        missing = [c for c in options.columns if c not in names]
        if missing and rows:
            raise ReportError(f"no column(s) {', '.join(missing)} in {redact(path)}; its columns: "
                              f"{', '.join(names)}")
        names = options.columns
    if not rows:
        return pl.DataFrame(schema={n: pl.String for n in names})
    return pl.DataFrame([{n: _cell(row.get(n), options.max_chars) for n in names} for row in rows],
                        infer_schema_length=None, strict=False)


def format_table(df: pl.DataFrame, max_chars: int = MAX_CELL_CHARS) -> str:
    """The table as polars prints it, every row and column shown, as wide as the terminal."""
    if df.is_empty():
        return "no rows"
    with pl.Config(tbl_rows=-1, tbl_cols=-1, fmt_str_lengths=max_chars, tbl_hide_dataframe_shape=True,
                   tbl_hide_column_data_types=True, tbl_width_chars=shutil.get_terminal_size((160, 40)).columns):
        return str(df)


def sample_rows(path: str, count: int, max_chars: int = 240, storage_options: dict[str, Any] | None = None
                ) -> list[dict[str, Any]]:
    """The first ``count`` ok rows for the report: id, an excerpt of the input (the carried columns) and of
    the output, and the finish reason."""
    samples: list[dict[str, Any]] = []
    for row in iter_rows(path, storage_options):
        if row.get("error"):
            continue
        carried = "; ".join(f"{k}: {v}" for k, v in row.items() if k not in RESULT_FIELDS and v is not None)
        samples.append({"id": row.get("id", row.get("custom_id")), "input": _cell(carried, max_chars),
                        "output": _cell(row.get("output") or "", max_chars), "finish_reason": row.get("finish_reason")})
        if len(samples) >= count:
            break
    return samples
