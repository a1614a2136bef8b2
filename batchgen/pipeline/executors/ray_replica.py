"""An engine replica of a Ray run (one actor, one ``LLM``): it runs sort windows and commits each window's rows
as parts of the window's own scope, so that a window retried after a replica died redoes only what that
attempt had not committed."""
from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass
from itertools import chain
from typing import Any, Callable, Iterator

import numpy as np

from batchgen.engine import LLM
from batchgen.engine.flops import engine_peak_flops
from batchgen.io import InputError, OutputError, redact
from batchgen.io.committer import PartCommitter
from batchgen.io.store import Store
from batchgen.io.paths import filesystem
from batchgen.pipeline import preflight
from batchgen.pipeline.errors import JobError
from batchgen.pipeline.executors.ray_board import BoardLink, ReplicaInfo
from batchgen.pipeline.executors.ray_shards import load_window
from batchgen.pipeline.job import RunPlan
from batchgen.pipeline.rows import Request, ResultRow
from batchgen.pipeline.stages import Window
from batchgen.pipeline.telemetry import Telemetry
from batchgen.pipeline.window_runner import committing, run_requests

log = logging.getLogger(__name__)

WINDOWS_AT_ONCE = 2  # windows a replica runs side by side (see EngineFeed)


class _Pending:
    """The requests of one window inside the feed: each result goes to ``write``; ``wait`` returns once every
    request is written or was left unrun by a stop, and raises what failed them."""

    def __init__(self, count: int, write: Callable[[ResultRow], None]) -> None:
        self.left = count
        self.write = write
        self.failure: BaseException | None = None
        self.done = threading.Event()
        if count == 0:
            self.done.set()

    def deliver(self, row: ResultRow) -> None:
        if self.failure is None:
            try:
                self.write(row)
            except BaseException as e:  # noqa: BLE001 - e.g. a lost lease: this window fails, the engine goes on
                self.fail(e)
        self.skip()

    def skip(self) -> None:
        self.left -= 1
        if self.left <= 0:
            self.done.set()

    def fail(self, e: BaseException) -> None:
        self.failure = self.failure or e
        self.done.set()

    def wait(self) -> None:
        self.done.wait()
        if self.failure is not None:
            raise self.failure


class EngineFeed:
    """One engine stream for every window the replica runs at once.

    Windows queue their requests in arrival order; the stream takes them as the engine has room and ends when
    the queue is empty (the engine then finishes what it holds). With two windows at once, the next window's
    requests are queued while the current ones still wait, so the engine drains only when a window is smaller
    than what the engine takes in, or at the end. Once ``stop`` is set nothing more is admitted; requests not
    admitted are handed back unrun.
    """

    def __init__(self, llm: LLM, telemetry: Telemetry, stop: threading.Event) -> None:
        self.llm = llm
        self.telemetry = telemetry
        self.stop = stop
        self._queue: queue.SimpleQueue[Request | None] = queue.SimpleQueue()
        self._owners: dict[str, _Pending] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="engine-feed", daemon=True)
        self._thread.start()

    def run(self, requests: list[Request], write: Callable[[ResultRow], None]) -> None:
        """Runs ``requests`` through the engine, handing each result to ``write`` (in the feed's thread)."""
        pending = _Pending(len(requests), write)
        with self._lock:
            self._owners.update((r.row_id, pending) for r in requests)
        for r in requests:
            self._queue.put(r)
        pending.wait()

    def _queued(self) -> Iterator[Request]:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is None:
                self._queue.put(None)  # seen again by the loop, which then ends
                return
            yield item

    def _loop(self) -> None:
        while (first := self._queue.get()) is not None:
            try:
                run_requests(self.llm, chain([first], self._queued()), self.stop, self.telemetry, self._deliver)
            except BaseException as e:  # noqa: BLE001 - every window waiting on the engine fails with it
                self._release(lambda p: p.fail(e))
            if self.stop.is_set():
                self._release(lambda p: p.skip())

    def _deliver(self, row: ResultRow) -> None:
        with self._lock:
            owner = self._owners.pop(row.row_id)
        owner.deliver(row)

    def _release(self, how: Callable[[_Pending], None]) -> None:
        """Hands every request not yet finished back to its window (nothing runs in the engine now)."""
        while True:
            try:
                if self._queue.get_nowait() is None:
                    self._queue.put(None)
                    break
            except queue.Empty:
                break
        with self._lock:
            owners, self._owners = list(self._owners.values()), {}
        for p in owners:
            how(p)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)


