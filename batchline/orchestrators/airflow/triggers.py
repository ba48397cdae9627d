"""`BatchlineVersionTrigger`: waits on the triggerer for a version to end, holding no worker.

Each poll reads the store in a thread (`asyncio.to_thread`), never on the triggerer's event
loop, which other tasks' triggers share. It fires once, when the version is sealed, halted or
cancelled. While it waits, the task's log shows the records answered as they move and, for a
version with a deadline, when it is `at risk` (`fleet.news`: once per change, at most once a
poll). A store it cannot read is polled again, and after `max_failures` polls in a row it
fires an error naming the store, so the task fails and its retry re-attaches: nothing of the
version is lost, its workers go on.

A user who marks the deferred task failed or succeeded, or clears it, stops the fleet the task
launched (`on_kill`, which Airflow 3.3 and later call then, and never on a triggerer's restart or
redistribution): as the operator's own `on_kill` stops it while the task runs, recorded, so the
task's next try launches again. The trigger serialises the launch's key, the launcher's name and
the task's own launcher options (those the DAG gives; the connection's are read on the
triggerer), never the store's URL or a credential of the connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from batchline.errors import BatchlineError

ERROR = "error"


def _watched(conn_id: str, version: str, key: str | None, launcher: str | None,
             overrides: dict[str, Any]) -> tuple[str, Any]:
    """The store's URL and the launch the trigger watches, as its launcher is asked about it,
    both from the connection as it is now (the launch None: a trigger serialised before it
    knew its launch, which watches the version alone)."""
    from batchline.launch.fleet import LaunchRequest
    from batchline.orchestrators.airflow.hooks import BatchlineHook

    hook = BatchlineHook(conn_id)
    url = hook.store_url()
    if key is None or launcher is None:
        return url, None
    return url, LaunchRequest(version=version, spec="", key=key, plan_key=key, store_url=url,
                              options={**hook.launcher_options(launcher), **overrides})


def _poll(conn_id: str, version: str, key: str | None, launcher: str | None, overrides: dict[str, Any],
          quiet_since: float | None) -> dict[str, Any]:
    from batchline.launch.fleet import poll

    url, request = _watched(conn_id, version, key, launcher, overrides)
    return poll(url, version, request, quiet_since).to_json()


def _news(before: dict[str, Any] | None, now: dict[str, Any]) -> list[tuple[bool, str]]:
    from batchline.launch.fleet import news

    return news(before, now)


def _stop(conn_id: str, version: str, key: str, launcher: str, overrides: dict[str, Any]) -> None:
    import contextlib

    from batchline.launch.fleet import stop_launched
    from batchline.store import open_store

    url, request = _watched(conn_id, version, key, launcher, overrides)
    with contextlib.closing(open_store(url, create=False)) as store:
        stop_launched(store, request, "the Airflow task was killed while deferred")


class BatchlineVersionTrigger(BaseTrigger):
    """Fires when `version` is sealed, halted or cancelled (or its store stays unreadable)."""

    def __init__(self, version: str, batchline_conn_id: str = "batchline_default", poll_seconds: float = 30.0,
                 max_failures: int = 10, launch_key: str | None = None, launcher: str | None = None,
                 launcher_options: dict[str, Any] | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.version = version
        self.batchline_conn_id = batchline_conn_id
        self.poll_seconds = poll_seconds
        self.max_failures = max_failures
        self.launch_key = launch_key
        self.launcher = launcher
        self.launcher_options = dict(launcher_options or {})

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}",
                {"version": self.version, "batchline_conn_id": self.batchline_conn_id,
                 "poll_seconds": self.poll_seconds, "max_failures": self.max_failures,
                 "launch_key": self.launch_key, "launcher": self.launcher,
                 "launcher_options": self.launcher_options})

    async def on_kill(self) -> None:
        """Stops the fleet the task launched (see the module); in a thread, off the event loop."""
        if self.launch_key is None or self.launcher is None:
            return  # a trigger serialised before it knew its launch: nothing it can name
        await asyncio.to_thread(_stop, self.batchline_conn_id, self.version, self.launch_key, self.launcher,
                                self.launcher_options)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        failures = 0
        last = ""
        before: dict[str, Any] | None = None
        quiet: float | None = None
        while True:
            try:
                state = await asyncio.to_thread(_poll, self.batchline_conn_id, self.version, self.launch_key,
                                                self.launcher, self.launcher_options, quiet)
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
            before, quiet = state, state["quiet_since"]
            if state["state"] != "running":
                yield TriggerEvent(state)  # type: ignore[no-untyped-call]
                return
            await asyncio.sleep(self.poll_seconds)
