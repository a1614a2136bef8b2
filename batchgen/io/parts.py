"""Serialization of output rows to whole Parquet/JSONL part files in memory, and back."""

from __future__ import annotations

import io
import json
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.io import openai_batch
from batchgen.io.manifest import PartId, part_name


def _column_order(rows: list[dict[str, Any]]) -> list[str]:
    seen: dict[str, None] = {}
    for row in rows:
        for key in row:
            seen.setdefault(key, None)
    return list(seen)


def rows_to_table(rows: list[dict[str, Any]], known_types: dict[str, pa.DataType]) -> pa.Table:
    """Arrow table for rows; an all-null column takes its type from earlier parts, else string.

    known_types is updated with the types seen here, so that later parts stay consistent.
    """
    arrays: dict[str, pa.Array] = {}
    for name in _column_order(rows):
        values = [row.get(name) for row in rows]
        if all(v is None for v in values):
            arrays[name] = pa.array(values, type=known_types.get(name, pa.string()))
        elif name in known_types:
            try:
                arrays[name] = pa.array(values, type=known_types[name])
            except (pa.ArrowInvalid, pa.ArrowTypeError):
                arrays[name] = pa.array(values)
        else:
            arrays[name] = pa.array(values)
    table = pa.table(arrays)
    for f in table.schema:
        if not pa.types.is_null(f.type):
            known_types.setdefault(f.name, f.type)
    return table


def serialize_rows(
    rows: list[dict[str, Any]],
    fmt: str,
    schema: pa.Schema | None = None,
    known_types: dict[str, pa.DataType] | None = None,
) -> bytes:
    """The complete bytes of one part file."""
    if fmt == "jsonl":
        return b"".join(json.dumps(r, ensure_ascii=False, default=str).encode("utf-8") + b"\n" for r in rows)
    if schema is not None:
        table = pa.Table.from_pylist(rows, schema=schema)
    else:
        table = rows_to_table(rows, known_types if known_types is not None else {})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


def serialize_part(
    rows: list[dict[str, Any]],
    fmt: str,
    part: PartId,
    schema: pa.Schema | None = None,
    known_types: dict[str, pa.DataType] | None = None,
) -> dict[str, bytes]:
    """Every file of ``part``, by name; the first is the part's main file."""
    if fmt == "openai":
        return openai_batch.serialize_part(rows, part.key)
    return {part_name(part, fmt): serialize_rows(rows, fmt, schema, known_types)}


def deserialize_rows(data: bytes, fmt: str) -> list[dict[str, Any]]:
    """Rows of one part file's bytes."""
    if fmt == "jsonl":
        return [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]
    return pq.read_table(io.BytesIO(data)).to_pylist()
