"""`output.provenance: true`: each row says which attempt it is (the attempt that computed it,
its worker and lease epoch, and the version that computed it: a carried result names the base
version and that version's worker) in the JSONL and Parquet exports, the Iceberg table and the
index rows; an output setting, so no version moves. On both stores."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import yaml

from batchline.api import Jobs
from batchline.spec import load_spec
from batchline.store import Store
from tests.helpers import write_jsonl
from tests.iceberg_support import main_rows, with_table


def with_provenance(path: Path, **output: Any) -> Path:
    spec = yaml.safe_load(path.read_text())
    spec["output"].update({"provenance": True, **output})
    path.write_text(yaml.safe_dump(spec))
    return path


def run(spec: Path, store_url: str) -> str:
    result = Jobs(store_url).run(spec, workers=2, publish=True, progress=None, log=lambda _m: None)
    assert result.exit_code == 0
    return result.version


def jsonl_rows(store_url: str, version: str, tmp_path: Path) -> dict[str, dict[str, Any]]:
    out = tmp_path / f"{version.replace('@', '_')}.jsonl"
    Jobs(store_url).export(version, format="jsonl", out=out)
    return {row["id"]: row for row in map(json.loads, out.read_text().splitlines())}


def test_provenance_names_each_rows_attempt_worker_epoch_and_the_version_that_computed_it(
        job_factory: Any, store_url: str, store: Store, tmp_path: Path) -> None:
    records = [{"id": f"r{i:06d}", "text": f"ticket {i}", "acl": ["g"]} for i in range(80)]
    first = with_provenance(job_factory(records, base="published"))
    v1 = run(first, store_url)
    stored = {r.record_id: r for r in store.iter_results(v1)}
    rows = jsonl_rows(store_url, v1, tmp_path)
    assert {rid: row["provenance"] for rid, row in rows.items()} == {
        rid: {"attempt": r.attempt, "worker": r.worker, "epoch": r.epoch, "origin_version": v1}
        for rid, r in stored.items()}
    assert len({row["provenance"]["worker"] for row in rows.values()}) >= 1
    night = [dict(r) for r in records]
    night[5]["text"] = "a changed ticket"
    second = with_provenance(job_factory(input_path=write_jsonl(tmp_path / "night.jsonl", night), base="published"))
    v2 = run(second, store_url)
    carried = jsonl_rows(store_url, v2, tmp_path)
    # A carried row is the base version's attempt, by that version's worker, under its lease epoch.
    assert carried["r000001"]["provenance"] == {"attempt": stored["r000001"].attempt, "worker": stored["r000001"].worker,
                                                "epoch": stored["r000001"].epoch, "origin_version": v1}
    recomputed = {r.record_id: r for r in store.iter_results(v2)}["r000005"]
    assert carried["r000005"]["provenance"] == {"attempt": recomputed.attempt, "worker": recomputed.worker,
                                                "epoch": recomputed.epoch, "origin_version": v2}
    parquet = tmp_path / "v2.parquet"
    Jobs(store_url).export(v2, format="parquet", out=parquet)
    table = pq.read_table(parquet)
    by_id = dict(zip(table.column("id").to_pylist(), table.column("provenance").to_pylist(), strict=True))
    assert by_id == {rid: row["provenance"] for rid, row in carried.items()}


def test_a_job_without_provenance_exports_none_and_provenance_moves_no_version(
        job_factory: Any, store_url: str, tmp_path: Path) -> None:
    plain = job_factory(n=20)
    version = run(plain, store_url)
    assert "provenance" not in next(iter(jsonl_rows(store_url, version, tmp_path).values()))
    out = tmp_path / "plain.parquet"
    Jobs(store_url).export(version, format="parquet", out=out)
    assert "provenance" not in pq.read_table(out).column_names
    spec = load_spec(plain)
    assert load_spec(with_provenance(plain)).version("sha256:x") == spec.version("sha256:x")


def test_the_iceberg_table_and_the_index_rows_carry_provenance(
        job_factory: Any, store_url: str, tmp_path: Path) -> None:
    import lancedb

    from batchline.targets.lancedb_index import version_tag

    path = with_table(job_factory(n=30), tmp_path / "warehouse")
    with_provenance(path)
    version = run(path, store_url)
    rows = main_rows(store_url, "lake.results", "id, provenance.origin_version, provenance.epoch, provenance.worker")
    assert len(rows) == 30 and {r[1] for r in rows} == {version} and all(r[2] >= 1 and r[3] for r in rows)

    vectors = {"type": "object", "properties": {"embedding": {"type": "array", "items": {"type": "number"},
                                                              "minItems": 4, "maxItems": 4}},
               "required": ["embedding"]}
    index = job_factory(n=25, name="vectors", schema=vectors)
    with_provenance(index, index={"uri": str(tmp_path / "index"), "fields": []})
    indexed = run(index, store_url)
    table = lancedb.connect(str(tmp_path / "index")).open_table("vectors")
    table.checkout(table.tags.get_version(version_tag(indexed)))
    got = table.to_arrow()
    assert {p["origin_version"] for p in got.column("provenance").to_pylist()} == {indexed}
