"""Read-only access to an output folder: committed parts, their manifest entries and the metadata files."""

from __future__ import annotations

import json
from typing import Any, Callable, TypeVar

from batchgen.io.errors import OutputError, guard
from batchgen.io.manifest import ManifestEntry, load_entries
from batchgen.io.parts import deserialize_rows
from batchgen.io.paths import filesystem
from batchgen.io.redaction import redact
from batchgen.io.retry import retry

__all__ = ["OutputFolder", "read_output"]

T = TypeVar("T")


class OutputFolder:
    """Reads what a job wrote without changing anything (no probe, no clean-up, unlike OutputWriter)."""

    def __init__(self, path: str, storage_options: dict[str, Any] | None = None) -> None:
        self.path = path.rstrip("/")
        self.fs, root = self._guard(lambda: filesystem(path, storage_options), "open")
        self.root = root.rstrip("/")
        self._entries: list[ManifestEntry] | None = None

    def _guard(self, fn: Callable[[], T], action: str) -> T:
        return guard(self.path, fn, f"{action} output")

    def entries(self) -> list[ManifestEntry]:
        """Manifest entries of the committed parts, in part order."""
        if self._entries is None:
            found, _ = self._guard(lambda: load_entries(self.fs, self.root), "read the manifest of")
            self._entries = [found[n] for n in sorted(found)]
        return self._entries

    def committed_row_ids(self) -> set[str]:
        return {rid for e in self.entries() for rid in e.row_ids}

    def read_part(self, entry: ManifestEntry, name: str | None = None) -> bytes:
        """The whole file ``name`` of one committed part (default: its main file; see ``entry.files``)."""
        name = name or entry.part
        target = f"{self.root}/{name}"
        return self._guard(lambda: retry(lambda: self.fs.cat_file(target), what=f"read {name}"),
                           f"read {name} of")

    def read_json(self, name: str) -> dict[str, Any] | None:
        """A JSON metadata file of the folder (stats.json, telemetry.json, _SUCCESS, _job.json); None when absent."""
        return read_metadata(self.fs, self.root, self.path, name)


def read_metadata(fs: Any, root: str, display: str, name: str) -> dict[str, Any] | None:
    """The JSON file ``name`` in the output folder at ``root`` (``display``: its URL); None when absent."""
    target = f"{root.rstrip('/')}/{name}"

    def read() -> bytes | None:
        try:
            return retry(lambda: fs.cat_file(target), what=f"read {name}")
        except FileNotFoundError:
            return None

    data = guard(display, read, f"read {name} of output")
    if data is None:
        return None
    try:
        return json.loads(data or b"{}")
    except ValueError as exc:
        raise OutputError(redact(f"{display}/{name} is not valid JSON: {exc}")) from None


def read_output(path: str, storage_options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """All rows of the committed parts under path, in part order (an OpenAI Batch part: results, then errors)."""
    folder = OutputFolder(path, storage_options)
    rows: list[dict[str, Any]] = []
    for entry in folder.entries():
        try:
            for name in entry.files:
                rows.extend(deserialize_rows(folder.read_part(entry, name), name.rsplit(".", 1)[-1]))
        except OutputError:
            raise
        except Exception as exc:
            raise OutputError(redact(f"cannot read output {path}: {type(exc).__name__}: {exc}")) from exc
    return rows
