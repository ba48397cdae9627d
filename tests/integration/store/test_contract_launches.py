"""The store contract for what an orchestrator launched, on every store: an intent is written
once per key, a retry reads it back instead of writing another, what was launched is kept, a
stopped launch is launched again by the next try, and the first intent opens the run."""

from __future__ import annotations

import pytest

from batchline.errors import NoSuchVersion, StoreError
from batchline.store import Store
from tests.integration.store.test_contract import plan_version

KEY = "airflow:nightly/triage/scheduled__2026-12-06/-1"


def test_a_retried_task_reads_its_launch_back_and_writes_no_second_one(store: Store) -> None:
    plan_version(store)
    first, made = store.launch_intent("job@1", KEY, "local", "airflow")
    assert made and first.state == "intent" and first.detail is None
    # The task died before recording its launch: the retry finds the orphaned intent.
    again, made_again = store.launch_intent("job@1", KEY, "local", "airflow")
    assert not made_again and again.state == "intent" and again.created_at == first.created_at
    launched = store.launch_recorded("job@1", KEY, {"pid": 4242, "host": "worker-1"})
    assert launched.state == "launched" and launched.detail == {"pid": 4242, "host": "worker-1"}
    assert launched.launched_at is not None
    third, made_third = store.launch_intent("job@1", KEY, "local", "airflow")
    assert not made_third and third.state == "launched" and third.detail == {"pid": 4242, "host": "worker-1"}
    assert [r.key for r in store.launches("job@1")] == [KEY]
    assert [e.detail for e in store.events("job@1", ["launch"])] == [{"key": KEY, "launcher": "local"}]


def test_a_launch_opens_the_run_once(store: Store) -> None:
    plan_version(store)
    store.launch_intent("job@1", KEY, "kubernetes", "airflow")
    opened = store.status("job@1").opened_at
    assert opened is not None
    store.shift_clock(60)
    store.launch_intent("job@1", "airflow:nightly/triage/manual__1/-1", "kubernetes", "airflow")
    assert store.status("job@1").opened_at == opened
    assert len(store.events("job@1", ["open"])) == 1


def test_a_retry_with_another_launcher_is_refused_and_changes_nothing(store: Store) -> None:
    plan_version(store)
    store.launch_intent("job@1", KEY, "ray", "airflow")
    with pytest.raises(StoreError, match="made by the ray launcher, not kubernetes"):
        store.launch_intent("job@1", KEY, "kubernetes", "airflow")
    [record] = store.launches("job@1")
    assert (record.launcher, record.state) == ("ray", "intent")


def test_a_stopped_launch_is_kept_stopped_and_launched_again_by_the_next_try(store: Store) -> None:
    plan_version(store)
    store.launch_intent("job@1", KEY, "local", "airflow")
    store.launch_recorded("job@1", KEY, {"pid": 1})
    stopped = store.launch_stopped("job@1", KEY, "killed by the DAG run's user")
    assert stopped is not None and stopped.state == "stopped" and stopped.stop_reason == "killed by the DAG run's user"
    # A late record of the stopped launch (a launcher that finished after the kill) is refused.
    with pytest.raises(StoreError, match="was stopped"):
        store.launch_recorded("job@1", KEY, {"pid": 2})
    assert store.launch_stopped("job@1", KEY, "again") is not None
    assert store.launches("job@1")[0].stop_reason == "killed by the DAG run's user"
    revived, made = store.launch_intent("job@1", KEY, "local", "airflow")
    assert made and revived.state == "intent" and revived.detail is None and revived.stopped_at is None


def test_a_launch_of_a_version_that_does_not_exist_is_refused(store: Store) -> None:
    with pytest.raises(NoSuchVersion):
        store.launch_intent("nope@1", KEY, "local", "airflow")
    assert store.launch_stopped("nope@1", KEY, "gone") is None
    with pytest.raises(StoreError, match="no launch"):
        store.launch_recorded("nope@1", KEY, {})


def test_a_versions_lineage_parent_is_kept_replaced_by_the_latest_and_refused_incomplete(store: Store) -> None:
    plan_version(store)
    assert store.lineage_parent("job@1") is None
    store.set_lineage_parent("job@1", {"namespace": "airflow", "name": "nightly.triage", "run_id": "r-1"})
    store.set_lineage_parent("job@1", {"namespace": "airflow", "name": "nightly.triage", "run_id": "r-2"})
    assert store.lineage_parent("job@1") == {"namespace": "airflow", "name": "nightly.triage", "run_id": "r-2"}
    with pytest.raises(ValueError, match="needs run_id"):
        store.set_lineage_parent("job@1", {"namespace": "airflow", "name": "nightly.triage"})
    with pytest.raises(NoSuchVersion):
        store.set_lineage_parent("nope@1", {"namespace": "a", "name": "b", "run_id": "c"})
