"""The interruption simulator: the reference scenario's figures, and the model's behaviour."""

from __future__ import annotations

import statistics
from dataclasses import replace

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from batchline.sizing import simulate as sim
from batchline.sizing.simulate import REFERENCE, Strategy

SEEDS = sim.REFERENCE_SEEDS


@pytest.fixture(scope="module")
def table() -> dict[tuple[Strategy, int], list[sim.RunResult]]:
    return {
        (strategy, size): [sim.simulate(REFERENCE, strategy, size, seed) for seed in SEEDS]
        for strategy in Strategy
        for size in sim.REFERENCE_SHARD_SIZES
    }


def mean_hours(runs: list[sim.RunResult]) -> float:
    return statistics.fmean(r.makespan_seconds for r in runs) / 3600


def test_reference_ideal() -> None:
    work = REFERENCE.items / (REFERENCE.workers * REFERENCE.records_per_second) / 3600
    assert round(work, 2) == 1.49
    assert round(REFERENCE.ideal_seconds / 3600, 2) == 1.54


def test_appending_duplicates_rows_more_so_with_bigger_shards(table: dict) -> None:
    dups = [statistics.fmean(r.duplicate_rows for r in table[Strategy.APPEND_PER_SHARD, size])
            for size in sim.REFERENCE_SHARD_SIZES]
    assert dups[0] > 0
    assert dups == sorted(dups) and len(set(dups)) == len(dups)


def test_keyed_writes_leave_no_duplicates_and_no_gaps(table: dict) -> None:
    for (strategy, _), runs in table.items():
        for r in runs:
            assert r.missing_rows == 0
            assert r.stalls > 0  # there was something to duplicate
            if strategy is not Strategy.APPEND_PER_SHARD:
                assert r.duplicate_rows == 0


def test_keyed_per_record_is_fastest_at_5000(table: dict) -> None:
    by_size = {size: mean_hours(table[Strategy.KEYED_PER_RECORD, size]) for size in sim.REFERENCE_SHARD_SIZES}
    assert min(by_size, key=by_size.__getitem__) == 5_000
    for size in sim.REFERENCE_SHARD_SIZES:
        for other in (Strategy.APPEND_PER_SHARD, Strategy.KEYED_PER_SHARD):
            assert by_size[size] <= mean_hours(table[other, size])


def test_reference_makespan_over_five_seeds_is_within_sampling_error_of_181(table: dict) -> None:
    # A 5-seed mean of this cell has a standard error of about 0.05 h in this
    # model (per-seed sd 0.12 h), so 1.81 is pinned to two standard errors here
    # and to the model's long-run mean below.
    runs = table[Strategy.KEYED_PER_RECORD, 5_000]
    assert abs(mean_hours(runs) - 1.81) < 0.10
    assert abs(statistics.fmean(r.over_ideal for r in runs) - 1.18) < 0.07


def test_reference_makespan_long_run() -> None:
    runs = [sim.simulate(REFERENCE, Strategy.KEYED_PER_RECORD, 5_000, seed) for seed in range(100)]
    assert abs(mean_hours(runs) - 1.81) <= 0.02
    assert abs(statistics.fmean(r.over_ideal for r in runs) - 1.18) <= 0.01


def test_notices_and_tail_splitting_each_lower_makespan() -> None:
    def mean(sc: sim.Scenario) -> float:
        return mean_hours([sim.simulate(sc, Strategy.KEYED_PER_RECORD, 5_000, seed) for seed in SEEDS])

    plain = mean(REFERENCE)
    notice = mean(replace(REFERENCE, notice=True))
    tail = mean(replace(REFERENCE, tail_split=True))
    both = mean(sim.with_batchline(REFERENCE))
    assert notice < plain
    assert tail < plain
    assert both < min(notice, tail) * 1.005  # together at least as good as either alone


def test_batchline_features_bring_keyed_per_record_within_12_percent_of_ideal() -> None:
    scenario = sim.with_batchline(REFERENCE)
    runs = [sim.simulate(scenario, Strategy.KEYED_PER_RECORD, 5_000, seed) for seed in SEEDS]
    assert statistics.fmean(r.over_ideal for r in runs) <= 1.12
    assert sum(r.splits for r in runs) > 0
    assert all(r.missing_rows == 0 and r.duplicate_rows == 0 for r in runs)


