"""`batchline launch k8s`: manifests for N workers queued through Kueue.

Which objects, and why:

- **One Job per worker, not one Job of N pods.** Kueue admits and evicts a
  Job as one workload: an Indexed Job (or any Job) with parallelism N needs
  quota for all N pods at once, and when Kueue preempts it to make room, it
  suspends the whole Job, so every worker stops at once. N Jobs of one pod
  each are N workloads: Kueue admits them one by one as quota frees up, and
  preemption takes one worker, not the fleet. A Deployment would not do
  either: its pods restart on exit 0, so a worker that found no work left
  would be started again forever.
- **A pod failure policy that replaces a preempted worker.** A worker that
  is stopped early (SIGTERM from an eviction or node drain, or a cloud
  preemption notice) finishes what it can within its grace period, gives its
  lease back and exits 75. The rule `onExitCodes 75 -> Ignore` makes the Job
  replace that pod without counting it against `backoffLimit`, and without
  counting it as the Job's completion (only exit 0, "no work left", completes
  a Job). Pods that get the `DisruptionTarget` condition (evicted,
  preempted by the scheduler, lost with their node before exiting) are
  ignored the same way. Exit 2, 3 or 5 (bad spec, input changed, engine or
  weights broken) fails the Job at once: a replacement would only repeat it.
  Any other crash is retried up to `backoffLimit`. `podReplacementPolicy:
  Failed` starts the replacement only once the old pod is gone, so two
  workers of one slot never hold a GPU together.
- **The lowest priority.** A PriorityClass with a value below every default
  (negative) and `preemptionPolicy: Never`: the scheduler evicts these pods
  first whenever an interactive pod needs the node, and they never evict
  anything themselves. Kueue takes the workload's priority from it too, so
  within a ClusterQueue or cohort the batch workloads are preempted first.
- **Credentials from a Secret.** The store URL (with its password) comes from
  a Secret key as `BATCHLINE_STORE`; it is never in the manifest or on the
  command line. Make it with `kubectl create secret generic NAME
  --from-literal=url=postgresql://...`, ideally with a role from `batchline
  grants`, which can touch this job version only.
- **Leases of dead pods taken back at once.** Each worker knows its pod
  (name, namespace and uid from the downward API) and tells the store when it
  claims; an idle worker asks the API server whether a lease owner's pod is
  still there and takes back the lease of one that is gone instead of waiting
  for it to run out. For that the worker's ServiceAccount has one Role: `get`
  on `pods` in its own namespace, nothing else (no list, no watch, no other
  resource), and its token is mounted. `--no-take-back` renders no Role and
  mounts no token: dead workers' leases then run out.
- **Kept apart from the interactive engine on a shared node.** Its own
  ServiceAccount with no other rights on the API; a non-root user, no privilege escalation, every capability
  dropped, the runtime's seccomp profile, a read-only root filesystem; no
  host network, PID or IPC namespace, no hostPath and no shared volume (the
  only volume is the pod's own scratch `emptyDir` for /tmp); no service
  links. The input snapshot and the weights are read from where they live
  (object storage, or a read-only volume of the worker's own added by the
  operator), with the access `batchline grants` prints.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

from batchline.errors import BatchlineError
from batchline.launch import FATAL_EXITS, slug
from batchline.liveness import POD_ENV

EXIT_PREEMPTED = 75
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# Below the default priority (0) of every pod that names no class.
LOWEST_PRIORITY = -1_000_000
# Seconds between SIGKILL and the end of the grace period the worker was given:
# enough to write its last results and give the lease back.
TERMINATION_MARGIN_SECONDS = 30
NON_ROOT_UID = 65532


@dataclass
class K8sOptions:
    version: str
    workers: int
    image: str
    queue: str
    store_secret: str
    store_secret_key: str = "url"
    namespace: str = "default"
    gpus_per_worker: int = 1
    gpu_resource: str = "nvidia.com/gpu"
    cpu: str = "1"
    memory: str = "8Gi"
    grace_seconds: float = 30.0
    priority_class: str = "batchline-batch"
    priority_value: int = LOWEST_PRIORITY
    service_account: str = "batchline-worker"
    backoff_limit: int = 6
    preemption_notice: str = "none"  # aws | gcp | none: a cloud notice besides SIGTERM
    take_back: bool = True  # may ask the API server whether a lease owner's pod is gone
    extra_labels: dict[str, str] = field(default_factory=dict)


def _labels(o: K8sOptions, index: int | None = None) -> dict[str, str]:
    labels = {"app.kubernetes.io/name": "batchline-worker", "app.kubernetes.io/part-of": "batchline",
              "batchline/job": slug(o.version, 63), **o.extra_labels}
    if index is not None:
        labels["batchline/worker"] = str(index)
    return labels


def priority_class(o: K8sOptions) -> dict[str, Any]:
    return {
        "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
        "metadata": {"name": o.priority_class, "labels": _labels(o)},
        "value": o.priority_value, "preemptionPolicy": "Never", "globalDefault": False,
        "description": "batchline workers: preempted first, never preempt anything",
    }


def service_account(o: K8sOptions) -> dict[str, Any]:
    # No rights on the API but the Role below (with take-back), so no token without it.
    return {"apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": {"name": o.service_account, "namespace": o.namespace, "labels": _labels(o)},
            "automountServiceAccountToken": o.take_back}


def pod_reader_role(o: K8sOptions) -> list[dict[str, Any]]:
    """`get` on pods of its own namespace: enough to prove a lease owner's pod gone, nothing more."""
    name = f"{o.service_account}-pod-reader"
    meta = {"name": name, "namespace": o.namespace, "labels": _labels(o)}
    return [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta,
         "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta,
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": o.service_account, "namespace": o.namespace}]},
    ]


