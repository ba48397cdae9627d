"""A worker is untrusted (I8): what it records of its shard's file is checked against the store
before anything of it is published. A worker (under the role `batchline grants` makes, on
PostgreSQL) completes a shard recording a forged file: a path outside the staging prefix, its
own file with an empty pin, a file of as many rows whose ACLs are wider, a file missing one
record, a file of another shard. Each is refused at validation, naming the shard and the file;
publish refuses it too (with --force, by its own check), and nothing is published. And `forget`
never deletes a file outside the version's own prefixes."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from batchline.check.validate import validate
from batchline.errors import BatchlineError
from batchline.publish.pointer import publish
from batchline.spec import JobVersion, stored_spec
from batchline.store import Store
from batchline.targets import targets_for
from batchline.targets.files import ShardFileRefused, version_prefix, whole_pin
from batchline.worker.supervisor import Worker
from tests.helpers import make_records, planned
from tests.iceberg_support import main_rows, pyiceberg_table
from tests.stores import SQLITE, WORKER_ROLE

TABLE = "lake.trusted"
N, SHARD, FORGED = 200, 50, 2
# SQLite, and PostgreSQL with every worker call under the version's worker role.
AS_WORKER = [SQLITE, pytest.param(WORKER_ROLE, marks=pytest.mark.postgres)]


@pytest.fixture(params=AS_WORKER)
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def per_shard(job_factory: Any, tmp_path: Path) -> Path:
    records = [{**r, "acl": [f"team-{i % 3}"]} for i, r in enumerate(make_records(N))]
    path = job_factory(records, shards={"size": SHARD, "lease_seconds": 30})
    spec = yaml.safe_load(path.read_text())
    spec["output"]["table"] = {"catalog": "store", "name": TABLE, "warehouse": str(tmp_path / "wh"),
                               "files": "per-shard"}
    path.write_text(yaml.safe_dump(spec))
    return path


def pinned(path: Path) -> dict[str, Any]:
    import hashlib

    data = path.read_bytes()
    return whole_pin(len(data), hashlib.sha256(data).hexdigest())


def rewrite(path: Path, change: Callable[[pa.Table], pa.Table]) -> dict[str, Any]:
    """The file at `path` rewritten as `change` makes its rows; what a worker would record of it."""
    table = change(pq.read_table(path))
    pq.write_table(table, path)
    return {"path": str(path), "rows": table.num_rows, "pin": pinned(path)}


def outside(entry: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    foreign = tmp_path / "elsewhere" / "shard.parquet"
    foreign.parent.mkdir()
    shutil.copy(entry["path"], foreign)
    return {**entry, "path": str(foreign), "pin": pinned(foreign)}


def wider_acls(entry: dict[str, Any], _tmp_path: Path) -> dict[str, Any]:
    def widen(t: pa.Table) -> pa.Table:
        acl = pa.array([["team-0", "team-1", "team-2", "everyone"]] * t.num_rows, type=t.schema.field("acl").type)
        return t.set_column(t.schema.get_field_index("acl"), "acl", acl)

    return rewrite(Path(entry["path"]), widen)


def one_missing(entry: dict[str, Any], _tmp_path: Path) -> dict[str, Any]:
    return rewrite(Path(entry["path"]), lambda t: t.slice(1))


def another_shards(entry: dict[str, Any], _tmp_path: Path) -> dict[str, Any]:
    other = sorted(Path(entry["path"]).parent.glob("shard-000001-*.parquet"))[0]
    shutil.copy(other, entry["path"])
    return {**entry, "pin": pinned(Path(entry["path"]))}


def empty_pin(entry: dict[str, Any], _tmp_path: Path) -> dict[str, Any]:
    return {**entry, "pin": {}}


FORGERIES: dict[str, tuple[Callable[[dict[str, Any], Path], dict[str, Any]], str]] = {
    "a path outside the staging prefix": (outside, r"recorded it at .*elsewhere/shard.parquet, not at .*"
                                                   r"shard-000002-epoch-1\.parquet"),
    "its own file with an empty pin": (empty_pin, "its pin as its worker recorded it lacks its size or digest"),
    "a file of as many rows with wider ACLs": (wider_acls, r"its acl of 'r000100' is \['team-0', 'team-1', "
                                                           r"'team-2', 'everyone'\], the store's \['team-1'\]"),
    "a file missing one record": (one_missing, "it lacks 'r000100', which the store holds in this shard"),
    "a file of another shard": (another_shards, "it holds 'r000050'.*which the store does not hold in this shard"),
}


class Forging:
    """A worker's store through which shard FORGED's completion records what `forge` makes of the
    file its worker wrote (the worker's calls go through the version's role, where there is one)."""

    def __init__(self, store: Store, forge: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        self._store = store
        self._forge = forge

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def complete(self, lease: Any, files: Any = None) -> None:
        if lease.shard_no == FORGED and files:
            files = {key: self._forge(dict(entry)) for key, entry in files.items()}
        self._store.complete(lease, files)


def forged_version(job_factory: Any, store: Store, tmp_path: Path,
                   forge: Callable[[dict[str, Any], Path], dict[str, Any]]) -> str:
    _spec, version = planned(per_shard(job_factory, tmp_path), store)
    worker = Worker(Forging(store, lambda entry: forge(entry, tmp_path)), version=version,  # type: ignore[arg-type]
                    poll_seconds=0.1)
    assert worker.run() == 0
    job = store.job(version)
    assert job is not None and job.state == "sealed"
    return version


def nothing_published(store: Store, store_url: str, version: str) -> None:
    assert store.resolve_name("test-job") is None
    table = pyiceberg_table(store_url, TABLE)
    assert table is None or version not in table.metadata.refs


@pytest.mark.parametrize("forgery", list(FORGERIES))
def test_a_forged_shard_file_is_refused_at_validation_by_name_and_nothing_is_published(
        forgery: str, job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    forge, why = FORGERIES[forgery]
    version = forged_version(job_factory, store, tmp_path, forge)
    report = validate(store, version)
    assert not report.passed
    [check] = [c for c in report.checks if c.name == "shard_files"]
    assert not check.passed and len(check.details["refused"]) == 1
    [refused] = check.details["refused"]
    assert f"the file of shard {FORGED}, " in refused and ".parquet: " in refused
    assert re.search(why, refused), refused
    with pytest.raises(BatchlineError, match="failed its latest validation \\(shard_files\\)"):
        publish(store, version)
    # Published anyway, on the owner's word: the publisher checks the files itself and refuses.
    with pytest.raises(ShardFileRefused, match=f"the file of shard {FORGED}, .*nothing was published"):
        publish(store, version, force=True, reason="the owner says so")
    nothing_published(store, store_url, version)


def test_the_shard_file_check_exits_as_a_failed_gate_in_one_line(job_factory: Any, store: Store, store_url: str,
                                                                    tmp_path: Path) -> None:
    version = forged_version(job_factory, store, tmp_path, wider_acls)
    done = subprocess.run([sys.executable, "-m", "batchline", "publish", version, "--store", store_url,
                           "--force", "--reason", "test"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    [line] = [x for x in done.stderr.splitlines() if x.strip()]
    assert f"the file of shard {FORGED}, " in line and "its acl of 'r000100'" in line
    nothing_published(store, store_url, version)


def test_a_file_swapped_after_validation_is_refused_by_publish(job_factory: Any, store: Store, store_url: str,
                                                                 tmp_path: Path) -> None:
    _spec, version = planned(per_shard(job_factory, tmp_path), store)
    assert Worker(store, version=version, poll_seconds=0.1).run() == 0
    assert validate(store, version).passed
    [unit] = [u for u in store.shard_units(version) if u.shard_no == FORGED]
    assert unit.files is not None
    path = Path(next(iter(unit.files.values()))["path"])
    wider_acls({"path": str(path)}, tmp_path)  # the same path, other bytes, after the check
    with pytest.raises(ShardFileRefused, match=rf"shard {FORGED} of {version}, {path}, its (size|digest) is .*as the check "
                                               "recorded it; nothing was published"):
        publish(store, version)
    nothing_published(store, store_url, version)


def test_forget_never_deletes_a_file_outside_the_versions_own_prefixes(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    """A branch that holds a foreign file (as a table written before files were checked might):
    forgetting the version deletes its own files and leaves the foreign one in place."""
    from pyiceberg.io.pyarrow import parquet_file_to_data_file

    _spec, version = planned(per_shard(job_factory, tmp_path), store)
    assert Worker(store, version=version, poll_seconds=0.1).run() == 0
    assert validate(store, version).passed
    job = JobVersion.of(store, version)
    [target] = targets_for(stored_spec(job.info), store_url)
    assert target.stage(store, job)
    own = sorted((tmp_path / "wh" / "batchline-staging" / version).glob("*.parquet"))
    foreign = tmp_path / "someone-elses" / "data.parquet"
    foreign.parent.mkdir()
    shutil.copy(own[0], foreign)
    table = pyiceberg_table(store_url, TABLE)
    with table.transaction() as txn, txn.update_snapshot(branch=version).fast_append() as append:
        append.append_data_file(parquet_file_to_data_file(table.io, table.metadata, f"file://{foreign}"))
    (tmp_path / "wh" / "batchline-staging" / "other-version").mkdir()
    neighbour = tmp_path / "wh" / "batchline-staging" / "other-version" / "shard-000000-epoch-1.parquet"
    shutil.copy(own[0], neighbour)
    target.forget("test-job", version)
    assert foreign.exists() and neighbour.exists()
    assert not any(p.exists() for p in own)
    assert version_prefix(str(tmp_path / "wh" / "batchline-staging"), version).endswith(f"/{version}/")


@pytest.mark.parametrize("schema", [
    None,  # the tests' schema: strings only, read by Arrow's JSON reader
    {"type": "object", "properties": {"category": {"type": "string"}, "count": {"type": "integer"},
                                      "extra": {}}, "required": ["category"]},  # a long and a JSON column
])
def test_the_rows_a_file_is_checked_against_are_the_rows_its_worker_writes(
        schema: dict[str, Any] | None, job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    """The check reads the store a column at a time; the worker writes from row objects: for every
    shard, results and dead letters alike, the two make the same table."""
    path = per_shard(job_factory, tmp_path)
    if schema is not None:
        spec = yaml.safe_load(path.read_text())
        (path.parent / "schema.json").write_text(__import__("json").dumps(schema))
        path.write_text(yaml.safe_dump(spec))
    spec_dict = yaml.safe_load(path.read_text())
    spec_dict["model"]["options"] = {"error_on": ["r000007", "r000120"]}
    spec_dict.setdefault("validate", {})["max_dead_letter_rate"] = 0.5
    path.write_text(yaml.safe_dump(spec_dict))
    _spec, version = planned(path, store)
    assert Worker(store, version=version, poll_seconds=0.1).run() == 0
    job = JobVersion.of(store, version)
    [output] = job.spec.targets
    stored = output.stored_shard_rows(store, job.spec, version)
    shards = [u.shard_no for u in store.shard_units(version)]
    for shard_no in shards:
        written = output.shard_rows(job.spec, version, *store.shard_outcomes(version, shard_no, computed_only=True))
        assert stored(shard_no).equals(written), shard_no
    assert sum(stored(n).num_rows for n in shards) == N
    assert validate(store, version).passed


class StopsAtHome:
    """A worker's store that gives back a shard of another region and stops its worker: the
    region's workers end where its own shards do."""

    def __init__(self, store: Store, region: str, stop: Any) -> None:
        self._store, self._region, self._stop = store, region, stop

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def claim(self, *args: Any, **kwargs: Any) -> Any:
        lease = self._store.claim(*args, **kwargs)
        if lease is not None and lease.home != self._region:
            self._store.release(lease, "test")
            self._stop.set()
            return None
        return lease


