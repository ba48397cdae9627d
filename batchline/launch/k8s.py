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
  ignored the same way. Exit 2, 3, 5, 7, 66 or 73 (bad spec, input changed, engine
  or weights broken, the version halted on its dead letters, a version the store
  does not have, a staging prefix it cannot write) fails the Job at
  once: a replacement would only repeat it.
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
- **Leases of dead pods taken back by the pacer.** Each worker knows its pod
  (name, namespace and uid from the downward API) and tells the store when it
  claims; the pacer (with `--fallback-queue`) asks the API server whether a lease
  owner's pod is still there and takes back the lease of one that is gone instead
  of waiting for it to run out. Workers hold no token and have no Role: reading
  pods would show a worker every pod spec of the namespace. Without a pacer (or
  with `--no-take-back`), a lease whose pod died without its grace period runs out.
- **Isolated on the network** (`batchline.launch.k8s_isolation`): a NetworkPolicy
  per version lets worker pods accept nothing and reach DNS and what
  `--egress-cidr` and `--egress-selector` name; an admission policy
  (`--cluster-objects`) lets the pacer create only this version's paid workers.
- **Kept apart from the interactive engine on a shared node.** Its own
  ServiceAccount with no other rights on the API; a non-root user, no privilege escalation, every capability
  dropped, the runtime's seccomp profile, a read-only root filesystem; no
  host network, PID or IPC namespace, no hostPath and no shared volume (the
  only volumes are the pod's own `emptyDir`s: scratch for /tmp, and the
  weights cache); no service links. The input snapshot and the weights are
  read from where they live (object storage, or a read-only volume of the
  worker's own added by the operator), with the access `batchline grants`
  prints.
- **Object-store credentials from a Secret or the workload's identity.**
  `--lake-secret NAME` puts every key of a Secret into the worker's
  environment (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, or
  `GOOGLE_APPLICATION_CREDENTIALS` naming a file of it); with workload
  identity (EKS IRSA, GKE Workload Identity) there is no Secret: the
  ServiceAccount carries the annotation that binds it to a cloud role
  (`--service-account-annotation`), and the SDK finds the credentials.
- **Resources stated, not guessed, for a GPU worker.** What a GPU worker needs
  besides its GPUs (CPUs, memory, room for its weights) depends on the engine
  and the model, which the manifests cannot see: a vLLM worker of 16 GB of
  weights evicted from a 1 GiB scratch volume is the failure a default would
  invite. So a GPU worker's `--cpu`, `--memory` and `--weights-cache-size` are
  required; a worker without GPUs has the small defaults of the CPU image. The
  weights cache (`$BATCHLINE_CACHE_DIR`, where weights in object storage are
  fetched once and a packaged model is assembled) is a volume of its own, sized
  for the weights, apart from the scratch space for /tmp (`--scratch-size`),
  and the pod requests the ephemeral storage of both, so it is placed on a node
  with that much disk.
- **Kueue's own objects on request.** The Jobs are created suspended and only
  Kueue unsuspends them: without Kueue, or without the LocalQueue they name,
  they stay suspended and no worker starts (the manifests say so at the top).
  `--kueue-sample` also renders a ResourceFlavor, a ClusterQueue whose quota
  admits every worker of this fleet at once, and the LocalQueue, as a start
  for a cluster that has none.
- **A nightly schedule as one CronJob per worker slot** (`--schedule CRON
  --spec JOB.yaml`). The spec (and the prompt, schema and evaluation files it
  names, from a ConfigMap) is planned afresh at each scheduled time, so a glob
  over an object prefix or a table without a snapshot id takes the
  newest snapshot. Each slot's pod runs `batchline run` with one worker and
  the run's key, the scheduled minute (the suffix of the Job name the CronJob
  controller gives): the first slot to plan keys the version, and every other
  slot, or a slot's replacement after a preemption, runs that version even if
  the input moved on meanwhile. Slot 0 alone validates and publishes
  (`--publish`). `concurrencyPolicy: Forbid` keeps a run that overran its
  night from meeting the next one. One CronJob per slot, not one of N pods,
  for the reason above: Kueue admits and preempts each slot on its own.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field, replace
