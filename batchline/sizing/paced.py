"""The deadline simulated: spot capacity taken away, and paid workers bought by a policy.

`simulate_paced` runs the interruption simulator (`batchline.sizing.simulate`:
keyed per-record writes, notices, take-backs and tail splits, as batchline's
worker and store do them) with two kinds of worker:

- **spot** slots (`Scenario.workers`), each interrupted as the scenario says, and
  present only as far as the spot capacity trace allows: when the trace falls,
  the extra ones are killed outright, as a reclaim would (their leases are taken
  back once they are proven dead); when it rises, they start again, each paying
  the model load;
- **paid** slots (`Pacing.max_paid`), never interrupted, started and stopped at
  each tick by the policy's decision (`batchline.sizing.pacing.decide`, the same
  rule every launcher's pacer runs), each start paying the model load (the
  restart overhead `d`), each stop a preemption notice (finish what is in
  flight, give the lease back).

What a run measures: whether the job ended by the deadline, the paid
worker-seconds (from each paid start to its stop: loading included) and the
hindsight lower bound: the work left once the spot slots did all the work their
uptime allowed by the deadline (time loading after each start taken out), in
worker-seconds of one worker; no policy that learns the trace as it goes can
need fewer paid worker-seconds.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from batchline.errors import BatchlineError
from batchline.sizing.pacing import Policy, decide, observe
from batchline.sizing.simulate import (
    _IDLE,
    _LOADING,
    _WORKING,
    Scenario,
    SimulationDiverged,
    Strategy,
    _coverage,
    _Sim,
    _Worker,
)

_OFF = 4  # a slot with no worker: spot capacity the trace took away, or a paid worker not bought
_TICK, _TRACE = 10, 11  # event kinds of this variant


@dataclass(frozen=True)
class Trace:
    """Spot workers available over time: `points` of (seconds from the start, workers), each
    holding until the next; before the first, the first's."""

    points: tuple[tuple[float, int], ...]

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("a capacity trace needs at least one point")
        times = [t for t, _ in self.points]
        if times != sorted(times) or any(n < 0 for _, n in self.points):
            raise ValueError("a capacity trace's times must rise and its workers be 0 or more")

    @functools.cached_property
    def _times(self) -> list[float]:
        return [p[0] for p in self.points]

    def at(self, t: float) -> int:
        i = bisect.bisect_right(self._times, t) - 1
        return self.points[max(i, 0)][1]

    @classmethod
    def read(cls, path: Path, *, workers: int | None = None, start_seconds: float = 0.0) -> Trace:
        """A file of lines `SECONDS WORKERS` (or `SECONDS,WORKERS`; `#` starts a comment), or a
        JSON availability trace (`{"metadata": {"gap_seconds": G}, "data": [...]}`, a point
        every G seconds, as the "Can't Be Late" traces are). Read from `start_seconds` on (the
        points before it dropped, the one in force kept at 0). A JSON trace of one instance
        (every point 0 or 1) has each point scaled to `workers`: a zone with capacity or none."""
        text = path.read_text()
        if text.lstrip().startswith("{"):
            points = cls._json_points(path, text, workers)
        else:
            points = cls._line_points(path, text)
        if start_seconds < 0:
            raise ValueError(f"{path}: the start offset cannot be negative ({start_seconds:g})")
        if start_seconds:
            before = [p for p in points if p[0] <= start_seconds]
            after = [(t - start_seconds, n) for t, n in points if t > start_seconds]
            points = ([(0.0, before[-1][1])] if before else []) + after
        try:
            return cls(tuple(points))
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None

    @staticmethod
    def _line_points(path: Path, text: str) -> list[tuple[float, int]]:
        points = []
        for n, line in enumerate(text.splitlines(), start=1):
            cut = line.split("#", 1)[0].strip()
            if not cut:
                continue
            parts = cut.replace(",", " ").split()
            try:
                if len(parts) != 2:
                    raise ValueError
                points.append((float(parts[0]), int(parts[1])))
            except ValueError:
                raise ValueError(f"{path}:{n}: a trace line is SECONDS WORKERS (such as '3600 10'), not "
                                 f"{line.strip()!r}") from None
        return points

    @staticmethod
    def _json_points(path: Path, text: str, workers: int | None) -> list[tuple[float, int]]:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None
        meta = raw.get("metadata") if isinstance(raw, dict) else None
        gap = meta.get("gap_seconds") if isinstance(meta, dict) else None
        data = raw.get("data") if isinstance(raw, dict) else None
        if isinstance(gap, bool) or not isinstance(gap, int | float) or gap <= 0:
            raise ValueError(f"{path}: a JSON trace needs metadata.gap_seconds, a positive number of seconds "
                             "between points")
        if not isinstance(data, list) or not data or any(
                isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in data):
            raise ValueError(f"{path}: a JSON trace's data is a list of whole numbers of 0 or more, a point "
                             "every gap_seconds")
        one_instance = all(v in (0, 1) for v in data)
        if one_instance and workers is None:
            raise ValueError(f"{path}: a trace of one instance (points 0 or 1) needs the spot workers to scale to")
        scale = workers if one_instance and workers is not None else 1
        points: list[tuple[float, int]] = []
        for i, v in enumerate(data):
            if not points or points[-1][1] != v * scale:
                points.append((i * float(gap), v * scale))
        return points

    @classmethod
    def load(cls, path: str | Path, *, workers: int, start_seconds: float = 0.0) -> Trace:
        """`--spot-trace` as `run` and `simulate` read it: one readable line when it cannot be."""
        try:
            return cls.read(Path(path), workers=workers, start_seconds=start_seconds)
        except FileNotFoundError:
            raise BatchlineError(f"--spot-trace {path}: no such file") from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise BatchlineError(f"--spot-trace {exc}") from None


