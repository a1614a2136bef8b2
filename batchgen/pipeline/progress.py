"""A tqdm progress bar on stderr: rows done of the total, prompt and generated tok/s, and an ETA from tokens."""
from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Callable, Iterable, Iterator, TypeVar

from tqdm import tqdm

from batchgen.pipeline.rows import ResultRow

log = logging.getLogger(__name__)
T = TypeVar("T")
BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} rows [{elapsed}{postfix}]"


def _clock_text(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """Counts rows read, prepared (tokenized) and finished; the rates cover this run's rows since the bar was
    created.

    ``done`` rows (committed by an earlier run) start the bar. ``known`` rows of the input are counted before
    the bar starts (Parquet footers); the rest, if ``counting``, by :meth:`count_total` in a background thread,
    and until that count is done the bar shows the rows read so far. The total is at most ``limit``.

    The ETA is in tokens, not rows (rows finish in bursts, long ones last): the prompt tokens left (those of
    the rows prepared but not finished, plus the unread rows at the mean prompt length so far) at the rate
    the finished rows' prompt tokens came, which includes the time their generation took.
    """

    def __init__(self, quiet: bool, desc: str, done: int = 0, limit: int | None = None, known: int = 0,
                 counting: bool = False, clock: Callable[[], float] = time.perf_counter) -> None:
        self.limit, self.known, self.counting = limit, known, counting
        self.initial = done
        self.clock = clock
        self.start = clock()
        self.rows = 0  # finished this run
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.rows_read = 0
        self.rows_prepared = 0
        self.prepared_tokens = 0
        self._last_postfix = self.start
        self._counted: int | None = None
        self._cancel = threading.Event()
        self._counter: threading.Thread | None = None
        self.bar = tqdm(total=self.total, initial=done, disable=quiet, file=sys.stderr, unit="row", desc=desc,
                        dynamic_ncols=True, mininterval=0.5, bar_format=BAR_FORMAT)

    def count_total(self, count: Callable[[threading.Event], int]) -> None:
        """Runs ``count(cancel)`` (the input rows not in ``known``; it should stop when ``cancel`` is set) in a
        daemon thread, so a long count never delays the job; the bar takes the total at its next update."""
        self.counting = True

        def run() -> None:
            try:
                self._counted = count(self._cancel)
            except Exception as e:  # noqa: BLE001 - the bar just goes without a total
                log.debug("could not count the input rows: %s", e)

        self._counter = threading.Thread(target=run, name="count-rows", daemon=True)
        self._counter.start()

    @property
    def total(self) -> int | None:
        """The rows the run ends at, once known (at most ``limit``); ``limit`` until then."""
        if self.counting and self._counted is None:
            return self.limit
        rows = self.known + (self._counted or 0)
        return rows if self.limit is None else min(self.limit, rows)

    def reading(self, rows: Iterable[T]) -> Iterator[T]:
        """Passes input rows on, counting them (shown until the total is known)."""
        for row in rows:
            self.rows_read += 1
            yield row

    def prepared(self, prompt_tokens: int) -> None:
        """A row was tokenized into ``prompt_tokens`` and queued for the engine."""
        self.rows_prepared += 1
        self.prepared_tokens += prompt_tokens

    def update(self, row: ResultRow) -> None:
        self.advance(1, row.prompt_tokens, row.completion_tokens)

    def advance(self, rows: int, prompt_tokens: int, completion_tokens: int) -> None:
        """Counts ``rows`` more finished rows holding these tokens (rows finished elsewhere, e.g. by replicas)."""
        self.rows += rows
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        self._apply_total()
        if self.clock() - self._last_postfix >= 0.5:
            self._set_postfix()
        self.bar.update(rows)

    def prompt_tokens_left(self) -> float | None:
        """The prompt tokens of the rows not finished yet, estimated; None while the total is unknown."""
        total = self.total
        if total is None:
            return None
        unseen = max(0, total - self.initial - max(self.rows_prepared, self.rows))
        if self.rows_prepared:
            pending = max(0, self.prepared_tokens - self.prompt_tokens)
            return pending + unseen * self.prepared_tokens / self.rows_prepared
        return unseen * self.prompt_tokens / self.rows if self.rows else None

    def eta_s(self) -> float | None:
        """Seconds left: the prompt tokens left at the rate finished rows' prompt tokens came."""
        left, elapsed = self.prompt_tokens_left(), self.clock() - self.start
        if left is None or self.prompt_tokens <= 0 or elapsed <= 0:
            return None
        return left * elapsed / self.prompt_tokens

    def _apply_total(self) -> None:
        total = self.total
        if total is not None and self.bar.total != total:
            self.bar.total = max(total, self.bar.n)

    def _set_postfix(self) -> None:
        now = self.clock()
        self._last_postfix = now
        elapsed = max(now - self.start, 1e-9)
        parts = [f"prompt {self.prompt_tokens / elapsed:.0f} tok/s",
                 f"gen {self.completion_tokens / elapsed:.0f} tok/s"]
        if self.counting and self._counted is None:
            parts.append(f"{self.rows_read} read, counting")
        eta = self.eta_s()
        if eta is not None:
            parts.append(f"ETA {_clock_text(eta)}")
        self.bar.set_postfix_str(", ".join(parts), refresh=False)

    def close(self) -> None:
        """Stops a count still running (waiting briefly for one about to finish) and closes the bar."""
        if self._counter is not None:
            self._counter.join(timeout=0.2)
            self._cancel.set()
        self._apply_total()
        self._set_postfix()
        self.bar.close()