from decimal import Decimal
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from batchline.errors import BatchlineError, SpecError
from batchline.launch import FATAL_EXITS, slug
from batchline.worker.liveness import POD_ENV

EXIT_PREEMPTED = 75
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# Below the default priority (0) of every pod that names no class.
LOWEST_PRIORITY = -1_000_000
# Seconds between SIGKILL and the end of the grace period the worker was given:
# enough to write its last results and give the lease back.
TERMINATION_MARGIN_SECONDS = 30
NON_ROOT_UID = 65532
# The weights cache's mount: a volume of its own, apart from the scratch space for /tmp.
CACHE_DIR = "/var/cache/batchline"
# What a worker without GPUs gets unless told otherwise: enough for the CPU image's
# packaged model. A GPU worker's are not guessed (see `resources`).
CPU_WORKER_DEFAULTS = {"cpu": "1", "memory": "8Gi", "weights_cache_size": "4Gi"}
MINIMUM_KUBERNETES = "1.29"
MINIMUM_KUEUE = "0.3"
# The sample's objects use only fields both versions share; Kueue serves v1beta1 from 0.3 to
# 0.16 and v1beta2 from 0.15 on.
KUEUE_APIS = ("v1beta2", "v1beta1")


# What a worker pod may connect to (batchline.launch.k8s_isolation renders and checks it).
@dataclass(frozen=True)
class Peer:
    """`--egress-selector`: pods by their labels, in namespaces by theirs (either may be empty)."""

    namespace: tuple[tuple[str, str], ...] = ()
    pod: tuple[tuple[str, str], ...] = ()

    def to_peer(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.namespace:
            out["namespaceSelector"] = {"matchLabels": dict(self.namespace)}
        if self.pod:
            out["podSelector"] = {"matchLabels": dict(self.pod)}
        return out


@dataclass(frozen=True)
class Egress:
    """Where a worker pod may connect besides DNS; the pacer adds the API server."""

    cidrs: tuple[str, ...] = ()
    selectors: tuple[Peer, ...] = ()
    api_server: tuple[str, ...] = ()
    dns: Peer = field(default_factory=lambda: Peer((("kubernetes.io/metadata.name", "kube-system"),),
                                                   (("k8s-app", "kube-dns"),)))



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
    cpu: str | None = None  # None: CPU_WORKER_DEFAULTS without GPUs; a GPU worker's must be given
    memory: str | None = None
    weights_cache_size: str | None = None
    scratch_size: str = "1Gi"
    grace_seconds: float = 30.0
    priority_class: str = "batchline-batch"
    priority_value: int = LOWEST_PRIORITY
    service_account: str | None = None  # None: the version's own (`worker_account`)
    backoff_limit: int = 6
    preemption_notice: str = "none"  # aws | gcp | none: a cloud notice besides SIGTERM
    take_back: bool = True  # may ask the API server whether a lease owner's pod is gone
    extra_labels: dict[str, str] = field(default_factory=dict)
    lake_secret: str | None = None  # a Secret whose keys become the worker's environment
    service_account_annotations: dict[str, str] = field(default_factory=dict)  # workload identity
    schedule: Schedule | None = None  # a CronJob per slot instead of a Job per worker
    # A scheduled run's worker slots' Secret: a role for the job's name, which cannot plan or publish.
    worker_secret: str | None = None
    worker_secret_key: str = "url"
    kueue_sample: bool = False  # also a ResourceFlavor, ClusterQueue and LocalQueue that admit the fleet
    kueue_api: str = KUEUE_APIS[0]  # the sample's kueue.x-k8s.io version
    # Where the pods are placed besides the queue (a paid worker's on-demand nodes).
    node_selector: dict[str, str] = field(default_factory=dict)
    # The region this pool of workers runs in (`--region`): its workers read that region's replica
    # and claim its shards first, and are placed on its nodes (topology.kubernetes.io/region).
    region: str | None = None
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    # Paid workers a pacer Deployment buys while the job is behind (batchline.launch.k8s_pacer).
    fallback: PaidPool | None = None
    egress: Egress = field(default_factory=Egress)  # what a worker (and the pacer) may connect to


@dataclass(frozen=True)
class PaidPool:
    """`launch k8s --fallback-...`: where the pacer's paid worker Jobs go."""

    queue: str  # their LocalQueue (an on-demand ClusterQueue's)
    workers: int = 0  # the most at once, for --kueue-sample's quota (the spec's fallback.workers)
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    priority_class: str | None = None  # None: the workers' lowest one


@dataclass(frozen=True)
class Schedule:
    """A job planned afresh at each scheduled time from its spec and the files it names."""

    cron: str  # five fields, or @daily, @hourly ...
    job_name: str  # the spec's name
    files: dict[str, str]  # path relative to the spec's folder -> text; the spec first
    time_zone: str | None = None
    publish: bool = False
    starting_deadline_seconds: int = 3600
    grace_seconds: float = 30.0  # the spec's shards.grace_seconds


SPEC_DIR = "/etc/batchline/job"
CONTROL = "control"  # the component label of a scheduled run's control Job
# The Job name the CronJob controller gives ends in the scheduled minute, the same for
# every slot of one scheduled run: the run's key.
RUN_KEY = '"${BATCHLINE_SCHEDULED_JOB##*-}"'
CRON_MACROS = {"@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly"}


# The well-known node label of the region a node runs in.
REGION_NODE_LABEL = "topology.kubernetes.io/region"

# Every name rendered stays a DNS-1123 label (63): a Job's name becomes its pods' `job-name`
# label value and host name prefix, so it must, and the kinds named by a DNS subdomain
# (ServiceAccounts, Roles, ConfigMaps, NetworkPolicies, admission policies: 253) take it too.
NAME_LIMIT = 63
# The CronJob controller names each Job it starts `<cronjob>-<11 digits>`, within 63.
CRONJOB_NAME_LIMIT = 52
_PREFIX = "batchline-"
# The version's hash (16 hex digits) with the dash before it: what a cut name must keep.
_HASH_ROOM = 17


def object_name(version: str, role: str = "", limit: int = NAME_LIMIT) -> str:
    """`batchline-VERSION-ROLE` within `limit` characters: the one rule for the names of the
    objects a version owns. A long job name is cut, never the version's hash (or, for a
    scheduled job's name, which has none, a digest of it), so the objects of two versions in
    one namespace never share a name and applying one's never replaces the other's."""
    tail = f"-{role}" if role else ""
    room = limit - len(_PREFIX) - len(tail)
    if room < _HASH_ROOM:
        raise BatchlineError(f"the object name for {version!r} with {role!r} cannot keep the version's hash within "
                             f"{limit} characters")
    return f"{_PREFIX}{slug(version, room)}{tail}"


def worker_account(o: K8sOptions) -> str:
    """The workers' ServiceAccount: the version's own unless one is named, since its annotations
    (workload identity) bind it to the version's cloud role, which another version's must not
    replace while this one's pods run."""
    return o.service_account or object_name(o.version, "worker")


# The labels of an object every version shares by the name the operator gave it (the
# PriorityClass): no version's, so applying one version's leaves it as the others' had it.
SHARED_LABELS = {"app.kubernetes.io/name": "batchline-worker", "app.kubernetes.io/part-of": "batchline"}


def _labels(o: K8sOptions, index: int | None = None) -> dict[str, str]:
    labels = {**SHARED_LABELS, "batchline/job": slug(o.version, NAME_LIMIT), **o.extra_labels}
    if index is not None:
        labels["batchline/worker"] = str(index)
    if o.region is not None:
        labels["batchline/region"] = o.region
    return labels


def priority_class(o: K8sOptions) -> dict[str, Any]:
    return {
        "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
        "metadata": {"name": o.priority_class, "labels": dict(SHARED_LABELS)},
        "value": o.priority_value, "preemptionPolicy": "Never", "globalDefault": False,
        "description": "batchline workers: preempted first, never preempt anything",
    }


def service_account(o: K8sOptions) -> dict[str, Any]:
    # No rights on the API, and no token: a worker never talks to the API server.
    meta: dict[str, Any] = {"name": worker_account(o), "namespace": o.namespace, "labels": _labels(o)}
    if o.service_account_annotations:
        meta["annotations"] = dict(o.service_account_annotations)
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta, "automountServiceAccountToken": False}


