"""Input snapshots: streaming readers for JSONL, CSV and Parquet, slices and digests.

A slice is what one shard reads: a byte range of a JSONL or CSV file or
object, or whole row groups of a Parquet one. Each slice carries a digest
taken at planning time, and the worker that reads the slice checks it, so a
changed input is refused per shard without rehashing the whole snapshot; an
object's slice also carries the object's pin, and every read of it is
conditional on that. Nothing here loads a whole file.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import json
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from batchline.acl import acl_entry_refusal
from batchline.errors import InputError, SourceUnavailable
from batchline.snapshot.openai_batch import messages_hash_text, parse_request
from batchline.sources import (
    Pin,
    Snapshot,
    Source,
    SourceContext,
    StoredRows,
    open_source,
    snapshot_digest,
)
from batchline.sources.base import WithColumns
from batchline.spec import OPENAI_BATCH, STORED, InputSpec, RoutingSpec
from batchline.store import InputRecord

# The slice a worker checks must be read whole before any record is parsed, so
# a shard of a text format is bounded in bytes as well as in records.
PARQUET_BATCH_ROWS = 8192
# Each shard is cut into this many pieces (fewer for a shard of fewer records): the
# unit its unstarted tail is split off in when other workers would idle.
PIECES_PER_SHARD = 16


@dataclass(frozen=True)
class Record:
    id: str
    text: str
    acl: Any
    content_hash: str
    line: int  # 1-based line (JSONL, CSV) or row number (Parquet) in its file
    data_class: Any = None  # the routing class field's value, when the job routes by class
    # openai-batch: the conversation, which the engine renders with its chat template;
    # `text` is then the last user message.
    messages: tuple[dict[str, Any], ...] | None = None
    piece: int | None = None  # the piece of its shard it was read from (see Piece)
    # Why the record has no text to read (an input read from the store whose chosen field
    # is missing or null): the planner dead-letters it.
    missing: str | None = None
    # output.carry: the input fields copied onto its result and dead letter, as read.
    carried: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class Piece:
    """A run of a shard's records with its own bounds and digest: the unit a shard's
    unstarted tail is split off in (see batchline.store.core.split_point)."""

    no: int  # numbered across the version, so a piece keeps its number in a split-off shard
    start: int
    end: int
    first_line: int
    digest: str
    records: int
    dead: int = 0  # records the planner dead-lettered (over the length cap)
    # With ids from content: the ids of rows identical to an earlier row, by line (the
    # planner numbered them by their order; a worker reading this piece alone cannot).
    ids: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        if not self.ids:
            del out["ids"]
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Piece:
        return cls(int(data["no"]), int(data["start"]), int(data["end"]), int(data["first_line"]),
                   str(data["digest"]), int(data["records"]), int(data.get("dead", 0)), dict(data.get("ids", {})))


@dataclass(frozen=True)
class Slice:
    path: str
    format: str
    start: int  # byte offset (jsonl, csv) or first row (parquet)
    end: int  # exclusive
    first_line: int
    digest: str
    header: tuple[str, ...] | None = None  # csv column names
    # With routing, a route's shard covers the range from its first record to its
    # last, and holds only that range's records of its own route.
    route: str | None = None
    # Planned with pieces: each is checked against its own digest (the slice's digest
    # then covers the shard as planned, before any split).
    pieces: tuple[Piece, ...] = ()
    pin: Pin | None = None  # an object's size, ETag and version: the worker reads exactly that
    # Values every row of the file shares that the file does not hold (a table's partition
    # values): added to each row read.
    columns: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "path": self.path, "format": self.format, "start": self.start, "end": self.end,
            "first_line": self.first_line, "digest": self.digest,
            "header": list(self.header) if self.header is not None else None,
        }
        if self.route is not None:
            out["route"] = self.route
        if self.pieces:
            out["pieces"] = [p.to_json() for p in self.pieces]
        if self.pin is not None:
            out["pin"] = self.pin.to_json()
        if self.columns:
            out["columns"] = dict(self.columns)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Slice:
        header = data.get("header")
        pin = data.get("pin")
        return cls(path=data["path"], format=data["format"], start=int(data["start"]),
                   end=int(data["end"]), first_line=int(data["first_line"]),
                   digest=data["digest"], header=tuple(header) if header is not None else None,
                   route=data.get("route"), pieces=tuple(Piece.from_json(p) for p in data.get("pieces", ())),
                   pin=Pin.from_json(pin) if pin is not None else None, columns=dict(data.get("columns", {})))

    def describe(self) -> str:
        unit = "rows" if self.format in ("parquet", STORED) else "bytes"
        return f"{self.path}:{self.first_line} ({unit} {self.start}-{self.end})"


def content_hash(text: str, acl: Any, data_class: str | None = None) -> str:
    """What decides a record's result: its text, its access rules and, when the job routes
    by class, its class (which decides where it is sent); not other fields."""
    data = text.encode()
    h = hashlib.sha256(len(data).to_bytes(8, "big"))
    h.update(data)
    if acl is not None:
        h.update(orjson.dumps(acl, option=orjson.OPT_SORT_KEYS))
    if data_class is not None:
        h.update(b"\0class\0" + data_class.encode())
    return h.hexdigest()[:32]


def text_hash(record: Record, spec: InputSpec) -> str | None:
    """The hash of what the prompt reads of a record, its text and class without its ACL, where
    that differs from its content hash (a record with an ACL and text); None otherwise."""
    if record.acl is None or record.missing is not None or record.messages is not None:
        return None
    return content_hash(record.text, None, class_key(spec, record.data_class))


def pinned_snapshot(spec: InputSpec, store_url: str | None = None) -> Snapshot:
    """The input's snapshot as its source reads it now: the files or objects in order (for a
    table, the data files of the snapshot the spec names; the planner pins it into the spec
    first), and what the snapshot's digest is taken over (each file's or object's pin, whose
    later reads through these sources are conditional on it, or a table's own pin)."""
    return spec.source.snapshot(SourceContext(spec, store_url))


