"""Copies a remote file or folder to a local path whole or not at all: each file goes to a temp name, its
size (and SHA-256 where the store keeps one) is checked, and the finished copy is renamed into place."""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable

import fsspec

from batchgen.crashpoints import crash_point
from batchgen.io.errors import InputError
from batchgen.io.manifest import TEMP_MARK
from batchgen.io.paths import S3_PROTOCOLS, filesystem
from batchgen.io.redaction import redact
from batchgen.io.retry import retry

__all__ = ["fetch"]

log = logging.getLogger(__name__)

_ATTEMPTS = 4  # whole-file attempts after a short or corrupt copy; failed requests are retried by retry()


class _Mismatch(Exception):
    """A downloaded file is not what the store lists (cut short, or corrupted)."""


def _stored_sha256(fs: fsspec.AbstractFileSystem, path: str) -> str | None:
    """Hex SHA-256 of an S3 object uploaded with a full-object SHA-256 checksum; None elsewhere."""
    if not any(p in S3_PROTOCOLS for p in ([fs.protocol] if isinstance(fs.protocol, str) else fs.protocol)):
        return None
    bucket, key, _ = fs.split_path(path)
    head = retry(lambda: fs.call_s3("head_object", Bucket=bucket, Key=key, ChecksumMode="ENABLED"),
                 what=f"stat {path}")
    value = head.get("ChecksumSHA256")
    if not value or "-" in value or head.get("ChecksumType", "FULL_OBJECT") != "FULL_OBJECT":
        return None
    return base64.b64decode(value).hex()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _verify(local: Path, size: int | None, sha256: str | None) -> None:
    got = local.stat().st_size
    if size is not None and got != size:
        raise _Mismatch(f"{got} bytes instead of {size}")
    if sha256 is not None and _sha256(local) != sha256:
        raise _Mismatch("SHA-256 differs from the stored checksum")


def _download(fs: fsspec.AbstractFileSystem, remote: str, local: Path, info: dict[str, Any]) -> None:
    """remote -> local, verified; nothing at local unless the whole file arrived."""
    local.parent.mkdir(parents=True, exist_ok=True)
    partial = local.with_name(f".{local.name}{TEMP_MARK}{uuid.uuid4().hex}")
    sha256 = _stored_sha256(fs, remote)
    try:
        for attempt in range(1, _ATTEMPTS + 1):
            try:
                retry(lambda: fs.get_file(remote, str(partial)), what=f"download {remote}")
                _verify(partial, info.get("size"), sha256)
                break
            except _Mismatch as exc:
                if attempt == _ATTEMPTS:
                    raise
                log.warning("download of %s failed (attempt %d/%d), retrying: %s", redact(remote), attempt,
                            _ATTEMPTS, redact(str(exc)))
        crash_point("download.file")
        os.replace(partial, local)
    finally:
        partial.unlink(missing_ok=True)


def _listing(fs: fsspec.AbstractFileSystem, root: str, url: str) -> dict[str, dict[str, Any]]:
    """{path relative to root ("" for a single file): info} of every file under root."""
    try:
        info = retry(lambda: fs.info(root), what=f"stat {url}")
    except FileNotFoundError:
        raise FileNotFoundError(redact(f"{url} does not exist")) from None
    if info.get("type") != "directory":
        return {"": info}
    found = retry(lambda: fs.find(root, detail=True), what=f"list {url}")
    files = {p[len(root):].lstrip("/"): i for p, i in found.items() if i.get("type") != "directory"}
    if not files:
        raise FileNotFoundError(redact(f"{url} is an empty folder"))
    return files


def _remove_leftovers(dest: Path) -> None:
    """Temp copies of dest left by a killed process (callers serialize fetches of one dest)."""
    for stale in [*dest.parent.glob(f".{dest.name}{TEMP_MARK}*"), *dest.parent.glob(f"..{dest.name}{TEMP_MARK}*")]:
        shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)


def fetch(url: str, dest: Path, storage_options: dict[str, Any] | None = None,
          select: Callable[[list[str]], list[str]] | None = None) -> Path:
    """Copies the file or folder at url to dest (which must not exist) with the job's credentials and
    retries; dest appears complete or not at all. ``select`` picks which of a folder's files (paths
    relative to it) to copy. Raises FileNotFoundError or InputError."""
    fs, root = filesystem(url, storage_options)
    root = root.rstrip("/")
    dest.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(dest)
    staging = dest.with_name(f".{dest.name}{TEMP_MARK}{uuid.uuid4().hex}")
    try:
        files = _listing(fs, root, url)
        chosen = select(sorted(files)) if select is not None else sorted(files)
        for rel, info in ((r, files[r]) for r in chosen):
            remote = f"{root}/{rel}" if rel else root
            _download(fs, remote, staging / rel if rel else staging, info)
        os.replace(staging, dest)
    except FileNotFoundError:
        raise
    except Exception as exc:
        raise InputError(redact(f"cannot download {url}: {type(exc).__name__}: {exc}")) from exc
    finally:
        if staging.is_dir():
            shutil.rmtree(staging, ignore_errors=True)
        elif staging.exists():
            staging.unlink()
    return dest