_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)?$")
_UNITS: dict[str, int | Decimal] = {
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
    "m": Decimal("0.001"), "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}


def quantity(text: str, flag: str) -> Decimal:
    """A Kubernetes quantity (`8`, `500m`, `64Gi`) as a number, refused with its flag when it is none."""
    match = _QUANTITY.match(text)
    if match is None:
        raise BatchlineError(f"{flag} {text!r} is not a Kubernetes quantity (such as 8, 500m, 64Gi)")
    return Decimal(match.group(1)) * _UNITS.get(match.group(2) or "", 1)


def _scaled(text: str, times: int) -> str:
    """`text` times `times`, in the unit it was written in."""
    match = _QUANTITY.match(text)
    assert match is not None
    return f"{Decimal(match.group(1)) * times:f}{match.group(2) or ''}"


def _mebibytes(amount: Decimal) -> str:
    return f"{-(-amount // 2**20):f}Mi"


@dataclass(frozen=True)
class Resources:
    cpu: str
    memory: str
    weights_cache: str
    scratch: str
    gpus: int

    def requests(self, gpu_resource: str) -> dict[str, str]:
        """What the worker's container requests (quantities are strings in the API's schema)."""
        out = {"cpu": self.cpu, "memory": self.memory,
               # Both volumes are on the node's disk; a request places the pod where they fit.
               "ephemeral-storage": _mebibytes(quantity(self.scratch, "--scratch-size")
                                               + quantity(self.weights_cache, "--weights-cache-size"))}
        if self.gpus:
            out[gpu_resource] = str(self.gpus)
        return out


def resources(o: K8sOptions) -> Resources:
    """The worker's resources: as stated, else a CPU worker's defaults. A GPU worker's CPUs,
    memory and weights cache follow from its engine and model, which are not known here,
    so they are refused unless stated rather than left at a CPU demo's."""
    if o.gpus_per_worker < 0:
        raise BatchlineError(f"--gpus-per-worker cannot be negative, not {o.gpus_per_worker}")
    flags = {"cpu": "--cpu", "memory": "--memory", "weights_cache_size": "--weights-cache-size"}
    stated = {"cpu": o.cpu, "memory": o.memory, "weights_cache_size": o.weights_cache_size}
    missing = [flags[k] for k, v in stated.items() if v is None]
    if o.gpus_per_worker and missing:
        raise BatchlineError(
            f"a GPU worker's CPUs, memory and weights cache depend on its engine and model and are not guessed: "
            f"state {', '.join(missing)} (a vLLM worker of 16 GB of weights: --cpu 8 --memory 64Gi "
            f"--weights-cache-size 40Gi)")
    given = {k: v if v is not None else CPU_WORKER_DEFAULTS[k] for k, v in stated.items()}
    for key, value in given.items():
        quantity(value, flags[key])
    quantity(o.scratch_size, "--scratch-size")
    return Resources(cpu=given["cpu"], memory=given["memory"], weights_cache=given["weights_cache_size"],
                     scratch=o.scratch_size, gpus=o.gpus_per_worker)


def _downward(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _job_spec(o: K8sOptions, index: int | None, command: list[str], args: list[str],
              env: list[dict[str, Any]], mounts: list[dict[str, Any]], volumes: list[dict[str, Any]]) -> dict[str, Any]:
    res = resources(o)
    container_resources: dict[str, Any] = {"requests": res.requests(o.gpu_resource), "limits": {"memory": res.memory}}
    if res.gpus:
        container_resources["limits"][o.gpu_resource] = str(res.gpus)
    container: dict[str, Any] = {
        "name": "worker",
        "image": o.image,
        "command": command,
        "args": args,
        "env": [{"name": "BATCHLINE_STORE",
                 "valueFrom": {"secretKeyRef": {"name": o.store_secret, "key": o.store_secret_key}}},
                {"name": "PYTHONUNBUFFERED", "value": "1"},
                {"name": "HOME", "value": "/tmp"},
                {"name": "BATCHLINE_CACHE_DIR", "value": CACHE_DIR},
                # Who this worker is, for a take-back of its lease should its pod be gone.
                _downward(POD_ENV["pod"], "metadata.name"), _downward(POD_ENV["namespace"], "metadata.namespace"),
                _downward(POD_ENV["pod_uid"], "metadata.uid"), *env],
        "resources": container_resources,
        "securityContext": {
            "allowPrivilegeEscalation": False, "privileged": False, "readOnlyRootFilesystem": True,
            "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [{"name": "scratch", "mountPath": "/tmp"},
                         {"name": "weights-cache", "mountPath": CACHE_DIR}, *mounts],
    }
    if o.lake_secret:
        container["envFrom"] = [{"secretRef": {"name": o.lake_secret}}]
    pod_spec = {
        "restartPolicy": "Never",  # the Job replaces pods; required by a pod failure policy
        "priorityClassName": o.priority_class,
        "serviceAccountName": worker_account(o),
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "hostNetwork": False, "hostPID": False, "hostIPC": False,
        "terminationGracePeriodSeconds": int(o.grace_seconds) + TERMINATION_MARGIN_SECONDS,
        "securityContext": {"runAsNonRoot": True, "runAsUser": NON_ROOT_UID, "runAsGroup": NON_ROOT_UID,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": [{"name": "scratch", "emptyDir": {"sizeLimit": res.scratch}},
                    {"name": "weights-cache", "emptyDir": {"sizeLimit": res.weights_cache}}, *volumes],
    }
    if o.node_selector or o.region is not None:
        pod_spec["nodeSelector"] = {**o.node_selector,
                                    **({REGION_NODE_LABEL: o.region} if o.region is not None else {})}
    if o.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in o.tolerations]
    return {
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
    }


def _notice_args(o: K8sOptions) -> list[str]:
    return (["--preemption-notice", o.preemption_notice] if o.preemption_notice != "none" else []) + (
        ["--region", o.region] if o.region is not None else [])


def worker_job(o: K8sOptions, index: int) -> dict[str, Any]:
    args = ["worker", "--job", o.version, *_notice_args(o)]
    # A pool per region: each region's Jobs are named apart.
    name = object_name(o.version, f"{slug(o.region, 12) + '-' if o.region else ''}{index}")
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": name, "namespace": o.namespace,
                     "labels": {**_labels(o, index), QUEUE_LABEL: o.queue}},
        "spec": _job_spec(o, index, ["batchline"], args, [], [], []),
    }


