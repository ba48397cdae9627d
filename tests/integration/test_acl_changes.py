"""A nightly run whose records changed only their ACLs: the answers are carried under the new
ACLs (store, exports, the Iceberg table, the index) with no engine call; `plan --dry-run` says
so before anything is written, and `batchline changes` lists the records by kind. On both
stores."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from batchline.api import Jobs
from batchline.check.validate import validate
from batchline.cli import main
from batchline.publish.pointer import publish
from batchline.store import Store
from tests.helpers import call_counts, make_records, planned, run_to_seal, write_jsonl
from tests.iceberg_support import main_rows, with_table

N = 60
RETAGGED = [f"r{i:06d}" for i in range(0, N, 10)]  # 10%: their ACL alone changes


def night(records: list[dict[str, Any]], retag: bool = False, text: dict[str, str] | None = None,
          drop: tuple[str, ...] = (), add: int = 0) -> list[dict[str, Any]]:
    out = []
    for r in records:
        if r["id"] in drop:
            continue
        r = dict(r)
        if retag and r["id"] in RETAGGED:
            r["acl"] = ["legal", *r["acl"]]
        if text and r["id"] in text:
            r["text"] = text[r["id"]]
        out.append(r)
    return out + [{"id": f"n{i:06d}", "text": f"a new ticket {i}", "acl": ["group-0"]} for i in range(add)]


def job(job_factory: Any, tmp_path: Path, records: list[dict[str, Any]], tag: str, *, table: bool = False) -> Path:
    path = job_factory(input_path=write_jsonl(tmp_path / f"{tag}.jsonl", records),
                       options={"call_log": str(tmp_path / "calls.log")}, base="published", name="nightly",
                       input_extra={"max_input_tokens": 1000})
    if table:
        with_table(path, tmp_path / "warehouse")
    return path


def test_an_acl_only_change_is_carried_under_the_new_acl_with_no_engine_call_everywhere(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    records = make_records(N)
    _, v1 = planned(job(job_factory, tmp_path, records, "night1", table=True), store)
    run_to_seal(store, v1)
    assert validate(store, v1).passed
    publish(store, v1)
    (tmp_path / "calls.log").unlink()

    retagged = night(records, retag=True)
    _, v2 = planned(job(job_factory, tmp_path, retagged, "night2", table=True), store)
    assert v2 != v1  # the ACLs are part of the snapshot: a new version
    info = store.job(v2)
    assert info is not None and info.state == "sealed" and info.carried == N  # nothing left to infer
    assert call_counts(tmp_path / "calls.log") == {}
    assert validate(store, v2).passed
    publish(store, v2)
    want = {r["id"]: r["acl"] for r in retagged}
    before = {r.record_id: r for r in store.iter_results(v1)}
    after = {r.record_id: r for r in store.iter_results(v2)}
    assert {rid: r.acl for rid, r in after.items()} == want
    assert all(after[rid].origin == v1 and after[rid].output == before[rid].output for rid in after)
    # Every export and the table carry the new ACLs.
    Jobs(store_url).export(v2, format="jsonl", out=tmp_path / "out.jsonl")
    assert {json.loads(line)["id"]: json.loads(line)["acl"] for line in (tmp_path / "out.jsonl").open()} == want
    Jobs(store_url).export(v2, format="parquet", out=tmp_path / "out.parquet")
    assert {r["id"]: r["acl"] for r in pq.read_table(tmp_path / "out.parquet").to_pylist()} == want
    rows = main_rows(store_url, "lake.results", "id, acl, version")
    assert {rid: list(acl) for rid, acl, _v in rows} == want and {v for *_x, v in rows} == {v2}


def test_an_acl_change_alongside_other_changes_reaches_the_engine_only_for_text(
        job_factory: Any, store: Store, tmp_path: Path) -> None:
    records = make_records(N)
    _, v1 = planned(job(job_factory, tmp_path, records, "night1"), store)
    run_to_seal(store, v1)
    assert validate(store, v1).passed
    publish(store, v1)
    (tmp_path / "calls.log").unlink()
    # r000000 changes its ACL and its text: it is inferred again, under its new ACL.
    changed = night(records, retag=True, text={"r000000": "a rewritten ticket", "r000003": "another rewrite"},
                    drop=("r000005",), add=2)
    _, v2 = planned(job(job_factory, tmp_path, changed, "night2"), store)
    run_to_seal(store, v2)
    assert set(call_counts(tmp_path / "calls.log")) == {"r000000", "r000003", "n000000", "n000001"}
    assert {r.record_id: r.acl for r in store.iter_results(v2)} == {r["id"]: r["acl"] for r in changed}


def test_plan_dry_run_says_what_a_run_would_carry_and_infer_and_writes_nothing(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    records = make_records(N)
    _, v1 = planned(job(job_factory, tmp_path, records, "night1"), store)
    run_to_seal(store, v1)
    assert validate(store, v1).passed
    publish(store, v1)
    changed = night(records, retag=True, text={"r000000": "a rewritten ticket", "r000003": "another rewrite"},
                    drop=("r000005", "r000007"), add=3)
    changed.append({"id": "long", "text": "x" * 40_000, "acl": ["g"]})
    path = job(job_factory, tmp_path, changed, "night2")
    jobs_before = [j.version for j in store.jobs()]
    assert main(["plan", str(path), "--dry-run", "--json", "--store", store_url]) == 0
    preview = json.loads(capsys.readouterr().out)
    # 58 of the base's records remain; r000000 changed its text (and ACL), so 5 of the retagged are carried.
    assert {k: preview[k] for k in ("base", "state", "records", "carried", "acl_changed", "new", "changed",
                                    "retried", "removed", "dead_letters", "to_infer")} == {
        "base": v1, "state": None, "records": N - 2 + 3 + 1, "carried": N - 2 - 2, "acl_changed": 5, "new": 3,
        "changed": 2, "retried": 0, "removed": 2, "dead_letters": 1, "to_infer": 5}
    assert [j.version for j in store.jobs()] == jobs_before  # nothing written
    assert main(["plan", str(path), "--dry-run", "--store", store_url]) == 0
    table = capsys.readouterr().out
    assert f"against base {v1}" in table and "5 of them under a changed ACL" in table and "nothing was written" in table
    # The plan itself does what the dry run said, and `changes` lists the records by kind.
    version = Jobs(store_url).plan(path, log=lambda _m: None).version
    assert version == preview["version"]
    assert store.job(version).carried == preview["carried"]  # type: ignore[union-attr]
    assert main(["changes", version, "--store", store_url]) == 0
    out, err = capsys.readouterr()
    listed = [line.split("\t") for line in out.splitlines()]
    assert sorted(i for k, i in listed if k == "acl") == [i for i in RETAGGED if i != "r000000"]
    assert sorted(i for k, i in listed if k == "text") == ["r000000", "r000003"]
    assert sorted(i for k, i in listed if k == "new") == ["long", "n000000", "n000001", "n000002"]
    assert sorted(i for k, i in listed if k == "removed") == ["r000005", "r000007"]
    assert "unchanged 51" in err and not any(k == "unchanged" for k, _i in listed)


def test_changes_of_a_version_planned_without_a_base_is_refused(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, v1 = planned(job_factory(make_records(5)), store)
    assert main(["changes", v1, "--store", store_url]) == 1
    assert "planned without a base version" in capsys.readouterr().err
    assert main(["changes", "nightly@0000000000000000", "--store", store_url]) == 66


def test_a_dry_run_with_no_store_yet_makes_none(job_factory: Any, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'nowhere.db'}"
    assert main(["plan", str(job_factory(make_records(7))), "--dry-run", "--json", "--store", url]) == 0
    preview = json.loads(capsys.readouterr().out)
    assert (preview["records"], preview["to_infer"], preview["base"]) == (7, 7, None)
    assert not (tmp_path / "nowhere.db").exists()


def test_a_dry_run_refuses_a_duplicate_id_as_planning_does(job_factory: Any, store: Store, store_url: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    records = make_records(6)
    records.append(dict(records[2]))
    assert main(["plan", str(job_factory(records)), "--dry-run", "--store", store_url]) == 3
    assert "duplicate id 'r000002'" in capsys.readouterr().err
    assert store.jobs() == []


def test_a_plan_that_fails_on_its_input_leaves_no_new_store_file(job_factory: Any, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"id": "a", "text": "fine", "acl": ["g"]}\n{"id": "b", "text": \n')
    url = f"sqlite:///{tmp_path / 'fresh' / 'store.db'}"
    for command in ("plan", "run"):
        assert main([command, str(job_factory(input_path=broken)), "--store", url]) == 3
        assert "malformed JSON" in capsys.readouterr().err
        assert list((tmp_path / "fresh").glob("store.db*")) == []
