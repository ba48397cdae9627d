"""A worker's connection to PostgreSQL dropped under it: backends terminated
mid-run, the server restarted, and the worst case, a commit whose
acknowledgement never arrives. Each write must be applied exactly once."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import psycopg
import pytest

from batchline.errors import StoreError
from batchline.store import DeadLetterRow, ResultRow, Store, open_store
from batchline.store.postgres import PostgresStore
from examples.pgbouncer import AS_POSTGRES, PgBouncer
from examples.pgbouncer import installed as pgbouncer_installed
from tests.helpers import (
    PG_ADMIN_URL,
    check_invariants,
    free_port,
    planned,
    postgres_missing,
    start_worker,
    stop_all,
    wait_for,
)
from tests.integration.store.test_contract import OUT, plan_version

pytestmark = pytest.mark.postgres


class LoseAcknowledgement:
    """A test fake of the network between client and server: the next transaction
    commits on the server, then the connection drops before the client hears so.
    No real peer can be made to do this on cue; it is the window in which a retry
    cannot know whether its first try happened."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.armed = False
        self.fired = 0
        original = psycopg.Transaction.__exit__

        def exit_then_drop(tx: psycopg.Transaction, exc_type: type[BaseException] | None,
                           exc: BaseException | None, tb: TracebackType | None) -> bool:
            result = original(tx, exc_type, exc, tb)
            if self.armed and exc_type is None and not tx.savepoint_name:
                self.armed = False
                self.fired += 1
                tx.connection.close()
                raise psycopg.OperationalError("the connection dropped after COMMIT (test fake)")
            return result

        monkeypatch.setattr(psycopg.Transaction, "__exit__", exit_then_drop)

    def __enter__(self) -> LoseAcknowledgement:
        self.armed = True
        return self

    def __exit__(self, *_exc: object) -> None:
        assert self.fired == 1 and not self.armed, "the fake did not drop the connection"
        self.fired = 0


@pytest.fixture
def lose(monkeypatch: pytest.MonkeyPatch) -> LoseAcknowledgement:
    return LoseAcknowledgement(monkeypatch)


def test_a_claim_whose_acknowledgement_was_lost_returns_the_lease_it_took(store: Store,
                                                                          lose: LoseAcknowledgement) -> None:
    plan_version(store, shards=2)
    with lose:
        lease = store.claim("w1")
    assert lease is not None and (lease.shard_no, lease.epoch) == (0, 1)
    assert [(r.owner, r.epoch, r.claims) for r in store.shard_rows("job@1")] == [("w1", 1, 1), (None, 0, 0)]
    assert len(store.events("job@1", ["claim"])) == 1
    assert store.renew(lease) is not None  # the lease it returned is the one it holds


def test_charges_releases_and_events_are_applied_once(store: Store, lose: LoseAcknowledgement) -> None:
    ids = plan_version(store, shards=1)
    lease = store.claim("w1")
    assert lease is not None
    with lose:
        charged = store.charge_attempt(lease, ids[0][0], "crash", "boom", None, 3)
    assert (charged.attempts, charged.dead_lettered) == (1, False)
    assert store.attempts("job@1", ids[0]) == {ids[0][0]: 1}
    with lose:
        store.log_event("engine_crash", version="job@1", worker="w1", shard_no=0, epoch=lease.epoch)
    with lose:
        assert store.release(lease, "stop") is True
    assert len(store.events("job@1", ["attempt_failed"])) == 1
    assert len(store.events("job@1", ["engine_crash"])) == 1
    assert [e.detail["reason"] for e in store.events("job@1", ["release"])] == ["stop"]
    assert store.events("job@1", ["stale_epoch"]) == []


def test_puts_dead_letters_and_the_sealing_completion_are_applied_once(store: Store,
                                                                       lose: LoseAcknowledgement) -> None:
    ids = plan_version(store, shards=1)
    lease = store.claim("w1")
    assert lease is not None
    with lose:
        store.put_results(lease, [ResultRow(rid, OUT) for rid in ids[0][:3]])
    with lose:
        store.dead_letter(lease, [DeadLetterRow(ids[0][3], "too_long", "long")])
    [row] = store.shard_rows("job@1")
    assert (row.results, row.dead_letters) == (3, 1)  # the counters moved once
    with lose:
        store.complete(lease)
    job = store.job("job@1")
    assert job is not None and job.state == "sealed"
    assert len(store.events("job@1", ["complete"])) == 1 and len(store.events("job@1", ["seal"])) == 1


