"""Parquet: each row a record, its columns named by the input section's fields. Read in ranges
of rows: a shard takes whole row groups (one, or several small ones up to about shards.size
records), so each worker reads only its own, and only the columns a record needs. Values every
row of a file shares that the file does not hold (a table's partition values, which its log
keeps) are added to each row."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, BinaryIO, ClassVar

from batchline.errors import InputError, SourceUnavailable
from batchline.snapshot.formats import RowFormat, Scan
from batchline.snapshot.reading import (
    PARQUET_BATCH_ROWS,
    Record,
    ScannedRecord,
    record_from_row,
    shared_columns,
)
from batchline.sources import Source
from batchline.spec import InputSpec


class ParquetFormat(RowFormat):
    name: ClassVar[str] = "parquet"
    suffixes: ClassVar[tuple[str, ...]] = (".parquet",)

    def scan(self, source: Source, spec: InputSpec) -> Scan:
        return Scan(None, self._scan(source, spec))

    def _scan(self, source: Source, spec: InputSpec) -> Iterator[ScannedRecord]:
        path = source.location
        shared = shared_columns(source)
        with _parquet(source) as (pf, f):
            columns = _file_columns(_columns(pf, path, spec, shared), shared)
            row = 0
            for group in range(pf.metadata.num_row_groups):
                _prefetch_group(f, pf, group, columns)
                for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=[group], columns=columns):
                    for obj in batch.to_pylist():
                        row += 1
                        yield ScannedRecord(record_from_row({**obj, **shared}, path, row, spec, self), row - 1, row)

    def row_groups(self, source: Source) -> list[int]:
        """Rows in each row group, from the footer (an object's footer is fetched once per source)."""
        with _parquet(source) as (pf, _f):
            return [pf.metadata.row_group(g).num_rows for g in range(pf.metadata.num_row_groups)]

    def count(self, source: Source) -> int:
        return sum(self.row_groups(source))

    def rows(self, source: Source, start: int, end: int, spec: InputSpec) -> list[Record]:
        path = source.location
        shared = shared_columns(source)
        # Only the row groups that overlap the slice are read.
        out: list[Record] = []
        with _parquet(source) as (pf, f):
            columns = _file_columns(_columns(pf, path, spec, shared), shared)
            first_row = 0
            for g in range(pf.metadata.num_row_groups):
                n = pf.metadata.row_group(g).num_rows
                group_start, group_end = first_row, first_row + n
                first_row = group_end
                if group_end <= start or group_start >= end:
                    continue
                _prefetch_group(f, pf, g, columns)
                table = pf.read_row_group(g, columns=columns)
                lo, hi = max(start, group_start) - group_start, min(end, group_end) - group_start
                for i, obj in enumerate(table.slice(lo, hi - lo).to_pylist()):
                    out.append(record_from_row({**obj, **shared}, path, group_start + lo + i + 1, spec, self))
        if len(out) != end - start:
            raise InputError(f"input changed since planning: {path} has fewer rows than {end}")
        return out


@contextlib.contextmanager
def _parquet(source: Source) -> Iterator[tuple[Any, BinaryIO]]:
    """The Parquet reader over a source, and the file object under it."""
    import pyarrow.parquet as pq

    f = source.random_access()
    try:
        try:
            # Without pre-buffering: pyarrow would otherwise keep every column chunk it read
            # for the life of the file, and planning would grow with the input.
            pf = pq.ParquetFile(f, pre_buffer=False)
        except (InputError, SourceUnavailable):
            raise
        except Exception as exc:  # pyarrow raises several types for unreadable files
            raise InputError(f"{source.location}: not a readable Parquet file: {exc}") from None
        with pf:
            yield pf, f
    finally:
        f.close()


def _prefetch_group(f: BinaryIO, pf: Any, group: int, columns: Sequence[str]) -> None:
    """One request for the column chunks of `group` that are read, where the file is an
    object (a local file is read in place)."""
    prefetch = getattr(f, "prefetch", None)
    if prefetch is None:
        return
    rg = pf.metadata.row_group(group)
    spans = []
    for i in range(rg.num_columns):
        col = rg.column(i)
        if col.path_in_schema.split(".")[0] not in columns:
            continue
        start = col.dictionary_page_offset if col.has_dictionary_page and col.dictionary_page_offset else (
            col.data_page_offset)
        spans.append((start, start + col.total_compressed_size))
    if spans:
        prefetch(min(s for s, _ in spans), max(e for _, e in spans))


def _columns(pf: Any, path: str, spec: InputSpec, shared: Mapping[str, Any]) -> list[str]:
    """The file's columns to read; a field among `shared` is not read from the file."""
    names = [*pf.schema_arrow.names, *shared]
    for name in spec.carry:
        if name not in names:
            raise InputError(f"{path}: Parquet file has no column {name!r}, which output.carry names")
    if spec.ids == "content":
        # The id is a digest of the whole row.
        for name in spec.text_columns:
            if name not in names:
                raise InputError(f"{path}: Parquet file has no column {name!r}")
        return names
    required = [spec.id_field, *spec.text_columns]
    for name in required:
        if name not in names:
            raise InputError(f"{path}: Parquet file has no column {name!r}")
    columns = (required + ([spec.acl_field] if spec.acl_field else [])
               + ([spec.class_field] if spec.class_field else []))
    return list(dict.fromkeys([c for c in columns if c in names] + list(spec.carry)))


def _file_columns(columns: list[str], shared: Mapping[str, Any]) -> list[str]:
    return [c for c in columns if c not in shared]


PARQUET = ParquetFormat()
