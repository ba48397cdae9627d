"""A job's deadline and its paid fallback capacity: the spec's `deadline` and `fallback`.

Neither can change a result, so neither is part of the job version (I2): a
nightly job keeps its version whatever its deadline, and moving the deadline or
the budget of a running version changes only how it is paced.

- `deadline`: an absolute time (ISO 8601, `2026-12-01T06:00:00Z`), or a window
  (`6h`, `90m`, `1h30m`, `2d`) counted from the version's run start (set once by
  the first runner, launcher or pacer that opens it, kept across resumes), so a
  nightly CronJob needs no edit. A window of zero is refused when the spec is
  read; an absolute time already past is refused by `run` and `launch` before
  anything starts (`Deadline.refusal`): a stored spec stays readable after its
  deadline.
- `fallback`: the paid capacity a pacer may buy while the job is behind (see
  `batchline.sizing.pacing`): `workers` (the most paid workers at once),
  `cost_per_worker_hour`, an optional `max_cost` (at least one worker-hour; held
  by the pacer and by each paid worker itself), the spot side's
  `spot_cost_per_worker_hour`, a prior `records_per_worker_second` for before
  any rate is measured, and `launch_timeout_seconds`, after which a paid start
  never seen is stale.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from batchline.spec.reader import Fields, SpecReader

# The store holds it too: a worker's loading allowance (batchline.store.beats) counts in it.
from batchline.store.paid import (
    DEFAULT_RESTART_OVERHEAD_SECONDS as DEFAULT_RESTART_OVERHEAD_SECONDS,
)

_WINDOW = re.compile(r"^(?:(\d+(?:\.\d+)?)d)?(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?$")
_UNITS = (86_400.0, 3_600.0, 60.0, 1.0)


def format_duration(seconds: float) -> str:
    """A duration as progress lines and reports say it: 1h02m03s, 2m05s, 7s."""
    total = round(seconds)
    h, rem = divmod(total, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def format_rate(per_second: float) -> str:
    """A rate as progress lines and reports say it: two significant figures below 100 (0.063,
    1.2, 47), whole numbers above (1,234)."""
    rounded = float(f"{per_second:.2g}")
    if per_second >= 99.5 or rounded == 0:
        return f"{per_second:,.0f}"
    return f"{rounded:.{max(0, 1 - math.floor(math.log10(abs(rounded))))}f}"


def parse_duration(text: str) -> float | None:
    """A duration as a window is written (`6h`, `90m`, `1h30m`, `2d`, `45s`) or a plain number
    of seconds; None when it is neither."""
    text = text.strip().lower()
    match = _WINDOW.match(text) if text else None
    if match is not None and any(match.groups()):
        return sum(float(g) * unit for g, unit in zip(match.groups(), _UNITS, strict=True) if g)
    try:
        seconds = float(text)
    except ValueError:
        return None
    return seconds if seconds == seconds and seconds not in (float("inf"), float("-inf")) else None


@dataclass(frozen=True)
class Deadline:
    """When the job must be done: `at` (seconds since the epoch), or `window` seconds after
    the version's run start."""

    at: float | None = None
    window: float | None = None
    text: str = ""  # as the spec wrote it

    def resolve(self, started_at: float | None, now: float) -> float:
        """The deadline as a time: a window counts from the run start (from now, before it)."""
        if self.at is not None:
            return self.at
        assert self.window is not None
        return (started_at if started_at is not None else now) + self.window

    def refusal(self, now: float) -> str | None:
        """Why a run cannot be held to it, or None: an absolute time already past."""
        if self.at is not None and self.at <= now:
            passed = datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            return (f"deadline {self.text} is already past (it is {passed}); give a later time, or a window "
                    "such as 6h counted from the run start")
        return None

    def to_json(self) -> str:
        return self.text

    def describe(self) -> str:
        return self.text if self.at is not None else f"{self.text} from the run start"


def parse_deadline(value: Any, where: str, fail: Any) -> Deadline | None:
    """`deadline` as the spec (or `--deadline`) writes it; `fail(field, why)` refuses it."""
    if value is None:
        return None
    if isinstance(value, datetime):
        stamp = value if value.tzinfo else value.replace(tzinfo=UTC)
        return Deadline(at=stamp.timestamp(), text=stamp.isoformat().replace("+00:00", "Z"))
    text = str(value).strip()
    match = _WINDOW.match(text.lower()) if text else None
    if match is not None and any(match.groups()):
        seconds = parse_duration(text)
        assert seconds is not None
        if seconds <= 0:
            fail(where, f"{text!r} is a window of zero: give how long the job may take, such as 6h")
        return Deadline(window=seconds, text=text)
    try:
        stamp = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        fail(where, f"{value!r} is neither an ISO 8601 time (2026-12-01T06:00:00Z) nor a window (6h, 90m, 1h30m)")
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=UTC)
    return Deadline(at=stamp.timestamp(), text=text)


