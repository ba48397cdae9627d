"""Commands that plan, run, inspect and export jobs."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from batchline.cli.common import store_command
from batchline.errors import BatchlineError
from batchline.store import JobStatus, Store, open_store


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        return store_command(sub, name, help_text)

    p = command("run", "plan the job if new, run N local workers until it is done")
    p.add_argument("spec", metavar="JOB.yaml")
    p.add_argument("--workers", type=int, default=1, metavar="N")
    p.add_argument("--log-dir", type=Path, default=None, help="where worker logs go")
    p.add_argument("--publish", action="store_true", help="validate when done and publish if it passes")
    p.set_defaults(func=cmd_run)

    p = command("plan", "plan the job and print its version")
    p.add_argument("spec", metavar="JOB.yaml")
    p.set_defaults(func=cmd_plan)

    p = command("worker", "run one worker; exits 0 when no work is left, 75 when stopped early")
    p.add_argument("--job", default=None, metavar="VERSION", help="work on this version only")
    p.add_argument("--poll-seconds", type=float, default=1.0,
                   help="how often to look for shards while others hold the leases")
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
    p.add_argument("--routes", default=None, metavar="ROUTE,...",
                   help="take only shards of these routes: 'local' for the job's own engine, or the names of "
                        "routing.providers (default: every route; a worker without a GPU can poll hosted "
                        "batches with --routes naming only providers)")
    p.set_defaults(func=cmd_worker)

    p = command("status", "progress of a job version (or a list of jobs)")
    p.add_argument("version", nargs="?", metavar="VERSION")
    p.add_argument("--json", action="store_true")
    p.add_argument("--watch", action="store_true", help="redraw the progress line until the version is sealed")
    p.add_argument("--interval", type=float, default=2.0, metavar="SECONDS", help="how often --watch redraws")
    p.set_defaults(func=cmd_status)

    p = command("dead-letters", "records that ended as dead letters, with their errors")
    p.add_argument("version", metavar="VERSION")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_dead_letters)

    p = command("export", "write a version's results with each record's ACL; a published NAME with "
                          "--format parquet writes a dataset per version and flips NAME/CURRENT (a folder, "
                          "or an s3:// or gs:// prefix)")
    p.add_argument("target", metavar="VERSION|NAME")
    p.add_argument("--format", choices=("jsonl", "parquet", "openai-batch"), default="jsonl",
                   help="openai-batch: OpenAI's batch output file (--out) and error file (--errors), one "
                        "line per input line, in the input's order")
    p.add_argument("--out", default=None, metavar="PATH|URL",
                   help="a file or folder, or an s3:// or gs:// URL (jsonl and parquet)")
    p.add_argument("--errors", type=Path, default=None, metavar="PATH",
                   help="with --format openai-batch: the error file (default: --out with .errors.jsonl)")
    p.add_argument("--partial", action="store_true",
                   help="with --format openai-batch: export a version that is not finished yet")
    p.set_defaults(func=cmd_export)

    p = command("validate", "check a sealed version: coverage, schema, dead letters, drift, evaluation")
    p.add_argument("version", metavar="VERSION")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_validate)

    p = command("publish", "point the job's name (and its view) at a validated version")
    p.add_argument("version", metavar="VERSION")
    p.add_argument("--force", action="store_true", help="publish without a passing validation")
    p.add_argument("--reason", default=None, help="why, recorded with a forced publish")
    p.set_defaults(func=cmd_publish)

    p = command("rollback", "point NAME back at the version published before the current one")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--reason", default=None)
    p.set_defaults(func=cmd_rollback)


def _store(args: argparse.Namespace) -> Store:
    return open_store(args.store)


def _version(store: Store, target: str) -> str:
    if store.job(target) is not None:
        return target
    resolved = store.resolve_name(target)
    if resolved is None:
        raise BatchlineError(f"no job version or published name {target!r} in {store.url}")
    return resolved


def cmd_plan(args: argparse.Namespace) -> int:
    from batchline.planner import plan
    from batchline.spec import load_spec

    spec = load_spec(args.spec)
    store = _store(args)
    result = plan(spec, store, log=lambda m: print(m, file=sys.stderr))
    if not result.created:
        print(f"already planned: {result.records} records in {result.shards} shards", file=sys.stderr)
    print(result.version)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from batchline.planner import plan
    from batchline.runner import LocalRunner, default_log_dir, format_duration
    from batchline.spec import load_spec

    if args.workers < 1:
        raise BatchlineError("--workers must be at least 1")
    spec = load_spec(args.spec)
    store = _store(args)
    result = plan(spec, store, log=lambda m: print(m, file=sys.stderr))
    print(f"version {result.version}", file=sys.stderr)
    runner = LocalRunner(store, result.version, args.workers,
                         log_dir=args.log_dir or default_log_dir(store.url, result.version),
                         deadline=spec.deadline.timestamp() if spec.deadline else None)
    summary = runner.run()
    st = summary.status
    info = store.job(st.version)
    assert info is not None
    rate = (st.results + st.dead_letters) / summary.seconds if summary.seconds > 0 else 0.0
    tokens = store.token_totals(st.version)
    lines = [
        f"{st.state}: {st.version}",
        f"  records      {st.records:,}",
        f"  results      {st.results:,}" + (f" ({info.carried:,} carried from the base)" if info.carried else ""),
        f"  dead letters {st.dead_letters:,}"
        + (f" ({', '.join(f'{k} {v}' for k, v in sorted(st.dead_letters_by_kind.items()))})"
           if st.dead_letters else ""),
        f"  wall time    {format_duration(summary.seconds)} ({rate:,.2f} records/s this run)",
        f"  workers      {args.workers} ({summary.restarts} restarts, {st.leases_lost} leases lost)",
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
    lines.append(f"  worker logs  {summary.log_dir}")
    print("\n".join(lines), file=sys.stderr)
    if args.publish and summary.exit_code == 0:
        from batchline.publish import publish
        from batchline.validate import validate

        report = validate(store, st.version)
        print(report.table(), file=sys.stderr)
        if not report.passed:
            raise BatchlineError(f"{st.version} failed validation; not published")
        published = publish(store, st.version, log=lambda m: print(m, file=sys.stderr))
        print(f"published {st.version} as {published.name}"
              + (f" (was {published.previous})" if published.previous else ""), file=sys.stderr)
    print(st.version)
    return summary.exit_code


def cmd_worker(args: argparse.Namespace) -> int:
    from batchline.logs import configure_worker_logging
    from batchline.telemetry import WorkerTelemetry
    from batchline.worker.supervisor import Worker, new_worker_id

    # Batch work yields: the lowest CPU priority, so interactive work on a shared node comes first.
    os.nice(19)
    worker_id = new_worker_id()
    log = configure_worker_logging(args.log_format, worker_id, sys.stderr)
    telemetry: WorkerTelemetry | None = None
    if args.metrics_port is not None:
        from batchline.metrics import serve_metrics

        telemetry = serve_metrics(args.metrics_port, worker_id=worker_id, addr=args.metrics_addr)
        log.info("metrics on %s:%d/metrics", args.metrics_addr, args.metrics_port)
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("received %s: stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    from batchline.notices import start_watcher

    watcher = start_watcher(args.preemption_notice, stop, base_url=args.metadata_url, log=log.info)
    worker = Worker(_store(args), version=args.job, worker_id=worker_id, stop=stop,
                    poll_seconds=args.poll_seconds, log=log.info, telemetry=telemetry,
                    routes=[r.strip() for r in args.routes.split(",") if r.strip()] if args.routes else None)
    code = worker.run()
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
        "records_per_second": st.records_done_last_minutes / st.window_seconds,
    }


def routes_dict(store: Store, version: str) -> dict[str, Any]:
    return {route: t.__dict__ for route, t in sorted(store.route_totals(version).items())}


def cmd_status(args: argparse.Namespace) -> int:
    from batchline.runner import progress_line

    store = _store(args)
    if args.version is None:
        if args.watch:
            raise BatchlineError("--watch needs a VERSION (or a published NAME)")
        jobs = store.jobs()
        if args.json:
            print(json.dumps([status_dict(store.status(j.version)) for j in jobs], indent=2))
        else:
            for j in jobs:
                print(f"{j.version}  {j.state:7}  {j.record_count:,} records  {j.shard_count:,} shards")
        return 0
    if args.watch:
        from batchline.cli.observe import watch_status

        if args.json:
            raise BatchlineError("--watch draws a progress line; use --json without it")
        return watch_status(store, _version(store, args.version), interval=args.interval)
    st = store.status(_version(store, args.version))
    if args.json:
        print(json.dumps({**status_dict(st), "routes": routes_dict(store, st.version)}, indent=2))
        return 0
    rate = st.records_done_last_minutes / st.window_seconds or None
    print(f"{st.version} ({st.state})")
    print("  " + progress_line(st, rate, None, None, None))
    print("  shards: " + ", ".join(f"{k} {v}" for k, v in st.shards.items()))
    routes = store.route_totals(st.version)
    if set(routes) - {"local"}:
        print("  routes: " + "; ".join(f"{route} {t.records:,} records, {t.results:,} results"
                                       for route, t in sorted(routes.items())))
    if st.dead_letters_by_kind:
        print("  dead letters: " + ", ".join(f"{k} {v}" for k, v in sorted(st.dead_letters_by_kind.items())))
    return 0


def cmd_dead_letters(args: argparse.Namespace) -> int:
    store = _store(args)
    version = _version(store, args.version)
    rows = list(store.iter_dead_letters(version))
    if args.json:
        print(json.dumps([{"id": r.record_id, "kind": r.kind, "error": r.error, "attempts": r.attempts,
                           "shard": r.shard_no, "acl": r.acl} for r in rows], indent=2))
        return 0
    for r in rows:
        print(f"{r.record_id}\t{r.kind}\t{r.attempts} attempts\t{r.error}")
    print(f"{len(rows)} dead letters", file=sys.stderr)
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from batchline.validate import validate

    store = _store(args)
    report = validate(store, _version(store, args.version))
    print(json.dumps(report.to_json(), indent=2) if args.json else report.table())
    return 0 if report.passed else 1


def cmd_publish(args: argparse.Namespace) -> int:
    from batchline.publish import publish

    store = _store(args)
    result = publish(store, args.version, force=args.force, reason=args.reason,
                     log=lambda m: print(m, file=sys.stderr))
    print(f"published {result.version} as {result.name}"
          + (f" (was {result.previous})" if result.previous else ""), file=sys.stderr)
    return 0


def cmd_rollback(args: argparse.Namespace) -> int:
    from batchline.publish import rollback

    old, new = rollback(_store(args), args.name, args.reason)
    print(f"{args.name}: rolled back from {old} to {new}", file=sys.stderr)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from batchline.export import export_dataset, export_jsonl, export_parquet, export_to

    store = _store(args)
    if args.format == "openai-batch":
        return _export_openai_batch(store, args)
    if args.errors is not None or args.partial:
        raise BatchlineError("--errors and --partial go with --format openai-batch")
    if store.job(args.target) is None and args.format == "parquet":
        version, folder = export_dataset(store, args.target, args.out or "exports")
        print(f"exported {version} to {folder}; {folder.rsplit('/', 1)[0]}/CURRENT names it", file=sys.stderr)
        return 0
    version = _version(store, args.target)
    out: str | None = args.out
    if args.format == "parquet":
        out = out or f"{version.replace('@', '-')}.parquet"
        n = export_to(out, lambda path: export_parquet(store, version, path))
    elif out is None:
        n = export_jsonl(store, version, None)
    else:
        n = export_to(out, lambda path: export_jsonl(store, version, path))
    print(f"exported {n:,} results of {version}" + (f" to {out}" if out else ""), file=sys.stderr)
    return 0


def _export_openai_batch(store: Store, args: argparse.Namespace) -> int:
    from batchline.export import export_openai_batch, openai_errors_path

    if args.out is None:
        raise BatchlineError("--format openai-batch needs --out FILE (the error file goes beside it)")
    if args.out.startswith(("s3://", "gs://")):
        raise BatchlineError("--format openai-batch writes two files side by side on local disk; --out must "
                             "be a local file (copy them to object storage afterwards)")
    out = Path(args.out)
    errors = args.errors or openai_errors_path(out)
    if errors.resolve() == out.resolve():
        raise BatchlineError(f"--errors {errors} is the output file itself; name another file")
    version = _version(store, args.target)
    done = export_openai_batch(store, version, out, errors, partial=args.partial)
    print(f"exported {version}: responses {done.responses:,} in {args.out}, errors {done.errors:,} in {errors}"
          + (f"; {done.pending:,} records have no outcome yet" if done.pending else ""), file=sys.stderr)
    return 0
