"""Local files written whole or not at all: a temp name beside the target, then one rename (or hard link) into place."""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from pathlib import Path
from typing import IO, Any, Iterator

__all__ = ["TEMP_MARK", "atomic_open", "atomic_path", "fsync_dir", "remove_leftovers", "write_atomic",
           "write_file"]

TEMP_MARK = ".tmp-"  # in every temp name: cleanups and listings tell half-written files by it

PathLike = str | os.PathLike[str]


def fsync_dir(folder: PathLike) -> None:
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


def _makedirs(folder: str, durable: bool) -> None:
    if folder and not os.path.isdir(folder):
        os.makedirs(folder, exist_ok=True)
        if durable:
            fsync_dir(os.path.dirname(folder.rstrip("/")) or ".")


def temp_name(target: PathLike) -> str:
    """A fresh temp path beside target: ``.<name>.tmp-<random>``."""
    folder, name = os.path.split(os.fspath(target))
    return os.path.join(folder, f".{name}{TEMP_MARK}{uuid.uuid4().hex}")


def write_file(path: PathLike, data: bytes, durable: bool = False) -> None:
    """Writes data to path (replacing it in place); ``durable`` fsyncs the bytes before returning."""
    with open(path, "wb") as f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


def _copy_exclusive(tmp: str, target: str) -> None:
    """Create-if-absent without hard links: an exclusive create, then the bytes (not atomic for readers)."""
    fd = os.open(target, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    with os.fdopen(fd, "wb") as dst, open(tmp, "rb") as src:
        shutil.copyfileobj(src, dst, 1 << 20)
        dst.flush()
        os.fsync(dst.fileno())


def _publish(tmp: str, target: str, exclusive: bool) -> None:
    if not exclusive:
        os.replace(tmp, target)
        return
    try:
        os.link(tmp, target)  # FileExistsError when target exists: nothing is replaced
    except FileExistsError:
        raise
    except OSError:  # a filesystem without hard links
        _copy_exclusive(tmp, target)


@contextlib.contextmanager
def atomic_path(target: PathLike, durable: bool = False, exclusive: bool = False) -> Iterator[str]:
    """A temp path beside target for the block to fill (a file, or a folder); when the block returns it takes
    target's place whole, and whatever the block left is removed when it raises.

    ``durable`` also fsyncs new folders and the rename (the block fsyncs its own bytes, e.g. with
    ``write_file(..., durable=True)``). ``exclusive`` never replaces: a target that exists raises
    FileExistsError (a hard link of the finished temp file, so readers never see it half written).
    """
    target = os.fspath(target)
    folder = os.path.dirname(target)
    _makedirs(folder, durable)
    tmp = temp_name(target)
    try:
        yield tmp
        _publish(tmp, target, exclusive)
        if durable:
            fsync_dir(folder or ".")
    finally:
        _remove(tmp)


@contextlib.contextmanager
def atomic_open(target: PathLike, mode: str = "wb", durable: bool = False, **kwargs: Any) -> Iterator[IO[Any]]:
    """``open(target, mode)`` for writing, where target appears only once the block returns, complete."""
    with atomic_path(target, durable) as tmp:
        with open(tmp, mode, **kwargs) as f:
            yield f
            if durable:
                f.flush()
                os.fsync(f.fileno())


def write_atomic(target: PathLike, data: bytes, durable: bool = False, exclusive: bool = False) -> None:
    """Stores data as target whole (see :func:`atomic_path`)."""
    with atomic_path(target, durable, exclusive) as tmp:
        write_file(tmp, data, durable)


def remove_leftovers(target: PathLike) -> None:
    """Temp copies of target left by a killed process (callers make sure no live writer owns them), also those
    of files that were being written inside a temp folder of target."""
    path = Path(target)
    for stale in [*path.parent.glob(f".{path.name}{TEMP_MARK}*"), *path.parent.glob(f"..{path.name}{TEMP_MARK}*")]:
        _remove(str(stale))
