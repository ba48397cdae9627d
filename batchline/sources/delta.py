"""A Delta Lake table at one version, as a job's input (`input.delta`).

    input:
      delta: {uri: s3://lake/tickets, version: 42}   # version: pinned at planning when left out

The version is pinned by the table's id and its version number: a table dropped
and made again at the same place starts its versions again, so the number alone
would not say which rows were read. Its data files are immutable Parquet files,
opened like any other location, and a shard's slice is a range of one data
file's rows, so a worker reads the data file directly and needs no Delta log.
A partitioned table keeps its partition values in the log, not in the files:
they are restored from the log onto every row read.

A version whose rows are changed by deletion vectors is refused with one line:
reading its data files whole would answer deleted rows. So is a table whose
columns are mapped to other physical names (column mapping), since data files
are read by column name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar
from urllib.parse import unquote

from batchline.errors import BatchlineError, InputError, missing_extra, one_line
from batchline.lake import lake_settings
from batchline.sources.base import (
    DatasetName,
    KeyedFamily,
    Pin,
    Snapshot,
    SourceContext,
    StoreDatasets,
    WithColumns,
    location_dataset,
)

if TYPE_CHECKING:
    from batchline.spec.model import InputSpec
    from batchline.spec.reader import Fields, ParseContext, SpecReader

FIELDS: Fields = {
    "uri": {"type": "string", "minLength": 1, "description": "The table's folder, or its s3:// or gs:// URL"},
    "version": {"type": "integer", "minimum": 0, "description": "The version read (the newest when left out)"},
}


def _deltalake() -> Any:
    try:
        import deltalake
    except ImportError:
        raise BatchlineError(missing_extra("Delta tables", "deltalake", "delta")) from None
    return deltalake


@dataclass(frozen=True)
class DeltaVersion:
    uri: str
    table_id: str
    version: int
    files: tuple[tuple[str, int, dict[str, Any]], ...]  # location, rows, partition values

    @property
    def pin(self) -> Pin:
        return Pin(f"delta:{self.table_id}", sum(rows for _loc, rows, _p in self.files), version=str(self.version))


@dataclass(frozen=True)
class DeltaSource:
    """`input.delta`: a table's version, read from its Parquet data files."""

    uri: str
    version: int | None = None
    locations: tuple[str, ...] = ()  # its data files, known once the version is read
    format: str | None = "parquet"

    def describe(self) -> str:
        at = f" at version {self.version}" if self.version is not None else ""
        return f"Delta table {self.uri}{at}"

    def to_dict(self) -> dict[str, Any]:
        return {"delta": {"uri": self.uri, **({"version": self.version} if self.version is not None else {})}}

    def datasets(self, pins: Sequence[Mapping[str, Any]], store: StoreDatasets) -> list[DatasetName]:
        return [location_dataset(self.uri.rstrip("/"), str(self.version) if self.version is not None else None)]

    def snapshot(self, ctx: SourceContext) -> Snapshot:
        from batchline.sources import open_source

        read = read_version(self, ctx.input)
        pinned = DeltaSource(self.uri, read.version)

        def still() -> bool:
            return read_version(pinned, ctx.input).pin == read.pin

        files = [WithColumns(open_source(location, ctx.input.storage), values) if values
                 else open_source(location, ctx.input.storage) for location, _rows, values in read.files]
        return Snapshot(pinned, files, [read.pin], still)


