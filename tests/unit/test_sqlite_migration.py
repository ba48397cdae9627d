"""SQLite stores made by earlier batchlines are brought up to date in place, keeping their rows."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from batchline.store import ResultRow, open_store
from batchline.store.sqlite_sql import MIGRATIONS, SCHEMA_VERSION


def old_store(path: Path, schema: int) -> None:
    """A store exactly as a batchline at `schema` made it: its migrations and nothing later,
    with one planned job of one shard of two records, one of them answered."""
    conn = sqlite3.connect(path, isolation_level=None)
    for number, _description, script in MIGRATIONS:
        if number <= schema:
            conn.executescript(script)
    conn.execute("INSERT INTO meta (key, value) VALUES ('schema_version', ?)", (str(schema),))
    conn.execute("INSERT INTO jobs (version, name, state, spec, record_count, shard_count, created_at) "
                 "VALUES ('job@1', 'job', 'ready', '{\"name\": \"job\", \"shards\": {\"lease_seconds\": 60}}', "
                 "2, 1, 0)")
    conn.execute("INSERT INTO shards (version, shard_no, slice, record_count, state, results_count) "
                 "VALUES ('job@1', 0, '{}', 2, 'ready', 1)")
    conn.executemany("INSERT INTO records (version, record_id, shard_no, content_hash) VALUES ('job@1', ?, 0, 'h')",
                     [("a",), ("b",)])
    conn.execute("INSERT INTO results (version, record_id, shard_no, output, worker, epoch, attempt, input_tokens, "
                 "output_tokens, created_at) VALUES ('job@1', 'a', 0, '{}', 'w0', 1, 1, 30, 7, 0)")
    conn.close()


def schema_of(path: Path) -> int:
    return int(sqlite3.connect(path).execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0])


def test_a_schema_1_store_gains_routes_batches_and_models_and_keeps_its_rows(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    old_store(path, 1)
    store = open_store(f"sqlite:///{path}")
    lease = store.claim("w1")
    assert lease is not None and lease.route == "local" and lease.batch is None
    store.put_results(lease, [ResultRow("b", '{"x":1}', model="m", input_tokens=5, output_tokens=2)])
    assert [r.model for r in store.iter_results("job@1")] == [None, "m"]
    assert schema_of(path) == SCHEMA_VERSION
    store.close()


def test_a_schema_2_store_counts_the_tokens_it_already_has_on_its_shards(tmp_path: Path) -> None:
    # Route totals and status read counters kept on the shards; the upgrade fills them
    # from the results already stored, or a half-done job would count its tokens from zero.
    path = tmp_path / "old.db"
    old_store(path, 2)
    store = open_store(f"sqlite:///{path}")
    assert store.token_totals("job@1") == (30, 7)
    totals = store.route_totals("job@1")["local"]
    assert (totals.records, totals.results, totals.input_tokens, totals.output_tokens) == (2, 1, 30, 7)
    assert schema_of(path) == SCHEMA_VERSION
    store.close()
