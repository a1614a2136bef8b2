"""Local S3 for tests: a moto server on 127.0.0.1 and a fault-injecting HTTP proxy in front of it."""

from __future__ import annotations

import http.client
import logging
import socket
import struct
import threading
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator

import boto3
import pytest
import s3fs
from moto.server import ThreadedMotoServer

HOST = "127.0.0.1"
BUCKET = "batchgen-bucket"
KEY = SECRET = "testing"
FAULT_KINDS = ("drop", "reset", "reset_mid_response", "slowdown", "error500")

_ERROR_BODIES = {
    "slowdown": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
    "error500": (500, "Internal Server Error", "InternalError", "We encountered an internal error."),
}
_HOP_HEADERS = {"transfer-encoding", "content-length", "connection", "keep-alive", "expect"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _abort(sock: socket.socket) -> None:
    """Close with RST instead of FIN, as a crashed peer or middlebox would."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    except OSError:
        pass


@dataclass
class _Fault:
    kind: str
    remaining: int
    method: str | None
    path: str | None = None


class FaultProxy:
    """HTTP proxy on 127.0.0.1 forwarding to an upstream on 127.0.0.1, with injected faults.

    inject("drop", n): reset the next n new connections as they are accepted;
    inject("reset", n): reset the connection on the next n requests, before any response;
    inject("reset_mid_response", n): send half of the next n responses, then reset;
    inject("slowdown", n) / inject("error500", n): answer 503 SlowDown / 500 InternalError.
    method= limits a fault to requests with that HTTP method ("GET", "PUT", ...), path= to requests whose
    path contains that text ("part-", "models/").
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.injected: Counter[str] = Counter()
        self.requests = 0
        self._faults: list[_Fault] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(_ProxyHandler):
            owner = proxy

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def verify_request(self, request: Any, client_address: Any) -> bool:
                if proxy.take("drop", None):
                    _abort(request)
                    return False
                return True

            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # broken connections are the point here

        self._server = Server((HOST, 0), Handler)
        self.port = self._server.server_address[1]
        self.endpoint_url = f"http://{HOST}:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True, name="s3-fault-proxy")
        self._thread.start()

    def inject(self, kind: str, n: int = 1, method: str | None = None, path: str | None = None) -> None:
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {kind!r}")
        with self._lock:
            self._faults.append(_Fault(kind, n, method, path))

    def take(self, kind: str | None, method: str | None, path: str | None = None) -> str | None:
        """Consume one pending fault of kind (any request-level kind when None) matching method and path."""
        with self._lock:
            for f in self._faults:
                if f.remaining <= 0 or (f.method and f.method != method):
                    continue
                if f.path and (path is None or f.path not in path):
                    continue
                if (kind is None and f.kind != "drop") or f.kind == kind:
                    f.remaining -= 1
                    self.injected[f.kind] += 1
                    return f.kind
        return None

    def pending(self) -> int:
        with self._lock:
            return sum(f.remaining for f in self._faults)

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()
            self.injected.clear()
            self.requests = 0

    def close(self) -> None:
        self.clear()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 30
    owner: FaultProxy

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(HOST, self.owner.upstream_port, timeout=30)
        try:
            conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for k, v in self.headers.items():
                if k.lower() not in _HOP_HEADERS:
                    conn.putheader(k, v)
            conn.putheader("Content-Length", str(len(body)))
            conn.putheader("Connection", "close")
            conn.endheaders(body)
            resp = conn.getresponse()
            return resp.status, resp.reason, resp.getheaders(), resp.read()
        finally:
            conn.close()

    def _send(self, status: int, reason: str, headers: list[tuple[str, str]], data: bytes, cut: bool) -> None:
        length = len(data)
        if self.command == "HEAD":
            length = int(dict((k.lower(), v) for k, v in headers).get("content-length", 0))
        head = [f"HTTP/1.1 {status} {reason}"]
        head += [f"{k}: {v}" for k, v in headers if k.lower() not in _HOP_HEADERS]
        head.append(f"Content-Length: {length}")
        self.wfile.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
        if cut:
            self.wfile.write(data[: len(data) // 2])
            self.close_connection = True
            _abort(self.connection)
        elif self.command != "HEAD":
            self.wfile.write(data)

    def _handle(self) -> None:
        body = self._read_body()
        with self.owner._lock:
            self.owner.requests += 1
        kind = self.owner.take(None, self.command, self.path)
        if kind == "reset":
            self.close_connection = True
            _abort(self.connection)
            return
        if kind in _ERROR_BODIES:
            status, reason, code, message = _ERROR_BODIES[kind]
            xml = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
                   f"<Message>{message}</Message><RequestId>fault</RequestId></Error>").encode()
            self._send(status, reason, [("Content-Type", "application/xml")], xml, cut=False)
            return
        status, reason, headers, data = self._forward(body)
        self._send(status, reason, headers, data, cut=kind == "reset_mid_response")

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle


@dataclass
class S3Env:
    """Where tests find the S3 endpoint, bucket and the storage_options to reach it."""

    endpoint_url: str  # what storage_options point at: moto itself, or the fault proxy
    moto_url: str
    bucket: str = BUCKET
    proxy: FaultProxy | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.storage_options:
            self.storage_options = {"endpoint_url": self.endpoint_url, "key": KEY, "secret": SECRET,
                                    "client_kwargs": {"region_name": "us-east-1"}}

    def url(self, key: str = "") -> str:
        return f"s3://{self.bucket}/{key}"

    def client(self) -> Any:
        """A boto3 client that talks to moto directly, never through the fault proxy."""
        return boto3.client("s3", endpoint_url=self.moto_url, aws_access_key_id=KEY,
                            aws_secret_access_key=SECRET, region_name="us-east-1")


@pytest.fixture(scope="session")
def moto_server() -> Iterator[str]:
    """Endpoint URL of a moto S3 server on 127.0.0.1 for the test session."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = free_port()
    server = ThreadedMotoServer(ip_address=HOST, port=port, verbose=False)
    server.start()
    try:
        yield f"http://{HOST}:{port}"
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_proxy(moto_server: str) -> Iterator[FaultProxy]:
    proxy = FaultProxy(int(moto_server.rsplit(":", 1)[1]))
    try:
        yield proxy
    finally:
        proxy.close()


@pytest.fixture
def s3(moto_server: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Env]:
    """A fresh moto state with one empty bucket."""
    monkeypatch.setenv("NO_PROXY", HOST)
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_ACCESS_KEY_ID",
                 "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    urllib.request.urlopen(urllib.request.Request(f"{moto_server}/moto-api/reset", method="POST"), timeout=10)
    env = S3Env(endpoint_url=moto_server, moto_url=moto_server)
    env.client().create_bucket(Bucket=BUCKET)
    s3fs.S3FileSystem.clear_instance_cache()
    yield env
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def faulty_s3(s3: S3Env, s3_proxy: FaultProxy) -> Iterator[S3Env]:
    """Like s3, but storage_options point at the fault proxy; faults are cleared before and after."""
    s3_proxy.clear()
    yield S3Env(endpoint_url=s3_proxy.endpoint_url, moto_url=s3.moto_url, proxy=s3_proxy)
    s3_proxy.clear()
