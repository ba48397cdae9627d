"""The store's rules, written once for every backend.

Each operation of the ports (`batchline.store.ports`) is written here: what it
checks, which events it appends, what it refuses and with which words, and the
arithmetic of status, coverage and route totals. A backend
(`batchline.store.sqlite`, `batchline.store.postgres`) brings only its SQL (one
module of named statements, the same names in each) and its transactions:

- `_write(body, recover=...)` runs `body` in one write transaction. A backend
  that can lose a connection after a commit (PostgreSQL) retries, and first
  asks `recover` whether the lost try committed: every operation that is not
  idempotent carries a token that its events record (`_marks`).
- `_read(body, snapshot=...)` runs reads, in one snapshot when asked.
- A few steps whose SQL differs in shape, not in rule: the fenced insert of
  results and of dead letters, bulk planning of records, a version's own
  partitions, statistics before coverage, and the published view.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any, Protocol, TypeVar

import orjson

from batchline.errors import NoSuchVersion, PublicationMoved, StoreError
from batchline.store import lineage
from batchline.store.changes import VersionChanges
from batchline.store.files import ShardOutcomes
from batchline.store.lineage import LineageOutbox
from batchline.store.model import (
    WRITE_BATCH_ROWS,
    ChargeResult,
    Coverage,
    DeadLetterBound,
    DeadLetterRow,
    DuplicateRecord,
    Event,
    Halt,
    InputRecord,
    JobInfo,
    JobStatus,
    Lease,
    LeaseHolder,
    LeaseLost,
    PlannedRecord,
    PlannedShard,
    Publication,
    ResultRow,
    RouteTotals,
    ShardRow,
    StoredDeadLetter,
    StoredResult,
    ValidationRecord,
    rollback_target,
    within,
)
from batchline.store.paid import PaidSlots

T = TypeVar("T")
Row = Sequence[Any]


class _Pieced(Protocol):
    @property
    def piece(self) -> int | None: ...


P = TypeVar("P", bound=_Pieced)
Params = Mapping[str, Any]

SHARD_STATES = ("ready", "leased", "done", "submitted")


class Tx(Protocol):
    """One transaction's statements. Parameters are named (`:v` in SQLite's SQL,
    `%(v)s` in PostgreSQL's); the statement texts come from the backend's module."""

    def one(self, stmt: str, params: Params | None = None) -> Row | None: ...

    def all(self, stmt: str, params: Params | None = None) -> list[Row]: ...

    def run(self, stmt: str, params: Params | None = None) -> int:
        """Executes; returns the number of rows it changed."""
        ...

    def many(self, stmt: str, rows: Sequence[Params]) -> int:
        """Executes once per row; returns the number of rows changed in all."""
        ...


class Missing:
    """The outcome of an operation whose token is not in the event log: not applied."""


MISSING = Missing()


@dataclass(frozen=True)
class _Mark:
    """An event written by the operation whose token it carries."""

    kind: str
    version: str | None
    shard_no: int | None
    epoch: int | None
    detail: dict[str, Any]


@dataclass(frozen=True)
class _Lost:
    """A fenced operation refused (its stale_epoch event is committed); raised after the commit."""

    op: str


class DuplicateKey(Exception):
    """A backend's bulk insert of planned records met an id already planned."""


# --- the rules in words ------------------------------------------------------------------

def no_shard(version: str, shard_no: int) -> StoreError:
    return StoreError(f"no shard {shard_no} in {version}")


def unanswered(lease: Lease, missing: int) -> StoreError:
    return StoreError(f"shard {lease.shard_no} of {lease.version} has {missing} records without an outcome; "
                      f"not completing it")


def taken_over(version: str) -> StoreError:
    return StoreError(f"planning of {version} was taken over by another planner")


# --- row mapping, written once ----------------------------------------------------------

def acl_json(acl: Any) -> str | None:
    """ACLs are stored as canonical JSON text, so equal ACLs compare equal in SQL."""
    return None if acl is None else orjson.dumps(acl, option=orjson.OPT_SORT_KEYS).decode()


def input_columns(r: PlannedRecord) -> tuple[str | None, str | None, int]:
    """A planned record's text, ACL and position, as the records table holds them."""
    assert r.input is not None
    return r.input.text, acl_json(r.input.acl), r.input.position


