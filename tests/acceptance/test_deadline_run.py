"""`batchline run` holding a deadline, on both stores: its spot workers taken away by a
drill's spot trace (killed outright, as a reclaim would), or never there at all (the night a
launch took the idle fleet); its pacer buys paid workers of the same version while the job
is behind, from the run's start, not from a first claim that may never come. Each run ends
with 0 records lost and 0 duplicated, every paid worker stopped, and the deadline met as
measured from the run start. The work is a small share of each window, so a slow machine
does not decide whether the deadline is met: whether paid workers were bought does."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from batchline.spec import stored_spec
from batchline.store import Store
from tests.helpers import check_invariants, wait_for

pytestmark = pytest.mark.acceptance


def run(spec: Path, store_url: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "batchline", "run", str(spec), "--store", store_url, *args],
                          capture_output=True, text=True, timeout=timeout)


def held(store: Store, version: str, records: int) -> None:
    """Sealed by the deadline counted from the run start, every record once, every paid worker
    stopped, and the paid workers did the work they were bought for."""
    info = store.job(version)
    assert info is not None and info.state == "sealed" and info.sealed_at is not None
    st = store.status(version)
    spec = stored_spec(info)
    assert spec.deadline is not None and st.run_start is not None
    deadline = spec.deadline.resolve(st.run_start, st.now)
    assert info.sealed_at <= deadline, (info.sealed_at, deadline)
    results, dead = check_invariants(store, version, spec)
    assert len(results) == records and dead == set()
    starts = store.paid_slots(version)
    assert starts and all(not s.running for s in starts)
    assert {r.worker for r in store.iter_results(version)} & {s.worker for s in starts}


def test_a_run_whose_spot_workers_are_taken_away_buys_paid_workers_and_meets_its_deadline(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    # 20 worker-seconds of work in a 60 s window; the spot workers are gone from 3 s to 50 s, so
    # without paid workers the job would end past the deadline.
    spec = job_factory(n=2000, options={"seconds_per_record": 0.01},
                       shards={"size": 100, "lease_seconds": 10, "renew_seconds": 2, "batch_size": 8},
                       deadline="60s",
                       fallback={"workers": 4, "cost_per_worker_hour": 3.0, "restart_overhead_seconds": 3})
    trace = tmp_path / "spot.trace"
    trace.write_text("# both spot workers for 3 s, none until 50 s, both again after\n0 2\n3 0\n50 2\n")
    done = run(spec, store_url, "--workers", "2", "--spot-trace", str(trace))
    assert done.returncode == 0, done.stderr[-3000:]
    version = done.stdout.strip()
    held(store, version, 2000)
    # The drill did take the spot workers away, and paid workers of this version took over.
    assert "spot trace   2 spot workers reclaimed" in done.stderr
    assert [e.detail["slot"] for e in store.events(version, ["paid_launch"])]
    assert "pacer: behind" in done.stderr or "pacer: safety net" in done.stderr
    assert "deadline     met, sealed" in done.stderr and "worker-hours paid at 3/h" in done.stderr


@pytest.mark.parametrize("deadline", ["window", "absolute"])
def test_regression_the_night_no_spot_worker_ever_claimed_bought_nothing(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path, deadline: str) -> None:
    # No spot worker at any time: before, nothing was ever claimed, the pacer waited for a first
    # claim to start its line (a window never even began), and no paid worker was bought.
    at = datetime.fromtimestamp(store.now() + 120, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    spec = job_factory(n=2000, options={"seconds_per_record": 0.005},
                       shards={"size": 100, "lease_seconds": 10, "renew_seconds": 2, "batch_size": 8},
                       deadline="120s" if deadline == "window" else at,
                       fallback={"workers": 4, "cost_per_worker_hour": 3.0, "restart_overhead_seconds": 2})
    trace = tmp_path / "spot.trace"
    trace.write_text("0 0\n")
    done = run(spec, store_url, "--workers", "3", "--spot-trace", str(trace))
    assert done.returncode == 0, done.stderr[-3000:]
    version = done.stdout.strip()
    held(store, version, 2000)
    # The run start was recorded before anything claimed, and the first claim was a paid worker's.
    [opened] = store.events(version, ["open"])
    first = store.events(version, ["claim"])[0]
    assert opened.ts <= first.ts and first.worker in {s.worker for s in store.paid_slots(version)}
    assert "behind with no rate measured: buying every paid worker (4)" in done.stderr


def test_the_pacer_killed_while_no_spot_worker_ever_claimed_loses_nothing_and_starts_no_slot_twice(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    spec = job_factory(n=1500, options={"seconds_per_record": 0.02},
                       shards={"size": 100, "lease_seconds": 10, "renew_seconds": 2, "batch_size": 8},
                       deadline="10m",
                       fallback={"workers": 2, "cost_per_worker_hour": 3.0, "restart_overhead_seconds": 2})
    trace = tmp_path / "spot.trace"
    trace.write_text("0 0\n")
    logs = tmp_path / "logs"
    first = subprocess.Popen([sys.executable, "-m", "batchline", "run", str(spec), "--store", store_url,
                              "--workers", "1", "--spot-trace", str(trace), "--log-dir", str(logs)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
    version = wait_for(lambda: next((j.version for j in store.jobs() if j.name == "test-job"), None),
                       what="the version planned")
    wait_for(lambda: store.status(version).results > 0, timeout=120, what="the paid workers' first results")
    first.send_signal(signal.SIGKILL)  # the runner, and its pacer, are gone; its paid workers go on
    first.wait()
    assert first.stdout is not None and first.stderr is not None
    first.stdout.close()
    first.stderr.close()
    before = {(s.slot, s.generation) for s in store.paid_slots(version)}
    again = run(spec, store_url, "--workers", "1", "--spot-trace", str(trace))
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.strip() == version
    held(store, version, 1500)
    # The orphaned paid workers were "already there": no slot had two starts running at once.
    starts = store.paid_slots(version)
    for slot in {s.slot for s in starts}:
        spans = sorted((s.launched_at, s.stopped_at or float("inf")) for s in starts if s.slot == slot)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), (slot, spans)
    assert before <= {(s.slot, s.generation) for s in starts}


def test_status_shows_the_pace_of_a_version_with_a_deadline_open_and_sealed(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    from batchline.plan.planner import plan
    from batchline.spec import load_spec
    from batchline.store import ResultRow
    from tests.helpers import run_to_seal

    spec = load_spec(job_factory(n=100, shards={"size": 50, "lease_seconds": 10, "renew_seconds": 2},
                                 deadline="1h", fallback={"workers": 2, "cost_per_worker_hour": 3.0,
                                                          "spot_cost_per_worker_hour": 1.0}))
    version = plan(spec, store).version
    lease = store.claim("spot", version)
    assert lease is not None
    store.worker_beat(version, "spot", every=60.0)
    store.put_results(lease, [ResultRow(f"r{i:06d}", '{"category": "a"}', piece=i // 4) for i in range(4)])

    def status(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "batchline", "status", version, "--store", store_url, *args],
                              capture_output=True, text=True, timeout=60)

    done = status("--json")
    assert done.returncode == 0, done.stderr
    pace = json.loads(done.stdout)["pace"]
    assert pace["mode"] == "on time" and pace["paid"] == 0 and pace["spot_workers"] == 1
    assert pace["outcome"]["met"] is None and pace["outcome"]["paid_starts"] == 0
    text = status().stdout
    assert "pace: 1 spot, 0 paid | committed 4 vs expected" in text and "| on time" in text
    assert "deadline: ready, " in text and "left to the deadline" in text
    # Sealed, it keeps its pace section: met, by how much, the paid starts and the cost.
    store.release(lease, "test")
    run_to_seal(store, version)
    sealed = json.loads(status("--json").stdout)["pace"]
    assert sealed["outcome"]["met"] is True and sealed["outcome"]["margin_seconds"] > 0
    assert sealed["outcome"]["cost"]["unit"] == "worker-hours" and sealed["outcome"]["cost"]["total"] is not None
    text = status().stdout
    assert "deadline: met, sealed" in text and "0 paid starts" in text and "spot at 1/h" in text
