"""`make demo-lake` (examples/lake_demo.py): the ticket example with its input in the S3
stand-in and its results published into an Iceberg table whose warehouse is there too,
read back from S3 by DuckDB's own Iceberg reader and matching the store."""

from __future__ import annotations

import json
from pathlib import Path

from batchline.store import open_store
from examples.iceberg_demo import TABLE, differences
from examples.lake_demo import BUCKET, demo
from tests.iceberg_support import main_rows
from tests.integration.lake.support import S3StandIn


def test_the_lake_demo_publishes_into_s3_and_duckdb_reads_back_what_the_store_holds(
        lake_env: S3StandIn, tmp_path: Path) -> None:
    out = tmp_path / "demo"
    assert demo(out, s3=lake_env) == 0
    store_url = f"sqlite:///{out / 'batchline.db'}"
    store = open_store(store_url, create=False)
    try:
        [job] = store.jobs()
        version = job.version
        assert store.resolve_name(job.name) == version
        # The input was the object in the stand-in, and every ticket has one outcome.
        assert job.spec["input"]["path"] == [f"s3://{BUCKET}/input/tickets.jsonl"]
        expected = {(r.record_id, "result", json.loads(r.output)["category"], version)
                    for r in store.iter_results(version)}
        assert not list(store.iter_dead_letters(version))
    finally:
        store.close()
    assert len(expected) == 2990
    # Read again here, independently of the demo's own check: DuckDB over S3 sees exactly
    # the store's results, once each, and nothing of any other version.
    rows = main_rows(store_url, TABLE, "id, outcome, output.category, version", s3=lake_env)
    assert len(rows) == 2990 and set(rows) == expected
    warehouse = lake_env.client.list_objects_v2(Bucket=BUCKET, Prefix="warehouse/")["Contents"]
    assert any(o["Key"].endswith(".parquet") for o in warehouse)
    # The demo's check would have failed on a table missing a row or showing it twice.
    assert differences(store_url, job.name, rows) == []
    assert differences(store_url, job.name, rows[1:]) == [
        "1 of the store's outcomes are missing from the table or differ, 0 rows of the table are not the store's"]
    assert differences(store_url, job.name, [*rows, rows[0]]) == ["1 ids appear more than once in the table"]
