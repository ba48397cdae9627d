"""The backfill the design is for, rehearsed at smaller sizes and extrapolated to 50 million records:
every phase of a full version and of the nightly version after it, each timed with its peak
memory, the disk it used and the store's size.

    python bench/backfill_50m.py --records 1000000 2000000 5000000 10000000 [--workers 2]
                                 [--changed 0.05] [--work DIR] [--store-url postgresql://...]

For each size: the input as Parquet on local disk (row groups of 100,000; made once, not timed),
a PostgreSQL store (a database of its own on the server), the synthetic engine at no cost per
record (so every second is the pipeline's own), `shards.size` 5,000 (a Parquet shard takes whole row groups, so
its shards hold 100,000 records each), and the results published into
an Iceberg table whose files the workers write (`files: per-shard`, the SQL catalog in the store's
database, the warehouse on local disk) and into a Parquet dataset. The phases, each a
`batchline` command under `/usr/bin/time`: plan, run (`--workers` local workers), validate,
publish; then the nightly version (`base: published`, `--changed` of the records changed among
the most recent ones): plan, run, validate, publish. Per phase: wall seconds; CPU seconds of the
command and every process it started; the peak resident memory of the largest of them; bytes
added under the work folder; the store database's size after it.

A run can be stopped at any point: the figures of every phase that ended are kept in
`WORK/rehearsal.json`, and running the command again goes on from the first phase without
them (a phase stopped part-way runs again: each is idempotent, as the commands are). At the end
it prints the phase table of every size, the linear fit of each phase's seconds against the
records (seconds = a + b x records) with its residuals, each phase extrapolated to 50,000,000,
the serial phases (plan, validate, publish) summed at that size against the 36-minute budget,
and the pipeline's worker seconds per record against the 1 ms budget.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "examples" / "tickets" / "triage.schema.json"
TARGET = 50_000_000
SERIAL = ("plan", "validate", "publish")
BUDGET_SERIAL_MINUTES = 36.0
BUDGET_WORKER_MS = 1.0
PG_ADMIN = os.environ.get("BATCHLINE_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")


def write_input(path: Path, records: int, changed: set[int] | range = range(0)) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    changed_from = changed.start if isinstance(changed, range) and len(changed) else None
    with pq.ParquetWriter(path, pa.schema([("id", pa.string()), ("text", pa.string()),
                                           ("acl", pa.list_(pa.string()))])) as writer:
        for start in range(0, records, 100_000):
            ids = range(start, min(records, start + 100_000))
            texts = [f"ticket {i}: printer on floor {i % 9} jams when printing from laptop {i % 13}"
                     + (" (updated overnight)" if changed_from is not None and i >= changed_from else "")
                     for i in ids]
            writer.write_table(pa.table({"id": [f"t-{i:09d}" for i in ids], "text": texts,
                                         "acl": [[f"team-{i % 5}"] for i in ids]}))


def write_spec(path: Path, data: Path, work: Path, name: str, base: bool) -> None:
    spec: dict[str, Any] = {
        "name": name, "input": {"path": str(data), "acl_field": "acl"},
        "model": {"engine": "synthetic"}, "prompt": {"text": "Classify the ticket.", "version": "v1"},
        "output": {"schema": str(SCHEMA), "label_field": "category",
                   "table": {"catalog": "store", "name": f"rehearsal.{name.replace('-', '_')}",
                             "warehouse": str(work / "warehouse"), "files": "per-shard"},
                   "dataset": str(work / "dataset")},
        "shards": {"size": 5000, "lease_seconds": 1800},
        "validate": {"drift": {"max_psi": 10, "max_new_categories": 10}},
    }
    if base:
        spec["base"] = "published"
    path.write_text(yaml.safe_dump(spec))


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def store_bytes(url: str) -> int:
    import psycopg

    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT pg_database_size(current_database())").fetchone()
    return int(row[0]) if row else 0


def timed(command: list[str], work: Path, store_url: str) -> dict[str, Any]:
    """One phase: the command under /usr/bin/time (wall, CPU of its whole tree, the largest process's
    peak memory), the bytes it added under the work folder, the store's size after it."""
    before = folder_bytes(work)
    report = work / "time.txt"
    start = time.perf_counter()
    done = subprocess.run(["/usr/bin/time", "-o", str(report), "-f", "%e %U %S %M",
                           sys.executable, "-m", "batchline", *command], capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"batchline {' '.join(command)} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    _elapsed, user, system, peak_kb = report.read_text().split()[-4:]
    return {"seconds": round(wall, 2), "cpu_seconds": round(float(user) + float(system), 2),
            "peak_mb": round(int(peak_kb) / 1024, 1), "disk_mb": round((folder_bytes(work) - before) / 1e6, 1),
            "store_mb": round(store_bytes(store_url) / 1e6, 1), "stdout": done.stdout.strip().splitlines()[-1:]}


def rehearse(records: int, args: argparse.Namespace, state: dict[str, Any], save: Any) -> None:
    import psycopg

    key = str(records)
    figures = state.setdefault(key, {})
    work = Path(args.work) / f"n{records}"
    work.mkdir(parents=True, exist_ok=True)
    database = f"bl_rehearsal_{records}"
    url = args.store_url or PG_ADMIN.rsplit("/", 1)[0] + f"/{database}"
    if "input" not in figures:
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{database}"')
            conn.execute(f'CREATE DATABASE "{database}"')
        for leftover in ("warehouse", "dataset"):
            shutil.rmtree(work / leftover, ignore_errors=True)
        write_input(work / "full.parquet", records)
        n_changed = int(records * args.changed)
        write_input(work / "nightly.parquet", records, range(records - n_changed, records))
        figures["input"] = {"records": records, "changed": n_changed,
                            "input_mb": round((work / "full.parquet").stat().st_size / 1e6, 1)}
        save()
    name = f"backfill-{records}"
    for night in (False, True):
        prefix = "nightly " if night else ""
        spec = work / ("nightly.yaml" if night else "full.yaml")
        write_spec(spec, work / ("nightly.parquet" if night else "full.parquet"), work, name, night)
        steps = [("plan", ["plan", str(spec), "--store", url]),
                 ("run", ["run", str(spec), "--store", url, "--workers", str(args.workers)])]
        for phase, command in steps:
            if prefix + phase not in figures:
                figures[prefix + phase] = timed(command, work, url)
                save()
                print(f"{records:,} {prefix}{phase}: {figures[prefix + phase]}", flush=True)
        version = figures[prefix + "plan"]["stdout"][0]
        for phase, command in (("validate", ["validate", version, "--store", url]),
                               ("publish", ["publish", version, "--store", url])):
            if prefix + phase not in figures:
                figures[prefix + phase] = timed(command, work, url)
                save()
                print(f"{records:,} {prefix}{phase}: {figures[prefix + phase]}", flush=True)


def fit(xs: list[float], ys: list[float]) -> tuple[float, float, list[float]]:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    a = my - b * mx
    return a, b, [y - (a + b * x) for x, y in zip(xs, ys, strict=True)]


def report(state: dict[str, Any], workers: int) -> None:
    sizes = sorted(int(k) for k, v in state.items() if isinstance(v, dict) and "nightly publish" in v)
    if not sizes:
        print("no size has every phase yet")
        return
    phases = ["plan", "run", "validate", "publish", "nightly plan", "nightly run", "nightly validate",
              "nightly publish"]
    print("\n| phase | " + " | ".join(f"{n:,}" for n in sizes) + " | fit a + b x n (s) | residuals (s) | at 50,000,000 |")
    print("| --- |" + " --- |" * (len(sizes) + 3))
    at_target: dict[str, float] = {}
    for phase in phases:
        ys = [float(state[str(n)][phase]["seconds"]) for n in sizes]
        a, b, residuals = fit([float(n) for n in sizes], ys)
        at_target[phase] = a + b * TARGET
        cells = " | ".join(f"{y:,.1f} s, {state[str(n)][phase]['peak_mb']:,.0f} MB" for n, y in zip(sizes, ys, strict=True))
        print(f"| {phase} | {cells} | {a:.1f} + {b * 1e6:.2f} per million | "
              f"{', '.join(f'{r:+.1f}' for r in residuals)} | {at_target[phase] / 60:,.1f} min |")
    serial = sum(at_target[p] for p in SERIAL) / 60
    print(f"\nserial phases (plan, validate, publish) at 50,000,000: {serial:.1f} min "
          f"(budget {BUDGET_SERIAL_MINUTES:.0f}: {'met' if serial <= BUDGET_SERIAL_MINUTES else 'NOT met'})")
    per_record = [1000 * workers * state[str(n)]["run"]["seconds"] / n for n in sizes]
    cpu_per_record = [1000 * state[str(n)]["run"]["cpu_seconds"] / n for n in sizes]
    print(f"worker time per record of the full run ({workers} workers x wall / records): "
          f"{', '.join(f'{x:.3f}' for x in per_record)} ms; CPU of the run's processes per record: "
          f"{', '.join(f'{x:.3f}' for x in cpu_per_record)} ms (budget {BUDGET_WORKER_MS} ms)")
    for n in sizes:
        s = state[str(n)]
        print(f"{n:,}: input {s['input']['input_mb']} MB; store after the nightly {s['nightly publish']['store_mb']} MB; "
              f"disk added by the full run {s['run']['disk_mb']} MB, its publish {s['publish']['disk_mb']} MB, "
              f"the nightly publish {s['nightly publish']['disk_mb']} MB")


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--records", type=int, nargs="+", default=[1_000_000, 2_000_000, 5_000_000, 10_000_000])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--changed", type=float, default=0.05)
    parser.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "batchline-rehearsal"))
    parser.add_argument("--store-url", default=None, help="one PostgreSQL database for every size (default: one "
                                                          "made for each on the server)")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    state_file = work / "rehearsal.json"
    state: dict[str, Any] = json.loads(state_file.read_text()) if state_file.exists() else {}

    def save() -> None:
        tmp = state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(state_file)

    if not args.report_only:
        for records in args.records:
            rehearse(records, args, state, save)
    report(state, args.workers)
    print(f"command: python bench/backfill_50m.py --records {' '.join(map(str, args.records))} --workers "
          f"{args.workers} --changed {args.changed} --work {args.work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
