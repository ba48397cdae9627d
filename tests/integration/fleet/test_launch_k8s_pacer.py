"""`launch k8s --fallback-queue`: the pacer Deployment, its Role on jobs alone, the paid worker
Job template and the on-demand queue, each parsed through the official kubernetes client's
models; and the pacer's decisions on Kubernetes (`K8sPaid` with the real `Pacer` and store)
against a recording stand-in for the API server, since no cluster runs here."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from batchline.cli import main
from batchline.launch.k8s import Egress, K8sOptions, PaidPool, to_yaml
from batchline.launch.k8s_pacer import (
    GENERATION_LABEL,
    SLOT_LABEL,
    K8sPaid,
    paid_job,
    paid_job_template,
)
from batchline.launch.manifests import render
from batchline.launch.pacer import Pacer
from batchline.sizing.pacing import Mode
from batchline.store import Store
from tests.integration.fleet.test_launch_k8s import MODELS, parse
from tests.integration.test_pacer import behind

kubernetes = pytest.importorskip("kubernetes")
from kubernetes.client.exceptions import ApiException  # noqa: E402

MODELS.update({"Deployment": "V1Deployment", "ConfigMap": "V1ConfigMap"})
VERSION = "ticket-triage@3f9a0c1d2e"
POOL = PaidPool("on-demand", 4, {"capacity": "on-demand"},
                [{"key": "capacity", "operator": "Equal", "value": "on-demand", "effect": "NoSchedule"}], "paid")


# Where the workers may connect besides DNS (the store's, the object store's and the catalog's network).
EGRESS = Egress(cidrs=("10.20.0.0/16",), api_server=("172.20.0.1/32",))


def options(**kw: Any) -> K8sOptions:
    return K8sOptions(egress=EGRESS, version=VERSION, workers=2, image="registry.example/batchline:1", queue="batch-spot",
                      store_secret="batchline-store", gpus_per_worker=0, namespace="jobs", fallback=POOL, **kw)


def kinds(objects: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for o in objects:
        out.setdefault(o["kind"], []).append(o)
    return out


def test_every_object_of_the_paid_pool_parses_as_a_kubernetes_object() -> None:
    objects = list(yaml.safe_load_all(to_yaml(render(options()))))
    for obj in objects:
        parse(obj)
    found = kinds(objects)
    assert len(found["Job"]) == 2 and len(found["Deployment"]) == 1 and len(found["ConfigMap"]) == 1
    template = json.loads(found["ConfigMap"][0]["data"]["job.json"])
    parse(template)
    parse(paid_job(template, "paid-3", 2))


def test_one_pacer_at_a_time_with_rights_on_jobs_and_reading_pods() -> None:
    found = kinds(render(options()))
    [deployment] = found["Deployment"]
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "batchline-ticket-triage-3f9a0c1d2e-pacer"
    [container] = pod["containers"]
    assert container["args"][:3] == ["pace", "--job", VERSION]
    assert container["env"][0]["valueFrom"] == {"secretKeyRef": {"name": "batchline-store", "key": "url"}}
    roles = [r for r in found["Role"] if r["metadata"]["name"] == "batchline-ticket-triage-3f9a0c1d2e-pacer"]
    assert [r["rules"] for r in roles] == [[{"apiGroups": ["batch"], "resources": ["jobs"],
                                             "verbs": ["get", "list", "watch", "create", "delete"]},
                                            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}]]
    assert container["args"][-1] == "--take-back" and pod["automountServiceAccountToken"] is True
    # Without take-back, the pacer reads no pod either.
    quiet = kinds(render(options(take_back=False)))
    [role] = [r for r in quiet["Role"] if r["metadata"]["name"] == "batchline-ticket-triage-3f9a0c1d2e-pacer"]
    assert [r["resources"] for r in role["rules"]] == [["jobs"]]
    assert "--take-back" not in quiet["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]["args"]
    [binding] = [b for b in found["RoleBinding"] if b["metadata"]["name"] == "batchline-ticket-triage-3f9a0c1d2e-pacer"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "batchline-ticket-triage-3f9a0c1d2e-pacer",
                                    "namespace": "jobs"}]


def test_a_paid_job_is_an_ordinary_worker_of_the_version_in_the_paid_queue_and_nodes() -> None:
    job = paid_job(paid_job_template(options()), "paid-1", 3)
    assert job["metadata"]["name"] == "batchline-ticket-triage-3f9a0c1d2e-paid-1-g3"
    labels = job["metadata"]["labels"]
    assert (labels["kueue.x-k8s.io/queue-name"], labels[SLOT_LABEL], labels[GENERATION_LABEL]) == (
        "on-demand", "paid-1", "3")
    assert labels["batchline/job"] == "ticket-triage-3f9a0c1d2e"
    pod = job["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"capacity": "on-demand"} and pod["priorityClassName"] == "paid"
    assert pod["tolerations"] == POOL.tolerations
    assert pod["containers"][0]["args"] == ["worker", "--job", VERSION, "--paid-slot", "paid-1/3"]
    assert job["spec"]["suspend"] is True  # admitted by Kueue, as every worker Job


def test_the_sample_on_demand_queue_admits_every_paid_worker() -> None:
    found = kinds(render(options(kueue_sample=True)))
    [queue] = [q for q in found["LocalQueue"] if q["metadata"]["name"] == "on-demand"]
    flavor = next(f for f in found["ResourceFlavor"] if f["metadata"]["name"] == queue["spec"]["clusterQueue"])
    assert flavor["spec"] == {"nodeLabels": {"capacity": "on-demand"}}
    cluster = next(c for c in found["ClusterQueue"] if c["metadata"]["name"] == queue["spec"]["clusterQueue"])
    quota = {r["name"]: r["nominalQuota"] for r in cluster["spec"]["resourceGroups"][0]["flavors"][0]["resources"]}
    assert quota["cpu"] == "4" and quota["memory"] == "32Gi"


# --- the pacer on Kubernetes, against a stand-in for the API server ----------------------------


@dataclass
class FakeBatchApi:
    """A recording stand-in for BatchV1Api (no cluster runs here): Jobs by name, each body
    checked through the client's model as the API server would have it."""

    jobs: dict[str, dict[str, Any]] = field(default_factory=dict)
    calls: list[tuple[str, str]] = field(default_factory=list)

    def _model(self, body: dict[str, Any]) -> Any:
        return parse(body)

    def create_namespaced_job(self, namespace: str, body: dict[str, Any]) -> Any:
        name = body["metadata"]["name"]
        self.calls.append(("create", name))
        if name in self.jobs:
            raise ApiException(status=409, reason="AlreadyExists")
        self.jobs[name] = body
        return self._model(body)

    def read_namespaced_job(self, name: str, namespace: str) -> Any:
        if name not in self.jobs:
            raise ApiException(status=404, reason="NotFound")
        return self._model(self.jobs[name])

    def delete_namespaced_job(self, name: str, namespace: str, propagation_policy: str,
                              grace_period_seconds: int | None = None) -> None:
        self.calls.append(("delete", name) if grace_period_seconds is None else ("delete at once", name))
        assert propagation_policy == "Background"
        self.jobs.pop(name)

    def list_namespaced_job(self, namespace: str, label_selector: str) -> Any:
        wanted = dict(p.split("=", 1) if "=" in p else (p, None) for p in label_selector.split(","))
        items = [self._model(j) for j in self.jobs.values()
                 if all(k in j["metadata"]["labels"] and (v is None or j["metadata"]["labels"][k] == v)
                        for k, v in wanted.items())]
        return kubernetes.client.V1JobList(items=items)


