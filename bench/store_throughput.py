"""Store throughput: fenced put-if-absent result rows per second, and shard
claim+complete cycles per second, measured through the `Store` protocol.

    python bench/store_throughput.py [--store sqlite:///path.db] [--rows 400000] [--cycles 5000]

Each figure is the median of --repeats runs on a fresh version; the baseline
(raw sqlite3 `INSERT OR IGNORE` in the same batches, and bare claim+complete
UPDATEs) is measured in the same run so the ratio holds on a noisy machine.
"""

from __future__ import annotations

import argparse
import sqlite3
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from batchline.store import PlannedRecord, PlannedShard, ResultRow, Store, open_store
from batchline.store.base import WRITE_BATCH_ROWS

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
        batches.append((lease, [ResultRow(f"{lease.shard_no}-{i}", OUTPUT, ["g"], 1, 300, 20)
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", default=None)
    parser.add_argument("--rows", type=int, default=400_000)
    parser.add_argument("--cycles", type=int, default=5_000)
    parser.add_argument("--repeats", type=int, default=3)
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
    print("command: python " + " ".join(sys.argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
