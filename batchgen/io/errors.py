"""Exceptions raised by the io package, and the wrapper that turns storage failures into them."""

from __future__ import annotations

from typing import Callable, TypeVar

from batchgen.io.redaction import redact

T = TypeVar("T")


class InputError(Exception):
    """Input that fails the whole job: missing files, corrupt Parquet, unreadable paths."""


class OutputError(Exception):
    """The output folder cannot be written or read back."""


def guard(path: str, fn: Callable[[], T], action: str) -> T:
    """Runs ``fn``; any failure but an OutputError becomes one, naming ``action`` and the folder (redacted)."""
    try:
        return fn()
    except OutputError:
        raise
    except Exception as exc:
        raise OutputError(redact(f"cannot {action} {path}: {type(exc).__name__}: {exc}")) from exc