def test_a_refusal_whose_acknowledgement_was_lost_is_logged_once(store: Store, lose: LoseAcknowledgement) -> None:
    plan_version(store, shards=1)
    old = store.claim("w1")
    assert old is not None
    store.shift_clock(1000)
    assert store.claim("w2") is not None
    with lose:
        assert store.renew(old) is None
    assert [e.detail["op"] for e in store.events("job@1", ["stale_epoch"])] == ["renew"]


def test_a_worker_stopped_inside_a_transaction_kept_its_shard_locked_and_now_loses_its_session(
        store: Store, pg_url: str) -> None:
    plan_version(store, shards=2)
    # The worker's session setting, made short so the test need not wait a minute.
    worker = PostgresStore(pg_url, migrate=False, settings={"idle_in_transaction_session_timeout": "1s"})
    inside, wake = threading.Event(), threading.Event()
    woke: list[BaseException] = []

    def stopped_in_its_claim(cur: Any) -> None:
        cur.execute("SELECT shard_no FROM shards WHERE version = 'job@1' AND shard_no = 0 FOR UPDATE")
        inside.set()
        wake.wait(30)  # stopped here, between two statements of its transaction

    def run() -> None:
        try:
            worker._run(stopped_in_its_claim, retry=False)
        except StoreError as exc:
            woke.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    assert inside.wait(10)
    first = store.claim("w2")
    assert first is not None and first.shard_no == 1  # shard 0 is locked: every claimer skips it
    # Claimable again once the server ends the stopped session (after 1 s inside its transaction).
    taken = wait_for(lambda: store.claim("w3"), timeout=20, what="shard 0 to be claimable again")
    assert taken.shard_no == 0
    wake.set()
    thread.join(10)
    assert len(woke) == 1  # woken, the worker finds its transaction gone: nothing of it was committed
    assert worker._rows("SELECT 1") == [(1,)]  # and its store connects again
    assert [(r.owner, r.epoch) for r in store.shard_rows("job@1")] == [("w3", 1), ("w2", 1)]
    worker.close()


def test_only_a_workers_sessions_are_ended_inside_a_transaction(pg_url: str) -> None:
    setting = "SHOW idle_in_transaction_session_timeout"
    for worker, shown in ((True, "1min"), (False, "0")):
        opened = open_store(pg_url, create=False, worker=worker)
        assert isinstance(opened, PostgresStore)
        assert opened._rows(setting) == [(shown,)]
        opened.close()
    # A URL that sets it keeps its own, and its other options stay.
    url = pg_url + ("&" if "?" in pg_url else "?") + "options=-c%20idle_in_transaction_session_timeout%3D5s%20-c%20" \
        "statement_timeout%3D7s"
    opened = open_store(url, create=False, worker=True)
    assert isinstance(opened, PostgresStore)
    assert opened._rows(setting) == [("5s",)]
    assert opened._rows("SHOW statement_timeout") == [("7s",)]
    opened.close()


def test_an_error_that_is_not_a_lost_connection_is_not_retried(store_url: str) -> None:
    store = PostgresStore(store_url)
    try:
        started = time.monotonic()
        with pytest.raises(StoreError, match="syntax"):
            store._read(lambda tx: tx.one("SELEKT 1"))
        assert time.monotonic() - started < 5
        assert store.reconnects == 0
    finally:
        store.close()


def test_a_server_that_stays_away_is_reported_within_the_reconnect_time(pg_url: str) -> None:
    store = PostgresStore(pg_url, reconnect_seconds=1.0)
    store._conninfo = store._conninfo.replace("port=5432", "port=1")  # nothing listens there
    store._drop_connection()
    started = time.monotonic()
    with pytest.raises(StoreError, match="could not get it back within 1s"):
        store.now()
    assert time.monotonic() - started < 10
    assert "password" not in store.url


# --- real worker processes -------------------------------------------------------------------

N = 1500
SHARD = 100
POISON = {"crash_on": ["r000007"], "error_on": ["r000420"], "invalid_on": ["r000901"]}


def admin() -> psycopg.Connection[Any]:
    return psycopg.connect(PG_ADMIN_URL, autocommit=True)


def terminate_backends(dbname: str) -> int:
    """Ends every session on the test database: the workers', and the test's own store."""
    with admin() as conn:
        rows = conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                            "WHERE datname = %s AND pid <> pg_backend_pid()", (dbname,)).fetchall()
    return sum(1 for (ok,) in rows if ok)


def progress(store: Store, version: str) -> int:
    st = store.status(version)
    return st.results + st.dead_letters


def sealed(store: Store, version: str) -> bool:
    job = store.job(version)
    return job is not None and job.state == "sealed"


