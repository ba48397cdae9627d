"""The Airflow provider, run by real Airflow in processes of their own against a metadata
database made for the test, with the local launcher and the synthetic engine, on both stores:
the example DAG's run by `dag.test()`, deferral and re-attachment, a failed gate, a kill, a
store that cannot be read, and the provider's registration."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from batchline.store import Store
from tests.helpers import call_counts, make_records

ROOT = Path(__file__).resolve().parents[3]
SCENARIOS = Path(__file__).with_name("airflow_scenarios.py")
EXAMPLE_DAGS = ROOT / "examples" / "airflow"

pytest.importorskip("airflow", reason="the airflow extra is not installed")


@pytest.fixture(scope="module")
def airflow_base(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Airflow's own settings for this module's runs: a home and a metadata database (SQLite)
    made once, the example DAGs' folder, no example DAGs of Airflow's own."""
    home = tmp_path_factory.mktemp("airflow")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "OPENLINEAGE"))}
    env.update({"AIRFLOW_HOME": str(home), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
                "AIRFLOW__CORE__DAGS_FOLDER": str(EXAMPLE_DAGS), "PYTHONPATH": str(ROOT)})
    migrated = subprocess.run([str(Path(sys.executable).with_name("airflow")), "db", "migrate"], env=env,
                              capture_output=True, text=True, timeout=300)
    assert migrated.returncode == 0, migrated.stderr[-3000:]
    return env


def connection(store_url: str, runner_dir: Path) -> str:
    """The `batchline` connection of a store: a SQLite store by its URL in the extra, a
    PostgreSQL one by host, port, login and database."""
    local = {"local": {"runner_dir": str(runner_dir)}}
    if store_url.startswith("sqlite:"):
        return json.dumps({"conn_type": "batchline", "extra": {"store": store_url, **local}})
    parts = urlsplit(store_url)
    return json.dumps({"conn_type": "batchline", "host": parts.hostname, "port": parts.port, "login": parts.username,
                       "schema": parts.path.lstrip("/"), "extra": local})


@pytest.fixture
def airflow(airflow_base: dict[str, str], store_url: str, tmp_path: Path) -> Any:
    env = {**airflow_base, "AIRFLOW_CONN_BATCHLINE_DEFAULT": connection(store_url, tmp_path / "runners"),
           "AIRFLOW_CONN_BATCHLINE_GONE": json.dumps({"conn_type": "batchline", "extra": {
               "store": f"sqlite:///{tmp_path / 'no-such-folder' / 'store.db'}"}})}

    def run(scenario: str, **args: Any) -> dict[str, Any]:
        done = subprocess.run([sys.executable, str(SCENARIOS), scenario, json.dumps(args)], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=600)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        assert done.returncode == 0 and lines, (done.stdout[-4000:] + done.stderr[-4000:])
        result: dict[str, Any] = json.loads(lines[-1][len("RESULT "):])
        return result

    return run


def triage_spec(job_factory: Any, calls: Path, n: int = 120, **kw: Any) -> Path:
    records = make_records(n)
    for r in records:
        r["acl"] = ["support"]
    return job_factory(records, name="triage-nightly", base="published",
                       options={"call_log": str(calls), "seconds_per_record": 0.005}, **kw)


