"""Iceberg tables in the tests: specs that publish into one, and reading them back the way
a downstream reader does, with DuckDB's own Iceberg reader over the table's current
metadata file (examples/iceberg_reader.py). Reading through pyiceberg would prove nothing
about the table itself; it is used only for what only the metadata says (refs, snapshots)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from batchline.lake import lake_settings
from examples.iceberg_reader import connect, metadata_location
from tests.integration.lake.support import S3StandIn

__all__ = ["duckdb_iceberg", "main_rows", "metadata_location", "pyiceberg_table", "set_schema", "with_table"]


def duckdb_iceberg(s3: S3StandIn | None = None) -> Any:
    """A DuckDB connection with the Iceberg extension (examples/iceberg_reader.py); with `s3`,
    it also reads from the S3 stand-in, with the settings and keys a reader's environment gives."""
    if s3 is None:
        return connect()
    return connect(lake_settings(env=s3.env()), s3.env())


def main_rows(store_url: str, table: str, columns: str = "id, outcome, version",
              s3: S3StandIn | None = None) -> list[tuple[Any, ...]]:
    con = duckdb_iceberg(s3)
    try:
        return list(con.execute(f"SELECT {columns} FROM iceberg_scan('{metadata_location(store_url, table)}') "
                                "ORDER BY id").fetchall())
    finally:
        con.close()


def with_table(path: Path, warehouse: Path | str, table: str = "lake.results", **extra: Any) -> Path:
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
    from batchline.sources.iceberg import TableRef, open_catalog

    with open_catalog(TableRef("store", table), store_url) as catalog:
        return catalog.load_table(table)

