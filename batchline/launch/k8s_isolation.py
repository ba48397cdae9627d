"""What a worker pod may reach, and what the pacer may create, on Kubernetes.

A worker is the least trusted part of a deployment: it runs on shared or preemptible nodes
and reads customer text written to steer models. `launch k8s` renders, beside its workers:

- **A NetworkPolicy per version** for its worker pods (the spot workers' and the paid
  ones'): no ingress at all; egress to DNS and to what `--egress-cidr` and
  `--egress-selector` name (the store, the object store, the catalog: a NetworkPolicy takes
  CIDRs and label selectors, not host names, and the store URL is in a Secret the renderer
  never reads), refused when neither is given. The link-local range (169.254.0.0/16,
  fe80::/10) is cut out of every CIDR; the cloud's instance identity endpoint
  (169.254.169.254, and fd00:ec2::254 on AWS) is allowed only where the workers use the
  machine's identity for the lake (no `--lake-secret`). So a worker cannot reach the
  interactive engine's endpoints, the cluster's log stores, the API server or the node's
  metadata service.
- **A NetworkPolicy for the pacer**: the workers' egress and the API server
  (`--api-server-cidr`, required with a pacer: what `kubectl get endpoints kubernetes`
  lists).
- **An admission policy for the pacer's Jobs** (`--cluster-objects`, for whoever
  administers the cluster: a ValidatingAdmissionPolicy and its binding are cluster-scoped,
  as Kueue's sample objects are), one per version: for requests by this version's pacer's
  own ServiceAccount (no other version's pacer matches it), a Job is
  admitted only when it is one of this version's paid workers as the template makes them:
  its labels, image, command, ServiceAccount (token unmounted), Secrets, volumes (the pod's
  own emptyDirs only) and pod security; and the pacer deletes only this version's paid Jobs.
  Its Role on `jobs` cannot say so (RBAC does not filter by label): without the policy the
  pacer's token could create any pod in the namespace.

Every object a version owns is named by `batchline.launch.k8s.object_name` (a long job name
is cut, the version's hash kept), so two versions in one namespace never replace each other's
policies, Roles or Jobs.

Workers hold no token and have no Role: the take-back of a dead pod's lease (proof from the
API server that its pod is gone) is the pacer's, whose Role adds `get` on pods. Without a
pacer, a lease whose pod died without its grace period runs out (`shards.lease_seconds`).
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any

from batchline.errors import BatchlineError
from batchline.launch.k8s import (
    CONTROL,
    QUEUE_LABEL,
    Egress,
    K8sOptions,
    Peer,
    _labels,
    object_name,
)
from batchline.launch.k8s_pacer import PACER, SLOT_LABEL, pacer_account, paid_job_template

# The link-local ranges: the node's metadata service and the cloud's other host endpoints live there.
LINK_LOCAL = (ipaddress.ip_network("169.254.0.0/16"), ipaddress.ip_network("fe80::/10"))
# The instance identity endpoint (AWS, GCP and Azure; AWS's IPv6 one): the machine's credentials.
INSTANCE_IDENTITY = ("169.254.169.254/32", "fd00:ec2::254/128")
DNS_PORTS = [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]
API_SERVER_PORTS = [{"protocol": "TCP", "port": 443}, {"protocol": "TCP", "port": 6443}]
_LABEL = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")


def egress_cidr(text: str, flag: str = "--egress-cidr") -> str:
    """A CIDR as written, refused in one line when it is none or lies in the link-local range."""
    try:
        net = ipaddress.ip_network(text.strip(), strict=True)
    except ValueError as exc:
        raise BatchlineError(f"{flag} {text!r} is not a CIDR (such as 10.20.0.0/16): {exc}") from None
    if text != text.strip():
        raise BatchlineError(f"{flag} {text!r} has spaces around it")
    for local in LINK_LOCAL:
        if net.version == local.version and net.subnet_of(local):  # type: ignore[arg-type]
            raise BatchlineError(f"{flag} {text}: the link-local range ({local}) is never reachable from a worker "
                                 "(the node's metadata service lives there)")
    return str(net)


def egress_selector(text: str) -> Peer:
    """`namespace:KEY=VALUE,...;pod:KEY=VALUE,...` (either part alone) as a Peer."""
    parts: dict[str, tuple[tuple[str, str], ...]] = {}
    for part in text.split(";"):
        kind, colon, labels = part.partition(":")
        if not colon or kind not in ("namespace", "pod") or kind in parts:
            raise BatchlineError(f"--egress-selector {text!r} must be namespace:KEY=VALUE,... and/or "
                                 "pod:KEY=VALUE,..., separated by ';' (such as "
                                 "namespace:kubernetes.io/metadata.name=db;pod:app=postgres)")
        pairs = []
        for item in labels.split(","):
            key, eq, value = item.partition("=")
            if not eq or not _LABEL.fullmatch(key) or len(key.rsplit("/", 1)[-1]) > 63 or not _VALUE.fullmatch(value) \
                    or len(value) > 63:
                raise BatchlineError(f"--egress-selector {text!r}: {item!r} is not a label KEY=VALUE")
            pairs.append((key, value))
        parts[kind] = tuple(pairs)
    return Peer(parts.get("namespace", ()), parts.get("pod", ()))


def ip_block(cidr: str) -> dict[str, Any]:
    """The CIDR as a NetworkPolicy peer, the link-local range cut out of it."""
    net = ipaddress.ip_network(cidr)
    cut = [str(local) for local in LINK_LOCAL if net.version == local.version and local.subnet_of(net)]  # type: ignore[arg-type]
    return {"ipBlock": {"cidr": cidr, **({"except": cut} if cut else {})}}


def _rules(egress: Egress, machine_identity: bool) -> list[dict[str, Any]]:
    rules: list[dict[str, Any]] = [{"to": [egress.dns.to_peer()], "ports": DNS_PORTS}]
    peers = [ip_block(c) for c in egress.cidrs] + [s.to_peer() for s in egress.selectors]
    if peers:
        rules.append({"to": peers})
    if machine_identity:
        rules.append({"to": [{"ipBlock": {"cidr": c}} for c in INSTANCE_IDENTITY]})
    return rules


def network_policies(o: K8sOptions) -> list[dict[str, Any]]:
    """The workers' NetworkPolicy (every pod of this version's workers, paid ones included), and
    with a pacer, the pacer's; with a schedule, its control's."""
    egress: Egress = o.egress
    if not egress.cidrs and not egress.selectors:
        raise BatchlineError("the workers' NetworkPolicy lets them reach DNS and what --egress-cidr and "
                             "--egress-selector name, and nothing else: give the store's, the object store's and "
                             "the catalog's addresses (a NetworkPolicy takes CIDRs and label selectors, not host "
                             "names)")
    labels = _labels(o)
    job = labels["batchline/job"]
    identity = o.lake_secret is None
    meta = {"namespace": o.namespace, "labels": labels}
    workers: dict[str, Any] = {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": object_name(o.version, "workers"), **meta},
        "spec": {
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "batchline-worker", "batchline/job": job},
                            "matchExpressions": [{"key": "app.kubernetes.io/component", "operator": "DoesNotExist"}]},
            # No ingress rule: nothing connects to a worker.
            "policyTypes": ["Ingress", "Egress"],
            "egress": _rules(egress, identity),
        },
    }
    out = [workers]
    if o.schedule is not None:
        # A scheduled run's control (plans, validates, publishes) reaches what the workers reach.
        out.append({**workers, "metadata": {"name": object_name(o.version, CONTROL), **meta},
                    "spec": {**workers["spec"], "podSelector": {"matchLabels": {
                        "batchline/job": job, "app.kubernetes.io/component": CONTROL}}}})
    if o.fallback is None:
        return out
    if not egress.api_server:
        raise BatchlineError("the pacer reaches the API server to start and stop paid worker Jobs: give "
                             "--api-server-cidr (the addresses `kubectl get endpoints kubernetes` lists)")
    pacer: dict[str, Any] = {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": object_name(o.version, PACER), **meta},
        "spec": {
            "podSelector": {"matchLabels": {"batchline/job": job, "app.kubernetes.io/component": PACER}},
            "policyTypes": ["Ingress", "Egress"],
            "egress": [*_rules(egress, identity),
                       {"to": [ip_block(c) for c in egress.api_server], "ports": API_SERVER_PORTS}],
        },
    }
    return [*out, pacer]


# --- the pacer's admission policy -------------------------------------------------------------


def _quoted(text: str) -> str:
    """A CEL string literal."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _listed(items: list[str]) -> str:
    """A CEL list of string literals."""
    return "[" + ", ".join(_quoted(i) for i in items) + "]"


