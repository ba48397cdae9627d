"""`batchline grants`: a worker connected under the role it makes works its own
job version, and the database itself refuses everything else."""

from __future__ import annotations

import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import errors

from batchline.errors import BatchlineError, StoreError
from batchline.ops.grants import grant
from batchline.publish.pointer import publish
from batchline.store import Store
from batchline.store.postgres import PostgresStore
from tests.helpers import (
    PG_ADMIN_URL,
    check_invariants,
    make_records,
    planned,
    start_worker,
    wait_for,
)
from tests.stores import role_url

pytestmark = pytest.mark.postgres


@pytest.fixture
def role(pg_url: str) -> Iterator[str]:
    # Roles belong to the cluster, not the test's database: unique, and dropped after.
    name = f"bl_test_worker_{uuid.uuid4().hex[:10]}"
    yield name
    with psycopg.connect(pg_url, autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (name,)).fetchone():
            conn.execute(f'DROP OWNED BY "{name}"')
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'DROP ROLE IF EXISTS "{name}"')


as_role = role_url


def test_dry_run_prints_the_grants_and_creates_nothing(job_factory: Any, store: Store, store_url: str,
                                                      role: str) -> None:
    _spec, version = planned(job_factory(n=10), store)
    plan = grant(store_url, version, role=role, dry_run=True)
    assert not plan.created
    text = "\n".join(plan.statements)
    assert f'CREATE ROLE "{role}" LOGIN' in text and "NOBYPASSRLS" in text
    assert "CREATE POLICY" in text and f"'{version}'" in text
    assert not any("pointers" in s or "publications" in s for s in plan.statements)
    assert any("input snapshot" in line and "read-only" in line for line in plan.access)
    with psycopg.connect(store_url) as conn:
        assert conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone() is None


def test_grants_needs_postgresql(tmp_path: Path) -> None:
    with pytest.raises(BatchlineError, match="needs a PostgreSQL store"):
        grant(f"sqlite:///{tmp_path / 'x.db'}", "v@1")