def input_sources(spec: InputSpec, store_url: str | None = None) -> list[Source]:
    """The input's files or objects in order."""
    return pinned_snapshot(spec, store_url).files


def pinned_sources(spec: InputSpec, store_url: str | None = None) -> tuple[list[Source], list[Pin]]:
    """The input's sources, and what the snapshot's digest is taken over."""
    snapshot = pinned_snapshot(spec, store_url)
    return snapshot.files, snapshot.pins


def input_pins(spec: InputSpec, store_url: str | None = None) -> list[Pin]:
    """What the input guarantees about itself now."""
    return pinned_snapshot(spec, store_url).pins


def file_digest(spec: InputSpec, store_url: str | None = None) -> str:
    """The snapshot digest: what each input source guarantees about itself (a local
    file: every byte, with its name; a table: its UUID and snapshot id), in order."""
    return snapshot_digest(input_pins(spec, store_url))


# --- scanning (planning) -------------------------------------------------------


@dataclass(frozen=True)
class ScannedRecord:
    record: Record
    start: int  # byte offset or row index where the record begins
    end: int  # where it ends (exclusive)
    # Text formats: the bytes from where the record before ended to where this one ends
    # (blank lines included), so a run of records' bytes is hashed as it streams by.
    raw: bytes = b""


_COMPRESSED_MAGIC = {b"\x1f\x8b": "gzip", b"\x28\xb5\x2f\xfd": "zstd", b"BZh": "bzip2",
                     b"\xfd7zXZ\x00": "xz", b"PK\x03\x04": "zip"}


def refuse_compressed(source: Source, head: bytes) -> None:
    """A compressed stream cannot be read from a byte offset, so a shard's slice
    of it could not be read on its own: refuse it whatever its name says."""
    for magic, kind in _COMPRESSED_MAGIC.items():
        if head.startswith(magic):
            raise InputError(f"{source.location} is {kind}-compressed; decompress it (or convert it to Parquet) "
                             "first: each shard reads its own byte range")


def scan(source: Source | str, spec: InputSpec) -> Iterator[ScannedRecord]:
    """Every record of one input source in order, with its position, validated."""
    source = open_source(source, spec.storage) if isinstance(source, str) else source
    if spec.format in ("jsonl", OPENAI_BATCH):
        yield from _scan_jsonl(source, spec)
    elif spec.format == STORED:
        yield from _scan_stored(source, spec)
    elif spec.format == "csv":
        yield from _scan_csv(source, spec)
    else:
        yield from _scan_parquet(source, spec)


