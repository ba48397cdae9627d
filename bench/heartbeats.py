"""What every worker's heartbeat costs the store: a thousand workers, one heartbeat each every 5 s.

    python bench/heartbeats.py [--workers 1000] [--beats 10] [--processes 4] [--stores sqlite postgres]

A thousand workers heartbeating every 5 s (batchline.worker.heartbeat) are 200 upserts a
second on the store, beside the pacer reading who is seen. This writes `--beats` heartbeats for
each of `--workers` workers of one version, from `--processes` processes at once (each its own
connection, as workers have), as fast as the store takes them, on a new SQLite file and a new
PostgreSQL database, then times the pacer's read of the workers seen (`workers_seen`, the
median of 20). It prints the heartbeats a second each store took, the share of that a thousand
workers need (200 a second), and the read's time.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stores import new_store

from batchline.store import PlannedRecord, PlannedShard, open_store
from batchline.worker.heartbeat import HEARTBEAT_SECONDS

VERSION = "beats@1"


def beat(url: str, workers: range, beats: int) -> int:
    store = open_store(url, create=False)
    try:
        for _ in range(beats):
            for w in workers:
                store.worker_beat(VERSION, f"worker-{w}", every=HEARTBEAT_SECONDS,
                                  process={"host": "bench", "pid": w})
        return len(workers) * beats
    finally:
        store.close()


def measure(kind: str, args: argparse.Namespace) -> tuple[float, float]:
    with tempfile.TemporaryDirectory(prefix="bench-beats-") as tmp, new_store(kind, Path(tmp), "bench_beats") as url:
        store = open_store(url)
        writer = store.begin_plan(VERSION, "beats", {"name": "beats", "shards": {"lease_seconds": 600}})
        writer.add_shards([PlannedShard(0, {"shard": 0}, 1)])
        writer.add_records([PlannedRecord("r0", 0, "h")])
        writer.commit(1, 1)
        per = args.workers // args.processes
        parts = [range(i * per, (i + 1) * per) for i in range(args.processes)]
        started = time.perf_counter()
        with multiprocessing.get_context("spawn").Pool(args.processes) as pool:
            done = sum(pool.starmap(beat, [(url, part, args.beats) for part in parts]))
        rate = done / (time.perf_counter() - started)
        reads = []
        for _ in range(20):
            t = time.perf_counter()
            seen = store.workers_seen(VERSION)
            reads.append(time.perf_counter() - t)
        assert len(seen) == per * args.processes, len(seen)
        store.close()
        return rate, statistics.median(reads)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--workers", type=int, default=1000)
    parser.add_argument("--beats", type=int, default=10)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--stores", nargs="+", default=["sqlite", "postgres"], choices=["sqlite", "postgres"])
    args = parser.parse_args()
    needed = args.workers / HEARTBEAT_SECONDS
    print(f"{args.workers:,} workers x {args.beats} heartbeats from {args.processes} processes; "
          f"{args.workers:,} workers beating every {HEARTBEAT_SECONDS:g} s need {needed:,.0f} a second")
    print(f"{'store':<10}{'heartbeats/s':>14}{'share needed':>14}{'workers_seen':>14}")
    for kind in args.stores:
        rate, read = measure(kind, args)
        print(f"{kind:<10}{rate:>14,.0f}{needed / rate:>14.1%}{read * 1000:>11.1f} ms")
    print("command: python " + " ".join(sys.argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
