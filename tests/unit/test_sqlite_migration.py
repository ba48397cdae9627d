"""A SQLite store made by an earlier batchline (schema 1) is brought up to date in place."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from batchline.store import PlannedRecord, PlannedShard, ResultRow, open_store
from batchline.store.sqlite import SCHEMA_VERSION


def test_a_schema_1_store_gains_routes_batches_and_models_and_keeps_its_rows(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    store = open_store(f"sqlite:///{path}")
    writer = store.begin_plan("job@1", "job", {"name": "job", "shards": {"lease_seconds": 60}})
    writer.add_shards([PlannedShard(0, {"shard": 0}, 1)])
    writer.add_records([PlannedRecord("a", 0, "h")])
    writer.commit(1, 1)
    store.close()
    # What schema 1 had: none of the columns routing added.
    conn = sqlite3.connect(path)
    for table, column in (("shards", "route"), ("shards", "batch"), ("shards", "poll_at"), ("results", "model")):
        conn.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
    conn.execute("UPDATE meta SET value = '1' WHERE key = 'schema_version'")
    conn.commit()
    conn.close()

    store = open_store(f"sqlite:///{path}")
    lease = store.claim("w1")
    assert lease is not None and lease.route == "local" and lease.batch is None
    store.put_results(lease, [ResultRow("a", '{"x":1}', model="m")])
    assert [r.model for r in store.iter_results("job@1")] == ["m"]
    version = sqlite3.connect(path).execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0]
    assert int(version) == SCHEMA_VERSION
    store.close()
