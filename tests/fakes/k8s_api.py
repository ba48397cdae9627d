"""A recording stand-in for the Kubernetes API server, named as such: the official client
talks HTTP to it through a kubeconfig, and it records every request. It keeps objects by
path: a POST to a collection creates `COLLECTION/NAME` (409 if it exists), a GET reads one
(404 if absent), a DELETE removes one. No cluster runs here; this is the protocol peer."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


@dataclass
class Recorded:
    method: str
    path: str
    body: Any


@dataclass
class StandInApi:
    url: str
    objects: dict[str, Any] = field(default_factory=dict)
    requests: list[Recorded] = field(default_factory=list)

    def kubeconfig(self, folder: Path, namespace: str = "batch") -> Path:
        path = folder / "kubeconfig.yaml"
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "stand-in",
            "clusters": [{"name": "stand-in", "cluster": {"server": self.url}}],
            "users": [{"name": "task", "user": {"token": "stand-in-token"}}],
            "contexts": [{"name": "stand-in", "context": {"cluster": "stand-in", "user": "task",
                                                          "namespace": namespace}}]}))
        return path

    def posted(self) -> list[Any]:
        return [r.body for r in self.requests if r.method == "POST"]

    def of(self, method: str) -> list[Recorded]:
        return [r for r in self.requests if r.method == method]


def _status(code: int, reason: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code, "reason": reason,
            "message": reason}


@contextmanager
def stand_in_api() -> Iterator[StandInApi]:
    state: dict[str, Any] = {}
    api = StandInApi("")
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _reply(self, code: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _path(self) -> str:
            return self.path.split("?", 1)[0].rstrip("/")

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")
            path = self._path()
            with lock:
                api.requests.append(Recorded("POST", path, body))
                key = f"{path}/{body['metadata']['name']}"
                if key in state:
                    return self._reply(409, _status(409, "AlreadyExists"))
                state[key] = body
            self._reply(201, body)

        def do_GET(self) -> None:
            path = self._path()
            with lock:
                api.requests.append(Recorded("GET", path, None))
                found = state.get(path)
            self._reply(200, found) if found is not None else self._reply(404, _status(404, "NotFound"))

        def do_DELETE(self) -> None:
            path = self._path()
            with lock:
                api.requests.append(Recorded("DELETE", path, None))
                found = state.pop(path, None)
            if found is None:
                return self._reply(404, _status(404, "NotFound"))
            self._reply(200, {"kind": "Status", "apiVersion": "v1", "status": "Success"})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    api.url = f"http://127.0.0.1:{server.server_address[1]}"
    api.objects = state
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield api
    finally:
        server.shutdown()
        server.server_close()