def read_version(source: DeltaSource, spec: InputSpec) -> DeltaVersion:
    """The table's version (the one `source` names, else the newest) and its data files,
    whose columns must hold the input's fields."""
    deltalake = _deltalake()
    import pyarrow as pa

    options = lake_settings(spec.storage).object_store_options(source.uri.split(":", 1)[0])
    where = source.describe()
    try:
        table = deltalake.DeltaTable(source.uri, version=source.version, storage_options=options)
    except deltalake.exceptions.TableNotFoundError:
        raise InputError(f"{where}: no Delta table there") from None
    except Exception as exc:  # the reader raises its own types for a version it cannot load
        what = "has no such version (vacuumed, or never there)" if source.version is not None else "cannot be read"
        raise InputError(f"{where} {what}: {one_line(exc)}") from None
    version = int(table.version())
    where = DeltaSource(source.uri, version).describe()
    _refuse_what_cannot_be_read_by_file(table, where, spec)
    actions = pa.table(table.get_add_actions(flatten=True)).to_pylist()
    root = str(table.table_uri).rstrip("/")
    files = tuple((_location(root, str(a["path"])), int(a["num_records"] or 0),
                   {k.removeprefix("partition."): v for k, v in a.items() if k.startswith("partition.")})
                  for a in sorted(actions, key=lambda a: str(a["path"])))
    return DeltaVersion(source.uri, str(table.metadata().id), version, files)


def _location(root: str, path: str) -> str:
    """A data file's location: the log's paths are relative to the table and URI-encoded."""
    if "://" in path:
        return path
    if root.startswith("file://") or "://" not in root:
        return str(Path(unquote(root.removeprefix("file://"))) / unquote(path))
    return f"{root}/{unquote(path)}"


def _refuse_what_cannot_be_read_by_file(table: Any, where: str, spec: InputSpec) -> None:
    import pyarrow as pa

    mapping = (table.metadata().configuration or {}).get("delta.columnMapping.mode", "none")
    if mapping != "none":
        raise InputError(f"{where} maps its columns to other physical names (delta.columnMapping.mode={mapping}); "
                         "batchline reads data files by column name: rewrite the table without column mapping")
    if "deletionVectors" in (table.protocol().reader_features or []):
        try:
            marked = pa.table(table.deletion_vectors()).num_rows
        except Exception as exc:  # a deletion vector that cannot be read is still one
            raise InputError(f"{where} has deletion vectors that cannot be read ({one_line(exc)}); batchline "
                             "reads whole data files and would answer deleted rows") from None
        if marked:
            raise InputError(f"{where} has deletion vectors on {marked} data files; batchline reads whole data "
                             "files and would answer deleted rows: rewrite them (OPTIMIZE, or REORG TABLE ... "
                             "APPLY (PURGE)) and plan the new version")
    columns = set(pa.schema(table.schema().to_arrow()).names)
    for name in spec.row_columns:
        if name not in columns:
            raise InputError(f"{where}: the table has no column {name!r} (columns: {', '.join(sorted(columns))})")


class DeltaInput(KeyedFamily):
    """A Delta Lake table's version as the input (`input.delta`)."""

    name = "delta"
    keys: ClassVar[Fields] = {"delta": {"type": "object", "properties": dict(FIELDS), "required": ["uri"],
                                        "additionalProperties": False, "description": "A Delta Lake table",
                                        "examples": [{"uri": "s3://lake/tickets", "version": 42}]}}

    def parse(self, key: str, section: Mapping[str, Any], r: SpecReader, ctx: ParseContext) -> DeltaSource:
        from batchline.sources import is_remote

        delta = r.section(section[key], "input.delta", FIELDS, required={"uri"})
        uri = r.string(delta["uri"], "input.delta.uri")
        if not is_remote(uri) and "://" not in uri:
            uri = str((ctx.base_dir / uri).resolve())
        return DeltaSource(uri, r.optional_int(delta.get("version"), "input.delta.version", 0))

    def access(self, section: Mapping[str, Any]) -> list[str]:
        delta = section.get("delta")
        if not delta:
            return []
        return [f"input table {delta['uri']} (Delta, version {delta.get('version')}): the worker needs read access "
                "to the version's data files only, which its shards name (s3:GetObject under the table's prefix "
                "for a table in S3); the planner reads the table's _delta_log"]

    def pod_refusal(self, section: Mapping[str, Any], where: str) -> str | None:
        from batchline.sources import is_remote

        delta = section.get("delta")
        if isinstance(delta, dict) and delta.get("uri") and not is_remote(str(delta["uri"])):
            return f"input.delta.uri: {delta['uri']} is a folder on this machine; give an s3:// or gs:// table"
        return None


DELTA = DeltaInput()
