"""The board of a Ray run: one small actor where replicas register, report their rows and take each window,
and the driver reads progress and posts a stop request or a lost lease."""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

import ray

from batchgen.io.lease import LeaseLost
from batchgen.pipeline.rows import ResultRow
from batchgen.pipeline.stats import Counts

REPORT_S = 0.5  # how often replicas report and the driver reads the board
_CALL_TIMEOUT_S = 60.0


def board_name(run_id: str) -> str:
    """The board's actor name: ``ray.get_actor(board_name(run))`` reads a running job from the driver's namespace."""
    return f"batchgen-board-{run_id}"


class JobBoard:
    """What the driver knows of its replicas (an actor: calls run one at a time).

    ``begin`` hands out windows: it counts each window's attempts (a window begun again was cut short by a
    replica that died, and its retry first reads what that attempt committed) and refuses every window once a
    stop is requested, so that after the stop only the windows already running finish.
    """

    def __init__(self) -> None:
        self.replicas: dict[int, dict[str, Any]] = {}
        self.attempts: dict[str, int] = {}
        self.active: dict[str, int] = {}  # window -> replica running it
        self.stop = False
        self.lost: str | None = None
        self.failure: str | None = None  # the first failure a replica reported

    def register(self, info: dict[str, Any]) -> int:
        index = len(self.replicas)
        self.replicas[index] = {**info, "replica": index, "counts": Counts().to_dict(), "windows": 0,
                                "first_begin": None, "last_end": None, "telemetry": None}
        return index

    def begin(self, window: str, replica: int) -> dict[str, Any]:
        """{"attempt": n (0 the first time), "run": whether to run it at all}."""
        if self.stop:
            self.active.pop(window, None)
            return {"attempt": self.attempts.get(window, 0), "run": False}
        attempt = self.attempts.get(window, 0)
        self.attempts[window] = attempt + 1
        self.active[window] = replica
        info = self.replicas[replica]
        info["first_begin"] = info["first_begin"] or time.time()
        return {"attempt": attempt, "run": True}

    def end(self, window: str, replica: int, counts: dict[str, int], telemetry: dict[str, Any]) -> None:
        self.active.pop(window, None)
        info = self.replicas[replica]
        info.update(counts=counts, telemetry=telemetry, windows=info["windows"] + 1, last_end=time.time())

    def report(self, replica: int, counts: dict[str, int]) -> dict[str, Any]:
        self.replicas[replica]["counts"] = counts
        return {"stop": self.stop, "lost": self.lost}

    def fail(self, message: str) -> None:
        self.failure = self.failure or message

    def request_stop(self) -> None:
        self.stop = True

    def lease_lost(self, message: str) -> None:
        self.lost = message
        self.stop = True

    def snapshot(self) -> dict[str, Any]:
        return {"replicas": [dict(r) for r in self.replicas.values()], "active": len(self.active),
                "running": dict(self.active),
                "stop": self.stop, "windows": len(self.attempts),
                "retried": sum(n > 1 for n in self.attempts.values()), "failure": self.failure}


def totals(snapshot: dict[str, Any]) -> Counts:
    """The rows every replica has finished so far."""
    return Counts.total(r["counts"] for r in snapshot["replicas"])


class BoardLink:
    """A replica's line to the board: it registers, reports its rows every ``REPORT_S`` in the background, and
    learns of a stop request or a lost lease. ``ensure_held`` fences the replica's writes on the driver's lease:
    it raises once the driver lost it, or once the board has been unreachable for 0.75 of the lease timeout
    (the driver is gone), as the driver's own writer does."""

    def __init__(self, board: Any, info: dict[str, Any], lease_timeout_s: float) -> None:
        self.board = board
        self.index: int = ray.get(board.register.remote(info), timeout=_CALL_TIMEOUT_S)
        self.stop = threading.Event()
        self.fence_s = 0.75 * lease_timeout_s
        self.counts = Counts()
        self._lost: str | None = None
        self._contact = time.monotonic()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="board-link", daemon=True)
        self._thread.start()

    def on_row(self, row: ResultRow) -> None:
        with self._lock:
            self.counts.add_row(row)

    def _counts(self) -> dict[str, int]:
        with self._lock:
            return self.counts.to_dict()

    def _call(self, method: Callable[..., Any], *args: Any) -> Any:
        answer = ray.get(method.remote(*args), timeout=_CALL_TIMEOUT_S)
        self._contact = time.monotonic()
        return answer

    def _loop(self) -> None:
        while not self._closed.wait(REPORT_S):
            try:
                state = self._call(self.board.report, self.index, self._counts())
            except Exception:  # noqa: BLE001 - the fence notices a board that stays unreachable
                continue
            self._lost = state["lost"]
            if state["stop"]:
                self.stop.set()

    def begin(self, window: str) -> int | None:
        """The window's attempt number, or None when it is not to run (a stop was requested)."""
        answer = self._call(self.board.begin, window, self.index)
        if not answer["run"]:
            self.stop.set()
            return None
        return answer["attempt"]

    def end(self, window: str, telemetry: dict[str, Any]) -> None:
        self._call(self.board.end, window, self.index, self._counts(), telemetry)

    def ensure_held(self) -> None:
        silent = time.monotonic() - self._contact
        if self._lost is None and silent > self.fence_s:
            self._lost = f"this replica could not reach the job's driver for {silent:.0f} s"
        if self._lost is not None:
            raise LeaseLost(self._lost)

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)
