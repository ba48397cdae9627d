"""Results published into an Iceberg table: write to the version's branch, publish and roll
back by moving main in one catalog commit, refusals, races, retention and evolution; read
back by DuckDB's own Iceberg reader, on both stores (the catalog lives in the store's database)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from batchline.check.validate import validate
from batchline.errors import BatchlineError, PublicationMoved, SpecError, StoreError
from batchline.plan.planner import plan
from batchline.publish.pointer import publish, rollback
from batchline.spec import JobVersion, load_spec
from batchline.store import Store, open_store
from batchline.targets.iceberg import IcebergTable
from batchline.targets.iceberg_schema import node_of
from tests.helpers import (
    SIMPLE_SCHEMA,
    before_the_store_records,
    make_records,
    planned,
    read_during_switches,
    run_to_seal,
)
from tests.iceberg_support import (
    duckdb_iceberg,
    main_rows,
    metadata_location,
    pyiceberg_table,
    set_schema,
    with_table,
)
from tests.integration.lake.support import S3StandIn

TABLE = "lake.results"


def sealed(job_factory: Any, store: Store, warehouse: Path | str, records: list[dict[str, Any]] | None = None, *,
           n: int = 40, options: dict[str, Any] | None = None, schema: dict[str, Any] | None = None,
           **top: Any) -> str:
    path = job_factory(records, n=n, options=options, schema=schema,
                       validate={"max_dead_letter_rate": 0.5}, **top)
    with_table(path, warehouse)
    _spec, version = planned(path, store)
    run_to_seal(store, version)
    assert validate(store, version).passed
    return version


def main_versions(store_url: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for _id, _outcome, version in main_rows(store_url, TABLE):
        out[version] = out.get(version, 0) + 1
    return out


def test_publish_writes_a_branch_then_moves_main_and_rollback_moves_it_back(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    wh = tmp_path / "wh"
    v1 = sealed(job_factory, store, wh, n=30, options={"error_on": ["r000004"]})
    v2 = sealed(job_factory, store, wh, make_records(25, "x"))
    publish(store, v1)
    assert main_versions(store_url) == {v1: 30}
    table = pyiceberg_table(store_url, TABLE)
    assert set(table.metadata.refs) == {"main", v1}
    assert table.metadata.snapshot_by_name(v1).summary.additional_properties["batchline.version"] == v1

    # Staged but not published: on its branch, not on main.
    IcebergTable(load_spec_of(store, v2).targets[0].ref, store_url).stage(store, JobVersion.of(store, v2))
    assert main_versions(store_url) == {v1: 30}
    assert v2 in pyiceberg_table(store_url, TABLE).metadata.refs

    publish(store, v2)
    assert main_versions(store_url) == {v2: 25}
    recorded = store.publications("test-job")[-1].targets
    assert recorded is not None
    [state] = recorded.values()
    assert state["snapshot_id"] == pyiceberg_table(store_url, TABLE).metadata.current_snapshot_id
    assert state["version"] == v2

    assert rollback(store, "test-job") == (v2, v1)
    assert main_versions(store_url) == {v1: 30}
    assert pyiceberg_table(store_url, TABLE).metadata.current_snapshot_id == \
        store.publications("test-job")[0].targets["iceberg:store/lake.results"]["snapshot_id"]  # type: ignore[index]


def load_spec_of(store: Store, version: str) -> Any:
    from batchline.spec import stored_spec

    info = store.job(version)
    assert info is not None
    return stored_spec(info)


def test_duckdb_readers_see_one_whole_version_during_30_publish_and_rollback_switches(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    wh = tmp_path / "wh"
    v1 = sealed(job_factory, store, wh, n=300, options={"error_on": ["r000007"]})
    v2 = sealed(job_factory, store, wh, make_records(200, "n"))
    publish(store, v1)
    sizes = {v1: 300, v2: 200}
    problems: list[str] = []
    seen: set[str] = set()

    def reader(stop: threading.Event) -> None:
        con = duckdb_iceberg()
        while not stop.is_set():
            try:
                location = metadata_location(store_url, TABLE)
                rows = con.execute(f"SELECT version, count(*), count(DISTINCT id) FROM iceberg_scan('{location}') "
                                   "GROUP BY version").fetchall()
                if len(rows) != 1 or rows[0][1] != sizes[rows[0][0]] or rows[0][2] != rows[0][1]:
                    problems.append(f"read {rows}")
                else:
                    seen.add(rows[0][0])
            except Exception as exc:  # a reader of main must never get an error
                problems.append(repr(exc))
        con.close()

    read_during_switches(store, "test-job", v2, reader)
    assert problems == []
    assert seen == {v1, v2}  # the readers did read across the switches
    assert main_versions(store_url) == {v1: 300} and store.resolve_name("test-job") == v1
    # 30 switches moved main; none wrote a snapshot: each version was written once, to its branch.
    assert len(pyiceberg_table(store_url, TABLE).metadata.snapshots) == 3  # the empty first one, v1, v2


def test_acl_on_every_row_of_the_table_results_and_dead_letters_joined_with_the_source(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    records = make_records(120)
    for i, r in enumerate(records):
        r["acl"] = [f"team-{i % 4}", f"user{i}"]
    version = sealed(job_factory, store, tmp_path / "wh", records, options={"error_on": ["r000009", "r000050"]})
    publish(store, version)
    con = duckdb_iceberg()
    con.execute("CREATE TABLE source (id VARCHAR, acl VARCHAR[])")
    con.executemany("INSERT INTO source VALUES (?, ?)", [(r["id"], r["acl"]) for r in records])
    location = metadata_location(store_url, TABLE)
    joined = con.execute(f"""
        SELECT t.outcome, count(*), count(*) FILTER (WHERE t.acl IS NOT DISTINCT FROM s.acl),
               count(*) FILTER (WHERE t.error_kind IS NOT NULL), count(*) FILTER (WHERE t.output IS NOT NULL)
        FROM iceberg_scan('{location}') t JOIN source s USING (id) GROUP BY t.outcome ORDER BY t.outcome""").fetchall()
    assert joined == [("dead_letter", 2, 2, 2, 0), ("result", 118, 118, 0, 118)]
    # A row for every record, each once: results and dead letters came in one commit.
    assert con.execute(f"SELECT count(DISTINCT id), count(*) FROM iceberg_scan('{location}')").fetchall() == [(120, 120)]
    letters = con.execute(f"SELECT id, error_kind, error LIKE '%r000009%' OR error LIKE '%r000050%' OR true "
                          f"FROM iceberg_scan('{location}') WHERE outcome = 'dead_letter' ORDER BY id").fetchall()
    assert [(i, k) for i, k, _e in letters] == [("r000009", "engine_error"), ("r000050", "engine_error")]


TYPED_SCHEMA = {
    "type": "object",
    "properties": {
        "category": {"enum": ["a", "b", "c"]},
        "summary": {"type": "string", "maxLength": 30},
        "score": {"type": "integer", "minimum": 0, "maximum": 9},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
        "detail": {"type": "object", "properties": {"urgent": {"type": "boolean"}}, "required": ["urgent"],
                   "additionalProperties": False},
        "anything": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
        "id": {"type": "string", "maxLength": 5},
    },
    "required": ["category", "summary", "score", "confidence", "tags", "detail", "anything", "id"],
    "additionalProperties": False,
}


def test_output_fields_are_typed_columns_under_output_so_they_cannot_collide_with_id(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    version = sealed(job_factory, store, tmp_path / "wh", n=20, schema=TYPED_SCHEMA)
    publish(store, version)
    con = duckdb_iceberg()
    location = metadata_location(store_url, TABLE)
    types = {r[0]: r[1] for r in con.execute(f"DESCRIBE SELECT * FROM iceberg_scan('{location}')").fetchall()}
    assert types["output"] == ("STRUCT(category VARCHAR, summary VARCHAR, score BIGINT, confidence DOUBLE, "
                               "tags VARCHAR[], detail STRUCT(urgent BOOLEAN), anything VARCHAR, id VARCHAR)")
    assert types["id"] == "VARCHAR" and types["acl"] == "VARCHAR[]" and types["model"] == "VARCHAR"
    rows = con.execute(f"SELECT id, output.id, output.score, output.detail.urgent, output.anything, raw_output "
                       f"FROM iceberg_scan('{location}') ORDER BY id").fetchall()
    assert len(rows) == 20
    for record_id, out_id, score, urgent, anything, raw in rows:
        raw_value = json.loads(raw)
        assert record_id.startswith("r") and out_id == raw_value["id"]  # the record's id and the output's own
        assert score == raw_value["score"] and urgent == raw_value["detail"]["urgent"]
        assert json.loads(anything) == raw_value["anything"]  # no one clear type: its JSON


def test_json_schema_types_map_to_columns() -> None:
    assert node_of({"enum": ["a", "b"]}).kind == "string"
    assert node_of({"enum": ["a", 1]}).kind == "json"
    assert node_of({"type": ["integer", "null"]}).kind == "long"
    assert node_of({"type": ["integer", "string"]}).kind == "json"
    assert node_of({"oneOf": [{"type": "string"}]}).kind == "json"
    assert node_of({}).kind == "json"
    assert node_of({"type": "object"}).kind == "json"  # no properties: a free-form object
    assert node_of({"type": "array", "items": {"type": "number"}}).describe() == "list<double>"
    assert node_of(SIMPLE_SCHEMA).describe() == "struct"


def move_main_elsewhere(store_url: str, version: str) -> int:
    """Someone else makes another snapshot current on the table's main."""
    table = pyiceberg_table(store_url, TABLE)
    other = table.metadata.refs[version].snapshot_id
    table.manage_snapshots().set_current_snapshot(snapshot_id=other).commit()
    return int(other)


