"""Helpers for tests: planning, worker processes, waiting on the store, invariant checks."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchline.plan.planner import plan
from batchline.spec import JobSpec, load_spec
from batchline.store import Store

if TYPE_CHECKING:
    import pytest

ROOT = Path(__file__).resolve().parents[1]
TICKET_SCHEMA = ROOT / "examples" / "tickets" / "triage.schema.json"

SIMPLE_SCHEMA = {
    "type": "object",
    "properties": {
        "category": {"enum": ["a", "b", "c"]},
        "summary": {"type": "string", "maxLength": 30},
    },
    "required": ["category", "summary"],
    "additionalProperties": False,
}


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    with path.open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return path


def make_records(n: int, prefix: str = "r") -> list[dict[str, Any]]:
    return [{"id": f"{prefix}{i:06d}", "text": f"record number {i} about topic {i % 7}",
             "acl": [f"group-{i % 3}"]} for i in range(n)]


PG_ADMIN_URL = os.environ.get("BATCHLINE_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")


def pg_available() -> bool:
    """True when the PostgreSQL store can be imported and the server answers."""
    try:
        import psycopg

        import batchline.store.postgres  # noqa: F401
    except ImportError:
        return False
    try:
        with psycopg.connect(PG_ADMIN_URL, connect_timeout=3):
            return True
    except psycopg.Error:
        return False


def database_url(name: str) -> str:
    return f"{PG_ADMIN_URL.rsplit('/', 1)[0]}/{name}"


@contextlib.contextmanager
def fresh_pg_database(prefix: str) -> Iterator[str]:
    """A new database on the test server for one test, dropped afterwards."""
    if not pg_available():
        postgres_missing("PostgreSQL is not running on 127.0.0.1:5432 (make services starts it)")
    import psycopg

    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield database_url(name)
    finally:
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class Database:
    """Plain SQL on a test store's own database, whichever the backend: what a dashboard
    reading the published view does, or a test that tampers with stored rows. Parameters
    are written `?` and sent in the backend's own style."""

    def __init__(self, store_url: str) -> None:
        self.postgres = not store_url.startswith("sqlite:///")
        if self.postgres:
            import psycopg

            self.conn: Any = psycopg.connect(store_url, autocommit=True)
        else:
            import sqlite3

            self.conn = sqlite3.connect(store_url.removeprefix("sqlite:///"), isolation_level=None)

    def __enter__(self) -> Database:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def execute(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        cur = self.conn.execute(sql.replace("?", "%s") if self.postgres else sql, params)
        return list(cur.fetchall()) if cur.description is not None else []

    def view(self, name: str) -> str:
        """How a reader names the view published under `name`."""
        return f'published."{name}"' if self.postgres else f'"{name}"'

    def close(self) -> None:
        self.conn.close()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, for a server a test starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def postgres_missing(reason: str) -> None:
    """Skips a PostgreSQL test where the server is absent, but fails it where the
    run promised one (`make test` sets BATCHLINE_REQUIRE_POSTGRES=1 after starting it)."""
    import pytest

    if os.environ.get("BATCHLINE_REQUIRE_POSTGRES") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


def planned(spec_path: Path, store: Store) -> tuple[JobSpec, str]:
    spec = load_spec(spec_path)
    return spec, plan(spec, store).version


# --- worker processes -------------------------------------------------------------


def start_worker(store_url: str, version: str | None = None, log: Path | None = None,
                 poll: float = 0.2, env: dict[str, str] | None = None,
                 cwd: Path | None = None) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "batchline", "worker", "--store", store_url, "--poll-seconds", str(poll)]
    if version:
        cmd += ["--job", version]
    out = log.open("ab") if log else subprocess.DEVNULL
    run_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    if cwd is not None:
        # Elsewhere than the checkout: the package must still be found.
        run_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), run_env.get("PYTHONPATH")) if p)
    return subprocess.Popen(cmd, stdout=out, stderr=out, stdin=subprocess.DEVNULL, env=run_env, cwd=cwd)