def test_the_example_dag_defers_fires_on_the_seal_and_publishes_with_only_a_manifest_in_xcom(
        airflow: Any, job_factory: Any, store: Store, tmp_path: Path) -> None:
    calls = tmp_path / "calls.log"
    triage = triage_spec(job_factory, calls)
    summaries = job_factory(name="summaries", input_path=None)
    raw = yaml.safe_load(summaries.read_text())
    raw["input"] = {"job": "triage-nightly", "field": "output.summary", "acl_field": "acl"}
    summaries.write_text(yaml.safe_dump(raw))

    result = airflow("example_dag", dags=str(EXAMPLE_DAGS), triage=str(triage), summaries=str(summaries))

    assert result["state"] == "success", result
    assert {t: v["state"] for t, v in result["tasks"].items()} == {
        "triage": "success", "summaries": "success", "publish_index": "success"}
    triaged = result["xcoms"]["triage"]["return_value"]
    assert set(triaged) == {"version", "name", "state", "records", "results", "computed", "carried", "dead_letters",
                            "input_tokens", "output_tokens", "paid_worker_seconds", "paid_cost", "published_as",
                            "targets"}
    assert (triaged["paid_worker_seconds"], triaged["paid_cost"]) == (0.0, 0.0)  # no pacer bought any
    assert (triaged["records"], triaged["results"], triaged["published_as"]) == (120, 120, "triage-nightly")
    assert (triaged["computed"], triaged["carried"]) == (120, 0)
    assert triaged["targets"] == [{"kind": "view", "name": "triage-nightly", "version": triaged["version"]}]
    assert store.resolve_name("triage-nightly") == triaged["version"]
    summarised = result["xcoms"]["summaries"]["return_value"]
    assert summarised["published_as"] is None  # validated by its own task, published by the next
    assert result["xcoms"]["publish_index"]["return_value"]["published_as"] == "summaries"
    assert store.resolve_name("summaries") == summarised["version"]
    assert set(call_counts(calls).values()) == {1}
    [launch] = store.launches(triaged["version"])
    assert (launch.launcher, launch.state) == ("local", "launched")
    # batchline's own events hang under the task's OpenLineage run.
    parent = store.lineage_parent(triaged["version"])
    assert parent is not None and parent["name"] == "batchline_nightly_triage.triage" and parent["run_id"]


def test_a_task_killed_while_deferred_and_retried_reattaches_and_computes_nothing_twice(
        airflow: Any, job_factory: Any, store: Store, tmp_path: Path) -> None:
    calls = tmp_path / "calls.log"
    spec = triage_spec(job_factory, calls, n=200)
    result = airflow("defer_retry_and_finish", spec=str(spec))

    assert result["classpath"] == "batchline.orchestrators.airflow.triggers.BatchlineVersionTrigger"
    assert result["method"] == "execute_complete"
    version = result["kwargs"]["version"]
    assert result["second_kwargs"] == result["kwargs"]  # the retry planned the same version
    assert "password" not in json.dumps(result["kwargs"]) and "://" not in json.dumps(result["kwargs"])
    [launch] = store.launches(version)
    assert launch.state == "launched" and launch.key == "airflow:nightly/triage/scheduled__2026-12-06T01:00:00+00:00/-1"
    assert [e.detail["key"] for e in store.events(version, ["launch"])] == [launch.key]  # launched once
    assert result["event"]["state"] == "sealed"
    assert result["manifest"]["published_as"] == "triage-nightly" and result["manifest"]["results"] == 200
    counts = call_counts(calls)
    assert len(counts) == 200 and set(counts.values()) == {1}
    # Airflow's own lineage of the task: the input snapshot, the view it published, batchline's facets.
    from batchline.lineage.events import store_datasets

    view = store_datasets(store.url).of("triage-nightly")
    assert result["lineage"]["inputs"] == [["file", str(Path(yaml.safe_load(spec.read_text())["input"]["path"]))]]
    assert result["lineage"]["outputs"] == [[view.namespace, view.name, version]]
    assert {"batchline_job", "batchline_model", "batchline_prompt"} <= set(result["lineage"]["run_facets"])


def test_on_kill_stops_the_fleet_and_the_next_try_launches_it_again_without_a_record_computed_twice(
        airflow: Any, job_factory: Any, store: Store, tmp_path: Path) -> None:
    calls = tmp_path / "calls.log"
    spec = triage_spec(job_factory, calls, n=200, shards={"size": 20})
    result = airflow("killed_then_retried", spec=str(spec))
    version = result["version"]
    assert result["manifest"]["results"] == 200
    assert [e.detail["key"] for e in store.events(version, ["launch"])] == [
        "airflow:nightly/triage/scheduled__2026-12-06T01:00:00+00:00/-1"] * 2
    [launch] = store.launches(version)
    assert launch.state == "launched"
    counts = call_counts(calls)
    assert len(counts) == 200 and set(counts.values()) == {1}


