"""A Delta Lake table's version as a job's input: pinned by the table's id and version,
planned as ranges of its data files with partition values restored from the log, read by
workers without the log; deletion vectors, column mapping and a version that is gone
refused with one line. On both stores."""

from __future__ import annotations

import json
import struct
import uuid
import zlib
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import yaml
from deltalake import DeltaTable, write_deltalake

from batchline.errors import InputError, SpecError
from batchline.plan.planner import plan
from batchline.snapshot import Slice
from batchline.sources.delta import DeltaSource
from batchline.spec import load_spec, stored_spec
from batchline.store import Store
from tests.helpers import make_records, run_to_seal
from tests.integration.test_iceberg_input import store_slices

ARROW = pa.schema([("id", pa.string()), ("text", pa.string()), ("acl", pa.list_(pa.string())),
                   ("team", pa.string())])


def write_table(folder: Path, records: list[dict[str, Any]], *, mode: str = "append",
                partition_by: list[str] | None = None, **options: Any) -> Path:
    rows = [{**r, "team": f"team-{int(r['id'][1:]) % 3}"} for r in records]
    write_deltalake(str(folder), pa.Table.from_pylist(rows, schema=ARROW), mode=mode,  # type: ignore[arg-type]
                    partition_by=partition_by, **options)
    return folder


def delta_job(job_factory: Any, delta: dict[str, Any], acl_field: str = "acl", **kw: Any) -> Path:
    path = job_factory(n=1, **kw)
    spec = yaml.safe_load(path.read_text())
    spec["input"] = {"delta": delta, "id_field": "id", "acl_field": acl_field}
    path.write_text(yaml.safe_dump(spec))
    return path


def slices(store: Store, version: str) -> list[Slice]:
    return [Slice.from_json(s) for s in store_slices(store, version)]


def test_a_partitioned_table_is_planned_over_its_data_files_with_partition_values_restored(
        job_factory: Any, store: Store, tmp_path: Path) -> None:
    table = write_table(tmp_path / "tickets", make_records(90), partition_by=["team"])
    write_table(table, make_records(120)[90:], partition_by=["team"])
    # The ACL is the partition column, which no data file holds: each row's must come from the log.
    result = plan(load_spec(delta_job(job_factory, {"uri": str(table)}, acl_field="team")), store)
    assert result.records == 120
    planned = slices(store, result.version)
    # Six data files (three partitions, two appends), each its own shards; none holds the team column.
    assert len({s.path for s in planned}) == 6
    assert all(s.columns.get("team", "").startswith("team-") and f"team={s.columns['team']}" in s.path
               for s in planned)
    stored = stored_spec(store.job(result.version))  # type: ignore[arg-type]
    assert isinstance(stored.input.source, DeltaSource) and stored.input.source.version == 1
    run_to_seal(store, result.version)
    results = list(store.iter_results(result.version))
    assert len(results) == 120
    assert all(r.acl == [f"team-{int(r.record_id[1:]) % 3}"] for r in results)


def test_a_version_is_pinned_by_the_tables_id_so_a_table_made_again_is_another_version(
        job_factory: Any, store: Store, tmp_path: Path) -> None:
    table = write_table(tmp_path / "t", make_records(20))
    first = plan(load_spec(delta_job(job_factory, {"uri": str(table), "version": 0})), store)
    again = plan(load_spec(delta_job(job_factory, {"uri": str(table), "version": 0})), store)
    assert again.version == first.version and not again.created
    # Dropped and made again with the same rows: version 0 again, but not the same table.
    import shutil

    shutil.rmtree(table)
    write_table(table, make_records(20))
    remade = plan(load_spec(delta_job(job_factory, {"uri": str(table), "version": 0})), store)
    assert remade.version != first.version


def test_a_table_with_deletion_vectors_is_refused_with_one_line(job_factory: Any, store: Store,
                                                                  tmp_path: Path) -> None:
    table = write_table(tmp_path / "dv", make_records(10), configuration={"delta.enableDeletionVectors": "true"})
    mark_first_row_deleted(table)
    with pytest.raises(InputError, match=r"has deletion vectors on 1 data files; batchline reads whole data files"):
        plan(load_spec(delta_job(job_factory, {"uri": str(table)})), store)


def test_column_mapping_and_a_missing_version_and_a_missing_column_are_refused(
        job_factory: Any, store: Store, tmp_path: Path) -> None:
    mapped = write_table(tmp_path / "mapped", make_records(5),
                         configuration={"delta.columnMapping.mode": "name", "delta.minReaderVersion": "2",
                                        "delta.minWriterVersion": "5"})
    with pytest.raises(InputError, match=r"delta\.columnMapping\.mode=name"):
        plan(load_spec(delta_job(job_factory, {"uri": str(mapped)})), store)
    plain = write_table(tmp_path / "plain", make_records(5))
    with pytest.raises(InputError, match=r"at version 7 has no such version"):
        plan(load_spec(delta_job(job_factory, {"uri": str(plain), "version": 7})), store)
    with pytest.raises(InputError, match=r"no Delta table there"):
        plan(load_spec(delta_job(job_factory, {"uri": str(tmp_path / "nothing")})), store)
    path = delta_job(job_factory, {"uri": str(plain)})
    spec = yaml.safe_load(path.read_text())
    spec["input"]["text_field"] = "body"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(InputError, match=r"has no column 'body'"):
        plan(load_spec(path), store)


