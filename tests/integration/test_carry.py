"""output.carry: input fields copied onto every result and dead letter, so results join back to
the input without a second read of it."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from batchline.check.validate import validate
from batchline.errors import InputError, SpecError
from batchline.publish.pointer import publish
from batchline.spec import load_spec, stored_spec
from batchline.store import Store
from batchline.targets.files import export_jsonl, export_parquet
from batchline.targets.openai_batch import export_openai_batch, openai_errors_path
from tests.helpers import Database, make_records, planned, run_to_seal, write_jsonl
from tests.iceberg_support import duckdb_iceberg, metadata_location, with_table

PINNED = Path(__file__).resolve().parents[1] / "data" / "pinned"


def customers(n: int, prefix: str = "r") -> list[dict[str, Any]]:
    records = make_records(n, prefix)
    for i, r in enumerate(records):
        r["customer"] = 1000 + i
        r["region"] = ["eu", "us", None][i % 3]
    return records


def set_output(path: Path, **output: Any) -> Path:
    spec = yaml.safe_load(path.read_text())
    spec["output"].update(output)
    path.write_text(yaml.safe_dump(spec))
    return path


def test_carried_input_fields_travel_onto_results_dead_letters_every_export_and_the_view(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    records = customers(40)
    path = job_factory(records, options={"error_on": ["r000007"]}, validate={"max_dead_letter_rate": 0.5})
    with_table(path, tmp_path / "wh")
    set_output(path, carry=["customer", "region"], dataset=str(tmp_path / "datasets"))
    spec, version = planned(path, store)
    run_to_seal(store, version)
    assert validate(store, version).passed
    publish(store, version)
    source = {r["id"]: {"customer": r["customer"], "region": r["region"]} for r in records}
    # As text where a column has one type for every input: a number as its JSON, null as null.
    as_text = {rid: {"customer": str(c["customer"]), "region": c["region"]} for rid, c in source.items()}

    results = {r.record_id: r.carry for r in store.iter_results(version)}
    letters = {d.record_id: d.carry for d in store.iter_dead_letters(version)}
    assert len(results) == 39 and set(letters) == {"r000007"}
    assert {**results, **letters} == source
    assert {r: store.results_for(version, [r])[r].carry for r in ("r000001", "r000002")} == {
        r: source[r] for r in ("r000001", "r000002")}

    export_jsonl(store, version, tmp_path / "out.jsonl")
    assert {d["id"]: d["carry"] for d in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())} == (
        results)
    export_openai_batch(store, version, tmp_path / "batch.jsonl", openai_errors_path(tmp_path / "batch.jsonl"))
    lines = [json.loads(x) for f in ("batch.jsonl", "batch.errors.jsonl") for x in (tmp_path / f).read_text().split("\n")
             if x]
    assert {line["custom_id"]: line["carry"] for line in lines} == source

    export_parquet(store, version, tmp_path / "out.parquet")
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.schema.field("carry").type == pa.struct([("customer", pa.string()), ("region", pa.string())])
    assert {r["id"]: r["carry"] for r in table.to_pylist()} == {rid: as_text[rid] for rid in results}
    folder = tmp_path / "datasets" / spec.name / version.replace("@", "-")
    assert {r["id"]: r["carry"] for r in pq.read_table(folder).to_pylist()} == {rid: as_text[rid] for rid in results}

    con = duckdb_iceberg()
    rows = con.execute(f"SELECT id, outcome, carry.customer, carry.region FROM "
                       f"iceberg_scan('{metadata_location(store_url, 'lake.results')}')").fetchall()
    assert {rid: {"customer": c, "region": g} for rid, _o, c, g in rows} == as_text
    assert {o for rid, o, _c, _g in rows if rid == "r000007"} == {"dead_letter"}

    with Database(store_url) as db:
        viewed = db.execute(f"SELECT id, carry FROM {db.view(spec.name)}")
    assert {rid: json.loads(carry) for rid, carry in viewed} == results


def test_a_job_without_carry_keeps_its_version_and_one_with_it_is_another(store: Store, tmp_path: Path) -> None:
    folder = tmp_path / "pinned"
    shutil.copytree(PINNED, folder)
    without = folder / "csv.yaml"
    _, version = planned(without, store)
    assert version == "pinned-csv@18ed8a40ad420681"  # tests/integration/test_pinned_versions.py's
    plain = load_spec(without)
    assert "carry" not in plain.to_dict()["output"] and "carry" not in plain.version_material("")

    carrying = folder / "carry.yaml"
    carrying.write_text(without.read_text().replace("  label_field: category\n",
                                                    "  label_field: category\n  carry: [acl]\n"))
    spec, other = planned(carrying, store)
    assert other != version and spec.input.carry == ("acl",)
    # The same inference: a base version of either may carry the other's results.
    assert spec.inference_identity() == plain.inference_identity()
    info = store.job(other)
    assert info is not None and stored_spec(info).input.carry == ("acl",)
    assert stored_spec(info).version_material("") == spec.version_material("")
    # A different list of fields is a different version again.
    carrying.write_text(carrying.read_text().replace("carry: [acl]", "carry: [acl, text]"))
    assert planned(carrying, store)[1] not in (version, other)


def test_a_result_carried_from_the_base_version_gets_this_versions_carried_values(
        job_factory: Any, store: Store, tmp_path: Path) -> None:
    records = customers(30)
    first = job_factory(records, base="published")
    set_output(first, label_field="category", carry=["customer"])
    _, v1 = planned(first, store)
    run_to_seal(store, v1)
    assert validate(store, v1).passed
    publish(store, v1)

    night2 = [dict(r, customer=r["customer"] + 500) for r in records]
    night2[4]["text"] = "a changed ticket"
    second = job_factory(input_path=write_jsonl(tmp_path / "night2.jsonl", night2), base="published")
    set_output(second, label_field="category", carry=["customer", "region"])
    _, v2 = planned(second, store)
    run_to_seal(store, v2)
    results = {r.record_id: r for r in store.iter_results(v2)}
    assert sum(1 for r in results.values() if r.origin == v1) == 29 and results["r000004"].origin is None
    assert {rid: r.carry for rid, r in results.items()} == {
        r["id"]: {"customer": r["customer"], "region": r["region"]} for r in night2}
    # The base version's own rows keep its values.
    assert {r.record_id: r.carry for r in store.iter_results(v1)} == {r["id"]: {"customer": r["customer"]}
                                                                      for r in records}


def test_a_record_without_a_carried_field_is_refused_at_planning_with_its_file_and_line(
        job_factory: Any, store: Store, tmp_path: Path) -> None:
    records = customers(10)
    del records[6]["customer"]
    path = set_output(job_factory(records), carry=["customer"])
    with pytest.raises(InputError, match=r"input\.jsonl:7: id 'r000006': carried field 'customer' is missing"):
        planned(path, store)

    csv_input = tmp_path / "in.csv"
    with csv_input.open("w", newline="") as f:
        csv.writer(f).writerows([["id", "text"], ["a", "one"]])
    path = set_output(job_factory(input_path=csv_input), carry=["customer"])
    with pytest.raises(InputError, match=r"in\.csv:1: CSV header has no column 'customer', which output\.carry"):
        planned(path, store)

    parquet_input = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ["a"], "text": ["one"]}), parquet_input)
    path = set_output(job_factory(input_path=parquet_input), carry=["customer"])
    with pytest.raises(InputError, match=r"in\.parquet: Parquet file has no column 'customer', which output\.carry"):
        planned(path, store)
    assert store.jobs() == []

    path = set_output(job_factory(n=3), carry=["customer", "customer"])
    with pytest.raises(SpecError, match=r"output\.carry: names a field twice"):
        load_spec(path)


def test_a_view_made_before_carried_fields_gets_its_carry_column_at_its_next_publish(
        job_factory: Any, store: Store, store_url: str) -> None:
    _, v1 = planned(job_factory(customers(10)), store)
    run_to_seal(store, v1)
    assert validate(store, v1).passed
    publish(store, v1)
    with Database(store_url) as db:
        # The view as the release before made it: no carry column.
        view = db.view("test-job")
        db.execute(f"DROP VIEW {view}")
        db.execute(f"""CREATE VIEW {view} AS
            SELECT r.record_id AS id, COALESCE(r.output, o.output) AS output, r.acl AS acl, r.label AS label,
                   r.version AS version
            FROM pointers p JOIN results r ON r.version = p.version
            LEFT JOIN results o ON r.origin IS NOT NULL AND o.version = r.origin AND o.record_id = r.record_id
            WHERE p.name = 'test-job'""")
    path = set_output(job_factory(customers(12, "x")), carry=["customer"])
    _, v2 = planned(path, store)
    run_to_seal(store, v2)
    assert validate(store, v2).passed
    publish(store, v2)
    with Database(store_url) as db:
        rows = db.execute(f"SELECT id, version, carry FROM {db.view('test-job')}")
    assert sorted((rid, json.loads(c)["customer"]) for rid, v, c in rows if v == v2) == [
        (f"x{i:06d}", 1000 + i) for i in range(12)]