def scan_with_header(source: Source, spec: InputSpec) -> tuple[tuple[str, ...] | None, Iterator[ScannedRecord]]:
    """`scan`, and for CSV the header, read from the same stream (an object is read once)."""
    if spec.format != "csv":
        return None, scan(source, spec)
    f = source.stream()
    try:
        first = f.readline()
        header = _csv_columns(source, first, spec)
    except BaseException:
        f.close()
        raise

    def records() -> Iterator[ScannedRecord]:
        with f:
            yield from _csv_records(f, source.location, len(first), 2, header, spec)

    return header, records()


def _parse_header(source: Source, first: bytes) -> tuple[str, ...]:
    refuse_compressed(source, first[:8])
    try:
        text = first.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise InputError(f"{source.location}:1: header is not valid UTF-8") from None
    header = next(csv.reader([text]), None)
    if not header:
        raise InputError(f"{source.location}: empty file (no CSV header)")
    return tuple(header)


def read_bytes(source: Source, start: int, end: int) -> bytes:
    """A byte range of a source, as the planner reads a shard's to take its digests."""
    return source.read(start, end)


def _scan_jsonl(source: Source, spec: InputSpec) -> Iterator[ScannedRecord]:
    offset = 0
    path = source.location
    since: list[bytes] = []  # blank lines since the last record
    with source.stream() as f:
        for line_no, raw in enumerate(f, start=1):
            if line_no == 1:
                refuse_compressed(source, raw[:8])
            start, offset = offset, offset + len(raw)
            record = parse_jsonl_line(raw, path, line_no, spec)
            if record is None:
                since.append(raw)
                continue
            yield ScannedRecord(record, start, offset, b"".join([*since, raw]) if since else raw)
            since.clear()


UTF8_BOM = b"\xef\xbb\xbf"


def parse_jsonl_line(raw: bytes, path: Path | str, line_no: int, spec: InputSpec) -> Record | None:
    if line_no == 1 and raw.startswith(UTF8_BOM):
        raw = raw[len(UTF8_BOM):]  # a byte order mark some editors write: not part of the JSON
    if not raw.strip():
        return None
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        # The standard parser words the error (and takes the odd line orjson refuses).
        obj = _parse_slowly(raw, path, line_no)
    if not isinstance(obj, dict):
        raise InputError(f"{path}:{line_no}: a line must be a JSON object, not {type(obj).__name__}")
    if spec.format == OPENAI_BATCH:
        return _chat_record(obj, path, line_no, spec)
    return _record(obj, path, line_no, spec)


def _chat_record(obj: dict[str, Any], path: Path | str, line_no: int, spec: InputSpec) -> Record:
    req = parse_request(obj, f"{path}:{line_no}", spec.chat_rules)
    return Record(req.custom_id, req.text, None, content_hash(messages_hash_text(req.messages), None),
                  line_no, messages=req.messages)


def _parse_slowly(raw: bytes, path: Path | str, line_no: int) -> Any:
    # Without its line ending: a fault at the end of the line is at its last column, not
    # at column 1 of the next.
    line = raw.rstrip(b"\r\n")
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}:{line_no}: {_id_if_readable(line)}not valid UTF-8 (byte {exc.start + 1} of "
                         f"the line)") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        where = "at the end of the line" if exc.pos >= len(text) else f"at column {exc.colno}"
        raise InputError(f"{path}:{line_no}: {_id_if_readable(line)}malformed JSON: {exc.msg} {where}") from None


_ID_IN_TEXT = re.compile(rb'"id"\s*:\s*("(?:[^"\\]|\\.){1,200}"|-?\d{1,30})')


def _id_if_readable(line: bytes) -> str:
    """`id 'x': ` when the line's id can be read in spite of its fault, for the message."""
    try:
        obj = json.loads(line.decode("utf-8", errors="replace"))
        rid = obj.get("id") if isinstance(obj, dict) else None
    except json.JSONDecodeError:
        # Broken JSON: an `"id": ...` near the start still says which record it is.
        found = _ID_IN_TEXT.search(line)
        try:
            rid = json.loads(found.group(1).decode("utf-8", errors="replace")) if found else None
        except json.JSONDecodeError:
            rid = None
    return f"id {rid!r}: " if isinstance(rid, str | int) and not isinstance(rid, bool) else ""


