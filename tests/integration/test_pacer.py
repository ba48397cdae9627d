"""The pacer with real paid worker processes (the local runner's launcher) on both stores:
each paid slot started once however many pacers run (two processes ticking at once on
PostgreSQL), a pacer restarted doubles nothing and can stop what its predecessor started, a
paid worker killed while loading or hung is stopped and started again while the job is
behind, a start never seen is not "already there" forever, a job on time or done buys
nothing, the paid workers hold the budget with no pacer running, and a store the pacer
cannot read makes it start nothing new."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from batchline.launch.pacer import Pacer, pace_until_done
from batchline.ops.runner import LocalRunner
from batchline.sizing.pacing import Mode
from batchline.spec.deadline import parse_deadline
from batchline.store import Lease, ResultRow, Store, open_store
from batchline.worker.heartbeat import HEARTBEAT_SECONDS
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
    # The spot worker heartbeats (on the shifted clock): it counts as capacity.
    store.worker_beat(version, "spot-1", every=60.0)
    return version, lease


def spot_at_work(store: Store, version: str) -> None:
    """The spot worker as a working one is seen: holding a lease (its first went to a paid
    worker once the shifted clock expired it) and heartbeating. A heartbeat alone is no
    capacity past a worker's time to load (store.live_capacity)."""
    assert store.claim("spot-1", version) is not None
    store.worker_beat(version, "spot-1", every=60.0)


def running_slots(store: Store, version: str) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for s in store.paid_slots(version):
        out.setdefault(s.slot, []).append(s.generation)
    return out


