"""`batchline launch k8s --schedule CRON --spec JOB.yaml`: a control CronJob that plans the
spec's newest snapshot at each scheduled time, waits for the worker slots and publishes, with
the owner's Secret; and one CronJob per worker slot, with the worker's Secret, which works the
night's version and can neither plan nor publish. The manifests parse as Kubernetes objects,
and the containers' commands, run here as pods would run them (the ConfigMap written out as its
volume, the Job name the CronJob controller gives in its environment), plan one version per
scheduled run over the S3 stand-in, work it in the slots and publish it."""

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

from batchline.errors import BatchlineError, SpecError
from batchline.launch.k8s import SPEC_DIR, Egress, K8sOptions, scheduled_spec, to_yaml
from batchline.launch.manifests import render
from batchline.store import Store
from tests.helpers import ROOT, SIMPLE_SCHEMA, make_records
from tests.integration.fleet.test_launch_k8s import parse as parse_known
from tests.integration.lake.support import S3StandIn
from tests.stores import SQLITE

kubernetes = pytest.importorskip("kubernetes")

MODELS = {"CronJob": "V1CronJob", "ConfigMap": "V1ConfigMap"}


# Where the workers may connect besides DNS (the store's, the object store's and the catalog's network).
EGRESS = Egress(cidrs=("10.20.0.0/16",), api_server=("172.20.0.1/32",))


def parse(obj: dict[str, Any]) -> Any:
    if obj["kind"] not in MODELS:
        return parse_known(obj)
    client = kubernetes.client.ApiClient()
    model = client.deserialize(json.dumps(obj), MODELS[obj["kind"]], "application/json")
    assert client.sanitize_for_serialization(model) == obj, f"{obj['kind']} has fields Kubernetes does not know"
    return model


def write_spec(folder: Path, input_path: str, **top: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "schemas").mkdir(exist_ok=True)
    (folder / "schemas" / "out.json").write_text(json.dumps(SIMPLE_SCHEMA))
    (folder / "triage.prompt").write_text("Classify this ticket.\n")
    spec = {
        "name": "nightly-triage",
        "input": {"path": input_path, "id_field": "id"},
        "model": {"engine": "synthetic"},
        "prompt": {"file": "triage.prompt", "version": "v1"},
        "output": {"schema": "schemas/out.json"},
        "shards": {"size": 25, "lease_seconds": 30, "renew_seconds": 1, "batch_size": 4, "grace_seconds": 7},
        **top,
    }
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def options(spec: Path, **extra: Any) -> K8sOptions:
    from dataclasses import replace

    schedule = replace(scheduled_spec(spec), cron="0 2 * * *", time_zone="Europe/Berlin", publish=True)
    return K8sOptions(egress=EGRESS, version=schedule.job_name, workers=2, image="registry.example/batchline:1",
                      queue="batch-cpu", store_secret="batchline-store", worker_secret="batchline-worker-store",
                      gpus_per_worker=0, schedule=schedule, grace_seconds=schedule.grace_seconds, **extra)