def wave_trace(workers: int, deadline_seconds: float, *, waves: int = 2, share: float = 0.5,
               wave_seconds: float = 3600.0, seed: int = 0) -> Trace:
    """`workers` spot workers, less `share` of them during each of `waves` reclaim waves of
    `wave_seconds`, each starting at a seeded random time in the window (waves that overlap
    each take their share of what is left)."""
    rng = random.Random(f"batchline-paced/{seed}/waves")
    starts = sorted(rng.uniform(0.0, max(0.0, deadline_seconds - wave_seconds)) for _ in range(waves))
    edges = sorted({0.0, *starts, *(s + wave_seconds for s in starts)})
    points = []
    for t in edges:
        active = sum(1 for s in starts if s <= t < s + wave_seconds)
        points.append((t, round(workers * (1 - share) ** active)))
    return Trace(tuple(points))


@dataclass(frozen=True)
class Pacing:
    deadline_seconds: float
    max_paid: int
    policy: Policy = Policy.UNIFORM
    tick_seconds: float = 60.0
    trace: Trace | None = None  # None: every spot slot is there throughout
    # One worker's rate before the run has measured one (an earlier version's, or the spec's
    # fallback.records_per_worker_second); None: none, so a job behind buys every paid worker.
    prior_rate: float | None = None

    def __post_init__(self) -> None:
        if self.deadline_seconds <= 0:
            raise ValueError("the deadline must be after the start")
        if self.max_paid < 0 or self.tick_seconds <= 0:
            raise ValueError("paid workers cannot be negative, and ticks must be positive")


@dataclass(frozen=True)
class PacedResult:
    policy: Policy
    seed: int
    makespan_seconds: float
    deadline_seconds: float
    paid_seconds: float  # paid worker-seconds, loading included
    spot_seconds: float  # spot worker-seconds up by the deadline, loading and stalls excluded
    bound_seconds: float  # the hindsight lower bound of paid worker-seconds
    duplicate_rows: int
    missing_rows: int
    paid_starts: int

    @property
    def met(self) -> bool:
        return self.makespan_seconds <= self.deadline_seconds

    @property
    def finished(self) -> bool:
        """False for a run that could not finish (no spot, no paid workers): a missed deadline."""
        return math.isfinite(self.makespan_seconds)