def test_a_second_pacer_finds_each_paid_slot_already_there(
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


class _Recording:
    """A launcher that starts no process: what two racing pacers do is the store's to decide."""

    stop_seconds = 0.0

    def start(self, version: str, slot: str, generation: int) -> None:
        pass

    def stop(self, version: str, start: Any, *, outright: bool = False) -> None:
        pass

    def gone(self, version: str, start: Any) -> bool:
        return False


def _race(url: str, version: str, rounds: int, barrier: Any, started: Any) -> None:
    """One pacer process: ticks once a round, all pacers at the same moment."""
    with contextlib.closing(open_store(url, create=False)) as store:
        pacer = Pacer(store, version, _Recording(), by=f"pacer-{id(barrier)}")
        for _ in range(rounds):
            barrier.wait(timeout=60)
            report = pacer.tick()
            started.put(report.started if report is not None else ())
            barrier.wait(timeout=60)  # the round ends
            barrier.wait(timeout=60)  # the starts have been ended for the next one


@pytest.mark.postgres
def test_two_pacers_ticking_at_the_same_moment_from_two_processes_never_start_one_slot_twice(
        job_factory: Any) -> None:
    import multiprocessing

    from tests.helpers import fresh_pg_database

    rounds = 25
    with fresh_pg_database("bl_race") as url, contextlib.closing(open_store(url)) as store:
        version, _lease = behind(job_factory, store, workers=3)
        ctx = multiprocessing.get_context("spawn")
        barrier, started = ctx.Barrier(3), ctx.Queue()
        pacers = [ctx.Process(target=_race, args=(url, version, rounds, barrier, started)) for _ in range(2)]
        for p in pacers:
            p.start()
        try:
            for n in range(rounds):
                barrier.wait(timeout=120)  # both tick now
                barrier.wait(timeout=120)
                both = [started.get(timeout=60), started.get(timeout=60)]
                # Each slot started exactly once this round, by one pacer or the other.
                assert sorted(slot for made in both for slot in made) == ["paid-0", "paid-1", "paid-2"], (n, both)
                live: dict[str, int] = {}
                for s in store.paid_slots(version):
                    live[s.slot] = live.get(s.slot, 0) + s.running
                assert live == {"paid-0": 1, "paid-1": 1, "paid-2": 1}, (n, live)
                for s in store.paid_slots(version):
                    if s.running:
                        store.paid_stop(version, s.slot, s.generation, "the next round")
                barrier.wait(timeout=120)
        finally:
            for p in pacers:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
        assert [p.exitcode for p in pacers] == [0, 0]
        assert len(store.paid_slots(version)) == 3 * rounds


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
    spot_at_work(store, version)
    report = later.pacer.tick()  # type: ignore[union-attr]
    assert report is not None and report.decision.paid == 0 and report.stopped == ("paid-0", "paid-1")
    for proc in orphans:
        assert proc is not None and proc.wait(timeout=60) == 75  # SIGTERM: finished in flight, lease given back
    assert all(not s.running for s in store.paid_slots(version))


def test_a_paid_worker_killed_while_loading_is_started_again_while_the_job_is_behind(
        job_factory: Any, store: Store, tmp_path: Path, runners: list[LocalRunner]) -> None:
    version, _lease = behind(job_factory, store, workers=1)
    runner = runner_for(store, version, tmp_path, runners)
    assert runner.pacer.tick().started == ("paid-0",)  # type: ignore[union-attr]
    assert runner.paid is not None
    victim = runner.paid.slots["paid-0"].proc
    assert victim is not None
    victim.send_signal(signal.SIGKILL)  # before its interpreter has even loaded batchline
    victim.wait()
    [killed] = store.paid_slots(version)
    assert killed.seen_at is None and killed.started_at is None  # it never came up: it cost nothing
    report = runner.pacer.tick()  # type: ignore[union-attr]
    assert report is not None and report.started == ("paid-0",)
    starts = [s for s in store.paid_slots(version) if s.slot == "paid-0"]
    assert [(s.generation, s.running, s.stop_reason) for s in starts] == [
        (1, False, "its worker is gone"), (2, True, None)]


def stop_between_writes(proc: Any, store: Store) -> None:
    """SIGSTOP, at a moment the process holds no write of the store: on SQLite a process stopped
    inside its heartbeat's transaction would hold the database's one write lock for good (and
    every later write would wait out the busy timeout and fail). PostgreSQL locks rows only."""
    import sqlite3

    path = getattr(store, "path", None)  # a SQLite store's file
    if path is None:
        proc.send_signal(signal.SIGSTOP)
        return
    for _ in range(100):
        proc.send_signal(signal.SIGSTOP)
        probe = sqlite3.connect(str(path), timeout=0.5, isolation_level=None)
        try:
            probe.execute("BEGIN IMMEDIATE")
            probe.execute("ROLLBACK")
            return
        except sqlite3.OperationalError:
            proc.send_signal(signal.SIGCONT)
            time.sleep(0.02)
        finally:
            probe.close()
    raise AssertionError("the worker held the store's write lock each time it was stopped")


def test_a_hung_paid_worker_is_stopped_outright_and_started_again(
        job_factory: Any, store: Store, tmp_path: Path, runners: list[LocalRunner]) -> None:
    version, _lease = behind(job_factory, store, workers=1)
    runner = runner_for(store, version, tmp_path, runners)
    assert runner.pacer.tick().started == ("paid-0",)  # type: ignore[union-attr]
    wait_for(lambda: store.paid_slots(version)[0].seen_at, what="the paid worker up")
    assert runner.paid is not None
    hung = runner.paid.slots["paid-0"].proc
    assert hung is not None
    stop_between_writes(hung, store)  # alive, and silent: a SIGTERM would wait for it forever
    store.shift_clock(61)
    store.worker_beat(version, "spot-1", every=60.0)
    report = runner.pacer.tick()  # type: ignore[union-attr]
    assert hung.wait(timeout=30) == -signal.SIGKILL  # stopped where it runs, not only forgotten
    assert report is not None and report.started == ("paid-0",)
    first, second = store.paid_slots(version)
    assert (first.generation, first.running) == (1, False)
    assert first.stop_reason == "its worker was not heard from for 60 s"
    assert (second.generation, second.running) == (2, True)


def test_regression_a_start_whose_worker_never_came_up_was_already_there_forever(
        job_factory: Any, store: Store, tmp_path: Path, runners: list[LocalRunner]) -> None:
    # A runner killed between its launch and the worker's first heartbeat: the store has the
    # start, and no process will ever say it is up.
    version, _lease = behind(job_factory, store, workers=1)
    assert store.paid_launch(version, "paid-0", "killed-runner", 3.6, stale_seconds=60, launch_timeout=3) == 1
    runner = runner_for(store, version, tmp_path, runners)
    report = runner.pacer.tick()  # type: ignore[union-attr]
    # Within the launch timeout (three restart overheads of 1 s) it is capacity ordered.
    assert report is not None and report.started == () and report.paid_not_admitted == 1
    store.shift_clock(4)
    store.worker_beat(version, "spot-1", every=60.0)
    again = runner_for(store, version, tmp_path, runners)  # run again: started once, not stuck
    report = again.pacer.tick()  # type: ignore[union-attr]
    assert report is not None and report.started == ("paid-0",)
    assert runner.pacer.tick().started == ()  # type: ignore[union-attr]
    starts = store.paid_slots(version)
    assert [(s.generation, s.running) for s in starts] == [(1, False), (2, True)]
    assert starts[0].stop_reason == "its worker was not seen within 3 s of its launch"


def test_every_spot_worker_gone_while_ahead_keeps_the_paid_workers(
        job_factory: Any, store: Store, tmp_path: Path, runners: list[LocalRunner]) -> None:
    version, _lease = behind(job_factory, store, workers=2)
    runner = runner_for(store, version, tmp_path, runners)
    assert runner.pacer.tick().started == ("paid-0", "paid-1")  # type: ignore[union-attr]
    wait_for(lambda: all(s.seen_at for s in store.paid_slots(version)), what="both paid workers up")
    # The spot worker leaves, and a far later deadline puts the job well ahead of its line.
    store.worker_gone(version, "spot-1")
    later = runner_for(store, version, tmp_path, runners, deadline=parse_deadline("2h", "--deadline", None))
    report = later.pacer.tick()  # type: ignore[union-attr]
    assert report is not None and report.spot_workers == 0
    assert report.decision.mode is Mode.HOLDING and report.decision.paid >= 1 and "paid-0" not in report.stopped


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


def test_the_paid_workers_hold_the_budget_with_no_pacer_running(
        job_factory: Any, store: Store, tmp_path: Path, runners: list[LocalRunner]) -> None:
    # max_cost 3.6 at 3.6 an hour: one paid worker-hour in all, held by the workers themselves.
    version, _lease = behind(job_factory, store, workers=2, max_cost=3.6)
    runner = runner_for(store, version, tmp_path, runners)
    assert runner.pacer.tick().started == ("paid-0", "paid-1")  # type: ignore[union-attr]
    wait_for(lambda: all(s.started_at for s in store.paid_slots(version)), what="both paid workers up")
    # The pacer is gone from here on (it never ticks again). 2 x 1,790 s: 20 paid worker-seconds
    # are left, which two workers spend in 10 s.
    store.shift_clock(1790)
    assert runner.paid is not None
    for slot in runner.paid.slots.values():
        assert slot.proc is not None and slot.proc.wait(timeout=90) == 75  # finished in flight, lease given back
    starts = store.paid_slots(version)
    assert all(not s.running for s in starts)
    assert all(s.stop_reason is not None and "paid budget would be passed" in s.stop_reason for s in starts)
    # Past the cap by at most what the paid workers cost between two heartbeats.
    bound = 3.6 + 2 * 3.6 * HEARTBEAT_SECONDS / 3600.0
    spent, _per_hour = store.paid_budget(version)
    assert spent <= bound, spent
    # A start made after that (a pacer that thinks otherwise) spends at most what is left and
    # stops itself on the same rule: the bound still holds.
    assert store.paid_launch(version, "paid-0", "pacer", 3.6, stale_seconds=60, launch_timeout=60) == 2
    late = subprocess.run([sys.executable, "-m", "batchline", "worker", "--job", version, "--paid-slot", "paid-0/2",
                           "--store", store.url], capture_output=True, text=True, timeout=120)
    assert late.returncode in (0, 75) and "paid budget would be passed" in late.stderr, late.stderr[-2000:]
    assert store.paid_slots(version)[-1].stopped_at is not None
    assert store.paid_budget(version)[0] <= bound


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
    assert len(cut) == 1 and "starting nothing new" in cut[0]
    assert any("the store answers again" in line for line in said)
    assert len(store.paid_slots(version)) == 2  # no start was made meanwhile, of any slot


def test_a_pacer_for_a_version_without_a_fallback_is_refused(job_factory: Any, store: Store) -> None:
    from batchline.errors import BatchlineError

    _spec, version = planned(job_factory(n=5, deadline="1h"), store)
    with pytest.raises(BatchlineError, match="has no fallback section: nothing to buy paid workers with"):
        Pacer(store, version, None)  # type: ignore[arg-type]


@pytest.mark.postgres
def test_a_store_outage_longer_than_a_lease_stops_the_paid_workers_and_loses_nothing(
        job_factory: Any, tmp_path: Path) -> None:
    # PostgreSQL only: the relay (a stand-in for the network) stands between the run (its runner
    # and every worker it starts) and the server.
    import io
    import threading

    from batchline.sizing.paced import Trace
    from batchline.spec import load_spec
    from tests.fakes.tcp_relay import TcpRelay, free_port
    from tests.helpers import check_invariants, fresh_pg_database

    with fresh_pg_database("bl_outage") as url, contextlib.closing(open_store(url)) as store:
        spec = job_factory(n=600, options={"seconds_per_record": 0.05},
                           shards={"size": 50, "lease_seconds": 6, "renew_seconds": 1, "batch_size": 4},
                           deadline="10m", fallback={"workers": 2, "cost_per_worker_hour": 3.6,
                                                     "restart_overhead_seconds": 1})
        _spec, version = planned(spec, store)
        relay = TcpRelay(free_port(), ("127.0.0.1", 5432))
        relay.start()
        through = open_store(url.replace("127.0.0.1:5432", f"127.0.0.1:{relay.port}"), create=False)
        out = io.StringIO()
        # No spot worker at all: the paid workers do the work.
        runner = LocalRunner(through, version, 1, log_dir=tmp_path / "logs", out=out, spot_trace=Trace(((0.0, 0),)),
                             tick_seconds=1.0)
        ran: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: ran.update(summary=runner.run()), daemon=True)
        thread.start()
        try:
            wait_for(lambda: len([s for s in store.paid_slots(version) if s.seen_at]) == 2, what="paid workers up")
            wait_for(lambda: store.status(version).results > 0, what="the paid workers' first results")
            relay.close()  # the store goes away under the run
            assert runner.paid is not None
            wait_for(lambda: runner.paid.alive() == 0, timeout=120,  # type: ignore[union-attr]
                     what="the paid workers stopped once a lease went by without the store")
            relay.start()
            thread.join(timeout=300)
            assert not thread.is_alive(), out.getvalue()[-3000:]
        finally:
            relay.close()
            through.close()
        said = out.getvalue()
        assert said.count("the store cannot be read now") == 1, said[-3000:]
        assert "the store answers again" in said
        assert ran["summary"].exit_code == 0 and ran["summary"].status.state == "sealed"
        results, dead = check_invariants(store, version, load_spec(spec))
        assert len(results) == 600 and dead == set()
        # The first starts ended during the outage; the job went on with new ones once it answered.
        assert max(s.generation for s in store.paid_slots(version)) >= 2


