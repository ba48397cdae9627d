"""Reading batchline's Iceberg tables the way a downstream reader does: DuckDB's own
Iceberg reader (`iceberg_scan`) over the table's current metadata file, found with
plain SQL in the SQL catalog's table. Reading through pyiceberg, which wrote the table,
would prove nothing about the table itself.

The demos use it, and so do the tests (tests/iceberg_support.py); it needs the dev
extra (duckdb 1.5.5 with its extension wheels, which load offline).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from batchline.lake import LakeSettings

# batchline.sources.iceberg.STORE_CATALOG_NAME, spelled out: a reader knows the catalog by name.
CATALOG_NAME = "batchline"


def connect(lake: LakeSettings | None = None, env: Mapping[str, str] | None = None) -> Any:
    """A DuckDB connection with the Iceberg extension loaded from its wheel, offline: DuckDB
    is told never to download an extension, so a missing one fails here, not silently.

    With `lake` (for a table in S3), httpfs too and an S3 secret made of the lake's
    settings (`LakeSettings.duckdb_settings`: endpoint, URL style, TLS, region) and the
    credentials in `env` (the process's environment by default), as every other client
    of the lake gets them."""
    import duckdb
    import duckdb_extension_avro
    import duckdb_extension_httpfs
    import duckdb_extension_iceberg

    con = duckdb.connect(config={"autoinstall_known_extensions": False, "autoload_known_extensions": False})
    modules = [(duckdb_extension_avro, "avro"), (duckdb_extension_iceberg, "iceberg")]
    if lake is not None:
        modules.insert(1, (duckdb_extension_httpfs, "httpfs"))
    for module, name in modules:
        [path] = Path(str(module.__file__)).parent.glob(f"extensions/*/{name}.duckdb_extension")
        con.execute(f"LOAD '{path}'")
    if lake is not None:
        con.execute(s3_secret(lake, os.environ if env is None else env))
    return con


def s3_secret(lake: LakeSettings, env: Mapping[str, str]) -> str:
    """`CREATE SECRET` for DuckDB's S3 reads: the lake's settings (`s3_endpoint` becomes
    ENDPOINT, and so on) with the keys from the environment."""
    params = {key.removeprefix("s3_").upper(): value for key, value in lake.duckdb_settings().items()}
    for name, var in (("KEY_ID", "AWS_ACCESS_KEY_ID"), ("SECRET", "AWS_SECRET_ACCESS_KEY"),
                      ("SESSION_TOKEN", "AWS_SESSION_TOKEN")):
        if env.get(var):
            params[name] = env[var]

    def quoted(value: str) -> str:
        return "'" + value.replace("'", "''") + "'"

    return "CREATE SECRET (TYPE s3, " + ", ".join(f"{k} {quoted(v)}" for k, v in params.items()) + ")"


def metadata_location(store_url: str, table: str) -> str:
    """The table's current metadata file, as the SQL catalog in the store's database
    (`catalog: store`, SQLite or PostgreSQL) names it."""
    namespace, name = table.rsplit(".", 1)
    sql = ("SELECT metadata_location FROM iceberg_tables WHERE catalog_name = ? AND table_namespace = ? "
           "AND table_name = ?")
    params = (CATALOG_NAME, namespace, name)
    if store_url.startswith("sqlite:///"):
        with contextlib.closing(sqlite3.connect(store_url.removeprefix("sqlite:///"))) as db:
            rows = db.execute(sql, params).fetchall()
    else:
        import psycopg

        with psycopg.connect(store_url) as pg:
            rows = pg.execute(sql.replace("?", "%s"), params).fetchall()
    if not rows:
        raise LookupError(f"no table {table} in the catalog of {store_url}")
    return str(rows[0][0])