def wait_for(condition: Callable[[], Any], timeout: float = 60.0, what: str = "condition",
             workers: Sequence[tuple[subprocess.Popen[bytes], Path]] = ()) -> Any:
    """Waits on the store's state (polling), never on a fixed sleep. With `workers` (each process
    and its log), a worker that exits before the condition holds ends the wait at once, and a
    failure shows the end of each worker's log: the wait's cause is theirs to tell."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if any(p.poll() is not None for p, _ in workers):
            raise AssertionError(f"a worker exited while waiting for {what}" + _log_tails(workers))
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}" + _log_tails(workers))


def _log_tails(workers: Sequence[tuple[subprocess.Popen[bytes], Path]], lines: int = 15) -> str:
    tails = []
    for p, log in workers:
        text = log.read_text(errors="replace") if log.exists() else ""
        tails.append(f"\n--- worker {p.pid} (exit {p.poll()}), {log.name}:\n"
                     + "\n".join(text.splitlines()[-lines:]))
    return "".join(tails)


def kill_9(pid: int) -> None:
    """Kills a worker outright, as a lost machine would, and waits until it and its engine
    child are gone."""
    from batchline.ops.drill.run import children, gone

    engine = children(pid)
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: gone(pid) and all(gone(c) for c in engine), what=f"worker {pid} and its engine gone")


def _holds_write_lock(store: Store | None) -> bool:
    """Whether another process is inside a transaction of the store right now: holding SQLite's
    one write lock, or a PostgreSQL session of the store's database that is not idle."""
    from batchline.store.postgres import PostgresStore
    from batchline.store.sqlite import SQLiteStore

    if isinstance(store, SQLiteStore):
        import sqlite3

        probe = sqlite3.connect(str(store.path), isolation_level=None, timeout=0.2)
        try:
            probe.execute("BEGIN IMMEDIATE")
            probe.execute("ROLLBACK")
            return False
        except sqlite3.OperationalError:
            return True
        finally:
            probe.close()
    if isinstance(store, PostgresStore):
        import psycopg

        with psycopg.connect(store.url, autocommit=True) as conn:
            row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                               " AND backend_type = 'client backend' AND state <> 'idle'"
                               " AND pid <> pg_backend_pid()").fetchone()
        return bool(row and row[0])
    return False


def stop_group(pid: int, store: Store | None = None, tries: int = 100) -> list[int]:
    """SIGSTOP a worker and its engine child (a stall); returns the stopped pids. Given its
    store, the stop lands between the worker's transactions: a process stopped inside one
    keeps its locks (SQLite's single write lock, which stalls every process of the host; the
    shard row PostgreSQL's claims skip), a different fault from a stalled worker's expired
    lease, the one these tests reproduce."""
    from batchline.ops.drill.run import children

    group = [pid, *children(pid)]
    for _ in range(tries):
        for p in group:
            os.kill(p, signal.SIGSTOP)
        if not _holds_write_lock(store):
            return group
        for p in group:
            os.kill(p, signal.SIGCONT)
        time.sleep(0.05)
    raise AssertionError(f"worker {pid} held the store's write lock at each of {tries} stops")


@contextlib.contextmanager
def stopped(pid: int, store: Store | None = None) -> Iterator[list[int]]:
    """A worker and its engine child SIGSTOPped for the block (a stall), SIGCONTed after it."""
    group = stop_group(pid, store)
    try:
        yield group
    finally:
        for p in group:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGCONT)


def stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGCONT)
            p.kill()
        p.wait()


def check_invariants(store: Store, version: str, spec: JobSpec) -> tuple[set[str], set[str]]:
    """I1 and I4 from what was stored: every snapshot id has exactly one outcome,
    nothing else has one, and every result is valid against the schema."""
    from batchline.check.outputs import OutputChecker
    from batchline.snapshot.order import snapshot_records

    snapshot_ids = [r.id for r in snapshot_records(spec, store.url)]
    results = {r.record_id: r for r in store.iter_results(version)}
    dead = {d.record_id for d in store.iter_dead_letters(version)}
    assert not (set(results) & dead), f"ids both answered and dead-lettered: {sorted(set(results) & dead)[:5]}"
    assert set(results) | dead == set(snapshot_ids), "results plus dead letters differ from the snapshot"
    assert len(results) + len(dead) == len(snapshot_ids)
    checker = OutputChecker(spec.output_schema)
    for r in results.values():
        assert checker.is_valid(json.loads(r.output)), f"invalid stored result for {r.record_id}"
    return set(results), dead


