"""OpenLineage events of real runs, received over HTTP by a local receiver and validated against
the OpenLineage JSON Schemas of the spec version the client emits (tests/data/openlineage), on
both stores: one START, one COMPLETE and one publish run per job, whatever fails on the way to
the receiver; nothing sent, and nothing imported, where lineage is not configured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from batchline.api import Jobs
from batchline.errors import BatchlineError
from batchline.lineage import LineageConfigError, lineage_config
from batchline.store import Store
from tests.fakes.lineage_receiver import (
    LineageReceiver,
    kept_schema_ids,
    lineage_receiver,
    schema_urls,
    validate_event,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def receiver() -> Iterator[LineageReceiver]:
    with lineage_receiver() as r:
        yield r


@pytest.fixture
def lineage_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    """No OpenLineage configuration but what a test gives: a working folder of its own (no
    openlineage.yml), no OPENLINEAGE_* variables, a home without ~/.openlineage."""
    for key in list(os.environ):
        if key.startswith("OPENLINEAGE"):
            monkeypatch.delenv(key)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return monkeypatch


def run_job(spec: Path, store_url: str, *, publish: bool = True, workers: int = 2) -> str:
    result = Jobs(store_url).run(spec, workers=workers, publish=publish, progress=None, log=lambda _m: None)
    assert result.exit_code == 0
    return result.version


def test_a_whole_job_sends_start_complete_and_its_publish_once_each_every_event_valid(
        job_factory: Any, store_url: str, store: Store, receiver: LineageReceiver,
        lineage_env: pytest.MonkeyPatch) -> None:
    lineage_env.setenv("OPENLINEAGE_URL", receiver.url)
    spec = job_factory(n=300, name="triage", options={"seconds_per_record": 0.002})
    version = run_job(spec, store_url)
    start, complete = receiver.of("triage", "START"), receiver.of("triage", "COMPLETE")
    [published] = receiver.of("triage.publish", "COMPLETE")
    assert len(start) == 1 and len(complete) == 1 and len(receiver.received()) == 3
    assert start[0]["run"]["runId"] == complete[0]["run"]["runId"] != published["run"]["runId"]
    assert published["run"]["facets"]["parent"]["run"]["runId"] == start[0]["run"]["runId"]
    ids = kept_schema_ids()
    for event in receiver.received():
        validate_event(event)
        assert {u.split("#")[0] for u in schema_urls(event)} <= ids
        assert event["producer"].startswith("https://pypi.org/project/batchline/")
    facets = complete[0]["run"]["facets"]
    assert facets["batchline_job"]["version"] == version and facets["batchline_job"]["attempt"] == 1
    assert facets["batchline_outcomes"]["results"] == 300 and facets["batchline_outcomes"]["deadLetters"] == 0
    assert facets["batchline_model"]["engine"] == "synthetic"
    assert facets["batchline_prompt"]["version"] == "v1"
    [source] = complete[0]["inputs"]
    input_path = str(yaml.safe_load(spec.read_text())["input"]["path"])
    assert (source["namespace"], source["name"]) == ("file", input_path)
    import hashlib

    assert source["facets"]["version"]["datasetVersion"] == hashlib.sha256(Path(input_path).read_bytes()).hexdigest()
    [output] = complete[0]["outputs"]
    assert output["facets"]["version"]["datasetVersion"] == version
    assert output["outputFacets"]["outputStatistics"]["rowCount"] == 300
    lineage = output["facets"]["columnLineage"]["fields"]
    assert lineage["output.category"]["inputFields"][0]["field"] == "text"
    assert lineage["id"]["inputFields"][0]["transformations"][0]["subtype"] == "IDENTITY"
    assert [r.state for r in store.lineage_rows(version)] == ["sent"] * 3


def test_with_nothing_configured_nothing_is_sent_or_imported_and_the_rows_wait_in_the_store(
        job_factory: Any, store_url: str, store: Store, receiver: LineageReceiver,
        lineage_env: pytest.MonkeyPatch) -> None:
    assert lineage_config() is None
    version = run_job(job_factory(n=60), store_url)
    assert receiver.received() == []
    assert [(r.kind, r.state) for r in store.lineage_rows(version)] == [
        ("start", "pending"), ("complete", "pending"), ("publish", "pending")]
    probe = ("import sys; from batchline.worker.supervisor import Worker; from batchline.lineage import lineage_config;"
             " from batchline.api import Jobs; assert lineage_config() is None;"
             " print(sorted(m for m in sys.modules if m.startswith('openlineage')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == "[]"


def test_an_unreachable_receiver_warns_once_keeps_the_events_and_the_job_runs_on(
        job_factory: Any, store_url: str, store: Store, receiver: LineageReceiver,
        lineage_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config = Path.cwd() / "openlineage.yml"
    config.write_text(yaml.safe_dump({"transport": {
        "type": "http", "url": "http://127.0.0.1:9", "timeout": 2, "retry": {"total": 0, "connect": 0}}}))
    spec = job_factory(n=120)
    done = subprocess.run([sys.executable, "-m", "batchline", "run", str(spec), "--store", store_url, "--workers", "2",
                           "--publish"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stderr.splitlines() if "warning: lineage" in line]
    assert len(warnings) == 1, done.stderr
    assert "Traceback" not in done.stderr
    version = next(j.version for j in store.jobs())
    rows = store.lineage_rows(version)
    assert [(r.kind, r.state) for r in rows] == [("start", "pending"), ("complete", "pending"), ("publish", "pending")]
    assert all(r.tries >= 1 and r.last_error for r in rows)
    # The receiver is mended (another address here): the next drain sends each event once.
    config.write_text(yaml.safe_dump({"transport": {"type": "http", "url": receiver.url}}))
    store.shift_clock(3600)  # past the retry pause
    outbox = Jobs(store_url).lineage(send=True)
    assert outbox.sent == 3 and outbox.failed == 0
    assert [e["eventType"] for e in receiver.received()] == ["START", "COMPLETE", "COMPLETE"]
    assert Jobs(store_url).lineage(send=True).sent == 0  # sent once, never again


@pytest.mark.parametrize("content, problem", [
    ("transport: {type: http, url: [\n", "not valid YAML"),
    ("- http\n", "must be a mapping"),
    ("transport: http\n", "transport must be a mapping with a `type`"),
    ("", "is empty"),
    ("facets: {}\n", "configures no transport"),
])
def test_a_malformed_openlineage_yml_is_refused_in_one_line_naming_it_before_anything_runs(
        content: str, problem: str, job_factory: Any, lineage_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config = Path.cwd() / "openlineage.yml"
    config.write_text(content)
    with pytest.raises(LineageConfigError, match=problem):
        lineage_config()
    spec = job_factory(n=10)
    db = tmp_path / "never.db"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for command in (["run", str(spec)], ["worker"]):
        done = subprocess.run([sys.executable, "-m", "batchline", *command, "--store", f"sqlite:///{db}"],
                              capture_output=True, text=True, timeout=60, env=env)
        assert done.returncode == 2, done.stderr
        [line] = done.stderr.strip().splitlines()
        assert str(config) in line and problem in line
        assert not db.exists()


def test_openlineage_disabled_turns_a_configuration_off_and_a_noop_transport_is_off(
        lineage_env: pytest.MonkeyPatch) -> None:
    Path("openlineage.yml").write_text(yaml.safe_dump({"transport": {"type": "http", "url": "http://x"}}))
    assert lineage_config() is not None
    lineage_env.setenv("OPENLINEAGE_DISABLED", "true")
    assert lineage_config() is None
    lineage_env.delenv("OPENLINEAGE_DISABLED")
    Path("openlineage.yml").write_text(yaml.safe_dump({"transport": {"type": "noop"}}))
    assert lineage_config() is None


def test_a_resumed_version_is_a_new_run_of_the_same_job_whose_parent_is_the_first(
        job_factory: Any, store_url: str, store: Store, receiver: LineageReceiver,
        lineage_env: pytest.MonkeyPatch) -> None:
    from batchline.errors import BatchlineError

    lineage_env.setenv("OPENLINEAGE_URL", receiver.url)
    poison = [f"r{i:06d}" for i in range(0, 40)]
    spec = job_factory(n=200, name="halting", options={"error_on": poison},
                       shards={"size": 50, "max_attempts": 1, "abort_dead_letter_rate": 0.5,
                               "abort_min_outcomes": 20})
    with pytest.raises(BatchlineError, match="is halted") as halted:
        Jobs(store_url).run(spec, workers=1, progress=None, log=lambda _m: None)
    assert halted.value.exit_code == 7
    version = next(j.version for j in store.jobs())
    Jobs(store_url).resume(version, abort_dead_letter_rate=1.0)
    run_job(spec, store_url, publish=False, workers=1)
    events = [(e["eventType"], e["run"]["runId"]) for e in receiver.of("halting")]
    assert [kind for kind, _ in events] == ["START", "FAIL", "START", "COMPLETE"]
    first, second = events[0][1], events[2][1]
    assert events[1][1] == first and events[3][1] == second != first
    resumed = receiver.of("halting")[2]
    assert resumed["run"]["facets"]["parent"]["run"]["runId"] == first
    assert resumed["run"]["facets"]["batchline_job"]["attempt"] == 2
    failed = receiver.of("halting", "FAIL")[0]
    assert "halted" in failed["run"]["facets"]["errorMessage"]["message"]
    for event in receiver.received():
        validate_event(event)


def test_a_job_over_a_job_names_the_upstreams_version_as_its_input(
        job_factory: Any, store_url: str, store: Store, receiver: LineageReceiver,
        lineage_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    lineage_env.setenv("OPENLINEAGE_URL", receiver.url)
    records = [{"id": f"r{i:03d}", "text": f"ticket {i}", "acl": ["g"]} for i in range(40)]
    upstream = run_job(job_factory(records, name="upstream"), store_url)
    down = job_factory(records, name="downstream", input_path=None)
    raw = yaml.safe_load(down.read_text())
    raw["input"] = {"job": "upstream", "field": "output.summary", "acl_field": "acl"}
    down.write_text(yaml.safe_dump(raw))
    run_job(down, store_url, publish=False)
    [complete] = receiver.of("downstream", "COMPLETE")
    [source] = complete["inputs"]
    [produced] = receiver.of("upstream", "COMPLETE")[0]["outputs"]
    assert (source["namespace"], source["name"]) == (produced["namespace"], produced["name"])
    assert source["facets"]["version"]["datasetVersion"] == upstream
    assert complete["outputs"][0]["facets"]["columnLineage"]["fields"]["acl"]["inputFields"][0]["field"] == "acl"
    validate_event(complete)


def _names(event: dict[str, Any]) -> set[tuple[str, str]]:
    return {(d["namespace"], d["name"]) for d in [*event.get("inputs", []), *event.get("outputs", [])]}


def test_a_version_that_failed_its_gate_was_shown_as_the_published_views_current_version(
        job_factory: Any, store_url: str, store: Store, receiver: LineageReceiver,
        lineage_env: pytest.MonkeyPatch) -> None:
    from batchline.lineage.events import store_datasets

    lineage_env.setenv("OPENLINEAGE_URL", receiver.url)
    spec = job_factory(n=60, name="failing", options={"error_on": [f"r{i:06d}" for i in range(10)]},
                       validate={"max_dead_letter_rate": 0.01})
    with pytest.raises(BatchlineError, match="failed validation; not published"):
        Jobs(store_url).run(spec, workers=1, publish=True, progress=None, log=lambda _m: None)
    assert store.resolve_name("failing") is None
    [job] = [j for j in store.jobs() if j.name == "failing"]
    datasets = store_datasets(store_url)
    view = datasets.of("failing")
    [complete] = receiver.of("failing", "COMPLETE")
    [output] = complete["outputs"]
    assert (output["namespace"], output["name"]) == (datasets.namespace, datasets.results("failing").name)
    assert output["facets"]["version"]["datasetVersion"] == job.version
    assert receiver.of("failing.publish") == []
    assert all((view.namespace, view.name) not in _names(e) for e in receiver.received())
    validate_event(complete)


def test_two_jobs_publishing_under_one_dataset_root_collapsed_into_one_lineage_node(
        job_factory: Any, store_url: str, receiver: LineageReceiver, lineage_env: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    lineage_env.setenv("OPENLINEAGE_URL", receiver.url)
    root = tmp_path / "exports"
    for name in ("alpha", "beta"):
        spec = job_factory(n=20, name=name)
        raw = yaml.safe_load(spec.read_text())
        raw["output"]["dataset"] = str(root)
        spec.write_text(yaml.safe_dump(raw))
        run_job(spec, store_url)
    named = {}
    for name in ("alpha", "beta"):
        [published] = receiver.of(f"{name}.publish", "COMPLETE")
        [dataset] = [o for o in published["outputs"] if o["namespace"] == "file"]
        named[name] = dataset["name"]
        validate_event(published)
    assert named == {"alpha": str(root / "alpha"), "beta": str(root / "beta")}


def test_a_version_launched_by_an_orchestrators_task_names_that_run_as_its_parent_and_root(
        job_factory: Any, store_url: str, store: Store, receiver: LineageReceiver,
        lineage_env: pytest.MonkeyPatch) -> None:
    from batchline.plan.planner import plan
    from batchline.spec import load_spec

    lineage_env.setenv("OPENLINEAGE_URL", receiver.url)
    task = {"namespace": "airflow-prod", "name": "nightly.triage", "run_id": "01939c2e-8f0a-7000-8000-000000000001"}
    spec = job_factory(n=40, name="scheduled")
    version = plan(load_spec(spec), store).version
    store.set_lineage_parent(version, task)
    assert Jobs(store_url).run(spec, workers=1, publish=True, progress=None, log=lambda _m: None).exit_code == 0
    [start] = receiver.of("scheduled", "START")
    parent = start["run"]["facets"]["parent"]
    assert (parent["job"]["namespace"], parent["job"]["name"], parent["run"]["runId"]) == (
        "airflow-prod", "nightly.triage", task["run_id"])
    [published] = receiver.of("scheduled.publish", "COMPLETE")
    facet = published["run"]["facets"]["parent"]
    assert facet["run"]["runId"] == start["run"]["runId"]  # the publish hangs under the computation
    assert (facet["root"]["job"]["namespace"], facet["root"]["job"]["name"], facet["root"]["run"]["runId"]) == (
        "airflow-prod", "nightly.triage", task["run_id"])
    for event in receiver.received():
        validate_event(event)


def test_a_cancelled_run_is_aborted_naming_who(job_factory: Any, store_url: str, store: Store,
                                                receiver: LineageReceiver, lineage_env: pytest.MonkeyPatch) -> None:
    from batchline.plan.planner import plan
    from batchline.spec import load_spec

    lineage_env.setenv("OPENLINEAGE_URL", receiver.url)
    version = plan(load_spec(job_factory(n=20, name="dropped")), store).version
    assert store.claim("w1", version) is not None
    assert Jobs(store_url).cancel(version, reason="wrong prompt")
    assert [e["eventType"] for e in receiver.of("dropped")] == ["START", "ABORT"]
    aborted = receiver.of("dropped", "ABORT")[0]
    assert "wrong prompt" in aborted["run"]["facets"]["errorMessage"]["message"]
    from batchline.lineage.events import store_datasets

    view = store_datasets(store_url).of("dropped")
    assert all((view.namespace, view.name) not in _names(e) for e in receiver.received())
    validate_event(aborted)


def test_the_lineage_command_lists_the_outbox_and_refuses_to_send_where_lineage_is_off(
        job_factory: Any, store_url: str, lineage_env: pytest.MonkeyPatch) -> None:
    version = run_job(job_factory(n=30, name="listed"), store_url)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    listed = subprocess.run([sys.executable, "-m", "batchline", "lineage", version, "--store", store_url, "--json"],
                            capture_output=True, text=True, env=env, check=True)
    assert [(e["kind"], e["state"]) for e in json.loads(listed.stdout)["events"]] == [
        ("start", "pending"), ("complete", "pending"), ("publish", "pending")]
    refused = subprocess.run([sys.executable, "-m", "batchline", "lineage", "--send", "--store", store_url],
                             capture_output=True, text=True, env=env)
    assert refused.returncode == 1 and "lineage is off here" in refused.stderr


def test_the_clients_aliases_of_openlineage_url_leaked_into_the_environment_that_workers_inherit(
        lineage_env: pytest.MonkeyPatch, receiver: LineageReceiver) -> None:
    lineage_env.setenv("OPENLINEAGE_URL", receiver.url)
    config = lineage_config()
    assert config is not None
    before = dict(os.environ)
    config.client()  # the client writes OPENLINEAGE__TRANSPORT__TRANSPORTS__... as it reads OPENLINEAGE_URL
    assert dict(os.environ) == before


def test_a_transports_variables_without_its_type_are_refused_not_taken_for_a_configuration(
        lineage_env: pytest.MonkeyPatch) -> None:
    lineage_env.setenv("OPENLINEAGE__TRANSPORT__URL", "http://marquez:5000")
    with pytest.raises(LineageConfigError, match="OPENLINEAGE__TRANSPORT__URL is set without "
                                                 "OPENLINEAGE__TRANSPORT__TYPE"):
        lineage_config()
    lineage_env.setenv("OPENLINEAGE__TRANSPORT__TYPE", "http")
    config = lineage_config()
    assert config is not None and config.source == "the OPENLINEAGE__TRANSPORT variables"
