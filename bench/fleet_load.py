"""A thousand workers on one store: batchline's own store calls, as a fleet's workers make them,
through PgBouncer in transaction pooling.

    python bench/fleet_load.py [--workers 1000] [--minutes 10] [--procs 4] [--restart-pooler-at SECONDS]

Each simulated worker is a thread holding its own `open_store(..., worker=True)` connection to a
PgBouncer of this benchmark's own (Debian's pgbouncer; transaction pooling, `max_client_conn`
above the workers, at most `--server-connections` to the server, whose `max_connections` is
100), `--procs` processes of `--workers / --procs` threads each. Each does what a worker does
with the store, through the `Store` calls the worker makes:

- a heartbeat every 5 s (`worker_beat`, the interval workers use);
- claim a shard (`claim`), hold it for `--shard-seconds` (300: a 5-minute shard), renewing its
  lease every 30 s (`renew`), writing its results in 500-row flushes spread over the shard
  (`put_results`; the shard sizes add up to `--rows-per-second` over the fleet, 9,000 by
  default), then completing it with a per-shard file record (`complete(lease, files=...)`);
- and so on until the run ends. The first shard of each worker is a random part of a whole one
  (its records and its time in proportion), so the fleet is in its steady state from the start
  rather than claiming and completing all at once.

Reported: p50/p99 (and max) of renewal, claim, completion, put and heartbeat latency, and of the
claim wait (from wanting a shard to holding one, retries included); errors; the server
connections used (the most `pg_stat_activity` showed, sampled every 2 s); the CPU the server's
processes, PgBouncer and the load generator used over the run, as a share of the machine's cores
(a generator near the machine's limit measures itself, not the store). `--restart-pooler-at`
restarts PgBouncer that far into the run: every worker reconnects, and a lease lost that had not
expired is counted as an error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import random
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from batchline.acl import Acl
from batchline.store import PlannedShard, ResultRow, open_store
from examples.pgbouncer import PgBouncer

OUTPUT = '{"category":"Hardware","summary":"laptop screen flickers after update","entities":["laptop"]}'
FLUSH_ROWS = 500
HEARTBEAT_SECONDS = 5.0
RENEW_SECONDS = 30.0
LEASE_SECONDS = 600.0


@contextlib.contextmanager
def database(admin: str) -> Iterator[str]:
    name = f"bench_fleet_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    try:
        yield name
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE {name} WITH (FORCE)")


def plan(url: str, workers: int, seconds: float, shard_seconds: float, rows_per_shard: int) -> str:
    """Enough shards for every worker's claims over the run (no record ids: completion checks
    counts). The first `workers` shards are a random part of a whole one each."""
    store = open_store(url)
    version = f"fleet@{uuid.uuid4().hex[:12]}"
    per_worker = int(seconds / shard_seconds) + 2
    rng = random.Random(7)
    sizes = [max(FLUSH_ROWS, int(rows_per_shard * rng.uniform(0.05, 1.0))) for _ in range(workers)]
    sizes += [rows_per_shard] * (workers * per_worker)
    writer = store.begin_plan(version, "fleet", {"name": "fleet", "shards": {"lease_seconds": LEASE_SECONDS}})
    for i in range(0, len(sizes), 5000):
        writer.add_shards([PlannedShard(s, {}, n) for s, n in enumerate(sizes[i:i + 5000], start=i)])
    writer.commit(sum(sizes), len(sizes))
    store.close()
    return version


class Recorder:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.times: dict[str, list[float]] = {}
        self.errors: dict[str, int] = {}
        self.lost = 0

    def timed(self, op: str, started: float) -> None:
        took = time.perf_counter() - started
        with self.lock:
            self.times.setdefault(op, []).append(took)

    def error(self, op: str, exc: BaseException) -> None:
        with self.lock:
            key = f"{op}: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
            self.errors[key] = self.errors.get(key, 0) + 1


def simulated_worker(url: str, version: str, name: str, until: float, shard_seconds: float, rows_per_shard: int,
                     rec: Recorder, stop: threading.Event) -> None:
    rng = random.Random(name)
    # A fleet comes up over a while, not in one millisecond: each worker starts within the first
    # 30 s (a thousand connections opened at one instant measure the generator's own start-up).
    stop.wait(rng.uniform(0, 30.0))
    try:
        store = open_store(url, create=False, worker=True, wait_seconds=60)
    except Exception as exc:
        rec.error("connect", exc)
        return
    next_beat = time.monotonic() + rng.uniform(0, HEARTBEAT_SECONDS)
    acl = Acl(["staff"])

    def beat_if_due() -> None:
        nonlocal next_beat
        if time.monotonic() >= next_beat:
            started = time.perf_counter()
            try:
                store.worker_beat(version, name, every=HEARTBEAT_SECONDS)
                rec.timed("heartbeat", started)
            except Exception as exc:
                rec.error("heartbeat", exc)
            next_beat += HEARTBEAT_SECONDS

    def wait(seconds: float) -> None:
        end = time.monotonic() + seconds
        while not stop.is_set() and time.monotonic() < end:
            beat_if_due()
            stop.wait(min(0.5, max(0.0, end - time.monotonic())))

    try:
        while time.time() < until and not stop.is_set():
            wanted = time.perf_counter()
            lease = None
            while lease is None and time.time() < until and not stop.is_set():
                started = time.perf_counter()
                try:
                    lease = store.claim(name, version)
                    rec.timed("claim", started)
                except Exception as exc:
                    rec.error("claim", exc)
                if lease is None:
                    wait(1.0)
            if lease is None:
                break
            rec.timed("claim_wait", wanted)
            rows = lease.record_count
            duration = shard_seconds * rows / rows_per_shard
            begun = time.monotonic()
            flushes = list(range(0, rows, FLUSH_ROWS))
            flush_at = [begun + duration * (i + 1) / (len(flushes) + 1) for i in range(len(flushes))]
            last_renew = begun
            while flushes and not stop.is_set() and time.time() < until:
                now = time.monotonic()
                if now - last_renew >= RENEW_SECONDS:
                    started = time.perf_counter()
                    try:
                        renewed = store.renew(lease)
                        rec.timed("renew", started)
                        if renewed is None:
                            rec.error("renew", RuntimeError("lease lost before it expired"))
                            break
                        lease = renewed
                    except Exception as exc:
                        rec.error("renew", exc)
                    last_renew = now
                if now >= flush_at[0]:
                    first = flushes.pop(0)
                    flush_at.pop(0)
                    batch = [ResultRow(f"{lease.shard_no}-{j}", OUTPUT, acl, 1, 300, 20)
                             for j in range(first, min(rows, first + FLUSH_ROWS))]
                    started = time.perf_counter()
                    try:
                        store.put_results(lease, batch)
                        rec.timed("put", started)
                    except Exception as exc:
                        rec.error("put", exc)
                    continue
                wait(min(flush_at[0], last_renew + RENEW_SECONDS, until - time.time() + time.monotonic())
                     - time.monotonic())
            if stop.is_set() or flushes:
                # The run ends: the lease is given back, as a stopping worker gives it back.
                with contextlib.suppress(Exception):
                    store.release(lease, "stop")
                break
            wait(max(0.0, begun + duration - time.monotonic()))
            started = time.perf_counter()
            try:
                store.complete(lease, files={"bench": {
                    "location": f"s3://bench/staging/{version}/shard-{lease.shard_no:06d}-e{lease.epoch}.parquet",
                    "size": rows * 120, "sha256": uuid.uuid4().hex * 2}})
                rec.timed("complete", started)
            except Exception as exc:
                rec.error("complete", exc)
    finally:
        with contextlib.suppress(Exception):
            store.close()


def load_process(url: str, version: str, names: list[str], until: float, shard_seconds: float,
                 rows_per_shard: int, out: Any) -> None:
    rec = Recorder()
    stop = threading.Event()
    threads = [threading.Thread(target=simulated_worker, args=(url, version, n, until, shard_seconds,
                                                              rows_per_shard, rec, stop), daemon=True)
               for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(1.0, until - time.time() + 120))
    stop.set()
    usage = os.times()
    out.put({"times": rec.times, "errors": rec.errors, "cpu": usage.user + usage.system})


def cpu_seconds(pids: list[int]) -> float:
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])) / tick
    return total


def postgres_pids() -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if (entry / "comm").read_text().strip() in ("postgres", "postmaster"):
                    out.append(int(entry.name))
    return out


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--admin", default="postgresql://postgres@127.0.0.1:5432/postgres")
    ap.add_argument("--workers", type=int, default=1000)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--shard-seconds", type=float, default=300.0)
    ap.add_argument("--rows-per-second", type=float, default=9000.0)
    ap.add_argument("--server-connections", type=int, default=40)
    ap.add_argument("--restart-pooler-at", type=float, default=None, metavar="SECONDS")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()
    seconds = args.minutes * 60
    rows_per_shard = int(args.rows_per_second * args.shard_seconds / args.workers)
    with database(args.admin) as dbname:
        direct = args.admin.rsplit("/", 1)[0] + f"/{dbname}"
        version = plan(direct, args.workers, seconds, args.shard_seconds, rows_per_shard)
        pooler = PgBouncer(dbname, pool_size=args.server_connections, clients=args.workers + 200)
        try:
            names = [f"sim-{i:04d}" for i in range(args.workers)]
            ctx = multiprocessing.get_context("spawn")
            out = ctx.Queue()
            until = time.time() + seconds
            pg_cpu0, pgb_cpu0, wall0 = cpu_seconds(postgres_pids()), cpu_seconds(pooler.pids()), time.monotonic()
            procs = [ctx.Process(target=load_process, args=(pooler.url, version, names[i::args.procs], until,
                                                            args.shard_seconds, rows_per_shard, out))
                     for i in range(args.procs)]
            for p in procs:
                p.start()
            most = 0
            restarted = False
            pgb_cpu = 0.0
            with psycopg.connect(direct, autocommit=True) as watch:
                while time.time() < until:
                    most = max(most, int(watch.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
                        (dbname,)).fetchone()[0]))
                    if (args.restart_pooler_at is not None and not restarted
                            and time.monotonic() - wall0 >= args.restart_pooler_at):
                        pgb_cpu += cpu_seconds(pooler.pids()) - pgb_cpu0
                        pooler.restart()
                        pgb_cpu0 = cpu_seconds(pooler.pids())
                        restarted = True
                    time.sleep(2)
            results = [out.get(timeout=seconds + 600) for _ in procs]
            for p in procs:
                p.join(60)
            wall = time.monotonic() - wall0
            pg_cpu = cpu_seconds(postgres_pids()) - pg_cpu0
            pgb_cpu += cpu_seconds(pooler.pids()) - pgb_cpu0
            with psycopg.connect(direct) as conn:
                done, rows = conn.execute("SELECT count(*) FILTER (WHERE state = 'done'), "
                                          "COALESCE(sum(results_count), 0) FROM shards WHERE version = %s",
                                          (version,)).fetchone()
        finally:
            pooler.close()
    times: dict[str, list[float]] = {}
    errors: dict[str, int] = {}
    gen_cpu = 0.0
    for r in results:
        for op, values in r["times"].items():
            times.setdefault(op, []).extend(values)
        for key, n in r["errors"].items():
            errors[key] = errors.get(key, 0) + n
        gen_cpu += r["cpu"]
    cores = os.cpu_count() or 1
    figures = {
        "workers": args.workers, "processes": args.procs, "seconds": round(wall, 1),
        "shards_done": int(done), "result_rows": int(rows), "rows_per_second": round(int(rows) / wall, 1),
        "ops": {op: {"n": len(v), "p50_ms": round(statistics.median(v) * 1000, 2),
                     "p99_ms": round(pct(v, 0.99) * 1000, 2), "max_ms": round(max(v) * 1000, 2)}
                for op, v in sorted(times.items())},
        "errors": errors, "server_connections_max": most, "server_connections_allowed": args.server_connections,
        "cpu_share": {"postgres": round(pg_cpu / wall / cores, 3), "pgbouncer": round(pgb_cpu / wall / cores, 3),
                      "load_generator": round(gen_cpu / wall / cores, 3)},
        "pooler_restarted": restarted,
    }
    print(f"fleet load: {args.workers} simulated workers on {args.procs} processes for {wall:.0f} s through "
          f"PgBouncer (transaction pooling, {args.server_connections} server connections), {cores} cores")
    print(f"  shards done {int(done):,}, result rows {int(rows):,} ({int(rows) / wall:,.0f}/s)")
    for op, f in figures["ops"].items():
        print(f"  {op:10} n={f['n']:>7,}  p50 {f['p50_ms']:8.2f} ms  p99 {f['p99_ms']:8.2f} ms  max {f['max_ms']:9.2f} ms")
    print(f"  errors: {sum(errors.values())}" + "".join(f"\n    {n} x {k}" for k, n in sorted(errors.items())))
    print(f"  server connections: at most {most} (pool {args.server_connections}; max_connections 100)")
    print(f"  CPU over the run, share of {cores} cores: postgres {figures['cpu_share']['postgres']:.0%}, "
          f"pgbouncer {figures['cpu_share']['pgbouncer']:.0%}, load generator {figures['cpu_share']['load_generator']:.0%}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
