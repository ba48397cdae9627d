"""The PostgreSQL store: the shard table, results and event log for many machines.

It behaves as the SQLite store does (the same contract suite runs over both);
what differs is how it keeps the rules under real concurrency:

- A claim picks the lowest open shard with `FOR UPDATE SKIP LOCKED`, so
  claimers never wait on each other's rows. Every fenced write first locks its
  shard row while checking (owner, epoch), so no claim can take the shard over
  between the check and the write: the fence holds to the commit.
- Every time comes from the server (`batchline_now()`: `now()` plus the test
  clock's offset).
- A put is COPY into a staging table and one `INSERT ... SELECT ... ON
  CONFLICT DO NOTHING` under the fence (tiny flushes: one statement with the
  rows as arrays), committed without waiting for the WAL flush: see
  `postgres_sql.PUT_FROM_STAGE` for why that loses nothing that matters.
- A dropped connection (a terminated backend, a restarted server, a network
  blip) is reconnected with backoff for up to `reconnect_seconds`, and the
  operation is retried. Retrying is safe because every operation is either
  idempotent (renew, complete, put-if-absent, reads) or carries a token that
  its events record (`events.op`): a retry whose token is already there knows
  the first try committed, reads its outcome back, and applies nothing twice.
  Planning is not retried: a planner that loses its connection stops, and the
  next one starts over, as after any planner death.

All SQL lives in `postgres_sql.py`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import psycopg
from psycopg import errors, sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.types.json import Json, Jsonb

from batchline.errors import StoreError
from batchline.store import postgres_sql as q
from batchline.store.base import (
    WRITE_BATCH_ROWS,
    ChargeResult,
    Coverage,
    DeadLetterRow,
    DuplicateRecord,
    Event,
    JobInfo,
    JobStatus,
    Lease,
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
)

T = TypeVar("T")
log = logging.getLogger("batchline.store")
Cursor = psycopg.Cursor[Any]

# How long an operation keeps trying to get its connection back before the
# worker gives up (exit 4). Long enough for a server restart or a failover.
DEFAULT_RECONNECT_SECONDS = 120.0
# Flushes at least this large go through COPY and a staging table (measured
# about 1.6 times the rows/s of arrays at 500 rows); smaller ones as arrays in
# one statement, which costs fewer round trips.
COPY_MIN_ROWS = 64

# Connection settings applied unless the URL sets them: a name to find the
# store's sessions by, and keepalives so a vanished server is noticed in
# seconds rather than at the kernel's TCP timeout.
CONNECTION_DEFAULTS = {
    "application_name": "batchline",
    "connect_timeout": "10",
    "keepalives": "1",
    "keepalives_idle": "10",
    "keepalives_interval": "5",
    "keepalives_count": "3",
}


class _Missing:
    """The outcome of an operation whose token is not in the event log: not applied."""


_MISSING = _Missing()


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


def _acl_json(acl: Any) -> str | None:
    return None if acl is None else json.dumps(acl, sort_keys=True, separators=(",", ":"))


def _acl_value(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def _jsonb(value: Any) -> Jsonb:
    return Jsonb(value, dumps=lambda o: json.dumps(o, default=str))


def _stored_result(r: Sequence[Any]) -> StoredResult:
    return StoredResult(r[0], r[1], _acl_value(r[2]), r[3], r[4], r[5], r[6], r[7], r[8], r[9], r[10], r[11],
                        r[12])


def _chunks(rows: Sequence[T], size: int = WRITE_BATCH_ROWS) -> Iterator[Sequence[T]]:
    for i in range(0, len(rows), size):
        yield rows[i:i + size]


def redact(url: str) -> str:
    """The URL without its password, for messages."""
    try:
        params = conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return "postgresql://..."
    host, port, user = params.get("host", "localhost"), params.get("port", 5432), params.get("user")
    return f"postgresql://{f'{user}@' if user else ''}{host}:{port}/{params.get('dbname', '')}"


def partition_name(table: str, version: str) -> str:
    # Identifiers are at most 63 bytes and versions are free text: name by digest.
    return f"{table}_{hashlib.sha256(version.encode()).hexdigest()[:24]}"


class PostgresStore:
    def __init__(self, url: str, *, reconnect_seconds: float = DEFAULT_RECONNECT_SECONDS,
                 migrate: bool = True) -> None:
        self.url = url
        self.reconnect_seconds = reconnect_seconds
        try:
            given = conninfo_to_dict(url)
        except psycopg.ProgrammingError as exc:
            raise StoreError(f"bad PostgreSQL URL: {exc}") from None
        self._conninfo = make_conninfo(url, **{k: v for k, v in CONNECTION_DEFAULTS.items() if k not in given})
        self._conn: psycopg.Connection[Any] | None = None
        self._staged = False
        self.reconnects = 0
        try:
            self._connection()
        except psycopg.Error as exc:
            raise StoreError(f"cannot connect to PostgreSQL store {redact(url)}: {_first_line(exc)}") from None
        if migrate:
            self._migrate()

    # --- connections, retries ---------------------------------------------------------

    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(self._conninfo, autocommit=True)
            self._staged = False
        return self._conn

    def _drop_connection(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(psycopg.Error):
                self._conn.close()
        self._conn = None

    @staticmethod
    def _retryable(conn: psycopg.Connection[Any] | None, exc: psycopg.Error) -> bool:
        if isinstance(exc, errors.SerializationFailure | errors.DeadlockDetected):
            return True  # rolled back whole: applying again is the first application
        if isinstance(exc, errors.AdminShutdown | errors.CrashShutdown | errors.CannotConnectNow):
            return True
        if conn is None or conn.closed or conn.broken:
            return isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError)
        return False

    def _run(self, body: Callable[[Cursor], T], *, recover: Callable[[Cursor], T | _Missing] | None = None,
             retry: bool = True, isolation: psycopg.IsolationLevel | None = None) -> T:
        """Runs `body` in one transaction. After a lost connection it reconnects and, when the
        outcome of the lost try is unknown, asks `recover` whether it committed before trying again."""
        started: float | None = None
        delay = 0.05
        while True:
            conn: psycopg.Connection[Any] | None = None
            try:
                conn = self._connection()
                with conn.cursor() as cur:
                    if started is not None and recover is not None:
                        found = recover(cur)
                        if not isinstance(found, _Missing):
                            return found
                    with conn.transaction():
                        if isolation is not None:
                            cur.execute(sql.SQL("SET TRANSACTION ISOLATION LEVEL {}").format(
                                sql.SQL(isolation.name.replace("_", " "))))
                        return body(cur)
            except psycopg.Error as exc:
                if not (retry and self._retryable(conn if conn is not None else self._conn, exc)):
                    if conn is not None and (conn.broken or conn.closed):
                        self._drop_connection()
                    raise StoreError(f"store {redact(self.url)}: {_first_line(exc)}") from exc
                self._drop_connection()
                now = time.monotonic()
                if started is None:
                    started = now
                    log.warning("lost the connection to %s (%s); reconnecting", redact(self.url), _first_line(exc))
                elif now - started > self.reconnect_seconds:
                    raise StoreError(f"lost the connection to {redact(self.url)} and could not get it back "
                                     f"within {self.reconnect_seconds:.0f}s: {_first_line(exc)}") from exc
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
                self.reconnects += 1

    def _read(self, query: str | sql.Composed, params: Sequence[Any] | dict[str, Any] | None = None) -> list[Any]:
        def body(cur: Cursor) -> list[Any]:
            cur.execute(query, params)
            return cur.fetchall()
        return self._run(body)

    def _migrate(self) -> None:
        current = int(self._read(q.CURRENT_SCHEMA)[0][0]) if self._read(q.HAS_MIGRATIONS)[0][0] else 0
        if current == q.SCHEMA_VERSION:
            return
        if current > q.SCHEMA_VERSION:
            raise StoreError(f"store {redact(self.url)} has schema {current}, newer than this batchline "
                             f"({q.SCHEMA_VERSION}); upgrade batchline")

        def body(cur: Cursor) -> None:
            cur.execute("SELECT pg_advisory_xact_lock(%s)", (q.MIGRATION_LOCK,))
            cur.execute(q.MIGRATIONS_TABLE)
            cur.execute(q.CURRENT_SCHEMA)
            row = cur.fetchone()
            applied = int(row[0]) if row else 0
            for number, description, statements in q.MIGRATIONS:
                if number > applied:
                    cur.execute(statements.encode())
                    cur.execute("INSERT INTO schema_migrations (version, description) VALUES (%s, %s)",
                                (number, description))

        try:
            self._run(body, retry=False)
        except StoreError as exc:
            if isinstance(exc.__cause__, errors.InsufficientPrivilege):
                raise StoreError(f"store {redact(self.url)} has schema {current}, this batchline needs "
                                 f"{q.SCHEMA_VERSION}, and this role may not migrate it: run any batchline "
                                 f"command once as the store's owner") from None
            raise

    def close(self) -> None:
        self._drop_connection()

    # --- clock --------------------------------------------------------------------------

    def now(self) -> float:
        return float(self._read(q.NOW)[0][0])

    def shift_clock(self, seconds: float) -> None:
        self._run(lambda cur: cur.execute(q.SHIFT_CLOCK, (seconds,)) and None)

    # --- events -------------------------------------------------------------------------

    @staticmethod
    def _event(cur: Cursor, kind: str, version: str | None, worker: str | None, shard_no: int | None,
               epoch: int | None, detail: dict[str, Any] | None = None, op: uuid.UUID | None = None) -> None:
        cur.execute(q.INSERT_EVENT, (version, kind, worker, shard_no, epoch, _jsonb(detail or {}), op))

    @staticmethod
    def _marks(cur: Cursor, op: uuid.UUID) -> list[_Mark]:
        cur.execute(q.EVENTS_BY_OP, (op,))
        return [_Mark(*r) for r in cur.fetchall()]

    def log_event(self, kind: str, *, version: str | None = None, worker: str | None = None,
                  shard_no: int | None = None, epoch: int | None = None,
                  detail: dict[str, Any] | None = None) -> None:
        op = uuid.uuid4()

        def recover(cur: Cursor) -> _Missing | None:
            return None if self._marks(cur, op) else _MISSING

        self._run(lambda cur: self._event(cur, kind, version, worker, shard_no, epoch, detail, op),
                  recover=recover)

    def events(self, version: str | None = None, kinds: Sequence[str] | None = None) -> list[Event]:
        query = q.EVENTS + " WHERE true"
        params: list[Any] = []
        if version is not None:
            query += " AND version = %s"
            params.append(version)
        if kinds:
            query += " AND kind = ANY(%s)"
            params.append(list(kinds))
        rows = self._read(query + " ORDER BY id", params)
        return [Event(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7]) for r in rows]

    # --- jobs and planning ---------------------------------------------------------------

    @staticmethod
    def _job(row: Sequence[Any]) -> JobInfo:
        return JobInfo(version=row[0], name=row[1], state=row[2], spec=row[3], record_count=row[4],
                       shard_count=row[5], created_at=row[6], sealed_at=row[7], carried=int(row[8]))

    def job(self, version: str) -> JobInfo | None:
        rows = self._read(q.JOB, (version,))
        return self._job(rows[0]) if rows else None

    def jobs(self) -> list[JobInfo]:
        return [self._job(r) for r in self._read(q.JOBS)]

    def begin_plan(self, version: str, name: str, spec: dict[str, Any]) -> PostgresPlanWriter:
        token = uuid.uuid4().hex

        def body(cur: Cursor) -> None:
            # Serialises planners of one version; different versions plan side by side.
            cur.execute(q.PLAN_LOCK, (version,))
            cur.execute(q.JOB_STATE_FOR_UPDATE, (version,))
            row = cur.fetchone()
            if row is not None and row[0] != "planning":
                raise StoreError(f"version {version} is already planned")
            self._ensure_partitions(cur, version)
            self._delete_version(cur, version)
            cur.execute(q.INSERT_JOB, (version, name, Json(spec), token))

        self._run(body, retry=False)
        return PostgresPlanWriter(self, version, token)

    @staticmethod
    def _ensure_partitions(cur: Cursor, version: str) -> None:
        for table in q.PARTITIONED:
            cur.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} PARTITION OF {} FOR VALUES IN ({})").format(
                sql.Identifier(partition_name(table, version)), sql.Identifier(table), sql.Literal(version)))

    @staticmethod
    def _delete_version(cur: Cursor, version: str) -> None:
        for table in (*q.PARTITIONED, *q.PER_VERSION):
            cur.execute(sql.SQL("DELETE FROM {} WHERE version = %s").format(sql.Identifier(table)), (version,))

    # --- leases --------------------------------------------------------------------------

    def claim(self, worker: str, version: str | None = None, routes: Sequence[str] | None = None) -> Lease | None:
        op = uuid.uuid4()
        route_list = list(routes) if routes is not None else None

        def body(cur: Cursor) -> Lease | None:
            if version is None:
                cur.execute(q.READY_JOBS)
                versions = [r[0] for r in cur.fetchall()]
            else:
                versions = [version]
            for v in versions:
                cur.execute(q.PICK_SHARD, {"v": v, "routes": route_list})
                row = cur.fetchone()
                if row is not None:
                    return self._grant(cur, v, row, worker, op)
            return None

        def recover(cur: Cursor) -> Lease | _Missing | None:
            for mark in self._marks(cur, op):
                if mark.kind == "claim" and mark.version is not None and mark.shard_no is not None:
                    cur.execute(q.LEASE_BY_CLAIM, (mark.version, mark.shard_no))
                    slice_, count, expires, _owner, _epoch, route, batch = cur.fetchone()  # type: ignore[misc]
                    # If the lease was lost meanwhile, the first fenced write says so.
                    return Lease(mark.version, mark.shard_no, worker, int(mark.epoch or 0), slice_, count,
                                 float(expires or 0.0), route, batch)
            return _MISSING

        return self._run(body, recover=recover)

    def _grant(self, cur: Cursor, version: str, row: Sequence[Any], worker: str, op: uuid.UUID) -> Lease:
        shard_no, state, old_owner, old_epoch, slice_, count, now, lease_seconds, route, batch = row
        expired = _jsonb({"reclaimed_by": worker}) if state == "leased" else None
        cur.execute(q.GRANT_SHARD, {"w": worker, "now": now, "lease": float(lease_seconds), "v": version,
                                    "s": shard_no, "old_owner": old_owner, "old_epoch": old_epoch,
                                    "expired": expired, "op": op})
        granted = cur.fetchone()
        assert granted is not None
        return Lease(version=version, shard_no=shard_no, owner=worker, epoch=int(granted[0]), slice=slice_,
                     record_count=count, expires=float(granted[1]), route=route, batch=batch)

    @staticmethod
    def _fence_params(lease: Lease) -> dict[str, Any]:
        return {"v": lease.version, "s": lease.shard_no, "w": lease.owner, "e": lease.epoch}

    def _refusal(self, cur: Cursor, lease: Lease, op_name: str, op: uuid.UUID,
                 detail: dict[str, Any] | None = None) -> _Lost:
        self._event(cur, "stale_epoch", lease.version, lease.owner, lease.shard_no, lease.epoch,
                    {"op": op_name, **(detail or {})}, op)
        return _Lost(op_name)

    def _recover_refusal(self, op: uuid.UUID) -> Callable[[Cursor], _Lost | _Missing]:
        """For idempotent fenced writes: only a committed refusal must not be logged twice."""
        def recover(cur: Cursor) -> _Lost | _Missing:
            for mark in self._marks(cur, op):
                if mark.kind == "stale_epoch":
                    return _Lost(str(mark.detail.get("op", "write")))
            return _MISSING
        return recover

    def renew(self, lease: Lease) -> Lease | None:
        op = uuid.uuid4()

        def body(cur: Cursor) -> float | _Lost:
            cur.execute(q.RENEW, self._fence_params(lease))
            row = cur.fetchone()
            if row is None:
                return self._refusal(cur, lease, "renew", op)
            return float(row[0])

        expires = self._run(body, recover=self._recover_refusal(op))
        if isinstance(expires, _Lost):
            return None
        return replace(lease, expires=expires)

    def release(self, lease: Lease, reason: str) -> bool:
        op = uuid.uuid4()

        def body(cur: Cursor) -> bool:
            cur.execute(q.RELEASE, self._fence_params(lease))
            released = cur.rowcount == 1
            if released:
                self._event(cur, "release", lease.version, lease.owner, lease.shard_no, lease.epoch,
                            {"reason": reason}, op)
            else:
                self._refusal(cur, lease, "release", op)
            return released

        def recover(cur: Cursor) -> bool | _Missing:
            marks = self._marks(cur, op)
            return marks[0].kind == "release" if marks else _MISSING

        return self._run(body, recover=recover)

    def set_batch(self, lease: Lease, batch: dict[str, Any] | None) -> Lease:
        op = uuid.uuid4()

        def body(cur: Cursor) -> _Lost | None:
            cur.execute(q.SET_BATCH, {**self._fence_params(lease), "batch": _jsonb(batch) if batch is not None else None})
            return None if cur.rowcount == 1 else self._refusal(cur, lease, "batch", op)

        if isinstance(self._run(body, recover=self._recover_refusal(op)), _Lost):
            raise _lost(lease, "batch")
        return replace(lease, batch=batch)

    def await_provider(self, lease: Lease, batch: dict[str, Any], poll_in: float) -> None:
        op = uuid.uuid4()

        def body(cur: Cursor) -> _Lost | None:
            cur.execute(q.SHARD_FOR_AWAIT, (lease.version, lease.shard_no))
            row = cur.fetchone()
            if row is None:
                raise StoreError(f"no shard {lease.shard_no} in {lease.version}")
            state, owner, epoch, previous = row
            if (owner, epoch) == (lease.owner, lease.epoch) and state == "submitted" and previous == batch:
                return None  # a retry of the same parking
            cur.execute(q.AWAIT_PROVIDER, {**self._fence_params(lease), "batch": _jsonb(batch),
                                           "poll_in": float(poll_in)})
            if cur.rowcount != 1:
                return self._refusal(cur, lease, "await_provider", op)
            fresh = previous is None or previous.get("batch_id") != batch.get("batch_id")
            self._event(cur, "submitted" if fresh else "provider_wait", lease.version, lease.owner,
                        lease.shard_no, lease.epoch,
                        {"batch_id": batch.get("batch_id"), "requests": batch.get("request_count")}, op)
            return None

        if isinstance(self._run(body, recover=self._recover_refusal(op)), _Lost):
            raise _lost(lease, "await_provider")

    def complete(self, lease: Lease) -> None:
        op = uuid.uuid4()

        def body(cur: Cursor) -> _Lost | None:
            cur.execute(q.SHARD_FOR_COMPLETE, (lease.version, lease.shard_no))
            row = cur.fetchone()
            if row is None:
                raise StoreError(f"no shard {lease.shard_no} in {lease.version}")
            state, owner, epoch, count, results, dead = row
            if (owner, epoch) != (lease.owner, lease.epoch) or state not in ("leased", "done"):
                return self._refusal(cur, lease, "complete", op, {"current_epoch": epoch})
            if state == "leased":
                if results + dead != count:
                    raise StoreError(f"shard {lease.shard_no} of {lease.version} has {count - results - dead} "
                                     f"records without an outcome; not completing it")
                self._finish_shard(cur, lease, count, results, dead, op)
            # state == 'done' for this owner and epoch: a retried completion after a
            # lost acknowledgement, which succeeds again.
            return None

        outcome = self._run(body, recover=self._recover_refusal(op))
        if isinstance(outcome, _Lost):
            raise _lost(lease, "completion")

    def _finish_shard(self, cur: Cursor, lease: Lease, count: int, results: int, dead: int,
                      op: uuid.UUID) -> None:
        detail = _jsonb({"records": count, "results": results, "dead_letters": dead})
        cur.execute(q.FINISH_SHARD, {**self._fence_params(lease), "detail": detail, "op": op})
        cur.execute(q.SEAL, {"v": lease.version, "w": lease.owner, "op": op})

    def open_versions(self) -> list[str]:
        return [r[0] for r in self._read(q.OPEN_VERSIONS)]

    def has_open_shards(self, version: str | None = None, routes: Sequence[str] | None = None) -> bool:
        params = {"v": version, "routes": list(routes) if routes is not None else None}
        rows = self._read(q.HAS_OPEN if version is None else q.HAS_OPEN_VERSION, params)
        return bool(rows[0][0])

    # --- records -------------------------------------------------------------------------

    def answered(self, version: str, record_ids: Sequence[str]) -> set[str]:
        out: set[str] = set()
        for chunk in _chunks(record_ids, 10_000):
            out.update(r[0] for r in self._read(q.ANSWERED, {"v": version, "ids": list(chunk)}))
        return out

    def attempts(self, version: str, record_ids: Sequence[str]) -> dict[str, int]:
        out: dict[str, int] = {}
        for chunk in _chunks(record_ids, 10_000):
            out.update((r[0], int(r[1])) for r in self._read(q.ATTEMPTS, (version, list(chunk))))
        return out

    def put_results(self, lease: Lease, rows: Sequence[ResultRow]) -> int:
        inserted = 0
        for chunk in _chunks(rows):
            op = uuid.uuid4()

            def body(cur: Cursor, chunk: Sequence[ResultRow] = chunk, op: uuid.UUID = op) -> int | _Lost:
                if len(chunk) >= COPY_MIN_ROWS:
                    self._stage(cur, chunk)
                    cur.execute(q.PUT_FROM_STAGE, self._fence_params(lease))
                else:
                    cur.execute(q.PUT_RESULTS, {
                        **self._fence_params(lease),
                        "ids": [r.record_id for r in chunk], "outputs": [r.output for r in chunk],
                        "labels": [r.label for r in chunk], "acls": [_acl_json(r.acl) for r in chunk], "attempts": [r.attempt for r in chunk],
                        "tin": [r.input_tokens for r in chunk], "tout": [r.output_tokens for r in chunk],
                        "models": [r.model for r in chunk]})
                fenced, n = cur.fetchone()  # type: ignore[misc]
                if not fenced:
                    return self._refusal(cur, lease, "put", op)
                return int(n)

            # Put-if-absent: a retry after a commit whose acknowledgement was lost
            # finds every row present and inserts none (and counts none).
            n = self._run(body, recover=self._recover_refusal(op))
            if isinstance(n, _Lost):
                raise _lost(lease, "put")
            inserted += n
        return inserted

    def _stage(self, cur: Cursor, rows: Sequence[ResultRow]) -> None:
        if not self._staged:
            cur.execute(q.CREATE_STAGE)
            self._staged = True
        with cur.copy(q.COPY_STAGE) as copy:
            copy.set_types(q.STAGE_TYPES)
            for r in rows:
                copy.write_row((r.record_id, r.output, r.label, _acl_json(r.acl), r.attempt, r.input_tokens,
                                r.output_tokens, r.model))

    def charge_attempt(self, lease: Lease, record_id: str, kind: str, error: str, acl: Any,
                       max_attempts: int) -> ChargeResult:
        op = uuid.uuid4()

        def body(cur: Cursor) -> ChargeResult | _Lost:
            cur.execute(q.FENCE_LOCK, self._fence_params(lease))
            if cur.fetchone() is None:
                return self._refusal(cur, lease, "charge", op)
            cur.execute(q.IS_ANSWERED, {"v": lease.version, "r": record_id})
            row = cur.fetchone()
            if row is not None and row[0]:
                return ChargeResult(attempts=0, dead_lettered=False)
            cur.execute(q.CHARGE, (lease.version, record_id, kind, error))
            attempts = int(cur.fetchone()[0])  # type: ignore[index]
            self._event(cur, "attempt_failed", lease.version, lease.owner, lease.shard_no, lease.epoch,
                        {"record_id": record_id, "kind": kind, "attempts": attempts, "error": error[:500]}, op)
            result = ChargeResult(attempts=attempts, dead_lettered=attempts >= max_attempts)
            if result.dead_lettered:
                self._insert_dead(cur, lease, [DeadLetterRow(record_id, kind, error, acl, attempts)])
            return result

        def recover(cur: Cursor) -> ChargeResult | _Lost | _Missing:
            for mark in self._marks(cur, op):
                if mark.kind == "stale_epoch":
                    return _Lost("charge")
                if mark.kind == "attempt_failed":
                    attempts = int(mark.detail["attempts"])
                    return ChargeResult(attempts=attempts, dead_lettered=attempts >= max_attempts)
            return _MISSING

        result = self._run(body, recover=recover)
        if isinstance(result, _Lost):
            raise _lost(lease, "charge")
        return result

    def dead_letter(self, lease: Lease, rows: Sequence[DeadLetterRow]) -> int:
        n = 0
        for chunk in _chunks(rows):
            op = uuid.uuid4()

            def body(cur: Cursor, chunk: Sequence[DeadLetterRow] = chunk, op: uuid.UUID = op) -> int | _Lost:
                fenced, inserted = self._insert_dead(cur, lease, chunk)
                return inserted if fenced else self._refusal(cur, lease, "dead_letter", op)

            got = self._run(body, recover=self._recover_refusal(op))
            if isinstance(got, _Lost):
                raise _lost(lease, "dead_letter")
            n += got
        return n

    def _insert_dead(self, cur: Cursor, lease: Lease, rows: Sequence[DeadLetterRow]) -> tuple[bool, int]:
        cur.execute(q.DEAD_LETTER, {
            **self._fence_params(lease),
            "ids": [r.record_id for r in rows], "kinds": [r.kind for r in rows],
            "errors": [r.error for r in rows], "acls": [_acl_json(r.acl) for r in rows],
            "attempts": [r.attempts for r in rows]})
        fenced, n = cur.fetchone()  # type: ignore[misc]
        return bool(fenced), int(n)

    # --- reading -------------------------------------------------------------------------

    def status(self, version: str, window_seconds: float = 300.0) -> JobStatus:
        def body(cur: Cursor) -> JobStatus:
            cur.execute(q.JOB, (version,))
            row = cur.fetchone()
            if row is None:
                raise StoreError(f"no job version {version!r} in {redact(self.url)}")
            job = self._job(row)
            cur.execute(q.NOW)
            now = float(cur.fetchone()[0])  # type: ignore[index]
            shards = {"ready": 0, "leased": 0, "done": 0, "submitted": 0}
            results = dead = 0
            cur.execute(q.STATUS_SHARDS, (version,))
            for state, n, r, d in cur.fetchall():
                shards[state] = int(n)
                results += int(r)
                dead += int(d)
            cur.execute(q.DEAD_BY_KIND, (version,))
            by_kind = {k: int(n) for k, n in cur.fetchall()}
            cur.execute(q.LEASES_LOST, (version,))
            lost = int(cur.fetchone()[0])  # type: ignore[index]
            cur.execute(q.RECENT, (version, now - window_seconds))
            recent = int(cur.fetchone()[0])  # type: ignore[index]
            return JobStatus(version=version, name=job.name, state=job.state, records=job.record_count,
                             results=results, dead_letters=dead, shards=shards, dead_letters_by_kind=by_kind,
                             leases_lost=lost, records_done_last_minutes=recent, window_seconds=window_seconds,
                             now=now)

        return self._run(body)

    def shard_rows(self, version: str) -> list[ShardRow]:
        return [ShardRow(*r) for r in self._read(q.SHARD_ROWS, (version,))]

    def result_histogram(self, version: str, start: float, width: float, bins: int) -> list[tuple[int, int, int]]:
        rows = self._read(q.RESULT_HISTOGRAM, {"v": version, "start": start, "width": width,
                                               "last": max(bins - 1, 0)})
        return [(int(a), int(b), int(n)) for a, b, n in rows]

    def route_totals(self, version: str) -> dict[str, RouteTotals]:
        computed = {r[0]: r[1:] for r in self._read(q.ROUTE_RESULTS, (version,))}
        out: dict[str, RouteTotals] = {}
        for route, shards, records, dead in self._read(q.ROUTE_SHARDS, (version,)):
            n, tin, tout = computed.get(route, (0, 0, 0))
            out[route] = RouteTotals(records=int(records), results=int(n), dead_letters=int(dead),
                                     input_tokens=int(tin), output_tokens=int(tout), shards=int(shards))
        return out

    def _pages(self, query: str, version: str, page_size: int) -> Iterator[Sequence[Any]]:
        # Keyset pages, each its own short statement: a reader never holds a
        # snapshot open for the whole export, and a page retried after a lost
        # connection starts where the last one ended.
        last = ""
        while True:
            rows = self._read(query, (version, last, page_size))
            if not rows:
                return
            yield from rows
            last = rows[-1][0]

    def iter_results(self, version: str, page_size: int = 5000, *,
                     computed_only: bool = False) -> Iterator[StoredResult]:
        query = q.COMPUTED_RESULTS_PAGE if computed_only else q.RESULTS_PAGE
        for r in self._pages(query, version, page_size):
            yield _stored_result(r)

    def results_for(self, version: str, record_ids: Sequence[str]) -> dict[str, StoredResult]:
        out: dict[str, StoredResult] = {}
        for chunk in _chunks(record_ids, 10_000):
            out.update((r[0], _stored_result(r)) for r in self._read(q.RESULTS_FOR, (version, list(chunk))))
        return out

    def token_totals(self, version: str) -> tuple[int, int]:
        tin, tout = self._read(q.TOKEN_TOTALS, (version,))[0]
        return int(tin), int(tout)

    def run_throughput(self, version: str) -> float:
        records, seconds = self._read(q.RUN_THROUGHPUT, (version,))[0]
        return float(records) / float(seconds) if records and seconds and seconds > 0 else 0.0

    def iter_dead_letters(self, version: str) -> Iterator[StoredDeadLetter]:
        for r in self._pages(q.DEAD_LETTERS_PAGE, version, 5000):
            yield StoredDeadLetter(r[0], r[1], r[2], r[3], _acl_value(r[4]), r[5], r[6], r[7])

    def planned_ids(self, version: str) -> Iterator[str]:
        for r in self._pages(q.PLANNED_PAGE, version, 20_000):
            yield r[0]

    def resolve_name(self, name: str) -> str | None:
        rows = self._read(q.RESOLVE_NAME, (name,))
        return rows[0][0] if rows else None

    # --- validation and publication --------------------------------------------------------

    def coverage(self, version: str, sample: int = 10) -> Coverage:
        def body(cur: Cursor) -> Coverage:
            def one(query: str, params: Any) -> int:
                cur.execute(query, params)
                return int(cur.fetchone()[0])  # type: ignore[index]

            # Matching millions of ids is one hash join; probing an index per row
            # (what the planner picks on freshly loaded, unvacuumed partitions)
            # visits the heap once per row and takes twice as long.
            cur.execute(q.COVERAGE_SETTINGS)
            records = one(q.COUNT_RECORDS, (version,))
            results = one(q.COUNT_RESULTS, (version,))
            dead = one(q.COUNT_DEAD, (version,))
            matched = one(q.COUNT_MATCHED, {"v": version})
            both = one(q.COUNT_BOTH, {"v": version})
            missing = records - (matched - both)
            unexpected = results + dead - matched
            samples: list[tuple[str, ...]] = []
            for query, count in ((q.MISSING_SAMPLE, missing), (q.UNEXPECTED_SAMPLE, unexpected)):
                if count:
                    cur.execute(query, {"v": version, "n": sample})
                    samples.append(tuple(r[0] for r in cur.fetchall()))
                else:
                    samples.append(())
            return Coverage(records, missing, unexpected, both, samples[0], samples[1])

        # Fresh planner statistics for the version's partitions: they were bulk-loaded
        # and may never have been analysed, and without row counts the planner picks
        # a hash join sized for a few thousand rows that spills to disk.
        def analyse(cur: Cursor) -> None:
            for table in ("records", "results", "dead_letters"):
                cur.execute(sql.SQL(q.ANALYZE_PARTITION).format(sql.Identifier(partition_name(table, version))))

        self._run(analyse)
        # One snapshot for every count, so a count and its sample agree.
        return self._run(body, isolation=psycopg.IsolationLevel.REPEATABLE_READ)

    def label_counts(self, version: str) -> dict[str | None, int]:
        return {r[0]: int(r[1]) for r in self._read(q.LABEL_COUNTS, (version,))}

    def record_validation(self, version: str, passed: bool, report: dict[str, Any]) -> None:
        op = uuid.uuid4()

        def body(cur: Cursor) -> None:
            cur.execute(q.INSERT_VALIDATION, (version, passed, _jsonb(report)))
            self._event(cur, "validate", version, None, None, None, {"passed": passed}, op)

        def recover(cur: Cursor) -> _Missing | None:
            return None if self._marks(cur, op) else _MISSING

        self._run(body, recover=recover)

    def latest_validation(self, version: str) -> ValidationRecord | None:
        rows = self._read(q.LATEST_VALIDATION, (version,))
        return ValidationRecord(version, bool(rows[0][0]), rows[0][1], float(rows[0][2])) if rows else None

    def _point(self, cur: Cursor, name: str, version: str) -> str | None:
        """Moves the pointer in one row update, under the pointer's row lock so two
        publishers of one name queue instead of both reading the same `previous`."""
        cur.execute(q.POINTER_FOR_UPDATE, (name,))
        row = cur.fetchone()
        cur.execute(q.SET_POINTER, (name, version))
        cur.execute(q.VIEW_EXISTS, (sql.Identifier(name).as_string(cur),))
        exists = cur.fetchone()
        if exists is None or not exists[0]:
            cur.execute(sql.SQL(q.CREATE_VIEW).format(view=sql.Identifier(name), name=sql.Literal(name)))
        return row[0] if row else None

    def publish(self, name: str, version: str, who: str, reason: str | None,
                validation: dict[str, Any] | None) -> str | None:
        op = uuid.uuid4()

        def body(cur: Cursor) -> str | None:
            cur.execute(q.PLAN_LOCK, (f"publish:{name}",))
            previous = self._point(cur, name, version)
            cur.execute(q.INSERT_PUBLICATION, (name, version, previous, "publish", who, reason,
                                               _jsonb(validation) if validation else None))
            self._event(cur, "publish", version, None, None, None,
                        {"name": name, "previous": previous, "who": who, "reason": reason}, op)
            return previous

        def recover(cur: Cursor) -> str | _Missing | None:
            marks = self._marks(cur, op)
            return marks[0].detail.get("previous") if marks else _MISSING

        return self._run(body, recover=recover)

    def rollback(self, name: str, who: str, reason: str | None) -> tuple[str, str]:
        op = uuid.uuid4()

        def body(cur: Cursor) -> tuple[str, str]:
            cur.execute(q.PLAN_LOCK, (f"publish:{name}",))
            cur.execute(q.POINTER_FOR_UPDATE, (name,))
            row = cur.fetchone()
            if row is None:
                raise StoreError(f"nothing is published under {name!r}")
            current = row[0]
            cur.execute(q.PREVIOUS_PUBLISHED, (name, current))
            prev = cur.fetchone()
            if prev is None or prev[0] is None:
                raise StoreError(f"{name!r} has no earlier version to roll back to (current: {current})")
            target = str(prev[0])
            cur.execute(q.IS_SEALED, (target,))
            if not cur.fetchone()[0]:  # type: ignore[index]
                raise StoreError(f"cannot roll {name!r} back to {target}: that version was removed")
            self._point(cur, name, target)
            cur.execute(q.INSERT_PUBLICATION, (name, target, current, "rollback", who, reason, None))
            self._event(cur, "rollback", target, None, None, None, {"name": name, "from": current, "who": who}, op)
            return current, target

        def recover(cur: Cursor) -> tuple[str, str] | _Missing:
            marks = self._marks(cur, op)
            if marks and marks[0].version is not None:
                return str(marks[0].detail["from"]), marks[0].version
            return _MISSING

        return self._run(body, recover=recover)

    def publications(self, name: str) -> list[Publication]:
        return [Publication(int(r[0]), r[1], r[2], r[3], r[4], r[5], r[6], r[7], float(r[8]))
                for r in self._read(q.PUBLICATIONS, (name,))]

    def remove_version(self, version: str) -> None:
        def body(cur: Cursor) -> None:
            cur.execute(q.IS_PUBLISHED, (version,))
            if cur.fetchone()[0]:  # type: ignore[index]
                raise StoreError(f"{version} is published; it cannot be removed")
            cur.execute(q.REMOVE_RESULTS, {"v": version})
            for table in q.REMOVE_PER_VERSION:
                cur.execute(sql.SQL("DELETE FROM {} WHERE version = %s").format(sql.Identifier(table)), (version,))
            cur.execute(q.MARK_REMOVED, (version,))
            self._event(cur, "remove", version, None, None, None)

        # Every statement is idempotent, and a second `remove` event is harmless.
        self._run(body)


def _lost(lease: Lease, op: str) -> LeaseLost:
    return LeaseLost(f"lease on shard {lease.shard_no} of {lease.version} lost (epoch {lease.epoch}); "
                     f"{op} refused")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class PostgresPlanWriter:
    """Planning is not retried after a lost connection: the planner stops, and the
    next one discards what this one left in the `planning` state."""

    def __init__(self, store: PostgresStore, version: str, token: str) -> None:
        self.store = store
        self.version = version
        self.token = token

    def _planning(self, body: Callable[[Cursor], T]) -> T:
        def checked(cur: Cursor) -> T:
            cur.execute(q.PLAN_TOKEN, (self.version,))
            row = cur.fetchone()
            if row is None or row[0] != self.token:
                raise StoreError(f"planning of {self.version} was taken over by another planner")
            return body(cur)
        return self.store._run(checked, retry=False)

    def add_shards(self, shards: Sequence[PlannedShard]) -> None:
        self._planning(lambda cur: cur.executemany(
            q.INSERT_SHARD, [(self.version, s.shard_no, Jsonb(s.slice), s.record_count, s.route)
                             for s in shards]))

    def add_records(self, records: Sequence[PlannedRecord]) -> None:
        for chunk in _chunks(records, 20_000):
            self._planning(lambda cur, chunk=chunk: self._copy_records(cur, chunk))  # type: ignore[misc]

    def _copy_records(self, cur: Cursor, chunk: Sequence[PlannedRecord]) -> None:
        seen: dict[str, int] = {}
        for r in chunk:
            if r.record_id in seen:
                raise DuplicateRecord(r.record_id, seen[r.record_id])
            seen[r.record_id] = r.shard_no
        try:
            # A savepoint, so that after a duplicate the transaction can still say which.
            with cur.connection.transaction(), cur.copy(q.COPY_RECORDS) as copy:
                for r in chunk:
                    copy.write_row((self.version, r.record_id, r.shard_no, r.content_hash))
        except errors.UniqueViolation:
            for r in chunk:
                cur.execute(q.RECORD_SHARD, (self.version, [r.record_id]))
                row = cur.fetchone()
                if row is not None:
                    raise DuplicateRecord(r.record_id, int(row[0])) from None
            raise

    def add_dead_letters(self, shard_no: int, rows: Sequence[DeadLetterRow]) -> None:
        def body(cur: Cursor) -> None:
            cur.execute(q.PLAN_DEAD_LETTERS, {
                "v": self.version, "s": shard_no, "ids": [r.record_id for r in rows],
                "kinds": [r.kind for r in rows], "errors": [r.error for r in rows],
                "acls": [_acl_json(r.acl) for r in rows]})
            cur.execute(q.BUMP_DEAD, (len(rows), self.version, shard_no))
        self._planning(body)

    def carry_from(self, base: str) -> int:
        def body(cur: Cursor) -> int:
            cur.execute(q.CARRY, {"v": self.version, "base": base})
            carried = cur.rowcount
            cur.execute(q.SET_CARRIED, {"n": carried, "v": self.version})
            cur.execute(q.CARRY_COUNTS, {"v": self.version})
            cur.execute(q.CARRY_DONE, {"v": self.version})
            self.store._event(cur, "carry", self.version, None, None, None, {"base": base, "records": carried})
            return carried
        return self._planning(body)

    def commit(self, record_count: int, shard_count: int) -> None:
        def body(cur: Cursor) -> None:
            cur.execute(q.COMMIT_PLAN, (record_count, shard_count, self.version))
            self.store._event(cur, "plan", self.version, None, None, None,
                              {"records": record_count, "shards": shard_count})
            # Nothing left to infer (no shards, or everything carried): sealed at planning.
            cur.execute(q.SEAL_IF_NOTHING_OPEN, {"v": self.version})
        self._planning(body)

    def abort(self) -> None:
        def body(cur: Cursor) -> None:
            cur.execute(q.PLAN_TOKEN_ANY, (self.version,))
            row = cur.fetchone()
            if row is not None and row[0] == self.token:
                self.store._delete_version(cur, self.version)
        # On failure a half-written plan stays invisible in the 'planning' state and is replaced next time.
        with contextlib.suppress(StoreError):
            self.store._run(body, retry=False)
