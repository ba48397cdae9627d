"""Iceberg publish time against the Parquet export of the same version.

    python bench/iceberg_publish.py [--records 1000000] [--store URL]

One sealed version of the ticket schema's outputs is made through the Store API
(as `validate_scale.py` makes it). Then, from that store, the Parquet export of
the version (`export --format parquet`) and the Iceberg publication into a new
table in the store's own SQL catalog, with a warehouse on local disk: the write
of the version's branch (results and dead letters read from the store, outputs
parsed into typed columns, Parquet data files, manifests, one commit) and the
commit that makes it main's snapshot. Goal: the Iceberg publication within
1.5x of the Parquet export. `publish_section` is what a larger lake benchmark
can call.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from validate_scale import make_version

from batchline.sources.iceberg import TableRef
from batchline.spec import JobVersion
from batchline.store import Store, open_store
from batchline.targets.files import export_parquet
from batchline.targets.iceberg import IcebergTable

GOAL = 1.5


def publish_section(store: Store, version: str, name: str, folder: Path) -> dict[str, Any]:
    """Seconds of the Parquet export and of the Iceberg publication of `version`, and the table's rows.
    pyiceberg is imported before the clock starts, as pyarrow is: a one-off of a second or two."""
    import pyiceberg.catalog.sql  # noqa: F401

    start = time.perf_counter()
    exported = export_parquet(store, version, folder / "export.parquet")
    parquet = time.perf_counter() - start

    target = IcebergTable(TableRef("store", f"bench.{name}", warehouse=f"file://{folder / 'warehouse'}"), store.url)
    start = time.perf_counter()
    target.stage(store, JobVersion.of(store, version))
    staged = time.perf_counter() - start
    start = time.perf_counter()
    state = target.show(name, version, None)
    shown = time.perf_counter() - start
    return {"rows": exported, "parquet_s": parquet, "stage_s": staged, "show_s": shown,
            "iceberg_s": staged + shown, "ratio": (staged + shown) / parquet, "snapshot_id": state["snapshot_id"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--store", default=None)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bench-iceberg-"))
    store = open_store(args.store or f"sqlite:///{folder / 'store.db'}")
    name = f"ice{uuid.uuid4().hex[:6]}"
    try:
        start = time.perf_counter()
        version = make_version(store, name, args.records, variant=1)
        print(f"made {args.records:,} results of {version} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
        r = publish_section(store, version, name, folder)
    finally:
        store.close()
        shutil.rmtree(folder, ignore_errors=True)
    print(f"{'Parquet export':<40} {r['parquet_s']:8.2f} s  {r['rows'] / r['parquet_s']:>12,.0f} rows/s")
    print(f"{'Iceberg: write the version branch':<40} {r['stage_s']:8.2f} s  {r['rows'] / r['stage_s']:>12,.0f} rows/s")
    print(f"{'Iceberg: commit main to it':<40} {r['show_s']:8.2f} s")
    verdict = "met" if r["ratio"] <= GOAL else "NOT met"
    print(f"{'Iceberg publish / Parquet export':<40} {r['ratio']:8.2f} x  (goal <= {GOAL}x: {verdict})")
    print(f"command: python bench/iceberg_publish.py --records {args.records}"
          + (f" --store {args.store}" if args.store else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
