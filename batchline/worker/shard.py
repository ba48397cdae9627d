"""What a shard run holds, whichever route it is on: the job it belongs to, and
the lease with the fenced writes made under it.

The local run (`local.py`, records through the engine child) and the hosted
run (`hosted.py`, records through a provider's batch) both write through one
`ShardContext`: renewal, charging an attempt, results, dead letters and the
shard's end, each reported to the worker's telemetry the same way.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, TypeVar

from batchline.check.outputs import OutputChecker
from batchline.errors import BatchlineError, OutputUnwritable, one_line
from batchline.prompts.examples import ExampleIndex
from batchline.prompts.render import render, split_template
from batchline.providers.base import BatchProvider
from batchline.registry import ENGINES
from batchline.snapshot import Record, Slice, StoredReader, read_slice
from batchline.spec import JobSpec
from batchline.store import (
    ChargeResult,
    DeadLetterRow,
    Halt,
    Lease,
    LeaseLost,
    ResultRow,
    VersionClosed,
    WorkerStore,
)
from batchline.worker.regions import RegionReader
from batchline.worker.telemetry import WorkerTelemetry

T = TypeVar("T")

# How often, at most, a worker that wrote dead letters asks the store whether they pass the
# version's bound: a broken job stops within seconds, and a fleet's questions are few
# (one read of the version's shard counters each).
JUDGE_SECONDS = 1.0


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

    @classmethod
    def of(cls, spec: JobSpec) -> JobContext:
        """A version's context, from its stored spec: what its engine child is started with."""
        prefix, suffix = split_template(spec.prompt.text)
        init = {
            "model": {"engine": spec.model.engine, "path": spec.model.path, "digest": spec.model.digest,
                      "options": dict(spec.model.options)},
            "decoding": spec.decoding.to_dict(),
            "schema": dict(spec.output_schema),
            "max_input_tokens": spec.input.max_input_tokens,
            "work_dir": os.getcwd(),
        }
        return cls(spec, OutputChecker(spec.output_schema), prefix, suffix, init, model=spec.model.label)

    def engine_init(self) -> dict[str, Any]:
        """The engine child's init, with weights in object storage replaced by this node's
        verified copy of them (fetched once per node, before any shard is claimed)."""
        from batchline.worker.weights import local_weights

        model = self.init["model"]
        path = local_weights(model["path"], model["digest"], self.spec.input.storage)
        return self.init if path == model["path"] else {**self.init, "model": {**model, "path": path}}

    def request(self, r: Record) -> dict[str, Any]:
        """What the engine child is sent for one record."""
        if r.messages is not None:
            # Only the child has the model's chat template; it renders the prompt.
            return {"id": r.id, "prompt": "", "prefix": "", "text": r.text, "messages": list(r.messages)}
        return {"id": r.id, "prompt": self.prompt(r.id, r.text), "prefix": self.prefix, "text": r.text}

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
    # The version this worker was on, and why, once the store holds it halted: the run
    # stops as on a preemption notice (I5) and the worker exits with VersionHalted.
    halted: tuple[str, Halt] | None = None
    judge_pending: bool = False  # dead letters written since the store was last asked
    judged_at: float = float("-inf")
    regions: RegionReader = field(default_factory=lambda: RegionReader(None))


