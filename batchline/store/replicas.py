"""Replicas of a version's input, and where its shards and workers are: the rules of the
`Replicas` port.

A replica holds the primary's objects under the same keys below another prefix (another
bucket, near another region's workers). The version is the snapshot's content, not where it
lies: each replica's objects have pins of their own (an ETag and a version id differ between
buckets), taken when the replica was checked equal to the primary (`batchline.snapshot.
replicas`), kept here per version and region, and every read of a replica is conditional on
them. Adding a replica never moves the version.

Mixed into `StoreCore`; the SQL is each backend's (the same statement names).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchline.store.base import Row, StoreBase


@dataclass(frozen=True)
class ReplicaRecord:
    """One region's copy of a version's input, as it was checked."""

    region: str
    location: str  # the prefix the copy is under
    root: str  # the primary's common folder, which `location` stands for
    pins: dict[str, dict[str, Any]]  # primary location -> the replica object's pin (Pin.to_json)
    compared: str  # what was compared to call it equal (sizes and checksums, or the bytes' SHA-256)
    by: str
    added_at: float

    def location_of(self, primary: str) -> str:
        """Where the replica holds the primary object `primary`."""
        return self.location + primary[len(self.root):]


@dataclass(frozen=True)
class ShardRegions:
    """Shards counted by their home region, where they were last claimed, and their state."""

    home: str | None
    ran_in: str | None
    state: str
    shards: int
    records: int


@dataclass(frozen=True)
class WorkerRegion:
    worker: str
    region: str | None
    cross_region_bytes: int


class ReplicaRecords(StoreBase):
    """A version's replicas (written by the owner, read by its workers), and its regions' counts."""

    def add_replica(self, version: str, replica: ReplicaRecord) -> None:
        """Records (or replaces) a region's checked copy of the version's input."""

        def body(tx: Any) -> None:
            if tx.one(self.q.LOCK_JOB, {"v": version}) is None:
                raise self._no_version(version)
            tx.run(self.q.REPLICA_ADD, {"v": version, "region": replica.region, "location": replica.location,
                                        "root": replica.root, "pins": self._json(replica.pins),
                                        "compared": replica.compared, "by": replica.by})
            self._event(tx, "replica", version, replica.by, None, None,
                        {"region": replica.region, "location": replica.location, "objects": len(replica.pins),
                         "compared": replica.compared})

        self._write(body)

    def _replica(self, r: Row) -> ReplicaRecord:
        return ReplicaRecord(str(r[0]), str(r[1]), str(r[2]), self._unjson(r[3]), str(r[4]), str(r[5]), float(r[6]))

    def replicas(self, version: str) -> dict[str, ReplicaRecord]:
        """The version's replicas by region."""
        rows = self._read(lambda tx: tx.all(self.q.REPLICAS, {"v": version}))
        return {str(r[0]): self._replica(r) for r in rows}

    def shard_regions(self, version: str) -> list[ShardRegions]:
        rows = self._read(lambda tx: tx.all(self.q.SHARD_REGIONS, {"v": version}))
        return [ShardRegions(r[0], r[1], str(r[2]), int(r[3]), int(r[4] or 0)) for r in rows]

    def worker_regions(self, version: str) -> list[WorkerRegion]:
        rows = self._read(lambda tx: tx.all(self.q.WORKER_REGIONS, {"v": version}))
        return [WorkerRegion(str(r[0]), r[1], int(r[2] or 0)) for r in rows]