def two_regions(job_factory: Any, tmp_path: Path) -> Path:
    """The per-shard table over an input split between east and west, staged per region."""
    path = per_shard(job_factory, tmp_path)
    spec = yaml.safe_load(path.read_text())
    records = [{**r, "acl": [f"team-{i % 3}"]} for i, r in enumerate(make_records(N))]
    halves = {"east": records[:N // 2], "west": records[N // 2:]}
    for region, rows in halves.items():
        (tmp_path / f"{region}.jsonl").write_text("".join(__import__("json").dumps(r) + "\n" for r in rows))
    spec["input"].pop("path")
    spec["input"]["regions"] = {region: str(tmp_path / f"{region}.jsonl") for region in halves}
    spec["output"]["table"]["staging"] = {region: str(tmp_path / f"staging-{region}") for region in halves}
    path.write_text(yaml.safe_dump(spec))
    return path


def test_each_regions_workers_stage_their_files_in_their_region_and_one_commit_publishes_them_all(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    import threading

    _spec, version = planned(two_regions(job_factory, tmp_path), store)
    stop = threading.Event()
    east = Worker(StopsAtHome(store, "east", stop), version=version, poll_seconds=0.1,  # type: ignore[arg-type]
                  region="east", stop=stop)
    assert east.run() == 75  # stopped at the first shard of the west
    assert Worker(store, version=version, poll_seconds=0.1, region="west").run() == 0
    staged = {region: sorted(p.name for p in (tmp_path / f"staging-{region}" / version).glob("*.parquet"))
              for region in ("east", "west")}
    assert staged == {"east": [f"shard-00000{i}-epoch-1.parquet" for i in (0, 1)],
                      "west": ["shard-000002-epoch-2.parquet", "shard-000003-epoch-1.parquet"]}
    assert validate(store, version).passed
    publish(store, version)
    table = pyiceberg_table(store_url, TABLE)
    assert table is not None
    files = [task.file.file_path for task in table.scan().plan_files()]
    # One snapshot added the files of both regions.
    assert len(files) == 4 and table.current_snapshot().summary["added-data-files"] == "4"
    # The publisher's copies of both regions' files, under the table's own location.
    location = table.metadata.location.removeprefix("file://")
    assert sorted(f.removeprefix("file://") for f in files) == \
        [f"{location}/data/batchline-shards/{version}/{name}" for name in sorted(staged["east"] + staged["west"])]


def test_a_file_staged_under_another_regions_prefix_than_its_shard_ran_in_is_refused(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    """The prefix a shard's file must be under is the store's word (where its completing lease
    was claimed), not the worker's: an east worker's file recorded under the west's staging."""
    _spec, version = planned(two_regions(job_factory, tmp_path), store)

    def move_west(entry: dict[str, Any]) -> dict[str, Any]:
        moved = Path(str(entry["path"]).replace("staging-east", "staging-west"))
        moved.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(entry["path"], moved)
        return {**entry, "path": str(moved)}

    assert Worker(Forging(store, move_west), version=version, poll_seconds=0.1,  # type: ignore[arg-type]
                  region="east").run() == 0
    report = validate(store, version)
    [check] = [c for c in report.checks if c.name == "shard_files"]
    [refused] = check.details["refused"]
    assert re.search(rf"the file of shard {FORGED}, .*staging-west/.*: .*recorded it at .*staging-west/.*, not at "
                     rf".*staging-east/{re.escape(version)}/shard-000002-epoch-1\.parquet", refused), refused


# --- what is read after publish: the publisher's copy, out of the worker's reach ------------------


def same_size(path: Path, change: Callable[[pa.Table], pa.Table]) -> None:
    """The file at `path` rewritten as `change` makes its rows, padded (in its footer's key-value
    metadata) to the size it had: what a worker with its staging credential could put there to
    pass a check of sizes alone."""
    size = path.stat().st_size
    table = change(pq.read_table(path))
    pad = 0
    for _try in range(20):
        # Without statistics the rewrite is smaller than the worker's file; a footer-only key's
        # padding then counts once.
        with pq.ParquetWriter(path, table.schema, write_statistics=False, compression="zstd") as writer:
            writer.write_table(table)
            writer.add_key_value_metadata({"pad": "x" * pad})
        now = path.stat().st_size
        if now == size:
            return
        pad = max(0, pad + size - now)
    raise AssertionError(f"could not rewrite {path} at {size} bytes")


def widen(t: pa.Table) -> pa.Table:
    acl = pa.array([["everyone"]] * t.num_rows, type=t.schema.field("acl").type)
    return t.set_column(t.schema.get_field_index("acl"), "acl", acl)


def records_acls() -> dict[str, list[str]]:
    return {r["id"]: [f"team-{i % 3}"] for i, r in enumerate(make_records(N))}


def staged_file(store: Store, version: str, shard_no: int) -> Path:
    [unit] = [u for u in store.shard_units(version) if u.shard_no == shard_no]
    assert unit.files is not None
    return Path(next(iter(unit.files.values()))["path"])


def test_a_shard_file_rewritten_after_publish_at_the_same_size_with_wider_acls_is_never_read(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    """Iceberg records only a data file's path: were it the worker's, the worker's rewrite after
    publish would be what DuckDB reads. The table names the publisher's copy; the Parquet CURRENT
    is written from the store."""
    import duckdb

    path = per_shard(job_factory, tmp_path)
    spec = yaml.safe_load(path.read_text())
    spec["output"]["dataset"] = str(tmp_path / "exports")
    path.write_text(yaml.safe_dump(spec))
    _spec, version = planned(path, store)
    assert Worker(store, version=version, poll_seconds=0.1).run() == 0
    assert validate(store, version).passed
    publish(store, version)
    staged = staged_file(store, version, FORGED)
    before = staged.stat().st_size
    same_size(staged, widen)  # the worker's credential still covers its staging prefix
    assert staged.stat().st_size == before and pq.read_table(staged).column("acl").to_pylist()[0] == ["everyone"]
    want = records_acls()
    table_acls = dict(main_rows(store_url, TABLE, "id, acl"))
    assert table_acls == want
    table = pyiceberg_table(store_url, TABLE)
    files = [t.file.file_path.removeprefix("file://") for t in table.scan().plan_files()]
    location = table.metadata.location.removeprefix("file://")
    assert files and all(f.startswith(f"{location}/data/batchline-shards/{version}/") for f in files)
    assert str(staged) not in files
    current = (tmp_path / "exports" / "test-job" / "CURRENT").read_text().strip()
    con = duckdb.connect()
    try:
        rows = con.execute(f"SELECT id, acl FROM read_parquet('{tmp_path / 'exports' / 'test-job' / current}/*.parquet')"
                           ).fetchall()
    finally:
        con.close()
    assert dict(rows) == want


def test_a_shard_file_rewritten_between_validate_and_publish_at_the_same_size_is_refused_by_name(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    _spec, version = planned(per_shard(job_factory, tmp_path), store)
    assert Worker(store, version=version, poll_seconds=0.1).run() == 0
    assert validate(store, version).passed
    staged = staged_file(store, version, FORGED)
    same_size(staged, widen)
    with pytest.raises(ShardFileRefused, match=rf"the file of shard {FORGED} of {version}, {staged}, its digest is .* "
                                               "as the check recorded it; nothing was published"):
        publish(store, version)
    nothing_published(store, store_url, version)
    location = pyiceberg_table(store_url, TABLE).metadata.location.removeprefix("file://")
    assert not (Path(location) / "data" / "batchline-shards" / version / staged.name).exists()


def test_a_staging_prefix_that_holds_the_warehouse_is_refused_when_the_spec_is_read(
        job_factory: Any, store: Store, tmp_path: Path) -> None:
    path = per_shard(job_factory, tmp_path)
    spec = yaml.safe_load(path.read_text())
    spec["output"]["table"]["staging"] = str(tmp_path)  # the warehouse, tmp_path/wh, lies under it
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(BatchlineError, match=r"output\.table\.staging.*holds the warehouse"):
        planned(path, store)


def test_grants_never_give_a_worker_the_location_of_the_published_copies(
        job_factory: Any, store: Store, tmp_path: Path) -> None:
    from batchline.ops.grants import snapshot_access

    _spec, version = planned(per_shard(job_factory, tmp_path), store)
    info = store.job(version)
    assert info is not None
    [line] = [x for x in snapshot_access(dict(info.spec)) if x.startswith(f"output table {TABLE}")]
    worker, publisher = line.split("; the publisher", 1)
    staging = str(tmp_path / "wh" / "batchline-staging")
    assert f"write objects under {staging}/VERSION/" in worker and "nothing under the table's location" in worker
    assert "data/batchline-shards/" in publisher
    assert not str(tmp_path / "wh" / "lake").startswith(f"{staging}/")
