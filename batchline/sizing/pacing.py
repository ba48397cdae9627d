"""Holding the deadline: how many paid workers a job needs now (I7), by one rule.

Every launcher's pacer (local, Ray, Kubernetes) and the simulator ask `decide`;
no other module states the rule. It keeps no state of its own: everything it
reads (committed progress, the workers the store has seen, the paid workers
running now, the spend so far) comes from the store and the launcher each time,
so a pacer that restarts, or two that run at once, decide the same.

The rule is Uniform Progress (Wu et al., "Can't Be Late: Optimizing Spot
Instance Savings under Deadlines", NSDI 2024), for a job of many workers:

- **Expected progress** grows linearly from what was done when the version's
  run started (carried results and the planner's dead letters count as done at
  the start), from a restart overhead after the run start (the workers load
  their model first), to every record at the deadline: `ep(t)`. The run start
  is set by the first runner, launcher or pacer that opens the version for
  work, not by its first claim, which may never come. Committed progress `cp(t)` is the
  results and dead letters the version holds.
- **Before any rate is measured** the rule does not wait. A job with nothing
  computed is given two restart overheads from its run start to load; past
  them it is behind by definition. The rate of one worker is the one measured
  once results come; before that a prior (the rate an earlier version of the
  same name measured on the store, else `fallback.records_per_worker_second`);
  with neither, a job that is behind buys every paid worker it may, as it does
  when it is behind by definition.
- **Behind** (`cp(t) < ep(t)`): paid workers are bought, as many as bring the
  job back onto the line within the catch-up horizon (paid workers that start
  now produce only after the restart overhead `d`, their launch to their first
  claim), at least one and at most `fallback.workers`.
- **Hysteresis.** Paid workers that run are kept until `cp(t) >= ep(t + 2d)`:
  the job is then two restart overheads ahead, and they are reduced to the
  number that holds the line's pace beside the spot workers (none once spot
  capacity alone keeps it; with no spot worker at all, however far ahead,
  never the last one), never stopped and restarted tick after tick.
- **Safety net.** When the time left is less than the remaining work at every
  worker's rate (the spot workers seen now and every paid worker) plus `2d`,
  every paid worker is held to the end: the last moment at which the deadline
  can still be met.
- **The budget** (`fallback.max_cost`): no more paid workers run than the spend
  left pays for until the next decision and their stop (`stop_seconds`); with
  the budget spent the job is "at risk". Paid workers also hold it themselves
  (`batchline.worker.paid`), so it holds when no pacer runs.

The spot side is never bought or stopped here: spot workers come and go as the
cluster gives them. Paid workers are ordinary workers of the same version, so
I1-I5 hold whatever is decided.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from batchline.spec.deadline import DEFAULT_RESTART_OVERHEAD_SECONDS

# The catch-up horizon: paid workers started now are to bring the job back onto the line
# within this many restart overheads (they work for all but the first), and at least this
# share of the window, so a short overhead does not make a burst of the whole fleet.
CATCH_UP_OVERHEADS = 8
CATCH_UP_WINDOW_SHARE = 0.05


class Policy(StrEnum):
    """How paid workers are bought: batchline's rule (`uniform`), and the baselines the
    simulator compares it with."""

    NONE = "none"  # never
    ALWAYS = "always"  # every paid worker from the start to the end
    GREEDY = "greedy"  # every paid worker while behind, none otherwise, re-decided at each tick
    UNIFORM = "uniform"  # Uniform Progress: the rule above


@dataclass(frozen=True)
class Observation:
    """What a pacer knows at one moment, all of it read anew each time."""

    now: float
    started_at: float  # the version's run start (`open_run`), where the line starts
    deadline: float
    records: int  # the version's records
    done_at_start: int  # carried results and planner dead letters: done before any worker
    committed: int  # results plus dead letters now
    spot_workers: int  # spot workers the store counts as capacity (store.live_capacity)
    paid_workers: int  # paid workers it counts (launched ones not seen yet do not count)
    paid_running: int  # paid slots that exist now (seen or not): hysteresis holds these
    max_paid: int  # fallback.workers
    worker_rate: float  # records per second of one worker; 0: none measured and no prior
    restart_overhead: float = DEFAULT_RESTART_OVERHEAD_SECONDS
    # Paid worker-seconds the budget still pays for (None: no max_cost), and what a
    # decision must leave for: the time to the next one plus a worker's stop.
    budget_seconds: float | None = None
    stop_seconds: float = 0.0
    # How long the last records can take beyond the line: a stalled owner's lease runs out
    # before its records in flight are done again (the job's shards.lease_seconds).
    tail_seconds: float = 0.0


class Mode(StrEnum):
    DONE = "done"
    ON_TIME = "on time"
    BEHIND = "behind"
    HOLDING = "holding"  # ahead of the line, paid workers kept to keep its pace
    SAFETY_NET = "safety net"
    AT_RISK = "at risk"


@dataclass(frozen=True)
class Decision:
    paid: int  # paid workers to run now
    mode: Mode
    expected: float  # ep(now), records
    reason: str  # one line, as status and run show it

    def to_json(self) -> dict[str, object]:
        return {"paid": self.paid, "mode": str(self.mode), "expected": self.expected, "reason": self.reason}


def line_start(obs: Observation) -> float:
    """When the line starts to rise: a restart overhead after the run start, since no worker
    computes anything before it has loaded its model (its first claim, were one to come)."""
    return obs.started_at + obs.restart_overhead


def line_end(obs: Observation) -> float:
    """When the line reaches every record: before the deadline by the tail (a stalled
    owner's lease running out on the last records) and two restart overheads (the safety
    net's margin)."""
    return max(line_start(obs), obs.deadline - obs.tail_seconds - 2 * obs.restart_overhead)


def expected_progress(obs: Observation, at: float) -> float:
    """ep(at): records done by `at` on the line from `line_start` to `line_end`."""
    start = line_start(obs)
    window = line_end(obs) - start
    share = 1.0 if window <= 0 else min(1.0, max(0.0, (at - start) / window))
    return obs.done_at_start + (obs.records - obs.done_at_start) * share


def catch_up_horizon(obs: Observation) -> float:
    return max(CATCH_UP_OVERHEADS * obs.restart_overhead,
               CATCH_UP_WINDOW_SHARE * max(0.0, obs.deadline - obs.started_at), 1.0)


def line_rate(obs: Observation) -> float:
    """Records per second the line rises by."""
    window = max(1.0, line_end(obs) - line_start(obs))
    return (obs.records - obs.done_at_start) / window


def safety_net(obs: Observation) -> bool:
    """Whether even every worker there can be (the spot workers seen and every paid worker)
    has no more than `2d` of slack left: the last moment to hold all of them."""
    remaining = obs.records - obs.committed
    capacity = (obs.spot_workers + obs.max_paid) * obs.worker_rate
    if remaining <= 0:
        return False
    needed = math.inf if capacity <= 0 else remaining / capacity
    return obs.deadline - obs.now < needed + 2 * obs.restart_overhead


def loading(obs: Observation) -> bool:
    """Whether nothing is computed yet and the workers still have time to load: two restart
    overheads from the run start. Past them, nothing computed is behind by definition."""
    return obs.committed <= obs.done_at_start and obs.now < obs.started_at + 2 * obs.restart_overhead


def behind_line(obs: Observation) -> bool:
    """Behind the line, or (past the time to load) with nothing computed at all."""
    if loading(obs):
        return False
    return obs.committed < expected_progress(obs, obs.now) or obs.committed <= obs.done_at_start


def decide(obs: Observation, policy: Policy | str = Policy.UNIFORM) -> Decision:
    """The paid workers to run now, under `policy` (see the module's doc)."""
    policy = Policy(policy)
    expected = expected_progress(obs, obs.now)
    if obs.committed >= obs.records:
        return Decision(0, Mode.DONE, expected, "done")
    behind = behind_line(obs)
    if policy is Policy.NONE or obs.max_paid <= 0:
        wanted, mode = 0, Mode.BEHIND if behind else Mode.ON_TIME
    elif policy is Policy.ALWAYS:
        wanted, mode = obs.max_paid, Mode.BEHIND if behind else Mode.ON_TIME
    elif loading(obs):
        return _within_budget(obs, min(obs.max_paid, obs.paid_running), Mode.ON_TIME, expected,
                              "starting: nothing computed yet, the workers loading")
    elif policy is Policy.GREEDY:
        wanted, mode = (obs.max_paid, Mode.BEHIND) if behind else (0, Mode.ON_TIME)
    elif behind and (obs.worker_rate <= 0 or obs.committed <= obs.done_at_start):
        # No rate to size the catch-up with (none measured, no prior), or nothing computed past
        # the time to load: every paid worker it may, until results give a rate.
        return _within_budget(obs, obs.max_paid, Mode.BEHIND, expected,
                              f"behind with {'nothing computed' if obs.worker_rate > 0 else 'no rate measured'}: "
                              f"buying every paid worker ({obs.max_paid})")
    elif obs.worker_rate <= 0:
        return _within_budget(obs, min(obs.max_paid, obs.paid_running), Mode.ON_TIME, expected,
                              "on time: measuring the rate")
    else:
        wanted, mode = _uniform(obs, expected)
    return _within_budget(obs, wanted, mode, expected)


def _uniform(obs: Observation, expected: float) -> tuple[int, Mode]:
    rate = max(obs.worker_rate, 1e-9)
    spot = obs.spot_workers * obs.worker_rate
    if safety_net(obs):
        return obs.max_paid, Mode.SAFETY_NET
    held = max(obs.paid_running, obs.paid_workers)
    if obs.committed < expected:
        # Back onto the line by t + h: the spot and paid workers seen work all of h; the paid
        # workers started and not seen yet, and any started now, h - d.
        h = catch_up_horizon(obs)
        working = max(h - obs.restart_overhead, 1.0)
        gap = (expected_progress(obs, obs.now + h) - obs.committed - spot * h
               - rate * (obs.paid_workers * h + max(0, held - obs.paid_workers) * working))
        extra = math.ceil(gap / (rate * working)) if gap > 0 else 0
        return min(obs.max_paid, max(held + extra, 1)), Mode.BEHIND
    if held:
        # Not behind: as many of those running as keep the job two restart overheads ahead of
        # the line by the end of the horizon beside the spot workers there are now (so none
        # once spot capacity alone does), never more than run now: a paid worker is started
        # only when the job is behind, so none is stopped and started again tick after tick.
        # With no spot worker at all, however far ahead, never the last one: stopping it stops
        # the job, which is then surely behind later and buys it back, paying its restart twice.
        h = catch_up_horizon(obs)
        gap = expected_progress(obs, obs.now + h + 2 * obs.restart_overhead) - obs.committed - spot * h
        keep = max(0, math.ceil(gap / (rate * h) - 1e-9), 1 if obs.spot_workers == 0 else 0)
        if keep:
            return min(obs.max_paid, held, keep), Mode.HOLDING
    return 0, Mode.ON_TIME


def _within_budget(obs: Observation, wanted: int, mode: Mode, expected: float,
                   reason: str | None = None) -> Decision:
    affordable = wanted
    if obs.budget_seconds is not None:
        per_worker = max(obs.stop_seconds, 1e-9)
        affordable = min(wanted, max(0, math.floor(obs.budget_seconds / per_worker)))
    if affordable < wanted:
        return Decision(affordable, Mode.AT_RISK, expected,
                        f"at risk: paid budget spent ({affordable} of the {wanted} paid workers wanted)")
    if reason is not None:
        pass
    elif mode is Mode.DONE:
        reason = "done"
    elif mode is Mode.ON_TIME:
        reason = "on time"
    elif mode is Mode.BEHIND:
        reason = f"behind: buying {wanted} paid worker{'s' if wanted != 1 else ''}" if wanted else \
            "behind, and no paid capacity (fallback.workers)"
    elif mode is Mode.HOLDING:
        reason = f"on time: holding {wanted} paid worker{'s' if wanted != 1 else ''} to keep the pace"
    else:
        reason = f"safety net: every paid worker ({wanted}) to the end"
    return Decision(affordable, mode, expected, reason)


def worker_rate(measured: float, prior: float | None) -> float:
    """The rate of one worker the rule is given: the measured one once there is one, else the
    prior, else 0 (none: a job behind buys every paid worker it may)."""
    if measured > 0:
        return measured
    return prior if prior is not None and prior > 0 else 0.0


def observe(*, now: float, run_start: float, deadline: float, records: int, done_at_start: int, committed: int,
            spot_seen: int, paid_seen: int, paid_running: int, max_paid: int, measured_rate: float,
            prior_rate: float | None, restart_overhead: float, budget_seconds: float | None = None,
            stop_seconds: float = 0.0, tail_seconds: float = 0.0) -> Observation:
    """The rule's observation, built the same way by every launcher's pacer and the simulator:
    the line from the run start; as capacity, the spot and paid workers the store counts
    (`live_capacity`: loading, or holding a lease within their interval; paid, only as the
    worker of a running start; not the dead); the rate measured from what was committed,
    else the prior."""
    return Observation(now=now, started_at=run_start, deadline=deadline, records=records,
                       done_at_start=done_at_start, committed=committed, spot_workers=spot_seen,
                       paid_workers=paid_seen, paid_running=paid_running, max_paid=max_paid,
                       worker_rate=worker_rate(measured_rate, prior_rate), restart_overhead=restart_overhead,
                       budget_seconds=budget_seconds, stop_seconds=stop_seconds, tail_seconds=tail_seconds)


def hindsight_paid_seconds(work_seconds: float, spot_seconds: float) -> float:
    """The least paid worker-time that finishes by the deadline with the spot side known in
    hindsight: the work left once the spot workers did all they could (`spot_seconds`:
    their productive worker-seconds by the deadline, each restart's overhead taken out),
    in worker-seconds of one worker's rate."""
    return max(0.0, work_seconds - spot_seconds)
