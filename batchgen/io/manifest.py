"""Output folder layout and per-part manifest entries: a part is committed iff its entry exists."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any

import fsspec

from batchgen.io.atomic import TEMP_MARK  # noqa: F401 - part of the folder layout: listings skip temp names
from batchgen.io.redaction import redact
from batchgen.io.retry import retry

log = logging.getLogger(__name__)

MANIFEST_DIR = "_manifest"
SUCCESS = "_SUCCESS"
STATS = "stats.json"
TELEMETRY = "telemetry.json"
JOB = "_job.json"  # the identity of the job whose rows the folder holds (see pipeline.identity)
FORMATS = ("parquet", "jsonl", "openai")
_KEY = r"(?:[a-z0-9]+-)*\d{5,}"  # a PartId's key: [scope-]number
PART_RE = re.compile(rf"^(?:part|errors)-({_KEY})\.(parquet|jsonl)$")  # any data file of a part
ENTRY_RE = re.compile(rf"^part-({_KEY})\.json$")
SCOPE_RE = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*$")


@dataclass(frozen=True, order=True)
class PartId:
    """Which part: its ``number`` within a ``scope``. A single writer numbers its parts in the empty scope
    (``part-00012``); writers that commit into one folder side by side each number their own scope
    (``part-r1a2b-s00003-w00001-00000``), so their names never collide. Parts sort by scope, then number."""

    scope: str = ""
    number: int = 0

    def __post_init__(self) -> None:
        if self.scope and not SCOPE_RE.match(self.scope):
            raise ValueError(f"bad part scope {self.scope!r}: lowercase letters and digits joined by '-'")

    @property
    def key(self) -> str:
        return f"{self.scope}-{self.number:05d}" if self.scope else f"{self.number:05d}"

    @classmethod
    def parse(cls, key: str) -> PartId:
        scope, _, number = key.rpartition("-")
        return cls(scope, int(number))


def part_name(part: PartId, fmt: str) -> str:
    return f"part-{part.key}.{'jsonl' if fmt == 'openai' else fmt}"


def entry_name(part: PartId) -> str:
    return f"part-{part.key}.json"


def to_json_bytes(obj: Any) -> bytes:
    """Redacted, UTF-8 JSON for metadata files."""
    return json.dumps(redact(obj), ensure_ascii=False, sort_keys=True, default=str).encode("utf-8")


@dataclass
class ManifestEntry:
    """What one committed part holds."""

    id: PartId
    part: str  # file name inside the output folder
    row_ids: list[str]
    stats: dict[str, Any] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)  # every file of the part (the openai format adds errors)
    format: str = ""

    def __post_init__(self) -> None:
        self.files = self.files or [self.part]
        self.format = self.format or self.part.rsplit(".", 1)[-1]

    def to_bytes(self) -> bytes:
        # row ids are data, not credentials: only the stats go through redaction
        doc = {"part": self.part, "files": self.files, "format": self.format, "rows": len(self.row_ids),
               "row_ids": self.row_ids, "stats": redact(self.stats)}
        return json.dumps(doc, ensure_ascii=False, default=str).encode("utf-8")

    @classmethod
    def from_bytes(cls, part_id: PartId, data: bytes) -> ManifestEntry:
        doc = json.loads(data.decode("utf-8"))
        part, row_ids, files = doc["part"], doc["row_ids"], doc.get("files") or [doc["part"]]
        if not all(isinstance(f, str) and PART_RE.match(f) for f in files) or part not in files \
                or not isinstance(row_ids, list) or doc.get("format", "jsonl") not in FORMATS:
            raise ValueError(f"bad manifest entry for {part!r}")
        stats = dict(doc.get("stats") or {})
        return cls(id=part_id, part=part, row_ids=[str(r) for r in row_ids], stats=stats, files=list(files),
                   format=doc.get("format", ""))


def list_names(fs: fsspec.AbstractFileSystem, folder: str) -> list[str]:
    """Base names of the entries directly in folder ([] when it does not exist)."""
    fs.invalidate_cache(folder)
    try:
        found = retry(lambda: fs.ls(folder, detail=False), what=f"list {folder}")
    except FileNotFoundError:
        return []
    return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in found)


def entry_ids(names: list[str], scope: str | None = None) -> list[PartId]:
    """The parts whose manifest entries are among ``names`` (only those of ``scope`` when given)."""
    found = [PartId.parse(m.group(1)) for n in names if (m := ENTRY_RE.match(n))]
    return [p for p in found if scope is None or p.scope == scope]


def load_entries(fs: fsspec.AbstractFileSystem, root: str, scope: str | None = None
                 ) -> tuple[dict[PartId, ManifestEntry], list[str]]:
    """(valid entries by part, paths of unreadable entry files); only those of ``scope`` when given."""
    folder = f"{root}/{MANIFEST_DIR}"
    paths = {f"{folder}/{entry_name(p)}": p for p in entry_ids(list_names(fs, folder), scope)}
    if not paths:
        return {}, []
    blobs = retry(lambda: fs.cat(list(paths)), what=f"read manifest in {root}")
    entries: dict[PartId, ManifestEntry] = {}
    bad: list[str] = []
    for path, part_id in paths.items():
        try:
            entries[part_id] = ManifestEntry.from_bytes(part_id, blobs[path])
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring bad manifest entry %s: %s", redact(path), redact(str(exc)))
            bad.append(path)
    return entries, bad
