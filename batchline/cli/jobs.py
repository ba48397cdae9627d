"""Commands that plan, run, inspect and export jobs."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batchline.api import Jobs
from batchline.cli.common import CommandTable, Subcommands, duration, on_stop_signals, store_command
from batchline.errors import BatchlineError
from batchline.store import JobStatus, Store, open_store

COMMANDS = CommandTable()


@COMMANDS
def _run(sub: Subcommands) -> None:
    p = store_command(sub, "run", "plan the job if new and run N local workers until it is done; with --publish, "
                                  "then validate it and publish it if it passes")
    p.add_argument("spec", metavar="JOB.yaml")
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="local workers to run (0: none here; the version's workers run elsewhere, such as a "
                        "scheduled run's worker slots, and this command waits for them)")
    p.add_argument("--log-dir", type=Path, default=None, metavar="DIR",
                   help="where worker logs go (default: a folder of this run's own under $BATCHLINE_LOG_DIR)")
    p.add_argument("--publish", action="store_true", help="validate when done and publish if it passes")
    p.add_argument("--plan-key", default=None, metavar="KEY",
                   help="a scheduled run's key (its scheduled minute): the first run with KEY plans the version, "
                        "every later one runs that version, whatever the input has become")
    p.add_argument("--deadline", default=None, metavar="TIME|WINDOW",
                   help="the deadline instead of the spec's: an ISO 8601 time, or a window such as 6h from the "
                        "version's run start; with the spec's fallback section, paid workers hold it")
    p.add_argument("--spot-trace", default=None, metavar="FILE",
                   help="a drill: at most as many of the --workers as this trace (lines of SECONDS WORKERS from "
                        "the run's start, or a JSON availability trace whose 0 or 1 is scaled to --workers) allows "
                        "at each moment; the extra ones are killed outright, as a reclaim would")
    p.add_argument("--spot-trace-start", default=0.0, type=duration, metavar="DURATION",
                   help="where in --spot-trace the run starts: seconds, or such as 24h (default 0)")
    region_option(p)
    p.set_defaults(func=cmd_run)


@COMMANDS
def _plan(sub: Subcommands) -> None:
    p = store_command(sub, "plan", "plan the job and print its version")
    p.add_argument("spec", metavar="JOB.yaml")
    p.add_argument("--dry-run", action="store_true",
                   help="say what planning would do (records carried, to infer, removed, dead-lettered) and "
                        "write nothing")
    p.add_argument("--json", action="store_true", help="with --dry-run: the figures as JSON")
    p.add_argument("--plan-key", default=None, metavar="KEY",
                   help="a scheduled run's key, as run takes it: the first plan with KEY keys the version it plans, "
                        "every later one prints that version, whatever the input has become")
    p.set_defaults(func=cmd_plan)


@COMMANDS
def _changes(sub: Subcommands) -> None:
    p = store_command(sub, "changes", "the records of an incremental version by kind against its base: new, text (changed "
                                      "text), acl (only the ACL changed: carried under the new one), unchanged, removed")
    p.add_argument("version", metavar="VERSION")
    p.add_argument("--kind", action="append", choices=("new", "text", "acl", "unchanged", "removed"), default=None,
                   help="only records of this kind (repeatable; default: every kind but unchanged)")
    p.set_defaults(func=cmd_changes)


@COMMANDS
def _worker(sub: Subcommands) -> None:
    p = store_command(sub, "worker", "run one worker; exits 0 when no work is left, 75 when stopped early")
    p.add_argument("--job", default=None, metavar="VERSION", help="work on this version only")
    p.add_argument("--name", default=None, metavar="NAME", help="with --plan-key: the job's name")
    p.add_argument("--plan-key", default=None, metavar="KEY",
                   help="instead of --job: work on the version the run KEY of --name planned (a scheduled run's "
                        "worker slot), waiting up to --wait-for-work SECONDS for it to be planned")
    p.add_argument("--wait-for-work", type=float, default=0.0, metavar="SECONDS",
                   help="with --plan-key: how long to wait for the run's version to be planned before exiting 0")
    p.add_argument("--poll-seconds", type=float, default=1.0, metavar="SECONDS",
                   help="how often to look for shards while others hold the leases")
    p.add_argument("--store-wait", type=float, default=float(os.environ.get("BATCHLINE_STORE_WAIT", 300)),
                   metavar="SECONDS", help="how long to wait for a store that cannot be reached yet, saying so, "
                   "before giving up (exit 4); one that does not exist is refused at once (default 300, or "
                   "$BATCHLINE_STORE_WAIT)")
    p.add_argument("--preemption-notice", choices=("none", "aws", "gcp"),
                   default=os.environ.get("BATCHLINE_PREEMPTION_NOTICE", "none"),
                   help="also stop on the cloud's preemption notice (AWS spot interruption via IMDSv2, "
                        "Google Cloud's preempted value), as on SIGTERM")
    # The notice tests' stand-in for the metadata service; not for users.
    p.add_argument("--metadata-url", default=None, help=argparse.SUPPRESS)
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics on this port (needs the metrics extra)")
    p.add_argument("--metrics-addr", default="0.0.0.0", metavar="ADDR",
                   help="the address the metrics endpoint listens on (default: all)")
    p.add_argument("--log-format", choices=("text", "json"), default="text",
                   help="json: one JSON object a line, for a log pipeline")
    p.add_argument("--paid-slot", default=None, metavar="paid-N/GENERATION",
                   help="run as the paid worker of this slot's start, as a pacer starts one (with --job): it "
                        "tells the store it is up and when it stops, and exits at once if that start was ended")
    p.add_argument("--routes", default=None, metavar="ROUTE,...",
                   help="take only shards of these routes: 'local' for the job's own engine, or the names of "
                        "routing.providers (default: every route; a worker without a GPU can poll hosted "
                        "batches with --routes naming only providers)")
    region_option(p)
    p.set_defaults(func=cmd_worker)


def region_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--region", default=None, metavar="REGION",
                   help="the region this worker runs in (default: $BATCHLINE_REGION): it reads its region's replica "
                        "of the input and claims shards whose input lives there first; one the input does not "
                        "know is refused")


@COMMANDS
def _status(sub: Subcommands) -> None:
    p = store_command(sub, "status", "progress of a job version (or a list of jobs)")
    p.add_argument("version", nargs="?", metavar="VERSION")
    p.add_argument("--json", action="store_true")
    p.add_argument("--watch", action="store_true",
                   help="redraw the progress line until the version is sealed (or halted: exit 7)")
    p.add_argument("--interval", type=float, default=2.0, metavar="SECONDS", help="how often --watch redraws")
    p.set_defaults(func=cmd_status)


@COMMANDS
def _dead_letters(sub: Subcommands) -> None:
    p = store_command(sub, "dead-letters", "records that ended as dead letters, with their errors")
    p.add_argument("version", metavar="VERSION")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_dead_letters)


@COMMANDS
def _export(sub: Subcommands) -> None:
    p = store_command(sub, "export", "write a version's results with each record's ACL; a published NAME with "
                                     "--format parquet writes a dataset per version and flips NAME/CURRENT (a folder, "
                                     "or an s3:// or gs:// prefix)")
    p.add_argument("target", metavar="VERSION|NAME")
    from batchline.registry import EXPORTS

    formats = {name: entry.load() for name, entry in EXPORTS.items()}
    p.add_argument("--format", choices=tuple(formats), default=next(iter(formats)),
                   help="; ".join(f"{name}: {f.help}" for name, f in formats.items()))
    p.add_argument("--out", default=None, metavar="PATH|URL",
                   help="a file or folder, or an s3:// or gs:// URL (jsonl and parquet)")
    with_errors = " or ".join(name for name, f in formats.items() if f.errors_file)
    p.add_argument("--errors", type=Path, default=None, metavar="PATH",
                   help=f"with --format {with_errors}: the error file (default: --out with .errors.jsonl)")
    p.add_argument("--partial", action="store_true",
                   help="export a version that is not finished yet (refused without it)")
    p.set_defaults(func=cmd_export)


@COMMANDS
def _validate(sub: Subcommands) -> None:
    p = store_command(sub, "validate", "check a sealed version: coverage, schema, dead letters, drift and its graders")
    p.add_argument("version", metavar="VERSION")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_validate)


@COMMANDS
def _publish(sub: Subcommands) -> None:
    p = store_command(sub, "publish", "point the job's name (and its view) at a validated version")
    p.add_argument("version", metavar="VERSION")
    p.add_argument("--force", action="store_true", help="publish without a passing validation")
    p.add_argument("--reason", default=None, help="why, recorded with a forced publish")
    p.set_defaults(func=cmd_publish)


@COMMANDS
def _rollback(sub: Subcommands) -> None:
    p = store_command(sub, "rollback", "point NAME back at the version published before the current one")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--reason", default=None, help="why, recorded in the history")
    p.set_defaults(func=cmd_rollback)


@COMMANDS
def _cancel(sub: Subcommands) -> None:
    p = store_command(sub, "cancel", "end a version nobody will publish: its shards are no longer claimed and its "
                                     "workers leave it (not the published version, nor the one a rollback returns to)")
    p.add_argument("version", metavar="VERSION")
    p.add_argument("--reason", default=None, help="why, recorded with the cancellation")
    p.set_defaults(func=cmd_cancel)


@COMMANDS
def _resume(sub: Subcommands) -> None:
    p = store_command(sub, "resume", "lift the halt of a version whose dead letters passed shards.abort_dead_letter_rate, "
                                     "under that bound or a new one the store keeps for it; its workers may claim its shards "
                                     "again")
    p.add_argument("version", metavar="VERSION")
    p.add_argument("--abort-dead-letter-rate", type=float, default=None, metavar="RATE",
                   help="the new bound: a share of the outcomes it computed, at least its "
                        "validate.max_dead_letter_rate (1: never halt)")
    p.add_argument("--abort-min-outcomes", type=int, default=None, metavar="N",
                   help="outcomes it computes before the bound is judged (default: as it was)")
    p.add_argument("--reason", default=None, help="why, recorded with the resumption")
    p.set_defaults(func=cmd_resume)


@COMMANDS
def _delete(sub: Subcommands) -> None:
    p = store_command(sub, "delete", "remove the rows of a cancelled version, or of a sealed one that is not published, "
                                     "not what a rollback returns to and not read by a version not sealed yet")
    p.add_argument("version", metavar="VERSION")
    p.set_defaults(func=cmd_delete)


@COMMANDS
def _history(sub: Subcommands) -> None:
    p = store_command(sub, "history", "every publish and rollback of NAME: when, who, which version, why, and the "
                                      "validation figures")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_history)


@COMMANDS
def _search(sub: Subcommands) -> None:
    p = store_command(sub, "search", "the records of NAME's published version nearest a query, among those whose ACL "
                                     "names one of the caller's groups (the job's output.index)")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--query", required=True, metavar="TEXT", help="embedded with the job's own pinned model")
    p.add_argument("--groups", action="append", default=[], metavar="G1,G2",
                   help="the caller's groups, separated by commas or the option repeated: only rows whose ACL "
                        "names one of them exactly are searched (a group with whitespace at either end or a "
                        "control character is refused)")
    p.add_argument("--k", type=int, default=10, metavar="K", help="how many hits (default 10, at most 100,000)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_search)


@COMMANDS
def _spec_schema(sub: Subcommands) -> None:
    p = sub.add_parser("spec-schema", help="print the job spec's JSON Schema, for editors that complete and check "
                                           "job files", description="print the job spec's JSON Schema, for editors "
                                           "that complete and check job files")
    p.set_defaults(func=cmd_spec_schema)

register = COMMANDS.register


def cmd_spec_schema(args: argparse.Namespace) -> int:
    from batchline.spec.schema import render

    sys.stdout.write(render())
    return 0


def _store(args: argparse.Namespace) -> Store:
    """Only the commands that plan (plan, run) make a store; the others refuse one that
    does not exist, so a typo in a path is not taken for an empty store."""
    return open_store(args.store, create=False)


def cmd_plan(args: argparse.Namespace) -> int:
    if args.dry_run and args.plan_key is not None:
        raise BatchlineError("--plan-key keys the version planned and --dry-run writes nothing: give one of them")
    if args.dry_run:
        preview = Jobs(args.store).preview(args.spec)
        print(json.dumps(preview.to_json(), indent=2) if args.json else preview.table())
        return 0
    if args.json:
        raise BatchlineError("--json goes with --dry-run (a plan prints its version)")
    result = Jobs(args.store).plan(args.spec, plan_key=args.plan_key)
    if not result.created:
        print(f"already planned: {result.records} records in {result.shards} shards", file=sys.stderr)
    print(result.version)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from batchline.ops.pace import pace_outcome
    from batchline.ops.runner import format_duration
    from batchline.spec import stored_spec
    from batchline.spec.deadline import parse_deadline

    if args.workers < 0:
        raise BatchlineError("--workers must be at least 0 (0: the version's workers run elsewhere, and this command "
                             "plans it, waits for it and with --publish publishes it)")
    from batchline.worker.regions import worker_region

    summary = Jobs(args.store).run(args.spec, workers=args.workers, log_dir=args.log_dir, plan_key=args.plan_key,
                                   deadline=args.deadline, spot_trace=args.spot_trace,
                                   spot_trace_start=args.spot_trace_start, region=worker_region(args.region))
    store = _store(args)
    st = summary.status
    info = store.job(st.version)
    assert info is not None
    spec = stored_spec(info)
    done = summary.answered
    pace = (f"{done:,} records answered this run, {done / summary.seconds:,.2f} records/s" if done
            else "nothing was left to answer")
    tokens = store.token_totals(st.version)
    # Stopped early (Ctrl-C, SIGTERM): the version is still open, and what it takes is the same command.
    stopped = st.state not in ("sealed", "cancelled") and summary.exit_code != 0
    lines = [
        f"stopped: {st.pending:,} records left; run the same command again to go on\n  version      {st.version}"
        if stopped else f"{st.state}: {st.version}",
        f"  records      {st.records:,}",
        f"  results      {st.results:,}" + (f" ({info.carried:,} carried from the base)" if info.carried else ""),
        f"  dead letters {st.dead_letters:,}"
        + (f" ({', '.join(f'{k} {v}' for k, v in sorted(st.dead_letters_by_kind.items()))})"
           if st.dead_letters else ""),
        f"  wall time    {format_duration(summary.seconds)} ({pace})",
        f"  workers      {args.workers} ({summary.restarts} restarts, {st.leases_lost} leases lost, "
        f"{st.leases_taken_back} taken back from dead workers, {st.splits} tails split)",
    ]
    labels = {k: v for k, v in store.label_counts(st.version).items() if k is not None}
    if labels:
        lines.append("  " + f"{spec.label_field:<12} " + ", ".join(
            f"{k} {v}" for k, v in sorted(labels.items(), key=lambda kv: -kv[1])))
    if tokens[0]:
        lines.append(f"  tokens       {tokens[0]:,} in, {tokens[1]:,} out "
                     f"({tokens[1] / summary.seconds:,.1f} output tokens/s)")
    if spec.routing is not None:
        routes = store.route_totals(st.version)
        lines.append("  routes       " + "; ".join(
            f"{route} {t.results:,}/{t.records:,} answered, {t.input_tokens:,} in, {t.output_tokens:,} out"
            for route, t in sorted(routes.items())))
    outcome = pace_outcome(store, st.version, parse_deadline(args.deadline, "--deadline", None)
                           if args.deadline is not None else None)
    if outcome is not None:
        lines.append(f"  deadline     {outcome.line()}"
                     + (f"; last decision: {summary.pace.decision.reason}" if summary.pace is not None else ""))
    if summary.reclaims:
        lines.append(f"  spot trace   {summary.reclaims} spot workers reclaimed")
    lines.append(f"  worker logs  {summary.log_dir}")
    print("\n".join(lines), file=sys.stderr)
    if args.publish and summary.exit_code == 0:
        _report, published = Jobs(store).validate_and_publish(st.version)
        if published is not None:
            print(published.summary(), file=sys.stderr)
    print(st.version)
    return summary.exit_code


def cmd_changes(args: argparse.Namespace) -> int:
    kinds = set(args.kind or ("new", "text", "acl", "removed"))
    counts: dict[str, int] = {}
    for kind, record_id in Jobs(_store(args)).changes(args.version):
        counts[kind] = counts.get(kind, 0) + 1
        if kind in kinds:
            print(f"{kind}\t{record_id}")
    print(", ".join(f"{k} {counts.get(k, 0):,}" for k in ("new", "text", "acl", "unchanged", "removed")),
          file=sys.stderr)
    return 0


def _keyed_version(store: Store, name: str, key: str, wait: float, stop: threading.Event,
                   log: Callable[[str], None]) -> str | None:
    """The version the run `key` of `name` planned, waited for up to `wait` seconds (a scheduled
    run's worker slot starts as its control plans); None, said, when none was planned by then."""
    deadline = time.monotonic() + wait
    while True:
        version = store.keyed_version(name, key)
        if version is not None:
            log(f"run {key!r} of {name} is {version}")
            return version
        if time.monotonic() >= deadline or stop.is_set():
            log(f"no version of {name} was planned for run {key!r} within {wait:g} s: no work")
            return None
        stop.wait(min(5.0, max(0.1, deadline - time.monotonic())))


def cmd_worker(args: argparse.Namespace) -> int:
    from batchline.lineage import lineage_config
    from batchline.ops.logs import configure_worker_logging
    from batchline.worker.regions import worker_region
    from batchline.worker.supervisor import Worker, new_worker_id
    from batchline.worker.telemetry import WorkerTelemetry

    lineage = lineage_config()  # a malformed configuration is refused before anything starts
    region = worker_region(args.region)
    # Batch work yields: the lowest CPU priority, so interactive work on a shared node comes first.
    os.nice(19)
    worker_id = new_worker_id()
    log = configure_worker_logging(args.log_format, worker_id, sys.stderr)
    telemetry: WorkerTelemetry | None = None
    if args.metrics_port is not None:
        from batchline.ops.metrics import serve_metrics

        telemetry = serve_metrics(args.metrics_port, worker_id=worker_id, addr=args.metrics_addr)
        log.info("metrics on %s:%d/metrics", args.metrics_addr, args.metrics_port)
    stop = threading.Event()

    def on_signal(name: str) -> None:
        log.info("received %s: stopping", name)
        stop.set()

    on_stop_signals(on_signal)
    from batchline.worker.notices import start_watcher

    watcher = start_watcher(args.preemption_notice, stop, base_url=args.metadata_url, log=log.info)
    from batchline.worker.paid import PaidSlotKeeper, PaidSlotRef

    if (args.plan_key is None) != (args.name is None) or (args.plan_key is not None and args.job is not None) \
            or args.wait_for_work < 0 or (args.wait_for_work and args.plan_key is None):
        raise BatchlineError("--plan-key KEY goes with --name NAME (and --wait-for-work SECONDS, not negative), "
                             "instead of --job")
    paid = PaidSlotRef.parse(args.paid_slot) if args.paid_slot else None
    if paid is not None and args.job is None:
        raise BatchlineError("--paid-slot needs --job VERSION: a paid worker works the version its pacer bought it for")
    store = open_store(args.store, create=False, wait_seconds=args.store_wait, log=log.info, worker=True)
    if args.plan_key is not None:
        args.job = _keyed_version(store, args.name, args.plan_key, args.wait_for_work, stop, log.info)
        if args.job is None:
            return 0
    from batchline.worker.heartbeat import Heartbeat
    from batchline.worker.liveness import process_identity

    keeper = None
    if paid is not None:
        from batchline.spec import stored_spec
        from batchline.store import require_job

        assert args.job is not None
        spec = stored_spec(require_job(store, args.job))
        # Out of reach for a lease, its lease is lost anyway: a paid worker stops then, not later.
        store.reconnect_seconds = min(store.reconnect_seconds, spec.shards.lease_seconds)
        keeper = PaidSlotKeeper(store, args.job, paid, worker_id, process_identity(), log=log.info,
                                on_lost=stop.set, max_cost=spec.fallback.max_cost if spec.fallback else None,
                                unreachable_seconds=spec.shards.lease_seconds)
        if not keeper.start():
            log.info("paid slot %s: %s: exit 0", paid,
                     keeper.reason or "not running in the store (stopped, or started again elsewhere)")
            keeper.stop("its worker exited")
            return 0
        log.info("paid worker of slot %s", paid)
    # Every worker heartbeats from now on, the model's loading included: the capacity a pacer counts.
    heartbeat = Heartbeat(store, worker_id, args.job, process_identity(), paid=keeper, log=log.info, region=region)
    worker = Worker(store, version=args.job, worker_id=worker_id, stop=stop,
                    poll_seconds=args.poll_seconds, log=log.info, telemetry=telemetry,
                    routes=[r.strip() for r in args.routes.split(",") if r.strip()] if args.routes else None,
                    on_claim=heartbeat.on_claim, lineage=lineage, region=region)
    heartbeat.cross_region_bytes = lambda: worker.handle.regions.cross_region_bytes
    heartbeat.start()
    try:
        code = worker.run()
    finally:
        heartbeat.stop()
        if keeper is not None:
            keeper.stop("its worker exited")
    if watcher is not None:
        watcher.close()
    log.info("exit %d", code)
    return code


def status_dict(st: JobStatus) -> dict[str, Any]:
    return {
        "version": st.version, "name": st.name, "state": st.state, "records": st.records,
        "shards": st.shards,
        "outcomes": {"results": st.results, "dead_letters": st.dead_letters, "pending": st.pending},
        "dead_letters_by_kind": st.dead_letters_by_kind, "leases_lost": st.leases_lost,
        "leases_taken_back": st.leases_taken_back, "splits": st.splits,
        # Over the last rate_window_seconds (the window, or the time since the first claim if
        # shorter); null before any shard was claimed.
        "records_per_second": st.records_per_second, "rate_window_seconds": st.rate_window,
        "halt": st.halt.to_json() if st.halt else None,
        # Why no worker can finish it as it is (a shard's input changed), or null.
        "stopped": st.stopped,
    }


def routes_dict(store: Store, version: str) -> dict[str, Any]:
    return {route: t.__dict__ for route, t in sorted(store.route_totals(version).items())}


def cmd_status(args: argparse.Namespace) -> int:
    from batchline.launch.pacer import Pacer
    from batchline.ops.pace import pace_outcome
    from batchline.ops.runner import progress_line
    from batchline.publish.upstream import lag

    store = _store(args)
    if args.version is None:
        if args.watch:
            raise BatchlineError("--watch needs a VERSION (or a published NAME)")
        listing = Jobs(store).versions()
        if args.json:
            print(json.dumps([{**status_dict(store.status(j.version)), "published": j.published}
                              for j in listing], indent=2))
        else:
            for j in listing:
                print(f"{j.version}  {j.state:9}  {j.records:,} records  {j.shards:,} shards"
                      + ("  published" if j.published else ""))
        return 0
    version = Jobs(store).resolve(args.version)
    if args.watch:
        from batchline.cli.observe import watch_status

        if args.json:
            raise BatchlineError("--watch draws a progress line; use --json without it")
        return watch_status(store, version, interval=args.interval)
    st = store.status(version)
    published = store.resolve_name(st.name) == st.version
    info = store.job(version)
    assert info is not None
    lags = lag(store, info, count=True)
    watching = Pacer.watching(store, version) if st.state == "ready" else None
    pace = watching.picture() if watching is not None else None
    # Sealed, halted or cancelled, as while it runs: met or missed, by how much, paid starts, cost.
    outcome = pace_outcome(store, version)
    if args.json:
        history = store.publications(st.name) if published else []
        print(json.dumps({**status_dict(st), "published": published, "routes": routes_dict(store, st.version),
                          "upstreams": [u.to_json() for u in lags],
                          "pace": None if outcome is None else {
                              **(pace.to_json() if pace is not None else {}), "outcome": outcome.to_json()},
                          # What each target showed after the publication readers see now (an
                          # Iceberg table's metadata_location, for a reader without a catalog).
                          "targets": (history[-1].targets or {}) if history else {},
                          "regions": regions_dict(store, version)}, indent=2))
        return 0
    rate = st.records_per_second or None
    print(f"{st.version} ({st.state}" + (f", published as {st.name}" if published else "") + ")")
    print("  " + progress_line(st, rate, None, None, None))
    for u in lags:
        if u.behind:
            print(f"  {u.describe()}: a search of its index checks each hit against the ACLs {u.name} publishes "
                  f"now; its own view, exports and tables keep the ACLs it was planned with until it runs again "
                  f"(an incremental run re-infers only what changed, and an ACL-only change nothing)")
    print("  shards: " + ", ".join(f"{k} {v}" for k, v in st.shards.items()))
    if pace is not None:
        print(f"  pace: {pace.line()}")
    if outcome is not None:
        print(f"  deadline: {outcome.line()}")
    routes = store.route_totals(st.version)
    if set(routes) - {"local"}:
        print("  routes: " + "; ".join(f"{route} {t.records:,} records, {t.results:,} results"
                                       for route, t in sorted(routes.items())))
    if st.dead_letters_by_kind:
        print("  dead letters: " + ", ".join(f"{k} {v}" for k, v in sorted(st.dead_letters_by_kind.items())))
    if st.halt is not None:
        print(f"  {st.halt.message(st.version)}")
    for line in region_lines(store, version):
        print(f"  {line}")
    return 0


def regions_dict(store: Store, version: str) -> dict[str, Any]:
    """Shards by home region and where they were last claimed, replicas, bytes across regions."""
    return {
        "shards": [{"home": r.home, "ran_in": r.ran_in, "state": r.state, "shards": r.shards, "records": r.records}
                   for r in store.shard_regions(version)],
        "replicas": {region: {"location": r.location, "objects": len(r.pins), "compared": r.compared}
                     for region, r in store.replicas(version).items()},
        "workers": [{"worker": w.worker, "region": w.region, "cross_region_bytes": w.cross_region_bytes}
                    for w in store.worker_regions(version) if w.region is not None],
    }


def region_lines(store: Store, version: str) -> list[str]:
    """What `status` says of regions: nothing for a version that has none."""
    shards = [r for r in store.shard_regions(version) if r.home is not None or r.ran_in is not None]
    replicas = store.replicas(version)
    workers = [w for w in store.worker_regions(version) if w.region is not None]
    lines: list[str] = []
    if shards:
        by_home: dict[str, dict[str, int]] = {}
        for r in shards:
            where = by_home.setdefault(r.home or "any", {})
            key = f"ran in {r.ran_in}" if r.ran_in else r.state
            where[key] = where.get(key, 0) + r.shards
        lines.append("regions: " + "; ".join(f"home {home}: " + ", ".join(f"{k} {v}" for k, v in sorted(c.items()))
                                             for home, c in sorted(by_home.items())))
    for region, replica in replicas.items():
        lines.append(f"replica {region}: {replica.location} ({replica.compared})")
    if workers:
        crossed = sum(w.cross_region_bytes for w in workers)
        lines.append(f"read across regions: {crossed:,} bytes by {len(workers)} workers with a region"
                     + "".join(f"; {w.worker} ({w.region}) {w.cross_region_bytes:,}"
                               for w in workers if w.cross_region_bytes))
    return lines


@COMMANDS
def _replicas(sub: Subcommands) -> None:
    p = sub.add_parser("replicas", help="a version's replicas of its input near other regions",
                       description="a version's replicas of its input near other regions")
    replicas = p.add_subparsers(dest="replicas_command", required=True, metavar="COMMAND")
    add = store_command(replicas, "add", "check a copy of the version's input under another prefix against the "
                                         "primary object by object and record it for REGION's workers (the version "
                                         "does not change)")
    add.add_argument("version", metavar="VERSION")
    add.add_argument("region", metavar="REGION")
    add.add_argument("location", metavar="LOCATION", help="the s3:// or gs:// prefix the copy is under")
    add.add_argument("--endpoint", default=None, metavar="URL",
                     help="the replica's object store, where it is not input.storage's")
    add.set_defaults(func=cmd_replicas_add)
    show = store_command(replicas, "list", "the version's replicas, each with what was compared")
    show.add_argument("version", metavar="VERSION")
    show.add_argument("--json", action="store_true")
    show.set_defaults(func=cmd_replicas_list)


def cmd_replicas_add(args: argparse.Namespace) -> int:
    from batchline.errors import ArgumentError
    from batchline.lake import check_storage_options
    from batchline.snapshot.replicas import check_replicas, record_replicas
    from batchline.spec import stored_spec
    from batchline.spec.model import region_refusal
    from batchline.store import require_job
    from batchline.store.model import who

    why = region_refusal(args.region)
    if why is not None:
        raise ArgumentError(f"REGION {why}")
    store = _store(args)
    version = Jobs(store).resolve(args.version)
    spec = stored_spec(require_job(store, version))
    storage = check_storage_options({"endpoint": args.endpoint} if args.endpoint else None, "--endpoint",
                                    "endpoint")
    if args.region == spec.input.regions.primary:
        raise ArgumentError(f"{args.region} is the primary's region (input.region); a replica is in another")
    checked = check_replicas(spec, {args.region: (args.location, storage)}, store.replicas(version), who())
    record_replicas(store, version, checked, lambda line: print(line, file=sys.stderr))
    print(version)
    return 0


def cmd_replicas_list(args: argparse.Namespace) -> int:
    store = _store(args)
    version = Jobs(store).resolve(args.version)
    found = store.replicas(version)
    if args.json:
        print(json.dumps({region: {"location": r.location, "root": r.root, "compared": r.compared, "by": r.by,
                                   "added_at": r.added_at, "objects": len(r.pins)} for region, r in found.items()},
                         indent=2))
        return 0
    for region, r in found.items():
        print(f"{region}\t{r.location}\t{r.root}\t{r.compared}")
    return 0


def cmd_dead_letters(args: argparse.Namespace) -> int:
    rows = Jobs(_store(args)).dead_letters(args.version)
    if args.json:
        print(json.dumps([{"id": r.record_id, "kind": r.kind, "error": r.error, "attempts": r.attempts,
                           "shard": r.shard_no, "acl": None if r.acl is None else r.acl.to_list(), **({} if r.carry is None else {"carry": r.carry})}
                          for r in rows], indent=2))
        return 0
    for r in rows:
        print(f"{r.record_id}\t{r.kind}\t{r.attempts} attempts\t{r.error}")
    print(f"{len(rows)} dead letters", file=sys.stderr)
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    report = Jobs(_store(args)).validate(args.version)
    print(json.dumps(report.to_json(), indent=2) if args.json else report.table())
    return 0 if report.passed else 1


def cmd_publish(args: argparse.Namespace) -> int:
    result = Jobs(_store(args)).publish(args.version, force=args.force, reason=args.reason)
    print(result.summary(), file=sys.stderr)
    return 0


def cmd_rollback(args: argparse.Namespace) -> int:
    old, new = Jobs(_store(args)).rollback(args.name, reason=args.reason)
    print(f"{args.name}: rolled back from {old} to {new}", file=sys.stderr)
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    cancelled = Jobs(_store(args)).cancel(args.version, reason=args.reason)
    print(f"cancelled {args.version}" if cancelled else f"{args.version} was cancelled already", file=sys.stderr)
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    bound = Jobs(_store(args)).resume(args.version, abort_dead_letter_rate=args.abort_dead_letter_rate,
                                      abort_min_outcomes=args.abort_min_outcomes, reason=args.reason)
    print(f"resumed {args.version} under {bound.describe()}; start its workers again (batchline run JOB.yaml, "
          f"or batchline worker --job {args.version})", file=sys.stderr)
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    deleted = Jobs(_store(args)).delete(args.version)
    print(f"deleted {args.version}" if deleted else f"{args.version} was deleted already", file=sys.stderr)
    return 0


def cmd_history(args: argparse.Namespace) -> int:
    entries = Jobs(_store(args)).history(args.name)
    if args.json:
        print(json.dumps([{"at": iso_time(p.ts), "action": p.action, "version": p.version, "previous": p.previous,
                           "who": p.who, "reason": p.reason, "validation": p.validation} for p in entries],
                         indent=2))
        return 0
    for p in entries:
        line = f"{iso_time(p.ts)}  {p.action:8}  {p.version}  by {p.who}"
        if p.previous:
            line += f" (was {p.previous})"
        if p.reason:
            line += f"  reason: {p.reason}"
        if p.validation:
            checks = "; ".join(f"{c['name']} {c['figure']}" for c in p.validation.get("checks", []))
            line += f"  validation {'passed' if p.validation.get('passed') else 'FAILED'}: {checks}"
        print(line)
    if not entries:
        print(f"{args.name} has never been published", file=sys.stderr)
    return 0


def cmd_search(args: argparse.Namespace) -> int:
    from batchline.acl import caller_groups, check_k, split_groups_option

    groups = caller_groups(split_groups_option(args.groups))
    check_k(args.k)
    found = Jobs(_store(args)).search(args.name, args.query, groups, k=args.k, count_behind=args.json)
    if args.json:
        print(json.dumps({"name": found.name, "version": found.version, "path": found.path,
                          "withheld": found.withheld, "upstreams": [u.to_json() for u in found.behind],
                          "hits": [h.to_dict() for h in found.hits]}, indent=2, ensure_ascii=False))
        return 0
    print(f"{len(found.hits)} hits from {found.version}", file=sys.stderr)
    for lag in found.behind:
        if lag.behind:
            print(f"{found.version} is {lag.describe()}; each hit was checked against the ACLs published now",
                  file=sys.stderr)
    for h in found.hits:
        print(f"{h.score:.4f}  {h.record_id}  {json.dumps(h.fields, ensure_ascii=False)}")
    return 0


def iso_time(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def cmd_export(args: argparse.Namespace) -> int:
    done = Jobs(_store(args)).export(args.target, format=args.format, out=args.out, errors=args.errors,
                                      partial=args.partial)
    if done.current is not None:
        print(f"exported {done.version} to {done.path}; {done.current} names it", file=sys.stderr)
    elif done.errors_path is not None:
        print(f"exported {done.version}: responses {done.count:,} in {done.path}, errors {done.errors:,} in "
              f"{done.errors_path}" + (f"; {done.pending:,} records have no outcome yet" if done.pending else ""),
              file=sys.stderr)
    else:
        print(f"exported {done.count:,} results of {done.version}" + (f" to {done.path}" if done.path else ""),
              file=sys.stderr)
    return 0
