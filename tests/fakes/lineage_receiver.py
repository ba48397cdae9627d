"""TEST FAKE: a local OpenLineage receiver, standing in for Marquez or any other collector.

A threaded stdlib HTTP server on 127.0.0.1 (port 0) that takes what the OpenLineage client's
HTTP transport posts (`POST /api/v1/lineage`, one event a request) and keeps every event as
received; `down` makes it answer 503 (the client's transport then fails the send); `stall`
(event types) holds such a request unanswered until `release` is set, and then drops it,
as a receiver whose sender died mid-request never got it (`stalled` counts them). The
events are checked against the OpenLineage JSON Schemas kept under tests/data/openlineage
(`validate_event`): the real schemas of the spec version the client emits, and batchline's
own facet schemas from the package.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

SCHEMAS = Path(__file__).resolve().parents[1] / "data" / "openlineage"
ENDPOINT = "/api/v1/lineage"


class LineageReceiver:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.down = False
        self.stall: set[str] = set()
        self.stalled = 0
        self.release = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                if receiver.down or self.path != ENDPOINT:
                    self.send_response(503 if receiver.down else 404)
                    self.end_headers()
                    return
                event = json.loads(body)
                if event.get("eventType") in receiver.stall:
                    with receiver.lock:
                        receiver.stalled += 1
                    receiver.release.wait(120)
                    self.send_response(503)
                    self.end_headers()
                    return
                with receiver.lock:
                    receiver.events.append(event)
                self.send_response(201)
                self.end_headers()

            def log_message(self, *_args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def received(self) -> list[dict[str, Any]]:
        with self.lock:
            return list(self.events)

    def of(self, job: str, event_type: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.received() if e["job"]["name"] == job
                and (event_type is None or e["eventType"] == event_type)]


@contextlib.contextmanager
def lineage_receiver() -> Iterator[LineageReceiver]:
    receiver = LineageReceiver()
    thread = threading.Thread(target=receiver.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        receiver.release.set()
        receiver.server.shutdown()
        receiver.server.server_close()


def _registry() -> Any:
    from referencing import Registry, Resource

    from batchline.lineage.events import FACETS_SCHEMA_FILE

    resources = []
    for path in [SCHEMAS / "OpenLineage.json", *sorted((SCHEMAS / "facets").glob("*.json")), FACETS_SCHEMA_FILE]:
        schema = json.loads(path.read_text())
        resources.append((schema["$id"], Resource.from_contents(schema)))
    return Registry().with_resources(resources)


def kept_schema_ids() -> set[str]:
    from batchline.lineage.events import FACETS_SCHEMA_FILE

    paths = [SCHEMAS / "OpenLineage.json", *(SCHEMAS / "facets").glob("*.json"), FACETS_SCHEMA_FILE]
    return {json.loads(p.read_text())["$id"] for p in paths}


def schema_urls(value: Any) -> Iterator[str]:
    """Every `_schemaURL` (and the event's `schemaURL`) an event names."""
    if isinstance(value, dict):
        for key, item in value.items():
            if key in ("_schemaURL", "schemaURL") and isinstance(item, str):
                yield item
            else:
                yield from schema_urls(item)
    elif isinstance(value, list):
        for item in value:
            yield from schema_urls(item)


def facets(value: Any) -> Iterator[dict[str, Any]]:
    """Every facet of an event (anything that names its schema)."""
    if isinstance(value, dict):
        if "_schemaURL" in value:
            yield value
        for item in value.values():
            yield from facets(item)
    elif isinstance(value, list):
        for item in value:
            yield from facets(item)


def validate_event(event: dict[str, Any]) -> None:
    """The event against the core schema's RunEvent, and each facet against the schema its
    `_schemaURL` names (a standard facet's file, or batchline's own): jsonschema raises on
    the first problem."""
    from jsonschema import Draft202012Validator

    registry = _registry()

    def check(instance: Any, url: str) -> None:
        # Through a reference, so each schema's own `#/$defs/...` resolve against its `$id`.
        Draft202012Validator({"$ref": url}, registry=registry).validate(instance)

    check(event, event["schemaURL"])
    for facet in facets(event):
        check(facet, facet["_schemaURL"])
