"""A tqdm progress bar on stderr: rows done of the total (so it shows an ETA), prompt and generated tok/s."""
from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Callable

from tqdm import tqdm

from batchgen.pipeline.rows import ResultRow

log = logging.getLogger(__name__)


class Progress:
    """Counts finished rows; the rates cover this run's rows since the bar was created.

    ``done`` rows (committed by an earlier run) start the bar. The total is ``limit`` until
    :meth:`count_total` has counted the input in a background thread, then ``min(limit, rows)``.
    """

    def __init__(self, quiet: bool, desc: str, done: int = 0, limit: int | None = None) -> None:
        self.bar = tqdm(total=limit, initial=done, disable=quiet, file=sys.stderr, unit="row", desc=desc,
                        dynamic_ncols=True, mininterval=0.5)
        self.limit = limit
        self.start = time.perf_counter()
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self._last_postfix = time.perf_counter()
        self._counted: int | None = None
        self._cancel = threading.Event()
        self._counter: threading.Thread | None = None

    def count_total(self, count: Callable[[threading.Event], int]) -> None:
        """Runs ``count(cancel)`` (the input's row count; it should stop when ``cancel`` is set) in a
        daemon thread, so a long count never delays the job; the bar takes the total at its next update."""

        def run() -> None:
            try:
                self._counted = count(self._cancel)
            except Exception as e:  # noqa: BLE001 - the bar just goes without a total
                log.debug("could not count the input rows: %s", e)

        self._counter = threading.Thread(target=run, name="count-rows", daemon=True)
        self._counter.start()

    @property
    def total(self) -> int | None:
        if self._counted is None:
            return self.limit
        return self._counted if self.limit is None else min(self.limit, self._counted)

    def update(self, row: ResultRow) -> None:
        self.advance(1, row.prompt_tokens, row.completion_tokens)

    def advance(self, rows: int, prompt_tokens: int, completion_tokens: int) -> None:
        """Counts ``rows`` more finished rows holding these tokens (rows finished elsewhere, e.g. by replicas)."""
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        self._apply_total()
        self.bar.update(rows)
        if time.perf_counter() - self._last_postfix >= 0.5:
            self._set_postfix()

    def _apply_total(self) -> None:
        total = self.total
        if total is not None and self.bar.total != total:
            self.bar.total = max(total, self.bar.n)

    def _set_postfix(self) -> None:
        now = time.perf_counter()
        self._last_postfix = now
        elapsed = max(now - self.start, 1e-9)
        self.bar.set_postfix({"prompt tok/s": f"{self.prompt_tokens / elapsed:.0f}",
                              "gen tok/s": f"{self.completion_tokens / elapsed:.0f}"}, refresh=False)

    def close(self) -> None:
        """Stops a count still running (waiting briefly for one about to finish) and closes the bar."""
        if self._counter is not None:
            self._counter.join(timeout=0.2)
            self._cancel.set()
        self._apply_total()
        self._set_postfix()
        self.bar.close()
