"""The report at scale: one page for a version of many results.

    python bench/report_scale.py [--records 1000000] [--store URL]

The version is generated through the Store API as bench/validate_scale.py
makes it (planned records, then results written as a worker writes them), and
`batchline report`'s page is written for it. Prints the seconds the page took
and what it read: results are counted in the store by attempt and time bin, so
the page's cost grows with the store's scan, not with Python per row.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from validate_scale import make_version

from batchline.ops.report.page import write_report
from batchline.store import open_store


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--store", default=None, help="store URL (default: a SQLite file in a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = open_store(args.store or f"sqlite:///{Path(tmp) / 'report.db'}")
        start = time.perf_counter()
        version = make_version(store, "report-scale", args.records, 0)
        built = time.perf_counter() - start
        start = time.perf_counter()
        data = write_report(store, version, Path(tmp) / "report.html")
        seconds = time.perf_counter() - start
        print(f"{args.records:,} results on {store.url.split(':')[0]} (built in {built:.1f} s)")
        print(f"  report page      {seconds:6.2f} s  ({args.records / seconds:,.0f} results/s)")
        print(f"  results counted  {data.computed:,} in {sum(1 for b in data.bins if b)} time bins")
        store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
