"""A tqdm progress bar on stderr: rows done, prompt and generated tokens per second."""
from __future__ import annotations

import sys
import time

from tqdm import tqdm

from batchgen.pipeline.rows import ResultRow


class Progress:
    """Counts finished rows; the rates cover this run's rows since the bar was created."""

    def __init__(self, total: int | None, quiet: bool, desc: str, done: int = 0) -> None:
        self.bar = tqdm(total=total, initial=done, disable=quiet, file=sys.stderr, unit="row", desc=desc,
                        dynamic_ncols=True, mininterval=0.5)
        self.start = time.perf_counter()
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self._last_postfix = time.perf_counter()

    def update(self, row: ResultRow) -> None:
        self.prompt_tokens += row.prompt_tokens
        self.completion_tokens += row.completion_tokens
        self.bar.update(1)
        if time.perf_counter() - self._last_postfix >= 0.5:
            self._set_postfix()

    def _set_postfix(self) -> None:
        now = time.perf_counter()
        self._last_postfix = now
        elapsed = max(now - self.start, 1e-9)
        self.bar.set_postfix({"prompt tok/s": f"{self.prompt_tokens / elapsed:.0f}",
                              "gen tok/s": f"{self.completion_tokens / elapsed:.0f}"}, refresh=False)

    def close(self) -> None:
        self._set_postfix()
        self.bar.close()
