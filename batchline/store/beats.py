"""What a heartbeat means: the capacity a version has now (I7), as the store holds it (I8).

Each worker process (spot or paid, loading, working or idle) says it is up every
`every` seconds (from `HEARTBEAT_MIN_SECONDS` to `HEARTBEAT_MAX_SECONDS`), under
the version it works (`--job`, else the version of its first claim), from its
start to its exit, when it says it is gone. One row per (version, worker),
updated in place: a heartbeat is one upsert, cheap enough for a thousand
workers on PostgreSQL. A heartbeat after the worker said it is gone changes
nothing.

A heartbeat is what a worker says, and a worker is not trusted (I8): on its
own it is never capacity. `live_capacity` is the one rule that turns
heartbeats into capacity, and every reader that needs the workers a version
has (the pacers of every launcher, an orchestrator's liveness, the pools) calls
it. A worker is counted while it is heard (its last heartbeat at most
`SILENT_AFTER` of its interval old, an interval above the bound read as the
bound) and not gone, and only for one of these reasons, each read from the
store's own records rather than from what the worker says:

- `leased`: it holds a lease of the version that has not expired (the shards
  table: it is the owner, at the current epoch, of a leased shard);
- `completed`: it completed a shard of the version within its last interval
  (between two shards it holds none for a moment);
- `loading`: its first heartbeat is within `LOADING_OVERHEADS` restart
  overheads of now: the version's measured one (the median of its paid starts'
  launch to first claim), else the spec's `fallback.restart_overhead_seconds`,
  else the default. Loading workers count, so a fleet that is starting does
  not buy paid workers it does not need (I7).

A worker that beats and never claims stops counting once its loading allowance
is over, whatever interval it declared; the database refuses an interval
outside the bounds (a CHECK on `worker_beats` named after them: PostgreSQL
migration 26, which holds for the worker role's own SQL, and SQLite migration
21), and this module refuses it first with a one-line error naming them.

A paid heartbeat (`paid_slot`, `paid-N/G`) counts only when its slot and
generation are a start of `paid_workers` that a pacer launched, that is not
stopped, and whose worker (as the start's own `paid_seen` recorded it first) is
the one beating. So a worker posing as a paid slot (a slot never launched, a
generation stopped, or another worker's start) is not counted at all, and one
posing as a spot worker is counted only while it loads or leases. What a
worker's credentials can still do: beat as a new worker name each loading
allowance (each counted until its allowance is over; the pacer sees capacity it
does not have for that long), hold leases it does not work on until they
expire (counted as `leased`, as any stalled owner is), and, as the worker of a
real paid start, delay its first claim to lengthen the measured restart
overhead.

Mixed into `StoreCore`; the SQL is each backend's (the same statement names).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from batchline.errors import StoreError
from batchline.store.base import StoreBase, Tx
from batchline.store.paid import DEFAULT_RESTART_OVERHEAD_SECONDS, median_restart

# A worker is counted while its last heartbeat is at most this many of its intervals old: one
# heartbeat late is tolerated (a busy node), one interval and a half is silence.
SILENT_AFTER = 1.5

# The bounds of a heartbeat's interval, held by the worker's environment
# (BATCHLINE_HEARTBEAT_SECONDS), by this store and by the database (PostgreSQL migration 26,
# SQLite 21): faster is load on the store for nothing, slower lets a dead worker count for
# minutes. A change of them is a new migration of each store: an applied one is never edited.
HEARTBEAT_MIN_SECONDS = 0.1
HEARTBEAT_MAX_SECONDS = 60.0
# The database's name of the bound (PostgreSQL's constraint, SQLite's), so its refusal says it.
HEARTBEAT_BOUND = f"heartbeat interval from {HEARTBEAT_MIN_SECONDS:g} to {HEARTBEAT_MAX_SECONDS:g} s"

# A worker loads for this many restart overheads from its first heartbeat before it must have
# claimed: the measured overhead is a median (half the starts take longer), and the pacing
# rule gives a starting job the same two overheads to load (batchline.sizing.pacing.loading).
LOADING_OVERHEADS = 2.0


def heartbeat_interval_refused(every: float) -> str | None:
    """Why an interval is refused (None: it is within the bounds), in one line."""
    if math.isfinite(every) and HEARTBEAT_MIN_SECONDS <= every <= HEARTBEAT_MAX_SECONDS:
        return None
    return (f"a heartbeat's interval is from {HEARTBEAT_MIN_SECONDS:g} to {HEARTBEAT_MAX_SECONDS:g} s, "
            f"not {every:g}")


@dataclass(frozen=True)
class WorkerSeen:
    """A worker the store has heard heartbeat recently: what it says of itself."""

    worker: str
    paid_slot: str | None  # paid-N/G for a paid worker; None for a spot worker
    process: dict[str, Any] | None  # what its process said of itself (host, pid, pod, actor)
    every: float
    started_at: float
    seen_at: float

    @property
    def paid(self) -> bool:
        return self.paid_slot is not None


# Why a live worker is counted (`LiveWorker.why`).
LEASED = "leased"  # holds an unexpired lease of the version
COMPLETED = "completed"  # completed a shard of the version within its last interval
LOADING = "loading"  # its first heartbeat is within its loading allowance


@dataclass(frozen=True)
class LiveWorker(WorkerSeen):
    """A worker counted as the version's capacity, and why (`LEASED`, `COMPLETED`, `LOADING`)."""

    why: str


