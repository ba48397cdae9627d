"""The rows port: a source with no files that exists only in the tests (tests/fakes/query_source.py,
the rows of a SQL query over a SQLite database, as a warehouse query's would be), added to the
SOURCES table through `batchline.registry.register`, is planned and worked like any input: its
rows streamed at planning, each worker reading its shard's rows again from the database by
range, checked against what planning read. On both stores."""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from batchline.check.validate import validate
from batchline.errors import InputError
from batchline.registry import SOURCES
from batchline.snapshot import Slice, read_slice
from batchline.spec import ROWS, load_spec, stored_spec
from batchline.store import open_store
from batchline.targets.files import export_jsonl
from tests.fakes import query_source
from tests.helpers import planned, run_to_seal

RECORDS = 45


@pytest.fixture
def query_family() -> Iterator[None]:
    query_source.registered()
    try:
        yield
    finally:
        query_source.removed()


def database(path: Path) -> Path:
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.execute("CREATE TABLE tickets (id TEXT PRIMARY KEY, text TEXT NOT NULL, acl TEXT)")
        db.executemany("INSERT INTO tickets VALUES (?, ?, ?)",
                       [(f"t{i:03d}", f"ticket {i}: the printer on floor {i % 7} jams",
                         json.dumps(["hr"] if i % 9 == 0 else ["desk", "staff"])) for i in range(RECORDS)])
        db.commit()
    return path


def job(tmp_path: Path) -> Path:
    database(tmp_path / "tickets.db")
    (tmp_path / "schema.json").write_text(json.dumps(
        {"type": "object", "properties": {"category": {"type": "string"}, "summary": {"type": "string"}},
         "required": ["category", "summary"]}))
    spec: dict[str, Any] = {
        "name": "tickets-query",
        "input": {"query": {"database": "tickets.db", "sql": "SELECT id, text, acl FROM tickets ORDER BY id"},
                  "acl_field": "acl"},
        "model": {"engine": "synthetic"}, "prompt": {"text": "Classify.\n", "version": "v1"},
        "output": {"schema": "schema.json"},
        "shards": {"size": 10, "lease_seconds": 60, "renew_seconds": 2}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_a_source_with_no_files_outside_batchline_is_planned_and_worked_through_the_rows_port(
        query_family: None, store_url: str, tmp_path: Path) -> None:
    assert "query" in SOURCES
    spec_path = job(tmp_path)
    with contextlib.closing(open_store(store_url)) as store:
        spec, version = planned(spec_path, store)
        assert spec.input.format == ROWS
        slices = [Slice.from_json(store.shard_slice(version, s.shard_no)) for s in store.shard_rows(version)]
        assert len(slices) == 5 and {sl.format for sl in slices} == {ROWS}
        run_to_seal(store, version)
        assert validate(store, version).passed
        export_jsonl(store, version, tmp_path / "out.jsonl")
        stored = stored_spec(store.job(version))  # type: ignore[arg-type]
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == [f"t{i:03d}" for i in range(RECORDS)]  # each record once
    assert {r["id"]: r["acl"] for r in rows}["t009"] == ["hr"]
    assert stored.to_dict()["input"]["query"]["database"] == str(tmp_path / "tickets.db")

    # The same query over the database as it is now is the same version; over a changed
    # database, another.
    with contextlib.closing(open_store(store_url)) as store:
        assert planned(spec_path, store)[1] == version
        with contextlib.closing(sqlite3.connect(tmp_path / "tickets.db")) as db:
            db.execute("UPDATE tickets SET text = 'ticket 12: the screen flickers' WHERE id = 't012'")
            db.commit()
        assert planned(spec_path, store)[1] != version


def test_a_shard_whose_rows_changed_since_planning_is_refused_by_its_worker(
        query_family: None, store_url: str, tmp_path: Path) -> None:
    spec_path = job(tmp_path)
    with contextlib.closing(open_store(store_url)) as store:
        _spec, version = planned(spec_path, store)
        sl = Slice.from_json(store.shard_slice(version, 1))
        spec = stored_spec(store.job(version))  # type: ignore[arg-type]
    assert [r.id for r in read_slice(sl, spec.input)] == [f"t{i:03d}" for i in range(10, 20)]
    with contextlib.closing(sqlite3.connect(tmp_path / "tickets.db")) as db:
        db.execute("UPDATE tickets SET acl = '[\"hr\"]' WHERE id = 't012'")
        db.commit()
    with pytest.raises(InputError, match="input changed since planning"):
        read_slice(sl, load_spec(spec_path).input)
