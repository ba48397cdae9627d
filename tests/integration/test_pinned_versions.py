"""Job versions of every kind of input and output do not move: the same spec over the same
input plans to the same version across releases. A refactor that re-hashed them would
orphan every stored result (incremental runs find their base by version) and re-run
every nightly job.

Each spec in tests/data/pinned is a frozen copy, planned here through the public API
(`batchline.Jobs.plan`) as a user plans it, into a fresh SQLite store; the versions were
computed by the release that introduced this test. Objects live in the S3 stand-in (an
object's pin is its name, size, ETag and version: an unversioned bucket has no version,
and the ETag of one PUT is the MD5 of its bytes, so the bucket's random name does not
move the version). An Iceberg table's UUID and snapshot id are new with every table, so
that pin is frozen in two halves: the pin the planner takes has this shape, and a pin of
this shape hashes to this version.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import batchline
from batchline.sources import Pin, snapshot_digest
from batchline.spec import load_spec
from tests.integration.lake.support import S3StandIn

PINNED = Path(__file__).resolve().parents[1] / "data" / "pinned"

LOCAL = {
    "csv.yaml": "pinned-csv@18ed8a40ad420681",
    "parquet.yaml": "pinned-parquet@bc459467d6e53951",
    "table-output.yaml": "pinned-table-output@524887a14faed42f",
}
OBJECTS = {
    "objects.yaml": "pinned-objects@a53325f70734f10e",
    "manifest.yaml": "pinned-manifest@0e382a63d94faa85",
}
# A table pinned at this UUID and snapshot id, with 40 rows.
TABLE_PIN = Pin("iceberg:3d1b2c4e-5f60-4718-9a2b-c3d4e5f60718", 40, version="4242424242424242")
TABLE_VERSION = "pinned-table-input@4072caf755d277d8"


def copy_pinned(tmp_path: Path) -> Path:
    folder = tmp_path / "pinned"
    shutil.copytree(PINNED, folder)
    return folder


def planned(spec: Path, tmp_path: Path) -> str:
    jobs = batchline.Jobs(f"sqlite:///{tmp_path / 'store.db'}")
    return jobs.plan(spec, log=lambda _m: None).version


@pytest.mark.parametrize("name", sorted(LOCAL))
def test_a_pinned_local_spec_keeps_its_version(name: str, tmp_path: Path) -> None:
    assert planned(copy_pinned(tmp_path) / name, tmp_path) == LOCAL[name]


@pytest.mark.parametrize("name", sorted(OBJECTS))
def test_a_pinned_object_spec_keeps_its_version(name: str, tmp_path: Path, lake_env: S3StandIn) -> None:
    folder = copy_pinned(tmp_path)
    bucket = lake_env.bucket()
    lines = (PINNED / "tickets.jsonl").read_bytes().splitlines(keepends=True)
    # Two objects: a glob's listing and a manifest's lines both give them in this order.
    bucket.put("tickets/a.jsonl", b"".join(lines[:25]))
    bucket.put("tickets/b.jsonl", b"".join(lines[25:]))
    bucket.put("manifest.txt", b"# the night's objects\ntickets/b.jsonl\ntickets/a.jsonl\n")
    spec = folder / name
    spec.write_text(spec.read_text().replace("BUCKET", bucket.name))
    assert planned(spec, tmp_path) == OBJECTS[name]


def test_a_pinned_table_input_hashes_its_pin_to_its_version() -> None:
    spec = load_spec(PINNED / "table-input.yaml")
    assert spec.version(snapshot_digest([TABLE_PIN])) == TABLE_VERSION


def test_the_planner_pins_a_table_by_its_uuid_snapshot_id_and_row_count(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from pyiceberg.catalog.sql import SqlCatalog

    folder = copy_pinned(tmp_path)
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    rows = pq.read_table(folder / "tickets.parquet")
    # The store's own catalog (`catalog: store`), as batchline names it in the store's database.
    catalog = SqlCatalog("batchline", uri=store_url, warehouse=f"file://{tmp_path / 'wh'}")
    catalog.create_namespace("src")
    table = catalog.create_table("src.tickets", schema=rows.schema)
    table.append(pa.Table.from_batches(rows.to_batches(), schema=rows.schema))
    table = catalog.load_table("src.tickets")
    catalog.engine.dispose()
    pin = Pin(f"iceberg:{table.metadata.table_uuid}", 40, version=str(table.metadata.current_snapshot_id))
    expected = load_spec(folder / "table-input.yaml").version(snapshot_digest([pin]))
    assert planned(folder / "table-input.yaml", tmp_path) == expected


def test_the_pins_notice_a_change_that_can_change_a_result(tmp_path: Path) -> None:
    # The pins can fail: one row's text changed is a new version.
    folder = copy_pinned(tmp_path)
    csv = folder / "tickets.csv"
    csv.write_text(csv.read_text().replace("dear", "Dear", 1))
    assert planned(folder / "csv.yaml", tmp_path) != LOCAL["csv.yaml"]
    other = Pin(TABLE_PIN.name, TABLE_PIN.size, version="4242424242424243")
    assert load_spec(PINNED / "table-input.yaml").version(snapshot_digest([other])) != TABLE_VERSION
