"""A paid worker's side of its slot: saying it is up, heartbeating, and saying it stopped.

A pacer starts a paid worker with `batchline worker --job V --paid-slot paid-3/2`
(the slot and the generation of this start). The worker is an ordinary worker of
the version (I1-I5 hold unchanged); besides, it tells the store at once that it is
up (its paid time starts, and the pacer counts it as capacity only from then on),
heartbeats while it runs, marks its first claim (launch to first claim is the
restart overhead the pacer measures) and, when it exits, that it stopped. A
start the store no longer has running (stopped meanwhile, or taken over by a
newer start) is not worked: the worker exits at once.

A paid worker keeps the pacer's promises without it. At each heartbeat it reads
the version's paid spend (`paid_budget`) and stops itself as under I5 (finish in
flight, give the lease back, exit 75) once running on to the next heartbeat
could pass `fallback.max_cost`; and it stops itself when it has not reached the
store for a lease. So the spend passes `max_cost` by at most what the paid
workers cost between two heartbeats and their stop, whether or not a pacer runs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batchline.errors import BatchlineError
from batchline.store import WorkerStore
from batchline.worker.heartbeat import heartbeat_seconds


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
                 on_lost: Callable[[], None] = lambda: None, every: float | None = None,
                 max_cost: float | None = None, unreachable_seconds: float = 600.0) -> None:
        self.store, self.version, self.ref, self.worker = store, version, ref, worker
        self.process, self.log, self.on_lost = process, log, on_lost
        self.every = every if every is not None else heartbeat_seconds()
        self.max_cost = max_cost  # fallback.max_cost: held at each heartbeat
        self.unreachable_seconds = unreachable_seconds  # the job's lease: without the store longer, stop
        self.claimed = threading.Event()
        self.lost = threading.Event()  # this start is to end: stopped in the store, or stopping itself
        self.reason: str | None = None  # why it stops itself, as its stop records it
        self._reached = time.monotonic()

    def seen(self) -> bool:
        ok = self.store.paid_seen(self.version, self.ref.slot, self.ref.generation, self.worker, self.process,
                                  claimed=self.claimed.is_set())
        self._reached = time.monotonic()
        if not ok:
            self._give_up(None)
        return ok

    def _give_up(self, reason: str | None) -> None:
        if self.lost.is_set():
            return
        if reason is not None:
            self.reason = reason
            self.log(f"paid slot {self.ref}: {reason}: stopping")
        self.lost.set()
        self.on_lost()

    def check(self) -> None:
        """One heartbeat: says the worker is up and holds the budget; stops the worker (as under
        I5) once the next heartbeat could find the budget passed, or the store out of reach for
        longer than a lease."""
        try:
            if not self.seen() or self.max_cost is None:
                return
            spent, per_hour = self.store.paid_budget(self.version)
        except BatchlineError as exc:
            away = time.monotonic() - self._reached
            if away > self.unreachable_seconds:
                self._give_up(f"the store could not be reached for {away:.0f} s (a lease)")
            else:
                self.log(f"paid slot {self.ref}: heartbeat failed ({exc}); trying again")
            return
        if spent + per_hour * self.every / 3600.0 >= self.max_cost:
            self._give_up(f"the paid budget would be passed by the next heartbeat ({spent:.2f} of "
                          f"{self.max_cost:g} spent, {per_hour:g} an hour running)")

    def start(self) -> bool:
        """Says the worker is up; False when its start is not running in the store (stopped, or
        taken over) or the budget is spent: the worker is to exit without working. Its
        heartbeats after this one are the worker's (`batchline.worker.heartbeat`)."""
        self.check()
        return not self.lost.is_set()

    def on_claim(self, _version: str) -> None:
        if not self.claimed.is_set():
            self.claimed.set()
            self.check()

    def stop(self, reason: str) -> None:
        """Records the start's end (after the worker's heartbeat has stopped)."""
        try:
            self.store.paid_stop(self.version, self.ref.slot, self.ref.generation, self.reason or reason)
        except BatchlineError as exc:
            self.log(f"paid slot {self.ref}: could not record its stop ({exc}); its pacer will")