def test_each_slot_is_a_cronjob_of_its_own_at_the_lowest_priority_queued_through_kueue(tmp_path: Path) -> None:
    objects = list(yaml.safe_load_all(to_yaml(render(options(
        write_spec(tmp_path / "job", "s3://lake/tickets/*.jsonl"))))))
    assert [o["kind"] for o in objects] == ["PriorityClass", "ServiceAccount", "NetworkPolicy", "NetworkPolicy",
                                            "ConfigMap", "CronJob", "CronJob", "CronJob"]
    parsed = [parse(o) for o in objects]
    control, *crons = [c for c in parsed if c.kind == "CronJob"]
    assert len({c.metadata.name for c in crons}) == 2 and all(len(c.metadata.name) <= 52 for c in crons)
    for cron in [control, *crons]:
        assert (cron.spec.schedule, cron.spec.time_zone, cron.spec.concurrency_policy) == (
            "0 2 * * *", "Europe/Berlin", "Forbid")
        job = cron.spec.job_template
        rules = {(r.action, tuple(r.on_exit_codes.values) if r.on_exit_codes else None)
                 for r in job.spec.pod_failure_policy.rules}
        assert {("Ignore", (75,)), ("FailJob", (2, 3, 5, 7, 66, 73))} <= rules
        pod = job.spec.template.spec
        assert pod.priority_class_name == parsed[0].metadata.name and parsed[0].value < 0
        assert pod.termination_grace_period_seconds >= 7 + 10
        assert pod.automount_service_account_token is False
        assert "postgresql://" not in to_yaml(objects)
    for cron in crons:
        job = cron.spec.job_template
        assert job.metadata.labels["kueue.x-k8s.io/queue-name"] == "batch-cpu"
        assert (job.spec.suspend, job.spec.parallelism, job.spec.completions) == (True, 1, 1)
        [container] = job.spec.template.spec.containers
        # A worker slot: the worker's Secret, a worker of the version planned for the night's key; no
        # spec, no plan.
        assert container.command == ["sh", "-c"] and container.args == [
            "exec batchline worker --name nightly-triage --wait-for-work 3600 --plan-key "
            "\"${BATCHLINE_SCHEDULED_JOB##*-}\""]
        secret = {e.name: e.value_from.secret_key_ref.name for e in container.env
                  if e.value_from is not None and e.value_from.secret_key_ref is not None}
        assert secret == {"BATCHLINE_STORE": "batchline-worker-store"}
        assert not job.spec.template.spec.volumes or all(v.config_map is None for v in job.spec.template.spec.volumes)
    # The control: the owner's Secret, plans and publishes, runs no worker; not queued (the slots
    # waiting for its plan never hold the quota it needs).
    job = control.spec.job_template
    assert "kueue.x-k8s.io/queue-name" not in job.metadata.labels and job.spec.suspend is False
    assert job.spec.template.metadata.labels["app.kubernetes.io/component"] == "control"
    [container] = job.spec.template.spec.containers
    env = {e.name: e.value_from for e in container.env if e.value_from is not None}
    assert env["BATCHLINE_STORE"].secret_key_ref.name == "batchline-store"
    assert env["BATCHLINE_SCHEDULED_JOB"].field_ref.field_path == "metadata.labels['batch.kubernetes.io/job-name']"
    assert container.command == ["sh", "-c"]
    assert container.args == ["exec batchline run /etc/batchline/job/job.yaml --workers 0 --log-dir "
                              "/tmp/batchline-logs --publish --plan-key \"${BATCHLINE_SCHEDULED_JOB##*-}\""]