def k8s_pacer(store: Store, version: str, api: FakeBatchApi) -> Pacer:
    template = paid_job_template(K8sOptions(egress=EGRESS, version=version, workers=1, image="img", queue="spot",
                                            store_secret="s", gpus_per_worker=0, fallback=POOL))
    return Pacer(store, version, K8sPaid(api, "default", template), tick_seconds=30, by="k8s-pacer")


def test_the_k8s_pacer_creates_each_paid_job_once_and_counts_only_what_was_admitted(
        job_factory: Any, store: Store) -> None:
    version, _lease = behind(job_factory, store, workers=3)
    api = FakeBatchApi()
    report = k8s_pacer(store, version, api).tick()
    assert report is not None and report.decision.paid == 3
    names = sorted(api.jobs)
    assert [n.rsplit("-", 2)[-2:] for n in names] == [["0", "g1"], ["1", "g1"], ["2", "g1"]]
    # Created and not admitted (no worker has come up): capacity ordered, not capacity.
    again = k8s_pacer(store, version, api).tick()  # a second pacer (a rollout, a restart)
    assert again is not None and again.started == () and sorted(api.jobs) == names
    assert (again.paid_seen, again.paid_not_admitted) == (0, 3)
    assert "(+3 paid capacity not admitted)" in again.line()
    # The slot's next start finds its Job made already (by a pacer that died before the store
    # heard of it): the API server answers 409, and that Job is the start's, not a second one.
    store.paid_stop(version, "paid-0", 1, "its pod was lost")
    third = k8s_pacer(store, version, api)
    assert isinstance(third.launcher, K8sPaid)
    made = paid_job(third.launcher.template, "paid-0", 2)
    api.jobs[made["metadata"]["name"]] = made
    report = third.tick()
    assert report is not None and report.started == ("paid-0",)
    assert api.calls.count(("create", made["metadata"]["name"])) == 1 and len(api.jobs) == 4