def _config_key(path: str) -> str:
    return re.sub(r"[^-._a-zA-Z0-9]", "_", path)


def spec_config_map(o: K8sOptions) -> dict[str, Any]:
    assert o.schedule is not None
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": object_name(o.version, "spec"), "namespace": o.namespace,
                         "labels": _labels(o)},
            "data": {_config_key(path): text for path, text in o.schedule.files.items()}}


# How long a scheduled worker slot waits for the night's version to be planned (its plan starts
# with it): the planning of tens of millions of records takes minutes.
PLAN_WAIT_SECONDS = 3600
# The control Job plans, waits and publishes: no model, a planner's memory.
CONTROL_RESOURCES = {"cpu": "1", "memory": "2Gi", "weights_cache_size": "256Mi"}


def _cron(o: K8sOptions, name: str, labels: dict[str, str], job_spec: dict[str, Any], *,
          queued: bool = True) -> dict[str, Any]:
    sched = o.schedule
    assert sched is not None
    cron: dict[str, Any] = {
        "schedule": sched.cron,
        # A run that overran its night is not met by the next one; the next starts once it ends.
        "concurrencyPolicy": "Forbid",
        "startingDeadlineSeconds": sched.starting_deadline_seconds,
        "successfulJobsHistoryLimit": 3,
        "failedJobsHistoryLimit": 3,
        "jobTemplate": {"metadata": {"labels": {**labels, **({QUEUE_LABEL: o.queue} if queued else {})}},
                        "spec": job_spec},
    }
    if sched.time_zone:
        cron["timeZone"] = sched.time_zone
    return {"apiVersion": "batch/v1", "kind": "CronJob",
            "metadata": {"name": name, "namespace": o.namespace, "labels": labels}, "spec": cron}


