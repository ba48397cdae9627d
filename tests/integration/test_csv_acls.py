"""A CSV ACL cell holding several groups: read by the rule the spec states, or refused."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest

from batchline.errors import InputError, SpecError
from batchline.plan.planner import plan
from batchline.spec import load_spec
from batchline.store import Store
from batchline.targets.files import export_jsonl
from tests.helpers import planned, run_to_seal

PINNED = Path(__file__).resolve().parents[1] / "data" / "pinned"


def csv_job(job_factory: Any, tmp_path: Path, cells: list[str], **input_extra: Any) -> Path:
    path = tmp_path / f"in-{len(list(tmp_path.glob('in-*.csv')))}.csv"
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["id", "text", "acl"])
        for i, cell in enumerate(cells):
            w.writerow([f"c{i}", f"ticket number {i}", cell])
    spec = job_factory(input_path=path, input_extra={"acl_field": "acl", **input_extra})
    return spec


def result_acls(store: Store, version: str) -> dict[str, Any]:
    return {r.record_id: r.acl for r in store.iter_results(version)}


def test_a_csv_acl_cell_holding_a_json_array_is_not_read_as_one_group(job_factory: Any, store: Store,
                                                                      tmp_path: Path) -> None:
    cells = ["support", '["support", "billing"]', "billing"]
    unruled = csv_job(job_factory, tmp_path, cells)
    with pytest.raises(InputError) as refused:
        planned(unruled, store)
    assert str(refused.value).startswith(f"{tmp_path / 'in-0.csv'}:3: id 'c1': ")
    assert "holds a JSON array" in str(refused.value) and "input.acl_json" in str(refused.value)
    assert store.jobs() == []

    _, version = planned(csv_job(job_factory, tmp_path, ['["support"]', '["support", "billing"]', "[]"],
                                 acl_json=True, acl_missing=["restricted"]), store)
    run_to_seal(store, version)
    assert result_acls(store, version) == {"c0": ["support"], "c1": ["support", "billing"], "c2": []}

    _, version = planned(csv_job(job_factory, tmp_path, ["support", "support; billing", ""],
                                 acl_separator=";", acl_missing=["restricted"]), store)
    run_to_seal(store, version)
    assert result_acls(store, version) == {"c0": ["support"], "c1": ["support", "billing"], "c2": ["restricted"]}


@pytest.mark.parametrize(("rule", "cell", "why"), [
    ({"acl_json": True}, '["support", billing]', "is not a JSON array of group names"),
    ({"acl_json": True}, '["support", 7]', "is not a JSON array of group names"),
    ({"acl_json": True}, "support", "is not a JSON array of group names"),
    ({"acl_separator": ";"}, '["support"]', "starts like a JSON array"),
    ({"acl_separator": ";"}, "support;;billing", "has an empty group"),
])
def test_a_csv_acl_cell_that_does_not_parse_under_its_rule_is_refused_with_its_file_and_line(
        job_factory: Any, store: Store, tmp_path: Path, rule: dict[str, Any], cell: str, why: str) -> None:
    spec = csv_job(job_factory, tmp_path, ['["a"]' if rule.get("acl_json") else "a", cell], **rule)
    with pytest.raises(InputError) as refused:
        planned(spec, store)
    assert str(refused.value).startswith(f"{tmp_path / 'in-0.csv'}:3: id 'c1': ACL cell {cell!r} {why}")
    assert store.jobs() == []


def test_the_acl_rules_are_refused_where_they_cannot_apply(job_factory: Any, tmp_path: Path) -> None:
    jsonl = job_factory(n=3, input_extra={"acl_json": True})
    with pytest.raises(SpecError, match=r"input\.acl_json: says how a CSV cell holds several groups"):
        load_spec(jsonl)
    both = csv_job(job_factory, tmp_path, ["a"], acl_json=True, acl_separator=";")
    with pytest.raises(SpecError, match=r"input\.acl_separator: goes without input\.acl_json"):
        load_spec(both)


def test_a_csv_job_planned_before_the_acl_rules_keeps_its_reading(job_factory: Any, store: Store,
                                                                   tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # A CSV spec that states no rule keeps the version it always had.
    pinned = load_spec(PINNED / "csv.yaml")
    assert not {"acl_json", "acl_separator"} & set(pinned.version_material("")["input"])
    assert not {"acl_json", "acl_separator"} & set(pinned.to_dict()["input"])

    # A version planned by the release before the rules, whose cell held a JSON array (it
    # was read as one group then), reads the same way in its workers and exports now.
    spec = csv_job(job_factory, tmp_path, ["support", '["support", "billing"]'])
    with monkeypatch.context() as before:
        before.setattr("batchline.formats.csv.CsvFormat.checks_records", lambda *_a: False)
        version = plan(load_spec(spec), store).version
    run_to_seal(store, version)
    assert result_acls(store, version) == {"c0": ["support"], "c1": ['["support", "billing"]']}
    export_jsonl(store, version, tmp_path / "out.jsonl")
    assert '"acl": ["[\\"support\\", \\"billing\\"]"]' in (tmp_path / "out.jsonl").read_text()
    # Planned again now, it is the version there is, not a refusal.
    again = plan(load_spec(spec), store)
    assert (again.version, again.created) == (version, False)


def test_a_csv_acl_cell_holding_a_comma_under_no_rule_is_refused_with_both_rules(
        job_factory: Any, store: Store, tmp_path: Path) -> None:
    with pytest.raises(InputError) as refused:
        planned(csv_job(job_factory, tmp_path, ["support", "support,billing"]), store)
    message = str(refused.value)
    assert message.startswith(f"{tmp_path / 'in-0.csv'}:3: id 'c1': ACL cell 'support,billing' holds a comma")
    assert "input.acl_json: true" in message and "input.acl_separator" in message and "\n" not in message
    assert store.jobs() == []
    # Under the separator rule it is two groups.
    _, version = planned(csv_job(job_factory, tmp_path, ["support", "support,billing"], acl_separator=","), store)
    run_to_seal(store, version)
    assert result_acls(store, version) == {"c0": ["support"], "c1": ["support", "billing"]}


def test_a_json_array_cell_with_a_padded_group_is_refused_at_planning(
        job_factory: Any, store: Store, tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"id 'c1': ACL field 'acl': entry ' billing' has whitespace at its start"):
        planned(csv_job(job_factory, tmp_path, ['["support"]', '["support", " billing"]'], acl_json=True), store)
    assert store.jobs() == []
