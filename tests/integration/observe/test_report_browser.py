"""The report in a real headless browser: it loads without a script error, every
chart lays out with a size, hostile text does not run, and a screenshot is drawn.

Needs Debian's chromium (`apt-get install -y chromium`, which `make test` does);
skips with that reason where it is absent.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
from pathlib import Path
from typing import Any

import pytest

from batchline.ops.report.page import write_report
from batchline.sizing.costs import WorkerPrices
from batchline.store import Store
from tests.integration.observe.support import hostile_job, parse

BROWSER = next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p),
               None)
pytestmark = pytest.mark.skipif(BROWSER is None, reason="chromium is not installed "
                                "(apt-get install -y chromium; make test installs it)")

WIDTH, HEIGHT = 1280, 2400


def browser(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    assert BROWSER is not None
    profile = tmp_path / "profile"
    profile.mkdir(exist_ok=True)
    cmd = [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
           "--hide-scrollbars", f"--window-size={WIDTH},{HEIGHT}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    width, height = struct.unpack(">II", head[16:24])
    return width, height


def test_the_report_loads_in_chromium_and_draws_its_charts(job_factory: Any, store: Store, tmp_path: Path) -> None:
    job = hostile_job(job_factory, store)
    page_path = tmp_path / "report.html"
    write_report(store, job.version, page_path)
    url = page_path.resolve().as_uri()

    dom = browser(tmp_path, "--dump-dom", url)
    assert dom.returncode == 0, dom.stderr[-2000:]
    root = parse(dom.stdout).root_attrs
    # Set by the page's own script once the DOM is up: no script error, every chart drawn.
    assert root.get("data-report-ready") == "ok", root
    assert "data-js-errors" not in root
    assert root.get("data-charts") == root.get("data-charts-drawn") == "4"
    # Hostile ids and labels, had they been markup, would have set this as they ran.
    assert "data-pwned" not in root

    shot = tmp_path / "report.png"
    run = browser(tmp_path, f"--screenshot={shot}", url)
    assert run.returncode == 0 and shot.exists(), run.stderr[-2000:]
    assert png_size(shot) == (WIDTH, HEIGHT)
    # A blank page compresses to a few kilobytes; charts, tables and text do not.
    assert shot.stat().st_size > 60_000


def test_the_pacing_picture_of_a_run_held_to_its_deadline_is_drawn(
        job_factory: Any, store: Store, tmp_path: Path) -> None:
    from batchline.api import Jobs

    spec = job_factory(n=800, options={"seconds_per_record": 0.01},
                       shards={"size": 50, "lease_seconds": 5, "renew_seconds": 1, "batch_size": 8},
                       deadline="16s", fallback={"workers": 3, "cost_per_worker_hour": 3.0,
                                                 "restart_overhead_seconds": 2, "spot_cost_per_worker_hour": 1.0})
    trace = tmp_path / "spot.trace"
    trace.write_text("0 1\n2 0\n12 1\n")
    run = Jobs(store).run(spec, workers=1, spot_trace=trace, progress=None, log=lambda _m: None)
    assert run.sealed and store.paid_slots(run.version)
    page_path = tmp_path / "report.html"
    data = write_report(store, run.version, page_path)
    assert data.pace is not None and data.pace.paid and data.cost.paid_seconds > 0
    # Priced from the spec, spot and paid, in worker-hours (the synthetic engine has no GPU).
    assert data.cost.prices == WorkerPrices(1.0, 3.0, "worker-hours")
    url = page_path.resolve().as_uri()
    dom = browser(tmp_path, "--dump-dom", url)
    root = parse(dom.stdout).root_attrs
    assert root.get("data-report-ready") == "ok" and "data-js-errors" not in root
    # Throughput, the pace, the lease timeline and attempts (the job names no label field), each laid out.
    assert root.get("data-charts") == root.get("data-charts-drawn") == "4"
    assert 'aria-label="committed progress against the expected progress' in dom.stdout
    assert "Meeting the deadline" in dom.stdout and "paid worker-hours" in dom.stdout
    assert "GPU-hour" not in dom.stdout
    shot = Path(os.environ.get("BATCHLINE_PACE_SCREENSHOT", tmp_path / "pace.png"))
    done = browser(tmp_path, f"--screenshot={shot}", url)
    assert done.returncode == 0 and shot.exists() and shot.stat().st_size > 60_000
