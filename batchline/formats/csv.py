"""CSV with a header row: each row a record, its columns named by the header (quoted fields may
span lines). Read in byte ranges: a shard's slice is the bytes of its rows, read with the file's
header. A CSV cell is text, so the job says how an ACL cell holds several groups: a JSON array
in every cell (`acl_json`), or groups between a separator (`acl_separator`, each group's
surrounding spaces trimmed); with neither, a cell is one group, as CSV jobs planned before the
rules read it, and a cell that holds a comma or a JSON array is refused at planning."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

from batchline.errors import InputError
from batchline.snapshot.formats import Scan, TextFormat
from batchline.snapshot.reading import (
    Record,
    ScannedRecord,
    Slice,
    record_from_row,
    refuse_compressed,
)
from batchline.sources import Source
from batchline.spec import InputSpec
from batchline.spec.reader import Fields, SpecReader


class CsvFormat(TextFormat):
    name: ClassVar[str] = "csv"
    suffixes: ClassVar[tuple[str, ...]] = (".csv",)
    options: ClassVar[Fields] = {
        "acl_json": {"type": "boolean", "description": "CSV: every ACL cell is a JSON array of groups, such as "
                                                       "[\"a\", \"b\"]", "default": False},
        "acl_separator": {"type": "string", "minLength": 1, "maxLength": 8,
                          "description": "CSV: every ACL cell is groups between this separator, such as ;"},
    }

    def parse_options(self, section: Mapping[str, Any], acl_field: str | None, r: SpecReader) -> dict[str, Any]:
        acl_json = r.boolean(section.get("acl_json", False), "input.acl_json")
        separator = r.optional_string(section.get("acl_separator"), "input.acl_separator")
        for key, given in (("acl_json", acl_json), ("acl_separator", separator is not None)):
            if given and acl_field is None:
                r.fail(f"input.{key}", "says how ACL cells are read; it needs input.acl_field")
        if acl_json and separator is not None:
            r.fail("input.acl_separator", "goes without input.acl_json: a cell is a JSON array or groups between a "
                                          "separator, not both")
        if separator is not None and (separator != separator.strip() or len(separator) > 8):
            r.fail("input.acl_separator", f"{separator!r} must be 1 to 8 characters, not starting or ending in a "
                                          "space")
        return {**({"acl_json": True} if acl_json else {}),
                **({"acl_separator": separator} if separator is not None else {})}

    def foreign_option(self, key: str, fmt: str) -> str:
        return f"says how a CSV cell holds several groups; a {fmt} input holds a list itself"

    # --- reading ----------------------------------------------------------------------------

    def scan(self, source: Source, spec: InputSpec) -> Scan:
        """The rows, and the header, read from the same stream (an object is read once)."""
        f = source.stream()
        try:
            first = f.readline()
            header = self._columns(source, first, spec)
        except BaseException:
            f.close()
            raise

        def records() -> Iterator[ScannedRecord]:
            with f:
                yield from self._rows(f, source.location, len(first), 2, header, spec)

        return Scan(header, records())

    def parse(self, data: bytes, sl: Slice, offset: int, first_line: int, spec: InputSpec) -> list[Record]:
        assert sl.header is not None
        return [s.record for s in self._rows(io.BytesIO(data), sl.path, offset, first_line, sl.header, spec)]

    def _columns(self, source: Source, first: bytes, spec: InputSpec) -> tuple[str, ...]:
        refuse_compressed(source, first[:8])
        try:
            text = first.decode("utf-8-sig")
        except UnicodeDecodeError:
            raise InputError(f"{source.location}:1: header is not valid UTF-8") from None
        header = next(csv.reader([text]), None)
        if not header:
            raise InputError(f"{source.location}: empty file (no CSV header)")
        for name in spec.row_columns:
            if name not in header:
                raise InputError(f"{source.location}:1: CSV header has no column {name!r} "
                                 f"(columns: {', '.join(header)})")
        for name in spec.carry:
            if name not in header:
                raise InputError(f"{source.location}:1: CSV header has no column {name!r}, which output.carry "
                                 f"names (columns: {', '.join(header)})")
        return tuple(header)

    def _rows(self, stream: io.BufferedIOBase | io.BytesIO | Any, path: Path | str, offset: int,
              first_line: int, header: tuple[str, ...], spec: InputSpec) -> Iterator[ScannedRecord]:
        """Parses CSV rows while tracking the byte offset where each row ends.

        csv.reader pulls exactly the physical lines one row needs (quoted fields
        may span lines), so the bytes consumed when a row is yielded end that row.
        """
        consumed = offset
        line_no = first_line - 1
        taken: list[bytes] = []  # the physical lines since the last record

        def lines() -> Iterator[str]:
            nonlocal consumed, line_no
            for raw in stream:
                line_no += 1
                consumed += len(raw)
                taken.append(raw)
                try:
                    yield raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise InputError(f"{path}:{line_no}: not valid UTF-8 (byte {exc.start} of the line)") from None

        reader = csv.reader(lines(), strict=True)
        row_start, start_line = offset, first_line
        while True:
            try:
                row = next(reader)
            except StopIteration:
                return
            except csv.Error as exc:
                raise InputError(f"{path}:{line_no}: malformed CSV: {exc}") from None
            if not row or (len(row) == 1 and not row[0].strip()):
                row_start, start_line = consumed, line_no + 1
                continue
            if len(row) != len(header):
                raise InputError(f"{path}:{start_line}: row has {len(row)} fields, header has {len(header)}")
            record = record_from_row(dict(zip(header, row, strict=True)), path, start_line, spec, self)
            yield ScannedRecord(record, row_start, consumed, b"".join(taken))
            taken.clear()
            row_start, start_line = consumed, line_no + 1

    # --- the ACL cell rule ------------------------------------------------------------------

    def acl_cell(self, cell: str, spec: InputSpec, where: str) -> list[str] | None:
        """A cell's groups under the job's rule; None for an empty cell (a missing ACL)."""
        options = spec.format_options
        if not options.get("acl_json") and options.get("acl_separator") is None:
            return [cell]  # one cell, one group (`refusal` refuses one that looks like a list)
        text = cell.strip()
        if not text:
            return None
        where = f"{where}: ACL cell {cell[:80]!r}"
        if options.get("acl_json"):
            try:
                groups = json.loads(text)
            except json.JSONDecodeError:
                groups = None
            if not isinstance(groups, list) or not all(isinstance(g, str) and g for g in groups):
                raise InputError(f"{where} is not a JSON array of group names (input.acl_json reads every cell as "
                                 "one)")
            return groups
        separator = str(options["acl_separator"])
        if text.startswith("["):
            raise InputError(f"{where} starts like a JSON array, but input.acl_separator reads groups between "
                             f"{separator!r}; set input.acl_json: true instead if every cell is a JSON array")
        groups = [g.strip() for g in text.split(separator)]
        if not all(groups):
            raise InputError(f"{where} has an empty group between {separator!r} (input.acl_separator)")
        return groups

    def checks_records(self, spec: InputSpec) -> bool:
        options = spec.format_options
        return spec.acl_field is not None and not options.get("acl_json") and options.get("acl_separator") is None

    def refusal(self, record: Record, spec: InputSpec, location: str) -> str | None:
        """An ACL cell read under no rule (one cell, one group, as CSV jobs planned before the rules
        read it) that holds a JSON array or a comma, which would become one group named like the
        array or the list: a silently wrong security label."""
        options = spec.format_options
        if spec.acl_field is None or options.get("acl_json") or options.get("acl_separator") is not None:
            return None
        if record.acl is None or len(record.acl) != 1:
            return None
        cell = record.acl.groups[0]
        rules = ("say how cells hold groups: input.acl_json: true (a JSON array in every cell) or "
                 "input.acl_separator (for example ',')")
        if "," in cell and not cell.lstrip().startswith("["):
            return (f"{location}:{record.line}: id {record.id!r}: ACL cell {cell[:80]!r} holds a comma, and would be "
                    f"read as one group named so; {rules}")
        if not cell.lstrip().startswith("["):
            return None
        try:
            if not isinstance(json.loads(cell), list):
                return None
        except json.JSONDecodeError:
            return None
        return (f"{location}:{record.line}: id {record.id!r}: ACL cell {cell[:80]!r} holds a JSON array, which "
                f"would be read as one group; {rules}")


CSV = CsvFormat()
