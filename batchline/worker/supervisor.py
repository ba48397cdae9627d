"""The worker's supervisor loop.

It owns the store connection and the lease; the engine runs in a child
process. Records stream to the child and outcomes back; results are written
as they complete, in bounded batches, fenced by the lease's epoch. When the
child crashes or misses a batch's deadline, the records in flight are bisected
in fresh children until the one that fails alone is found, and only it is
charged an attempt (I4). When the supervisor is asked to stop (SIGTERM,
SIGINT, a preemption notice) it stops taking records, finishes what is in
flight within the grace period, writes it, and gives the lease back (I5).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from batchline.errors import EngineFatal, InputError
from batchline.outputs import OutputChecker
from batchline.prompt import render, split_template
from batchline.providers.base import BatchProvider
from batchline.snapshot import Record, Slice, read_slice
from batchline.spec import LOCAL_ROUTE, JobSpec, ProviderSpec, spec_from_store
from batchline.store import DeadLetterRow, Lease, LeaseLost, ResultRow, Store
from batchline.telemetry import WorkerTelemetry
from batchline.worker.engine_process import EngineProcess, EngineStopped

EXIT_DONE = 0
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped early with work left; start another
EXIT_INPUT = 3
EXIT_ENGINE = 5

FLUSH_ROWS = 500
FLUSH_SECONDS = 0.25
LOAD_TIMEOUT_SECONDS = 900.0


def new_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


@dataclass
class _Group:
    """Records sent to the child together, with the deadline the batch must meet."""

    remaining: dict[str, Record]
    deadline: float
    isolated: bool
    sent: float = 0.0
    size: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    budget: float = 0.0  # batch_timeout + n * record_timeout: how long the engine may take on it


@dataclass
class _Job:
    spec: JobSpec
    checker: OutputChecker
    prefix: str
    suffix: str
    init: dict[str, Any] = field(default_factory=dict)
    model: str = ""  # how results of the local engine name the model that answered
    providers: dict[str, BatchProvider] = field(default_factory=dict)

    @property
    def hosted_routes(self) -> list[str]:
        return [p.route for p in self.spec.routing.providers] if self.spec.routing else []


class Worker:
    def __init__(self, store: Store, *, version: str | None = None, worker_id: str | None = None,
                 stop: threading.Event | None = None, poll_seconds: float = 1.0,
                 log: Callable[[str], None] = lambda _m: None,
                 telemetry: WorkerTelemetry | None = None, routes: Sequence[str] | None = None) -> None:
        self.store = store
        self.routes = list(routes) if routes is not None else None  # None: every route of the job
        self.telemetry = telemetry or WorkerTelemetry()
        self.version = version
        self.worker_id = worker_id or new_worker_id()
        self.stop = stop or threading.Event()
        self.poll_seconds = poll_seconds
        self.log = log
        self._jobs: dict[str, _Job] = {}
        self._engine: EngineProcess | None = None
        self._engine_version: str | None = None
        self._announced: set[tuple[str, str]] = set()

    # --- the claim loop -------------------------------------------------------

    def run(self) -> int:
        try:
            return self._loop()
        finally:
            if self._engine is not None:
                self._engine.close()
            for job in self._jobs.values():
                for provider in job.providers.values():
                    provider.close()

    def _loop(self) -> int:
        while True:
            if self.stop.is_set():
                return EXIT_PREEMPTED if self.store.has_open_shards(self.version, self.routes) else EXIT_DONE
            lease = self._claim()
            if lease is None:
                if self.stop.is_set():
                    continue
                if not self.store.has_open_shards(self.version, self.routes):
                    self.log("no work left")
                    return EXIT_DONE
                # Shards are leased by others; wait for them to finish or for a lease to expire.
                self.stop.wait(self.poll_seconds)
                continue
            self.log(f"claimed shard {lease.shard_no} of {lease.version} (epoch {lease.epoch})"
                     + (f", route {lease.route}" if lease.route != LOCAL_ROUTE else ""))
            try:
                outcome = self._run_shard(lease)
            except InputError as exc:
                self._give_back(lease, "input_changed", str(exc))
                raise
            except EngineFatal as exc:
                self._give_back(lease, "engine_fatal", str(exc))
                raise
            self.log(f"shard {lease.shard_no}: {outcome}")
            if outcome == "stopped":
                return EXIT_PREEMPTED

    def _run_shard(self, lease: Lease) -> str:
        job = self._job(lease.version)
        if lease.route == LOCAL_ROUTE:
            return _ShardRun(self, lease, job).run()
        from batchline.worker.hosted import HostedShardRun

        assert job.spec.routing is not None
        return HostedShardRun(self, lease, job, self._provider(job, lease.route),
                              job.spec.routing.provider(lease.route)).run()

    def _provider(self, job: _Job, route: str) -> BatchProvider:
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
                lease = self.store.claim(self.worker_id, version, hosted)
                if lease is not None:
                    self.telemetry.claimed(version)
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
            lease = self.store.claim(self.worker_id, version, [LOCAL_ROUTE] if job.spec.routing else None)
            if lease is not None:
                self.telemetry.claimed(version)
                return lease
        return None

    def lease_lost(self, exc: LeaseLost) -> None:
        self.log(str(exc))
        self.telemetry.stale_epoch(exc.op)

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

    def label(self, job: _Job, canonical: str) -> str | None:
        field_name = job.spec.label_field
        if field_name is None:
            return None
        value = json.loads(canonical)
        if not isinstance(value, dict) or value.get(field_name) is None:
            return None
        label = value[field_name]
        return label if isinstance(label, str) else json.dumps(label)

    def _give_back(self, lease: Lease, reason: str, error: str) -> None:
        self.store.log_event(reason, version=lease.version, worker=self.worker_id, shard_no=lease.shard_no,
                             epoch=lease.epoch, detail={"error": error})
        self.store.release(lease, reason)

    def _job(self, version: str) -> _Job:
        if version not in self._jobs:
            info = self.store.job(version)
            assert info is not None
            spec = spec_from_store(info.spec)
            prefix, suffix = split_template(spec.prompt.text)
            init = {
                "model": {"engine": spec.model.engine, "path": spec.model.path, "digest": spec.model.digest,
                          "options": dict(spec.model.options)},
                "decoding": dict(spec.decoding.__dict__),
                "schema": dict(spec.output_schema),
                "max_input_tokens": spec.input.max_input_tokens,
                "work_dir": os.getcwd(),
            }
            self._jobs[version] = _Job(spec, OutputChecker(spec.output_schema), prefix, suffix, init,
                                       model=spec.model.label)
        return self._jobs[version]

    def _ensure_engine(self, version: str, job: _Job) -> EngineProcess:
        if self._engine is not None and self._engine_version == version and self._engine.exit_code is None:
            return self._engine
        if self._engine is not None:
            self._engine.close()
        self._engine = EngineProcess(job.init, LOAD_TIMEOUT_SECONDS)
        self._engine_version = version
        self._engine.start(self.stop)
        return self._engine

    def restart_engine(self) -> EngineProcess:
        assert self._engine is not None
        self._engine.kill()
        self._engine.start()
        return self._engine


class _ShardRun:
    def __init__(self, worker: Worker, lease: Lease, job: _Job) -> None:
        self.w = worker
        self.store = worker.store
        self.lease = lease
        self.job = job
        self.shards = job.spec.shards
        assert worker._engine is not None
        self.engine = worker._engine
        self.pending: deque[Record] = deque()
        self.isolation: deque[list[Record]] = deque()
        self.groups: list[_Group] = []
        self.attempts: dict[str, int] = {}
        self.results: list[ResultRow] = []
        self.too_long: list[DeadLetterRow] = []
        self.buffer_since = 0.0
        self.last_renew = time.monotonic()

    # -- the shard loop --

    def run(self) -> str:
        try:
            return self._run()
        except LeaseLost as exc:
            self.w.lease_lost(exc)
            if self._in_flight():
                self.w.restart_engine()  # its records belong to a shard we no longer hold
            return "lost"
        except EngineFatal:
            with contextlib.suppress(LeaseLost):
                self._flush(force=True)  # what was computed before the engine died is good
            raise

    def _run(self) -> str:
        records = read_slice(Slice.from_json(self.lease.slice), self.job.spec.input, self.job.spec.routing)
        ids = [r.id for r in records]
        answered = self.store.answered(self.lease.version, ids)
        self.attempts = self.store.attempts(self.lease.version, ids)
        self.pending.extend(r for r in records if r.id not in answered)
        stop_at: float | None = None
        while True:
            now = time.monotonic()
            if self.w.stop.is_set() and stop_at is None:
                stop_at = now + self.shards.grace_seconds
                self.w.log(f"stopping: finishing {self._in_flight()} records in flight "
                           f"(grace {self.shards.grace_seconds:.0f}s)")
            if stop_at is not None and (not self.groups or now >= stop_at):
                return self._stop()
            if stop_at is None:
                self._fill(now)
            if not self.groups and not self.pending and not self.isolation:
                break
            msg = self.engine.get(self._wait_seconds(now))
            if msg is not None:
                if msg["op"] == "out":
                    self._outcome(msg)
                elif msg["op"] == "fatal":
                    # The engine says it cannot go on (CUDA error, server gone): no record is to blame.
                    raise EngineFatal(msg["error"])
                elif msg["op"] == "eof":
                    self._failure("crash", None)
            now = time.monotonic()
            if self.groups and self.groups[0].deadline <= now:
                self._failure("hang", None)
            self._flush(force=False)
            self._renew(now)
        self._flush(force=True)
        self.store.complete(self.lease)
        return "done"

    def _stop(self) -> str:
        self._flush(force=True)
        if self.groups:
            # Unfinished records are lost, not charged. The worker is stopping, so no
            # new engine is started: the GPU is free as soon as this child is gone.
            self.engine.kill()
            self.groups.clear()
        if not self.pending and not self.isolation:
            self.store.complete(self.lease)
            return "done-then-stopped"
        self.store.release(self.lease, "stop")
        return "stopped"

    def _in_flight(self) -> int:
        return sum(len(g.remaining) for g in self.groups)

    def _wait_seconds(self, now: float) -> float:
        waits = [0.5, self.last_renew + self.shards.renew_seconds - now]
        if self.groups:
            waits.append(self.groups[0].deadline - now)
        if self.results or self.too_long:
            waits.append(self.buffer_since + FLUSH_SECONDS - now)
        return max(0.0, min(waits))

    # -- sending --

    def _fill(self, now: float) -> None:
        if any(g.isolated for g in self.groups):
            return
        if self.isolation:
            if not self.groups:
                self._send(self.isolation.popleft(), isolated=True, now=now)
            return
        size = self.shards.batch_size
        # Two batches in flight keep a streaming engine busy while the next is queued.
        while self.pending and self._in_flight() < 2 * size:
            batch = [self.pending.popleft() for _ in range(min(size, len(self.pending)))]
            self._send(batch, isolated=False, now=now)

    def _send(self, records: list[Record], *, isolated: bool, now: float) -> None:
        budget = self.shards.batch_timeout_seconds + len(records) * self.shards.record_timeout_seconds
        start = max([now] + [g.deadline for g in self.groups])
        self.groups.append(_Group({r.id: r for r in records}, start + budget, isolated, now, len(records),
                                  budget=budget))
        self.w.telemetry.in_flight(self._in_flight())
        self.engine.send([self._request(r) for r in records])

    def _request(self, r: Record) -> dict[str, Any]:
        if r.messages is not None:
            # Only the child has the model's chat template; it renders the prompt.
            return {"id": r.id, "prompt": "", "prefix": "", "text": r.text, "messages": list(r.messages)}
        return {"id": r.id, "prompt": render(self.job.prefix, self.job.suffix, r.text),
                "prefix": self.job.prefix, "text": r.text}

    # -- receiving --

    def _take(self, msg: dict[str, Any]) -> Record | None:
        for i, g in enumerate(self.groups):
            record = g.remaining.pop(msg["id"], None)
            if record is not None:
                g.input_tokens += msg.get("in") or 0
                g.output_tokens += msg.get("outt") or 0
                if not g.remaining:
                    del self.groups[i]
                    self.w.telemetry.engine_batch(g.size, time.monotonic() - g.sent, g.input_tokens,
                                                  g.output_tokens)
                    if i == 0 and self.groups:
                        # A queued batch's clock starts when the one ahead of it is done, not at
                        # that one's deadline: stacked deadlines would grow by a whole budget per
                        # batch sent, and a hang late in a shard would go unseen for minutes.
                        head = self.groups[0]
                        head.deadline = min(head.deadline, time.monotonic() + head.budget)
                self.w.telemetry.in_flight(self._in_flight())
                return record
        return None

    def _outcome(self, msg: dict[str, Any]) -> None:
        record = self._take(msg)
        if record is None:
            return  # an answer from a batch already given up on
        if msg.get("kind") == "too_long":
            self.w.telemetry.outcome("too_long")
            self._buffer_dead(DeadLetterRow(record.id, "too_long", msg["error"], record.acl,
                                            self.attempts.get(record.id, 0)))
        elif msg.get("error"):
            self._charge(record, msg.get("kind") or "engine_error", msg["error"])
        else:
            canonical, problem = self.job.checker.check(msg["output"])
            if canonical is None:
                self._charge(record, "invalid_output", problem or "invalid output")
            else:
                self.w.telemetry.outcome("result")
                self._buffer(ResultRow(record.id, canonical, record.acl, self.attempts.get(record.id, 0) + 1,
                                       msg.get("in"), msg.get("outt"), self.w.label(self.job, canonical),
                                       self.job.model))

    def _buffer(self, row: ResultRow) -> None:
        if not self.results and not self.too_long:
            self.buffer_since = time.monotonic()
        self.results.append(row)

    def _buffer_dead(self, row: DeadLetterRow) -> None:
        if not self.results and not self.too_long:
            self.buffer_since = time.monotonic()
        self.too_long.append(row)

    def _charge(self, record: Record, kind: str, error: str) -> None:
        result = self.store.charge_attempt(self.lease, record.id, kind, error, record.acl,
                                           self.shards.max_attempts)
        if result.attempts == 0:
            return  # answered meanwhile
        self.attempts[record.id] = result.attempts
        self.w.telemetry.outcome("dead_letter" if result.dead_lettered else "retry")
        if result.dead_lettered:
            self.w.log(f"record {record.id}: dead letter after {result.attempts} attempts ({kind})")
        elif kind in ("crash", "hang"):
            self.isolation.appendleft([record])
        else:
            self.pending.append(record)

    def _failure(self, kind: str, detail: str | None) -> None:
        suspects = [r for g in self.groups for r in g.remaining.values()]
        self.groups.clear()
        self.w.telemetry.engine_failure(kind)
        code = self.engine.exit_code
        self.store.log_event(f"engine_{kind}", version=self.lease.version, worker=self.w.worker_id,
                             shard_no=self.lease.shard_no, epoch=self.lease.epoch,
                             detail={"in_flight": len(suspects), "exit_code": code, "error": detail})
        self.engine = self.w.restart_engine()
        self.last_renew = 0.0  # renew at once: the restart may have taken a while
        if len(suspects) == 1:
            what = (f"engine process died (exit status {code})" if kind == "crash"
                    else "engine gave no answer before the batch deadline")
            self._charge(suspects[0], kind, f"{what} with this record alone in flight"
                         + (f": {detail}" if detail else ""))
        elif suspects:
            half = len(suspects) // 2
            self.isolation.appendleft(suspects[half:])
            self.isolation.appendleft(suspects[:half])

    # -- writing --

    def _flush(self, *, force: bool) -> None:
        if not self.results and not self.too_long:
            return
        due = (len(self.results) + len(self.too_long) >= FLUSH_ROWS
               or time.monotonic() - self.buffer_since >= FLUSH_SECONDS)
        if not (force or due):
            return
        if self.results:
            self.store.put_results(self.lease, self.results)
            self.results = []
        if self.too_long:
            self.store.dead_letter(self.lease, self.too_long)
            self.too_long = []

    def _renew(self, now: float) -> None:
        if now - self.last_renew < self.shards.renew_seconds:
            return
        # Renewing only while the child keeps its deadlines: a hung engine lets the lease lapse.
        if self.groups and self.groups[0].deadline <= now:
            return
        renewed = self.store.renew(self.lease)
        self.w.telemetry.renewed(renewed is not None)
        if renewed is None:
            raise LeaseLost(f"lease on shard {self.lease.shard_no} of {self.lease.version} lost at renewal", "renew")
        self.lease = renewed
        self.last_renew = now
