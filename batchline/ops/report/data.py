"""What the report shows, read from the store: leases, markers, outcomes, costs."""

from __future__ import annotations

import collections
import html
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from batchline.sizing.costs import RunCost, WorkerPrices
from batchline.spec import LOCAL_ROUTE, JobSpec, ProviderSpec, stored_spec
from batchline.store import (
    Event,
    JobInfo,
    JobStatus,
    ReaderStore,
    RouteTotals,
    StoredDeadLetter,
    job_or_published,
)
from batchline.store.model import ValidationRecord, rollback_target
from batchline.store.paid import PaidSlot

THROUGHPUT_BINS = 60
LABELS_SHOWN = 15
DEAD_LETTER_SAMPLES = 3
ERROR_CHARS = 240

LEASE_KINDS = ("claim", "complete", "release", "lease_expired", "take_back", "submitted", "provider_wait")
MARKER_KINDS = ("stale_epoch", "engine_crash", "engine_hang", "split")
# The drill (and tests) move the database clock instead of sleeping past a lease;
# it logs each shift so the report can take it back out of the time axis.
CLOCK_SHIFT = "clock_shift"


def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


# --- what the page shows, read from the store ---------------------------------------


@dataclass
class LeaseSpan:
    shard_no: int
    epoch: int
    worker: str
    start: float
    end: float | None
    outcome: str  # done | expired | released | open
    detail: str = ""


@dataclass
class Marker:
    ts: float
    worker: str
    kind: str
    text: str


@dataclass
class ReportData:
    info: JobInfo
    spec: JobSpec
    status: JobStatus
    generated: float
    cost: RunCost  # spot and paid worker time at the spec's prices (batchline.sizing.costs)
    published: str | None
    compare_to: str | None
    compare_why: str
    leases: list[LeaseSpan]
    markers: list[Marker]
    t_start: float | None
    t_end: float | None
    bin_seconds: float
    bins: list[int]
    attempts_results: dict[int, int]
    attempts_dead: dict[int, int]
    dead_counts: dict[str, int]
    dead_samples: dict[str, list[StoredDeadLetter]]
    labels: dict[str, int]
    compare_labels: dict[str, int]
    label_field: str | None
    validation: ValidationRecord | None
    tokens: tuple[int, int]
    per_worker_rate: float
    stale_by_op: dict[str, int]
    event_counts: dict[str, int]
    shifted_seconds: float
    deadline: float | None
    sealed_at: float | None
    computed: int
    carried: int
    lease_seconds_by_outcome: dict[str, float] = field(default_factory=dict)
    routes: dict[str, RouteTotals] = field(default_factory=dict)
    providers: tuple[ProviderSpec, ...] = ()
    pace: PacePicture | None = None  # a version with a deadline

    @property
    def lease_hours(self) -> float:
        """Lease time on the local engine's shards, every worker's, in hours."""
        return sum(self.lease_seconds_by_outcome.values()) / 3600.0

    @property
    def answered(self) -> int:
        return self.status.results + self.status.dead_letters


@dataclass(frozen=True)
class PacePicture:
    """A version's deadline and its paid workers, as the report draws them (their cost is the
    report's `cost`)."""

    deadline: float  # when the job must be done
    line_start: float  # when the expected progress starts to rise (the run start and a restart overhead)
    line_end: float  # when the expected progress reaches every record (before the deadline, by the tail)
    done_at_start: int  # carried results and planner dead letters: where the line starts
    paid: list[tuple[float, float]]  # each paid start's time, from its worker's first heartbeat to its stop


class _Clock:
    """Maps database time to real time by removing logged clock shifts."""

    def __init__(self, shifts: Sequence[Event]) -> None:
        self.shifts = sorted((e.ts, float(e.detail.get("seconds", 0.0))) for e in shifts)

    def __call__(self, ts: float) -> float:
        # A shift logged at t (before it happened) moved every later time by s; a time
        # at or past t + s was written after it. Shifts are far longer than the gap
        # between logging one and making it, so the two cannot be confused.
        return ts - sum(s for t, s in self.shifts if s > 0 and ts >= t + s)

    @property
    def total(self) -> float:
        return sum(s for _, s in self.shifts)


