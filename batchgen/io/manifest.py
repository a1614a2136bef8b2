"""Output folder layout and per-part manifest entries: a part is committed iff its entry exists."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any

import fsspec

from batchgen.io.redaction import redact
from batchgen.io.retry import retry

log = logging.getLogger(__name__)

MANIFEST_DIR = "_manifest"
SUCCESS = "_SUCCESS"
STATS = "stats.json"
TELEMETRY = "telemetry.json"
FORMATS = ("parquet", "jsonl", "openai")
PART_RE = re.compile(r"^(?:part|errors)-(\d{5,})\.(parquet|jsonl)$")  # any data file of a part
ENTRY_RE = re.compile(r"^part-(\d{5,})\.json$")
TEMP_MARK = ".tmp-"


def part_name(number: int, fmt: str) -> str:
    return f"part-{number:05d}.{'jsonl' if fmt == 'openai' else fmt}"


def entry_name(number: int) -> str:
    return f"part-{number:05d}.json"


def to_json_bytes(obj: Any) -> bytes:
    """Redacted, UTF-8 JSON for metadata files."""
    return json.dumps(redact(obj), ensure_ascii=False, sort_keys=True, default=str).encode("utf-8")


@dataclass
class ManifestEntry:
    """What one committed part holds."""

    number: int
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
    def from_bytes(cls, number: int, data: bytes) -> ManifestEntry:
        doc = json.loads(data.decode("utf-8"))
        part, row_ids, files = doc["part"], doc["row_ids"], doc.get("files") or [doc["part"]]
        if not all(isinstance(f, str) and PART_RE.match(f) for f in files) or part not in files \
                or not isinstance(row_ids, list) or doc.get("format", "jsonl") not in FORMATS:
            raise ValueError(f"bad manifest entry for {part!r}")
        stats = dict(doc.get("stats") or {})
        return cls(number=number, part=part, row_ids=[str(r) for r in row_ids], stats=stats, files=list(files),
                   format=doc.get("format", ""))


def list_names(fs: fsspec.AbstractFileSystem, folder: str) -> list[str]:
    """Base names of the entries directly in folder ([] when it does not exist)."""
    fs.invalidate_cache(folder)
    try:
        found = retry(lambda: fs.ls(folder, detail=False), what=f"list {folder}")
    except FileNotFoundError:
        return []
    return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in found)


def load_entries(fs: fsspec.AbstractFileSystem, root: str) -> tuple[dict[int, ManifestEntry], list[str]]:
    """(valid entries by part number, paths of unreadable entry files)."""
    folder = f"{root}/{MANIFEST_DIR}"
    paths = {f"{folder}/{n}": int(m.group(1)) for n in list_names(fs, folder) if (m := ENTRY_RE.match(n))}
    if not paths:
        return {}, []
    blobs = retry(lambda: fs.cat(list(paths)), what=f"read manifest in {root}")
    entries: dict[int, ManifestEntry] = {}
    bad: list[str] = []
    for path, number in paths.items():
        try:
            entries[number] = ManifestEntry.from_bytes(number, blobs[path])
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring bad manifest entry %s: %s", redact(path), redact(str(exc)))
            bad.append(path)
    return entries, bad
