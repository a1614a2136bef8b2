"""Output rows: one per input row, ok or error, and the Parquet schema that keeps parts consistent."""
from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import pyarrow as pa

from batchgen.engine import RequestOutput, SamplingParams
from batchgen.io import redact
from batchgen.pipeline.sampling import output_problem

log = logging.getLogger(__name__)

RESULT_COLUMNS = ("output", "prompt_tokens", "completion_tokens", "finish_reason", "error")
ERROR_TYPE = pa.struct([("code", pa.string()), ("message", pa.string())])
_RESULT_TYPES = {
    "output": pa.string(),
    "prompt_tokens": pa.int64(),
    "completion_tokens": pa.int64(),
    "finish_reason": pa.string(),
    "error": ERROR_TYPE,
}


@dataclass
class Request:
    """A rendered row on its way through the engine."""

    row_id: str
    carried: dict[str, Any]
    prompt_ids: list[int]
    params: SamplingParams
    source: str = ""  # the input file


@dataclass
class ResultRow:
    """One finished row; ``cached_tokens`` and ``source`` (its input file) feed the part stats, they are not
    columns."""

    row_id: str
    carried: dict[str, Any]
    output: str | None
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    error: dict[str, str] | None = None
    cached_tokens: int = 0
    logprobs: list[dict[str, Any]] | None = None  # [{token, bytes, logprob}] when the request asked for them
    source: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_dict(self, id_column: str) -> dict[str, Any]:
        row: dict[str, Any] = {id_column: self.row_id}
        row.update(self.carried)
        row.update(output=self.output, prompt_tokens=self.prompt_tokens,
                   completion_tokens=self.completion_tokens, finish_reason=self.finish_reason,
                   error=self.error)
        return row


def carried_values(values: dict[str, Any], columns: list[str]) -> dict[str, Any]:
    return {c: values.get(c) for c in columns}


def error_row(row_id: str, carried: dict[str, Any], code: str, message: str, source: str = "",
              prompt_tokens: int = 0, completion_tokens: int = 0, cached_tokens: int = 0) -> ResultRow:
    """A row that failed, with the tokens the engine spent on it (0 for a row that never reached it)."""
    return ResultRow(row_id, carried, None, prompt_tokens, completion_tokens, "error",
                     {"code": code, "message": redact(message)}, cached_tokens=cached_tokens, source=source)


def engine_row(req: Request, out: RequestOutput, tokenizer: Any) -> ResultRow:
    """The result of one engine request; a constrained output that a stop condition cut short, or off its schema,
    is an error row that counts the tokens it spent."""
    spent = {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": len(out.token_ids),
             "cached_tokens": out.num_cached_tokens}
    if out.finish_reason == "error":
        message = out.error or "the engine failed this request"
        return error_row(req.row_id, req.carried, "engine_error", message, req.source, **spent)
    problem = output_problem(req.params, out.text, out.grammar_complete, out.finish_reason)
    if problem is not None:
        return error_row(req.row_id, req.carried, *problem, source=req.source, **spent)
    logprobs = None
    if out.logprobs is not None:
        pieces = tokenizer.token_bytes(out.token_ids)  # a token may hold part of a character: its bytes say which
        logprobs = [{"token": b.decode("utf-8", "replace"), "bytes": list(b), "logprob": lp}
                    for b, lp in zip(pieces, out.logprobs)]
    return ResultRow(req.row_id, req.carried, out.text, len(out.prompt_token_ids), len(out.token_ids),
                     out.finish_reason or "stop", None, out.num_cached_tokens, logprobs, req.source)


def openai_record(row: ResultRow, model: str, default_url: str) -> dict[str, Any]:
    """What the OpenAI Batch writer needs of a row: the row id is its custom_id; an error row keeps its tokens."""
    return {"custom_id": row.row_id, "url": row.carried.get("url") or default_url, "model": model,
            "output": row.output, "finish_reason": row.finish_reason, "prompt_tokens": row.prompt_tokens,
            "completion_tokens": row.completion_tokens, "error": row.error, "logprobs": row.logprobs}


def _same(a: Any, b: Any) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def _holds(values: list[Any], dtype: pa.DataType | None) -> pa.DataType | None:
    """``dtype`` (inferred when None) if an Arrow array of it gives the values back as they are, else None."""
    try:
        array = pa.array(values, type=dtype)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError, TypeError):
        return None
    back = array.to_pylist()
    return array.type if len(back) == len(values) and all(map(_same, back, values)) else None


def _json_text(value: Any) -> str | None:
    return value if value is None or isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)


@dataclass
class PartSchema:
    """Parquet schema of output parts: fixed result columns, carried columns typed by their first values.

    Remembering carried column types keeps every part of a job on one schema, so the folder reads back
    as a single dataset; a column that is null throughout a part stays typed as in earlier parts. Values that
    no one type holds as they are (mixed types, or a part's values that its earlier type would change) are
    written as JSON text instead: carried values are never changed nor dropped.
    """

    id_column: str
    carry_columns: list[str]
    carry_types: dict[str, pa.DataType] = field(default_factory=dict)

    def seed(self, types: Mapping[str, pa.DataType]) -> None:
        """Take carried column types from already committed parts (on resume)."""
        for name, dtype in types.items():
            if name in self.carry_columns and not pa.types.is_null(dtype):
                self.carry_types.setdefault(name, dtype)

    def _carry_type(self, name: str, values: list[Any]) -> pa.DataType | None:
        """The column's type, or None where its values go as JSON text."""
        known = self.carry_types.get(name)
        held = _holds(values, known)
        if held is not None:
            if known is None and not pa.types.is_null(held):
                self.carry_types[name] = held
            return held
        if known is None:
            log.warning("carried column %r mixes value types: written as JSON text", name)
            self.carry_types[name] = pa.string()
        elif not pa.types.is_string(known):
            log.warning("carried column %r: values that its type from earlier parts (%s) would change are "
                        "written as JSON text in this part", name, known)
        return None

    def for_rows(self, rows: list[dict[str, Any]]) -> pa.Schema:
        """The part's schema; carried values that go as JSON text are turned into it in ``rows``."""
        fields = [pa.field(self.id_column, pa.string())]
        for name in self.carry_columns:
            dtype = self._carry_type(name, [r.get(name) for r in rows])
            if dtype is None:
                dtype = pa.string()
                for r in rows:
                    r[name] = _json_text(r.get(name))
            fields.append(pa.field(name, dtype))
        fields += [pa.field(name, _RESULT_TYPES[name]) for name in RESULT_COLUMNS]
        return pa.schema(fields)