def paid_job_rules(o: K8sOptions, template: dict[str, Any]) -> list[tuple[str, str]]:
    """The CEL rules a Job the pacer creates must meet, each with the message a refusal says:
    what the paid worker template (`template`) makes, and nothing else."""
    labels = template["metadata"]["labels"]
    pod = template["spec"]["template"]["spec"]
    [container] = pod["containers"]
    job, queue = _quoted(labels["batchline/job"]), _quoted(labels[QUEUE_LABEL])
    secrets = sorted({e["valueFrom"]["secretKeyRef"]["name"] for e in container["env"]
                      if "secretKeyRef" in e.get("valueFrom", {})})
    lake = [f["secretRef"]["name"] for f in container.get("envFrom", [])]
    spec = "object.spec.template.spec"
    c_sc = "c.securityContext"
    not_delete = "request.operation == 'DELETE' || "
    rules = [
        (f"has(object.metadata.labels) && 'batchline/job' in object.metadata.labels && "
         f"object.metadata.labels['batchline/job'] == {job} && {_quoted(SLOT_LABEL)} in object.metadata.labels && "
         f"{_quoted(QUEUE_LABEL)} in object.metadata.labels && object.metadata.labels[{_quoted(QUEUE_LABEL)}] == "
         f"{queue}", "a paid worker Job carries this version's labels, a paid slot's, and the paid LocalQueue's"),
        ("has(object.spec.template.metadata.labels) && 'batchline/job' in object.spec.template.metadata.labels && "
         f"object.spec.template.metadata.labels['batchline/job'] == {job}", "its pods carry this version's label"),
        (f"has({spec}.serviceAccountName) && {spec}.serviceAccountName == {_quoted(pod['serviceAccountName'])} && "
         f"has({spec}.automountServiceAccountToken) && {spec}.automountServiceAccountToken == false",
         "its pods run as the workers' ServiceAccount, with no token mounted"),
        (f"size({spec}.containers) == 1 && !has({spec}.initContainers) && !has({spec}.ephemeralContainers) && "
         f"{spec}.containers.all(c, c.image == {_quoted(container['image'])} && c.command == ['batchline'] && "
         f"size(c.args) >= 3 && c.args[0] == 'worker' && c.args[1] == '--job' && c.args[2] == {_quoted(o.version)})",
         "its one container is the worker image running this version's worker"),
        (f"{spec}.containers.all(c, (!has(c.env) || c.env.all(e, !has(e.valueFrom) || "
         f"!has(e.valueFrom.secretKeyRef) || e.valueFrom.secretKeyRef.name in {_listed(secrets)})) && "
         f"(!has(c.envFrom) || c.envFrom.all(f, has(f.secretRef) && f.secretRef.name in {_listed(lake)})))",
         "it reads only the workers' store and lake Secrets"),
        (f"!has({spec}.volumes) || {spec}.volumes.all(v, has(v.emptyDir))",
         "its only volumes are the pod's own emptyDirs (no hostPath, no claim, no Secret or ConfigMap)"),
        (f"!has({spec}.nodeName) && !(has({spec}.hostNetwork) && {spec}.hostNetwork) && "
         f"!(has({spec}.hostPID) && {spec}.hostPID) && !(has({spec}.hostIPC) && {spec}.hostIPC)",
         "it shares no namespace of the node and is placed by the scheduler"),
        (f"has({spec}.securityContext) && has({spec}.securityContext.runAsNonRoot) && "
         f"{spec}.securityContext.runAsNonRoot == true && has({spec}.securityContext.seccompProfile) && "
         f"{spec}.securityContext.seccompProfile.type == 'RuntimeDefault' && {spec}.containers.all(c, "
         f"has({c_sc}) && (!has({c_sc}.privileged) || {c_sc}.privileged == false) && "
         f"has({c_sc}.allowPrivilegeEscalation) && {c_sc}.allowPrivilegeEscalation == false && "
         f"has({c_sc}.capabilities) && has({c_sc}.capabilities.drop) && 'ALL' in {c_sc}.capabilities.drop && "
         f"!has({c_sc}.capabilities.add) && (!has(c.ports) || c.ports.all(p, !has(p.hostPort))))",
         "its pod meets the restricted Pod Security profile as the worker template does"),
    ]
    out = [(not_delete + f"({expression})", message) for expression, message in rules]
    out.append((f"request.operation != 'DELETE' || (has(oldObject.metadata.labels) && "
                f"'batchline/job' in oldObject.metadata.labels && oldObject.metadata.labels['batchline/job'] == {job} "
                f"&& {_quoted(SLOT_LABEL)} in oldObject.metadata.labels)",
                "the pacer deletes only this version's paid worker Jobs"))
    return out


