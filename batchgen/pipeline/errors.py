"""Exceptions that end a job: a failed job (exit 1) and an interrupted one (exit 128 + signal)."""
from __future__ import annotations

import signal


class JobError(Exception):
    """The job cannot run or failed as a whole; the message is one line, safe to show."""


class JobInterrupted(Exception):
    """SIGINT or SIGTERM stopped the job after it committed what had finished."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class Terminated(KeyboardInterrupt):
    """SIGTERM before the job's own handlers run (while the model loads): as SIGINT's KeyboardInterrupt, a
    BaseException, so that no ``except Exception`` on the way out takes it for a failure of what it stopped."""

    signum = signal.SIGTERM
