"""The pacer: holds a version's deadline by buying paid workers of its own pinned model (I7).

Each `tick` reads everything anew (the version's progress, the workers the store
has seen, the paid slots and their spend) and asks the one pacing rule
(`batchline.sizing.pacing.decide`) how many paid workers to run, then makes the
paid slots `paid-0` ... `paid-N-1` so:

- a slot is started only after the store has made its start (`paid_launch`), so
  two pacers at once, or one restarted, never start a slot twice: a start that
  runs is "already there";
- a slot above what is wanted is stopped as under I5 (its worker finishes what
  is in flight, gives its lease back and exits), so stopping loses nothing;
- a worker counts as capacity only as the store reads its heartbeats
  (`live_capacity`: loading, holding a lease, or, paid, the worker of a running
  start); a slot launched and not seen (a Kueue workload not admitted) is
  reported as "paid capacity not admitted";
- a start that is stale (its process gone, its worker silent past
  `STALE_SECONDS`, or never seen within `fallback.launch_timeout_seconds` of its
  launch) is stopped where it runs and ended in the store and, while the job is
  still behind, started again like any worker: no slot stays "already there";
- the version's run start is recorded at the first tick (`open_run`): the line
  and a window deadline count from it, so a job no worker ever claims is late.

What it needs of a launcher is `PaidLauncher`: start a slot's worker, stop it, and
say whether it is still there. The local runner, `launch ray` and the Kubernetes
pacer Deployment each bring one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from batchline.errors import BatchlineError, NoSuchVersion
from batchline.sizing.pacing import Decision, Mode, Observation, Policy, decide, observe
from batchline.spec import JobSpec, stored_spec
from batchline.spec.deadline import Deadline, FallbackSpec, format_duration
from batchline.store import Store, require_job
from batchline.store.paid import PaidSlot, restart_overhead, slot_name
from batchline.worker.heartbeat import heartbeat_seconds
from batchline.worker.liveness import death_proof

# A worker that has not been heard from for this long is taken for gone (it heartbeats every 5 s).
STALE_SECONDS = 60.0


class PaidLauncher(Protocol):
    """What a pacer needs of the place paid workers run (local processes, Ray, Kubernetes)."""

    # How long a stopped paid worker may take to finish what is in flight (it is paid meanwhile).
    stop_seconds: float

    def start(self, version: str, slot: str, generation: int) -> None:
        """Starts the worker of this start of the slot (`batchline worker --job V --paid-slot
        slot/generation`); one that is there already is left as it is."""

    def stop(self, version: str, start: PaidSlot, *, outright: bool = False) -> None:
        """Stops the slot's worker with a preemption notice (SIGTERM: finish in flight, give the
        lease back); `outright`, at once (a stale start: hung, or out of reach)."""

    def gone(self, version: str, start: PaidSlot) -> bool:
        """Whether the start's worker is surely gone (its process, actor or Job is not there)."""


@dataclass(frozen=True)
class PaceReport:
    """What one tick saw and did, as `run`, `status` and the metrics show it."""

    decision: Decision
    committed: int
    records: int
    deadline: float
    spot_workers: int
    paid_seen: int
    paid_not_admitted: int
    paid_spend_seconds: float
    cost: float
    restart_overhead: float
    started: tuple[str, ...] = ()
    stopped: tuple[str, ...] = ()
    eta: float | None = None

    def to_json(self) -> dict[str, object]:
        return {**self.decision.to_json(), "committed": self.committed, "records": self.records,
                "deadline": self.deadline, "spot_workers": self.spot_workers, "paid_workers": self.paid_seen,
                "paid_not_admitted": self.paid_not_admitted, "paid_worker_seconds": self.paid_spend_seconds,
                "paid_cost": self.cost, "restart_overhead_seconds": self.restart_overhead, "eta": self.eta}

    def line(self) -> str:
        paid = f"{self.paid_seen} paid" + (f" (+{self.paid_not_admitted} paid capacity not admitted)"
                                           if self.paid_not_admitted else "")
        reason = self.decision.reason
        if self.decision.mode is Mode.AT_RISK and self.eta is not None and self.eta > self.deadline:
            reason += f", ETA {format_duration(self.eta - self.deadline)} past the deadline"
        return (f"{self.spot_workers} spot, {paid} | committed {self.committed:,} vs expected "
                f"{self.decision.expected:,.0f} | {reason}")


class _Watching:
    """No launcher: a pacer that only says what it would decide (`status`, the report)."""

    stop_seconds = 0.0

    def start(self, version: str, slot: str, generation: int) -> None:
        raise AssertionError("a watching pacer starts nothing")

    def stop(self, version: str, start: PaidSlot, *, outright: bool = False) -> None:
        raise AssertionError("a watching pacer stops nothing")

    def gone(self, version: str, start: PaidSlot) -> bool:
        return False


