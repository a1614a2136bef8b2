"""Committing parts into an output folder: a part's files are stored whole, then its manifest entry, which is
the commit. Several committers may share a folder, each numbering the parts of its own scope."""

from __future__ import annotations

from typing import Any, Callable

import pyarrow as pa

from batchgen.crashpoints import crash_point
from batchgen.io.errors import OutputError, guard
from batchgen.io.manifest import MANIFEST_DIR, ManifestEntry, PartId, entry_name, load_entries, part_name
from batchgen.io.parts import serialize_part
from batchgen.io.paths import filesystem
from batchgen.io.redaction import redact
from batchgen.io.store import Store

__all__ = ["PartCommitter"]


class PartCommitter:
    """Writes parts ``PartId(scope, first)``, ``PartId(scope, first + 1)``, ... into ``store``.

    ``fence`` runs before every write and raises (``LeaseLost``) once the run no longer owns the folder.
    ``types`` maps column names to the types earlier parts gave them, so a column that is null throughout a
    part keeps its type; the committer adds the types it writes. Row ids come from ``row[id_key]`` unless
    ``write_part`` is given them.
    """

    def __init__(self, store: Store, path: str, fmt: str, scope: str = "", first: int = 0,
                 types: dict[str, pa.DataType] | None = None, fence: Callable[[], None] | None = None,
                 id_key: str = "row_id", schema: pa.Schema | None = None) -> None:
        self.store = store
        self.path = path.rstrip("/")
        self.fmt = fmt
        self.scope = scope
        self.next = first
        self.types = types if types is not None else {}
        self.fence = fence
        self.id_key = id_key
        self.schema = schema
        self.committed: list[ManifestEntry] = []  # the scope's parts committed before (see open)
        PartId(scope)  # checks the scope's spelling

    @classmethod
    def open(cls, path: str, fmt: str, storage_options: dict[str, Any] | None, scope: str,
             **kwargs: Any) -> PartCommitter:
        """A committer of ``scope`` in the folder at ``path`` that continues after the scope's committed parts;
        ``committed`` of the result holds them (a rerun of the same work reads what it need not redo)."""
        fs, root = guard(path, lambda: filesystem(path, storage_options), "open output")
        store = Store(fs, root)
        entries, _ = guard(path, lambda: load_entries(fs, store.root, scope), "read the manifest of")
        committer = cls(store, path, fmt, scope, max((p.number for p in entries), default=-1) + 1, **kwargs)
        committer.committed = list(entries.values())
        return committer

    def _put(self, name: str, data: bytes) -> None:
        """Store name whole or not at all, if this run still owns the folder."""
        if self.fence is not None:
            self.fence()
        self.store.put(name, data)

    def write_part(self, rows: list[dict[str, Any]], stats: dict[str, Any] | None = None,
                   row_ids: list[str] | None = None, schema: pa.Schema | None = None) -> str:
        """Writes and commits the next part; returns its URL. Nothing of it is committed if this raises."""
        return self.url(self.commit(rows, stats, row_ids, schema))

    def commit(self, rows: list[dict[str, Any]], stats: dict[str, Any] | None = None,
               row_ids: list[str] | None = None, schema: pa.Schema | None = None) -> ManifestEntry:
        """Writes and commits the next part; returns its manifest entry."""
        part = PartId(self.scope, self.next)
        name = part_name(part, self.fmt)
        if row_ids is None:
            try:
                row_ids = [str(r[self.id_key]) for r in rows]
            except KeyError:
                raise OutputError(f"rows for {name} lack the id key {self.id_key!r}") from None
        elif len(row_ids) != len(rows):
            raise OutputError(f"{name}: {len(row_ids)} row ids for {len(rows)} rows")
        schema = schema or self.schema
        if not rows and schema is None and self.fmt == "parquet":
            raise OutputError(f"{name}: an empty Parquet part needs a schema")
        try:
            files = serialize_part(rows, self.fmt, part, schema, self.types)
        except Exception as exc:
            raise OutputError(redact(f"cannot serialize {name}: {type(exc).__name__}: {exc}")) from exc
        entry = ManifestEntry(id=part, part=name, row_ids=[str(r) for r in row_ids], stats=dict(stats or {}),
                              files=list(files), format=self.fmt)
        crash_point("part.before")
        for file_name, data in files.items():
            guard(self.path, lambda: self._put(file_name, data), f"write {file_name} in")
        crash_point("part.after")
        guard(self.path, lambda: self._put(f"{MANIFEST_DIR}/{entry_name(part)}", entry.to_bytes()),
              f"commit {name} in")
        crash_point("manifest.after")
        self.next = part.number + 1
        return entry

    def url(self, entry: ManifestEntry) -> str:
        return f"{self.path}/{entry.part}"