class WorkerBeats(StoreBase):
    """Workers' heartbeats: their writes by the worker, and the capacity read of them."""

    def worker_beat(self, version: str, worker: str, *, every: float, paid_slot: str | None = None,
                    process: dict[str, Any] | None = None, region: str | None = None,
                    cross_region_bytes: int = 0) -> None:
        """`cross_region_bytes`: what the worker has read from outside its region so far (a
        count that only grows; the store keeps the largest it was told). An interval outside
        the bounds is refused (`StoreError`), as the database refuses it."""
        refused = heartbeat_interval_refused(every)
        if refused is not None:
            raise StoreError(f"heartbeat of {worker} for {version} refused: {refused}")
        params = {"v": version, "w": worker, "slot": paid_slot, "every": every,
                  "process": self._json(process) if process is not None else None, "region": region,
                  "cross": int(cross_region_bytes)}
        self._write(lambda tx: tx.run(self.q.WORKER_BEAT, params))

    def worker_gone(self, version: str, worker: str) -> None:
        self._write(lambda tx: tx.run(self.q.WORKER_GONE, {"v": version, "w": worker}))

    def workers_seen(self, version: str) -> list[WorkerSeen]:
        """Every worker heard recently and not gone, as it says: not capacity (`live_capacity`)."""
        rows = self._read(lambda tx: tx.all(self.q.WORKERS_SEEN, {"v": version, "grace": SILENT_AFTER}))
        return [WorkerSeen(str(r[0]), r[1], self._unjson(r[2]) if r[2] is not None else None, float(r[3]),
                           float(r[4]), float(r[5])) for r in rows]

    def loading_allowance(self, version: str) -> float:
        """How long from its first heartbeat a worker of the version counts while loading."""
        return self._read(lambda tx: self._loading_allowance(tx, version))

    def _loading_allowance(self, tx: Tx, version: str) -> float:
        measured = median_restart([float(r[0]) for r in tx.all(self.q.RESTART_SPANS, {"v": version})])
        if measured is None:
            row = tx.one(self.q.SPEC_RESTART_OVERHEAD, {"v": version})
            measured = float(row[0]) if row is not None and row[0] is not None else DEFAULT_RESTART_OVERHEAD_SECONDS
        return LOADING_OVERHEADS * measured

    def live_capacity(self, version: str) -> list[LiveWorker]:
        """The version's workers that count as capacity now, each with why (the module's doc)."""

        def body(tx: Tx) -> list[LiveWorker]:
            params = {"v": version, "grace": SILENT_AFTER, "max_every": HEARTBEAT_MAX_SECONDS,
                      "loading": self._loading_allowance(tx, version)}
            return [LiveWorker(str(r[0]), r[1], self._unjson(r[2]) if r[2] is not None else None, float(r[3]),
                               float(r[4]), float(r[5]), str(r[6])) for r in tx.all(self.q.LIVE_CAPACITY, params)]

        return self._read(body)