@dataclass
class ReplicaJob:
    """What a replica needs of the run: its plan (without the committed ids), the run's id (the first part of
    every scope it writes), the board, and the column types of committed parts."""

    plan: RunPlan
    run_id: str
    board: Any  # ActorHandle of JobBoard
    types: dict[str, Any]


class EngineReplica:
    """A Ray Data actor: each call gets one sort window (``prepare_windows``' output row) and commits its rows."""

    def __init__(self, job: ReplicaJob) -> None:
        started = time.perf_counter()
        self.job = job
        spec = job.plan.spec
        try:
            self.llm = preflight.load_model(spec)
        except JobError as e:  # Ray keeps only the text of a constructor's error: the driver reports this one
            job.board.fail.remote(str(e))
            raise
        # the driver's start on this process's clock: step times are perf_counter times
        self.telemetry = Telemetry(self.llm.engine.token_budget,
                                   start=time.perf_counter() - (time.time() - job.plan.epoch_start))
        self.telemetry.stages.add("startup", time.perf_counter() - started)
        info = ReplicaInfo(node=socket.gethostname(), pid=os.getpid(),
                           startup_s=round(time.perf_counter() - started, 3), token_budget=self.llm.engine.token_budget,
                           dtype=self.llm.config.dtype_choice.name, profile=self.llm.profile(),
                           peak_flops=engine_peak_flops(self.llm.config))
        self.link = BoardLink(job.board, info, spec.output.lease_timeout_s)
        self.feed = EngineFeed(self.llm, self.telemetry, self.link.stop)
        fs, root = filesystem(spec.output.path, spec.storage_options)
        self.store = Store(fs, root)
        self.recorded = set(job.plan.recorded)
        self.types = dict(job.types)  # column types of the parts written so far, shared by every window

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list[Any]]:
        keys = [str(k) for k in batch["window"]]
        try:
            rows = [self.run_window(k, load_window(p)) for k, p in zip(keys, batch["payload"])]
        except (JobError, InputError, OutputError):
            raise
        except Exception as e:  # Ray Data hands the driver its own wrapper without this cause: report it
            first = (str(e).strip().splitlines() or [""])[0]
            self.job.board.fail.remote(redact(f"the job failed on Ray: {type(e).__name__}: {first}"))
            raise
        return {"window": keys, "rows": rows, "replica": [self.link.index] * len(keys)}

    def _committer(self, scope: str, retry: bool) -> PartCommitter:
        spec = self.job.plan.spec
        options = dict(types=self.types, fence=self.link.ensure_held, id_key=spec.input.id_column or "id")
        if retry:  # read what the cut-short attempt committed
            return PartCommitter.open(spec.output.path, spec.output.format, spec.storage_options, scope, **options)
        return PartCommitter(self.store, spec.output.path, spec.output.format, scope, **options)

    def run_window(self, key: str, window: Window) -> int:
        """Runs the window's rows not yet committed; returns how many it committed."""
        attempt = self.link.begin(key)
        if attempt is None:
            return 0
        committer = self._committer(f"{self.job.run_id}-{key}", retry=attempt > 0)
        done = {row_id for entry in committer.committed for row_id in entry.row_ids}
        if done:
            log.info("window %s: %d rows already committed by an earlier attempt", key, len(done))
        sink = self.job.plan.part_sink(committer, on_row=self._on_row)
        sink.recorded |= self.recorded
        write = self.telemetry.stages.wrap(sink.add, "write")
        with committing(sink, self.telemetry):
            for row in window.errors:
                if row.row_id not in done:
                    write(row)
            self.feed.run([r for r in window.requests if r.row_id not in done], write)
        self.recorded |= sink.recorded
        self.telemetry.metrics.adopt_states(self.llm.engine.metrics.states())  # the method and fit: no step has them
        self.link.end(key, self.telemetry.state())
        return sink.run.rows

    def _on_row(self, row: ResultRow) -> None:
        self.telemetry.on_row(row)
        self.link.on_row(row)

    def close(self) -> None:
        """Stops feeding the engine, leaves the board and closes the model (its engine's workers stop)."""
        for part in ("feed", "link", "llm"):
            if hasattr(self, part):
                getattr(self, part).close()

    def __del__(self) -> None:  # Ray Data drops the replica when its pool shuts down
        self.close()
