"""`batchline run` with its workers in separate processes, then the reading commands, on every store."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from batchline.spec import load_spec
from batchline.store import Store
from tests.helpers import check_invariants, planned, wait_for

pytestmark = pytest.mark.acceptance


def batchline(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "batchline", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_run_with_separate_worker_processes(job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    spec_path = job_factory(n=600, options={"seconds_per_record": 0.002, "error_on": ["r000123"]},
                            shards={"size": 50}, validate={"max_dead_letter_rate": 0.01})
    done = batchline("run", str(spec_path), "--store", store_url, "--workers", "3", "--log-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    version = done.stdout.strip().splitlines()[-1]
    check_invariants(store, version, load_spec(spec_path))
    workers = {e.worker for e in store.events(version, ["claim"])}
    assert len({w.split(":")[1] for w in workers if w}) >= 2, "the shards were not shared between processes"
    status = batchline("status", version, "--store", store_url, "--json")
    assert status.returncode == 0
    assert json.loads(status.stdout)["outcomes"] == {"results": 599, "dead_letters": 1, "pending": 0}
    again = batchline("run", str(spec_path), "--store", store_url, "--workers", "2", "--log-dir", str(tmp_path))
    assert again.returncode == 0 and again.stdout.strip().splitlines()[-1] == version
    out = tmp_path / "out.jsonl"
    exported = batchline("export", version, "--store", store_url, "--format", "jsonl", "--out", str(out))
    assert exported.returncode == 0 and len(out.read_text().splitlines()) == 599


def test_a_run_stopped_by_ctrl_c_says_stopped_with_the_records_left_not_ready(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    spec_path = job_factory(n=400, options={"seconds_per_record": 0.02}, shards={"size": 50})
    _spec, version = planned(spec_path, store)
    # A session of its own: Ctrl-C reaches every process of the terminal's foreground group.
    run = subprocess.Popen([sys.executable, "-m", "batchline", "run", str(spec_path), "--store", store_url,
                            "--log-dir", str(tmp_path / "logs")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, start_new_session=True)
    try:
        wait_for(lambda: store.status(version).results >= 30, timeout=120, what="a run under way")
        os.killpg(run.pid, signal.SIGINT)
        out, err = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    left = store.status(version).pending
    assert run.returncode == 75 and 0 < left < 400, err[-3000:]
    summary = err.splitlines()
    assert f"stopped: {left:,} records left; run the same command again to go on" in summary, err[-3000:]
    assert not [line for line in summary if line.startswith("ready:")]
    assert out.strip() == version
