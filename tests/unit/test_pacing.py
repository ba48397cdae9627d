"""The pacing rule (batchline.sizing.pacing) and the simulator's policies and hindsight bound
(batchline.sizing.paced), each on cases computed by hand."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from batchline.sizing.paced import Pacing, Trace, simulate_paced, wave_trace
from batchline.sizing.pacing import Mode, Observation, Policy, decide, expected_progress, line_end
from batchline.sizing.simulate import Scenario

# A line from 0 to every record at 9,800 s (the deadline, 10,000 s, less 2d): 10 records a second.
# One worker does 1 record a second; the catch-up horizon is max(8d, 5% of the window) = 800 s.
BASE = Observation(now=500.0, started_at=0.0, deadline=10_000.0, records=98_000, done_at_start=0, committed=5_000,
                   spot_workers=5, paid_workers=0, paid_running=0, max_paid=20, worker_rate=1.0,
                   restart_overhead=100.0)


def test_the_line_runs_from_what_was_done_at_the_start_to_every_record_before_the_deadline() -> None:
    obs = replace(BASE, done_at_start=9_800, tail_seconds=200.0)
    assert line_end(obs) == 10_000 - 200 - 2 * 100
    assert expected_progress(obs, 0.0) == 9_800
    assert expected_progress(obs, 4_800.0) == pytest.approx(9_800 + (98_000 - 9_800) * 0.5)
    assert expected_progress(obs, 20_000.0) == 98_000


def test_on_the_line_without_paid_workers_nothing_is_bought() -> None:
    decision = decide(BASE)
    assert (decision.paid, decision.mode, decision.reason) == (0, Mode.ON_TIME, "on time")
    assert decision.expected == 5_000


def test_behind_it_buys_what_brings_the_job_back_onto_the_line_within_the_horizon() -> None:
    # ep(1300) = 13,000; spot adds 5 x 800 = 4,000 by then; 4,000 committed: a gap of 5,000 records,
    # which paid workers started now make up in 800 - 100 s at 1 record a second: 8 of them.
    decision = decide(replace(BASE, committed=4_000))
    assert (decision.paid, decision.mode, decision.reason) == (8, Mode.BEHIND, "behind: buying 8 paid workers")
    # Never fewer than run already, never more than fallback.workers.
    assert decide(replace(BASE, committed=4_000, paid_running=11)).paid == 11
    assert decide(replace(BASE, committed=4_000, max_paid=3)).paid == 3
    # Behind by a little, spot would close it alone: still at least one.
    assert decide(replace(BASE, committed=4_990, spot_workers=30)).paid == 1


def test_paid_workers_are_held_and_then_reduced_to_what_keeps_two_overheads_ahead() -> None:
    # 6 running, just on the line: to be 2d ahead of ep(500 + 800 + 200) = 15,000 by the horizon,
    # beside 4,000 from spot, 15,000 - 5,000 - 4,000 = 6,000 in 800 s: 8, capped at the 6 running.
    held = decide(replace(BASE, paid_running=6, paid_workers=6))
    assert (held.paid, held.mode) == (6, Mode.HOLDING)
    # Far ahead: 6,000 more records committed leave 0 to make up; they all stop.
    assert decide(replace(BASE, committed=11_000, paid_running=6, paid_workers=6)).paid == 0
    # Half way: 3,200 to make up in 800 s: 4 of the 6.
    reduced = decide(replace(BASE, committed=7_800, paid_running=6, paid_workers=6))
    assert (reduced.paid, reduced.mode) == (4, Mode.HOLDING)
    assert reduced.reason == "on time: holding 4 paid workers to keep the pace"


def test_the_safety_net_holds_every_paid_worker_when_no_slack_is_left() -> None:
    # 1,000 s left, 40,000 records to go: even 5 spot and 20 paid need 1,600 s.
    decision = decide(replace(BASE, now=9_000.0, committed=58_000))
    assert (decision.paid, decision.mode) == (20, Mode.SAFETY_NET)
    # With 2d of slack to spare it is not the safety net yet (ahead of the line: nothing).
    assert decide(replace(BASE, now=9_000.0, committed=97_000 - 25 * 700)).mode is not Mode.SAFETY_NET


def test_the_budget_caps_the_paid_workers_and_says_the_job_is_at_risk() -> None:
    # 300 worker-seconds left; each paid worker costs 100 s until it can be stopped: 3 of the 8 wanted.
    decision = decide(replace(BASE, committed=4_000, budget_seconds=300.0, stop_seconds=100.0))
    assert (decision.paid, decision.mode) == (3, Mode.AT_RISK)
    assert decision.reason == "at risk: paid budget spent (3 of the 8 paid workers wanted)"
    assert decide(replace(BASE, committed=4_000, budget_seconds=0.0, stop_seconds=100.0)).paid == 0
    assert decide(replace(BASE, committed=4_000, budget_seconds=10_000.0, stop_seconds=100.0)).paid == 8


def test_done_or_ahead_buys_nothing_whatever_the_policy_but_always() -> None:
    done = replace(BASE, committed=98_000)
    assert all(decide(done, p).paid == 0 for p in Policy)
    ahead = replace(BASE, committed=20_000)
    assert [decide(ahead, p).paid for p in Policy] == [0, 20, 0, 0]
    behind = replace(BASE, committed=4_000)
    assert [decide(behind, p).paid for p in Policy] == [0, 20, 20, 8]


# --- the simulator's policies and bound ------------------------------------------------------

# Two spot workers at 1 record a second, 100 s to load, no interruptions and no per-shard cost.
SMALL = Scenario(items=5_000, workers=2, records_per_second=1.0, interruptions_per_hour=0.0,
                 model_load_seconds=100.0, shard_overhead_seconds=0.0, lease_seconds=300.0, renew_seconds=10.0,
                 notice=True, take_back=True, tail_split=True)
# One of them is reclaimed from 1,000 s to 2,000 s; the deadline is 2,500 s.
TRACE = Trace(((0.0, 2), (1_000.0, 1), (2_000.0, 2)))


def test_the_hindsight_bound_is_the_work_the_spot_workers_could_not_do_by_the_deadline() -> None:
    # Spot uptime by 2,500 s, loads taken out: 2,400 s of one, and 900 s + 400 s of the other
    # (reloaded at 2,000 s): 3,700 worker-seconds of 5,000 records' work, so 1,300 paid ones.
    none = simulate_paced(SMALL, Pacing(2_500.0, 4, Policy.NONE, 10.0, TRACE), 50)
    assert none.spot_seconds == pytest.approx(3_700.0)
    assert none.bound_seconds == pytest.approx(1_300.0)
    assert not none.met and none.paid_seconds == 0.0


def test_each_policy_is_measured_against_the_same_bound_and_always_pays_from_start_to_end() -> None:
    runs = {p: simulate_paced(SMALL, Pacing(2_500.0, 4, p, 10.0, TRACE), 50) for p in Policy}
    assert all(r.bound_seconds == pytest.approx(1_300.0) for r in runs.values())
    always = runs[Policy.ALWAYS]
    assert always.met and always.paid_starts == 4
    assert always.paid_seconds == pytest.approx(4 * always.makespan_seconds)
    for policy in (Policy.GREEDY, Policy.UNIFORM):
        assert runs[policy].met and runs[policy].paid_seconds >= runs[policy].bound_seconds
        assert runs[policy].duplicate_rows == runs[policy].missing_rows == 0
    assert runs[Policy.UNIFORM].paid_seconds < always.paid_seconds


def test_wave_traces_take_a_share_of_the_spot_workers_for_each_wave() -> None:
    trace = wave_trace(20, 7_200.0, waves=2, share=0.5, wave_seconds=3_600.0, seed=4)
    assert trace.at(0.0) in (20, 10) and min(n for _t, n in trace.points) in (5, 10)
    assert trace.points[-1][1] == 20
    assert wave_trace(20, 7_200.0, waves=2, seed=4) == trace  # seeded


def test_a_capacity_trace_file_is_read_or_refused_by_line(tmp_path: Path) -> None:
    path = tmp_path / "spot.trace"
    path.write_text("# seconds workers\n0 20\n3600, 10  # a wave\n\n7200 20\n")
    assert Trace.read(path).points == ((0.0, 20), (3600.0, 10), (7200.0, 20))
    path.write_text("0 20\n3600 ten\n")
    with pytest.raises(ValueError, match=r"spot.trace:2: a trace line is SECONDS WORKERS"):
        Trace.read(path)
    path.write_text("100 20\n50 10\n")
    with pytest.raises(ValueError, match="times must rise"):
        Trace.read(path)
