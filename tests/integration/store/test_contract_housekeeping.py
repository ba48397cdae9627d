"""The store contract for versions nobody will publish: cancel ends one (no shard of it is
claimed again, its lease holders are fenced off), delete removes its rows; neither touches
the published version or the one a rollback would return to. Over every store, and a
worker's role can do neither."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from batchline.errors import NoSuchVersion, StoreError
from batchline.store import LeaseLost, ResultRow, Store, open_store
from tests.integration.store.test_contract import OUT, answer_all, latest_publication, plan_version

WHO = "ops@host"


def seal(store: Store, version: str, ids: list[list[str]]) -> None:
    while (lease := store.claim("w-seal", version)) is not None:
        answer_all(store, lease, ids[lease.shard_no])
        store.complete(lease)
    job = store.job(version)
    assert job is not None and job.state == "sealed"


def state(store: Store, version: str) -> str:
    job = store.job(version)
    assert job is not None
    return job.state


def test_a_cancelled_version_is_claimed_no_more_and_its_lease_holders_are_fenced_off(store: Store) -> None:
    ids = plan_version(store, shards=2)
    lease = store.claim("w1", "job@1")
    assert lease is not None
    assert store.cancel("job@1", WHO, "input edited after planning") is True
    assert store.claim("w2", "job@1") is None and store.claim("w2") is None
    assert not store.has_open_shards("job@1") and store.open_versions() == []
    assert store.renew(lease) is None
    with pytest.raises(LeaseLost):
        store.put_results(lease, [ResultRow(ids[0][0], OUT)])
    with pytest.raises(LeaseLost):
        store.complete(lease)
    assert state(store, "job@1") == "cancelled"
    assert [(j.version, j.state) for j in store.jobs()] == [("job@1", "cancelled")]
    [event] = store.events("job@1", ["cancel"])
    assert event.detail == {"who": WHO, "reason": "input edited after planning", "was": "ready",
                            "leases_ended": 1}
    assert store.cancel("job@1", WHO, None) is False
    assert len(store.events("job@1", ["cancel"])) == 1


def test_the_published_version_and_the_one_a_rollback_returns_to_are_neither_cancelled_nor_deleted(
        store: Store) -> None:
    for version in ("job@1", "job@2", "job@3"):
        seal(store, version, plan_version(store, version))
    store.publish("job", "job@1", WHO, None, None, expected=None)
    store.publish("job", "job@2", WHO, None, None, expected=latest_publication(store, "job"))
    assert store.published() == {"job": "job@2"}
    for verb, operation in (("cancel", lambda v: store.cancel(v, WHO, None)),
                            ("delete", lambda v: store.delete(v, WHO))):
        with pytest.raises(StoreError, match=f"^cannot {verb} job@2: it is published as 'job'$"):
            operation("job@2")
        with pytest.raises(StoreError, match=f"^cannot {verb} job@1: a rollback of 'job' would return to it$"):
            operation("job@1")
    assert [state(store, v) for v in ("job@1", "job@2")] == ["sealed", "sealed"]
    assert store.events("job@1", ["cancel", "remove"]) == [] == store.events("job@2", ["cancel", "remove"])
    # A sealed version that was never published may be cancelled, and is then never published.
    assert store.cancel("job@3", WHO, "superseded") is True
    with pytest.raises(StoreError, match="cannot publish job@3: it is not sealed"):
        store.publish("job", "job@3", WHO, None, None, expected=latest_publication(store, "job"))
    assert store.resolve_name("job") == "job@2"


def test_delete_removes_a_cancelled_or_unpublished_sealed_version_and_refuses_one_still_running(
        store: Store) -> None:
    seal(store, "job@1", plan_version(store, "job@1"))
    plan_version(store, "job@2")
    with pytest.raises(StoreError, match=r"^cannot delete job@2: it is not finished; cancel it first$"):
        store.delete("job@2", WHO)
    assert store.cancel("job@2", WHO, None) is True
    assert store.delete("job@2", WHO) is True
    assert store.delete("job@1", WHO) is True
    for version, was in (("job@1", "sealed"), ("job@2", "cancelled")):
        assert state(store, version) == "removed"
        assert list(store.planned_ids(version)) == [] and list(store.iter_results(version)) == []
        assert [e.detail for e in store.events(version, ["remove"])] == [{"who": WHO, "was": was}]
    assert store.jobs() == []
    assert store.delete("job@1", WHO) is False
    with pytest.raises(StoreError, match="cannot cancel job@1: it is removed"):
        store.cancel("job@1", WHO, None)
    with pytest.raises(NoSuchVersion, match=re.escape(f"no job version 'job@9' in {store.where()}")):
        store.delete("job@9", WHO)


def test_a_worker_can_neither_cancel_nor_delete(store_kind: str, store: Store,
                                                 worker_url: Callable[[str], str]) -> None:
    if store_kind != "postgres-worker-role":
        pytest.skip("only PostgreSQL has a worker role narrower than the store's owner")
    plan_version(store, "job@1")
    seal(store, "job@2", plan_version(store, "job@2"))
    worker = open_store(worker_url("job@1"))
    other = open_store(worker_url("job@2"))
    try:
        with pytest.raises(StoreError, match="permission denied"):
            worker.cancel("job@1", "worker", None)
        with pytest.raises(StoreError, match="permission denied"):
            other.delete("job@2", "worker")
    finally:
        worker.close()
        other.close()
    assert (state(store, "job@1"), state(store, "job@2")) == ("ready", "sealed")
    assert len(list(store.iter_results("job@2"))) == 12
    assert store.events(None, ["cancel", "remove"]) == []
