"""What every port of the store is written over: a backend's transactions and SQL, the events
each operation appends, the clock, and the mapping of rows, each written once (see
`batchline.store.core`)."""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol, TypeVar

import orjson

from batchline.acl import Acl
from batchline.errors import NoSuchVersion, StoreError
from batchline.store.model import (
    WRITE_BATCH_ROWS,
    Coverage,
    DeadLetterBound,
    DeadLetterRow,
    Event,
    Halt,
    JobInfo,
    Lease,
    PlannedRecord,
    Publication,
    ResultRow,
    RouteTotals,
    StoredDeadLetter,
    StoredResult,
    Written,
    within,
)
from batchline.store.rights import key_hash

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

def acl_json(acl: Acl | None) -> str | None:
    """An ACL as the store's column holds it (`Acl.to_json`), NULL for none."""
    return None if acl is None else acl.to_json()


def input_columns(r: PlannedRecord) -> tuple[str | None, int]:
    """A planned record's text and position, as the records table holds them (its ACL is the
    record's own, `PlannedRecord.acl`)."""
    assert r.input is not None
    return r.input.text, r.input.position


acl_value = Acl.from_json


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
    """A lease's fence, with its key (`k`, which PostgreSQL's fences read back) and the key's hash
    (`kh`, which the shard's row is compared with)."""
    return {"v": lease.version, "s": lease.shard_no, "w": lease.owner, "e": lease.epoch, "k": lease.key,
            "kh": key_hash(lease.key)}


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


class StoreBase(ABC):
    """A store over a backend: what the backend brings, and what every port's operations share."""

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

    def _planned(self, version: str) -> None:  # noqa: B027 - a hook a backend may fill, not one it must
        """After a plan commits: what the backend does to serve its claims well (nothing, by default)."""

    @abstractmethod
    def _put(self, tx: Tx, lease: Lease, rows: Sequence[ResultRow]) -> Written:
        """Fenced put-if-absent of results, counting them (and their tokens) on the shard and
        moving its pieces started past theirs. Fenced: nothing is written unless the lease is
        held and its version open, and a row whose piece the shard no longer covers (`within`)
        is not written."""

    @abstractmethod
    def _insert_dead(self, tx: Tx, lease: Lease, rows: Sequence[DeadLetterRow]) -> Written:
        """Fenced insert of dead letters for ids without a result, counted on the shard (as
        `_put` is fenced)."""

    def _held_rows(self, tx: Tx, lease: Lease, rows: Sequence[P]) -> tuple[Written, Sequence[P]]:
        """For a store that fences in its own statements before it writes: the lease's fence in
        this transaction (its row locked), and the rows of the pieces the shard still covers."""
        held = tx.one(self.q.FENCE_LOCK, fence(lease))
        if held is None:
            return Written(False, False, 0), []
        if not held[2]:
            return Written(True, False, 0), []
        return Written(True, True, 0), [r for r in rows if within(r.piece, held[0], held[1])]

    @abstractmethod
    def _insert_records(self, tx: Tx, version: str, rows: Sequence[PlannedRecord],
                        acl_nos: Sequence[int | None]) -> None:
        """Bulk insert of planned records, each with the number of its ACL in the version's
        `acls` (`acl_nos`, in order); raises DuplicateKey on an id already planned."""

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

    def identity(self) -> str:
        """Who the store is: made once with it and kept whatever its URL or path, so a target
        it publishes into knows its owner however the store is reached (`targets.owner`)."""
        row = self._read(lambda tx: tx.one(self.q.STORE_IDENTITY))
        assert row is not None
        return str(row[0])

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

    # --- what several ports read ----------------------------------------------------------

    def _publications(self, tx: Tx, name: str) -> list[Publication]:
        return [Publication(int(r[0]), r[1], r[2], r[3], r[4], r[5], r[6],
                            self._unjson(r[7]) if r[7] is not None else None, float(r[8]),
                            self._unjson(r[9]) if r[9] is not None else None)
                for r in tx.all(self.q.PUBLICATIONS, {"name": name})]

    def _row(self, stmt: str, params: Params) -> Row:
        """The one row an aggregate statement returns."""
        row = self._read(lambda tx: tx.one(stmt, params))
        assert row is not None, stmt
        return row

    def _job(self, row: Row) -> JobInfo:
        return JobInfo(version=row[0], name=row[1], state=row[2], spec=self._unjson(row[3]),
                       record_count=int(row[4]), shard_count=int(row[5]), created_at=float(row[6]),
                       sealed_at=float(row[7]) if row[7] is not None else None, carried=int(row[8]),
                       bound=_bound(row[9], row[10]), halt=self._halt(row[11]), planned_dead=int(row[12] or 0),
                       opened_at=float(row[13]) if row[13] is not None else None)

    def _halt(self, value: Any) -> Halt | None:
        return Halt.from_json(self._unjson(value)) if value is not None else None

    def job(self, version: str) -> JobInfo | None:
        row = self._read(lambda tx: tx.one(self.q.JOB, {"v": version}))
        return self._job(row) if row else None

    def jobs(self) -> list[JobInfo]:
        return [self._job(r) for r in self._read(lambda tx: tx.all(self.q.JOBS))]

    def _by_ids(self, stmt: str, version: str, record_ids: Sequence[str]) -> list[Row]:
        out: list[Row] = []
        for chunk in chunks(record_ids, 10_000):
            params = {"v": version, "ids": self._list(list(chunk))}
            out.extend(self._read(lambda tx, params=params: tx.all(stmt, params)))  # type: ignore[misc]
        return out

    def _no_version(self, version: str) -> NoSuchVersion:
        return NoSuchVersion(version, self.where())

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

    def _figures(self, tx: Tx, version: str) -> tuple[str, DeadLetterBound | None, int, int] | None:
        """The version's state, its bound, and the dead letters and outcomes it computed."""
        row = tx.one(self.q.DEAD_LETTER_FIGURES, {"v": version})
        if row is None:
            return None
        state, rate, minimum, results, dead = row
        return str(state), _bound(rate, minimum), int(dead), int(results) + int(dead)

    def _halt_in(self, tx: Tx, version: str) -> Halt | None:
        row = tx.one(self.q.JOB_HALT, {"v": version})
        return self._halt(row[1]) if row is not None and row[0] == "halted" else None


def _bound(rate: Any, minimum: Any) -> DeadLetterBound | None:
    return DeadLetterBound(float(rate), int(minimum)) if rate is not None and minimum is not None else None


def _scalar(tx: Tx, stmt: str, params: Params | None = None) -> Any:
    row = tx.one(stmt, params)
    return row[0] if row is not None else None
