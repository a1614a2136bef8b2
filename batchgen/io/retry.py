"""Retry with exponential backoff for transient storage errors."""

from __future__ import annotations

import errno
import logging
import random
import time
from typing import Callable, Iterator, TypeVar

from batchgen.io.redaction import redact

T = TypeVar("T")
log = logging.getLogger(__name__)
_sleep = time.sleep  # tests replace it to retry without waiting

_PERMANENT_TYPES = (
    FileNotFoundError,
    FileExistsError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
)
# s3fs maps S3 error codes onto these errnos: EIO (unknown), EREMOTEIO (500), EBUSY (503/SlowDown).
_TRANSIENT_ERRNOS = {errno.EIO, getattr(errno, "EREMOTEIO", errno.EIO), errno.EBUSY, errno.EAGAIN}
_TRANSIENT_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "InternalError",
    "ServiceUnavailable",
}
_TRANSIENT_NAME_HINTS = (
    "Connection", "Timeout", "Payload", "Disconnected", "IncompleteRead", "ResponseParser",
)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def _classify(exc: BaseException) -> bool | None:
    if isinstance(exc, _PERMANENT_TYPES):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    response = getattr(exc, "response", None)
    if isinstance(response, dict) and "Error" in response:
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        return status >= 500 or response["Error"].get("Code") in _TRANSIENT_CODES
    if any(hint in type(exc).__name__ for hint in _TRANSIENT_NAME_HINTS):
        return True
    if isinstance(exc, OSError) and exc.errno is not None:
        return exc.errno in _TRANSIENT_ERRNOS
    return None


def is_transient(exc: BaseException) -> bool:
    """True for errors worth retrying: connection resets, timeouts, 5xx, SlowDown."""
    for link in _chain(exc):
        verdict = _classify(link)
        if verdict is not None:
            return verdict
    return False


def retry(
    fn: Callable[[], T],
    what: str = "storage call",
    attempts: int = 5,
    base_delay: float = 0.2,
    max_delay: float = 5.0,
) -> T:
    """Call fn(), retrying transient errors with jittered exponential backoff."""
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except Exception as exc:
            if attempt == attempts or not is_transient(exc):
                raise
            delay = min(max_delay, base_delay * 2 ** (attempt - 1)) * (0.5 + random.random() / 2)
            log.warning("transient error in %s (attempt %d/%d), retrying in %.2fs: %s",
                        redact(what), attempt, attempts, delay, redact(str(exc)))
            _sleep(delay)
    raise AssertionError("unreachable")
