"""Store throughput: fenced put-if-absent result rows per second, and shard
claim+complete cycles per second, measured through the `Store` protocol.

    python bench/store_throughput.py [--store sqlite:///path.db] [--rows 400000] [--cycles 5000]
    python bench/store_throughput.py --store postgresql://postgres@127.0.0.1:5432/bench [--procs 1,8,32]

Each figure is the median of --repeats runs on a fresh version; the baseline
(raw sqlite3 `INSERT OR IGNORE` in the same batches, and bare claim+complete
UPDATEs) is measured in the same run so the ratio holds on a noisy machine.

For PostgreSQL it also runs, with 1, 8 and 32 concurrent worker processes
(--procs), the worker's write pattern: claim a shard, put its rows in 500-row
flushes, renew, complete (result rows/s); and the lease pattern alone on empty
shards (claims+renewals+completions/s). Then the renewal load of 1,000 workers
(1,000 leases held, renewed at 34/s, about every 30 s each) while 8 processes
write results, with the latency of each renewal (p50, p99). Its raw baselines
(psycopg `executemany` of INSERT ... ON CONFLICT DO NOTHING, COPY into a
staging table then insert-select, and a bare SKIP LOCKED claim plus a fenced
complete) run in the same database in the same run.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sqlite3
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from batchline.acl import Acl
from batchline.store import PlannedRecord, PlannedShard, ResultRow, Store, open_store
from batchline.store.model import WRITE_BATCH_ROWS

OUTPUT = '{"category":"Hardware","summary":"laptop screen flickers after update","entities":["laptop"]}'


def plan(store: Store, shards: int, per_shard: int) -> str:
    version = f"bench@{uuid.uuid4().hex[:12]}"
    writer = store.begin_plan(version, "bench", {"name": "bench", "shards": {"lease_seconds": 600}})
    writer.add_shards([PlannedShard(s, {}, per_shard) for s in range(shards)])
    if per_shard:
        writer.add_records([PlannedRecord(f"{s}-{i}", s, "h") for s in range(shards) for i in range(per_shard)])
    writer.commit(shards * per_shard, shards)
    return version


def puts_per_second(store: Store, rows: int) -> float:
    per_shard = 10_000
    shards = rows // per_shard
    version = plan(store, shards, per_shard)
    batches = []
    for _ in range(shards):
        lease = store.claim("bench", version)
        assert lease is not None
        batches.append((lease, [ResultRow(f"{lease.shard_no}-{i}", OUTPUT, Acl(["g"]), 1, 300, 20)
                                for i in range(per_shard)]))
    start = time.perf_counter()
    for lease, batch in batches:
        for i in range(0, len(batch), 500):  # as a worker flushes: a few hundred rows at a time
            store.put_results(lease, batch[i:i + 500])
    return rows / (time.perf_counter() - start)


def cycles_per_second(store: Store, cycles: int) -> float:
    version = plan(store, cycles, 0)
    start = time.perf_counter()
    for _ in range(cycles):
        lease = store.claim("bench", version)
        assert lease is not None
        store.complete(lease)
    return cycles / (time.perf_counter() - start)


def raw_sqlite_baseline(path: Path, rows: int, cycles: int) -> tuple[float, float]:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = NORMAL")
    conn.execute("CREATE TABLE r (version TEXT, record_id TEXT, output TEXT, PRIMARY KEY (version, record_id))")
    conn.execute("CREATE TABLE s (version TEXT, shard_no INTEGER, state TEXT, owner TEXT, epoch INTEGER, "
                 "PRIMARY KEY (version, shard_no))")
    data = [("v", f"x{i}", OUTPUT) for i in range(rows)]
    start = time.perf_counter()
    for i in range(0, rows, WRITE_BATCH_ROWS):
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany("INSERT OR IGNORE INTO r VALUES (?, ?, ?)", data[i:i + WRITE_BATCH_ROWS])
        conn.execute("COMMIT")
    puts = rows / (time.perf_counter() - start)
    conn.executemany("INSERT INTO s VALUES ('v', ?, 'ready', NULL, 0)", [(i,) for i in range(cycles)])
    start = time.perf_counter()
    for i in range(cycles):
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("UPDATE s SET state = 'leased', owner = 'w', epoch = epoch + 1 "
                     "WHERE version = 'v' AND shard_no = ?", (i,))
        conn.execute("COMMIT")
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("UPDATE s SET state = 'done' WHERE version = 'v' AND shard_no = ? AND owner = 'w'", (i,))
        conn.execute("COMMIT")
    return puts, cycles / (time.perf_counter() - start)


# --- PostgreSQL: concurrent workers, renewal latency, raw baselines ----------------------------


def plan_empty(store: Store, shards: int, per_shard: int) -> str:
    """Shards without planned record ids: completion checks counts, and planning
    tens of thousands of ids per run would only slow the benchmark down."""
    version = f"bench@{uuid.uuid4().hex[:12]}"
    writer = store.begin_plan(version, "bench", {"name": "bench", "shards": {"lease_seconds": 600}})
    writer.add_shards([PlannedShard(s, {}, per_shard) for s in range(shards)])
    writer.commit(shards * per_shard, shards)
    return version


def _worker(url: str, version: str, name: str, rows: int, until: float, go: Any, out: Any) -> None:
    store = open_store(url)
    go.wait()
    written = ops = 0
    while time.time() < until:
        lease = store.claim(name, version)
        if lease is None:
            break
        ops += 1
        for i in range(0, max(rows, 1), 500):
            if i % 1000 == 0:  # a renewal every other flush, and at least one per shard
                renewed = store.renew(lease)
                assert renewed is not None
                ops += 1
            if rows:
                written += store.put_results(lease, [ResultRow(f"{lease.shard_no}-{j}", OUTPUT, Acl(["g"]), 1, 300,
                                                               20) for j in range(i, min(rows, i + 500))])
        store.complete(lease)
        ops += 1
    store.close()
    out.put((written, ops))


def concurrent_run(url: str, procs: int, rows: int, seconds: float) -> tuple[float, float]:
    """Result rows/s and claims+renewals+completions/s of `procs` worker processes."""
    store = open_store(url)
    # Enough shards that nobody runs out within the time: at most ~100k rows/s, or
    # (empty shards) ~1,000 claims/s.
    shards = int(100_000 * seconds / rows) if rows else int(1_000 * seconds)
    version = plan_empty(store, shards + 4 * procs, rows)
    store.close()
    ctx = multiprocessing.get_context("spawn")
    go, out = ctx.Event(), ctx.Queue()
    until = time.time() + seconds + 5  # the start-up of 32 interpreters is not measured
    ps = [ctx.Process(target=_worker, args=(url, version, f"w{i}", rows, until, go, out)) for i in range(procs)]
    for p in ps:
        p.start()
    time.sleep(min(5.0, 0.5 + 0.15 * procs))
    start = time.perf_counter()
    go.set()
    reports = [out.get(timeout=seconds + 120) for _ in ps]
    elapsed = time.perf_counter() - start
    for p in ps:
        p.join()
    return sum(r[0] for r in reports) / elapsed, sum(r[1] for r in reports) / elapsed


def renewal_latency(url: str, leases: int, rate: float, seconds: float, writers: int,
                    rows: int) -> tuple[float, float, float, float]:
    """Holds `leases` leases and renews them round-robin at `rate` per second while
    `writers` processes write results; returns p50, p99 and max in ms, and rows/s."""
    store = open_store(url)
    version = plan_empty(store, leases, 1)
    held = [store.claim(f"sim{i}", version) for i in range(leases)]
    ctx = multiprocessing.get_context("spawn")
    go, out = ctx.Event(), ctx.Queue()
    write_version = plan_empty(store, writers * 200, rows)
    until = time.time() + seconds + 5
    ps = [ctx.Process(target=_worker, args=(url, write_version, f"w{i}", rows, until, go, out))
          for i in range(writers)]
    for p in ps:
        p.start()
    time.sleep(min(5.0, 0.5 + 0.15 * writers))
    go.set()
    started = time.perf_counter()
    latencies: list[float] = []
    n = 0
    while time.perf_counter() - started < seconds:
        lease = held[n % leases]
        assert lease is not None
        t0 = time.perf_counter()
        renewed = store.renew(lease)
        latencies.append((time.perf_counter() - t0) * 1000)
        assert renewed is not None
        held[n % leases] = renewed
        n += 1
        # Paced, as renewals arrive from many workers: not as fast as one loop can go.
        time.sleep(max(0.0, started + n / rate - time.perf_counter()))
    reports = [out.get(timeout=seconds + 120) for _ in ps]
    elapsed = time.perf_counter() - started
    for p in ps:
        p.join()
    store.close()
    latencies.sort()
    return (latencies[len(latencies) // 2], latencies[int(len(latencies) * 0.99)], latencies[-1],
            sum(r[0] for r in reports) / elapsed)


def raw_postgres_baseline(url: str, rows: int, cycles: int) -> tuple[float, float, float]:
    """executemany INSERT ... ON CONFLICT DO NOTHING, COPY to staging + insert-select
    (rows/s, 500-row transactions), and a bare SKIP LOCKED claim + fenced complete (cycles/s)."""
    import psycopg

    data = [(f"x{i}", OUTPUT) for i in range(rows)]
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DROP SCHEMA IF EXISTS bench_raw CASCADE")
        conn.execute("CREATE SCHEMA bench_raw")
        conn.execute("CREATE TABLE bench_raw.r (version text, record_id text, output text, "
                     "PRIMARY KEY (version, record_id))")
        conn.execute("CREATE TABLE bench_raw.s (version text, shard_no int, state text, owner text, "
                     "epoch int, PRIMARY KEY (version, shard_no))")
        conn.execute("CREATE TEMP TABLE stage (record_id text, output text) ON COMMIT DELETE ROWS")
        with conn.cursor() as cur:
            start = time.perf_counter()
            for i in range(0, rows, 500):
                with conn.transaction():
                    cur.executemany("INSERT INTO bench_raw.r VALUES ('a', %s, %s) ON CONFLICT DO NOTHING",
                                    data[i:i + 500])
            executemany = rows / (time.perf_counter() - start)
            start = time.perf_counter()
            for i in range(0, rows, 500):
                with conn.transaction():
                    with cur.copy("COPY stage FROM STDIN") as copy:
                        for item in data[i:i + 500]:
                            copy.write_row(item)
                    cur.execute("INSERT INTO bench_raw.r SELECT 'b', record_id, output FROM stage "
                                "ON CONFLICT DO NOTHING")
            copied = rows / (time.perf_counter() - start)
            cur.execute("INSERT INTO bench_raw.s SELECT 'v', g, 'ready', NULL, 0 FROM generate_series(1, %s) g",
                        (cycles,))
            start = time.perf_counter()
            for _ in range(cycles):
                with conn.transaction():
                    cur.execute("SELECT shard_no FROM bench_raw.s WHERE version = 'v' AND state = 'ready' "
                                "ORDER BY shard_no LIMIT 1 FOR UPDATE SKIP LOCKED")
                    row = cur.fetchone()
                    assert row is not None
                    cur.execute("UPDATE bench_raw.s SET state = 'leased', owner = 'w', epoch = epoch + 1 "
                                "WHERE version = 'v' AND shard_no = %s", row)
                with conn.transaction():
                    cur.execute("UPDATE bench_raw.s SET state = 'done' WHERE version = 'v' AND shard_no = %s "
                                "AND owner = 'w' AND epoch = 1 AND state = 'leased'", row)
            bare = cycles / (time.perf_counter() - start)
        conn.execute("DROP SCHEMA bench_raw CASCADE")
    return executemany, copied, bare


def postgres_figures(url: str, args: argparse.Namespace, puts: float, cycles: float) -> None:
    raw_many, raw_copy, raw_cycles = raw_postgres_baseline(url, min(args.rows, 200_000), min(args.cycles, 3000))
    print(f"raw psycopg baseline: {raw_many:,.0f} executemany INSERT ON CONFLICT rows/s, "
          f"{raw_copy:,.0f} COPY+insert-select rows/s, {raw_cycles:,.0f} bare SKIP LOCKED claim+complete cycles/s")
    print(f"ratios: puts {puts / raw_copy:.2f}x raw COPY, cycles {cycles / raw_cycles:.2f}x raw")
    print(f"concurrent workers ({args.shard_rows:,}-row shards, 500-row flushes, {args.seconds:.0f}s each):")
    for procs in (int(p) for p in args.procs.split(",")):
        rows_s, _ = concurrent_run(url, procs, args.shard_rows, args.seconds)
        _, ops_s = concurrent_run(url, procs, 0, args.seconds)
        print(f"  {procs:>3} processes: {rows_s:>9,.0f} result rows/s   "
              f"{ops_s:>7,.0f} claims+renewals+completions/s (empty shards)")
    rate = args.leases / 30.0
    p50, p99, worst, rows_s = renewal_latency(url, args.leases, rate, args.seconds, 8, args.shard_rows)
    print(f"renewals of {args.leases:,} held leases at {rate:.0f}/s while 8 processes write "
          f"{rows_s:,.0f} rows/s: p50 {p50:.1f} ms, p99 {p99:.1f} ms, max {worst:.1f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", default=None)
    parser.add_argument("--rows", type=int, default=400_000)
    parser.add_argument("--cycles", type=int, default=5_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--procs", default="1,8,32", help="PostgreSQL: concurrent worker processes to try")
    parser.add_argument("--shard-rows", type=int, default=2000, help="PostgreSQL: rows per shard, concurrent runs")
    parser.add_argument("--seconds", type=float, default=15.0, help="PostgreSQL: length of each concurrent run")
    parser.add_argument("--leases", type=int, default=1000, help="PostgreSQL: workers simulated for renewals")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-store-"))
    url = args.store or f"sqlite:///{tmp / 'bench.db'}"
    store = open_store(url)
    puts = statistics.median(puts_per_second(store, args.rows) for _ in range(args.repeats))
    cycles = statistics.median(cycles_per_second(store, args.cycles) for _ in range(args.repeats))
    print(f"store: {url.split('://')[0]}  (rows {args.rows:,}, cycles {args.cycles:,}, median of {args.repeats})")
    print(f"result puts (fenced put-if-absent, 500-row flushes): {puts:,.0f} rows/s")
    print(f"claim+complete cycles:                                {cycles:,.0f} cycles/s")
    if url.startswith("sqlite"):
        raw_puts, raw_cycles = raw_sqlite_baseline(tmp / "raw.db", args.rows, args.cycles)
        print(f"raw sqlite3 baseline: {raw_puts:,.0f} INSERT OR IGNORE rows/s, "
              f"{raw_cycles:,.0f} bare claim+complete cycles/s")
        print(f"ratios: puts {puts / raw_puts:.2f}x raw, cycles {cycles / raw_cycles:.2f}x raw")
    else:
        store.close()
        postgres_figures(url, args, puts, cycles)
    print("command: python " + " ".join(sys.argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