def _leases(events: Iterable[Event], clock: _Clock, now: float) -> list[LeaseSpan]:
    spans: dict[tuple[int, int], LeaseSpan] = {}
    order: list[LeaseSpan] = []
    for e in events:
        if e.shard_no is None or e.epoch is None:
            continue
        key = (e.shard_no, e.epoch)
        if e.kind == "claim" and e.worker:
            span = LeaseSpan(e.shard_no, e.epoch, e.worker, clock(e.ts), None, "open")
            spans[key] = span
            order.append(span)
            continue
        span_or_none = spans.get(key)
        if span_or_none is None or span_or_none.end is not None:
            continue
        span = span_or_none
        if e.kind == "complete":
            span.end, span.outcome = clock(e.ts), "done"
        elif e.kind == "release":
            span.end, span.outcome = clock(e.ts), "released"
            span.detail = str(e.detail.get("reason", ""))
        elif e.kind in ("submitted", "provider_wait"):
            span.end, span.outcome = clock(e.ts), "parked"
            span.detail = f"batch {e.detail.get('batch_id', '?')} at the provider"
        elif e.kind == "lease_expired":
            # Logged when another worker reclaimed the shard: the lease ran until then.
            span.end, span.outcome = clock(e.ts), "expired"
            span.detail = f"re-leased by {e.detail.get('reclaimed_by', '?')}"
        elif e.kind == "take_back":
            # Its owner was proven dead: the lease ended there, not when it would have run out.
            proof = e.detail.get("proof") or {}
            span.end, span.outcome = clock(e.ts), "taken back"
            span.detail = (f"owner proven dead by {e.detail.get('by', '?')} ({proof.get('kind', '?')}: "
                           f"{proof.get('found', '')})")
    for span in order:
        if span.end is None:
            span.end = clock(now)
    return order


def _bin_seconds(span: float, bins: int) -> float:
    raw = max(span / bins, 1e-3)
    for step in (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 43200, 86400):
        if step >= raw:
            return float(step)
    return math.ceil(raw / 86400) * 86400.0


def collect(store: ReaderStore, version: str, *, price: float | None = None) -> ReportData:
    """Reads everything the page shows. Results are counted in the store by attempt and
    time bin; dead letters are streamed once into fixed-size tallies (kinds, samples), so
    memory does not grow with the job; the event log is read whole (a few events per
    shard, plus one per charged attempt). `price`: a spot worker-hour's, where the spec's
    fallback gives none."""
    info = job_or_published(store, version)
    version = info.version
    spec = stored_spec(info)
    status = store.status(version, window_seconds=60.0)
    now = store.now()
    events = store.events(version)
    clock = _Clock([e for e in events if e.kind == CLOCK_SHIFT])
    leases = _leases((e for e in events if e.kind in LEASE_KINDS), clock, now)
    markers, stale_by_op = _markers(events, clock)
    seal = next((e for e in events if e.kind == "seal"), None)
    sealed_at = clock(seal.ts) if seal else None
    timeline = _Timeline.of(leases, markers, sealed_at)
    outcomes = _OutcomeTallies.count(store, version, clock, timeline)
    published, compare_to, why = _comparison(store, info.name, version)
    starts = store.paid_slots(version)
    return ReportData(
        info=info, spec=spec, status=status, generated=now, published=published,
        cost=run_cost(store, info, spec, leases, starts, clock, now, spot_price=price),
        compare_to=compare_to, compare_why=why, leases=leases, markers=markers, t_start=timeline.start,
        t_end=timeline.end, bin_seconds=timeline.bin_seconds, bins=timeline.bins,
        attempts_results=dict(outcomes.attempts_results), attempts_dead=dict(outcomes.attempts_dead),
        dead_counts=dict(outcomes.dead_counts), dead_samples=dict(outcomes.dead_samples),
        labels=_labels(store, version), compare_labels=_labels(store, compare_to) if compare_to else {},
        label_field=spec.label_field, validation=store.latest_validation(version),
        tokens=store.token_totals(version), per_worker_rate=store.run_throughput(version),
        stale_by_op=stale_by_op, event_counts=dict(collections.Counter(e.kind for e in events)),
        shifted_seconds=clock.total, deadline=spec.deadline.resolve(status.run_start, now) if spec.deadline else None,
        sealed_at=sealed_at, computed=outcomes.computed, carried=info.carried,
        lease_seconds_by_outcome=_gpu_seconds(store, version, leases), routes=store.route_totals(version),
        providers=spec.routing.providers if spec.routing else (),
        pace=_pace(info, spec, status, starts, clock, now),
    )


