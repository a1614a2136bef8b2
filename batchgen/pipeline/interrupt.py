"""SIGINT/SIGTERM: the first signal stops the job admitting work, a second one stops it at once."""
from __future__ import annotations

import logging
import signal
import threading
from contextlib import contextmanager
from typing import Any, Iterator

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """Set by the first SIGINT/SIGTERM; ``signum`` says which one."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signum: int | None = None

    def set(self, signum: int) -> None:
        if self.signum is None:
            self.signum = signum
        self.event.set()

    def is_set(self) -> bool:
        return self.event.is_set()


@contextmanager
def stop_on_signals(stop: StopRequest) -> Iterator[StopRequest]:
    """Installs the handlers for the duration (main thread only; elsewhere signals keep their handlers).

    The first signal lets requests already in the engine finish so that their rows are kept; a second
    raises KeyboardInterrupt at once.
    """
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handle(signum: int, _frame: Any) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set(signum)
        log.warning("%s received: finishing the requests already running, then committing; "
                    "send it again to stop at once", signal.Signals(signum).name)

    previous = {s: signal.signal(s, handle) for s in SIGNALS}
    try:
        yield stop
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
