"""The board of a Ray run: one small actor where replicas register, report their rows and take each window,
and the driver reads progress and posts a stop request or a lost lease."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable

import ray

from batchgen.io.lease import LeaseLost
from batchgen.pipeline.rows import ResultRow
from batchgen.pipeline.stats import Counts

if TYPE_CHECKING:
    from batchgen.bench.flops import PeakFlops
    from batchgen.engine.models.base import ModelProfile

REPORT_S = 0.5  # how often replicas report and the driver reads the board
_CALL_TIMEOUT_S = 60.0


def board_name(run_id: str) -> str:
    """The board's actor name: ``ray.get_actor(board_name(run))`` reads a running job from the driver's namespace."""
    return f"batchgen-board-{run_id}"


@dataclass(frozen=True)
class ReplicaInfo:
    """What a replica tells the board once its model is loaded: where it runs and what its engine is."""

    node: str
    pid: int
    startup_s: float
    token_budget: int  # tokens one step of its engine may compute (data parallel ranks multiply it)
    dtype: str
    profile: ModelProfile | None = None
    peak_flops: PeakFlops | None = None


@dataclass
class ReplicaState:
    """The board's record of one replica: its info, the rows it finished and when it worked."""

    replica: int
    info: ReplicaInfo
    counts: Counts = field(default_factory=Counts)
    windows: int = 0
    first_begin: float | None = None  # epoch seconds
    last_end: float | None = None
    telemetry: dict[str, Any] | None = None  # its Telemetry.state() after its last window

    @property
    def active_s(self) -> float:
        return (self.last_end - self.first_begin) if self.last_end and self.first_begin else 0.0


@dataclass(frozen=True)
class WindowTicket:
    """The board's answer to a replica about to run a window: its attempt (0 the first time), and whether to run it."""

    attempt: int
    run: bool


@dataclass(frozen=True)
class BoardNews:
    """The board's answer to a replica's report: a stop request, and why the driver lost the lease if it did."""

    stop: bool
    lost: str | None


@dataclass(frozen=True)
class BoardSnapshot:
    """What the driver reads of the board: the replicas, the windows running (window -> replica) and begun."""

    replicas: list[ReplicaState] = field(default_factory=list)
    running: dict[str, int] = field(default_factory=dict)
    stop: bool = False
    windows: int = 0
    retried: int = 0
    failure: str | None = None  # the first failure a replica reported

    @property
    def active(self) -> int:
        return len(self.running)

    def totals(self) -> Counts:
        """The rows every replica has finished so far."""
        out = Counts()
        for r in self.replicas:
            out.add(r.counts)
        return out

    def generating_s(self) -> float:
        """From the first window a replica began to the last one it finished: the run's time from the first
        request to the last result, as a local run counts it (Ray's start and the replicas' model loads apart)."""
        begins = [r.first_begin for r in self.replicas if r.first_begin]
        ends = [r.last_end for r in self.replicas if r.last_end]
        return max(0.0, max(ends) - min(begins)) if begins and ends else 0.0

    def engine(self) -> ReplicaInfo | None:
        """The engine every replica runs (the first one's info); None when none started."""
        return self.replicas[0].info if self.replicas else None


class JobBoard:
    """What the driver knows of its replicas (an actor: calls run one at a time).

    ``begin`` hands out windows: it counts each window's attempts (a window begun again was cut short by a
    replica that died, and its retry first reads what that attempt committed) and refuses every window once a
    stop is requested, so that after the stop only the windows already running finish.
    """

    def __init__(self) -> None:
        self.replicas: dict[int, ReplicaState] = {}
        self.attempts: dict[str, int] = {}
        self.active: dict[str, int] = {}  # window -> replica running it
        self.stop = False
        self.lost: str | None = None
        self.failure: str | None = None

    def register(self, info: ReplicaInfo) -> int:
        index = len(self.replicas)
        self.replicas[index] = ReplicaState(index, info)
        return index

    def begin(self, window: str, replica: int) -> WindowTicket:
        attempt = self.attempts.get(window, 0)
        if self.stop:
            self.active.pop(window, None)
            return WindowTicket(attempt, run=False)
        self.attempts[window] = attempt + 1
        self.active[window] = replica
        state = self.replicas[replica]
        state.first_begin = state.first_begin or time.time()
        return WindowTicket(attempt, run=True)

    def end(self, window: str, replica: int, counts: Counts, telemetry: dict[str, Any]) -> None:
        self.active.pop(window, None)
        state = self.replicas[replica]
        state.counts, state.telemetry, state.last_end = counts, telemetry, time.time()
        state.windows += 1

    def report(self, replica: int, counts: Counts) -> BoardNews:
        self.replicas[replica].counts = counts
        return BoardNews(self.stop, self.lost)

    def fail(self, message: str) -> None:
        self.failure = self.failure or message

    def request_stop(self) -> None:
        self.stop = True

    def lease_lost(self, message: str) -> None:
        self.lost = message
        self.stop = True

    def snapshot(self) -> BoardSnapshot:
        return BoardSnapshot(replicas=[replace(r) for r in self.replicas.values()], running=dict(self.active),
                             stop=self.stop, windows=len(self.attempts),
                             retried=sum(n > 1 for n in self.attempts.values()), failure=self.failure)


class BoardLink:
    """A replica's line to the board: it registers, reports its rows every ``REPORT_S`` in the background, and
    learns of a stop request or a lost lease. ``ensure_held`` fences the replica's writes on the driver's lease:
    it raises once the driver lost it, or once the board has been unreachable for 0.75 of the lease timeout
    (the driver is gone), as the driver's own writer does."""

    def __init__(self, board: Any, info: ReplicaInfo, lease_timeout_s: float) -> None:
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

    def _counts(self) -> Counts:
        with self._lock:
            return replace(self.counts)

    def _call(self, method: Callable[..., Any], *args: Any) -> Any:
        answer = ray.get(method.remote(*args), timeout=_CALL_TIMEOUT_S)
        self._contact = time.monotonic()
        return answer

    def _loop(self) -> None:
        while not self._closed.wait(REPORT_S):
            try:
                news: BoardNews = self._call(self.board.report, self.index, self._counts())
            except Exception:  # noqa: BLE001 - the fence notices a board that stays unreachable
                continue
            self._lost = news.lost
            if news.stop:
                self.stop.set()

    def begin(self, window: str) -> int | None:
        """The window's attempt number, or None when it is not to run (a stop was requested)."""
        ticket: WindowTicket = self._call(self.board.begin, window, self.index)
        if not ticket.run:
            self.stop.set()
            return None
        return ticket.attempt

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
