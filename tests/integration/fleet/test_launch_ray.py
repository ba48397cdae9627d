"""`batchline launch ray` on a local Ray instance: a worker actor killed
mid-shard is replaced, and the job still ends with one outcome per record (I1)
and poison costing only itself (I4)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from batchline.launch.ray import LaunchSummary, RayLauncher
from batchline.store import Store
from tests.helpers import check_invariants, planned, wait_for

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.acceptance


@pytest.fixture(scope="module")
def local_ray() -> Iterator[Any]:
    # Small on purpose: the machine has two cores shared with other work.
    ray.init(num_cpus=2, num_gpus=0, include_dashboard=False, namespace="batchline-test", log_to_driver=False)
    yield ray
    ray.shutdown()


def pid_gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def test_a_killed_worker_actor_is_replaced_and_nothing_is_lost(
        local_ray: Any, job_factory: Any, store: Store, store_url: str) -> None:
    spec, version = planned(job_factory(n=600, options={"seconds_per_record": 0.01, "error_on": ["r000450"]},
                                        shards={"size": 100, "lease_seconds": 60}), store)
    launcher = RayLauncher(store_url, version, 2, cpus_per_worker=1, poll_seconds=0.2)
    outcome: list[LaunchSummary | BaseException] = []

    def run() -> None:
        try:
            outcome.append(launcher.run())
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    row = wait_for(lambda: next((r for r in store.shard_rows(version)
                                 if r.state == "leased" and 0 < r.results < r.record_count - 20), None),
                   timeout=120, what="a shard partly done")
    victim_pid = int(row.owner.split(":")[1])
    actors = launcher.worker_pids()
    assert victim_pid in actors, f"worker {row.owner} is not one of the launcher's {sorted(actors)}"
    ray.kill(actors[victim_pid])
    wait_for(lambda: pid_gone(victim_pid), timeout=30, what="the worker to die with its actor")
    # No clock shift: the launcher saw the actor die (and the other worker can prove the
    # process gone), so the lease is taken back rather than left to lapse.
    thread.join(timeout=240)
    assert not thread.is_alive(), "the launch did not finish"
    [summary] = outcome
    assert isinstance(summary, LaunchSummary), summary
    # The kill reaches the launcher one of two ways, by which Ray reports first: the actor's death,
    # or the actor's worker process ended by signal 9 (seen once in a full run). Either way it is
    # counted once and the worker replaced.
    assert summary.exit_code == 0 and summary.restarts >= 1
    assert summary.actor_deaths + summary.exits.get(-9, 0) == 1, summary
    _results, dead = check_invariants(store, version, spec)
    assert dead == {"r000450"}
    assert [d.attempts for d in store.iter_dead_letters(version)] == [3]
    charged = {e.detail["record_id"] for e in store.events(version, ["attempt_failed"])}
    assert charged == {"r000450"}
    taken = store.events(version, ["take_back"])
    assert [(e.shard_no, e.worker) for e in taken] == [(row.shard_no, row.owner)]
    assert taken[0].detail["proof"]["kind"] in ("ray", "same-host")
    assert not store.events(version, ["lease_expired"])
