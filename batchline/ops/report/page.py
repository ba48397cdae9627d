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
import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from batchline.errors import BatchlineError
from batchline.ops.report.charts import (
    COLORS,
    OUTCOME_WORDS,
    dur,
    hbar_chart,
    legend,
    pace_chart,
    throughput_chart,
    tick,
    timeline_chart,
    utc,
)
from batchline.ops.report.data import (
    ERROR_CHARS,
    LABELS_SHOWN,
    ReportData,
    collect,
    esc,
)
from batchline.spec import LOCAL_ROUTE, ProviderSpec
from batchline.spec.deadline import format_rate
from batchline.store import ReaderStore, RouteTotals
from batchline.targets.files import atomic_write

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
svg .committed { fill: none; stroke: #0f766e; stroke-width: 2; }
svg .expected { fill: none; stroke: #64748b; stroke-width: 1.5; stroke-dasharray: 6 4; }
svg .deadline { stroke: #dc2626; stroke-width: 1.5; } svg .deadline-tick { fill: #dc2626; }
svg .paid { fill: #f59e0b; opacity: .45; } svg .paid-tick { fill: #b45309; }
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
        when.append(f"started {utc(d.t_start)}")
    if d.sealed_at is not None and d.t_start is not None:
        when.append(f"sealed {utc(d.sealed_at)} after {dur(d.sealed_at - d.t_start)}")
    if d.deadline is not None:
        ref = d.sealed_at if d.sealed_at is not None else None
        if ref is not None:
            slack = d.deadline - ref
            when.append(f"deadline {utc(d.deadline)}: met with {dur(slack)} to spare" if slack >= 0
                        else f"deadline {utc(d.deadline)}: missed by {dur(-slack)}")
        else:
            when.append(f"deadline {utc(d.deadline)}")
    return (f'<header><h1>{esc(d.info.name)} {"".join(badges)}</h1>'
            f'<div class="sub">{esc(st.version)}</div>'
            f'<div class="sub">{esc("; ".join(when))}</div></header>')


def _price_words(d: ReportData) -> str:
    prices = d.cost.prices
    parts = [f"spot at {prices.spot:,.2f}/h" if prices.spot is not None else "",
             f"paid at {prices.paid:,.2f}/h" if prices.paid is not None else ""]
    return ", ".join(p for p in parts if p) or "no worker time priced"


def _cards(d: ReportData) -> str:
    st = d.status
    pct = 100.0 * d.answered / st.records if st.records else 100.0
    makespan = (d.sealed_at or d.t_end or 0.0) - d.t_start if d.t_start is not None else 0.0
    per_k = d.cost.per_thousand(d.answered)
    total = d.cost.total
    prices = d.cost.prices
    tokens_in, tokens_out = d.tokens
    cards = [
        _card("records", f"{st.records:,}", f"{d.answered:,} answered ({pct:.1f}%)"),
        _card("results", f"{st.results:,}", f"{d.carried:,} carried from the base" if d.carried
              else "all computed in this version"),
        _card("dead letters", f"{st.dead_letters:,}",
              f"{st.dead_letters / st.records:.2%} of records" if st.records else ""),
        _card("makespan", dur(makespan) if d.t_start is not None else "—",
              f"{format_rate(d.per_worker_rate)} records/s per worker"),
        _card("leases lost", f"{st.leases_lost:,}",
              f"{st.leases_taken_back:,} taken back from dead owners; "
              f"{sum(d.stale_by_op.values()):,} stale writes refused"),
        _card(prices.unit, f"{d.lease_hours:,.3f}", "worker lease time"),
        _card("cost", f"{total:,.2f}" if total is not None else "—",
              _price_words(d) if total is not None else "no spot price: give fallback.spot_cost_per_worker_hour"),
        _card("per 1,000 records", "—" if per_k is None else f"{per_k:,.4f}" if per_k < 1 else f"{per_k:,.2f}",
              "answered"),
        _card("tokens", f"{tokens_in + tokens_out:,}", f"{tokens_in:,} in, {tokens_out:,} out"),
        _card("workers", f"{len({s.worker for s in d.leases}):,}", f"{len(d.leases):,} leases"),
        _card("attempts charged", f"{d.event_counts.get('attempt_failed', 0):,}",
              f"{sum(d.attempts_dead.values()):,} records given up on"),
        _card("engine failures", f"{d.event_counts.get('engine_crash', 0) + d.event_counts.get('engine_hang', 0):,}",
              f"{d.event_counts.get('engine_crash', 0):,} crashes, {d.event_counts.get('engine_hang', 0):,} hangs"),
    ]
    return '<div class="cards">' + "".join(cards) + "</div>"


def _throughput_section(d: ReportData) -> str:
    note = (f" The database clock was moved {dur(d.shifted_seconds)} by a test hook in place of waiting out "
            f"leases; that time is taken out of the axis." if d.shifted_seconds else "")
    return ('<section><h2>Throughput</h2><p class="what">Records answered per second (results and dead '
            f'letters, in {tick(d.bin_seconds)} bins) and the leases held at the time.{esc(note)}</p>'
            + throughput_chart(d)
            + legend([("#0f766e", "records/s"), ("#7c3aed", "leases held (right axis)")]) + "</section>")


def _timeline_section(d: ReportData) -> str:
    done = sum(1 for s in d.leases if s.outcome == "done")
    expired = sum(1 for s in d.leases if s.outcome == "expired")
    released = sum(1 for s in d.leases if s.outcome == "released")
    taken = sum(1 for s in d.leases if s.outcome == "taken back")
    what = (f"{len(d.leases):,} leases on {len({s.shard_no for s in d.leases}):,} shards by "
            f"{len({s.worker for s in d.leases}):,} workers: {done:,} completed, {expired:,} expired and "
            f"re-leased (dashed line to the re-lease), {taken:,} taken back from owners proven dead, "
            f"{released:,} given back. Point at a lease to see it and every other lease of its shard.")
    key = legend([(COLORS["done"], "completed"), ("", "expired"), (COLORS["taken back"], "taken back"),
                      (COLORS["released"], "released"),
                      (COLORS["open"], "held now"), (COLORS["stale_epoch"], "stale epoch refused"),
                      (COLORS["engine_crash"], "engine crash"), (COLORS["engine_hang"], "engine hang"),
                      (COLORS["split"], "tail split off")])
    key = key.replace('<i style="background:"></i>', '<i class="hatch"></i>')
    return (f'<section><h2>Shard leases per worker</h2><p class="what">{esc(what)}</p>'
            + timeline_chart(d) + key + "</section>")


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
            + legend([("#14b8a6", "results"), ("#f97316", "dead letters")]) + "</section>")


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
            + legend([("#2563eb", "this version")] + ([("#cbd5e1", d.compare_to or "")] if d.compare_to else []))
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
    # "evaluation": the labels check's name in reports recorded before it was a grader.
    evaluation = next((c for c in checks if isinstance(c, dict) and c.get("name") in ("labels", "evaluation")),
                      None)
    reproduced = next((c for c in checks if isinstance(c, dict) and c.get("name") == "reproducibility"), None)
    return (f'<section><h2>Validation <span class="badge {"good" if v.passed else "bad"}">'
            f'{"passed" if v.passed else "failed"}</span></h2><p class="what">The latest validation, '
            f'{esc(utc(v.ts))}.</p><table><thead><tr><th>check</th><th>result</th><th>figure</th></tr></thead>'
            f"<tbody>{rows}</tbody></table>"
            + (confusion_table(evaluation.get("details") or {}) if evaluation else "")
            + "".join(graded(c) for c in checks if isinstance(c, dict))
            + (disagreements(reproduced.get("details") or {}) if reproduced else "") + "</section>")


def graded(check: dict[str, Any]) -> str:
    """A grader's share per category and its failing examples (batchline.check.graders.base's
    details, which every grader reports through)."""
    details = check.get("details") or {}
    per = details.get("by_category")
    if not isinstance(per, dict) or not per:
        return ""
    rows = "".join(
        f'<tr><td>{esc(str(cat))}</td><td class="num">{int(v.get("graded", 0)):,}</td>'
        f'<td class="num">{float(v.get("share", 0.0)):.1%}</td></tr>'
        for cat, v in per.items() if isinstance(v, dict))
    failing = details.get("failing") or []
    items = "".join(f'<li><code>{esc(str(f.get("id", "")))}</code> ({esc(str(f.get("category", "")))}): '
                    f'{esc(str(f.get("why", "")))}</li>' for f in failing if isinstance(f, dict))
    name = esc(str(check.get("name", "")))
    cost = details.get("seconds_per_1000")
    spent = f" Graded at {float(cost):,.1f} s per 1,000 results." if cost is not None else ""
    return (f'<h3>{name}: the share that passes, per category</h3><p class="what">{spent}</p>'
            f'<table><thead><tr><th>category</th><th class="num">graded</th><th class="num">passes</th></tr></thead>'
            f"<tbody>{rows}</tbody></table>"
            + (f"<h4>{name}: failing ({len(failing)} shown)</h4><ul>{items}</ul>" if items else ""))


def disagreements(details: dict[str, Any]) -> str:
    """The reproducibility check's records that came out otherwise when recomputed (the stored,
    first answer is the version's)."""
    found = details.get("disagreements") or []
    if not found:
        return ""
    items = "".join(f"<li><code>{esc(str(line))}</code></li>" for line in found)
    return (f"<h3>Recomputed otherwise ({len(found)} shown; the stored answer, the first attempt's, is the "
            f"version's)</h3><ul>{items}</ul>")


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


def _pace_section(d: ReportData) -> str:
    pace = d.pace
    if pace is None:
        return ""
    end = d.sealed_at
    verdict = ("not sealed yet" if end is None else f"met with {dur(pace.deadline - end)} to spare"
               if end <= pace.deadline else f"missed by {dur(end - pace.deadline)}")
    cost = d.cost
    per_k = cost.per_thousand(d.answered)
    facts = [("deadline", f"{utc(pace.deadline)}: {verdict}"),
             (f"spot {cost.prices.unit}", f"{cost.spot_seconds / 3600:,.3f}"
              + (f" (cost {cost.spot_cost:,.2f})" if cost.spot_cost is not None else " (no spot price)")),
             (f"paid {cost.prices.unit}", f"{cost.paid_seconds / 3600:,.3f} (cost {cost.paid_cost:,.2f}, "
                                          f"{len(pace.paid)} paid starts)"),
             ("cost per 1,000 records", f"{per_k:,.4f}" if per_k is not None else "not priced")]
    rows = "".join(f'<tr><td>{esc(k)}</td><td class="num">{esc(v)}</td></tr>' for k, v in facts)
    return ('<section><h2>Meeting the deadline</h2><p class="what">Records committed (results and dead letters) '
            'against the expected progress, which rises from the run start to every record a lease and two '
            'restart overheads before the deadline; paid workers of the same version, bought while the job was '
            'behind, are shaded beneath.</p>' + pace_chart(d)
            + legend([("#0f766e", "committed"), ("#64748b", "expected"), ("#f59e0b", "paid workers"),
                      ("#dc2626", "deadline")]) + f"<table><tbody>{rows}</tbody></table></section>")


def _cost_section(d: ReportData) -> str:
    total = sum(d.lease_seconds_by_outcome.values())
    unit = d.cost.prices.unit
    rows = []
    for outcome in ("done", "expired", "taken back", "released", "open"):
        s = d.lease_seconds_by_outcome.get(outcome, 0.0)
        if not s:
            continue
        rows.append(f'<tr><td>{esc(OUTCOME_WORDS[outcome])}</td><td class="num">{s / 3600:,.3f}</td>'
                    f'<td class="num">{s / total:.1%}</td></tr>')
    tokens_in, tokens_out = d.tokens
    per_hour = (tokens_out / d.lease_hours) if d.lease_hours else 0.0
    stale = ", ".join(f"{op} {n:,}" for op, n in sorted(d.stale_by_op.items())) or "none"
    ev = d.event_counts
    cost = d.cost
    facts = [
        (f"spot {unit}", f"{cost.spot_seconds / 3600:,.3f}" + (
            f" at {cost.prices.spot:,.2f}/h: {cost.spot_cost:,.2f}" if cost.spot_cost is not None
            else " (no spot price)")),
        (f"paid {unit}", f"{cost.paid_seconds / 3600:,.3f}" + (
            f" at {cost.prices.paid:,.2f}/h: {cost.paid_cost:,.2f}" if cost.prices.paid is not None else "")),
        ("cost", f"{cost.total:,.2f}" if cost.total is not None else "not priced"),
        ("tokens in", f"{tokens_in:,}"), ("tokens out", f"{tokens_out:,}"),
        (f"output tokens per {unit[:-1]}", f"{per_hour:,.0f}"),
        ("records per second per worker", format_rate(d.per_worker_rate)),
        ("charged attempts", f"{ev.get('attempt_failed', 0):,}"),
        ("engine crashes / hangs", f"{ev.get('engine_crash', 0):,} / {ev.get('engine_hang', 0):,}"),
        ("stale writes refused", stale),
    ]
    fact_rows = "".join(f'<tr><td>{esc(k)}</td><td class="num">{esc(v)}</td></tr>' for k, v in facts)
    return (f'<section><h2>Tokens, {esc(unit)} and cost</h2><p class="what">Worker time is lease time: '
            'every second a worker held a shard, whether the work was kept or lost. Time in leases that expired '
            "or were given back is where the job lost time. Cost is the spot workers' lease time at the spec's "
            "spot price and the paid workers' time (first heartbeat to stop) at its fallback price."
            '</p><div class="grid2"><table><thead><tr>'
            f'<th>lease time</th><th class="num">{esc(unit)}</th><th class="num">share</th>'
            f'</tr></thead><tbody>{"".join(rows)}</tbody></table>'
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
    total = d.cost.total
    rows = [(LOCAL_ROUTE, f"{engine} (in-house)", local, f"{d.lease_hours:,.3f} {d.cost.prices.unit}",
             f"{total:,.2f}" if total is not None else "no spot price configured", "stays in-house")]
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
            "class, stays in-house. Cost is worker time at the spec's prices for the in-house engine and tokens at "
            "the configured batch prices for each provider.</p><table><thead><tr><th>route</th><th>answered by</th>"
            '<th class="num">records</th><th class="num">results</th><th class="num">dead letters</th>'
            '<th class="num">tokens in / out</th><th>cost basis</th><th class="num">cost</th>'
            f"<th>data retention</th></tr></thead><tbody>{body}</tbody></table></section>")


def render(d: ReportData) -> str:
    body = "".join([
        _header(d), _cards(d), _throughput_section(d), _pace_section(d), _timeline_section(d),
        '<div class="pair">', _attempts_section(d), _labels_section(d), "</div>",
        _dead_letters_section(d), _validation_section(d), _routes_section(d), _cost_section(d),
        f'<footer>Generated {esc(utc(d.generated))} by batchline report; engine '
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


def write_report(store: ReaderStore, version: str, out: Path, *, price: float | None = None) -> ReportData:
    if price is not None and price < 0:
        raise BatchlineError("--gpu-hour-price must not be negative")
    data = collect(store, version, price=price)
    text = render(data)
    out = Path(out)
    try:
        # Written beside it under a name no one can guess and renamed over it: a browser
        # reloading the file never sees half a page.
        atomic_write(out, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    except OSError as exc:
        raise BatchlineError(f"cannot write {out}: {exc.strerror or exc}") from None
    return data

