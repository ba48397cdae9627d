"""Commands for running across machines: `launch ray`, `launch k8s`, `grants`."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from batchline.cli.common import (
    CommandTable,
    Subcommands,
    add_store_option,
    key_values,
    on_stop_signals,
)
from batchline.errors import BatchlineError, NoSuchVersion
from batchline.spec import stored_spec
from batchline.store import default_url, open_store

if TYPE_CHECKING:
    from batchline.launch.k8s import PaidPool
    from batchline.spec.deadline import Deadline, FallbackSpec
    from batchline.store import Store


COMMANDS = CommandTable()


@COMMANDS
def _launch(sub: Subcommands) -> None:
    launch = sub.add_parser("launch", help="place N workers on a cluster (Ray or Kubernetes)",
                            description="Place N workers on a cluster; all coordination stays in the store.")
    targets = launch.add_subparsers(dest="target", required=True, metavar="TARGET")
    _launch_ray(targets)
    _launch_k8s(targets)


def _launch_ray(targets: Subcommands) -> None:
    p = targets.add_parser("ray", help="run N worker loops on a Ray cluster, restarting lost ones",
                           description="Run N worker loops on a Ray cluster, one per GPU where GPUs exist; a "
                                       "worker whose actor or node died, or that exited 75, is replaced.")
    add_store_option(p)
    p.add_argument("--job", required=True, metavar="VERSION")
    p.add_argument("--workers", type=int, default=1, metavar="N")
    p.add_argument("--address", default="auto",
                   help="the Ray cluster ('auto': the one this machine belongs to; 'local': start one here)")
    p.add_argument("--gpus-per-worker", type=float, default=None, metavar="G",
                   help="default: 1 where the cluster has GPUs, else 0")
    p.add_argument("--cpus-per-worker", type=float, default=1.0, metavar="C")
    p.add_argument("--max-restarts", type=int, default=None, metavar="M")
    p.add_argument("--spot-resource", default=None, metavar="NAME",
                   help="place the workers on nodes offering this custom resource (such as spot)")
    p.add_argument("--paid-resource", default=None, metavar="NAME",
                   help="with the spec's fallback section: place the paid workers its pacer buys on nodes "
                        "offering this custom resource (such as on_demand)")
    p.add_argument("--deadline", default=None, metavar="TIME|WINDOW",
                   help="the deadline instead of the spec's: an ISO 8601 time, or a window such as 6h from the "
                        "version's first claim")
    p.add_argument("--region", default=None, metavar="REGION",
                   help="the region these workers run in (BATCHLINE_REGION in each actor): they read its replica of "
                        "the input and claim its shards first; with --spot-resource naming the region's nodes, "
                        "launch one per region")
    p.set_defaults(func=cmd_launch_ray)


def _launch_k8s(targets: Subcommands) -> None:
    p = targets.add_parser("k8s", help="print Kubernetes manifests for N workers queued through Kueue",
                           description="Print manifests for N workers queued through Kueue: one Job per worker "
                                       "at the lowest priority, the store URL from a Secret; with --schedule, one "
                                       "CronJob per worker slot that plans the spec's newest snapshot at each "
                                       "scheduled time and runs it.")
    add_store_option(p, "read the job's grace period from here and check the version exists "
                        "(the pods read the store URL from --store-secret, never from the manifest)")
    p.add_argument("--job", default=None, metavar="VERSION", help="a planned version to work on now")
    p.add_argument("--schedule", default=None, metavar="CRON",
                   help="plan and run --spec at each scheduled time instead (such as '0 2 * * *')")
    p.add_argument("--spec", type=Path, default=None, metavar="JOB.yaml",
                   help="with --schedule: the job spec, shipped with the files it names in a ConfigMap")
    p.add_argument("--time-zone", default=None, metavar="TZ", help="with --schedule: such as Europe/Berlin "
                                                                      "(default: the controller's, usually UTC)")
    p.add_argument("--publish", action="store_true",
                   help="with --schedule: validate each run when it is done and publish it if it passes")
    p.add_argument("--workers", type=int, default=1, metavar="N")
    p.add_argument("--image", required=True)
    p.add_argument("--queue", required=True, metavar="LOCALQUEUE", help="the Kueue LocalQueue to submit to")
    p.add_argument("--store-secret", required=True, metavar="NAME",
                   help="a Secret whose key (--store-secret-key) holds the store URL")
    p.add_argument("--store-secret-key", default="url", metavar="KEY")
    p.add_argument("--worker-secret", default=None, metavar="NAME",
                   help="with --schedule: the worker slots' Secret, a store URL whose role `batchline grants --name "
                        "JOB` makes (it can work the job's versions, not plan or publish them); --store-secret is "
                        "then the owner's, for the control Job that plans and publishes")
    p.add_argument("--worker-secret-key", default="url", metavar="KEY")
    p.add_argument("--namespace", default="default")
    p.add_argument("--gpus-per-worker", type=int, default=1, metavar="G")
    p.add_argument("--gpu-resource", default="nvidia.com/gpu")
    p.add_argument("--cpu", default=None, metavar="QUANTITY",
                   help="CPUs each worker requests (default 1 without GPUs; required with them, as are --memory "
                        "and --weights-cache-size: what a GPU worker needs depends on its engine and model)")
    p.add_argument("--memory", default=None, metavar="QUANTITY",
                   help="memory each worker requests and is limited to (default 8Gi without GPUs)")
    p.add_argument("--weights-cache-size", default=None, metavar="QUANTITY",
                   help="the weights cache's own volume, where weights in object storage are fetched: at least "
                        "the weights' size (default 4Gi without GPUs)")
    p.add_argument("--scratch-size", default="1Gi", metavar="QUANTITY",
                   help="the scratch volume for /tmp, the worker's HOME (default 1Gi)")
    p.add_argument("--kueue-sample", action="store_true",
                   help="also render a ResourceFlavor, a ClusterQueue with quota for every worker, and the "
                        "LocalQueue --queue, for a cluster without them")
    p.add_argument("--kueue-api", choices=("v1beta2", "v1beta1"), default="v1beta2",
                   help="the sample's API version: v1beta2 for Kueue 0.15 and later (default), v1beta1 for 0.3 "
                        "to 0.16")
    p.add_argument("--priority-class", default="batchline-batch")
    p.add_argument("--preemption-notice", choices=("none", "aws", "gcp"), default="none",
                   help="also watch the cloud's preemption notice (SIGTERM on eviction always works)")
    p.add_argument("--no-take-back", dest="take_back", action="store_false",
                   help="give the pacer no right to read pods: a dead pod's lease then runs out instead of being "
                        "taken back when the pacer finds the pod gone (workers never read pods)")
    p.add_argument("--egress-cidr", action="append", default=[], metavar="CIDR",
                   help="an address range workers may connect to (the store, the object store, the catalog); with "
                        "--egress-selector, at least one is required: the workers' NetworkPolicy allows DNS and "
                        "these alone")
    p.add_argument("--egress-selector", action="append", default=[], metavar="SELECTOR",
                   help="pods workers may connect to, by labels: namespace:KEY=VALUE,... and/or pod:KEY=VALUE,..., "
                        "separated by ';'")
    p.add_argument("--api-server-cidr", action="append", default=[], metavar="CIDR",
                   help="with --fallback-queue: the API server's addresses, which the pacer alone may reach "
                        "(kubectl get endpoints kubernetes)")
    p.add_argument("--cluster-objects", action="store_true",
                   help="print only the cluster-scoped objects, for whoever administers the cluster: the admission "
                        "policy that lets the pacer create only this version's paid workers")
    p.add_argument("--lake-secret", default=None, metavar="NAME",
                   help="a Secret whose keys (AWS_ACCESS_KEY_ID, ...) become the workers' environment, for the "
                        "object store")
    p.add_argument("--service-account-annotation", action="append", default=[], metavar="KEY=VALUE",
                   help="an annotation of the workers' ServiceAccount, binding it to a cloud role (workload "
                        "identity: eks.amazonaws.com/role-arn=..., iam.gke.io/gcp-service-account=...)")
    _paid_pool_options(p)
    p.add_argument("--region", default=None, metavar="REGION",
                   help="the region this pool of workers runs in: placed on its nodes (topology.kubernetes.io/"
                        "region), they read its replica of the input and claim its shards first; launch a pool per "
                        "region")
    p.add_argument("--out", type=Path, default=None, metavar="PATH", help="write here instead of stdout")
    p.set_defaults(func=cmd_launch_k8s)


def _paid_pool_options(p: argparse.ArgumentParser) -> None:
    f = p.add_argument_group("paid workers held to the job's deadline (the spec's fallback section), with --job")
    f.add_argument("--fallback-queue", default=None, metavar="LOCALQUEUE",
                   help="render a pacer Deployment that buys paid worker Jobs into this LocalQueue while the job is "
                        "behind its deadline")
    f.add_argument("--fallback-node-selector", action="append", default=[], metavar="KEY=VALUE",
                   help="a node label the paid workers' pods select (the on-demand nodes')")
    f.add_argument("--fallback-toleration", action="append", default=[], metavar="KEY[=VALUE]:EFFECT",
                   help="a taint the paid workers' pods tolerate (such as capacity=on-demand:NoSchedule)")
    f.add_argument("--fallback-priority-class", default=None, metavar="NAME",
                   help="the paid workers' PriorityClass (default: the workers' lowest one)")
    f.add_argument("--fallback-workers", type=int, default=None, metavar="N",
                   help="the paid pool's size for --kueue-sample's quota (default: the spec's fallback.workers, "
                        "read with --store)")


@COMMANDS
def _pace(sub: Subcommands) -> None:
    p = sub.add_parser("pace", help="hold a version's deadline with paid worker Jobs on Kubernetes (the pacer "
                                    "Deployment launch k8s --fallback-queue renders runs it)",
                       description="Every tick, read the version's progress from the store and keep its paid "
                                   "worker Jobs at what the pacing rule wants, until the version is done.")
    add_store_option(p)
    p.add_argument("--job", required=True, metavar="VERSION")
    p.add_argument("--namespace", required=True)
    p.add_argument("--template", type=Path, required=True, metavar="FILE",
                   help="the paid worker Job template (JSON) launch k8s rendered into its ConfigMap")
    p.add_argument("--tick-seconds", type=float, default=30.0, metavar="SECONDS", help="how often it decides")
    p.add_argument("--kubeconfig", default=None, metavar="FILE",
                   help="outside the cluster: a kubeconfig (default: the pod's own service account)")
    p.add_argument("--take-back", action="store_true",
                   help="each tick, take back the leases of workers whose pods the API server says are gone (needs "
                        "get on pods; the workers themselves hold no token)")
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve the pacer's gauges (committed and expected records, workers by kind, paid spend, "
                        "mode) as Prometheus metrics on this port (needs the metrics extra)")
    p.set_defaults(func=cmd_pace)


@COMMANDS
def _grants(sub: Subcommands) -> None:
    p = sub.add_parser("grants", help="a PostgreSQL role that can work one job version and nothing else",
                       description="Create (or print, with --dry-run) a worker role that can claim and renew "
                                   "the version's shards and insert its results, dead letters and events, and "
                                   "nothing else; print the access the worker needs outside the database.")
    p.add_argument("version", nargs="?", default=None, metavar="VERSION")
    p.add_argument("--name", default=None, metavar="NAME",
                   help="instead of one version: every version of this job's name, planned now or later (the "
                        "worker Secret of a scheduled run, whose version is planned each night)")
    add_store_option(p, "postgresql://... as the store's owner")
    p.add_argument("--role", default=None, metavar="NAME", help="default: derived from the version")
    p.add_argument("--password-env", default=None, metavar="VAR",
                   help="set the role's password from this environment variable")
    p.add_argument("--dry-run", action="store_true", help="print the SQL, change nothing")
    p.set_defaults(func=cmd_grants)


register = COMMANDS.register


def cmd_launch_ray(args: argparse.Namespace) -> int:
    from batchline.launch.ray import RayLauncher
    from batchline.worker.regions import worker_region

    url = args.store or default_url()
    store = open_store(url, create=False)
    try:
        _refuse_past_deadline(store, args.job)
    finally:
        store.close()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s launch %(message)s", stream=sys.stderr)
    log = logging.getLogger("batchline.launch")
    deadline = _deadline(args.deadline, store_url=url)
    launcher = RayLauncher(url, args.job, args.workers, address=args.address,
                           gpus_per_worker=args.gpus_per_worker, cpus_per_worker=args.cpus_per_worker,
                           max_restarts=args.max_restarts, log=log.info, spot_resource=args.spot_resource,
                           paid_resource=args.paid_resource, deadline=deadline, region=worker_region(args.region))

    def on_signal(name: str) -> None:
        log.info("received %s: stopping every worker", name)
        launcher.request_stop()

    on_stop_signals(on_signal)
    summary = launcher.run()
    log.info("done: exit %d, %d worker starts, %d restarts, %d actors lost", summary.exit_code, summary.starts,
             summary.restarts, summary.actor_deaths)
    return summary.exit_code


def cmd_launch_k8s(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from batchline.errors import SpecError
    from batchline.launch.k8s import (
        Egress,
        K8sOptions,
        Schedule,
        header,
        pod_refusals,
        scheduled_spec,
        to_yaml,
    )
    from batchline.launch.k8s_isolation import egress_cidr, egress_selector
    from batchline.launch.manifests import render, render_cluster_objects
    from batchline.worker.regions import worker_region

    if (args.job is None) == (args.schedule is None):
        raise BatchlineError("give --job VERSION (work on a planned version now) or --schedule CRON with --spec "
                             "JOB.yaml (plan and run at each scheduled time)")
    if (args.schedule is None) != (args.spec is None):
        raise BatchlineError("--schedule and --spec go together")
    if args.schedule is None and (args.time_zone or args.publish or args.worker_secret):
        raise BatchlineError("--time-zone, --publish and --worker-secret go with --schedule")
    annotations = key_values(args.service_account_annotation, "--service-account-annotation")
    grace = 30.0
    job_fallback = None
    schedule: Schedule | None = None
    if args.schedule is not None:
        schedule = replace(scheduled_spec(args.spec), cron=args.schedule, time_zone=args.time_zone,
                           publish=args.publish)
        grace = schedule.grace_seconds
    elif url := args.store or os.environ.get("BATCHLINE_STORE"):
        store = open_store(url, create=False)
        try:
            job = store.job(args.job)
            if job is None:
                raise NoSuchVersion(args.job, store.where())
            # What the pods could never read (a file on this machine) is refused as --schedule refuses it.
            refusals = pod_refusals(dict(job.spec))
            if refusals:
                raise SpecError(f"{args.job}: {refusals[0]}")
            _refuse_past_deadline(store, args.job)
        finally:
            store.close()
        stored = stored_spec(job)
        grace = stored.shards.grace_seconds
        job_fallback = stored.fallback
        if job_fallback is not None and args.fallback_queue is None:
            raise BatchlineError(f"{args.job} has a fallback section, and these manifests could not start its paid "
                                 "workers: give --fallback-queue LOCALQUEUE (the on-demand queue the pacer "
                                 "Deployment submits paid worker Jobs to)")
    pool = _paid_pool(args, job_fallback)
    options = K8sOptions(
        version=args.job or (schedule.job_name if schedule else ""), workers=args.workers, image=args.image,
        queue=args.queue, store_secret=args.store_secret, store_secret_key=args.store_secret_key,
        namespace=args.namespace, gpus_per_worker=args.gpus_per_worker, gpu_resource=args.gpu_resource, cpu=args.cpu,
        memory=args.memory, weights_cache_size=args.weights_cache_size, scratch_size=args.scratch_size,
        grace_seconds=grace, priority_class=args.priority_class,
        preemption_notice=args.preemption_notice, take_back=args.take_back, lake_secret=args.lake_secret,
        service_account_annotations=annotations, schedule=schedule, worker_secret=args.worker_secret,
        worker_secret_key=args.worker_secret_key, kueue_sample=args.kueue_sample,
        kueue_api=args.kueue_api, fallback=pool, region=worker_region(args.region),
        egress=Egress(tuple(egress_cidr(c) for c in args.egress_cidr),
                      tuple(egress_selector(s) for s in args.egress_selector),
                      tuple(egress_cidr(c, "--api-server-cidr") for c in args.api_server_cidr)))
    if args.cluster_objects:
        text = to_yaml(render_cluster_objects(options))
    else:
        text = header(options) + to_yaml(render(options))
    what = f"{args.workers} scheduled worker slots" if schedule else f"{args.workers} worker Jobs"
    if args.out:
        if args.out.is_dir():
            raise BatchlineError(f"--out {args.out} is a folder: the manifests are one file, so name it "
                                 f"(such as {args.out / 'fleet.yaml'})")
        try:
            args.out.write_text(text)
        except OSError as exc:
            raise BatchlineError(f"--out {args.out}: cannot write the manifests: {exc.strerror}") from None
        print(f"wrote {what} to {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def _refuse_past_deadline(store: Store, version: str) -> None:
    """A version whose spec's deadline is an absolute time already past is refused before any
    worker is placed (exit 2), as `run` refuses it."""
    from batchline.errors import SpecError
    from batchline.store import require_job

    spec = stored_spec(require_job(store, version))
    refusal = spec.deadline.refusal(store.now()) if spec.deadline is not None else None
    if refusal is not None:
        raise SpecError(f"{version}: {refusal}")


def _deadline(text: str | None, *, store_url: str) -> Deadline | None:
    """`--deadline` read as the spec's is; one already past is refused before anything starts."""
    from batchline.errors import SpecError
    from batchline.spec.deadline import parse_deadline

    if text is None:
        return None

    def refuse(where: str, why: str) -> NoReturn:
        raise SpecError(f"{where}: {why}")

    deadline = parse_deadline(text, "--deadline", refuse)
    assert deadline is not None
    store = open_store(store_url, create=False)
    try:
        refusal = deadline.refusal(store.now())
    finally:
        store.close()
    if refusal is not None:
        raise SpecError(refusal)
    return deadline