def call_counts(call_log: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    if call_log.exists():
        for line in call_log.read_text().split():
            counts[line] = counts.get(line, 0) + 1
    return counts


def run_to_seal(store: Store, version: str) -> None:
    """Runs one in-process worker (with its real engine child) until the version seals."""
    from batchline.worker.supervisor import Worker

    assert Worker(store, version=version, poll_seconds=0.1).run() == 0
    job = store.job(version)
    assert job is not None and job.state == "sealed"


def rescue_stalled_shard(store: Store, store_url: str, version: str, shard_no: int,
                         procs: list[subprocess.Popen[bytes]], log: Path, *, lease_seconds: float = 60,
                         timeout: float = 120) -> None:
    """With the shard's owner stalled: the store's clock past its lease, and a new worker
    (added to `procs`) that takes the shard over and finishes it."""
    stalled_owner = store.shard_rows(version)[shard_no].owner
    store.shift_clock(lease_seconds + 1)
    procs.append(start_worker(store_url, version, log))

    def done() -> bool:
        row = store.shard_rows(version)[shard_no]
        if row.state == "leased" and row.owner == stalled_owner and (row.lease_expires or 0) > store.now():
            # A renewal the owner sent just before it was stopped, run by the server after the
            # shift: its lease runs from the shifted clock. The owner is stopped now, so no
            # other renewal can follow this one.
            store.shift_clock(lease_seconds + 1)
        return row.state == "done"

    wait_for(done, timeout=timeout, what="the rescuer to finish the stalled worker's shard")


def sealed_and_gone(store: Store, version: str, stalled: subprocess.Popen[bytes], timeout: float = 180) -> None:
    """The job sealed, and the stalled worker, woken, gone."""
    wait_for(lambda: (job := store.job(version)) is not None and job.state == "sealed", timeout=timeout,
             what="the job to seal")
    wait_for(lambda: stalled.poll() is not None, timeout=60, what="the stalled worker to exit")


def workers_until_done(store_url: str, version: str, log_dir: Path, n: int = 2, timeout: float = 180) -> None:
    """`n` workers on the version, each of which must exit 0 (no work left)."""
    procs = [start_worker(store_url, version, log_dir / f"w{i}.log") for i in range(n)]
    try:
        for p in procs:
            assert p.wait(timeout=timeout) == 0
    finally:
        stop_all(procs)


def before_the_store_records(monkeypatch: pytest.MonkeyPatch, store: Store, operation: str,
                             other: Callable[[], Any]) -> list[Any]:
    """Runs `other` (another publisher) once, after the publish path has moved every target
    and just before it asks `store` to record the publication (`operation`: "publish" or
    "rollback"): two publishers interleaved deterministically, not raced. Returns what
    `other` returned, once it has run."""
    recorded = getattr(store, operation)
    ran: list[Any] = []

    def between(*args: Any, **kwargs: Any) -> Any:
        if not ran:
            ran.append(other())
        return recorded(*args, **kwargs)

    monkeypatch.setattr(store, operation, between)
    return ran


def read_during_switches(store: Store, name: str, other: str, read_until: Callable[[threading.Event], None],
                         *, readers: int = 2, switches: int = 15) -> None:
    """Runs `readers` threads of `read_until(stop)` while `name` is published to `other`
    and rolled back, `switches` times over; the readers are stopped and joined after."""
    from batchline.publish.pointer import publish, rollback

    stop = threading.Event()
    threads = [threading.Thread(target=read_until, args=(stop,)) for _ in range(readers)]
    for t in threads:
        t.start()
    try:
        for _ in range(switches):
            publish(store, other)
            rollback(store, name)
    finally:
        stop.set()
        for t in threads:
            t.join()
