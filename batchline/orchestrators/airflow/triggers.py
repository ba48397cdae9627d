"""`BatchlineVersionTrigger`: waits on the triggerer for a version to end, holding no worker.

Each poll reads the store in a thread (`asyncio.to_thread`), never on the triggerer's event
loop, which other tasks' triggers share. It fires once, when the version is sealed, halted or
cancelled. While it waits, the task's log shows the records answered as they move and, for a
version with a deadline, when it is `at risk` (`fleet.news`: once per change, at most once a
poll). A store it cannot read is polled again, and after `max_failures` polls in a row it
fires an error naming the store, so the task fails and its retry re-attaches: nothing of the
version is lost, its workers go on.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from batchline.errors import BatchlineError

ERROR = "error"


def _poll(store_url: str, version: str) -> dict[str, Any]:
    from batchline.launch.fleet import poll

    return poll(store_url, version).to_json()


def _news(before: dict[str, Any] | None, now: dict[str, Any]) -> list[tuple[bool, str]]:
    from batchline.launch.fleet import news

    return news(before, now)


def _store_url(conn_id: str) -> str:
    from batchline.orchestrators.airflow.hooks import BatchlineHook

    return BatchlineHook(conn_id).store_url()


class BatchlineVersionTrigger(BaseTrigger):
    """Fires when `version` is sealed, halted or cancelled (or its store stays unreadable)."""

    def __init__(self, version: str, batchline_conn_id: str = "batchline_default", poll_seconds: float = 30.0,
                 max_failures: int = 10) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.version = version
        self.batchline_conn_id = batchline_conn_id
        self.poll_seconds = poll_seconds
        self.max_failures = max_failures

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}",
                {"version": self.version, "batchline_conn_id": self.batchline_conn_id,
                 "poll_seconds": self.poll_seconds, "max_failures": self.max_failures})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        failures = 0
        last = ""
        before: dict[str, Any] | None = None
        while True:
            try:
                url = await asyncio.to_thread(_store_url, self.batchline_conn_id)
                state = await asyncio.to_thread(_poll, url, self.version)
            except (BatchlineError, OSError) as exc:
                failures += 1
                last = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                self.log.warning("batchline store unreadable (%d of %d): %s", failures, self.max_failures, last)
                if failures >= self.max_failures:
                    message = (f"the batchline store of connection {self.batchline_conn_id} could not be read "
                               f"{failures} times in a row: {last}; {self.version} and its workers are untouched")
                    yield TriggerEvent(  # type: ignore[no-untyped-call]
                        {"state": ERROR, "version": self.version, "message": message})
                    return
                await asyncio.sleep(self.poll_seconds)
                continue
            failures = 0
            for warning, line in _news(before, state):
                (self.log.warning if warning else self.log.info)("%s", line)
            before = state
            if state["state"] != "running":
                yield TriggerEvent(state)  # type: ignore[no-untyped-call]
                return
            await asyncio.sleep(self.poll_seconds)