def test_a_delta_section_is_its_own_and_checked_as_such(job_factory: Any, tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"input.delta.versoin: unknown field \(allowed: uri, version\)"):
        load_spec(delta_job(job_factory, {"uri": "x", "versoin": 1}))
    with pytest.raises(SpecError, match=r"input: give exactly one of"):
        path = delta_job(job_factory, {"uri": "x"})
        spec = yaml.safe_load(path.read_text())
        spec["input"]["path"] = "in.jsonl"
        path.write_text(yaml.safe_dump(spec))
        load_spec(path)


# --- a deletion vector, written as the Delta protocol describes one ---------------------------

_Z85 = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"


def _z85(data: bytes) -> str:
    out = []
    for i in range(0, len(data), 4):
        value = int.from_bytes(data[i:i + 4], "big")
        chunk = []
        for _ in range(5):
            chunk.append(_Z85[value % 85])
            value //= 85
        out.append("".join(reversed(chunk)))
    return "".join(out)


def mark_first_row_deleted(table: Path) -> None:
    """Commits a deletion vector over the table's one data file (delta-rs writes none itself):
    a file of one RoaringBitmapArray marking row 0, and an add action naming it."""
    from pyroaring import BitMap

    name = uuid.uuid4()
    body = struct.pack("<i", 1681511377) + struct.pack("<q", 1) + struct.pack("<i", 0) + BitMap([0]).serialize()
    (table / f"deletion_vector_{name}.bin").write_bytes(
        bytes([1]) + struct.pack(">i", len(body)) + body + struct.pack(">I", zlib.crc32(body)))
    dt = DeltaTable(str(table))
    [action] = pa.table(dt.get_add_actions(flatten=True)).to_pylist()
    path = action["path"]
    commit = [
        {"commitInfo": {"timestamp": 1, "operation": "DELETE"}},
        {"remove": {"path": path, "dataChange": True, "deletionTimestamp": 1}},
        {"add": {"path": path, "partitionValues": {}, "size": action["size_bytes"], "modificationTime": 2,
                 "dataChange": True, "stats": json.dumps({"numRecords": action["num_records"]}),
                 "deletionVector": {"storageType": "u", "pathOrInlineDv": _z85(name.bytes), "offset": 1,
                                    "sizeInBytes": len(body), "cardinality": 1}}},
    ]
    log = table / "_delta_log" / f"{dt.version() + 1:020d}.json"
    log.write_text("".join(json.dumps(line) + "\n" for line in commit))


def test_a_table_in_the_s3_stand_in_is_planned_and_read_through_the_lake_settings(
        job_factory: Any, store: Store, lake_env: Any) -> None:
    from batchline.lake import lake_settings

    bucket = lake_env.bucket()
    uri = f"s3://{bucket.name}/tickets"
    rows = [{**r, "team": "t"} for r in make_records(30)]
    write_deltalake(uri, pa.Table.from_pylist(rows, schema=ARROW),  # type: ignore[arg-type]
                    storage_options={**lake_env.env(), **lake_settings().object_store_options("s3")})
    result = plan(load_spec(delta_job(job_factory, {"uri": uri})), store)
    assert result.records == 30
    run_to_seal(store, result.version)
    assert sorted(r.record_id for r in store.iter_results(result.version)) == [r["id"] for r in rows]


def test_a_table_in_the_gcs_stand_in_was_read_from_googles_own_endpoint_instead_of_the_lake_settings(
        job_factory: Any, store: Store, gcs_standin: Any, monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    """The lake settings' GCS endpoint reaches the Delta reader as it reaches obstore: the
    storage options once mapped only S3's, so the log was asked of Google's own endpoint."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_standin.url)
    bucket = gcs_standin.bucket()
    rows = [{**r, "team": "t"} for r in make_records(30)]
    # The emulator takes uploads through the JSON API only: the table is written on disk, then uploaded.
    local = tmp_path / "tickets"
    write_deltalake(str(local), pa.Table.from_pylist(rows[:20], schema=ARROW))  # type: ignore[arg-type]
    write_deltalake(str(local), pa.Table.from_pylist(rows[20:], schema=ARROW), mode="append")  # type: ignore[arg-type]
    for f in sorted(local.rglob("*")):
        if f.is_file():
            bucket.put(f"tickets/{f.relative_to(local)}", f.read_bytes())
    uri = f"gs://{bucket.name}/tickets"
    result = plan(load_spec(delta_job(job_factory, {"uri": uri})), store)
    assert result.records == 30
    run_to_seal(store, result.version)
    assert sorted(r.record_id for r in store.iter_results(result.version)) == [r["id"] for r in rows]
