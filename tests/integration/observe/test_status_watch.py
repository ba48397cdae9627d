"""`batchline status --watch`: the progress of a job run by other processes, from the store."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any

import pytest

from batchline.cli import main
from batchline.cli.observe import watch_status, workers_alive
from batchline.errors import VersionEnded
from batchline.store import Store
from tests.helpers import planned, start_worker, stop_all, wait_for


def test_watch_follows_workers_elsewhere_until_the_seal(job_factory: Any, store: Store, store_url: str,
                                                       tmp_path: Any) -> None:
    spec = job_factory(n=400, options={"seconds_per_record": 0.02}, shards={"size": 50},
                       deadline="2001-01-01T00:00:00Z")
    _spec, version = planned(spec, store)
    procs = [start_worker(store_url, version, tmp_path / f"w{i}.log") for i in range(2)]
    try:
        wait_for(lambda: workers_alive(store, version, store.now()) >= 1, what="a worker to hold a lease")
        out = io.StringIO()
        assert watch_status(store, version, interval=0.3, out=out) == 0
    finally:
        stop_all(procs)
    lines = out.getvalue().splitlines()
    assert len(lines) >= 2
    assert lines[-1].startswith("sealed ") and "400/400 records (100.0%)" in lines[-1]
    running = [ln for ln in lines if ln.startswith("ready ")]
    assert running, "at least one update before the seal"
    assert any(re.search(r"\| [12] workers \|", ln) for ln in running)
    # The deadline is long past: once there is a rate, the ETA says how late the job will be.
    with_eta = [ln for ln in running if "ETA" in ln]
    assert with_eta and all("past the deadline" in ln for ln in with_eta)
    done = [int(re.match(r"\w+ +([\d,]+)/", ln).group(1).replace(",", "")) for ln in lines]  # type: ignore[union-attr]
    assert done == sorted(done), "progress never goes backwards"
    assert workers_alive(store, version, store.now()) == 0


def test_status_names_a_version_stopped_by_a_changed_input_instead_of_a_rate_and_an_eta(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec, version = planned(job_factory(n=100, shards={"size": 50}), store)
    path = Path(spec.input.locations[0])
    planned_input = path.read_bytes()
    path.write_bytes(planned_input.replace(b"record number 70 ", b"record number 7X "))
    assert start_worker(store_url, version, tmp_path / "w.log").wait(timeout=60) == 3
    st = store.status(version)
    assert st.results == 50 and st.records_per_second, "the first shard was done: there is a rate"
    assert main(["status", version, "--store", store_url]) == 0
    line = capsys.readouterr().out.splitlines()[1]
    assert "rec/s" not in line and "ETA" not in line
    assert re.search(rf"\| stopped: shard 1: {re.escape(str(path))}:\d+: input changed since planning", line), line
    assert main(["status", version, "--store", store_url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stopped"] == st.stopped
    # Put back as planned, the input is read again: the version is no longer stopped.
    path.write_bytes(planned_input)
    assert start_worker(store_url, version, tmp_path / "w2.log").wait(timeout=60) == 0
    assert store.status(version).stopped is None


def test_a_watch_of_a_cancelled_version_redrew_for_ever_instead_of_ending(
        job_factory: Any, store: Store, store_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A cancelled version never seals: the watch ends at its first line with exit 1 and
    says so, where it once redrew the same line until it was interrupted."""
    _spec, version = planned(job_factory(n=40, shards={"size": 20}), store)
    assert store.cancel(version, "ops", "superseded")
    out = io.StringIO()
    with pytest.raises(VersionEnded, match=rf"^{re.escape(version)} was cancelled in .*; nothing of it runs again$"):
        watch_status(store, version, interval=0.05, out=out, max_updates=40)
    assert [ln.split()[0] for ln in out.getvalue().splitlines()] == ["cancelled"]
    assert main(["status", version, "--store", store_url, "--watch", "--interval", "0.05"]) == 1
    assert capsys.readouterr().err.strip() == f"batchline: error: {version} was cancelled in {store.where()}; " \
                                               "nothing of it runs again"
