"""Preemption notices (I5): the AWS and Google Cloud notices read from a local
stand-in for the metadata service, and the time from notice to a free GPU
(engine child gone, lease released) measured on a real worker process."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from batchline.store import Store
from batchline.worker.notices import AwsSpotNotice, GcpPreemptedNotice, NoticeWatcher, start_watcher
from tests.helpers import ROOT, planned, stop_all, wait_for
from tests.integration.fleet.metadata_fake import FakeMetadataServer


@pytest.fixture
def metadata() -> Any:
    with FakeMetadataServer() as server:
        yield server


def test_aws_notice_reads_with_an_imdsv2_token_and_gets_a_new_one_when_refused(
        metadata: FakeMetadataServer) -> None:
    source = AwsSpotNotice(metadata.url)
    assert source.check() is None
    assert source.check() is None
    assert [r for r in metadata.requests if r[0] == "PUT"] == [("PUT", "/latest/api/token")]  # token reused
    metadata.revoke_tokens()
    metadata.notice()
    notice = source.check()
    assert notice is not None and "terminate at 2026-11-30T01:02:03Z" in notice
    assert len([r for r in metadata.requests if r[0] == "PUT"]) == 2


def test_gcp_notice_sends_the_metadata_flavor_header(metadata: FakeMetadataServer) -> None:
    source = GcpPreemptedNotice(metadata.url)
    assert source.check() is None  # the fake answers 403 without the header, which would raise
    metadata.notice()
    assert source.check() == "Google Cloud preemption notice (instance/preempted is TRUE)"


@pytest.mark.parametrize("kind", ["aws", "gcp"])
def test_the_watcher_sets_the_stop_event_on_the_notice_only(metadata: FakeMetadataServer, kind: str) -> None:
    stop = threading.Event()
    watcher = start_watcher(kind, stop, base_url=metadata.url, interval=0.05)
    assert isinstance(watcher, NoticeWatcher)
    try:
        assert not stop.wait(0.3)
        metadata.notice()
        assert stop.wait(5)
        assert watcher.notice is not None and watcher.noticed_at is not None
    finally:
        watcher.close()


def test_an_unreachable_metadata_service_never_stops_the_worker() -> None:
    stop = threading.Event()
    messages: list[str] = []
    # Nothing listens on port 9 of the loopback: every read fails at once.
    watcher = start_watcher("aws", stop, base_url="http://127.0.0.1:9", interval=0.02, log=messages.append)
    assert watcher is not None
    try:
        assert not stop.wait(0.5)
    finally:
        watcher.close()
    assert len(messages) == 1 and "still watching" in messages[0]
    assert start_watcher("none", stop) is None
    with pytest.raises(ValueError, match="unknown preemption notice"):
        start_watcher("azure", stop)


def children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


GRACE = 1.0
INTERVAL = 2.0  # the CLI's default poll interval


@pytest.mark.acceptance
@pytest.mark.parametrize("kind", ["aws", "gcp"])
def test_notice_to_free_gpu_is_bounded_by_the_grace_period(
        metadata: FakeMetadataServer, kind: str, job_factory: Any, store: Store, store_url: str,
        tmp_path: Path) -> None:
    # Records slow enough that what is in flight cannot finish within the grace period:
    # the bound must hold because the worker gives up on them, not because they were quick.
    _spec, version = planned(job_factory(n=200, options={"seconds_per_record": 0.3},
                                        shards={"size": 50, "batch_size": 4, "grace_seconds": GRACE,
                                                "record_timeout_seconds": 5.0}), store)
    log = tmp_path / "worker.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchline", "worker", "--store", store_url, "--job", version, "--poll-seconds",
         "0.2", "--preemption-notice", kind, "--metadata-url", metadata.url],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        row = wait_for(lambda: next((r for r in store.shard_rows(version) if r.state == "leased" and r.results > 0),
                                    None), timeout=60, what="a shard partly done")
        engines = children(proc.pid)
        assert engines, "no engine child to free"
        noticed = time.monotonic()
        metadata.notice()
        wait_for(lambda: any(e.worker == row.owner for e in store.events(version, ["release"]))
                 and not any(alive(pid) for pid in engines + children(proc.pid)),
                 timeout=30, what="the lease released and the engine gone")
        freed = time.monotonic() - noticed
        assert proc.wait(timeout=30) == 75
    finally:
        stop_all([proc])
    # Notice to free: at most one poll interval to see it, the grace period for the
    # records in flight, and a margin for killing the child and two round trips.
    print(f"{kind}: notice to free GPU {freed:.2f}s (interval {INTERVAL}s, grace {GRACE}s)")
    assert freed <= INTERVAL + GRACE + 2.0, log.read_text()[-2000:]
    st = store.status(version)
    assert st.shards["leased"] == 0 and st.state == "ready" and st.pending > 0
    assert "preemption notice" in log.read_text() or "interruption notice" in log.read_text()
    assert not store.events(version, ["attempt_failed"])  # records in flight were not charged
