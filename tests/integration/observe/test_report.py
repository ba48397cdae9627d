"""The HTML report: what it shows comes from the store, and nothing untrusted runs."""

from __future__ import annotations

import argparse
import html
import re
from pathlib import Path
from typing import Any

import pytest

from batchline.cli import observe
from batchline.errors import BatchlineError
from batchline.ops.report.data import collect
from batchline.ops.report.page import SENTINEL_JS, render, write_report
from batchline.snapshot import Slice, read_slice
from batchline.store import Lease, LeaseLost, ResultRow, Store
from tests.helpers import planned
from tests.integration.observe.support import EVIL, EVIL_LABEL, EVIL_NEW_LABEL, hostile_job, parse


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="batchline")
    observe.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


@pytest.fixture
def hostile(job_factory: Any, store: Store) -> Any:
    return hostile_job(job_factory, store)


def test_every_untrusted_string_is_escaped_and_no_script_but_the_pages_own(
        hostile: Any, store: Store, tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    write_report(store, hostile.version, out)
    text = out.read_text(encoding="utf-8")
    page = parse(text)

    assert page.scripts == [SENTINEL_JS]
    assert [a for a in page.attrs if a[1].lower().startswith("on")] == []
    assert [a for a in page.attrs if a[1] == "data-pwned"] == []
    assert not {"img", "iframe", "b", "object", "embed", "link", "base"} & set(page.tags)
    for evil in EVIL:
        assert evil not in text
        # Shown, escaped (in full in a table cell or a tooltip), not dropped.
        assert html.escape(evil, quote=True) in text, evil
    # The hostile new label reached the validation figures too, and is escaped there.
    assert re.search(r"drift.*?new \[&#x27;&lt;svg onload=", text, re.S)


def test_the_page_loads_nothing_from_outside(hostile: Any, store: Store) -> None:
    text = render(collect(store, hostile.version))
    page = parse(text)
    fetching = [(tag, k, v) for tag, k, v in page.attrs if k in ("src", "href", "xlink:href", "action", "data",
                                                                   "srcset", "poster")]
    assert fetching == []
    assert all(m == "url(#" for m in re.findall(r"url\(.?", text)), "only in-page references"
    assert "@import" not in text
    csp = next(v for tag, k, v in page.attrs if tag == "meta" and k == "content" and v and "default-src" in v)
    assert "default-src 'none'" in csp and "script-src 'sha256-" in csp


def test_it_shows_what_the_store_holds(hostile: Any, store: Store, tmp_path: Path) -> None:
    data = write_report(store, hostile.version, tmp_path / "r.html", price=7.0)
    text = (tmp_path / "r.html").read_text(encoding="utf-8")
    st = store.status(hostile.version)

    assert data.answered == st.records == 40
    assert data.dead_counts == {"engine_error": 1, "invalid_output": 1}
    assert data.labels == {k: v for k, v in store.label_counts(hostile.version).items() if k is not None}
    assert data.compare_to == hostile.published and hostile.published in text
    assert EVIL_NEW_LABEL in data.labels and EVIL_NEW_LABEL not in data.compare_labels
    assert EVIL_LABEL in data.compare_labels
    validation = store.latest_validation(hostile.version)
    assert validation is not None and not validation.passed
    assert "validation failed" in text and ">FAIL<" in text

    # GPU time is lease time: from each claim to the completion of the same (shard, epoch).
    events = store.events(hostile.version, ["claim", "complete"])
    claims = {(e.shard_no, e.epoch): e.ts for e in events if e.kind == "claim"}
    seconds = sum(e.ts - claims[(e.shard_no, e.epoch)] for e in events if e.kind == "complete")
    assert data.lease_hours == pytest.approx(seconds / 3600)
    # No paid worker, no spot price in the spec: spot lease time at the price given.
    assert data.cost.spot_seconds == pytest.approx(seconds) and data.cost.paid_seconds == 0
    assert data.cost.total == pytest.approx(seconds / 3600 * 7.0)
    assert len(data.leases) == len(claims) == 3 and all(s.outcome == "done" for s in data.leases)
    per_thousand = seconds / 3600 * 7.0 / 40 * 1000
    assert (f"{per_thousand:,.4f}" if per_thousand < 1 else f"{per_thousand:,.2f}") in text
    # The synthetic engine computes on no GPU: its time is worker-hours, never GPU-hours.
    assert data.cost.prices.unit == "worker-hours" and "GPU-hour" not in text
    assert sum(data.bins) == 40  # every outcome falls in a throughput bin
    # The store's histogram puts each outcome in the bin its own time gives it.
    assert data.t_start is not None
    expected = [0] * len(data.bins)
    times = [r.created_at for r in store.iter_results(hostile.version, computed_only=True)]
    times += [d.created_at for d in store.iter_dead_letters(hostile.version) if d.worker is not None]
    for ts in times:
        expected[min(max(int((ts - data.t_start) // data.bin_seconds), 0), len(expected) - 1)] += 1
    assert data.bins == expected
    assert sum(data.attempts_results.values()) == 38 and data.attempts_dead == {3: 2}
    assert data.tokens == store.token_totals(hostile.version) and data.tokens[0] > 0


def test_an_expired_and_re_leased_shard_is_on_the_timeline_without_the_clock_shift(
        job_factory: Any, store: Store) -> None:
    spec_path = job_factory(n=20, shards={"size": 10, "lease_seconds": 30})
    spec, version = planned(spec_path, store)
    ids = list(store.planned_ids(version))

    def rows(chosen: list[str]) -> list[ResultRow]:
        # Each row says its piece, as a worker's do: the fence refuses those that do not.
        pieces = {r.id: r.piece for lease in (stalled, second) if lease is not None
                  for r in read_slice(Slice.from_json(lease.slice), spec.input)}
        return [ResultRow(i, '{"category":"a","summary":"s"}', None, 1, 3, 4, piece=pieces[i]) for i in chosen]

    second: Lease | None = None

    stalled = store.claim("host:101:aaaaaa", version)
    assert stalled is not None and stalled.shard_no == 0
    store.put_results(stalled, rows(ids[:4]))
    # The stalled worker's lease runs out: the clock moves instead of the test sleeping.
    store.log_event("clock_shift", version=version, detail={"seconds": 31.0})
    store.shift_clock(31.0)
    rescuer = store.claim("host:102:bbbbbb", version)
    assert rescuer is not None and (rescuer.shard_no, rescuer.epoch) == (0, 2)
    with pytest.raises(LeaseLost):
        store.put_results(stalled, rows(ids[4:6]))
    store.put_results(rescuer, rows(ids[4:10]))
    store.complete(rescuer)
    second = store.claim("host:102:bbbbbb", version)
    assert second is not None
    store.put_results(second, rows(ids[10:]))
    store.complete(second)

    data = collect(store, version)
    outcomes = [(s.worker, s.shard_no, s.epoch, s.outcome) for s in data.leases]
    assert outcomes == [("host:101:aaaaaa", 0, 1, "expired"), ("host:102:bbbbbb", 0, 2, "done"),
                        ("host:102:bbbbbb", 1, 1, "done")]
    expired = data.leases[0]
    assert expired.end is not None and expired.end - expired.start < 5.0, "the clock shift is taken out"
    assert data.shifted_seconds == pytest.approx(31.0)
    assert [(m.worker, m.kind) for m in data.markers] == [("host:101:aaaaaa", "stale_epoch")]
    assert data.status.leases_lost == 1 and data.stale_by_op == {"put": 1}
    assert set(data.lease_seconds_by_outcome) == {"expired", "done"}
    text = render(data)
    assert text.count('class="lease expired"') == 1 and text.count('class="lease done"') == 2
    assert text.count('class="relink"') == 1
    assert "re-leased by host:102:bbbbbb" in text


def test_the_report_command_writes_the_page_and_names_a_bad_version_in_one_line(
        hostile: Any, store_url: str, tmp_path: Path) -> None:
    out = tmp_path / "sub" / "report.html"
    assert cli("report", hostile.version, "--store", store_url, "--html", str(out), "--gpu-hour-price", "2") == 0
    assert "spot at 2.00/h" in out.read_text(encoding="utf-8")
    # Without a price, spot time is not priced: no built-in price stands in for one.
    assert cli("report", hostile.version, "--store", store_url, "--html", str(out)) == 0
    assert "no spot price" in out.read_text(encoding="utf-8")
    # A published name works as well as a version.
    assert cli("report", "hostile", "--store", store_url, "--html", str(tmp_path / "by-name.html")) == 0
    assert hostile.published in (tmp_path / "by-name.html").read_text(encoding="utf-8")
    with pytest.raises(BatchlineError, match="no job version or published name 'nope'"):
        cli("report", "nope", "--store", store_url, "--html", str(tmp_path / "x.html"))
    with pytest.raises(BatchlineError, match="must not be negative"):
        cli("report", hostile.version, "--store", store_url, "--html", str(out), "--gpu-hour-price", "-1")


def test_a_link_planted_at_the_reports_old_scratch_name_writes_nothing_through_it(
        hostile: Any, store: Store, tmp_path: Path) -> None:
    # Regression: the page was written to `.NAME.tmp` beside it, a name anyone with the folder
    # could plant a link at, so the report overwrote whatever the link named.
    folder = tmp_path / "reports"
    folder.mkdir()
    victim = folder / "victim.txt"
    victim.write_text("not the report's")
    out = folder / "report.html"
    (folder / ".report.html.tmp").symlink_to(victim)
    write_report(store, hostile.version, out)
    assert victim.read_text() == "not the report's"
    assert out.read_text(encoding="utf-8").startswith("<!DOCTYPE html>") and not out.is_symlink()
    assert sorted(p.name for p in folder.iterdir()) == [".report.html.tmp", "report.html", "victim.txt"]
