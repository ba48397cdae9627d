"""The pacer with real paid worker processes (the local runner's launcher) on both stores:
each paid slot started once however many pacers run, a pacer restarted doubles nothing and
can stop what its predecessor started, a paid worker killed outright is started again while
the job is behind, a job on time or done buys nothing, the budget is never exceeded, and a
store the pacer cannot read makes it start nothing new."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from batchline.launch.pacer import Pacer, pace_until_done
from batchline.ops.runner import LocalRunner
from batchline.sizing.pacing import Mode
from batchline.spec.deadline import parse_deadline
from batchline.store import Lease, ResultRow, Store, open_store
from tests.helpers import planned, run_to_seal, wait_for

OUT = '{"category": "a"}'


@pytest.fixture
def runners() -> Iterator[list[LocalRunner]]:
    made: list[LocalRunner] = []
    yield made
    for runner in made:
        assert runner.paid is not None
        for slot in runner.paid.slots.values():
            if slot.proc is not None and slot.proc.poll() is None:
                slot.proc.kill()
                slot.proc.wait()


def runner_for(store: Store, version: str, tmp_path: Path, made: list[LocalRunner], **kw: Any) -> LocalRunner:
    runner = LocalRunner(store, version, 1, log_dir=tmp_path / f"logs-{len(made)}", **kw)
    made.append(runner)
    assert runner.pacer is not None
    return runner


def put_done(store: Store, lease: Lease, n: int) -> None:
    """The shard's first `n` records answered, each under its piece, as a worker writes them."""
    rows, record = [], 0
    for piece in lease.slice["pieces"]:
        for _ in range(int(piece["records"])):
            if len(rows) < n:
                rows.append(ResultRow(f"r{record:06d}", OUT, piece=int(piece["no"])))
            record += 1
    assert store.put_results(lease, rows) == n


def behind(job_factory: Any, store: Store, *, workers: int = 3, **fallback: Any) -> tuple[str, Lease]:
    """A version 40 s into a 120 s window with 5 records done: far behind its line."""
    spec = job_factory(n=400, options={"seconds_per_record": 0.05}, shards={"size": 50, "lease_seconds": 10,
                                                                            "renew_seconds": 2},
                       deadline="120s", fallback={"workers": workers, "cost_per_worker_hour": 3.6,
                                                  "restart_overhead_seconds": 1, **fallback})
    _spec, version = planned(spec, store)
    lease = store.claim("spot-1", version)
    assert lease is not None
    put_done(store, lease, 5)
    store.shift_clock(40)
    return version, lease


def running_slots(store: Store, version: str) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for s in store.paid_slots(version):
        out.setdefault(s.slot, []).append(s.generation)
    return out


def test_two_pacers_at_once_start_each_paid_slot_once(
        job_factory: Any, store: Store, tmp_path: Path, runners: list[LocalRunner]) -> None:
    version, _lease = behind(job_factory, store)
    first, second = (runner_for(store, version, tmp_path, runners) for _ in range(2))
    report = first.pacer.tick()  # type: ignore[union-attr]
    # So far behind that even every worker is barely enough: the safety net holds all three.
    assert report is not None and report.decision.mode is Mode.SAFETY_NET and report.decision.paid == 3
    assert report.started == ("paid-0", "paid-1", "paid-2")
    again = second.pacer.tick()  # type: ignore[union-attr]
    assert again is not None and again.decision.paid == 3 and again.started == ()
    assert running_slots(store, version) == {"paid-0": [1], "paid-1": [1], "paid-2": [1]}
    assert first.paid is not None and second.paid is not None
    assert first.paid.alive() == 3 and second.paid.alive() == 0
    assert [e.detail["slot"] for e in store.events(version, ["paid_launch"])] == ["paid-0", "paid-1", "paid-2"]
    # Counted as capacity only once the store has seen each one.
    wait_for(lambda: (second.pacer.tick() or again).paid_seen == 3,  # type: ignore[union-attr]
             what="the paid workers' first heartbeats")


def test_a_pacer_restarted_mid_run_doubles_nothing_and_stops_what_the_one_before_started(
        job_factory: Any, store: Store, tmp_path: Path, runners: list[LocalRunner]) -> None:
    version, _lease = behind(job_factory, store, workers=2)
    killed = runner_for(store, version, tmp_path, runners)
    assert killed.pacer.tick().started == ("paid-0", "paid-1")  # type: ignore[union-attr]
    assert killed.paid is not None
    orphans = [s.proc for s in killed.paid.slots.values()]
    wait_for(lambda: all(s.seen_at for s in store.paid_slots(version)), what="both paid workers up")
    # Its successor finds both running and starts neither again.
    successor = runner_for(store, version, tmp_path, runners)
    assert successor.pacer.tick().started == ()  # type: ignore[union-attr]
    assert running_slots(store, version) == {"paid-0": [1], "paid-1": [1]}
    # Given a far later deadline, the job is ahead: the successor stops the workers it did not start.
    later = runner_for(store, version, tmp_path, runners, deadline=parse_deadline("30d", "--deadline", None))
    report = later.pacer.tick()  # type: ignore[union-attr]
    assert report is not None and report.decision.paid == 0 and report.stopped == ("paid-0", "paid-1")
    for proc in orphans:
        assert proc is not None and proc.wait(timeout=60) == 75  # SIGTERM: finished in flight, lease given back
    assert all(not s.running for s in store.paid_slots(version))


