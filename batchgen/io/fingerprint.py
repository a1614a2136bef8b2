"""Size, etag and modification time of input files, to tell whether one changed between two runs, and content
digests of files and folders (a model's weights)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import posixpath
from collections import defaultdict
from datetime import datetime
from typing import Any

from batchgen.io.atomic import write_atomic
from batchgen.io.paths import cache_dir, filesystem
from batchgen.io.redaction import redact
from batchgen.io.retry import retry

log = logging.getLogger(__name__)

_ETAG_KEYS = ("ETag", "etag", "md5Hash", "content_md5")
_MTIME_KEYS = ("mtime", "LastModified", "last_modified", "updated", "Last-Modified", "created")


def _first(info: dict[str, Any], keys: tuple[str, ...]) -> Any:
    for k in keys:
        value = info.get(k)
        if value is not None:
            return value.isoformat() if isinstance(value, datetime) else value
    return None


def _fingerprint(info: dict[str, Any]) -> dict[str, Any]:
    etag = _first(info, _ETAG_KEYS)
    return {"size": info.get("size"), "etag": str(etag).strip('"') if etag is not None else None,
            "mtime": _first(info, _MTIME_KEYS)}


def _folder_infos(urls: list[str], storage_options: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """Listing entries of urls: one listing of their folder, else one stat per file."""
    fs, path = filesystem(urls[0], storage_options)
    try:
        listing = retry(lambda: fs.ls(posixpath.dirname(path), detail=True), what="list inputs")
        by_path = {fs._strip_protocol(i["name"]).rstrip("/"): i for i in listing}
        found = {u: by_path[p] for u in urls if (p := fs._strip_protocol(u).rstrip("/")) in by_path}
        if len(found) == len(urls):
            return found
    except Exception:  # noqa: BLE001 - e.g. HTTP has no folder listings: stat each file instead
        pass
    return {u: retry(lambda: fs.info(u), what="stat input") for u in urls}


def fingerprints(files: list[str], storage_options: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """{file URL: {size, etag, mtime}}; files that cannot be listed are left out (the check is advisory)."""
    by_folder: dict[str, list[str]] = defaultdict(list)
    for url in files:
        by_folder[posixpath.dirname(url)].append(url)
    out: dict[str, dict[str, Any]] = {}
    for folder, urls in by_folder.items():
        try:
            infos = _folder_infos(urls, storage_options)
        except Exception as exc:  # noqa: BLE001
            log.warning("cannot record the size and etag of the input files in %s: %s", redact(folder),
                        redact(f"{type(exc).__name__}: {exc}"))
            continue
        out.update({u: _fingerprint(info) for u, info in infos.items()})
    return out


def difference(before: dict[str, Any], now: dict[str, Any]) -> str | None:
    """How a file changed between two fingerprints, or None."""
    changes = []
    for key in ("size", "etag", "mtime"):
        old, new = before.get(key), now.get(key)
        if old is not None and new is not None and old != new:
            changes.append(f"{key} {old} -> {new}")
        if key == "etag" and old is not None and new is not None:
            break  # same etag, same content: a new mtime alone (a re-upload, a touch) is no change
    return ", ".join(changes) or None


READ_BYTES = 8 << 20


def file_hash(path: str) -> str:
    """sha256 of a local file's whole content, kept in ``cache_dir()/digests`` under its path, size, modification
    time and inode: a multi-GB checkpoint is read once, and then again only when it changes.

    Every byte counts: a checkpoint that differs from another in a few tensors (a merged adapter, one layer
    retrained) must not pass for it, while a copy (new mtime, same bytes) keeps its digest."""
    st = os.stat(path)
    key = f"{os.path.realpath(path)}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\0{st.st_dev}"
    memo = cache_dir() / "digests" / hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
    try:
        return memo.read_text().strip()
    except OSError:
        pass
    h = hashlib.sha256(str(st.st_size).encode())
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(READ_BYTES), b""):
            h.update(chunk)
    digest = h.hexdigest()
    try:
        write_atomic(memo, digest.encode())
    except OSError as e:  # a read-only home: the digest is still right, only not remembered
        log.debug("cannot remember the digest of %s: %s", path, e)
    return digest


def tree_digest(url: str, storage_options: dict[str, Any] | None = None) -> str:
    """A digest of a file or of a folder's files (hidden ones skipped): their relative names and contents.

    Local files are read (see ``file_hash``); remote ones are never downloaded: their size and etag (else
    modification time) stand for their content.
    """
    fs, path = filesystem(url, storage_options)
    path = path.rstrip("/")
    local = "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
    infos = retry(lambda: fs.find(path, detail=True, withdirs=False), what=f"list {redact(url)}")
    if not infos:
        infos = {path: retry(lambda: fs.info(path), what=f"stat {redact(url)}")}
    h = hashlib.sha256()
    for name in sorted(infos):
        rel = name[len(path):].lstrip("/") if name != path else posixpath.basename(path)
        if any(part.startswith(".") for part in rel.split("/")):
            continue
        info = infos[name]
        content = file_hash(name) if local else json.dumps(_fingerprint(info), default=str)
        h.update(f"{rel}\0{content}\0".encode())
    return h.hexdigest()
