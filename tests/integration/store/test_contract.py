"""The store contract: every store passes the same tests (I1, I3, fencing, the clock)."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from batchline.acl import Acl
from batchline.errors import StoreError
from batchline.store import (
    DeadLetterRow,
    DuplicateRecord,
    InputRecord,
    Lease,
    LeaseLost,
    PlannedRecord,
    PlannedShard,
    ResultRow,
    Store,
    open_store,
)

LEASE = 100.0
OUT = '{"category":"a","summary":"s"}'


def plan_version(store: Store, version: str = "job@1", shards: int = 3, per_shard: int = 4,
                 lease_seconds: float = LEASE, acl: Acl | None = None) -> list[list[str]]:
    spec = {"name": "job", "shards": {"lease_seconds": lease_seconds}}
    writer = store.begin_plan(version, "job", spec)
    ids = [[f"s{s}-r{i}" for i in range(per_shard)] for s in range(shards)]
    writer.add_shards([PlannedShard(s, {"shard": s}, per_shard) for s in range(shards)])
    writer.add_records([PlannedRecord(rid, s, "h", acl=acl) for s in range(shards) for rid in ids[s]])
    writer.commit(shards * per_shard, shards)
    return ids


def owners_hand_result(store_url: str, version: str, record_id: str, shard_no: int) -> None:
    """A result of a record the version never planned, written past every fence by the store's
    owner's own hand (no worker can: the fences refuse it), for the coverage checks to find."""
    statement = ("INSERT INTO results (version, record_id, shard_no, output, worker, epoch, attempt, created_at) "
                 f"VALUES ('{version}', '{record_id}', {shard_no}, '{{}}', 'hand', 0, 1, 0)")
    if store_url.startswith("sqlite:///"):
        import sqlite3

        with sqlite3.connect(store_url.removeprefix("sqlite:///")) as conn:
            conn.execute(statement)
    else:
        import psycopg

        with psycopg.connect(store_url, autocommit=True) as conn:
            conn.execute(statement)


def answer_all(store: Store, lease: Lease, ids: list[str]) -> None:
    store.put_results(lease, [ResultRow(rid, OUT) for rid in ids])


def latest_publication(store: Store, name: str) -> int | None:
    """The id a publisher passes as the publication it read (None: the name has none)."""
    history = store.publications(name)
    return history[-1].id if history else None


def test_claim_sets_owner_epoch_and_expiry_from_the_database_clock(store: Store) -> None:
    plan_version(store)
    before = store.now()
    lease = store.claim("w1")
    assert lease is not None
    assert (lease.shard_no, lease.owner, lease.epoch) == (0, "w1", 1)
    assert before + LEASE - 1 <= lease.expires <= store.now() + LEASE
    claims = store.events("job@1", ["claim"])
    assert [(e.worker, e.shard_no, e.epoch) for e in claims] == [("w1", 0, 1)]


def test_each_ready_shard_is_claimed_once_then_nothing(store: Store) -> None:
    plan_version(store, shards=3)
    leases = [store.claim(f"w{i}") for i in range(3)]
    assert sorted(lease.shard_no for lease in leases if lease) == [0, 1, 2]
    assert store.claim("w9") is None
    assert store.has_open_shards("job@1")


def test_a_version_still_planning_is_invisible(store: Store) -> None:
    writer = store.begin_plan("job@2", "job", {"name": "job", "shards": {"lease_seconds": LEASE}})
    writer.add_shards([PlannedShard(0, {}, 1)])
    assert store.claim("w1") is None
    assert store.jobs() == []
    writer.abort()
    assert store.job("job@2") is None


def test_replanning_discards_what_a_dead_planner_left(store: Store) -> None:
    writer = store.begin_plan("job@1", "job", {"name": "job", "shards": {"lease_seconds": LEASE}})
    writer.add_shards([PlannedShard(0, {}, 1)])
    writer.add_records([PlannedRecord("x", 0, "h")])
    # the planner dies here; a new one starts over
    ids = plan_version(store)
    info = store.job("job@1")
    assert info is not None and info.state == "ready" and info.record_count == 12
    assert "x" not in set(store.planned_ids("job@1"))
    assert len(list(store.planned_ids("job@1"))) == sum(len(s) for s in ids)
    with pytest.raises(StoreError, match="taken over"):
        writer.add_records([PlannedRecord("y", 0, "h")])