class ShardContext:
    """A leased shard's fenced writes. Each raises LeaseLost once the lease is not current."""

    def __init__(self, worker: WorkerHandle, lease: Lease, job: JobContext) -> None:
        self.worker = worker
        self.store = worker.store
        self.lease = lease
        self.job = job
        self.max_attempts = job.spec.shards.max_attempts
        self.renew_seconds = job.spec.shards.renew_seconds
        # Only a version planned with a dead-letter bound can be halted: the others ask nothing.
        self.bounded = job.spec.shards.abort_bound is not None
        self.last_renew = time.monotonic()

    @property
    def stopping(self) -> bool:
        return self.worker.stop.is_set() or self.worker.halted is not None

    @property
    def stop_reason(self) -> str:
        """Why a stopping run gives its lease back, as the release event records it."""
        return "halted" if self.worker.halted is not None else "stop"

    def judge_if_due(self, *, force: bool = False) -> None:
        """Asks the store whether the version's dead letters pass its bound (which halts it),
        when this worker wrote some since it last asked and JUDGE_SECONDS have passed."""
        worker = self.worker
        now = time.monotonic()
        if not self.bounded or not worker.judge_pending or worker.halted is not None or (
                not force and now - worker.judged_at < JUDGE_SECONDS):
            return
        worker.judge_pending, worker.judged_at = False, now
        halt = self.store.judge_dead_letters(self.lease.version, worker.worker_id)
        if halt is not None:
            self._halted(halt)

    def _halted(self, halt: Halt) -> None:
        self.worker.halted = (self.lease.version, halt)
        self.log(f"{halt.message(self.lease.version)}; stopping as on a preemption notice")

    def _dead_lettered(self) -> None:
        self.worker.judge_pending = True
        self.judge_if_due()

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
        spec, stored = self.job.spec, self.stored_reader()
        return self.worker.regions.read(self.store, self.lease.version, spec, sl,
                                        lambda at: read_slice(at, spec.input, spec.routing, stored))

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
        # Another worker may have halted the version: its workers learn it within a renewal.
        if self.bounded and self.worker.halted is None:
            halt = self.store.halt_of(self.lease.version)
            if halt is not None:
                self._halted(halt)
        self.judge_if_due()

    def renew_now(self, started: int | None = None) -> None:
        self.last_renew = float("-inf")
        self.renew_if_due(time.monotonic(), started)

    def renew_soon(self) -> None:
        """The next renew_if_due renews at once (after a pause as long as an engine restart)."""
        self.last_renew = 0.0

    def stored_reader(self) -> StoredReader:
        """Where the store holds the input (a job over a published job), how this shard's
        records are read: from the version's own records, which planning copied there."""
        version = self.lease.version
        return lambda start, end: self.store.input_records(version, start, end)

    def charge(self, record: Record, kind: str, error: str, *, max_attempts: int | None = None) -> ChargeResult:
        """Charges the record an attempt (none if it was answered meanwhile, or split off to
        another shard: attempts 0). At `max_attempts` (the job's unless given) it becomes a
        dead letter."""
        outcome = self._unless_closed(
            lambda: self.store.charge_attempt(self.lease, record.id, kind, error, record.acl,
                                              max_attempts or self.max_attempts, record.piece),
            ChargeResult(attempts=0, dead_lettered=False))
        if outcome.attempts:
            self.worker.telemetry.outcome("dead_letter" if outcome.dead_lettered else "retry")
            if outcome.dead_lettered:
                self.log(f"record {record.id}: dead letter after {outcome.attempts} attempts ({kind})")
                self._dead_lettered()
        return outcome

    def _unless_closed(self, write: Callable[[], T], dropped: T) -> T:
        """`write()`, or `dropped` where the store refused it because the version halted while
        this lease was held: what was in flight is dropped uncharged (I5) and the run stops as on
        a preemption notice. A version closed otherwise (sealed, cancelled) ends the lease."""
        try:
            return write()
        except VersionClosed as exc:
            halt = self.store.halt_of(self.lease.version)
            if halt is None:
                raise LeaseLost.of(self.lease, exc.op) from None
            if self.worker.halted is None:
                self._halted(halt)
            return dropped

    def put(self, rows: Sequence[ResultRow]) -> int:
        new = self._unless_closed(lambda: self.store.put_results(self.lease, rows), 0)
        self.worker.telemetry.outcome("result", new)
        return new

    def dead_letter(self, rows: Sequence[DeadLetterRow], outcome: str = "dead_letter") -> int:
        n = self._unless_closed(lambda: self.store.dead_letter(self.lease, rows), 0)
        self.worker.telemetry.outcome(outcome, n)
        if n:
            self._dead_lettered()
        return n

    def complete(self) -> None:
        self.store.complete(self.lease, self.shard_files())

    def shard_files(self) -> dict[str, Any] | None:
        """For each target that takes its files from the workers (files: per-shard), the file of
        what this worker computed of its shard, read back from the store under the lease: written
        before the completion that records it, so a file whose completion is refused (a stale
        owner's) is never used."""
        spec = self.job.spec
        writers = [t for t in spec.targets if t.shard_files() is not None]
        if not writers:
            return None
        results, dead = self.store.shard_outcomes(self.lease.version, self.lease.shard_no, computed_only=True)
        files = {}
        for t in writers:
            try:
                files[t.target(None, spec.input.storage).key] = t.write_shard_file(
                    spec, self.lease.version, self.lease.shard_no, self.lease.epoch, results, dead, spec.input.storage,
                    self.worker.regions.region)
            except (OSError, BatchlineError) as exc:
                raise OutputUnwritable(f"cannot write the file of shard {self.lease.shard_no} of {self.lease.version} "
                                       f"under {t.shard_files()}: {one_line(exc)}") from None
        return files

    def release(self, reason: str) -> bool:
        return self.store.release(self.lease, reason)

    def lost(self, exc: LeaseLost) -> None:
        self.log(str(exc))
        self.worker.telemetry.stale_epoch(exc.op)
