"""Headless Chromium driven over the DevTools protocol through a pipe (no websocket library, no driver)."""
from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--remote-debugging-pipe")
CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "chrome")


def find_chromium() -> str | None:
    return os.environ.get("BATCHGEN_CHROMIUM") or next(filter(None, map(shutil.which, CANDIDATES)), None)


@dataclass
class PageLoad:
    """What a page did while it loaded: console errors, exceptions, failed requests, and a screenshot."""

    console_errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    screenshot: bytes = b""


class Chromium:
    """One headless browser; Chrome DevTools Protocol messages are NUL-separated JSON on fds 3 and 4."""

    def __init__(self, binary: str, timeout: float = 60.0) -> None:
        self.timeout = timeout
        self.profile = tempfile.mkdtemp(prefix="batchgen-chromium-")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()

        def child_fds() -> None:  # the protocol pipe must be fds 3 (commands) and 4 (replies)
            # Move both ends above 4 first: either may itself be fd 3 or 4 and be overwritten otherwise.
            commands, replies = (fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
                                 for fd in (to_browser_r, from_browser_w))
            os.dup2(commands, 3)  # dup2 leaves the copies inheritable
            os.dup2(replies, 4)

        self.proc = subprocess.Popen([binary, *FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, preexec_fn=child_fds, close_fds=False)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict[str, Any]] = []

    def send(self, method: str, params: dict | None = None, session: str | None = None) -> dict[str, Any]:
        """Sends a command and waits for its reply; events that arrive meanwhile go to ``events``."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._receive()
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def _receive(self) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_browser], [], [], left)[0]:
                raise TimeoutError(f"no reply from Chromium within {self.timeout} s")
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise RuntimeError("Chromium closed the DevTools pipe")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def wait_for(self, method: str, session: str) -> dict[str, Any]:
        for event in self.events:
            if event.get("method") == method and event.get("sessionId") == session:
                return event
        while True:
            event = self._receive()
            self.events.append(event)
            if event.get("method") == method and event.get("sessionId") == session:
                return event

    def open(self, url: str, width: int = 1280, height: int = 900) -> tuple[str, PageLoad]:
        """Loads ``url`` in a new tab; returns the tab's session and what happened while it loaded."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.send(f"{domain}.enable", session=session)
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}, session)
        self.events.clear()
        self.send("Page.navigate", {"url": url}, session)
        self.wait_for("Page.loadEventFired", session)
        return session, self._page_load(session)

    def _page_load(self, session: str) -> PageLoad:
        load = PageLoad()
        for e in (e for e in self.events if e.get("sessionId") == session):
            method, params = e.get("method"), e.get("params", {})
            if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert", "warning"):
                load.console_errors.append(" ".join(str(a.get("value", a.get("description")))
                                                    for a in params.get("args", [])))
            elif method == "Runtime.exceptionThrown":
                load.console_errors.append(json.dumps(params.get("exceptionDetails", {}))[:500])
            elif method == "Log.entryAdded" and params["entry"].get("level") in ("error", "warning"):
                load.console_errors.append(params["entry"].get("text", ""))
            elif method == "Network.requestWillBeSent":
                load.requests.append(params["request"]["url"])
        return load

    def evaluate(self, session: str, expression: str) -> Any:
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session)
        if "exceptionDetails" in result:
            raise RuntimeError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, session: str, path: Path) -> Path:
        """A PNG of the whole page (not just the viewport)."""
        data = self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True}, session)
        path.write_bytes(base64.b64decode(data["data"]))
        return path

    def close(self) -> None:
        try:
            self.send("Browser.close")
        except (OSError, RuntimeError, TimeoutError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_browser)
        os.close(self._from_browser)
        shutil.rmtree(self.profile, ignore_errors=True)
