"""The store contract for what a heartbeat means (batchline.store.beats), on every store and on
PostgreSQL under the worker's role: a heartbeat is what a worker says, and counts as capacity
only while its worker loads, holds a lease, or (paid) is the worker of a running start. Each
test is named after the failure it reproduces: a worker's credentials steering the pacer."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from batchline.errors import StoreError
from batchline.store import PlannedRecord, PlannedShard, Store
from batchline.store.beats import (
    HEARTBEAT_BOUND,
    HEARTBEAT_MAX_SECONDS,
    LOADING_OVERHEADS,
    SILENT_AFTER,
)
from tests.integration.store.test_contract import answer_all

YEAR = 365 * 86_400.0
V = "job@1"
OVERHEAD = 20.0  # the spec's fallback.restart_overhead_seconds: a worker loads for two of them


def plan_paced(store: Store, *, lease_seconds: float = 600.0, shards: int = 3, per_shard: int = 4) -> list[list[str]]:
    spec = {"name": "job", "shards": {"lease_seconds": lease_seconds}, "deadline": "1h",
            "fallback": {"workers": 2, "cost_per_worker_hour": 3.6, "restart_overhead_seconds": OVERHEAD}}
    writer = store.begin_plan(V, "job", spec)
    ids = [[f"s{s}-r{i}" for i in range(per_shard)] for s in range(shards)]
    writer.add_shards([PlannedShard(s, {"shard": s}, per_shard) for s in range(shards)])
    writer.add_records([PlannedRecord(rid, s, "h") for s in range(shards) for rid in ids[s]])
    writer.commit(shards * per_shard, shards)
    return ids


def counted(store: Store) -> dict[str, str]:
    return {w.worker: w.why for w in store.live_capacity(V)}


def test_a_heartbeat_declaring_an_interval_of_a_year_is_refused(store: Store) -> None:
    plan_paced(store)
    for every in (YEAR, 1e12, 0.01, float("nan"), float("inf")):
        with pytest.raises(StoreError, match=r"heartbeat's interval is from 0\.1 to 60 s"):
            store.worker_beat(V, "w-year", every=every)
    assert store.workers_seen(V) == [] and counted(store) == {}
    # A worker that beat within the bounds cannot stretch its interval afterwards either.
    store.worker_beat(V, "w-year", every=HEARTBEAT_MAX_SECONDS)
    with pytest.raises(StoreError, match=r"from 0\.1 to 60 s"):
        store.worker_beat(V, "w-year", every=YEAR)
    assert [w.every for w in store.workers_seen(V)] == [HEARTBEAT_MAX_SECONDS]


def test_batchline_own_worker_changed_to_beat_once_a_year_is_refused(store: Store) -> None:
    from batchline.worker.heartbeat import Heartbeat

    plan_paced(store)
    said: list[str] = []
    # The one line an attacker changes: the interval its heartbeat declares.
    beat = Heartbeat(store, "w-year", V, {"host": "h", "pid": 1}, every=YEAR, log=said.append)
    beat.beat()
    assert len(said) == 1 and "from 0.1 to 60 s" in said[0]
    assert store.workers_seen(V) == []


def test_a_heartbeat_of_a_year_written_by_hand_is_refused_by_the_database(
        store: Store, store_kind: str, store_url: str, worker_url: Callable[[str], str]) -> None:
    # The attacker skips batchline's own check and writes the row as its credentials allow
    # (on PostgreSQL under the worker's role, where the store has one).
    plan_paced(store)
    store.worker_beat(V, "honest", every=5.0)
    insert = ("INSERT INTO worker_beats (version, worker, every_s, started_at, seen_at) "
              "VALUES ('job@1', 'w-year', 31536000, 0, 0)")
    stretch = "UPDATE worker_beats SET every_s = 31536000 WHERE version = 'job@1' AND worker = 'honest'"
    if store_kind == "sqlite":
        conn = sqlite3.connect(store_url.removeprefix("sqlite:///"))
        try:
            for sql in (insert, stretch):
                with pytest.raises(sqlite3.IntegrityError, match=f"CHECK constraint failed: {HEARTBEAT_BOUND}"):
                    conn.execute(sql)
        finally:
            conn.close()
    else:
        with psycopg.connect(worker_url(V), autocommit=True) as pg:
            for sql in (insert, stretch):
                with pytest.raises(psycopg.errors.CheckViolation, match=f'"{HEARTBEAT_BOUND}"'):
                    pg.execute(sql)
    assert {w.worker: w.every for w in store.workers_seen(V)} == {"honest": 5.0}


def test_fifty_workers_beating_without_ever_claiming_stop_counting_after_the_loading_allowance(
        store: Store) -> None:
    plan_paced(store)
    allowance = store.loading_allowance(V)
    assert allowance == LOADING_OVERHEADS * OVERHEAD  # no paid start has measured one: the spec's
    fleet = [f"idle-{i:02d}" for i in range(50)]

    def beat_all() -> None:
        for w in fleet:
            store.worker_beat(V, w, every=HEARTBEAT_MAX_SECONDS)

    beat_all()
    assert counted(store) == dict.fromkeys(fleet, "loading")  # loading workers count (I7)
    store.shift_clock(allowance - 1)
    beat_all()
    assert len(counted(store)) == 50
    store.shift_clock(2)
    beat_all()
    # Still heard, at the longest interval there is, and no longer capacity: none ever claimed.
    assert len(store.workers_seen(V)) == 50
    assert counted(store) == {}


def test_a_worker_still_loading_its_model_counts_before_any_claim(store: Store) -> None:
    plan_paced(store)
    store.worker_beat(V, "spot-loading", every=5.0)
    store.shift_clock(OVERHEAD)
    store.worker_beat(V, "spot-loading", every=5.0)
    store.worker_beat(V, "spot-new", every=5.0)
    assert counted(store) == {"spot-loading": "loading", "spot-new": "loading"}
    # Once paid starts measure the version's restart overhead, that is what a worker loads in.
    assert store.paid_launch(V, "paid-0", "pacer", 3.6, stale_seconds=60, launch_timeout=600) == 1
    store.shift_clock(30)
    assert store.paid_seen(V, "paid-0", 1, "paid-w0", None)
    assert store.paid_seen(V, "paid-0", 1, "paid-w0", None, claimed=True)
    assert store.loading_allowance(V) == pytest.approx(LOADING_OVERHEADS * 30, abs=1.0)


def test_a_worker_that_claimed_counts_while_it_holds_its_lease_and_just_after_completing(
        store: Store) -> None:
    ids = plan_paced(store, lease_seconds=600)
    store.worker_beat(V, "spot-working", every=5.0)  # its first heartbeat: its loading starts
    lease = store.claim("spot-working", V)
    assert lease is not None
    store.shift_clock(LOADING_OVERHEADS * OVERHEAD + 10)  # past any loading allowance
    store.worker_beat(V, "spot-working", every=5.0)
    assert counted(store) == {"spot-working": "leased"}
    answer_all(store, lease, ids[lease.shard_no])
    store.complete(lease)
    store.worker_beat(V, "spot-working", every=5.0)
    assert counted(store) == {"spot-working": "completed"}  # between two shards it holds none
    store.shift_clock(5.0 * SILENT_AFTER + 1)
    store.worker_beat(V, "spot-working", every=5.0)
    assert counted(store) == {}  # it completed, claimed nothing since, and its loading is long over


def test_a_worker_whose_lease_expired_stops_counting(store: Store) -> None:
    plan_paced(store, lease_seconds=10)
    store.worker_beat(V, "stalled", every=5.0)
    assert store.claim("stalled", V) is not None
    store.shift_clock(LOADING_OVERHEADS * OVERHEAD + 10)
    store.worker_beat(V, "stalled", every=5.0)
    assert counted(store) == {}


def test_a_worker_posing_as_a_paid_slot_that_was_never_launched_is_not_counted(store: Store) -> None:
    plan_paced(store)
    store.worker_beat(V, "poser", every=5.0, paid_slot="paid-0/1")
    assert [w.worker for w in store.workers_seen(V)] == ["poser"]  # what it says
    assert counted(store) == {}  # and it is no capacity: no such start


def test_a_worker_posing_as_another_workers_running_paid_start_is_not_counted(store: Store) -> None:
    plan_paced(store)
    assert store.paid_launch(V, "paid-0", "pacer", 3.6, stale_seconds=60, launch_timeout=600) == 1
    assert store.paid_seen(V, "paid-0", 1, "paid-w0", None)
    store.worker_beat(V, "paid-w0", every=5.0, paid_slot="paid-0/1")
    store.worker_beat(V, "poser", every=5.0, paid_slot="paid-0/1")  # the same start, another worker
    store.worker_beat(V, "poser-2", every=5.0, paid_slot="paid-0/2")  # a generation never launched
    store.worker_beat(V, "poser-3", every=5.0, paid_slot="paid-1/1")  # a slot never launched
    live = {w.worker: w for w in store.live_capacity(V)}
    assert set(live) == {"paid-w0"} and live["paid-w0"].paid and live["paid-w0"].why == "loading"


def test_a_worker_posing_as_a_stopped_paid_start_is_not_counted(store: Store) -> None:
    plan_paced(store)
    assert store.paid_launch(V, "paid-0", "pacer", 3.6, stale_seconds=60, launch_timeout=600) == 1
    assert store.paid_seen(V, "paid-0", 1, "paid-w0", None)
    lease = store.claim("paid-w0", V)
    assert lease is not None
    store.worker_beat(V, "paid-w0", every=5.0, paid_slot="paid-0/1")
    assert counted(store) == {"paid-w0": "leased"}
    assert store.paid_stop(V, "paid-0", 1, "stopped by the pacer")
    # Its start stopped, it goes on beating (and even working): it is no paid capacity.
    store.worker_beat(V, "paid-w0", every=5.0, paid_slot="paid-0/1")
    assert counted(store) == {}


def test_live_capacity_reads_many_workers_in_one_statement(store: Store, monkeypatch: Any) -> None:
    # The pacer reads it every tick for a fleet of a thousand: one statement over the fleet,
    # not one per worker.
    plan_paced(store)
    for i in range(200):
        store.worker_beat(V, f"w{i:03d}", every=5.0)
    owner: Any = getattr(store, "owner", store)
    calls: list[str] = []
    real = owner.q

    class Counting:
        def __getattr__(self, name: str) -> Any:
            calls.append(name)
            return getattr(real, name)

    monkeypatch.setattr(owner, "q", Counting())
    assert len(owner.live_capacity(V)) == 200
    assert calls.count("LIVE_CAPACITY") == 1 and len(calls) <= 3