@pytest.mark.parametrize("store_kind", ["sqlite"], indirect=True)  # the trigger's rule; launch records: the contract suite
def test_a_deferred_task_marked_failed_stops_its_fleet_through_the_trigger_and_the_next_try_launches_again(
        airflow: Any, job_factory: Any, store: Store, tmp_path: Path) -> None:
    calls = tmp_path / "calls.log"
    spec = triage_spec(job_factory, calls, n=200, shards={"size": 20})
    result = airflow("killed_while_deferred_then_retried", spec=str(spec))
    version = result["version"]
    assert (result["kwargs"]["launch_key"], result["kwargs"]["launcher"]) == (
        "airflow:nightly/triage/scheduled__2026-12-06T01:00:00+00:00/-1", "local")
    assert "://" not in json.dumps(result["kwargs"])  # never the store's URL
    assert result["after_kill"] == ["stopped", "the Airflow task was killed while deferred"]
    assert [e.detail["key"] for e in store.events(version, ["launch"])] == [result["kwargs"]["launch_key"]] * 2
    assert result["manifest"]["results"] == 200
    counts = call_counts(calls)
    assert len(counts) == 200 and set(counts.values()) == {1}


def test_a_failed_gate_fails_the_task_with_its_table_and_publishes_nothing(
        airflow: Any, job_factory: Any, store: Store, tmp_path: Path) -> None:
    spec = triage_spec(job_factory, tmp_path / "calls.log",
                       validate={"max_dead_letter_rate": 0.01})
    raw = yaml.safe_load(spec.read_text())
    raw["model"]["options"]["error_on"] = [f"r{i:06d}" for i in range(10)]
    spec.write_text(yaml.safe_dump(raw))
    result = airflow("failing_gate", spec=str(spec))
    assert result["event"]["state"] == "sealed"
    assert result["failed"] is not None and "failed its gate; nothing published" in result["failed"]
    assert "FAIL  10 (8.33%, limit 1.00%): engine_error 10" in result["failed"]
    assert store.resolve_name("triage-nightly") is None


def test_a_store_the_trigger_cannot_read_fails_the_task_after_its_bound_naming_the_store(
        airflow: Any, job_factory: Any, tmp_path: Path) -> None:
    result = airflow("store_unreachable", version="triage-nightly@0123456789abcdef",
                     spec=str(triage_spec(job_factory, tmp_path / "calls.log")))
    assert result["event"]["state"] == "error"
    assert "batchline_gone could not be read 3 times in a row" in result["event"]["message"]
    assert "untouched" in result["failed"]


def test_checks_that_run_a_model_and_an_unknown_launcher_option_are_refused_before_anything_is_planned(
        airflow: Any, job_factory: Any, store: Store, tmp_path: Path) -> None:
    spec = triage_spec(job_factory, tmp_path / "calls.log", validate={"grounded": ["summary"],
                                                                      "reproduce": {"sample": 5}})
    refused = airflow("refused_at_start", spec=str(spec))["refused"]
    assert "validate.reproduce run a model" in refused
    plain = triage_spec(job_factory, tmp_path / "calls.log")
    refused = airflow("refused_at_start", spec=str(plain), kwargs={"launcher_options": {"runner_dri": "/tmp"}})["refused"]
    assert "option 'runner_dri' is not one it takes (runner_dir)" in refused
    refused = airflow("refused_at_start", spec=str(plain), kwargs={"launcher": "slurm"})["refused"]
    assert "launcher 'slurm' is not one of kubernetes, local, ray" in refused
    # None of these is retried: a retry would be refused the same way.
    assert refused.startswith("AirflowFailException: SpecError: ")
    assert store.jobs() == []


@pytest.mark.parametrize("store_kind", ["sqlite"], indirect=True)  # a connection's SQLite path: no other store has one
def test_a_connection_naming_a_store_that_does_not_exist_fails_the_task_naming_it_and_makes_nothing(
        airflow: Any, job_factory: Any, tmp_path: Path) -> None:
    refused = airflow("refused_at_start", spec=str(triage_spec(job_factory, tmp_path / "calls.log")),
                      kwargs={"batchline_conn_id": "batchline_gone"})["refused"]
    missing = tmp_path / "no-such-folder" / "store.db"
    assert refused == (f"AirflowFailException: StoreMissing: store {missing} does not exist "
                       f"(batchline plan or run makes it)")
    assert not missing.parent.exists()


@pytest.mark.parametrize("store_kind", ["sqlite"], indirect=True)
def test_the_provider_is_registered_by_its_entry_point_and_its_info_meets_airflows_schema(airflow: Any) -> None:
    result = airflow("provider")
    assert result["providers"] == ["batchline"]
    assert result["hook"] == "batchline.orchestrators.airflow.hooks.BatchlineHook"
    assert result["triggers"] == ["batchline.orchestrators.airflow.triggers"]  # its module, as Airflow lists it
