"""The store contract for failing fast: a version whose computed dead letters pass its bound
is halted for every worker (no shard of it is claimed until it is resumed or cancelled),
counted over the final outcomes it computed, neither the planner's dead letters nor attempts
still being retried. Over every store, and the halt under a worker's own role."""

from __future__ import annotations

import pytest

from batchline.errors import StoreError
from batchline.store import (
    DeadLetterBound,
    DeadLetterRow,
    Halt,
    PlannedRecord,
    PlannedShard,
    ResultRow,
    Store,
    VersionClosed,
)
from tests.integration.store.test_contract import LEASE, OUT

WHO = "ops@host"


def plan_bounded(store: Store, version: str = "job@1", shards: int = 3, per_shard: int = 4,
                 planned_dead: int = 2) -> list[list[str]]:
    spec = {"name": "job", "shards": {"lease_seconds": LEASE, "abort_dead_letter_rate": 0.5, "abort_min_outcomes": 4}}
    writer = store.begin_plan(version, "job", spec)
    ids = [[f"s{s}-r{i}" for i in range(per_shard)] for s in range(shards)]
    writer.add_shards([PlannedShard(s, {"shard": s}, per_shard) for s in range(shards)])
    writer.add_records([PlannedRecord(rid, s, "h") for s in range(shards) for rid in ids[s]])
    # The planner's own dead letters (surely over the length cap) are not the version's doing.
    writer.add_dead_letters(0, [DeadLetterRow(rid, "too_long", "over the cap") for rid in ids[0][:planned_dead]])
    writer.commit(shards * per_shard, shards)
    return ids


def state(store: Store, version: str) -> str:
    job = store.job(version)
    assert job is not None
    return job.state


def test_a_version_whose_computed_dead_letters_pass_its_bound_is_halted_and_claimed_no_more(store: Store) -> None:
    ids = plan_bounded(store)
    first = store.claim("w1", "job@1")
    assert first is not None and first.shard_no == 0
    store.put_results(first, [ResultRow(rid, OUT) for rid in ids[0][2:]])
    store.complete(first)
    second = store.claim("w1", "job@1")
    assert second is not None and second.shard_no == 1
    # Two results and one dead letter computed: under the minimum of 4 outcomes (counting
    # the planner's two too_long would make it 3 dead of 5, over the bound).
    store.dead_letter(second, [DeadLetterRow(ids[1][0], "truncated", "cut off at max_tokens", attempts=1)])
    assert store.judge_dead_letters("job@1", "w1") is None
    # Attempts that have not ended a record are not outcomes.
    for _ in range(2):
        assert not store.charge_attempt(second, ids[1][1], "invalid_output", "not JSON", None, 3).dead_lettered
    assert store.judge_dead_letters("job@1", "w1") is None
    assert store.charge_attempt(second, ids[1][1], "invalid_output", "not JSON", None, 3).dead_lettered
    # 2 of 4 outcomes dead: the bound is passed only above half.
    assert store.judge_dead_letters("job@1", "w1") is None
    assert state(store, "job@1") == "ready"
    store.dead_letter(second, [DeadLetterRow(ids[1][2], "truncated", "cut off at max_tokens", attempts=1)])

    halt = store.judge_dead_letters("job@1", "w1")
    assert halt == Halt(dead_letters=3, outcomes=5, rate=0.5, min_outcomes=4, kind="truncated", kind_count=2,
                        example=ids[1][0], by="w1")
    assert state(store, "job@1") == "halted"
    assert store.halt_of("job@1") == halt
    job = store.job("job@1")
    assert job is not None and job.halt == halt and job.bound == DeadLetterBound(0.5, 4)
    assert store.status("job@1").halt == halt
    # No worker claims its shards, and the holder of a lease writes no outcome more (a halted
    # version is not open: the store refuses it as a lost lease) and gives it back.
    assert store.claim("w2", "job@1") is None and store.claim("w2") is None
    assert not store.has_open_shards("job@1") and store.open_versions() == []
    assert store.renew(second) is not None
    with pytest.raises(VersionClosed, match="put refused: the version is not open"):
        store.put_results(second, [ResultRow(ids[1][3], OUT)])
    assert store.release(second, "halted")
    assert store.judge_dead_letters("job@1", "w2") == halt  # judged once: the first halt stands
    [event] = store.events("job@1", ["halt"])
    assert event.worker == "w1" and Halt.from_json(event.detail) == halt
    assert [(j.version, j.state) for j in store.jobs()] == [("job@1", "halted")]


