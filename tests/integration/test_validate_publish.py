"""Validation, publication, rollback, retention, access rules and incremental runs."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import yaml

from batchline.check.validate import population_stability, validate
from batchline.engines.synthetic import synthetic_instance
from batchline.errors import BatchlineError, PublicationMoved, StoreError
from batchline.publish.pointer import publish, rollback
from batchline.store import Store, open_store
from batchline.targets.files import export_jsonl, export_parquet
from batchline.targets.parquet import export_dataset
from tests.helpers import (
    Database,
    before_the_store_records,
    call_counts,
    make_records,
    planned,
    read_during_switches,
    run_to_seal,
    write_jsonl,
)


def add_to_spec(path: Path, **top: Any) -> Path:
    spec = yaml.safe_load(path.read_text())
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key].update(value)
        else:
            spec[key] = value
    path.write_text(yaml.safe_dump(spec))
    return path


def sealed_version(job_factory: Any, store: Store, records: list[dict[str, Any]] | None = None,
                   **kw: Any) -> tuple[Any, str]:
    path = job_factory(records, **{k: v for k, v in kw.items() if k in ("options", "n", "input_path")})
    add_to_spec(path, output={"label_field": "category"},
                **{k: v for k, v in kw.items() if k not in ("options", "n", "input_path")})
    spec, version = planned(path, store)
    run_to_seal(store, version)
    return spec, version


def checks(report: Any) -> dict[str, bool]:
    return {c.name: c.passed for c in report.checks}




def test_a_clean_version_passes_every_check(job_factory: Any, store: Store) -> None:
    _spec, version = sealed_version(job_factory, store, n=120)
    report = validate(store, version)
    assert report.passed
    assert checks(report) == {"coverage": True, "schema": True, "dead_letters": True, "drift": True}
    assert "120 snapshot ids; 0 without an outcome" in report.checks[0].figure
    assert store.latest_validation(version).passed  # type: ignore[union-attr]


def test_coverage_is_an_anti_join_not_a_count(job_factory: Any, store: Store, store_url: str) -> None:
    _spec, version = sealed_version(job_factory, store, n=60)
    with Database(store_url) as db:
        # Same count, different ids: a count comparison would pass this.
        db.execute("UPDATE results SET record_id = 'ghost' WHERE version = ? AND record_id = 'r000007'",
                   (version,))
    report = validate(store, version)
    cov = report.checks[0]
    assert not cov.passed and not report.passed
    assert (cov.details["missing"], cov.details["unexpected"]) == (1, 1)
    assert cov.details["missing_sample"] == ["r000007"] and cov.details["unexpected_sample"] == ["ghost"]


def test_schema_check_finds_a_stored_result_that_does_not_validate(job_factory: Any, store: Store,
                                                                   store_url: str) -> None:
    _spec, version = sealed_version(job_factory, store, n=40)
    with Database(store_url) as db:
        db.execute("UPDATE results SET output = '{\"category\": \"z\"}' WHERE record_id = 'r000003'")
    report = validate(store, version)
    assert checks(report)["schema"] is False
    assert report.checks[1].details["examples"][0].startswith("r000003: output fails the schema")


def test_schema_check_can_sample_and_says_so(job_factory: Any, store: Store) -> None:
    _spec, version = sealed_version(job_factory, store, n=100, validate={"schema_sample": 10})
    schema = validate(store, version).checks[1]
    assert schema.passed and schema.details["checked"] == 10
    assert "a sample of 10 of 100" in schema.figure


def test_dead_letter_rate_over_the_limit_fails(job_factory: Any, store: Store) -> None:
    _spec, version = sealed_version(job_factory, store, n=50, options={"error_on": ["r000001", "r000002"]},
                                    validate={"max_dead_letter_rate": 0.02})
    dl = validate(store, version).checks[2]
    assert not dl.passed and dl.details["by_kind"] == {"engine_error": 2}
    assert "2 (4.00%, limit 2.00%): engine_error 2" in dl.figure


def test_drift_against_the_published_version(job_factory: Any, store: Store, tmp_path: Path) -> None:
    _spec, v1 = sealed_version(job_factory, store, n=300)
    assert validate(store, v1).passed
    publish(store, v1)
    same_mix = [{"id": f"s{i}", "text": f"record number {i} about topic {i % 7}", "acl": None} for i in range(300)]
    _spec, v2 = sealed_version(job_factory, store, same_mix)
    assert checks(validate(store, v2))["drift"] is True
    one_text = [{"id": f"o{i}", "text": "always the same ticket", "acl": None} for i in range(300)]
    _spec, v3 = sealed_version(job_factory, store, one_text)
    drift = validate(store, v3).checks[3]
    assert not drift.passed
    assert drift.details["psi"] > 1 and len(drift.details["vanished"]) == 2
    assert drift.details["against"] == v1


def test_population_stability_index() -> None:
    assert population_stability({"a": 50, "b": 50}, {"a": 50, "b": 50}) == 0
    assert 0.0 < population_stability({"a": 50, "b": 50}, {"a": 60, "b": 40}) < 0.1
    assert population_stability({"a": 50, "b": 50}, {"a": 100}) > 2


def grade_first_letter(output: dict[str, Any], expected: str, record_id: str) -> bool:
    return bool(output["category"][0] == expected[0])


@pytest.mark.parametrize("mode", ["exact", "wrong", "grader"])
def test_evaluation_on_labelled_records(job_factory: Any, store: Store, tmp_path: Path, mode: str) -> None:
    from tests.conftest import SIMPLE_SCHEMA

    records = make_records(200)
    labels = tmp_path / "labels.jsonl"
    write_jsonl(labels, [{"id": r["id"], "label": "a" if mode == "wrong" and
                          synthetic_instance(SIMPLE_SCHEMA, r["text"])["category"] != "a" else
                          ("b" if mode == "wrong" else synthetic_instance(SIMPLE_SCHEMA, r["text"])["category"])}
                         for r in records])
    ev = {"labels": str(labels), "sample": 50, "min_accuracy": 0.9}
    if mode == "grader":
        ev["grader"] = "tests.integration.test_validate_publish:grade_first_letter"
    _spec, version = sealed_version(job_factory, store, records, validate={"eval": ev})
    check = validate(store, version).checks[-1]
    assert check.name == "labels" and check.details["sample"] == 50
    assert check.passed == (mode != "wrong")
    assert check.details["accuracy"] == (0.0 if mode == "wrong" else 1.0)
    # Where the answers went, label by label: the report draws this matrix.
    confusion = check.details["confusion"]
    assert sum(n for row in confusion.values() for n in row.values()) == 50
    right = sum(row.get(expected, 0) for expected, row in confusion.items())
    assert right == (0 if mode == "wrong" else 50)
    if mode == "exact":
        from batchline.ops.report.page import confusion_table

        html = confusion_table(check.details)
        assert html.count('class="num diag"') == len(confusion) and "expected category (rows)" in html


def test_publish_is_refused_without_a_passing_validation(job_factory: Any, store: Store) -> None:
    path = job_factory(n=30, options={"error_on": ["r000001"]})
    spec, version = planned(path, store)
    with pytest.raises(BatchlineError, match="not sealed"):
        publish(store, version)
    with pytest.raises(BatchlineError, match="not sealed"):
        validate(store, version)
    run_to_seal(store, version)
    with pytest.raises(BatchlineError, match="has not been validated"):
        publish(store, version)
    assert not validate(store, version).passed  # 1 of 30 dead is over the 1% default
    with pytest.raises(BatchlineError, match=r"failed its latest validation \(dead_letters\)"):
        publish(store, version)
    with pytest.raises(BatchlineError, match="--force needs --reason"):
        publish(store, version, force=True)
    publish(store, version, force=True, reason="one known-bad ticket, accepted by triage lead")
    [pub] = store.publications(spec.name)
    assert pub.reason == "one known-bad ticket, accepted by triage lead" and pub.validation is not None
    assert store.resolve_name(spec.name) == version


def view_rows(store_url: str, name: str) -> list[tuple[Any, ...]]:
    with Database(store_url) as db:
        return db.execute(f"SELECT id, version, acl FROM {db.view(name)}")


def test_rollback_returns_to_the_previous_version(job_factory: Any, store: Store, store_url: str) -> None:
    spec, v1 = sealed_version(job_factory, store, n=20)
    _, v2 = sealed_version(job_factory, store, make_records(25, "x"))
    for v in (v1, v2):
        validate(store, v)
        publish(store, v)
    assert {row[1] for row in view_rows(store_url, spec.name)} == {v2}
    assert rollback(store, spec.name) == (v2, v1)
    rows = view_rows(store_url, spec.name)
    assert {row[1] for row in rows} == {v1} and len(rows) == 20
    assert [p.action for p in store.publications(spec.name)] == ["publish", "publish", "rollback"]
    with pytest.raises(BatchlineError, match="no earlier version"):
        rollback(store, spec.name)


def test_publishing_the_version_already_published_records_nothing_and_rollback_never_goes_to_itself(
        job_factory: Any, store: Store, store_url: str) -> None:
    from batchline.api import Jobs
    from tests.integration.test_cli import cli

    spec, v1 = sealed_version(job_factory, store, n=20)
    _, v2 = sealed_version(job_factory, store, make_records(25, "x"))
    jobs = Jobs(store_url)
    for v in (v1, v2):
        assert jobs.validate(v).passed
    said: list[str] = []

    def publish_again(version: str) -> None:
        """Through the Jobs API and the command line: one line, exit 0, nothing recorded."""
        line = f"{version} is published as {spec.name} already; nothing changed"
        again = jobs.publish(version, log=said.append)
        assert not again.changed and again.summary() == line and again.removed == ()
        run = cli("publish", version, "--store", store_url)
        assert run.returncode == 0 and run.stderr.splitlines() == [line], run.stderr

    def history() -> list[tuple[str, str, str | None]]:
        return [(p.action, p.version, p.previous) for p in jobs.history(spec.name)]

    assert jobs.publish(v1).changed
    publish_again(v1)
    assert history() == [("publish", v1, None)]
    # So there is nothing to roll back to: not v1 itself.
    run = cli("rollback", spec.name, "--store", store_url)
    assert run.returncode == 4 and run.stderr.splitlines() == [
        f"batchline: error: {spec.name!r} has no earlier version to roll back to (current: {v1})"]
    with pytest.raises(StoreError, match="no earlier version to roll back to"):
        jobs.rollback(spec.name)

    assert jobs.publish(v2).previous == v1
    publish_again(v2)
    run = cli("rollback", spec.name, "--store", store_url)
    assert run.returncode == 0 and run.stderr.splitlines() == [f"{spec.name}: rolled back from {v2} to {v1}"]
    publish_again(v1)
    with pytest.raises(StoreError, match="no earlier version to roll back to"):
        jobs.rollback(spec.name)
    assert history() == [("publish", v1, None), ("publish", v2, v1), ("rollback", v1, v2)]
    assert said == [] and store.resolve_name(spec.name) == v1

    # A store an older release wrote may hold a publish of the published version over
    # itself, which replaced nothing: rollback passes it by, and so do cancel and delete.
    assert jobs.publish(v2).previous == v1
    with Database(store_url) as db:
        db.execute("INSERT INTO publications (name, version, previous, action, who, ts) "
                   "VALUES (?, ?, ?, 'publish', 'an older release', 0)", (spec.name, v2, v2))
    with pytest.raises(StoreError, match=f"cannot delete {v1}: a rollback of 'test-job' would return to it"):
        store.delete(v1, "ops@host")
    assert jobs.rollback(spec.name) == (v2, v1)
    assert store.resolve_name(spec.name) == v1


def test_a_reader_paging_through_a_version_or_the_view_reads_one_whole_version_during_publish(
        job_factory: Any, store: Store, store_url: str) -> None:
    spec, v1 = sealed_version(job_factory, store, n=300)
    _, v2 = sealed_version(job_factory, store, make_records(200, "n"))
    for v in (v1, v2):
        validate(store, v)
    publish(store, v1)
    sizes = {v1: 300, v2: 200}
    problems: list[str] = []

    def reader(stop: threading.Event) -> None:
        from batchline.store import open_store

        mine = open_store(store_url)
        db = Database(store_url)
        while not stop.is_set():
            try:
                # a dashboard: resolve once, then page through that version
                version = mine.resolve_name(spec.name)
                assert version is not None
                pages = list(mine.iter_results(version, page_size=37))
                if len(pages) != sizes[version]:
                    problems.append(f"paged {len(pages)} rows of {version}")
                # a reader of the view
                rows = db.execute(f"SELECT version, COUNT(*) FROM {db.view(spec.name)} GROUP BY version")
                if len(rows) != 1 or rows[0][1] != sizes[rows[0][0]]:
                    problems.append(f"view showed {rows}")
            except Exception as exc:  # a reader of the view must never get an error
                problems.append(repr(exc))
        db.close()
        mine.close()

    read_during_switches(store, spec.name, v2, reader)
    assert problems == []

    # The same reader against a swap done in two steps (drop the pointer, then
    # write the new one) sees a name with no version in between.
    with Database(store_url) as db:
        db.execute("DELETE FROM pointers WHERE name = ?", (spec.name,))
        between = db.execute(f"SELECT COUNT(*) FROM {db.view(spec.name)}")[0][0]
        resolved = store.resolve_name(spec.name)
        db.execute("INSERT INTO pointers (name, version, updated_at) VALUES (?, ?, 0)", (spec.name, v2))
    assert between == 0 and resolved is None


def test_acl_travels_into_the_view_every_export_carried_rows_and_dead_letters(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    records = make_records(150)
    for i, r in enumerate(records):
        r["acl"] = [f"team-{i % 4}", f"user{i}"]
    source = {r["id"]: r["acl"] for r in records}
    path = job_factory(records, options={"error_on": ["r000009"]})
    add_to_spec(path, output={"label_field": "category"}, validate={"max_dead_letter_rate": 0.5})
    spec, v1 = planned(path, store)
    run_to_seal(store, v1)
    validate(store, v1)
    publish(store, v1)

    changed = [dict(r) for r in records]
    changed[3]["text"] = "a changed ticket"
    input2 = write_jsonl(tmp_path / "night2.jsonl", changed)
    path2 = job_factory(input_path=input2, options={"error_on": ["r000009"]})
    add_to_spec(path2, output={"label_field": "category"}, base="published",
                validate={"max_dead_letter_rate": 0.5})
    _, v2 = planned(path2, store)
    run_to_seal(store, v2)
    validate(store, v2)
    publish(store, v2)
    assert sum(1 for r in store.iter_results(v2) if r.origin is not None) == 148

    def same(rows: list[tuple[str, Any]]) -> None:
        assert rows and all(acl == source[rid] for rid, acl in rows)

    same([(rid, json.loads(acl)) for rid, _v, acl in view_rows(store_url, spec.name)])
    export_jsonl(store, v2, tmp_path / "out.jsonl")
    same([(d["id"], d["acl"]) for d in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())])
    export_parquet(store, v2, tmp_path / "out.parquet")
    same([(r["id"], r["acl"]) for r in pq.read_table(tmp_path / "out.parquet").to_pylist()])
    _, folder = export_dataset(store, spec.name, tmp_path / "warehouse")
    same([(r["id"], r["acl"]) for r in pq.read_table(folder).to_pylist()])
    same([(d.record_id, d.acl) for d in store.iter_dead_letters(v2)])
    same([(r.record_id, r.acl) for r in store.iter_results(v2) if r.origin is not None])


def test_an_incremental_run_infers_only_new_and_changed_records(job_factory: Any, store: Store,
                                                                tmp_path: Path) -> None:
    calls = tmp_path / "calls.log"
    records = make_records(200)
    path = job_factory(records, options={"call_log": str(calls)})
    add_to_spec(path, output={"label_field": "category"}, base="published")
    _spec, v1 = planned(path, store)  # nothing published yet: a full run
    run_to_seal(store, v1)
    validate(store, v1)
    publish(store, v1)
    assert len(call_counts(calls)) == 200
    calls.unlink()

    night2 = [dict(r) for r in records if r["id"] != "r000005"]  # one record gone
    night2[10]["text"] = "changed text"  # r000011 changed
    night2[20]["acl"] = ["new-group"]  # r000021's access rules changed
    night2.append({"id": "new-1", "text": "a new ticket", "acl": ["g"]})
    input2 = write_jsonl(tmp_path / "night2.jsonl", night2)
    path2 = job_factory(input_path=input2, options={"call_log": str(calls)})
    add_to_spec(path2, output={"label_field": "category"}, base="published")
    _spec2, v2 = planned(path2, store)
    assert v2 != v1
    run_to_seal(store, v2)
    # An ACL-only change is carried under its new ACL: the engine never sees r000021 again.
    assert set(call_counts(calls)) == {"r000011", "new-1"}
    results = {r.record_id: r for r in store.iter_results(v2)}
    assert len(results) == 200 and "r000005" not in results
    assert results["r000000"].origin == v1 and results["r000000"].output == next(
        r.output for r in store.iter_results(v1) if r.record_id == "r000000")
    assert results["r000011"].origin is None
    assert (results["r000021"].origin, results["r000021"].acl) == (v1, ["new-group"])
    assert [e.detail["records"] for e in store.events(v2, ["carry"])] == [198]
    report = validate(store, v2)
    assert report.passed, report.table()

    # Planned again against the same base, it is the same version.
    assert planned(path2, store)[1] == v2
    # A third night with no change carries everything and seals at planning.
    publish(store, v2)
    calls.unlink()
    _, v3 = planned(path2, store)
    assert v3 != v2
    assert store.job(v3).state == "sealed"  # type: ignore[union-attr]
    assert not calls.exists()
    assert validate(store, v3).passed
    assert {r.origin for r in store.iter_results(v3)} == {v1, v2}


def test_a_changed_prompt_carries_nothing(job_factory: Any, store: Store, tmp_path: Path) -> None:
    records = make_records(40)
    path = job_factory(records)
    add_to_spec(path, output={"label_field": "category"}, base="published")
    _, v1 = planned(path, store)
    run_to_seal(store, v1)
    validate(store, v1)
    publish(store, v1)
    path2 = job_factory(records, prompt="Classify, differently.\n")
    add_to_spec(path2, output={"label_field": "category"}, base="published")
    _, v2 = planned(path2, store)
    assert not store.events(v2, ["carry"])
    assert store.status(v2).results == 0


def test_retention_removes_old_versions_but_never_the_published_or_its_predecessor(
        job_factory: Any, store: Store) -> None:
    versions = []
    for night in range(5):
        path = job_factory(make_records(10, f"n{night}-"))
        add_to_spec(path, output={"label_field": "category"}, retention={"versions": 2})
        _, v = planned(path, store)
        run_to_seal(store, v)
        validate(store, v)
        versions.append(v)
    publish(store, versions[0])
    publish(store, versions[4])
    # newest two are 4 and 3; 0 is the predecessor a rollback returns to.
    kept = {j.version for j in store.jobs()}
    assert kept == {versions[0], versions[3], versions[4]}
    assert store.job(versions[1]).state == "removed"  # type: ignore[union-attr]
    assert list(store.iter_results(versions[1])) == []
    assert rollback(store, "test-job") == (versions[4], versions[0])


def test_a_job_named_like_a_store_table_never_publishes_over_it(job_factory: Any, store: Store,
                                                                store_url: str) -> None:
    # Regression: a job named `results` published "as results" and exited 0, but the view
    # was never made (the store's own table had the name), so a dashboard reading
    # `results` read every version's raw rows, unpublished ones and other ACLs included.
    path = job_factory(n=20, name="results")
    add_to_spec(path, output={"label_field": "category"})
    if store_url.startswith("sqlite:///"):
        # Views and the store's tables share SQLite's one namespace: refused at planning.
        with pytest.raises(StoreError, match="'results' is the name of one of the store's own tables"):
            planned(path, store)
        assert store.jobs() == []
        return
    # PostgreSQL keeps published views in a schema of their own.
    _spec, version = planned(path, store)
    run_to_seal(store, version)
    validate(store, version)
    publish(store, version)
    with Database(store_url) as db:
        assert db.execute(f"SELECT version, count(*) FROM {db.view('results')} GROUP BY version") == [(version, 20)]


def test_publish_fails_loudly_when_the_name_is_taken_by_something_that_is_not_its_view(
        job_factory: Any, store: Store, store_url: str) -> None:
    spec, version = sealed_version(job_factory, store, n=10)
    validate(store, version)
    with Database(store_url) as db:
        db.execute(f"CREATE TABLE {db.view(spec.name)} (id text)")
    with pytest.raises(StoreError, match="is not the view that reads through the pointer"):
        publish(store, version)
    assert store.resolve_name(spec.name) is None and store.publications(spec.name) == []


def test_a_publication_target_follows_the_pointer_and_refuses_a_state_the_store_did_not_record(
        job_factory: Any, store: Store, tmp_path: Path) -> None:
    from batchline.targets.parquet import ParquetDataset, version_folder

    dataset = ParquetDataset(tmp_path / "warehouse")
    spec, v1 = sealed_version(job_factory, store, n=20)
    _, v2 = sealed_version(job_factory, store, make_records(25, "x"))
    for v in (v1, v2):
        validate(store, v)
        publish(store, v, targets=[dataset])
        assert dataset.current(spec.name) == version_folder(v)
    assert store.publications(spec.name)[-1].targets == {dataset.key: {"current": version_folder(v2)}}
    assert pq.read_table(dataset.folder(spec.name, v2)).num_rows == 25
    assert rollback(store, spec.name, targets=[dataset]) == (v2, v1)
    assert dataset.current(spec.name) == version_folder(v1)
    # Someone else changed what readers see: the next publish refuses and moves nothing.
    (tmp_path / "warehouse" / spec.name / "CURRENT").write_text("elsewhere\n")
    with pytest.raises(BatchlineError, match=r"CURRENT names 'elsewhere', not 'test-job-.* as the store recorded"):
        publish(store, v2, targets=[dataset])
    assert store.resolve_name(spec.name) == v1


class Unchecked:
    """A target whose `show` can check nothing (an index without a conditional write): it
    shows whatever it is told. Two publishers keep it in line only through the store."""

    key = "unchecked"

    def __init__(self) -> None:
        self.current: str | None = None

    def describe(self) -> str:
        return "a target that checks nothing"

    def claim(self, name: str, store: Any) -> None:
        pass

    def stage(self, store: Any, version: str) -> None:
        pass

    def show(self, name: str, version: str, recorded: dict[str, Any] | None) -> dict[str, Any]:
        self.current = version
        return {"current": version}

    def restore(self, name: str, recorded: dict[str, Any] | None, shown: dict[str, Any]) -> None:
        if self.current == shown["current"]:
            self.current = recorded["current"] if recorded else None

    def forget(self, name: str, version: str) -> None:
        pass


def three_validated(job_factory: Any, store: Store) -> tuple[str, list[str]]:
    spec, v1 = sealed_version(job_factory, store, n=20)
    versions = [v1] + [sealed_version(job_factory, store, make_records(n, f"v{n}-"))[1] for n in (25, 15)]
    for v in versions:
        validate(store, v)
    return spec.name, versions


def test_two_publishers_at_once_leave_the_store_and_a_target_that_checks_nothing_agreeing(
        job_factory: Any, store: Store, store_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    name, (v1, v2, v3) = three_validated(job_factory, store)
    target = Unchecked()
    publish(store, v1, targets=[target])
    other = open_store(store_url)
    try:
        came_between = before_the_store_records(monkeypatch, store, "publish",
                                                lambda: publish(other, v3, targets=[target]))
        with pytest.raises(PublicationMoved, match=rf"cannot publish {v2} .* \(it now shows {v3}, published by"):
            publish(store, v2, targets=[target])
        assert came_between and target.current == v3 == store.resolve_name(name)
        assert store.publications(name)[-1].targets == {"unchecked": {"current": v3}}
        assert [p.version for p in store.publications(name)] == [v1, v3]
    finally:
        other.close()


def test_a_rollback_raced_by_a_publish_leaves_the_store_and_a_target_that_checks_nothing_agreeing(
        job_factory: Any, store: Store, store_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    name, (v1, v2, v3) = three_validated(job_factory, store)
    target = Unchecked()
    for v in (v1, v2):
        publish(store, v, targets=[target])
    other = open_store(store_url)
    try:
        came_between = before_the_store_records(monkeypatch, store, "rollback",
                                                lambda: publish(other, v3, targets=[target]))
        with pytest.raises(PublicationMoved, match=rf"cannot roll '{name}' back from {v3}: .* came in between"):
            rollback(store, name, targets=[target])
        assert came_between and target.current == v3 == store.resolve_name(name)
        assert [(p.action, p.version) for p in store.publications(name)] == [
            ("publish", v1), ("publish", v2), ("publish", v3)]
        monkeypatch.undo()
        assert rollback(store, name, targets=[target]) == (v3, v2) and target.current == v2
    finally:
        other.close()


def test_a_store_that_fails_to_publish_leaves_the_parquet_current_as_it_recorded(
        job_factory: Any, store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from batchline.targets.parquet import ParquetDataset, version_folder

    dataset = ParquetDataset(tmp_path / "warehouse")
    spec, v1 = sealed_version(job_factory, store, n=20)
    _, v2 = sealed_version(job_factory, store, make_records(25, "x"))
    for v in (v1, v2):
        validate(store, v)

    def unreachable(*_a: Any, **_k: Any) -> Any:
        raise StoreError("store unreachable")

    monkeypatch.setattr(store, "publish", unreachable)
    with pytest.raises(StoreError, match="store unreachable"):
        publish(store, v1, targets=[dataset])
    assert dataset.current(spec.name) is None  # the first publication left no CURRENT behind
    monkeypatch.undo()
    publish(store, v1, targets=[dataset])
    monkeypatch.setattr(store, "publish", unreachable)
    with pytest.raises(StoreError, match="store unreachable"):
        publish(store, v2, targets=[dataset])
    assert dataset.current(spec.name) == version_folder(v1)


def test_the_manifest_says_computed_and_carried_apart_and_each_target_as_a_structured_entry(
        job_factory: Any, store: Store, tmp_path: Path) -> None:
    from batchline.launch.fleet import manifest
    from batchline.targets.parquet import ParquetDataset, version_folder

    dataset = ParquetDataset(tmp_path / "warehouse")
    records = make_records(20)
    spec, v1 = sealed_version(job_factory, store, records, base="published")
    validate(store, v1)
    publish(store, v1, targets=[dataset])
    records[3]["text"] = "changed"
    _, v2 = sealed_version(job_factory, store, records, base="published")
    validate(store, v2)
    publish(store, v2, targets=[dataset])
    shown = manifest(store, v2, spec.name)
    assert (shown["results"], shown["computed"], shown["carried"], shown["dead_letters"]) == (20, 1, 19, 0)
    assert shown["targets"] == [{"kind": "view", "name": spec.name, "version": v2},
                                {"kind": "parquet", "location": str(tmp_path / "warehouse"),
                                 "current": version_folder(v2)}]
    assert manifest(store, v1, None)["targets"] == []  # not published by the task that made it
