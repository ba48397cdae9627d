"""Dagster assets of batchline jobs, materialised in process by real Dagster with the local
launcher and the synthetic engine, on both stores: the triage asset and the asset over it pass
their checks (one per check of each job's gate) and are published; dead letters over the gate
fail the asset's check and publish nothing."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import yaml

from batchline.store import Store
from tests.helpers import call_counts, make_records

pytest.importorskip("dagster", reason="the dagster extra is not installed")

ROOT = Path(__file__).resolve().parents[3]


def specs(job_factory: Any, calls: Path, **triage: Any) -> tuple[Path, Path]:
    records = make_records(100)
    for r in records:
        r["acl"] = ["support"]
    first = job_factory(records, name="triage-nightly", base="published",
                        options={"call_log": str(calls), "seconds_per_record": 0.002},
                        validate={"max_dead_letter_rate": 0.01, "grounded": {"fields": ["category"],
                                                                             "min_share": None}}, **triage)
    second = job_factory(name="summaries", input_path=None)
    raw = yaml.safe_load(second.read_text())
    raw["input"] = {"job": "triage-nightly", "field": "output.summary", "acl_field": "acl"}
    second.write_text(yaml.safe_dump(raw))
    return first, second


def materialised(first: Path, second: Path, store_url: str, runners: Path) -> Any:
    from dagster import materialize

    from batchline.orchestrators.dagster import BatchlineResource, batchline_asset

    triage = batchline_asset(first, workers=2, poll_seconds=0.2)
    summaries = batchline_asset(second, deps=[triage], poll_seconds=0.2)
    resource = BatchlineResource(store_url=store_url, launcher_options={"local": {"runner_dir": str(runners)}})
    return materialize([triage, summaries], resources={"batchline": resource}, raise_on_error=False)


def test_both_assets_materialise_with_the_gates_checks_passing_and_are_published(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    calls = tmp_path / "calls.log"
    first, second = specs(job_factory, calls)
    result = materialised(first, second, store_url, tmp_path / "runners")
    assert result.success
    checks = {(e.asset_key.to_user_string(), e.check_name): e.passed for e in result.get_asset_check_evaluations()}
    assert checks == {("triage-nightly", "coverage"): True, ("triage-nightly", "schema"): True,
                      ("triage-nightly", "dead_letters"): True, ("triage-nightly", "drift"): True,
                      ("triage-nightly", "grounded"): True,
                      ("summaries", "coverage"): True, ("summaries", "schema"): True,
                      ("summaries", "dead_letters"): True, ("summaries", "drift"): True}
    [triage] = result.asset_materializations_for_node("triage_nightly") or [
        m for m in result.get_asset_materialization_events()
        if m.asset_key.to_user_string() == "triage-nightly"]
    metadata = {k: v.value for k, v in getattr(triage, "metadata", None).items()} if hasattr(triage, "metadata") else {}
    version = store.resolve_name("triage-nightly")
    assert version is not None and metadata.get("version") == version
    assert (metadata["records"], metadata["results"], metadata["published_as"]) == (100, 100, "triage-nightly")
    assert store.resolve_name("summaries") is not None
    assert set(call_counts(calls).values()) == {1}


def test_dead_letters_over_the_gate_fail_the_check_and_nothing_is_published(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    first, second = specs(job_factory, tmp_path / "calls.log")
    raw = yaml.safe_load(first.read_text())
    raw["model"]["options"]["error_on"] = [f"r{i:06d}" for i in range(5)]
    first.write_text(yaml.safe_dump(raw))
    result = materialised(first, second, store_url, tmp_path / "runners")
    assert not result.success
    checks = {e.check_name: e.passed for e in result.get_asset_check_evaluations()
              if e.asset_key.to_user_string() == "triage-nightly"}
    assert checks["dead_letters"] is False and checks["coverage"] is True
    assert result.get_asset_materialization_events() == []
    assert store.resolve_name("triage-nightly") is None and store.resolve_name("summaries") is None


@pytest.mark.parametrize("store_kind", ["sqlite"], indirect=True)
def test_the_example_definitions_load_with_one_check_per_gate_check(monkeypatch: pytest.MonkeyPatch,
                                                                   store_url: str) -> None:
    monkeypatch.setenv("BATCHLINE_STORE", store_url)
    spec = importlib.util.spec_from_file_location("nightly_dagster", ROOT / "examples" / "dagster" / "nightly_triage.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    graph = module.defs.resolve_asset_graph()
    assert {k.to_user_string() for k in graph.get_all_asset_keys()} == {"ticket-triage-nightly",
                                                                      "ticket-summaries-nightly"}
    assert {c.name for c in graph.asset_check_keys} >= {"coverage", "schema", "dead_letters", "drift"}


def test_a_re_execution_of_a_failed_run_keys_on_its_root_run_and_so_finds_the_first_executions_version() -> None:
    from dagster import DagsterRun

    from batchline.orchestrators.dagster import dagster_run_key

    first = DagsterRun(job_name="__ASSET_JOB", run_id="first-run")
    again = DagsterRun(job_name="__ASSET_JOB", run_id="re-execution", root_run_id="first-run",
                       parent_run_id="first-run")
    assert dagster_run_key(again, "triage-nightly") == dagster_run_key(first, "triage-nightly") == (
        "dagster:first-run/triage-nightly")