class _PacedSim(_Sim):
    def __init__(self, sc: Scenario, pacing: Pacing, shard_size: int, seed: int) -> None:
        super().__init__(sc, Strategy.KEYED_PER_RECORD, shard_size, seed)
        self.pacing = pacing
        self.spot = sc.workers
        self.workers += [_Worker(sc.workers + i) for i in range(pacing.max_paid)]
        self.paid_seconds = self.spot_seconds = 0.0
        self.paid_starts = 0
        self.now = 0.0

    # -- bookkeeping of what each slot's time bought

    def book(self, w: _Worker, t: float) -> None:
        span = t - w.since
        if w.idx >= self.spot:
            if w.state != _OFF:
                self.paid_seconds += span
        elif w.state in (_WORKING, _IDLE):
            deadline = self.pacing.deadline_seconds
            self.spot_seconds += max(0.0, min(t, deadline) - min(w.since, deadline))
        if w.state == _OFF:
            w.since = t
            return
        super().book(w, t)

    # -- slots coming and going

    def start_slot(self, w: _Worker, t: float) -> None:
        self.book(w, t)
        if w.idx >= self.spot:
            self.paid_starts += 1
        self.start_load(w, t, self.sc.model_load_seconds)

    def retire(self, w: _Worker, t: float, *, notice: bool) -> None:
        """The slot's worker goes away and nobody replaces it: a paid worker stopped (with a
        notice), or a spot worker the trace reclaimed (outright)."""
        self.book(w, t)
        if w.state == _WORKING:
            s = w.shard
            assert s is not None
            pos = self.position(w, t)
            durable = math.floor(pos) if notice else self.durable_without_notice(w, pos)
            if durable >= s.hi:
                self.complete(w, s, t)
            else:
                self.writes.append((w.run_start, durable))
                s.done = durable
                if notice:
                    self.release(s, t)
                else:
                    self.go_silent(w, s, t, dead=True)
        self.idle.discard(w.idx)
        w.state, w.since, w.gen = _OFF, t, w.gen + 1
        w.shard, w.draining, w.pending = None, False, None

    def on_interrupt(self, w: _Worker, t: float, is_stall: bool, stall_seconds: float) -> None:
        if w.state == _OFF:
            # Reclaimed: nothing to interrupt, but the slot's own stream of interruptions goes on,
            # so every policy sees the same ones.
            self.next_interrupt(w.idx, t)
            return
        super().on_interrupt(w, t, is_stall, stall_seconds)

    def die(self, w: _Worker, t: float, *, notice: bool, delay: float) -> None:
        if w.state != _OFF:
            super().die(w, t, notice=notice, delay=delay)

    # -- the run

    def start(self) -> None:
        trace = self.pacing.trace
        for w in self.workers:
            w.state = _OFF
        for w in self.workers[:self.spot]:
            self.next_interrupt(w.idx, 0.0)  # paid slots are never interrupted
        for w in self.workers[:self.spot if trace is None else min(self.spot, trace.at(0.0))]:
            self.start_slot(w, 0.0)
        if trace is not None:
            for t, _n in trace.points:
                if t > 0:
                    self.push(t, _TRACE, -1, 0)
        self.push(self.pacing.tick_seconds, _TICK, -1, 0)
        if self.pacing.policy is Policy.ALWAYS:
            for w in self.workers[self.spot:]:
                self.start_slot(w, 0.0)

    def on_other(self, kind: int, t: float, a: int, b: int, extra: Any) -> None:
        if kind == _TRACE:
            self.follow_trace(t)
        elif kind == _TICK:
            self.tick(t)
            self.push(t + self.pacing.tick_seconds, _TICK, -1, 0)

    def follow_trace(self, t: float) -> None:
        assert self.pacing.trace is not None
        wanted = min(self.spot, self.pacing.trace.at(t))
        up = [w for w in self.workers[:self.spot] if w.state != _OFF]
        for w in up[wanted:][::-1]:
            self.retire(w, t, notice=False)
        for w in [w for w in self.workers[:self.spot] if w.state == _OFF][:max(0, wanted - len(up))]:
            self.start_slot(w, t)

    def committed(self) -> int:
        """Records durably written now: the ranges logged, and what each working slot has
        written of its run so far (keyed per-record writes go out a write batch at a time)."""
        done = _coverage(self.writes)[1]
        for w in self.workers:
            if w.state == _WORKING and w.shard is not None and not w.draining:
                done += max(0, self.durable_without_notice(w, self.position(w, t=self.now)) - w.run_start)
        return done

    def working_seconds(self, t: float) -> float:
        """Worker-seconds spent working on shards so far: what a measured rate divides."""
        return self.compute_time + self.overhead_time + sum(
            t - w.since for w in self.workers if w.state == _WORKING)

    def tick(self, t: float) -> None:
        """The rule's decision, on what a pacer would measure: the run starts at 0 (the runner
        opens the version), and the rate is measured from what was committed, never handed in."""
        self.now = t
        paid = self.workers[self.spot:]
        if self.pacing.policy is Policy.ALWAYS:
            return
        # As a pacer counts them: every worker heartbeating, its model loading included, not one
        # stalled (a stopped process sends nothing) or gone.
        seen = [w for w in self.workers if w.state in (_WORKING, _IDLE, _LOADING)]
        committed = self.committed()
        busy = self.working_seconds(t)
        measured = committed / busy if committed > 0 and busy > 0 else 0.0
        obs = observe(
            now=t, run_start=0.0, deadline=self.pacing.deadline_seconds, records=self.sc.items,
            done_at_start=0, committed=committed,
            spot_seen=sum(1 for w in seen if w.idx < self.spot),
            paid_seen=sum(1 for w in seen if w.idx >= self.spot),
            paid_running=sum(1 for w in paid if w.state != _OFF), max_paid=self.pacing.max_paid,
            measured_rate=measured, prior_rate=self.pacing.prior_rate, restart_overhead=self.sc.model_load_seconds,
            tail_seconds=self.sc.lease_seconds)
        wanted = decide(obs, self.pacing.policy).paid
        running = [w for w in paid if w.state != _OFF]
        for w in running[wanted:][::-1]:
            self.retire(w, t, notice=True)
        for w in [w for w in paid if w.state == _OFF][:max(0, wanted - len(running))]:
            self.start_slot(w, t)