def pacer_username(o: K8sOptions) -> str:
    """The user name the API server gives requests made with the version's pacer's token."""
    return f"system:serviceaccount:{o.namespace}:{pacer_account(o)}"


def admission_policy(o: K8sOptions) -> list[dict[str, Any]]:
    """The ValidatingAdmissionPolicy that admits, for this version's pacer, only this version's
    paid worker Jobs, and its binding (cluster-scoped both).

    One policy per version, matched only by that version's pacer. The API server evaluates
    every policy whose binding and match conditions match a request, each on its own, and
    refuses the request when any of them refuses it: so a policy must never apply to another
    version's requests, or last night's (still bound, or simply left behind) would refuse
    tonight's paid Jobs. Each version's pacer runs as a ServiceAccount of its own, and the
    policy's match condition is that account's user name: a request by another version's
    pacer skips the policy (a false match condition skips it, whatever the other conditions),
    and is held by its own version's policy instead. A policy left from before the pacers had
    accounts of their own matches the old shared account, which no pacer rendered now runs as.
    One shared policy with a params object per version (paramKind) would still need each
    version's pacer to have an account of its own to tell the requests apart, and its params
    would have to carry all of the version's template (image, Secrets, queue): one more
    object per version to keep in step, for nothing the per-version policy lacks."""
    if o.fallback is None:
        raise BatchlineError("--cluster-objects renders the admission policy for the pacer's paid worker Jobs: give "
                             "--fallback-queue (a version without a pacer needs no cluster object of batchline's)")
    labels = _labels(o)
    name = object_name(o.version, "paid-jobs")
    pacer = pacer_username(o)
    rules = paid_job_rules(o, paid_job_template(o))
    return [
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
         "metadata": {"name": name, "labels": labels},
         "spec": {
             "failurePolicy": "Fail",
             "matchConstraints": {"resourceRules": [{"apiGroups": ["batch"], "apiVersions": ["v1"],
                                                     "operations": ["CREATE", "UPDATE", "DELETE"],
                                                     "resources": ["jobs"]}]},
             "matchConditions": [{"name": "by-this-versions-pacer",
                                  "expression": f"request.userInfo.username == {_quoted(pacer)}"}],
             "validations": [{"expression": expression, "message": message} for expression, message in rules],
         }},
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
         "metadata": {"name": name, "labels": labels},
         "spec": {"policyName": name, "validationActions": ["Deny"],
                  "matchResources": {"namespaceSelector": {
                      "matchLabels": {"kubernetes.io/metadata.name": o.namespace}}}}},
    ]
