"""Validation at scale: coverage (counts and id fingerprints on PostgreSQL, else an anti-join), dead letters and drift (GROUP BY)
run in the store; the schema re-check streams every stored result.

    python bench/validate_scale.py [--records 5000000] [--store URL]

The version is generated through the Store API (planned records, then results
written as a worker writes them, with outputs made by the synthetic engine's
generator and a label column), sealed, and a published version of the same
name is made beside it so drift has something to compare against.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path

from batchline.check.validate import check_coverage, check_dead_letters, check_drift, check_schema
from batchline.engines.synthetic import synthetic_instance
from batchline.spec import parse_spec
from batchline.store import PlannedRecord, PlannedShard, ResultRow, Store, open_store

SCHEMA = json.loads((Path(__file__).resolve().parents[1] / "examples/tickets/triage.schema.json").read_text())
SHARD = 10_000


def spec_dict(name: str) -> dict[str, object]:
    return {"name": name, "input": {"path": ["/dev/null"], "format": "jsonl"},
            "model": {"engine": "synthetic"}, "prompt": {"text": "x", "version": "v1"},
            "output": {"schema": SCHEMA, "label_field": "category"}, "shards": {"lease_seconds": 600}}


def make_version(store: Store, name: str, records: int, variant: int) -> str:
    version = f"{name}@{uuid.uuid4().hex[:16]}"
    writer = store.begin_plan(version, name, spec_dict(name))
    shards = -(-records // SHARD)
    writer.add_shards([PlannedShard(s, {}, min(SHARD, records - s * SHARD)) for s in range(shards)])
    outputs = []
    for i in range(64):
        value = synthetic_instance(SCHEMA, f"ticket text {i} {variant}")
        outputs.append((json.dumps(value, separators=(",", ":")), value["category"]))
    for s in range(shards):
        ids = [f"t-{n:09d}" for n in range(s * SHARD, min((s + 1) * SHARD, records))]
        writer.add_records([PlannedRecord(rid, s, "h") for rid in ids])
    writer.commit(records, shards)
    for _ in range(shards):
        lease = store.claim("bench", version)
        assert lease is not None
        ids = [f"t-{n:09d}" for n in range(lease.shard_no * SHARD, min((lease.shard_no + 1) * SHARD, records))]
        store.put_results(lease, [ResultRow(rid, *outputs[n % 64][:1], acl=None, label=outputs[n % 64][1])
                                  for n, rid in enumerate(ids)])
        store.complete(lease)
    return version


def timed(label: str, rows: int | None, fn: object) -> float:
    start = time.perf_counter()
    check = fn()  # type: ignore[operator]
    seconds = time.perf_counter() - start
    rate = f"{rows / seconds:>12,.0f} rows/s" if rows else f"{'(counters)':>19}"
    print(f"{label:<28} {seconds:8.2f} s  {rate}   {'pass' if check.passed else 'FAIL'}: {check.figure}")
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=5_000_000)
    parser.add_argument("--store", default=None)
    args = parser.parse_args()
    url = args.store or f"sqlite:///{Path(tempfile.mkdtemp(prefix='bench-validate-')) / 'v.db'}"
    store = open_store(url)
    name = f"scale{uuid.uuid4().hex[:6]}"
    start = time.perf_counter()
    published = make_version(store, name, args.records // 10, variant=0)
    store.publish(name, published, "bench", None, None, expected=None)
    version = make_version(store, name, args.records, variant=1)
    print(f"generated {args.records:,} results (+{args.records // 10:,} published) on {url.split('://')[0]} "
          f"in {time.perf_counter() - start:.0f}s")
    spec = parse_spec(spec_dict(name), base_dir=Path("/"))
    n = args.records
    timed("coverage", n, lambda: check_coverage(store, version))
    timed("dead letters", None, lambda: check_dead_letters(store, version, spec))
    timed("drift (GROUP BY label)", n, lambda: check_drift(store, version, spec))
    timed("schema (streams every row)", n, lambda: check_schema(store, version, spec))
    print("command: python " + " ".join(sys.argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
