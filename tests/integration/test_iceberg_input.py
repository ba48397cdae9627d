"""An Iceberg table's snapshot as a job's input: pinned by the table's UUID and snapshot id,
planned as ranges of its data files, read by workers without the catalog; delete files,
renamed columns and catalog addresses that hold credentials refused. On both stores (the
catalog is a SQL catalog in the store's database, or one named in the environment)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from batchline.errors import InputError, SpecError
from batchline.plan.planner import plan
from batchline.snapshot import Slice, file_digest
from batchline.sources.iceberg import TableRef, TableSource, open_catalog, sqlalchemy_uri
from batchline.spec import load_spec, parse_spec, stored_spec
from batchline.store import Store
from tests.helpers import make_records, run_to_seal
from tests.integration.lake.support import S3StandIn

SOURCE = "src.tickets"
ARROW = pa.schema([("id", pa.string()), ("text", pa.string()), ("acl", pa.list_(pa.string()))])


def source_ref(tmp_path: Path, warehouse: str | None = None) -> TableRef:
    return TableRef("store", SOURCE, warehouse=warehouse or f"file://{tmp_path / 'source-wh'}")


def make_source(store_url: str, tmp_path: Path, *batches: list[dict[str, Any]], warehouse: str | None = None,
                storage: dict[str, Any] | None = None, row_group_rows: int | None = None) -> Any:
    """A table in the store's own catalog with one data file per batch, its files in
    `warehouse` (a local folder by default), reached with the lake settings `storage`;
    `row_group_rows` cuts data files into row groups of that many rows (a shard of a
    Parquet object is whole row groups)."""
    properties = {} if row_group_rows is None else {"write.parquet.row-group-limit": str(row_group_rows)}
    with open_catalog(source_ref(tmp_path, warehouse), store_url, storage) as catalog:
        catalog.create_namespace_if_not_exists("src")
        table = catalog.create_table(SOURCE, schema=ARROW, properties=properties)
        for batch in batches:
            table.append(pa.Table.from_pylist(batch, schema=ARROW))
        return catalog.load_table(SOURCE)


def append(store_url: str, tmp_path: Path, batch: list[dict[str, Any]]) -> Any:
    with open_catalog(source_ref(tmp_path), store_url) as catalog:
        table = catalog.load_table(SOURCE)
        table.append(pa.Table.from_pylist(batch, schema=ARROW))
        return catalog.load_table(SOURCE)


def table_job(job_factory: Any, table: dict[str, Any], storage: dict[str, Any] | None = None, **kw: Any) -> Path:
    path = job_factory(n=1, **kw)
    spec = yaml.safe_load(path.read_text())
    spec["input"] = {"table": table, "id_field": "id", "acl_field": "acl", **({"storage": storage} if storage else {})}
    path.write_text(yaml.safe_dump(spec))
    return path


def test_a_table_snapshot_is_planned_over_its_data_files_and_every_record_answered_once(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    records = make_records(210)
    # A shard is whole row groups: of 50 rows here.
    table = make_source(store_url, tmp_path, records[:70], records[70:140], records[140:], row_group_rows=50)
    data_files = [t.file.file_path for t in table.scan().plan_files()]
    assert len(data_files) == 3
    path = table_job(job_factory, {"catalog": "store", "name": SOURCE}, options={"error_on": ["r000100"]})
    result = plan(load_spec(path), store)
    assert (result.records, result.shards) == (210, 6)  # 50 + 20 rows of each data file
    slices = [Slice.from_json(s) for s in store_slices(store, result.version)]
    assert sorted({s.path for s in slices}) == sorted(data_files)
    assert all(s.format == "parquet" and s.end - s.start in (50, 20) for s in slices)

    run_to_seal(store, result.version)
    results = {r.record_id: r for r in store.iter_results(result.version)}
    dead = [d.record_id for d in store.iter_dead_letters(result.version)]
    assert dead == ["r000100"] and len(results) == 209
    assert set(results) | set(dead) == {r["id"] for r in records}
    assert all(results[r["id"]].acl == r["acl"] for r in records if r["id"] in results)

    # The version pins the snapshot: the stored spec names it, and a new snapshot is a new version.
    info = store.job(result.version)
    assert info is not None
    assert info.spec["input"]["table"]["snapshot_id"] == table.metadata.current_snapshot_id
    assert stored_spec(info).version(file_digest(stored_spec(info).input, store_url)) == result.version
    newer = append(store_url, tmp_path, make_records(5, "late"))
    again = plan(load_spec(path), store)
    assert again.version != result.version and again.records == 215
    pinned = table_job(job_factory, {"catalog": "store", "name": SOURCE,
                                     "snapshot_id": table.metadata.current_snapshot_id},
                       options={"error_on": ["r000100"]})
    assert plan(load_spec(pinned), store).version == result.version
    assert newer.metadata.current_snapshot_id != table.metadata.current_snapshot_id


def store_slices(store: Store, version: str) -> list[dict[str, Any]]:
    from tests.helpers import Database

    with Database(store.url) as db:
        rows = db.execute("SELECT slice FROM shards WHERE version = ? ORDER BY shard_no", (version,))
    return [json.loads(s) if isinstance(s, str) else s for (s,) in rows]


def test_the_version_is_pinned_by_the_tables_uuid_and_snapshot_never_by_the_catalog_address(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    table = make_source(store_url, tmp_path, make_records(30))
    # The same table registered in a second catalog, configured in the environment with a
    # password in its address (the test server trusts local connections and ignores it).
    address = store_url.replace("postgresql://postgres@", "postgresql://postgres:s3cret@")
    monkeypatch.setenv("PYICEBERG_CATALOG__LAKE__URI", sqlalchemy_uri(address))
    monkeypatch.setenv("PYICEBERG_CATALOG__LAKE__TYPE", "sql")
    with open_catalog(TableRef("lake", SOURCE)) as lake:
        lake.create_namespace_if_not_exists("src")
        lake.register_table(SOURCE, table.metadata_location)

    via_store = plan(load_spec(table_job(job_factory, {"catalog": "store", "name": SOURCE})), store)
    via_lake = plan(load_spec(table_job(job_factory, {"catalog": "lake", "name": SOURCE})), store)
    assert via_lake.version == via_store.version and not via_lake.created
    stored = json.dumps([j.spec for j in store.jobs()])
    assert "s3cret" not in stored and address not in stored


def test_a_catalog_address_with_a_credential_is_refused_in_a_spec(tmp_path: Path) -> None:
    base = {"name": "j", "model": {"engine": "synthetic"}, "prompt": {"text": "x", "version": "1"},
            "output": {"schema": {"type": "object"}}}
    for uri in ("postgresql://u:pw@db/cat", "https://rest.example/v1?token=abc", "https://rest/v1?credential=a:b"):
        with pytest.raises(SpecError, match="holds a credential"):
            parse_spec({**base, "input": {"table": {"catalog": "c", "name": "a.b", "uri": uri}}}, tmp_path)
    spec = parse_spec({**base, "input": {"table": {"catalog": "c", "name": "a.b", "uri": "sqlite:///cat.db"}}},
                      tmp_path)
    assert isinstance(spec.input.source, TableSource) and spec.input.source.ref.uri == f"sqlite:///{tmp_path / 'cat.db'}"
    with pytest.raises(SpecError, match="give exactly one of 'path'"):
        parse_spec({**base, "input": {"table": {"catalog": "c", "name": "a.b"}, "path": "x.jsonl"}}, tmp_path)


def add_position_deletes(table: Any, data_file: str, positions: list[int], folder: Path) -> None:
    """Commits a snapshot that deletes rows of `data_file` by position, as an engine with
    merge-on-read deletes would: a position delete file in a delete manifest. (pyiceberg
    itself only rewrites data files when it deletes.)"""
    from pyiceberg.manifest import (
        DataFile,
        DataFileContent,
        FileFormat,
        ManifestContent,
        ManifestEntry,
        ManifestEntryStatus,
        ManifestWriterV2,
        write_manifest_list,
    )
    from pyiceberg.table.refs import SnapshotRefType
    from pyiceberg.table.snapshots import Operation, Snapshot, Summary
    from pyiceberg.table.update import AddSnapshotUpdate, AssertRefSnapshotId, SetSnapshotRefUpdate
    from pyiceberg.typedef import Record

    class DeleteManifestWriter(ManifestWriterV2):
        def content(self) -> ManifestContent:
            return ManifestContent.DELETES

        @property
        def _meta(self) -> dict[str, str]:
            return {**super()._meta, "content": "deletes"}

    meta = table.metadata
    deletes = folder / "deletes.parquet"
    pq.write_table(pa.table({"file_path": [data_file] * len(positions), "pos": positions}), deletes)
    snapshot_id = uuid.uuid4().int & ((1 << 63) - 1)
    sequence = meta.next_sequence_number()
    delete_file = DataFile.from_args(
        content=DataFileContent.POSITION_DELETES, file_path=f"file://{deletes}", file_format=FileFormat.PARQUET,
        partition=Record(), record_count=len(positions), file_size_in_bytes=deletes.stat().st_size)
    delete_file.spec_id = 0
    manifest_path = f"file://{folder / 'delete-manifest.avro'}"
    with DeleteManifestWriter(meta.spec(), meta.schema(), table.io.new_output(manifest_path), snapshot_id,
                              "deflate") as writer:
        writer.add_entry(ManifestEntry.from_args(status=ManifestEntryStatus.ADDED, snapshot_id=snapshot_id,
                                                 sequence_number=None, data_file=delete_file))
    parent = meta.current_snapshot()
    list_path = f"file://{folder / 'manifest-list.avro'}"
    with write_manifest_list(2, table.io.new_output(list_path), snapshot_id, parent.snapshot_id, sequence,
                             "deflate") as lists:
        lists.add_manifests([*parent.manifests(table.io), writer.to_manifest_file()])
    snapshot = Snapshot(snapshot_id=snapshot_id, parent_snapshot_id=parent.snapshot_id, sequence_number=sequence,
                        manifest_list=list_path, summary=Summary(Operation.DELETE), schema_id=meta.current_schema_id)
    table.catalog.commit_table(table, (AssertRefSnapshotId(snapshot_id=parent.snapshot_id, ref="main"),), (
        AddSnapshotUpdate(snapshot=snapshot),
        SetSnapshotRefUpdate(snapshot_id=snapshot_id, ref_name="main", type=SnapshotRefType.BRANCH)))


def test_a_snapshot_with_delete_files_is_refused_and_nothing_is_planned(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    records = make_records(40)
    with open_catalog(source_ref(tmp_path), store_url) as catalog:
        catalog.create_namespace_if_not_exists("src")
        table = catalog.create_table(SOURCE, schema=ARROW)
        table.append(pa.Table.from_pylist(records, schema=ARROW))
        table = catalog.load_table(SOURCE)
        before = table.metadata.current_snapshot_id
        [data_file] = [t.file.file_path for t in table.scan().plan_files()]
        add_position_deletes(table, data_file, [3, 7], tmp_path)
        table = catalog.load_table(SOURCE)
        # What the deletes mean, read by pyiceberg: the rows are gone from the snapshot.
        assert table.scan().to_arrow().num_rows == 38
    path = table_job(job_factory, {"catalog": "store", "name": SOURCE})
    with pytest.raises(InputError, match=r"^Iceberg table src.tickets in catalog 'store' at snapshot \d+ has delete "
                                         r"files \(1 files of position deletes\); batchline reads whole data files"):
        plan(load_spec(path), store)
    assert store.jobs() == []
    # The snapshot before the deletes has none: named by id, it is planned.
    older = table_job(job_factory, {"catalog": "store", "name": SOURCE, "snapshot_id": before})
    assert plan(load_spec(older), store).records == 40


def test_a_renamed_column_is_refused_since_older_data_files_carry_the_old_name(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    table = make_source(store_url, tmp_path, make_records(10))
    with table.update_schema() as update:
        update.rename_column("text", "body")
    path = table_job(job_factory, {"catalog": "store", "name": SOURCE})
    spec = yaml.safe_load(path.read_text())
    spec["input"]["text_field"] = "body"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(InputError, match=r"column 'body' was renamed in schema 0 \(there: 'text'"):
        plan(load_spec(path), store)


def test_a_missing_table_or_snapshot_is_one_line(job_factory: Any, store: Store, store_url: str,
                                                 tmp_path: Path) -> None:
    make_source(store_url, tmp_path, make_records(10))
    with pytest.raises(InputError, match=r"^Iceberg table src.nope in catalog 'store': no such table$"):
        plan(load_spec(table_job(job_factory, {"catalog": "store", "name": "src.nope"})), store)
    with pytest.raises(InputError, match=r"at snapshot 12345 has no such snapshot"):
        plan(load_spec(table_job(job_factory, {"catalog": "store", "name": SOURCE, "snapshot_id": 12345})), store)


def test_worker_processes_read_the_data_files_without_any_catalog_configured(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import subprocess
    import sys

    records = make_records(120)
    catalog_db = tmp_path / "lake-catalog.db"
    monkeypatch.setenv("PYICEBERG_CATALOG__LAKE__URI", f"sqlite:///{catalog_db}")
    lake = TableRef("lake", SOURCE, warehouse=f"file://{tmp_path / 'lake-wh'}")
    with open_catalog(lake) as catalog:
        catalog.create_namespace_if_not_exists("src")
        table = catalog.create_table(SOURCE, schema=ARROW)
        table.append(pa.Table.from_pylist(records[:60], schema=ARROW))
        table.append(pa.Table.from_pylist(records[60:], schema=ARROW))
    version = plan(load_spec(table_job(job_factory, {"catalog": "lake", "name": SOURCE})), store).version
    # The workers get no catalog at all: only the store, and the data files their shards name.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYICEBERG_")}
    catalog_db.rename(tmp_path / "gone.db")
    workers = [subprocess.Popen([sys.executable, "-m", "batchline", "worker", "--store", store_url, "--job", version,
                                 "--poll-seconds", "0.2"], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for w in workers:
        _out, err = w.communicate(timeout=180)
        assert w.returncode == 0, err
    info = store.job(version)
    assert info is not None and info.state == "sealed"
    assert sorted(r.record_id for r in store.iter_results(version)) == [r["id"] for r in records]


def test_a_table_with_its_files_in_s3_is_planned_and_read_through_the_specs_storage_endpoint(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path, lake_env: S3StandIn,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Only the spec's input.storage names the S3 stand-in: pyiceberg (reading the manifests
    # at planning) and obstore (a worker reading its range of a data file) both take the
    # endpoint from there; the keys stay in the environment.
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    storage = {"endpoint": lake_env.url}
    bucket = lake_env.bucket()
    records = make_records(130)
    make_source(store_url, tmp_path, records[:80], records[80:], warehouse=bucket.url("wh"), storage=storage,
                row_group_rows=25)
    path = table_job(job_factory, {"catalog": "store", "name": SOURCE}, storage=storage,
                     options={"error_on": ["r000007"]})
    result = plan(load_spec(path), store)
    # Shards of whole row groups of 25: 50 + 30 rows of the first data file, 50 of the second.
    assert (result.records, result.shards) == (130, 3)
    slices = [Slice.from_json(s) for s in store_slices(store, result.version)]
    assert len({s.path for s in slices}) == 2
    assert all(s.path.startswith(f"s3://{bucket.name}/wh/") and s.path.endswith(".parquet") for s in slices)
    run_to_seal(store, result.version)
    assert [d.record_id for d in store.iter_dead_letters(result.version)] == ["r000007"]
    assert sorted(r.record_id for r in store.iter_results(result.version)) == \
        [r["id"] for r in records if r["id"] != "r000007"]