def _keyed(words: list[str]) -> tuple[str, list[dict[str, Any]]]:
    """`words --plan-key KEY` as a shell line, the key the scheduled minute the shell takes from the
    Job's name (its environment, given here): every other word quoted."""
    line = "exec " + " ".join(shlex.quote(word) for word in words) + " --plan-key " + RUN_KEY
    return line, [_downward("BATCHLINE_SCHEDULED_JOB", "metadata.labels['batch.kubernetes.io/job-name']")]


def scheduled_control(o: K8sOptions) -> dict[str, Any]:
    """The control of a scheduled run, with the owner's Secret: at each scheduled time, plan the
    spec (or find the version planned for this time, should it start again), wait while the
    worker slots work it, and with --publish validate and publish it. It runs no worker."""
    sched = o.schedule
    assert sched is not None
    spec_file = next(iter(sched.files))
    run = ["batchline", "run", f"{SPEC_DIR}/{spec_file}", "--workers", "0", "--log-dir", "/tmp/batchline-logs",
           *(["--publish"] if sched.publish else [])]
    line, env = _keyed(run)
    config = spec_config_map(o)["metadata"]["name"]
    volume = {"name": "job-spec", "configMap": {
        "name": config, "items": [{"key": _config_key(path), "path": path} for path in sched.files]}}
    mount = {"name": "job-spec", "mountPath": SPEC_DIR, "readOnly": True}
    control = replace(o, gpus_per_worker=0, cpu=CONTROL_RESOURCES["cpu"], memory=CONTROL_RESOURCES["memory"],
                      weights_cache_size=CONTROL_RESOURCES["weights_cache_size"])
    job_spec = _job_spec(control, None, ["sh", "-c"], [line], env, [mount], [volume])
    labels = {**_labels(o), "app.kubernetes.io/component": CONTROL}
    job_spec["template"]["metadata"]["labels"] = labels
    # Not queued through Kueue: were the worker slots to hold the queue's quota while they wait for
    # the plan, a queued control could never start to make it.
    job_spec["suspend"] = False
    return _cron(o, object_name(o.version, CONTROL, CRONJOB_NAME_LIMIT), labels, job_spec, queued=False)


