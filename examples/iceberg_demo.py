"""The ticket example published into an Iceberg table on local disk, read back by DuckDB.

    python -m examples.iceberg_demo [--out demo/iceberg]      (make demo-iceberg)

Runs examples/tickets/synthetic.yaml with `output.table` added (a SQL catalog in
the job's own SQLite store, a warehouse folder beside it) through `batchline run
--publish`, then reads the table the way a downstream reader would: its current
metadata file found with plain SQL in the catalog's table, scanned by DuckDB's own
Iceberg reader (examples/iceberg_reader.py). What DuckDB reads is checked against the
store: the published version's results and dead letters, each once, with the same
category. Run it twice and the second run finds the version done and published
already. examples/lake_demo.py does the same with input and table in S3.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from batchline.lake import LakeSettings
from batchline.store import open_store
from examples.iceberg_reader import connect, metadata_location

EXAMPLES = Path(__file__).resolve().parent / "tickets"
EXAMPLE = EXAMPLES / "synthetic.yaml"
TABLE = "tickets.triage"


def example_spec(example: Path) -> dict[str, Any]:
    """The example's spec with the files it names made absolute, so it runs from anywhere."""
    spec = yaml.safe_load(example.read_text())
    for section, key in (("input", "path"), ("prompt", "file"), ("output", "schema")):
        spec[section][key] = str(example.parent / spec[section][key])
    return dict(spec)


def write_spec(out: Path, spec: dict[str, Any], warehouse: str) -> Path:
    """The spec with `output.table` (the store's own SQL catalog, the warehouse given), in `out`."""
    spec["output"]["table"] = {"catalog": "store", "name": TABLE, "warehouse": warehouse}
    path = out / "job.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def run(spec: Path, store_url: str, env: Mapping[str, str] | None = None) -> int:
    """`batchline run SPEC --publish`, as a user runs it."""
    command = [sys.executable, "-m", "batchline", "run", str(spec), "--store", store_url, "--workers", "2", "--publish"]
    return subprocess.run(command, env={**os.environ, **(env or {})}).returncode


def read_back(store_url: str, name: str, lake: LakeSettings | None = None,
              env: Mapping[str, str] | None = None) -> list[str]:
    """Reads the table's main with DuckDB, prints what it holds, and returns how it differs
    from what the store holds for the version published under `name` (nothing: it matches)."""
    con = connect(lake, env)
    try:
        scan = f"iceberg_scan('{metadata_location(store_url, TABLE)}')"
        print(f"DuckDB reads {TABLE} (main) through {scan}:")
        rows = con.execute(f"SELECT id, outcome, output.category, version FROM {scan}").fetchall()
        for (version, outcome), n in sorted(Counter((r[3], r[1]) for r in rows).items()):
            print(f"  {version}  {outcome:<11} {n:>6,} rows")
        categories = Counter(r[2] for r in rows if r[1] == "result")
        print("  categories: " + ", ".join(f"{c} {n}" for c, n in categories.most_common()))
        for row in con.execute(f"SELECT id, output.category, output.summary, acl FROM {scan} ORDER BY id LIMIT 3")\
                .fetchall():
            print(f"  {row[0]}  {row[1]:<14} {row[2][:48]!r:<52} acl={row[3]}")
    finally:
        con.close()
    return differences(store_url, name, rows)


def differences(store_url: str, name: str, rows: list[tuple[str, str, str | None, str]]) -> list[str]:
    """How the table's rows (id, outcome, category, version) differ from the store's
    results and dead letters of the version published under `name`."""
    store = open_store(store_url, create=False)
    try:
        version = store.resolve_name(name)
        if version is None:
            return [f"nothing is published as {name} in {store_url}"]
        expected = {(r.record_id, "result", json.loads(r.output).get("category")) for r in store.iter_results(version)}
        expected |= {(d.record_id, "dead_letter", None) for d in store.iter_dead_letters(version)}
    finally:
        store.close()
    problems = []
    if {r[3] for r in rows} != {version}:
        problems.append(f"the table shows versions {sorted({r[3] for r in rows})}, not {version}")
    if len({r[0] for r in rows}) != len(rows):
        problems.append(f"{len(rows) - len({r[0] for r in rows})} ids appear more than once in the table")
    got = {r[:3] for r in rows}
    if got != expected:
        problems.append(f"{len(expected - got)} of the store's outcomes are missing from the table or differ, "
                        f"{len(got - expected)} rows of the table are not the store's")
    if not problems:
        print(f"checked: the table's {len(rows):,} rows are the store's results and dead letters of {version}, "
              "each once, with the same category")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("demo/iceberg"))
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    store_url = f"sqlite:///{out / 'batchline.db'}"
    spec = example_spec(EXAMPLE)
    status = run(write_spec(out, spec, str(out / "warehouse")), store_url)
    if status != 0:
        return status
    problems = read_back(store_url, str(spec["name"]))
    for problem in problems:
        print(f"demo-iceberg: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