def check_applied_once(store: Store, version: str) -> None:
    """Nothing was applied twice: per-shard counters match the rows, and each
    poison record was charged exactly max_attempts times."""
    per_shard: dict[int, int] = {}
    for r in store.iter_results(version):
        per_shard[r.shard_no] = per_shard.get(r.shard_no, 0) + 1
    dead_per_shard: dict[int, int] = {}
    for d in store.iter_dead_letters(version):
        dead_per_shard[d.shard_no] = dead_per_shard.get(d.shard_no, 0) + 1
    for row in store.shard_rows(version):
        assert (row.results, row.dead_letters) == (per_shard.get(row.shard_no, 0),
                                                   dead_per_shard.get(row.shard_no, 0))
    charges: dict[str, list[int]] = {}
    for e in store.events(version, ["attempt_failed"]):
        charges.setdefault(e.detail["record_id"], []).append(e.detail["attempts"])
    poison = {rid for ids in POISON.values() for rid in ids}
    assert {rid: sorted(n) for rid, n in charges.items()} == {rid: [1, 2, 3] for rid in poison}
    letters = {d.record_id: d.attempts for d in store.iter_dead_letters(version)}
    assert letters == dict.fromkeys(poison, 3)


@pytest.fixture
def poison_job(job_factory: Any) -> Path:
    return job_factory(n=N, options={"seconds_per_record": 0.003, **POISON},
                       shards={"size": SHARD, "lease_seconds": 60})


def test_workers_survive_their_backends_being_terminated_mid_run(
        poison_job: Path, store: Store, store_url: str, tmp_path: Path) -> None:
    spec, version = planned(poison_job, store)
    dbname = store_url.rsplit("/", 1)[1]
    procs = [start_worker(store_url, version, tmp_path / f"w{i}.log") for i in range(3)]
    terminated = []
    try:
        done = 0
        for _ in range(6):
            # Wait for real progress between terminations, so each one lands mid-run.
            done = wait_for(lambda d=done: (n := progress(store, version)) > d + 100 and n, timeout=90,
                            what="progress between terminations")
            if sealed(store, version):
                break
            terminated.append(terminate_backends(dbname))
        wait_for(lambda: sealed(store, version), timeout=180, what="the job to seal")
        codes = [p.wait(timeout=60) for p in procs]
    finally:
        stop_all(procs)
    assert sum(terminated) >= 6 and len(terminated) >= 3, f"too few terminations landed: {terminated}"
    assert codes == [0, 0, 0], [(tmp_path / f"w{i}.log").read_text()[-2000:] for i in range(3)]
    check_invariants(store, version, spec)
    check_applied_once(store, version)


# PostgreSQL's programs and PgBouncer refuse to run as root: as root, a test runs them as postgres.



