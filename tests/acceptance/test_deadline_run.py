"""`batchline run` holding a deadline: its spot workers taken away by a drill's spot trace
(killed outright, as a reclaim would), its pacer buys paid workers of the same version while
the job is behind and stops them once it is ahead; the deadline is met with 0 records lost
and 0 duplicated, and every paid worker has stopped when the run ends. On both stores."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from batchline.spec import stored_spec
from batchline.store import Store
from tests.helpers import check_invariants

pytestmark = pytest.mark.acceptance

WINDOW = 40  # seconds from the first claim


def test_a_run_whose_spot_workers_are_taken_away_buys_paid_workers_and_meets_its_deadline(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    spec = job_factory(n=3000, options={"seconds_per_record": 0.01},
                       shards={"size": 100, "lease_seconds": 10, "renew_seconds": 2, "batch_size": 8},
                       deadline=f"{WINDOW}s",
                       fallback={"workers": 4, "cost_per_worker_hour": 3.0, "restart_overhead_seconds": 3})
    trace = tmp_path / "spot.trace"
    trace.write_text("# both spot workers for 5 s, none until 35 s, both again after\n0 2\n5 0\n35 2\n")
    done = subprocess.run([sys.executable, "-m", "batchline", "run", str(spec), "--store", store_url, "--workers",
                           "2", "--spot-trace", str(trace)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    version = done.stdout.strip()
    info = store.job(version)
    assert info is not None and info.state == "sealed" and info.sealed_at is not None
    first_claim = store.status(version).started_at
    assert first_claim is not None and info.sealed_at - first_claim <= WINDOW, (info.sealed_at - first_claim)
    results, dead = check_invariants(store, version, stored_spec(info))
    assert len(results) == 3000 and dead == set()
    # The drill did take the spot workers away, and paid workers of this version took over.
    assert "spot trace   2 spot workers reclaimed" in done.stderr
    starts = store.paid_slots(version)
    assert starts and all(not s.running for s in starts)
    assert {r.worker for r in store.iter_results(version)} & {s.worker for s in starts}
    assert [e.detail["slot"] for e in store.events(version, ["paid_launch"])]
    assert "pacer: behind: buying" in done.stderr or "pacer: safety net" in done.stderr
    assert "paid worker-hours" in done.stderr


def test_status_shows_the_pace_of_a_version_with_a_deadline(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    from batchline.plan.planner import plan
    from batchline.spec import load_spec
    from batchline.store import ResultRow

    spec = load_spec(job_factory(n=100, shards={"size": 50, "lease_seconds": 10, "renew_seconds": 2},
                                 deadline="1h"))
    version = plan(spec, store).version
    lease = store.claim("spot", version)
    assert lease is not None
    store.put_results(lease, [ResultRow(f"r{i:06d}", '{"category": "a"}', piece=i // 4) for i in range(4)])
    done = subprocess.run([sys.executable, "-m", "batchline", "status", version, "--json", "--store", store_url],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    pace = json.loads(done.stdout)["pace"]
    assert pace["mode"] == "on time" and pace["paid"] == 0 and pace["spot_workers"] == 1
    text = subprocess.run([sys.executable, "-m", "batchline", "status", version, "--store", store_url],
                          capture_output=True, text=True, timeout=60).stdout
    assert "pace: 1 spot, 0 paid | committed 4 vs expected" in text and "| on time" in text
