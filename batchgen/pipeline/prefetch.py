"""Runs an iterator in a background thread a bounded number of items ahead of its consumer."""
from __future__ import annotations

import queue
import threading
from typing import Generic, Iterable, Iterator, TypeVar

T = TypeVar("T")

_DONE = object()


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class Prefetcher(Generic[T]):
    """Iterates ``source`` in a daemon thread, at most ``depth`` items ahead.

    Reading and tokenizing the next rows then overlaps with the engine's steps (torch and the tokenizer
    release the GIL), so the engine does not stall while a new sort window fills. An exception in the
    source is raised to the consumer. ``close`` stops the thread; the consumer must call it.
    """

    def __init__(self, source: Iterable[T], depth: int, name: str = "prefetch") -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(source,), name=name, daemon=True)
        self._thread.start()

    def _put(self, item: object) -> bool:
        while not self._closed.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, source: Iterable[T]) -> None:
        try:
            for item in source:
                if not self._put(item):
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the consumer's thread
            self._put(_Failure(e))
            return
        self._put(_DONE)

    def __iter__(self) -> Iterator[T]:
        while True:
            item = self._queue.get()
            if item is _DONE:
                return
            if isinstance(item, _Failure):
                raise item.exc
            yield item

    def close(self, timeout: float = 5.0) -> None:
        """Stops the thread at its next item (a source blocked in a read finishes that read first)."""
        self._closed.set()
        try:
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            pass
        self._thread.join(timeout)