def test_a_halted_version_resumes_only_under_a_bound_it_does_not_pass_and_is_sealed_when_nothing_is_left(
        store: Store) -> None:
    ids = plan_bounded(store, shards=1, planned_dead=0)
    lease = store.claim("w1", "job@1")
    assert lease is not None
    store.dead_letter(lease, [DeadLetterRow(rid, "truncated", "cut off", attempts=1) for rid in ids[0][:3]])
    store.put_results(lease, [ResultRow(ids[0][3], OUT)])
    assert store.judge_dead_letters("job@1", "w1") is not None
    store.complete(lease)  # its last shard, completed while the version is halted
    assert state(store, "job@1") == "halted"

    with pytest.raises(StoreError, match=r"cannot resume job@1: 3 of the 4 outcomes it computed are dead letters, "
                                         r"over shards.abort_dead_letter_rate 0.5 after 4 outcomes already"):
        store.resume("job@1", WHO, None)
    assert state(store, "job@1") == "halted"
    assert store.resume("job@1", WHO, "a poor backfill", rate=0.8) == DeadLetterBound(0.8, 4)
    assert state(store, "job@1") == "sealed"
    job = store.job("job@1")
    assert job is not None and job.bound == DeadLetterBound(0.8, 4) and job.halt is None
    [event] = store.events("job@1", ["resume"])
    assert event.detail["who"] == WHO and event.detail["rate"] == 0.8 and event.detail["was"]["kind"] == "truncated"
    with pytest.raises(StoreError, match="cannot resume job@1: it is sealed, not halted"):
        store.resume("job@1", WHO, None)


def test_a_halted_version_with_work_left_is_claimed_again_once_resumed_or_can_be_cancelled(store: Store) -> None:
    for version in ("job@1", "job@2"):
        ids = plan_bounded(store, version, shards=2, planned_dead=0)
        lease = store.claim("w1", version)
        assert lease is not None
        store.dead_letter(lease, [DeadLetterRow(rid, "too_long", "over the cap", attempts=0) for rid in ids[0]])
        assert store.judge_dead_letters(version, "w1") is not None
        store.release(lease, "halted")
    assert store.resume("job@1", WHO, None, rate=1.0, min_outcomes=10) == DeadLetterBound(1.0, 10)
    again = store.claim("w2", "job@1")
    assert again is not None and state(store, "job@1") == "ready"
    assert store.judge_dead_letters("job@1", "w2") is None  # rate 1 is never passed
    with pytest.raises(StoreError, match="cannot delete job@2: it is not finished; cancel it first"):
        store.delete("job@2", WHO)
    assert store.cancel("job@2", WHO, "max_tokens too small") is True
    assert state(store, "job@2") == "cancelled"
    [event] = store.events("job@2", ["cancel"])
    assert event.detail["was"] == "halted"


def test_a_version_planned_without_a_bound_is_never_halted(store: Store) -> None:
    writer = store.begin_plan("job@1", "job", {"name": "job", "shards": {"lease_seconds": LEASE}})
    writer.add_shards([PlannedShard(0, {"shard": 0}, 200)])
    writer.add_records([PlannedRecord(f"r{i}", 0, "h") for i in range(200)])
    writer.commit(200, 1)
    lease = store.claim("w1", "job@1")
    assert lease is not None
    store.dead_letter(lease, [DeadLetterRow(f"r{i}", "truncated", "cut off", attempts=1) for i in range(200)])
    assert store.judge_dead_letters("job@1", "w1") is None
    job = store.job("job@1")
    assert job is not None and job.bound is None and job.state == "ready"