def run_cost(store: ReaderStore, info: JobInfo, spec: JobSpec, leases: Sequence[LeaseSpan], starts: Sequence[PaidSlot],
             clock: _Clock, now: float, *, spot_price: float | None = None) -> RunCost:
    """The version's worker time at the spec's prices (batchline.sizing.costs): paid time from
    each paid start's first heartbeat to its stop, spot time the local leases of every other
    worker."""
    from batchline.registry import ENGINES

    entry = ENGINES.get(spec.model.engine)
    computes_on = entry.computes_on(spec.model.options, store.pinned_runtime(info.version)) if entry else None
    paid_workers = {s.worker for s in starts if s.worker}
    hosted = {row.shard_no for row in store.shard_rows(info.version) if row.route != LOCAL_ROUTE} \
        if spec.routing is not None else set()
    spot = sum((span.end if span.end is not None else clock(now)) - span.start for span in leases
               if span.worker not in paid_workers and span.shard_no not in hosted)
    paid = sum(b - a for a, b in _paid_spans(starts, clock, now))
    return RunCost(WorkerPrices.of(spec, computes_on, spot_price), spot, paid)


def version_cost(store: ReaderStore, info: JobInfo, starts: Sequence[PaidSlot], now: float, *,
                 spot_price: float | None = None) -> RunCost:
    """`run_cost` read from the store alone (`starts`: the version's paid starts, as read
    already), as `status` and `run`'s summary say it: in the database's time, as
    `fallback.max_cost` is held (the report takes a test's clock shifts out of its time axis)."""
    clock = _Clock([])
    leases = _leases(store.events(info.version, LEASE_KINDS), clock, now)
    return run_cost(store, info, stored_spec(info), leases, starts, clock, now, spot_price=spot_price)


def _paid_spans(starts: Sequence[PaidSlot], clock: _Clock, now: float) -> list[tuple[float, float]]:
    return [(clock(s.started_at), clock(s.stopped_at if s.stopped_at is not None else now)) for s in starts
            if s.started_at is not None]


def _pace(info: JobInfo, spec: JobSpec, status: JobStatus, starts: Sequence[PaidSlot], clock: _Clock,
          now: float) -> PacePicture | None:
    """The deadline's picture for a version with a deadline and a run start, else None."""
    from batchline.sizing.pacing import Observation, line_end, line_start
    from batchline.spec.deadline import FallbackSpec
    from batchline.store.paid import restart_overhead

    if spec.deadline is None or status.run_start is None:
        return None
    fallback = spec.fallback or FallbackSpec(0)
    deadline = spec.deadline.resolve(status.run_start, status.now)
    obs = Observation(now=now, started_at=status.run_start, deadline=deadline, records=status.records,
                      done_at_start=info.carried + info.planned_dead, committed=0, spot_workers=0, paid_workers=0,
                      paid_running=0, max_paid=fallback.workers, worker_rate=1.0,
                      restart_overhead=restart_overhead(starts) or fallback.restart_overhead_seconds,
                      tail_seconds=spec.shards.lease_seconds)
    return PacePicture(clock(deadline), clock(line_start(obs)), clock(line_end(obs)), obs.done_at_start,
                       _paid_spans(starts, clock, now))


def _markers(events: list[Event], clock: _Clock) -> tuple[list[Marker], dict[str, int]]:
    """The moments the timeline marks (refused writes, engine crashes and hangs), and the refusals by operation."""
    markers: list[Marker] = []
    stale_by_op: collections.Counter[str] = collections.Counter()
    for e in events:
        if e.kind not in MARKER_KINDS or not e.worker:
            continue
        if e.kind == "stale_epoch":
            op = str(e.detail.get("op", "?"))
            stale_by_op[op] += 1
            text = f"stale epoch {e.epoch}: {op} of shard {e.shard_no} refused"
        elif e.kind == "split":
            text = (f"the unstarted tail of shard {e.shard_no} ({e.detail.get('records', '?')} records) split off "
                    f"to shard {e.detail.get('new_shard', '?')} by {e.detail.get('by', '?')}")
        else:
            what = "engine crashed" if e.kind == "engine_crash" else "engine missed a batch deadline"
            text = f"{what} on shard {e.shard_no} ({e.detail.get('in_flight', '?')} records in flight)"
        markers.append(Marker(clock(e.ts), e.worker, e.kind, text))
    return markers, dict(stale_by_op)


