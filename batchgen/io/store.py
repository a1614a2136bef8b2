"""Whole-object writes into one folder on any fsspec filesystem: durable on local disks, create-if-absent."""

from __future__ import annotations

import contextlib

import fsspec
from fsspec.implementations.local import LocalFileSystem

from batchgen.crashpoints import crash_point
from batchgen.io.atomic import atomic_path, write_file
from batchgen.io.manifest import list_names
from batchgen.io.redaction import redact
from batchgen.io.retry import retry


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
        with atomic_path(target, durable=True) as tmp:
            write_file(tmp, data, durable=True)
            crash_point("store.temp")

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
        try:
            with atomic_path(target, durable=True, exclusive=True) as tmp:
                write_file(tmp, data, durable=True)
        except FileExistsError:
            return False
        return True

    def read(self, name: str) -> bytes:
        """The bytes of name; FileNotFoundError when it does not exist."""
        target = self.full(name)
        return retry(lambda: self.fs.cat_file(target), what=f"read {redact(target)}")

    def list(self, folder: str = "") -> list[str]:
        """Base names directly in root (or root/folder); [] when it does not exist."""
        return list_names(self.fs, self.full(folder) if folder else self.root)

    def delete(self, names: list[str]) -> None:
        """Delete names; one already gone (another run's cleanup got there first) is not an error."""
        if not names:
            return
        paths = [self.full(n) for n in names]
        try:
            retry(lambda: self.fs.rm(paths), what=f"delete in {redact(self.root)}")
        except FileNotFoundError:
            for path in paths:
                with contextlib.suppress(FileNotFoundError):
                    retry(lambda: self.fs.rm(path), what=f"delete {redact(path)}")