def test_the_k8s_pacer_deletes_only_paid_jobs_of_its_own_version(job_factory: Any, store: Store) -> None:
    version, _lease = behind(job_factory, store, workers=2)
    api = FakeBatchApi()
    pacer = k8s_pacer(store, version, api)
    assert pacer.tick().started == ("paid-0", "paid-1")  # type: ignore[union-attr]
    assert isinstance(pacer.launcher, K8sPaid)
    # Another version's Job under the name this pacer would delete is left alone.
    start = next(s for s in store.paid_slots(version) if s.slot == "paid-1")
    name = next(n for n in api.jobs if n.endswith("paid-1-g1"))
    api.jobs[name]["metadata"]["labels"]["batchline/job"] = "someone-else"
    pacer.launcher.stop(version, start)
    assert name in api.jobs and ("delete", name) not in api.calls
    assert pacer.launcher.listed() == [n for n in sorted(api.jobs) if n != name]
    other = next(s for s in store.paid_slots(version) if s.slot == "paid-0")
    ours = next(n for n in api.jobs if n.endswith("paid-0-g1"))
    pacer.launcher.stop(version, other)
    assert [c for c in api.calls if c[0] == "delete"] == [("delete", ours)] and ours not in api.jobs
    # A deleted Job is gone; a finished one too.
    assert pacer.launcher.gone(version, other)
    done = api.jobs[name]
    done["status"] = {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}
    assert pacer.launcher.gone(version, start)


def test_launch_k8s_refuses_a_fallback_it_could_not_place(
        lake_env: Any, store: Store, store_url: str, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from batchline.plan.planner import plan
    from tests.helpers import make_records
    from tests.integration.lake.test_object_inputs import jsonl, object_spec

    url = lake_env.bucket().put("in/tickets.jsonl", jsonl(make_records(5)))
    version = plan(object_spec(tmp_path, {"path": url}, deadline="6h", fallback={"workers": 2}), store).version
    argv = ["launch", "k8s", "--job", version, "--image", "img", "--queue", "spot", "--store-secret", "s", "--egress-cidr", "10.20.0.0/16",
            "--gpus-per-worker", "0", "--store", store_url]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert "has a fallback section, and these manifests could not start its paid workers: give --fallback-queue" \
        in err and len(err.splitlines()) == 1
    assert main([*argv, "--fallback-queue", "on-demand", "--out", str(tmp_path / "fleet.yaml")]) == 1
    assert "give --api-server-cidr" in capsys.readouterr().err
    argv = [*argv[:-2], "--api-server-cidr", "172.20.0.1/32", *argv[-2:]]
    assert main([*argv, "--fallback-queue", "on-demand", "--out", str(tmp_path / "fleet.yaml")]) == 0
    rendered = list(yaml.safe_load_all((tmp_path / "fleet.yaml").read_text()))
    assert any(o["kind"] == "Deployment" for o in rendered)
    assert main([*argv[:-2], "--fallback-toleration", "bad"]) == 1
    assert "go with --fallback-queue" in capsys.readouterr().err


def test_a_pacer_picture_is_read_from_the_store_alone(job_factory: Any, store: Store) -> None:
    version, _lease = behind(job_factory, store, workers=2)
    watching = Pacer.watching(store, version)
    assert watching is not None
    picture = watching.picture()
    assert picture is not None and picture.decision.mode in (Mode.BEHIND, Mode.SAFETY_NET)
    assert store.paid_slots(version) == []  # it started nothing


def test_a_paid_job_never_seen_is_deleted_at_once_and_started_again_and_finished_ones_go(
        job_factory: Any, store: Store) -> None:
    version, _lease = behind(job_factory, store, workers=1)
    api = FakeBatchApi()
    pacer = k8s_pacer(store, version, api)
    assert pacer.tick().started == ("paid-0",)  # type: ignore[union-attr]
    [first] = list(api.jobs)
    # Its Job's pod never came up (not admitted, or its node lost while it loaded): past the launch
    # timeout (three restart overheads of 1 s) the start is stale, its Job deleted without a grace
    # period, and the slot started again.
    store.shift_clock(4)
    store.worker_beat(version, "spot-1", every=60.0)
    report = pacer.tick()
    assert report is not None and report.started == ("paid-0",)
    assert ("delete at once", first) in api.calls and first not in api.jobs
    [second] = list(api.jobs)
    assert second.endswith("paid-0-g2")
    # The cluster removes a finished start's Job after a while by itself.
    assert api.jobs[second]["spec"]["ttlSecondsAfterFinished"] == 600
    # One that finished is deleted as soon as the pacer judges it gone.
    api.jobs[second]["status"] = {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}
    pacer.tick()
    assert ("delete at once", second) in api.calls and second not in api.jobs