def test_a_dead_worker_proven_dead_costs_less_than_its_lease_and_a_stalled_one_is_never_taken_back() -> None:
    def runs(sc: sim.Scenario) -> list[sim.RunResult]:
        return [sim.simulate(sc, Strategy.KEYED_PER_RECORD, 5_000, seed) for seed in SEEDS]

    deaths_only = replace(REFERENCE, stall_share=0.0)
    waited, taken = runs(deaths_only), runs(replace(deaths_only, take_back=True))
    assert sum(r.take_backs for r in taken) > 0 and mean_hours(taken) < mean_hours(waited)
    # A stall is a live worker: with only stalls there is nothing to prove dead.
    stalls_only = replace(REFERENCE, stall_share=1.0, take_back=True)
    assert sum(r.take_backs for r in runs(stalls_only)) == 0
    assert mean_hours(runs(stalls_only)) == mean_hours(runs(replace(stalls_only, take_back=False)))


def test_a_split_follows_the_stores_rule_and_never_moves_written_records() -> None:
    # One slow shard at the tail: a worker idle at the end splits off half of what the
    # owner has not started, again and again, and no record is lost or written twice.
    scenario = sim.Scenario(items=1_000, workers=2, records_per_second=10, interruptions_per_hour=0,
                            shard_overhead_seconds=0, model_load_seconds=0.001, tail_split=True,
                            pieces_per_shard=16, write_batch=1)
    split = sim.simulate(scenario, Strategy.KEYED_PER_RECORD, 1_000)
    whole = sim.simulate(replace(scenario, tail_split=False), Strategy.KEYED_PER_RECORD, 1_000)
    assert split.splits >= 1 and split.missing_rows == 0 and split.duplicate_rows == 0
    assert whole.makespan_seconds == pytest.approx(100, abs=0.01)
    # Two workers share it, less what is started before each split (two records in flight)
    # and the granularity of pieces.
    assert split.makespan_seconds < 0.6 * whole.makespan_seconds


def test_deterministic_for_a_seed() -> None:
    scenario = replace(sim.with_batchline(REFERENCE), waves_per_hour=0.5)
    a = sim.simulate(scenario, Strategy.KEYED_PER_RECORD, 5_000, seed=7)
    b = sim.simulate(scenario, Strategy.KEYED_PER_RECORD, 5_000, seed=7)
    c = sim.simulate(scenario, Strategy.KEYED_PER_RECORD, 5_000, seed=8)
    assert a == b
    assert a.makespan_seconds != c.makespan_seconds


@pytest.mark.parametrize("strategy", list(Strategy))
@pytest.mark.parametrize("features", [{}, {"notice": True}, {"tail_split": True}, {"waves_per_hour": 0.5}])
def test_lost_time_adds_up_to_the_gap_from_ideal(strategy: Strategy, features: dict) -> None:
    scenario = replace(REFERENCE, items=400_000, **features)
    r = sim.simulate(scenario, strategy, 2_000, seed=3)
    assert r.lost.total == pytest.approx(scenario.workers * (r.makespan_seconds - scenario.ideal_seconds))
    assert r.lost.redone >= -1e-6
    assert r.missing_rows == 0


def test_without_interruptions_the_makespan_is_the_ideal_plus_overhead() -> None:
    scenario = sim.Scenario(items=1_000, workers=2, records_per_second=10, interruptions_per_hour=0,
                            shard_overhead_seconds=0, model_load_seconds=180)
    assert sim.simulate(scenario, Strategy.KEYED_PER_RECORD, 100).makespan_seconds == pytest.approx(230)
    # Five shards each, 3 s apiece.
    with_overhead = replace(scenario, shard_overhead_seconds=3)
    assert sim.simulate(with_overhead, Strategy.KEYED_PER_RECORD, 100).makespan_seconds == pytest.approx(245)


def test_appenders_duplicate_on_stalls_not_on_deaths() -> None:
    deaths_only = replace(REFERENCE, items=400_000, stall_share=0.0)
    stalls_only = replace(REFERENCE, items=400_000, stall_share=1.0)
    assert all(sim.simulate(deaths_only, Strategy.APPEND_PER_SHARD, 5_000, s).duplicate_rows == 0 for s in SEEDS)
    assert all(sim.simulate(stalls_only, Strategy.APPEND_PER_SHARD, 5_000, s).duplicate_rows > 0 for s in SEEDS)


def test_keyed_per_shard_redoes_whole_shards_keyed_per_record_only_in_flight() -> None:
    shard = [sim.simulate(REFERENCE, Strategy.KEYED_PER_SHARD, 5_000, s) for s in SEEDS]
    record = [sim.simulate(REFERENCE, Strategy.KEYED_PER_RECORD, 5_000, s) for s in SEEDS]
    deaths = sum(r.deaths + r.stalls for r in record)
    # At most one write batch (16 records) lost per interruption.
    assert sum(r.lost.redone for r in record) <= deaths * 16 / REFERENCE.records_per_second + 1e-6
    assert sum(r.lost.redone for r in shard) > 10 * sum(r.lost.redone for r in record)