def scheduled_job(o: K8sOptions, index: int) -> dict[str, Any]:
    """Worker slot `index` of a scheduled run, with the worker's Secret (a role for the job's name,
    `batchline grants --name`): at each scheduled time, wait for the night's version to be
    planned, and work on it until it is done. It cannot plan or publish."""
    sched = o.schedule
    assert sched is not None
    if o.worker_secret is None:
        raise BatchlineError("a scheduled run's worker slots get a Secret of their own, which can work the job's "
                             "versions and not plan or publish them: give --worker-secret NAME (a store URL whose "
                             "role `batchline grants --name JOB` makes)")
    slot = replace(o, store_secret=o.worker_secret, store_secret_key=o.worker_secret_key)
    # The night's version is the one its control plans for this run's key, found in the store.
    words = ["batchline", "worker", "--name", sched.job_name, "--wait-for-work", str(PLAN_WAIT_SECONDS),
             *_notice_args(o)]
    line, env = _keyed(words)
    job_spec = _job_spec(slot, index, ["sh", "-c"], [line], env, [], [])
    return _cron(o, object_name(o.version, str(index), CRONJOB_NAME_LIMIT), _labels(o, index), job_spec)


def kueue_sample(o: K8sOptions) -> list[dict[str, Any]]:
    """A ResourceFlavor, a ClusterQueue with quota for every worker of this fleet at once (each
    resource a worker requests, times the workers), and the LocalQueue the Jobs name: a start
    for a cluster with no queue yet. A resource the ClusterQueue does not cover would keep
    the Jobs from being admitted, so it covers exactly what the workers request."""
    if o.kueue_api not in KUEUE_APIS:
        raise BatchlineError(f"--kueue-api must be {' or '.join(KUEUE_APIS)}, not {o.kueue_api!r}")
    api = f"kueue.x-k8s.io/{o.kueue_api}"
    name = f"batchline-{slug(o.queue, 40)}"
    requests = resources(o).requests(o.gpu_resource)
    # The queue's objects are named by the operator and shared by every version that uses it.
    labels = dict(SHARED_LABELS)
    return [
        {"apiVersion": api, "kind": "ResourceFlavor", "metadata": {"name": name, "labels": labels}},
        {"apiVersion": api, "kind": "ClusterQueue", "metadata": {"name": name, "labels": labels},
         "spec": {
             "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": o.namespace}},
             "queueingStrategy": "BestEffortFIFO",
             "resourceGroups": [{"coveredResources": list(requests), "flavors": [{"name": name, "resources": [
                 {"name": resource, "nominalQuota": _scaled(amount, o.workers)}
                 for resource, amount in requests.items()]}]}]}},
        {"apiVersion": api, "kind": "LocalQueue",
         "metadata": {"name": o.queue, "namespace": o.namespace, "labels": labels},
         "spec": {"clusterQueue": name}},
    ]