def _record(obj: dict[str, Any], path: Path | str, line_no: int, spec: InputSpec) -> Record:
    # `where` is formatted only for an error: on the planner's path, once per record, it cost a fifth of a scan.
    if spec.ids == "content":
        record_id = content_id(obj)
    else:
        raw_id = obj.get(spec.id_field)
        if raw_id is None:
            raise InputError(f"{path}:{line_no}: missing id (field {spec.id_field!r})")
        if isinstance(raw_id, bool) or not isinstance(raw_id, str | int):
            raise InputError(f"{path}:{line_no}: id {raw_id!r} must be a string or an integer")
        record_id = raw_id if isinstance(raw_id, str) else str(raw_id)
        if not record_id.strip():
            raise InputError(f"{path}:{line_no}: empty id (field {spec.id_field!r})")
    text = obj.get(spec.text_field)
    if not isinstance(text, str):
        what = "missing" if text is None else f"not a string ({type(text).__name__})"
        raise InputError(f"{path}:{line_no}: id {record_id!r}: text field {spec.text_field!r} is {what}")
    acl = _acl(obj, spec, path, line_no, record_id) if spec.acl_field else None
    data_class = obj.get(spec.class_field) if spec.class_field else None
    carried = _carried(obj, spec, path, line_no, record_id) if spec.carry else None
    return Record(record_id, text, acl, content_hash(text, acl, class_key(spec, data_class)), line_no,
                  data_class, carried=carried)


def _carried(obj: dict[str, Any], spec: InputSpec, path: Path | str, line_no: int,
             record_id: str) -> dict[str, Any]:
    """The fields output.carry names, as the record holds them (null included). A record without
    one is refused: a result that cannot be joined back would be silently lost downstream."""
    out: dict[str, Any] = {}
    for name in spec.carry:
        if name not in obj:
            raise InputError(f"{path}:{line_no}: id {record_id!r}: carried field {name!r} is missing; every "
                             "record needs each field output.carry names")
        out[name] = obj[name]
    return out


def content_id(row: dict[str, Any]) -> str:
    """An id from the whole row: the same row has the same id in every snapshot, wherever it
    stands (row numbers shift from one nightly snapshot to the next; these do not)."""
    data = orjson.dumps(row, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS, default=str)
    return "c" + hashlib.sha256(data).hexdigest()[:24]


def _acl(obj: dict[str, Any], spec: InputSpec, path: Path | str, line_no: int, record_id: str) -> list[str]:
    """A record's ACL as a list of strings. A missing one is refused unless the spec says
    what it means: a reader downstream would take it for "open to all"."""
    acl = obj.get(spec.acl_field) if spec.acl_field else None
    if isinstance(acl, str) and (spec.acl_json or spec.acl_separator is not None):
        acl = _acl_cell(acl, spec, path, line_no, record_id)
    if acl is None:
        if spec.acl_missing is not None:
            return list(spec.acl_missing)
        what = "null" if spec.acl_field in obj else "missing"
        raise InputError(f"{path}:{line_no}: id {record_id!r}: ACL field {spec.acl_field!r} is {what}; every "
                         "record needs one, or set input.acl_missing to say what a missing one means "
                         '(for example ["restricted"])')
    if isinstance(acl, str):
        acl = [acl]
    if not isinstance(acl, list) or not all(isinstance(a, str) for a in acl):
        raise InputError(f"{path}:{line_no}: id {record_id!r}: ACL field {spec.acl_field!r} must be a list of "
                         f"strings (or one string), not {json.dumps(acl, default=str)[:80]}")
    refusal = acl_entry_refusal(acl)
    if refusal is not None:
        raise InputError(f"{path}:{line_no}: id {record_id!r}: ACL field {spec.acl_field!r}: {refusal}")
    return acl