# A run not finished by this many deadlines (or ideal makespans) never will be: it is a missed
# deadline, not an error (no spot capacity left in the trace, no paid workers bought).
HORIZON_DEADLINES = 6


def simulate_paced(scenario: Scenario, pacing: Pacing, shard_size: int, seed: int = 0, *,
                   bound_seconds: float | None = None) -> PacedResult:
    """One run under `pacing`; the same inputs and seed give the same result (the spot side,
    trace and interruptions, is the same for every policy: common random numbers). The
    hindsight bound is the work the spot side could not do by the deadline (its uptime
    there, each start's load taken out), from the same seed's run without paid workers,
    unless `bound_seconds` gives it. A run that cannot finish is a missed deadline: its
    makespan is infinite."""
    sim = _PacedSim(scenario, pacing, shard_size, seed)
    horizon = HORIZON_DEADLINES * max(scenario.ideal_seconds, pacing.deadline_seconds)
    try:
        sim.run(max_seconds=horizon)
        end = sim.finished_at
        assert end is not None
    except SimulationDiverged:
        end = horizon
    for w in sim.workers:
        sim.book(w, end)
    written, covered = _coverage(sim.writes)
    work = scenario.items / scenario.records_per_second
    if bound_seconds is None:
        bound_seconds = max(0.0, work - sim.spot_seconds) if pacing.policy is Policy.NONE or end >= \
            pacing.deadline_seconds else simulate_paced(scenario, replace(pacing, policy=Policy.NONE), shard_size,
                                                        seed).bound_seconds
    finished = sim.finished_at is not None
    return PacedResult(pacing.policy, seed, end if finished else math.inf, pacing.deadline_seconds,
                       sim.paid_seconds, sim.spot_seconds, bound_seconds, written - covered,
                       scenario.items - covered if finished else 0, sim.paid_starts)