def header(o: K8sOptions) -> str:
    """The comment the manifests begin with: what they need, and what happens without it."""
    what = (f"scheduled runs of {o.schedule.job_name}" if o.schedule is not None
            else f"{o.workers} worker Job{'s' if o.workers != 1 else ''} for {o.version}")
    lines = [
        f"batchline launch k8s: {what}.",
        f"Needs Kubernetes {MINIMUM_KUBERNETES} or later (podReplacementPolicy, and podFailurePolicy rules "
        "on exit codes alone) and Kueue",
        f"{MINIMUM_KUEUE} or later (the {QUEUE_LABEL} label).",
        "The Jobs are created suspended: Kueue unsuspends each when it admits it. Without Kueue, or",
        f"without the LocalQueue {o.queue!r} in namespace {o.namespace!r}, they stay suspended and no worker starts"
        + (";" if not o.kueue_sample else "."),
    ]
    if not o.kueue_sample:
        lines.append("--kueue-sample renders a ResourceFlavor, ClusterQueue and LocalQueue that admit them.")
    return "".join(f"# {line}\n" for line in lines)


def check_cron(cron: str) -> None:
    fields = cron.split()
    if cron.strip() in CRON_MACROS or (len(fields) == 5 and all(re.fullmatch(r"[-*/,0-9A-Za-z?]+", f)
                                                                 for f in fields)):
        return
    raise BatchlineError(f"--schedule {cron!r} is not a cron schedule: five fields (minute hour day month "
                         f"weekday, such as '0 2 * * *') or one of {', '.join(sorted(CRON_MACROS))}")


def to_yaml(objects: list[dict[str, Any]]) -> str:
    return yaml.safe_dump_all(objects, sort_keys=False, default_flow_style=False)


# A ConfigMap holds at most 1 MiB; what is shipped in it stays well below.
CONFIG_MAP_LIMIT = 1_000_000


def pod_refusals(raw: dict[str, Any]) -> list[str]:
    """What in a raw spec pods elsewhere could not reach (`field: why`), as each source and
    target family, and the engine's registry line, say: files on this machine, catalogs
    only this machine reaches, weights that are a local file."""
    from batchline import sources, targets
    from batchline.registry import ENGINES

    out: list[str] = []
    inp = raw.get("input") or {}
    paths = inp.get("path")
    for location in [paths] if isinstance(paths, str) else (paths or []):
        refusal = sources.location_family(str(location)).location_refusal(str(location), "input.path")
        if refusal:
            out.append(f"input.path: {refusal}")
    for source_family in sources.families():
        refusal = source_family.pod_refusal(inp, "input")
        if refusal:
            out.append(refusal)
    for target_family in targets.families():
        refusal = target_family.pod_refusal(raw.get("output") or {}, "output")
        if refusal:
            out.append(refusal)
    model = raw.get("model") or {}
    model_path = model.get("path")
    entry = ENGINES.get(str(model.get("engine")))
    if model_path and not (entry is not None and entry.remote) and not str(model_path).startswith(("pkg:", "/")) \
            and not sources.is_remote(str(model_path)):
        out.append(f"model.path: {model_path} is a file on this machine; give an object URL with model.digest, "
                   "a pkg: model, or an absolute path inside the image")
    return out


