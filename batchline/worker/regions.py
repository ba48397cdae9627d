"""Where a worker reads a shard from, and what it read across regions.

A worker of a region (`--region`, or `BATCHLINE_REGION`) reads each slice from its region's
replica of the version's input where one was checked (`batchline.snapshot.replicas`), else
from where the bytes live (the primary's region, or the shard's home with `input.regions`).
Every byte it reads from a region other than its own is counted, and its heartbeat carries
the count to the store, where `status` and the metrics show it.

A replica that cannot be reached is said once; with `input.replica_fallback: primary` the
worker reads the primary until the replica answers again (tried again after
`REPLICA_RETRY_SECONDS`), else the error goes up and the lease is given back.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

from batchline.errors import ArgumentError, SourceUnavailable
from batchline.snapshot import Record, Slice
from batchline.snapshot.replicas import replica_slice
from batchline.sources.base import READ_METER
from batchline.spec import JobSpec
from batchline.spec.model import region_refusal
from batchline.store.ports import ReplicaReader

REGION_ENV = "BATCHLINE_REGION"
REPLICA_RETRY_SECONDS = 300.0
T = TypeVar("T")


def worker_region(given: str | None) -> str | None:
    """The worker's region: `--region`, else `BATCHLINE_REGION` (how an image is told), else none."""
    region = given if given is not None else (os.environ.get(REGION_ENV) or None)
    why = region_refusal(region) if region is not None else None
    if why is not None:
        raise ArgumentError(f"--region {why}")
    return region


class RegionReader:
    def __init__(self, region: str | None, log: Callable[[str], None] = lambda _m: None,
                 on_cross: Callable[[int], None] = lambda _n: None) -> None:
        self.region = region
        self.log = log
        self.on_cross = on_cross  # the metrics' counter
        self.cross_region_bytes = 0
        self._replica_down: dict[str, float] = {}  # replica location -> when to try it again

    def read(self, store: ReplicaReader, version: str, spec: JobSpec, sl: Slice,
             read: Callable[[Slice], list[Record]]) -> list[Record]:
        """`read(sl)` of the slice where this worker should read it."""
        home = spec.input.regions.home_of(sl.path)
        if self.region is not None and home is not None and self.region != home:
            replica = store.replicas(version).get(self.region)
            if replica is not None and self._replica_down.get(replica.location, 0.0) <= time.monotonic():
                configured = spec.input.regions.replicas.get(self.region)
                storage = {**spec.input.storage, **(configured.storage if configured is not None else {})}
                try:
                    return self._metered(self.region, lambda: read(replica_slice(sl, replica, storage)))
                except SourceUnavailable as exc:
                    if spec.input.regions.fallback != "primary":
                        raise
                    self._replica_down[replica.location] = time.monotonic() + REPLICA_RETRY_SECONDS
                    self.log(f"replica {self.region} at {replica.location} cannot be reached ({exc}); reading the "
                             f"primary in {home} (input.replica_fallback: primary) for {REPLICA_RETRY_SECONDS:g} s")
        return self._metered(home, lambda: read(sl))

    def _metered(self, where: str | None, read: Callable[[], T]) -> T:
        before = READ_METER.total
        try:
            return read()
        finally:
            if self.region is not None and where is not None and where != self.region:
                crossed = READ_METER.total - before
                self.cross_region_bytes += crossed
                self.on_cross(crossed)