def test_reclaim_waves_hurt_less_with_notices() -> None:
    waves = replace(REFERENCE, waves_per_hour=2.0)
    plain = [sim.simulate(waves, Strategy.KEYED_PER_RECORD, 5_000, s) for s in SEEDS]
    notice = [sim.simulate(replace(waves, notice=True), Strategy.KEYED_PER_RECORD, 5_000, s) for s in SEEDS]
    assert sum(r.waves for r in plain) >= len(SEEDS)
    assert mean_hours(plain) > mean_hours([sim.simulate(REFERENCE, Strategy.KEYED_PER_RECORD, 5_000, s)
                                           for s in SEEDS])
    assert mean_hours(notice) < mean_hours(plain)
    # A wave takes half the fleet at once: far more deaths than the background rate alone.
    assert statistics.fmean(r.deaths for r in plain) > 1.2 * statistics.fmean(
        r.deaths for r in [sim.simulate(REFERENCE, Strategy.KEYED_PER_RECORD, 5_000, s) for s in SEEDS])


def test_recommend_shard_size_for_the_reference() -> None:
    sizes = sim.candidate_shard_sizes(2_000_000, 20, 18.7, 3)
    chosen = sim.recommend_shard_size(2_000_000, 20, 18.7, 1.0)
    assert chosen in sizes
    assert chosen == sim.recommend_shard_size(2_000_000, 20, 18.7, 1.0)
    choice = sim.choose_shard_size(sim.with_batchline(REFERENCE))
    best = min(mean for _, mean in choice.curve)
    assert dict(choice.curve)[choice.shard_size] <= best * (1 + sim.SHARD_SIZE_TOLERANCE)
    assert choice.shard_size == chosen
    assert 1_000 <= chosen <= 10_000


def test_costlier_shards_make_bigger_shards() -> None:
    cheap = sim.recommend_shard_size(2_000_000, 20, 18.7, 1.0, shard_overhead_seconds=3)
    dear = sim.recommend_shard_size(2_000_000, 20, 18.7, 1.0, shard_overhead_seconds=60)
    assert dear > cheap


def test_candidate_sizes_respect_their_bounds() -> None:
    sizes = sim.candidate_shard_sizes(2_000_000, 20, 18.7, 3)
    assert sizes == sorted(sizes)
    assert sizes[0] >= 9 * 3 * 18.7  # overhead at most a tenth of a shard's time
    assert sizes[-1] == 100_000  # one worker's share
    assert sim.candidate_shard_sizes(10, 20, 18.7, 0) == [1]


def test_recommend_refuses_a_job_that_never_finishes() -> None:
    with pytest.raises(sim.SimulationDiverged):
        sim.recommend_shard_size(200_000, 4, 18.7, 200.0)


@pytest.mark.parametrize(
    "bad",
    [{"workers": 0}, {"records_per_second": 0}, {"stall_share": 1.5}, {"interruptions_per_hour": -1}],
)
def test_scenario_refuses_nonsense(bad: dict) -> None:
    with pytest.raises(ValueError):
        replace(REFERENCE, **bad)


@settings(max_examples=60, deadline=None)
@given(
    items=st.integers(1, 30_000),
    workers=st.integers(1, 10),
    rate=st.floats(1, 50),
    interruptions=st.sampled_from([0.0, 1.0, 6.0]),
    stall_share=st.floats(0, 1),
    overhead=st.sampled_from([0.0, 3.0, 30.0]),
    notice=st.booleans(),
    tail_split=st.booleans(),
    waves=st.sampled_from([0.0, 2.0]),
    strategy=st.sampled_from(list(Strategy)),
    shard_size=st.integers(1, 10_000),
    seed=st.integers(0, 1_000),
)
def test_invariants_hold_for_any_scenario(items: int, workers: int, rate: float, interruptions: float,
                                          stall_share: float, overhead: float, notice: bool, tail_split: bool,
                                          waves: float, strategy: Strategy, shard_size: int, seed: int) -> None:
    scenario = sim.Scenario(
        items=items, workers=workers, records_per_second=rate, interruptions_per_hour=interruptions,
        stall_share=stall_share, shard_overhead_seconds=overhead, notice=notice, tail_split=tail_split,
        waves_per_hour=waves,
    )
    try:
        r = sim.simulate(scenario, strategy, shard_size, seed)
    except sim.SimulationDiverged:
        # A whole-shard strategy whose shards outlast the time between
        # interruptions never finishes; per-record writes always progress.
        assert strategy is not Strategy.KEYED_PER_RECORD
        assume(False)
        return
    assert r.missing_rows == 0  # every record ends up written
    if strategy is not Strategy.APPEND_PER_SHARD:
        assert r.duplicate_rows == 0
    assert r.lost.total == pytest.approx(workers * (r.makespan_seconds - scenario.ideal_seconds), abs=1e-6)
    assert r.makespan_seconds >= scenario.ideal_seconds - 1e-6
