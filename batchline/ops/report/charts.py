"""The report's charts, drawn as inline SVG, and the formatting they share with the page."""

from __future__ import annotations

import collections
import datetime as dt
import itertools
import math
from collections.abc import Callable, Sequence

from batchline.ops.report.data import LeaseSpan, ReportData, esc

# --- formatting -----------------------------------------------------------------------------


def dur(seconds: float) -> str:
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


def tick(seconds: float) -> str:
    return f"{seconds:g}s" if seconds < 10 else dur(seconds)


def utc(ts: float) -> str:
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


def _axes(y_max: float, span: float, y: Callable[[float], float], x: Callable[[float], float],
          left: float, right: float, h: int) -> list[str]:
    """Five grid lines up to y_max with their values, and the time ticks along the bottom (x of seconds in)."""
    out = []
    for i in range(5):
        v = y_max * i / 4
        out.append(f'<line class="grid" x1="{left}" x2="{right}" y1="{y(v):.1f}" y2="{y(v):.1f}"/>'
                   f'<text class="tick" x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{_num(v)}</text>')
    for t in _time_ticks(span):
        out.append(f'<text class="tick" x="{x(t):.1f}" y="{h - 12}" text-anchor="middle">+{tick(t)}</text>')
    return out


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

    out = _axes(y_max, span, y, x, left, w - right, h)
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
                   f'width="{pw / len(d.bins):.2f}" height="{ph}"><title>{esc(utc(t0))}: {n:,} records '
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
                   f'text-anchor="middle">+{tick(t)}</text>')
    by_shard: dict[int, list[LeaseSpan]] = collections.defaultdict(list)
    for s in d.leases:
        by_shard[s.shard_no].append(s)
    for s in d.leases:
        end = s.end if s.end is not None else s.start
        x0, x1 = x(s.start), max(x(end), x(s.start) + 1.5)
        yy = y(s.worker) + (row_h - bar_h) / 2
        tip = (f"shard {s.shard_no}, epoch {s.epoch}: {OUTCOME_WORDS[s.outcome]}"
               f"{' (' + s.detail + ')' if s.detail else ''}; {dur(end - s.start)} from {utc(s.start)}; "
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
        out.append(f'{shape} class="marker" fill="{COLORS[m.kind]}"><title>{esc(utc(m.ts))}: '
                   f'{esc(m.text)}</title>{"</path>" if m.kind == "stale_epoch" else "</circle>"}')
    return _svg(w, h, "shard leases per worker over time", "".join(out))


def legend(items: Sequence[tuple[str, str]]) -> str:
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




def pace_chart(d: ReportData) -> str:
    """Committed progress against the expected line to the deadline, the paid workers that ran
    shaded beneath (right axis), and the deadline marked."""
    pace = d.pace
    if pace is None or d.t_start is None or not d.bins:
        return '<p class="empty">No deadline, or no record answered yet.</p>'
    w, h, left, right, top, bottom = 1000, 260, 64, 56, 16, 34
    pw, ph = w - left - right, h - top - bottom
    t0 = d.t_start
    span = max(len(d.bins) * d.bin_seconds, pace.deadline - t0, 1.0)
    records = max(d.status.records, 1)

    def x(t: float) -> float:
        return left + pw * min(max(t - t0, 0.0), span) / span

    def y(v: float) -> float:
        return top + ph * (1 - v / records)

    steps = 48
    paid_counts = [sum(1 for a, b in pace.paid if a <= t0 + (i + 0.5) * span / steps < b) for i in range(steps)]
    p_max = max(1, max(paid_counts))
    out = _axes(records, span, y, lambda t: x(t0 + t), left, w - right, h)
    for i, n in enumerate(paid_counts):
        if n:
            height = ph * n / p_max * 0.5
            out.append(f'<rect class="paid" x="{x(t0 + i * span / steps):.1f}" y="{top + ph - height:.1f}" '
                       f'width="{pw / steps:.2f}" height="{height:.1f}"><title>{n} paid workers</title></rect>')
    done, points = pace.done_at_start, [f"M{x(t0):.1f},{y(pace.done_at_start):.1f}"]
    for i, n in enumerate(d.bins):
        done += n
        points.append(f"L{x(t0 + (i + 1) * d.bin_seconds):.1f},{y(min(done, records)):.1f}")
    out.append(f'<path class="committed" d="{" ".join(points)}"/>')
    # The line, flat until it starts to rise (a restart overhead after the run start, which may
    # be before the first lease the chart starts at), then to every record by its end.
    rise = max(pace.line_end - pace.line_start, 1e-9)
    start_at = max(t0, pace.line_start)
    start_v = pace.done_at_start + (d.status.records - pace.done_at_start) * min(
        1.0, max(0.0, (start_at - pace.line_start) / rise))
    out.append(f'<path class="expected" d="M{x(t0):.1f},{y(start_v):.1f} L{x(start_at):.1f},{y(start_v):.1f} '
               f'L{x(pace.line_end):.1f},{y(records):.1f} L{x(pace.deadline):.1f},{y(records):.1f}"/>')
    out.append(f'<line class="deadline" x1="{x(pace.deadline):.1f}" x2="{x(pace.deadline):.1f}" y1="{top}" '
               f'y2="{top + ph}"/><text class="tick deadline-tick" x="{x(pace.deadline) - 4:.1f}" y="{top + 12}" '
               f'text-anchor="end">deadline {esc(utc(pace.deadline))}</text>')
    out.append(f'<text class="axis" x="{left}" y="{top - 4}">records committed</text>'
               f'<text class="axis paid-tick" x="{w - right}" y="{top - 4}" text-anchor="end">'
               f'paid workers (up to {p_max})</text>')
    return _svg(w, h, "committed progress against the expected progress to the deadline, and the paid workers",
                "".join(out))
