"""A SQLite store made before versions could be cancelled takes the new state, keeping its jobs."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from batchline.store import open_store
from batchline.store.sqlite_sql import SCHEMA_VERSION
from tests.unit.test_sqlite_migration import old_store, schema_of


def test_a_schema_4_store_can_cancel_a_job_it_already_had(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    old_store(path, 4)
    store = open_store(f"sqlite:///{path}")
    try:
        [job] = store.jobs()
        assert (job.version, job.state, job.record_count) == ("job@1", "ready", 2)
        assert store.cancel("job@1", "ops@host", "input edited") is True
        assert [(j.version, j.state) for j in store.jobs()] == [("job@1", "cancelled")]
        assert [r.record_id for r in store.iter_results("job@1")] == ["a"]
    finally:
        store.close()
    assert schema_of(path) == SCHEMA_VERSION
    indexes = sqlite3.connect(path).execute("SELECT name FROM sqlite_master WHERE tbl_name = 'jobs' "
                                            "AND type = 'index' AND sql IS NOT NULL").fetchall()
    assert indexes == [("jobs_by_state",)]
