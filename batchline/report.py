"""`batchline report VERSION --html report.html`: one self-contained HTML page.

Everything comes from the store: the event log (claims, expired leases,
releases, completions, stale epochs refused, charged attempts, engine crashes
and hangs, seal, publish) and the rows (results carry worker, epoch, attempt,
time and tokens; dead letters their kind and error). The charts are inline
SVG drawn here, the page loads nothing from anywhere (its Content Security
Policy forbids it), and its only script is the small one below.

Record ids, labels (model output) and engine errors are untrusted text: every
string that reaches the page goes through `esc`, and nothing untrusted is ever
placed inside a script or a style. The CSP allows only the page's own script,
by hash, so even a mistake in escaping could not run an injected one.
"""

from __future__ import annotations

import base64
import collections
import datetime as dt
import hashlib
import html
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchline.errors import BatchlineError
from batchline.spec import LOCAL_ROUTE, JobSpec, ProviderSpec, stored_spec
from batchline.store import Event, JobInfo, JobStatus, ReaderStore, RouteTotals, StoredDeadLetter
from batchline.store.model import ValidationRecord

DEFAULT_GPU_HOUR_PRICE = 3.50
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
    price: float
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

    @property
    def gpu_hours(self) -> float:
        return sum(self.lease_seconds_by_outcome.values()) / 3600.0

    @property
    def cost(self) -> float:
        return self.gpu_hours * self.price

    @property
    def answered(self) -> int:
        return self.status.results + self.status.dead_letters


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


def collect(store: ReaderStore, version: str, *, price: float = DEFAULT_GPU_HOUR_PRICE) -> ReportData:
    """Reads everything the page shows. Results are counted in the store by attempt and
    time bin; dead letters are streamed once into fixed-size tallies (kinds, samples), so
    memory does not grow with the job; the event log is read whole (a few events per
    shard, plus one per charged attempt)."""
    info = _job_or_published(store, version)
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
    return ReportData(
        info=info, spec=spec, status=status, generated=now, price=price, published=published,
        compare_to=compare_to, compare_why=why, leases=leases, markers=markers, t_start=timeline.start,
        t_end=timeline.end, bin_seconds=timeline.bin_seconds, bins=timeline.bins,
        attempts_results=dict(outcomes.attempts_results), attempts_dead=dict(outcomes.attempts_dead),
        dead_counts=dict(outcomes.dead_counts), dead_samples=dict(outcomes.dead_samples),
        labels=_labels(store, version), compare_labels=_labels(store, compare_to) if compare_to else {},
        label_field=spec.label_field, validation=store.latest_validation(version),
        tokens=store.token_totals(version), per_worker_rate=store.run_throughput(version),
        stale_by_op=stale_by_op, event_counts=dict(collections.Counter(e.kind for e in events)),
        shifted_seconds=clock.total, deadline=spec.deadline.timestamp() if spec.deadline else None,
        sealed_at=sealed_at, computed=outcomes.computed, carried=info.carried,
        lease_seconds_by_outcome=_gpu_seconds(store, version, leases), routes=store.route_totals(version),
        providers=spec.routing.providers if spec.routing else (),
    )


def _job_or_published(store: ReaderStore, target: str) -> JobInfo:
    info = store.job(target)
    if info is None:
        resolved = store.resolve_name(target)
        info = store.job(resolved) if resolved else None
        if info is None:
            raise BatchlineError(f"no job version or published name {target!r} in {store.url}")
    return info


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
        before = [p for p in store.publications(name) if p.version == version and p.action == "publish"]
        compare_to = before[-1].previous if before else None
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


# --- formatting -----------------------------------------------------------------------------


def _dur(seconds: float) -> str:
    if seconds < 10:
        return f"{seconds:.1f}s"
    total = round(seconds)
    d, rem = divmod(total, 86400)
    h, rem = divmod(rem, 3600)
    m, s = divmod(rem, 60)
    if d:
        return f"{d}d{h:02d}h"
    if h:
        return f"{h}h{m:02d}m"
    if m:
        return f"{m}m{s:02d}s" if s else f"{m}m"
    return f"{s}s"


def _tick(seconds: float) -> str:
    return f"{seconds:g}s" if seconds < 10 else _dur(seconds)