def _paid_pool(args: argparse.Namespace, fallback: FallbackSpec | None) -> PaidPool | None:
    from batchline.launch.k8s import PaidPool

    flags = (args.fallback_node_selector or args.fallback_toleration or args.fallback_priority_class
             or args.fallback_workers is not None)
    if args.fallback_queue is None:
        if flags:
            raise BatchlineError("the --fallback-... options go with --fallback-queue LOCALQUEUE")
        return None
    if args.schedule is not None:
        raise BatchlineError("--fallback-queue goes with --job: a scheduled run's pacer is not rendered yet")
    selector = key_values(args.fallback_node_selector, "--fallback-node-selector")
    tolerations = []
    for item in args.fallback_toleration:
        head, colon, effect = item.rpartition(":")
        key, eq, value = head.partition("=")
        if not colon or not key or effect not in ("NoSchedule", "PreferNoSchedule", "NoExecute"):
            raise BatchlineError(f"--fallback-toleration {item!r} must be KEY[=VALUE]:EFFECT, EFFECT one of "
                                 "NoSchedule, PreferNoSchedule, NoExecute")
        tolerations.append({"key": key, "operator": "Equal" if eq else "Exists", **({"value": value} if eq else {}),
                            "effect": effect})
    workers = args.fallback_workers if args.fallback_workers is not None else (fallback.workers if fallback else 0)
    if workers < 0:
        raise BatchlineError(f"--fallback-workers cannot be negative, not {workers}")
    return PaidPool(args.fallback_queue, workers, selector, tolerations, args.fallback_priority_class)