def _downward(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def worker_job(o: K8sOptions, index: int) -> dict[str, Any]:
    resources: dict[str, Any] = {"requests": {"cpu": o.cpu, "memory": o.memory}, "limits": {"memory": o.memory}}
    if o.gpus_per_worker:
        # Quantities are strings in the API's schema.
        resources["requests"][o.gpu_resource] = str(o.gpus_per_worker)
        resources["limits"][o.gpu_resource] = str(o.gpus_per_worker)
    args = ["worker", "--job", o.version]
    if o.preemption_notice != "none":
        args += ["--preemption-notice", o.preemption_notice]
    container = {
        "name": "worker",
        "image": o.image,
        "command": ["batchline"],
        "args": args,
        "env": [{"name": "BATCHLINE_STORE",
                 "valueFrom": {"secretKeyRef": {"name": o.store_secret, "key": o.store_secret_key}}},
                {"name": "PYTHONUNBUFFERED", "value": "1"},
                {"name": "HOME", "value": "/tmp"},
                # Who this worker is, for a take-back of its lease should its pod be gone.
                _downward(POD_ENV["pod"], "metadata.name"), _downward(POD_ENV["namespace"], "metadata.namespace"),
                _downward(POD_ENV["pod_uid"], "metadata.uid")],
        "resources": resources,
        "securityContext": {
            "allowPrivilegeEscalation": False, "privileged": False, "readOnlyRootFilesystem": True,
            "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [{"name": "scratch", "mountPath": "/tmp"}],
    }
    pod_spec = {
        "restartPolicy": "Never",  # the Job replaces pods; required by a pod failure policy
        "priorityClassName": o.priority_class,
        "serviceAccountName": o.service_account,
        "automountServiceAccountToken": o.take_back,
        "enableServiceLinks": False,
        "hostNetwork": False, "hostPID": False, "hostIPC": False,
        "terminationGracePeriodSeconds": int(o.grace_seconds) + TERMINATION_MARGIN_SECONDS,
        "securityContext": {"runAsNonRoot": True, "runAsUser": NON_ROOT_UID, "runAsGroup": NON_ROOT_UID,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": [{"name": "scratch", "emptyDir": {"sizeLimit": "1Gi"}}],
    }
    name = f"batchline-{slug(o.version, 40)}-{index}"
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": name, "namespace": o.namespace,
                     "labels": {**_labels(o, index), QUEUE_LABEL: o.queue}},
        "spec": {
            # Created suspended: Kueue unsuspends it when it admits the workload.
            "suspend": True,
            "parallelism": 1,
            "completions": 1,
            "backoffLimit": o.backoff_limit,
            "podReplacementPolicy": "Failed",
            "podFailurePolicy": {"rules": [
                {"action": "FailJob",
                 "onExitCodes": {"containerName": "worker", "operator": "In", "values": sorted(FATAL_EXITS)}},
                {"action": "Ignore",
                 "onExitCodes": {"containerName": "worker", "operator": "In", "values": [EXIT_PREEMPTED]}},
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            ]},
            "template": {"metadata": {"labels": _labels(o, index)}, "spec": pod_spec},
        },
    }


def render(o: K8sOptions) -> list[dict[str, Any]]:
    if o.workers < 1:
        raise BatchlineError("--workers must be at least 1")
    if o.preemption_notice not in ("none", "aws", "gcp"):
        raise BatchlineError(f"--preemption-notice must be aws, gcp or none, not {o.preemption_notice!r}")
    return [priority_class(o), service_account(o), *(pod_reader_role(o) if o.take_back else []),
            *(worker_job(o, i) for i in range(o.workers))]


def to_yaml(objects: list[dict[str, Any]]) -> str:
    return yaml.safe_dump_all(objects, sort_keys=False, default_flow_style=False)
