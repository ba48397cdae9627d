"""Exports of a version: who can read them, what their columns are, and dataset folders kept as staged."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from batchline.spec import JobVersion
from batchline.store import Store
from batchline.targets.files import export_jsonl, export_parquet
from batchline.targets.openai_batch import export_openai_batch, openai_errors_path
from batchline.targets.parquet import dataset_at
from tests.helpers import make_records, planned, run_to_seal


@pytest.fixture
def umask_022() -> Iterator[None]:
    before = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(before)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_exports_are_as_readable_as_the_umask_makes_new_files_not_private_to_their_writer(
        job_factory: Any, store: Store, tmp_path: Path, umask_022: None) -> None:
    _spec, version = planned(job_factory(n=30), store)
    run_to_seal(store, version)
    out = tmp_path / "exports"
    export_jsonl(store, version, out / "results.jsonl")
    export_parquet(store, version, out / "results.parquet")
    export_openai_batch(store, version, out / "batch.jsonl", openai_errors_path(out / "batch.jsonl"))
    dataset = dataset_at(tmp_path / "warehouse")
    dataset.stage(store, JobVersion.of(store, version))
    dataset.show("test-job", version, None)
    folder = dataset.folder("test-job", version)
    files = [out / "results.jsonl", out / "results.parquet", out / "batch.jsonl", out / "batch.errors.jsonl",
             Path(folder) / "part-00000.parquet", tmp_path / "warehouse" / "test-job" / "CURRENT"]
    assert {str(f): oct(_mode(f)) for f in files} == {str(f): "0o644" for f in files}
    folders = [out, Path(folder), Path(folder).parent]
    assert {str(f): oct(_mode(f)) for f in folders} == {str(f): "0o755" for f in folders}


TYPED_SCHEMA = {
    "type": "object",
    "properties": {
        "category": {"enum": ["a", "b", "c"]},
        "summary": {"type": "string", "maxLength": 30},
        "score": {"type": "integer", "minimum": 0, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
        "detail": {"type": "object", "properties": {"urgent": {"type": "boolean"}}, "required": ["urgent"],
                   "additionalProperties": False},
        "anything": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
    },
    "required": ["category", "summary", "score", "tags", "detail", "anything"],
    "additionalProperties": False,
}


def sealed_into_table(job_factory: Any, store: Store, warehouse: Path, records: list[dict[str, Any]],
                      **kw: Any) -> str:
    from batchline.check.validate import validate
    from tests.iceberg_support import with_table

    path = with_table(job_factory(records, validate={"max_dead_letter_rate": 0.5}, **kw), warehouse)
    _spec, version = planned(path, store)
    run_to_seal(store, version)
    assert validate(store, version).passed
    return version


def test_the_parquet_export_types_output_and_acl_as_the_iceberg_table_does_instead_of_json_text(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from batchline.publish.pointer import publish
    from tests.iceberg_support import duckdb_iceberg, metadata_location

    records = make_records(30)
    for i, r in enumerate(records):
        r["acl"] = [f"team-{i % 4}", f"user{i}"]
    version = sealed_into_table(job_factory, store, tmp_path / "wh", records, schema=TYPED_SCHEMA,
                                options={"error_on": ["r000004"]})
    publish(store, version)
    export_parquet(store, version, tmp_path / "out.parquet")

    written = pq.read_schema(tmp_path / "out.parquet")
    assert written.metadata[b"batchline.format"] == b"typed"
    assert written.field("acl").type == pa.list_(pa.string())
    assert written.field("raw_output").type == pa.string()
    assert pa.types.is_struct(written.field("output").type)
    con = duckdb_iceberg()
    location = metadata_location(store_url, "lake.results")
    exported = {r[0]: r[1] for r in con.execute(f"DESCRIBE SELECT * FROM read_parquet('{tmp_path / 'out.parquet'}')")
                .fetchall()}
    table = {r[0]: r[1] for r in con.execute(f"DESCRIBE SELECT * FROM iceberg_scan('{location}')").fetchall()}
    assert exported["output"] == table["output"] == (
        "STRUCT(category VARCHAR, summary VARCHAR, score BIGINT, tags VARCHAR[], detail STRUCT(urgent BOOLEAN), "
        "anything VARCHAR)")
    assert exported["acl"] == table["acl"] == "VARCHAR[]"
    # The same values in both, row for row: the output's fields as typed, the ACL as its groups.
    both = "SELECT id, output, acl, raw_output FROM {} ORDER BY id"
    file_rows = con.execute(both.format(f"read_parquet('{tmp_path / 'out.parquet'}')")).fetchall()
    table_rows = con.execute(both.format(f"iceberg_scan('{location}') WHERE outcome = 'result'")).fetchall()
    assert file_rows == table_rows and len(file_rows) == 29
    source = {r["id"]: r["acl"] for r in records}
    for record_id, output, acl, raw in file_rows:
        assert acl == source[record_id]
        raw_value = json.loads(raw)
        assert output == {**raw_value, "anything": json.dumps(raw_value["anything"])}


def text_format_part(path: Path, version: str) -> None:
    """A version's part as batchline wrote it before typed exports: output and acl JSON text."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True)
    pq.write_table(pa.table({"id": ["r000000"], "output": ['{"category": "a", "summary": "s"}'],
                             "acl": ['["group-0"]'], "version": [version]}), path)


def test_a_dataset_folder_staged_before_is_never_rewritten_whatever_its_format(
        job_factory: Any, store: Store, tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    from batchline.targets.parquet import PART, version_folder

    _, old = planned(job_factory(n=10), store)
    run_to_seal(store, old)
    _, new = planned(job_factory(n=12), store)
    run_to_seal(store, new)
    dataset = dataset_at(tmp_path / "warehouse")
    old_part = tmp_path / "warehouse" / "test-job" / version_folder(old) / PART
    text_format_part(old_part, old)
    dataset.stage(store, JobVersion.of(store, new))
    new_part = Path(dataset.folder("test-job", new)) / PART
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in (old_part, new_part)}

    for version in (old, new, old, new):
        dataset.stage(store, JobVersion.of(store, version))
        dataset.show("test-job", version, None)
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in (old_part, new_part)} == before
    # Each folder says its own format: none (JSON text), or typed.
    assert b"batchline.format" not in (pq.read_schema(old_part).metadata or {})
    assert pq.read_schema(new_part).metadata[b"batchline.format"] == b"typed"
    assert pq.read_table(old_part).column("acl").to_pylist() == ['["group-0"]']
    assert pq.read_table(new_part).num_rows == 12


def test_an_iceberg_table_made_while_acls_were_json_text_keeps_that_column_type(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    from batchline.publish.pointer import publish
    from batchline.sources.iceberg import TableRef, open_catalog
    from batchline.targets.iceberg_schema import iceberg_schema
    from tests.helpers import SIMPLE_SCHEMA
    from tests.iceberg_support import main_rows

    with open_catalog(TableRef("store", "lake.results", warehouse=str(tmp_path / "wh")), store_url) as catalog:
        catalog.create_namespace_if_not_exists("lake")
        catalog.create_table("lake.results", schema=iceberg_schema(SIMPLE_SCHEMA, acl_text=True))
    records = make_records(10)
    version = sealed_into_table(job_factory, store, tmp_path / "wh", records)
    publish(store, version)
    rows = main_rows(store_url, "lake.results", "id, acl")
    assert rows == [(r["id"], json.dumps(r["acl"])) for r in records]
