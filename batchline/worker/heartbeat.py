"""A worker's heartbeat: that it is up, from its start (the model loading) to its exit.

One thread per worker process says so every `heartbeat_seconds()` (5 s, or
`BATCHLINE_HEARTBEAT_SECONDS`) under the version it works (`--job`, else the
version of its first claim) and, for a paid worker, keeps its slot
(`batchline.worker.paid`: its heartbeat, and the budget it holds). Each
heartbeat records its interval, so whoever reads it judges silence by the
worker's own. A heartbeat that fails is tried again at the next one: the
worker's own work does not wait on it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from batchline.errors import BatchlineError
from batchline.store import WorkerStore
from batchline.store.beats import HEARTBEAT_MAX_SECONDS, HEARTBEAT_MIN_SECONDS

if TYPE_CHECKING:
    from batchline.worker.paid import PaidSlotKeeper

HEARTBEAT_SECONDS = 5.0
HEARTBEAT_ENV = "BATCHLINE_HEARTBEAT_SECONDS"


def heartbeat_seconds() -> float:
    """How often a worker heartbeats: `BATCHLINE_HEARTBEAT_SECONDS`, else 5 s. A fleet of
    thousands on one store may beat less often; the budget a paid worker holds is passed by
    at most what the paid workers cost over one interval."""
    text = os.environ.get(HEARTBEAT_ENV)
    if text is None or not text.strip():
        return HEARTBEAT_SECONDS
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    # The store refuses a heartbeat outside the same bounds: refused here, before anything starts.
    if not HEARTBEAT_MIN_SECONDS <= value <= HEARTBEAT_MAX_SECONDS:
        raise BatchlineError(f"{HEARTBEAT_ENV}={text!r}: give the seconds between a worker's heartbeats, "
                             f"from {HEARTBEAT_MIN_SECONDS:g} to {HEARTBEAT_MAX_SECONDS:g}")
    return value


class Heartbeat:
    def __init__(self, store: WorkerStore, worker: str, version: str | None, process: dict[str, Any] | None, *,
                 paid: PaidSlotKeeper | None = None, every: float | None = None,
                 log: Callable[[str], None] = lambda _m: None, region: str | None = None) -> None:
        self.store, self.worker, self.version, self.process = store, worker, version, process
        self.region = region
        # What the worker has read from outside its region so far (its RegionReader's count).
        self.cross_region_bytes: Callable[[], int] = lambda: 0
        self.paid, self.log = paid, log
        self.every = every if every is not None else heartbeat_seconds()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._failing = False

    def start(self) -> None:
        self.beat()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()

    def on_claim(self, version: str) -> None:
        """A worker without --job beats under the version of its first claim from then on."""
        first = False
        with self._lock:
            if self.version is None:
                self.version, first = version, True
        if first:
            self.beat()
        if self.paid is not None:
            self.paid.on_claim(version)

    def beat(self) -> None:
        version = self.version
        if version is not None:
            try:
                self.store.worker_beat(version, self.worker, every=self.every, process=self.process,
                                       paid_slot=str(self.paid.ref) if self.paid is not None else None,
                                       region=self.region, cross_region_bytes=self.cross_region_bytes())
                if self._failing:
                    self.log("heartbeat: the store answers again")
                self._failing = False
            except BatchlineError as exc:
                if not self._failing:
                    self.log(f"heartbeat failed ({' '.join(str(exc).split())}); trying again")
                self._failing = True
        if self.paid is not None:
            self.paid.check()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.beat()

    def stop(self) -> None:
        """The worker exits: no more heartbeats, and the store told it is gone."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.every + 5)
        if self.version is not None:
            try:
                self.store.worker_gone(self.version, self.worker)
            except BatchlineError as exc:
                self.log(f"could not say this worker is gone ({exc}); it stops counting once silent")
