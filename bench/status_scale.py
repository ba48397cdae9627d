"""`status` at scale: a version of 1M results, its rate counted from the outcomes written.

    python bench/status_scale.py [--records 1000000] [--store URL] [--repeat 20]

The version is written through the Store API as workers write it (flushes of 500
results under a lease, shard after shard), with the store's clock moved on by
`--seconds-per-shard` after each shard, so the results were written over hours and
the rate's window (five minutes) holds the last shard's. The last shard is left
leased and half written: the rate must count it before it completes. Then
`store.status` is timed: as `batchline status` calls it (the five-minute window),
and with a window that holds every result (the worst case for the count).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from batchline.acl import Acl
from batchline.store import PlannedRecord, PlannedShard, ResultRow, Store, open_store

SHARD = 10_000
FLUSH = 500
OUTPUT = '{"category":"billing","summary":"a customer asks about an invoice"}'


def make_version(store: Store, records: int, seconds_per_shard: float) -> tuple[str, float]:
    """The version and the seconds its results took to write."""
    name = f"status{uuid.uuid4().hex[:6]}"
    version = f"{name}@{uuid.uuid4().hex[:16]}"
    spec = {"name": name, "shards": {"lease_seconds": 10 * seconds_per_shard + 600}}
    writer = store.begin_plan(version, name, spec)
    shards = -(-records // SHARD)
    writer.add_shards([PlannedShard(s, {}, min(SHARD, records - s * SHARD)) for s in range(shards)])
    for s in range(shards):
        writer.add_records([PlannedRecord(f"t-{n:09d}", s, "h")
                            for n in range(s * SHARD, min((s + 1) * SHARD, records))])
    writer.commit(records, shards)
    writing = 0.0
    for s in range(shards):
        lease = store.claim("bench", version)
        assert lease is not None
        ids = [f"t-{n:09d}" for n in range(s * SHARD, min((s + 1) * SHARD, records))]
        last = s == shards - 1
        if last:
            ids = ids[:len(ids) // 2]  # under way: written, not completed
        start = time.perf_counter()
        for i in range(0, len(ids), FLUSH):
            store.put_results(lease, [ResultRow(rid, OUTPUT, Acl(["g"]), 1, 300, 20) for rid in ids[i:i + FLUSH]])
        writing += time.perf_counter() - start
        if not last:
            store.complete(lease)
            store.shift_clock(seconds_per_shard)
    return version, writing


def timed(store: Store, version: str, window: float, repeat: int) -> tuple[float, float, int]:
    """Median and slowest seconds of `status`, and the outcomes it counted in the window."""
    times = []
    recent = 0
    for _ in range(repeat):
        start = time.perf_counter()
        st = store.status(version, window_seconds=window)
        times.append(time.perf_counter() - start)
        recent = st.records_done_last_minutes
    return statistics.median(times), max(times), recent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--store", default=None, help="default: a new SQLite file")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--seconds-per-shard", type=float, default=600.0,
                        help="the store clock's step after each shard (simulated writing time)")
    args = parser.parse_args()
    url = args.store or f"sqlite:///{Path(tempfile.mkdtemp(prefix='bench-status-')) / 's.db'}"
    store = open_store(url)
    version, writing = make_version(store, args.records, args.seconds_per_shard)
    st = store.status(version)
    print(f"{url.split('://')[0]}: {st.results:,} results written in {writing:.1f}s "
          f"({st.results / writing:,.0f} rows/s), {st.shards['done']} shards done, 1 under way")
    for label, window in (("status (5-minute window)", 300.0), ("status (window: every result)", 1e9)):
        median, worst, recent = timed(store, version, window, args.repeat)
        print(f"{label:<32} median {median * 1000:8.1f} ms  slowest {worst * 1000:8.1f} ms  "
              f"counting {recent:,} outcomes")
    print("command: python " + " ".join(sys.argv))
    store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
