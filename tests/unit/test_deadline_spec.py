"""The spec's `deadline` (a time or a window from the first claim) and `fallback` section:
read exactly, refused with the field named, and neither part of the job version (I2)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from batchline.errors import SpecError
from batchline.spec import load_spec
from batchline.spec.deadline import format_duration
from tests.unit.test_spec import BASE, write


def spec_with(tmp_path: Path, **top: Any) -> Any:
    return load_spec(write(tmp_path, {**json.loads(json.dumps(BASE)), **top}))


@pytest.mark.parametrize(("text", "seconds"), [("6h", 21_600), ("90m", 5_400), ("1h30m", 5_400), ("2d", 172_800),
                                               ("45s", 45), ("1d2h", 93_600), ("0.5h", 1_800)])
def test_a_window_counts_from_the_first_claim(tmp_path: Path, text: str, seconds: float) -> None:
    deadline = spec_with(tmp_path, deadline=text).deadline
    assert deadline.window == seconds and deadline.at is None and deadline.text == text
    assert deadline.resolve(1_000.0, 5_000.0) == 1_000.0 + seconds  # from the first claim
    assert deadline.resolve(None, 5_000.0) == 5_000.0 + seconds  # not claimed yet: from now


def test_an_absolute_deadline_is_a_time_and_is_refused_once_past(tmp_path: Path) -> None:
    deadline = spec_with(tmp_path, deadline="2026-12-01T06:00:00Z").deadline
    assert deadline.at == 1_796_104_800.0
    assert deadline.resolve(0.0, 0.0) == deadline.at
    assert deadline.refusal(deadline.at - 1) is None
    refusal = deadline.refusal(deadline.at + 60)
    assert refusal is not None and "deadline 2026-12-01T06:00:00Z is already past" in refusal


@pytest.mark.parametrize(("value", "why"), [
    ("0h", "is a window of zero"), ("0m0s", "is a window of zero"),
    ("tomorrow", "is neither an ISO 8601 time"), ("6 hours", "is neither an ISO 8601 time"),
    ("h", "is neither an ISO 8601 time"),
])
def test_a_deadline_that_is_neither_a_time_nor_a_window_is_refused(tmp_path: Path, value: str, why: str) -> None:
    with pytest.raises(SpecError, match=f"deadline: .*{why}"):
        spec_with(tmp_path, deadline=value)


@pytest.mark.parametrize(("fallback", "why"), [
    ({"workers": 0}, r"fallback\.workers"),
    ({}, r"fallback\.workers"),
    ({"workers": 2, "cost_per_worker_hour": 3, "max_cost": 2.5}, r"fallback\.max_cost: 2\.5 is below one paid "
                                                                 r"worker-hour \(3\)"),
    ({"workers": 2, "max_cost": 10}, r"fallback\.max_cost: needs fallback\.cost_per_worker_hour"),
    ({"workers": 2, "cost_per_worker_hour": -1}, r"fallback\.cost_per_worker_hour"),
    ({"workers": 2, "restart_overhead_seconds": 0}, r"fallback\.restart_overhead_seconds"),
    ({"workers": 2, "cost_per_workerhour": 3}, r"fallback\.cost_per_workerhour: unknown field"),
    ({"workers": 2, "records_per_worker_second": 0}, r"fallback\.records_per_worker_second: must be above 0"),
    ({"workers": 2, "records_per_worker_second": -2}, r"fallback\.records_per_worker_second"),
    ({"workers": 2, "records_per_worker_second": "fast"}, r"fallback\.records_per_worker_second"),
    ({"workers": 2, "restart_overhead_seconds": 60, "launch_timeout_seconds": 30},
     r"fallback\.launch_timeout_seconds: 30 is below the restart overhead \(60 s\)"),
    ({"workers": 2, "launch_timeout_seconds": 0}, r"fallback\.launch_timeout_seconds"),
])
def test_a_fallback_that_could_not_be_meant_is_refused_naming_the_field(
        tmp_path: Path, fallback: dict[str, Any], why: str) -> None:
    with pytest.raises(SpecError, match=why):
        spec_with(tmp_path, deadline="6h", fallback=fallback)


def test_a_fallback_without_a_deadline_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="fallback: buys paid workers to hold a deadline: give deadline too"):
        spec_with(tmp_path, fallback={"workers": 2})


def test_neither_the_deadline_nor_the_fallback_is_part_of_the_version(tmp_path: Path) -> None:
    versions = set()
    for i, top in enumerate([{}, {"deadline": "6h"}, {"deadline": "2030-01-01T00:00:00Z"},
                             {"deadline": "6h", "fallback": {"workers": 20, "cost_per_worker_hour": 3.1,
                                                             "max_cost": 500, "spot_cost_per_worker_hour": 1}}]):
        folder = tmp_path / str(i)
        folder.mkdir()
        versions.add(spec_with(folder, **top).version("sha256:" + "0" * 64))
    assert len(versions) == 1


def test_the_stored_spec_keeps_what_it_was_given(tmp_path: Path) -> None:
    spec = spec_with(tmp_path, deadline="1h30m", fallback={"workers": 3, "cost_per_worker_hour": 2.5, "max_cost": 40})
    stored = spec.to_dict()
    assert stored["deadline"] == "1h30m"
    assert stored["fallback"] == {"workers": 3, "cost_per_worker_hour": 2.5, "max_cost": 40.0,
                                  "restart_overhead_seconds": 180.0}


@pytest.mark.parametrize(("seconds", "text"), [(7, "7s"), (125, "2m05s"), (3723, "1h02m03s")])
def test_durations_read_as_progress_lines_say_them(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_a_paid_start_is_stale_after_three_restart_overheads_unless_the_spec_says(tmp_path: Path) -> None:
    fallback = spec_with(tmp_path, deadline="6h", fallback={"workers": 2, "restart_overhead_seconds": 40}).fallback
    assert fallback is not None and fallback.launch_timeout_seconds == 120.0
    assert fallback.records_per_worker_second is None
    given = spec_with(tmp_path, deadline="6h", fallback={"workers": 2, "restart_overhead_seconds": 40,
                                                        "launch_timeout_seconds": 50,
                                                        "records_per_worker_second": 2.5}).fallback
    assert given is not None and given.launch_timeout_seconds == 50.0 and given.records_per_worker_second == 2.5
    assert given.to_dict()["launch_timeout_seconds"] == 50.0


@pytest.mark.parametrize("value", ["0", "-1", "fast", "61", "nan"])
def test_a_heartbeat_interval_that_could_not_be_meant_is_refused_in_one_line(
        monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    from batchline.errors import BatchlineError
    from batchline.worker.heartbeat import heartbeat_seconds

    monkeypatch.setenv("BATCHLINE_HEARTBEAT_SECONDS", value)
    with pytest.raises(BatchlineError, match=r"BATCHLINE_HEARTBEAT_SECONDS=.*from 0\.1 to 60"):
        heartbeat_seconds()
    monkeypatch.setenv("BATCHLINE_HEARTBEAT_SECONDS", "2.5")
    assert heartbeat_seconds() == 2.5
    monkeypatch.delenv("BATCHLINE_HEARTBEAT_SECONDS")
    assert heartbeat_seconds() == 5.0
