"""A worker never chooses who reads a result (I8), tried as an attacker who holds one worker's
credentials would: batchline's own worker with one line changed, run beside an honest one, on
SQLite and on PostgreSQL under the role `batchline grants` makes.

- It widens every ACL it puts: every reader (the store's view, an export, the Iceberg table read
  by DuckDB) still reads each record's ACL as the planner read it, and an honest fleet finishes.
- It answers records of a shard it does not hold (another worker's live lease, a shard nobody
  has claimed, a lease taken back from it, a record split off to another shard), or after the
  version sealed: each is refused by the store, naming what, and nothing of it is read.
- On PostgreSQL the same refusals hold for a bare INSERT under the role (the database's fence,
  not batchline's statements), and a row added after publish is never served.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml
from psycopg import errors

from batchline.acl import Acl
from batchline.check.validate import validate
from batchline.errors import StoreError
from batchline.publish.pointer import publish
from batchline.spec import JobSpec
from batchline.store import DeadLetterRow, Lease, LeaseLost, ResultRow, Store
from batchline.worker.supervisor import Worker
from tests.helpers import check_invariants, make_records, planned, run_to_seal
from tests.iceberg_support import main_rows
from tests.stores import SQLITE, WORKER_ROLE

TABLE = "lake.trust"
N, SHARD = 120, 40
EVERYONE = Acl(["everyone"])
OUT = '{"category": "a", "summary": "s"}'
AS_WORKER = [SQLITE, pytest.param(WORKER_ROLE, marks=pytest.mark.postgres)]


@pytest.fixture(params=AS_WORKER)
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def acls_of(records: list[dict[str, Any]]) -> dict[str, list[str]]:
    return {r["id"]: list(r["acl"]) for r in records}


def trust_job(job_factory: Any, tmp_path: Path, *, n: int = N, shard: int = SHARD) -> tuple[Path, dict[str, Any]]:
    records = [{**r, "acl": [f"team-{i % 4}"]} for i, r in enumerate(make_records(n))]
    path = job_factory(records, shards={"size": shard, "lease_seconds": 30})
    spec = yaml.safe_load(path.read_text())
    spec["output"]["table"] = {"catalog": "store", "name": TABLE, "warehouse": str(tmp_path / "wh"),
                               "files": "per-shard"}
    path.write_text(yaml.safe_dump(spec))
    return path, acls_of(records)


class OneLineChanged:
    """The store batchline's own worker writes through, with the one line an attacker changed:
    every ACL it puts (results, dead letters, charged attempts) becomes `["everyone"]`."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.widened = 0
        self.has_put = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def put_results(self, lease: Lease, rows: list[ResultRow]) -> int:
        self.widened += len(rows)
        try:
            return self._store.put_results(lease, [replace(r, acl=EVERYONE) for r in rows])
        finally:
            self.has_put.set()

    def dead_letter(self, lease: Lease, rows: list[DeadLetterRow]) -> int:
        return self._store.dead_letter(lease, [replace(r, acl=EVERYONE) for r in rows])

    def charge_attempt(self, lease: Lease, record_id: str, kind: str, error: str, acl: Acl | None,
                       max_attempts: int, piece: int | None = None) -> Any:
        return self._store.charge_attempt(lease, record_id, kind, error, EVERYONE, max_attempts, piece)