def test_the_pacer_takes_back_the_lease_of_a_worker_whose_pod_the_api_server_says_is_gone(
        job_factory: Any, store: Store) -> None:
    """On Kubernetes the workers hold no token: the pacer proves a lease owner's pod gone (the API
    server stands in here as a lookup: no cluster runs in the tests) and takes its lease back."""
    from batchline.worker.liveness import take_back_dead

    version, _lease = behind(job_factory, store)
    pods = {("jobs", "batchline-w-0"): "uid-0"}
    gone = store.claim("spot-2", version, process={"pod": "batchline-w-1", "namespace": "jobs", "pod_uid": "uid-1"})
    alive = store.claim("spot-3", version, process={"pod": "batchline-w-0", "namespace": "jobs", "pod_uid": "uid-0"})
    assert gone is not None and alive is not None
    said: list[str] = []
    pacer = Pacer(store, version, _Recording(), log=said.append,
                  take_back=lambda: take_back_dead(store, version, "k8s-pacer",
                                                   lookup=lambda ns, pod: pods.get((ns, pod))))
    pacer.tick()
    owners = {r.shard_no: r.owner for r in store.shard_rows(version)}
    assert owners[gone.shard_no] is None and owners[alive.shard_no] == "spot-3"
    [taken] = store.events(version, ["take_back"])
    assert (taken.shard_no, taken.worker, taken.detail["by"]) == (gone.shard_no, "spot-2", "k8s-pacer")
    assert "took back 1 lease of workers proven dead" in said
