"""`launch ray` holding a deadline on a local Ray cluster of three nodes (`ray.cluster_utils`:
a head with no CPU, a node offering the custom resource `spot`, another offering `on_demand`):
the spot workers run on the one and the paid workers its pacer buys on the other, as each
worker's own identity says; and a fallback the launch could not place refused before
anything starts."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from batchline.errors import BatchlineError
from batchline.launch.ray import RayLauncher
from batchline.store import Store
from tests.helpers import check_invariants, planned

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.acceptance


@pytest.fixture(scope="module")
def two_pools() -> Iterator[dict[str, str]]:
    """The cluster; yields each pool's node id."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    spot = cluster.add_node(num_cpus=1, resources={"spot": 1})
    on_demand = cluster.add_node(num_cpus=2, resources={"on_demand": 2})
    ray.init(address=cluster.address, namespace="batchline-test-paid", log_to_driver=False)
    try:
        yield {"spot": spot.node_id, "on_demand": on_demand.node_id}
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_a_ray_launch_behind_its_deadline_places_paid_workers_on_the_on_demand_nodes(
        two_pools: dict[str, str], job_factory: Any, store: Store, store_url: str) -> None:
    # One spot worker does 10 records a second: 1,200 records need two minutes, the window is 40 s.
    spec, version = planned(job_factory(
        n=1200, options={"seconds_per_record": 0.1}, shards={"size": 50, "lease_seconds": 10, "renew_seconds": 2},
        deadline="40s", fallback={"workers": 2, "cost_per_worker_hour": 3, "restart_overhead_seconds": 3}), store)
    said: list[str] = []
    launcher = RayLauncher(store_url, version, 1, cpus_per_worker=1, poll_seconds=0.2, spot_resource="spot",
                           paid_resource="on_demand", pace_seconds=2.0, log=said.append)
    # Where each worker ran, as it tells the store with each heartbeat (its Ray node among it).
    ran: dict[str, tuple[bool, str | None]] = {}
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.2):
            for w in store.workers_seen(version):
                ran[w.worker] = (w.paid, (w.process or {}).get("ray_node"))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        summary = launcher.run()
    finally:
        done.set()
        watcher.join()
    assert summary.exit_code == 0, said[-10:]
    spot_ran = {node for paid, node in ran.values() if not paid}
    paid_ran = {node for paid, node in ran.values() if paid}
    assert spot_ran == {two_pools["spot"]} and paid_ran == {two_pools["on_demand"]}, ran
    assert store.job(version).state == "sealed"  # type: ignore[union-attr]
    check_invariants(store, version, spec)
    starts = store.paid_slots(version)
    assert starts and all(not s.running for s in starts) and all(s.claimed_at for s in starts)
    paid_workers = {s.worker for s in starts}
    assert {r.worker for r in store.iter_results(version)} & paid_workers
    assert any(s.process and str(s.process.get("ray_actor", "")).endswith(f"{s.slot}-g{s.generation}")
               for s in starts)
    assert any("paid workers on nodes with on_demand" in line for line in said)


def test_a_ray_launch_refuses_a_fallback_it_could_not_place(two_pools: Any, job_factory: Any, store: Store,
                                                            store_url: str) -> None:
    _spec, version = planned(job_factory(n=10, deadline="1h", fallback={"workers": 2}), store)
    with pytest.raises(BatchlineError, match="could not place its paid workers: give --paid-resource NAME"):
        RayLauncher(store_url, version, 1).run()
    with pytest.raises(BatchlineError, match="--paid-resource gpu_on_demand: no node of the Ray cluster offers it"):
        RayLauncher(store_url, version, 1, paid_resource="gpu_on_demand").run()
    _spec, plain = planned(job_factory(n=10, name="plain"), store)
    with pytest.raises(BatchlineError, match="has no fallback section, so no paid worker is ever bought"):
        RayLauncher(store_url, plain, 1, paid_resource="on_demand").run()
    assert store.paid_slots(version) == [] and store.shard_rows(version)[0].claims == 0
