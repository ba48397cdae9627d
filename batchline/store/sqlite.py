"""The embedded SQLite store: one machine, many worker processes, one file.

WAL mode so readers never block the writer; every write transaction starts
with BEGIN IMMEDIATE so a transaction that reads and then writes (a claim, a
fenced put) cannot be overtaken between the two; a busy timeout instead of
errors when another process holds the lock; writes batched, never one
transaction per record. The rules are `core.py`'s; the SQL is `sqlite_sql.py`.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from batchline.errors import StoreError, StoreMissing
from batchline.store import sqlite_sql as q
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
SCHEMA_VERSION = q.SCHEMA_VERSION

sqlite3.register_adapter(uuid.UUID, str)


class _Tx:
    def __init__(self, cur: sqlite3.Cursor) -> None:
        self.cur = cur

    def one(self, stmt: str, params: Params | None = None) -> Row | None:
        # fetchall, not fetchone: a RETURNING statement left half-stepped would keep
        # the transaction from committing.
        rows = self.cur.execute(stmt, params or {}).fetchall()
        return rows[0] if rows else None

    def all(self, stmt: str, params: Params | None = None) -> list[Row]:
        return self.cur.execute(stmt, params or {}).fetchall()

    def run(self, stmt: str, params: Params | None = None) -> int:
        return self.cur.execute(stmt, params or {}).rowcount

    def many(self, stmt: str, rows: Sequence[Params]) -> int:
        return self.cur.executemany(stmt, rows).rowcount


class SQLiteStore(StoreCore):
    q = q

    def __init__(self, path: str | Path, url: str | None = None, *, create: bool = True) -> None:
        self.path = Path(path)
        self.url = url or f"sqlite:///{self.path}"
        # A file has no connection to lose: nothing is retried (StoreHandle.reconnect_seconds).
        self.reconnect_seconds = 0.0
        if not create and not self.path.exists():
            # A typo in a path must not look like "every job is gone": nothing is made here.
            raise StoreMissing(f"store {self.path} does not exist (batchline plan or run makes it)")
        # One connection: a store shared by threads (a worker and its metrics, a test and
        # a worker thread) runs one transaction at a time.
        self._lock = threading.RLock()
        try:
            if create:
                self.created = not self.path.exists()
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

    def where(self) -> str:
        return str(self.path)

    def _migrate(self) -> None:
        def body(tx: Tx) -> None:
            tx.run("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
            row = tx.one("SELECT value FROM meta WHERE key = 'schema_version'")
            current = int(row[0]) if row else 0
            if current > q.SCHEMA_VERSION:
                raise StoreError(f"store {self.path} has schema {current}, newer than this batchline "
                                 f"({q.SCHEMA_VERSION}); upgrade batchline")
            for number, _description, script in q.MIGRATIONS:
                if number > current:
                    for statement in script.split(";"):
                        if statement.strip():
                            tx.run(statement)
            if current < q.SCHEMA_VERSION:
                tx.run("INSERT INTO meta (key, value) VALUES ('schema_version', :n) ON CONFLICT (key) "
                       "DO UPDATE SET value = excluded.value", {"n": str(q.SCHEMA_VERSION)})

        self._write(body)

    # --- transactions -------------------------------------------------------------------

    def _write(self, body: Callable[[Tx], T], *, recover: Callable[[Tx], T | Missing] | None = None,
               retry: bool = True) -> T:
        # A local file loses no acknowledgement: nothing is ever retried, so `recover` is not needed.
        with self._lock:
            return self._transaction(body)

    def _transaction(self, body: Callable[[Tx], T]) -> T:
        cur = self.conn.cursor()
        try:
            cur.execute("BEGIN IMMEDIATE")
            try:
                out = body(_Tx(cur))
            except BaseException:
                cur.execute("ROLLBACK")
                raise
            cur.execute("COMMIT")
            return out
        except sqlite3.Error as exc:
            raise StoreError(f"store {self.path}: {exc}") from None

    def _read(self, body: Callable[[Tx], T], *, snapshot: bool = False) -> T:
        with self._lock:
            cur = self.conn.cursor()
            try:
                if not snapshot:
                    return body(_Tx(cur))
                cur.execute("BEGIN")
                try:
                    return body(_Tx(cur))
                finally:
                    cur.execute("COMMIT")
            except sqlite3.Error as exc:
                raise StoreError(f"store {self.path}: {exc}") from None

    def close(self) -> None:
        self.conn.close()

    def close_discarding(self) -> None:
        # A store this opening made, that no plan was ever written into (the plan failed on its
        # input), is removed with its journal files: a failed first plan leaves nothing behind.
        row = self._read(lambda tx: tx.one(q.NO_JOBS)) if self.created else None
        empty = bool(row and row[0])
        self.conn.close()
        if empty:
            for suffix in ("", "-wal", "-shm", "-journal"):
                Path(f"{self.path}{suffix}").unlink(missing_ok=True)

    # --- what the SQL differs in ----------------------------------------------------------

    def _json(self, value: Any) -> Any:
        return json.dumps(value, default=str)

    def _unjson(self, value: Any) -> Any:
        return json.loads(value) if isinstance(value, str | bytes) else value

    def _list(self, values: Sequence[Any]) -> Any:
        return json.dumps(list(values))

    def _refuse_outcomes(self, tx: Tx, lease: Lease, what: str, record_ids: Sequence[str]) -> None:
        """The outcome fence PostgreSQL's trigger holds every worker to (batchline.store.rights),
        as the store's own statement: the same rules, refused in the same words."""
        row = tx.one(q.OUTCOME_REFUSAL, {**fence(lease), "ids": self._list(list(record_ids))})
        if row is not None:
            raise StoreError(f"{what} for record {row[0]} of {lease.version}: refused: {row[1]}")

    def _put(self, tx: Tx, lease: Lease, rows: Sequence[ResultRow]) -> Written:
        # The fence, checked in this transaction, which holds SQLite's write lock.
        assert isinstance(tx, _Tx)
        written, rows = self._held_rows(tx, lease, rows)
        if not (written.open and rows):
            return written
        self._refuse_outcomes(tx, lease, "a result", [r.record_id for r in rows])
        now = tx.one(q.NOW)
        assert now is not None
        v, s, w, e, at = lease.version, lease.shard_no, lease.owner, lease.epoch, now[0]
        # Positional rows: a flush binds thousands of them, and dicts cost a third of the time.
        params = [(v, r.record_id, s, r.output, w, e, r.attempt, r.input_tokens, r.output_tokens, at, r.label,
                   r.model) for r in rows]
        # Nearly every flush is all new rows: insert them as they are, and only when an id
        # is already answered (a retried flush, a record redone after a lost lease) find
        # which ones are new, so the shard counts the tokens of exactly those.
        tx.cur.execute("SAVEPOINT put")
        try:
            fresh = tx.cur.executemany(q.PUT_RESULT, params).rowcount == len(params)
        except sqlite3.IntegrityError:
            fresh = False
        if not fresh:
            tx.cur.execute("ROLLBACK TO put")
            present = {r[0] for r in tx.all(q.ANSWERED, {"v": lease.version,
                                                         "ids": self._list([r.record_id for r in rows])})}
            # Put-if-absent within the flush too: an id twice keeps its first row.
            kept = []
            for p in params:
                if p[1] not in present:
                    present.add(p[1])
                    kept.append(p)
            params = kept
            tx.cur.executemany(q.PUT_RESULT, params)
        tx.cur.execute("RELEASE put")
        tx.run(q.BUMP_RESULTS, {"v": v, "s": s, "n": len(params), "tin": sum(p[7] or 0 for p in params),
                                "tout": sum(p[8] or 0 for p in params), "high": past_highest(rows)})
        return Written(True, True, len(params))

    def _insert_dead(self, tx: Tx, lease: Lease, rows: Sequence[DeadLetterRow]) -> Written:
        written, rows = self._held_rows(tx, lease, rows)
        if not (written.open and rows):
            return written
        self._refuse_outcomes(tx, lease, "a dead letter", [r.record_id for r in rows])
        n = tx.many(q.INSERT_DEAD, [{**fence(lease), "r": r.record_id, "kind": r.kind, "error": r.error,
                                     "attempts": r.attempts} for r in rows])
        tx.run(q.BUMP_WORKER_DEAD, {"n": n, "v": lease.version, "s": lease.shard_no, "high": past_highest(rows)})
        return Written(True, True, n)

    def _insert_records(self, tx: Tx, version: str, rows: Sequence[PlannedRecord],
                        acl_nos: Sequence[int | None]) -> None:
        assert isinstance(tx, _Tx)
        try:
            if any(r.input is not None for r in rows):
                tx.cur.executemany(q.INSERT_RECORD_WITH_INPUT, [
                    (version, r.record_id, r.shard_no, r.content_hash, carry_json(r.carry), r.text_hash, acl_no,
                     r.piece, *input_columns(r)) for r, acl_no in zip(rows, acl_nos, strict=True)])
            else:
                tx.cur.executemany(q.INSERT_RECORD, [
                    (version, r.record_id, r.shard_no, r.content_hash, carry_json(r.carry), r.text_hash, acl_no,
                     r.piece) for r, acl_no in zip(rows, acl_nos, strict=True)])
        except sqlite3.IntegrityError:
            raise DuplicateKey() from None

    def _prepare_version(self, tx: Tx, version: str) -> None:
        return None  # one file, no partitions

    def _analyse(self, version: str) -> None:
        return None  # SQLite plans the coverage joins well on its primary keys alone

    def _make_view(self, tx: Tx, name: str) -> None:
        quoted = name.replace('"', '""').replace("'", "''")
        stale = tx.one(q.VIEW_WITHOUT_CARRY, {"name": name})
        if stale and stale[0]:
            tx.run(q.DROP_VIEW.format(name=quoted))
        tx.run(q.CREATE_VIEW.format(name=quoted))

    def _is_view(self, tx: Tx, name: str) -> bool:
        row = tx.one(q.IS_VIEW, {"name": name})
        return bool(row and row[0])
