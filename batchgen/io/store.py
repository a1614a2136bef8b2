"""Whole-object writes into one folder on any fsspec filesystem: durable on local disks, create-if-absent."""

from __future__ import annotations

import os
import posixpath
import uuid

import fsspec
from fsspec.implementations.local import LocalFileSystem

from batchgen.crashpoints import crash_point
from batchgen.io.manifest import TEMP_MARK, list_names
from batchgen.io.redaction import redact
from batchgen.io.retry import retry


def _fsync_dir(folder: str) -> None:
    """Make a rename or a new entry in folder survive a power loss (POSIX; a no-op where unsupported)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _makedirs(folder: str) -> None:
    if not os.path.isdir(folder):
        os.makedirs(folder, exist_ok=True)
        _fsync_dir(posixpath.dirname(folder.rstrip("/")))


def _temp_file(target: str, data: bytes) -> str:
    """A fully written, fsynced temp file beside target."""
    folder = posixpath.dirname(target)
    _makedirs(folder)
    tmp = f"{folder}/.{posixpath.basename(target)}{TEMP_MARK}{uuid.uuid4().hex}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return tmp


class Store:
    """Names inside one folder (root); every write stores an object whole or not at all."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.local = isinstance(fs, LocalFileSystem)

    def full(self, name: str) -> str:
        return f"{self.root}/{name}"

    def put(self, name: str, data: bytes) -> None:
        """Store name whole, replacing it; on a local disk the bytes and the rename are fsynced first."""
        target = self.full(name)
        if not self.local:
            retry(lambda: self.fs.pipe_file(target, data), what=f"write {redact(target)}")
            return
        tmp = _temp_file(target, data)
        crash_point("store.temp")
        try:
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        _fsync_dir(posixpath.dirname(target))

    def create(self, name: str, data: bytes) -> bool:
        """Store name only if it does not exist; False when it does.

        Atomic on local disks (a hard link of a complete temp file) and on S3 (``If-None-Match: *``). Other
        fsspec stores check for the object and then write it, which leaves a window for a racing writer.
        A write that reached the store before a retried request failed reads as False: callers that need
        to tell "mine" from "someone else's" read the object back.
        """
        target = self.full(name)
        if not self.local:
            try:
                retry(lambda: self.fs.pipe_file(target, data, mode="create"), what=f"create {redact(target)}")
            except FileExistsError:
                return False
            return True
        tmp = _temp_file(target, data)
        try:
            os.link(tmp, target)
        except FileExistsError:
            return False
        except OSError:  # a filesystem without hard links
            return self._create_exclusive(target, data)
        finally:
            os.remove(tmp)
        _fsync_dir(posixpath.dirname(target))
        return True

    @staticmethod
    def _create_exclusive(target: str, data: bytes) -> bool:
        try:
            fd = os.open(target, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(posixpath.dirname(target))
        return True

    def read(self, name: str) -> bytes:
        """The bytes of name; FileNotFoundError when it does not exist."""
        target = self.full(name)
        return retry(lambda: self.fs.cat_file(target), what=f"read {redact(target)}")

    def list(self, folder: str = "") -> list[str]:
        """Base names directly in root (or root/folder); [] when it does not exist."""
        return list_names(self.fs, self.full(folder) if folder else self.root)

    def delete(self, names: list[str]) -> None:
        if names:
            paths = [self.full(n) for n in names]
            retry(lambda: self.fs.rm(paths), what=f"delete in {redact(self.root)}")