@dataclass(frozen=True)
class PolicyRow:
    """One policy over the seeds."""

    policy: Policy
    seeds: int
    met: int
    paid_hours_mean: float
    paid_cost_mean: float  # in units of one spot worker-hour's price
    bound_hours_mean: float  # the hindsight bound, the same for every policy of the seeds
    over_bound_mean: float  # paid hours over the seed's own bound, averaged where the bound is above zero
    makespan_hours_mean: float  # over the runs that finished
    paid_hours: tuple[float, ...] = field(default_factory=tuple)  # each seed's
    bound_hours: tuple[float, ...] = field(default_factory=tuple)  # each seed's
    met_seeds: tuple[int, ...] = field(default_factory=tuple)
    unfinished: int = 0  # runs that could not finish at all (missed deadlines)


def compare_policies(scenario: Scenario, deadline_seconds: float, max_paid: int, seeds: Sequence[int], *,
                     policies: Sequence[Policy] = tuple(Policy), shard_size: int = 5000, paid_price: float = 3.0,
                     tick_seconds: float = 60.0, trace: Trace | None = None, waves: int = 0,
                     wave_share: float = 0.5, wave_seconds: float = 3600.0) -> list[PolicyRow]:
    """Every policy over the same seeds (each seed's spot side the same for all of them):
    deadlines met, paid worker-hours, paid cost in spot worker-hours' prices, and the
    hindsight bound (from each seed's run without paid workers)."""
    traces = {seed: trace if trace is not None or not waves else wave_trace(
        scenario.workers, deadline_seconds, waves=waves, share=wave_share, wave_seconds=wave_seconds, seed=seed)
        for seed in seeds}
    bounds = {seed: simulate_paced(scenario, Pacing(deadline_seconds, max_paid, Policy.NONE, tick_seconds,
                                                    traces[seed]), shard_size, seed).bound_seconds
              for seed in seeds}
    rows = []
    for policy in policies:
        runs = [simulate_paced(scenario, Pacing(deadline_seconds, max_paid, policy, tick_seconds, traces[seed]),
                               shard_size, seed, bound_seconds=bounds[seed]) for seed in seeds]
        hours = tuple(r.paid_seconds / 3600 for r in runs)
        bounded = [r.paid_seconds / r.bound_seconds for r in runs if r.bound_seconds > 0]
        rows.append(PolicyRow(
            policy=policy, seeds=len(seeds), met=sum(r.met for r in runs),
            paid_hours_mean=statistics.fmean(hours) if hours else 0.0,
            paid_cost_mean=paid_price * (statistics.fmean(hours) if hours else 0.0),
            bound_hours_mean=statistics.fmean(bounds.values()) / 3600 if bounds else 0.0,
            over_bound_mean=statistics.fmean(bounded) if bounded else 0.0,
            makespan_hours_mean=statistics.fmean(finished) / 3600 if (finished := [
                r.makespan_seconds for r in runs if r.finished]) else math.inf,
            paid_hours=hours, bound_hours=tuple(bounds[s] / 3600 for s in seeds),
            met_seeds=tuple(r.seed for r in runs if r.met), unfinished=sum(not r.finished for r in runs)))
    return rows