def acl_value(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def stored_result(r: Row) -> StoredResult:
    return StoredResult(r[0], r[1], acl_value(r[2]), r[3], r[4], r[5], r[6], float(r[7]), r[8], r[9], r[10],
                        r[11], r[12], carry_value(r[15]) if len(r) > 15 else None,
                        origin_worker=r[13], origin_epoch=int(r[14]) if r[14] is not None else None)


def stored_dead_letter(r: Row) -> StoredDeadLetter:
    return StoredDeadLetter(r[0], r[1], r[2], r[3], acl_value(r[4]), r[5], r[6], float(r[7]),
                            carry_value(r[8]) if len(r) > 8 else None)


def carry_json(carried: Mapping[str, Any] | None) -> str | None:
    """A record's carried fields as the store keeps them: JSON text, any value JSON cannot hold
    (a Parquet date, a decimal) as its text."""
    return None if carried is None else orjson.dumps(carried, default=str).decode()


def carry_value(text: str | None) -> dict[str, Any] | None:
    return None if text is None else dict(json.loads(text))


def chunks(rows: Sequence[T], size: int = WRITE_BATCH_ROWS) -> Iterator[Sequence[T]]:
    for i in range(0, len(rows), size):
        yield rows[i:i + size]


# Why a worker gives a shard back when its slice no longer reads as planned.
INPUT_CHANGED = "input_changed"

# A split leaves the owner at least this many unstarted pieces' worth of work to share:
# one piece is a few hundred records, less is not worth a claim.
MIN_SPLIT_PIECES = 2


def split_point(first: int, end: int, started: int | None) -> int | None:
    """Where a shard covering pieces [first, end), whose owner has started every piece
    before `started`, is split: the owner keeps the nearer half of what it has not
    started, and the rest becomes a new shard; None when there is too little to share.
    The store and the interruption simulator both cut by this rule."""
    begun = max(first, started if started is not None else first)
    remaining = end - begun
    if remaining < MIN_SPLIT_PIECES:
        return None
    return begun + (remaining + 1) // 2


def fence(lease: Lease) -> dict[str, Any]:
    return {"v": lease.version, "s": lease.shard_no, "w": lease.owner, "e": lease.epoch}


def route_totals_from(rows: Sequence[Row]) -> dict[str, RouteTotals]:
    """Rows of (route, shards, records, results, carried, dead letters, input tokens, output tokens)."""
    return {route: RouteTotals(records=int(records), results=int(results) - int(carried),
                               dead_letters=int(dead), input_tokens=int(tin), output_tokens=int(tout),
                               shards=int(shards))
            for route, shards, records, results, carried, dead, tin, tout in rows}


def coverage_from(counts: Sequence[int],
                  samples: Callable[[int, int], tuple[tuple[str, ...], tuple[str, ...]]]) -> Coverage:
    """One join per outcome table counts the outcomes whose id the snapshot has (ids are
    unique on both sides); missing and unexpected follow from it, and the anti-joins run
    (through `samples`) only to list some of them when there are any. `counts`: records,
    results, dead letters, outcomes matched to a record, ids with both outcomes."""
    records, results, dead, matched, both = counts
    missing = records - (matched - both)
    unexpected = results + dead - matched
    missing_sample, unexpected_sample = samples(missing, unexpected)
    return Coverage(records, missing, unexpected, both, missing_sample, unexpected_sample)


class StoreCore(VersionChanges, PaidSlots, LineageOutbox, ShardOutcomes, ABC):
    """Every port's operation, over a backend's SQL (`q`) and transactions."""

    url: str
    q: ModuleType
    created: bool = False

    # --- what a backend brings ------------------------------------------------------

    @abstractmethod
    def _write(self, body: Callable[[Tx], T], *, recover: Callable[[Tx], T | Missing] | None = None,
               retry: bool = True) -> T:
        """`retry=False`: after a lost connection the operation fails instead (planning)."""

    @abstractmethod
    def _read(self, body: Callable[[Tx], T], *, snapshot: bool = False) -> T: ...

    @abstractmethod
    def _json(self, value: Any) -> Any:
        """A JSON value as a statement parameter."""

    @abstractmethod
    def _unjson(self, value: Any) -> Any:
        """A JSON column as Python values."""

    @abstractmethod
    def _list(self, values: Sequence[Any]) -> Any:
        """A list of values as one statement parameter."""

    @abstractmethod
    def _put(self, tx: Tx, lease: Lease, rows: Sequence[ResultRow]) -> tuple[bool, int]:
        """Fenced put-if-absent of results, counting them (and their tokens) on the shard:
        (whether the fence held, rows inserted)."""

    @abstractmethod
    def _insert_dead(self, tx: Tx, lease: Lease, rows: Sequence[DeadLetterRow]) -> tuple[bool, int]:
        """Fenced insert of dead letters for ids without a result, counted on the shard."""

    @abstractmethod
    def _insert_records(self, tx: Tx, version: str, rows: Sequence[PlannedRecord]) -> None:
        """Bulk insert of planned records; raises DuplicateKey on an id already planned."""

    @abstractmethod
    def _prepare_version(self, tx: Tx, version: str) -> None:
        """Whatever a version needs before its first row (PostgreSQL: its partitions)."""

    @abstractmethod
    def _analyse(self, version: str) -> None:
        """Fresh statistics before a join over the whole version, where the backend needs them."""

    @abstractmethod
    def _make_view(self, tx: Tx, name: str) -> None:
        """Creates the view named after a job, reading through its pointer, if missing."""

    @abstractmethod
    def _is_view(self, tx: Tx, name: str) -> bool:
        """Whether the published view of `name` exists and is a view."""

    @abstractmethod
    def close(self) -> None: ...

    def close_discarding(self) -> None:
        """Closes the store after a failed plan, removing it where this opening made it and it
        holds no job (only a SQLite file is ever made by opening)."""
        self.close()

    @abstractmethod
    def where(self) -> str:
        """The store, as messages name it: each backend's own (a file's path, a URL without
        its password), so no message can show a password."""

    # --- events ----------------------------------------------------------------------

    def _event(self, tx: Tx, kind: str, version: str | None, worker: str | None, shard_no: int | None,
               epoch: int | None, detail: Mapping[str, Any] | None = None, op: uuid.UUID | None = None) -> None:
        tx.run(self.q.INSERT_EVENT, {"v": version, "kind": kind, "w": worker, "s": shard_no, "e": epoch,
                                     "detail": self._json(dict(detail or {})), "op": op})

    def _marks(self, tx: Tx, op: uuid.UUID) -> list[_Mark]:
        return [_Mark(r[0], r[1], r[2], r[3], self._unjson(r[4])) for r in tx.all(self.q.EVENTS_BY_OP, {"op": op})]

    def _recover_marked(self, op: uuid.UUID) -> Callable[[Tx], Missing | None]:
        """For operations whose only effect is their event: committed if the event is there."""
        return lambda tx: None if self._marks(tx, op) else MISSING

    def _recover_refusal(self, op: uuid.UUID) -> Callable[[Tx], _Lost | Missing]:
        """For idempotent fenced writes: only a committed refusal must not be logged twice."""
        def recover(tx: Tx) -> _Lost | Missing:
            for mark in self._marks(tx, op):
                if mark.kind == "stale_epoch":
                    return _Lost(str(mark.detail.get("op", "write")))
            return MISSING
        return recover

    def _refused(self, tx: Tx, lease: Lease, op_name: str, op: uuid.UUID,
                 detail: Mapping[str, Any] | None = None) -> _Lost:
        self._event(tx, "stale_epoch", lease.version, lease.owner, lease.shard_no, lease.epoch,
                    {"op": op_name, **(detail or {})}, op)
        return _Lost(op_name)

    def log_event(self, kind: str, *, version: str | None = None, worker: str | None = None,
                  shard_no: int | None = None, epoch: int | None = None,
                  detail: dict[str, Any] | None = None) -> None:
        op = uuid.uuid4()
        self._write(lambda tx: self._event(tx, kind, version, worker, shard_no, epoch, detail, op),
                    recover=self._recover_marked(op))

    def events(self, version: str | None = None, kinds: Sequence[str] | None = None) -> list[Event]:
        params = {"v": version, "kinds": self._list(list(kinds)) if kinds else None}
        stmt = self.q.ALL_EVENTS if version is None else self.q.EVENTS
        rows = self._read(lambda tx: tx.all(stmt, params))
        return [Event(r[0], r[1], float(r[2]), r[3], r[4], r[5], r[6], self._unjson(r[7])) for r in rows]

    # --- the clock ----------------------------------------------------------------------

    def now(self) -> float:
        return float(self._read(lambda tx: _scalar(tx, self.q.NOW)))

    def shift_clock(self, seconds: float) -> None:
        self._write(lambda tx: tx.run(self.q.SHIFT_CLOCK, {"seconds": seconds}) and None)

    # --- jobs and planning --------------------------------------------------------------

    def _job(self, row: Row) -> JobInfo:
        return JobInfo(version=row[0], name=row[1], state=row[2], spec=self._unjson(row[3]),
                       record_count=int(row[4]), shard_count=int(row[5]), created_at=float(row[6]),
                       sealed_at=float(row[7]) if row[7] is not None else None, carried=int(row[8]),
                       bound=_bound(row[9], row[10]), halt=self._halt(row[11]), planned_dead=int(row[12] or 0))

    def _halt(self, value: Any) -> Halt | None:
        return Halt.from_json(self._unjson(value)) if value is not None else None

    def job(self, version: str) -> JobInfo | None:
        row = self._read(lambda tx: tx.one(self.q.JOB, {"v": version}))
        return self._job(row) if row else None

    def jobs(self) -> list[JobInfo]:
        return [self._job(r) for r in self._read(lambda tx: tx.all(self.q.JOBS))]

    def _check_name(self, name: str) -> None:
        reserved = getattr(self.q, "RESERVED_NAMES", ())
        if name in reserved or name.startswith(getattr(self.q, "RESERVED_PREFIX", "\0")):
            raise StoreError(f"job name {name!r} is the name of one of the store's own tables in {self.where()}, "
                             f"where the published view would be made; rename the job")

    def begin_plan(self, version: str, name: str, spec: dict[str, Any]) -> CorePlanWriter:
        self._check_name(name)
        token = uuid.uuid4().hex

        def body(tx: Tx) -> None:
            # Serialises planners of one version; different versions plan side by side.
            tx.one(self.q.PLAN_LOCK, {"key": version})
            row = tx.one(self.q.JOB_STATE_FOR_UPDATE, {"v": version})
            if row is not None and row[0] != "planning":
                raise StoreError(f"version {version} is already planned")
            self._prepare_version(tx, version)
            self._delete_version(tx, version)
            # Key order kept as written: see spec.version_material.
            tx.run(self.q.INSERT_JOB, {"v": version, "name": name, "spec": self._json(spec), "token": token})

        self._write(body, retry=False)
        shards = spec.get("shards") or {}
        return CorePlanWriter(self, version, token, _bound(shards.get("abort_dead_letter_rate"),
                                                           shards.get("abort_min_outcomes")))

    def _delete_version(self, tx: Tx, version: str) -> None:
        # Only a version still in 'planning' is ever deleted whole: it never existed
        # for anyone, so its rows and its events go.
        for stmt in self.q.DELETE_PLANNING:
            tx.run(stmt, {"v": version})

    # --- leases ---------------------------------------------------------------------------

    def claim(self, worker: str, version: str | None = None, routes: Sequence[str] | None = None,
              *, process: dict[str, Any] | None = None) -> Lease | None:
        op = uuid.uuid4()
        route_list = self._list(list(routes)) if routes is not None else None

        def body(tx: Tx) -> Lease | None:
            versions = [version] if version is not None else [r[0] for r in tx.all(self.q.READY_JOBS)]
            for v in versions:
                row = tx.one(self.q.PICK_SHARD, {"v": v, "routes": route_list})
                if row is not None:
                    return self._grant(tx, v, row, worker, process, op)
            return None

        def recover(tx: Tx) -> Lease | Missing | None:
            for mark in self._marks(tx, op):
                if mark.kind == "claim" and mark.version is not None and mark.shard_no is not None:
                    row = tx.one(self.q.LEASE_BY_CLAIM, {"v": mark.version, "s": mark.shard_no})
                    assert row is not None
                    slice_, count, expires, route, batch, first_piece, end_piece = row
                    # If the lease was lost meanwhile, the first fenced write says so.
                    return Lease(mark.version, mark.shard_no, worker, int(mark.epoch or 0), self._unjson(slice_),
                                 int(count), float(expires or 0.0), route,
                                 self._unjson(batch) if batch is not None else None, first_piece, end_piece)
            return MISSING

        return self._write(body, recover=recover)

    def _grant(self, tx: Tx, version: str, row: Row, worker: str, process: dict[str, Any] | None,
               op: uuid.UUID) -> Lease:
        shard_no, state, old_owner, old_epoch, slice_, count, route, batch, now, lease_seconds, first, end = row
        granted = tx.one(self.q.GRANT_SHARD, {
            "w": worker, "expires": float(now) + float(lease_seconds), "v": version, "s": shard_no,
            "process": self._json(process) if process is not None else None})
        assert granted is not None
        epoch, expires = int(granted[0]), float(granted[1])
        if state == "leased":
            self._event(tx, "lease_expired", version, old_owner, shard_no, old_epoch, {"reclaimed_by": worker}, op)
        self._event(tx, "claim", version, worker, shard_no, epoch, None, op)
        self._lineage_claimed(tx, version)
        return Lease(version=version, shard_no=shard_no, owner=worker, epoch=epoch, slice=self._unjson(slice_),
                     record_count=int(count), expires=expires, route=route,
                     batch=self._unjson(batch) if batch is not None else None, first_piece=first, end_piece=end)

    def renew(self, lease: Lease, started: int | None = None) -> Lease | None:
        op = uuid.uuid4()

        def body(tx: Tx) -> Lease | _Lost:
            row = tx.one(self.q.RENEW, {**fence(lease), "started": started})
            if row is None:
                return self._refused(tx, lease, "renew", op)
            # The end may have moved down: the shard's tail was split off to another worker.
            return replace(lease, expires=float(row[0]), end_piece=row[1], record_count=int(row[2]))

        renewed = self._write(body, recover=self._recover_refusal(op))
        return None if isinstance(renewed, _Lost) else renewed

    def leases(self, version: str) -> list[LeaseHolder]:
        rows = self._read(lambda tx: tx.all(self.q.LEASE_HOLDERS, {"v": version}))
        return [LeaseHolder(r[0], r[1], int(r[2]), float(r[3]) if r[3] is not None else None,
                            self._unjson(r[4]) if r[4] is not None else None) for r in rows]

    def take_back(self, version: str, holder: LeaseHolder, by: str, proof: dict[str, Any]) -> bool:
        """Ends a lease whose owner is proven dead, at once: fenced on the owner's epoch and
        bumping it, so an owner misjudged alive can only lose its later writes."""
        op = uuid.uuid4()
        lease = Lease(version, holder.shard_no, holder.owner, holder.epoch, {}, 0, holder.expires or 0.0)

        def body(tx: Tx) -> bool:
            taken = tx.run(self.q.TAKE_BACK, fence(lease)) == 1
            if taken:
                self._event(tx, "take_back", version, holder.owner, holder.shard_no, holder.epoch,
                            {"by": by, "proof": proof}, op)
            return taken

        def recover(tx: Tx) -> bool | Missing:
            return True if self._marks(tx, op) else MISSING

        return self._write(body, recover=recover)

    def split(self, version: str, worker: str) -> int | None:
        """Splits the unstarted tail of the leased local shard that has the most of it into a
        new ready shard (see `split_point`); returns the new shard's number, or None. A shard
        holding carried results is never split: the store does not keep which pieces they are
        in, so they would stay counted on the shard that keeps none of their records."""
        op = uuid.uuid4()

        def body(tx: Tx) -> int | None:
            row = tx.one(self.q.SPLIT_CANDIDATE, {"v": version})
            if row is None:
                return None
            shard_no, owner, epoch, slice_json, first, end, started = row
            point = split_point(first, end, started)
            if point is None:
                return None
            piece_slice = self._unjson(slice_json)
            moved = piece_slice["pieces"][point - first:end - first]
            records = sum(int(p["records"]) for p in moved)
            dead = sum(int(p.get("dead", 0)) for p in moved)
            new = int(_scalar(tx, self.q.NEXT_SHARD_NO, {"v": version}))
            tx.run(self.q.SHRINK_SHARD, {"v": version, "s": shard_no, "end": point, "old_end": end,
                                         "records": records, "dead": dead})
            tail = {**piece_slice, "pieces": moved, "start": moved[0]["start"], "end": moved[-1]["end"],
                    "first_line": moved[0]["first_line"]}
            tx.run(self.q.SPLIT_SHARD, {"v": version, "new": new, "slice": self._json(tail), "records": records,
                                        "dead": dead, "first": point, "end": end})
            self._event(tx, "split", version, owner, shard_no, epoch,
                        {"by": worker, "new_shard": new, "at_piece": point, "end_piece": end, "records": records}, op)
            return new

        def recover(tx: Tx) -> int | Missing | None:
            marks = self._marks(tx, op)
            return int(marks[0].detail["new_shard"]) if marks else MISSING

        return self._write(body, recover=recover)

    def release(self, lease: Lease, reason: str, error: str | None = None) -> bool:
        op = uuid.uuid4()

        def body(tx: Tx) -> bool:
            # A batch already at the provider is not given up with the lease: the shard
            # waits there for the next poller, who must not submit it again.
            released = tx.run(self.q.RELEASE, fence(lease)) == 1
            if released:
                self._event(tx, "release", lease.version, lease.owner, lease.shard_no, lease.epoch,
                            {"reason": reason}, op)
                if reason == INPUT_CHANGED:
                    # No worker gets past a changed input: the run is broken until it is planned anew.
                    self._lineage(tx, lease.version, lineage.FAIL, {"reason": reason, "shard": lease.shard_no,
                                                                    "message": error or "the input changed"})
            else:
                self._refused(tx, lease, "release", op)
            return released

        def recover(tx: Tx) -> bool | Missing:
            marks = self._marks(tx, op)
            return marks[0].kind == "release" if marks else MISSING

        return self._write(body, recover=recover)

    def set_batch(self, lease: Lease, batch: dict[str, Any] | None) -> Lease:
        op = uuid.uuid4()

        def body(tx: Tx) -> _Lost | None:
            changed = tx.run(self.q.SET_BATCH, {**fence(lease), "batch": self._json(batch) if batch is not None
                                                 else None})
            return None if changed == 1 else self._refused(tx, lease, "batch", op)

        if isinstance(self._write(body, recover=self._recover_refusal(op)), _Lost):
            raise LeaseLost.of(lease, "batch")
        return replace(lease, batch=batch)

    def await_provider(self, lease: Lease, batch: dict[str, Any], poll_in: float) -> None:
        op = uuid.uuid4()

        def body(tx: Tx) -> _Lost | None:
            row = tx.one(self.q.SHARD_FOR_AWAIT, {"v": lease.version, "s": lease.shard_no})
            if row is None:
                raise no_shard(lease.version, lease.shard_no)
            state, owner, epoch, previous_json = row
            previous = self._unjson(previous_json) if previous_json is not None else None
            if (owner, epoch) == (lease.owner, lease.epoch) and state == "submitted" and previous == batch:
                return None  # a retry of the same parking
            if tx.run(self.q.AWAIT_PROVIDER, {**fence(lease), "batch": self._json(batch),
                                              "poll_in": float(poll_in)}) != 1:
                return self._refused(tx, lease, "await_provider", op)
            fresh = previous is None or previous.get("batch_id") != batch.get("batch_id")
            self._event(tx, "submitted" if fresh else "provider_wait", lease.version, lease.owner,
                        lease.shard_no, lease.epoch,
                        {"batch_id": batch.get("batch_id"), "requests": batch.get("request_count")}, op)
            return None

        if isinstance(self._write(body, recover=self._recover_refusal(op)), _Lost):
            raise LeaseLost.of(lease, "await_provider")

    def complete(self, lease: Lease, files: Mapping[str, Any] | None = None) -> None:
        op = uuid.uuid4()

        def body(tx: Tx) -> _Lost | None:
            row = tx.one(self.q.SHARD_FOR_COMPLETE, {"v": lease.version, "s": lease.shard_no})
            if row is None:
                raise no_shard(lease.version, lease.shard_no)
            state, owner, epoch, count, results, dead = row
            if (owner, epoch) != (lease.owner, lease.epoch) or state not in ("leased", "done"):
                return self._refused(tx, lease, "complete", op, {"current_epoch": epoch})
            if state == "leased":
                if results + dead != count:
                    raise unanswered(lease, count - results - dead)
                self._finish_shard(tx, lease, int(count), int(results), int(dead), op, files)
            # state == 'done' for this owner and epoch: a retried completion after a
            # lost acknowledgement, which succeeds again.
            return None

        if isinstance(self._write(body, recover=self._recover_refusal(op)), _Lost):
            raise LeaseLost.of(lease, "completion")

    def _finish_shard(self, tx: Tx, lease: Lease, count: int, results: int, dead: int, op: uuid.UUID,
                      files: Mapping[str, Any] | None = None) -> None:
        # The files its worker wrote of it are recorded in the step that completes it, under its
        # fence: a stale owner's file is never the one a publisher adds.
        tx.run(self.q.FINISH_SHARD, {**fence(lease), "files": self._json(dict(files)) if files else None})
        self._event(tx, "complete", lease.version, lease.owner, lease.shard_no, lease.epoch,
                    {"records": count, "results": results, "dead_letters": dead}, op)
        self._seal_if_done(tx, lease.version, lease.owner, op)

    def _seal_if_done(self, tx: Tx, version: str, worker: str | None, op: uuid.UUID | None) -> None:
        # Completions of one version take the job's row lock only here, so the one
        # that finishes the last open shard sees (in SEAL's fresh snapshot, after the
        # lock) every other completion committed, and seals exactly once.
        tx.one(self.q.LOCK_JOB, {"v": version})
        if tx.one(self.q.SEAL, {"v": version}) is not None:
            self._event(tx, "seal", version, worker, None, None, None, op)
            self._lineage_sealed(tx, version)

    # --- halting on dead letters ---------------------------------------------------------------

    def _figures(self, tx: Tx, version: str) -> tuple[str, DeadLetterBound | None, int, int] | None:
        """The version's state, its bound, and the dead letters and outcomes it computed."""
        row = tx.one(self.q.DEAD_LETTER_FIGURES, {"v": version})
        if row is None:
            return None
        state, rate, minimum, results, dead = row
        return str(state), _bound(rate, minimum), int(dead), int(results) + int(dead)

    def halt_of(self, version: str) -> Halt | None:
        row = self._read(lambda tx: tx.one(self.q.JOB_HALT, {"v": version}))
        return self._halt(row[1]) if row is not None and row[0] == "halted" else None

    def judge_dead_letters(self, version: str, worker: str) -> Halt | None:
        figures = self._read(lambda tx: self._figures(tx, version))
        if figures is None:
            return None
        state, bound, dead, outcomes = figures
        if state == "halted":
            return self.halt_of(version)
        if state != "ready" or bound is None or not bound.passed(dead, outcomes):
            return None  # the common case: one read, no write
        op = uuid.uuid4()

        def body(tx: Tx) -> Halt | None:
            now = self._figures(tx, version)
            assert now is not None
            state, bound, dead, outcomes = now
            if state != "ready" or bound is None or not bound.passed(dead, outcomes):
                return self._halt_in(tx, version)
            kind, count, example = tx.one(self.q.DOMINANT_DEAD_KIND, {"v": version}) or ("dead_letter", 0, "")
            halt = Halt(dead, outcomes, bound.rate, bound.min_outcomes, str(kind), int(count), str(example), worker)
            if tx.run(self.q.HALT_JOB, {"v": version, "halt": self._json(halt.to_json())}) != 1:
                return self._halt_in(tx, version)  # another worker halted it, or it was sealed, first
            self._event(tx, "halt", version, worker, None, None, halt.to_json(), op)
            self._lineage(tx, version, lineage.FAIL, {"reason": "halted", "message": halt.message(version),
                                                      **halt.to_json()})
            return halt

        def recover(tx: Tx) -> Halt | Missing | None:
            marks = self._marks(tx, op)
            return Halt.from_json(marks[0].detail) if marks else MISSING

        return self._write(body, recover=recover)

    def _halt_in(self, tx: Tx, version: str) -> Halt | None:
        row = tx.one(self.q.JOB_HALT, {"v": version})
        return self._halt(row[1]) if row is not None and row[0] == "halted" else None

    def resume(self, version: str, who: str, reason: str | None, rate: float | None = None,
               min_outcomes: int | None = None) -> DeadLetterBound:
        op = uuid.uuid4()

        def body(tx: Tx) -> DeadLetterBound:
            tx.one(self.q.JOB_STATE_FOR_UPDATE, {"v": version})
            row = tx.one(self.q.JOB, {"v": version})
            if row is None:
                raise self._no_version(version)
            job = self._job(row)
            if job.state != "halted" or job.bound is None:
                raise StoreError(f"cannot resume {version}: it is {job.state}, not halted")
            bound = DeadLetterBound(job.bound.rate if rate is None else rate,
                                    job.bound.min_outcomes if min_outcomes is None else min_outcomes)
            figures = self._figures(tx, version)
            assert figures is not None
            _state, _old, dead, outcomes = figures
            if bound.passed(dead, outcomes):
                raise StoreError(
                    f"cannot resume {version}: {dead:,} of the {outcomes:,} outcomes it computed are dead letters, "
                    f"over {bound.describe()} already, so it would halt again at once; give a higher "
                    f"--abort-dead-letter-rate (1 never halts), or cancel it")
            tx.run(self.q.RESUME_JOB, {"v": version, "abort_rate": bound.rate, "abort_min": bound.min_outcomes})
            self._lineage_resumed(tx, version)
            self._event(tx, "resume", version, None, None, None,
                        {"who": who, "reason": reason, "rate": bound.rate, "min_outcomes": bound.min_outcomes,
                         "was": job.halt.to_json() if job.halt else None}, op)
            # Its last shard may have been completed while it was halted: nobody else would seal it.
            self._seal_if_done(tx, version, None, op)
            return bound

        def recover(tx: Tx) -> DeadLetterBound | Missing:
            for mark in self._marks(tx, op):
                if mark.kind == "resume":
                    return DeadLetterBound(float(mark.detail["rate"]), int(mark.detail["min_outcomes"]))
            return MISSING

        return self._write(body, recover=recover)

    def open_versions(self) -> list[str]:
        return [r[0] for r in self._read(lambda tx: tx.all(self.q.OPEN_VERSIONS))]

    def has_open_shards(self, version: str | None = None, routes: Sequence[str] | None = None) -> bool:
        params = {"v": version, "routes": self._list(list(routes)) if routes is not None else None}
        stmt = self.q.HAS_OPEN if version is None else self.q.HAS_OPEN_VERSION
        return bool(self._read(lambda tx: _scalar(tx, stmt, params)))

    # --- records ---------------------------------------------------------------------------

    def _by_ids(self, stmt: str, version: str, record_ids: Sequence[str]) -> list[Row]:
        out: list[Row] = []
        for chunk in chunks(record_ids, 10_000):
            params = {"v": version, "ids": self._list(list(chunk))}
            out.extend(self._read(lambda tx, params=params: tx.all(stmt, params)))  # type: ignore[misc]
        return out

    def answered(self, version: str, record_ids: Sequence[str]) -> set[str]:
        return {r[0] for r in self._by_ids(self.q.ANSWERED, version, record_ids)}

    def input_records(self, version: str, start: int, end: int) -> list[InputRecord]:
        rows = self._read(lambda tx: tx.all(self.q.INPUT_RECORDS, {"v": version, "start": start, "end": end}))
        return [InputRecord(r[0], r[1], acl_value(r[2]), r[3], int(r[4])) for r in rows]

    def attempts(self, version: str, record_ids: Sequence[str]) -> dict[str, int]:
        return {r[0]: int(r[1]) for r in self._by_ids(self.q.ATTEMPTS, version, record_ids)}

    def put_results(self, lease: Lease, rows: Sequence[ResultRow]) -> int:
        # Put-if-absent: a retry after a commit whose acknowledgement was lost finds
        # every row present and inserts none (and counts none).
        return self._fenced_inserts(lease, rows, self._put, "put")

    def charge_attempt(self, lease: Lease, record_id: str, kind: str, error: str, acl: Any,
                       max_attempts: int, piece: int | None = None) -> ChargeResult:
        op = uuid.uuid4()

        def body(tx: Tx) -> ChargeResult | _Lost:
            held = tx.one(self.q.FENCE_LOCK, fence(lease))
            if held is None:
                return self._refused(tx, lease, "charge", op)
            if not within(piece, held[0], held[1]):
                # Another shard's record since a split (or one that does not say its piece).
                return ChargeResult(attempts=0, dead_lettered=False)
            if _scalar(tx, self.q.IS_ANSWERED, {"v": lease.version, "r": record_id}):
                return ChargeResult(attempts=0, dead_lettered=False)
            attempts = int(_scalar(tx, self.q.CHARGE, {"v": lease.version, "r": record_id, "kind": kind,
                                                       "error": error}))
            self._event(tx, "attempt_failed", lease.version, lease.owner, lease.shard_no, lease.epoch,
                        {"record_id": record_id, "kind": kind, "attempts": attempts, "error": error[:500]}, op)
            result = ChargeResult(attempts=attempts, dead_lettered=attempts >= max_attempts)
            if result.dead_lettered:
                self._insert_dead(tx, lease, [DeadLetterRow(record_id, kind, error, acl, attempts, piece)])
            return result

        def recover(tx: Tx) -> ChargeResult | _Lost | Missing:
            for mark in self._marks(tx, op):
                if mark.kind == "stale_epoch":
                    return _Lost("charge")
                if mark.kind == "attempt_failed":
                    attempts = int(mark.detail["attempts"])
                    return ChargeResult(attempts=attempts, dead_lettered=attempts >= max_attempts)
            return MISSING

        result = self._write(body, recover=recover)
        if isinstance(result, _Lost):
            raise LeaseLost.of(lease, "charge")
        return result

    def dead_letter(self, lease: Lease, rows: Sequence[DeadLetterRow]) -> int:
        return self._fenced_inserts(lease, rows, self._insert_dead, "dead_letter")

    def _fenced_inserts(self, lease: Lease, rows: Sequence[P],
                        insert: Callable[[Tx, Lease, Sequence[P]], tuple[bool, int]], op_name: str) -> int:
        """Rows written in bounded transactions, each fenced by the lease; how many were new.
        Rows of pieces the shard no longer covers (its tail was split off) are refused
        and not counted, and so, on a shard planned with pieces, are rows that do not
        say their piece."""
        inserted = 0
        for chunk in chunks(rows):
            op = uuid.uuid4()

            def body(tx: Tx, chunk: Sequence[P] = chunk, op: uuid.UUID = op) -> int | _Lost:
                held = tx.one(self.q.FENCE_LOCK, fence(lease))
                if held is None:
                    return self._refused(tx, lease, op_name, op)
                mine = [r for r in chunk if within(r.piece, held[0], held[1])]
                fenced, n = insert(tx, lease, mine) if mine else (True, 0)
                if not fenced:
                    return self._refused(tx, lease, op_name, op)
                pieces = [r.piece for r in mine if r.piece is not None]
                if pieces:
                    tx.run(self.q.BUMP_STARTED, {"v": lease.version, "s": lease.shard_no, "high": max(pieces) + 1})
                return n

            n = self._write(body, recover=self._recover_refusal(op))
            if isinstance(n, _Lost):
                raise LeaseLost.of(lease, op_name)
            inserted += n
        return inserted

    # --- reading ------------------------------------------------------------------------------

    def _no_version(self, version: str) -> NoSuchVersion:
        return NoSuchVersion(version, self.where())

    def status(self, version: str, window_seconds: float = 300.0) -> JobStatus:
        def body(tx: Tx) -> JobStatus:
            row = tx.one(self.q.JOB, {"v": version})
            if row is None:
                raise self._no_version(version)
            job = self._job(row)
            now = float(_scalar(tx, self.q.NOW))
            shards = dict.fromkeys(SHARD_STATES, 0)
            results = dead = 0
            for state, n, r, d in tx.all(self.q.STATUS_SHARDS, {"v": version}):
                shards[state] = int(n)
                results += int(r or 0)
                dead += int(d or 0)
            by_kind = {k: int(n) for k, n in tx.all(self.q.DEAD_BY_KIND, {"v": version})}
            lost = int(_scalar(tx, self.q.LEASES_LOST, {"v": version}))
            taken, splits = (int(_scalar(tx, self.q.COUNT_EVENTS, {"v": version, "kind": k}))
                             for k in ("take_back", "split"))
            first_claim = _scalar(tx, self.q.FIRST_CLAIM, {"v": version})
            # A sealed version's rate is over its own run, first claim to seal: the clock
            # running on after the seal does not lower it.
            ended = job.sealed_at if job.state == "sealed" and first_claim is not None else None
            since = float(first_claim) if ended is not None else now - window_seconds
            recent = int(_scalar(tx, self.q.RECENT, {"v": version, "since": since}))
            stopped = None
            if job.state == "ready":
                refused = tx.one(self.q.STOPPED_BY_INPUT, {"v": version})
                if refused is not None:
                    error = (self._unjson(refused[1]) or {}).get("error") or "input changed since planning"
                    stopped = f"shard {refused[0]}: {error}"
            return JobStatus(version=version, name=job.name, state=job.state, records=job.record_count,
                             results=results, dead_letters=dead, shards=shards, dead_letters_by_kind=by_kind,
                             leases_lost=lost, records_done_last_minutes=recent, window_seconds=window_seconds,
                             now=now, halt=job.halt, leases_taken_back=taken, splits=splits,
                             started_at=float(first_claim) if first_claim is not None else None,
                             stopped=stopped, ended_at=ended)

        return self._read(body, snapshot=True)

    def shard_slice(self, version: str, shard_no: int) -> dict[str, Any]:
        row = self._read(lambda tx: tx.one(self.q.SHARD_SLICE, {"v": version, "s": shard_no}))
        if row is None:
            raise no_shard(version, shard_no)
        return dict(self._unjson(row[0]))

    def shard_rows(self, version: str) -> list[ShardRow]:
        rows = self._read(lambda tx: tx.all(self.q.SHARD_ROWS, {"v": version}))
        return [ShardRow(r[0], r[1], r[2], int(r[3]), float(r[4]) if r[4] is not None else None, int(r[5]),
                         int(r[6]), int(r[7]), int(r[8]), r[9], r[10],
                         float(r[11]) if r[11] is not None else None) for r in rows]

    def route_totals(self, version: str) -> dict[str, RouteTotals]:
        return route_totals_from(self._read(lambda tx: tx.all(self.q.ROUTE_TOTALS, {"v": version})))

    def token_totals(self, version: str) -> tuple[int, int]:
        row = self._read(lambda tx: tx.one(self.q.TOKEN_TOTALS, {"v": version}))
        assert row is not None
        return int(row[0] or 0), int(row[1] or 0)

    def result_histogram(self, version: str, start: float, width: float, bins: int) -> list[tuple[int, int, int]]:
        params = {"v": version, "start": start, "width": width, "last": max(bins - 1, 0)}
        return [(int(a), int(b), int(n)) for a, b, n in self._read(lambda tx: tx.all(self.q.RESULT_HISTOGRAM,
                                                                                      params))]

    def run_throughput(self, version: str) -> float:
        row = self._read(lambda tx: tx.one(self.q.RUN_THROUGHPUT, {"v": version}))
        records, seconds = row if row is not None else (None, None)
        return float(records) / float(seconds) if records and seconds and seconds > 0 else 0.0

    def _pages(self, stmt: str, version: str, page_size: int) -> Iterator[Row]:
        # Keyset pages, each its own short statement: a reader never holds a snapshot
        # open for a whole export, and a page retried after a lost connection starts
        # where the last one ended.
        last = ""
        while True:
            params = {"v": version, "after": last, "n": page_size}
            rows = self._read(lambda tx, params=params: tx.all(stmt, params))  # type: ignore[misc]
            if not rows:
                return
            yield from rows
            last = rows[-1][0]

    def iter_results(self, version: str, page_size: int = 5000, *,
                     computed_only: bool = False) -> Iterator[StoredResult]:
        stmt = self._carrying(version, "COMPUTED_RESULTS_PAGE" if computed_only else "RESULTS_PAGE")
        for r in self._pages(stmt, version, page_size):
            yield stored_result(r)

    def iter_outputs(self, version: str, page_size: int = 20_000) -> Iterator[tuple[str, str]]:
        """Each result this version computed (none carried), as its record id and output, in id
        order: the two columns the gate's schema check reads, without the rest of each row."""
        for r in self._pages(self.q.COMPUTED_OUTPUTS_PAGE, version, page_size):
            yield str(r[0]), str(r[1])

    def results_for(self, version: str, record_ids: Sequence[str]) -> dict[str, StoredResult]:
        stmt = self._carrying(version, "RESULTS_FOR")
        return {r[0]: stored_result(r) for r in self._by_ids(stmt, version, record_ids)}

    def iter_dead_letters(self, version: str) -> Iterator[StoredDeadLetter]:
        for r in self._pages(self._carrying(version, "DEAD_LETTERS_PAGE"), version, 5000):
            yield stored_dead_letter(r)

    def _carrying(self, version: str, name: str) -> str:
        """The statement `name`, or where the version carries input fields (output.carry) its
        `_CARRY` form, which reads each row with its planned record's fields; a version's spec
        never changes, so the store is asked once a version."""
        known: dict[str, bool] = self.__dict__.setdefault("_carries", {})
        if version not in known:
            info = self.job(version)
            if info is None:
                return str(getattr(self.q, name))
            known[version] = bool((info.spec.get("output") or {}).get("carry"))
        return str(getattr(self.q, f"{name}_CARRY" if known[version] else name))

    def planned_ids(self, version: str) -> Iterator[str]:
        for r in self._pages(self.q.PLANNED_PAGE, version, 20_000):
            yield r[0]

    def resolve_name(self, name: str) -> str | None:
        row = self._read(lambda tx: tx.one(self.q.RESOLVE_NAME, {"name": name}))
        return str(row[0]) if row else None

    def published(self) -> dict[str, str]:
        return {str(r[0]): str(r[1]) for r in self._read(lambda tx: tx.all(self.q.POINTERS))}

    def label_counts(self, version: str) -> dict[str | None, int]:
        return {r[0]: int(r[1]) for r in self._read(lambda tx: tx.all(self.q.LABEL_COUNTS, {"v": version}))}

    # --- validation and publication ------------------------------------------------------------

    def coverage(self, version: str, sample: int = 10) -> Coverage:
        # The gate's first step, and the first read of the whole sealed version: its partitions'
        # statistics are made fresh here (their rows were bulk-loaded by workers, and a planner
        # without counts pages through them in a plan that sorts the whole version for each
        # page: validate, publish and exports after it read the version page by page).
        self._analyse(version)
        if self.q.COVERAGE_PROOF:
            proven = self._read(lambda tx: self._full_coverage(tx, version), snapshot=True)
            if proven is not None:
                return proven

        def body(tx: Tx) -> Coverage:
            p = {"v": version, "n": sample}
            # The backend's steps: counts, and between them the settings its joins want.
            found = [tx.one(stmt, p) for stmt in self.q.COVERAGE_STEPS]
            records, results, dead, matched_results, matched_dead, both = (int(r[0]) for r in found if r)
            counts = (records, results, dead, matched_results + matched_dead, both)

            def samples(missing: int, unexpected: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
                return (tuple(r[0] for r in tx.all(self.q.MISSING_SAMPLE, p)) if missing else (),
                        tuple(r[0] for r in tx.all(self.q.UNEXPECTED_SAMPLE, p)) if unexpected else ())

            return coverage_from(counts, samples)

        # One snapshot for every count, so a count and its sample agree.
        return self._read(body, snapshot=True)

    def _full_coverage(self, tx: Tx, version: str) -> Coverage | None:
        """Coverage, if the counts and id fingerprints of the backend's proof show every
        record with exactly one outcome and no other outcome; None where they do not, and
        the joins count what is wrong."""
        found = [tx.one(stmt, {"v": version}) for stmt in self.q.COVERAGE_PROOF]
        (records, *planned), (results, *answered), (dead, *dropped), (both,) = (
            tuple(int(x) for x in row) for row in found if row)
        if both or records != results + dead:
            return None
        if any(p != a ^ d for p, a, d in zip(planned, answered, dropped, strict=True)):
            return None
        return coverage_from((records, results, dead, results + dead, 0), lambda _m, _u: ((), ()))

    def record_validation(self, version: str, passed: bool, report: dict[str, Any]) -> None:
        op = uuid.uuid4()

        def body(tx: Tx) -> None:
            tx.run(self.q.INSERT_VALIDATION, {"v": version, "passed": passed, "report": self._json(report)})
            self._event(tx, "validate", version, None, None, None, {"passed": passed}, op)

        self._write(body, recover=self._recover_marked(op))

    def latest_validation(self, version: str) -> ValidationRecord | None:
        row = self._read(lambda tx: tx.one(self.q.LATEST_VALIDATION, {"v": version}))
        return ValidationRecord(version, bool(row[0]), self._unjson(row[1]), float(row[2])) if row else None

    def _point(self, tx: Tx, name: str, version: str) -> str | None:
        """Moves the pointer in one row update, under the pointer's row lock so two
        publishers of one name queue instead of both reading the same `previous`;
        the view reads through it, so readers switch from the whole old version to
        the whole new one at once."""
        row = tx.one(self.q.POINTER_FOR_UPDATE, {"name": name})
        tx.run(self.q.SET_POINTER, {"name": name, "v": version})
        self._make_view(tx, name)
        if not self._is_view(tx, name):
            # Something else holds the name (a table of the store): readers would not
            # read through the pointer, so nothing is published.
            raise StoreError(f"cannot publish {name!r} in {self.where()}: {name!r} is not the view that reads "
                             f"through the pointer; rename the job")
        return str(row[0]) if row else None

    def _unmoved(self, tx: Tx, name: str, expected: int | None, verb: str) -> None:
        """Refuses, under the name's lock, a publish or rollback whose publisher read a
        publication of the name other than its latest: the targets it moved in between
        were moved from a state the store no longer records."""
        row = tx.one(self.q.LATEST_PUBLICATION, {"name": name})
        latest = int(row[0]) if row else None
        if latest == expected:
            return
        now = (f"it now shows {row[1]}, {'rolled back to' if row[2] == 'rollback' else 'published'} by {row[3]}"
               if row else "its publications are gone")
        raise PublicationMoved(f"cannot {verb}: another publish or rollback of {name!r} came in between "
                               f"({now}); nothing was recorded: see `batchline history {name}` and try again")

    def publish(self, name: str, version: str, who: str, reason: str | None,
                validation: dict[str, Any] | None, *, expected: int | None,
                targets: dict[str, Any] | None = None) -> str | None:
        op = uuid.uuid4()

        def body(tx: Tx) -> str | None:
            tx.one(self.q.PLAN_LOCK, {"key": f"publish:{name}"})
            self._unmoved(tx, name, expected, f"publish {version} as {name!r}")
            # Checked under the name's lock: a version cancelled or removed since the
            # caller looked is not published.
            if not _scalar(tx, self.q.IS_SEALED, {"v": version}):
                raise StoreError(f"cannot publish {version}: it is not sealed (cancelled, removed or unfinished)")
            pointer = tx.one(self.q.POINTER_FOR_UPDATE, {"name": name})
            if pointer is not None and pointer[0] == version:
                # Published already: nothing moves, so history records nothing (a
                # publication of a version over itself would be one a rollback returns to).
                return version
            previous = self._point(tx, name, version)
            tx.run(self.q.INSERT_PUBLICATION, {"name": name, "v": version, "previous": previous,
                                               "action": "publish", "who": who, "reason": reason,
                                               "validation": self._json(validation) if validation else None,
                                               "targets": self._json(targets) if targets else None})
            self._event(tx, "publish", version, None, None, None,
                        {"name": name, "previous": previous, "who": who, "reason": reason}, op)
            self._lineage(tx, version, lineage.PUBLISH, {"name": name, "previous": previous, "who": who,
                                                         "reason": reason, "targets": targets or {},
                                                         "validation": validation})
            return previous

        def recover(tx: Tx) -> str | Missing | None:
            marks = self._marks(tx, op)
            return marks[0].detail.get("previous") if marks else MISSING

        return self._write(body, recover=recover)

    def rollback(self, name: str, who: str, reason: str | None, *, expected: int | None,
                 targets: dict[str, Any] | None = None) -> tuple[str, str]:
        op = uuid.uuid4()

        def body(tx: Tx) -> tuple[str, str]:
            tx.one(self.q.PLAN_LOCK, {"key": f"publish:{name}"})
            row = tx.one(self.q.POINTER_FOR_UPDATE, {"name": name})
            if row is None:
                raise StoreError(f"nothing is published under {name!r}")
            current = str(row[0])
            self._unmoved(tx, name, expected, f"roll {name!r} back from {current}")
            back_to = rollback_target(self._publications(tx, name), current)
            if back_to is None:
                raise StoreError(f"{name!r} has no earlier version to roll back to (current: {current})")
            target = back_to
            if not _scalar(tx, self.q.IS_SEALED, {"v": target}):
                raise StoreError(f"cannot roll {name!r} back to {target}: that version was removed")
            self._point(tx, name, target)
            tx.run(self.q.INSERT_PUBLICATION, {"name": name, "v": target, "previous": current,
                                               "action": "rollback", "who": who, "reason": reason,
                                               "validation": None, "targets": self._json(targets) if targets else None})
            self._event(tx, "rollback", target, None, None, None, {"name": name, "from": current, "who": who}, op)
            self._lineage(tx, target, lineage.ROLLBACK, {"name": name, "previous": current, "who": who,
                                                         "reason": reason, "targets": targets or {}})
            return current, target

        def recover(tx: Tx) -> tuple[str, str] | Missing:
            marks = self._marks(tx, op)
            if marks and marks[0].version is not None:
                return str(marks[0].detail["from"]), marks[0].version
            return MISSING

        return self._write(body, recover=recover)

    def publications(self, name: str) -> list[Publication]:
        return self._read(lambda tx: self._publications(tx, name))

    def _publications(self, tx: Tx, name: str) -> list[Publication]:
        return [Publication(int(r[0]), r[1], r[2], r[3], r[4], r[5], r[6],
                            self._unjson(r[7]) if r[7] is not None else None, float(r[8]),
                            self._unjson(r[9]) if r[9] is not None else None)
                for r in tx.all(self.q.PUBLICATIONS, {"name": name})]

    def remove_version(self, version: str) -> None:
        def body(tx: Tx) -> None:
            if _scalar(tx, self.q.IS_PUBLISHED, {"v": version}):
                raise StoreError(f"{version} is published; it cannot be removed")
            self._remove_rows(tx, version, None)

        # Every statement is idempotent, and a second `remove` event is harmless.
        self._write(body)

    def _remove_rows(self, tx: Tx, version: str, detail: Mapping[str, Any] | None,
                     op: uuid.UUID | None = None) -> None:
        # Rows that a later version carries stay: they hold that version's payload.
        for stmt in self.q.REMOVE_VERSION:
            tx.run(stmt, {"v": version})
        self._event(tx, "remove", version, None, None, None, detail, op)

    # --- housekeeping: versions nobody will publish ----------------------------------------

    def _kept(self, tx: Tx, version: str, verb: str) -> JobInfo:
        """The job, under its name's publication lock, once it is known to be neither the
        published version of its name nor the one a rollback would return to."""
        row = tx.one(self.q.JOB, {"v": version})
        if row is None:
            raise self._no_version(version)
        # Publish and rollback take the same lock: the pointer cannot move while this runs.
        tx.one(self.q.PLAN_LOCK, {"key": f"publish:{row[1]}"})
        row = tx.one(self.q.JOB, {"v": version})  # its state as it is under the lock
        assert row is not None
        job = self._job(row)
        pointer = tx.one(self.q.POINTER_FOR_UPDATE, {"name": job.name})
        if pointer is not None:
            current = str(pointer[0])
            if current == version:
                raise StoreError(f"cannot {verb} {version}: it is published as {job.name!r}")
            if rollback_target(self._publications(tx, job.name), current) == version:
                raise StoreError(f"cannot {verb} {version}: a rollback of {job.name!r} would return to it")
        return job

    def keyed_version(self, name: str, key: str) -> str | None:
        row = self._read(lambda tx: tx.one(self.q.KEYED_VERSION, {"name": name, "key": key}))
        return None if row is None else str(row[0])

    def key_plan(self, name: str, key: str, version: str) -> str:
        job = self.job(version)
        if job is None or job.name != name or job.state == "planning":
            raise StoreError(f"cannot key {version} as {name!r} run {key!r}: it is not a planned version of {name!r}")

        def body(tx: Tx) -> str:
            # First planner wins; a second, racing one is told the winner's version.
            tx.run(self.q.KEY_PLAN, {"name": name, "key": key, "v": version})
            row = tx.one(self.q.KEYED_VERSION, {"name": name, "key": key})
            assert row is not None
            return str(row[0])

        return self._write(body)

    def pinned_runtime(self, version: str) -> str | None:
        row = self._read(lambda tx: tx.one(self.q.PINNED_RUNTIME, {"v": version}))
        return None if row is None else str(row[0])

    def pin_runtime(self, version: str, runtime: str, worker: str) -> tuple[str, str]:
        def body(tx: Tx) -> tuple[str, str]:
            # The first worker to load the version's engine pins its runtime; later ones read it.
            tx.run(self.q.PIN_RUNTIME, {"v": version, "runtime": runtime, "w": worker})
            row = tx.one(self.q.PINNED_RUNTIME, {"v": version})
            assert row is not None
            return str(row[0]), str(row[1])

        return self._write(body)

    def cancel(self, version: str, who: str, reason: str | None) -> bool:
        op = uuid.uuid4()

        def body(tx: Tx) -> bool:
            job = self._kept(tx, version, "cancel")
            if job.state == "cancelled":
                return False
            if job.state not in ("ready", "halted", "sealed"):
                raise StoreError(f"cannot cancel {version}: it is {job.state}")
            # Leases end before the job's row is taken: a completing worker holds its
            # shard and then the job's row, so this order cannot wait on it in a circle.
            ended = tx.run(self.q.END_LEASES, {"v": version})
            if tx.run(self.q.CANCEL_JOB, {"v": version}) != 1:
                raise StoreError(f"cannot cancel {version}: its state changed meanwhile; look again")
            self._event(tx, "cancel", version, None, None, None,
                        {"who": who, "reason": reason, "was": job.state, "leases_ended": ended}, op)
            if job.state == "ready" and self._lineage_running(tx, version):
                self._lineage(tx, version, lineage.ABORT, {"who": who, "reason": reason})
            return True

        def recover(tx: Tx) -> bool | Missing:
            return True if self._marks(tx, op) else MISSING

        return self._write(body, recover=recover)

    def delete(self, version: str, who: str) -> bool:
        op = uuid.uuid4()

        def body(tx: Tx) -> bool:
            job = self._kept(tx, version, "delete")
            if job.state == "removed":
                return False
            if job.state in ("ready", "halted"):
                raise StoreError(f"cannot delete {version}: it is not finished; cancel it first")
            if job.state not in ("sealed", "cancelled"):
                raise StoreError(f"cannot delete {version}: it is {job.state}")
            self._remove_rows(tx, version, {"who": who, "was": job.state}, op)
            return True

        def recover(tx: Tx) -> bool | Missing:
            return True if self._marks(tx, op) else MISSING

        return self._write(body, recover=recover)


def _bound(rate: Any, minimum: Any) -> DeadLetterBound | None:
    return DeadLetterBound(float(rate), int(minimum)) if rate is not None and minimum is not None else None


def _scalar(tx: Tx, stmt: str, params: Params | None = None) -> Any:
    row = tx.one(stmt, params)
    return row[0] if row is not None else None


class CorePlanWriter:
    """Writes a plan under the `planning` state. Planning is not retried after a lost
    connection: the planner stops, and the next one discards what this one left."""

    def __init__(self, store: StoreCore, version: str, token: str, bound: DeadLetterBound | None = None) -> None:
        self.store = store
        self.q = store.q
        self.version = version
        self.token = token
        self.bound = bound  # the spec's, held by the store from the commit on

    def _planning(self, body: Callable[[Tx], T]) -> T:
        def checked(tx: Tx) -> T:
            row = tx.one(self.q.PLAN_TOKEN, {"v": self.version})
            if row is None or row[0] != self.token:
                raise taken_over(self.version)
            return body(tx)
        return self.store._write(checked, retry=False)

    def add_shards(self, shards: Sequence[PlannedShard]) -> None:
        rows = [{"v": self.version, "s": s.shard_no, "slice": self.store._json(s.slice), "n": s.record_count,
                 "route": s.route, "first": s.first_piece, "end": s.end_piece} for s in shards]
        self._planning(lambda tx: tx.many(self.q.INSERT_SHARD, rows))

    def add_records(self, records: Sequence[PlannedRecord]) -> None:
        for chunk in chunks(records, 20_000):
            seen: dict[str, int] = {}
            for r in chunk:
                if r.record_id in seen:
                    raise DuplicateRecord(r.record_id, seen[r.record_id])
                seen[r.record_id] = r.shard_no
            try:
                self._planning(lambda tx, chunk=chunk: self.store._insert_records(  # type: ignore[misc]
                    tx, self.version, chunk))
            except DuplicateKey:
                raise self._duplicate(chunk) from None

    def _duplicate(self, chunk: Sequence[PlannedRecord]) -> DuplicateRecord | StoreError:
        for r in chunk:
            row = self.store._read(lambda tx, r=r: tx.one(self.q.RECORD_SHARD,  # type: ignore[misc]
                                                          {"v": self.version, "r": r.record_id}))
            if row is not None:
                return DuplicateRecord(r.record_id, int(row[0]))
        return StoreError(f"planning of {self.version}: a record id was refused as a duplicate")

    def add_dead_letters(self, shard_no: int, rows: Sequence[DeadLetterRow]) -> None:
        params = [{"v": self.version, "s": shard_no, "r": r.record_id, "kind": r.kind, "error": r.error,
                   "acl": acl_json(r.acl)} for r in rows]

        def body(tx: Tx) -> None:
            tx.many(self.q.PLAN_DEAD_LETTER, params)
            tx.run(self.q.BUMP_DEAD, {"n": len(rows), "v": self.version, "s": shard_no})

        self._planning(body)

    def carry_from(self, base: str) -> int:
        def body(tx: Tx) -> int:
            p = {"v": self.version, "base": base}
            carried = tx.run(self.q.CARRY, p)
            tx.run(self.q.SET_CARRIED, {"n": carried, "v": self.version})
            # One pass over the carried rows, not one per shard.
            tx.run(self.q.CARRY_COUNTS, p)
            tx.run(self.q.CARRY_DONE, p)
            self.store._event(tx, "carry", self.version, None, None, None, {"base": base, "records": carried})
            return carried
        return self._planning(body)

    def commit(self, record_count: int, shard_count: int) -> None:
        def body(tx: Tx) -> None:
            tx.run(self.q.COMMIT_PLAN, {"records": record_count, "shards": shard_count, "v": self.version,
                                        "abort_rate": self.bound.rate if self.bound else None,
                                        "abort_min": self.bound.min_outcomes if self.bound else None})
            self.store._event(tx, "plan", self.version, None, None, None,
                              {"records": record_count, "shards": shard_count})
            # Nothing left to infer (no shards, or everything carried): sealed at planning, a run
            # that starts and completes at once.
            if tx.one(self.q.SEAL, {"v": self.version}) is not None:
                self.store._lineage_sealed(tx, self.version)
        self._planning(body)

    def abort(self) -> None:
        def body(tx: Tx) -> None:
            row = tx.one(self.q.PLAN_TOKEN_ANY, {"v": self.version})
            if row is not None and row[0] == self.token:
                self.store._delete_version(tx, self.version)
        # On failure a half-written plan stays invisible in the 'planning' state and is replaced next time.
        with contextlib.suppress(StoreError):
            self.store._write(body, retry=False)
