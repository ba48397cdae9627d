"""The store contract for versions nobody will publish: cancel ends one (no shard of it is
claimed again, its lease holders are fenced off), delete removes its rows; neither touches
the published version or the one a rollback would return to. Over every backend, and a
worker's role can do neither."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from batchline.errors import StoreError
from batchline.store import LeaseLost, ResultRow, Store, open_store
from tests.store.test_contract import OUT, answer_all, plan_version

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


def test_a_cancelled_version_is_claimed_no_more_and_its_lease_holders_are_fenced_off(backend: Store) -> None:
    ids = plan_version(backend, shards=2)
    lease = backend.claim("w1", "job@1")
    assert lease is not None
    assert backend.cancel("job@1", WHO, "input edited after planning") is True
    assert backend.claim("w2", "job@1") is None and backend.claim("w2") is None
    assert not backend.has_open_shards("job@1") and backend.open_versions() == []
    assert backend.renew(lease) is None
    with pytest.raises(LeaseLost):
        backend.put_results(lease, [ResultRow(ids[0][0], OUT)])
    with pytest.raises(LeaseLost):
        backend.complete(lease)
    assert state(backend, "job@1") == "cancelled"
    assert [(j.version, j.state) for j in backend.jobs()] == [("job@1", "cancelled")]
    [event] = backend.events("job@1", ["cancel"])
    assert event.detail == {"who": WHO, "reason": "input edited after planning", "was": "ready",
                            "leases_ended": 1}
    assert backend.cancel("job@1", WHO, None) is False
    assert len(backend.events("job@1", ["cancel"])) == 1


def test_the_published_version_and_the_one_a_rollback_returns_to_are_neither_cancelled_nor_deleted(
        backend: Store) -> None:
    for version in ("job@1", "job@2", "job@3"):
        seal(backend, version, plan_version(backend, version))
    backend.publish("job", "job@1", WHO, None, None)
    backend.publish("job", "job@2", WHO, None, None)
    assert backend.published() == {"job": "job@2"}
    for verb, operation in (("cancel", lambda v: backend.cancel(v, WHO, None)),
                            ("delete", lambda v: backend.delete(v, WHO))):
        with pytest.raises(StoreError, match=f"^cannot {verb} job@2: it is published as 'job'$"):
            operation("job@2")
        with pytest.raises(StoreError, match=f"^cannot {verb} job@1: a rollback of 'job' would return to it$"):
            operation("job@1")
    assert [state(backend, v) for v in ("job@1", "job@2")] == ["sealed", "sealed"]
    assert backend.events("job@1", ["cancel", "remove"]) == [] == backend.events("job@2", ["cancel", "remove"])
    # A sealed version that was never published may be cancelled, and is then never published.
    assert backend.cancel("job@3", WHO, "superseded") is True
    with pytest.raises(StoreError, match="cannot publish job@3: it is not sealed"):
        backend.publish("job", "job@3", WHO, None, None)
    assert backend.resolve_name("job") == "job@2"


def test_delete_removes_a_cancelled_or_unpublished_sealed_version_and_refuses_one_still_running(
        backend: Store) -> None:
    seal(backend, "job@1", plan_version(backend, "job@1"))
    plan_version(backend, "job@2")
    with pytest.raises(StoreError, match=r"^cannot delete job@2: it is not finished; cancel it first$"):
        backend.delete("job@2", WHO)
    assert backend.cancel("job@2", WHO, None) is True
    assert backend.delete("job@2", WHO) is True
    assert backend.delete("job@1", WHO) is True
    for version, was in (("job@1", "sealed"), ("job@2", "cancelled")):
        assert state(backend, version) == "removed"
        assert list(backend.planned_ids(version)) == [] and list(backend.iter_results(version)) == []
        assert [e.detail for e in backend.events(version, ["remove"])] == [{"who": WHO, "was": was}]
    assert backend.jobs() == []
    assert backend.delete("job@1", WHO) is False
    with pytest.raises(StoreError, match="cannot cancel job@1: it is removed"):
        backend.cancel("job@1", WHO, None)
    with pytest.raises(StoreError, match="cannot delete job@9: no such job version"):
        backend.delete("job@9", WHO)


def test_a_worker_can_neither_cancel_nor_delete(backend_kind: str, backend: Store,
                                                 worker_url: Callable[[str], str]) -> None:
    if backend_kind != "postgres-worker-role":
        pytest.skip("only PostgreSQL has a worker role narrower than the store's owner")
    plan_version(backend, "job@1")
    seal(backend, "job@2", plan_version(backend, "job@2"))
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
    assert (state(backend, "job@1"), state(backend, "job@2")) == ("ready", "sealed")
    assert len(list(backend.iter_results("job@2"))) == 12
    assert backend.events(None, ["cancel", "remove"]) == []
