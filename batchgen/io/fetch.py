"""Copies a remote file or folder to a local path whole or not at all: each file goes to a temp name, its
size (and SHA-256 where the store keeps one) is checked, and the finished copy is renamed into place."""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path
from typing import Any, Callable

import fsspec

from batchgen.crashpoints import crash_point
from batchgen.io.atomic import atomic_path, remove_leftovers
from batchgen.io.errors import InputError
from batchgen.io.paths import S3_PROTOCOLS, filesystem
from batchgen.io.redaction import redact
from batchgen.io.retry import TransientError, retry

__all__ = ["fetch"]


class _Mismatch(TransientError):
    """A downloaded file is not what the store lists (cut short, or corrupted): retried like a failed request."""


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
    sha256 = _stored_sha256(fs, remote)

    def download_into(partial: str) -> None:
        fs.get_file(remote, partial)
        _verify(Path(partial), info.get("size"), sha256)

    with atomic_path(local) as partial:
        retry(lambda: download_into(partial), what=f"download {remote}")
        crash_point("download.file")


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


def fetch(url: str, dest: Path, storage_options: dict[str, Any] | None = None,
          select: Callable[[list[str]], list[str]] | None = None) -> Path:
    """Copies the file or folder at url to dest (which must not exist) with the job's credentials and
    retries; dest appears complete or not at all. ``select`` picks which of a folder's files (paths
    relative to it) to copy. Raises FileNotFoundError or InputError."""
    fs, root = filesystem(url, storage_options)
    root = root.rstrip("/")
    remove_leftovers(dest)  # callers serialize fetches of one dest
    try:
        files = _listing(fs, root, url)
        chosen = select(sorted(files)) if select is not None else sorted(files)
        with atomic_path(dest) as staging:
            for rel, info in ((r, files[r]) for r in chosen):
                remote = f"{root}/{rel}" if rel else root
                _download(fs, remote, Path(staging) / rel if rel else Path(staging), info)
    except FileNotFoundError:
        raise
    except Exception as exc:
        raise InputError(redact(f"cannot download {url}: {type(exc).__name__}: {exc}")) from exc
    return dest
