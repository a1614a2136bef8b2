"""Buffers finished rows and commits them as parts of ``rows_per_part`` rows, or fewer once the oldest
buffered row is ``max_age_s`` old, with per-part stats."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Protocol

import pyarrow as pa

from batchgen.io import redact
from batchgen.pipeline.rows import PartSchema, ResultRow
from batchgen.pipeline.stats import Counts

log = logging.getLogger(__name__)

INPUTS_KEY = "inputs"  # part stats: fingerprints of the input files whose rows it is the first to commit


class PartWriter(Protocol):
    """Where a sink commits its parts: the output's ``OutputWriter``, or a ``PartCommitter`` of one scope."""

    fmt: str

    def write_part(self, rows: list[dict[str, Any]], stats: dict[str, Any] | None = None,
                   row_ids: list[str] | None = None, schema: pa.Schema | None = None) -> str: ...


class PartSink:
    """Collects rows in finishing order; ``flush`` writes the buffer as one committed part.

    A background thread flushes a buffer whose oldest row has waited ``max_age_s``, so a slow job loses
    at most that much finished work on a crash. ``inputs`` maps input files to their fingerprints; each
    file's fingerprint is stored with the first part holding one of its rows (``recorded`` files already
    have one from an earlier run).
    """

    def __init__(self, writer: PartWriter, schema: PartSchema, rows_per_part: int, job_digest: str,
                 on_row: Callable[[ResultRow], None] | None = None,
                 to_record: Callable[[ResultRow], dict[str, Any]] | None = None, max_age_s: float | None = None,
                 inputs: dict[str, dict[str, Any]] | None = None, recorded: set[str] | None = None) -> None:
        self.writer = writer
        self.schema = schema
        self.rows_per_part = rows_per_part
        self.job_digest = job_digest
        self.on_row = on_row
        self.to_record = to_record or (lambda row: row.to_dict(schema.id_column))
        self.max_age_s = max_age_s
        self.inputs = inputs or {}
        self.recorded = set(recorded or ())
        self.run = Counts()  # everything this run committed
        self.parts_written = 0
        self._rows: list[ResultRow] = []
        self._oldest = 0.0
        self._lock = threading.Lock()
        self._failure: BaseException | None = None
        self._stop = threading.Event()
        self._ager: threading.Thread | None = None
        if max_age_s is not None:
            self._ager = threading.Thread(target=self._flush_old, name="part-ager", daemon=True)
            self._ager.start()

    def add(self, row: ResultRow) -> None:
        with self._lock:
            if not self._rows:
                self._oldest = time.monotonic()
            self._rows.append(row)
        if self.on_row is not None:
            self.on_row(row)
        self._raise_background_failure()
        if len(self._rows) >= self.rows_per_part:
            self.flush()

    @property
    def buffered(self) -> int:
        return len(self._rows)

    def flush(self) -> None:
        self._raise_background_failure()
        with self._lock:
            self._flush()

    def save_finished(self) -> None:
        """Best effort after a failure: commit the rows that did finish, so a rerun need not redo them."""
        try:
            self.flush()
        except Exception as e:  # noqa: BLE001 - the original failure is the one to report
            log.warning("could not commit %d finished rows: %s", self.buffered, redact(str(e)))

    def close(self) -> None:
        """Stops the background flusher (the buffer is left as it is)."""
        self._stop.set()
        if self._ager is not None:
            self._ager.join(timeout=60)

    def _flush_old(self) -> None:
        assert self.max_age_s is not None
        tick = min(self.max_age_s / 4, 5.0)
        while not self._stop.wait(tick):
            with self._lock:
                if not self._rows or time.monotonic() - self._oldest < self.max_age_s:
                    continue
                try:
                    self._flush()
                except BaseException as e:  # noqa: BLE001 - raised in the job's thread at its next add/flush
                    self._failure = e
                    return

    def _raise_background_failure(self) -> None:
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure

    def _flush(self) -> None:
        if not self._rows:
            return
        rows, counts = self._rows, Counts()
        for r in rows:
            counts.add_row(r)
        dicts = [self.to_record(r) for r in rows]
        schema = self.schema.for_rows(dicts) if self.writer.fmt == "parquet" else None
        stats: dict[str, Any] = {**counts.to_dict(), "job_digest": self.job_digest}
        first = sorted({r.source for r in rows if r.source in self.inputs} - self.recorded)
        if first:
            stats[INPUTS_KEY] = [{"file": f, **self.inputs[f]} for f in first]
        url = self.writer.write_part(dicts, stats, row_ids=[r.row_id for r in rows], schema=schema)
        self._rows = []  # only once committed: a failed write keeps the rows for a retry
        self.recorded.update(first)
        self.run.add(counts)
        self.parts_written += 1
        log.debug("committed %s (%d rows)", url, counts.rows)