def published_then_staged(job_factory: Any, store: Store, store_url: str, wh: Path, *sizes: int) -> list[str]:
    """Sealed versions of these sizes: the first published, the others staged on their branches."""
    versions = [sealed(job_factory, store, wh, make_records(n, f"v{i}-")) for i, n in enumerate(sizes)]
    publish(store, versions[0])
    for v in versions[1:]:
        IcebergTable(load_spec_of(store, v).targets[0].ref, store_url).stage(store, JobVersion.of(store, v))
    return versions


def before_the_next_metadata_swap(monkeypatch: pytest.MonkeyPatch, other_writer: Any) -> list[bool]:
    """Runs `other_writer` once, after the next catalog commit has read the table and before it
    swaps the table's metadata: that commit then finds the table changed under it."""
    from pyiceberg.catalog.sql import SqlCatalog

    write_metadata = SqlCatalog._write_metadata  # a static method, inherited
    ran: list[bool] = []

    def first(*args: Any, **kwargs: Any) -> Any:
        ran.append(True)
        monkeypatch.delattr(SqlCatalog, "_write_metadata")
        other_writer()
        return write_metadata(*args, **kwargs)

    monkeypatch.setattr(SqlCatalog, "_write_metadata", staticmethod(first))
    return ran


def test_publish_is_refused_when_main_is_not_the_snapshot_the_store_recorded(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    v1, v2, v3 = published_then_staged(job_factory, store, store_url, tmp_path / "wh", 20, 25, 15)
    moved_to = move_main_elsewhere(store_url, v2)
    with pytest.raises(BatchlineError, match=rf"main is snapshot {moved_to} \({v2}\), not \d+ \({v1}\) as the "
                                             "store recorded; not changing it"):
        publish(store, v3)
    assert store.resolve_name("test-job") == v1
    assert pyiceberg_table(store_url, TABLE).metadata.current_snapshot_id == moved_to


def test_a_catalog_commit_that_loses_a_race_is_tried_again_against_the_new_metadata(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _v1, v2 = published_then_staged(job_factory, store, store_url, tmp_path / "wh", 20, 25)

    def set_a_property() -> None:
        with pyiceberg_table(store_url, TABLE).transaction() as tx:
            tx.set_properties({"owner": "someone else"})

    raced = before_the_next_metadata_swap(monkeypatch, set_a_property)
    publish(store, v2)
    assert raced
    assert main_versions(store_url) == {v2: 25}
    assert pyiceberg_table(store_url, TABLE).metadata.properties["owner"] == "someone else"  # it stands


def test_a_race_lost_to_a_writer_that_moved_main_is_refused_and_nothing_moves(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    v1, v2, v3 = published_then_staged(job_factory, store, store_url, tmp_path / "wh", 20, 25, 15)
    raced = before_the_next_metadata_swap(monkeypatch, lambda: move_main_elsewhere(store_url, v2))
    with pytest.raises(BatchlineError, match=rf"\({v2}\), not \d+ \({v1}\) as the store recorded"):
        publish(store, v3)
    assert raced
    assert store.resolve_name("test-job") == v1 and main_versions(store_url) == {v2: 25}


def test_a_store_that_fails_to_publish_after_the_catalog_commit_gets_the_table_put_back(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wh = tmp_path / "wh"
    v1 = sealed(job_factory, store, wh, n=20)
    v2 = sealed(job_factory, store, wh, make_records(25, "x"))
    publish(store, v1)
    before = pyiceberg_table(store_url, TABLE).metadata.current_snapshot_id

    def refuse(*_a: Any, **_k: Any) -> Any:
        assert main_versions(store_url) == {v2: 25}  # the catalog commit had gone through
        raise StoreError("store unreachable")

    monkeypatch.setattr(store, "publish", refuse)
    with pytest.raises(StoreError, match="store unreachable"):
        publish(store, v2)
    assert pyiceberg_table(store_url, TABLE).metadata.current_snapshot_id == before
    assert main_versions(store_url) == {v1: 20}
    monkeypatch.undo()
    publish(store, v2)  # and the next publish starts from the state the store recorded
    assert main_versions(store_url) == {v2: 25}


def test_two_publishers_at_once_leave_the_store_and_the_table_agreeing(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One publisher names the version main already shows, the other another version; the
    second publishes in full between the first's catalog commit and its store write (as
    they fell when released together: the first's commit changed nothing, so the second's
    check of main passed)."""
    wh = tmp_path / "wh"
    v1 = sealed(job_factory, store, wh, n=20)
    v2 = sealed(job_factory, store, wh, make_records(25, "x"))
    publish(store, v1)
    other = open_store(store_url)
    try:
        came_between = before_the_store_records(monkeypatch, store, "publish", lambda: publish(other, v2))
        with pytest.raises(PublicationMoved, match=rf"^cannot publish {v1} as 'test-job': another publish or "
                                                   rf"rollback of 'test-job' came in between \(it now shows {v2}, "
                                                   r"published by .*\); nothing was recorded"):
            publish(store, v1)
        assert [r.version for r in came_between] == [v2]
        monkeypatch.undo()

        # The store, the table and what the store recorded of the table all say v2.
        assert store.resolve_name("test-job") == v2 and main_versions(store_url) == {v2: 25}
        history = store.publications("test-job")
        assert [(p.version, p.previous) for p in history] == [(v1, None), (v2, v1)]
        table = pyiceberg_table(store_url, TABLE)
        assert history[-1].targets == {"iceberg:store/lake.results": {
            "table_uuid": str(table.metadata.table_uuid), "snapshot_id": table.metadata.current_snapshot_id,
            "version": v2, "metadata_location": table.metadata_location}}
        # So the next rollback and publish are not refused.
        assert rollback(store, "test-job") == (v2, v1)
        assert main_versions(store_url) == {v1: 20}
        publish(store, v2)
        assert store.resolve_name("test-job") == v2 and main_versions(store_url) == {v2: 25}
    finally:
        other.close()


def test_the_first_publish_into_a_new_table_puts_back_its_empty_first_snapshot_when_the_store_fails(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    v1 = sealed(job_factory, store, tmp_path / "wh", n=20)
    monkeypatch.setattr(store, "publish", lambda *_a, **_k: (_ for _ in ()).throw(StoreError("store unreachable")))
    with pytest.raises(StoreError):
        publish(store, v1)
    assert main_rows(store_url, TABLE) == []  # the empty first snapshot, not v1
    monkeypatch.undo()
    publish(store, v1)
    assert main_versions(store_url) == {v1: 20}


def data_files(warehouse: Path) -> set[Path]:
    return set(warehouse.rglob("*.parquet"))


def test_retention_removes_pruned_versions_branches_snapshots_and_their_files(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    wh = tmp_path / "wh"
    versions, files = [], []
    for night in range(4):
        before = data_files(wh) if wh.exists() else set()
        versions.append(sealed(job_factory, store, wh, make_records(10 + night, f"n{night}-"),
                               retention={"versions": 2}))
        publish(store, versions[-1])
        files.append(data_files(wh) - before)
        assert files[-1], "each publish wrote its version's data files"
    table = pyiceberg_table(store_url, TABLE)
    # Kept: the published version and the one a rollback returns to.
    assert set(table.metadata.refs) == {"main", versions[3], versions[2]}
    assert {s.summary.additional_properties.get("batchline.version") for s in table.metadata.snapshots} == \
        {versions[3], versions[2]}
    for pruned in files[:2]:
        assert not any(f.exists() for f in pruned)
    for kept in files[2:]:
        assert all(f.exists() for f in kept)
    assert rollback(store, "test-job") == (versions[3], versions[2])
    assert main_versions(store_url) == {versions[2]: 12}


def test_a_version_may_add_output_columns_and_any_other_change_is_refused_at_planning(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    wh = tmp_path / "wh"
    v1 = sealed(job_factory, store, wh, n=20)
    publish(store, v1)
    added = json.loads(json.dumps(SIMPLE_SCHEMA))
    added["properties"]["priority"] = {"type": "integer", "minimum": 1, "maximum": 3}
    added["required"] = [*added["required"], "priority"]
    v2 = sealed(job_factory, store, wh, make_records(10, "x"), schema=added)
    publish(store, v2)
    rows = main_rows(store_url, TABLE, "id, output.priority, output.category")
    assert len(rows) == 10 and all(isinstance(p, int) for _i, p, _c in rows)
    rollback(store, "test-job")
    assert {p for _i, p, _c in main_rows(store_url, TABLE, "id, output.priority, output.category")} == {None}

    for change, column in (("type", "output.summary is string in the table and long"),
                           ("removed", "output.summary (string) is in the table but not in this version's output")):
        schema = json.loads(json.dumps(added))
        if change == "type":
            schema["properties"]["summary"] = {"type": "integer"}
        else:
            del schema["properties"]["summary"]
            schema["required"] = ["category"]
        path = with_table(set_schema(job_factory(make_records(5, "z")), schema), wh)
        with pytest.raises(SpecError, match=rf"^output.table {TABLE}: column {re.escape(column)}.*only new columns may be added$"):
            plan(load_spec(path), store)
    assert len(store.jobs()) == 2  # nothing of the refused plans was left


def test_publish_and_rollback_on_the_command_line_move_the_table(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    wh = tmp_path / "wh"
    path = with_table(job_factory(n=30), wh)
    run = subprocess.run([sys.executable, "-m", "batchline", "run", str(path), "--store", store_url, "--publish"],
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    v1 = run.stdout.strip()
    assert main_versions(store_url) == {v1: 30}
    snapshot = pyiceberg_table(store_url, TABLE).metadata.current_snapshot_id
    assert f"Iceberg table {TABLE} in catalog 'store': table_uuid" in run.stderr
    assert f"snapshot_id {snapshot}, version {v1}" in run.stderr
    v2 = sealed(job_factory, store, wh, make_records(12, "x"))
    cli = [sys.executable, "-m", "batchline"]
    assert subprocess.run([*cli, "publish", v2, "--store", store_url], timeout=120).returncode == 0
    assert main_versions(store_url) == {v2: 12}
    back = subprocess.run([*cli, "rollback", "test-job", "--store", store_url], capture_output=True, text=True,
                          timeout=120)
    assert back.returncode == 0, back.stderr
    assert main_versions(store_url) == {v1: 30}
    v3 = sealed(job_factory, store, wh, make_records(7, "y"))
    move_main_elsewhere(store_url, v2)
    refused = subprocess.run([*cli, "publish", v3, "--store", store_url], capture_output=True, text=True,
                             timeout=120)
    assert refused.returncode != 0 and len(refused.stderr.strip().splitlines()) == 1
    assert "as the store recorded" in refused.stderr and store.resolve_name("test-job") == v1


def test_grants_say_the_worker_needs_no_catalog_right_and_the_publisher_needs_the_catalog(
        job_factory: Any, store: Store, tmp_path: Path) -> None:
    from batchline.ops.grants import snapshot_access

    path = with_table(job_factory(n=10), tmp_path / "wh")
    _spec, version = planned(path, store)
    info = store.job(version)
    assert info is not None
    spec = dict(info.spec)
    spec["input"] = {**spec["input"], "table": {"catalog": "lake", "name": "src.tickets", "snapshot_id": 7}}
    del spec["input"]["path"]
    lines = snapshot_access(spec)
    [reads] = [line for line in lines if line.startswith("input table src.tickets")]
    assert "the worker needs no catalog right" in reads and "snapshot 7" in reads
    [publishes] = [line for line in lines if line.startswith(f"output table {TABLE}")]
    assert "the worker needs nothing of it" in publishes
    assert "SELECT, INSERT, UPDATE and DELETE on the catalog's tables iceberg_tables" in publishes
    assert str(tmp_path / "wh") in publishes


def test_a_whole_float_goes_into_a_long_column_and_a_fraction_is_refused_not_truncated() -> None:
    # Regression: pyarrow writes 1.5 into a long column as 1 without a word.
    from batchline.targets.iceberg_schema import converter

    node = node_of({"type": "object", "properties": {"n": {"type": "integer"},
                                                      "xs": {"type": "array", "items": {"type": "integer"}},
                                                      "free": {"type": "object"}}})
    convert = converter(node)
    assert convert is not None
    assert convert({"n": 2.0, "xs": [1, 3.0], "free": {"a": [1]}}) == {"n": 2, "xs": [1, 3], "free": '{"a":[1]}'}
    with pytest.raises(BatchlineError, match=r"output.xs\[\] = 1.5 is not a whole number for a long column"):
        convert({"n": 1, "xs": [1.5]})
    assert converter(node_of(SIMPLE_SCHEMA)) is None  # strings only: nothing to convert


def test_a_table_with_its_warehouse_in_the_s3_standin_publishes_rolls_back_and_prunes_its_objects(
        job_factory: Any, store: Store, store_url: str, lake_env: S3StandIn) -> None:
    bucket = lake_env.bucket()
    versions, written = [], []
    for night in range(4):
        before = set(bucket.keys())
        versions.append(sealed(job_factory, store, bucket.url("wh"), make_records(10 + night, f"n{night}-"),
                               retention={"versions": 2}))
        publish(store, versions[-1])
        written.append({k for k in set(bucket.keys()) - before if k.endswith(".parquet")})
        assert written[-1], "each publish wrote its version's data files into the bucket"
    rows = main_rows(store_url, TABLE, s3=lake_env)
    assert {v for _i, _o, v in rows} == {versions[3]} and len(rows) == 13
    left = set(bucket.keys())
    assert not (written[0] | written[1]) & left  # pruned versions' objects are deleted
    assert written[2] | written[3] <= left
    assert rollback(store, "test-job") == (versions[3], versions[2])
    assert {v for _i, _o, v in main_rows(store_url, TABLE, s3=lake_env)} == {versions[2]}