def _utc(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _num(value: float) -> str:
    if value >= 100 or value == int(value):
        return f"{value:,.0f}"
    return f"{value:,.1f}" if value >= 10 else f"{value:,.2f}"


def _nice_max(value: float) -> float:
    if value <= 0:
        return 1.0
    exp = 10.0 ** math.floor(math.log10(value))
    for m in (1.0, 2.0, 2.5, 5.0, 10.0):
        if m * exp >= value:
            return m * exp
    return 10.0 * exp


def _short_worker(worker: str) -> str:
    # host:pid:suffix; the host is the same for every local worker and is in the tooltip.
    parts = worker.split(":")
    text = ":".join(parts[1:]) if len(parts) == 3 else worker
    return text if len(text) <= 24 else text[:23] + "…"


# --- charts (inline SVG) -------------------------------------------------------------------


COLORS = {
    "done": "#14b8a6", "released": "#94a3b8", "expired": "url(#bl-hatch)", "open": "#99f6e4",
    "parked": "#c4b5fd", "taken back": "#f59e0b",
    "stale_epoch": "#dc2626", "engine_crash": "#111827", "engine_hang": "#7c3aed", "split": "#2563eb",
}
OUTCOME_WORDS = {"done": "completed", "released": "released", "expired": "expired (lease lost)",
                 "open": "held now", "parked": "parked at a provider",
                 "taken back": "taken back (owner proven dead)"}


def _svg(width: int, height: int, label: str, body: str) -> str:
    return (f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" '
            f'role="img" aria-label="{esc(label)}">{body}</svg>')


def _time_ticks(span: float) -> list[float]:
    for step in (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400):
        if span / step <= 8:
            return [i * step for i in range(int(span // step) + 1)]
    step = math.ceil(span / 8 / 86400) * 86400
    return [i * step for i in range(int(span // step) + 1)]


def throughput_chart(d: ReportData) -> str:
    if d.t_start is None or not d.bins:
        return '<p class="empty">No records answered yet.</p>'
    w, h, left, right, top, bottom = 1000, 260, 56, 56, 16, 34
    pw, ph = w - left - right, h - top - bottom
    span = len(d.bins) * d.bin_seconds
    rates = [n / d.bin_seconds for n in d.bins]
    y_max = _nice_max(max(rates))
    held = _leases_held(d, len(d.bins))
    w_max = max(1.0, math.ceil(max(held) if held else 1.0))

    def x(t: float) -> float:
        return left + pw * t / span

    def y(v: float) -> float:
        return top + ph * (1 - v / y_max)

    out = []
    for i in range(5):
        v = y_max * i / 4
        out.append(f'<line class="grid" x1="{left}" x2="{w - right}" y1="{y(v):.1f}" y2="{y(v):.1f}"/>'
                   f'<text class="tick" x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{_num(v)}</text>')
    for t in _time_ticks(span):
        out.append(f'<text class="tick" x="{x(t):.1f}" y="{h - 12}" text-anchor="middle">+{_tick(t)}</text>')
    step_line = " ".join(f"L{x(i * d.bin_seconds):.1f},{y(r):.1f} L{x((i + 1) * d.bin_seconds):.1f},{y(r):.1f}"
                         for i, r in enumerate(rates))
    out.append(f'<path class="area" d="M{left},{y(0):.1f} {step_line} L{x(span):.1f},{y(0):.1f} Z"/>')
    out.append(f'<path class="rate" d="M{x(0):.1f},{y(rates[0]):.1f} {step_line}"/>')
    held_path = " ".join(f"{'M' if i == 0 else 'L'}{x(i * d.bin_seconds):.1f},"
                         f"{top + ph * (1 - v / w_max):.1f} L{x((i + 1) * d.bin_seconds):.1f},"
                         f"{top + ph * (1 - v / w_max):.1f}" for i, v in enumerate(held))
    out.append(f'<path class="held" d="{held_path}"/>')
    for i in range(int(w_max) + 1):
        if w_max > 8 and i % math.ceil(w_max / 8):
            continue
        yy = top + ph * (1 - i / w_max)
        out.append(f'<text class="tick held-tick" x="{w - right + 6}" y="{yy + 4:.1f}">{i}</text>')
    out.append(f'<text class="axis" x="{left}" y="{top - 4}">records/s</text>'
               f'<text class="axis held-tick" x="{w - right}" y="{top - 4}" text-anchor="end">leases held</text>')
    for i, (n, r) in enumerate(zip(d.bins, rates, strict=True)):
        t0 = d.t_start + i * d.bin_seconds
        out.append(f'<rect class="hover" x="{x(i * d.bin_seconds):.1f}" y="{top}" '
                   f'width="{pw / len(d.bins):.2f}" height="{ph}"><title>{esc(_utc(t0))}: {n:,} records '
                   f'({_num(r)}/s), {held[i]:.1f} leases held</title></rect>')
    return _svg(w, h, "records answered per second over time, and leases held", "".join(out))


def _leases_held(d: ReportData, n: int) -> list[float]:
    assert d.t_start is not None
    held = [0.0] * n
    for s in d.leases:
        a, b = s.start - d.t_start, (s.end or s.start) - d.t_start
        for i in range(max(0, int(a // d.bin_seconds)), min(n, int(b // d.bin_seconds) + 1)):
            lo, hi = i * d.bin_seconds, (i + 1) * d.bin_seconds
            held[i] += max(0.0, min(b, hi) - max(a, lo)) / d.bin_seconds
    return held


def timeline_chart(d: ReportData) -> str:
    if d.t_start is None or d.t_end is None or not d.leases:
        return '<p class="empty">No shard has been leased yet.</p>'
    workers: list[str] = []
    for s in d.leases:
        if s.worker not in workers:
            workers.append(s.worker)
    row_h, bar_h, left, right, top, bottom = 24, 14, 190, 16, 10, 34
    w = 1000
    h = top + bottom + row_h * len(workers)
    pw = w - left - right
    t0, t1 = d.t_start, d.t_end
    span = t1 - t0
    row = {wk: i for i, wk in enumerate(workers)}

    def x(t: float) -> float:
        return left + pw * (t - t0) / span

    def y(worker: str) -> float:
        return top + row[worker] * row_h

    out = ['<defs><pattern id="bl-hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
           'patternTransform="rotate(45)"><rect width="6" height="6" fill="#fcd34d"/>'
           '<line x1="0" y1="0" x2="0" y2="6" stroke="#d97706" stroke-width="3"/></pattern></defs>']
    for wk in workers:
        yy = y(wk)
        if row[wk] % 2 == 0:
            out.append(f'<rect class="band" x="{left}" y="{yy:.1f}" width="{pw}" height="{row_h}"/>')
        out.append(f'<text class="wlabel" x="{left - 8}" y="{yy + row_h / 2 + 4:.1f}" text-anchor="end">'
                   f'{esc(_short_worker(wk))}<title>{esc(wk)}</title></text>')
    for t in _time_ticks(span):
        out.append(f'<line class="grid" x1="{x(t0 + t):.1f}" x2="{x(t0 + t):.1f}" y1="{top}" '
                   f'y2="{h - bottom}"/><text class="tick" x="{x(t0 + t):.1f}" y="{h - 12}" '
                   f'text-anchor="middle">+{_tick(t)}</text>')
    by_shard: dict[int, list[LeaseSpan]] = collections.defaultdict(list)
    for s in d.leases:
        by_shard[s.shard_no].append(s)
    for s in d.leases:
        end = s.end if s.end is not None else s.start
        x0, x1 = x(s.start), max(x(end), x(s.start) + 1.5)
        yy = y(s.worker) + (row_h - bar_h) / 2
        tip = (f"shard {s.shard_no}, epoch {s.epoch}: {OUTCOME_WORDS[s.outcome]}"
               f"{' (' + s.detail + ')' if s.detail else ''}; {_dur(end - s.start)} from {_utc(s.start)}; "
               f"worker {s.worker}")
        out.append(f'<rect class="lease {s.outcome}" data-shard="{s.shard_no}" x="{x0:.1f}" y="{yy:.1f}" '
                   f'width="{x1 - x0:.1f}" height="{bar_h}" rx="2" fill="{COLORS[s.outcome]}">'
                   f'<title>{esc(tip)}</title></rect>')
        if x1 - x0 > 26:
            out.append(f'<text class="barlabel" x="{(x0 + x1) / 2:.1f}" y="{yy + bar_h - 3:.1f}" '
                       f'text-anchor="middle">{s.shard_no}</text>')
    # An expired lease and the re-lease of the same shard, joined: where the work moved.
    for spans in by_shard.values():
        for a, b in itertools.pairwise(spans):
            if a.outcome == "expired" and a.end is not None:
                out.append(f'<line class="relink" data-shard="{a.shard_no}" x1="{x(a.end):.1f}" '
                           f'y1="{y(a.worker) + row_h / 2:.1f}" x2="{x(b.start):.1f}" '
                           f'y2="{y(b.worker) + row_h / 2:.1f}"/>')
    for m in d.markers:
        if m.worker not in row:
            continue
        mx, my = x(min(max(m.ts, t0), t1)), y(m.worker) + row_h / 2
        shape = (f'<path d="M{mx:.1f},{my - 6:.1f} L{mx + 6:.1f},{my:.1f} L{mx:.1f},{my + 6:.1f} '
                 f'L{mx - 6:.1f},{my:.1f} Z"' if m.kind == "stale_epoch"
                 else f'<circle cx="{mx:.1f}" cy="{my:.1f}" r="4.5"')
        out.append(f'{shape} class="marker" fill="{COLORS[m.kind]}"><title>{esc(_utc(m.ts))}: '
                   f'{esc(m.text)}</title>{"</path>" if m.kind == "stale_epoch" else "</circle>"}')
    return _svg(w, h, "shard leases per worker over time", "".join(out))


def _legend(items: Sequence[tuple[str, str]]) -> str:
    return '<div class="legend">' + "".join(
        f'<span><i style="background:{color}"></i>{esc(text)}</span>' for color, text in items) + "</div>"


def hbar_chart(rows: Sequence[tuple[str, Sequence[float], Sequence[str]]], series: Sequence[str],
               colors: Sequence[str], label: str, *, share: bool = False, width: int = 520) -> str:
    """Horizontal bars, one group per row; each value has its own tooltip text.
    The view box is about as wide as the chart is drawn, so its text stays legible."""
    if not rows:
        return '<p class="empty">Nothing to show.</p>'
    group_h = 8 + 16 * len(series)
    w, left, right, top = width, 130, 64, 6
    h = top + group_h * len(rows) + 6
    pw = w - left - right
    vmax = max((v for _, values, _ in rows for v in values), default=1.0) or 1.0
    out = []
    for i, (name, values, tips) in enumerate(rows):
        y0 = top + i * group_h
        shown = name if len(name) <= 18 else name[:17] + "…"
        out.append(f'<text class="wlabel" x="{left - 8}" y="{y0 + group_h / 2 + 4:.1f}" text-anchor="end">'
                   f'{esc(shown)}<title>{esc(name)}</title></text>')
        for j, (v, tip) in enumerate(zip(values, tips, strict=True)):
            yy = y0 + 4 + j * 16
            bw = pw * v / vmax
            text = (f"{v:.1%}" if share else f"{v:,.0f}") if v else ""
            out.append(f'<rect class="bar" x="{left}" y="{yy}" width="{max(bw, 1.5 if v else 0):.1f}" height="13" '
                       f'rx="2" fill="{colors[j]}"><title>{esc(tip)}</title></rect>'
                       f'<text class="tick" x="{left + bw + 6:.1f}" y="{yy + 11}">{text}</text>')
    return _svg(w, h, label, "".join(out))


# --- the page -------------------------------------------------------------------------------------


# The page's only script: it records any script error and checks that every chart
# laid out with a size, as attributes on <html> that a headless browser (and the
# tests) read back; and it highlights every lease of a shard under the pointer.
SENTINEL_JS = """
(function () {
  var root = document.documentElement;
  var errors = [];
  window.addEventListener('error', function (e) {
    errors.push(String(e.message || e));
    root.setAttribute('data-js-errors', errors.join(' | '));
  });
  function check() {
    var charts = document.querySelectorAll('svg.chart');
    var drawn = 0;
    for (var i = 0; i < charts.length; i++) {
      var box = charts[i].getBoundingClientRect();
      if (box.width > 0 && box.height > 0 && charts[i].querySelector('rect,path,circle')) { drawn++; }
    }
    root.setAttribute('data-charts', String(charts.length));
    root.setAttribute('data-charts-drawn', String(drawn));
    root.setAttribute('data-report-ready', errors.length ? 'errors' : 'ok');
  }
  function highlight(e) {
    var shard = e.target && e.target.getAttribute && e.target.getAttribute('data-shard');
    var on = document.querySelectorAll('.same-shard');
    for (var i = 0; i < on.length; i++) { on[i].classList.remove('same-shard'); }
    if (shard === null || shard === undefined) { return; }
    var all = document.querySelectorAll('[data-shard="' + shard + '"]');
    for (var j = 0; j < all.length; j++) { all[j].classList.add('same-shard'); }
  }
  document.addEventListener('DOMContentLoaded', function () {
    check();
    document.addEventListener('mouseover', highlight);
  });
})();
""".strip()

CSS = """
:root { --ink:#0f172a; --muted:#64748b; --line:#e2e8f0; --card:#ffffff; --bg:#f1f5f9; --accent:#0f766e;
  --good:#15803d; --bad:#b91c1c; --warn:#b45309; }
* { box-sizing: border-box; }
body { margin:0; background:var(--bg); color:var(--ink);
  font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; }
main { max-width: 1180px; margin: 0 auto; padding: 28px 24px 48px; }
header h1 { margin: 0 0 4px; font-size: 24px; letter-spacing: -0.01em; }
header .sub { color: var(--muted); font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace;
  font-size: 13px; word-break: break-all; }
.badge { display:inline-block; padding: 2px 9px; border-radius: 999px; font-size: 12px; font-weight: 600;
  vertical-align: middle; margin-left: 6px; background:#e2e8f0; color:#334155; }
.badge.good { background:#dcfce7; color: var(--good); } .badge.bad { background:#fee2e2; color: var(--bad); }
.badge.warn { background:#fef3c7; color: var(--warn); }
.cards { display:grid; grid-template-columns: repeat(auto-fill, minmax(165px, 1fr)); gap: 12px; margin: 20px 0 8px; }
.card { background: var(--card); border:1px solid var(--line); border-radius: 10px; padding: 12px 14px; }
.card .k { color: var(--muted); font-size: 12px; text-transform: uppercase; letter-spacing: .04em; }
.card .v { font-size: 22px; font-weight: 650; margin-top: 2px; font-variant-numeric: tabular-nums; }
.card .n { color: var(--muted); font-size: 12px; }
section { background: var(--card); border:1px solid var(--line); border-radius: 12px; padding: 18px 20px;
  margin-top: 18px; }
section h2 { margin: 0 0 2px; font-size: 17px; }
section p.what { margin: 0 0 12px; color: var(--muted); }
svg.chart { width: 100%; height: auto; display: block; overflow: visible; }
svg .grid { stroke: #e2e8f0; stroke-width: 1; }
svg .tick { fill: #64748b; font-size: 11px; font-variant-numeric: tabular-nums; }
svg .axis { fill: #475569; font-size: 11px; font-weight: 600; }
svg .held-tick { fill: #7c3aed; }
svg .area { fill: #99f6e4; opacity: .55; } svg .rate { fill: none; stroke: #0f766e; stroke-width: 2; }
svg .held { fill: none; stroke: #7c3aed; stroke-width: 1.5; stroke-dasharray: 4 3; }
svg .hover { fill: transparent; } svg .hover:hover { fill: rgba(15, 118, 110, .08); }
svg .band { fill: #f8fafc; }
svg .wlabel { fill: #334155; font-size: 11.5px; font-family: ui-monospace, SFMono-Regular, Menlo, monospace; }
svg .barlabel { fill: #064e3b; font-size: 9.5px; pointer-events: none; }
svg .lease { stroke: rgba(15, 23, 42, .25); stroke-width: .6; }
svg .lease.open { stroke: #0f766e; stroke-dasharray: 3 2; }
svg .relink { stroke: #d97706; stroke-width: 1.2; stroke-dasharray: 3 3; }
svg .marker { stroke: #fff; stroke-width: 1; }
svg .same-shard { stroke: #0f172a; stroke-width: 2; }
.legend { display:flex; flex-wrap: wrap; gap: 14px; margin: 8px 0 0; color: #334155; font-size: 12.5px; }
.legend i { display:inline-block; width: 12px; height: 12px; border-radius: 3px; margin-right: 6px;
  vertical-align: -1px; }
.legend i.hatch { background: repeating-linear-gradient(45deg, #fcd34d 0 3px, #d97706 3px 5px) !important; }
table { border-collapse: collapse; width: 100%; font-size: 13px; }
th, td { text-align: left; padding: 7px 10px; border-bottom: 1px solid var(--line); vertical-align: top; }
th { color: var(--muted); font-weight: 600; font-size: 12px; text-transform: uppercase; letter-spacing: .03em; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
code { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 12px;
  background: #f1f5f9; padding: 1px 5px; border-radius: 4px; word-break: break-all; }
.err { color: #7f1d1d; font-family: ui-monospace, SFMono-Regular, Menlo, monospace; font-size: 12px;
  white-space: pre-wrap; word-break: break-word; }
.pass { color: var(--good); font-weight: 700; } .fail { color: var(--bad); font-weight: 700; }
td.diag { background: #ccfbf1; font-weight: 700; }
.grid2 { display:grid; grid-template-columns: 1fr 1fr; gap: 18px; align-items: start; }
.pair { display:grid; grid-template-columns: 1fr 1fr; gap: 18px; margin-top: 18px; }
.pair > section { margin-top: 0; }
@media (max-width: 860px) { .pair { grid-template-columns: 1fr; } }
td.kind { white-space: nowrap; }
@media (max-width: 860px) { .grid2 { grid-template-columns: 1fr; } }
.empty { color: var(--muted); font-style: italic; }
footer { color: var(--muted); font-size: 12px; margin-top: 22px; }
""".strip()


def _csp_hash(script: str) -> str:
    return "sha256-" + base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()


def _card(key: str, value: str, note: str = "") -> str:
    return (f'<div class="card"><div class="k">{esc(key)}</div><div class="v">{esc(value)}</div>'
            f'<div class="n">{esc(note)}</div></div>')


def _header(d: ReportData) -> str:
    st = d.status
    badges = [f'<span class="badge {"good" if st.state == "sealed" else "warn"}">{esc(st.state)}</span>']
    if d.published == st.version:
        badges.append('<span class="badge good">published</span>')
    if d.validation is not None:
        badges.append(f'<span class="badge {"good" if d.validation.passed else "bad"}">validation '
                      f'{"passed" if d.validation.passed else "failed"}</span>')
    when = []
    if d.t_start is not None:
        when.append(f"started {_utc(d.t_start)}")
    if d.sealed_at is not None and d.t_start is not None:
        when.append(f"sealed {_utc(d.sealed_at)} after {_dur(d.sealed_at - d.t_start)}")
    if d.deadline is not None:
        ref = d.sealed_at if d.sealed_at is not None else None
        if ref is not None:
            slack = d.deadline - ref
            when.append(f"deadline {_utc(d.deadline)}: met with {_dur(slack)} to spare" if slack >= 0
                        else f"deadline {_utc(d.deadline)}: missed by {_dur(-slack)}")
        else:
            when.append(f"deadline {_utc(d.deadline)}")
    return (f'<header><h1>{esc(d.info.name)} {"".join(badges)}</h1>'
            f'<div class="sub">{esc(st.version)}</div>'
            f'<div class="sub">{esc("; ".join(when))}</div></header>')


def _cards(d: ReportData) -> str:
    st = d.status
    pct = 100.0 * d.answered / st.records if st.records else 100.0
    makespan = (d.sealed_at or d.t_end or 0.0) - d.t_start if d.t_start is not None else 0.0
    per_k = d.cost / (d.answered / 1000) if d.answered else 0.0
    tokens_in, tokens_out = d.tokens
    cards = [
        _card("records", f"{st.records:,}", f"{d.answered:,} answered ({pct:.1f}%)"),
        _card("results", f"{st.results:,}", f"{d.carried:,} carried from the base" if d.carried
              else "all computed in this version"),
        _card("dead letters", f"{st.dead_letters:,}",
              f"{st.dead_letters / st.records:.2%} of records" if st.records else ""),
        _card("makespan", _dur(makespan) if d.t_start is not None else "—",
              f"{d.per_worker_rate:,.1f} records/s per worker"),
        _card("leases lost", f"{st.leases_lost:,}",
              f"{st.leases_taken_back:,} taken back from dead owners; "
              f"{sum(d.stale_by_op.values()):,} stale writes refused"),
        _card("GPU-hours", f"{d.gpu_hours:,.3f}", "worker lease time"),
        _card("cost", f"${d.cost:,.2f}", f"at ${d.price:,.2f} per GPU-hour"),
        _card("per 1,000 records", f"${per_k:,.4f}" if per_k < 1 else f"${per_k:,.2f}", "answered"),
        _card("tokens", f"{tokens_in + tokens_out:,}", f"{tokens_in:,} in, {tokens_out:,} out"),
        _card("workers", f"{len({s.worker for s in d.leases}):,}", f"{len(d.leases):,} leases"),
        _card("attempts charged", f"{d.event_counts.get('attempt_failed', 0):,}",
              f"{sum(d.attempts_dead.values()):,} records given up on"),
        _card("engine failures", f"{d.event_counts.get('engine_crash', 0) + d.event_counts.get('engine_hang', 0):,}",
              f"{d.event_counts.get('engine_crash', 0):,} crashes, {d.event_counts.get('engine_hang', 0):,} hangs"),
    ]
    return '<div class="cards">' + "".join(cards) + "</div>"


def _throughput_section(d: ReportData) -> str:
    note = (f" The database clock was moved {_dur(d.shifted_seconds)} by a test hook in place of waiting out "
            f"leases; that time is taken out of the axis." if d.shifted_seconds else "")
    return ('<section><h2>Throughput</h2><p class="what">Records answered per second (results and dead '
            f'letters, in {_tick(d.bin_seconds)} bins) and the leases held at the time.{esc(note)}</p>'
            + throughput_chart(d)
            + _legend([("#0f766e", "records/s"), ("#7c3aed", "leases held (right axis)")]) + "</section>")


def _timeline_section(d: ReportData) -> str:
    done = sum(1 for s in d.leases if s.outcome == "done")
    expired = sum(1 for s in d.leases if s.outcome == "expired")
    released = sum(1 for s in d.leases if s.outcome == "released")
    taken = sum(1 for s in d.leases if s.outcome == "taken back")
    what = (f"{len(d.leases):,} leases on {len({s.shard_no for s in d.leases}):,} shards by "
            f"{len({s.worker for s in d.leases}):,} workers: {done:,} completed, {expired:,} expired and "
            f"re-leased (dashed line to the re-lease), {taken:,} taken back from owners proven dead, "
            f"{released:,} given back. Point at a lease to see it and every other lease of its shard.")
    legend = _legend([(COLORS["done"], "completed"), ("", "expired"), (COLORS["taken back"], "taken back"),
                      (COLORS["released"], "released"),
                      (COLORS["open"], "held now"), (COLORS["stale_epoch"], "stale epoch refused"),
                      (COLORS["engine_crash"], "engine crash"), (COLORS["engine_hang"], "engine hang"),
                      (COLORS["split"], "tail split off")])
    legend = legend.replace('<i style="background:"></i>', '<i class="hatch"></i>')
    return (f'<section><h2>Shard leases per worker</h2><p class="what">{esc(what)}</p>'
            + timeline_chart(d) + legend + "</section>")


def _attempts_section(d: ReportData) -> str:
    keys = sorted(set(d.attempts_results) | set(d.attempts_dead))
    rows: list[tuple[str, Sequence[float], Sequence[str]]] = []
    for k in keys:
        r, x = d.attempts_results.get(k, 0), d.attempts_dead.get(k, 0)
        name = f"{k} charged" if k == 0 else (f"attempt {k}")
        rows.append((name, [float(r), float(x)],
                     [f"{r:,} results written at attempt {k}", f"{x:,} dead letters after {k} attempts"]))
    what = ("How many tries records took: a result's attempt is the charged failures before it plus one; "
            "a dead letter's is the failures that retired it (0 when it was over the length cap). "
            "Records redone after a lost lease are not charged.")
    if d.carried:
        what += f" {d.carried:,} carried results are left out."
    return (f'<section><h2>Attempts per record</h2><p class="what">{esc(what)}</p>'
            + hbar_chart(rows, ["results", "dead letters"], ["#14b8a6", "#f97316"], "attempts per record")
            + _legend([("#14b8a6", "results"), ("#f97316", "dead letters")]) + "</section>")


def _dead_letters_section(d: ReportData) -> str:
    st = d.status
    if not d.dead_counts:
        return ('<section><h2>Dead letters</h2><p class="what">No record was given up on.</p></section>')
    rows = []
    for kind, n in sorted(d.dead_counts.items(), key=lambda kv: -kv[1]):
        samples = "".join(
            f'<div><code>{esc(s.record_id)}</code> after {s.attempts} attempts'
            f'<div class="err">{esc(s.error[:ERROR_CHARS] + ("…" if len(s.error) > ERROR_CHARS else ""))}'
            f"</div></div>" for s in d.dead_samples.get(kind, []))
        rows.append(f'<tr><td class="kind"><code>{esc(kind)}</code></td><td class="num">{n:,}</td>'
                    f'<td class="num">{n / st.records:.3%}</td><td>{samples}</td></tr>')
    return ('<section><h2>Dead letters by error kind</h2><p class="what">Records that ended without a result, '
            'with a sample of each kind.</p><table><thead><tr><th>kind</th><th class="num">records</th>'
            '<th class="num">of all</th><th>sample</th></tr></thead><tbody>' + "".join(rows)
            + "</tbody></table></section>")


def _labels_section(d: ReportData) -> str:
    if not d.label_field:
        return ('<section><h2>Label distribution</h2><p class="what">The spec names no '
                '<code>output.label_field</code>, so there is no categorical field to show.</p></section>')
    total = sum(d.labels.values()) or 1
    before_total = sum(d.compare_labels.values()) or 1
    cats = sorted(set(d.labels) | set(d.compare_labels),
                  key=lambda c: (-d.labels.get(c, 0), -d.compare_labels.get(c, 0), c))
    shown, rest = cats[:LABELS_SHOWN], cats[LABELS_SHOWN:]
    rows: list[tuple[str, Sequence[float], Sequence[str]]] = []
    series = ["this version"] + (["compared"] if d.compare_to else [])
    for c in shown:
        a, b = d.labels.get(c, 0), d.compare_labels.get(c, 0)
        values = [a / total] + ([b / before_total] if d.compare_to else [])
        tips = [f"{c}: {a:,} results ({a / total:.1%}) in this version"]
        if d.compare_to:
            tips.append(f"{c}: {b:,} results ({b / before_total:.1%}) in {d.compare_to}")
        rows.append((c, values, tips))
    if rest:
        a = sum(d.labels.get(c, 0) for c in rest)
        b = sum(d.compare_labels.get(c, 0) for c in rest)
        rows.append((f"{len(rest)} other categories", [a / total] + ([b / before_total] if d.compare_to else []),
                     [f"{a:,} results in other categories"] + ([f"{b:,}"] if d.compare_to else [])))
    against = (f"against {d.compare_to} ({d.compare_why})" if d.compare_to else f"({d.compare_why})")
    new = sorted(set(d.labels) - set(d.compare_labels)) if d.compare_to else []
    gone = sorted(set(d.compare_labels) - set(d.labels)) if d.compare_to else []
    extra = ""
    if new:
        extra += " New: " + ", ".join(new[:10]) + ("…" if len(new) > 10 else "") + "."
    if gone:
        extra += " Vanished: " + ", ".join(gone[:10]) + ("…" if len(gone) > 10 else "") + "."
    return (f'<section><h2>Label distribution: <code>{esc(d.label_field)}</code></h2><p class="what">'
            f'Share of results per category, {esc(against)}.{esc(extra)}</p>'
            + hbar_chart(rows, series, ["#2563eb", "#cbd5e1"], "label distribution", share=True)
            + _legend([("#2563eb", "this version")] + ([("#cbd5e1", d.compare_to or "")] if d.compare_to else []))
            + "</section>")


def _validation_section(d: ReportData) -> str:
    v = d.validation
    if v is None:
        return ('<section><h2>Validation</h2><p class="what">This version has not been validated yet '
                '(<code>batchline validate VERSION</code>).</p></section>')
    checks = v.report.get("checks") or []
    rows = "".join(
        f'<tr><td>{esc(c.get("name", ""))}</td><td class="{"pass" if c.get("passed") else "fail"}">'
        f'{"pass" if c.get("passed") else "FAIL"}</td><td>{esc(c.get("figure", ""))}</td></tr>'
        for c in checks if isinstance(c, dict))
    evaluation = next((c for c in checks if isinstance(c, dict) and c.get("name") == "evaluation"), None)
    return (f'<section><h2>Validation <span class="badge {"good" if v.passed else "bad"}">'
            f'{"passed" if v.passed else "failed"}</span></h2><p class="what">The latest validation, '
            f'{esc(_utc(v.ts))}.</p><table><thead><tr><th>check</th><th>result</th><th>figure</th></tr></thead>'
            f"<tbody>{rows}</tbody></table>"
            + (confusion_table(evaluation.get("details") or {}) if evaluation else "") + "</section>")


def confusion_table(details: dict[str, Any]) -> str:
    """The evaluation's confusion matrix: each expected label's records by the label answered."""
    confusion: dict[str, dict[str, int]] = details.get("confusion") or {}
    if not confusion:
        return ""
    answered = sorted({a for row in confusion.values() for a in row} | set(confusion))
    expected = sorted(confusion)
    head = "".join(f'<th class="num">{esc(a)}</th>' for a in answered)
    body = "".join(
        f"<tr><th>{esc(e)}</th>" + "".join(
            f'<td class="num{" diag" if a == e else ""}">{confusion[e].get(a, 0) or ""}</td>' for a in answered)
        + f'<td class="num">{sum(confusion[e].values()):,}</td></tr>' for e in expected)
    return (f'<h3>Evaluation: expected {esc(details.get("field", "label"))} (rows) against the answer '
            f'(columns)</h3><table class="confusion"><thead><tr><th></th>{head}<th class="num">records</th>'
            f"</tr></thead><tbody>{body}</tbody></table>")


def _cost_section(d: ReportData) -> str:
    total = sum(d.lease_seconds_by_outcome.values())
    rows = []
    for outcome in ("done", "expired", "taken back", "released", "open"):
        s = d.lease_seconds_by_outcome.get(outcome, 0.0)
        if not s:
            continue
        rows.append(f'<tr><td>{esc(OUTCOME_WORDS[outcome])}</td><td class="num">{s / 3600:,.3f}</td>'
                    f'<td class="num">{s / total:.1%}</td><td class="num">${s / 3600 * d.price:,.2f}</td></tr>')
    tokens_in, tokens_out = d.tokens
    per_gpu_hour = (tokens_out / d.gpu_hours) if d.gpu_hours else 0.0
    stale = ", ".join(f"{op} {n:,}" for op, n in sorted(d.stale_by_op.items())) or "none"
    ev = d.event_counts
    facts = [
        ("tokens in", f"{tokens_in:,}"), ("tokens out", f"{tokens_out:,}"),
        ("output tokens per GPU-hour", f"{per_gpu_hour:,.0f}"),
        ("records per second per worker", f"{d.per_worker_rate:,.2f}"),
        ("charged attempts", f"{ev.get('attempt_failed', 0):,}"),
        ("engine crashes / hangs", f"{ev.get('engine_crash', 0):,} / {ev.get('engine_hang', 0):,}"),
        ("stale writes refused", stale),
    ]
    fact_rows = "".join(f'<tr><td>{esc(k)}</td><td class="num">{esc(v)}</td></tr>' for k, v in facts)
    return ('<section><h2>Tokens, GPU-hours and cost</h2><p class="what">GPU time is worker lease time: '
            'every second a worker held a shard, whether the work was kept or lost. Time in leases that expired '
            'or were given back is where the job lost time.</p><div class="grid2"><table><thead><tr>'
            '<th>lease time</th><th class="num">GPU-hours</th><th class="num">share</th>'
            f'<th class="num">cost</th></tr></thead><tbody>{"".join(rows)}</tbody></table>'
            f'<table><tbody>{fact_rows}</tbody></table></div></section>')


def provider_cost(provider: ProviderSpec, totals: RouteTotals | None) -> float | None:
    """Tokens at the configured batch prices; None when no price is configured."""
    if totals is None or (provider.input_price_per_mtok is None and provider.output_price_per_mtok is None):
        return None
    return (totals.input_tokens * (provider.input_price_per_mtok or 0.0)
            + totals.output_tokens * (provider.output_price_per_mtok or 0.0)) / 1e6


def _routes_section(d: ReportData) -> str:
    if not d.providers:
        return ""
    local = d.routes.get(LOCAL_ROUTE)
    engine = d.spec.model.engine
    rows = [(LOCAL_ROUTE, f"{engine} (in-house)", local, f"{d.gpu_hours:,.3f} GPU-hours",
             f"${d.cost:,.2f}", "stays in-house")]
    for p in d.providers:
        totals = d.routes.get(p.route)
        cost = provider_cost(p, totals)
        rows.append((p.route, f"{p.api} batch, {p.model}", totals, "tokens at batch prices",
                     f"${cost:,.2f}" if cost is not None else "no price configured", p.retention))
    body = "".join(
        f"<tr><td>{esc(route)}</td><td>{esc(where)}</td>"
        f'<td class="num">{(t.records if t else 0):,}</td><td class="num">{(t.results if t else 0):,}</td>'
        f'<td class="num">{(t.dead_letters if t else 0):,}</td>'
        f'<td class="num">{(t.input_tokens if t else 0):,} / {(t.output_tokens if t else 0):,}</td>'
        f"<td>{esc(basis)}</td><td class=\"num\">{esc(cost)}</td><td>{esc(retention)}</td></tr>"
        for route, where, t, basis, cost, retention in rows)
    field_name = d.spec.routing.class_field if d.spec.routing else "?"
    return ('<section><h2>Where records went</h2><p class="what">Records go to a hosted provider only when '
            f"their {esc(field_name)} names a class cleared for it; a record without it, or with any other "
            "class, stays in-house. Cost is GPU-hours at the GPU price for the in-house engine and tokens at "
            "the configured batch prices for each provider.</p><table><thead><tr><th>route</th><th>answered by</th>"
            '<th class="num">records</th><th class="num">results</th><th class="num">dead letters</th>'
            '<th class="num">tokens in / out</th><th>cost basis</th><th class="num">cost</th>'
            f"<th>data retention</th></tr></thead><tbody>{body}</tbody></table></section>")


def render(d: ReportData) -> str:
    body = "".join([
        _header(d), _cards(d), _throughput_section(d), _timeline_section(d),
        '<div class="pair">', _attempts_section(d), _labels_section(d), "</div>",
        _dead_letters_section(d), _validation_section(d), _routes_section(d), _cost_section(d),
        f'<footer>Generated {esc(_utc(d.generated))} by batchline report; engine '
        f'{esc(d.spec.model.engine)}.</footer>',
    ])
    csp = (f"default-src 'none'; style-src 'unsafe-inline'; img-src data:; "
           f"script-src '{_csp_hash(SENTINEL_JS)}'; base-uri 'none'; form-action 'none'")
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta http-equiv="Content-Security-Policy" content="{esc(csp)}">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<meta name="color-scheme" content="light">'
            f"<title>{esc(d.info.name)}: batchline report</title><style>{CSS}</style>"
            f"<script>{SENTINEL_JS}</script></head>"
            f"<body><main>{body}</main></body></html>\n")


def write_report(store: ReaderStore, version: str, out: Path, *, price: float = DEFAULT_GPU_HOUR_PRICE) -> ReportData:
    if price < 0:
        raise BatchlineError("--gpu-hour-price must not be negative")
    data = collect(store, version, price=price)
    text = render(data)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(out)  # a browser reloading the file never sees half a page
    except OSError as exc:
        raise BatchlineError(f"cannot write {out}: {exc.strerror or exc}") from None
    return data

