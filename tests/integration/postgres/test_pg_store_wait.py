"""A worker waits for a store it cannot reach yet, so a fleet started in any order comes
up; a store that does not exist is refused at once."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from batchline.store import Store
from tests.fakes.tcp_relay import TcpRelay, free_port
from tests.helpers import check_invariants, planned, start_worker, wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.acceptance]


def test_a_worker_started_before_the_store_is_reachable_waits_and_does_its_job(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    spec, version = planned(job_factory(n=100, options={"seconds_per_record": 0.002}), store)
    port = free_port()
    # Nothing listens on the port yet: the store cannot be reached, as before a server starts.
    via_relay = store_url.replace("127.0.0.1:5432", f"127.0.0.1:{port}")
    log = tmp_path / "worker.log"
    worker = start_worker(via_relay, version, log)
    relay = TcpRelay(port, ("127.0.0.1", 5432))
    try:
        wait_for(lambda: log.exists() and "waiting up to 300s for the store" in log.read_text(),
                 what="the worker to say it waits")
        time.sleep(1.0)
        assert worker.poll() is None, log.read_text()[-2000:]
        relay.start()
        assert worker.wait(timeout=120) == 0, log.read_text()[-2000:]
    finally:
        if worker.poll() is None:
            worker.kill()
        relay.close()
    check_invariants(store, version, spec)
    assert "reached the store" in log.read_text()


def test_a_store_that_does_not_exist_is_refused_at_once(store_url: str) -> None:
    missing = store_url.rsplit("/", 1)[0] + "/no_such_batchline_store"
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "batchline", "worker", "--store", missing],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 4
    assert time.monotonic() - started < 20
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("batchline: error: store postgresql://postgres@127.0.0.1:5432/"
                                "no_such_batchline_store does not exist")
