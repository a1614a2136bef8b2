"""OutputWriter: atomic part files, a per-part manifest for resume, and a _SUCCESS commit marker."""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any, Callable, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.io.committer import PartCommitter
from batchgen.io.errors import OutputError, guard
from batchgen.io.folder import read_metadata
from batchgen.io.lease import Lease, LeaseSettings
from batchgen.io.manifest import (
    FORMATS, JOB, MANIFEST_DIR, PART_RE, STATS, SUCCESS, TELEMETRY, TEMP_MARK, ManifestEntry, PartId, entry_name,
    list_names, load_entries, to_json_bytes,
)
from batchgen.io.paths import filesystem
from batchgen.io.redaction import redact
from batchgen.io.retry import retry
from batchgen.io.store import Store

__all__ = ["OutputWriter"]

log = logging.getLogger(__name__)
T = TypeVar("T")

# The writability probe of a run that does not hold the lease yet: a cleanup that deleted it would fail that
# run's probe, so cleanups leave probes alone (an empty file, left behind only by a crash mid-probe).
PROBE = ".probe"


def is_leftover_temp(name: str) -> bool:
    """A half-written file a crashed run left behind (not another run's writability probe)."""
    return TEMP_MARK in name and not name.lstrip(".").startswith(PROBE.lstrip("."))


