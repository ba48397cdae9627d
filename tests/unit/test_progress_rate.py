"""The progress line's rate and ETA: two significant figures, and an ETA that holds still on a
steady run whose outcomes are committed in bursts (a write batch, a shard's end)."""

from __future__ import annotations

import pytest

from batchline.ops.runner import RATE_WINDOW_SECONDS, RateMeter
from batchline.spec.deadline import format_rate


@pytest.mark.parametrize(("rate", "text"), [
    (0.06, "0.060"), (0.0634, "0.063"), (0.004, "0.0040"), (1.234, "1.2"), (9.96, "10"), (47.2, "47"),
    (99.4, "99"), (99.6, "100"), (123.4, "123"), (12_345.6, "12,346"), (0.0, "0"),
])
def test_a_rate_keeps_two_significant_figures(rate: float, text: str) -> None:
    assert format_rate(rate) == text


def steady_bursts(seconds: int, burst_every: int = 45, per_burst: int = 900) -> list[tuple[float, int]]:
    """A steady run of 20 outcomes a second, committed 900 at a time every 45 s, sampled each second."""
    return [(float(t), (t // burst_every) * per_burst) for t in range(seconds)]


def etas(meter_rate: list[float | None], samples: list[tuple[float, int]], total: int) -> dict[int, float]:
    return {int(t): (total - done) / rate for (t, done), rate in zip(samples, meter_rate, strict=True)
            if rate}


def windowed(samples: list[tuple[float, int]]) -> list[float | None]:
    """The rate over the last minute's samples, as the progress line had it."""
    out: list[float | None] = []
    for i, (t, done) in enumerate(samples):
        first = next(j for j in range(i + 1) if t - samples[j][0] <= RATE_WINDOW_SECONDS)
        t0, d0 = samples[first]
        out.append((done - d0) / (t - t0) if t - t0 >= 1.0 else None)
    return out


def test_on_a_steady_run_the_eta_shown_a_minute_apart_moves_by_at_most_ten_percent() -> None:
    total = 20 * 3 * 3600  # three hours of work at 20 a second
    samples = steady_bursts(2 * 3600)
    meter = RateMeter()
    smoothed = etas([meter.add(t, done) for t, done in samples], samples, total)
    # From the first ten minutes on, while an hour or more is left.
    moves = [abs(smoothed[t + 60] - smoothed[t]) / smoothed[t] for t in range(600, 2 * 3600 - 60, 60)]
    assert max(moves) <= 0.10, max(moves)
    # The rate a one-minute window gave swung with each burst: the regression this replaces.
    window = etas(windowed(samples), samples, total)
    swings = [abs(window[t + 60] - window[t]) / window[t] for t in range(600, 2 * 3600 - 60, 60)
              if t in window and t + 60 in window]
    assert max(swings) > 0.10


def test_the_rate_is_the_average_since_the_first_sample_at_first_then_follows_changes_and_stalls() -> None:
    meter = RateMeter(window=300.0)
    assert meter.add(0.0, 0) is None
    assert meter.add(10.0, 100) == pytest.approx(10.0)
    # The run doubles its pace for good: within a window the rate is the new one.
    done, now = 100, 10.0
    rate: float | None = None
    for _ in range(1000):
        now += 1.0
        done += 10 if now < 300 else 20
        rate = meter.add(now, done)
    assert rate == pytest.approx(20.0, rel=0.01)
    # Then nothing is committed: past twice the usual gap the rate falls instead of holding.
    for _ in range(120):
        now += 1.0
        rate = meter.add(now, done)
    assert rate is not None and rate < 20.0 * 300 / 420 + 0.1
