"""The observability flags and commands through `python -m batchline`, as an operator
types them: a worker process with --metrics-port and --log-format json, status --watch,
report and drill --check."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from batchline.store import Store
from tests.helpers import free_port, planned, stop_all, wait_for

prometheus_parser = pytest.importorskip("prometheus_client.parser",
                                        reason="the metrics extra is not installed (pip install -e '.[metrics]')")


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "batchline", *args], capture_output=True, text=True, timeout=120)


def results_served(port: int) -> float | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            text = resp.read().decode()
    except (urllib.error.URLError, ConnectionError):
        return None
    for family in prometheus_parser.text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "batchline_records_total" and s.labels == {"outcome": "result"}:
                return float(s.value)
    return None


def test_a_worker_process_serves_metrics_and_logs_json(job_factory: Any, store: Store, store_url: str,
                                                       tmp_path: Path) -> None:
    _spec, version = planned(job_factory(n=300, options={"seconds_per_record": 0.01}), store)
    port = free_port()
    log = tmp_path / "worker.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "batchline", "worker", "--store", store_url, "--job", version,
                                 "--metrics-port", str(port), "--metrics-addr", "127.0.0.1", "--log-format", "json",
                                 "--poll-seconds", "0.2"], stdout=out, stderr=out, stdin=subprocess.DEVNULL)
    try:
        wait_for(lambda: proc.poll() is not None or (results_served(port) or 0) > 0, timeout=60,
                 what="the worker's endpoint to count results")
        assert proc.poll() is None, log.read_text()[-2000:]  # it served while it worked, not after
        assert proc.wait(timeout=60) == 0
    finally:
        stop_all([proc])
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    assert entries[-1]["msg"] == "exit 0"
    assert {e["worker"] for e in entries} == {entries[0]["worker"]}
    assert any(e["msg"].startswith("metrics on 127.0.0.1:") for e in entries)
    assert sum(e["msg"].startswith("claimed shard") for e in entries) == len(store.shard_rows(version))


def test_status_watch_report_and_drill_check(job_factory: Any, store_url: str, tmp_path: Path) -> None:
    run = cli("run", str(job_factory(n=120, options={"error_on": ["r000005"]})), "--store", store_url,
              "--workers", "2")
    assert run.returncode == 0, run.stderr
    version = run.stdout.strip()

    watch = cli("status", version, "--store", store_url, "--watch", "--interval", "0.2")
    assert watch.returncode == 0 and watch.stdout.startswith("sealed ") and "120/120 records" in watch.stdout
    bad = cli("status", "--store", store_url, "--watch")
    assert bad.returncode == 1 and bad.stderr.strip() == "batchline: error: --watch needs a VERSION (or a published NAME)"

    page = tmp_path / "report.html"
    report = cli("report", version, "--store", store_url, "--html", str(page))
    assert report.returncode == 0, report.stderr
    assert "<!DOCTYPE html>" in page.read_text() and f"wrote {page}" in report.stderr

    # The checker works on any synthetic job: its error_on record is the poison it expects.
    check = cli("drill", "--check", version, "--store", store_url, "--work-dir", str(tmp_path))
    assert check.returncode == 0, check.stdout
    assert "PASS  I4 poison costs only itself: 1 poison records: 1 dead-lettered" in check.stdout
    assert "FAIL" not in check.stdout
