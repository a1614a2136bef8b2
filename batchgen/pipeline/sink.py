"""Buffers finished rows and commits them as parts of ``rows_per_part`` rows, with per-part stats."""
from __future__ import annotations

import logging
from typing import Any, Callable

from batchgen.io import OutputError, OutputWriter
from batchgen.pipeline.rows import PartSchema, ResultRow
from batchgen.pipeline.stats import Counts

log = logging.getLogger(__name__)


class PartSink:
    """Collects rows in finishing order; ``flush`` writes the buffer as one committed part."""

    def __init__(self, writer: OutputWriter, schema: PartSchema, rows_per_part: int, spec_digest: str,
                 on_row: Callable[[ResultRow], None] | None = None,
                 to_record: Callable[[ResultRow], dict[str, Any]] | None = None) -> None:
        self.writer = writer
        self.schema = schema
        self.rows_per_part = rows_per_part
        self.spec_digest = spec_digest
        self.on_row = on_row
        self.to_record = to_record or (lambda row: row.to_dict(schema.id_column))
        self.run = Counts()  # everything this run committed
        self.parts_written = 0
        self._rows: list[ResultRow] = []

    def add(self, row: ResultRow) -> None:
        self._rows.append(row)
        if self.on_row is not None:
            self.on_row(row)
        if len(self._rows) >= self.rows_per_part:
            self.flush()

    @property
    def buffered(self) -> int:
        return len(self._rows)

    def flush(self) -> None:
        if not self._rows:
            return
        rows, counts = self._rows, Counts()
        for r in rows:
            counts.add_row(r)
        dicts = [self.to_record(r) for r in rows]
        try:
            schema = self.schema.for_rows(dicts) if self.writer.fmt == "parquet" else None
        except ValueError as e:
            raise OutputError(str(e)) from None
        stats = {**counts.to_dict(), "spec_digest": self.spec_digest}
        url = self.writer.write_part(dicts, stats, row_ids=[r.row_id for r in rows], schema=schema)
        self._rows = []  # only once committed: a failed write keeps the rows for a retry
        self.run.add(counts)
        self.parts_written += 1
        log.debug("committed %s (%d rows)", url, counts.rows)
