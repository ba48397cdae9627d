"""An Apache Iceberg table at one snapshot, as a job's input.

The snapshot is pinned by the table's UUID and the snapshot id (never by the
catalog's address, which may hold credentials and is not part of what was
read). Its data files are immutable Parquet files, so each is opened like any
other location (`open_source`) and a shard's slice is a range of one data
file's rows: a worker reads the data file directly and needs no catalog.

A snapshot whose rows are changed by delete files (position deletes, equality
deletes or deletion vectors) is refused: reading its data files whole would
answer deleted rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchline.errors import InputError
from batchline.sources.base import Pin
from batchline.sources.catalogs import load_table, one_line, open_catalog
from batchline.spec import InputSpec, TableRef


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


def read_snapshot(spec: InputSpec, store_url: str | None = None) -> TableSnapshot:
    """The table's snapshot (the one the spec names, else the current one) and its data files."""
    ref = spec.table
    assert ref is not None
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
    wanted = [f for f in (spec.id_field, spec.text_field, spec.acl_field, spec.class_field) if f]
    current = {f.name: f.field_id for f in meta.schema().fields}
    for name in wanted[:2]:
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