def cmd_pace(args: argparse.Namespace) -> int:
    import json
    import threading

    from batchline.launch.k8s_pacer import K8sPaid
    from batchline.launch.pacer import Pacer, pace_until_done

    try:
        template = json.loads(args.template.read_text())
    except (OSError, ValueError) as exc:
        raise BatchlineError(f"--template {args.template}: cannot read the paid Job template: {exc}") from None
    try:
        from kubernetes import client, config
    except ImportError:
        raise BatchlineError("batchline pace needs the kubernetes client: pip install 'batchline[fleet]'") from None
    if args.kubeconfig:
        config.load_kube_config(args.kubeconfig)  # type: ignore[no-untyped-call]
    else:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s pace %(message)s", stream=sys.stderr)
    log = logging.getLogger("batchline.pace")
    store = open_store(args.store or default_url(), create=False, wait_seconds=300, log=log.info)
    from batchline.store import require_job

    spec = stored_spec(require_job(store, args.job))
    launcher = K8sPaid(client.BatchV1Api(), args.namespace, template, stop_seconds=spec.shards.grace_seconds)
    take_back = None
    if args.take_back:
        from batchline.worker.liveness import kubernetes_pod_lookup, take_back_dead

        lookup = kubernetes_pod_lookup()
        take_back = (lambda: take_back_dead(store, args.job, "k8s-pacer", lookup=lookup)) if lookup else None
    pacer = Pacer(store, args.job, launcher, tick_seconds=args.tick_seconds, by="k8s-pacer", spec=spec, log=log.info,
                  take_back=take_back)
    stopping = threading.Event()

    def on_signal(name: str) -> None:
        log.info("received %s: stopping; the paid workers go on until the next pacer", name)
        stopping.set()

    on_stop_signals(on_signal)
    if args.metrics_port is None:
        return pace_until_done(pacer, stopping.wait, log.info)
    from batchline.ops.metrics import PaceMetrics

    metrics = PaceMetrics(args.job)
    metrics.serve(args.metrics_port)
    return pace_until_done(pacer, stopping.wait, log.info, metrics.observe)


def cmd_grants(args: argparse.Namespace) -> int:
    from batchline.ops.grants import grant

    plan = grant(args.store or default_url(), args.version, name=args.name, role=args.role, dry_run=args.dry_run,
                 password_env=args.password_env)
    print(f"-- {'would run' if args.dry_run else 'ran'}, for role {plan.role} on {plan.version}:")
    for statement in plan.statements:
        print(statement + ";")
    print("-- outside the database, the worker needs:")
    for line in plan.access:
        print(f"--   {line}")
    verb = "would get" if args.dry_run else "has"
    print(f"role {plan.role} {verb} the rights of a worker on {plan.version} only", file=sys.stderr)
    return 0