@dataclass
class _Timeline:
    """The run's span, from the first claim to the seal (or the last thing that happened), in bins."""

    start: float | None
    end: float | None
    bin_seconds: float
    bins: list[int]

    @classmethod
    def of(cls, leases: list[LeaseSpan], markers: list[Marker], sealed_at: float | None) -> _Timeline:
        claims = [s.start for s in leases]
        start = min(claims) if claims else None
        end: float | None = None
        if start is not None:
            ends = [s.end for s in leases if s.end is not None] + [m.ts for m in markers]
            end = max([sealed_at or start, *ends])
            if end <= start:
                end = start + 1.0
        bin_seconds = _bin_seconds((end - start) if start is not None and end else 1.0, THROUGHPUT_BINS)
        n_bins = max(1, math.ceil(((end or 0.0) - (start or 0.0)) / bin_seconds)) if start is not None else 0
        return cls(start, end, bin_seconds, [0] * n_bins)

    def place(self, ts: float) -> None:
        if self.start is None or not self.bins:
            return
        i = int((ts - self.start) // self.bin_seconds)
        self.bins[min(max(i, 0), len(self.bins) - 1)] += 1


@dataclass
class _OutcomeTallies:
    computed: int = 0
    attempts_results: collections.Counter[int] = field(default_factory=collections.Counter)
    attempts_dead: collections.Counter[int] = field(default_factory=collections.Counter)
    dead_counts: collections.Counter[str] = field(default_factory=collections.Counter)
    dead_samples: dict[str, list[StoredDeadLetter]] = field(
        default_factory=lambda: collections.defaultdict(list))

    @classmethod
    def count(cls, store: ReaderStore, version: str, clock: _Clock, timeline: _Timeline) -> _OutcomeTallies:
        """Results by attempt and throughput bin, and dead letters by kind, placed on the timeline."""
        t = cls()
        if clock.total == 0:
            # Counted in the store: the page reads a few hundred rows, not every result.
            for attempt, i, n in store.result_histogram(version, timeline.start or 0.0, timeline.bin_seconds,
                                                        len(timeline.bins) or 1):
                t.computed += n
                t.attempts_results[attempt] += n
                if timeline.bins:
                    timeline.bins[i] += n
        else:
            # The test hook moved the database clock: times are mapped back one by one.
            for r in store.iter_results(version, computed_only=True):
                t.computed += 1
                t.attempts_results[r.attempt] += 1
                timeline.place(clock(r.created_at))
        for d in store.iter_dead_letters(version):
            t.attempts_dead[d.attempts] += 1
            t.dead_counts[d.kind] += 1
            if len(t.dead_samples[d.kind]) < DEAD_LETTER_SAMPLES:
                t.dead_samples[d.kind].append(d)
            if d.worker is not None:  # the planner's dead letters were never worked on
                timeline.place(clock(d.created_at))
        return t


def _comparison(store: ReaderStore, name: str, version: str) -> tuple[str | None, str | None, str]:
    """What is published under the name, the version the label distribution is compared
    with, and why that one."""
    published = store.resolve_name(name)
    if published and published != version:
        return published, published, f"the version published as {name}"
    if published == version:
        compare_to = rollback_target(store.publications(name), version)
        why = "the version published before this one" if compare_to else "nothing was published before this one"
        return published, compare_to, why
    return published, None, f"nothing is published as {name} yet"


def _labels(store: ReaderStore, version: str) -> dict[str, int]:
    return {_label(k): v for k, v in store.label_counts(version).items() if k is not None}


def _gpu_seconds(store: ReaderStore, version: str, leases: list[LeaseSpan]) -> dict[str, float]:
    """Lease time on the local engine's shards, by how each lease ended. A hosted shard's
    lease is a poller's few seconds, paid for in the provider's tokens instead."""
    hosted_shards = {row.shard_no for row in store.shard_rows(version) if row.route != LOCAL_ROUTE}
    by_outcome: dict[str, float] = collections.defaultdict(float)
    for s in leases:
        if s.shard_no not in hosted_shards:
            by_outcome[s.outcome] += max(0.0, (s.end or s.start) - s.start)
    return dict(by_outcome)


def _label(value: Any) -> str:
    return value if isinstance(value, str) else str(value)


