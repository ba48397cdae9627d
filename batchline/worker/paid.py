"""A paid worker's side of its slot: saying it is up, heartbeating, and saying it stopped.

A pacer starts a paid worker with `batchline worker --job V --paid-slot paid-3/2`
(the slot and the generation of this start). The worker is an ordinary worker of
the version (I1-I5 hold unchanged); besides, it tells the store at once that it is
up (its paid time starts, and the pacer counts it as capacity only from then on),
heartbeats while it runs, marks its first claim (launch to first claim is the
restart overhead the pacer measures) and, when it exits, that it stopped. A
start the store no longer has running (stopped meanwhile, or taken over by a
newer start) is not worked: the worker exits at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batchline.errors import BatchlineError
from batchline.store import WorkerStore

HEARTBEAT_SECONDS = 5.0


@dataclass(frozen=True)
class PaidSlotRef:
    slot: str
    generation: int

    @classmethod
    def parse(cls, text: str) -> PaidSlotRef:
        name, sep, generation = text.partition("/")
        if not sep or not name.startswith("paid-") or not name[5:].isdigit() or not generation.isdigit():
            raise BatchlineError(f"--paid-slot {text!r} must be paid-N/GENERATION, as a pacer starts it "
                                 "(such as paid-3/2)")
        return cls(name, int(generation))

    def __str__(self) -> str:
        return f"{self.slot}/{self.generation}"


class PaidSlotKeeper:
    """Keeps a paid worker's start up to date in the store while the worker runs."""

    def __init__(self, store: WorkerStore, version: str, ref: PaidSlotRef, worker: str,
                 process: dict[str, Any] | None, *, log: Callable[[str], None] = lambda _m: None,
                 on_lost: Callable[[], None] = lambda: None, every: float = HEARTBEAT_SECONDS) -> None:
        self.store, self.version, self.ref, self.worker = store, version, ref, worker
        self.process, self.log, self.every, self.on_lost = process, log, every, on_lost
        self.claimed = threading.Event()
        self.lost = threading.Event()  # the store no longer has this start running
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def seen(self) -> bool:
        ok = self.store.paid_seen(self.version, self.ref.slot, self.ref.generation, self.worker, self.process,
                                  claimed=self.claimed.is_set())
        if not ok and not self.lost.is_set():
            self.lost.set()
            self.on_lost()
        return ok

    def start(self) -> bool:
        """Says the worker is up; False when its start is not running in the store (stopped, or
        taken over): the worker is to exit without working."""
        if not self.seen():
            return False
        self._thread = threading.Thread(target=self._beat, name="paid-heartbeat", daemon=True)
        self._thread.start()
        return True

    def on_claim(self, _version: str) -> None:
        if not self.claimed.is_set():
            self.claimed.set()
            self._safe_seen()

    def _safe_seen(self) -> None:
        try:
            self.seen()
        except BatchlineError as exc:
            self.log(f"paid slot {self.ref}: heartbeat failed ({exc}); trying again")

    def _beat(self) -> None:
        while not self._stop.wait(self.every):
            self._safe_seen()

    def stop(self, reason: str) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.every + 5)
        try:
            self.store.paid_stop(self.version, self.ref.slot, self.ref.generation, reason)
        except BatchlineError as exc:
            self.log(f"paid slot {self.ref}: could not record its stop ({exc}); its pacer will")