class PrivateServer:
    """A PostgreSQL cluster of this test's own (initdb in a temporary folder, a free port),
    because restarting the shared server on 127.0.0.1:5432 would cut the connections of every
    other test running beside this one, the vLLM tests included."""

    def __init__(self) -> None:
        found = [str(p.parent) for p in sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))]
        bindir = found[-1] if found else os.path.dirname(shutil.which("initdb") or "")
        if not bindir:
            postgres_missing("needs PostgreSQL's server programs (initdb, pg_ctl) to run a server of its own")
        self.bindir = bindir
        # initdb refuses to run as root; the cluster then belongs to the postgres user.
        self.as_user = AS_POSTGRES
        self.folder = Path(tempfile.mkdtemp(prefix="bl-pgserver-"))
        if self.as_user:
            shutil.chown(self.folder, "postgres", "postgres")
        self.port = free_port()
        self.data = self.folder / "data"
        self.ctl("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "--no-sync")
        self.ctl("pg_ctl", "-D", str(self.data), "-l", str(self.folder / "server.log"), "-w", "-t", "60",
                 "-o", f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c fsync=off",
                 "start")

    def ctl(self, program: str, *args: str) -> None:
        done = subprocess.run([*self.as_user, os.path.join(self.bindir, program), *args],
                              capture_output=True, text=True, timeout=120, check=False)
        if done.returncode != 0:
            raise AssertionError(f"{program} {' '.join(args)} failed: {done.stdout}{done.stderr}")

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def available(self) -> bool:
        try:
            with psycopg.connect(self.url, connect_timeout=3):
                return True
        except psycopg.Error:
            return False

    def restart(self) -> None:
        # -l again: without it the new server writes to pg_ctl's output, which it would hold open.
        self.ctl("pg_ctl", "-D", str(self.data), "-l", str(self.folder / "server.log"), "-m", "fast", "-w",
                 "-t", "60", "restart")

    def close(self) -> None:
        try:
            self.ctl("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)


@pytest.fixture
def private_server() -> Iterator[PrivateServer]:
    server = PrivateServer()
    try:
        yield server
    finally:
        server.close()


def test_workers_survive_a_server_restart(private_server: PrivateServer, poison_job: Path,
                                         tmp_path: Path) -> None:
    store_url = private_server.url
    store = open_store(store_url)
    spec, version = planned(poison_job, store)
    procs = [start_worker(store_url, version, tmp_path / f"w{i}.log") for i in range(2)]
    try:
        before = wait_for(lambda: (n := progress(store, version)) > 200 and n, timeout=90, what="progress")
        private_server.restart()
        wait_for(private_server.available, timeout=60, what="the server to come back")
        after = open_store(store_url)
        try:
            wait_for(lambda: progress(after, version) > before + 100, timeout=90,
                     what="the workers to go on after the restart")
            wait_for(lambda: sealed(after, version), timeout=180, what="the job to seal")
            codes = [p.wait(timeout=60) for p in procs]
            assert codes == [0, 0], [(tmp_path / f"w{i}.log").read_text()[-2000:] for i in range(2)]
            check_invariants(after, version, spec)
            check_applied_once(after, version)
        finally:
            after.close()
    finally:
        stop_all(procs)
        store.close()


def Pooler(pg_url: str, pool_size: int = 20) -> PgBouncer:
    """A PgBouncer of this test's own (examples/pgbouncer.py) in front of the store's database."""
    if not pgbouncer_installed():
        postgres_missing("needs PgBouncer (Debian's pgbouncer: make test installs it)")
    return PgBouncer(str(psycopg.conninfo.conninfo_to_dict(pg_url).get("dbname", "postgres")), pool_size=pool_size)


def test_a_worker_behind_a_pooler_that_refuses_session_settings_connects_without_them(
        store: Store, pg_url: str, caplog: pytest.LogCaptureFixture) -> None:
    plan_version(store, shards=1)
    pooler = Pooler(pg_url)
    try:
        try:
            psycopg.connect(pooler.url + "?options=-c%20statement_timeout%3D7s", connect_timeout=3).close()
        except psycopg.OperationalError as exc:
            assert "unsupported startup parameter: options" in str(exc)
        else:
            pytest.fail("this pooler took the options startup parameter: the test would show nothing")
        worker = open_store(pooler.url, create=False, worker=True)
        assert isinstance(worker, PostgresStore)
        lease = worker.claim("w1")  # works its version through the pooler as any worker
        assert lease is not None and lease.shard_no == 0
        warned = [r.getMessage() for r in caplog.records if "refuses session settings" in r.getMessage()]
        assert len(warned) == 1 and "unsupported startup parameter: options" in warned[0]
        worker.close()
    finally:
        pooler.close()


def test_workers_behind_a_transaction_pooler_share_server_connections_without_prepared_statements(
        store: Store, pg_url: str) -> None:
    """Regression: two workers behind PgBouncer in transaction mode, on its one server
    connection: the second failed once a statement had run five times ('prepared statement
    "_pg3_0" already exists', psycopg's automatic prepares), and a put after the server
    connection changed (here: the pooler restarted) found no staging table ('relation
    "put_stage" does not exist')."""
    plan_version(store, shards=2, per_shard=300)
    pooler = Pooler(pg_url, pool_size=1)
    workers = [open_store(pooler.url, create=False, worker=True) for _ in range(2)]
    try:
        for _ in range(6):
            for i, w in enumerate(workers):
                w.worker_beat("job@1", f"w{i}", every=5.0)
        leases = [w.claim(f"w{i}") for i, w in enumerate(workers)]
        assert all(lease is not None for lease in leases)
        first = [ResultRow(f"s{leases[0].shard_no}-r{j}", OUT) for j in range(150)]  # type: ignore[union-attr]
        assert workers[0].put_results(leases[0], first) == 150  # type: ignore[arg-type]
        # The pooler restarted: the workers reconnect, and the next transaction runs on a new
        # server connection; the lease, not expired, is still theirs.
        pooler.restart()
        rest = [ResultRow(f"s{leases[0].shard_no}-r{j}", OUT) for j in range(150, 300)]  # type: ignore[union-attr]
        assert workers[0].put_results(leases[0], rest) == 150  # type: ignore[arg-type]
        workers[0].complete(leases[0])  # type: ignore[arg-type]
    finally:
        for w in workers:
            w.close()
        pooler.close()
