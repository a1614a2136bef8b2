"""Looking after a prefix store: what it holds per namespace, and pruning it by age and by size."""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from batchgen.engine.kv_store.store import SUFFIX
from batchgen.io.manifest import TEMP_MARK
from batchgen.io.paths import filesystem
from batchgen.io.retry import retry

_MTIME_KEYS = ("mtime", "LastModified", "last_modified", "created", "updated")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
STALE_TEMP_S = 3600.0  # a temp file this old belongs to a writer that died


@dataclass(frozen=True)
class StoredObject:
    path: str
    namespace: str
    size: int
    mtime: float  # seconds since the epoch; when it was written
    temp: bool = False  # a writer's unfinished temp file


@dataclass
class Usage:
    objects: int = 0
    bytes: int = 0
    oldest: float | None = None
    newest: float | None = None

    def add(self, obj: StoredObject) -> None:
        self.objects += 1
        self.bytes += obj.size
        self.oldest = obj.mtime if self.oldest is None else min(self.oldest, obj.mtime)
        self.newest = obj.mtime if self.newest is None else max(self.newest, obj.mtime)


@dataclass
class PruneResult:
    deleted: int = 0
    freed_bytes: int = 0
    kept: int = 0
    kept_bytes: int = 0


def parse_duration(text: str) -> float:
    """Seconds in ``90``, ``45s``, ``30m``, ``12h``, ``7d`` or ``2w``."""
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"not a duration: {text!r} (use e.g. 45s, 30m, 12h, 7d, 2w)")
    return float(match.group(1)) * _UNIT_S[match.group(2)]


def _mtime(info: dict[str, Any]) -> float:
    for key in _MTIME_KEYS:
        value = info.get(key)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, (int, float)):
            return float(value)
    return 0.0


# A block object's path ends <namespace>/<key[:2]>/<key>.kv (store.object_name); a writer's temp file is that name
# hidden, with the temp mark and a random suffix. Nothing else under the URL is the store's.
_OBJECT = re.compile(r"(?:^|/)([0-9a-f]{32})/([0-9a-f]{2})/(\.?)(\2[0-9a-f]{14})" + re.escape(SUFFIX)
                     + r"(" + re.escape(TEMP_MARK) + r"[0-9a-f]+)?$")


class NoStore(FileNotFoundError):
    """Nothing is at the store's URL (a mistyped one, or a store never written)."""


def list_objects(url: str, storage_options: dict | None = None) -> list[StoredObject]:
    """Every block object (and leftover temp file) of the store at ``url`` (its root, or one namespace's folder);
    other files under it are not the store's and are never listed. Raises NoStore where nothing is at ``url``."""
    fs, root = filesystem(url, storage_options)
    root = root.rstrip("/")
    if not retry(lambda: fs.exists(root), what="look up the store"):
        raise NoStore(f"no prefix store at {url}")
    found = retry(lambda: fs.find(root, detail=True), what="list the store")
    out = []
    for path, info in sorted(found.items()):
        match = _OBJECT.search(path)
        if match is None or bool(match.group(3)) != bool(match.group(5)):  # a temp file's name is hidden
            continue
        out.append(StoredObject(path, match.group(1), int(info.get("size") or 0), _mtime(info), bool(match.group(5))))
    return out


def usage(objects: list[StoredObject]) -> dict[str, Usage]:
    """Objects and bytes per namespace (one model, dtype, layout and block size each)."""
    by_namespace: dict[str, Usage] = {}
    for obj in objects:
        if not obj.temp:  # a writer's unfinished file is no block (prune removes it once stale)
            by_namespace.setdefault(obj.namespace, Usage()).add(obj)
    return by_namespace


def prune(url: str, max_bytes: int | None = None, older_than_s: float | None = None,
          storage_options: dict | None = None, now: float | None = None, dry_run: bool = False) -> PruneResult:
    """Deletes objects written more than ``older_than_s`` ago, then the oldest until at most ``max_bytes``
    remain, and temp files of writers that died. A job reading a deleted block recomputes it."""
    now = time.time() if now is None else now
    objects = sorted(list_objects(url, storage_options), key=lambda o: o.mtime)
    doomed = [o for o in objects if (o.temp and now - o.mtime > STALE_TEMP_S)
              or (older_than_s is not None and now - o.mtime > older_than_s)]
    gone = set(doomed)
    kept = [o for o in objects if o not in gone]
    if max_bytes is not None:
        total = sum(o.size for o in kept)
        while kept and total > max_bytes:
            oldest = kept.pop(0)
            doomed.append(oldest)
            total -= oldest.size
    if doomed and not dry_run:
        fs, _ = filesystem(url, storage_options)
        paths = [o.path for o in doomed]
        try:
            retry(lambda: fs.rm(paths), what="prune the store")
        except FileNotFoundError:  # another prune took some first: the rest one at a time
            for path in paths:
                try:
                    retry(lambda: fs.rm_file(path), what="prune the store")
                except FileNotFoundError:
                    pass
    return PruneResult(len(doomed), sum(o.size for o in doomed), len(kept), sum(o.size for o in kept))
