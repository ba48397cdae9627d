"""`batchline launch k8s --schedule CRON --spec JOB.yaml`: one CronJob per worker slot that
plans the spec's newest snapshot at each scheduled time. The manifests parse as Kubernetes
objects, and each slot's container command, run here as a pod would run it (the ConfigMap
written out as its volume, the Job name the CronJob controller gives in its environment),
plans one version per scheduled run over the S3 stand-in and publishes it from slot 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from batchline.errors import BatchlineError, SpecError
from batchline.launch.k8s import SPEC_DIR, K8sOptions, scheduled_spec, to_yaml
from batchline.launch.manifests import render
from batchline.store import Store
from tests.helpers import ROOT, SIMPLE_SCHEMA, make_records
from tests.integration.fleet.test_launch_k8s import parse as parse_known
from tests.integration.lake.support import S3StandIn

kubernetes = pytest.importorskip("kubernetes")

MODELS = {"CronJob": "V1CronJob", "ConfigMap": "V1ConfigMap"}


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
    return K8sOptions(version=schedule.job_name, workers=2, image="registry.example/batchline:1", queue="batch-cpu",
                      store_secret="batchline-store", gpus_per_worker=0, schedule=schedule,
                      grace_seconds=schedule.grace_seconds, **extra)


def test_each_slot_is_a_cronjob_of_its_own_at_the_lowest_priority_queued_through_kueue(tmp_path: Path) -> None:
    objects = list(yaml.safe_load_all(to_yaml(render(options(
        write_spec(tmp_path / "job", "s3://lake/tickets/*.jsonl"))))))
    assert [o["kind"] for o in objects] == ["PriorityClass", "ServiceAccount", "Role", "RoleBinding", "ConfigMap",
                                            "CronJob", "CronJob"]
    parsed = [parse(o) for o in objects]
    crons = [c for c in parsed if c.kind == "CronJob"]
    assert len({c.metadata.name for c in crons}) == 2 and all(len(c.metadata.name) <= 52 for c in crons)
    for cron in crons:
        assert (cron.spec.schedule, cron.spec.time_zone, cron.spec.concurrency_policy) == (
            "0 2 * * *", "Europe/Berlin", "Forbid")
        job = cron.spec.job_template
        assert job.metadata.labels["kueue.x-k8s.io/queue-name"] == "batch-cpu"
        assert (job.spec.suspend, job.spec.parallelism, job.spec.completions) == (True, 1, 1)
        rules = {(r.action, tuple(r.on_exit_codes.values) if r.on_exit_codes else None)
                 for r in job.spec.pod_failure_policy.rules}
        assert {("Ignore", (75,)), ("FailJob", (2, 3, 5, 7, 66, 73))} <= rules
        pod = job.spec.template.spec
        assert pod.priority_class_name == parsed[0].metadata.name and parsed[0].value < 0
        assert pod.termination_grace_period_seconds >= 7 + 10
        [container] = pod.containers
        env = {e.name: e.value_from.field_ref.field_path for e in container.env
               if e.value_from is not None and e.value_from.field_ref is not None}
        assert env["BATCHLINE_SCHEDULED_JOB"] == "metadata.labels['batch.kubernetes.io/job-name']"
        assert "postgresql://" not in to_yaml(objects)
    commands = [c.spec.job_template.spec.template.spec.containers[0].args[0] for c in crons]
    assert "--publish" in commands[0] and "--publish" not in commands[1]


def test_the_configmap_ships_the_spec_and_the_files_it_names_at_their_relative_paths(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "job", "s3://lake/tickets/*.jsonl")
    objects = render(options(spec))
    [config] = [o for o in objects if o["kind"] == "ConfigMap"]
    [volume] = [v for v in objects[-1]["spec"]["jobTemplate"]["spec"]["template"]["spec"]["volumes"]
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


def be_the_pod(objects: list[dict[str, Any]], slot: int, job_name: str, folder: Path, store_url: str,
               env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Runs slot `slot`'s container command as the kubelet would: its ConfigMap volume
    written out (at a folder of the test's instead of SPEC_DIR), the environment the
    manifest gives it (the store URL as the Secret would)."""
    [config] = [o for o in objects if o["kind"] == "ConfigMap"]
    cron = [o for o in objects if o["kind"] == "CronJob"][slot]
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
    values = {e["name"]: e.get("value", "") for e in container["env"]}
    values.update({"BATCHLINE_STORE": store_url, "BATCHLINE_SCHEDULED_JOB": job_name,
                   "PYTHONPATH": str(ROOT), **env,
                   # The image's batchline: this interpreter's.
                   "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])})
    return subprocess.run(["sh", "-c", script], env=values, capture_output=True, text=True, timeout=300,
                          cwd=folder)


def test_a_scheduled_run_plans_the_newest_objects_once_for_all_its_slots_and_slot_0_publishes(
        lake_env: S3StandIn, store: Store, store_url: str, tmp_path: Path) -> None:
    bucket = lake_env.bucket()
    records = make_records(60)
    bucket.put("tickets/day-1.jsonl", b"".join(json.dumps(r).encode() + b"\n" for r in records[:40]))
    objects = render(options(write_spec(tmp_path / "job", bucket.url("tickets/*.jsonl"))))
    env = {**lake_env.env(), "BATCHLINE_STORE_WAIT": "5"}
    # The CronJob controller names each Job <cronjob>-<scheduled minute>.
    night_1 = be_the_pod(objects, 0, "batchline-nightly-triage-0-29420160", tmp_path / "pod-a", store_url, env)
    assert night_1.returncode == 0, night_1.stderr
    version = night_1.stdout.strip()
    assert store.resolve_name("nightly-triage") == version and store.status(version).results == 40

    bucket.put("tickets/day-2.jsonl", b"".join(json.dumps(r).encode() + b"\n" for r in records[40:]))
    # Slot 1 of the same night, started late (after the new object landed): the night's version.
    late = be_the_pod(objects, 1, "batchline-nightly-triage-1-29420160", tmp_path / "pod-b", store_url, env)
    assert late.returncode == 0, late.stderr
    assert late.stdout.strip() == version and [j.version for j in store.jobs()] == [version]

    night_2 = be_the_pod(objects, 0, "batchline-nightly-triage-0-29421600", tmp_path / "pod-c", store_url, env)
    assert night_2.returncode == 0, night_2.stderr
    newer = night_2.stdout.strip()
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
