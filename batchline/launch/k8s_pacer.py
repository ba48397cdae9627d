"""Paid workers on Kubernetes: the pacer Deployment, its rights, and the paid worker Jobs it makes.

`launch k8s --fallback-queue Q ...` renders, beside the spot worker Jobs:

- **a pacer Deployment** (one replica, `strategy: Recreate`, so a rollout never
  runs two pacers at once for long; and were two to run, the store still starts
  each paid slot once): `batchline pace`, which reads the version's progress
  from the store every tick and keeps the paid slots at what the pacing rule
  wants (`batchline.launch.pacer`). It needs the store URL (the same Secret as the
  workers) and nothing of the cluster but `jobs`;
- **a ServiceAccount of the version's own** (`batchline-VERSION-pacer`, as every
  object a version owns is named: `batchline.launch.k8s.object_name`), so that each
  version's admission policy can tell its own pacer from another version's, **and a
  namespaced Role on `jobs`** (get, list,
  watch, create, delete) **and `get` on pods** (to prove a lease owner's pod gone
  and take its lease back, which the workers, holding no token, cannot; not with
  `--no-take-back`). RBAC cannot filter by label: the pacer itself touches only
  Jobs that carry this version's label and a paid slot's label (it lists by that
  selector and checks a Job's labels before it deletes it), and the admission
  policy `--cluster-objects` renders (`batchline.launch.k8s_isolation`) holds its
  token to that in the API server;
- **the paid worker Job template** (a ConfigMap): an ordinary worker Job of the
  version (the same image, Secret, security context, pod failure policy), in the
  paid LocalQueue (`--fallback-queue`), with the paid node selector, tolerations
  and priority class, which the pacer fills in for each start of a slot (its
  name `batchline-VERSION-paid-N-gG`, its `--paid-slot paid-N/G`). A Job that
  already exists is "already there" (409), never a second worker;
- with `--kueue-sample`, also an on-demand ResourceFlavor, ClusterQueue and the
  paid LocalQueue, with quota for `fallback.workers` paid workers.

A paid Job created and not admitted (a suspended Kueue workload) is reported as
"paid capacity not admitted" and costs nothing: its worker has not started, so
the store has not seen it. No cluster runs where batchline is tested: the
objects are checked through the official `kubernetes` client's models, and the
controller's decisions against a recording stand-in for the API server.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, replace
from typing import Any

from batchline.errors import BatchlineError
from batchline.launch import slug
from batchline.launch.k8s import (
    KUEUE_APIS,
    NAME_LIMIT,
    QUEUE_LABEL,
    SHARED_LABELS,
    K8sOptions,
    _job_spec,
    _labels,
    _notice_args,
    _scaled,
    object_name,
    resources,
)
from batchline.store.paid import PaidSlot

PACER = "pacer"
TEMPLATE_DIR = "/etc/batchline/paid"
TEMPLATE_KEY = "job.json"
SLOT_LABEL = "batchline/paid-slot"
GENERATION_LABEL = "batchline/paid-generation"
# The pacer's stop is the Job's deletion: its pod's grace period lets the worker finish.
TICK_SECONDS = 30.0
# How long the Job of a finished paid start stays for its logs before the cluster removes it.
PAID_JOB_TTL_SECONDS = 600


# What `paid_job` appends to the template's name (`-paid-N-gG`) fits in what the name leaves.
PAID_SUFFIX_ROOM = 13


def pacer_account(o: K8sOptions) -> str:
    """The version's pacer's ServiceAccount: its own, so that the API server tells one version's
    pacer from another's (the admission policy of each version matches only its own pacer)."""
    return object_name(o.version, PACER)


def paid_options(o: K8sOptions) -> K8sOptions:
    """The workers' options as the paid pool places them."""
    assert o.fallback is not None
    pool = o.fallback
    return replace(o, queue=pool.queue, node_selector=dict(pool.node_selector), tolerations=list(pool.tolerations),
                   priority_class=pool.priority_class or o.priority_class, fallback=None)


def paid_job_template(o: K8sOptions) -> dict[str, Any]:
    """A paid worker Job with the slot left out: `paid_job` fills it in for each start."""
    paid = paid_options(o)
    args = ["worker", "--job", o.version, *_notice_args(o)]
    # A finished start's Job (and its pod) is removed by the cluster after a while; the pacer
    # deletes one sooner when it judges the start gone or stale.
    spec = {**_job_spec(paid, 0, ["batchline"], args, [], [], []), "ttlSecondsAfterFinished": PAID_JOB_TTL_SECONDS}
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": object_name(o.version, limit=NAME_LIMIT - PAID_SUFFIX_ROOM), "namespace": o.namespace,
                     "labels": {**_labels(paid), QUEUE_LABEL: paid.queue}},
        "spec": spec,
    }