def test_a_worker_under_the_role_does_its_job_and_nothing_else(job_factory: Any, store: Store, store_url: str,
                                                               role: str, tmp_path: Path) -> None:
    spec, mine = planned(job_factory(n=300, options={"error_on": ["r000004"]},
                                     shards={"size": 50}), store)
    _other_spec, other = planned(job_factory(make_records(40, "o"), name="other-job"), store)
    plan = grant(store_url, mine, role=role)
    assert plan.created
    grant(store_url, mine, role=role)  # idempotent: a second run changes nothing and does not fail
    url = as_role(store_url, role)
    # The worker's session settings are the role's own, however it connects (a pooler may refuse
    # them at connection).
    with psycopg.connect(url) as conn:
        assert conn.execute("SHOW idle_in_transaction_session_timeout").fetchone() == ("1min",)

    # A real worker process under the narrow role finishes its job version.
    log = tmp_path / "worker.log"
    assert start_worker(url, mine, log).wait(timeout=120) == 0, log.read_text()[-3000:]
    check_invariants(store, mine, spec)
    assert store.job(mine).state == "sealed"  # type: ignore[union-attr]
    assert {d.record_id for d in store.iter_dead_letters(mine)} == {"r000004"}

    # Through the store, another job does not exist for this role.
    narrow = PostgresStore(url)
    try:
        assert narrow.claim("intruder", other) is None
        assert not narrow.has_open_shards(other)
        assert narrow.job(other) is None and [j.version for j in narrow.jobs()] == [mine]
        with pytest.raises(StoreError, match="permission denied"):
            narrow.publish(spec.name, mine, "intruder", None, None, expected=None)
        with pytest.raises(StoreError, match="permission denied"):
            narrow.remove_version(other)
    finally:
        narrow.close()

    # And directly in SQL, the database refuses each of these.
    refused = {
        "publish": "INSERT INTO pointers (name, version, updated_at) VALUES ('test-job', %(v)s, 0)",
        "publication": "INSERT INTO publications (name, version, action, who, ts) "
                       "VALUES ('test-job', %(v)s, 'publish', 'x', 0)",
        "validation": "INSERT INTO validations (version, passed, report, ts) VALUES (%(v)s, true, '{}', 0)",
        "update a result": "UPDATE results SET output = '{}' WHERE version = %(v)s",
        "delete a result": "DELETE FROM results WHERE version = %(v)s",
        "delete a dead letter": "DELETE FROM dead_letters WHERE version = %(v)s",
        "delete a shard": "DELETE FROM shards WHERE version = %(v)s",
        "delete events": "DELETE FROM events WHERE version = %(v)s",
        "write a planned record": "UPDATE records SET content_hash = 'x' WHERE version = %(v)s",
        "another job's result": "INSERT INTO results (version, record_id, shard_no, output, worker, epoch, "
                                "attempt, created_at) VALUES (%(o)s, 'o000001', 0, '{}', 'x', 1, 1, 0)",
        "another job's event": "INSERT INTO events (version, ts, kind) VALUES (%(o)s, 0, 'seal')",
        "a forged carried result": "INSERT INTO results (version, record_id, shard_no, output, origin, worker, "
                                   "epoch, attempt, created_at) VALUES (%(v)s, 'zz', 0, NULL, %(o)s, 'x', 1, 1, 0)",
        "rewrite the spec": "UPDATE jobs SET spec = '{}' WHERE version = %(v)s",
        "move the clock": "UPDATE clock SET offset_s = 1000",
    }
    with psycopg.connect(url, autocommit=True) as conn:
        for what, statement in refused.items():
            with pytest.raises(errors.InsufficientPrivilege):
                conn.execute(statement, {"v": mine, "o": other})
                pytest.fail(f"the database let the worker {what}")
        # Another job's rows are invisible: reading finds none, and changing them changes none.
        assert conn.execute("SELECT count(*) FROM shards WHERE version = %s", (other,)).fetchone() == (0,)
        assert conn.execute("UPDATE shards SET owner = 'x' WHERE version = %s", (other,)).rowcount == 0
        # Its own job, once sealed, is out of its reach too.
        assert conn.execute("UPDATE jobs SET state = 'ready' WHERE version = %s", (mine,)).rowcount == 0
        assert conn.execute("SELECT count(*) FROM events WHERE version = %s", (other,)).fetchone() == (0,)
        # Its own planned records it may read (where the store holds its input), another job's not.
        assert conn.execute("SELECT count(*) FROM records WHERE version = %s", (mine,)).fetchone() == (300,)
        assert conn.execute("SELECT count(*) FROM records WHERE version = %s", (other,)).fetchone() == (0,)
    # The owner still sees the other job untouched, and can publish the worker's.
    assert all(r.owner is None and r.epoch == 0 for r in store.shard_rows(other))
    from batchline.check.validate import validate

    validate(store, mine)
    publish(store, mine, force=True, reason="one engine error, accepted in this test")
    assert store.resolve_name(spec.name) == mine


def test_a_worker_under_the_role_gives_its_lease_back_on_sigterm(job_factory: Any, store: Store, store_url: str,
                                                                 role: str, tmp_path: Path) -> None:
    # Regression: the role could not write `poll_at`, which a release sets, so a worker
    # told to stop printed `permission denied for table shards`, exited 4 instead of 75,
    # and its shard stayed leased until the lease ran out (I5).
    _spec, version = planned(job_factory(n=400, options={"seconds_per_record": 0.02},
                                         shards={"size": 400, "lease_seconds": 600}), store)
    grant(store_url, version, role=role)
    log = tmp_path / "worker.log"
    proc = start_worker(as_role(store_url, role), version, log)
    wait_for(lambda: store.status(version).results >= 10, what="some results")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 75, log.read_text()[-2000:]
    [shard] = store.shard_rows(version)
    assert (shard.state, shard.owner) == ("ready", None)
    assert [e.detail["reason"] for e in store.events(version, ["release"])] == ["stop"]
    assert "permission denied" not in log.read_text()


