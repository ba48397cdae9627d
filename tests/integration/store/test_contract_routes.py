"""The store contract for hosted routes: shards of a route, the `submitted` state and
the batch kept on the shard, over every store."""

from __future__ import annotations

import pytest

from batchline.store import LeaseLost, PlannedRecord, PlannedShard, ResultRow, Store
from tests.integration.store.test_contract import LEASE, OUT

BATCH = {"api": "openai", "batch_id": "batch_1", "tag": "job@1/1/1", "request_count": 2, "submitted_at": 1.0}


def plan_routes(store: Store, version: str = "job@1") -> dict[int, list[str]]:
    """Shard 0 local, shard 1 hosted on 'oai', shard 2 local."""
    writer = store.begin_plan(version, "job", {"name": "job", "shards": {"lease_seconds": LEASE}})
    routes = {0: "local", 1: "oai", 2: "local"}
    ids = {s: [f"s{s}-r{i}" for i in range(2)] for s in routes}
    writer.add_shards([PlannedShard(s, {"shard": s}, 2, route) for s, route in routes.items()])
    writer.add_records([PlannedRecord(rid, s, "h") for s, group in ids.items() for rid in group])
    writer.commit(6, 3)
    return ids


def test_claim_takes_only_the_routes_asked_for(store: Store) -> None:
    plan_routes(store)
    hosted = store.claim("poller", routes=["oai"])
    assert hosted is not None and (hosted.shard_no, hosted.route, hosted.batch) == (1, "oai", None)
    assert store.claim("poller", routes=["oai"]) is None
    local = store.claim("gpu", "job@1", ["local"])
    assert local is not None and (local.shard_no, local.route) == (0, "local")
    assert store.has_open_shards("job@1", ["oai"]) and store.has_open_shards(None, ["local"])
    assert not store.has_open_shards("job@1", ["elsewhere"])


def test_a_submitted_shard_holds_no_lease_and_waits_for_its_poll_time(store: Store) -> None:
    plan_routes(store)
    lease = store.claim("w1", routes=["oai"])
    assert lease is not None
    lease = store.set_batch(lease, {"state": "submitting", "tag": "t"})
    store.await_provider(lease, BATCH, poll_in=60.0)
    [row] = [r for r in store.shard_rows("job@1") if r.shard_no == 1]
    assert (row.state, row.batch_id, row.lease_expires) == ("submitted", "batch_1", None)
    assert store.status("job@1").shards["submitted"] == 1
    assert store.claim("w2", routes=["oai"]) is None  # not due yet, and no lease to expire
    assert store.has_open_shards("job@1", ["oai"])
    store.shift_clock(61.0)
    poller = store.claim("w2", routes=["oai"])
    assert poller is not None and poller.epoch == lease.epoch + 1
    assert poller.batch == BATCH  # whoever polls gets the provider's batch id, and does not submit again
    kinds = [e.kind for e in store.events("job@1", ["submitted", "provider_wait"])]
    assert kinds == ["submitted"]
    store.await_provider(poller, BATCH, poll_in=60.0)
    assert [e.kind for e in store.events("job@1", ["submitted", "provider_wait"])] == ["submitted",
                                                                                          "provider_wait"]


def test_parking_is_fenced_and_a_retry_of_the_same_parking_succeeds(store: Store) -> None:
    plan_routes(store)
    lease = store.claim("w1", routes=["oai"])
    assert lease is not None
    store.await_provider(lease, BATCH, poll_in=0.0)
    store.await_provider(lease, BATCH, poll_in=0.0)  # a lost acknowledgement, retried
    poller = store.claim("w2", routes=["oai"])
    assert poller is not None
    with pytest.raises(LeaseLost):
        store.await_provider(lease, {**BATCH, "batch_id": "batch_2"}, poll_in=0.0)
    with pytest.raises(LeaseLost):
        store.set_batch(lease, None)
    assert store.claim("w3", routes=["oai"]) is None  # the stale parking changed nothing


def test_release_with_a_batch_at_the_provider_keeps_it_there(store: Store) -> None:
    plan_routes(store)
    lease = store.claim("w1", routes=["oai"])
    assert lease is not None
    store.await_provider(lease, BATCH, poll_in=0.0)
    poller = store.claim("w2", routes=["oai"])
    assert poller is not None
    assert store.release(poller, "stop")
    [row] = [r for r in store.shard_rows("job@1") if r.shard_no == 1]
    assert (row.state, row.batch_id) == ("submitted", "batch_1")
    again = store.claim("w3", routes=["oai"])
    assert again is not None and again.batch == BATCH


def test_an_intent_without_a_batch_id_goes_back_to_ready_with_the_intent(store: Store) -> None:
    plan_routes(store)
    lease = store.claim("w1", routes=["oai"])
    assert lease is not None
    intent = {"state": "submitting", "tag": "job@1/1/1", "request_count": 2}
    lease = store.set_batch(lease, intent)
    store.shift_clock(LEASE + 1)  # the worker died between its intent and the provider's answer
    heir = store.claim("w2", routes=["oai"])
    assert heir is not None and heir.batch == intent


def test_results_name_their_model_and_route_totals_count_per_route(store: Store) -> None:
    ids = plan_routes(store)
    hosted = store.claim("w1", routes=["oai"])
    local = store.claim("w2", routes=["local"])
    assert hosted is not None and local is not None
    store.put_results(hosted, [ResultRow(rid, OUT, input_tokens=10, output_tokens=3, model="gpt-x")
                                 for rid in ids[1]])
    store.put_results(local, [ResultRow(ids[0][0], OUT, input_tokens=7, output_tokens=2, model="llamacpp:m")])
    store.complete(hosted)
    models = {r.record_id: r.model for r in store.iter_results("job@1")}
    assert models == {ids[1][0]: "gpt-x", ids[1][1]: "gpt-x", ids[0][0]: "llamacpp:m"}
    totals = store.route_totals("job@1")
    assert (totals["oai"].records, totals["oai"].results, totals["oai"].input_tokens,
            totals["oai"].output_tokens, totals["oai"].shards) == (2, 2, 20, 6, 1)
    assert (totals["local"].records, totals["local"].results, totals["local"].shards) == (4, 1, 2)
