"""Named points where chaos tests kill the process: with ``BATCHGEN_CRASH_AT=<point>:<n>`` in the
environment, the n-th arrival at <point> sends SIGKILL to this process. Unset, a point does nothing."""
from __future__ import annotations

import os
import signal
import threading

POINTS = (
    "read_row",        # an input row was read
    "generate",        # the engine finished a request, before its row reaches the sink
    "part.before",     # a part is serialized, before it is stored
    "store.temp",      # local disk: the temp file is written and fsynced, not yet renamed
    "part.after",      # the part is stored, its manifest entry is not
    "manifest.after",  # the manifest entry is stored: the part is committed
    "stats.before",    # every part is committed, stats.json is not written
    "stats.after",     # stats.json is written, _SUCCESS is not
    "download.file",   # a model file is downloaded to its temp name, not yet renamed into the cache
)


def _target() -> tuple[str, int] | None:
    spec = os.environ.get("BATCHGEN_CRASH_AT", "")
    name, _, count = spec.partition(":")
    if not name:
        return None
    if name not in POINTS:
        raise ValueError(f"BATCHGEN_CRASH_AT: unknown point {name!r}; known: {', '.join(POINTS)}")
    return name, int(count or 1)


_UNREAD = ("", 0)
_target_cache: tuple[str, int] | None = _UNREAD  # read at the first point, so a forked child reads its own
_hits = 0
_lock = threading.Lock()


def crash_point(name: str) -> None:
    """Kill this process here if BATCHGEN_CRASH_AT names this point and its count is reached."""
    global _hits, _target_cache
    if _target_cache is _UNREAD:
        _target_cache = _target()
    if _target_cache is None or _target_cache[0] != name:
        return
    with _lock:
        _hits += 1
        if _hits >= _target_cache[1]:
            os.kill(os.getpid(), signal.SIGKILL)
