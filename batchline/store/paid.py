"""Paid workers in the store: the rules of the `PaidSlots` port (I7).

A pacer holds a version's deadline by running paid workers in numbered slots
(`paid-0` ... `paid-N-1`). Each start of a slot is a row of `paid_workers`, its
generation one more than the slot's last: `paid_launch` makes it only while the
slot has no row that runs, in one write transaction, so two pacers at once (a
restart, a rollout) can never start one slot twice, and a slot that exists is
"already there". The worker of a row says it is up (`paid_seen`: the first time
starts its paid time, each time after is a heartbeat, its first claim is marked)
and stops it (`paid_stop`, or the pacer does once its process is gone).

The rows are the store's own record of paid worker time: `paid_spend_seconds`
sums each start's time from its worker's first heartbeat to its stop (to now
while it runs), which `fallback.max_cost` is held against, by the pacer and by
each paid worker at its heartbeat (`paid_budget`). The times are the
database's: on PostgreSQL a trigger keeps them whatever an UPDATE says, so a
worker's role cannot make the spend look smaller. A launched slot whose
worker never came up (a Kueue workload not admitted) is capacity ordered, not
capacity: it costs nothing and counts as no worker.

Mixed into `StoreCore`; the SQL is each backend's (the same statement names).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from batchline.store.base import Row, StoreBase

# A paid worker's launch to its first claim (the model load included), until a run has
# measured it: the simulator's default model load.
DEFAULT_RESTART_OVERHEAD_SECONDS = 180.0


@dataclass(frozen=True)
class PaidSlot:
    """One start of a paid slot."""

    slot: str  # paid-0, paid-1, ...
    generation: int
    launched_at: float
    launched_by: str
    cost_per_hour: float
    worker: str | None  # the worker id, once it is up
    process: dict[str, Any] | None  # what its process said of itself (host, pid, pod, actor)
    started_at: float | None  # its first heartbeat: the paid time starts
    seen_at: float | None  # its last heartbeat
    claimed_at: float | None  # its first claim
    stopped_at: float | None
    stop_reason: str | None

    @property
    def index(self) -> int:
        return int(self.slot.rsplit("-", 1)[1])

    @property
    def running(self) -> bool:
        return self.stopped_at is None


def slot_name(index: int) -> str:
    return f"paid-{index}"


def restart_overhead(slots: Sequence[PaidSlot]) -> float | None:
    """The median time from a paid worker's launch to its first claim (which takes in loading
    the model), over the starts that have claimed; None before any has."""
    return median_restart([s.claimed_at - s.launched_at for s in slots if s.claimed_at is not None])


def median_restart(spans: Sequence[float]) -> float | None:
    """The restart overhead of the starts' launch-to-first-claim `spans`; None without any."""
    return statistics.median(spans) if spans else None


class PaidSlots(StoreBase):
    """Paid slots of a version: their starts, heartbeats, stops and spend."""

    def _paid(self, r: Row) -> PaidSlot:
        def at(v: Any) -> float | None:
            return float(v) if v is not None else None

        return PaidSlot(str(r[0]), int(r[1]), float(r[2]), str(r[3]), float(r[4]), r[5],
                        self._unjson(r[6]) if r[6] is not None else None, at(r[7]), at(r[8]), at(r[9]),
                        at(r[10]), r[11])

    def open_run(self, version: str, by: str) -> float:
        """The version's run start: set by the first caller (a runner, a launcher, a pacer) and
        kept from then on, resumes included; a deadline's window and the pacing line count
        from it, so a job no worker ever claims is still late."""

        def body(tx: Any) -> float:
            if tx.run(self.q.OPEN_RUN, {"v": version}) == 1:
                self._event(tx, "open", version, by, None, None, {})
            row = tx.one(self.q.OPENED_AT, {"v": version})
            if row is None:
                raise self._no_version(version)
            return float(row[0])

        opened: float = self._write(body)
        return opened

    def paid_slots(self, version: str) -> list[PaidSlot]:
        """Every start of every paid slot of the version, by slot and generation."""
        return [self._paid(r) for r in self._read(lambda tx: tx.all(self.q.PAID_SLOTS, {"v": version}))]

    def paid_launch(self, version: str, slot: str, by: str, cost_per_hour: float, *,
                    stale_seconds: float, launch_timeout: float) -> int | None:
        """A new start of `slot`, unless one runs ("already there": None). A start whose worker
        has not been heard from for `stale_seconds`, or never came up within `launch_timeout`
        of its launch, is ended first (the pacer stops its process): no slot stays "already
        there" for a start that will never work."""

        def body(tx: Any) -> int | None:
            tx.one(self.q.LOCK_JOB, {"v": version})  # one launch of the version's slots at a time
            row = tx.one(self.q.PAID_SLOT_LATEST, {"v": version, "slot": slot})
            latest = self._paid(row) if row is not None else None
            now = float(tx.one(self.q.NOW)[0])
            if latest is not None and latest.running:
                if latest.seen_at is not None and now - latest.seen_at > stale_seconds:
                    reason = f"not heard from for {stale_seconds:g} s"
                elif latest.seen_at is None and now - latest.launched_at > launch_timeout:
                    reason = f"not seen within {launch_timeout:g} s of its launch"
                else:
                    return None
                tx.run(self.q.PAID_STOP, {"v": version, "slot": slot, "g": latest.generation, "reason": reason})
            generation = latest.generation + 1 if latest is not None else 1
            tx.run(self.q.PAID_INSERT, {"v": version, "slot": slot, "g": generation, "by": by,
                                        "cost": cost_per_hour})
            self._event(tx, "paid_launch", version, by, None, None, {"slot": slot, "generation": generation})
            return generation

        result: int | None = self._write(body)
        return result

    def paid_seen(self, version: str, slot: str, generation: int, worker: str,
                  process: dict[str, Any] | None, *, claimed: bool = False) -> bool:
        """The worker of a start says it is up (and, `claimed`, that it has claimed); False when
        that start was stopped meanwhile or belongs to another worker: it is to exit."""
        params = {"v": version, "slot": slot, "g": generation, "w": worker,
                  "process": self._json(process) if process is not None else None, "claimed": claimed}
        changed: int = self._write(lambda tx: tx.run(self.q.PAID_SEEN, params))
        return changed == 1

    def paid_stop(self, version: str, slot: str, generation: int, reason: str) -> bool:
        """Ends a start (its worker exited, or its process is gone); False if it had ended."""
        params = {"v": version, "slot": slot, "g": generation, "reason": reason}
        changed: int = self._write(lambda tx: tx.run(self.q.PAID_STOP, params))
        return changed == 1

    def paid_budget(self, version: str) -> tuple[float, float]:
        """The version's paid spend so far (in the fallback's price), and what the paid workers
        up and unstopped cost an hour together."""
        row = self._row(self.q.PAID_BUDGET, {"v": version})
        return float(row[0] or 0.0), float(row[1] or 0.0)

    def paid_spend_seconds(self, version: str) -> float:
        """Paid worker-seconds the version has used: each start's, from its worker's first
        heartbeat to its stop, or to now while it runs."""
        row = self._row(self.q.PAID_SPEND, {"v": version})
        return float(row[0] or 0.0)
