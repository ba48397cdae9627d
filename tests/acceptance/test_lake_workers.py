"""Real `batchline worker` processes over inputs in object storage (the S3 and GCS stand-ins
of tests/integration/lake/support.py), hurt as in test_worker_faults.py: killed, stalled past their
lease, refused a changed object, cut off from the store, and started on a machine that
has nothing of the planning machine's files; and killed over an Iceberg snapshot whose
data files are in S3."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from batchline.plan.planner import plan
from batchline.spec import load_spec
from batchline.store import Store
from tests.acceptance.test_worker_faults import owner_pid, sealed, stored_ids
from tests.helpers import (
    SIMPLE_SCHEMA,
    call_counts,
    check_invariants,
    kill_9,
    make_records,
    rescue_stalled_shard,
    sealed_and_gone,
    start_worker,
    stop_all,
    stopped,
    wait_for,
    workers_until_done,
)
from tests.integration.lake.support import FaultProxy, GCSStandIn, S3StandIn
from tests.integration.test_iceberg_input import SOURCE, make_source, store_slices

pytestmark = pytest.mark.acceptance

N = 1200
SHARD = 100


def encode(records: list[dict[str, Any]], fmt: str) -> bytes:
    if fmt == "jsonl":
        return b"".join(json.dumps(r).encode() + b"\n" for r in records)
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerow(["id", "text", "acl"])
        writer.writerows([r["id"], r["text"], json.dumps(r["acl"])] for r in records)
        return out.getvalue().encode()
    buf = io.BytesIO()
    table = pa.table({k: [r[k] if k != "acl" else json.dumps(r[k]) for r in records] for k in ("id", "text", "acl")})
    pq.write_table(table, buf, row_group_size=SHARD)
    return buf.getvalue()


def write_spec(folder: Path, input_path: str, *, options: dict[str, Any] | None = None,
               model: dict[str, Any] | None = None, storage: dict[str, Any] | None = None,
               shards: dict[str, Any] | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "schema.json").write_text(json.dumps(SIMPLE_SCHEMA))
    spec = {
        "name": "lake-job",
        "input": {"path": input_path, "id_field": "id", **({"storage": storage} if storage else {})},
        "model": {"engine": "synthetic", "options": options or {}, **(model or {})},
        "prompt": {"text": "Classify.\n", "version": "v1"},
        "output": {"schema": "schema.json"},
        "shards": {"size": SHARD, "lease_seconds": 60, "renew_seconds": 1, "batch_size": 4,
                   "record_timeout_seconds": 1.0, "batch_timeout_seconds": 1.0, "grace_seconds": 5, **(shards or {})},
    }
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def planned_spec(path: Path, store: Store) -> tuple[Any, str]:
    spec = load_spec(path)
    return spec, plan(spec, store).version


def partly_done(store: Store, version: str, not_owner: str | None = None) -> Any:
    """A leased shard partly answered, held by someone other than `not_owner` (a killed
    worker's shard stays leased to it until its lease expires)."""
    for row in store.shard_rows(version):
        if row.state == "leased" and 0 < row.results < row.record_count - 20 and row.owner != not_owner:
            return row
    return None


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_workers_killed_and_stalled_over_s3_objects_leave_one_outcome_per_record(
        lake_env: S3StandIn, store: Store, store_url: str, tmp_path: Path, fmt: str) -> None:
    bucket = lake_env.bucket(versioned=fmt == "csv")
    half = N // 2
    records = make_records(N)
    # Two objects of the input, named by a glob.
    bucket.put(f"in/part-0.{fmt}", encode(records[:half], fmt))
    bucket.put(f"in/part-1.{fmt}", encode(records[half:], fmt))
    spec, version = planned_spec(write_spec(tmp_path / "job", bucket.url(f"in/part-*.{fmt}"),
                                            options={"seconds_per_record": 0.004}), store)
    assert len(spec.input.locations) == 2 and store.job(version).shard_count == N // SHARD  # type: ignore[union-attr]
    procs = [start_worker(store_url, version, tmp_path / f"w{i}.log") for i in range(2)]
    try:
        # kill -9 one worker mid-shard.
        killed_row = wait_for(lambda: partly_done(store, version), what="a shard partly done")
        kill_9(owner_pid(killed_row.owner))
        # SIGSTOP the other past its lease, and let a rescuer take its shard.
        stalled_row = wait_for(lambda: partly_done(store, version, not_owner=killed_row.owner),
                               what="the other worker's shard partly done")
        stalled = next(p for p in procs if p.pid == owner_pid(stalled_row.owner))
        with stopped(stalled.pid, store):
            rescue_stalled_shard(store, store_url, version, stalled_row.shard_no, procs, tmp_path / "rescuer.log")
        sealed_and_gone(store, version, stalled)
    finally:
        stop_all(procs)
    _results, dead = check_invariants(store, version, spec)
    assert dead == set()
    expired = {(e.shard_no, e.worker) for e in store.events(version, ["lease_expired"])}
    assert {(killed_row.shard_no, killed_row.owner), (stalled_row.shard_no, stalled_row.owner)} <= expired
    assert [e for e in store.events(version, ["stale_epoch"]) if e.worker == stalled_row.owner]


def test_a_worker_killed_over_an_iceberg_snapshot_in_s3_leaves_one_outcome_per_record(
        lake_env: S3StandIn, store: Store, store_url: str, tmp_path: Path) -> None:
    bucket = lake_env.bucket()
    records = make_records(N)
    # The table's warehouse is in the stand-in: two data files of row groups of SHARD rows.
    make_source(store_url, tmp_path, records[:N // 2], records[N // 2:], warehouse=bucket.url("wh"),
                row_group_rows=SHARD)
    call_log = tmp_path / "calls.log"
    path = write_spec(tmp_path / "job", "unused", options={"seconds_per_record": 0.004, "call_log": str(call_log)})
    text = yaml.safe_load(path.read_text())
    text["input"] = {"table": {"catalog": "store", "name": SOURCE}, "id_field": "id", "acl_field": "acl"}
    path.write_text(yaml.safe_dump(text))
    spec, version = planned_spec(path, store)
    slices = {s["path"] for s in store_slices(store, version)}
    assert len(slices) == 2 and all(p.startswith(f"s3://{bucket.name}/wh/") for p in slices)
    assert store.job(version).shard_count == N // SHARD  # type: ignore[union-attr]
    procs = [start_worker(store_url, version, tmp_path / f"w{i}.log") for i in range(2)]
    try:
        victim_row = wait_for(lambda: partly_done(store, version), what="a shard partly done")
        victim = owner_pid(victim_row.owner)
        kill_9(victim)
        in_flight = set(call_counts(call_log)) - stored_ids(store, version)
        # The survivor (or this replacement) proves the victim dead and takes its lease back.
        procs.append(start_worker(store_url, version, tmp_path / "w-replacement.log"))
        wait_for(lambda: sealed(store, version), timeout=180, what="the job to seal")
    finally:
        stop_all(procs)
    results, dead = check_invariants(store, version, spec)
    assert dead == set() and len(results) == N
    assert {r.acl.groups[0] for r in store.iter_results(version)} == {"group-0", "group-1", "group-2"}
    [taken] = store.events(version, ["take_back"])
    assert (taken.shard_no, taken.worker, taken.detail["proof"]["pid"]) == (
        victim_row.shard_no, victim_row.owner, victim)
    asked_again = {rid for rid, n in call_counts(call_log).items() if n > 1}
    assert asked_again <= in_flight, f"recomputed records that were already stored: {asked_again - in_flight}"


def test_an_object_overwritten_after_planning_is_refused_by_key_and_nothing_is_written(
        lake_env: S3StandIn, store: Store, store_url: str, tmp_path: Path) -> None:
    bucket = lake_env.bucket()
    data = encode(make_records(150), "jsonl")
    url = bucket.put("in/tickets.jsonl", data)
    _spec, version = planned_spec(write_spec(tmp_path / "job", url), store)
    bucket.put("in/tickets.jsonl", data.replace(b"record number 3 ", b"record number X "))
    log = tmp_path / "w.log"
    assert start_worker(store_url, version, log).wait(timeout=60) == 3
    assert f"input changed since planning: {url}" in log.read_text()
    assert not list(store.iter_results(version))
    [refused] = store.events(version, ["input_changed"])
    assert url in refused.detail["error"]
    assert all(r.state == "ready" for r in store.shard_rows(version))


def test_a_worker_cut_off_from_the_store_gives_its_shard_back_and_exits_75(
        lake_env: S3StandIn, s3_proxy: FaultProxy, store: Store, store_url: str, tmp_path: Path) -> None:
    bucket = lake_env.bucket()
    url = bucket.put("in/tickets.jsonl", encode(make_records(200), "jsonl"))
    _spec, version = planned_spec(write_spec(tmp_path / "job", url,
                                             storage={"timeout_seconds": 0.5, "unavailable_seconds": 3}), store)
    s3_proxy.throttle(1_000_000)
    log = tmp_path / "w.log"
    assert start_worker(store_url, version, log).wait(timeout=60) == 75
    text = log.read_text()
    assert "given back, its input cannot be read now" in text and "503" in text
    [released] = store.events(version, ["release"])
    assert released.detail["reason"] == "input_unavailable"
    assert store.events(version, ["input_unavailable"])
    assert not store.events(version, ["attempt_failed"]) and not list(store.iter_dead_letters(version))
    assert all(r.state == "ready" for r in store.shard_rows(version))
    # The store answers again: the next worker does the whole job, nothing was charged.
    s3_proxy.throttle(0)
    assert start_worker(store_url, version, tmp_path / "w2.log").wait(timeout=120) == 0
    assert sealed(store, version)


def test_a_job_over_gcs_objects_named_by_a_manifest(gcs_standin: GCSStandIn, monkeypatch: pytest.MonkeyPatch,
                                                    store: Store, store_url: str, tmp_path: Path) -> None:
    for key, value in gcs_standin.env().items():
        monkeypatch.setenv(key, value)
    bucket = gcs_standin.bucket(versioned=True)
    records = make_records(400)
    bucket.put("in/a.jsonl", encode(records[:200], "jsonl"))
    bucket.put("in/b.jsonl", encode(records[200:], "jsonl"))
    manifest = bucket.put("manifests/today.txt", b"in/a.jsonl\nin/b.jsonl\n")
    path = write_spec(tmp_path / "job", "unused")
    text = yaml.safe_load(path.read_text())
    text["input"] = {"manifest": manifest, "id_field": "id"}
    path.write_text(yaml.safe_dump(text))
    spec, version = planned_spec(path, store)
    assert spec.input.locations == (bucket.url("in/a.jsonl"), bucket.url("in/b.jsonl"))
    workers_until_done(store_url, version, tmp_path, timeout=120)
    assert sealed(store, version)
    check_invariants(store, version, spec)


def test_a_worker_with_nothing_of_the_planning_machine_completes_a_job_of_objects(
        lake_env: S3StandIn, store: Store, store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bucket = lake_env.bucket(versioned=True)
    records = make_records(300)
    bucket.put("in/tickets.parquet", encode(records, "parquet"))
    weights = os.urandom(300_000)
    bucket.put("models/tiny.bin", weights)
    digest = "sha256:" + hashlib.sha256(weights).hexdigest()
    planning = tmp_path / "planning"
    spec, version = planned_spec(write_spec(planning, bucket.url("in/tickets.parquet"),
                                            model={"path": bucket.url("models/tiny.bin"), "digest": digest}), store)
    # The planning machine's folder is gone, and the worker runs elsewhere with its own cache.
    shutil.rmtree(planning)
    node = tmp_path / "node"
    node.mkdir()
    monkeypatch.setenv("BATCHLINE_CACHE_DIR", str(node / "cache"))
    assert start_worker(store_url, version, node / "w.log", cwd=node).wait(timeout=120) == 0
    assert sealed(store, version)
    check_invariants(store, version, spec)
    cached = node / "cache" / "weights" / digest.removeprefix("sha256:") / "tiny.bin"
    assert cached.read_bytes() == weights