def paid_job(template: dict[str, Any], slot: str, generation: int) -> dict[str, Any]:
    """The Job of one start of a paid slot, from the template."""
    job = copy.deepcopy(template)
    name = f"{job['metadata']['name']}-{slot}-g{generation}"
    if len(name) > NAME_LIMIT:
        raise BatchlineError(f"paid Job name {name!r} is over {NAME_LIMIT} characters")
    labels = {**job["metadata"]["labels"], SLOT_LABEL: slot, GENERATION_LABEL: str(generation)}
    job["metadata"] = {**job["metadata"], "name": name, "labels": labels}
    pod = job["spec"]["template"]
    pod["metadata"]["labels"] = {**pod["metadata"]["labels"], SLOT_LABEL: slot, GENERATION_LABEL: str(generation)}
    pod["metadata"]["labels"].pop("batchline/worker", None)
    container = pod["spec"]["containers"][0]
    container["args"] = [*container["args"], "--paid-slot", f"{slot}/{generation}"]
    return job


def pacer_objects(o: K8sOptions) -> list[dict[str, Any]]:
    """The pacer's ServiceAccount, Role and RoleBinding, the paid Job template and the pacer
    Deployment (and with --kueue-sample, the on-demand queue)."""
    assert o.fallback is not None
    labels = {**_labels(o), "app.kubernetes.io/component": PACER}
    meta = {"namespace": o.namespace, "labels": labels}
    account = role = pacer_account(o)
    config = object_name(o.version, "paid")
    template = paid_job_template(o)
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": object_name(o.version, PACER), **meta},
        "spec": {
            "replicas": 1,
            # Never two pacers side by side in a rollout (and were two to run, the store starts each slot once).
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": {"batchline/job": labels["batchline/job"],
                                         "app.kubernetes.io/component": PACER}},
            "template": {"metadata": {"labels": labels}, "spec": {
                "serviceAccountName": account,
                "automountServiceAccountToken": True,
                "enableServiceLinks": False,
                "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532,
                                    "seccompProfile": {"type": "RuntimeDefault"}},
                "containers": [{
                    "name": "pacer", "image": o.image, "command": ["batchline"],
                    "args": ["pace", "--job", o.version, "--namespace", o.namespace,
                             "--template", f"{TEMPLATE_DIR}/{TEMPLATE_KEY}", *(["--take-back"] if o.take_back else [])],
                    "env": [{"name": "BATCHLINE_STORE",
                             "valueFrom": {"secretKeyRef": {"name": o.store_secret, "key": o.store_secret_key}}},
                            {"name": "PYTHONUNBUFFERED", "value": "1"}, {"name": "HOME", "value": "/tmp"}],
                    "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "512Mi"}},
                    "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                        "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}},
                    "volumeMounts": [{"name": "template", "mountPath": TEMPLATE_DIR, "readOnly": True},
                                     {"name": "scratch", "mountPath": "/tmp"}],
                }],
                "volumes": [{"name": "template", "configMap": {"name": config}},
                            {"name": "scratch", "emptyDir": {"sizeLimit": "64Mi"}}],
            }},
        },
    }
    out: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": account, **meta}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": role, **meta},
         "rules": [{"apiGroups": ["batch"], "resources": ["jobs"],
                    "verbs": ["get", "list", "watch", "create", "delete"]},
                   # To prove a lease owner's pod gone and take its lease back (the workers cannot).
                   *([{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}] if o.take_back else [])]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": role, **meta},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role},
         "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": o.namespace}]},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": config, **meta},
         "data": {TEMPLATE_KEY: json.dumps(template, indent=1, sort_keys=True)}},
        deployment,
    ]
    if o.kueue_sample:
        out = [*on_demand_queue(o), *out]
    return out


