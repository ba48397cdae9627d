"""What one claim costs as the fleet's leases grow, on PostgreSQL.

    python bench/claim_cost.py [--admin postgresql://postgres@127.0.0.1:5432/postgres] [--held 0,1000,3000]

A version of 6,000 shards is planned in a database of its own; then, with 0, 1,000 and 3,000
shards leased by other workers (`--held`), one worker claims and releases 50 times: the
median and the slowest claim. A claim that walked the open shards in number order passed
every live lease; one that seeks the ready, expired and due shards apart does not.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from batchline.store import PlannedShard, open_store

SHARDS = 6000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--admin", default="postgresql://postgres@127.0.0.1:5432/postgres")
    ap.add_argument("--held", default="0,1000,3000", help="leases held by others before each measurement")
    ap.add_argument("--claims", type=int, default=50)
    args = ap.parse_args()
    name = f"bench_claims_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(args.admin, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    try:
        store = open_store(args.admin.rsplit("/", 1)[0] + f"/{name}")
        version = "claims@1"
        writer = store.begin_plan(version, "claims", {"name": "claims", "shards": {"lease_seconds": 600}})
        writer.add_shards([PlannedShard(i, {}, 10) for i in range(SHARDS)])
        writer.commit(10 * SHARDS, SHARDS)
        held = 0
        print(f"claim cost on PostgreSQL: {SHARDS:,} shards, {args.claims} claims each")
        for target in (int(x) for x in args.held.split(",")):
            while held < target:
                store.claim(f"other-{held}", version)
                held += 1
            took = []
            for _ in range(args.claims):
                started = time.perf_counter()
                lease = store.claim("probe", version)
                took.append(time.perf_counter() - started)
                assert lease is not None
                store.release(lease, "bench")
            print(f"  {target:>6,} leases held: claim p50 {statistics.median(took) * 1000:.2f} ms, "
                  f"max {max(took) * 1000:.2f} ms")
        store.close()
    finally:
        with psycopg.connect(args.admin, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE {name} WITH (FORCE)")


if __name__ == "__main__":
    main()
