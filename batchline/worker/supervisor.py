"""The worker's supervisor: the claim loop.

It owns the store connection and the engine child (which owns the model),
claims shards and hands each to the run of its route: `local.py` streams the
records through the engine child, `hosted.py` through a provider's batch. A
model that cannot load, or a provider whose key is missing, takes no shard.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence

from batchline.errors import (
    EngineFatal,
    InputError,
    NoSuchVersion,
    OutputUnwritable,
    SourceUnavailable,
    VersionHalted,
)
from batchline.lineage import LineageConfig
from batchline.lineage.drain import Drainer, drain_beside
from batchline.providers.base import BatchProvider
from batchline.spec import LOCAL_ROUTE, ProviderSpec, stored_spec
from batchline.store import Lease, WorkerStore, open_store
from batchline.store.core import INPUT_CHANGED
from batchline.worker.build import batchline_build
from batchline.worker.engine_process import EngineProcess, EngineStopped
from batchline.worker.hosted import HostedShardRun
from batchline.worker.liveness import kubernetes_pod_lookup, process_identity, take_back_dead
from batchline.worker.local import LocalShardRun
from batchline.worker.regions import RegionReader
from batchline.worker.shard import JobContext, ShardContext, WorkerHandle
from batchline.worker.telemetry import WorkerTelemetry

EXIT_DONE = 0
# EX_TEMPFAIL: stopped early with work left (a signal, a preemption notice, an input store
# that cannot be read now); start another.
EXIT_PREEMPTED = 75
EXIT_INPUT = 3
EXIT_ENGINE = 5

LOAD_TIMEOUT_SECONDS = 900.0
# How long a worker that is done waits, at most, for its last lineage events to go out
# (what is not sent by then stays in the store for the next process of the job).
DRAIN_AT_EXIT_SECONDS = 10.0


def new_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class Worker:
    def __init__(self, store: WorkerStore, *, version: str | None = None, worker_id: str | None = None,
                 stop: threading.Event | None = None, poll_seconds: float = 1.0,
                 log: Callable[[str], None] = lambda _m: None,
                 telemetry: WorkerTelemetry | None = None, routes: Sequence[str] | None = None,
                 on_claim: Callable[[str], None] = lambda _version: None,
                 lineage: LineageConfig | None = None, region: str | None = None) -> None:
        self.store = store
        # The lineage outbox's drainer (None where lineage is off): kicked after the claims and
        # completions that may have started, completed or failed the version's run.
        self.lineage = lineage
        self._drainer: Drainer | None = None
        self.on_claim = on_claim  # a paid worker marks its first claim (batchline.worker.paid)
        self.routes = list(routes) if routes is not None else None  # None: every route of the job
        self.telemetry = telemetry or WorkerTelemetry()
        self.version = version
        self.worker_id = worker_id or new_worker_id()
        self.stop = stop or threading.Event()
        self.poll_seconds = poll_seconds
        self.log = log
        self._jobs: dict[str, JobContext] = {}
        self._engine: EngineProcess | None = None
        self._engine_version: str | None = None
        self._announced: set[tuple[str, str]] = set()
        self.identity = process_identity()
        self.pod_lookup = kubernetes_pod_lookup() if self.identity.get("pod") else None
        self.handle = WorkerHandle(store, self.worker_id, self.stop, self.telemetry, log,
                                   regions=RegionReader(region, log, self.telemetry.read_across_regions))
        # When this worker last claimed a shard of its own region (or started): it takes another
        # region's only once shards.locality_wait_seconds have passed since (see _claim_or_recover).
        self._home_found = time.monotonic()
        # The build this process loaded, taken now rather than at the first engine start, so
        # source changed on disk after the worker started is refused in its engine child.
        batchline_build()

    # --- the claim loop -------------------------------------------------------

    def run(self) -> int:
        url = self.store.url
        self._drainer = drain_beside(lambda: open_store(url, create=False), self.lineage, version=self.version)
        try:
            return self._loop()
        finally:
            if self._engine is not None:
                self._engine.close()
            for job in self._jobs.values():
                for provider in job.providers.values():
                    provider.close()
            if self._drainer is not None:
                self._drainer.close(DRAIN_AT_EXIT_SECONDS)

    def _transitioned(self) -> None:
        """A claim or a shard's end may have started, completed or failed the run: send it."""
        if self._drainer is not None:
            self._drainer.kick()

    @property
    def region(self) -> str | None:
        return self.handle.regions.region

    def _loop(self) -> int:
        if self.version is not None and self.store.job(self.version) is None:
            # Not "no work left" (0): a Job that exits 0 shows Complete, having done nothing.
            raise NoSuchVersion(self.version, self.store.where())
        if self.version is not None:
            self._job(self.version)  # a region the version does not know is refused before any claim
        while True:
            self._leave_halted()
            if self.stop.is_set():
                return EXIT_PREEMPTED if self.store.has_open_shards(self.version, self.routes) else EXIT_DONE
            try:
                lease = self._claim()
            except SourceUnavailable as exc:
                # The weights' store cannot be read now; no shard is held.
                self.log(f"stopping: {exc}")
                return EXIT_PREEMPTED
            if lease is None:
                if self.stop.is_set():
                    continue
                if not self.store.has_open_shards(self.version, self.routes):
                    halt = self.store.halt_of(self.version) if self.version is not None else None
                    if halt is not None:
                        raise VersionHalted(halt.message(self.version or ""))
                    self.log("no work left")
                    return EXIT_DONE
                # Shards are leased by others; wait for them to finish or for a lease to expire.
                self.stop.wait(self.poll_seconds)
                continue
            self.log(f"claimed shard {lease.shard_no} of {lease.version} (epoch {lease.epoch})"
                     + (f", route {lease.route}" if lease.route != LOCAL_ROUTE else ""))
            self._transitioned()
            try:
                outcome = self._run_shard(lease)
            except SourceUnavailable as exc:
                # Nothing is wrong with the shard or the input: another worker (or this
                # one, restarted later) reads it once the store answers again.
                self._give_back(lease, "input_unavailable", str(exc))
                self.log(f"shard {lease.shard_no}: given back, its input cannot be read now: {exc}")
                return EXIT_PREEMPTED
            except InputError as exc:
                self._give_back(lease, INPUT_CHANGED, str(exc))
                self._transitioned()
                raise
            except EngineFatal as exc:
                self._give_back(lease, "engine_fatal", str(exc))
                raise
            except OutputUnwritable as exc:
                # Its results are stored: the worker that completes it once the prefix is writable
                # only writes the file.
                self._give_back(lease, "output_unwritable", str(exc))
                raise
            self.log(f"shard {lease.shard_no}: {outcome}")
            self._transitioned()
            if outcome == "stopped" and self.handle.halted is None:
                return EXIT_PREEMPTED

    def _leave_halted(self) -> None:
        """A worker of one version exits when it is halted (no replacement would get past it);
        a worker of every version leaves it and goes on with the others."""
        if self.handle.halted is None:
            return
        version, halt = self.handle.halted
        if self.version is not None:
            raise VersionHalted(halt.message(version))
        self.handle.halted = None
        self.log(f"leaving {version}: it is halted")

    def _run_shard(self, lease: Lease) -> str:
        job = self._job(lease.version)
        ctx = ShardContext(self.handle, lease, job)
        if lease.route == LOCAL_ROUTE:
            assert self._engine is not None
            return LocalShardRun(ctx, self._engine, self.restart_engine).run()
        assert job.spec.routing is not None
        return HostedShardRun(ctx, self._provider(job, lease.route), job.spec.routing.provider(lease.route),
                              self.announce_retention).run()

    def _provider(self, job: JobContext, route: str) -> BatchProvider:
        """The route's client, opened before any of its shards is claimed: a worker
        without the route's key takes none of them."""
        if route not in job.providers:
            from batchline.providers import open_provider
            from batchline.providers.base import ProviderError

            assert job.spec.routing is not None
            try:
                job.providers[route] = open_provider(job.spec.routing.provider(route), job.spec.decoding,
                                                     job.spec.output_schema, job.spec.name)
            except ProviderError as exc:
                hint = "" if self.routes is not None else (
                    f"; a worker that is not to call providers takes --routes {LOCAL_ROUTE}")
                raise EngineFatal(f"{exc}{hint}") from None
        return job.providers[route]

    def _allowed(self, route: str) -> bool:
        return self.routes is None or route in self.routes

    def _claim(self) -> Lease | None:
        """Claims a shard of the first version with open work. A hosted route's shard
        needs no engine; for a local one the engine is loaded first: a model that fails
        to load or to match its digest takes no shard, and a shard's lease is never
        spent waiting for weights to load."""
        versions = [self.version] if self.version else self.store.open_versions()
        for version in versions:
            if not self.store.has_open_shards(version, self.routes):
                continue
            job = self._job(version)
            hosted = [r for r in job.hosted_routes if self._allowed(r)]
            if hosted and self.store.has_open_shards(version, hosted):
                try:
                    for route in hosted:
                        self._provider(job, route)
                except EngineFatal as exc:
                    self.store.log_event("engine_fatal", version=version, worker=self.worker_id,
                                         detail={"error": str(exc)})
                    raise
                lease = self._claim_or_recover(version, hosted, split=False)
                if lease is not None:
                    return lease
            if not self._allowed(LOCAL_ROUTE) or (
                    job.spec.routing is not None and not self.store.has_open_shards(version, [LOCAL_ROUTE])):
                if self._engine is not None and self._engine_version == version:
                    # Only batches at a provider are left: the GPU is not held while they are polled.
                    self._engine.close()
                    self._engine = None
                continue
            try:
                self._ensure_engine(version, job)
            except EngineFatal as exc:
                self.store.log_event("engine_fatal", version=version, worker=self.worker_id,
                                     detail={"error": str(exc)})
                raise
            except EngineStopped:
                return None
            lease = self._claim_or_recover(version, [LOCAL_ROUTE] if job.spec.routing else None,
                                           split=job.spec.shards.tail_split)
            if lease is not None:
                return lease
        return None

    def _claim_or_recover(self, version: str, routes: list[str] | None, *, split: bool) -> Lease | None:
        """A claim; with nothing to claim, leases of owners proven dead are taken back and,
        for the local route, the longest unstarted tail of a leased shard is split off, so
        this worker works instead of idling until a lease runs out or a slow owner ends."""
        wait = self._job(version).spec.shards.locality_wait_seconds
        for attempt in range(3):
            # Per worker, from its own last claim at home (not the fleet's): a wait longer than a
            # shard's work cannot keep an idle worker from another region's shards for longer
            # than the wait, however often its region's other workers find work at home.
            foreign = time.monotonic() - self._home_found >= wait
            lease = self.store.claim(self.worker_id, version, routes, process=self.identity, region=self.region,
                                     foreign=foreign)
            if lease is not None:
                if lease.home is None or lease.home == self.region:
                    self._home_found = time.monotonic()
                elif self.region is not None:
                    self.log(f"shard {lease.shard_no} lives in {lease.home}: no shard of {self.region} was ready "
                             f"for {wait:g} s")
                self.telemetry.claimed(version)
                self.on_claim(version)
                return lease
            if attempt == 0:
                taken = take_back_dead(self.store, version, self.worker_id, lookup=self.pod_lookup)
                if taken:
                    self.log(f"took back {taken} leases of workers proven dead")
                    self.telemetry.taken_back(taken)
                    continue
            if not split or self.store.split(version, self.worker_id) is None:
                return None
            self.log(f"split the unstarted tail of a slow shard of {version} off to work on it")
        return None

    def announce_retention(self, version: str, spec: ProviderSpec) -> None:
        """Says what the provider keeps, once per worker and route, before the first record goes."""
        if (version, spec.route) in self._announced:
            return
        self._announced.add((version, spec.route))
        self.log(f"route {spec.route}: sending records of classes {', '.join(spec.classes)} to {spec.api} "
                 f"({spec.model}); data retention there: {spec.retention}")
        self.store.log_event("provider_notice", version=version, worker=self.worker_id,
                             detail={"route": spec.route, "api": spec.api, "model": spec.model,
                                     "retention": spec.retention})

    def _give_back(self, lease: Lease, reason: str, error: str) -> None:
        self.store.log_event(reason, version=lease.version, worker=self.worker_id, shard_no=lease.shard_no,
                             epoch=lease.epoch, detail={"error": error})
        self.store.release(lease, reason, error)

    def _job(self, version: str) -> JobContext:
        if version not in self._jobs:
            info = self.store.job(version)
            assert info is not None
            spec = stored_spec(info)
            if self.region is not None:
                spec.input.regions.check_worker(self.region, tuple(self.store.replicas(version)))
            self._jobs[version] = JobContext.of(spec)
        return self._jobs[version]

    def _ensure_engine(self, version: str, job: JobContext) -> EngineProcess:
        if self._engine is not None and self._engine_version == version and self._engine.exit_code is None:
            return self._engine
        if self._engine is not None:
            self._engine.close()
        self._engine = EngineProcess(job.engine_init(), LOAD_TIMEOUT_SECONDS)
        self._engine_version = version
        self._engine.start(self.stop)
        self._check_runtime()
        return self._engine

    def _check_runtime(self) -> None:
        """The version keeps the engine runtime its first worker loaded (I2): a worker whose
        engine is another build refuses it before it computes anything."""
        assert self._engine is not None and self._engine_version is not None
        runtime = self._engine.runtime
        if runtime is None:
            return
        pinned, by = self.store.pin_runtime(self._engine_version, runtime, self.worker_id)
        if pinned != runtime:
            self._engine.close()
            self._engine = None
            raise EngineFatal(f"version {self._engine_version} is computed with the engine runtime {pinned} "
                              f"(first loaded by worker {by}), and this worker's engine is {runtime}: run its "
                              f"workers where {pinned} is installed")

    def restart_engine(self) -> EngineProcess:
        assert self._engine is not None
        self._engine.kill()
        self._engine.start()
        self._check_runtime()  # the packages may have changed on disk since the last start
        assert self._engine is not None
        return self._engine
