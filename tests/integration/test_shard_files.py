"""Shard files written by the workers (`output.table.files: per-shard`): each completing worker
writes its shard's file, named by the version, the shard and the lease epoch, into the staging
prefix, and the store records it in the step that completes the shard; publishing copies each
checked file into the table's own location, out of the workers' reach, and adds the copies in
one commit. The faults: a publisher killed after the
catalog commit, a worker killed between its file and its completion, a file deleted or altered
before publishing, a staging prefix that cannot be written. On both stores."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from batchline.check.validate import validate
from batchline.errors import BatchlineError
from batchline.publish.pointer import publish
from batchline.spec import JobVersion, stored_spec
from batchline.store import Store
from batchline.targets import targets_for
from batchline.worker.supervisor import Worker
from tests.helpers import make_records, planned, run_to_seal, start_worker, stop_all
from tests.iceberg_support import main_rows, pyiceberg_table

TABLE = "lake.results"
N, SHARD = 300, 50


def per_shard(job_factory: Any, tmp_path: Path, *, staging: str | None = None, **kwargs: Any) -> Path:
    path = job_factory(make_records(N), shards={"size": SHARD, "lease_seconds": 30}, **kwargs)
    spec = yaml.safe_load(path.read_text())
    spec["output"]["table"] = {"catalog": "store", "name": TABLE, "warehouse": str(tmp_path / "wh"),
                               "files": "per-shard", **({"staging": staging} if staging else {})}
    path.write_text(yaml.safe_dump(spec))
    return path


def recorded(store: Store, version: str) -> dict[int, str]:
    """The shard file the store recorded for each shard."""
    return {u.shard_no: next(iter(u.files.values()))["path"] for u in store.shard_units(version) if u.files}


def main_files(store_url: str) -> list[str]:
    table = pyiceberg_table(store_url, TABLE)
    snapshot = table.metadata.current_snapshot()
    return [e.data_file.file_path.removeprefix("file://") for m in snapshot.manifests(table.io)
            for e in m.fetch_manifest_entry(table.io)]


def test_workers_write_each_shards_file_and_publishing_adds_a_copy_of_each_out_of_their_reach(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    _spec, version = planned(per_shard(job_factory, tmp_path, options={"error_on": ["r000007"]},
                                      validate={"max_dead_letter_rate": 0.5}), store)
    procs = [start_worker(store_url, version, tmp_path / f"w{i}.log") for i in range(2)]
    try:
        for p in procs:
            assert p.wait(timeout=180) == 0
    finally:
        stop_all(procs)
    files = recorded(store, version)
    staging = tmp_path / "wh" / "batchline-staging" / version
    # Every shard has its file, those an idle worker split off its peer's included.
    assert sorted(files) == [u.shard_no for u in store.shard_units(version)]
    assert len(files) >= N // SHARD
    epochs = {row.shard_no: row.epoch for row in store.shard_rows(version)}
    assert all(Path(p).parent == staging and Path(p).name == f"shard-{s:06d}-epoch-{epochs[s]}.parquet"
               for s, p in files.items())
    assert validate(store, version).passed
    publish(store, version)
    # The publisher's copies, byte for byte the workers' files, under the table's own location.
    location = pyiceberg_table(store_url, TABLE).metadata.location.removeprefix("file://")
    copies = {f"{location}/data/batchline-shards/{version}/{Path(p).name}": p for p in files.values()}
    assert sorted(main_files(store_url)) == sorted(copies)
    assert all(Path(c).read_bytes() == Path(p).read_bytes() for c, p in copies.items())
    rows = main_rows(store_url, TABLE, "id, outcome")
    assert len(rows) == N and len({r[0] for r in rows}) == N
    assert dict(rows)["r000007"] == "dead_letter"


def test_a_publisher_killed_after_the_catalog_commit_publishes_again_and_adds_no_file_twice(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    _spec, version = planned(per_shard(job_factory, tmp_path), store)
    run_to_seal(store, version)
    assert validate(store, version).passed
    info = store.job(version)
    assert info is not None
    [target] = targets_for(stored_spec(info), store_url)
    # What publish does before the store records it, then the publisher is gone.
    assert target.stage(store, JobVersion.of(store, version))
    target.show(info.name, version, None)
    assert store.resolve_name(info.name) is None
    assert target.stage(store, JobVersion.of(store, version)) is False  # its branch's commit is found: nothing is added again
    publish(store, version)
    assert store.resolve_name(info.name) == version
    files = main_files(store_url)
    assert len(files) == len(set(files)) == N // SHARD
    rows = main_rows(store_url, TABLE, "id")
    assert len(rows) == len({r[0] for r in rows}) == N


class Killed(BaseException):
    """The worker's process is gone: nothing after it runs."""