def _acl_cell(cell: str, spec: InputSpec, path: Path | str, line_no: int, record_id: str) -> list[str] | None:
    """A CSV cell's groups under the spec's rule; None for an empty cell (a missing ACL)."""
    text = cell.strip()
    if not text:
        return None
    where = f"{path}:{line_no}: id {record_id!r}: ACL cell {cell[:80]!r}"
    if spec.acl_json:
        try:
            groups = json.loads(text)
        except json.JSONDecodeError:
            groups = None
        if not isinstance(groups, list) or not all(isinstance(g, str) and g for g in groups):
            raise InputError(f"{where} is not a JSON array of group names (input.acl_json reads every cell as one)")
        return groups
    separator = spec.acl_separator
    assert separator is not None
    if text.startswith("["):
        raise InputError(f"{where} starts like a JSON array, but input.acl_separator reads groups between "
                         f"{separator!r}; set input.acl_json: true instead if every cell is a JSON array")
    groups = [g.strip() for g in text.split(separator)]
    if not all(groups):
        raise InputError(f"{where} has an empty group between {separator!r} (input.acl_separator)")
    return groups


def unruled_acl_array(record: Record, spec: InputSpec, path: str) -> str | None:
    """At planning: why a CSV ACL cell read under no rule (one cell, one group, as CSV jobs planned
    before the rules read it) holds a JSON array or a comma, which would become one group named
    like the array or the list: a silently wrong security label. None when it does not."""
    if spec.format != "csv" or spec.acl_json or spec.acl_separator is not None or not isinstance(record.acl, list):
        return None
    if len(record.acl) != 1:
        return None
    cell = record.acl[0]
    rules = ("say how cells hold groups: input.acl_json: true (a JSON array in every cell) or "
             "input.acl_separator (for example ',')")
    if "," in cell and not cell.lstrip().startswith("["):
        return (f"{path}:{record.line}: id {record.id!r}: ACL cell {cell[:80]!r} holds a comma, and would be read "
                f"as one group named so; {rules}")
    if not cell.lstrip().startswith("["):
        return None
    try:
        if not isinstance(json.loads(cell), list):
            return None
    except json.JSONDecodeError:
        return None
    return (f"{path}:{record.line}: id {record.id!r}: ACL cell {cell[:80]!r} holds a JSON array, which "
            f"would be read as one group; {rules}")


def class_key(spec: InputSpec, data_class: Any) -> str | None:
    """The class as far as it can decide a route: None without routing, else the class
    string (any other value routes like a missing one, and hashes alike)."""
    if spec.class_field is None:
        return None
    return data_class if isinstance(data_class, str) else ""


def _scan_csv(source: Source, spec: InputSpec) -> Iterator[ScannedRecord]:
    _header, records = scan_with_header(source, spec)
    yield from records


def _csv_columns(source: Source, first: bytes, spec: InputSpec) -> tuple[str, ...]:
    header = _parse_header(source, first)
    for name in (spec.text_field,) if spec.ids == "content" else (spec.id_field, spec.text_field):
        if name not in header:
            raise InputError(f"{source.location}:1: CSV header has no column {name!r} "
                             f"(columns: {', '.join(header)})")
    for name in spec.carry:
        if name not in header:
            raise InputError(f"{source.location}:1: CSV header has no column {name!r}, which output.carry "
                             f"names (columns: {', '.join(header)})")
    return header


