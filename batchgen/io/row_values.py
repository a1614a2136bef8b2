"""What a read row's values must be to go on: held by Python (a Parquet value may not be) and writable as UTF-8
(a JSON string may hold half a surrogate pair); and Parquet rows' sizes before they are converted."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc


@dataclass
class Unconvertible:
    """A Parquet row with a value Python cannot hold (a timestamp past year 9999, ...): an error row, not the job's."""

    column: str
    reason: str
    values: dict[str, Any]  # the row's other columns


SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # a JSON escape that can decode to half a UTF-16 pair
LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def holds_surrogate(value: Any) -> bool:
    """Whether a decoded JSON value holds a lone surrogate anywhere (keys included), which UTF-8 cannot write."""
    if isinstance(value, str):
        return LONE_SURROGATE.search(value) is not None
    if isinstance(value, dict):
        return any(holds_surrogate(k) or holds_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(holds_surrogate(v) for v in value)
    return False


def row_sizes(batch: pa.RecordBatch) -> list[int]:
    """Approximate bytes per row: exact for string/binary columns, the column average for the others."""
    sizes = [0] * batch.num_rows
    for column in batch.columns:
        t = column.type
        if pa.types.is_string(t) or pa.types.is_binary(t) or pa.types.is_large_string(t) \
                or pa.types.is_large_binary(t):
            lengths = pc.binary_length(column).fill_null(0).to_pylist()
        else:
            lengths = [column.nbytes // max(1, batch.num_rows)] * batch.num_rows
        sizes = [a + b for a, b in zip(sizes, lengths)]
    return sizes


def to_pylist(batch: pa.RecordBatch) -> list[dict | Unconvertible]:
    """The batch's rows as dicts; a row with a value Python cannot hold as Unconvertible (its first such column)."""
    try:
        return batch.to_pylist()
    except (OverflowError, ValueError, pa.ArrowException):
        return [_row_or_unconvertible(batch.slice(i, 1)) for i in range(batch.num_rows)]


def _row_or_unconvertible(row: pa.RecordBatch) -> dict | Unconvertible:
    try:
        return row.to_pylist()[0]
    except (OverflowError, ValueError, pa.ArrowException):
        values, failed = {}, None
        for name, column in zip(row.schema.names, row.columns):
            try:
                values[name] = column.to_pylist()[0]
            except (OverflowError, ValueError, pa.ArrowException) as exc:
                failed = failed or (name, f"{type(exc).__name__}: {exc}")
        if failed is None:
            raise
        return Unconvertible(*failed, values)
