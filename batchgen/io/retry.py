"""The one retry layer of every storage call: jittered exponential backoff on transient errors.

batchgen owns retries instead of configuring the clients' own loops, because it reads and writes through any
fsspec store (S3, GCS, Azure, HTTP, memory), and only this layer sees them all: one classification of what is
transient, one attempt count, redacted log lines, and whole operations retried (a download and its checksum, a
stream reopened where it broke off). The S3 clients' loops are turned down to a single attempt so that layers
never multiply: botocore through ``config_kwargs={"retries": BOTO_SINGLE_ATTEMPT}`` (``storage_options_for``
sets it unless the job sets retries itself) and s3fs's own loop through ``single_attempt`` on every filesystem
io opens. A call is thus tried ``POLICY.attempts`` times in all.
"""

from __future__ import annotations

import errno
import logging
import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, TypeVar

from batchgen.io.redaction import redact

T = TypeVar("T")
log = logging.getLogger(__name__)
_sleep = time.sleep  # tests replace it to retry without waiting


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a transient failure is retried: ``attempts`` tries in all."""

    attempts: int = 5
    base_delay: float = 0.2
    max_delay: float = 5.0

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed try number ``attempt`` (1-based), with jitter."""
        return min(self.max_delay, self.base_delay * 2 ** (attempt - 1)) * (0.5 + random.random() / 2)


POLICY = RetryPolicy()
# botocore's retry config for a single attempt per request: its own retries off (see the module docstring)
BOTO_SINGLE_ATTEMPT = {"total_max_attempts": 1, "mode": "standard"}  # max_attempts counts retries only


class TransientError(Exception):
    """A failure that a new attempt may not meet (a download cut short), raised by batchgen itself."""


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


def single_attempt(fs: Any) -> Any:
    """Turns a filesystem's own retry loop down to one attempt (s3fs's ``retries``; others have none)."""
    if isinstance(getattr(fs, "retries", None), int) and "s3" in (fs.protocol if isinstance(fs.protocol, tuple)
                                                                  else (fs.protocol,)):
        fs.retries = 1
    return fs


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
    if isinstance(exc, (ConnectionError, TimeoutError, TransientError)):
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


def will_retry(exc: BaseException, attempt: int, what: str, policy: RetryPolicy = POLICY) -> bool:
    """After failed try number ``attempt`` of ``what``: False when exc is permanent or the tries are used up;
    else logs it, waits the backoff and returns True. For loops that retry more than one call (a stream)."""
    if attempt >= policy.attempts or not is_transient(exc):
        return False
    delay = policy.delay(attempt)
    log.warning("transient error in %s (attempt %d/%d), retrying in %.2fs: %s",
                redact(what), attempt, policy.attempts, delay, redact(str(exc)))
    _sleep(delay)
    return True


def retry(fn: Callable[[], T], what: str = "storage call", policy: RetryPolicy = POLICY) -> T:
    """Call fn(), retrying transient errors with jittered exponential backoff."""
    attempt = 1
    while True:
        try:
            return fn()
        except Exception as exc:
            if not will_retry(exc, attempt, what, policy):
                raise
            attempt += 1
