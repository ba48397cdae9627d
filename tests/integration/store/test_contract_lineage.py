"""The store contract for the lineage outbox: each state change of a version writes its one row
in the transaction that makes the change, however many workers race to it, and a drainer
claims, marks and retries rows without losing or doubling one. Over every store, and under
the worker's own role (a worker writes and drains its version's rows)."""

from __future__ import annotations

import threading

from batchline.store import DeadLetterRow, Halt, Store
from batchline.store.lineage import ABORT, COMPLETE, FAIL, PUBLISH, ROLLBACK, START
from tests.integration.store.test_contract import (
    LEASE,
    answer_all,
    latest_publication,
    plan_version,
)
from tests.integration.store.test_contract_halts import plan_bounded

V = "job@1"


def kinds(store: Store, version: str = V) -> list[tuple[str, int]]:
    return [(r.kind, r.attempt) for r in store.lineage_rows(version)]


def finish(store: Store, ids: list[list[str]], worker: str = "w1") -> None:
    while (lease := store.claim(worker, V)) is not None:
        answer_all(store, lease, ids[lease.shard_no])
        store.complete(lease)


def test_the_first_claim_starts_the_run_once_and_later_claims_write_nothing(store: Store) -> None:
    plan_version(store)
    assert kinds(store) == []  # planning is not the run
    first = store.claim("w1", V)
    second = store.claim("w2", V)
    assert first is not None and second is not None
    assert kinds(store) == [(START, 1)]
    [row] = store.lineage_rows(V)
    assert row.version == V and abs(row.at - store.now()) < 60 and row.state == "pending"


def test_a_worker_restarted_after_a_crash_never_starts_the_run_again(store: Store) -> None:
    plan_version(store)
    lost = store.claim("w1", V)
    assert lost is not None
    store.shift_clock(LEASE + 1)  # w1 died: its lease runs out and another worker takes the shard again
    again = store.claim("w1-restarted", V)
    assert again is not None and again.shard_no == lost.shard_no and again.epoch > lost.epoch
    assert kinds(store) == [(START, 1)]


def test_the_seal_completes_the_run_once_with_the_versions_figures(store: Store) -> None:
    ids = plan_version(store)
    finish(store, ids)
    assert kinds(store) == [(START, 1), (COMPLETE, 1)]
    complete = store.lineage_rows(V)[1]
    assert complete.detail["results"] == 12 and complete.detail["dead_letters"] == 0
    assert complete.detail["carried"] == 0 and complete.detail["dead_letters_by_kind"] == {}


def test_two_workers_completing_the_last_two_shards_at_once_complete_the_run_once(
        store: Store, open_again: object) -> None:
    ids = plan_version(store, shards=2)
    leases = [store.claim("w1", V), store.claim("w2", V)]
    assert all(lease is not None for lease in leases)
    for lease in leases:
        assert lease is not None
        answer_all(store, lease, ids[lease.shard_no])
    others = [open_again() for _ in leases]  # type: ignore[operator]
    gate = threading.Barrier(2)
    errors: list[BaseException] = []

    def complete(s: Store, lease: object) -> None:
        try:
            gate.wait()
            s.complete(lease)  # type: ignore[arg-type]
        except BaseException as exc:  # surfaced below, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=complete, args=(s, lease)) for s, lease in zip(others, leases, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in others:
        s.close()
    assert errors == []
    assert store.job(V) is not None and store.job(V).state == "sealed"  # type: ignore[union-attr]
    assert kinds(store) == [(START, 1), (COMPLETE, 1)]


def test_a_halt_fails_the_run_and_a_resume_is_a_new_run_started_at_its_first_claim(store: Store) -> None:
    ids = plan_bounded(store)
    for worker in ("w1", "w2"):  # the first two shards' records all end as dead letters
        lease = store.claim(worker, V)
        assert lease is not None
        store.dead_letter(lease, [DeadLetterRow(rid, "invalid_output", "not JSON", attempts=3)
                                  for rid in ids[lease.shard_no] if rid not in ids[0][:2]])
    halt = store.judge_dead_letters(V, "w2")
    assert isinstance(halt, Halt)
    assert store.judge_dead_letters(V, "w1") is not None  # judged again: still one FAIL
    assert kinds(store) == [(START, 1), (FAIL, 1)]
    fail = store.lineage_rows(V)[1]
    assert fail.detail["reason"] == "halted" and "halted" in fail.detail["message"]
    store.resume(V, "ops@host", "the prompt was fixed", rate=1.0)
    assert kinds(store) == [(START, 1), (FAIL, 1)]  # the next attempt starts at its first claim
    assert store.claim("w3", V) is not None
    assert kinds(store) == [(START, 1), (FAIL, 1), (START, 2)]


