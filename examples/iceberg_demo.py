"""The ticket example published into an Iceberg table on local disk, read back by DuckDB.

    python examples/iceberg_demo.py [--out demo/iceberg]      (make demo-iceberg)

Runs examples/tickets/synthetic.yaml with `output.table` added (a SQL catalog in
the job's own SQLite store, a warehouse folder beside it) through `batchline run
--publish`, then reads the table the way a downstream reader would: its current
metadata file found with plain SQL in the catalog's table, scanned by DuckDB's own
Iceberg reader. Run it twice and the second run finds the version done and
published already.
"""

from __future__ import annotations

import argparse
import sqlite3
import subprocess
import sys
from pathlib import Path

import yaml

EXAMPLE = Path(__file__).resolve().parent / "tickets" / "synthetic.yaml"
TABLE = "tickets.triage"


def write_spec(out: Path) -> Path:
    spec = yaml.safe_load(EXAMPLE.read_text())
    for section, key in (("input", "path"), ("prompt", "file"), ("output", "schema")):
        spec[section][key] = str(EXAMPLE.parent / spec[section][key])
    spec["output"]["table"] = {"catalog": "store", "name": TABLE, "warehouse": str(out / "warehouse")}
    path = out / "job.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def metadata_location(store: Path) -> str:
    namespace, name = TABLE.rsplit(".", 1)
    with sqlite3.connect(store) as db:
        row = db.execute("SELECT metadata_location FROM iceberg_tables WHERE table_namespace = ? AND table_name = ?",
                         (namespace, name)).fetchone()
    if row is None:
        raise SystemExit(f"no table {TABLE} in the catalog of {store}")
    return str(row[0])


def read_back(store: Path) -> None:
    import duckdb
    import duckdb_extension_avro
    import duckdb_extension_iceberg

    con = duckdb.connect(config={"autoinstall_known_extensions": False, "autoload_known_extensions": False})
    for module, name in ((duckdb_extension_avro, "avro"), (duckdb_extension_iceberg, "iceberg")):
        [ext] = Path(str(module.__file__)).parent.glob(f"extensions/*/{name}.duckdb_extension")
        con.execute(f"LOAD '{ext}'")
    scan = f"iceberg_scan('{metadata_location(store)}')"
    print(f"DuckDB reads {TABLE} (main) through {scan}:")
    for version, outcome, n in con.execute(f"SELECT version, outcome, count(*) FROM {scan} GROUP BY ALL ORDER BY ALL")\
            .fetchall():
        print(f"  {version}  {outcome:<11} {n:>6,} rows")
    print("  categories: " + ", ".join(f"{c} {n}" for c, n in con.execute(
        f"SELECT output.category, count(*) FROM {scan} WHERE outcome = 'result' GROUP BY 1 ORDER BY 2 DESC")
        .fetchall()))
    for row in con.execute(f"SELECT id, output.category, output.summary, acl FROM {scan} ORDER BY id LIMIT 3").fetchall():
        print(f"  {row[0]}  {row[1]:<14} {row[2][:48]!r:<52} acl={row[3]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("demo/iceberg"))
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    store = out / "batchline.db"
    spec = write_spec(out)
    run = subprocess.run([sys.executable, "-m", "batchline", "run", str(spec), "--store", f"sqlite:///{store}",
                          "--workers", "2", "--publish"])
    if run.returncode != 0:
        return run.returncode
    read_back(store)
    return 0


if __name__ == "__main__":
    sys.exit(main())
