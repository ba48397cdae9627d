"""Inputs in object storage: requests and bytes per shard read, planning requests per object,
and the planner's peak memory at two sizes, against the S3 stand-in (moto_server).

    python bench/lake_throughput.py [--records 200000] [--objects 2500]
                                    [--memory-small 100000] [--memory-large 5000000] [--no-memory]

- Shard reads: one object each of JSONL, CSV and Parquet (row groups of 10,000 rows,
  shards of 20,000 records) is planned through a counting proxy, then every shard's slice
  is read as a worker reads it. Goal: one ranged GET per JSONL or CSV slice; for Parquet
  the footer and one GET per row group; no byte read twice within a read.
- Planning requests: a glob over many small objects. Goal: one listing page per 1,000
  keys plus one HEAD (and the one GET that scans it) per object.
- Planning memory: each plan runs in a process of its own (SQLite store), for local files
  and objects of each format; its peak RSS and Arrow's peak allocation are printed. Goal:
  the peak at the large size within 50 MB of the peak at the small size.
- Read throughput (MB/s of slices read) is printed but is not a goal: the stand-in is not S3.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GROUP_ROWS = 10_000
FORMATS = ("jsonl", "csv", "parquet")


def record(i: int) -> dict[str, Any]:
    return {"id": f"t-{i:09d}", "text": f"ticket {i}: printer on floor {i % 9} jams when printing from laptop "
                                        f"{i % 13}, queue {i % 101}", "acl": f"team-{i % 5}"}


def write_input(path: Path, fmt: str, n: int, group_rows: int = GROUP_ROWS) -> Path:
    """`n` records in `fmt`, written a batch at a time (never all in memory)."""
    batch = 100_000
    if fmt == "jsonl":
        with path.open("w") as f:
            for start in range(0, n, batch):
                f.write("".join(json.dumps(record(i)) + "\n" for i in range(start, min(n, start + batch))))
    elif fmt == "csv":
        with path.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["id", "text", "acl"])
            for start in range(0, n, batch):
                w.writerows([r["id"], r["text"], r["acl"]] for r in map(record, range(start, min(n, start + batch))))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = pa.schema([("id", pa.string()), ("text", pa.string()), ("acl", pa.string())])
        with pq.ParquetWriter(path, schema) as writer:
            for start in range(0, n, group_rows):
                rows = [record(i) for i in range(start, min(n, start + group_rows))]
                writer.write_table(pa.Table.from_pylist(rows, schema=schema), row_group_size=group_rows)
    return path


def spec_for(location: str, shard_size: int) -> Any:
    from batchline.spec import parse_spec

    return parse_spec({"name": "lake-bench", "input": {"path": location, "acl_field": "acl"},
                       "model": {"engine": "synthetic"}, "prompt": {"text": "x", "version": "v1"},
                       "output": {"schema": {"type": "object"}}, "shards": {"size": shard_size}},
                      base_dir=Path("/"))


def spans(gets: list[Any]) -> list[tuple[int, int]]:
    out = []
    for g in gets:
        if g.range:
            a, _, b = g.range.removeprefix("bytes=").partition("-")
            out.append((int(a), int(b) if b else -1))
    return sorted(out)


def shard_reads(s3: Any, records: int, scratch: Path) -> list[str]:
    from batchline.plan.planner import plan
    from batchline.snapshot import Slice, read_slice
    from batchline.store import open_store
    from tests.integration.lake.support import FaultProxy, environment

    bucket = s3.bucket()
    proxy = FaultProxy(s3.url)
    rows = []
    try:
        with environment(s3.env(proxy.url)):
            for fmt in FORMATS:
                local = write_input(scratch / f"reads.{fmt}", fmt, records)
                url = bucket.put_file(f"reads/in.{fmt}", local)
                size = local.stat().st_size
                local.unlink()
                spec = spec_for(url, 2 * GROUP_ROWS)
                store = open_store(f"sqlite:///{scratch / f'reads-{fmt}.db'}")
                proxy.clear()
                version = plan(spec, store).version
                planning = proxy.requests()
                leases = []
                while (lease := store.claim("bench", version)) is not None:
                    leases.append(lease)
                gets = bytes_read = overlaps = 0
                slice_bytes = 0
                started = time.perf_counter()
                for lease in leases:
                    sl = Slice.from_json(lease.slice)
                    proxy.clear()
                    read_slice(sl, spec.input)
                    seen = proxy.requests("GET")
                    gets += len(seen)
                    bytes_read += sum(g.body_bytes for g in seen)
                    slice_bytes += sl.end - sl.start if fmt != "parquet" else 0
                    s = spans(seen)
                    overlaps += sum(1 for x, y in pairwise(s) if y[0] <= x[1])
                seconds = time.perf_counter() - started
                store.close()
                rows.append(f"| {fmt} | {size / 1e6:.1f} MB | {len(leases)} | "
                            f"{', '.join(f'{m} {sum(1 for r in planning if r.method == m)}' for m in ('HEAD', 'GET'))} "
                            f"| {gets / len(leases):.2f} | {bytes_read / len(leases) / 1e3:,.0f} kB "
                            f"| {(bytes_read / slice_bytes if slice_bytes else bytes_read / size):.3f} | {overlaps} "
                            f"| {bytes_read / seconds / 1e6:.1f} MB/s, {records / seconds:,.0f} records/s |")
    finally:
        proxy.close()
    return ["| format | object | shards | planning requests | GETs per shard read | bytes per shard read "
            "| bytes read / slice bytes (Parquet: / object) | overlapping ranges | read throughput (not a goal) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |", *rows]


def planning_requests(s3: Any, objects: int, scratch: Path) -> list[str]:
    from concurrent.futures import ThreadPoolExecutor

    from batchline.plan.planner import plan
    from batchline.store import open_store
    from tests.integration.lake.support import FaultProxy, environment

    bucket = s3.bucket()
    def body(n: int) -> bytes:
        return "".join(json.dumps(record(i)) + "\n" for i in range(10 * n, 10 * n + 10)).encode()

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda n: bucket.put(f"many/part-{n:06d}.jsonl", body(n)), range(objects)))
    proxy = FaultProxy(s3.url)
    try:
        with environment(s3.env(proxy.url)):
            spec = spec_for(bucket.url("many/part-*.jsonl"), 5000)
            listing = proxy.requests()
            proxy.clear()
            plan(spec, open_store(f"sqlite:///{scratch / 'many.db'}"))
            planned = proxy.requests()
    finally:
        proxy.close()
    heads = sum(1 for r in planned if r.method == "HEAD")
    gets = sum(1 for r in planned if r.method == "GET")
    return ["| objects | listing pages (glob) | HEADs | GETs | requests per object |",
            "| --- | --- | --- | --- | --- |",
            f"| {objects:,} | {len(listing)} | {heads:,} | {gets:,} | {(len(listing) + heads + gets) / objects:.3f} |"]


def _vm_hwm_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


def plan_once(location: str, db: str) -> None:
    """Runs in a process of its own: plans, then prints the peaks as JSON. The peak RSS is the
    process's VmHWM (ru_maxrss would carry over the forking parent's peak)."""
    import pyarrow as pa

    from batchline.plan.planner import plan
    from batchline.store import open_store

    started = time.perf_counter()
    result = plan(spec_for(location, 5000), open_store(db))
    print(json.dumps({"records": result.records, "seconds": time.perf_counter() - started,
                      "peak_rss_mb": _vm_hwm_kb() / 1024,
                      "arrow_peak_mb": pa.default_memory_pool().max_memory() / 1e6}))


def planning_memory(s3: Any, sizes: tuple[int, int], scratch: Path) -> None:
    """Prints a row as each format and source is done (the large runs take minutes)."""
    bucket = s3.bucket()
    print(f"| format | source | peak RSS at {sizes[0]:,} (Arrow peak) | peak RSS at {sizes[1]:,} (Arrow peak) "
          "| difference (goal: within 50 MB) | planning records/s at the large size |\n"
          "| --- | --- | --- | --- | --- | --- |", flush=True)
    for fmt in FORMATS:
        for where in ("local", "object"):
            peaks = []
            for n in sizes:
                local = write_input(scratch / f"mem-{n}.{fmt}", fmt, n)
                location = str(local)
                if where == "object":
                    location = bucket.put_file(f"mem/{n}.{fmt}", local)
                db = scratch / f"mem-{fmt}-{where}-{n}.db"
                out = subprocess.run([sys.executable, __file__, "--plan-once", location, f"sqlite:///{db}"],
                                     check=True, capture_output=True, text=True, env={**os.environ, **s3.env()})
                peaks.append(json.loads(out.stdout.strip().splitlines()[-1]))
                local.unlink()
                db.unlink()
                if where == "object":
                    s3.client.delete_object(Bucket=bucket.name, Key=f"mem/{n}.{fmt}")
            small, large = peaks
            print(f"| {fmt} | {where} | {small['peak_rss_mb']:.0f} MB ({small['arrow_peak_mb']:.0f} MB) "
                  f"| {large['peak_rss_mb']:.0f} MB ({large['arrow_peak_mb']:.0f} MB) "
                  f"| {large['peak_rss_mb'] - small['peak_rss_mb']:+.0f} MB "
                  f"| {large['records'] / large['seconds']:,.0f} |", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=200_000, help="records per object for the shard reads")
    parser.add_argument("--objects", type=int, default=2500, help="objects for the planning requests")
    parser.add_argument("--memory-small", type=int, default=100_000)
    parser.add_argument("--memory-large", type=int, default=5_000_000)
    parser.add_argument("--no-memory", action="store_true", help="skip the planning memory runs")
    parser.add_argument("--plan-once", nargs=2, metavar=("LOCATION", "STORE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plan_once:
        plan_once(*args.plan_once)
        return 0
    from tests.integration.lake.support import S3StandIn

    print(f"command: python bench/lake_throughput.py {' '.join(sys.argv[1:])}".rstrip(), flush=True)
    s3 = S3StandIn()
    try:
        with tempfile.TemporaryDirectory(prefix="lake-bench-") as folder:
            scratch = Path(folder)
            print(f"\nshard reads ({args.records:,} records an object):", flush=True)
            print("\n".join(shard_reads(s3, args.records, scratch)), flush=True)
            print(f"\nplanning requests ({args.objects:,} objects of 10 records, one glob):", flush=True)
            print("\n".join(planning_requests(s3, args.objects, scratch)), flush=True)
            if not args.no_memory:
                print("\nplanning memory:", flush=True)
                planning_memory(s3, (args.memory_small, args.memory_large), scratch)
    finally:
        s3.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
