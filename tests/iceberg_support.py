"""Reading Iceberg tables the way a downstream reader does: DuckDB's own Iceberg reader
over the table's current metadata file, found with plain SQL in the catalog's table.
Reading through pyiceberg would prove nothing about the table itself."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import duckdb
import yaml

from tests.helpers import Database

CATALOG_NAME = "batchline"  # batchline.catalogs.STORE_CATALOG_NAME, spelled out: a reader knows it by name


def duckdb_iceberg(s3: S3StandIn | None = None) -> Any:
    """A DuckDB connection with the Iceberg extension loaded from its wheel, offline: DuckDB
    is told never to download an extension, so a missing one fails here, not silently.
    With `s3`, it also reads from the S3 stand-in."""
    import duckdb_extension_avro
    import duckdb_extension_httpfs
    import duckdb_extension_iceberg

    con = duckdb.connect(config={"autoinstall_known_extensions": False, "autoload_known_extensions": False})
    modules = [(duckdb_extension_avro, "avro"), (duckdb_extension_iceberg, "iceberg")]
    if s3 is not None:
        modules.insert(1, (duckdb_extension_httpfs, "httpfs"))
    for module, name in modules:
        [path] = Path(module.__file__).parent.glob(f"extensions/*/{name}.duckdb_extension")
        con.execute(f"LOAD '{path}'")
    if s3 is not None:
        con.execute(f"CREATE SECRET (TYPE s3, KEY_ID 'testing', SECRET 'testing', REGION 'us-east-1', "
                    f"ENDPOINT '127.0.0.1:{s3.port}', URL_STYLE 'path', USE_SSL false)")
    return con


class S3StandIn:
    """An S3 protocol server (`moto_server`, from the moto package) run as a child process on
    127.0.0.1: the real service cannot be reached from the test machines."""

    def __init__(self) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = int(sock.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(self.url, timeout=1).read()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"moto_server did not start on {self.url}") from None
                time.sleep(0.1)

    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_REGION": "us-east-1"}

    def bucket(self) -> str:
        name = f"bl-{uuid.uuid4().hex[:12]}"
        urllib.request.urlopen(urllib.request.Request(f"{self.url}/{name}", method="PUT")).read()
        return name

    def keys(self, bucket: str) -> set[str]:
        body = urllib.request.urlopen(f"{self.url}/{bucket}?list-type=2&max-keys=1000").read().decode()
        assert "<IsTruncated>false</IsTruncated>" in body
        return set(re.findall(r"<Key>([^<]+)</Key>", body))

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def metadata_location(store_url: str, table: str) -> str:
    """The table's current metadata file, as the SQL catalog in the store's database names it."""
    namespace, name = table.rsplit(".", 1)
    with Database(store_url) as db:
        [(location,)] = db.execute("SELECT metadata_location FROM iceberg_tables WHERE catalog_name = ? "
                                   "AND table_namespace = ? AND table_name = ?", (CATALOG_NAME, namespace, name))
    return str(location)


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
    from batchline.catalogs import open_catalog
    from batchline.spec import TableRef

    with open_catalog(TableRef("store", table), store_url) as catalog:
        return catalog.load_table(table)