def _csv_records(stream: io.BufferedIOBase | io.BytesIO | Any, path: Path | str, offset: int,
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
        record = _record(dict(zip(header, row, strict=True)), path, start_line, spec)
        yield ScannedRecord(record, row_start, consumed, b"".join(taken))
        taken.clear()
        row_start, start_line = consumed, line_no + 1


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


def parquet_row_groups(source: Source) -> list[int]:
    """Rows in each row group, from the footer (an object's footer is fetched once per source)."""
    with _parquet(source) as (pf, _f):
        return [pf.metadata.row_group(g).num_rows for g in range(pf.metadata.num_row_groups)]


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


def shared_columns(source: Source) -> Mapping[str, Any]:
    """The values of columns every row of `source` shares that its file does not hold (a
    table's partition values, which its log keeps): readers add them to each row."""
    columns: Mapping[str, Any] = getattr(source, "columns", {})
    return columns


def _parquet_columns(pf: Any, path: str, spec: InputSpec, shared: Mapping[str, Any]) -> list[str]:
    """The file's columns to read; a field among `shared` is not read from the file."""
    names = [*pf.schema_arrow.names, *shared]
    for name in spec.carry:
        if name not in names:
            raise InputError(f"{path}: Parquet file has no column {name!r}, which output.carry names")
    if spec.ids == "content":
        # The id is a digest of the whole row.
        if spec.text_field not in names:
            raise InputError(f"{path}: Parquet file has no column {spec.text_field!r}")
        return names
    columns = ([spec.id_field, spec.text_field] + ([spec.acl_field] if spec.acl_field else [])
               + ([spec.class_field] if spec.class_field else []))
    for name in columns[:2]:
        if name not in names:
            raise InputError(f"{path}: Parquet file has no column {name!r}")
    return list(dict.fromkeys([c for c in columns if c in names] + list(spec.carry)))


def _file_columns(columns: list[str], shared: Mapping[str, Any]) -> list[str]:
    return [c for c in columns if c not in shared]


def _scan_parquet(source: Source, spec: InputSpec) -> Iterator[ScannedRecord]:
    path = source.location
    shared = shared_columns(source)
    with _parquet(source) as (pf, f):
        columns = _file_columns(_parquet_columns(pf, path, spec, shared), shared)
        row = 0
        for group in range(pf.metadata.num_row_groups):
            _prefetch_group(f, pf, group, columns)
            for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=[group], columns=columns):
                for obj in batch.to_pylist():
                    row += 1
                    yield ScannedRecord(_record({**obj, **shared}, path, row, spec), row - 1, row)


# A record without text has no content to match a base version's: its hash is none a text has.
NO_CONTENT = "-"


def _scan_stored(source: Source, spec: InputSpec) -> Iterator[ScannedRecord]:
    """An input the store holds: each row at its position (a row number, as for Parquet)."""
    rows: StoredRows = source  # type: ignore[assignment]  # a source of format `store` is one
    for position, row in enumerate(rows.rows()):
        text = row.text if row.text is not None else ""
        digest = content_hash(text, row.acl) if row.missing is None else NO_CONTENT
        yield ScannedRecord(Record(row.id, text, row.acl, digest, position + 1, missing=row.missing,
                                   carried=row.carried), position, position + 1)


def stored_input(scanned: ScannedRecord) -> InputRecord:
    """A scanned record of an input the store holds, as the version's own records keep it."""
    r = scanned.record
    return InputRecord(r.id, None if r.missing else r.text, r.acl, r.content_hash, scanned.start)


def parquet_slice_digest(records: Sequence[Record]) -> str:
    h = hashlib.sha256()
    for r in records:
        h.update(f"{r.id}\0{r.content_hash}\n".encode())
    return "sha256:" + h.hexdigest()


# --- reading a slice (workers) -------------------------------------------------


# Where a worker reads a shard's records when the store holds its input: the version's own
# records at positions [start, end).
StoredReader = Callable[[int, int], Sequence[InputRecord]]


def read_slice(sl: Slice, spec: InputSpec, routing: RoutingSpec | None = None,
               stored: StoredReader | None = None) -> list[Record]:
    """The records of one shard, after checking the slice's digest (or each piece's);
    `stored` reads them where the store holds the input."""
    if sl.format == STORED and stored is None:
        raise InputError(f"{sl.describe()}: this shard's records are in the store, and were read without it")
    if sl.route is not None and routing is None:
        raise InputError(f"shard of route {sl.route!r} read without the job's routing rules")
    if sl.pieces:
        return _read_pieces(sl, spec, routing, stored)
    records = _read_slice(sl, spec, stored)
    if sl.route is None:
        return records
    assert routing is not None
    mine = [r for r in records if routing.route_of(r.data_class) == sl.route]
    if sl.format == "parquet" and parquet_slice_digest(mine) != sl.digest:
        raise InputError(f"input changed since planning: {sl.describe()}")
    return mine


