"""`batchline launch ray`: N worker loops on a Ray cluster, one per GPU where GPUs exist.

Ray only places processes here. Each worker slot is a small actor that starts
an ordinary `batchline worker` process (with the store URL in its environment,
never on its command line, where other users of the node could read it) and
reports its exit status. The driver keeps N slots filled: a worker that exits
75 (stopped early with work left) or crashes, an actor that was killed, or a
node that died is replaced by a fresh actor; a worker that exits 0 (no work
left) is not; a worker that reports a broken job (2, 3, 5, 66, 73) or a halted version (7)
stops the launch.
All coordination stays in the store, so a replacement simply claims what the
lost worker's lease gives up; and since the driver saw the actor die, it takes
that lease back at once (the proof is in the event log) rather than leaving it
to run out.

The worker process dies with its actor (PR_SET_PDEATHSIG), and its engine
child dies with it in turn, so a dead actor never leaves a model on a GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from batchline.errors import BatchlineError
from batchline.launch import FATAL_EXITS, slug
from batchline.spec.deadline import Deadline
from batchline.store.paid import PaidSlot
from batchline.worker.liveness import RAY_ACTOR_ENV, RAY_NODE_ENV
from batchline.worker.regions import REGION_ENV

if TYPE_CHECKING:
    from batchline.launch.pacer import Pacer

EXIT_DONE = 0
EXIT_PREEMPTED = 75
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # Not Linux: a worker outliving its actor is found out when its lease lapses.
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class WorkerSlot:
    """The actor body: one `batchline worker` process at a time (see `actor_class`)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    def run(self, argv: list[str]) -> int:
        import ray

        # The node it runs on goes into the worker's process identity: where each worker ran.
        node = {RAY_NODE_ENV: ray.get_runtime_context().get_node_id()}
        # start_new_session: a signal to the actor's process group (Ray's own
        # shutdown) reaches the worker only through `stop`, as SIGTERM.
        self.proc = subprocess.Popen(argv, env={**os.environ, **self.env, **node}, stdin=subprocess.DEVNULL,
                                     preexec_fn=_die_with_parent, start_new_session=True)
        return self.proc.wait()

    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def stop(self) -> None:
        """A preemption notice for the worker: finish in-flight records, give the lease back, exit 75."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)


def actor_class(ray: Any) -> Any:
    # Two concurrent calls: `run` blocks for the worker's life while `pid` and `stop` answer.
    return ray.remote(max_concurrency=2)(WorkerSlot)


@dataclass
class _Slot:
    index: int
    actor: Any = None
    ref: Any = None
    starts: int = 0
    done: bool = False
    name: str = ""  # the current actor's, which its worker tells the store when it claims


class RayPaid:
    """The pacer's `PaidLauncher` on Ray: a paid worker is an actor placed by the custom
    resource of the nodes that are not taken away (`--paid-resource`, such as on_demand),
    named by version, slot and start (`get_if_exists`: a second start of one name is the
    actor that is there)."""

    def __init__(self, launcher: RayLauncher, ray: Any, cls: Any, gpus: float, resource: str,
                 stop_seconds: float) -> None:
        self.launcher, self.ray, self.cls, self.gpus, self.resource = launcher, ray, cls, gpus, resource
        self.stop_seconds = stop_seconds
        self.actors: dict[str, tuple[Any, Any]] = {}  # actor name -> (actor, its run's ref)

    def _name(self, version: str, slot: str, generation: int) -> str:
        return f"batchline-{slug(version)}-{slot}-g{generation}"

    def start(self, version: str, slot: str, generation: int) -> None:
        name = self._name(version, slot, generation)
        actor = self.cls.options(num_gpus=self.gpus, num_cpus=self.launcher.cpus_per_worker, max_restarts=0,
                                 name=name, get_if_exists=True, resources={self.resource: 1}).remote(
            {"BATCHLINE_STORE": self.launcher.store_url, "PYTHONUNBUFFERED": "1", RAY_ACTOR_ENV: name})
        if name not in self.actors:
            ref = actor.run.remote([sys.executable, "-m", "batchline", "worker", "--job", version,
                                    "--paid-slot", f"{slot}/{generation}"])
            self.actors[name] = (actor, ref)

    def stop(self, version: str, start: PaidSlot, *, outright: bool = False) -> None:
        found = self.actors.get(self._name(version, start.slot, start.generation))
        if found is None:
            return
        if outright:
            self.ray.kill(found[0])
        else:
            found[0].stop.remote()

    def gone(self, version: str, start: PaidSlot) -> bool:
        found = self.actors.get(self._name(version, start.slot, start.generation))
        if found is None:
            return False  # not this driver's: its heartbeats say whether it is there
        ready, _ = self.ray.wait([found[1]], timeout=0)
        return bool(ready)

    def reap(self) -> int:
        """Frees the actors whose worker has exited; returns how many still run."""
        for name, (actor, ref) in list(self.actors.items()):
            ready, _ = self.ray.wait([ref], timeout=0)
            if ready:
                with contextlib.suppress(self.ray.exceptions.RayError):
                    self.ray.get(ref)
                self.ray.kill(actor)
                del self.actors[name]
        return len(self.actors)


@dataclass
class LaunchSummary:
    exit_code: int
    starts: int
    restarts: int
    actor_deaths: int
    exits: dict[int, int] = field(default_factory=dict)


class RayLauncher:
    def __init__(self, store_url: str, version: str, workers: int, *, address: str | None = None,
                 gpus_per_worker: float | None = None, cpus_per_worker: float = 1.0,
                 max_restarts: int | None = None, poll_seconds: float = 1.0,
                 log: Callable[[str], None] = lambda _m: None, spot_resource: str | None = None,
                 paid_resource: str | None = None, deadline: Deadline | None = None,
                 pace_seconds: float = 10.0, region: str | None = None) -> None:
        if workers < 1:
            raise BatchlineError("--workers must be at least 1")
        self.store_url = store_url
        self.version = version
        self.workers = workers
        self.address = address
        self.gpus_per_worker = gpus_per_worker
        self.cpus_per_worker = cpus_per_worker
        self.max_restarts = max_restarts if max_restarts is not None else 5 * workers + 5
        self.poll_seconds = poll_seconds
        self.log = log
        self.slots: list[_Slot] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.spot_resource = spot_resource
        self.paid_resource = paid_resource
        self.region = region  # the region its workers run in: BATCHLINE_REGION in each actor
        self.deadline = deadline
        self.pace_seconds = pace_seconds
        self.paid: RayPaid | None = None
        self.pacer: Pacer | None = None

    def request_stop(self) -> None:
        self._stop.set()

    def _ray(self) -> Any:
        try:
            import ray
        except ImportError:
            raise BatchlineError("Ray is not installed: pip install ray") from None
        if not ray.is_initialized():
            # `local` starts a Ray instance on this machine; anything else is a cluster's address.
            ray.init(address=None if self.address in (None, "local") else self.address,
                     namespace="batchline", log_to_driver=False)
        return ray

    def _gpus(self, ray: Any) -> float:
        if self.gpus_per_worker is not None:
            return self.gpus_per_worker
        # One worker per GPU where the cluster has GPUs; CPU-only clusters run CPU engines.
        return 1.0 if ray.cluster_resources().get("GPU", 0) >= 1 else 0.0

    def _start(self, ray: Any, cls: Any, slot: _Slot, gpus: float) -> None:
        slot.starts += 1
        region = f"{slug(self.region, 12)}-" if self.region else ""
        slot.name = f"batchline-{slug(self.version)}-{region}{slot.index}-{slot.starts}"
        slot.actor = cls.options(num_gpus=gpus, num_cpus=self.cpus_per_worker, max_restarts=0, name=slot.name,
                                 resources={self.spot_resource: 1} if self.spot_resource else None).remote(
            {"BATCHLINE_STORE": self.store_url, "PYTHONUNBUFFERED": "1", RAY_ACTOR_ENV: slot.name,
             **({REGION_ENV: self.region} if self.region else {})})
        slot.ref = slot.actor.run.remote([sys.executable, "-m", "batchline", "worker", "--job", self.version])

    def worker_pids(self) -> dict[int, Any]:
        """The worker process id of each live slot, with its actor handle."""
        ray = self._ray()
        with self._lock:
            actors = [s.actor for s in self.slots if s.actor is not None and not s.done]
        out: dict[int, Any] = {}
        for actor in actors:
            try:
                pid = ray.get(actor.pid.remote(), timeout=10)
            except ray.exceptions.RayError:
                continue
            if pid is not None:
                out[int(pid)] = actor
        return out

    def _paid_pool(self, ray: Any, cls: Any, gpus: float) -> None:
        """A pacer and its paid pool where the version has a fallback section; refused when this
        launch could not place paid workers. Records the version's run start either way."""
        from batchline.launch.pacer import Pacer
        from batchline.spec import stored_spec
        from batchline.store import open_store, require_job

        store = open_store(self.store_url, create=False)
        spec = stored_spec(require_job(store, self.version))
        if spec.fallback is None:
            try:
                if self.paid_resource:
                    raise BatchlineError(f"--paid-resource: {self.version} has no fallback section, so no paid "
                                         "worker is ever bought")
                store.open_run(self.version, "ray-launcher")  # with a pacer, its first tick does
            finally:
                store.close()
            return
        if not self.paid_resource:
            store.close()
            raise BatchlineError(f"{self.version} has a fallback section, and this launch could not place its paid "
                                 "workers: give --paid-resource NAME (the custom resource of the nodes that are not "
                                 "taken away, such as on_demand)")
        if ray.cluster_resources().get(self.paid_resource, 0) < 1:
            store.close()
            raise BatchlineError(f"--paid-resource {self.paid_resource}: no node of the Ray cluster offers it "
                                 "(start the on-demand nodes with --resources='{\"" + self.paid_resource + "\": N}')")
        self.paid = RayPaid(self, ray, cls, gpus, self.paid_resource, spec.shards.grace_seconds)
        self.pacer = Pacer(store, self.version, self.paid, tick_seconds=self.pace_seconds, by="ray-launcher",
                           spec=spec, deadline_override=self.deadline, log=self.log)

    def _pace(self) -> None:
        assert self.pacer is not None
        try:
            report = self.pacer.tick()
        except BatchlineError as exc:
            self.log(f"the store cannot be read now ({exc}): starting nothing new; the workers go on")
            return
        if report is not None:
            self.log(report.line())

    def run(self) -> LaunchSummary:
        ray = self._ray()
        cls = actor_class(ray)
        gpus = self._gpus(ray)
        self._paid_pool(ray, cls, gpus)
        self.log(f"placing {self.workers} workers ({gpus:g} GPU, {self.cpus_per_worker:g} CPU each)"
                 + (f" on nodes with {self.spot_resource}" if self.spot_resource else "")
                 + (f"; paid workers on nodes with {self.paid_resource}" if self.pacer is not None else ""))
        with self._lock:
            self.slots = [_Slot(i) for i in range(self.workers)]
            for slot in self.slots:
                self._start(ray, cls, slot, gpus)
        restarts = deaths = 0
        exits: dict[int, int] = {}
        stopping = False
        last_pace = 0.0
        while True:
            if self.pacer is not None and not stopping and time.monotonic() - last_pace >= self.pace_seconds:
                last_pace = time.monotonic()
                self._pace()
            paid_running = self.paid.reap() if self.paid is not None else 0
            with self._lock:
                live = {s.ref: s for s in self.slots if not s.done and s.ref is not None}
            if not live:
                if paid_running and not stopping:
                    time.sleep(self.poll_seconds)  # the paid workers finish the job
                    continue
                break
            if self._stop.is_set() and not stopping:
                stopping = True
                for s in live.values():
                    s.actor.stop.remote()
                for actor, _ref in (self.paid.actors.values() if self.paid is not None else ()):
                    actor.stop.remote()
            ready, _ = ray.wait(list(live), num_returns=1, timeout=self.poll_seconds)
            for ref in ready:
                slot = live[ref]
                code: int | None = None
                try:
                    code = int(ray.get(ref))
                except ray.exceptions.RayError as exc:
                    deaths += 1  # the actor or its node died: the worker went with it
                    self.log(f"worker {slot.index}: actor lost ({type(exc).__name__})")
                if code is not None:
                    exits[code] = exits.get(code, 0) + 1
                    self.log(f"worker {slot.index}: exit {code}")
                if code != EXIT_DONE:
                    self._take_back(slot.name, "the actor died" if code is None else f"its worker exited {code}")
                with self._lock:
                    ray.kill(slot.actor)  # frees its GPU reservation before a replacement asks for one
                    if code == EXIT_DONE or stopping:
                        slot.done = True
                        continue
                    if code in FATAL_EXITS:
                        self._stop_all(ray)
                        return LaunchSummary(code, sum(s.starts for s in self.slots), restarts, deaths, exits)
                    restarts += 1
                    if restarts > self.max_restarts:
                        self._stop_all(ray)
                        raise BatchlineError(f"workers keep failing ({restarts} restarts)")
                    self._start(ray, cls, slot, gpus)
        code = EXIT_PREEMPTED if stopping else EXIT_DONE
        return LaunchSummary(code, sum(s.starts for s in self.slots), restarts, deaths, exits)

    def _take_back(self, actor: str, found: str) -> None:
        """Ends the leases the worker of `actor` held: this driver saw it end."""
        from batchline.store import open_store
        from batchline.worker.liveness import take_back_dead

        proof = {"kind": "ray", "actor": actor, "found": found}
        try:
            store = open_store(self.store_url)
        except BatchlineError as exc:
            self.log(f"cannot take back {actor}'s leases now ({exc}); they run out instead")
            return
        try:
            taken = take_back_dead(store, self.version, "ray-launcher", proof_of=lambda h: (
                proof if h.process and h.process.get("ray_actor") == actor else None))
        finally:
            store.close()
        if taken:
            self.log(f"took back {taken} leases of {actor} ({found})")

    def _stop_all(self, ray: Any) -> None:
        for s in self.slots:
            if not s.done and s.actor is not None:
                s.actor.stop.remote()
        deadline = time.monotonic() + 120
        for s in self.slots:
            if not s.done and s.ref is not None:
                with contextlib.suppress(ray.exceptions.RayError):
                    ray.get(s.ref, timeout=max(1.0, deadline - time.monotonic()))
                ray.kill(s.actor)
                s.done = True
