"""The embedded SQLite store: one machine, many worker processes, one file.

WAL mode so readers never block the writer; every write transaction starts
with BEGIN IMMEDIATE so a transaction that reads and then writes (a claim, a
fenced put) cannot be overtaken between the two; a busy timeout instead of
errors when another process holds the lock; writes batched, never one
transaction per record. All SQL for this backend lives in this module.
"""

from __future__ import annotations

import json
import sqlite3
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from batchline.errors import StoreError
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

SCHEMA_VERSION = 2
# Columns added after schema 1, added in place to stores made before them.
_ADDED_COLUMNS = (("shards", "route", "TEXT NOT NULL DEFAULT 'local'"), ("shards", "batch", "TEXT"),
                  ("shards", "poll_at", "REAL"), ("results", "model", "TEXT"))

# The database's clock, shifted by the test hook. julianday() keeps about a
# millisecond of precision, which is plenty for leases of seconds.
NOW = "((julianday('now') - 2440587.5) * 86400.0 + (SELECT offset_s FROM clock WHERE id = 1))"

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS clock (id INTEGER PRIMARY KEY CHECK (id = 1), offset_s REAL NOT NULL);
INSERT OR IGNORE INTO clock (id, offset_s) VALUES (1, 0);
CREATE TABLE IF NOT EXISTS jobs (
    version TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('planning', 'ready', 'sealed', 'removed')),
    spec TEXT NOT NULL,
    plan_token TEXT,
    record_count INTEGER NOT NULL DEFAULT 0,
    shard_count INTEGER NOT NULL DEFAULT 0,
    carried_count INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    sealed_at REAL
);
CREATE INDEX IF NOT EXISTS jobs_by_state ON jobs (state, created_at);
CREATE TABLE IF NOT EXISTS shards (
    version TEXT NOT NULL,
    shard_no INTEGER NOT NULL,
    slice TEXT NOT NULL,
    record_count INTEGER NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('ready', 'leased', 'done', 'submitted')),
    owner TEXT,
    epoch INTEGER NOT NULL DEFAULT 0,
    lease_expires REAL,
    claims INTEGER NOT NULL DEFAULT 0,
    results_count INTEGER NOT NULL DEFAULT 0,
    dead_count INTEGER NOT NULL DEFAULT 0,
    done_at REAL,
    route TEXT NOT NULL DEFAULT 'local',
    batch TEXT,  -- a hosted route's batch at its provider (JSON)
    poll_at REAL,
    PRIMARY KEY (version, shard_no)
);
CREATE INDEX IF NOT EXISTS shards_claimable ON shards (version, state, shard_no);
CREATE TABLE IF NOT EXISTS records (
    version TEXT NOT NULL,
    record_id TEXT NOT NULL,
    shard_no INTEGER NOT NULL,
    content_hash TEXT NOT NULL,
    PRIMARY KEY (version, record_id)
);
CREATE TABLE IF NOT EXISTS results (
    version TEXT NOT NULL,
    record_id TEXT NOT NULL,
    shard_no INTEGER NOT NULL,
    output TEXT,  -- NULL for a carried result: the row of version `origin` holds it
    origin TEXT,
    label TEXT,
    acl TEXT,
    worker TEXT NOT NULL,
    epoch INTEGER NOT NULL,
    attempt INTEGER NOT NULL,
    input_tokens INTEGER,
    output_tokens INTEGER,
    created_at REAL NOT NULL,
    model TEXT,
    PRIMARY KEY (version, record_id)
);
CREATE INDEX IF NOT EXISTS results_carried ON results (origin, record_id) WHERE origin IS NOT NULL;
CREATE TABLE IF NOT EXISTS attempts (
    version TEXT NOT NULL,
    record_id TEXT NOT NULL,
    attempts INTEGER NOT NULL,
    last_kind TEXT NOT NULL,
    last_error TEXT NOT NULL,
    PRIMARY KEY (version, record_id)
);
CREATE TABLE IF NOT EXISTS dead_letters (
    version TEXT NOT NULL,
    record_id TEXT NOT NULL,
    shard_no INTEGER NOT NULL,
    kind TEXT NOT NULL,
    error TEXT NOT NULL,
    acl TEXT,
    attempts INTEGER NOT NULL,
    worker TEXT,
    epoch INTEGER,
    created_at REAL NOT NULL,
    PRIMARY KEY (version, record_id)
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    version TEXT,
    ts REAL NOT NULL,
    kind TEXT NOT NULL,
    worker TEXT,
    shard_no INTEGER,
    epoch INTEGER,
    detail TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS events_by_version ON events (version, kind, id);
CREATE TABLE IF NOT EXISTS validations (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    version TEXT NOT NULL,
    passed INTEGER NOT NULL,
    report TEXT NOT NULL,
    ts REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS validations_by_version ON validations (version, id);
CREATE TABLE IF NOT EXISTS pointers (name TEXT PRIMARY KEY, version TEXT NOT NULL, updated_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS publications (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL,
    version TEXT NOT NULL,
    previous TEXT,
    action TEXT NOT NULL,
    who TEXT NOT NULL,
    reason TEXT,
    validation TEXT,
    ts REAL NOT NULL
);
"""

_JOB_COLUMNS = "version, name, state, spec, record_count, shard_count, created_at, sealed_at, carried_count"
_OPEN = "('ready', 'leased', 'submitted')"
_FENCE = "version = ? AND shard_no = ? AND owner = ? AND epoch = ? AND state = 'leased'"


def _acl_json(acl: Any) -> str | None:
    return None if acl is None else json.dumps(acl, sort_keys=True, separators=(",", ":"))


def _acl_value(text: str | None) -> Any:
    return None if text is None else json.loads(text)


# A carried result's payload lives in the row of the version that computed it.
_RESULT_COLUMNS = ("r.record_id, COALESCE(r.output, o.output), r.acl, r.shard_no, r.worker, r.epoch, r.attempt, "
                   "r.created_at, r.input_tokens, r.output_tokens, r.label, r.origin, r.model")
_RESULTS_FROM = ("FROM results r LEFT JOIN results o "
                 "ON r.origin IS NOT NULL AND o.version = r.origin AND o.record_id = r.record_id")


def _stored_result(r: Sequence[Any]) -> StoredResult:
    return StoredResult(r[0], r[1], _acl_value(r[2]), r[3], r[4], r[5], r[6], r[7], r[8], r[9], r[10], r[11],
                        r[12])


def _route_filter(routes: Sequence[str] | None) -> tuple[str, tuple[str, ...]]:
    if routes is None:
        return "", ()
    return f" AND route IN ({','.join('?' * len(routes))})" if routes else " AND 0", tuple(routes)


def _chunks(rows: Sequence[Any], size: int = WRITE_BATCH_ROWS) -> Iterator[Sequence[Any]]:
    for i in range(0, len(rows), size):
        yield rows[i:i + size]


class SQLiteStore:
    def __init__(self, path: str | Path, url: str | None = None) -> None:
        self.path = Path(path)
        self.url = url or f"sqlite:///{self.path}"
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # Transactions are explicit (BEGIN IMMEDIATE); the module's implicit
            # ones would start deferred transactions that can deadlock on upgrade.
            self.conn = sqlite3.connect(str(self.path), isolation_level=None, timeout=60.0,
                                        check_same_thread=False)
            self.conn.execute("PRAGMA busy_timeout = 60000")
            self.conn.execute("PRAGMA journal_mode = WAL")
            self.conn.execute("PRAGMA synchronous = NORMAL")
            self._migrate()
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open SQLite store {self.path}: {exc}") from None

    def _migrate(self) -> None:
        with self._write() as c:
            for statement in SCHEMA.split(";"):
                if statement.strip():
                    c.execute(statement)
            row = c.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            if row is None:
                c.execute("INSERT INTO meta (key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            elif int(row[0]) > SCHEMA_VERSION:
                raise StoreError(f"store {self.path} has schema {row[0]}, newer than this batchline "
                                 f"({SCHEMA_VERSION}); upgrade batchline")
            elif int(row[0]) < SCHEMA_VERSION:
                for table, column, decl in _ADDED_COLUMNS:
                    have = {r[1] for r in c.execute(f"PRAGMA table_info({table})")}
                    if column not in have:
                        c.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")
                c.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION),))

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Cursor]:
        c = self.conn.cursor()
        c.execute("BEGIN IMMEDIATE")
        try:
            yield c
        except BaseException:
            c.execute("ROLLBACK")
            raise
        else:
            c.execute("COMMIT")

    def close(self) -> None:
        self.conn.close()

    # --- clock --------------------------------------------------------------

    def now(self) -> float:
        return float(self.conn.execute(f"SELECT {NOW}").fetchone()[0])

    def shift_clock(self, seconds: float) -> None:
        with self._write() as c:
            c.execute("UPDATE clock SET offset_s = offset_s + ? WHERE id = 1", (seconds,))

    # --- events -------------------------------------------------------------

    def log_event(self, kind: str, *, version: str | None = None, worker: str | None = None,
                  shard_no: int | None = None, epoch: int | None = None,
                  detail: dict[str, Any] | None = None) -> None:
        with self._write() as c:
            self._event(c, kind, version, worker, shard_no, epoch, detail)

    @staticmethod
    def _event(c: sqlite3.Cursor, kind: str, version: str | None, worker: str | None,
               shard_no: int | None, epoch: int | None, detail: dict[str, Any] | None = None) -> None:
        c.execute(
            f"INSERT INTO events (version, ts, kind, worker, shard_no, epoch, detail) "
            f"VALUES (?, {NOW}, ?, ?, ?, ?, ?)",
            (version, kind, worker, shard_no, epoch, json.dumps(detail or {}, default=str)),
        )

    def events(self, version: str | None = None, kinds: Sequence[str] | None = None) -> list[Event]:
        sql = "SELECT id, version, ts, kind, worker, shard_no, epoch, detail FROM events WHERE 1 = 1"
        params: list[Any] = []
        if version is not None:
            sql += " AND version = ?"
            params.append(version)
        if kinds:
            sql += f" AND kind IN ({','.join('?' * len(kinds))})"
            params.extend(kinds)
        rows = self.conn.execute(sql + " ORDER BY id", params).fetchall()
        return [Event(r[0], r[1], r[2], r[3], r[4], r[5], r[6], json.loads(r[7])) for r in rows]

    # --- jobs and planning ----------------------------------------------------

    @staticmethod
    def _job(row: Sequence[Any]) -> JobInfo:
        return JobInfo(version=row[0], name=row[1], state=row[2], spec=json.loads(row[3]),
                       record_count=row[4], shard_count=row[5], created_at=row[6], sealed_at=row[7],
                       carried=row[8])

    def job(self, version: str) -> JobInfo | None:
        row = self.conn.execute(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE version = ?", (version,)).fetchone()
        return self._job(row) if row else None

    def jobs(self) -> list[JobInfo]:
        rows = self.conn.execute(
            f"SELECT {_JOB_COLUMNS} FROM jobs WHERE state IN ('ready', 'sealed') ORDER BY created_at").fetchall()
        return [self._job(r) for r in rows]

    def begin_plan(self, version: str, name: str, spec: dict[str, Any]) -> SQLitePlanWriter:
        token = uuid.uuid4().hex
        with self._write() as c:
            row = c.execute("SELECT state FROM jobs WHERE version = ?", (version,)).fetchone()
            if row is not None and row[0] != "planning":
                raise StoreError(f"version {version} is already planned")
            self._delete_version(c, version)
            c.execute(
                f"INSERT INTO jobs (version, name, state, spec, plan_token, created_at) "
                f"VALUES (?, ?, 'planning', ?, ?, {NOW})",
                (version, name, json.dumps(spec), token),  # key order kept: see spec.version_material
            )
        return SQLitePlanWriter(self, version, token)

    @staticmethod
    def _delete_version(c: sqlite3.Cursor, version: str) -> None:
        # Only a version still in 'planning' is ever deleted whole: it never existed
        # for anyone, so its rows and its events go.
        for table in ("shards", "records", "results", "attempts", "dead_letters", "events", "jobs"):
            c.execute(f"DELETE FROM {table} WHERE version = ?", (version,))

    # --- leases ---------------------------------------------------------------

    def claim(self, worker: str, version: str | None = None, routes: Sequence[str] | None = None) -> Lease | None:
        only, route_params = _route_filter(routes)
        columns = "shard_no, state, owner, epoch, slice, record_count, route, batch"
        with self._write() as c:
            now = c.execute(f"SELECT {NOW}").fetchone()[0]
            if version is None:
                versions = [r[0] for r in c.execute(
                    "SELECT version FROM jobs WHERE state = 'ready' ORDER BY created_at")]
            else:
                row = c.execute("SELECT state FROM jobs WHERE version = ?", (version,)).fetchone()
                versions = [version] if row is not None and row[0] == "ready" else []
            for v in versions:
                # Index seeks, one per way a shard can be claimable, rather than one OR,
                # which would sort every open shard per claim.
                candidates = [row for row in (
                    c.execute(f"SELECT {columns} FROM shards WHERE version = ? AND state = 'ready'{only} "
                              "ORDER BY shard_no LIMIT 1", (v, *route_params)).fetchone(),
                    c.execute(f"SELECT {columns} FROM shards WHERE version = ? AND state = 'leased' "
                              f"AND lease_expires <= ?{only} ORDER BY shard_no LIMIT 1",
                              (v, now, *route_params)).fetchone(),
                    c.execute(f"SELECT {columns} FROM shards WHERE version = ? AND state = 'submitted' "
                              f"AND poll_at <= ?{only} ORDER BY shard_no LIMIT 1",
                              (v, now, *route_params)).fetchone(),
                ) if row is not None]
                if candidates:
                    return self._grant(c, v, min(candidates), worker, now)
            return None

    def _grant(self, c: sqlite3.Cursor, version: str, row: Sequence[Any], worker: str, now: float) -> Lease:
        shard_no, state, old_owner, old_epoch, slice_text, count, route, batch = row
        spec = c.execute("SELECT spec FROM jobs WHERE version = ?", (version,)).fetchone()[0]
        expires = now + float(json.loads(spec)["shards"]["lease_seconds"])
        c.execute("UPDATE shards SET state = 'leased', owner = ?, epoch = epoch + 1, lease_expires = ?, "
                  "claims = claims + 1 WHERE version = ? AND shard_no = ?", (worker, expires, version, shard_no))
        if state == "leased":
            self._event(c, "lease_expired", version, old_owner, shard_no, old_epoch, {"reclaimed_by": worker})
        self._event(c, "claim", version, worker, shard_no, old_epoch + 1)
        return Lease(version=version, shard_no=shard_no, owner=worker, epoch=old_epoch + 1,
                     slice=json.loads(slice_text), record_count=count, expires=expires, route=route,
                     batch=json.loads(batch) if batch else None)

    def renew(self, lease: Lease) -> Lease | None:
        with self._write() as c:
            now = c.execute(f"SELECT {NOW}").fetchone()[0]
            spec = c.execute("SELECT spec FROM jobs WHERE version = ?", (lease.version,)).fetchone()
            expires = now + float(json.loads(spec[0])["shards"]["lease_seconds"]) if spec else now
            c.execute(f"UPDATE shards SET lease_expires = ? WHERE {_FENCE}",
                      (expires, lease.version, lease.shard_no, lease.owner, lease.epoch))
            if c.rowcount != 1:
                self._event(c, "stale_epoch", lease.version, lease.owner, lease.shard_no, lease.epoch,
                            {"op": "renew"})
                return None
        return replace(lease, expires=expires)

    def release(self, lease: Lease, reason: str) -> bool:
        with self._write() as c:
            # A batch already at the provider is not given up with the lease: the
            # shard waits there for the next poller, who must not submit it again.
            c.execute(f"UPDATE shards SET state = CASE WHEN json_extract(batch, '$.batch_id') IS NOT NULL "
                      f"THEN 'submitted' ELSE 'ready' END, owner = NULL, lease_expires = NULL, poll_at = {NOW} "
                      f"WHERE {_FENCE}", (lease.version, lease.shard_no, lease.owner, lease.epoch))
            released = c.rowcount == 1
            self._event(c, "release" if released else "stale_epoch", lease.version, lease.owner,
                        lease.shard_no, lease.epoch, {"reason": reason} if released else {"op": "release"})
            return released

    def set_batch(self, lease: Lease, batch: dict[str, Any] | None) -> Lease:
        with self._write() as c:
            c.execute(f"UPDATE shards SET batch = ? WHERE {_FENCE}",
                      (json.dumps(batch) if batch is not None else None,
                       lease.version, lease.shard_no, lease.owner, lease.epoch))
            current = c.rowcount == 1
            if not current:
                self._event(c, "stale_epoch", lease.version, lease.owner, lease.shard_no, lease.epoch,
                            {"op": "batch"})
        if not current:
            raise self._lost(lease, "batch")
        return replace(lease, batch=batch)

    def await_provider(self, lease: Lease, batch: dict[str, Any], poll_in: float) -> None:
        text = json.dumps(batch)
        with self._write() as c:
            row = c.execute("SELECT state, owner, epoch, batch FROM shards WHERE version = ? AND shard_no = ?",
                            (lease.version, lease.shard_no)).fetchone()
            if row is None:
                raise StoreError(f"no shard {lease.shard_no} in {lease.version}")
            state, owner, epoch, previous = row
            if (owner, epoch) == (lease.owner, lease.epoch) and state == "submitted" and previous == text:
                return  # a retry of the same parking
            c.execute(f"UPDATE shards SET state = 'submitted', batch = ?, lease_expires = NULL, "
                      f"poll_at = {NOW} + ? WHERE {_FENCE}",
                      (text, poll_in, lease.version, lease.shard_no, lease.owner, lease.epoch))
            current = c.rowcount == 1
            if current:
                fresh = previous is None or json.loads(previous).get("batch_id") != batch.get("batch_id")
                self._event(c, "submitted" if fresh else "provider_wait", lease.version, lease.owner,
                            lease.shard_no, lease.epoch, {"batch_id": batch.get("batch_id"),
                                                          "requests": batch.get("request_count")})
            else:
                self._event(c, "stale_epoch", lease.version, lease.owner, lease.shard_no, lease.epoch,
                            {"op": "await_provider"})
        if not current:
            raise self._lost(lease, "await_provider")

    def complete(self, lease: Lease) -> None:
        with self._write() as c:
            row = c.execute(
                "SELECT state, owner, epoch, record_count, results_count, dead_count FROM shards "
                "WHERE version = ? AND shard_no = ?", (lease.version, lease.shard_no)).fetchone()
            if row is None:
                raise StoreError(f"no shard {lease.shard_no} in {lease.version}")
            state, owner, epoch, count, results, dead = row
            stale = (owner, epoch) != (lease.owner, lease.epoch) or state not in ("leased", "done")
            if stale:
                # Recorded in the same transaction, which commits: the refusal is an event.
                self._event(c, "stale_epoch", lease.version, lease.owner, lease.shard_no, lease.epoch,
                            {"op": "complete", "current_epoch": epoch})
            elif state == "leased":
                if results + dead != count:
                    raise StoreError(f"shard {lease.shard_no} of {lease.version} has {count - results - dead} "
                                     f"records without an outcome; not completing it")
                self._finish_shard(c, lease, count, results, dead)
            # state == 'done' for this owner and epoch: a retried completion after a
            # lost acknowledgement, which succeeds again.
        if stale:
            raise self._lost(lease, "completion")

    def _finish_shard(self, c: sqlite3.Cursor, lease: Lease, count: int, results: int, dead: int) -> None:
        c.execute(f"UPDATE shards SET state = 'done', done_at = {NOW}, lease_expires = NULL WHERE {_FENCE}",
                  (lease.version, lease.shard_no, lease.owner, lease.epoch))
        self._event(c, "complete", lease.version, lease.owner, lease.shard_no, lease.epoch,
                    {"records": count, "results": results, "dead_letters": dead})
        open_shard = c.execute(f"SELECT 1 FROM shards WHERE version = ? AND state IN {_OPEN} LIMIT 1",
                               (lease.version,)).fetchone()
        if open_shard is None:
            c.execute(f"UPDATE jobs SET state = 'sealed', sealed_at = {NOW} WHERE version = ? AND state = 'ready'",
                      (lease.version,))
            if c.rowcount == 1:
                self._event(c, "seal", lease.version, lease.owner, None, None)

    def open_versions(self) -> list[str]:
        return [r[0] for r in self.conn.execute(
            f"SELECT j.version FROM jobs j WHERE j.state = 'ready' AND EXISTS (SELECT 1 FROM shards s "
            f"WHERE s.version = j.version AND s.state IN {_OPEN}) ORDER BY j.created_at")]

    def has_open_shards(self, version: str | None = None, routes: Sequence[str] | None = None) -> bool:
        only, route_params = _route_filter(routes)
        row = self.conn.execute(
            "SELECT 1 FROM shards s JOIN jobs j ON j.version = s.version "
            f"WHERE j.state = 'ready' AND (? IS NULL OR s.version = ?) AND s.state IN {_OPEN}"
            f"{only.replace('route', 's.route')} LIMIT 1",
            (version, version, *route_params)).fetchone()
        return row is not None

    # --- records --------------------------------------------------------------

    def _ids_query(self, sql: str, version: str, record_ids: Sequence[str]) -> list[Any]:
        out: list[Any] = []
        # Bounded by SQLite's limit on bound parameters.
        for chunk in _chunks(record_ids, 900):
            out.extend(self.conn.execute(sql.format(ids=",".join("?" * len(chunk))),
                                         (version, *chunk)).fetchall())
        return out

    def answered(self, version: str, record_ids: Sequence[str]) -> set[str]:
        rows = self._ids_query(
            "SELECT record_id FROM results WHERE version = ? AND record_id IN ({ids})", version, record_ids)
        rows += self._ids_query(
            "SELECT record_id FROM dead_letters WHERE version = ? AND record_id IN ({ids})", version, record_ids)
        return {r[0] for r in rows}

    def attempts(self, version: str, record_ids: Sequence[str]) -> dict[str, int]:
        rows = self._ids_query(
            "SELECT record_id, attempts FROM attempts WHERE version = ? AND record_id IN ({ids})",
            version, record_ids)
        return {r[0]: int(r[1]) for r in rows}

    def _fenced(self, c: sqlite3.Cursor, lease: Lease, op: str) -> bool:
        """True while (owner, epoch) is current; otherwise records the refusal."""
        row = c.execute("SELECT 1 FROM shards WHERE " + _FENCE,
                        (lease.version, lease.shard_no, lease.owner, lease.epoch)).fetchone()
        if row is None:
            self._event(c, "stale_epoch", lease.version, lease.owner, lease.shard_no, lease.epoch, {"op": op})
        return row is not None

    @staticmethod
    def _lost(lease: Lease, op: str) -> LeaseLost:
        return LeaseLost(f"lease on shard {lease.shard_no} of {lease.version} lost (epoch {lease.epoch}); "
                         f"{op} refused", op)

    def put_results(self, lease: Lease, rows: Sequence[ResultRow]) -> int:
        inserted = 0
        for chunk in _chunks(rows):
            with self._write() as c:
                current = self._fenced(c, lease, "put")
                if current:
                    now = c.execute(f"SELECT {NOW}").fetchone()[0]
                    c.executemany(
                        "INSERT OR IGNORE INTO results (version, record_id, shard_no, output, acl, worker, epoch, "
                        "attempt, input_tokens, output_tokens, created_at, label, model) "
                        "SELECT ?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13 WHERE NOT EXISTS "
                        "(SELECT 1 FROM dead_letters WHERE version = ?1 AND record_id = ?2)",
                        [(lease.version, r.record_id, lease.shard_no, r.output, _acl_json(r.acl), lease.owner,
                          lease.epoch, r.attempt, r.input_tokens, r.output_tokens, now, r.label, r.model)
                         for r in chunk],
                    )
                    n = c.rowcount
                    c.execute("UPDATE shards SET results_count = results_count + ? "
                              "WHERE version = ? AND shard_no = ?", (n, lease.version, lease.shard_no))
                    inserted += n
            if not current:
                raise self._lost(lease, "put")
        return inserted

    def charge_attempt(self, lease: Lease, record_id: str, kind: str, error: str, acl: Any,
                       max_attempts: int) -> ChargeResult:
        with self._write() as c:
            current = self._fenced(c, lease, "charge")
            result = ChargeResult(attempts=0, dead_lettered=False)
            answered = c.execute(
                "SELECT 1 FROM results WHERE version = ?1 AND record_id = ?2 UNION ALL "
                "SELECT 1 FROM dead_letters WHERE version = ?1 AND record_id = ?2",
                (lease.version, record_id)).fetchone()
            if current and not answered:
                c.execute(
                    "INSERT INTO attempts (version, record_id, attempts, last_kind, last_error) "
                    "VALUES (?, ?, 1, ?, ?) ON CONFLICT (version, record_id) DO UPDATE SET "
                    "attempts = attempts + 1, last_kind = excluded.last_kind, last_error = excluded.last_error",
                    (lease.version, record_id, kind, error))
                attempts = int(c.execute("SELECT attempts FROM attempts WHERE version = ? AND record_id = ?",
                                         (lease.version, record_id)).fetchone()[0])
                self._event(c, "attempt_failed", lease.version, lease.owner, lease.shard_no, lease.epoch,
                            {"record_id": record_id, "kind": kind, "attempts": attempts, "error": error[:500]})
                result = ChargeResult(attempts=attempts, dead_lettered=attempts >= max_attempts)
                if result.dead_lettered:
                    self._insert_dead(c, lease, [DeadLetterRow(record_id, kind, error, acl, attempts)])
        if not current:
            raise self._lost(lease, "charge")
        return result

    def dead_letter(self, lease: Lease, rows: Sequence[DeadLetterRow]) -> int:
        n = 0
        for chunk in _chunks(rows):
            with self._write() as c:
                current = self._fenced(c, lease, "dead_letter")
                if current:
                    n += self._insert_dead(c, lease, chunk)
            if not current:
                raise self._lost(lease, "dead_letter")
        return n

    def _insert_dead(self, c: sqlite3.Cursor, lease: Lease, rows: Sequence[DeadLetterRow]) -> int:
        c.executemany(
            f"INSERT OR IGNORE INTO dead_letters (version, record_id, shard_no, kind, error, acl, attempts, "
            f"worker, epoch, created_at) SELECT ?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, {NOW} WHERE NOT EXISTS "
            f"(SELECT 1 FROM results WHERE version = ?1 AND record_id = ?2)",
            [(lease.version, r.record_id, lease.shard_no, r.kind, r.error, _acl_json(r.acl), r.attempts,
              lease.owner, lease.epoch) for r in rows],
        )
        n = c.rowcount
        c.execute("UPDATE shards SET dead_count = dead_count + ? WHERE version = ? AND shard_no = ?",
                  (n, lease.version, lease.shard_no))
        return n

    # --- reading --------------------------------------------------------------

    def status(self, version: str, window_seconds: float = 300.0) -> JobStatus:
        job = self.job(version)
        if job is None:
            raise StoreError(f"no job version {version!r} in {self.url}")
        c = self.conn.cursor()
        now = c.execute(f"SELECT {NOW}").fetchone()[0]
        shards = {"ready": 0, "leased": 0, "done": 0, "submitted": 0}
        results = dead = 0
        for state, n, r, d in c.execute(
                "SELECT state, COUNT(*), SUM(results_count), SUM(dead_count) FROM shards WHERE version = ? "
                "GROUP BY state", (version,)):
            shards[state] = n
            results += r or 0
            dead += d or 0
        by_kind = dict(c.execute("SELECT kind, COUNT(*) FROM dead_letters WHERE version = ? GROUP BY kind",
                                 (version,)).fetchall())
        lost = c.execute("SELECT COUNT(*) FROM events WHERE version = ? AND kind = 'lease_expired'",
                         (version,)).fetchone()[0]
        recent = c.execute(
            "SELECT COALESCE(SUM(record_count), 0) FROM shards WHERE version = ? AND state = 'done' "
            "AND done_at >= ?", (version, now - window_seconds)).fetchone()[0]
        return JobStatus(version=version, name=job.name, state=job.state, records=job.record_count,
                         results=results, dead_letters=dead, shards=shards, dead_letters_by_kind=by_kind,
                         leases_lost=lost, records_done_last_minutes=recent, window_seconds=window_seconds,
                         now=now)

    def route_totals(self, version: str) -> dict[str, RouteTotals]:
        planned = self.conn.execute(
            "SELECT route, COUNT(*), SUM(record_count), SUM(dead_count) FROM shards WHERE version = ? "
            "GROUP BY route", (version,)).fetchall()
        computed = {r[0]: r[1:] for r in self.conn.execute(
            "SELECT s.route, COUNT(*), COALESCE(SUM(r.input_tokens), 0), COALESCE(SUM(r.output_tokens), 0) "
            "FROM results r JOIN shards s ON s.version = r.version AND s.shard_no = r.shard_no "
            "WHERE r.version = ? AND r.origin IS NULL GROUP BY s.route", (version,))}
        return {route: RouteTotals(records=int(records), results=int(computed.get(route, (0,))[0]),
                                   dead_letters=int(dead or 0), input_tokens=int(computed.get(route, (0, 0))[1]),
                                   output_tokens=int(computed.get(route, (0, 0, 0))[2]), shards=int(shards))
                for route, shards, records, dead in planned}

    def result_histogram(self, version: str, start: float, width: float, bins: int) -> list[tuple[int, int, int]]:
        rows = self.conn.execute(
            "SELECT attempt, MIN(MAX(CAST((created_at - ?) / ? AS INTEGER), 0), ?) AS bin, COUNT(*) "
            "FROM results WHERE version = ? AND origin IS NULL GROUP BY attempt, bin",
            (start, width, max(bins - 1, 0), version)).fetchall()
        return [(int(a), int(b), int(n)) for a, b, n in rows]

    def token_totals(self, version: str) -> tuple[int, int]:
        row = self.conn.execute("SELECT COALESCE(SUM(input_tokens), 0), COALESCE(SUM(output_tokens), 0) "
                                "FROM results WHERE version = ? AND origin IS NULL", (version,)).fetchone()
        return int(row[0]), int(row[1])

    def run_throughput(self, version: str) -> float:
        row = self.conn.execute(
            "SELECT SUM(json_extract(c.detail, '$.records')), SUM(c.ts - k.ts) FROM events c "
            "JOIN events k ON k.version = c.version AND k.kind = 'claim' AND k.shard_no = c.shard_no "
            "AND k.epoch = c.epoch WHERE c.version = ? AND c.kind = 'complete'", (version,)).fetchone()
        records, seconds = row
        return float(records) / seconds if records and seconds and seconds > 0 else 0.0

    def shard_rows(self, version: str) -> list[ShardRow]:
        rows = self.conn.execute(
            "SELECT shard_no, state, owner, epoch, lease_expires, claims, record_count, results_count, dead_count, "
            "route, json_extract(batch, '$.batch_id'), poll_at FROM shards WHERE version = ? ORDER BY shard_no",
            (version,)).fetchall()
        return [ShardRow(*r) for r in rows]

    def iter_results(self, version: str, page_size: int = 5000, *,
                     computed_only: bool = False) -> Iterator[StoredResult]:
        last = ""
        only = " AND r.origin IS NULL" if computed_only else ""
        while True:
            rows = self.conn.execute(
                f"SELECT {_RESULT_COLUMNS} {_RESULTS_FROM} WHERE r.version = ? AND r.record_id > ?{only} "
                f"ORDER BY r.record_id LIMIT ?", (version, last, page_size)).fetchall()
            if not rows:
                return
            for r in rows:
                yield _stored_result(r)
            last = rows[-1][0]

    def results_for(self, version: str, record_ids: Sequence[str]) -> dict[str, StoredResult]:
        rows = self._ids_query(
            f"SELECT {_RESULT_COLUMNS} {_RESULTS_FROM} WHERE r.version = ? AND r.record_id IN ({{ids}})",
            version, record_ids)
        return {r[0]: _stored_result(r) for r in rows}

    def iter_dead_letters(self, version: str) -> Iterator[StoredDeadLetter]:
        rows = self.conn.execute(
            "SELECT record_id, shard_no, kind, error, acl, attempts, worker, created_at FROM dead_letters "
            "WHERE version = ? ORDER BY record_id", (version,))
        for r in rows:
            yield StoredDeadLetter(r[0], r[1], r[2], r[3], _acl_value(r[4]), r[5], r[6], r[7])

    def planned_ids(self, version: str) -> Iterator[str]:
        for (record_id,) in self.conn.execute(
                "SELECT record_id FROM records WHERE version = ? ORDER BY record_id", (version,)):
            yield record_id

    def resolve_name(self, name: str) -> str | None:
        row = self.conn.execute("SELECT version FROM pointers WHERE name = ?", (name,)).fetchone()
        return row[0] if row else None


    # --- validation and publication ----------------------------------------------

    def coverage(self, version: str, sample: int = 10) -> Coverage:
        c = self.conn.cursor()
        records = c.execute("SELECT COUNT(*) FROM records WHERE version = ?", (version,)).fetchone()[0]
        results = c.execute("SELECT COUNT(*) FROM results WHERE version = ?", (version,)).fetchone()[0]
        dead = c.execute("SELECT COUNT(*) FROM dead_letters WHERE version = ?", (version,)).fetchone()[0]
        # One join per outcome table gives the outcomes whose id the snapshot has
        # (ids are unique on both sides); the anti-join's rows follow from it, and
        # are listed only when there are any.
        matched = c.execute(
            "SELECT (SELECT COUNT(*) FROM results r JOIN records p ON p.version = r.version "
            "AND p.record_id = r.record_id WHERE r.version = ?1) + (SELECT COUNT(*) FROM dead_letters d "
            "JOIN records p ON p.version = d.version AND p.record_id = d.record_id WHERE d.version = ?1)",
            (version,)).fetchone()[0]
        both = c.execute("SELECT COUNT(*) FROM dead_letters d WHERE d.version = ?1 AND EXISTS "
                         "(SELECT 1 FROM results r WHERE r.version = ?1 AND r.record_id = d.record_id)",
                         (version,)).fetchone()[0]
        missing = records - (matched - both)
        unexpected = results + dead - matched
        missing_sample = tuple(r[0] for r in c.execute(
            "SELECT p.record_id FROM records p WHERE p.version = ?1 "
            "AND NOT EXISTS (SELECT 1 FROM results r WHERE r.version = ?1 AND r.record_id = p.record_id) "
            "AND NOT EXISTS (SELECT 1 FROM dead_letters d WHERE d.version = ?1 AND d.record_id = p.record_id) "
            "LIMIT ?2", (version, sample))) if missing else ()
        unexpected_sample = tuple(r[0] for r in c.execute(
            "SELECT x.record_id FROM (SELECT record_id FROM results WHERE version = ?1 UNION ALL "
            "SELECT record_id FROM dead_letters WHERE version = ?1) x WHERE NOT EXISTS "
            "(SELECT 1 FROM records p WHERE p.version = ?1 AND p.record_id = x.record_id) LIMIT ?2",
            (version, sample))) if unexpected else ()
        return Coverage(records, missing, unexpected, both, missing_sample, unexpected_sample)

    def label_counts(self, version: str) -> dict[str | None, int]:
        return dict(self.conn.execute(
            "SELECT label, COUNT(*) FROM results WHERE version = ? GROUP BY label", (version,)).fetchall())

    def record_validation(self, version: str, passed: bool, report: dict[str, Any]) -> None:
        with self._write() as c:
            c.execute(f"INSERT INTO validations (version, passed, report, ts) VALUES (?, ?, ?, {NOW})",
                      (version, int(passed), json.dumps(report, default=str)))
            self._event(c, "validate", version, None, None, None, {"passed": passed})

    def latest_validation(self, version: str) -> ValidationRecord | None:
        row = self.conn.execute("SELECT passed, report, ts FROM validations WHERE version = ? "
                                "ORDER BY id DESC LIMIT 1", (version,)).fetchone()
        return ValidationRecord(version, bool(row[0]), json.loads(row[1]), row[2]) if row else None

    def publish(self, name: str, version: str, who: str, reason: str | None,
                validation: dict[str, Any] | None) -> str | None:
        with self._write() as c:
            previous = self._point(c, name, version)
            c.execute(f"INSERT INTO publications (name, version, previous, action, who, reason, validation, ts) "
                      f"VALUES (?, ?, ?, 'publish', ?, ?, ?, {NOW})",
                      (name, version, previous, who, reason, json.dumps(validation) if validation else None))
            self._event(c, "publish", version, None, None, None, {"name": name, "previous": previous,
                                                                   "who": who, "reason": reason})
        return previous

    def _point(self, c: sqlite3.Cursor, name: str, version: str) -> str | None:
        """Moves the pointer in one UPDATE; the view reads through it, so readers
        switch from the whole old version to the whole new one at once."""
        row = c.execute("SELECT version FROM pointers WHERE name = ?", (name,)).fetchone()
        c.execute(f"INSERT INTO pointers (name, version, updated_at) VALUES (?, ?, {NOW}) "
                  f"ON CONFLICT (name) DO UPDATE SET version = excluded.version, updated_at = excluded.updated_at",
                  (name, version))
        c.execute(f'CREATE VIEW IF NOT EXISTS "{name}" AS SELECT r.record_id AS id, '
                  f"COALESCE(r.output, o.output) AS output, r.acl AS acl, r.label AS label, r.version AS version "
                  f"FROM pointers p JOIN results r ON r.version = p.version LEFT JOIN results o "
                  f"ON r.origin IS NOT NULL AND o.version = r.origin AND o.record_id = r.record_id "
                  f"WHERE p.name = '{name}'")
        return row[0] if row else None

    def rollback(self, name: str, who: str, reason: str | None) -> tuple[str, str]:
        with self._write() as c:
            row = c.execute("SELECT version FROM pointers WHERE name = ?", (name,)).fetchone()
            if row is None:
                raise StoreError(f"nothing is published under {name!r}")
            current = row[0]
            prev = c.execute("SELECT previous FROM publications WHERE name = ? AND version = ? AND action = 'publish' "
                             "ORDER BY id DESC LIMIT 1", (name, current)).fetchone()
            if prev is None or prev[0] is None:
                raise StoreError(f"{name!r} has no earlier version to roll back to (current: {current})")
            target = prev[0]
            if c.execute("SELECT 1 FROM jobs WHERE version = ? AND state = 'sealed'", (target,)).fetchone() is None:
                raise StoreError(f"cannot roll {name!r} back to {target}: that version was removed")
            self._point(c, name, target)
            c.execute(f"INSERT INTO publications (name, version, previous, action, who, reason, ts) "
                      f"VALUES (?, ?, ?, 'rollback', ?, ?, {NOW})", (name, target, current, who, reason))
            self._event(c, "rollback", target, None, None, None, {"name": name, "from": current, "who": who})
        return current, target

    def publications(self, name: str) -> list[Publication]:
        rows = self.conn.execute("SELECT id, name, version, previous, action, who, reason, validation, ts "
                                 "FROM publications WHERE name = ? ORDER BY id", (name,)).fetchall()
        return [Publication(r[0], r[1], r[2], r[3], r[4], r[5], r[6], json.loads(r[7]) if r[7] else None, r[8])
                for r in rows]

    def remove_version(self, version: str) -> None:
        with self._write() as c:
            if c.execute("SELECT 1 FROM pointers WHERE version = ?", (version,)).fetchone():
                raise StoreError(f"{version} is published; it cannot be removed")
            # Rows that a later version carries stay: they hold that version's payload.
            c.execute("DELETE FROM results WHERE version = ?1 AND NOT EXISTS (SELECT 1 FROM results c "
                      "WHERE c.origin = ?1 AND c.record_id = results.record_id)", (version,))
            for table in ("shards", "records", "attempts", "dead_letters", "validations"):
                c.execute(f"DELETE FROM {table} WHERE version = ?", (version,))
            c.execute("UPDATE jobs SET state = 'removed' WHERE version = ?", (version,))
            self._event(c, "remove", version, None, None, None)


class SQLitePlanWriter:
    def __init__(self, store: SQLiteStore, version: str, token: str) -> None:
        self.store = store
        self.version = version
        self.token = token

    @contextmanager
    def _planning(self) -> Iterator[sqlite3.Cursor]:
        with self.store._write() as c:
            row = c.execute("SELECT plan_token FROM jobs WHERE version = ? AND state = 'planning'",
                            (self.version,)).fetchone()
            if row is None or row[0] != self.token:
                raise StoreError(f"planning of {self.version} was taken over by another planner")
            yield c

    def add_shards(self, shards: Sequence[PlannedShard]) -> None:
        with self._planning() as c:
            c.executemany(
                "INSERT INTO shards (version, shard_no, slice, record_count, state, route) "
                "VALUES (?, ?, ?, ?, 'ready', ?)",
                [(self.version, s.shard_no, json.dumps(s.slice), s.record_count, s.route) for s in shards])

    def add_records(self, records: Sequence[PlannedRecord]) -> None:
        for chunk in _chunks(records, 20000):
            try:
                with self._planning() as c:
                    c.executemany("INSERT INTO records (version, record_id, shard_no, content_hash) "
                                  "VALUES (?, ?, ?, ?)",
                                  [(self.version, r.record_id, r.shard_no, r.content_hash) for r in chunk])
            except sqlite3.IntegrityError:
                self._raise_duplicate(chunk)
                raise

    def _raise_duplicate(self, chunk: Sequence[PlannedRecord]) -> None:
        seen: dict[str, int] = {}
        for r in chunk:
            if r.record_id in seen:
                raise DuplicateRecord(r.record_id, seen[r.record_id])
            seen[r.record_id] = r.shard_no
        for r in chunk:
            row = self.store.conn.execute("SELECT shard_no FROM records WHERE version = ? AND record_id = ?",
                                          (self.version, r.record_id)).fetchone()
            if row is not None:
                raise DuplicateRecord(r.record_id, int(row[0]))

    def add_dead_letters(self, shard_no: int, rows: Sequence[DeadLetterRow]) -> None:
        with self._planning() as c:
            c.executemany(
                f"INSERT INTO dead_letters (version, record_id, shard_no, kind, error, acl, attempts, created_at) "
                f"VALUES (?, ?, ?, ?, ?, ?, 0, {NOW})",
                [(self.version, r.record_id, shard_no, r.kind, r.error, _acl_json(r.acl)) for r in rows])
            c.execute("UPDATE shards SET dead_count = dead_count + ? WHERE version = ? AND shard_no = ?",
                      (len(rows), self.version, shard_no))

    def carry_from(self, base: str) -> int:
        with self._planning() as c:
            c.execute(
                f"INSERT INTO results (version, record_id, shard_no, output, origin, label, acl, worker, epoch, "
                f"attempt, input_tokens, output_tokens, created_at, model) "
                f"SELECT n.version, n.record_id, n.shard_no, NULL, COALESCE(b.origin, b.version), b.label, b.acl, "
                f"'carried', 0, b.attempt, b.input_tokens, b.output_tokens, {NOW}, b.model "
                f"FROM records n JOIN records p ON p.version = ?2 AND p.record_id = n.record_id "
                f"AND p.content_hash = n.content_hash "
                f"JOIN results b ON b.version = ?2 AND b.record_id = n.record_id "
                f"WHERE n.version = ?1", (self.version, base))
            carried = c.rowcount
            c.execute("UPDATE jobs SET carried_count = ? WHERE version = ?", (carried, self.version))
            # One pass over the carried rows, not one per shard.
            c.execute("UPDATE shards SET results_count = results_count + carried.n FROM "
                      "(SELECT shard_no, COUNT(*) AS n FROM results WHERE version = ?1 AND origin IS NOT NULL "
                      "GROUP BY shard_no) AS carried WHERE shards.version = ?1 AND shards.shard_no = carried.shard_no",
                      (self.version,))
            c.execute(f"UPDATE shards SET state = 'done', done_at = {NOW} WHERE version = ? "
                      f"AND results_count + dead_count = record_count", (self.version,))
            self.store._event(c, "carry", self.version, None, None, None, {"base": base, "records": carried})
            return carried

    def commit(self, record_count: int, shard_count: int) -> None:
        with self._planning() as c:
            c.execute("UPDATE jobs SET state = 'ready', record_count = ?, shard_count = ?, plan_token = NULL "
                      "WHERE version = ?", (record_count, shard_count, self.version))
            self.store._event(c, "plan", self.version, None, None, None,
                              {"records": record_count, "shards": shard_count})
            if c.execute(f"SELECT 1 FROM shards WHERE version = ? AND state IN {_OPEN} LIMIT 1",
                         (self.version,)).fetchone() is None:
                c.execute(f"UPDATE jobs SET state = 'sealed', sealed_at = {NOW} WHERE version = ?",
                          (self.version,))

    def abort(self) -> None:
        try:
            with self.store._write() as c:
                row = c.execute("SELECT plan_token FROM jobs WHERE version = ?", (self.version,)).fetchone()
                if row is not None and row[0] == self.token:
                    self.store._delete_version(c, self.version)
        except sqlite3.Error:
            pass  # a half-written plan stays invisible in the 'planning' state and is replaced next time
