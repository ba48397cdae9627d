"""Real `batchline worker` processes, hurt the way preemptible capacity hurts them.

Every test waits on the store's state (and shifts the database clock instead of
sleeping past a lease), then checks from the store that each record has exactly
one outcome (I1), that poison cost only itself (I4), that the fault really
happened (the event log shows it), and that the engine was asked again only for
records that were in flight when the fault struck.
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

from batchline.ops.drill.run import children, gone
from batchline.store import Store
from tests.helpers import (
    call_counts,
    check_invariants,
    planned,
    rescue_stalled_shard,
    sealed_and_gone,
    start_worker,
    stop_all,
    stop_group,
    wait_for,
    workers_until_done,
)

pytestmark = pytest.mark.acceptance

N = 2000
SHARD = 100


def owner_pid(owner: str) -> int:
    return int(owner.split(":")[1])


def partly_done_shard(store: Store, version: str) -> Any:
    for row in store.shard_rows(version):
        if row.state == "leased" and 0 < row.results < row.record_count - 20:
            return row
    return None


def stored_ids(store: Store, version: str) -> set[str]:
    return {r.record_id for r in store.iter_results(version)}


def sealed(store: Store, version: str) -> bool:
    job = store.job(version)
    return job is not None and job.state == "sealed"


@pytest.fixture
def slow_job(job_factory: Any, tmp_path: Path) -> tuple[Path, Path]:
    call_log = tmp_path / "calls.log"
    spec = job_factory(n=N, options={"seconds_per_record": 0.004, "call_log": str(call_log)},
                       shards={"size": SHARD, "lease_seconds": 60})
    return spec, call_log


def test_kill_9_mid_shard_loses_nothing_and_recomputes_only_what_was_in_flight(
        slow_job: tuple[Path, Path], store: Store, store_url: str, tmp_path: Path) -> None:
    spec_path, call_log = slow_job
    spec, version = planned(spec_path, store)
    procs = [start_worker(store_url, version, tmp_path / f"w{i}.log") for i in range(2)]
    try:
        victim_row = wait_for(lambda: partly_done_shard(store, version), what="a shard partly done")
        victim = owner_pid(victim_row.owner)
        engine_children = children(victim)
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: gone(victim) and all(gone(c) for c in engine_children), what="victim gone")
        asked_before = set(call_counts(call_log))
        stored_at_kill = stored_ids(store, version)
        in_flight = asked_before - stored_at_kill
        # No clock shift: the survivor proves the victim dead (same host, its pid gone)
        # and takes its lease back instead of waiting for it to run out.
        procs.append(start_worker(store_url, version, tmp_path / "w-replacement.log"))
        wait_for(lambda: sealed(store, version), timeout=120, what="the job to seal")
    finally:
        stop_all(procs)
    results, dead = check_invariants(store, version, spec)
    assert dead == set()
    [taken] = store.events(version, ["take_back"])
    assert (taken.shard_no, taken.worker, taken.detail["proof"]["kind"]) == (
        victim_row.shard_no, victim_row.owner, "same-host")
    assert taken.detail["proof"]["pid"] == victim and not store.events(version, ["lease_expired"])
    assert max(r.epoch for r in store.shard_rows(version)) >= 2
    counts = call_counts(call_log)
    asked_again = {rid for rid, n in counts.items() if n > 1}
    assert asked_again <= in_flight, f"recomputed records that were already stored: {asked_again - in_flight}"
    assert len(in_flight) <= SHARD
    assert set(counts) == results


def test_sigstop_past_the_lease_then_sigcont_is_fenced_off(
        slow_job: tuple[Path, Path], store: Store, store_url: str, tmp_path: Path) -> None:
    spec_path, call_log = slow_job
    spec, version = planned(spec_path, store)
    stalled = start_worker(store_url, version, tmp_path / "stalled.log")
    procs = [stalled]
    try:
        row = wait_for(lambda: partly_done_shard(store, version), what="a shard partly done")
        group = stop_group(stalled.pid, store)
        stored_at_stop = stored_ids(store, version)
        asked_at_stop = set(call_counts(call_log))
        rescue_stalled_shard(store, store_url, version, row.shard_no, procs, tmp_path / "rescuer.log")
        for pid in group:
            os.kill(pid, signal.SIGCONT)
        sealed_and_gone(store, version, stalled)
    finally:
        stop_all(procs)
    _results, dead = check_invariants(store, version, spec)
    assert dead == set()
    refused = [e for e in store.events(version, ["stale_epoch"]) if e.worker == row.owner]
    assert refused, "the stalled worker's late write or renewal was not refused"
    assert refused[0].epoch == row.epoch
    assert store.shard_rows(version)[row.shard_no].epoch >= 2
    # Whatever the stalled worker computed after waking was written by nobody twice.
    in_flight = asked_at_stop - stored_at_stop
    counts = call_counts(call_log)
    asked_again = {rid for rid, n in counts.items() if n > 1}
    assert asked_again <= in_flight | (set(counts) - asked_at_stop)
    assert all(n <= 2 for n in counts.values())
    mine = [r for r in store.iter_results(version) if r.worker == row.owner and r.shard_no == row.shard_no]
    assert all(r.epoch == row.epoch for r in mine)


def test_sigterm_finishes_in_flight_records_gives_the_lease_back_and_exits_75(
        slow_job: tuple[Path, Path], store: Store, store_url: str, tmp_path: Path) -> None:
    spec_path, call_log = slow_job
    spec, version = planned(spec_path, store)
    procs = [start_worker(store_url, version, tmp_path / f"w{i}.log") for i in range(2)]
    try:
        row = wait_for(lambda: partly_done_shard(store, version), what="a shard partly done")
        victim = next(p for p in procs if p.pid == owner_pid(row.owner))
        victim.send_signal(signal.SIGTERM)
        assert victim.wait(timeout=30) == 75
        releases = [e for e in store.events(version, ["release"]) if e.worker == row.owner]
        assert [(e.shard_no, e.detail["reason"]) for e in releases] == [(row.shard_no, "stop")]
        # The shard is ready at once, not after its lease: no clock shift needed.
        wait_for(lambda: sealed(store, version), timeout=120, what="the job to seal")
    finally:
        stop_all(procs)
    _results, dead = check_invariants(store, version, spec)
    assert dead == set()
    assert not store.events(version, ["lease_expired"])
    counts = call_counts(call_log)
    assert {rid for rid, n in counts.items() if n > 1} == set(), "in-flight work was lost on SIGTERM"


def test_sigterm_takes_back_what_the_engine_has_not_started_and_keeps_all_it_finished(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    # Regression: with Gemma (8 records a batch, two batches in flight, a few seconds each)
    # a stop waited out the grace on records the engine had not even started, then lost
    # them with the child: SIGINT took 20.8 s and kept 3 of 18.
    calls = tmp_path / "calls.log"
    spec_path = job_factory(n=200, options={"seconds_per_record": 0.4, "call_log": str(calls)},
                            shards={"size": 200, "batch_size": 8, "grace_seconds": 10})
    _spec, version = planned(spec_path, store)
    worker = start_worker(store_url, version, tmp_path / "w.log")
    try:
        wait_for(lambda: store.status(version).results >= 3, what="the worker under way")
        signalled = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=30) == 75
        took = time.monotonic() - signalled
    finally:
        stop_all([worker])
    # The grace went on the record being decoded (0.4 s), not on the 16 handed over: waiting
    # for those alone would take 6.4 s (the bound leaves room for a loaded machine's exit).
    assert took < 16 * 0.4, f"the stop took {took:.1f}s"
    asked = set(call_counts(calls))
    stored = stored_ids(store, version)
    # Everything the engine started was finished within the grace and stored: nothing was
    # lost with the child but at most the one record it was decoding.
    assert len(asked - stored) <= 1, sorted(asked - stored)
    assert len(stored) < 16 + 3  # the records handed over but not started went back, unanswered
    assert not store.events(version, ["attempt_failed"])
    assert [e.detail["reason"] for e in store.events(version, ["release"])] == ["stop"]


def test_a_worker_with_no_work_left_exits_0(job_factory: Any, store: Store, store_url: str) -> None:
    _spec, version = planned(job_factory(n=30), store)
    first = start_worker(store_url, version)
    assert first.wait(timeout=60) == 0
    assert sealed(store, version)
    second = start_worker(store_url, version)
    assert second.wait(timeout=60) == 0


def test_a_worker_given_a_version_the_store_does_not_have_exits_66_not_0(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    log = tmp_path / "w.log"
    typo = start_worker(store_url, "test-job@0123456789ab", log)
    assert typo.wait(timeout=60) == 66
    lines = log.read_text().strip().splitlines()
    assert lines[-1] == f"batchline: error: no job version 'test-job@0123456789ab' in {store.where()}"
    # A version that exists and will never have work again is still "no work left".
    _spec, version = planned(job_factory(n=10), store)
    assert store.cancel(version, "test", None)
    assert start_worker(store_url, version).wait(timeout=60) == 0


POISON = {
    "crash_on": ["r000007", "r000333"],
    "error_on": ["r000050", "r000051"],
    "hang_on": ["r000120"],
    "invalid_on": ["r000260", "r000399"],
}
KIND = {"crash_on": "crash", "error_on": "engine_error", "hang_on": "hang", "invalid_on": "invalid_output"}


def test_poison_records_cost_only_themselves(job_factory: Any, store: Store, store_url: str,
                                             tmp_path: Path) -> None:
    call_log = tmp_path / "calls.log"
    spec_path = job_factory(n=400, options={**POISON, "call_log": str(call_log)},
                            shards={"size": 100, "record_timeout_seconds": 0.5, "batch_timeout_seconds": 0.5})
    spec, version = planned(spec_path, store)
    workers_until_done(store_url, version, tmp_path, timeout=180)
    results, _dead = check_invariants(store, version, spec)
    expected = {rid: KIND[k] for k, ids in POISON.items() for rid in ids}
    letters = {d.record_id: d for d in store.iter_dead_letters(version)}
    assert {rid: d.kind for rid, d in letters.items()} == expected
    assert all(d.attempts == 3 for d in letters.values())
    assert "alone in flight" in letters["r000007"].error
    # Batch-mates were never charged: the only attempts on record are the poison's.
    charged = {e.detail["record_id"] for e in store.events(version, ["attempt_failed"])}
    assert charged == set(expected)
    assert store.events(version, ["engine_crash"]) and store.events(version, ["engine_hang"])
    assert len(results) == 400 - len(expected)


def test_a_record_over_the_cap_only_the_exact_count_catches_is_dead_lettered_uncharged(
        job_factory: Any, store: Store, store_url: str) -> None:
    records = [{"id": f"x{i}", "text": "short text", "acl": None} for i in range(20)]
    # 60 characters is 15 synthetic tokens, over a cap of 10, yet far under the
    # planner's bound of 10 tokens * 32 bytes.
    records[5]["text"] = "y" * 60
    records[6]["text"] = "z" * 400  # surely over: the planner catches this one
    spec, version = planned(job_factory(records, input_extra={"max_input_tokens": 10}), store)
    assert start_worker(store_url, version).wait(timeout=60) == 0
    check_invariants(store, version, spec)
    letters = {d.record_id: d for d in store.iter_dead_letters(version)}
    assert set(letters) == {"x5", "x6"}
    assert letters["x5"].kind == letters["x6"].kind == "too_long"
    assert "15 input tokens" in letters["x5"].error
    assert "surely over" in letters["x6"].error
    assert letters["x5"].attempts == 0 and not store.events(version, ["attempt_failed"])


def test_an_input_changed_after_planning_is_refused_by_the_worker(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    spec_path = job_factory(n=100)
    spec, version = planned(spec_path, store)
    path = Path(spec.input.locations[0])
    data = path.read_bytes()
    path.write_bytes(data.replace(b"record number 3 ", b"record number X "))
    log = tmp_path / "w.log"
    proc = start_worker(store_url, version, log)
    code = proc.wait(timeout=60)
    assert code == 3
    assert "input changed since planning" in log.read_text()
    assert not list(store.iter_results(version))
    assert store.events(version, ["input_changed"])
    assert store.shard_rows(version)[0].state == "ready"


def test_an_engine_that_cannot_load_stops_the_worker_and_keeps_no_shard(
        job_factory: Any, store: Store, store_url: str) -> None:
    _spec, version = planned(job_factory(n=10, options={"fail_load": True}), store)
    proc = subprocess.run([sys.executable, "-m", "batchline", "worker", "--store", store_url],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 5
    assert "fail_load" in proc.stderr
    assert all(r.state == "ready" and r.owner is None and r.epoch == 0 for r in store.shard_rows(version))
    assert not store.events(version, ["claim"])
    [fatal] = store.events(version, ["engine_fatal"])
    assert "fail_load" in fatal.detail["error"]


def test_sigterm_while_the_model_loads_stops_at_once_without_taking_a_shard(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    _spec, version = planned(job_factory(n=20, options={"load_seconds": 60}), store)
    log = tmp_path / "w.log"
    proc = start_worker(store_url, version, log)
    wait_for(lambda: "load" in log.read_text() or children(proc.pid), what="the engine child to start")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 75
    assert not store.events(version, ["claim"])


@pytest.mark.parametrize("temperature,calls", [(0.0, 1), (0.7, 3)])
def test_an_output_cut_off_at_max_tokens_costs_one_engine_call_at_temperature_zero(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path, temperature: float, calls: int) -> None:
    # Regression: a Gemma summary that repeated "0" until max_tokens was computed three
    # times at temperature 0, and came out the same each time.
    call_log = tmp_path / "calls.log"
    spec_path = job_factory(n=20, options={"truncate_on": ["r000003"], "invalid_on": ["r000005"],
                                           "call_log": str(call_log)},
                            shards={"size": 20}, decoding={"temperature": temperature, "max_tokens": 50})
    spec, version = planned(spec_path, store)
    workers_until_done(store_url, version, tmp_path, timeout=120)
    check_invariants(store, version, spec)
    letters = {d.record_id: d for d in store.iter_dead_letters(version)}
    assert {rid: (d.kind, d.attempts) for rid, d in letters.items()} == {
        "r000003": ("truncated" if calls == 1 else "invalid_output", calls), "r000005": ("invalid_output", 3)}
    counts = call_counts(call_log)
    assert (counts["r000003"], counts["r000005"]) == (calls, 3)
    if calls == 1:
        assert "retrying would write it again" in letters["r000003"].error
