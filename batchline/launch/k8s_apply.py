"""The `kubernetes` launcher: the namespaced objects `batchline launch k8s` renders for a
version, applied through the official client in the connection's namespace.

Before anything is written it checks that the cluster-scoped objects the fleet relies on
exist (the priority class, the Kueue LocalQueue its Jobs are queued to), naming each one
missing: those are the cluster administrator's, never created by a task. Each namespaced
object (the workers' ServiceAccount, the NetworkPolicies, a Job per worker) is created; one
that exists already (a retry whose first try died before recording its launch) is left as
it is, so nothing is created twice: every name comes from the version, never from the try.
`stop` deletes the version's worker Jobs; their pods get SIGTERM and the workers give their
leases back (I5).

The client is configured from `kubeconfig` (and `context`) when given, else from the pod's
service account when run in a cluster, else from the default kubeconfig.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from batchline.errors import BatchlineError, SpecError
from batchline.launch.fleet import LaunchRequest

REQUIRED = ("image", "queue", "store_secret")
KINDS = ("ServiceAccount", "NetworkPolicy", "Job")  # the namespaced kinds a plain fleet renders


def _str_list(value: Any, name: str) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise SpecError(f"launcher kubernetes: option {name} must be a string or a list of strings")


def k8s_options(request: LaunchRequest) -> Any:
    """The `launch k8s` options of a request (refused in one line where one is missing or wrong)."""
    from batchline.launch.k8s import Egress, K8sOptions
    from batchline.launch.k8s_isolation import egress_cidr, egress_selector

    o = request.options
    missing = [name for name in REQUIRED if not o.get(name)]
    if missing:
        raise SpecError(f"launcher kubernetes: option {missing[0]} is required ({', '.join(REQUIRED)} are)")
    egress = Egress(tuple(egress_cidr(c, "egress_cidr") for c in _str_list(o.get("egress_cidr", []), "egress_cidr")),
                    tuple(egress_selector(s) for s in _str_list(o.get("egress_selector", []), "egress_selector")))
    given = {k: o[k] for k in ("namespace", "store_secret_key", "gpu_resource", "cpu", "memory", "weights_cache_size",
                               "priority_class", "service_account", "lake_secret", "kueue_api") if o.get(k) is not None}
    if "gpus_per_worker" in o:
        given["gpus_per_worker"] = int(o["gpus_per_worker"])
    return K8sOptions(version=request.version, workers=request.workers, image=str(o["image"]), queue=str(o["queue"]),
                      store_secret=str(o["store_secret"]), egress=egress, **given)


class K8sLauncher:
    name = "kubernetes"
    options: ClassVar[Mapping[str, str]] = {
        "namespace": "the namespace of the fleet's objects (default: default)",
        "image": "the worker image (required)",
        "queue": "the Kueue LocalQueue the worker Jobs are queued to (required; it must exist)",
        "store_secret": "the Secret holding the workers' store URL (required)",
        "store_secret_key": "its key (default: url)",
        "gpus_per_worker": "GPUs each worker asks for (default 1)",
        "gpu_resource": "the GPU's resource name (default nvidia.com/gpu)",
        "cpu": "each worker's CPU request", "memory": "each worker's memory request",
        "weights_cache_size": "each worker's weights cache (with GPUs: cpu, memory and this are required)",
        "priority_class": "the priority class the Jobs use (default batchline-batch; it must exist)",
        "service_account": "the workers' ServiceAccount (default: the version's own, batchline-VERSION-worker)",
        "lake_secret": "a Secret whose keys become the workers' environment (the lake's credentials)",
        "egress_cidr": "CIDRs the workers may connect to (the store, the object store)",
        "egress_selector": "namespace:K=V;pod:K=V selectors the workers may connect to",
        "kueue_api": "the kueue.x-k8s.io version (default v1beta2)",
        "kubeconfig": "a kubeconfig file (default: in-cluster, else ~/.kube/config)",
        "context": "the kubeconfig's context",
    }

    def _client(self, request: LaunchRequest) -> Any:
        from kubernetes import client, config

        kubeconfig = request.option("kubeconfig")
        configuration = client.Configuration()
        try:
            if kubeconfig is None:
                try:
                    config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
                except config.ConfigException:
                    config.load_kube_config(  # type: ignore[no-untyped-call]
                        context=request.option("context"), client_configuration=configuration)
            else:
                config.load_kube_config(  # type: ignore[no-untyped-call]
                    config_file=str(kubeconfig), context=request.option("context"), client_configuration=configuration)
        except (config.ConfigException, OSError) as exc:
            raise BatchlineError(f"launcher kubernetes: no cluster to reach: {' '.join(str(exc).split())}") from None
        return client.ApiClient(configuration)

    def _objects(self, request: LaunchRequest) -> list[dict[str, Any]]:
        from batchline.launch.manifests import render

        return render(k8s_options(request))

    def check(self, request: LaunchRequest) -> None:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        o = k8s_options(request)
        if request.deadline is not None:
            # A deadline is held by a pacer that buys paid workers; its paid queue and the admission
            # policy that lets only it start them are the cluster administrator's objects, which a
            # task never creates: refused, not a fleet that silently ignores the deadline.
            raise SpecError(f"launcher kubernetes: deadline {request.deadline!r} needs the version's pacer, which "
                            f"this launcher does not apply (its paid queue and admission policy are cluster objects): "
                            f"render it with `batchline launch k8s {request.version} --fallback-queue QUEUE`, have "
                            f"it applied, and launch without deadline; or launch with local or ray, which pace here")
        for obj in self._objects(request):
            if obj["metadata"].get("namespace") is None and obj["kind"] != "PriorityClass":
                raise SpecError(f"launcher kubernetes: the fleet needs cluster object {obj['kind']} "
                                f"{obj['metadata']['name']}, which a task does not create")
        api = self._client(request)
        missing = []
        try:
            try:
                client.SchedulingV1Api(api).read_priority_class(o.priority_class)
            except ApiException as exc:
                if exc.status != 404:
                    raise
                missing.append(f"PriorityClass {o.priority_class}")
            group, version = "kueue.x-k8s.io", o.kueue_api.rsplit("/", 1)[-1]
            try:
                client.CustomObjectsApi(api).get_namespaced_custom_object(group, version, o.namespace, "localqueues",
                                                                          o.queue)
            except ApiException as exc:
                if exc.status != 404:
                    raise
                missing.append(f"LocalQueue {o.namespace}/{o.queue}")
        except ApiException as exc:
            raise BatchlineError(f"launcher kubernetes: the API server refused a read: {exc.status} "
                                 f"{exc.reason}") from None
        finally:
            api.close()
        if missing:
            raise BatchlineError(f"launcher kubernetes: the cluster lacks {', '.join(missing)} (its administrator's "
                                 f"objects: `batchline launch k8s` renders them for review)")

    def launch(self, request: LaunchRequest) -> dict[str, Any]:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        o = k8s_options(request)
        api = self._client(request)
        creators: dict[str, Callable[..., Any]] = {"ServiceAccount": client.CoreV1Api(api).create_namespaced_service_account,
                    "NetworkPolicy": client.NetworkingV1Api(api).create_namespaced_network_policy,
                    "Job": client.BatchV1Api(api).create_namespaced_job}
        created: list[str] = []
        existing: list[str] = []
        try:
            for obj in self._objects(request):
                kind, name = obj["kind"], obj["metadata"]["name"]
                if obj["metadata"].get("namespace") is None:
                    continue  # cluster-scoped: checked, never created
                if kind not in creators:
                    raise BatchlineError(f"launcher kubernetes: {kind} {name} is not an object it applies")
                try:
                    creators[kind](o.namespace, obj)
                    created.append(f"{kind}/{name}")
                except ApiException as exc:
                    if exc.status != 409:
                        raise BatchlineError(f"launcher kubernetes: creating {kind} {o.namespace}/{name} was refused: "
                                             f"{exc.status} {exc.reason}") from None
                    existing.append(f"{kind}/{name}")
        finally:
            api.close()
        jobs = [n.split("/", 1)[1] for n in created + existing if n.startswith("Job/")]
        return {"namespace": o.namespace, "created": created, "existing": existing, "jobs": sorted(jobs)}

    def stop(self, request: LaunchRequest, detail: Mapping[str, Any]) -> None:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        api = self._client(request)
        try:
            batch = client.BatchV1Api(api)
            for name in detail.get("jobs") or ():
                try:
                    batch.delete_namespaced_job(name, str(detail["namespace"]), propagation_policy="Background")
                except ApiException as exc:
                    if exc.status != 404:
                        raise BatchlineError(f"launcher kubernetes: deleting Job {name} was refused: {exc.status} "
                                             f"{exc.reason}") from None
        finally:
            api.close()

    def running(self, request: LaunchRequest, detail: Mapping[str, Any]) -> bool | None:
        """Not asked yet: the Jobs' conditions would say, through the cluster's API. Until then
        a fleet with no worker counted is gone only after `fleet.UNASKED_GONE_SECONDS`."""
        return None


KUBERNETES = K8sLauncher()
