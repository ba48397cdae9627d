"""The store contract for holding a deadline, on every store: the run start is set once and
kept, workers' heartbeats are capacity while fresh and not once gone or silent, and the paid
budget reads what the paid starts spent."""

from __future__ import annotations

import pytest

from batchline.errors import NoSuchVersion
from batchline.store import Store
from batchline.store.beats import SILENT_AFTER
from tests.integration.store.test_contract import plan_version


def test_the_run_start_is_set_by_the_first_opener_and_kept(store: Store) -> None:
    plan_version(store)
    assert store.status("job@1").run_start is None  # nothing opened it, nothing claimed
    opened = store.open_run("job@1", "runner")
    assert opened == pytest.approx(store.now(), abs=1.0)
    store.shift_clock(100)
    # A second runner, a pacer restarted, a resume: the line keeps its start.
    assert store.open_run("job@1", "pacer") == opened
    st = store.status("job@1")
    assert st.opened_at == opened and st.run_start == opened and st.started_at is None
    assert [(e.worker, e.kind) for e in store.events("job@1", ["open"])] == [("runner", "open")]
    with pytest.raises(NoSuchVersion):
        store.open_run("nope@1", "runner")


def test_a_version_a_bare_worker_claimed_first_starts_at_that_claim(store: Store) -> None:
    plan_version(store)
    lease = store.claim("w1", "job@1")
    assert lease is not None
    claimed = store.events("job@1", ["claim"])[0].ts
    store.shift_clock(50)
    assert store.status("job@1").run_start == pytest.approx(claimed)  # no opener yet: the first claim
    assert store.open_run("job@1", "runner") == pytest.approx(claimed)


def test_heartbeats_are_capacity_while_fresh_and_not_once_gone_or_silent(store: Store) -> None:
    plan_version(store)
    store.worker_beat("job@1", "spot-1", every=5.0, process={"host": "h", "pid": 1})
    store.worker_beat("job@1", "paid-a", every=5.0, paid_slot="paid-0/1")
    store.worker_beat("job@1", "gone", every=5.0)
    store.worker_gone("job@1", "gone")
    store.worker_beat("job@1", "gone", every=5.0)  # a late heartbeat after its exit changes nothing
    seen = {w.worker: w for w in store.workers_seen("job@1")}
    assert set(seen) == {"spot-1", "paid-a"}
    assert not seen["spot-1"].paid and seen["spot-1"].process == {"host": "h", "pid": 1}
    assert seen["paid-a"].paid and seen["paid-a"].paid_slot == "paid-0/1"
    # One heartbeat late is tolerated; silent for longer, a worker is no longer counted.
    store.shift_clock(5.0 * SILENT_AFTER - 1)
    assert {w.worker for w in store.workers_seen("job@1")} == {"spot-1", "paid-a"}
    store.shift_clock(2)
    assert store.workers_seen("job@1") == []
    store.worker_beat("job@1", "spot-1", every=5.0)
    assert [w.worker for w in store.workers_seen("job@1")] == ["spot-1"]
    # A heartbeat for a version that does not exist (a mistyped --job) leaves nothing (as the
    # owner: no worker role is ever made for a version that does not exist).
    owner = getattr(store, "owner", store)
    owner.worker_beat("nope@1", "spot-1", every=5.0)
    assert owner.workers_seen("nope@1") == []


def test_the_paid_budget_is_the_spend_and_the_hourly_cost_of_the_starts_that_run(store: Store) -> None:
    plan_version(store)
    assert store.paid_budget("job@1") == (0.0, 0.0)
    for slot in ("paid-0", "paid-1"):
        assert store.paid_launch("job@1", slot, "pacer", 3.6, stale_seconds=60, launch_timeout=60) == 1
    # Launched, not up: nothing spent, nothing running.
    assert store.paid_budget("job@1") == (0.0, 0.0)
    assert store.paid_seen("job@1", "paid-0", 1, "w0", None)
    assert store.paid_seen("job@1", "paid-1", 1, "w1", None)
    store.shift_clock(1000)
    spent, per_hour = store.paid_budget("job@1")
    assert spent == pytest.approx(2 * 1000 * 3.6 / 3600, rel=0.01) and per_hour == pytest.approx(7.2)
    assert store.paid_stop("job@1", "paid-1", 1, "stopped")
    store.shift_clock(1000)
    spent, per_hour = store.paid_budget("job@1")
    assert spent == pytest.approx(3 * 1000 * 3.6 / 3600, rel=0.01) and per_hour == pytest.approx(3.6)


def test_a_start_never_seen_is_already_there_until_its_launch_timeout(store: Store) -> None:
    plan_version(store)
    assert store.paid_launch("job@1", "paid-0", "pacer", 3.6, stale_seconds=60, launch_timeout=30) == 1
    assert store.paid_launch("job@1", "paid-0", "pacer", 3.6, stale_seconds=60, launch_timeout=30) is None
    store.shift_clock(31)
    assert store.paid_launch("job@1", "paid-0", "pacer", 3.6, stale_seconds=60, launch_timeout=30) == 2
    first, second = store.paid_slots("job@1")
    assert not first.running and first.stop_reason == "not seen within 30 s of its launch" and second.running
