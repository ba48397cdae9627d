"""The source ports: what the planner and the workers need of an input.

Two kinds of plug-in make up the `SOURCES` table (batchline.registry), each a
`SourceFamily`:

- a family that opens *locations* (`schemes`): a local path, or an `s3://` or
  `gs://` object. Each location is a `Source` (pinned, streamed, read in ranges).
  `input.path` is a list of locations, each expanded (globs, listings) by the
  family that opens it; every reader of a location (the planner's scan, a
  worker's slice, an export's re-read, the weights fetcher) goes through the
  family that claims its scheme;
- a family that owns *input keys* (`keys`): `input.manifest` (a list of objects),
  `input.table` (a table's snapshot). Its `parse` validates its own section and
  returns an `InputSource`, which pins the snapshot at planning and lists the
  locations it is read from.

A source contributes to the job version only through its pins (the snapshot
digest), never through how its section is written, so moving a key into a
plug-in moves no version.

The types a parsed section is (`InputSource`, and what it reads: `Source`, `Pin`,
`Snapshot`) belong to the spec layer (`batchline.spec.ports`), which holds them; they are
taken from there.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, ClassVar, Protocol

from batchline.errors import InputError
from batchline.spec.ports import (
    DatasetName,
    InputSource,
    Pin,
    Snapshot,
    Source,
    SourceContext,
    StoreDatasets,
    location_dataset,
)

__all__ = [
    "READ_METER",
    "DatasetName",
    "InputSource",
    "KeyedFamily",
    "LocationFamily",
    "Pin",
    "RowSource",
    "RowsNotBytes",
    "Snapshot",
    "Source",
    "SourceContext",
    "SourceFamily",
    "StoreDatasets",
    "StoredRow",
    "WithColumns",
    "location_dataset",
]

if TYPE_CHECKING:
    from batchline.acl import Acl
    from batchline.spec.reader import Fields, ParseContext, SpecReader












class ReadMeter:
    """The bytes this process has read from object stores (every source family that reaches a
    store over the network adds what it receives): a worker measures a shard's read by it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total = 0

    def add(self, n: int) -> None:
        with self._lock:
            self._total += n

    @property
    def total(self) -> int:
        return self._total


READ_METER = ReadMeter()


@dataclass(frozen=True)
class StoredRow:
    """A record of an input with no files, as its source hands it (`RowSource`)."""

    id: str
    text: str | None  # None: the record has none to read (`missing` says why)
    acl: Acl | None
    missing: str | None = None
    carried: Mapping[str, Any] | None = None  # output.carry's fields, as the source holds them


class RowSource(Protocol):
    """The rows port: an input with no files, whose source hands its records as rows (a
    published job's results, a warehouse query). Its `InputSource` says so by its `format`:

    - `store` (`spec.STORED`): planning reads the rows in order (`rows`) and copies
      them into the version's own records, and a worker reads its shard's from there, so the
      version never depends on the source again (a published job's results may be pruned);
    - `rows` (`spec.ROWS`): planning reads the rows in order and pins what they were (their
      ids and content hashes, a shard's digest), and a worker reads its shard's rows again
      from the source itself (`rows_between`), checked against that digest, so a source
      that changed since planning is refused per shard as a changed file is.

    Either way the snapshot's digest is the source's own pins (`InputSource.snapshot`), and
    its `location` names it in messages."""

    location: str

    def rows(self) -> Iterator[StoredRow]:
        """Every record, in the input's order."""
        ...

    def rows_between(self, start: int, end: int) -> Sequence[StoredRow]:
        """The records at positions [start, end) of the input's order (`rows` format only)."""
        ...








class RowsNotBytes:
    """What a row source answers where a reader of files would ask it for bytes: it has none.
    A row source is handed where a snapshot's files are (`Snapshot.files`), so it answers a
    file's questions too; one that can pin itself (a database file's digest) says so by
    overriding `pin` and `still`."""

    location: str
    # What its records are, as a refusal says it.
    rows_are: ClassVar[str] = "its records are rows, not a file"

    def _no_bytes(self) -> InputError:
        return InputError(f"{self.location}: {self.rows_are}")

    def pin(self) -> Pin:
        raise self._no_bytes()

    def stream(self) -> BinaryIO:
        raise self._no_bytes()

    def read(self, start: int, end: int) -> bytes:
        raise self._no_bytes()

    def random_access(self) -> BinaryIO:
        raise self._no_bytes()

    def still(self, pin: Pin) -> bool:
        return True

    def slice_pin(self) -> Pin | None:
        return None