def test_a_hosted_route_runs_under_the_role(job_factory: Any, store: Store, store_url: str, role: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # Regression: intents, parking and polling write `batch` and `poll_at`, which the role lacked.
    from tests.acceptance.test_hosted_routes import KEY_ENV, SERVED, classed, job
    from tests.fakes.provider_servers import openai_batch_server

    with openai_batch_server() as server:
        monkeypatch.setenv(KEY_ENV, server.api_key)
        server.served_model, server.api = SERVED["openai"], "openai"
        spec, version = planned(job(job_factory, server, classed(20, cleared_every=2)), store)
        grant(store_url, version, role=role)
        narrow = PostgresStore(as_role(store_url, role))
        try:
            from batchline.worker.supervisor import Worker

            assert Worker(narrow, version=version, poll_seconds=0.02).run() == 0
        finally:
            narrow.close()
    check_invariants(store, version, spec)
    assert store.route_totals(version)["hosted"].results == 10


def test_a_job_over_a_published_job_runs_under_the_role_reading_only_its_own_versions_rows(
        job_factory: Any, store: Store, store_url: str, role: str, tmp_path: Path) -> None:
    from tests.integration.test_job_input import downstream_job, publish_upstream, texts_read

    _up, upstream = publish_upstream(job_factory, store, make_records(150))
    spec, version = planned(downstream_job(job_factory, shards={"size": 40}), store)
    access = grant(store_url, version, role=role).access
    assert [line for line in access if line.startswith(f"input job tickets (version {upstream}, output.summary)")]
    url = as_role(store_url, role)
    log = tmp_path / "worker.log"
    assert start_worker(url, version, log).wait(timeout=120) == 0, log.read_text()[-3000:]
    results, _dead = check_invariants(store, version, spec)
    assert len(results) == 150 and "permission denied" not in log.read_text()
    # The role reads its own version's records, with their text, and nothing of the upstream's.
    with psycopg.connect(url, autocommit=True) as conn:
        for table in ("records", "results", "dead_letters", "shards", "jobs"):
            assert conn.execute(f"SELECT count(*) FROM {table} WHERE version = %s", (upstream,)).fetchone() == (0,)
        rows = conn.execute("SELECT record_id, text FROM records WHERE version = %s", (version,)).fetchall()
    assert dict(rows) == texts_read(store, version) and all(text for _rid, text in rows)


def test_a_worker_under_the_role_cannot_make_the_paid_spend_look_smaller(
        job_factory: Any, store: Store, store_url: str, role: str) -> None:
    _spec, version = planned(job_factory(n=10, deadline="1h", fallback={"workers": 1, "cost_per_worker_hour": 3.6,
                                                                        "max_cost": 3.6}), store)
    grant(store_url, version, role=role)
    assert store.paid_launch(version, "paid-0", "pacer", 3.6, stale_seconds=60, launch_timeout=600) == 1
    narrow = PostgresStore(as_role(store_url, role))
    try:
        # What a paid worker does: up, a heartbeat, its budget read, a heartbeat row of its own.
        assert narrow.paid_seen(version, "paid-0", 1, "w", {"pid": 1})
        narrow.worker_beat(version, "w", every=5.0, paid_slot="paid-0/1")
        assert narrow.paid_budget(version)[1] == pytest.approx(3.6)
    finally:
        narrow.close()
    [start] = store.paid_slots(version)
    assert start.started_at is not None
    store.shift_clock(1800)
    with psycopg.connect(as_role(store_url, role), autocommit=True) as conn:
        # Its start's launch, price and first heartbeat are out of its reach...
        for column, value in (("started_at", "started_at + 1800"), ("launched_at", "0"), ("cost_per_hour", "0")):
            with pytest.raises(errors.InsufficientPrivilege):
                conn.execute(f"UPDATE paid_workers SET {column} = {value} WHERE version = %s", (version,))
                pytest.fail(f"the database let the worker set {column}")
        # ...and the times it may write are the database's, whatever it says.
        conn.execute("UPDATE paid_workers SET seen_at = 0, claimed_at = 0, stopped_at = 0 WHERE version = %s",
                     (version,))
        # Nor can it drop another's heartbeat row or forge one for another version.
        with pytest.raises(errors.InsufficientPrivilege):
            conn.execute("DELETE FROM worker_beats WHERE version = %s", (version,))
    [after] = store.paid_slots(version)
    now = store.now()
    assert after.started_at == start.started_at
    assert after.seen_at is not None and abs(after.seen_at - now) < 5
    assert after.stopped_at is not None and abs(after.stopped_at - now) < 5
    spent, _per_hour = store.paid_budget(version)
    assert spent == pytest.approx(3.6 * 1800 / 3600, rel=0.01)  # the half hour it ran, not less


def test_a_worker_role_changes_shards_only_as_its_fenced_statements_do(store: Store, store_url: str,
                                                                        role: str) -> None:
    """The role may update its version's shards (claim, renew, complete ...), but a bare UPDATE
    or INSERT of its own is held to the shapes of those statements: a shard's file is recorded
    only by the completion of its current lease, and nothing else is rewritten."""
    from tests.integration.store.test_contract import answer_all, plan_version

    version = "fenced@1"
    ids = plan_version(store, version, shards=3, lease_seconds=600)
    grant(store_url, version, role=role)
    url = as_role(store_url, role)
    narrow = PostgresStore(url)
    try:
        first, held, freed = (narrow.claim(f"w{i}", version) for i in range(3))
        assert first is not None and held is not None and freed is not None
        # One shard completed under the role, recording its file; one leased and live; one ready.
        answer_all(narrow, first, ids[first.shard_no])
        answer_all(narrow, held, ids[held.shard_no][:2])
        narrow.complete(first, {"iceberg:store/x": {"path": "/staging/own.parquet", "rows": 4, "pin": {"size": 1}}})
        assert narrow.release(freed, "test")
    finally:
        narrow.close()
    completed, leased, ready = first.shard_no, held.shard_no, freed.shard_no
    rows = {r.shard_no: r for r in store.shard_rows(version)}
    assert (rows[completed].state, rows[leased].state, rows[ready].state) == ("done", "leased", "ready")
    files_before = {u.shard_no: u.files for u in store.shard_units(version)}
    assert files_before[completed] is not None
    forged = '{"iceberg:store/x": {"path": "/etc/passwd", "rows": 1, "pin": {}}}'
    refused = {
        "rewrite a completed shard's file": (f"UPDATE shards SET files = '{forged}' WHERE shard_no = {completed}",
                                             "a completed shard is not changed by a worker"),
        "reopen a completed shard": (f"UPDATE shards SET state = 'ready' WHERE shard_no = {completed}",
                                     "a completed shard is not changed by a worker"),
        "record a file without completing": (f"UPDATE shards SET files = '{forged}' WHERE shard_no = {leased}",
                                             "recorded only by the completion of its current lease"),
        "complete a shard without its outcomes": (
            f"UPDATE shards SET state = 'done', files = '{forged}' WHERE shard_no = {leased}",
            "once every record has an outcome"),
        "complete a ready shard": (f"UPDATE shards SET state = 'done' WHERE shard_no = {ready}",
                                   "only by its current lease"),
        "move an epoch back": (f"UPDATE shards SET epoch = epoch - 1 WHERE shard_no = {leased}",
                               "an epoch only moves up by one"),
        "take a live lease without a take-back": (
            f"UPDATE shards SET owner = 'thief', epoch = epoch + 1 WHERE shard_no = {leased}",
            "a claim of a claimable shard"),
        "hand a lease over in its epoch": (f"UPDATE shards SET owner = 'thief' WHERE shard_no = {leased}",
                                           "changes hands only with a new epoch"),
        "rewrite a slice": (f"UPDATE shards SET slice = '{{}}' WHERE shard_no = {ready}",
                            "permission denied for table shards"),  # not even a column it may write
        "rewrite a shard's home region": (f"UPDATE shards SET home = 'elsewhere' WHERE shard_no = {ready}",
                                          "permission denied for table shards"),  # the planner's alone
        "say its shard ran in another region": (f"UPDATE shards SET ran_in = 'elsewhere' WHERE shard_no = {leased}",
                                                "where a shard runs is set only by a claim"),
        "undo counted outcomes": (f"UPDATE shards SET results_count = 0 WHERE shard_no = {leased}",
                                  "never go down"),
        "shrink a shard without a split": (f"UPDATE shards SET record_count = 1 WHERE shard_no = {ready}",
                                           "shrink only when a split moves its tail"),
        "insert a completed shard": (
            "INSERT INTO shards (version, shard_no, slice, record_count, state, files) "
            f"VALUES (%(v)s, 99, '{{}}', 0, 'done', '{forged}')", "a new shard is a split's"),
    }
    with psycopg.connect(url, autocommit=True) as conn:
        for what, (statement, why) in refused.items():
            where = statement if statement.startswith("INSERT") else statement + " AND version = %(v)s"
            with pytest.raises(errors.InsufficientPrivilege, match=why):
                conn.execute(where, {"v": version})
                pytest.fail(f"the database let the worker {what}")
        # Another worker of the same role cannot act for a live lease: without the lease's key
        # (its holder's secret, of which the row keeps only a hash) a renewal is refused ...
        with pytest.raises(errors.InsufficientPrivilege, match="only by the lease's holder \\(its key\\)"):
            conn.execute(f"UPDATE shards SET lease_expires = lease_expires + 1 WHERE version = %(v)s "
                         f"AND shard_no = {leased}", {"v": version})
        # ... and what the holder's statements do, with its key, still goes.
        assert conn.execute("UPDATE shards SET lease_expires = lease_expires + 1 WHERE version = %(v)s "
                            f"AND shard_no = {leased} AND set_config('batchline.lease_key', %(k)s, true) "
                            "IS NOT NULL", {"v": version, "k": held.key}).rowcount == 1
    assert {u.shard_no: u.files for u in store.shard_units(version)} == files_before


def test_a_role_for_a_jobs_name_works_its_versions_and_cannot_plan_publish_or_see_another_job(
        job_factory: Any, store: Store, store_url: str, role: str) -> None:
    """`batchline grants --name`: a scheduled run's worker slots hold it before the night's version
    is planned; it reaches every version of its job's name and nothing else."""
    _spec, mine = planned(job_factory(n=20, name="nightly"), store)
    _other_spec, other = planned(job_factory(make_records(10, "o"), name="nightly-other"), store)
    store.key_plan("nightly", "29420160", mine)
    store.key_plan("nightly-other", "29420160", other)
    plan = grant(store_url, name="nightly", role=role)
    assert plan.created and plan.version == "every version of nightly"
    narrow = PostgresStore(as_role(store_url, role))
    try:
        assert [j.version for j in narrow.jobs()] == [mine]
        assert narrow.keyed_version("nightly", "29420160") == mine
        assert narrow.keyed_version("nightly-other", "29420160") is None  # another job's key is invisible
        lease = narrow.claim("slot-0", None)
        assert lease is not None and lease.version == mine
        with pytest.raises(StoreError, match="permission denied"):
            narrow.publish("nightly", mine, "intruder", None, None, expected=None)
    finally:
        narrow.close()
    with psycopg.connect(as_role(store_url, role), autocommit=True) as conn:
        for statement in ("INSERT INTO jobs (version, name, state, spec, created_at) "
                          "VALUES ('nightly@forged', 'nightly', 'ready', '{}', 0)",
                          "INSERT INTO plan_keys (name, key, version, created_at) VALUES ('nightly', 'k', 'nightly@x', 0)",
                          "INSERT INTO validations (version, passed, report, ts) VALUES (%(v)s, true, '{}', 0)"):
            with pytest.raises(errors.InsufficientPrivilege):
                conn.execute(statement, {"v": mine})
    with pytest.raises(BatchlineError, match="--name 'Nightly' is not a job name"):
        grant(store_url, name="Nightly", role=role)