@dataclass
class Pacer:
    store: Store
    version: str
    launcher: PaidLauncher
    policy: Policy = Policy.UNIFORM
    tick_seconds: float = 10.0
    by: str = "pacer"
    log: Callable[[str], None] = lambda _m: None
    spec: JobSpec | None = None
    deadline_override: Deadline | None = None  # given on the command line instead of the spec's
    # Takes back the leases of owners proven dead (on Kubernetes: pods the API server says are
    # gone), each tick; how many.
    take_back: Callable[[], int] | None = None
    _warned: set[str] = field(default_factory=set)
    _opened: bool = False
    _prior: float | None = None
    _prior_read: bool = False

    def __post_init__(self) -> None:
        if self.spec is None:
            self.spec = stored_spec(require_job(self.store, self.version))
        if self.fallback is None:
            raise BatchlineError(f"{self.version} has no fallback section: nothing to buy paid workers with")
        if self.deadline is None:
            raise BatchlineError(f"{self.version} has no deadline: a pacer holds one (spec deadline, or --deadline)")
        heartbeat_seconds()  # a malformed setting is refused before anything starts

    @classmethod
    def watching(cls, store: Store, version: str) -> Pacer | None:
        """A pacer that decides and acts on nothing, for what `status` and the report say of a
        version with a deadline (without a fallback section, as one with no paid workers to buy);
        None for a version without a deadline."""
        spec = stored_spec(require_job(store, version))
        if spec.deadline is None:
            return None
        if spec.fallback is None:
            from dataclasses import replace

            spec = replace(spec, fallback=FallbackSpec(0))
        return cls(store, version, _Watching(), spec=spec)

    def picture(self) -> PaceReport | None:
        """What a tick would decide now, starting and stopping nothing."""
        obs, slots, spot, spend = self.observe()
        if obs is None:
            return None
        return self._report(obs, decide(obs, self.policy), slots, spot, spend, (), ())

    @property
    def fallback(self) -> FallbackSpec | None:
        assert self.spec is not None
        return self.spec.fallback

    @property
    def deadline(self) -> Deadline | None:
        assert self.spec is not None
        return self.deadline_override if self.deadline_override is not None else self.spec.deadline

    def prior_rate(self) -> float | None:
        """One worker's rate before this version has measured one: the latest earlier version of
        the same name on this store that measured one, else `fallback.records_per_worker_second`."""
        assert self.spec is not None and self.fallback is not None
        if not self._prior_read:
            self._prior_read = True
            earlier = sorted((j for j in self.store.jobs() if j.name == self.spec.name and j.version != self.version),
                             key=lambda j: j.created_at, reverse=True)
            for job in earlier:
                rate = self.store.run_throughput(job.version)
                if rate > 0:
                    self._prior = rate
                    break
            else:
                self._prior = self.fallback.records_per_worker_second
        return self._prior

    def observe(self) -> tuple[Observation | None, list[PaidSlot], int, float]:
        """The observation the rule decides on (None for a version no runner, launcher or pacer
        has opened and no worker has claimed), this version's latest start of each slot, the
        spot workers seen, and the paid spend so far."""
        assert self.spec is not None and self.fallback is not None
        info = require_job(self.store, self.version)
        st = self.store.status(self.version)
        starts = self.store.paid_slots(self.version)
        latest: dict[str, PaidSlot] = {}
        for s in starts:
            latest[s.slot] = s
        slots = sorted(latest.values(), key=lambda s: s.index)
        # Capacity is the store's one reading of heartbeats (`live_capacity`: loading, leasing,
        # or paid as a running start), less those proven dead on this host: not what workers
        # say of themselves, which a worker's credentials could make look like a covered job.
        alive = [w for w in self.store.live_capacity(self.version) if death_proof(w.process) is None]
        spot = sum(1 for w in alive if not w.paid)
        paid_up = {w.paid_slot for w in alive if w.paid}
        spend = self.store.paid_spend_seconds(self.version)
        run_start = st.run_start
        if run_start is None:
            return None, slots, spot, spend
        deadline = self.deadline
        assert deadline is not None
        seen = [s for s in slots if s.running and f"{s.slot}/{s.generation}" in paid_up]
        # Per worker: of completed shards (claim to completion); else the recent window's, shared
        # by the workers seen; else the run's average since its first claim. None of them before
        # anything is computed: then the prior.
        workers = max(1, spot + len(seen))
        computed = st.results + st.dead_letters - info.carried - info.planned_dead
        measured = 0.0
        if computed > 0:
            first = st.started_at if st.started_at is not None else run_start
            measured = (self.store.run_throughput(self.version) or (st.records_per_second or 0.0) / workers
                        or computed / max(1.0, st.now - first) / workers)
        fb = self.fallback
        budget = None
        if fb.max_cost is not None:
            # The spend as each paid worker holds it (batchline.worker.paid): one reading of it.
            spent, _per_hour = self.store.paid_budget(self.version)
            budget = max(0.0, fb.max_cost - spent) / max(fb.cost_per_worker_hour, 1e-9) * 3600.0
        obs = observe(
            now=st.now, run_start=run_start, deadline=deadline.resolve(run_start, st.now),
            records=st.records, done_at_start=info.carried + info.planned_dead,
            committed=st.results + st.dead_letters, spot_seen=spot, paid_seen=len(seen),
            paid_running=sum(1 for s in slots if s.running), max_paid=fb.workers,
            measured_rate=measured, prior_rate=self.prior_rate(),
            restart_overhead=restart_overhead(starts) or fb.restart_overhead_seconds,
            budget_seconds=budget,
            # A paid worker holds the budget itself at each heartbeat: the pacer is at least as strict.
            stop_seconds=max(self.tick_seconds, heartbeat_seconds()) + self.launcher.stop_seconds,
            tail_seconds=self.spec.shards.lease_seconds)
        return obs, slots, spot, spend

    def stale(self, start: PaidSlot, now: float) -> str | None:
        """Why a running start is to be stopped and ended (None: it is not): its worker gone,
        silent past STALE_SECONDS, or never seen within the launch timeout."""
        assert self.fallback is not None
        if self.launcher.gone(self.version, start):
            return "its worker is gone"
        if start.seen_at is not None and now - start.seen_at > STALE_SECONDS:
            return f"its worker was not heard from for {STALE_SECONDS:g} s"
        timeout = self.fallback.launch_timeout_seconds
        if start.seen_at is None and now - start.launched_at > timeout:
            return f"its worker was not seen within {timeout:g} s of its launch"
        return None

    def tick(self) -> PaceReport | None:
        """One decision, and the slots made to follow it; None once the version is no longer
        open. The first tick records the run start (`open_run`)."""
        assert self.fallback is not None
        info = require_job(self.store, self.version)
        if info.state != "ready":
            return None
        if not self._opened:
            self.store.open_run(self.version, self.by)
            self._opened = True
        if self.take_back is not None:
            taken = self.take_back()
            if taken:
                self.log(f"took back {taken} lease{'s' if taken != 1 else ''} of workers proven dead")
        obs, slots, spot, spend = self.observe()
        if obs is None:
            return None
        # Stale starts are stopped where they run and ended in the store: as any worker, they
        # are replaced if needed.
        for s in slots:
            why = self.stale(s, obs.now) if s.running else None
            if why is not None:
                self.launcher.stop(self.version, s, outright=True)
                self.store.paid_stop(self.version, s.slot, s.generation, why)
                self.log(f"paid slot {s.slot}: {why}; stopped")
        decision = decide(obs, self.policy)
        running = {s.slot: s for s in self.store.paid_slots(self.version) if s.running}
        started, stopped = [], []
        for index in range(decision.paid):
            slot = slot_name(index)
            if slot in running:
                continue
            generation = self.store.paid_launch(self.version, slot, self.by, self.fallback.cost_per_worker_hour,
                                                stale_seconds=STALE_SECONDS,
                                                launch_timeout=self.fallback.launch_timeout_seconds)
            if generation is None:
                continue  # another pacer started it meanwhile: already there
            self.launcher.start(self.version, slot, generation)
            started.append(slot)
        for slot, s in sorted(running.items(), key=lambda kv: kv[1].index):
            if s.index >= decision.paid:
                self.launcher.stop(self.version, s)
                stopped.append(slot)
        if started or stopped:
            self.log(f"{decision.reason}" + (f"; started {', '.join(started)}" if started else "")
                     + (f"; stopping {', '.join(stopped)}" if stopped else ""))
        return self._report(obs, decision, list(running.values()), spot, spend, tuple(started), tuple(stopped))

    def _report(self, obs: Observation, decision: Decision, slots: list[PaidSlot], spot: int, spend: float,
                started: tuple[str, ...], stopped: tuple[str, ...]) -> PaceReport:
        assert self.fallback is not None
        running = [s for s in slots if s.running]
        seen = obs.paid_workers
        not_admitted = sum(1 for s in running if s.seen_at is None)
        total_rate = (spot + seen) * obs.worker_rate
        eta = obs.now + (obs.records - obs.committed) / total_rate if total_rate > 0 else None
        return PaceReport(decision, obs.committed, obs.records, obs.deadline, spot, seen, not_admitted, spend,
                          spend * self.fallback.cost_per_worker_hour / 3600.0, obs.restart_overhead,
                          started, stopped, eta)


def pace_until_done(pacer: Pacer, stop: Callable[[float], bool], log: Callable[[str], None],
                    observe: Callable[[PaceReport], None] = lambda _r: None) -> int:
    """`tick` every `tick_seconds` until the version is no longer open (sealed, halted,
    cancelled) or `stop(seconds)` (which waits that long) says to stop: 0. A store that cannot
    be read is said, once each time it stops answering: nothing new is started meanwhile, and the
    workers go on."""
    unreachable = False
    while True:
        try:
            info = require_job(pacer.store, pacer.version)
            if info.state != "ready":
                log(f"{pacer.version} is {info.state}: nothing more to pace")
                return 0
            report = pacer.tick()
            if unreachable:
                log("the store answers again: pacing")
            unreachable = False
            if report is not None:
                log(report.line())
                observe(report)
        except BatchlineError as exc:
            if isinstance(exc, NoSuchVersion):
                raise
            if not unreachable:
                log(f"the store cannot be read now ({' '.join(str(exc).split())}): starting nothing new; "
                    "the workers go on")
            unreachable = True
        if stop(pacer.tick_seconds):
            return 0