class SourceFamily:
    """What every member of the SOURCES table provides: its name, and what
    `grants` and `launch k8s` say of the part of a spec it owns."""

    name: ClassVar[str]

    def access(self, section: Mapping[str, Any]) -> list[str]:
        """What a worker (and the planner) must be able to read, as `batchline grants` prints
        it, for the part of a stored input section this family owns."""
        return []

    def pod_refusal(self, section: Mapping[str, Any], where: str) -> str | None:
        """Why pods elsewhere could not plan or read this part of a raw spec (a file on this
        machine, a catalog only this machine reaches), or None: `launch k8s --schedule`
        refuses a spec its pods would fail on."""
        return None

    def reads_versions(self, section: Mapping[str, Any]) -> list[str]:
        """The job versions of the store that the part of a stored input section this family
        owns reads (a job over a published job): retention keeps each while a version
        planned on it is not sealed."""
        return []

    def reads_published(self, section: Mapping[str, Any]) -> list[tuple[str, str | None]]:
        """The published names of the store that the part of a stored input section this family
        owns reads (a job over a published job), each with the version it was pinned to: the
        ACLs its records came with are the ones that name publishes now."""
        return []


class LocationFamily(SourceFamily, ABC):
    """A family that opens locations: local paths, objects."""

    schemes: ClassVar[tuple[str, ...]]  # the location prefixes it opens ("" for a plain path)

    @abstractmethod
    def expand(self, location: str, where: str, r: SpecReader, ctx: ParseContext) -> list[str]:
        """A location as a spec writes it (a glob, a relative path) as the locations it names."""

    @abstractmethod
    def open(self, location: str, storage: Mapping[str, Any] | None = None, pin: Pin | None = None) -> Source:
        """The source at `location`, read conditional on `pin` when one is given."""

    @abstractmethod
    def upload(self, path: Path, location: str, storage: Mapping[str, Any] | None = None) -> None:
        """A local file to `location`, whole: readers there see the old content or all of the new."""

    @abstractmethod
    def download(self, location: str, dest: Path, storage: Mapping[str, Any] | None = None) -> Path:
        """What is at `location` (a file, or a folder when it ends in `/`) copied to `dest`."""

    @abstractmethod
    def listing(self, prefix: str, storage: Mapping[str, Any] | None = None) -> list[tuple[str, float]]:
        """Every file or object under `prefix`, each with when it was last written (seconds since
        the epoch); none where nothing is there."""

    @abstractmethod
    def delete(self, location: str, storage: Mapping[str, Any] | None = None) -> None:
        """Removes the file or object at `location`; nothing where it is gone already."""

    def location_access(self, locations: Sequence[str], what: str) -> list[str]:
        """What `grants` prints for locations it opens (`what`: "input snapshot", "model weights")."""
        return []

    def location_refusal(self, location: str, where: str) -> str | None:
        """Why pods elsewhere could not read this location, or None."""
        return None


class KeyedFamily(SourceFamily, ABC):
    """A family that owns input keys: a manifest, a table."""

    # The input keys that select it (a job's input names exactly one of all the families'
    # keys, or `path`), each with the JSON Schema of its value.
    keys: ClassVar[Fields]
    # Other input fields only it reads (with their schema), allowed beside its key.
    options: ClassVar[Fields] = {}

    @abstractmethod
    def parse(self, key: str, section: Mapping[str, Any], r: SpecReader, ctx: ParseContext) -> InputSource:
        """Its part of the input section (`section[key]`, and its options), validated."""


class WithColumns:
    """A source whose rows all share values of columns its file does not hold (a table's
    partition values, which its log keeps rather than its data files): readers add
    `columns` to every row, and a shard's slice carries them to its worker."""

    def __init__(self, source: Source, columns: Mapping[str, Any]) -> None:
        self.source = source
        self.columns = dict(columns)
        self.location = source.location

    def pin(self) -> Pin:
        return self.source.pin()

    def stream(self) -> BinaryIO:
        return self.source.stream()

    def read(self, start: int, end: int) -> bytes:
        return self.source.read(start, end)

    def random_access(self) -> BinaryIO:
        return self.source.random_access()

    def still(self, pin: Pin) -> bool:
        return self.source.still(pin)

    def slice_pin(self) -> Pin | None:
        return self.source.slice_pin()