def test_a_paid_worker_killed_outright_is_started_again_while_the_job_is_behind(
        job_factory: Any, store: Store, tmp_path: Path, runners: list[LocalRunner]) -> None:
    version, _lease = behind(job_factory, store, workers=1)
    runner = runner_for(store, version, tmp_path, runners)
    assert runner.pacer.tick().started == ("paid-0",)  # type: ignore[union-attr]
    assert runner.paid is not None
    victim = runner.paid.slots["paid-0"].proc
    assert victim is not None
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    report = runner.pacer.tick()  # type: ignore[union-attr]
    assert report is not None and report.started == ("paid-0",)
    starts = [s for s in store.paid_slots(version) if s.slot == "paid-0"]
    assert [(s.generation, s.running, s.stop_reason) for s in starts] == [
        (1, False, "its worker is gone"), (2, True, None)]


def test_a_job_on_time_or_done_buys_nothing(job_factory: Any, store: Store, tmp_path: Path,
                                            runners: list[LocalRunner]) -> None:
    spec = job_factory(n=60, shards={"size": 20, "lease_seconds": 10, "renew_seconds": 2}, deadline="1h",
                       fallback={"workers": 4, "restart_overhead_seconds": 1})
    _spec, version = planned(spec, store)
    lease = store.claim("spot-1", version)
    assert lease is not None
    put_done(store, lease, 20)
    runner = runner_for(store, version, tmp_path, runners)
    report = runner.pacer.tick()  # type: ignore[union-attr]
    assert report is not None and (report.decision.paid, report.decision.mode) == (0, Mode.ON_TIME)
    assert report.decision.reason == "on time"
    store.complete(lease)
    run_to_seal(store, version)
    assert runner.pacer.tick() is None  # type: ignore[union-attr]  # sealed: nothing to pace
    assert store.paid_slots(version) == [] and store.events(version, ["paid_launch"]) == []


def test_the_paid_budget_is_never_exceeded_and_the_job_is_said_to_be_at_risk(
        job_factory: Any, store: Store, tmp_path: Path, runners: list[LocalRunner]) -> None:
    # max_cost 3.6 at 3.6 an hour: one paid worker-hour in all.
    version, _lease = behind(job_factory, store, workers=2, max_cost=3.6)
    runner = runner_for(store, version, tmp_path, runners)
    assert runner.pacer.tick().started == ("paid-0", "paid-1")  # type: ignore[union-attr]
    wait_for(lambda: all(s.started_at for s in store.paid_slots(version)), what="both paid workers up")
    store.shift_clock(1800)  # 2 x 1800 s: every one of the 3,600 paid worker-seconds spent
    shifted = store.now()
    wait_for(lambda: all((s.seen_at or 0) >= shifted for s in store.paid_slots(version)),
             what="a heartbeat of each paid worker on the shifted clock")
    report = runner.pacer.tick()  # type: ignore[union-attr]
    assert report is not None and report.decision.mode is Mode.AT_RISK and report.decision.paid == 0
    assert report.decision.reason.startswith("at risk: paid budget spent (0 of the 2 paid workers wanted)")
    assert report.stopped == ("paid-0", "paid-1")
    assert runner.paid is not None
    for slot in runner.paid.slots.values():
        assert slot.proc is not None and slot.proc.wait(timeout=60) == 75
    # Past the cap only by what stopping takes: the decision left no paid worker running.
    assert all(not s.running for s in store.paid_slots(version))


@pytest.mark.postgres
def test_a_pacer_that_cannot_read_the_store_says_so_and_starts_nothing_new(
        job_factory: Any, tmp_path: Path, runners: list[LocalRunner]) -> None:
    # PostgreSQL only: the relay (a stand-in for the network) stands between the pacer and the server.
    from tests.fakes.tcp_relay import TcpRelay, free_port
    from tests.helpers import fresh_pg_database

    with fresh_pg_database("bl_pace") as store_url, contextlib.closing(open_store(store_url)) as store:
        _cut_off(job_factory, store, store_url, tmp_path, runners, TcpRelay, free_port())


def _cut_off(job_factory: Any, store: Store, store_url: str, tmp_path: Path, runners: list[LocalRunner],
             relay_class: Any, port: int) -> None:
    version, _lease = behind(job_factory, store, workers=2)
    relay = relay_class(port, ("127.0.0.1", 5432))
    relay.start()
    through = open_store(store_url.replace("127.0.0.1:5432", f"127.0.0.1:{port}"), create=False)
    through.reconnect_seconds = 0.5  # type: ignore[attr-defined]
    runner = runner_for(through, version, tmp_path, runners)
    said: list[str] = []
    ticks = {"n": 0}

    def stop(_seconds: float) -> bool:
        ticks["n"] += 1
        if ticks["n"] == 1:
            relay.close()  # the store goes away under the pacer
        if ticks["n"] == 3:
            relay.start()
        return ticks["n"] >= 5

    try:
        assert pace_until_done(runner.pacer, stop, said.append) == 0  # type: ignore[arg-type]
    finally:
        relay.close()
        through.close()
    cut = [line for line in said if "the store cannot be read now" in line]
    assert len(cut) == 1 and "starting nothing new; the workers go on" in cut[0]
    assert any("the store answers again" in line for line in said)
    assert len({s.slot for s in store.paid_slots(version)}) == 2  # nothing more was started meanwhile


def test_a_pacer_for_a_version_without_a_fallback_is_refused(job_factory: Any, store: Store) -> None:
    from batchline.errors import BatchlineError

    _spec, version = planned(job_factory(n=5, deadline="1h"), store)
    with pytest.raises(BatchlineError, match="has no fallback section: nothing to buy paid workers with"):
        Pacer(store, version, None)  # type: ignore[arg-type]
