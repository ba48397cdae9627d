"""Launching a version's fleet once per task (batchline.launch.fleet), on both stores: the
kubernetes launcher against a recording stand-in for the API server (the official client
over HTTP, through a kubeconfig), and the local launcher's detached runner."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from batchline.errors import BatchlineError, SpecError
from batchline.launch.fleet import LaunchRequest, launch_once, stop_launched
from batchline.launch.k8s_apply import k8s_options
from batchline.launch.manifests import render
from batchline.store import Store
from tests.fakes.k8s_api import StandInApi, stand_in_api
from tests.helpers import call_counts, planned, wait_for

KEY = "airflow:nightly/triage/scheduled__2026-12-06T01:00:00+00:00/-1"
PRIORITY = "/apis/scheduling.k8s.io/v1/priorityclasses/batchline-batch"
QUEUE = "/apis/kueue.x-k8s.io/v1beta2/namespaces/batch/localqueues/gpu-spot"


def k8s_request(version: str, api: StandInApi, folder: Path, **options: Any) -> LaunchRequest:
    return LaunchRequest(version=version, spec="job.yaml", key=KEY, plan_key=KEY, store_url="unused", workers=3,
                         options={"namespace": "batch", "image": "registry.example/batchline:1", "queue": "gpu-spot",
                                  "store_secret": "batchline-store", "egress_cidr": ["10.20.0.0/16"],
                                  "cpu": "8", "memory": "64Gi", "weights_cache_size": "40Gi",
                                  "kubeconfig": str(api.kubeconfig(folder)), **options})


def with_cluster_objects(api: StandInApi) -> None:
    api.objects[PRIORITY] = {"kind": "PriorityClass", "metadata": {"name": "batchline-batch"}}
    api.objects[QUEUE] = {"kind": "LocalQueue", "metadata": {"name": "gpu-spot", "namespace": "batch"}}


@pytest.fixture
def cluster(job_factory: Any, store: Store, tmp_path: Path) -> Iterator[tuple[StandInApi, LaunchRequest]]:
    """A planned version, the stand-in API server with the cluster's own objects, and the request."""
    _spec, version = planned(job_factory(n=40), store)
    with stand_in_api() as api:
        with_cluster_objects(api)
        yield api, k8s_request(version, api, tmp_path)


def test_the_kubernetes_launcher_sends_the_rendered_objects_once_and_a_retry_sends_none(
        cluster: tuple[StandInApi, LaunchRequest], store: Store) -> None:
    api, request = cluster
    first = launch_once(store, request, "kubernetes", by="test")
    rendered = [o for o in render(k8s_options(request)) if o["metadata"].get("namespace")]
    assert first.launched_now and api.posted() == rendered
    assert [o["kind"] for o in rendered].count("Job") == 3
    assert {r.path for r in api.of("GET")} == {PRIORITY, QUEUE}
    assert first.record.detail is not None and sorted(first.record.detail["jobs"]) == sorted(
        o["metadata"]["name"] for o in rendered if o["kind"] == "Job")

    sent = len(api.requests)
    again = launch_once(store, request, "kubernetes", by="test")
    assert not again.launched_now and len(api.of("POST")) == len(rendered)
    assert all(r.method == "GET" for r in api.requests[sent:])  # only the checks, before the record is read


def test_an_orphaned_intent_is_launched_again_and_finds_every_object_there_creating_nothing_twice(
        cluster: tuple[StandInApi, LaunchRequest], store: Store) -> None:
    api, request = cluster
    version = request.version
    from batchline.launch.fleet import launcher

    launcher("kubernetes").launch(request)  # the first try launched, then died before recording it
    store.launch_intent(version, KEY, "kubernetes", "test")
    objects = dict(api.objects)
    retried = launch_once(store, request, "kubernetes", by="test")
    assert retried.launched_now and retried.record.state == "launched"
    assert retried.record.detail is not None and retried.record.detail["created"] == []
    assert len(retried.record.detail["existing"]) == len([o for o in render(k8s_options(request))
                                                          if o["metadata"].get("namespace")])
    assert api.objects == objects  # every object once