def _judge_files(raw: dict[str, Any], folder: Path) -> list[tuple[str, Any]]:
    """The judge spec a scheduled job's gate names, and the files that spec names (relative
    to the judge spec's folder, which lies in the job spec's)."""
    judge = ((raw.get("validate") or {}).get("judge") or {}).get("spec")
    if not isinstance(judge, str):
        return []
    out: list[tuple[str, Any]] = [("validate.judge.spec", judge)]
    try:
        inner = yaml.safe_load((folder / judge).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return out  # refused when the spec is parsed, naming the file
    if not isinstance(inner, dict):
        return out
    at = PurePosixPath(judge).parent
    for where, name in (("prompt.file", (inner.get("prompt") or {}).get("file")),
                        ("prompt.examples.file", ((inner.get("prompt") or {}).get("examples") or {}).get("file")),
                        ("output.schema", (inner.get("output") or {}).get("schema"))):
        if isinstance(name, str):
            out.append((f"validate.judge.spec {where}", str(at / name)))
    return out


def scheduled_spec(path: Path) -> Schedule:
    """The spec of a scheduled job and the files it names, checked for what a pod can
    reach: the input in object storage or a table, weights by object URL, a
    `pkg:` model or a path inside the image, catalogs over the network. Nothing here
    reads the lake: globs and the newest snapshot are resolved by each scheduled plan."""
    from batchline.spec import parse_spec

    try:
        text = path.read_text(encoding="utf-8")
        raw = yaml.safe_load(text)
    except FileNotFoundError:
        raise SpecError(f"{path}: job spec not found") from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise SpecError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
    if not isinstance(raw, dict):
        raise SpecError(f"{path}: a job spec is a mapping")

    def refuse(field_name: str, why: str) -> SpecError:
        return SpecError(f"{path}: {field_name}: {why}")

    refusals = pod_refusals(raw)
    if refusals:
        raise SpecError(f"{path}: {refusals[0]}")

    named = [("prompt.file", (raw.get("prompt") or {}).get("file")),
             ("prompt.examples.file", ((raw.get("prompt") or {}).get("examples") or {}).get("file")),
             ("output.schema", (raw.get("output") or {}).get("schema")),
             ("validate.eval.labels", ((raw.get("validate") or {}).get("eval") or {}).get("labels")),
             ("validate.injection.instructions",
              ((raw.get("validate") or {}).get("injection") or {}).get("instructions")),
             *_judge_files(raw, path.parent)]
    files = {path.name: text}
    for where, name in named:
        if not isinstance(name, str):
            continue  # absent, or written inline
        relative = PurePosixPath(name)
        if relative.is_absolute() or ".." in relative.parts:
            raise refuse(where, f"{name} must lie in the spec's folder (it is shipped beside the spec)")
        try:
            files[str(relative)] = (path.parent / relative).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise refuse(where, f"cannot read {path.parent / relative} as UTF-8 text: {exc}") from None
    size = sum(len(t.encode()) for t in files.values())
    if size > CONFIG_MAP_LIMIT:
        raise SpecError(f"{path}: the spec and the files it names come to {size:,} bytes; a ConfigMap holds "
                        f"{CONFIG_MAP_LIMIT:,} (sample the evaluation labels, or put them in the image)")
    # Checks every field as planning will, without listing a glob (the pods do that; a
    # manifest in object storage is read once here).
    spec = parse_spec(raw, base_dir=path.parent, source=path, resolved=True)
    return Schedule(cron="", job_name=spec.name, files=files, grace_seconds=spec.shards.grace_seconds)
