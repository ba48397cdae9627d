"""Commands that look at a job: `report` (one HTML page) and `drill` (a fault drill),
and the `status --watch` loop that `batchline status` calls."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import IO

from batchline.cli.common import add_store_option, store_command
from batchline.errors import BatchlineError, VersionEnded, VersionHalted
from batchline.spec import stored_spec
from batchline.store import Store, open_store, require_job


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        return store_command(sub, name, help_text)

    p = command("report", "write one self-contained HTML page about a job version: throughput, leases, "
                          "attempts, dead letters, labels, validation, tokens and cost")
    p.add_argument("version", metavar="VERSION|NAME")
    p.add_argument("--html", type=Path, required=True, metavar="PATH", help="where to write the page")
    p.add_argument("--gpu-hour-price", type=float, default=None, metavar="PRICE",
                   help="price of one spot worker-hour (a GPU-hour for a GPU engine) where the spec's "
                        "fallback.spot_cost_per_worker_hour gives none (default: spot time is not priced)")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("drill", help="run a synthetic job while hurting its workers, then check the invariants",
                       description="Runs a synthetic job on the store twice with real workers: once without "
                                   "faults, once while killing, stalling and stopping them at random and feeding "
                                   "them poison records; then checks from the store that every record has "
                                   "exactly one outcome. Exits 1 if any check fails.")
    add_store_option(p, "the store to drill (default: a new SQLite file in the drill's work directory)")
    p.add_argument("--workers", type=int, default=4, metavar="N")
    p.add_argument("--minutes", type=float, default=3.0, metavar="M", help="about how long the drill runs")
    p.add_argument("--seed", type=int, default=None, help="repeat a drill's choices of faults and poison")
    p.add_argument("--work-dir", type=Path, default=None, metavar="DIR", help="input, worker logs and exports (default: a temp dir)")
    p.add_argument("--report", type=Path, default=None, metavar="PATH",
                   help="also write the HTML report of the run with faults")
    p.add_argument("--check", default=None, metavar="VERSION",
                   help="run no job: only check a drill's stored version again")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(func=cmd_drill)


def cmd_report(args: argparse.Namespace) -> int:
    from batchline.api import Jobs

    data = Jobs(args.store).report(args.version, args.html, gpu_hour_price=args.gpu_hour_price)
    print(f"wrote {args.html} ({data.status.version}: {data.answered:,}/{data.status.records:,} records, "
          f"{len(data.leases):,} leases, {data.lease_hours:,.3f} {data.cost.prices.unit})", file=sys.stderr)
    return 0


def cmd_drill(args: argparse.Namespace) -> int:
    from batchline.ops.drill.checks import check_job
    from batchline.ops.drill.run import run_drill

    if args.check is not None:
        if args.store is None:
            raise BatchlineError("--check needs the --store that holds the drill's job")
        store = open_store(args.store, create=False)
        try:
            figures, checks = check_job(store, args.check, work_dir=args.work_dir, validate_gate=False)
        finally:
            store.close()
        passed = all(c.passed for c in checks)
        if args.json:
            print(json.dumps({"figures": figures.__dict__, "passed": passed,
                              "checks": [c.__dict__ for c in checks]}, indent=2))
        else:
            print(f"{args.check}: {figures.records:,} records, {figures.results:,} results, "
                  f"{figures.dead_letters:,} dead letters, {figures.records_lost:,} lost, "
                  f"{figures.duplicate_results + figures.result_and_dead_letter:,} duplicate answers")
            for c in checks:
                print(f"  {'PASS' if c.passed else 'FAIL'}  {c.name}: {c.figure}")
        return 0 if passed else 1

    result = run_drill(args.store, workers=args.workers, minutes=args.minutes, seed=args.seed,
                       work_dir=args.work_dir)
    if args.report is not None:
        from batchline.ops.report.page import write_report

        store = open_store(result.store_url)
        try:
            write_report(store, result.faulted.version, args.report)
        finally:
            store.close()
        print(f"report: {args.report}", file=sys.stderr)
    print(json.dumps(result.to_json(), indent=2) if args.json else result.text())
    return 0 if result.passed else 1


# --- batchline status --watch ----------------------------------------------------------------


def workers_alive(store: Store, version: str, now: float) -> int:
    """Workers holding a lease that has not expired: from the store, so it counts
    workers on any machine, not only the ones this process started."""
    return len({r.owner for r in store.shard_rows(version)
                if r.state == "leased" and r.owner and r.lease_expires is not None and r.lease_expires > now})


def watch_status(store: Store, version: str, *, interval: float = 2.0, out: IO[str] | None = None,
                 max_updates: int | None = None) -> int:
    """Redraws the progress line of a job running elsewhere until it is sealed (or halted,
    which ends it with the halt's line and exit 7; or cancelled or deleted, which ends it
    with a line saying so and exit 1).

    The rate is measured over the last minute of this watch's own samples (the
    store's figure, outcomes written within its window, before a second has passed),
    and the ETA is measured against the spec's deadline when it has one.
    """
    from batchline.ops.runner import RATE_WINDOW_SECONDS, RateMeter, progress_line

    stream = out or sys.stdout
    info = require_job(store, version)
    spec = stored_spec(info)
    meter = RateMeter()
    started = time.monotonic()
    updates = 0
    tty = stream.isatty()
    try:
        while True:
            st = store.status(version, window_seconds=RATE_WINDOW_SECONDS)
            deadline = spec.deadline.resolve(st.run_start, st.now) if spec.deadline else None
            now = time.monotonic()
            rate = meter.add(now, st.results + st.dead_letters) or st.records_per_second or None
            line = f"{st.state:6} " + progress_line(st, rate, workers_alive(store, version, st.now),
                                                      now - started, deadline)
            stream.write(("\r\033[K" + line) if tty else line + "\n")
            stream.flush()
            updates += 1
            if (st.state in ("sealed", "halted") or st.state in VersionEnded.ENDED_STATES
                    or (max_updates is not None and updates >= max_updates)):
                break
            time.sleep(interval)
    except KeyboardInterrupt:
        pass  # watching is read-only: stopping it is not an error
    finally:
        if tty:
            stream.write("\n")
    halt = store.halt_of(version)
    if halt is not None:
        raise VersionHalted(halt.message(version))  # nothing moves until it is resumed or cancelled
    ended = require_job(store, version).state
    if ended in VersionEnded.ENDED_STATES:
        # It will never seal: a watch that went on would hold a script waiting for ever.
        raise VersionEnded(version, ended, store.where())
    return 0
