"""`batchline launch k8s`: the manifests parse as Kubernetes objects (with the
official client's models, which drop any field they do not know) and carry the
fields that make preemption take one worker and replace it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from batchline.errors import BatchlineError
from batchline.launch.k8s import Egress, K8sOptions, to_yaml
from batchline.launch.manifests import render

kubernetes = pytest.importorskip("kubernetes")

MODELS = {"PriorityClass": "V1PriorityClass", "ServiceAccount": "V1ServiceAccount", "Job": "V1Job",
          "Role": "V1Role", "RoleBinding": "V1RoleBinding", "NetworkPolicy": "V1NetworkPolicy",
          "ValidatingAdmissionPolicy": "V1ValidatingAdmissionPolicy",
          "ValidatingAdmissionPolicyBinding": "V1ValidatingAdmissionPolicyBinding"}


# Where the workers may connect besides DNS (the store's, the object store's and the catalog's network).
EGRESS = Egress(cidrs=("10.20.0.0/16",), api_server=("172.20.0.1/32",))


# What a GPU worker must state.
GPU_WORKER: dict[str, Any] = {"cpu": "8", "memory": "64Gi", "weights_cache_size": "40Gi"}


def parse(obj: dict[str, Any]) -> Any:
    client = kubernetes.client.ApiClient()
    model = client.deserialize(json.dumps(obj), MODELS[obj["kind"]], "application/json")
    # A misspelt or unknown field does not survive the round trip through the model.
    assert client.sanitize_for_serialization(model) == obj, f"{obj['kind']} has fields Kubernetes does not know"
    return model


def jobs_of(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == "Job"]


@pytest.fixture
def objects() -> list[dict[str, Any]]:
    options = K8sOptions(egress=EGRESS, version="ticket-triage@3f9a0c1d2e", workers=3, image="registry.example/batchline:1",
                         queue="batch-gpu", store_secret="batchline-store", grace_seconds=45, **GPU_WORKER)
    return list(yaml.safe_load_all(to_yaml(render(options))))


def test_every_manifest_parses_as_a_kubernetes_object(objects: list[dict[str, Any]]) -> None:
    assert [o["kind"] for o in objects] == ["PriorityClass", "ServiceAccount", "NetworkPolicy", "Job", "Job", "Job"]
    for obj in objects:
        parse(obj)


def test_one_single_pod_job_per_worker_so_kueue_preempts_one_at_a_time(objects: list[dict[str, Any]]) -> None:
    jobs = [parse(o) for o in objects if o["kind"] == "Job"]
    assert len({j.metadata.name for j in jobs}) == 3
    for job in jobs:
        assert job.metadata.labels["kueue.x-k8s.io/queue-name"] == "batch-gpu"
        assert (job.spec.parallelism, job.spec.completions, job.spec.suspend) == (1, 1, True)
        assert job.spec.completion_mode in (None, "NonIndexed")


def test_exit_75_is_replaced_not_finished_and_a_broken_job_fails_at_once(objects: list[dict[str, Any]]) -> None:
    job = parse(next(o for o in objects if o["kind"] == "Job"))
    assert job.spec.template.spec.restart_policy == "Never"
    assert job.spec.pod_replacement_policy == "Failed"
    rules = {(r.action, tuple(r.on_exit_codes.values) if r.on_exit_codes else None,
              tuple(c.type for c in r.on_pod_conditions or ())) for r in job.spec.pod_failure_policy.rules}
    assert ("Ignore", (75,), ()) in rules
    assert ("FailJob", (2, 3, 5, 7, 66, 73), ()) in rules
    assert ("Ignore", None, ("DisruptionTarget",)) in rules


def test_lowest_priority_that_never_preempts(objects: list[dict[str, Any]]) -> None:
    pc = parse(objects[0])
    assert pc.value < 0 and pc.preemption_policy == "Never" and not pc.global_default
    for obj in jobs_of(objects):
        assert parse(obj).spec.template.spec.priority_class_name == pc.metadata.name


def test_the_store_url_comes_from_a_secret_and_nowhere_else(objects: list[dict[str, Any]]) -> None:
    text = to_yaml(objects)
    assert "postgresql://" not in text
    pod = parse(jobs_of(objects)[0]).spec.template.spec
    [container] = pod.containers
    env = {e.name: e for e in container.env}
    ref = env["BATCHLINE_STORE"].value_from.secret_key_ref
    assert (ref.name, ref.key) == ("batchline-store", "url")
    assert container.args == ["worker", "--job", "ticket-triage@3f9a0c1d2e"]


def test_a_worker_holds_no_token_and_no_role_so_it_reads_no_other_pod(objects: list[dict[str, Any]]) -> None:
    # Regression: a worker's Role let it `get` every pod of the namespace (their specs, literal env
    # values included) to prove a lease owner gone; that proof is the pacer's now.
    assert not [o for o in objects if o["kind"] in ("Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding")]
    sa = parse(objects[1])
    pod = parse(jobs_of(objects)[0]).spec.template.spec
    assert sa.automount_service_account_token is False and pod.automount_service_account_token is False
    # It still says which pod it is, for the pacer's proof when its pod is gone.
    env = {e.name: e.value_from.field_ref.field_path for e in pod.containers[0].env
           if e.value_from is not None and e.value_from.field_ref is not None}
    assert env == {"BATCHLINE_POD_NAME": "metadata.name", "BATCHLINE_POD_NAMESPACE": "metadata.namespace",
                   "BATCHLINE_POD_UID": "metadata.uid"}


def test_a_worker_is_kept_away_from_the_rest_of_a_shared_node(objects: list[dict[str, Any]]) -> None:
    sa = parse(objects[1])
    pod = parse(jobs_of(objects)[0]).spec.template.spec
    assert pod.service_account_name == sa.metadata.name
    assert not (pod.host_network or pod.host_pid or pod.host_ipc) and pod.enable_service_links is False
    assert pod.security_context.run_as_non_root and pod.security_context.run_as_user != 0
    assert pod.security_context.seccomp_profile.type == "RuntimeDefault"
    [container] = pod.containers
    sc = container.security_context
    assert sc.allow_privilege_escalation is False and sc.privileged is False and sc.read_only_root_filesystem
    assert sc.capabilities.drop == ["ALL"]
    # The only volumes are the pod's own scratch space and weights cache: no host path, nothing shared.
    assert [(v.name, v.empty_dir is not None, v.host_path, v.persistent_volume_claim) for v in pod.volumes] == [
        ("scratch", True, None, None), ("weights-cache", True, None, None)]
    assert container.resources.limits["nvidia.com/gpu"] == "1"
    assert pod.termination_grace_period_seconds >= 45 + 10
    # Nor on the network: its version's NetworkPolicy selects it, lets nothing in, and lets it out to DNS
    # and the addresses it was given alone (tests/integration/fleet/test_k8s_isolation.py has the rest).
    [policy] = [parse(o) for o in objects if o["kind"] == "NetworkPolicy"]
    labels = jobs_of(objects)[0]["spec"]["template"]["metadata"]["labels"]
    assert all(labels[k] == v for k, v in policy.spec.pod_selector.match_labels.items())
    assert policy.spec.policy_types == ["Ingress", "Egress"] and not policy.spec.ingress
    blocks = [peer.ip_block.cidr for rule in policy.spec.egress for peer in rule.to if peer.ip_block]
    assert blocks[0] == "10.20.0.0/16" and set(blocks[1:]) <= {"169.254.169.254/32", "fd00:ec2::254/128"}


def test_bad_options_are_refused() -> None:
    with pytest.raises(BatchlineError, match="at least 1"):
        render(K8sOptions(egress=EGRESS, version="v@1", workers=0, image="i", queue="q", store_secret="s", gpus_per_worker=0))
    with pytest.raises(BatchlineError, match="aws, gcp or none"):
        render(K8sOptions(egress=EGRESS, version="v@1", workers=1, image="i", queue="q", store_secret="s",
                          preemption_notice="azure", gpus_per_worker=0))


def test_a_long_version_keeps_its_whole_hash_and_a_short_one_reads_as_before() -> None:
    def names(version: str) -> list[str]:
        objects = render(K8sOptions(egress=EGRESS, version=version, workers=2, image="i", queue="q", store_secret="s",
                                    gpus_per_worker=0))
        return [o["metadata"]["name"] for o in jobs_of(objects)] + [
            o["metadata"]["labels"]["batchline/job"] for o in jobs_of(objects)]

    first, second = ("customer-support-ticket-classification-v2@" + h
                     for h in ("0123456789abcdef", "0123456789abcdee"))
    for version in (first, second):
        for name in names(version):
            assert version.split("@")[1] in name and len(name) <= 63, name
    assert not set(names(first)) & set(names(second))
    assert names("ticket-triage@3f9a0c1d2e") == ["batchline-ticket-triage-3f9a0c1d2e-0",
                                                 "batchline-ticket-triage-3f9a0c1d2e-1",
                                                 "ticket-triage-3f9a0c1d2e", "ticket-triage-3f9a0c1d2e"]


def container_of(job: dict[str, Any]) -> Any:
    [container] = parse(job).spec.template.spec.containers
    return container


def test_a_gpu_worker_is_refused_cpu_demo_requests_and_told_what_to_state(
        capsys: pytest.CaptureFixture[str]) -> None:
    from batchline.cli import main

    base = ["launch", "k8s", "--job", "v@1", "--image", "i", "--queue", "q", "--store-secret", "s", "--egress-cidr", "10.20.0.0/16",
            "--gpus-per-worker", "1"]
    assert main(base) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err, err
    assert "state --cpu, --memory, --weights-cache-size" in err
    assert main([*base, "--cpu", "8"]) == 1
    err = capsys.readouterr().err
    assert "state --memory, --weights-cache-size" in err and "--cpu," not in err
    # Stated, they are what the pod gets; a worker without GPUs keeps the small defaults.
    gpu = container_of(jobs_of(render(K8sOptions(egress=EGRESS, version="v@1", workers=1, image="i", queue="q",
                                                 store_secret="s", **GPU_WORKER)))[0])
    assert (gpu.resources.requests["cpu"], gpu.resources.requests["memory"], gpu.resources.limits["memory"],
            gpu.resources.requests["nvidia.com/gpu"]) == ("8", "64Gi", "64Gi", "1")
    cpu = container_of(jobs_of(render(K8sOptions(egress=EGRESS, version="v@1", workers=1, image="i", queue="q",
                                                 store_secret="s", gpus_per_worker=0)))[0])
    assert (cpu.resources.requests["cpu"], cpu.resources.requests["memory"]) == ("1", "8Gi")
    assert "nvidia.com/gpu" not in cpu.resources.requests


def test_the_weights_cache_is_a_volume_of_its_own_sized_as_told_and_scratch_too(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kubernetes.utils import parse_quantity

    from batchline.digests import cache_dir

    job = jobs_of(render(K8sOptions(egress=EGRESS, version="v@1", workers=1, image="i", queue="q", store_secret="s",
                                    cpu="8", memory="64Gi", weights_cache_size="40Gi", scratch_size="2Gi")))[0]
    pod = parse(job).spec.template.spec
    container = container_of(job)
    sizes = {v.name: v.empty_dir.size_limit for v in pod.volumes}
    mounts = {m.name: m.mount_path for m in container.volume_mounts}
    assert sizes == {"scratch": "2Gi", "weights-cache": "40Gi"}
    assert mounts["scratch"] == "/tmp" and not mounts["weights-cache"].startswith("/tmp")
    # The worker keeps its weights where the volume is mounted.
    env = {e.name: e.value for e in container.env}
    monkeypatch.setenv("BATCHLINE_CACHE_DIR", env["BATCHLINE_CACHE_DIR"])
    assert str(cache_dir()) == mounts["weights-cache"]
    # The pod is placed on a node with the disk for both.
    assert parse_quantity(container.resources.requests["ephemeral-storage"]) >= parse_quantity("42Gi")
    with pytest.raises(BatchlineError, match="--scratch-size 'lots' is not a Kubernetes quantity"):
        render(K8sOptions(egress=EGRESS, version="v@1", workers=1, image="i", queue="q", store_secret="s", gpus_per_worker=0,
                          scratch_size="lots"))


def test_the_manifests_say_that_without_kueue_their_jobs_stay_suspended(tmp_path: Path) -> None:
    from batchline.cli import main

    out = tmp_path / "fleet.yaml"
    assert main(["launch", "k8s", "--job", "v@1", "--workers", "2", "--image", "i", "--queue", "batch",
                 "--store-secret", "s", "--egress-cidr", "10.20.0.0/16", "--gpus-per-worker", "0", "--out", str(out)]) == 0
    text = out.read_text()
    comment = " ".join(line.lstrip("# ") for line in text.splitlines() if line.startswith("#"))
    assert "Without Kueue" in comment and "stay suspended and no worker starts" in comment
    assert "LocalQueue 'batch'" in comment and "--kueue-sample" in comment
    assert "Kubernetes 1.29 or later" in comment and "Kueue 0.3 or later" in comment
    jobs = jobs_of(list(yaml.safe_load_all(text)))
    assert len(jobs) == 2 and all(j["spec"]["suspend"] is True for j in jobs)


@pytest.mark.parametrize("api", ["v1beta2", "v1beta1"])
@pytest.mark.parametrize("worker", [GPU_WORKER, {"gpus_per_worker": 0}], ids=["gpu", "cpu"])
def test_the_kueue_sample_admits_every_worker_of_the_fleet_it_was_rendered_for(
        api: str, worker: dict[str, Any]) -> None:
    from kubernetes.utils import parse_quantity

    objects = render(K8sOptions(egress=EGRESS, version="v@1", workers=5, image="i", queue="batch", namespace="jobs",
                                store_secret="s", kueue_sample=True, kueue_api=api, **worker))
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for obj in objects:
        by_kind.setdefault(obj["kind"], []).append(obj)
    assert {o["apiVersion"] for k in ("ResourceFlavor", "ClusterQueue", "LocalQueue") for o in by_kind[k]} == {
        f"kueue.x-k8s.io/{api}"}
    jobs = by_kind["Job"]
    [local] = [q for q in by_kind["LocalQueue"] if q["metadata"]["name"] == jobs[0]["metadata"]["labels"][
        "kueue.x-k8s.io/queue-name"] and q["metadata"]["namespace"] == jobs[0]["metadata"]["namespace"]]
    [cluster] = [c for c in by_kind["ClusterQueue"] if c["metadata"]["name"] == local["spec"]["clusterQueue"]]
    assert cluster["spec"]["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "jobs"}}
    [group] = cluster["spec"]["resourceGroups"]
    [flavor] = group["flavors"]
    assert flavor["name"] in {f["metadata"]["name"] for f in by_kind["ResourceFlavor"]}
    # Kueue's own rule: each flavor lists the covered resources, in their order.
    assert [r["name"] for r in flavor["resources"]] == group["coveredResources"]
    quota = {r["name"]: parse_quantity(r["nominalQuota"]) for r in flavor["resources"]}
    demand: dict[str, Any] = {}
    for job in jobs:
        for resource, amount in (container_of(job).resources.requests or {}).items():
            demand[resource] = demand.get(resource, 0) + parse_quantity(amount)
    # A resource the ClusterQueue does not cover keeps a workload from being admitted.
    assert set(demand) == set(group["coveredResources"])
    assert all(demand[r] <= quota[r] for r in demand), (demand, quota)
    assert ("nvidia.com/gpu" in demand) == bool(worker.get("cpu"))


def test_a_pool_per_region_runs_on_its_regions_nodes_named_apart_and_says_its_region() -> None:
    pools = {region: jobs_of(render(K8sOptions(egress=EGRESS, version="v@1", workers=2, image="i", queue="q",
                                                   store_secret="s", gpus_per_worker=0, region=region)))
             for region in ("us-east-1", "eu-west-1")}
    names = [job["metadata"]["name"] for jobs in pools.values() for job in jobs]
    assert len(set(names)) == 4
    for region, jobs in pools.items():
        for job in jobs:
            parse(job)
            pod = job["spec"]["template"]["spec"]
            assert pod["nodeSelector"]["topology.kubernetes.io/region"] == region
            args = pod["containers"][0]["args"]
            assert args[args.index("--region") + 1] == region
            assert job["spec"]["template"]["metadata"]["labels"]["batchline/region"] == region
