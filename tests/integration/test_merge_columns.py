"""What a downstream merge keys on: a carried row keeps the `created_at` of the attempt that
computed it and names that attempt's version in `origin_version`, in the store and in every
export (the JSONL and Parquet files, the Iceberg table), on both stores; `version` stays the version the
row is published under (in the Iceberg table, the version that wrote the row's file)."""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from batchline.check.validate import validate
from batchline.publish.pointer import publish
from batchline.store import Store
from batchline.targets.files import export_jsonl, export_parquet
from tests.helpers import make_records, planned, run_to_seal, write_jsonl
from tests.iceberg_support import main_rows, with_table


def _night(job_factory: Any, store: Store, records: list[dict[str, Any]], warehouse: Path,
           tmp_path: Path, n: int) -> str:
    path = with_table(job_factory(input_path=write_jsonl(tmp_path / f"night{n}.jsonl", records),
                                  base="published"), warehouse)
    _spec, version = planned(path, store)
    run_to_seal(store, version)
    report = validate(store, version)
    assert report.passed, report.table()
    publish(store, version)
    return version


def test_a_carried_row_took_the_carry_time_and_a_merge_keyed_on_time_saw_every_row_as_new(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    warehouse = tmp_path / "wh"
    records = make_records(60)
    v1 = _night(job_factory, store, records, warehouse, tmp_path, 1)
    first = {r.record_id: r.created_at for r in store.iter_results(v1)}
    time.sleep(1.1)  # the second night's clock is visibly later than the first's
    night2 = [dict(r) for r in records]
    night2[3]["text"] = "a changed ticket"
    v2 = _night(job_factory, store, night2, warehouse, tmp_path, 2)

    rows = {r.record_id: r for r in store.iter_results(v2)}
    changed = records[3]["id"]
    assert rows[changed].origin is None and rows[changed].created_at > max(first.values())
    carried = {rid: r for rid, r in rows.items() if rid != changed}
    assert {r.origin for r in carried.values()} == {v1}
    assert {rid: r.created_at for rid, r in carried.items()} == {rid: first[rid] for rid in carried}

    export_parquet(store, v2, tmp_path / "v2.parquet")
    exported = {r["id"]: r for r in pq.read_table(tmp_path / "v2.parquet").to_pylist()}
    assert {r["version"] for r in exported.values()} == {v2}
    assert {rid: r["origin_version"] for rid, r in exported.items()} == {
        rid: (v2 if rid == changed else v1) for rid in rows}
    assert all(abs(exported[rid]["created_at"].timestamp() - first[rid]) < 0.002 for rid in carried)

    export_jsonl(store, v2, tmp_path / "v2.jsonl")
    lines = {d["id"]: d for d in map(json.loads, (tmp_path / "v2.jsonl").read_text().splitlines())}
    assert {rid: d["origin_version"] for rid, d in lines.items()} == {
        rid: (v2 if rid == changed else v1) for rid in rows}
    assert all(abs(datetime.fromisoformat(lines[rid]["created_at"]).timestamp() - first[rid]) < 0.002
               for rid in carried)

    table = {rid: (version, origin, created) for rid, version, origin, created in main_rows(
        store_url, "lake.results", "id, version, origin_version, epoch(created_at)")}
    # A shard file shared with the base keeps its writer in `version` (publishing.md, files
    # shared between versions); what computed each row is `origin_version` either way.
    assert {rid: t[1] for rid, t in table.items()} == {rid: v2 if rid == changed else v1 for rid in rows}
    assert table[changed][0] == v2 and {t[0] for t in table.values()} == {v1, v2}
    assert all(abs(table[rid][2] - first[rid]) < 0.002 for rid in carried)
