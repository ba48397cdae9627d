"""Every worker's heartbeat: the capacity a version has now (I7).

Each worker process (spot or paid, loading, working or idle) says it is up every
`every` seconds, under the version it works (`--job`, else the version of its
first claim), from its start to its exit, when it says it is gone. A pacer
counts as capacity the workers seen within `SILENT_AFTER` of their interval that
have not said they are gone, so a worker loading its model counts and a dead
one stops counting within seconds, however long its lease has to run.

One row per (version, worker), updated in place: a heartbeat is one upsert,
cheap enough for a thousand workers on PostgreSQL. A heartbeat after the worker
said it is gone changes nothing.

Mixed into `StoreCore`; the SQL is each backend's (the same statement names).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchline.store.base import StoreBase

# A worker is counted while its last heartbeat is at most this many of its intervals old: one
# heartbeat late is tolerated (a busy node), one interval and a half is silence.
SILENT_AFTER = 1.5


@dataclass(frozen=True)
class WorkerSeen:
    """A worker the store has seen heartbeat recently."""

    worker: str
    paid_slot: str | None  # paid-N/G for a paid worker; None for a spot worker
    process: dict[str, Any] | None  # what its process said of itself (host, pid, pod, actor)
    every: float
    started_at: float
    seen_at: float

    @property
    def paid(self) -> bool:
        return self.paid_slot is not None


class WorkerBeats(StoreBase):
    """Workers' heartbeats: their writes by the worker, and what a pacer reads of them."""

    def worker_beat(self, version: str, worker: str, *, every: float, paid_slot: str | None = None,
                    process: dict[str, Any] | None = None, region: str | None = None,
                    cross_region_bytes: int = 0) -> None:
        """`cross_region_bytes`: what the worker has read from outside its region so far (a
        count that only grows; the store keeps the largest it was told)."""
        params = {"v": version, "w": worker, "slot": paid_slot, "every": every,
                  "process": self._json(process) if process is not None else None, "region": region,
                  "cross": int(cross_region_bytes)}
        self._write(lambda tx: tx.run(self.q.WORKER_BEAT, params))

    def worker_gone(self, version: str, worker: str) -> None:
        self._write(lambda tx: tx.run(self.q.WORKER_GONE, {"v": version, "w": worker}))

    def workers_seen(self, version: str) -> list[WorkerSeen]:
        rows = self._read(lambda tx: tx.all(self.q.WORKERS_SEEN, {"v": version, "grace": SILENT_AFTER}))
        return [WorkerSeen(str(r[0]), r[1], self._unjson(r[2]) if r[2] is not None else None, float(r[3]),
                           float(r[4]), float(r[5])) for r in rows]
