"""An Apache Iceberg table at one snapshot, as a job's input.

The snapshot is pinned by the table's UUID and the snapshot id (never by the
catalog's address, which may hold credentials and is not part of what was
read). Its data files are immutable Parquet files, so each is opened like any
other location (`open_source`) and a shard's slice is a range of one data
file's rows: a worker reads the data file directly and needs no catalog.

A snapshot whose rows are changed by delete files (position deletes, equality
deletes or deletion vectors) is refused: reading its data files whole would
answer deleted rows.

Catalogs (how a spec's `table`, catalog and name, becomes a pyiceberg catalog), which
the Iceberg target shares:

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
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from batchline.errors import BatchlineError, InputError, missing_extra, one_line
from batchline.lake import LakeSettings, lake_settings
from batchline.sources.base import (
    DatasetName,
    KeyedFamily,
    Pin,
    Snapshot,
    SourceContext,
    StoreDatasets,
)

if TYPE_CHECKING:
    from batchline.spec.model import InputSpec
    from batchline.spec.reader import Fields, ParseContext, SpecReader

STORE_CATALOG = "store"  # a table's catalog named so: a SQL catalog in the job's own store database
_SECRET_QUERY_KEYS = ("password", "secret", "token", "credential", "key")


@dataclass(frozen=True)
class TableRef:
    """An Apache Iceberg table: its catalog and name. The catalog's address and
    credentials come from pyiceberg's own configuration (`PYICEBERG_CATALOG__NAME__URI`,
    `.pyiceberg.yaml`) or, for `catalog: store`, from the store URL the command was
    given; `uri` is only taken when it holds no credential, since the spec is stored."""

    catalog: str
    name: str  # namespace.table
    snapshot_id: int | None = None  # an input: the snapshot read (pinned at planning when left out)
    uri: str | None = None
    warehouse: str | None = None  # where a table made by batchline keeps its files

    def describe(self) -> str:
        at = f" at snapshot {self.snapshot_id}" if self.snapshot_id is not None else ""
        return f"Iceberg table {self.name} in catalog {self.catalog!r}{at}"

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}

    def dataset(self, store: StoreDatasets, version: str | None = None) -> DatasetName:
        """The table as lineage names it: by its catalog (the store's own database for
        `catalog: store`, else the catalog's address where the spec gives one, else its
        name), so an input and an output of one table meet in a lineage graph."""
        if self.catalog == STORE_CATALOG:
            return DatasetName(store.namespace, f"{store.prefix}{self.name}", version)
        return DatasetName(f"iceberg://{self.catalog}" if self.uri is None else self.uri, self.name, version)


_TABLE = {"type": "string", "minLength": 1}
# A table's section, as an input (with snapshot_id) and as an output.
TABLE_FIELDS: Fields = {
    "catalog": {**_TABLE, "description": "store (the store's own database) or a pyiceberg catalog name"},
    "name": {**_TABLE, "pattern": "^[^.].*[.].*[^.]$", "description": "namespace.table"},
    "uri": {**_TABLE, "description": "the catalog's address, without credentials"},
    "warehouse": {**_TABLE, "description": "where a table made by batchline keeps its files"},
}
SNAPSHOT_FIELDS: Fields = {**TABLE_FIELDS, "snapshot_id": {
    "type": "integer", "minimum": 0, "description": "the snapshot read (the current one at planning when left out)"}}


def table_schema(fields: Fields, description: str) -> dict[str, Any]:
    """The JSON Schema of a table section with these fields."""
    return {"type": "object", "properties": dict(fields), "required": ["catalog", "name"],
            "additionalProperties": False, "description": description,
            "examples": [{"catalog": "store", "name": "lake.tickets"}]}


def parse_table(r: SpecReader, raw: Any, where: str, base_dir: Path, *, snapshot: bool = False,
                extra: Fields | None = None) -> TableRef:
    """The table a section names; `extra`: the fields its family reads besides (an output's)."""
    tb = r.section(raw, where, {**(SNAPSHOT_FIELDS if snapshot else TABLE_FIELDS), **(extra or {})},
                   required={"catalog", "name"})
    catalog = r.string(tb["catalog"], f"{where}.catalog")
    name = r.string(tb["name"], f"{where}.name")
    if "." not in name.strip(".") or name != name.strip("."):
        r.fail(f"{where}.name", f"{name!r} must be namespace.table")
    uri = r.optional_string(tb.get("uri"), f"{where}.uri")
    if uri is not None:
        if catalog == STORE_CATALOG:
            r.fail(f"{where}.uri", f"catalog {STORE_CATALOG!r} is the store's own database; leave uri out")
        uri = _catalog_uri(r, uri, f"{where}.uri", base_dir)
    warehouse = r.optional_string(tb.get("warehouse"), f"{where}.warehouse")
    if warehouse is not None and "://" not in warehouse:
        warehouse = "file://" + str((base_dir / warehouse).resolve())
    snapshot_id = r.optional_int(tb.get("snapshot_id"), f"{where}.snapshot_id", 0) if snapshot else None
    return TableRef(catalog=catalog, name=name, snapshot_id=snapshot_id, uri=uri, warehouse=warehouse)


def _catalog_uri(r: SpecReader, uri: str, where: str, base_dir: Path) -> str:
    """A catalog address that may be stored: no password, token or key in it."""
    from urllib.parse import parse_qsl, urlsplit

    parts = urlsplit(uri)
    secret = parts.password is not None or any(
        any(word in key.lower() for word in _SECRET_QUERY_KEYS) for key, _v in parse_qsl(parts.query))
    if secret:
        r.fail(where, "holds a credential, and the spec is stored: put the catalog's address in "
                      "PYICEBERG_CATALOG__<CATALOG>__URI (or .pyiceberg.yaml) and leave uri out")
    if parts.scheme.startswith("sqlite") and uri.startswith(f"{parts.scheme}:///") \
            and not uri.startswith(f"{parts.scheme}:////"):
        # sqlite:///relative.db: relative to the spec, like every other path in it.
        return f"{parts.scheme}:///" + str((base_dir / uri[len(parts.scheme) + 4:]).resolve())
    return uri


def table_refusal(table: Any, where: str) -> str | None:
    """Why pods elsewhere could not reach a raw spec's table section, or None."""
    if not isinstance(table, dict):
        return None
    if table.get("catalog", STORE_CATALOG) != STORE_CATALOG and str(table.get("uri", "")).startswith("sqlite:"):
        return (f"{where}.uri: a SQLite catalog on this machine cannot be reached from the pods; use "
                "catalog: store, or a catalog on PostgreSQL or REST")
    if table.get("warehouse") and "://" not in str(table["warehouse"]):
        return f"{where}.warehouse: {table['warehouse']} is a folder on this machine; give an s3:// or gs:// warehouse"
    return None


def pyiceberg_properties(settings: LakeSettings) -> dict[str, str]:
    """The lake settings as pyiceberg FileIO properties (credentials stay in the environment)."""
    props: dict[str, str] = {}
    if settings.s3_endpoint:
        props["s3.endpoint"] = settings.s3_endpoint
        props["s3.force-virtual-addressing"] = "false"
    if settings.region:
        props["s3.region"] = settings.region
    if settings.gcs_endpoint:
        props["gcs.service.host"] = settings.gcs_endpoint
    return props


# The name batchline's own SQL catalog has in the catalog tables of the store's database.
STORE_CATALOG_NAME = "batchline"


def _pyiceberg() -> Any:
    try:
        import pyiceberg.catalog
    except ImportError:
        raise BatchlineError(missing_extra("Iceberg tables", "pyiceberg", "iceberg")) from None
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
    return name, {**pyiceberg_properties(lake_settings(storage)), **props}


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


# --- the input: a table's snapshot --------------------------------------------------------


@dataclass(frozen=True)
class DataFile:
    path: str  # as the table's manifests name it: file:///..., s3://...
    records: int
    size: int


@dataclass(frozen=True)
class TableSnapshot:
    ref: TableRef  # with the snapshot id that was read
    table_uuid: str
    snapshot_id: int
    data_files: tuple[DataFile, ...]

    @property
    def pin(self) -> Pin:
        return Pin(f"iceberg:{self.table_uuid}", sum(f.records for f in self.data_files),
                   version=str(self.snapshot_id))


def read_snapshot(ref: TableRef, spec: InputSpec, store_url: str | None = None) -> TableSnapshot:
    """The table's snapshot (the one `ref` names, else the current one) and its data files,
    whose columns must hold the input's fields (`spec`)."""
    with open_catalog(ref, store_url, spec.storage) as catalog:
        table = load_table(catalog, ref)
        if table is None:
            raise InputError(f"{ref.describe()}: no such table")
        meta = table.metadata
        snapshot = meta.current_snapshot() if ref.snapshot_id is None else meta.snapshot_by_id(ref.snapshot_id)
        if snapshot is None:
            what = "has no snapshot (it is empty)" if ref.snapshot_id is None else \
                "has no such snapshot (expired, or never there)"
            raise InputError(f"{ref.describe()} {what}")
        pinned = TableRef(ref.catalog, ref.name, snapshot.snapshot_id, ref.uri, ref.warehouse)
        _check_columns(meta, spec, pinned)
        try:
            files = _data_files(table, snapshot, pinned)
        except InputError:
            raise
        except Exception as exc:  # a manifest that cannot be read: pyiceberg and the file system raise several types
            raise InputError(f"{pinned.describe()}: cannot read its manifests: {one_line(exc)}") from None
    return TableSnapshot(pinned, str(meta.table_uuid), snapshot.snapshot_id, files)


def _data_files(table: Any, snapshot: Any, ref: TableRef) -> tuple[DataFile, ...]:
    from pyiceberg.manifest import DataFileContent, FileFormat, ManifestContent

    out: list[DataFile] = []
    deletes = {"position deletes": 0, "equality deletes": 0}
    for manifest in snapshot.manifests(table.io):
        for entry in manifest.fetch_manifest_entry(table.io, discard_deleted=True):
            f = entry.data_file
            if manifest.content == ManifestContent.DELETES or f.content != DataFileContent.DATA:
                kind = "equality deletes" if f.content == DataFileContent.EQUALITY_DELETES else "position deletes"
                deletes[kind] += 1
                continue
            if f.file_format != FileFormat.PARQUET:
                raise InputError(f"{ref.describe()}: data file {f.file_path} is {f.file_format.name}; batchline "
                                 "reads Parquet data files only")
            out.append(DataFile(f.file_path, int(f.record_count), int(f.file_size_in_bytes)))
    if any(deletes.values()):
        found = ", ".join(f"{n} files of {kind}" for kind, n in deletes.items() if n)
        raise InputError(f"{ref.describe()} has delete files ({found}); batchline reads whole data files and "
                         "would answer deleted rows: compact the table (rewrite its data files) and plan the new "
                         "snapshot")
    return tuple(out)


def _check_columns(meta: Any, spec: InputSpec, ref: TableRef) -> None:
    """Data files are read by column name: a column renamed, or dropped and added again,
    would make an older data file answer with another column's values."""
    required = [spec.id_field, *spec.text_columns]
    wanted = [f for f in (*required, spec.acl_field, spec.class_field) if f]
    current = {f.name: f.field_id for f in meta.schema().fields}
    for name in required:
        if name not in current:
            raise InputError(f"{ref.describe()}: the table has no column {name!r} "
                             f"(columns: {', '.join(current)})")
    for schema in meta.schemas:
        for field in schema.fields:
            for name in wanted:
                if name not in current:
                    continue
                if (field.name == name) != (field.field_id == current[name]):
                    raise InputError(
                        f"{ref.describe()}: column {name!r} was {'renamed' if field.field_id == current[name] else 'replaced'} "
                        f"in schema {schema.schema_id} (there: {field.name!r}, field id {field.field_id}); "
                        "batchline reads data files by column name: rewrite the table's data files first")



@dataclass(frozen=True)
class TableSource:
    """`input.table`: a table's snapshot, read from its Parquet data files."""

    ref: TableRef
    locations: tuple[str, ...] = ()  # its data files, known once the snapshot is read
    format: str | None = "parquet"

    def describe(self) -> str:
        return self.ref.describe()

    def to_dict(self) -> dict[str, Any]:
        return {"table": self.ref.to_dict()}

    def datasets(self, pins: Sequence[Mapping[str, Any]], store: StoreDatasets) -> list[DatasetName]:
        at = str(self.ref.snapshot_id) if self.ref.snapshot_id is not None else None
        return [self.ref.dataset(store, at)]

    def snapshot(self, ctx: SourceContext) -> Snapshot:
        from batchline.sources import open_source

        read = read_snapshot(self.ref, ctx.input, ctx.store_url)
        # The snapshot is pinned whole: the planner writes its id into the stored spec.
        pinned = TableSource(read.ref)

        def still() -> bool:
            return read_snapshot(read.ref, ctx.input, ctx.store_url).pin == read.pin

        return Snapshot(pinned, [open_source(f.path, ctx.input.storage) for f in read.data_files], [read.pin], still)


class IcebergInput(KeyedFamily):
    """An Apache Iceberg table's snapshot as the input (`input.table`)."""

    name = "iceberg"
    keys: ClassVar[Fields] = {"table": table_schema(SNAPSHOT_FIELDS, "An Apache Iceberg table's snapshot")}

    def parse(self, key: str, section: Mapping[str, Any], r: SpecReader, ctx: ParseContext) -> TableSource:
        return TableSource(parse_table(r, section[key], "input.table", ctx.base_dir, snapshot=True))

    def access(self, section: Mapping[str, Any]) -> list[str]:
        table = section.get("table")
        if not table:
            return []
        return [f"input table {table['name']} (catalog {table['catalog']!r}, snapshot {table.get('snapshot_id')}): the "
                "worker needs no catalog right, only read access to the snapshot's data files, which its shards name "
                "(the table's data/ folder or prefix: s3:GetObject and s3:GetObjectVersion on it for a warehouse in "
                "S3); the planner loads the table from the catalog and reads its manifests"]

    def pod_refusal(self, section: Mapping[str, Any], where: str) -> str | None:
        return table_refusal(section.get("table"), "input.table")


ICEBERG = IcebergInput()
