"""The pacing rule (batchline.sizing.pacing) and the simulator's policies and hindsight bound
(batchline.sizing.paced), each on cases computed by hand."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from batchline.errors import BatchlineError
from batchline.sizing.paced import Pacing, Trace, simulate_paced, wave_trace
from batchline.sizing.pacing import (
    Mode,
    Observation,
    Policy,
    decide,
    expected_progress,
    line_end,
    worker_rate,
)
from batchline.sizing.simulate import Scenario

# The run started at -100 s; a line from 0 (a restart overhead later: the workers load first) to
# every record at 9,800 s (the deadline, 10,000 s, less 2d): 10 records a second. One worker does
# 1 record a second; the catch-up horizon is max(8d, 5% of the window) = 800 s.
BASE = Observation(now=500.0, started_at=-100.0, deadline=10_000.0, records=98_000, done_at_start=0, committed=5_000,
                   spot_workers=5, paid_workers=0, paid_running=0, max_paid=20, worker_rate=1.0,
                   restart_overhead=100.0)


def test_the_line_runs_from_what_was_done_at_the_start_to_every_record_before_the_deadline() -> None:
    obs = replace(BASE, done_at_start=9_800, tail_seconds=200.0)
    assert line_end(obs) == 10_000 - 200 - 2 * 100
    # Flat for the restart overhead after the run start (-100 s), the workers loading.
    assert expected_progress(obs, -100.0) == expected_progress(obs, 0.0) == 9_800
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


# --- before any rate: the run start, the time to load, the prior -----------------------------

# 50 s into a run of a 10,000 s window, nothing computed yet: the workers are loading (2d = 200 s).
STARTING = replace(BASE, now=50.0, committed=0, spot_workers=0, worker_rate=0.0)


def test_nothing_computed_within_two_restart_overheads_of_the_run_start_buys_nothing_yet() -> None:
    decision = decide(STARTING)
    assert (decision.paid, decision.mode) == (0, Mode.ON_TIME)
    assert decision.reason == "starting: nothing computed yet, the workers loading"
    # Paid workers already running are kept while they load.
    assert decide(replace(STARTING, paid_running=3)).paid == 3


@pytest.mark.parametrize("rate", [0.0, 1.0])
def test_nothing_computed_past_two_restart_overheads_is_behind_by_definition_and_buys_every_paid_worker(
        rate: float) -> None:
    # Not behind the line by much at 201 s (ep = 2,010), but nothing computed at all: with a
    # prior rate as without one, every paid worker it may.
    decision = decide(replace(STARTING, now=201.0, worker_rate=rate))
    assert (decision.paid, decision.mode) == (20, Mode.BEHIND)
    assert decision.reason.startswith("behind with nothing computed" if rate else "behind with no rate measured")
    # Within the budget all the same.
    capped = decide(replace(STARTING, now=201.0, worker_rate=rate, budget_seconds=500.0, stop_seconds=100.0))
    assert (capped.paid, capped.mode) == (5, Mode.AT_RISK)
    # Carried results are done at the start: they are not "computed".
    carried = replace(STARTING, now=201.0, done_at_start=9_000, committed=9_000)
    assert decide(carried).paid == 20


def test_behind_without_a_measured_rate_or_a_prior_buys_every_paid_worker() -> None:
    # Something computed (so not behind by definition), behind the line, and no rate to size with.
    decision = decide(replace(BASE, committed=4_000, worker_rate=0.0))
    assert (decision.paid, decision.mode) == (20, Mode.BEHIND)
    # On time without a rate: nothing bought, the running kept.
    assert decide(replace(BASE, committed=20_000, worker_rate=0.0, paid_running=2)).paid == 2


def test_the_rule_is_given_the_measured_rate_else_the_prior_else_none() -> None:
    assert worker_rate(3.0, 2.0) == 3.0
    assert worker_rate(0.0, 2.0) == 2.0
    assert worker_rate(0.0, None) == 0.0 and worker_rate(0.0, 0.0) == 0.0


def test_regression_the_pacer_stopped_its_only_worker_when_every_spot_worker_was_gone() -> None:
    # Far ahead of the line (by 11,000 records, past ep at the horizon) with no spot worker left: the
    # paid workers are reduced, but never to none (which would stop the job, then buy a worker back
    # once behind, paying its restart twice).
    ahead = replace(BASE, committed=16_000, spot_workers=0, paid_running=12, paid_workers=12)
    decision = decide(ahead)
    assert (decision.paid, decision.mode) == (1, Mode.HOLDING)
    assert decide(replace(ahead, paid_running=1, paid_workers=1)).paid == 1
    # Nearer the line, as many as keep it two restart overheads ahead by the horizon, as ever:
    # 15,000 - 11,000 to make up in 800 s at 1 a second.
    assert decide(replace(ahead, committed=11_000)).paid == 5
    # With spot workers there, far ahead still stops them all (spot may hold the line).
    assert decide(replace(ahead, spot_workers=5)).paid == 0


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


def test_a_night_without_spot_capacity_is_a_missed_deadline_for_none_and_bought_by_the_rule() -> None:
    nothing = Trace(((0.0, 0),))
    none = simulate_paced(SMALL, Pacing(2_500.0, 4, Policy.NONE, 10.0, nothing), 50)
    # It can never finish: a missed deadline, not an exception, its bound all the work.
    assert not none.met and not none.finished and none.bound_seconds == pytest.approx(5_000.0)
    uniform = simulate_paced(SMALL, Pacing(2_500.0, 4, Policy.UNIFORM, 10.0, nothing), 50)
    # Nothing computed 2d after the start: every paid worker at the first tick past 200 s, with
    # no rate handed to it; then as the line needs them, never fewer than one.
    assert uniform.met and uniform.finished and uniform.paid_starts >= 4
    assert uniform.duplicate_rows == uniform.missing_rows == 0
    assert uniform.bound_seconds == pytest.approx(5_000.0)
    assert uniform.bound_seconds <= uniform.paid_seconds <= 1.25 * uniform.bound_seconds


def test_the_simulator_measures_the_rate_rather_than_being_told_it() -> None:
    # The spot workers commit before any decision needs a rate, so the rate the rule is given is
    # the one measured from what was committed: a prior ten times too high or too low changes
    # nothing (were it kept, the runs would differ: 2,244 s and 2,104 paid worker-seconds).
    runs = [simulate_paced(SMALL, Pacing(2_500.0, 4, Policy.UNIFORM, 10.0, TRACE, prior_rate=prior), 50)
            for prior in (None, 10.0, 0.1)]
    assert runs[0].met and runs[0] == runs[1] == runs[2]


def test_the_spot_gone_at_the_end_of_a_trace_never_crashes_the_comparison() -> None:
    # The spot workers leave for good at 600 s: none cannot finish; every policy gets a row.
    gone = Trace(((0.0, 2), (600.0, 0)))
    runs = {p: simulate_paced(SMALL, Pacing(2_500.0, 4, p, 10.0, gone), 50) for p in Policy}
    assert not runs[Policy.NONE].finished
    assert runs[Policy.UNIFORM].met and runs[Policy.ALWAYS].met and runs[Policy.GREEDY].met


def test_a_json_availability_trace_is_read_from_an_offset_and_scaled_to_the_spot_workers(tmp_path: Path) -> None:
    path = tmp_path / "zone.json"
    path.write_text('{"metadata": {"gap_seconds": 100}, "data": [1, 1, 0, 0, 1, 0]}')
    assert Trace.read(path, workers=8).points == ((0.0, 8), (200.0, 0), (400.0, 8), (500.0, 0))
    # From 250 s on: what held at 250 s (none) first, then the rest shifted.
    assert Trace.read(path, workers=8, start_seconds=250.0).points == ((0.0, 0), (150.0, 8), (250.0, 0))
    # Past its end the last point holds.
    assert Trace.read(path, workers=8, start_seconds=10_000.0).points == ((0.0, 0),)
    # A trace of counts is taken as it is.
    path.write_text('{"metadata": {"gap_seconds": 60}, "data": [3, 2, 2, 5]}')
    assert Trace.read(path, workers=8).points == ((0.0, 3), (60.0, 2), (180.0, 5))


@pytest.mark.parametrize(("text", "why"), [
    ('{"metadata": {}, "data": [1]}', "needs metadata.gap_seconds"),
    ('{"metadata": {"gap_seconds": -5}, "data": [1]}', "needs metadata.gap_seconds"),
    ('{"metadata": {"gap_seconds": 5}, "data": []}', "data is a list of whole numbers"),
    ('{"metadata": {"gap_seconds": 5}, "data": [1, -1]}', "data is a list of whole numbers"),
    ('{"metadata": {"gap_seconds": 5}, "data": [1, 0.5]}', "data is a list of whole numbers"),
    ('{"metadata": {"gap_seconds": 5}, "data": [1, true]}', "data is a list of whole numbers"),
    ('{"metadata": {"gap_seconds": 5}, "data": [1, 0', "not JSON"),
])
def test_a_json_trace_that_cannot_be_read_exactly_is_refused_in_one_line(tmp_path: Path, text: str,
                                                                         why: str) -> None:
    path = tmp_path / "zone.json"
    path.write_text(text)
    with pytest.raises(BatchlineError, match=why) as raised:
        Trace.load(path, workers=4)
    assert "\n" not in str(raised.value) and str(raised.value).startswith("--spot-trace ")
    with pytest.raises(BatchlineError, match="no such file"):
        Trace.load(tmp_path / "missing.json", workers=4)
    with pytest.raises(BatchlineError, match="start offset cannot be negative"):
        Trace.load(path.with_name("ok.json") if path.with_name("ok.json").write_text(
            '{"metadata": {"gap_seconds": 5}, "data": [1]}') else path, workers=4, start_seconds=-1)