def _read_pieces(sl: Slice, spec: InputSpec, routing: RoutingSpec | None,
                 stored: StoredReader | None = None) -> list[Record]:
    """One read of the pieces' whole range; each piece's records checked against its digest."""
    start, end = sl.pieces[0].start, sl.pieces[-1].end
    parquet = sl.format in ("parquet", STORED)  # records by row, digested by id and content hash
    rows: list[Record] | None
    if sl.format == STORED:
        assert stored is not None
        rows, data = _stored_rows(sl, stored, start, end), b""
    else:
        source = _slice_source(sl, spec)
        rows = _read_parquet_rows(source, start, end, spec) if parquet else None
        data = b"" if parquet else source.read(start, end)
    out: list[Record] = []
    for p in sl.pieces:
        where = (f"{sl.path}:{p.first_line}: input changed since planning (the {p.records} records from "
                 f"{'row' if parquet else 'line'} {p.first_line} on)")
        if rows is not None:
            records = rows[p.start - start:p.end - start]
        else:
            chunk = data[p.start - start:p.end - start]
            if "sha256:" + hashlib.sha256(chunk).hexdigest() != p.digest:
                raise InputError(where)
            records = _parse_text(chunk, sl, p.start, p.first_line, spec)
        if sl.route is not None:
            assert routing is not None
            records = [r for r in records if routing.route_of(r.data_class) == sl.route]
        if p.ids:
            records = [replace(r, id=p.ids.get(str(r.line), r.id)) for r in records]
        if parquet and parquet_slice_digest(records) != p.digest:
            raise InputError(where)
        out.extend(replace(r, piece=p.no) for r in records)
    return out


def _slice_source(sl: Slice, spec: InputSpec) -> Source:
    source = open_source(sl.path, spec.storage, sl.pin)
    return WithColumns(source, sl.columns) if sl.columns else source


def _parse_text(data: bytes, sl: Slice, offset: int, first_line: int, spec: InputSpec) -> list[Record]:
    if sl.format in ("jsonl", OPENAI_BATCH):
        out = []
        # Split on b"\n" alone, as iterating the file did at planning time.
        for i, raw in enumerate(data.split(b"\n")):
            record = parse_jsonl_line(raw, sl.path, first_line + i, spec)
            if record is not None:
                out.append(record)
        return out
    assert sl.header is not None
    return [s.record for s in _csv_records(io.BytesIO(data), sl.path, offset, first_line, sl.header, spec)]


def _stored_rows(sl: Slice, stored: StoredReader, start: int, end: int) -> list[Record]:
    """The version's own records at positions [start, end): what planning copied there."""
    out = [Record(r.record_id, r.text if r.text is not None else "", r.acl, r.content_hash, r.position + 1,
                  missing=None if r.text is not None else "no text") for r in stored(start, end)]
    if len(out) != end - start:
        raise InputError(f"{sl.describe()}: the store holds {len(out)} of the shard's {end - start} records")
    return out


def _read_slice(sl: Slice, spec: InputSpec, stored: StoredReader | None = None) -> list[Record]:
    changed = f"input changed since planning: {sl.describe()}"
    if sl.format == STORED:
        assert stored is not None
        records = _stored_rows(sl, stored, sl.start, sl.end)
        if parquet_slice_digest(records) != sl.digest:
            raise InputError(changed)
        return records
    source = _slice_source(sl, spec)
    if sl.format == "parquet":
        records = _read_parquet_rows(source, sl.start, sl.end, spec)
        if sl.route is None and parquet_slice_digest(records) != sl.digest:
            raise InputError(changed)
        return records
    data = source.read(sl.start, sl.end)
    if "sha256:" + hashlib.sha256(data).hexdigest() != sl.digest:
        raise InputError(changed)
    return _parse_text(data, sl, sl.start, sl.first_line, spec)


def _read_parquet_rows(source: Source, start: int, end: int, spec: InputSpec) -> list[Record]:
    path = source.location
    shared = shared_columns(source)
    # Only the row groups that overlap the slice are read.
    out: list[Record] = []
    with _parquet(source) as (pf, f):
        columns = _file_columns(_parquet_columns(pf, path, spec, shared), shared)
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
                out.append(_record({**obj, **shared}, path, group_start + lo + i + 1, spec))
    if len(out) != end - start:
        raise InputError(f"input changed since planning: {path} has fewer rows than {end}")
    return out