def on_demand_queue(o: K8sOptions) -> list[dict[str, Any]]:
    """A ResourceFlavor for the on-demand nodes, a ClusterQueue with quota for every paid
    worker at once, and the paid LocalQueue."""
    assert o.fallback is not None
    if o.kueue_api not in KUEUE_APIS:
        raise BatchlineError(f"--kueue-api must be {' or '.join(KUEUE_APIS)}, not {o.kueue_api!r}")
    if o.fallback.workers < 1:
        raise BatchlineError("--kueue-sample with a paid pool needs its size: --fallback-workers N (or --store, to "
                             "read the spec's fallback.workers)")
    api = f"kueue.x-k8s.io/{o.kueue_api}"
    name = f"batchline-{slug(o.fallback.queue, 40)}"
    requests = resources(o).requests(o.gpu_resource)
    flavor: dict[str, Any] = {"apiVersion": api, "kind": "ResourceFlavor", "metadata": {"name": name,
                                                                                         "labels": dict(SHARED_LABELS)}}
    if o.fallback.node_selector:
        flavor["spec"] = {"nodeLabels": dict(o.fallback.node_selector)}
    return [
        flavor,
        {"apiVersion": api, "kind": "ClusterQueue", "metadata": {"name": name, "labels": dict(SHARED_LABELS)},
         "spec": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": o.namespace}},
                  "queueingStrategy": "BestEffortFIFO",
                  "resourceGroups": [{"coveredResources": list(requests), "flavors": [{"name": name, "resources": [
                      {"name": resource, "nominalQuota": _scaled(amount, o.fallback.workers)}
                      for resource, amount in requests.items()]}]}]}},
        {"apiVersion": api, "kind": "LocalQueue",
         "metadata": {"name": o.fallback.queue, "namespace": o.namespace, "labels": dict(SHARED_LABELS)},
         "spec": {"clusterQueue": name}},
    ]


@dataclass
class K8sPaid:
    """The pacer's `PaidLauncher` on Kubernetes: a Job per start of a paid slot, created from the
    template, deleted to stop it (its pod's SIGTERM lets the worker finish and give its lease
    back). `batch` is the client's BatchV1Api (or what stands in for it in the tests)."""

    batch: Any
    namespace: str
    template: dict[str, Any]
    stop_seconds: float = 60.0

    def _selector(self) -> str:
        labels = self.template["metadata"]["labels"]
        return f"batchline/job={labels['batchline/job']},{SLOT_LABEL}"

    def _ours(self, job: Any) -> bool:
        labels = (job.metadata.labels or {}) if hasattr(job, "metadata") else job["metadata"].get("labels", {})
        return bool(labels.get("batchline/job") == self.template["metadata"]["labels"]["batchline/job"]
                    and SLOT_LABEL in labels)

    def start(self, version: str, slot: str, generation: int) -> None:
        from kubernetes.client.exceptions import ApiException

        body = paid_job(self.template, slot, generation)
        try:
            self.batch.create_namespaced_job(self.namespace, body)
        except ApiException as exc:
            if exc.status != 409:
                raise BatchlineError(f"cannot create paid Job {body['metadata']['name']}: {exc.reason}") from None
            # 409: it exists already (another pacer, or this one before a restart): already there.

    def _name(self, start: PaidSlot) -> str:
        return str(paid_job(self.template, start.slot, start.generation)["metadata"]["name"])

    def stop(self, version: str, start: PaidSlot, *, outright: bool = False) -> None:
        from kubernetes.client.exceptions import ApiException

        name = self._name(start)
        try:
            job = self.batch.read_namespaced_job(name, self.namespace)
            if not self._ours(job):
                return  # not a paid Job of this version: never touched
            self.batch.delete_namespaced_job(name, self.namespace, propagation_policy="Background",
                                             **({"grace_period_seconds": 0} if outright else {}))
        except ApiException as exc:
            if exc.status != 404:
                raise BatchlineError(f"cannot delete paid Job {name}: {exc.reason}") from None

    def gone(self, version: str, start: PaidSlot) -> bool:
        from kubernetes.client.exceptions import ApiException

        try:
            job = self.batch.read_namespaced_job(self._name(start), self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                return True
            raise BatchlineError(f"cannot read paid Job {self._name(start)}: {exc.reason}") from None
        status = job.status
        finished = bool(status and ((status.succeeded or 0) > 0 or any(
            c.type in ("Complete", "Failed") and c.status == "True" for c in (status.conditions or []))))
        return finished

    def listed(self) -> list[str]:
        """The paid Jobs of this version there are, by name (listed by this version's labels only)."""
        found = self.batch.list_namespaced_job(self.namespace, label_selector=self._selector())
        return sorted(j.metadata.name for j in found.items if self._ours(j))
