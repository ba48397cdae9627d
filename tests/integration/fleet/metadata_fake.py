"""A test fake of the cloud metadata services (the real endpoints cannot exist
here): AWS IMDSv2 (session tokens, the spot `instance-action` document) and
Google Cloud's `instance/preempted` value, served on a loopback port."""

from __future__ import annotations

import json
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class FakeMetadataServer:
    def __init__(self) -> None:
        self.noticed = False
        self.tokens: set[str] = set()
        self.requests: list[tuple[str, str]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_args: Any) -> None:
                pass

            def _send(self, code: int, body: str = "") -> None:
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_PUT(self) -> None:
                fake.requests.append(("PUT", self.path))
                if self.path != "/latest/api/token" or not self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    self._send(400)
                    return
                token = secrets.token_hex(16)
                fake.tokens.add(token)
                self._send(200, token)

            def do_GET(self) -> None:
                fake.requests.append(("GET", self.path))
                if self.path == "/latest/meta-data/spot/instance-action":
                    if self.headers.get("X-aws-ec2-metadata-token") not in fake.tokens:
                        self._send(401)  # IMDSv2: no valid session token, no metadata
                    elif fake.noticed:
                        self._send(200, json.dumps({"action": "terminate", "time": "2026-11-30T01:02:03Z"}))
                    else:
                        self._send(404)
                elif self.path == "/computeMetadata/v1/instance/preempted":
                    if self.headers.get("Metadata-Flavor") != "Google":
                        self._send(403)
                    else:
                        self._send(200, "TRUE" if fake.noticed else "FALSE")
                else:
                    self._send(404)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeMetadataServer:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def notice(self) -> None:
        self.noticed = True

    def revoke_tokens(self) -> None:
        self.tokens.clear()
