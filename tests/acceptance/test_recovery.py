"""Recovery without waiting out the lease, and a tail that does not wait for its slowest worker.

Real `batchline run` and `batchline worker` processes on both stores: a whole run killed
and run again takes its dead workers' leases back at once (they are proven dead: same
host, their pids gone); a stopped worker is alive and keeps its lease; a take-back forced
on a live worker loses nothing; a slow worker's unstarted tail is split off to an idle one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from batchline.engines.synthetic import SLOWDOWN_ENV
from batchline.store import LeaseHolder, Store
from tests.helpers import (
    call_counts,
    check_invariants,
    planned,
    run_to_seal,
    start_worker,
    stop_all,
    stop_group,
    wait_for,
)

pytestmark = pytest.mark.acceptance


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def run_command(spec: Path, store_url: str, log_dir: Path, *extra: str) -> subprocess.Popen[bytes]:
    # A session of its own: killing the group is a lost machine (runner, workers, engine children).
    return subprocess.Popen([sys.executable, "-m", "batchline", "run", str(spec), "--store", store_url,
                             "--workers", "2", "--log-dir", str(log_dir), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def test_a_whole_run_killed_and_run_again_takes_the_dead_leases_back_at_once(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    calls = tmp_path / "calls.log"
    # The default lease: a rerun that waited for it would take ten minutes.
    spec_path = job_factory(n=800, options={"seconds_per_record": 0.01, "call_log": str(calls)},
                            shards={"size": 100, "lease_seconds": 600, "renew_seconds": 30})
    spec, version = planned(spec_path, store)
    first = run_command(spec_path, store_url, tmp_path / "logs1")
    wait_for(lambda: store.status(version).results >= 300, timeout=120, what="a run half done")
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    held = {h.shard_no for h in store.leases(version)}
    assert held, "the kill left no lease behind: nothing to recover"
    wait_for(lambda: all(gone(int(str(h.process["pid"]))) for h in store.leases(version) if h.process),
             what="the killed workers gone")
    stored = {r.record_id for r in store.iter_results(version)}
    in_flight = set(call_counts(calls)) - stored

    started = time.monotonic()
    again = run_command(spec_path, store_url, tmp_path / "logs2", "--publish")
    _out, err = again.communicate(timeout=300)
    rerun = time.monotonic() - started
    assert again.returncode == 0, err.decode()[-3000:]
    # Nowhere near the 600 s lease: the remaining 500 records at 10 ms on 2 workers, and start-up.
    assert rerun < 60, f"the rerun took {rerun:.0f}s"
    taken = store.events(version, ["take_back"])
    assert {e.shard_no for e in taken} == held
    assert all(e.detail["proof"]["kind"] == "same-host" for e in taken)
    assert not store.events(version, ["lease_expired"])
    results, dead = check_invariants(store, version, spec)
    assert not dead and len(results) == 800
    recomputed = {rid for rid, n in call_counts(calls).items() if n > 1}
    assert recomputed <= in_flight, f"recomputed records already stored: {sorted(recomputed - in_flight)[:5]}"
    assert store.resolve_name(spec.name) == version


def test_a_stopped_worker_is_alive_and_keeps_its_lease(job_factory: Any, store: Store, store_url: str,
                                                       tmp_path: Path) -> None:
    spec_path = job_factory(n=200, options={"seconds_per_record": 0.01},
                            shards={"size": 100, "lease_seconds": 600, "renew_seconds": 30})
    spec, version = planned(spec_path, store)
    stopped = start_worker(store_url, version, tmp_path / "stopped.log")
    procs = [stopped]
    try:
        wait_for(lambda: store.status(version).results >= 5, what="the first worker under way")
        group = stop_group(stopped.pid, store)
        held = {h.shard_no: (h.owner, h.epoch) for h in store.leases(version)}
        procs.append(start_worker(store_url, version, tmp_path / "other.log"))
        # The other worker does all it can (the ready shard, and the stopped one's
        # unstarted tail), then waits: the stopped worker is alive, so its lease stands.
        wait_for(lambda: store.status(version).shards["ready"] == 0 and not store.leases(version)[1:],
                 timeout=120, what="only the stopped worker's shard left")
        time.sleep(1.0)  # several of the other worker's claim rounds, each of which looks for the dead
        assert not store.events(version, ["take_back"])
        # Its lease stands, same owner and epoch. The other worker may hold a piece it split
        # off that lease's tail a moment ago: the wait above can end between two such pieces.
        now = {h.shard_no: (h.owner, h.epoch) for h in store.leases(version)}
        assert held and all(now.get(shard) == holder for shard, holder in held.items()), (held, now)
        assert all(owner != held_owner for shard, (owner, _e) in now.items() if shard not in held
                   for held_owner, _ in held.values())
        for pid in group:
            os.kill(pid, signal.SIGCONT)
        wait_for(lambda: store.job(version).state == "sealed", timeout=120,  # type: ignore[union-attr]
                 what="the job to seal")
    finally:
        stop_all(procs)
    check_invariants(store, version, spec)


def test_a_take_back_forced_on_a_live_worker_loses_nothing(job_factory: Any, store: Store, store_url: str,
                                                            tmp_path: Path) -> None:
    # As a pod cut off from the API server might be misjudged: its lease is taken back
    # while it works. Its later writes are refused; another worker does the shard.
    calls = tmp_path / "calls.log"
    spec_path = job_factory(n=300, options={"seconds_per_record": 0.01, "call_log": str(calls)},
                            shards={"size": 150})
    spec, version = planned(spec_path, store)
    live = start_worker(store_url, version, tmp_path / "live.log")
    procs = [live]
    try:
        holder: LeaseHolder = wait_for(lambda: next(iter(store.leases(version)), None), what="a lease")
        wait_for(lambda: store.status(version).results >= 5, what="the worker under way")
        assert store.take_back(version, holder, "test", {"kind": "misjudged", "note": "the owner is alive"})
        procs.append(start_worker(store_url, version, tmp_path / "other.log"))
        wait_for(lambda: store.job(version).state == "sealed", timeout=120,  # type: ignore[union-attr]
                 what="the job to seal")
    finally:
        stop_all(procs)
    results, dead = check_invariants(store, version, spec)
    assert len(results) == 300 and not dead
    refused = store.events(version, ["stale_epoch"])
    assert any(e.worker == holder.owner and e.epoch == holder.epoch for e in refused)


def test_an_idle_worker_splits_off_a_slow_workers_tail(job_factory: Any, store: Store, store_url: str,
                                                       tmp_path: Path) -> None:
    per_record, slowdown, records = 0.01, 6.0, 240
    spec_path = job_factory(n=records, options={"seconds_per_record": per_record},
                            shards={"size": records, "renew_seconds": 1, "batch_size": 4})
    spec, version = planned(spec_path, store)
    slow = start_worker(store_url, version, tmp_path / "slow.log", env={SLOWDOWN_ENV: str(slowdown)})
    procs = [slow]
    try:
        wait_for(lambda: store.status(version).results >= 8, what="the slow worker under way")
        left = records - store.status(version).results
        started = time.monotonic()
        procs.append(start_worker(store_url, version, tmp_path / "fast.log"))
        wait_for(lambda: store.job(version).state == "sealed", timeout=120,  # type: ignore[union-attr]
                 what="the job to seal")
        took = time.monotonic() - started
    finally:
        stop_all(procs)
    results, dead = check_invariants(store, version, spec)
    assert len(results) == records and not dead
    splits = store.events(version, ["split"])
    assert splits and all(e.detail["by"] != e.worker for e in splits)
    # Unsplit, the slow worker would answer everything that was left; split, the idle worker,
    # six times faster, takes most of it (counted, not timed: a loaded machine stretches time).
    fast_worker = procs[1].pid
    by_fast = sum(int(r.worker.split(":")[1]) == fast_worker for r in store.iter_results(version))
    assert by_fast >= left / 2, f"the idle worker answered {by_fast} of the {left} left ({took:.1f}s)"


def test_a_shard_re_leased_after_its_tail_was_split_computes_none_of_the_split_off_tail(
        job_factory: Any, store: Store, tmp_path: Path) -> None:
    calls = tmp_path / "calls.log"
    records = 160
    spec_path = job_factory(n=records, options={"call_log": str(calls)}, shards={"size": records})
    spec, version = planned(spec_path, store)
    # Its owner dies with its tail split off to a shard of its own, before writing anything.
    owner = store.claim("gone", version)
    assert owner is not None and (owner.first_piece, owner.end_piece) == (0, 16)
    assert store.split(version, "idle") == 1
    [holder] = store.leases(version)
    assert store.take_back(version, holder, "test", {"kind": "test", "note": "the owner died"})
    run_to_seal(store, version)
    results, dead = check_invariants(store, version, spec)
    assert len(results) == records and not dead
    counts = call_counts(calls)
    # The shard taken back holds pieces 0..7 now; the split-off pieces are computed by
    # the shard they were split into, and by nobody else.
    assert sum(counts.values()) == records and set(counts.values()) == {1}
