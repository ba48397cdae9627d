"""JSONL: one JSON object a line, each a record (its id, text, ACL and carried fields by the
input section's field names). Read in byte ranges: a shard's slice is the bytes of its lines."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

from batchline.snapshot.formats import Scan, TextFormat
from batchline.snapshot.reading import (
    Record,
    ScannedRecord,
    Slice,
    json_object,
    record_from_row,
    refuse_compressed,
)
from batchline.sources import Source
from batchline.spec import InputSpec


class JsonlFormat(TextFormat):
    name: ClassVar[str] = "jsonl"
    suffixes: ClassVar[tuple[str, ...]] = (".jsonl", ".ndjson")

    def scan(self, source: Source, spec: InputSpec) -> Scan:
        return Scan(None, self._lines(source, spec))

    def _lines(self, source: Source, spec: InputSpec) -> Iterator[ScannedRecord]:
        offset = 0
        path = source.location
        since: list[bytes] = []  # blank lines since the last record
        with source.stream() as f:
            for line_no, raw in enumerate(f, start=1):
                if line_no == 1:
                    refuse_compressed(source, raw[:8])
                start, offset = offset, offset + len(raw)
                record = self.line(raw, path, line_no, spec)
                if record is None:
                    since.append(raw)
                    continue
                yield ScannedRecord(record, start, offset, b"".join([*since, raw]) if since else raw)
                since.clear()

    def parse(self, data: bytes, sl: Slice, offset: int, first_line: int, spec: InputSpec) -> list[Record]:
        out = []
        # Split on b"\n" alone, as iterating the file did at planning time.
        for i, raw in enumerate(data.split(b"\n")):
            record = self.line(raw, sl.path, first_line + i, spec)
            if record is not None:
                out.append(record)
        return out

    def line(self, raw: bytes, path: Path | str, line_no: int, spec: InputSpec) -> Record | None:
        """One line's record; None for a blank line."""
        obj = json_object(raw, path, line_no)
        return None if obj is None else self.record(obj, path, line_no, spec)

    def record(self, obj: dict[str, Any], path: Path | str, line_no: int, spec: InputSpec) -> Record:
        return record_from_row(obj, path, line_no, spec, self)


JSONL = JsonlFormat()
