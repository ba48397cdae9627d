"""input.text_fields through planning: every listed field reaches the prompt the engine is sent
and the text graders read, and an input without one of them is refused naming it and where."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchline.errors import InputError
from batchline.plan.planner import plan
from batchline.snapshot import Slice, read_slice, records_of
from batchline.spec import load_spec
from batchline.spec.parse import stored_spec
from batchline.store import Store
from batchline.worker.shard import JobContext
from tests.helpers import write_jsonl

FIELDS = {"text_fields": ["subject", "body"]}


def tickets(n: int) -> list[dict[str, Any]]:
    return [{"id": f"t{i}", "subject": f"Subject {i}", "body": f"Body of ticket {i}.\nSecond line.",
             "acl": ["support"]} for i in range(n)]


def expected_text(i: int) -> str:
    return f"subject: Subject {i}\n\nbody: Body of ticket {i}.\nSecond line."


def claimed_slices(store: Store, version: str) -> list[Slice]:
    slices = []
    while (lease := store.claim("reader", version)) is not None:
        slices.append((lease.shard_no, Slice.from_json(lease.slice)))
    return [s for _, s in sorted(slices, key=lambda x: x[0])]


def test_every_listed_field_reaches_the_prompt_the_engine_is_sent(job_factory: Any, store: Store,
                                                                  tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "tickets.jsonl", tickets(60))
    version = plan(load_spec(job_factory(input_path=path, input_extra=FIELDS)), store).version
    info = store.job(version)
    assert info is not None
    # The worker's view: the stored spec, its shards' slices, the request its engine child gets.
    spec = stored_spec(info)
    assert spec.input.text_fields == ("subject", "body")
    job = JobContext.of(spec)
    records = [r for sl in claimed_slices(store, version) for r in read_slice(sl, spec.input)]
    assert [r.text for r in records] == [expected_text(i) for i in range(60)]
    request = job.request(records[7])
    assert request["text"] == expected_text(7)
    assert request["prompt"] == f"Classify.\n<record>\n{expected_text(7)}\n</record>\n"


def test_graders_and_reproduce_read_the_same_composed_text(job_factory: Any, store: Store, tmp_path: Path) -> None:
    # Graders and validate.reproduce read a version's records through records_of.
    path = write_jsonl(tmp_path / "tickets.jsonl", tickets(60))
    version = plan(load_spec(job_factory(input_path=path, input_extra=FIELDS)), store).version
    info = store.job(version)
    assert info is not None
    found = records_of(store, version, stored_spec(info), {"t3": 0, "t55": 1})
    assert {rid: r.text for rid, r in found.items()} == {"t3": expected_text(3), "t55": expected_text(55)}


def test_changing_the_listed_fields_plans_a_new_version(job_factory: Any, store: Store, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "tickets.jsonl", tickets(5))
    both = plan(load_spec(job_factory(input_path=path, input_extra=FIELDS)), store)
    body = plan(load_spec(job_factory(input_path=path, input_extra={"text_fields": ["body"]})), store)
    assert both.created and body.created and both.version != body.version


def test_a_jsonl_record_without_a_listed_field_is_refused_naming_it(job_factory: Any, store: Store,
                                                                    tmp_path: Path) -> None:
    rows = tickets(5)
    del rows[3]["body"]
    path = write_jsonl(tmp_path / "tickets.jsonl", rows)
    with pytest.raises(InputError) as info:
        plan(load_spec(job_factory(input_path=path, input_extra=FIELDS)), store)
    assert str(info.value) == f"{path}:4: id 't3': text field 'body' is missing"
    assert store.jobs() == []


def test_a_parquet_file_without_a_listed_column_is_refused_naming_it(job_factory: Any, store: Store,
                                                                      tmp_path: Path) -> None:
    path = tmp_path / "tickets.parquet"
    pq.write_table(pa.Table.from_pylist([{k: v for k, v in r.items() if k != "body"} for r in tickets(5)]), path)
    with pytest.raises(InputError) as info:
        plan(load_spec(job_factory(input_path=path, input_extra=FIELDS)), store)
    assert str(info.value) == f"{path}: Parquet file has no column 'body'"
    assert store.jobs() == []


def test_a_parquet_row_with_a_null_listed_field_is_refused_naming_it_and_the_row(
        job_factory: Any, store: Store, tmp_path: Path) -> None:
    rows = tickets(5)
    rows[2]["subject"] = None
    path = tmp_path / "tickets.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(InputError) as info:
        plan(load_spec(job_factory(input_path=path, input_extra=FIELDS)), store)
    assert str(info.value) == f"{path}:3: id 't2': text field 'subject' is missing"
    assert store.jobs() == []


def test_parquet_rows_compose_the_same_text_as_jsonl(job_factory: Any, store: Store, tmp_path: Path) -> None:
    path = tmp_path / "tickets.parquet"
    pq.write_table(pa.Table.from_pylist(tickets(5)), path)
    spec = load_spec(job_factory(input_path=path, input_extra=FIELDS))
    version = plan(spec, store).version
    records = [r for sl in claimed_slices(store, version) for r in read_slice(sl, spec.input)]
    assert [r.text for r in records] == [expected_text(i) for i in range(5)]


def test_a_csv_header_without_a_listed_column_is_refused_naming_it(job_factory: Any, store: Store,
                                                                    tmp_path: Path) -> None:
    path = tmp_path / "tickets.csv"
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["id", "subject", "acl"])
        w.writerow(["t0", "Subject 0", "support"])
    with pytest.raises(InputError) as info:
        plan(load_spec(job_factory(input_path=path, input_extra=FIELDS)), store)
    assert str(info.value) == f"{path}:1: CSV header has no column 'body' (columns: id, subject, acl)"
    assert store.jobs() == []


def test_csv_rows_compose_the_same_text_as_jsonl(job_factory: Any, store: Store, tmp_path: Path) -> None:
    path = tmp_path / "tickets.csv"
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["id", "body", "subject"])
        for r in tickets(5):
            w.writerow([r["id"], r["body"], r["subject"]])
    spec = load_spec(job_factory(input_path=path, input_extra=FIELDS))
    version = plan(spec, store).version
    records = [r for sl in claimed_slices(store, version) for r in read_slice(sl, spec.input)]
    assert [r.text for r in records] == [expected_text(i) for i in range(5)]
