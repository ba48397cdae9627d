"""Many regions: replicas of one snapshot checked object by object and read in the primary's
place, workers that know their region, shards claimed where their data lives, and the bytes
read across regions (the S3 stand-in of tests/integration/lake/support.py; locality on local
files, whose regions are only names)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from batchline.errors import InputError
from batchline.plan.planner import plan
from batchline.spec import JobSpec, parse_spec, stored_spec
from batchline.store import Store, require_job
from batchline.worker.supervisor import Worker
from tests.helpers import make_records, start_worker, wait_for, write_jsonl
from tests.integration.lake.support import FaultProxy, S3Bucket, S3StandIn
from tests.stores import POSTGRES, SQLITE, WORKER_ROLE


# Each store, and PostgreSQL with every worker call under the role `batchline grants` makes
# (a worker reads its version's replicas, and claims by region, through it).
@pytest.fixture(params=[SQLITE, pytest.param(POSTGRES, marks=pytest.mark.postgres),
                        pytest.param(WORKER_ROLE, marks=pytest.mark.postgres)])
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def jsonl(records: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def region_spec(tmp_path: Path, input_: dict[str, Any], size: int = 50, seconds_per_record: float = 0.0,
                name: str = "regional", **shards: Any) -> JobSpec:
    return parse_spec({"name": name, "input": {"acl_field": "acl", **input_},
                       "model": {"engine": "synthetic", "options": {"seconds_per_record": seconds_per_record}},
                       "prompt": {"text": "Classify.", "version": "v1"},
                       "output": {"schema": {"type": "object"}}, "shards": {"size": size, **shards}},
                      base_dir=tmp_path)


def primary_and_copy(lake: S3StandIn, n: int = 120) -> tuple[S3Bucket, S3Bucket, list[bytes]]:
    """Two objects under in/ in one bucket, and the same bytes under copy/ in another."""
    primary, replica = lake.bucket(), lake.bucket()
    parts = [jsonl(make_records(n // 2, prefix=p)) for p in ("a", "b")]
    for name, data in zip(("a", "b"), parts, strict=True):
        primary.put(f"in/{name}.jsonl", data)
        replica.put(f"copy/{name}.jsonl", data)
    return primary, replica, parts


def replicated(primary: S3Bucket, replica: S3Bucket, **extra: Any) -> dict[str, Any]:
    return {"path": f"s3://{primary.name}/in/*.jsonl", "region": "us-east-1",
            "replicas": {"eu-west-1": f"s3://{replica.name}/copy/", **extra.pop("more", {})}, **extra}


def results_once(store: Store, version: str, n: int) -> None:
    """Every record has exactly one outcome: none lost, none computed twice."""
    ids = [r.record_id for r in store.iter_results(version)]
    assert len(ids) == len(set(ids)) == n
    assert store.status(version).state == "sealed"


# --- replicas ---------------------------------------------------------------------------


def test_a_replica_is_checked_object_by_object_and_never_moves_the_version(
        lake_env: S3StandIn, store: Store, tmp_path: Path) -> None:
    primary, replica, _ = primary_and_copy(lake_env)
    bare = plan(region_spec(tmp_path, {"path": f"s3://{primary.name}/in/*.jsonl", "region": "us-east-1"}), store)
    with_replica = plan(region_spec(tmp_path, replicated(primary, replica)), store)
    assert with_replica.version == bare.version and not with_replica.created
    [(region, record)] = store.replicas(bare.version).items()
    assert region == "eu-west-1" and record.location == f"s3://{replica.name}/copy/"
    assert record.root == f"s3://{primary.name}/in/"
    assert sorted(record.pins) == [f"s3://{primary.name}/in/a.jsonl", f"s3://{primary.name}/in/b.jsonl"]
    # moto's single-part ETags are the MD5 of the bytes: content compared without reading it.
    assert record.compared == "2 objects: 2 by size and MD5 ETag"
    assert all(p["etag"] for p in record.pins.values())


@pytest.mark.parametrize("change", ["size", "checksum"])
def test_a_replica_with_one_object_of_another_size_or_checksum_is_refused_by_name_and_nothing_is_written(
        lake_env: S3StandIn, store: Store, tmp_path: Path, change: str) -> None:
    primary, replica, parts = primary_and_copy(lake_env)
    other = parts[1] + b"\n" if change == "size" else parts[1].replace(b"record number 1 ", b"record number 9 ")
    assert (len(other) == len(parts[1])) == (change == "checksum") and other != parts[1]
    replica.put("copy/b.jsonl", other)
    spec = region_spec(tmp_path, replicated(primary, replica))
    with pytest.raises(InputError) as refused:
        plan(spec, store)
    message = str(refused.value)
    assert f"s3://{replica.name}/copy/b.jsonl" in message and "replica eu-west-1" in message
    assert ("SHA-256" in message) == (change == "checksum")
    assert store.jobs() == []  # refused before anything was planned
    # Added to a planned version later, it is refused the same way and not recorded.
    version = plan(region_spec(tmp_path, {"path": f"s3://{primary.name}/in/*.jsonl", "region": "us-east-1"}),
                   store).version
    with pytest.raises(InputError, match=r"copy/b\.jsonl"):
        plan(spec, store)
    assert store.replicas(version) == {}


def test_a_worker_of_a_replicas_region_reads_the_replica_alone_and_crosses_no_region(
        s3_proxy: FaultProxy, lake_env: S3StandIn, store: Store, tmp_path: Path) -> None:
    primary, replica, _ = primary_and_copy(lake_env)
    version = plan(region_spec(tmp_path, replicated(primary, replica)), store).version
    s3_proxy.clear()
    worker = Worker(store, version=version, poll_seconds=0.1, region="eu-west-1")
    assert worker.run() == 0
    results_once(store, version, 120)
    read = [s.path for s in s3_proxy.requests("GET")]
    assert read and all(f"/{replica.name}/" in path for path in read), read
    assert worker.handle.regions.cross_region_bytes == 0


def test_an_unreachable_replica_is_said_once_and_read_from_the_primary_only_with_fallback(
        lake_env: S3StandIn, store: Store, tmp_path: Path) -> None:
    primary, replica, parts = primary_and_copy(lake_env)
    gate = FaultProxy(lake_env.url)  # the replica's region's endpoint: it stops answering after planning
    storage = {"endpoint": gate.url, "unavailable_seconds": 0.5}
    spec_input = replicated(primary, replica)
    spec_input["replicas"]["eu-west-1"] = {"location": f"s3://{replica.name}/copy/", "storage": storage}
    fallback = {**spec_input, "replica_fallback": "primary"}
    try:
        version = plan(region_spec(tmp_path, spec_input), store).version
        with_fallback = plan(region_spec(tmp_path, fallback, name="regional-fallback"), store).version
        gate.stall(10**6, 0.01)  # every request: the connection closed, unanswered
        logged: list[str] = []
        worker = Worker(store, version=version, poll_seconds=0.1, region="eu-west-1", log=logged.append)
        assert worker.run() == 75  # no fallback: the lease given back, the worker stops, to be started again
        assert all(s.state == "ready" for s in store.shard_rows(version))
        assert [e.kind for e in store.events(version)].count("input_unavailable") == 1

        logged.clear()
        version = with_fallback
        worker = Worker(store, version=version, poll_seconds=0.1, region="eu-west-1", log=logged.append)
        assert worker.run() == 0
    finally:
        gate.close()
    results_once(store, version, 120)
    said = [line for line in logged if "cannot be reached" in line]
    assert len(said) == 1 and "reading the primary in us-east-1" in said[0]
    # Every byte came from the primary's region: counted as crossing.
    assert worker.handle.regions.cross_region_bytes == sum(len(p) for p in parts)


def test_a_region_the_input_does_not_know_is_refused_in_one_line_with_exit_2(
        lake_env: S3StandIn, store: Store, store_url: str, tmp_path: Path) -> None:
    primary, replica, _ = primary_and_copy(lake_env, 20)
    version = plan(region_spec(tmp_path, replicated(primary, replica)), store).version
    done = subprocess.run([sys.executable, "-m", "batchline", "worker", "--store", store_url, "--job", version,
                           "--region", "mars-north-1"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert "mars-north-1" in line and "us-east-1, eu-west-1" in line and "Traceback" not in done.stderr
    assert all(s.state == "ready" for s in store.shard_rows(version))


# --- homes and locality -----------------------------------------------------------------


def homed(tmp_path: Path, counts: dict[str, int]) -> dict[str, Any]:
    """`input.regions`: one local file of `counts[region]` records per region."""
    out: dict[str, Any] = {}
    for region, n in counts.items():
        out[region] = str(write_jsonl(tmp_path / f"{region}.jsonl", make_records(n, prefix=region[:4])))
    return {"regions": out}


def test_each_shard_has_its_inputs_home_and_a_claim_prefers_it_until_the_wait_has_passed(
        store: Store, tmp_path: Path) -> None:
    spec = region_spec(tmp_path, homed(tmp_path, {"east": 100, "west": 50}), size=50, locality_wait_seconds=0.3)
    version = plan(spec, store).version
    assert {(r.home, r.ran_in, r.state): r.shards for r in store.shard_regions(version)} == {
        ("east", None, "ready"): 2, ("west", None, "ready"): 1}
    again = stored_spec(require_job(store, version))
    assert again.input.regions.known == ("east", "west")
    first = store.claim("e1", version, region="east", foreign=False)
    assert first is not None and first.home == "east"
    second = store.claim("e2", version, region="east", foreign=False)
    assert second is not None and second.home == "east"
    # Its region's shards are all leased, not done: it waits, unless its wait has passed.
    assert store.claim("e3", version, region="east", foreign=False) is None
    foreign = store.claim("e3", version, region="east", foreign=True)
    assert foreign is not None and foreign.home == "west"
    regions = {(r.home, r.ran_in, r.state): r.shards for r in store.shard_regions(version)}
    assert regions == {("east", "east", "leased"): 2, ("west", "east", "leased"): 1}


def test_a_worker_takes_another_regions_shard_at_once_when_its_own_region_has_none_left(
        store: Store, tmp_path: Path) -> None:
    version = plan(region_spec(tmp_path, homed(tmp_path, {"east": 100, "west": 50}), locality_wait_seconds=3600),
                   store).version
    gone = store.claim("east-gone", version, region="east", foreign=False)
    assert gone is not None
    store.shift_clock(601)  # the east worker is gone and its lease has run out
    worker = Worker(store, version=version, poll_seconds=0.1, region="west")
    started = time.monotonic()
    assert worker.run() == 0
    # The west shard, then both east ones: with no shard of its own left, an hour's wait holds nothing.
    assert time.monotonic() - started < 60
    results_once(store, version, 150)
    ran = {(r.home, r.ran_in): r.shards for r in store.shard_regions(version)}
    assert ran == {("east", "west"): 2, ("west", "west"): 1}


def test_a_wait_longer_than_a_shards_work_cannot_starve_another_region(store: Store, tmp_path: Path) -> None:
    """SPARK-18886: the wait is timed from this worker's own last claim at home, so its region's
    other workers claiming home shards again and again (each one's work far shorter than the
    wait) do not hold it back from another region's shards."""
    version = plan(region_spec(tmp_path, homed(tmp_path, {"east": 200, "west": 100}), size=20,
                               locality_wait_seconds=0.5), store).version
    held = []
    while (lease := store.claim("east-busy", version, region="east", foreign=False)) is not None:
        held.append(lease)
    assert len(held) == 10  # every east shard leased by the region's busy workers
    idle = Worker(store, version=version, poll_seconds=0.05, region="east")
    start = time.monotonic()
    first_foreign = None
    while time.monotonic() - start < 5 and first_foreign is None:
        # One busy worker ends a shard and the region starts another at once, every 50 ms.
        lease = held.pop(0)
        assert store.release(lease, "test")
        again = store.claim("east-busy", version, region="east", foreign=False)
        assert again is not None and again.home == "east"
        held.append(again)
        taken = idle._claim_or_recover(version, None, split=False)
        if taken is not None:
            assert taken.home == "west"
            first_foreign = time.monotonic() - start
        time.sleep(0.05)
    assert first_foreign is not None and 0.45 <= first_foreign <= 1.5


