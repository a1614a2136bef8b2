"""Forks `batchgen run` processes for the chaos tests without paying torch's import each time.

    python -m tests.chaos_zygote      (driven by tests/test_chaos.py through Zygote)

Imports batchgen once, then reads one JSON request per line on stdin: ``{"start": [cli args], "env": {...},
"log": path}`` forks a child that runs the CLI exactly as ``batchgen run`` would (its own pid, environment,
stdout/stderr in ``log``) and answers ``{"pid": n}``; ``{"wait": pid}`` answers ``{"status": s}`` once that
child ended (the exit code, or -signal).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import batchgen.cli  # noqa: F401  (the imports a child would otherwise repeat)
import batchgen.pipeline.runner  # noqa: F401

ROOT = str(Path(__file__).resolve().parents[1])


def _child(request: dict[str, Any]) -> None:
    os.environ.update(request["env"])
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    code = 1
    try:
        batchgen.cli.main(request["start"], prog_name="batchgen")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _status(raw: int) -> int:
    return -os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else os.WEXITSTATUS(raw)


def main() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        if "start" in request:
            pid = os.fork()
            if pid == 0:
                _child(request)
            answer: dict[str, Any] = {"pid": pid}
        else:
            answer = {"status": _status(os.waitpid(request["wait"], 0)[1])}
        print(json.dumps(answer), flush=True)


class Zygote:
    """The test side: starts the zygote, forks runs through it, waits for them."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.chaos_zygote"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONPATH": ROOT})

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"the chaos zygote died (exit {self.proc.wait()})")
        return json.loads(answer)

    def start(self, args: list[str], log: str, env: dict[str, str] | None = None) -> int:
        return self._ask({"start": args, "log": log, "env": env or {}})["pid"]

    def wait(self, pid: int) -> int:
        return self._ask({"wait": pid})["status"]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


if __name__ == "__main__":
    main()
