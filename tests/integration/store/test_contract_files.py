"""The store contract for a version's outcomes by shard: each shard's identity is the input it
read (the same bytes, the same identity, in any version), its outcomes come a shard at a time
(a worker's own: what it computed), and the file its worker wrote is recorded in the step that
completes the shard, under its fence. Over every store, and under the worker's own role."""

from __future__ import annotations

import pytest

from batchline.store import DeadLetterRow, LeaseLost, PlannedRecord, PlannedShard, ResultRow, Store
from tests.integration.store.test_contract import LEASE, OUT

FILE = {"parquet:/x": {"path": "/x/shard-0.parquet", "rows": 4, "pin": {"size": 10}}}


def plan_with_slices(store: Store, version: str, digests: list[str], *, base: str | None = None) -> list[list[str]]:
    writer = store.begin_plan(version, "job", {"name": "job", "shards": {"lease_seconds": LEASE}})
    ids = [[f"s{s}-r{i}" for i in range(4)] for s in range(len(digests))]
    writer.add_shards([PlannedShard(s, {"digest": d}, 4) for s, d in enumerate(digests)])
    # A record's content is its shard's input: another digest, another content.
    writer.add_records([PlannedRecord(rid, s, f"h-{digests[s]}") for s in range(len(digests)) for rid in ids[s]])
    if base is not None:
        writer.carry_from(base)
    writer.commit(4 * len(digests), len(digests))
    return ids


def test_a_shard_is_known_by_the_input_it_read_and_whether_its_outcomes_were_carried(store: Store) -> None:
    ids = plan_with_slices(store, "job@1", ["sha256:a", "sha256:b"])
    while (lease := store.claim("w1", "job@1")) is not None:
        store.put_results(lease, [ResultRow(rid, OUT) for rid in ids[lease.shard_no]])
        store.complete(lease)
    plan_with_slices(store, "job@2", ["sha256:a", "sha256:c"], base="job@1")  # its second shard's input changed
    first, second = store.shard_units("job@1"), store.shard_units("job@2")
    assert first[0].identity == second[0].identity != second[1].identity != first[1].identity
    assert (second[0].all_carried, second[1].all_carried) == (True, False)
    assert not first[0].all_carried  # computed there


def test_a_worker_reads_what_it_computed_of_its_shard_and_its_file_is_recorded_as_it_completes(store: Store) -> None:
    ids = plan_with_slices(store, "job@1", ["sha256:a"])
    lease = store.claim("w1", "job@1")
    assert lease is not None
    store.put_results(lease, [ResultRow(rid, OUT) for rid in ids[0][:3]])
    store.dead_letter(lease, [DeadLetterRow(ids[0][3], "invalid_output", "not JSON", attempts=3)])
    results, dead = store.shard_outcomes("job@1", 0, computed_only=True)
    assert [r.record_id for r in results] == ids[0][:3] and [d.record_id for d in dead] == [ids[0][3]]
    store.complete(lease, FILE)
    [unit] = store.shard_units("job@1")
    assert unit.files == FILE and (unit.results, unit.dead_letters) == (3, 1)


def test_a_stale_owners_completion_and_its_file_are_refused(store: Store) -> None:
    ids = plan_with_slices(store, "job@1", ["sha256:a"])
    stale = store.claim("w1", "job@1")
    assert stale is not None
    store.shift_clock(LEASE + 1)
    current = store.claim("w2", "job@1")
    assert current is not None and current.epoch > stale.epoch
    store.put_results(current, [ResultRow(rid, OUT) for rid in ids[0]])
    with pytest.raises(LeaseLost):
        store.complete(stale, FILE)
    store.complete(current, {"parquet:/x": {**FILE["parquet:/x"], "path": "/x/epoch-2.parquet"}})
    [unit] = store.shard_units("job@1")
    assert unit.files == {"parquet:/x": {**FILE["parquet:/x"], "path": "/x/epoch-2.parquet"}}


def test_the_outputs_a_version_computed_are_read_alone_in_id_order_without_the_carried_ones(store: Store) -> None:
    ids = plan_with_slices(store, "job@1", ["sha256:a", "sha256:b"])
    while (lease := store.claim("w1", "job@1")) is not None:
        store.put_results(lease, [ResultRow(rid, OUT) for rid in ids[lease.shard_no]])
        store.complete(lease)
    assert list(store.iter_outputs("job@1", page_size=3)) == [(rid, OUT) for rid in sorted(ids[0] + ids[1])]
    again = plan_with_slices(store, "job@2", ["sha256:a", "sha256:c"], base="job@1")
    lease = store.claim("w1", "job@2")
    assert lease is not None and lease.shard_no == 1  # its first shard was carried whole
    computed = '{"category":"b","summary":"again"}'
    store.put_results(lease, [ResultRow(rid, computed) for rid in again[1][:2]])
    assert list(store.iter_outputs("job@2")) == [(rid, computed) for rid in sorted(again[1][:2])]