def test_every_worker_of_one_region_killed_the_other_regions_workers_take_its_shards_after_the_wait(
        store: Store, store_url: str, tmp_path: Path) -> None:
    """Real workers: the east region's only worker is killed with SIGKILL holding a lease; the
    west region's two workers finish their own shards and then the east's (the killed one's after
    its lease), each record once."""
    spec = region_spec(tmp_path, homed(tmp_path, {"east": 180, "west": 60}), size=30, seconds_per_record=0.01,
                       locality_wait_seconds=1, lease_seconds=4, renew_seconds=1)
    version = plan(spec, store).version
    log = tmp_path / "workers.log"
    east = start_worker(store_url, version, log, env={"BATCHLINE_REGION": "east"})
    wait_for(lambda: any(r.home == "east" and r.state == "leased" for r in store.shard_regions(version)), 60,
             "the east worker's first claim", [(east, log)])
    east.send_signal(signal.SIGKILL)
    east.wait(30)
    west = [start_worker(store_url, version, log, env={"BATCHLINE_REGION": "west"}) for _ in range(2)]
    try:
        for proc in west:
            assert proc.wait(180) == 0, log.read_text()[-3000:]
    finally:
        for proc in west:
            if proc.poll() is None:
                proc.kill()
    results_once(store, version, 240)
    ran = {(r.home, r.ran_in): r.shards for r in store.shard_regions(version)}
    assert ran.get(("west", "west")) == 2 and ran.get(("east", "west")) == 6, ran
    text = log.read_text()
    assert "lives in east: no shard of west was ready" in text
    from batchline.cli.jobs import region_lines

    [line, *_] = region_lines(store, version)
    assert line == "regions: home east: ran in west 6; home west: ran in west 2"
