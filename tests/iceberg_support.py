"""Reading Iceberg tables the way a downstream reader does: DuckDB's own Iceberg reader
over the table's current metadata file, found with plain SQL in the catalog's table.
Reading through pyiceberg would prove nothing about the table itself."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import duckdb
import yaml

from tests.helpers import Database

CATALOG_NAME = "batchline"  # batchline.catalogs.STORE_CATALOG_NAME, spelled out: a reader knows it by name


def duckdb_iceberg() -> Any:
    """A DuckDB connection with the Iceberg extension loaded from its wheel, offline: DuckDB
    is told never to download an extension, so a missing one fails here, not silently."""
    import duckdb_extension_avro
    import duckdb_extension_iceberg

    con = duckdb.connect(config={"autoinstall_known_extensions": False, "autoload_known_extensions": False})
    for module, name in ((duckdb_extension_avro, "avro"), (duckdb_extension_iceberg, "iceberg")):
        [path] = Path(module.__file__).parent.glob(f"extensions/*/{name}.duckdb_extension")
        con.execute(f"LOAD '{path}'")
    return con


def metadata_location(store_url: str, table: str) -> str:
    """The table's current metadata file, as the SQL catalog in the store's database names it."""
    namespace, name = table.rsplit(".", 1)
    with Database(store_url) as db:
        [(location,)] = db.execute("SELECT metadata_location FROM iceberg_tables WHERE catalog_name = ? "
                                   "AND table_namespace = ? AND table_name = ?", (CATALOG_NAME, namespace, name))
    return str(location)


def main_rows(store_url: str, table: str, columns: str = "id, outcome, version") -> list[tuple[Any, ...]]:
    con = duckdb_iceberg()
    try:
        return list(con.execute(f"SELECT {columns} FROM iceberg_scan('{metadata_location(store_url, table)}') "
                                "ORDER BY id").fetchall())
    finally:
        con.close()


def with_table(path: Path, warehouse: Path, table: str = "lake.results", **extra: Any) -> Path:
    """Adds `output.table` (the store's own catalog, a warehouse on local disk) to a job spec."""
    spec = yaml.safe_load(path.read_text())
    spec["output"]["table"] = {"catalog": "store", "name": table, "warehouse": str(warehouse), **extra}
    spec["output"]["label_field"] = "category"
    path.write_text(yaml.safe_dump(spec))
    return path


def set_schema(path: Path, schema: dict[str, Any]) -> Path:
    (path.parent / "schema.json").write_text(json.dumps(schema))
    return path


def pyiceberg_table(store_url: str, table: str) -> Any:
    """The table through pyiceberg, for what only its metadata says (refs, snapshots)."""
    from batchline.catalogs import open_catalog
    from batchline.spec import TableRef

    with open_catalog(TableRef("store", table), store_url) as catalog:
        return catalog.load_table(table)

