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

The rules are `core.py`'s; all SQL lives in `postgres_sql.py`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import psycopg
from psycopg import errors, sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.types.json import Json

from batchline.errors import StoreError
from batchline.store import postgres_sql as q
from batchline.store.core import (
    DuplicateKey,
    Missing,
    Params,
    Row,
    StoreCore,
    Tx,
    carry_json,
    fence,
    input_columns,
)
from batchline.store.model import (
    DeadLetterRow,
    Lease,
    PlannedRecord,
    ResultRow,
    Written,
    past_highest,
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

NO_SUCH_DATABASE = re.compile(r'database ".*" does not exist')
REFUSED_CREDENTIALS = re.compile(r'role ".*" does not exist|authentication failed|no pg_hba\.conf entry')

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


# A worker's session is ended by the server when it sits inside a transaction this long. A
# worker's transactions take milliseconds; one stopped inside one (a frozen VM, SIGSTOP, a
# debugger) would otherwise keep its shard row locked until the server's TCP keepalive gives
# up (two hours by default), and a locked row is one every claimer skips: its lease could run
# out and nobody could take the shard over. The worker, if it wakes, finds its connection
# lost and runs its transaction again under its fence, as after any lost connection.
WORKER_SESSION_SETTINGS = {"idle_in_transaction_session_timeout": "60s"}


UNSUPPORTED_OPTIONS = "unsupported startup parameter: options"


def session_options(given: str | None, settings: Mapping[str, str]) -> str | None:
    """libpq's `options` with `settings` as `-c name=value`, after what the URL gave (a setting
    the URL's options name already is the URL's)."""
    parts = [given] if given else []
    parts += [f"-c {name}={value}" for name, value in settings.items() if not given or name not in given]
    return " ".join(parts) or None


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


class PostgresStore(StoreCore):
    q = q

    def __init__(self, url: str, *, reconnect_seconds: float = DEFAULT_RECONNECT_SECONDS,
                 migrate: bool = True, wait_seconds: float = 0.0,
                 log: Callable[[str], None] = lambda _m: None, settings: Mapping[str, str] | None = None) -> None:
        """`settings`: server settings of this store's sessions (`WORKER_SESSION_SETTINGS` for a
        worker's)."""
        self.url = url
        self.reconnect_seconds = reconnect_seconds
        try:
            given = conninfo_to_dict(url)
        except psycopg.ProgrammingError as exc:
            raise StoreError(f"bad PostgreSQL URL: {exc}") from None
        extra = {k: v for k, v in CONNECTION_DEFAULTS.items() if k not in given}
        self._conninfo = self._plain_conninfo = make_conninfo(url, **extra)
        given_options = given.get("options")
        options = session_options(str(given_options) if given_options is not None else None, settings or {})
        if options is not None and options != given_options:
            self._conninfo = make_conninfo(url, **extra, options=options)
        self._conn: psycopg.Connection[Any] | None = None
        self.reconnects = 0
        # One connection: a store shared by threads runs one transaction at a time.
        self._lock = threading.RLock()
        self._first_connection(wait_seconds, log)
        if migrate:
            self._migrate()

    def _first_connection(self, wait_seconds: float, log: Callable[[str], None]) -> None:
        """Connects, waiting up to `wait_seconds` for a server that cannot be reached yet (a
        fleet started in any order comes up); a database that does not exist, or credentials
        refused, are said at once: no wait would change them."""
        deadline = time.monotonic() + wait_seconds
        delay, said = 0.5, False
        while True:
            try:
                self._connection()
                if said:
                    log(f"reached the store {redact(self.url)}")
                return
            except psycopg.Error as exc:
                # The server's answer at connection time comes as text, without its sqlstate.
                said_by_server = _server_message(exc)
                if NO_SUCH_DATABASE.search(said_by_server):
                    raise StoreError(f"store {redact(self.url)} does not exist: {said_by_server}") from None
                if REFUSED_CREDENTIALS.search(said_by_server) or time.monotonic() + delay > deadline:
                    raise StoreError(f"cannot connect to PostgreSQL store {redact(self.url)}: "
                                     f"{_first_line(exc)}") from None
                if not said:
                    log(f"waiting up to {wait_seconds:.0f}s for the store {redact(self.url)}: {_first_line(exc)}")
                    said = True
                time.sleep(delay)
                delay = min(delay * 2, 10.0)

    # --- connections, retries ---------------------------------------------------------

    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            # No server-side prepared statements: behind a pooler in transaction mode (PgBouncer
            # before 1.21, or without max_prepared_statements) the next transaction may run on
            # another server connection, where a statement prepared on this one is unknown.
            try:
                self._conn = psycopg.connect(self._conninfo, autocommit=True, prepare_threshold=None)
            except psycopg.OperationalError as exc:
                # A pooler (PgBouncer by default) refuses the options startup parameter: the
                # session settings are a safeguard, not a condition, so connect without them.
                if self._conninfo == self._plain_conninfo or UNSUPPORTED_OPTIONS not in str(exc):
                    raise
                log.warning("%s refuses session settings at connection (%s); connecting without them",
                            redact(self.url), _first_line(exc))
                self._conninfo = self._plain_conninfo
                self._conn = psycopg.connect(self._conninfo, autocommit=True, prepare_threshold=None)
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

    def _run(self, body: Callable[[Cursor], T], *, recover: Callable[[Cursor], T | Missing] | None = None,
             retry: bool = True, isolation: psycopg.IsolationLevel | None = None) -> T:
        """Runs `body` in one transaction. After a lost connection it reconnects and, when the
        outcome of the lost try is unknown, asks `recover` whether it committed before trying again."""
        with self._lock:
            return self._attempts(body, recover, retry, isolation)

    def _attempts(self, body: Callable[[Cursor], T], recover: Callable[[Cursor], T | Missing] | None,
                  retry: bool, isolation: psycopg.IsolationLevel | None) -> T:
        started: float | None = None
        delay = 0.05
        while True:
            conn: psycopg.Connection[Any] | None = None
            try:
                conn = self._connection()
                with conn.cursor() as cur:
                    if started is not None and recover is not None:
                        found = recover(cur)
                        if not isinstance(found, Missing):
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

    def _rows(self, query: str) -> list[Any]:
        def body(cur: Cursor) -> list[Any]:
            cur.execute(query)
            return cur.fetchall()
        return self._run(body)

    def _migrate(self) -> None:
        current = int(self._rows(q.CURRENT_SCHEMA)[0][0]) if self._rows(q.HAS_MIGRATIONS)[0][0] else 0
        if current == q.SCHEMA_VERSION and self._rows(q.FENCES_INSTALLED)[0][0] == q.FENCES_MARK_TEXT:
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
            # The fences follow batchline.store.rights as it is now, whatever the schema's age.
            cur.execute(q.FENCES_INSTALLED)
            mark = cur.fetchone()
            if mark is None or mark[0] != q.FENCES_MARK_TEXT:
                cur.execute(q.FENCES.encode())
                cur.execute(q.FENCES_MARK)

        try:
            self._run(body, retry=False)
        except StoreError as exc:
            if isinstance(exc.__cause__, errors.InsufficientPrivilege):
                raise StoreError(f"store {redact(self.url)} has schema {current} and fences other than this "
                                 f"batchline's (schema {q.SCHEMA_VERSION}), and this role may not bring them up "
                                 f"to date: run any batchline command once as the store's owner") from None
            raise

    def close(self) -> None:
        self._drop_connection()

    def _write(self, body: Callable[[Tx], T], *, recover: Callable[[Tx], T | Missing] | None = None,
               retry: bool = True) -> T:
        return self._run(lambda cur: body(_Tx(cur)),
                         recover=(lambda cur: recover(_Tx(cur))) if recover is not None else None, retry=retry)

    def _read(self, body: Callable[[Tx], T], *, snapshot: bool = False) -> T:
        return self._run(lambda cur: body(_Tx(cur)),
                         isolation=psycopg.IsolationLevel.REPEATABLE_READ if snapshot else None)

    def where(self) -> str:
        return redact(self.url)

    # --- what the SQL differs in ----------------------------------------------------------

    def _json(self, value: Any) -> Any:
        # Typed json, not jsonb: a job's spec keeps its key order (see spec.version_material);
        # columns of type jsonb take it by assignment.
        return Json(value, dumps=lambda o: json.dumps(o, default=str))

    def _unjson(self, value: Any) -> Any:
        return json.loads(value) if isinstance(value, str | bytes) else value

    def _list(self, values: Sequence[Any]) -> Any:
        return list(values)

    def _planned(self, version: str) -> None:
        # The shards a plan adds at once (thousands) are all ready: until autovacuum's analyze
        # runs, the planner's statistics say otherwise, and a claim may walk the live leases in
        # number order instead of seeking the expired ones by time (see postgres_sql._pick).
        self._write(lambda tx: tx.run(q.ANALYZE_SHARDS), retry=False)
        # The version's records, vacuumed once now that the plan wrote them all (they change no
        # more): every page visible to all, so the outcome fence's probe of each record a worker
        # answers, and each reader's of its ACL, read the key's index alone, not the table too.
        # Only that: a vacuum that fails (a lost connection) leaves autovacuum to do it later.
        records = sql.Identifier(partition_name("records", version))
        try:
            with self._lock, self._connection().cursor() as cur:  # autocommit: VACUUM runs in no transaction
                cur.execute(sql.SQL(q.VACUUM_PARTITION).format(records))
        except psycopg.Error as exc:
            self._drop_connection()
            log.warning("could not vacuum the records of %s (autovacuum will): %s", version, _first_line(exc))

    def _put(self, tx: Tx, lease: Lease, rows: Sequence[ResultRow]) -> Written:
        assert isinstance(tx, _Tx)
        if len(rows) >= COPY_MIN_ROWS:
            self._stage(tx.cur, rows)
            row = tx.one(q.PUT_FROM_STAGE, {**fence(lease), "past_piece": past_highest(rows)})
        else:
            row = tx.one(q.PUT_RESULTS, {
                **fence(lease), "past_piece": past_highest(rows), "ids": [r.record_id for r in rows],
                "outputs": [r.output for r in rows], "labels": [r.label for r in rows],
                "attempts": [r.attempt for r in rows],
                "tin": [r.input_tokens for r in rows], "tout": [r.output_tokens for r in rows],
                "models": [r.model for r in rows], "pieces": [r.piece for r in rows]})
        return _written(row)

    def _stage(self, cur: Cursor, rows: Sequence[ResultRow]) -> None:
        # In the put's own transaction, every time: behind a pooler in transaction mode each
        # transaction may run on another server connection, whose session has no staging table.
        cur.execute(q.CREATE_STAGE)
        with cur.copy(q.COPY_STAGE) as copy:
            copy.set_types(q.STAGE_TYPES)
            for r in rows:
                copy.write_row((r.record_id, r.output, r.label, r.attempt, r.input_tokens, r.output_tokens,
                                r.model, r.piece))

    def _insert_dead(self, tx: Tx, lease: Lease, rows: Sequence[DeadLetterRow]) -> Written:
        return _written(tx.one(q.INSERT_DEAD, {
            **fence(lease), "past_piece": past_highest(rows), "ids": [r.record_id for r in rows],
            "kinds": [r.kind for r in rows], "errors": [r.error for r in rows],
            "attempts": [r.attempts for r in rows],
            "pieces": [r.piece for r in rows]}))

    def _insert_records(self, tx: Tx, version: str, rows: Sequence[PlannedRecord],
                        acl_nos: Sequence[int | None]) -> None:
        assert isinstance(tx, _Tx)
        try:
            if any(r.input is not None for r in rows):
                with tx.cur.copy(q.COPY_RECORDS_WITH_INPUT) as copy:
                    for r, acl_no in zip(rows, acl_nos, strict=True):
                        copy.write_row((version, r.record_id, r.shard_no, r.content_hash, carry_json(r.carry),
                                        r.text_hash, acl_no, r.piece, *input_columns(r)))
            else:
                with tx.cur.copy(q.COPY_RECORDS) as copy:
                    for r, acl_no in zip(rows, acl_nos, strict=True):
                        copy.write_row((version, r.record_id, r.shard_no, r.content_hash, carry_json(r.carry),
                                        r.text_hash, acl_no, r.piece))
        except errors.UniqueViolation:
            raise DuplicateKey() from None

    def _prepare_version(self, tx: Tx, version: str) -> None:
        assert isinstance(tx, _Tx)
        for table in q.PARTITIONED:
            tx.cur.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} PARTITION OF {} FOR VALUES IN ({})").format(
                sql.Identifier(partition_name(table, version)), sql.Identifier(table), sql.Literal(version)))

    def _analyse(self, version: str) -> None:
        # Fresh planner statistics for the version's partitions: they were bulk-loaded
        # and may never have been analysed, and without row counts the planner picks
        # a hash join sized for a few thousand rows that spills to disk.
        def body(cur: Cursor) -> None:
            for table in q.PARTITIONED:
                cur.execute(sql.SQL(q.ANALYZE_PARTITION).format(sql.Identifier(partition_name(table, version))))
        self._run(body)

    def _make_view(self, tx: Tx, name: str) -> None:
        assert isinstance(tx, _Tx)
        view = sql.Identifier(q.PUBLISHED_SCHEMA, name)
        taken = tx.one(q.RELATION_EXISTS, {"relation": view.as_string(tx.cur)})
        stale = tx.one(q.VIEW_WITHOUT_CARRY, {"name": name})
        if not (taken and taken[0]) or (stale and stale[0]):
            tx.cur.execute(sql.SQL(q.CREATE_VIEW).format(view=view, name=sql.Literal(name)))

    def _is_view(self, tx: Tx, name: str) -> bool:
        row = tx.one(q.IS_VIEW, {"name": name})
        return bool(row and row[0])


def _written(row: Row | None) -> Written:
    """A fenced write's answer (postgres_sql._FENCED): lease held, version open, rows new."""
    assert row is not None
    return Written(bool(row[0]), bool(row[1]), int(row[2]))


class _Tx:
    def __init__(self, cur: Cursor) -> None:
        self.cur = cur

    def one(self, stmt: str, params: Params | None = None) -> Row | None:
        self.cur.execute(stmt, params)
        return self.cur.fetchone() if self.cur.description is not None else None

    def all(self, stmt: str, params: Params | None = None) -> list[Row]:
        self.cur.execute(stmt, params)
        return self.cur.fetchall() if self.cur.description is not None else []

    def run(self, stmt: str, params: Params | None = None) -> int:
        self.cur.execute(stmt, params)
        return self.cur.rowcount

    def many(self, stmt: str, rows: Sequence[Params]) -> int:
        self.cur.executemany(stmt, rows)
        return self.cur.rowcount


def _server_message(exc: BaseException) -> str:
    """What the server said, past libpq's 'connection to server at ... failed:' preamble."""
    text = " ".join(str(exc).split())
    return text.split("FATAL: ", 1)[1].strip() if "FATAL: " in text else _first_line(exc)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