def test_missing_cluster_objects_are_named_and_nothing_is_sent_or_recorded(
        job_factory: Any, store: Store, tmp_path: Path) -> None:
    _spec, version = planned(job_factory(n=40), store)
    with stand_in_api() as api:
        request = k8s_request(version, api, tmp_path)
        with pytest.raises(BatchlineError, match=r"lacks PriorityClass batchline-batch, LocalQueue batch/gpu-spot"):
            launch_once(store, request, "kubernetes", by="test")
        assert api.of("POST") == [] and store.launches(version) == []


def test_a_kubernetes_option_missing_or_misspelt_is_refused_before_the_cluster_is_reached(
        job_factory: Any, store: Store, tmp_path: Path) -> None:
    _spec, version = planned(job_factory(n=40), store)
    with stand_in_api() as api:
        with_cluster_objects(api)
        request = k8s_request(version, api, tmp_path, imgae="typo")
        with pytest.raises(SpecError, match="option 'imgae' is not one it takes"):
            launch_once(store, request, "kubernetes", by="test")
        no_image = k8s_request(version, api, tmp_path)
        no_image = LaunchRequest(**{**no_image.__dict__, "options": {
            k: v for k, v in no_image.options.items() if k != "image"}})
        with pytest.raises(SpecError, match="option image is required"):
            launch_once(store, no_image, "kubernetes", by="test")
        assert api.requests == [] and store.launches(version) == []


def test_a_deadline_with_the_kubernetes_launcher_is_refused_naming_the_pacer_before_the_cluster_is_reached(
        cluster: tuple[StandInApi, LaunchRequest], store: Store) -> None:
    api, request = cluster
    paced = LaunchRequest(**{**request.__dict__, "deadline": "06:00"})
    with pytest.raises(SpecError, match=r"^launcher kubernetes: deadline '06:00' needs the version's pacer, which this "
                                        r"launcher does not apply .*--fallback-queue QUEUE"):
        launch_once(store, paced, "kubernetes", by="test")
    assert api.requests == [] and store.launches(request.version) == []


def test_stopping_a_kubernetes_launch_deletes_its_worker_jobs_and_records_the_stop(
        cluster: tuple[StandInApi, LaunchRequest], store: Store) -> None:
    api, request = cluster
    launched = launch_once(store, request, "kubernetes", by="test")
    stopped = stop_launched(store, request, "the Airflow task was killed")
    assert stopped is not None and stopped.state == "stopped"
    assert assert_detail(launched.record.detail)
    deleted = sorted(r.path.rsplit("/", 1)[1] for r in api.of("DELETE"))
    assert deleted == sorted(launched.record.detail["jobs"])  # type: ignore[index]
    assert all("/apis/batch/v1/namespaces/batch/jobs/" in r.path for r in api.of("DELETE"))


def assert_detail(detail: Any) -> bool:
    return isinstance(detail, dict) and detail["namespace"] == "batch" and len(detail["jobs"]) == 3


