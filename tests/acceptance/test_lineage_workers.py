"""Lineage from real `batchline worker` processes that are killed: a worker killed mid-shard and
started again sends no second START, and a worker killed after the seal while it sends the
COMPLETE leaves it in the store for the next process of the job (here `validate`), which sends
it; the receiver gets START, COMPLETE and the publish run exactly once each, every one valid
against the OpenLineage schemas. Waits on the store's state, and shifts its clock rather than
sleeping past the dead sender's claim."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from batchline.store import Store
from tests.fakes.lineage_receiver import lineage_receiver, validate_event
from tests.helpers import check_invariants, kill_9, planned, start_worker, stop_all, wait_for

pytestmark = pytest.mark.acceptance

ROOT = Path(__file__).resolve().parents[2]


def partly_done(store: Store, version: str) -> Any:
    return next((r for r in store.shard_rows(version) if r.state == "leased" and 0 < r.results < r.record_count - 20),
                None)


def test_killed_workers_leave_one_start_one_complete_and_one_publish_at_the_receiver(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    spec_path = job_factory(n=1500, name="nightly", options={"seconds_per_record": 0.004},
                            shards={"size": 100, "lease_seconds": 60})
    spec, version = planned(spec_path, store)
    with lineage_receiver() as receiver:
        env = {"OPENLINEAGE_URL": receiver.url}
        procs = [start_worker(store_url, version, tmp_path / f"w{i}.log", env=env) for i in range(2)]
        try:
            wait_for(lambda: receiver.of("nightly", "START"), what="the START")
            row = wait_for(lambda: partly_done(store, version), what="a shard partly done")
            kill_9(int(row.owner.split(":")[1]))  # a worker killed mid-shard...
            procs.append(start_worker(store_url, version, tmp_path / "w-again.log", env=env))  # ...and another
            receiver.stall.add("COMPLETE")
            wait_for(lambda: receiver.stalled, timeout=180, what="the COMPLETE on its way")
            for p in procs:  # every worker killed while the one that sealed sends the COMPLETE
                if p.poll() is None:
                    os.kill(p.pid, signal.SIGKILL)
                    p.wait()
        finally:
            stop_all(procs)
        job = store.job(version)
        assert job is not None and job.state == "sealed"
        assert [(r.kind, r.state) for r in store.lineage_rows(version)] == [("start", "sent"), ("complete", "pending")]
        assert receiver.of("nightly", "COMPLETE") == []
        receiver.stall.clear()
        receiver.release.set()
        store.shift_clock(600)  # the dead sender's claim on the row runs out
        run_env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
        for command in (["validate", version], ["publish", version]):
            done = subprocess.run([sys.executable, "-m", "batchline", *command, "--store", store_url],
                                  capture_output=True, text=True, timeout=120, env=run_env)
            assert done.returncode == 0, done.stderr
        assert [e["eventType"] for e in receiver.of("nightly")] == ["START", "COMPLETE"]
        assert len(receiver.of("nightly.publish", "COMPLETE")) == 1
        for event in receiver.received():
            validate_event(event)
        outcomes = receiver.of("nightly", "COMPLETE")[0]["run"]["facets"]["batchline_outcomes"]
        assert outcomes["results"] == 1500 and outcomes["deadLetters"] == 0
    check_invariants(store, version, spec)
    assert store.events(version, ["take_back"]) or store.events(version, ["lease_expired"])
