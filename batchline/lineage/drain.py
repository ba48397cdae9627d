"""Sending the lineage outbox: claim the rows due, send each, mark it sent.

Any batchline process of a job drains: a worker its version's rows (beside its work, in a
thread with its own store connection, so a receiver that is slow or down never holds up a
lease), `run`, `validate`, `publish`, `rollback`, `cancel` and `resume` every row, for a
bounded time before they return. A send that fails is tried again later, with a growing
pause, up to `MAX_TRIES` times; then the row is given up and kept with its error
(`batchline lineage` shows it, `batchline lineage --retry` makes it due again). The first
failure in a process is said once, as a warning; the work goes on.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from batchline.errors import one_line
from batchline.lineage.config import LineageConfig
from batchline.store.lineage import OutboxRow
from batchline.store.model import JobInfo

MAX_TRIES = 8
# How long a drainer holds the rows it claimed: longer than a send's retries take.
HOLD_SECONDS = 120.0
# A failed row is due again after this many seconds, doubling per try, at most the last.
FIRST_RETRY_SECONDS = 5.0
LAST_RETRY_SECONDS = 900.0

log = logging.getLogger("batchline.lineage")


class _Drainable(Protocol):
    url: str

    def job(self, version: str) -> JobInfo | None: ...

    def pinned_runtime(self, version: str) -> str | None: ...

    def lineage_parent(self, version: str) -> dict[str, Any] | None: ...

    def lineage_claim(self, by: str, *, version: str | None = None, hold_seconds: float = 60.0,
                      limit: int = 100) -> list[OutboxRow]: ...

    def lineage_sent(self, row_id: int, by: str) -> bool: ...

    def lineage_failed(self, row_id: int, by: str, error: str, *, retry_in: float, give_up: bool) -> None: ...


def retry_after(tries: int) -> float:
    return float(min(FIRST_RETRY_SECONDS * 2.0 ** max(0, tries - 1), LAST_RETRY_SECONDS))


@dataclass
class DrainReport:
    sent: int = 0
    failed: int = 0
    given_up: int = 0


class _Warning:
    """Says the first failure of this process, once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.said = False

    def once(self, message: str) -> None:
        with self.lock:
            if self.said:
                log.debug(message)
                return
            self.said = True
        print(f"batchline: warning: {message}", file=sys.stderr, flush=True)


_WARNING = _Warning()


class Sender:
    """The OpenLineage client of this process's configuration, made on first use."""

    def __init__(self, config: LineageConfig, emit: Callable[[Any], None] | None = None) -> None:
        self.config = config
        self._emit = emit
        self._lock = threading.Lock()

    def emit(self, event: Any) -> None:
        with self._lock:
            if self._emit is None:
                self._emit = self.config.client().emit
            emit = self._emit
        emit(event)


def drain_now(store: _Drainable, sender: Sender, *, by: str | None = None, version: str | None = None,
              seconds: float | None = None) -> DrainReport:
    """Sends what is due (of `version`, or of every version the store lets this process
    see), until nothing is left, a send fails (the receiver is down: the rest waits for the
    next try), or `seconds` have passed."""
    from batchline.lineage.events import event_for, store_datasets

    by = by or f"drain:{uuid.uuid4().hex[:12]}"
    report = DrainReport()
    started = time.monotonic()
    datasets = store_datasets(store.url)
    jobs: dict[str, JobInfo | None] = {}
    parents: dict[str, dict[str, Any] | None] = {}
    while seconds is None or time.monotonic() - started < seconds:
        rows = store.lineage_claim(by, version=version, hold_seconds=HOLD_SECONDS)
        if not rows:
            return report
        for i, row in enumerate(rows):
            if row.version not in jobs:
                jobs[row.version] = store.job(row.version)
                parents[row.version] = store.lineage_parent(row.version)
            job = jobs[row.version]
            try:
                if job is None:
                    raise LookupError(f"{row.version} is not in the store")
                event = event_for(row, job, namespace=sender.config.namespace, store=datasets,
                                  runtime=store.pinned_runtime(row.version), parent=parents[row.version])
            except Exception as exc:  # a row no event can be made of is kept, with why
                store.lineage_failed(row.id, by, f"cannot make its event: {one_line(exc)}", retry_in=0.0,
                                     give_up=True)
                report.given_up += 1
                _WARNING.once(f"lineage: the {row.kind} event of {row.version} cannot be made "
                              f"({one_line(exc)}); it is kept in the store, not sent")
                continue
            try:
                sender.emit(event)
            except Exception as exc:  # the transport's own error, whatever it is: the job goes on
                error = one_line(exc) or type(exc).__name__
                for left in rows[i:]:
                    give_up = left.tries >= MAX_TRIES
                    store.lineage_failed(left.id, by, error, retry_in=retry_after(left.tries), give_up=give_up)
                    report.given_up += give_up
                report.failed += 1
                _WARNING.once(f"lineage: cannot send to {sender.config.source} ({error}); events are kept "
                              "in the store and sent again later")
                return report
            store.lineage_sent(row.id, by)
            report.sent += 1
    return report


class Drainer:
    """Drains beside the caller's work, in a thread with a store connection of its own:
    `kick` after a transition this process made, `close` when the process ends (one last
    drain, bounded). The thread also drains every `every` seconds, so a row a dead process
    left behind is sent too."""

    def __init__(self, open_store: Callable[[], Any], sender: Sender, *, version: str | None = None,
                 every: float = 30.0) -> None:
        self._open = open_store
        self.sender = sender
        self.version = version
        self.every = every
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self.by = f"drain:{uuid.uuid4().hex[:12]}"
        self.report = DrainReport()
        self._thread = threading.Thread(target=self._run, name="batchline-lineage", daemon=True)
        self._thread.start()
        self.kick()

    def kick(self) -> None:
        self._idle.clear()
        self._wake.set()

    def _run(self) -> None:
        store = None
        try:
            while not self._stop.is_set():
                self._wake.wait(self.every)
                self._wake.clear()
                try:
                    if store is None:
                        store = self._open()
                    got = drain_now(store, self.sender, by=self.by, version=self.version, seconds=60.0)
                    self.report.sent += got.sent
                    self.report.failed += got.failed
                    self.report.given_up += got.given_up
                except Exception as exc:  # the store or the receiver: said once, never the worker's end
                    _WARNING.once(f"lineage: the outbox could not be drained ({one_line(exc)}); "
                                  "it is drained again later")
                finally:
                    if not self._wake.is_set():
                        self._idle.set()
        finally:
            if store is not None:
                with contextlib.suppress(Exception):  # closing a broken connection says nothing new
                    store.close()

    def close(self, timeout: float = 10.0) -> None:
        """One last drain, waited for at most `timeout` seconds (what is not sent by then
        stays for the next process)."""
        self.kick()
        self._idle.wait(timeout)
        self._stop.set()
        self._wake.set()
        self._thread.join(min(timeout, 1.0))


def client_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("openlineage") is not None


def drain_beside(open_store: Callable[[], Any], config: LineageConfig | None, *,
                 version: str | None = None) -> Drainer | None:
    """A `Drainer` where lineage is on, else None (nothing imported, nothing started). Where
    lineage is configured but its client is not installed, this process leaves its events in
    the store for another process of the job to send, and says so once."""
    if config is None:
        return None
    if not client_installed():
        _WARNING.once(f"lineage is configured ({config.source}) but openlineage-python is not installed here "
                      "(pip install 'batchline[lineage]'): this process leaves its events in the store for "
                      "another process of the job to send")
        return None
    return Drainer(open_store, Sender(config), version=version)
