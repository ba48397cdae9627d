"""Helpers shared by the engine tests: a RequestSource over a list, and the example prompt."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from pathlib import Path

from batchline.engines.base import EngineRequest
from batchline.prompt import render, split_template

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "tickets"


def triage_template() -> tuple[str, str]:
    """The example job's prompt, split around its record block."""
    return split_template((EXAMPLES / "triage.prompt").read_text(encoding="utf-8"))


def make_request(record_id: str, prefix: str, text: str, suffix: str = "") -> EngineRequest:
    """A request rendered the way the pipeline renders it: prefix, then the delimited record."""
    return EngineRequest(
        record_id=record_id, prompt=render(prefix, suffix, text), prefix=prefix, text=text
    )


class ListSource:
    """A RequestSource that hands out a fixed list of requests, recording each call."""

    def __init__(self, requests: Iterable[EngineRequest]) -> None:
        self._pending = list(requests)
        self._lock = threading.Lock()
        self.calls: list[tuple[str, int, int]] = []

    def next_batch(self, max_items: int) -> list[EngineRequest]:
        return self._take("next_batch", max_items)

    def poll(self, max_items: int) -> list[EngineRequest]:
        return self._take("poll", max_items)

    def _take(self, kind: str, max_items: int) -> list[EngineRequest]:
        with self._lock:
            batch, self._pending = self._pending[:max_items], self._pending[max_items:]
            self.calls.append((kind, max_items, len(batch)))
            return batch
