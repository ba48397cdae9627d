"""Input snapshots: what every format shares, slices and digests.

Each file or object is read by its format (the FORMATS table: JSONL, CSV, Parquet, OpenAI
batch files, `batchline.formats`, through the port in `batchline.snapshot.formats`); an
input with no files (a published job's results, a warehouse query) by its source's rows
(`batchline.sources.base.RowSource`). What they share is here: a record and its content
hash, the rule every format reads a record's fields by (`record_from_row`), and the slices
shards read.

A slice is what one shard reads: a byte range of a text file or
object, or whole row groups of a Parquet one, or a range of a row source's rows. Each slice carries a digest
taken at planning time, and the worker that reads the slice checks it, so a
changed input is refused per shard without rehashing the whole snapshot; an
object's slice also carries the object's pin, and every read of it is
conditional on that. Nothing here loads a whole file.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from batchline.acl import Acl, AclUnreadable
from batchline.errors import InputError
from batchline.snapshot.formats import RowFormat, Scan, TextFormat, input_format
from batchline.sources import (
    Pin,
    RowSource,
    Snapshot,
    Source,
    SourceContext,
    StoredRow,
    open_source,
    snapshot_digest,
)
from batchline.sources.base import WithColumns
from batchline.spec import ROWS, STORED, InputSpec, JobSpec, RoutingSpec
from batchline.store import InputRecord

if TYPE_CHECKING:
    from batchline.snapshot.formats import InputFormat

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
    acl: Acl | None
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
    # Where a worker reads a replica instead of the planned location: that region's storage
    # settings (never stored: the slice's stored form names the primary).
    storage: Mapping[str, Any] | None = None

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
        unit = "rows" if by_rows(self) else "bytes"
        return f"{self.path}:{self.first_line} ({unit} {self.start}-{self.end})"


def content_hash(text: str, acl: Acl | None, data_class: str | None = None) -> str:
    """What decides a record's result: its text, its access rules and, when the job routes
    by class, its class (which decides where it is sent); not other fields."""
    data = text.encode()
    h = hashlib.sha256(len(data).to_bytes(8, "big"))
    h.update(data)
    if acl is not None:
        h.update(acl.to_json().encode())
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
    return spec.source.snapshot(SourceContext(spec, store_url, records_of))


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












UTF8_BOM = b"\xef\xbb\xbf"






def scan(source: Source | str, spec: InputSpec) -> Iterator[ScannedRecord]:
    """Every record of one input source in order, with its position, validated."""
    return scan_with_header(source, spec)[1]


def scan_with_header(source: Source | str, spec: InputSpec) -> tuple[tuple[str, ...] | None, Iterator[ScannedRecord]]:
    """`scan`, and the column names its slices are read with where its format has them (a CSV
    file's header), read from the same stream (an object is read once)."""
    if spec.format in (STORED, ROWS):
        rows: RowSource = source  # type: ignore[assignment]  # a source of a row input is one
        return None, _scan_rows(rows)
    source = open_source(source, spec.storage_of(source)) if isinstance(source, str) else source
    found: Scan = input_format(spec.format).scan(source, spec)
    return found.header, found.records


UTF8_BOM = b"\xef\xbb\xbf"


def json_object(raw: bytes, path: Path | str, line_no: int) -> dict[str, Any] | None:
    """One line of a JSON Lines file as its object; None for a blank line."""
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
    return obj


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




TEXT_FIELD_SEPARATOR = "\n\n"


def record_text(row: Mapping[str, Any], spec: InputSpec) -> str:
    """A record's text, the one rule every reader composes it by: what the prompt shows, the
    content hash covers and graders read. With input.text_field, that field's value as it is;
    with input.text_fields, each named field as `name: value`, in the listed order, a blank
    line between. Every field must hold a string (an empty one is shown empty, as a lone
    text_field's may be); one missing, null or of another type is refused naming it (the
    caller adds where)."""
    if not spec.text_fields:
        return _text_value(row, spec.text_field)
    return TEXT_FIELD_SEPARATOR.join(f"{name}: {_text_value(row, name)}" for name in spec.text_fields)


def _text_value(row: Mapping[str, Any], name: str) -> str:
    value = row.get(name)
    if not isinstance(value, str):
        what = "missing" if value is None else f"not a string ({type(value).__name__})"
        raise InputError(f"text field {name!r} is {what}")
    return value


def record_from_row(obj: dict[str, Any], path: Path | str, line_no: int, spec: InputSpec,
                    fmt: InputFormat) -> Record:
    """A record from one row of a file (a JSON object, a CSV row, a Parquet row), by the input
    section's field names: its id (or a digest of the row), text, ACL (a text cell read by the
    format's rule), class and carried fields, each checked; refused in one line naming where."""
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
    try:
        text = record_text(obj, spec)
    except InputError as exc:
        raise InputError(f"{path}:{line_no}: id {record_id!r}: {exc}") from None
    acl = _acl(obj, spec, path, line_no, record_id, fmt) if spec.acl_field else None
    data_class = obj.get(spec.class_field) if spec.class_field else None
    carried = _carried(obj, spec, path, line_no, record_id) if spec.carry else None
    return Record(record_id, text, acl, content_hash(text, acl, class_key(spec, data_class)), line_no,
                  data_class, carried=carried)


def _acl(obj: dict[str, Any], spec: InputSpec, path: Path | str, line_no: int, record_id: str,
         fmt: InputFormat) -> Acl:
    """A record's ACL. A missing one is refused unless the spec says what it means: a reader
    downstream would take it for "open to all"."""
    acl = obj.get(spec.acl_field) if spec.acl_field else None
    if isinstance(acl, str):
        acl = fmt.acl_cell(acl, spec, f"{path}:{line_no}: id {record_id!r}")
    if acl is None:
        if spec.acl_missing is not None:
            return Acl(spec.acl_missing)  # checked when the spec was parsed
        what = "null" if spec.acl_field in obj else "missing"
        raise InputError(f"{path}:{line_no}: id {record_id!r}: ACL field {spec.acl_field!r} is {what}; every "
                         "record needs one, or set input.acl_missing to say what a missing one means "
                         '(for example ["restricted"])')
    try:
        return Acl.read(acl)
    except AclUnreadable as exc:
        # A list's entries are checked one by one; a value that is not a list is named whole.
        joint = ": " if str(exc).startswith("entry ") else " "
        raise InputError(f"{path}:{line_no}: id {record_id!r}: ACL field {spec.acl_field!r}{joint}{exc}") from None


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








def class_key(spec: InputSpec, data_class: Any) -> str | None:
    """The class as far as it can decide a route: None without routing, else the class
    string (any other value routes like a missing one, and hashes alike)."""
    if spec.class_field is None:
        return None
    return data_class if isinstance(data_class, str) else ""














def shared_columns(source: Source) -> Mapping[str, Any]:
    """The values of columns every row of `source` shares that its file does not hold (a
    table's partition values, which its log keeps): readers add them to each row."""
    columns: Mapping[str, Any] = getattr(source, "columns", {})
    return columns








# A record without text has no content to match a base version's: its hash is none a text has.
NO_CONTENT = "-"


def _scan_rows(source: RowSource) -> Iterator[ScannedRecord]:
    """An input with no files: each of its source's rows at its position (a row number, as for
    Parquet)."""
    for position, row in enumerate(source.rows()):
        yield ScannedRecord(_row_record(row, position), position, position + 1)


def _row_record(row: StoredRow, position: int) -> Record:
    text = row.text if row.text is not None else ""
    digest = content_hash(text, row.acl) if row.missing is None else NO_CONTENT
    return Record(row.id, text, row.acl, digest, position + 1, missing=row.missing, carried=row.carried)


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
    records = _read_range(sl, spec, stored)
    if sl.route is None:
        return records
    assert routing is not None
    mine = [r for r in records if routing.route_of(r.data_class) == sl.route]
    if by_rows(sl) and parquet_slice_digest(mine) != sl.digest:
        raise InputError(f"input changed since planning: {sl.describe()}")
    return mine


def by_rows(sl: Slice) -> bool:
    """Whether a slice is a range of rows (its records' ids and content hashes are its digest),
    not of bytes."""
    return sl.format in (STORED, ROWS) or isinstance(input_format(sl.format), RowFormat)


def _read_pieces(sl: Slice, spec: InputSpec, routing: RoutingSpec | None,
                 stored: StoredReader | None = None) -> list[Record]:
    """One read of the pieces' whole range; each piece's records checked against its digest."""
    start, end = sl.pieces[0].start, sl.pieces[-1].end
    rowwise = by_rows(sl)  # records by row, digested by id and content hash
    rows: list[Record] | None = _rows(sl, spec, stored, start, end) if rowwise else None
    data = b"" if rowwise else _slice_source(sl, spec).read(start, end)
    out: list[Record] = []
    for p in sl.pieces:
        where = (f"{sl.path}:{p.first_line}: input changed since planning (the {p.records} records from "
                 f"{'row' if rowwise else 'line'} {p.first_line} on)")
        if rows is not None:
            records = rows[p.start - start:p.end - start]
        else:
            chunk = data[p.start - start:p.end - start]
            if "sha256:" + hashlib.sha256(chunk).hexdigest() != p.digest:
                raise InputError(where)
            records = _text_format(sl).parse(chunk, sl, p.start, p.first_line, spec)
        if sl.route is not None:
            assert routing is not None
            records = [r for r in records if routing.route_of(r.data_class) == sl.route]
        if p.ids:
            records = [replace(r, id=p.ids.get(str(r.line), r.id)) for r in records]
        if rowwise and parquet_slice_digest(records) != p.digest:
            raise InputError(where)
        out.extend(replace(r, piece=p.no) for r in records)
    return out


def _read_range(sl: Slice, spec: InputSpec, stored: StoredReader | None = None) -> list[Record]:
    changed = f"input changed since planning: {sl.describe()}"
    if by_rows(sl):
        records = _rows(sl, spec, stored, sl.start, sl.end)
        if (sl.route is None or sl.format in (STORED, ROWS)) and parquet_slice_digest(records) != sl.digest:
            raise InputError(changed)
        return records
    data = _slice_source(sl, spec).read(sl.start, sl.end)
    if "sha256:" + hashlib.sha256(data).hexdigest() != sl.digest:
        raise InputError(changed)
    return _text_format(sl).parse(data, sl, sl.start, sl.first_line, spec)


def _rows(sl: Slice, spec: InputSpec, stored: StoredReader | None, start: int, end: int) -> list[Record]:
    """The records at rows [start, end): the version's own copy of a row input's (STORED), the
    row source's own (ROWS), or a row format's file's."""
    if sl.format == STORED:
        assert stored is not None
        return _stored_rows(sl, stored, start, end)
    if sl.format == ROWS:
        source = row_source(spec)
        out = [_row_record(row, position) for position, row in zip(range(start, end),
                                                                    source.rows_between(start, end), strict=False)]
        if len(out) != end - start:
            raise InputError(f"{sl.describe()}: {source.location} now holds {len(out)} of the shard's "
                             f"{end - start} rows")
        return out
    fmt = input_format(sl.format)
    assert isinstance(fmt, RowFormat)
    return fmt.rows(_slice_source(sl, spec), start, end, spec)


def row_source(spec: InputSpec) -> RowSource:
    """The row source of an input with no files, opened again as its stored section names it
    (once per process: a worker reads many shards of it)."""
    if spec.source not in _ROW_SOURCES:
        [source] = spec.source.snapshot(SourceContext(spec)).files
        _ROW_SOURCES[spec.source] = source  # type: ignore[assignment]  # a row input's one source is one
    return _ROW_SOURCES[spec.source]


_ROW_SOURCES: dict[Any, RowSource] = {}


def _text_format(sl: Slice) -> TextFormat:
    fmt = input_format(sl.format)
    assert isinstance(fmt, TextFormat)
    return fmt


def _slice_source(sl: Slice, spec: InputSpec) -> Source:
    source = open_source(sl.path, sl.storage if sl.storage is not None else spec.storage_of(sl.path), sl.pin)
    return WithColumns(source, sl.columns) if sl.columns else source


def _stored_rows(sl: Slice, stored: StoredReader, start: int, end: int) -> list[Record]:
    """The version's own records at positions [start, end): what planning copied there."""
    out = [Record(r.record_id, r.text if r.text is not None else "", r.acl, r.content_hash, r.position + 1,
                  missing=None if r.text is not None else "no text") for r in stored(start, end)]
    if len(out) != end - start:
        raise InputError(f"{sl.describe()}: the store holds {len(out)} of the shard's {end - start} records")
    return out


# --- the records a sample of results answered (the gate's graders, a judge's input) ---------


class SliceStore(Protocol):
    def shard_slice(self, version: str, shard_no: int) -> dict[str, object]: ...

    def input_records(self, version: str, start: int, end: int) -> list[InputRecord]: ...


def records_of(store: SliceStore, version: str, spec: JobSpec, shard_of: Mapping[str, int]) -> dict[str, Record]:
    """The records `shard_of` names (id -> the shard its result was computed in) as their
    shards' slices hold them, each slice read once; a record its shard does not hold (a
    carried result's) is left out."""
    by_shard: dict[int, set[str]] = {}
    for rid, shard_no in shard_of.items():
        by_shard.setdefault(shard_no, set()).add(rid)
    found: dict[str, Record] = {}
    for shard_no in sorted(by_shard):
        wanted = by_shard[shard_no]
        sl = Slice.from_json(store.shard_slice(version, shard_no))
        for record in read_slice(sl, spec.input, spec.routing,
                                 lambda start, end: store.input_records(version, start, end)):
            if record.id in wanted and record.id not in found:
                found[record.id] = record
    return found
