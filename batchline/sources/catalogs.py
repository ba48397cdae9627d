"""Iceberg catalogs: how a spec's `table` (catalog and name) becomes a pyiceberg catalog.

- `catalog: store`: a SQL catalog in the job's own store database (SQLite or
  PostgreSQL), reached with the store URL the command was given, so its
  password is never in the spec; `warehouse` says where new tables' files go.
- `catalog: NAME`: pyiceberg's own configuration of that name (environment
  variables `PYICEBERG_CATALOG__NAME__URI`, `__WAREHOUSE`, `__TYPE`, ... or
  `.pyiceberg.yaml`), where credentials belong; a spec's `uri` and `warehouse`
  (checked to hold no credential) are used when given.

pyiceberg is imported only here and in the Iceberg source and target, so a job
without a table never needs it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from batchline.errors import BatchlineError
from batchline.lake import lake_settings
from batchline.spec import STORE_CATALOG, TableRef

# The name batchline's own SQL catalog has in the catalog tables of the store's database.
STORE_CATALOG_NAME = "batchline"


def _pyiceberg() -> Any:
    try:
        import pyiceberg.catalog
    except ImportError:
        raise BatchlineError("Iceberg tables need pyiceberg: pip install 'batchline[iceberg]'") from None
    return pyiceberg.catalog


def sqlalchemy_uri(url: str) -> str:
    """pyiceberg's SQL catalog speaks SQLAlchemy: PostgreSQL through psycopg 3, which the store already uses."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix):]
    return url


def catalog_properties(ref: TableRef, store_url: str | None,
                       storage: Mapping[str, Any] | None = None) -> tuple[str, dict[str, str]]:
    """The catalog's name and the properties batchline gives it (pyiceberg adds its own configuration).

    The lake settings (the job's `input.storage` over the environment, `batchline.lake`)
    go in as pyiceberg's file IO properties, since its S3 client does not read
    `AWS_ENDPOINT_URL` itself: a warehouse or data files in an S3-compatible store
    (MinIO, R2, a stand-in) are reached as obstore and DuckDB reach them. Keys come
    from the environment or the machine's role, never from here."""
    props: dict[str, str] = {}
    if ref.catalog == STORE_CATALOG:
        if store_url is None:
            raise BatchlineError(f"{ref.describe()}: catalog {STORE_CATALOG!r} is the store's database, "
                                 "and no store was given")
        props = {"type": "sql", "uri": sqlalchemy_uri(store_url)}
        name = STORE_CATALOG_NAME
    else:
        name = ref.catalog
        if ref.uri is not None:
            sql = not ref.uri.startswith(("http://", "https://"))
            props = {"type": "sql" if sql else "rest", "uri": sqlalchemy_uri(ref.uri) if sql else ref.uri}
    if ref.warehouse is not None:
        props["warehouse"] = ref.warehouse
    return name, {**lake_settings(storage).pyiceberg_properties(), **props}


@contextlib.contextmanager
def open_catalog(ref: TableRef, store_url: str | None = None,
                 storage: Mapping[str, Any] | None = None) -> Iterator[Any]:
    """The table's catalog, closed afterwards (a SQL catalog holds a connection pool);
    `storage` is the job's `input.storage`, where its object store is."""
    catalogs = _pyiceberg()
    from pyiceberg.utils.config import Config

    name, props = catalog_properties(ref, store_url, storage)
    if ref.catalog != STORE_CATALOG:
        # Read now, not as pyiceberg read it when first imported, and what the spec says wins.
        configured: dict[str, Any] = Config().get_catalog_config(name) or {}
        props = {**configured, **props}
    try:
        catalog = catalogs.load_catalog(name, **props)
    except (ValueError, TypeError, ImportError, OSError) as exc:
        hint = "" if "PYICEBERG_CATALOG" in str(exc) else \
            f" (configure it as PYICEBERG_CATALOG__{ref.catalog.upper()}__URI or in .pyiceberg.yaml)"
        raise BatchlineError(f"{ref.describe()}: cannot open the catalog: {one_line(exc)}{hint}") from None
    except Exception as exc:  # SQLAlchemy's errors, a REST catalog's
        raise BatchlineError(f"{ref.describe()}: cannot open the catalog: {one_line(exc)}") from None
    try:
        yield catalog
    finally:
        engine = getattr(catalog, "engine", None)
        if engine is not None:
            engine.dispose()


def load_table(catalog: Any, ref: TableRef) -> Any | None:
    """The table, or None when the catalog has no such table."""
    from pyiceberg.exceptions import NoSuchNamespaceError, NoSuchTableError

    try:
        return catalog.load_table(ref.name)
    except (NoSuchTableError, NoSuchNamespaceError):
        return None


def one_line(exc: object) -> str:
    return " ".join(str(exc).split())