class OutputWriter:
    """Writes part files into an output folder so that a crashed job can resume where it stopped.

    Each part is serialized in memory and stored with one PUT (or fsynced temp file + rename on local
    disks), then recorded by its own manifest entry: a part is committed iff that entry exists.
    Row ids come from row[id_key] unless write_part is given row_ids. With ``lease`` the writer owns
    the folder (see batchgen.io.lease) from before it touches anything until close(). The writer's own
    parts are numbered in the empty scope; other committers (see ``committer``) may add parts of their own
    scopes while it holds the lease, which ``refresh`` reads.
    """

    def __init__(
        self,
        path: str,
        fmt: str = "parquet",
        storage_options: dict[str, Any] | None = None,
        overwrite: bool = False,
        schema: pa.Schema | None = None,
        id_key: str = "row_id",
        lease: LeaseSettings | None = None,
    ) -> None:
        if fmt not in FORMATS:
            raise OutputError(f"unknown output format {fmt!r}; use one of {', '.join(FORMATS)}")
        self.path = path.rstrip("/")
        self.fmt = fmt
        self.schema = schema
        self.id_key = id_key
        self._types: dict[str, pa.DataType] = {}
        fs, root = self._guard(lambda: filesystem(path, storage_options), "open output")
        self.store = Store(fs, root)
        self.fs, self.root = fs, self.store.root
        self._check_writable()
        self.lease = Lease(self.store, self.path, lease) if lease is not None else None
        if self.lease is not None:
            self._guard(self.lease.acquire, "take the lease of")
        try:
            self._open(overwrite)
        except BaseException:
            self.close()
            raise

    def _open(self, overwrite: bool) -> None:
        if overwrite:
            self._delete_previous()
        self._entries: dict[PartId, ManifestEntry] = {}
        self.refresh()
        self._check_resume_format()
        if not overwrite:
            self._refuse_foreign_parts()
            self.cleanup_uncommitted()
        if self.fmt == "parquet" and self._entries:
            self._seed_types()
        own = max((p.number for p in self._entries if not p.scope), default=-1) + 1
        self._committer = PartCommitter(self.store, self.path, self.fmt, first=own, types=self._types,
                                        fence=self.ensure_held, id_key=self.id_key, schema=self.schema)

    # -- storage helpers ------------------------------------------------------------------

    def _guard(self, fn: Callable[[], T], action: str) -> T:
        return guard(self.path, fn, action)

    def _full(self, name: str) -> str:
        return self.store.full(name)

    def ensure_held(self) -> None:
        """Raises LeaseLost once this writer no longer owns the folder (a no-op without a lease)."""
        if self.lease is not None:
            self.lease.ensure_held()

    def _put(self, name: str, data: bytes) -> None:
        """Store name whole or not at all, if this writer still owns the folder."""
        self.ensure_held()
        self.store.put(name, data)

    def _delete(self, names: list[str]) -> None:
        self.store.delete(names)

    def _check_writable(self) -> None:
        probe = f"{PROBE}{TEMP_MARK}{uuid.uuid4().hex}"

        def probe_once() -> None:
            self.store.put(probe, b"")
            self._delete([probe])

        try:
            probe_once()
        except Exception as exc:
            message = f"output path {self.path} is not writable: {type(exc).__name__}: {exc}"
            raise OutputError(redact(message)) from exc

    def _delete_previous(self) -> None:
        def delete() -> None:
            names = list_names(self.fs, self.root)
            # un-complete, then un-commit, then remove the data
            self._delete([n for n in (SUCCESS,) if n in names])
            if MANIFEST_DIR in names:
                retry(lambda: self.fs.rm(self._full(MANIFEST_DIR), recursive=True), what="delete manifest")
            self._delete([n for n in names if PART_RE.match(n) or n in (STATS, TELEMETRY, JOB) or is_leftover_temp(n)])

        self._guard(delete, "clear previous output in")

    def _drop_entries(self, paths: list[str]) -> None:
        if paths:
            self._guard(lambda: retry(lambda: self.fs.rm(paths), what="delete bad manifest entries"),
                        "delete bad manifest entries in")

    def _refuse_foreign_parts(self) -> None:
        """A folder no batchgen run has written (no manifest, _job.json, stats or _SUCCESS) whose files are named
        as parts are someone else's: resuming would delete or overwrite them as a killed run's leftovers."""
        names = self._guard(lambda: list_names(self.fs, self.root), "list")
        parts = sorted(n for n in names if PART_RE.match(n))
        if parts and not {MANIFEST_DIR, JOB, STATS, SUCCESS} & set(names):
            shown = ", ".join(parts[:3]) + (f" and {len(parts) - 3} more" if len(parts) > 3 else "")
            raise OutputError(redact(f"{self.path} holds files named as output parts ({shown}) that no batchgen "
                                     f"run recorded; they would be replaced. Choose an empty or new folder, or pass "
                                     f"--overwrite to delete them"))

    def _check_resume_format(self) -> None:
        other = sorted({e.format for e in self._entries.values()} - {self.fmt})
        if other:
            raise OutputError(redact(f"{self.path} holds committed {other[0]} parts from an earlier run; "
                                     f"resume with that format or overwrite"))

    def _seed_types(self) -> None:
        """Take column types from the last committed part, so resumed parts keep the same schema."""
        last = self._full(self._entries[max(self._entries)].part)

        def read_schema() -> pa.Schema:
            with self.fs.open(last, "rb") as f:
                return pq.read_schema(f)

        for f in self._guard(lambda: retry(read_schema, what=f"read schema of {redact(last)}"), "read"):
            if not pa.types.is_null(f.type):
                self._types[f.name] = f.type

    # -- public API -----------------------------------------------------------------------

    def is_complete(self) -> bool:
        """True when _SUCCESS exists: the job that wrote this folder finished."""
        self.fs.invalidate_cache(self.root)
        return self._guard(lambda: retry(lambda: self.fs.exists(self._full(SUCCESS))), "check")

    def committed_row_ids(self) -> set[str]:
        """Row ids covered by committed parts."""
        return {rid for e in self._entries.values() for rid in e.row_ids}

    def committed_stats(self, scope_prefix: str = "") -> list[dict[str, Any]]:
        """The stats dicts of committed parts (those whose scope starts with ``scope_prefix``), in part order."""
        return [self._entries[p].stats for p in sorted(self._entries) if p.scope.startswith(scope_prefix)]

    def committed_scopes(self) -> set[str]:
        """The scopes of committed parts ("" for the parts of a single writer)."""
        return {p.scope for p in self._entries}

    def committed_column_types(self) -> dict[str, pa.DataType]:
        """Column types of the last committed Parquet part (empty otherwise), for a consistent schema."""
        return dict(self._types)

    def success_stats(self) -> dict[str, Any]:
        """The stats a finished job wrote to _SUCCESS."""
        data = self._guard(lambda: retry(lambda: self.fs.cat_file(self._full(SUCCESS))), "read _SUCCESS in")
        return json.loads(data or b"{}")

    def refresh(self, cleanup: bool = False) -> None:
        """Reads the manifest again (other committers may have added parts); ``cleanup`` then deletes the files
        no committed part holds. Only while no other committer is writing: their part in flight would go."""
        entries, bad = self._guard(lambda: load_entries(self.fs, self.root), "read the manifest of")
        self._entries = entries
        self._drop_entries(bad)
        if cleanup:
            self.cleanup_uncommitted()

    def cleanup_uncommitted(self) -> None:
        """Delete part and temp files that no manifest entry covers (left by a crashed run)."""
        committed = {f for e in self._entries.values() for f in e.files}

        def cleanup() -> None:
            names = list_names(self.fs, self.root)
            orphans = [n for n in names if (PART_RE.match(n) and n not in committed) or is_leftover_temp(n)]
            if MANIFEST_DIR in names:
                orphans += [f"{MANIFEST_DIR}/{n}" for n in list_names(self.fs, self._full(MANIFEST_DIR))
                            if TEMP_MARK in n]
            # an entry whose part file has gone no longer covers its rows
            missing = [n for n, e in self._entries.items() if not set(e.files) <= set(names)]
            for n in missing:
                log.warning("part %s listed in the manifest is missing; its rows will be redone",
                            self._entries[n].part)
            self._drop_entries([self._full(f"{MANIFEST_DIR}/{entry_name(n)}") for n in missing])
            for n in missing:
                del self._entries[n]
            if orphans:
                log.info("deleting %d uncommitted file(s) in %s", len(orphans), redact(self.path))
            self._delete(orphans)

        self._guard(cleanup, "clean up")

    def write_part(
        self,
        rows: list[dict[str, Any]],
        stats: dict[str, Any] | None = None,
        row_ids: list[str] | None = None,
        schema: pa.Schema | None = None,
    ) -> str:
        """Write and commit the next part; returns its URL. Nothing is visible if this raises."""
        entry = self._committer.commit(rows, stats, row_ids, schema)
        self._entries[entry.id] = entry
        return self._committer.url(entry)

    def write_stats(self, stats: dict[str, Any]) -> None:
        """Write stats.json (credentials redacted)."""
        self._guard(lambda: self._put(STATS, to_json_bytes(stats)), "write stats.json in")

    def write_job(self, doc: dict[str, Any]) -> None:
        """Write _job.json: what the job whose rows this folder holds is (see ``pipeline.identity``)."""
        self._guard(lambda: self._put(JOB, to_json_bytes(doc)), "write _job.json in")

    def read_json(self, name: str) -> dict[str, Any] | None:
        """A JSON metadata file of the folder (stats.json, _job.json, ...); None when absent."""
        return read_metadata(self.fs, self.root, self.path, name)

    def write_telemetry(self, telemetry: dict[str, Any]) -> None:
        """Write telemetry.json (credentials redacted), beside stats.json."""
        self._guard(lambda: self._put(TELEMETRY, to_json_bytes(telemetry)), "write telemetry.json in")

    def commit(self, stats: dict[str, Any]) -> None:
        """Mark the job finished: write _SUCCESS, holding the job's stats, last."""
        self._guard(lambda: self._put(SUCCESS, to_json_bytes(stats)), "write _SUCCESS in")

    def close(self) -> None:
        """Give up the folder's lease (a no-op without one)."""
        if self.lease is not None:
            self.lease.release()

    def __enter__(self) -> OutputWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

