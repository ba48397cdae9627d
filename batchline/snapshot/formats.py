"""The format port: how the records of one input file or object are read.

Each member of the FORMATS table (batchline.registry) is an `InputFormat`: JSONL, CSV,
Parquet and OpenAI batch files, one module each under `batchline.formats`. A format owns
its options (the input keys only it reads, such as CSV's rule for ACL cells), the suffixes a
file of it is known by, and how its records are read:

- planning scans a file once, front to back (`scan`), and cuts it into shards;
- a worker reads its shard's slice again: a `TextFormat` as a byte range (the planner's
  digest of those bytes checked first, then `parse`), a `RowFormat` as a range of rows
  (`rows`, whose records' ids and content hashes are checked against the planner's);
- where a format reads records differently from the common rule (an ACL cell that holds
  several groups in text), it is the format's rule (`acl_cell`, `refusal`), applied by
  `batchline.snapshot.reading.record_from_row`.

What every format shares (a record, its content hash, the slice a shard reads, the digests)
stays in `batchline.snapshot.reading`. A source with no files (a published job's results, a
warehouse query) has no format: its rows come through the rows port
(`batchline.sources.base.RowSource`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from batchline.registry import FORMATS

if TYPE_CHECKING:
    from batchline.snapshot.reading import Record, ScannedRecord, Slice
    from batchline.sources import Source
    from batchline.spec import InputSpec
    from batchline.spec.reader import Fields, SpecReader


@dataclass(frozen=True)
class Scan:
    """A file's records in order, and the column names its slices are read with (a CSV file's
    header row; None for a format whose every slice names its own)."""

    header: tuple[str, ...] | None
    records: Iterator[ScannedRecord]


class InputFormat(ABC):
    """A member of the FORMATS table."""

    name: ClassVar[str]
    # File suffixes that choose it when input.format is not given (none: only by name).
    suffixes: ClassVar[tuple[str, ...]] = ()
    # A shard's slice is a range of rows, not of bytes.
    by_rows: ClassVar[bool] = False
    # A record is a conversation that carries its own prompt (the job's prompt is not used).
    chat: ClassVar[bool] = False
    # The input keys only it reads, each with the JSON Schema of its value.
    options: ClassVar[Fields] = {}

    def parse_options(self, section: Mapping[str, Any], acl_field: str | None, r: SpecReader) -> dict[str, Any]:
        """Its options in a job's input section, validated, as the stored spec keeps them (only
        those set, so a job without them keeps its version)."""
        return {}

    def foreign_option(self, key: str, fmt: str) -> str:
        """Why its option `key` is refused for an input of another format, `fmt`."""
        return f"goes with input.format {self.name}, not {fmt}"

    @abstractmethod
    def scan(self, source: Source, spec: InputSpec) -> Scan:
        """Every record of one file, in order, with where each begins and ends, validated."""

    @abstractmethod
    def count(self, source: Source) -> int:
        """About how many records the file holds, cheaply (for sizing shards)."""

    def row_groups(self, source: Source) -> list[int] | None:
        """Rows in each of the file's row groups, where a shard must take whole ones; None."""
        return None

    def acl_cell(self, cell: str, spec: InputSpec, where: str) -> list[str] | None:
        """A record's ACL given as text (a cell), as the groups it holds under this format's rule;
        None for an empty cell (a missing ACL). By default one string is one group."""
        return [cell]

    def checks_records(self, spec: InputSpec) -> bool:
        """Whether planning must ask `refusal` of each record this format reads for `spec`."""
        return False

    def refusal(self, record: Record, spec: InputSpec, location: str) -> str | None:
        """Why planning refuses a record this format read, or None."""
        return None


class TextFormat(InputFormat):
    """A format read in byte ranges: a shard's slice is the bytes from its first record to its
    last, digested at planning and checked before a worker parses them."""

    @abstractmethod
    def parse(self, data: bytes, sl: Slice, offset: int, first_line: int, spec: InputSpec) -> list[Record]:
        """The records in `data`, the slice's bytes from `offset` on (`first_line`: the line
        the bytes start at)."""

    def count(self, source: Source) -> int:
        """Lines of a local file; for an object, the lines of its first MiB scaled to its size
        (one ranged read, not two whole reads of every object)."""
        pin = source.slice_pin()  # an object's pin, taken once at planning
        if pin is not None:
            size = pin.size
            sample = source.read(0, min(size, ESTIMATE_SAMPLE_BYTES))
            if not sample:
                return 0
            return round(sample.count(b"\n") * size / len(sample)) or 1
        lines = 0
        with source.stream() as f:
            while chunk := f.read(1 << 22):
                lines += chunk.count(b"\n")
        return lines


ESTIMATE_SAMPLE_BYTES = 1 << 20


class RowFormat(InputFormat):
    """A format read in ranges of rows: a shard's slice is whole row groups, its records' ids
    and content hashes digested at planning and checked when a worker reads them."""

    by_rows = True

    @abstractmethod
    def rows(self, source: Source, start: int, end: int, spec: InputSpec) -> list[Record]:
        """The records at rows [start, end) of the file."""


def input_format(name: str) -> InputFormat:
    """The FORMATS member named `name` (a job's `input.format`)."""
    member: InputFormat = FORMATS[name].load()
    return member