@dataclass(frozen=True)
class FallbackSpec:
    """Paid capacity a pacer may buy while the job is behind its deadline."""

    workers: int
    cost_per_worker_hour: float = 0.0
    max_cost: float | None = None
    spot_cost_per_worker_hour: float | None = None
    # A paid worker's launch to its first claim (the model load included) until this run has
    # measured one.
    restart_overhead_seconds: float = DEFAULT_RESTART_OVERHEAD_SECONDS
    # One worker's records a second, for the pacer before this run or an earlier version of
    # the same name has measured one.
    records_per_worker_second: float | None = None
    # A paid start not seen (no heartbeat) this long after its launch is stale: stopped where
    # it runs and started again while the job is behind. None: three restart overheads.
    launch_timeout: float | None = None

    @property
    def launch_timeout_seconds(self) -> float:
        return self.launch_timeout if self.launch_timeout is not None else 3 * self.restart_overhead_seconds

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"workers": self.workers, "cost_per_worker_hour": self.cost_per_worker_hour,
                               "restart_overhead_seconds": self.restart_overhead_seconds}
        if self.max_cost is not None:
            out["max_cost"] = self.max_cost
        if self.spot_cost_per_worker_hour is not None:
            out["spot_cost_per_worker_hour"] = self.spot_cost_per_worker_hour
        if self.records_per_worker_second is not None:
            out["records_per_worker_second"] = self.records_per_worker_second
        if self.launch_timeout is not None:
            out["launch_timeout_seconds"] = self.launch_timeout
        return out


FALLBACK_FIELDS: Fields = {
    "workers": {"type": "integer", "minimum": 1, "description": "The most paid workers at once"},
    "cost_per_worker_hour": {"type": "number", "minimum": 0, "default": 0.0,
                             "description": "What a paid worker costs an hour (the report's and max_cost's unit)"},
    "max_cost": {"type": "number", "minimum": 0,
                 "description": "A cap on the paid spend of a version, at least one worker-hour's cost; passed by "
                                "at most what the paid workers cost between two heartbeats"},
    "spot_cost_per_worker_hour": {"type": "number", "minimum": 0,
                                  "description": "What a spot worker costs an hour, for the report"},
    "restart_overhead_seconds": {"type": "number", "exclusiveMinimum": 0,
                                 "default": DEFAULT_RESTART_OVERHEAD_SECONDS,
                                 "description": "A paid worker's launch to its first claim, the model load "
                                                "included, until the run has measured it"},
    "records_per_worker_second": {"type": "number", "exclusiveMinimum": 0,
                                  "description": "One worker's records a second, the pacer's prior until a rate is "
                                                 "measured (else an earlier version's of the same name)"},
    "launch_timeout_seconds": {"type": "number", "exclusiveMinimum": 0,
                               "description": "A paid start not seen this long after its launch is stale: stopped "
                                              "and started again (default: three restart overheads)"},
}


def parse_fallback(raw: Any, r: SpecReader) -> FallbackSpec | None:
    if raw is None:
        return None
    section = r.section(raw, "fallback", FALLBACK_FIELDS, required={"workers"})
    workers = r.integer(section["workers"], "fallback.workers", 1)

    def number(key: str, default: float | None) -> float | None:
        value = section.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            r.fail(f"fallback.{key}", f"must be a number of 0 or more, not {value!r}")
        return float(value)

    cost = number("cost_per_worker_hour", 0.0)
    assert cost is not None
    max_cost = number("max_cost", None)
    if max_cost is not None and max_cost < cost:
        r.fail("fallback.max_cost", f"{max_cost:g} is below one paid worker-hour ({cost:g}): no paid worker could "
                                    "run an hour; raise it, or leave fallback out")
    if max_cost is not None and cost == 0:
        r.fail("fallback.max_cost", "needs fallback.cost_per_worker_hour: the spend is counted in it")
    overhead = number("restart_overhead_seconds", DEFAULT_RESTART_OVERHEAD_SECONDS)
    assert overhead is not None
    if overhead <= 0:
        r.fail("fallback.restart_overhead_seconds", "must be positive: a worker takes time to start")
    prior = number("records_per_worker_second", None)
    if prior is not None and prior <= 0:
        r.fail("fallback.records_per_worker_second", f"must be above 0, not {prior:g}: a worker that does nothing "
                                                     "is no prior")
    timeout = number("launch_timeout_seconds", None)
    if timeout is not None and timeout < overhead:
        r.fail("fallback.launch_timeout_seconds", f"{timeout:g} is below the restart overhead ({overhead:g} s): "
                                                  "every paid start would be stale before it could load")
    return FallbackSpec(workers, cost, max_cost, number("spot_cost_per_worker_hour", None), overhead, prior, timeout)
