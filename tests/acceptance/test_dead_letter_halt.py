"""Failing fast: a job whose dead letters pass `shards.abort_dead_letter_rate` early is halted
for every worker, with real worker processes, instead of running to its end; the halted
version is then cancelled, or resumed under a changed bound and run to its end."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from batchline.engines.synthetic import SLOWDOWN_ENV
from batchline.store import Halt, Store
from tests.helpers import make_records, planned, start_worker, stop_all, wait_for

pytestmark = pytest.mark.acceptance

RECORDS = 400
BOUND = {"abort_dead_letter_rate": 0.5, "abort_min_outcomes": 40}


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "batchline", *args], capture_output=True, text=True, timeout=300)


def poisoned(job_factory: Any, n: int = RECORDS, **shards: Any) -> Path:
    """Every record dead: three in four cut off at max_tokens (dead at their first attempt),
    the rest with invalid output (dead at their third)."""
    rows = make_records(n)
    return job_factory(rows, options={
        "seconds_per_record": 0.02,
        "truncate_on": [r["id"] for i, r in enumerate(rows) if i % 4],
        "invalid_on": [r["id"] for i, r in enumerate(rows) if not i % 4],
    }, shards={**BOUND, **shards})


HALT_LINE = re.compile(r"(?P<version>test-job@\w+) is halted: (?P<dead>[\d,]+) of the (?P<outcomes>[\d,]+) "
                       r"outcomes it computed are dead letters \([\d.]+%, over shards.abort_dead_letter_rate 0.5 "
                       r"after 40 outcomes\), most of them truncated \([\d,]+; e.g. record r\d{6}\); see ")


def computed(store: Store, version: str) -> int:
    st = store.status(version)
    return st.results + st.dead_letters


def test_a_job_whose_dead_letters_pass_the_bound_early_halts_instead_of_running_to_the_end(
        job_factory: Any, store: Store, store_url: str) -> None:
    spec = poisoned(job_factory)
    done = cli("run", str(spec), "--workers", "2", "--store", store_url)
    assert done.returncode == 7, done.stderr
    last = done.stderr.splitlines()[-1]
    assert last.startswith("batchline: error: worker "), last
    found = HALT_LINE.search(last)
    assert found is not None, last
    version = found["version"]
    halt = store.halt_of(version)
    assert halt is not None and halt.kind == "truncated" and halt.example.startswith("r")
    example = next(d for d in store.iter_dead_letters(version) if d.record_id == halt.example)
    assert example.kind == "truncated"
    # Halted after about the minimum, not after the 400 records it would have run to.
    assert 40 <= halt.outcomes <= 160, halt
    st = store.status(version)
    assert st.state == "halted" and st.pending > RECORDS // 2 and st.shards["leased"] == 0
    shown = cli("status", version, "--store", store_url)
    assert shown.stdout.startswith(f"{version} (halted)") and halt.message(version) in shown.stdout
    as_json = json.loads(cli("status", version, "--json", "--store", store_url).stdout)
    assert as_json["state"] == "halted" and Halt.from_json(as_json["halt"]) == halt
    assert f"{version}  halted" in cli("status", "--store", store_url).stdout
    watched = cli("status", version, "--watch", "--interval", "0.1", "--store", store_url)
    assert (watched.returncode, watched.stderr) == (7, f"batchline: error: {halt.message(version)}\n")


def test_a_version_whose_dead_letters_pass_its_bound_is_halted_for_every_worker(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    _spec, version = planned(poisoned(job_factory), store)
    logs = [tmp_path / f"worker-{i}.log" for i in range(2)]
    # One worker ten times slower, so both are at work when the other passes the bound: the
    # slow one, mid-shard, must learn of the halt from the store.
    slow = start_worker(store_url, version, log=logs[0], env={SLOWDOWN_ENV: "10"})
    wait_for(lambda: store.events(version, ["claim"]), what="the slow worker's claim")
    fast = start_worker(store_url, version, log=logs[1])
    workers = [slow, fast]
    try:
        codes = [w.wait(timeout=120) for w in workers]
    finally:
        stop_all(workers)
    assert codes == [7, 7]
    [halt_event] = store.events(version, ["halt"])
    halt = Halt.from_json(halt_event.detail)
    # Usually the fast one passes the bound; on a loaded machine it may be the slow one.
    # Either way the other learns of the halt from the store, mid-shard.
    assert halt.by is not None
    [halter] = [i for i, w in enumerate(workers) if f":{w.pid}:" in halt.by]
    for log in logs:
        assert log.read_text().splitlines()[-1] == f"batchline: error: {halt.message(version)}"
    assert "stopping as on a preemption notice" in logs[1 - halter].read_text()
    # Claims stop at the halt; the shards held then were given back, not left to expire.
    assert all(e.id < halt_event.id for e in store.events(version, ["claim"]))
    released = [e for e in store.events(version, ["release"]) if e.detail.get("reason") == "halted"]
    assert released and store.leases(version) == []
    # What was in flight when the version halted is refused by the store (a halted version takes
    # no outcome) and given back uncharged (I5): no write refused as a lost lease, and only the
    # poisoned records were charged an attempt.
    assert store.events(version, ["stale_epoch"]) == []
    charged = {e.detail["record_id"] for e in store.events(version, ["attempt_failed"])}
    invalid = {f"r{i:06d}" for i in range(0, RECORDS, 4)}
    truncated = {f"r{i:06d}" for i in range(RECORDS) if i % 4}
    assert charged <= invalid | truncated
    assert computed(store, version) < RECORDS and store.status(version).state == "halted"
    assert store.claim("late-worker", version) is None


def test_a_halted_version_can_be_cancelled_or_resumed_after_its_bound_is_changed(
        job_factory: Any, store: Store, store_url: str) -> None:
    halted = []
    for n in (RECORDS, RECORDS + 1):  # two inputs: two versions of one job
        spec = poisoned(job_factory, n)
        done = cli("run", str(spec), "--store", store_url)
        assert done.returncode == 7, done.stderr
        found = HALT_LINE.search(done.stderr.splitlines()[-1])
        assert found is not None
        halted.append((spec, found["version"]))
    (cancel_spec, cancelled), (resume_spec, resumed) = halted

    done = cli("cancel", cancelled, "--reason", "max_tokens too small", "--store", store_url)
    assert (done.returncode, done.stderr) == (0, f"cancelled {cancelled}\n")
    rerun = cli("run", str(cancel_spec), "--store", store_url)
    assert rerun.returncode == 1 and f"{cancelled} was cancelled in " in rerun.stderr.splitlines()[-1]

    # Run again as it is, it stays halted: no worker starts, the same line.
    halt = store.halt_of(resumed)
    assert halt is not None
    before = len(store.events(resumed, ["claim"]))
    rerun = cli("run", str(resume_spec), "--store", store_url)
    assert (rerun.returncode, rerun.stderr.splitlines()[-1]) == (7, f"batchline: error: {halt.message(resumed)}")
    assert len(store.events(resumed, ["claim"])) == before
    refused = cli("resume", resumed, "--store", store_url)
    assert refused.returncode == 4 and refused.stderr.startswith(f"batchline: error: cannot resume {resumed}: ")
    assert "it would halt again at once" in refused.stderr and refused.stderr.count("\n") == 1
    refused = cli("resume", resumed, "--abort-dead-letter-rate", "0.001", "--store", store_url)
    assert refused.returncode == 1 and refused.stderr == (
        "batchline: error: --abort-dead-letter-rate 0.001 is below validate.max_dead_letter_rate (0.01): the "
        "version would be halted at a rate its validation passes\n")
    assert store.status(resumed).state == "halted"

    done = cli("resume", resumed, "--abort-dead-letter-rate", "1", "--reason", "a backfill of poor inputs",
               "--store", store_url)
    assert done.returncode == 0, done.stderr
    assert done.stderr.startswith(f"resumed {resumed} under shards.abort_dead_letter_rate 1 after 40 outcomes")
    done = cli("run", str(resume_spec), "--store", store_url)
    assert done.returncode == 0, done.stderr
    st = store.status(resumed)
    assert (st.state, st.dead_letters, st.results, st.halt) == ("sealed", RECORDS + 1, 0, None)
    [event] = store.events(resumed, ["resume"])
    assert event.detail["reason"] == "a backfill of poor inputs" and event.detail["rate"] == 1.0


def test_a_worker_of_every_version_leaves_a_halted_one_and_finishes_the_others(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    _spec, halting = planned(poisoned(job_factory, 200), store)
    _spec, healthy = planned(job_factory(n=60, name="other-job"), store)
    log = tmp_path / "worker.log"
    worker = start_worker(store_url, log=log)  # no --job: it serves every version
    try:
        assert worker.wait(timeout=120) == 0
    finally:
        stop_all([worker])
    assert store.status(halting).state == "halted" and store.status(healthy).state == "sealed"
    assert f"leaving {halting}: it is halted" in log.read_text()