def test_cancelling_a_running_version_aborts_its_run_and_one_never_started_writes_nothing(store: Store) -> None:
    plan_version(store)
    plan_version(store, "job@2")
    assert store.claim("w1", V) is not None
    assert store.cancel(V, "ops@host", "wrong prompt") and store.cancel("job@2", "ops@host", None)
    assert kinds(store) == [(START, 1), (ABORT, 1)]
    assert store.lineage_rows(V)[1].detail == {"who": "ops@host", "reason": "wrong prompt"}
    assert kinds(store, "job@2") == []


def test_a_changed_input_fails_the_run_once_however_many_workers_find_it(store: Store) -> None:
    plan_version(store)
    for worker in ("w1", "w2"):
        lease = store.claim(worker, V)
        assert lease is not None
        assert store.release(lease, "input_changed", "input changed since planning: x.jsonl:1")
    assert kinds(store) == [(START, 1), (FAIL, 1)]
    assert store.lineage_rows(V)[1].detail["message"] == "input changed since planning: x.jsonl:1"
    lease = store.claim("w3", V)
    assert lease is not None and store.release(lease, "stop")  # a stop is no failure
    assert kinds(store) == [(START, 1), (FAIL, 1)]


def test_publish_and_rollback_are_runs_of_their_own_naming_what_each_target_shows(store: Store) -> None:
    ids = plan_version(store)
    finish(store, ids)
    store.publish("job", V, "ops@host", None, None, expected=None, targets={"parquet:/x": {"current": "v=1"}})
    plan_version(store, "job@2")
    while (lease := store.claim("w1", "job@2")) is not None:
        answer_all(store, lease, ids[lease.shard_no])
        store.complete(lease)
    store.publish("job", "job@2", "ops@host", "nightly", None, expected=latest_publication(store, "job"))
    store.rollback("job", "ops@host", "bad night", expected=latest_publication(store, "job"))
    published = [(r.version, r.kind) for r in store.lineage_rows() if r.kind in (PUBLISH, ROLLBACK)]
    assert published == [(V, PUBLISH), ("job@2", PUBLISH), (V, ROLLBACK)]
    first = next(r for r in store.lineage_rows(V) if r.kind == PUBLISH)
    assert first.detail["name"] == "job" and first.detail["previous"] is None
    assert first.detail["targets"] == {"parquet:/x": {"current": "v=1"}}
    back = next(r for r in store.lineage_rows(V) if r.kind == ROLLBACK)
    assert back.detail["previous"] == "job@2" and back.detail["reason"] == "bad night"


def test_a_claimed_row_is_no_other_drainers_until_its_claim_lapses_and_a_sent_one_is_nobodys(store: Store) -> None:
    plan_version(store)
    assert store.claim("w1", V) is not None
    [row] = store.lineage_claim("d1", version=V, hold_seconds=30)
    assert store.lineage_claim("d2", version=V, hold_seconds=30) == []
    store.shift_clock(31)  # d1 died before it marked the row sent
    [again] = store.lineage_claim("d2", version=V, hold_seconds=30)
    assert again.id == row.id and again.tries == 2
    assert not store.lineage_sent(row.id, "d1")  # d1's claim lapsed: its mark is refused
    assert store.lineage_sent(row.id, "d2")
    store.shift_clock(31)
    assert store.lineage_claim("d3", version=V) == []
    assert [r.state for r in store.lineage_rows(V)] == ["sent"]


def test_a_failed_send_waits_for_its_retry_and_a_row_given_up_is_kept_with_its_error(store: Store) -> None:
    plan_version(store)
    assert store.claim("w1", V) is not None
    [row] = store.lineage_claim("d1", version=V)
    store.lineage_failed(row.id, "d1", "connection refused", retry_in=60, give_up=False)
    assert store.lineage_claim("d1", version=V) == []
    store.shift_clock(61)
    [row] = store.lineage_claim("d1", version=V)
    store.lineage_failed(row.id, "d1", "connection refused again", retry_in=60, give_up=True)
    store.shift_clock(3600)
    assert store.lineage_claim("d1", version=V) == []
    [kept] = store.lineage_rows(V)
    assert (kept.state, kept.tries, kept.last_error) == ("given up", 2, "connection refused again")
    assert store.lineage_retry(V) == 1
    [due] = store.lineage_claim("d1", version=V)
    assert due.id == kept.id


def test_a_version_sealed_at_planning_with_everything_carried_starts_and_completes_its_run(store: Store) -> None:
    ids = plan_version(store)
    finish(store, ids)
    writer = store.begin_plan("job@2", "job", {"name": "job", "shards": {"lease_seconds": LEASE}})
    from batchline.store import PlannedRecord, PlannedShard

    writer.add_shards([PlannedShard(s, {"shard": s}, 4) for s in range(3)])
    writer.add_records([PlannedRecord(rid, s, "h") for s in range(3) for rid in ids[s]])
    assert writer.carry_from(V) == 12
    writer.commit(12, 3)
    assert store.job("job@2").state == "sealed"  # type: ignore[union-attr]
    assert kinds(store, "job@2") == [(START, 1), (COMPLETE, 1)]
    assert store.lineage_rows("job@2")[1].detail["carried"] == 12