def test_the_local_launcher_runs_the_version_detached_and_a_retry_finds_the_same_runner(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    calls = tmp_path / "calls.log"
    spec = job_factory(n=200, options={"call_log": str(calls), "seconds_per_record": 0.01})
    from batchline.api import Jobs

    version = Jobs(store).plan(spec, plan_key=KEY, log=lambda _m: None).version
    request = LaunchRequest(version=version, spec=str(spec), key=KEY, plan_key=KEY, store_url=store_url, workers=2,
                            options={"runner_dir": str(tmp_path / "runners")})
    first = launch_once(store, request, "local", by="test")
    store.launch_stopped(version, KEY, "a test forgets the record")
    store.launch_intent(version, KEY, "local", "test")  # the intent of a retry whose record is lost
    again = launch_once(store, request, "local", by="test")
    assert first.record.detail is not None and again.record.detail == first.record.detail  # its pid file
    wait_for(lambda: store.job(version).state == "sealed", timeout=120, what="the seal")  # type: ignore[union-attr]
    counts = call_counts(calls)
    assert len(counts) == 200 and set(counts.values()) == {1}


def test_a_local_fleet_sigkilled_is_gone_within_its_heartbeat_bound_and_a_retry_launches_it_again_sealing_once(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import signal
    import time

    from batchline.api import Jobs
    from batchline.launch.fleet import GONE, WORKING, Watch, watch

    monkeypatch.setenv("BATCHLINE_HEARTBEAT_SECONDS", "0.5")  # the runner's workers inherit it
    calls = tmp_path / "calls.log"
    spec = job_factory(n=200, options={"call_log": str(calls), "seconds_per_record": 0.02}, shards={"size": 20})
    version = Jobs(store).plan(spec, plan_key=KEY, log=lambda _m: None).version
    request = LaunchRequest(version=version, spec=str(spec), key=KEY, plan_key=KEY, store_url=store_url, workers=2,
                            options={"runner_dir": str(tmp_path / "runners")})
    first = launch_once(store, request, "local", by="test")
    assert first.record.detail is not None
    wait_for(lambda: watch(store, version, request).fleet == WORKING, timeout=120, what="a worker counted")
    os.killpg(int(first.record.detail["pid"]), signal.SIGKILL)  # a lost machine: the runner and its workers
    killed = time.monotonic()
    seen: list[Watch] = []

    def gone() -> Watch | None:
        seen.append(watch(store, version, request, seen[-1].quiet_since if seen else None))
        return seen[-1] if seen[-1].state == GONE else None

    ended = wait_for(gone, timeout=60, what="the fleet gone")
    # Within the heartbeat bound (1.5 intervals of 0.5 s) and a poll or two of this loop.
    assert time.monotonic() - killed < 10
    assert ended.message.startswith(f"{version}: its fleet is gone (local launch): no worker has been heard "
                                    f"within the heartbeat bound and the local launcher says nothing it started runs")
    assert "the runner's log is" in ended.message
    assert store.job(version).state == "ready"  # type: ignore[union-attr]  # left as it is: nothing is lost
    again = launch_once(store, request, "local", by="test")
    assert again.launched_now and again.record.detail is not None
    assert again.record.detail["pid"] != first.record.detail["pid"]
    wait_for(lambda: store.job(version).state == "sealed", timeout=180, what="the seal")  # type: ignore[union-attr]
    assert store.status(version).results == 200  # every record once; those in flight at the kill were redone
    assert set(call_counts(calls)) == {f"r{i:06d}" for i in range(200)}


@pytest.fixture(scope="module")
def ray_jobs_api(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A local Ray cluster with its Jobs API (the dashboard), started as `ray start` would be
    on a head node, and stopped after the module's tests."""
    import os
    import subprocess
    import sys

    from tests.helpers import free_port

    pytest.importorskip("ray.dashboard", reason="the fleet extra's ray[default] is not installed")
    port = free_port()
    bin_dir = str(Path(sys.executable).parent)
    import secrets
    import tempfile

    token = secrets.token_hex(16)
    # The cluster authenticates with a token of its own, as a deployed one would.
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}",
           "RAY_TMPDIR": tempfile.mkdtemp(prefix="ray", dir="/tmp"),  # short: Ray's sockets live under it
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    ray_cli = str(Path(bin_dir) / "ray")
    # Ports of its own (6379, Ray's default, may be another server's on a test machine), and
    # `--block` in a session of its own: stopping it stops this cluster alone (`ray stop` would
    # stop every Ray process of the user, another test's included).
    head = subprocess.Popen([ray_cli, "start", "--head", "--block", "--port", str(free_port()), "--num-cpus", "2",
                             "--num-gpus", "0", "--ray-client-server-port", str(free_port()),
                             "--include-dashboard", "true", "--dashboard-host", "127.0.0.1",
                             "--dashboard-port", str(port), "--disable-usage-stats"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    address = f"http://127.0.0.1:{port}"
    try:
        import urllib.request

        def up() -> bool:
            try:
                with urllib.request.urlopen(f"{address}/api/version", timeout=2):
                    return True
            except OSError as exc:  # 401 without the token: the server is up
                return getattr(exc, "code", None) in (200, 401)

        wait_for(up, timeout=180, what="the Ray head's Jobs API")
        yield address, token
    finally:
        import shutil
        import signal

        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=10)  # the cluster is this test's alone: it need not stop gently
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)


@pytest.mark.acceptance
def ray_request(version: str, store_url: str, address: str, token: str) -> LaunchRequest:
    """One worker through the local cluster's Jobs API, the store's URL in the job's environment."""
    return LaunchRequest(version=version, spec="unused", key=KEY, plan_key=KEY, store_url=store_url, workers=1,
                         options={"address": address, "auth_token": token, "cpus_per_worker": 1,
                                  "store_url_in_runtime_env": True})


def test_the_ray_launcher_submits_one_job_a_retry_finds_it_and_the_version_seals_once(
        ray_jobs_api: tuple[str, str], job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    from ray.job_submission import JobSubmissionClient

    from batchline.launch.ray_jobs import submission_id

    address, token = ray_jobs_api
    calls = tmp_path / "calls.log"
    _spec, version = planned(job_factory(n=120, options={"call_log": str(calls), "seconds_per_record": 0.005}), store)
    request = ray_request(version, store_url, address, token)
    first = launch_once(store, request, "ray", by="test")
    assert first.launched_now and first.record.detail == {"address": address,
                                                          "submission_id": submission_id(request), "existing": False}
    store.launch_stopped(version, KEY, "a test forgets the record")
    store.launch_intent(version, KEY, "ray", "test")  # an orphaned intent: the retry must find the submission
    again = launch_once(store, request, "ray", by="test")
    assert again.record.detail is not None and again.record.detail["existing"] is True
    client = JobSubmissionClient(address, headers={"Authorization": f"Bearer {token}"})
    assert [j.submission_id for j in client.list_jobs() if j.metadata.get("batchline_version") == version] == [
        submission_id(request)]
    wait_for(lambda: store.job(version).state == "sealed", timeout=240,  # type: ignore[union-attr]
             what=f"the seal (driver log: {client.get_job_logs(submission_id(request))[-2000:]!r})")
    counts = call_counts(calls)
    assert len(counts) == 120 and set(counts.values()) == {1}


@pytest.mark.parametrize("store_kind", ["sqlite"], indirect=True)  # the launcher's rule, not the store's
def test_a_ray_submission_stopped_from_outside_is_submitted_again_under_the_next_attempt_and_seals(
        ray_jobs_api: tuple[str, str], job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    from ray.job_submission import JobStatus, JobSubmissionClient

    from batchline.launch.fleet import GONE, watch
    from batchline.launch.ray_jobs import submission_id

    address, token = ray_jobs_api
    calls = tmp_path / "calls.log"
    _spec, version = planned(job_factory(n=120, options={"call_log": str(calls), "seconds_per_record": 0.05}), store)
    request = ray_request(version, store_url, address, token)
    first = launch_once(store, request, "ray", by="test")
    client = JobSubmissionClient(address, headers={"Authorization": f"Bearer {token}"})
    client.stop_job(submission_id(request))
    wait_for(lambda: client.get_job_status(submission_id(request)) == JobStatus.STOPPED, timeout=120,
             what="the stop")
    assert first.record.detail is not None and first.record.detail["submission_id"] == submission_id(request)
    ended = wait_for(lambda: (w := watch(store, version, request)).state == GONE and w, timeout=60,
                     what="the fleet gone")
    assert "the ray launcher says nothing it started runs" in ended.message
    again = launch_once(store, request, "ray", by="test")
    assert again.launched_now and again.record.detail is not None
    assert again.record.detail["submission_id"] == submission_id(request, 1) == f"{submission_id(request)}-1"
    wait_for(lambda: store.job(version).state == "sealed", timeout=240,  # type: ignore[union-attr]
             what=f"the seal (driver log: {client.get_job_logs(submission_id(request, 1))[-2000:]!r})")
    assert store.status(version).results == 120
    assert set(call_counts(calls)) == {f"r{i:06d}" for i in range(120)}


def test_a_ray_launch_without_an_address_is_refused_before_anything_is_written(
        job_factory: Any, store: Store) -> None:
    _spec, version = planned(job_factory(n=20), store)
    request = LaunchRequest(version=version, spec="unused", key=KEY, plan_key=KEY, store_url="unused")
    with pytest.raises(SpecError, match="option address is required"):
        launch_once(store, request, "ray", by="test")
    assert store.launches(version) == []
