"""What a shard run holds, whichever route it is on: the job it belongs to, and
the lease with the fenced writes made under it.

The local run (`local.py`, records through the engine child) and the hosted
run (`hosted.py`, records through a provider's batch) both write through one
`ShardContext`: renewal, charging an attempt, results, dead letters and the
shard's end, each reported to the worker's telemetry the same way.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from batchline.check.outputs import OutputChecker
from batchline.prompts.examples import ExampleIndex
from batchline.prompts.render import render
from batchline.providers.base import BatchProvider
from batchline.registry import ENGINES
from batchline.snapshot import Record, Slice, read_slice
from batchline.spec import JobSpec
from batchline.store import ChargeResult, DeadLetterRow, Lease, LeaseLost, ResultRow, WorkerStore
from batchline.worker.telemetry import WorkerTelemetry


@dataclass
class JobContext:
    """A job version as a worker runs it: its spec, its output checker and prompt halves."""

    spec: JobSpec
    checker: OutputChecker
    prefix: str
    suffix: str
    init: dict[str, Any] = field(default_factory=dict)  # what the engine child is started with
    model: str = ""  # how results of the local engine name the model that answered
    providers: dict[str, BatchProvider] = field(default_factory=dict)

    @cached_property
    def _examples(self) -> ExampleIndex | None:
        examples = self.spec.prompt.examples
        return ExampleIndex(examples.items, examples.k, examples.max_chars) if examples else None

    def prompt(self, record_id: str, text: str) -> str:
        """A record's whole prompt: the shared prefix, its nearest examples where the job
        retrieves some, the record."""
        shown = self._examples.render(record_id, text, self.spec.label_field or "") if self._examples else ""
        return render(self.prefix, self.suffix, text, shown)

    @property
    def retry_cannot_help_truncation(self) -> bool:
        """A generation cut off at max_tokens comes out the same on every attempt."""
        return self.spec.decoding.temperature == 0 and ENGINES[self.spec.model.engine].deterministic

    @property
    def hosted_routes(self) -> list[str]:
        return [p.route for p in self.spec.routing.providers] if self.spec.routing else []

    def label(self, canonical: str) -> str | None:
        """The output's label field, kept as its own column for drift and counts."""
        field_name = self.spec.label_field
        if field_name is None:
            return None
        value = json.loads(canonical)
        if not isinstance(value, dict) or value.get(field_name) is None:
            return None
        label = value[field_name]
        return label if isinstance(label, str) else json.dumps(label)


@dataclass
class WorkerHandle:
    """The parts of the worker a shard run reports to."""

    store: WorkerStore
    worker_id: str
    stop: threading.Event
    telemetry: WorkerTelemetry
    log: Callable[[str], None]


class ShardContext:
    """A leased shard's fenced writes. Each raises LeaseLost once the lease is not current."""

    def __init__(self, worker: WorkerHandle, lease: Lease, job: JobContext) -> None:
        self.worker = worker
        self.store = worker.store
        self.lease = lease
        self.job = job
        self.max_attempts = job.spec.shards.max_attempts
        self.renew_seconds = job.spec.shards.renew_seconds
        self.last_renew = time.monotonic()

    @property
    def stopping(self) -> bool:
        return self.worker.stop.is_set()

    def log(self, message: str) -> None:
        self.worker.log(message)

    def event(self, kind: str, detail: dict[str, Any]) -> None:
        self.store.log_event(kind, version=self.lease.version, worker=self.worker.worker_id,
                             shard_no=self.lease.shard_no, epoch=self.lease.epoch, detail=detail)

    def records(self) -> list[Record]:
        """The records of the pieces the lease holds, read from the input. A shard whose
        tail was split off keeps its planned slice, and the split-off pieces belong to
        another shard: they are not read here, so nothing of them is computed twice."""
        sl = Slice.from_json(self.lease.slice)
        if sl.pieces:
            held = tuple(p for p in sl.pieces if self.lease.holds(p.no))
            if not held:
                return []
            sl = replace(sl, pieces=held)
        return read_slice(sl, self.job.spec.input, self.job.spec.routing)

    def renew_if_due(self, now: float | None = None, started: int | None = None) -> None:
        """Renews once renew_seconds have passed; `started`: every piece before it has been
        started (where a split of the tail may begin). The lease may come back shorter."""
        now = time.monotonic() if now is None else now
        if now - self.last_renew < self.renew_seconds:
            return
        renewed = self.store.renew(self.lease, started)
        self.worker.telemetry.renewed(renewed is not None)
        if renewed is None:
            raise LeaseLost.of(self.lease, "renew")
        self.lease = renewed
        self.last_renew = now

    def renew_now(self, started: int | None = None) -> None:
        self.last_renew = float("-inf")
        self.renew_if_due(time.monotonic(), started)

    def renew_soon(self) -> None:
        """The next renew_if_due renews at once (after a pause as long as an engine restart)."""
        self.last_renew = 0.0

    def charge(self, record: Record, kind: str, error: str, *, max_attempts: int | None = None) -> ChargeResult:
        """Charges the record an attempt (none if it was answered meanwhile, or split off to
        another shard: attempts 0). At `max_attempts` (the job's unless given) it becomes a
        dead letter."""
        outcome = self.store.charge_attempt(self.lease, record.id, kind, error, record.acl,
                                            max_attempts or self.max_attempts, record.piece)
        if outcome.attempts:
            self.worker.telemetry.outcome("dead_letter" if outcome.dead_lettered else "retry")
            if outcome.dead_lettered:
                self.log(f"record {record.id}: dead letter after {outcome.attempts} attempts ({kind})")
        return outcome

    def put(self, rows: Sequence[ResultRow]) -> int:
        new = self.store.put_results(self.lease, rows)
        self.worker.telemetry.outcome("result", new)
        return new

    def dead_letter(self, rows: Sequence[DeadLetterRow], outcome: str = "dead_letter") -> int:
        n = self.store.dead_letter(self.lease, rows)
        self.worker.telemetry.outcome(outcome, n)
        return n

    def complete(self) -> None:
        self.store.complete(self.lease)

    def release(self, reason: str) -> bool:
        return self.store.release(self.lease, reason)

    def lost(self, exc: LeaseLost) -> None:
        self.log(str(exc))
        self.worker.telemetry.stale_epoch(exc.op)