def test_a_scheduled_run_needs_the_workers_own_secret_and_quotes_the_spec_for_the_shell(tmp_path: Path) -> None:
    from dataclasses import replace

    spec = write_spec(tmp_path / "job", "s3://lake/tickets/*.jsonl")
    with pytest.raises(BatchlineError, match="give --worker-secret NAME"):
        render(replace(options(spec), worker_secret=None))
    # Regression: the spec's file name went into the shell line unquoted.
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "nightly job;rm -rf ~.yaml").write_text(spec.read_text())
    for name in ("triage.prompt", "schemas"):
        (odd / name).symlink_to(spec.parent / name)
    [control] = [o for o in render(options(odd / "nightly job;rm -rf ~.yaml")) if o["kind"] == "CronJob"][:1]
    line = control["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]["args"][0]
    assert "'/etc/batchline/job/nightly job;rm -rf ~.yaml'" in line


def test_the_configmap_ships_the_spec_and_the_files_it_names_at_their_relative_paths(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "job", "s3://lake/tickets/*.jsonl")
    objects = render(options(spec))
    [config] = [o for o in objects if o["kind"] == "ConfigMap"]
    control = next(o for o in objects if o["kind"] == "CronJob")
    [volume] = [v for v in control["spec"]["jobTemplate"]["spec"]["template"]["spec"]["volumes"]
                if "configMap" in v]
    files = {item["path"]: config["data"][item["key"]] for item in volume["configMap"]["items"]}
    assert files == {"job.yaml": spec.read_text(), "triage.prompt": "Classify this ticket.\n",
                     "schemas/out.json": (spec.parent / "schemas" / "out.json").read_text()}


@pytest.mark.parametrize(("top", "field", "why"), [
    ({"input": {"path": "tickets.jsonl", "id_field": "id"}}, "input.path", "is on this machine"),
    ({"model": {"engine": "synthetic", "path": "weights/model.gguf"}}, "model.path", "a file on this machine"),
    ({"prompt": {"file": "../shared.prompt", "version": "v1"}}, "prompt.file", "must lie in the spec's folder"),
    ({"output": {"schema": "schemas/out.json", "table": {"name": "db.triage", "catalog": "lake",
                                                         "uri": "sqlite:///catalog.db",
                                                         "warehouse": "s3://wh"}}},
     "output.table.uri", "SQLite catalog on this machine"),
])
def test_what_a_pod_cannot_reach_is_refused_when_the_manifests_are_rendered(
        tmp_path: Path, top: dict[str, Any], field: str, why: str) -> None:
    (tmp_path / "shared.prompt").write_text("x")
    spec = write_spec(tmp_path / "job", "s3://lake/tickets/*.jsonl", **top)
    with pytest.raises(SpecError, match=f"{field}: .*{why}"):
        scheduled_spec(spec)


def test_a_schedule_that_is_not_cron_is_refused(tmp_path: Path) -> None:
    from dataclasses import replace

    o = options(write_spec(tmp_path / "job", "s3://lake/tickets/*.jsonl"))
    assert o.schedule is not None
    with pytest.raises(BatchlineError, match="is not a cron schedule"):
        render(replace(o, schedule=replace(o.schedule, cron="every night")))


def be_the_control(objects: list[dict[str, Any]], job_name: str, folder: Path, store_url: str,
                   env: dict[str, str]) -> subprocess.Popen[str]:
    """Starts the control's container command as the kubelet would: its ConfigMap volume written
    out (at a folder of the test's instead of SPEC_DIR), the environment the manifest gives it
    (the store URL as the owner's Secret would)."""
    [config] = [o for o in objects if o["kind"] == "ConfigMap"]
    cron = next(o for o in objects if o["kind"] == "CronJob")
    pod = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    [volume] = [v for v in pod["volumes"] if "configMap" in v]
    for item in volume["configMap"]["items"]:
        target = folder / item["path"]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(config["data"][item["key"]])
    [container] = pod["containers"]
    assert container["command"] == ["sh", "-c"]
    script = container["args"][0].replace(SPEC_DIR, str(folder)).replace("/tmp/batchline-logs",
                                                                          str(folder / "logs"))
    values = {**pod_env(container), "BATCHLINE_STORE": store_url, "BATCHLINE_SCHEDULED_JOB": job_name, **env}
    return subprocess.Popen(["sh", "-c", script], env=values, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=folder)


def pod_env(container: dict[str, Any]) -> dict[str, str]:
    return {**{e["name"]: e.get("value", "") for e in container["env"]}, "PYTHONPATH": str(ROOT),
            # The image's batchline: this interpreter's.
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}


def be_a_slot(objects: list[dict[str, Any]], slot: int, job_name: str, store_url: str, env: dict[str, str],
              folder: Path) -> subprocess.Popen[str]:
    """Starts worker slot `slot`'s container command, the store URL as the worker's Secret gives it."""
    cron = [o for o in objects if o["kind"] == "CronJob"][1 + slot]
    [container] = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["sh", "-c"]
    script = container["args"][0].replace("--wait-for-work 3600", "--wait-for-work 60 --poll-seconds 0.2")
    folder.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(["sh", "-c", script], env={**pod_env(container), "BATCHLINE_STORE": store_url,
                                                      "BATCHLINE_SCHEDULED_JOB": job_name, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=folder)


def night(objects: list[dict[str, Any]], minute: str, tmp_path: Path, store_url: str, worker_url: str,
          env: dict[str, str]) -> str:
    """One scheduled run: its control and two worker slots, started at once (the CronJob controller
    names each Job <cronjob>-<scheduled minute>)."""
    pods = [be_a_slot(objects, slot, f"batchline-nightly-triage-{slot}-{minute}", worker_url, env,
                      tmp_path / f"slot-{slot}-{minute}") for slot in (0, 1)]
    control = be_the_control(objects, f"batchline-nightly-triage-control-{minute}", tmp_path / f"control-{minute}",
                             store_url, env)
    try:
        for pod in pods:
            _out, err = pod.communicate(timeout=180)
            assert pod.returncode == 0, err
        out, err = control.communicate(timeout=120)
    finally:
        for p in (*pods, control):
            p.kill()
    assert control.returncode == 0, err
    return out.strip().splitlines()[-1]


@pytest.fixture
def slot_url(store_kind: str, store_url: str) -> Iterator[str]:
    """What a worker slot's Secret holds: on PostgreSQL, the URL of the role `batchline grants
    --name nightly-triage` makes (every version of the name, none planned yet)."""
    if store_kind == SQLITE:
        yield store_url
        return
    import uuid

    import psycopg

    from batchline.ops.grants import grant
    from tests.helpers import PG_ADMIN_URL
    from tests.stores import role_url

    role = f"bl_test_slots_{uuid.uuid4().hex[:10]}"
    grant(store_url, name="nightly-triage", role=role)
    yield role_url(store_url, role)
    with psycopg.connect(store_url, autocommit=True) as conn:
        conn.execute(f'DROP OWNED BY "{role}"')
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'DROP ROLE IF EXISTS "{role}"')


def test_a_scheduled_run_plans_the_newest_objects_once_its_slots_work_it_and_the_control_publishes(
        lake_env: S3StandIn, store: Store, store_url: str, slot_url: str, tmp_path: Path) -> None:
    bucket = lake_env.bucket()
    records = make_records(60)
    bucket.put("tickets/day-1.jsonl", b"".join(json.dumps(r).encode() + b"\n" for r in records[:40]))
    objects = render(options(write_spec(tmp_path / "job", bucket.url("tickets/*.jsonl"))))
    env = {**lake_env.env(), "BATCHLINE_STORE_WAIT": "5"}
    # The CronJob controller names each Job <cronjob>-<scheduled minute>.
    version = night(objects, "29420160", tmp_path, store_url, slot_url, env)
    assert store.resolve_name("nightly-triage") == version and store.status(version).results == 40

    bucket.put("tickets/day-2.jsonl", b"".join(json.dumps(r).encode() + b"\n" for r in records[40:]))
    newer = night(objects, "29421600", tmp_path, store_url, slot_url, env)
    assert newer != version and store.status(newer).results == 60
    assert store.resolve_name("nightly-triage") == newer


def test_a_scheduled_job_ships_its_retrieved_examples_file(tmp_path: Path) -> None:
    # Without it the pod's spec names a file the pod does not have, and every night fails.
    folder = tmp_path / "job"
    folder.mkdir()
    (folder / "labelled.jsonl").write_text('{"id": "e1", "text": "printer jam", "label": "Misc"}\n')
    spec = write_spec(folder, "s3://lake/tickets/*.jsonl",
                      prompt={"file": "triage.prompt", "version": "v1",
                              "examples": {"file": "labelled.jsonl", "k": 2}},
                      output={"schema": "schemas/out.json", "label_field": "label"})
    [config] = [o for o in render(options(spec)) if o["kind"] == "ConfigMap"]
    assert '{"id": "e1", "text": "printer jam", "label": "Misc"}\n' in config["data"].values()
