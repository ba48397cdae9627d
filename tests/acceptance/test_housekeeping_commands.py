"""`batchline cancel`, `delete`, `history` and the published mark in `status`, from the command
line, with a real worker on the job being cancelled."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from batchline.store import Store
from tests.helpers import planned, start_worker, stop_all, wait_for

pytestmark = pytest.mark.acceptance


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "batchline", *args], capture_output=True, text=True, timeout=180)


def test_a_cancelled_version_is_left_by_its_worker_and_shown_cancelled(job_factory: Any, store: Store,
                                                                       store_url: str, tmp_path: Path) -> None:
    spec = job_factory(n=200, options={"seconds_per_record": 0.05})
    _spec, version = planned(spec, store)
    log = tmp_path / "worker.log"
    worker = start_worker(store_url, version, log=log)
    try:
        wait_for(lambda: store.events(version, ["claim"]), what="the worker's first claim")
        done = cli("cancel", version, "--reason", "input edited after planning", "--store", store_url)
        assert (done.returncode, done.stderr) == (0, f"cancelled {version}\n")
        assert worker.wait(timeout=60) == 0
    finally:
        stop_all([worker])
    assert "no work left" in log.read_text()
    assert store.events(version, ["stale_epoch"]), "the worker was not fenced off its shard"
    status = store.status(version)
    assert status.state == "cancelled" and status.pending > 0
    listing = cli("status", "--store", store_url).stdout
    assert f"{version}  cancelled  200 records" in listing
    for command in ("validate", "publish"):
        refused = cli(command, version, "--store", store_url)
        assert refused.stderr.endswith(f"{version} was cancelled: a cancelled version is "
                                       f"{'not validated' if command == 'validate' else 'never published'}\n")
    again = cli("cancel", version, "--store", store_url)
    assert (again.returncode, again.stderr) == (0, f"{version} was cancelled already\n")
    rerun = cli("run", str(spec), "--store", store_url)
    assert rerun.returncode == 1 and rerun.stderr.splitlines()[-1].startswith(
        f"batchline: error: {version} was cancelled in ")
    assert (cli("delete", version, "--store", store_url).stderr, store.jobs()) == (f"deleted {version}\n", [])


def test_status_marks_the_published_version_and_history_says_who_published_what(
        job_factory: Any, store_url: str) -> None:
    versions = []
    for n in (20, 21):  # two inputs of one job: two versions of one name
        done = cli("run", str(job_factory(n=n)), "--publish", "--store", store_url)
        assert done.returncode == 0, done.stderr
        versions.append(done.stdout.strip())
    first, second = versions
    lines = cli("status", "--store", store_url).stdout.splitlines()
    assert [line.endswith("  published") for line in lines] == [False, True]
    assert lines[1].startswith(second)
    as_json = json.loads(cli("status", "--json", "--store", store_url).stdout)
    assert [(j["version"], j["published"]) for j in as_json] == [(first, False), (second, True)]
    assert cli("status", second, "--store", store_url).stdout.startswith(
        f"{second} (sealed, published as test-job)")

    for verb in ("cancel", "delete"):
        refused = cli(verb, second, "--store", store_url)
        assert (refused.returncode, refused.stderr) == (
            4, f"batchline: error: cannot {verb} {second}: it is published as 'test-job'\n")
        refused = cli(verb, first, "--store", store_url)
        assert (refused.returncode, refused.stderr) == (
            4, f"batchline: error: cannot {verb} {first}: a rollback of 'test-job' would return to it\n")

    assert cli("rollback", "test-job", "--reason", "labels drifted", "--store", store_url).returncode == 0
    history = cli("history", "test-job", "--store", store_url).stdout.splitlines()
    assert [line.split()[1:3] for line in history] == [["publish", first], ["publish", second],
                                                        ["rollback", first]]
    assert f"(was {first})" in history[1] and "validation passed: coverage" in history[1]
    assert history[2].endswith("reason: labels drifted") and f"(was {second})" in history[2]
    entries = json.loads(cli("history", "test-job", "--json", "--store", store_url).stdout)
    assert [(e["action"], e["version"], e["reason"]) for e in entries] == [
        ("publish", first, None), ("publish", second, None), ("rollback", first, "labels drifted")]
    # After the rollback the newer version is what a rollback would return to no more.
    assert cli("delete", second, "--store", store_url).returncode == 0
