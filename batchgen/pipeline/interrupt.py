"""SIGINT/SIGTERM: the first signal stops the job admitting work and aborts what runs after a grace period; a
second one stops it at once."""
from __future__ import annotations

import logging
import signal
import threading
from contextlib import contextmanager
from typing import Any, Iterator

from batchgen.pipeline.errors import Terminated

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)
DEFAULT_GRACE_S = 10.0


class StopRequest:
    """Set by the first SIGINT/SIGTERM (``signum`` says which one): ``event`` at once (admit no more rows),
    ``abort`` ``grace_s`` seconds later (drop the requests still running; the finished ones are kept)."""

    def __init__(self, grace_s: float = DEFAULT_GRACE_S) -> None:
        self.event = threading.Event()
        self.abort = threading.Event()
        self.grace_s = grace_s
        self.signum: int | None = None
        self._timer: threading.Timer | None = None
        self._listeners: list[threading.Event] = []

    def notify(self, event: threading.Event) -> None:
        """Sets ``event`` when the stop is requested (at once if it already was): a thread that waits on it
        learns of the stop without polling."""
        self._listeners.append(event)
        if self.event.is_set():
            event.set()

    def set(self, signum: int) -> None:
        if self.signum is None:
            self.signum = signum
            self._timer = threading.Timer(self.grace_s, self.abort.set)
            self._timer.daemon = True
            self._timer.start()
        self.event.set()
        for listener in self._listeners:
            listener.set()

    def is_set(self) -> bool:
        return self.event.is_set()

    def cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


@contextmanager
def stop_on_signals(stop: StopRequest) -> Iterator[StopRequest]:
    """Installs the handlers for the duration (main thread only; elsewhere signals keep their handlers).

    The first signal lets requests already in the engine run for the grace period, so that those that finish are
    kept; a second raises KeyboardInterrupt at once.
    """
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handle(signum: int, _frame: Any) -> None:
        if stop.is_set():
            stop.abort.set()
            raise KeyboardInterrupt
        stop.set(signum)
        log.warning("%s received: admitting no more rows; the requests already running get %g s to finish, then "
                    "the finished rows are committed; send it again to stop at once", signal.Signals(signum).name,
                    stop.grace_s)

    previous = {s: signal.signal(s, handle) for s in SIGNALS}
    try:
        yield stop
    finally:
        stop.cancel_timer()
        for s, h in previous.items():
            signal.signal(s, h)


@contextmanager
def signals_raise() -> Iterator[None]:
    """Until stop_on_signals takes over, SIGINT raises KeyboardInterrupt and SIGTERM Terminated at once (even where
    the process was started with SIGINT ignored, as a background job is): a run stopped while it loads its model
    still releases its output folder's lease on the way out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum: int, _frame: Any) -> None:
        raise Terminated if signum == signal.SIGTERM else KeyboardInterrupt

    previous = {s: signal.signal(s, handle) for s in SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