def owner_rows(store_url: str, query: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
    """What the store holds, read past every reader, by the owner: the attack's own traces."""
    if store_url.startswith("sqlite:///"):
        import sqlite3

        with sqlite3.connect(store_url.removeprefix("sqlite:///")) as conn:
            return list(conn.execute(query.replace("%(v)s", ":v"), params).fetchall())
    with psycopg.connect(store_url, autocommit=True) as conn:
        return list(conn.execute(query, params).fetchall())


def view_acls(store_url: str) -> dict[str, list[str]]:
    """The published view, as a dashboard reads it."""
    view = '"test-job"' if store_url.startswith("sqlite:///") else 'published."test-job"'
    return {rid: json.loads(acl) for rid, acl in owner_rows(store_url, f"SELECT id, acl FROM {view}", {})}


def test_a_worker_that_widens_every_acl_it_puts_is_read_with_each_records_planned_acl(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    path, planned_acls = trust_job(job_factory, tmp_path)
    spec, version = planned(path, store)
    attacker = OneLineChanged(store)
    # The honest worker starts once the attacker has put: else it may take every shard first.
    honest = threading.Thread(target=lambda: attacker.has_put.wait(60) and Worker(
        store, version=version, poll_seconds=0.1).run())
    honest.start()
    assert Worker(attacker, version=version, poll_seconds=0.1).run() == 0  # type: ignore[arg-type]
    honest.join(timeout=120)
    assert not honest.is_alive()
    check_invariants(store, version, spec)
    # The attack happened: the attacker answered records, widening each ACL it said; the store
    # kept its answers and none of those ACLs (a put carries none) ...
    kept = owner_rows(store_url, "SELECT count(*), count(acl) FROM results WHERE version = %(v)s", {"v": version})
    assert attacker.widened > 0 and kept[0] == (len(planned_acls), 0)
    # ... and no reader reads it: the check passes (the files hold the plan's ACLs), and the view,
    # an export and the Iceberg table read by DuckDB carry each record's ACL as planned.
    assert validate(store, version).passed
    publish(store, version)
    assert view_acls(store_url) == planned_acls
    exported = tmp_path / "export.jsonl"
    from batchline.api import Jobs

    Jobs(store).export("test-job", format="jsonl", out=exported)
    rows = [json.loads(line) for line in exported.read_text().splitlines()]
    assert {r["id"]: r["acl"] for r in rows} == planned_acls
    lake = {rid: list(acl) for rid, acl in main_rows(store_url, TABLE, "id, acl")}
    assert lake == planned_acls


@pytest.fixture
def two_leases(job_factory: Any, store: Store, tmp_path: Path) -> Iterator[tuple[JobSpec, str, Lease, Lease]]:
    path, _acls = trust_job(job_factory, tmp_path)
    spec, version = planned(path, store)
    mine, theirs = store.claim("attacker", version), store.claim("honest", version)
    assert mine is not None and theirs is not None
    yield spec, version, mine, theirs


def ids_of(store: Store, version: str, lease: Lease) -> list[tuple[str, int | None]]:
    """The ids and pieces of a lease's records, as its worker reads them."""
    from batchline.snapshot.reading import Slice, read_slice
    from batchline.spec import stored_spec

    job = store.job(version)
    assert job is not None
    read = read_slice(Slice.from_json(lease.slice), stored_spec(job).input, None,
                      lambda start, end: store.input_records(version, start, end))
    return [(r.id, r.piece) for r in read]


def refused_put(store: Store, lease: Lease, rows: list[ResultRow], why: str) -> None:
    """The put is refused, as a lost lease (batchline's own statement found no lease it holds)
    or by the fence naming the rule; it writes nothing either way."""
    with pytest.raises((LeaseLost, StoreError), match=why):
        store.put_results(lease, rows)


def honest_fleet_finishes(store: Store, version: str, spec: JobSpec) -> None:
    """Every record once, and nothing of what the store refused."""
    run_to_seal(store, version)
    check_invariants(store, version, spec)
    assert not [r for r in store.iter_results(version) if r.worker == "attacker"]


def test_a_worker_cannot_answer_records_of_another_workers_live_lease(
        store: Store, two_leases: tuple[JobSpec, str, Lease, Lease]) -> None:
    spec, version, mine, theirs = two_leases
    ids = ids_of(store, version, theirs)
    # The one line: the lease it writes under is the other worker's, which it can read (owner,
    # epoch); the key is the one thing it does not have.
    forged = replace(theirs, key=mine.key)
    refused_put(store, forged, [ResultRow(rid, OUT, piece=piece) for rid, piece in ids],
                "put refused|does not hold the shard's lease")
    with pytest.raises((LeaseLost, StoreError)):
        store.complete(forged)
    assert store.release(mine, "done attacking")
    store.release(theirs, "handing over")
    honest_fleet_finishes(store, version, spec)


def test_a_worker_cannot_answer_records_of_a_shard_nobody_has_claimed(
        store: Store, two_leases: tuple[JobSpec, str, Lease, Lease]) -> None:
    spec, version, mine, theirs = two_leases
    [ready] = [r for r in store.shard_rows(version) if r.state == "ready"]
    forged = replace(mine, shard_no=ready.shard_no, owner="attacker", epoch=ready.epoch)
    refused_put(store, forged, [ResultRow(f"r{ready.shard_no * SHARD:06d}", OUT)],
                "put refused|not leased")
    store.release(mine, "stop")
    store.release(theirs, "stop")
    honest_fleet_finishes(store, version, spec)


def test_a_worker_whose_lease_was_taken_back_writes_nothing_more(
        store: Store, two_leases: tuple[JobSpec, str, Lease, Lease]) -> None:
    spec, version, mine, theirs = two_leases
    [holder] = [h for h in store.leases(version) if h.owner == "attacker"]
    assert store.take_back(version, holder, "pacer", {"reason": "its pod is gone"})
    ids = ids_of(store, version, mine)
    refused_put(store, mine, [ResultRow(rid, OUT, piece=piece) for rid, piece in ids],
                "put refused")
    store.release(theirs, "stop")
    honest_fleet_finishes(store, version, spec)


def test_a_worker_cannot_answer_a_record_split_off_to_another_shard(
        job_factory: Any, store: Store, tmp_path: Path) -> None:
    path, _acls = trust_job(job_factory, tmp_path, n=40, shard=40)
    spec, version = planned(path, store)
    mine = store.claim("attacker", version)
    assert mine is not None
    new = store.split(version, "honest")
    assert new is not None
    tail = store.claim("honest", version)
    assert tail is not None and tail.shard_no == new
    renewed = store.renew(mine)
    assert renewed is not None and renewed.end_piece is not None
    [(rid, piece)] = ids_of(store, version, tail)[-1:]
    assert piece is not None and piece >= renewed.end_piece
    # The one line: it says the record is of a piece it still holds.
    lie = [ResultRow(rid, OUT, piece=renewed.first_piece)]
    refused_put(store, renewed, lie, "its record is not in the shard's current slice")
    with pytest.raises(StoreError, match="its record is not in the shard's current slice"):
        store.dead_letter(renewed, [DeadLetterRow(rid, "engine_error", "x", piece=renewed.first_piece)])
    assert store.answered(version, [rid]) == set()
    store.release(renewed, "stop")
    store.release(tail, "stop")
    honest_fleet_finishes(store, version, spec)


def test_a_worker_writes_nothing_after_the_version_sealed_and_was_published(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    path, planned_acls = trust_job(job_factory, tmp_path)
    _spec, version = planned(path, store)
    kept = store.claim("attacker", version)
    assert kept is not None
    store.release(kept, "later")
    run_to_seal(store, version)
    assert validate(store, version).passed
    publish(store, version)
    # The lease it kept from before, and every lease the version had since, are over.
    rows = [ResultRow("r999999", OUT, acl=EVERYONE)]
    refused_put(store, kept, rows, "put refused")
    assert view_acls(store_url) == planned_acls


# --- the database's own fence: a bare INSERT under the worker's role (PostgreSQL) ---------

BARE_INSERT = ("INSERT INTO results (version, record_id, shard_no, output, acl, worker, epoch, attempt, created_at) "
               "SELECT %(v)s, %(r)s, %(s)s, '{\"category\": \"a\", \"summary\": \"s\"}', '[\"everyone\"]', %(w)s, "
               "%(e)s, 1, 0 WHERE set_config('batchline.lease_key', %(k)s, true) IS NOT NULL")


@pytest.mark.postgres
@pytest.mark.parametrize("store_kind", [WORKER_ROLE])
def test_a_bare_insert_under_the_worker_role_is_refused_by_the_database_naming_the_rule(
        job_factory: Any, store: Store, store_url: str, worker_url: Callable[[str], str], tmp_path: Path) -> None:
    path, planned_acls = trust_job(job_factory, tmp_path)
    spec, version = planned(path, store)
    mine, theirs = store.claim("attacker", version), store.claim("honest", version)
    assert mine is not None and theirs is not None
    [ready] = [r for r in store.shard_rows(version) if r.state == "ready"]
    theirs_ids = ids_of(store, version, theirs)
    mine_ids = ids_of(store, version, mine)
    insert = BARE_INSERT

    def attempt(record_id: str, shard_no: int, worker: str, epoch: int, key: str, why: str) -> None:
        with psycopg.connect(worker_url(version), autocommit=True) as conn, \
                pytest.raises(errors.InsufficientPrivilege, match=why):
            conn.execute(insert, {"v": version, "r": record_id, "s": shard_no, "w": worker, "e": epoch, "k": key})
            pytest.fail(f"the database let the worker role insert {record_id}")

    attempt(theirs_ids[0][0], theirs.shard_no, "honest", theirs.epoch, mine.key,
            "does not hold the shard's lease")
    attempt(f"r{ready.shard_no * SHARD:06d}", ready.shard_no, "attacker", ready.epoch, mine.key,
            "its shard is not leased to that worker")
    attempt(theirs_ids[0][0], mine.shard_no, "attacker", mine.epoch, mine.key,
            "its record is not in the shard's current slice")
    attempt("ghost", mine.shard_no, "attacker", mine.epoch, mine.key, "its record is not one this version planned")
    # Its own lease, its own record: the fence lets it through (it computes; it never says who
    # reads), and counts it on its shard as its own statements would, so the shard completes.
    with psycopg.connect(worker_url(version), autocommit=True) as conn:
        conn.execute(insert, {"v": version, "r": mine_ids[0][0], "s": mine.shard_no, "w": "attacker",
                              "e": mine.epoch, "k": mine.key})
    store.release(theirs, "stop")
    store.release(mine, "stop")
    run_to_seal(store, version)
    check_invariants(store, version, spec)
    assert validate(store, version).passed
    publish(store, version)
    # After the publish: the version is sealed, so even its own former lease inserts nothing, and
    # the published view never serves a row the database refused, nor a widened ACL.
    attempt("r999999", mine.shard_no, "attacker", mine.epoch, mine.key, "its version is not open")
    assert view_acls(store_url) == planned_acls


@pytest.mark.postgres
@pytest.mark.parametrize("store_kind", [WORKER_ROLE])
def test_a_split_never_moves_a_piece_that_a_bare_insert_answered(
        job_factory: Any, store: Store, worker_url: Callable[[str], str], tmp_path: Path) -> None:
    path, _acls = trust_job(job_factory, tmp_path, n=40, shard=40)
    spec, version = planned(path, store)
    mine = store.claim("attacker", version)
    assert mine is not None and mine.end_piece is not None
    # It answers the record of its last piece by a bare INSERT, which moves no piece started of
    # its own accord: the database's fence moves them past it, so no split hands it to another
    # shard, whose worker could then never complete it (one outcome a record).
    rid, piece = ids_of(store, version, mine)[-1]
    assert piece == mine.end_piece - 1
    with psycopg.connect(worker_url(version), autocommit=True) as conn:
        conn.execute(BARE_INSERT, {"v": version, "r": rid, "s": mine.shard_no, "w": "attacker", "e": mine.epoch,
                                   "k": mine.key})
    assert store.split(version, "honest") is None
    store.release(mine, "stop")
    run_to_seal(store, version)
    check_invariants(store, version, spec)


def test_a_widening_worker_never_reaches_an_index_search_outside_each_records_acl(
        store: Store, store_url: str, tmp_path: Path) -> None:
    from batchline.api import Jobs
    from tests.integration.test_retrieval_index import index_job

    records = [{"id": f"r{i:03d}", "text": f"ticket {i}", "acl": [f"team-{i % 4}"]} for i in range(40)]
    _spec, version = planned(index_job(tmp_path, records, engine="synthetic", name="trust-index"), store)
    attacker = OneLineChanged(store)
    assert Worker(attacker, version=version, poll_seconds=0.1).run() == 0  # type: ignore[arg-type]
    assert attacker.widened == len(records)
    assert validate(store, version).passed
    publish(store, version)
    assert Jobs(store_url).search("trust-index", "ticket", ["everyone"], k=10).hits == []
    found = Jobs(store_url).search("trust-index", "ticket", ["team-1"], k=40).hits
    assert {h.record_id for h in found} == {r["id"] for r in records if r["acl"] == ["team-1"]}