class KilledBeforeCompleting:
    """The worker's store, through which its first completion never happens: killed after its
    shard file is written and before the store records it."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def complete(self, lease: Any, files: Any = None) -> None:
        assert files, "the file is written before the completion"
        raise Killed


def test_a_worker_killed_between_its_shard_file_and_its_completion_leaves_a_file_nothing_uses(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    _spec, version = planned(per_shard(job_factory, tmp_path), store)
    with pytest.raises(Killed):
        Worker(KilledBeforeCompleting(store), version=version, poll_seconds=0.1).run()  # type: ignore[arg-type]
    staging = tmp_path / "wh" / "batchline-staging" / version
    [stale] = list(staging.iterdir())
    assert stale.name == "shard-000000-epoch-1.parquet" and recorded(store, version) == {}
    store.shift_clock(31)  # its lease runs out; the next owner does the shard again
    run_to_seal(store, version)
    assert recorded(store, version)[0].endswith("shard-000000-epoch-2.parquet")
    assert validate(store, version).passed
    publish(store, version)
    assert str(stale) not in main_files(store_url)
    rows = main_rows(store_url, TABLE, "id")
    assert len(rows) == len({r[0] for r in rows}) == N
    assert stale.exists()  # written less than a lease ago: a stale owner might still be writing it


def test_an_orphan_older_than_a_lease_is_removed_when_the_version_is_published(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    _spec, version = planned(per_shard(job_factory, tmp_path), store)
    run_to_seal(store, version)
    staging = tmp_path / "wh" / "batchline-staging" / version
    orphan = staging / "shard-000003-epoch-7.parquet"
    orphan.write_bytes((staging / "shard-000003-epoch-1.parquet").read_bytes())
    os.utime(orphan, (0, 0))
    assert validate(store, version).passed
    publish(store, version)
    # The orphan is gone; the checked files, copied, stay until the version is forgotten (those
    # staged less than a lease ago) or go now (older ones, as the orphan).
    assert not orphan.exists() and len(list(staging.iterdir())) == N // SHARD


@pytest.mark.parametrize("fault", ["deleted", "altered"])
def test_a_shard_file_deleted_or_altered_before_publish_is_refused_by_name_and_nothing_is_published(
        fault: str, job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    _spec, version = planned(per_shard(job_factory, tmp_path), store)
    run_to_seal(store, version)
    assert validate(store, version).passed
    path = Path(recorded(store, version)[2])
    if fault == "deleted":
        path.unlink()
    else:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    with pytest.raises(BatchlineError, match=rf"the file of shard 2 of {version}, {path}, .*nothing was published"):
        publish(store, version)
    assert store.resolve_name("test-job") is None
    table = pyiceberg_table(store_url, TABLE)
    assert version not in table.metadata.refs


def test_a_staging_prefix_that_cannot_be_written_exits_73_in_one_line_and_nothing_is_published(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the staging prefix's folder would be")
    _spec, version = planned(per_shard(job_factory, tmp_path, staging=str(blocked / "staging")), store)
    done = subprocess.run([sys.executable, "-m", "batchline", "worker", "--store", store_url, "--job", version],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 73, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "cannot write the file of shard 0" in errors[0] and "Traceback" not in done.stderr
    job = store.job(version)
    assert job is not None and job.state == "ready"
    [given_back] = store.events(version, ["release"])
    assert given_back.detail["reason"] == "output_unwritable"
    assert store.status(version).results > 0  # its results stay, for the worker that completes the shard