def test_duplicate_ids_are_refused_at_planning(store: Store) -> None:
    writer = store.begin_plan("job@1", "job", {"name": "job", "shards": {"lease_seconds": LEASE}})
    writer.add_shards([PlannedShard(0, {}, 1), PlannedShard(1, {}, 1)])
    writer.add_records([PlannedRecord("a", 0, "h")])
    with pytest.raises(DuplicateRecord) as info:
        writer.add_records([PlannedRecord("b", 1, "h"), PlannedRecord("a", 1, "h")])
    assert (info.value.record_id, info.value.first_shard) == ("a", 0)
    writer.abort()


def test_records_planned_with_their_input_are_read_back_by_position_in_their_version_only(store: Store) -> None:
    # An input the store holds (a job over a published job): a worker reads its shard's records
    # by position, text and ACL as planned (a record without text as None), and nothing of another version.
    rows = [InputRecord(f"r{i}", None if i == 3 else f"text {i}", Acl([f"g{i % 2}"]) if i % 4 else None, f"h{i}", i)
            for i in range(6)]
    for version in ("job@1", "job@2"):
        writer = store.begin_plan(version, "job", {"name": "job", "shards": {"lease_seconds": LEASE}})
        writer.add_shards([PlannedShard(0, {}, 3), PlannedShard(1, {}, 3)])
        mine = rows if version == "job@1" else [InputRecord(r.record_id, "other", None, "x", r.position)
                                                for r in rows]
        writer.add_records([PlannedRecord(r.record_id, r.position // 3, r.content_hash, r, acl=r.acl)
                            for r in mine])
        writer.commit(6, 2)
    assert store.input_records("job@1", 2, 5) == rows[2:5]
    assert store.input_records("job@1", 0, 6) == rows
    assert store.input_records("job@1", 6, 9) == []
    assert [r.text for r in store.input_records("job@2", 0, 2)] == ["other", "other"]


def test_expired_lease_is_reclaimed_with_a_higher_epoch(store: Store) -> None:
    plan_version(store, shards=1)
    first = store.claim("w1")
    assert first is not None
    assert store.claim("w2") is None
    store.shift_clock(LEASE + 1)
    second = store.claim("w2")
    assert second is not None and second.epoch == first.epoch + 1
    expired = store.events("job@1", ["lease_expired"])
    assert [(e.worker, e.epoch, e.detail["reclaimed_by"]) for e in expired] == [("w1", 1, "w2")]


def test_renewal_extends_only_the_current_lease(store: Store) -> None:
    plan_version(store, shards=1)
    old = store.claim("w1")
    assert old is not None
    store.shift_clock(LEASE / 2)
    renewed = store.renew(old)
    assert renewed is not None and renewed.expires > old.expires
    store.shift_clock(LEASE + 1)
    new = store.claim("w2")
    assert new is not None
    assert store.renew(old) is None
    refused = store.events("job@1", ["stale_epoch"])
    assert [(e.worker, e.detail["op"]) for e in refused] == [("w1", "renew")]


def test_put_is_put_if_absent(store: Store) -> None:
    ids = plan_version(store, shards=1)
    lease = store.claim("w1")
    assert lease is not None
    assert store.put_results(lease, [ResultRow(ids[0][0], OUT)]) == 1
    assert store.put_results(lease, [ResultRow(ids[0][0], '{"category":"b","summary":"other"}'),
                                       ResultRow(ids[0][1], OUT)]) == 1
    stored = {r.record_id: r for r in store.iter_results("job@1")}
    assert stored[ids[0][0]].output == OUT
    assert store.shard_rows("job@1")[0].results == 2


def test_a_stale_put_writes_nothing_and_is_logged(store: Store) -> None:
    ids = plan_version(store, shards=1)
    old = store.claim("w1")
    assert old is not None
    store.shift_clock(LEASE + 1)
    new = store.claim("w2")
    assert new is not None
    with pytest.raises(LeaseLost):
        store.put_results(old, [ResultRow(ids[0][0], OUT)])
    assert list(store.iter_results("job@1")) == []
    assert [e.detail["op"] for e in store.events("job@1", ["stale_epoch"])] == ["put"]


def test_completion_needs_every_outcome(store: Store) -> None:
    ids = plan_version(store, shards=1)
    lease = store.claim("w1")
    assert lease is not None
    answer_all(store, lease, ids[0][:-1])
    with pytest.raises(StoreError, match="without an outcome"):
        store.complete(lease)
    store.charge_attempt(lease, ids[0][-1], "crash", "boom", None, max_attempts=1)
    store.complete(lease)
    assert store.shard_rows("job@1")[0].state == "done"


def test_retried_completion_succeeds_and_late_completion_is_refused(store: Store) -> None:
    ids = plan_version(store, shards=2)
    old = store.claim("w1")
    assert old is not None
    store.shift_clock(LEASE + 1)
    new = store.claim("w2")
    assert new is not None and new.shard_no == old.shard_no
    answer_all(store, new, ids[0])
    store.complete(new)
    store.complete(new)  # the acknowledgement was lost; the retry succeeds again
    with pytest.raises(LeaseLost):
        store.complete(old)
    assert [e.epoch for e in store.events("job@1", ["complete"])] == [new.epoch]
    assert [e.detail["op"] for e in store.events("job@1", ["stale_epoch"])] == ["complete"]


def test_the_last_completion_seals_and_a_sealed_version_takes_no_writes(store: Store) -> None:
    ids = plan_version(store, shards=2)
    leases = [store.claim("w1"), store.claim("w2")]
    for lease in leases:
        assert lease is not None
        answer_all(store, lease, ids[lease.shard_no])
        store.complete(lease)
    info = store.job("job@1")
    assert info is not None and info.state == "sealed" and info.sealed_at is not None
    assert len(store.events("job@1", ["seal"])) == 1
    assert not store.has_open_shards("job@1")
    assert store.claim("w3") is None
    for lease in leases:
        assert lease is not None
        with pytest.raises(LeaseLost):
            store.put_results(lease, [ResultRow(ids[lease.shard_no][0], OUT)])
        with pytest.raises(LeaseLost):
            store.dead_letter(lease, [DeadLetterRow(ids[lease.shard_no][0], "too_long", "x")])


def test_a_record_has_a_result_or_a_dead_letter_never_both(store: Store) -> None:
    ids = plan_version(store, shards=1)
    lease = store.claim("w1")
    assert lease is not None
    a, b = ids[0][0], ids[0][1]
    assert store.dead_letter(lease, [DeadLetterRow(a, "too_long", "long")]) == 1
    assert store.put_results(lease, [ResultRow(a, OUT)]) == 0
    assert store.put_results(lease, [ResultRow(b, OUT)]) == 1
    assert store.dead_letter(lease, [DeadLetterRow(b, "too_long", "long")]) == 0
    assert store.charge_attempt(lease, b, "crash", "x", None, 1).attempts == 0
    assert {r.record_id for r in store.iter_results("job@1")} == {b}
    assert {d.record_id for d in store.iter_dead_letters("job@1")} == {a}
    assert store.answered("job@1", ids[0]) == {a, b}


def test_charged_attempts_dead_letter_at_the_maximum(store: Store) -> None:
    # The dead letter is read with its record's planned ACL, whatever its worker said.
    ids = plan_version(store, shards=1, acl=Acl(["g"]))
    lease = store.claim("w1")
    assert lease is not None
    rid = ids[0][0]
    for expected in (1, 2):
        r = store.charge_attempt(lease, rid, "engine_error", f"fail {expected}", Acl(["everyone"]), 3)
        assert (r.attempts, r.dead_lettered) == (expected, False)
    assert store.attempts("job@1", ids[0]) == {rid: 2}
    r = store.charge_attempt(lease, rid, "engine_error", "fail 3", Acl(["everyone"]), 3)
    assert (r.attempts, r.dead_lettered) == (3, True)
    [dead] = list(store.iter_dead_letters("job@1"))
    assert (dead.record_id, dead.kind, dead.error, dead.attempts, dead.acl) == (rid, "engine_error", "fail 3", 3, ["g"])
    assert len(store.events("job@1", ["attempt_failed"])) == 3


def test_release_makes_the_shard_ready_at_once(store: Store) -> None:
    plan_version(store, shards=1)
    lease = store.claim("w1")
    assert lease is not None
    assert store.release(lease, "stop")
    again = store.claim("w2")
    assert again is not None and again.epoch == lease.epoch + 1
    assert not store.release(lease, "stop")
    assert [e.detail["reason"] for e in store.events("job@1", ["release"])] == ["stop"]


def test_results_keep_worker_attempt_and_time_and_their_planned_acl_not_the_one_put(store: Store) -> None:
    ids = plan_version(store, shards=1, acl=Acl(["x", "o'brien"]))
    lease = store.claim("w1")
    assert lease is not None
    store.put_results(lease, [ResultRow(ids[0][0], OUT, acl=Acl(["everyone"]), attempt=2,
                                          input_tokens=5, output_tokens=7)])
    [r] = list(store.iter_results("job@1"))
    assert (r.worker, r.epoch, r.attempt, r.acl, r.input_tokens, r.output_tokens) == (
        "w1", lease.epoch, 2, Acl(["x", "o'brien"]), 5, 7)
    assert abs(r.created_at - store.now()) < 5


def test_status_counts_shards_and_outcomes(store: Store) -> None:
    ids = plan_version(store, shards=3)
    lease = store.claim("w1")
    assert lease is not None
    answer_all(store, lease, ids[0][:3])
    store.dead_letter(lease, [DeadLetterRow(ids[0][3], "too_long", "x")])
    store.complete(lease)
    store.claim("w2")
    st = store.status("job@1")
    assert st.shards == {"ready": 1, "leased": 1, "done": 1, "submitted": 0}
    assert (st.records, st.results, st.dead_letters, st.pending) == (12, 3, 1, 8)
    assert st.dead_letters_by_kind == {"too_long": 1}
    assert st.records_done_last_minutes == 4


def test_the_rate_counts_outcomes_written_before_their_shard_completes(store: Store) -> None:
    ids = plan_version(store, shards=2, per_shard=4)
    lease = store.claim("w1")
    assert lease is not None
    answer_all(store, lease, ids[0][:2])
    store.dead_letter(lease, [DeadLetterRow(ids[0][2], "engine_error", "x")])
    st = store.status("job@1", window_seconds=60)
    assert st.shards["done"] == 0
    assert st.records_done_last_minutes == 3
    assert st.records_per_second is not None and st.records_per_second > 0
    store.shift_clock(61)  # the outcomes are older than the window now
    later = store.status("job@1", window_seconds=60)
    assert later.records_done_last_minutes == 0 and later.records_per_second == 0


def test_the_rate_is_counted_from_an_index_of_when_outcomes_were_written(store: Store) -> None:
    plan_version(store)
    q = store.q  # type: ignore[attr-defined]
    params = {"v": "job@1", "since": 0.0}

    def plan(tx: Any) -> str:
        if store.url.startswith("sqlite"):
            return " ".join(str(r[-1]) for r in tx.all(f"EXPLAIN QUERY PLAN {q.RECENT}", params))
        # Tables this small are scanned whatever their indexes: what matters is that the
        # index answers the query at all.
        tx.run("SET LOCAL enable_seqscan = off")
        return " ".join(str(r[0]) for r in tx.all(f"EXPLAIN {q.RECENT}", params))

    text = store._write(plan)  # type: ignore[attr-defined]
    if store.url.startswith("sqlite"):
        assert "COVERING INDEX results_written" in text and "COVERING INDEX dead_letters_written" in text, text
    else:
        assert "Seq Scan" not in text and text.count("Index Only Scan") == 2 and "AND (created_at >=" in text, text


def test_the_rate_leaves_out_what_no_worker_computed(store: Store) -> None:
    ids = plan_version(store, "job@1", shards=1, per_shard=4)
    lease = store.claim("w1")
    assert lease is not None
    answer_all(store, lease, ids[0])
    store.complete(lease)
    # The same records again: carried from job@1 at planning, none computed.
    writer = store.begin_plan("job@2", "job", {"name": "job", "shards": {"lease_seconds": LEASE}})
    writer.add_shards([PlannedShard(0, {"shard": 0}, 5)])
    writer.add_records([PlannedRecord(rid, 0, "h") for rid in [*ids[0], "new"]])
    writer.carry_from("job@1")
    writer.add_dead_letters(0, [DeadLetterRow("new", "too_long", "over the cap")])
    writer.commit(5, 1)
    st = store.status("job@2")
    assert (st.results, st.dead_letters) == (4, 1)
    assert st.records_done_last_minutes == 0


def test_clock_shift_is_seen_by_every_connection(store: Store, open_again: Callable[[], Store]) -> None:
    other = open_again()
    try:
        before = other.now()
        store.shift_clock(3600)
        assert other.now() - before >= 3599
    finally:
        other.close()


def _claim_loop(url: str, worker: str, ids: list[list[str]], out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    """Claims until nothing is left; gives back every other lease to make epochs climb."""
    store = open_store(url)
    grants = []
    n = 0
    while True:
        lease = store.claim(worker, "job@1")
        if lease is None:
            if not store.has_open_shards("job@1"):
                break
            continue
        grants.append((lease.shard_no, lease.epoch))
        n += 1
        if n % 2:
            store.release(lease, "test")
            continue
        try:
            store.put_results(lease, [ResultRow(rid, OUT) for rid in ids[lease.shard_no]])
            store.complete(lease)
        except LeaseLost:
            pass
    out.put((worker, grants))
    store.close()


def test_concurrent_claimers_are_each_granted_a_shard_epoch_once(worker_url: Callable[[str], str],
                                                                store: Store) -> None:
    ids = plan_version(store, shards=24, per_shard=3)
    ctx = multiprocessing.get_context("spawn")
    out: multiprocessing.Queue = ctx.Queue()  # type: ignore[type-arg]
    procs = [ctx.Process(target=_claim_loop, args=(worker_url("job@1"), f"w{i}", ids, out)) for i in range(4)]
    for p in procs:
        p.start()
    reports = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    grants = [g for _, gs in reports for g in gs]
    assert len(grants) == len(set(grants)), "a (shard, epoch) was granted twice"
    assert len(grants) >= 48  # every shard was given back once and claimed again
    claimed = {(e.shard_no, e.epoch) for e in store.events("job@1", ["claim"])}
    assert claimed == set(grants)
    assert store.job("job@1").state == "sealed"  # type: ignore[union-attr]
    assert len(list(store.iter_results("job@1"))) == 72


def test_store_url_errors_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="unknown store URL"):
        open_store("mysql://x")


def test_a_stored_spec_keeps_its_key_order(store: Store) -> None:
    # Regression: specs were stored with sorted keys (SQLite) or as jsonb
    # (PostgreSQL), so a worker's engine saw schema properties in another order
    # than the spec's and wrote its outputs in that order.
    spec = {"name": "job", "shards": {"lease_seconds": LEASE},
            "output": {"schema": {"properties": {"zeta": {}, "alpha": {}, "mid": {}}}}}
    writer = store.begin_plan("job@1", "job", spec)
    writer.add_shards([PlannedShard(0, {}, 0)])
    writer.commit(0, 1)
    info = store.job("job@1")
    assert info is not None
    assert list(info.spec["output"]["schema"]["properties"]) == ["zeta", "alpha", "mid"]
    assert list(info.spec) == ["name", "shards", "output"]


def test_coverage_is_an_anti_join_both_ways(store: Store, store_url: str) -> None:
    ids = plan_version(store, shards=2, per_shard=4)
    lease = store.claim("w1")
    assert lease is not None
    store.put_results(lease, [ResultRow(rid, OUT) for rid in ids[0][:3]])
    owners_hand_result(store_url, "job@1", "ghost", 0)
    store.dead_letter(lease, [DeadLetterRow(ids[0][3], "too_long", "x")])
    cov = store.coverage("job@1")
    # Same total as the snapshot would give a count comparison a pass; the join does not.
    assert (cov.records, cov.missing, cov.unexpected, cov.both) == (8, 4, 1, 0)
    assert cov.unexpected_sample == ("ghost",)
    assert set(cov.missing_sample) == set(ids[1])


def test_coverage_is_not_fooled_by_as_many_outcomes_of_other_ids(store: Store, store_url: str) -> None:
    # PostgreSQL proves full coverage from counts and id fingerprints before it joins: equal
    # counts with a ghost in place of a planned id must still be found by the join.
    ids = plan_version(store, shards=1, per_shard=4)
    lease = store.claim("w1")
    assert lease is not None
    store.put_results(lease, [ResultRow(rid, OUT) for rid in ids[0][:3]])
    owners_hand_result(store_url, "job@1", "ghost", 0)
    cov = store.coverage("job@1")
    assert (cov.records, cov.missing, cov.unexpected, cov.both) == (4, 1, 1, 0)
    assert (cov.missing_sample, cov.unexpected_sample) == ((ids[0][3],), ("ghost",))
    store.put_results(lease, [ResultRow(ids[0][3], OUT)])
    store.dead_letter(lease, [DeadLetterRow(ids[0][0], "too_long", "x")])  # refused: it has a result
    full = store.coverage("job@1")
    assert (full.records, full.missing, full.unexpected, full.both) == (4, 0, 1, 0)


def test_full_coverage_with_results_and_dead_letters_is_proven(store: Store) -> None:
    ids = plan_version(store, shards=2, per_shard=4)
    while (lease := store.claim("w1")) is not None:
        store.put_results(lease, [ResultRow(rid, OUT) for rid in ids[lease.shard_no][1:]])
        store.dead_letter(lease, [DeadLetterRow(ids[lease.shard_no][0], "too_long", "x")])
        store.complete(lease)
    cov = store.coverage("job@1")
    assert (cov.records, cov.missing, cov.unexpected, cov.both, cov.missing_sample, cov.unexpected_sample) == (
        8, 0, 0, 0, (), ())


def test_the_result_histogram_counts_computed_results_by_attempt_and_time(store: Store) -> None:
    ids = plan_version(store, shards=1)
    lease = store.claim("w1")
    assert lease is not None
    store.put_results(lease, [ResultRow(ids[0][0], OUT, attempt=1), ResultRow(ids[0][1], OUT, attempt=2)])
    store.shift_clock(12.0)
    store.put_results(lease, [ResultRow(ids[0][2], OUT, attempt=1)])
    now = store.now()
    rows = store.result_histogram("job@1", now - 25.0, 10.0, 4)
    # The first two were written about 12 s before `now`: bin 1; the third at about `now`: bin 2.
    assert sorted(rows) == [(1, 1, 1), (1, 2, 1), (2, 1, 1)]
    # Times before the start and after the end land in the first and last bins.
    assert sorted(store.result_histogram("job@1", now + 100.0, 1.0, 2)) == [(1, 0, 2), (2, 0, 1)]
    assert sorted(store.result_histogram("job@1", now - 1000.0, 1.0, 3)) == [(1, 2, 2), (2, 2, 1)]


def test_every_refused_write_names_its_operation(store: Store) -> None:
    # Regression: PostgreSQL raised LeaseLost without the operation, so every refusal
    # there was counted under `unknown` in the worker's metrics.
    ids = plan_version(store, shards=1)
    old = store.claim("w1")
    assert old is not None
    store.shift_clock(LEASE + 1)
    assert store.claim("w2") is not None
    refusals = {
        "put": lambda: store.put_results(old, [ResultRow(ids[0][0], OUT)]),
        "charge": lambda: store.charge_attempt(old, ids[0][0], "crash", "x", None, 3),
        "dead_letter": lambda: store.dead_letter(old, [DeadLetterRow(ids[0][0], "too_long", "x")]),
        "completion": lambda: store.complete(old),
        "batch": lambda: store.set_batch(old, {"state": "submitting"}),
        "await_provider": lambda: store.await_provider(old, {"batch_id": "b"}, 1.0),
    }
    for op, refused in refusals.items():
        with pytest.raises(LeaseLost) as info:
            refused()
        assert info.value.op == op
        assert f"lease on shard 0 of job@1 lost (epoch {old.epoch}); {op} refused" == str(info.value)
    assert store.renew(old) is None
    assert not store.release(old, "stop")


def plan_pieces(store: Store, pieces: int = 8, per_piece: int = 2, dead_in: int | None = None) -> list[list[str]]:
    """One shard of `pieces` pieces of `per_piece` records; a planned dead letter in piece `dead_in`."""
    ids = [[f"p{p}-r{i}" for i in range(per_piece)] for p in range(pieces)]
    writer = store.begin_plan("job@1", "job", {"name": "job", "shards": {"lease_seconds": LEASE}})
    slice_ = {"pieces": [{"start": p * 10, "end": p * 10 + 10, "first_line": p + 1, "digest": f"d{p}",
                          "records": per_piece, "dead": int(p == dead_in)} for p in range(pieces)],
              "start": 0, "end": pieces * 10, "first_line": 1}
    writer.add_shards([PlannedShard(0, slice_, pieces * per_piece, first_piece=0, end_piece=pieces)])
    writer.add_records([PlannedRecord(rid, 0, "h") for group in ids for rid in group])
    if dead_in is not None:
        writer.add_dead_letters(0, [DeadLetterRow(ids[dead_in][0], "too_long", "over the cap")])
    writer.commit(pieces * per_piece, 1)
    return ids


def rows_of(ids: list[list[str]], pieces: range) -> list[ResultRow]:
    return [ResultRow(rid, OUT, piece=p) for p in pieces for rid in ids[p]]


def test_a_split_moves_the_unstarted_tail_to_a_new_shard_and_fences_the_owner_off_it(store: Store) -> None:
    ids = plan_pieces(store, pieces=8, per_piece=2, dead_in=7)
    owner = store.claim("slow")
    assert owner is not None and (owner.first_piece, owner.end_piece) == (0, 8)
    assert store.put_results(owner, rows_of(ids, range(0, 2))) == 4
    owner = store.renew(owner, started=2)
    assert owner is not None
    # Pieces 2..7 are unstarted: the owner keeps the nearer half (2, 3, 4), the rest moves.
    assert store.split("job@1", "idle") == 1
    [split] = store.events("job@1", ["split"])
    assert split.detail == {"by": "idle", "new_shard": 1, "at_piece": 5, "end_piece": 8, "records": 6}
    rows = {r.shard_no: r for r in store.shard_rows("job@1")}
    assert (rows[0].record_count, rows[0].dead_letters) == (10, 0)
    assert (rows[1].state, rows[1].record_count, rows[1].dead_letters) == ("ready", 6, 1)
    owner = store.renew(owner, started=3)
    assert owner is not None and owner.end_piece == 5 and owner.record_count == 10
    # The owner's writes past its new end are refused and not counted, whatever it sends.
    assert store.put_results(owner, rows_of(ids, range(4, 6))) == 2
    assert store.charge_attempt(owner, ids[6][0], "engine_error", "x", None, 3, piece=6).attempts == 0
    assert store.dead_letter(owner, [DeadLetterRow(ids[7][1], "too_long", "x", piece=7)]) == 0
    assert store.put_results(owner, rows_of(ids, range(2, 4))) == 4
    store.complete(owner)
    tail = store.claim("idle")
    assert tail is not None and (tail.shard_no, tail.first_piece, tail.end_piece) == (1, 5, 8)
    assert [p["first_line"] for p in tail.slice["pieces"]] == [6, 7, 8] and tail.slice["start"] == 50
    store.put_results(tail, rows_of(ids, range(5, 8)))
    store.complete(tail)
    assert store.job("job@1").state == "sealed"  # type: ignore[union-attr]
    cov = store.coverage("job@1")
    assert (cov.records, cov.missing, cov.unexpected, cov.both) == (16, 0, 0, 0)
    assert store.status("job@1").results == 15


def test_a_row_that_does_not_say_its_piece_is_refused_past_a_split_point(store: Store) -> None:
    ids = plan_pieces(store, pieces=8, per_piece=2)
    owner = store.claim("slow")
    assert owner is not None and store.split("job@1", "idle") == 1  # pieces 4..7 move
    owner = store.renew(owner)
    assert owner is not None and owner.end_piece == 4
    # Rows that do not say their piece could be any piece's: past the split point they
    # would be the other shard's records, so none is written, before it or past it.
    assert store.put_results(owner, [ResultRow(ids[6][0], OUT), ResultRow(ids[1][0], OUT)]) == 0
    assert store.dead_letter(owner, [DeadLetterRow(ids[7][0], "too_long", "x")]) == 0
    assert store.charge_attempt(owner, ids[5][0], "engine_error", "x", None, 1).attempts == 0
    assert store.status("job@1").results == store.status("job@1").dead_letters == 0
    assert store.put_results(owner, rows_of(ids, range(0, 4))) == 8
    store.complete(owner)
    tail = store.claim("idle")
    assert tail is not None and store.put_results(tail, rows_of(ids, range(4, 8))) == 8
    store.complete(tail)
    cov = store.coverage("job@1")
    assert (cov.records, cov.missing, cov.unexpected, cov.both) == (16, 0, 0, 0)


def test_a_split_needs_two_unstarted_pieces_a_live_lease_and_a_local_shard(store: Store) -> None:
    plan_pieces(store, pieces=3)
    assert store.split("job@1", "idle") is None  # nothing leased
    owner = store.claim("slow")
    assert owner is not None
    owner = store.renew(owner, started=2)
    assert owner is not None and store.split("job@1", "idle") is None  # one piece left
    store.shift_clock(LEASE + 1)
    assert store.split("job@1", "idle") is None  # an expired lease is reclaimed whole, not split


def test_the_split_rule_keeps_the_nearer_half_for_the_owner() -> None:
    from batchline.store.core import split_point

    assert split_point(0, 16, None) == 8
    assert split_point(0, 16, 5) == 11
    assert split_point(4, 8, 0) == 6  # started before the shard's first piece: counts from the first
    assert split_point(0, 8, 7) is None and split_point(0, 8, 8) is None


def test_a_take_back_ends_a_dead_owners_lease_at_once_and_fences_it_off(store: Store) -> None:
    ids = plan_version(store, shards=1)
    lease = store.claim("w1", process={"host": "h", "pid": 42})
    assert lease is not None
    [holder] = store.leases("job@1")
    assert (holder.owner, holder.epoch, holder.process) == ("w1", lease.epoch, {"host": "h", "pid": 42})
    assert store.take_back("job@1", holder, "w2", {"kind": "same-host", "pid": 42})
    assert not store.take_back("job@1", holder, "w3", {"kind": "same-host"})  # already ended
    [event] = store.events("job@1", ["take_back"])
    assert (event.worker, event.epoch, event.detail["by"], event.detail["proof"]["pid"]) == ("w1", lease.epoch, "w2", 42)
    again = store.claim("w2")
    assert again is not None and again.epoch == lease.epoch + 2  # the take-back bumped it once
    with pytest.raises(LeaseLost):
        store.put_results(lease, [ResultRow(ids[0][0], OUT)])
    assert store.leases("job@1")[0].owner == "w2"


def test_status_route_totals_and_tokens_read_no_result_row(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    # Regression: `status VERSION` joined every result with its shard for the per-route
    # totals, even without routes: 4.1 s at 5 M results, growing with the job.
    import batchline.store.postgres as pg_backend
    import batchline.store.sqlite as sqlite_backend

    ids = plan_version(store, shards=2)
    lease = store.claim("w1")
    assert lease is not None
    store.put_results(lease, [ResultRow(rid, OUT, input_tokens=3, output_tokens=2) for rid in ids[0]])
    seen: list[str] = []
    for module in (sqlite_backend, pg_backend):
        for name in ("one", "all"):
            real = getattr(module._Tx, name)

            def recording(self: Any, stmt: str, params: Any = None, real: Any = real) -> Any:
                seen.append(" ".join(str(stmt).split()))
                return real(self, stmt, params)

            monkeypatch.setattr(module._Tx, name, recording)
    st = store.status("job@1")
    totals = store.route_totals("job@1")["local"]
    assert store.token_totals("job@1") == (12, 8)
    assert (st.results, totals.results, totals.input_tokens, totals.output_tokens) == (4, 4, 12, 8)
    # But for the rate: it counts the outcomes written within its window (from an index
    # of when they were written), not every result.
    rate = " ".join(str(store.q.RECENT).split())  # type: ignore[attr-defined]
    assert seen and [s for s in seen if " results " in f" {s} "] == [rate], "a statement read the results table"


def test_a_shard_holding_carried_results_is_not_split_so_it_was_never_completed(store: Store) -> None:
    # Regression: a split moved a tail of pieces whose results were carried from the base, and
    # left them counted on the shard that kept none of their records: neither shard could ever
    # complete ("-1965 records without an outcome"), and `run` gave up after its restarts.
    ids = plan_pieces(store, pieces=8, per_piece=2)
    first = store.claim("w")
    assert first is not None and store.put_results(first, rows_of(ids, range(8))) == 16
    store.complete(first)
    writer = store.begin_plan("job@2", "job", {"name": "job", "shards": {"lease_seconds": LEASE}})
    slice_ = {"pieces": [{"start": p * 10, "end": p * 10 + 10, "first_line": p + 1, "digest": f"d{p}", "records": 2}
                         for p in range(8)], "start": 0, "end": 80, "first_line": 1}
    writer.add_shards([PlannedShard(0, slice_, 16, first_piece=0, end_piece=8)])
    # The even pieces' records are unchanged (carried), the odd pieces' changed.
    writer.add_records([PlannedRecord(rid, 0, "h" if p % 2 == 0 else "changed") for p, group in enumerate(ids)
                        for rid in group])
    assert writer.carry_from("job@1") == 8
    writer.commit(16, 1)
    owner = store.claim("slow", "job@2")
    assert owner is not None
    assert store.split("job@2", "idle") is None
    assert store.put_results(owner, [ResultRow(rid, OUT, piece=p) for p in range(1, 8, 2) for rid in ids[p]]) == 8
    store.complete(owner)
    assert store.job("job@2").state == "sealed"  # type: ignore[union-attr]
