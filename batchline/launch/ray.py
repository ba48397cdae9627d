"""`batchline launch ray`: N worker loops on a Ray cluster, one per GPU where GPUs exist.

Ray only places processes here. Each worker slot is a small actor that starts
an ordinary `batchline worker` process (with the store URL in its environment,
never on its command line, where other users of the node could read it) and
reports its exit status. The driver keeps N slots filled: a worker that exits
75 (stopped early with work left) or crashes, an actor that was killed, or a
node that died is replaced by a fresh actor; a worker that exits 0 (no work
left) is not; a worker that reports a broken job (2, 3, 5, 66) or a halted version (7)
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
from typing import Any

from batchline.errors import BatchlineError
from batchline.launch import FATAL_EXITS, slug
from batchline.worker.liveness import RAY_ACTOR_ENV

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
        # start_new_session: a signal to the actor's process group (Ray's own
        # shutdown) reaches the worker only through `stop`, as SIGTERM.
        self.proc = subprocess.Popen(argv, env={**os.environ, **self.env}, stdin=subprocess.DEVNULL,
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
                 log: Callable[[str], None] = lambda _m: None) -> None:
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
        slot.name = f"batchline-{slug(self.version)}-{slot.index}-{slot.starts}"
        slot.actor = cls.options(num_gpus=gpus, num_cpus=self.cpus_per_worker, max_restarts=0,
                                 name=slot.name).remote(
            {"BATCHLINE_STORE": self.store_url, "PYTHONUNBUFFERED": "1", RAY_ACTOR_ENV: slot.name})
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

    def run(self) -> LaunchSummary:
        ray = self._ray()
        cls = actor_class(ray)
        gpus = self._gpus(ray)
        self.log(f"placing {self.workers} workers ({gpus:g} GPU, {self.cpus_per_worker:g} CPU each)")
        with self._lock:
            self.slots = [_Slot(i) for i in range(self.workers)]
            for slot in self.slots:
                self._start(ray, cls, slot, gpus)
        restarts = deaths = 0
        exits: dict[int, int] = {}
        stopping = False
        while True:
            with self._lock:
                live = {s.ref: s for s in self.slots if not s.done and s.ref is not None}
            if not live:
                break
            if self._stop.is_set() and not stopping:
                stopping = True
                for s in live.values():
                    s.actor.stop.remote()
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
