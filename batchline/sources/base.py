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
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, ClassVar, Protocol

if TYPE_CHECKING:
    from batchline.spec.model import InputSpec
    from batchline.spec.reader import Fields, SpecReader


@dataclass(frozen=True)
class Pin:
    """What a source guarantees about its content at planning time. It goes into the
    snapshot digest (and so the job version), and reads are checked against it."""

    name: str  # the location's last part, as it goes into the digest
    size: int
    digest: str | None = None  # a local file: the sha256 of its bytes
    etag: str | None = None  # an object: its ETag
    version: str | None = None  # an object: its version id or generation
    changed_at: int | None = None  # a local file: its modification time (a cheap check, not in the digest)

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in (("name", self.name), ("size", self.size), ("etag", self.etag),
                                  ("version", self.version)) if v is not None}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Pin:
        return cls(str(data["name"]), int(data["size"]), etag=data.get("etag"), version=data.get("version"))

    def material(self) -> str:
        if self.digest is not None:
            return f"{self.name}\0{self.digest}\n"
        return f"{self.name}\0{self.size}\0{self.etag or ''}\0{self.version or ''}\n"


@dataclass(frozen=True)
class DatasetName:
    """A dataset as lineage names it (OpenLineage's naming: the namespace is the datasource, a
    scheme and authority; the name its path or table), and the version read or written."""

    namespace: str
    name: str
    version: str | None = None
    # An input whose fields are not the spec's input fields (the results of a job read with
    # input.job): what it calls the record's id, text, ACL, and the prefix of a carried field.
    fields: tuple[tuple[str, str], ...] = ()

    def field(self, role: str, default: str) -> str:
        return dict(self.fields).get(role, default)


def location_dataset(location: str, version: str | None = None) -> DatasetName:
    """A file or object by its location: `s3://bucket` or `gs://bucket` with the key as its
    name, and `file` with an absolute path for a local one."""
    for scheme in ("s3://", "gs://"):
        if location.startswith(scheme):
            bucket, _, key = location[len(scheme):].partition("/")
            return DatasetName(f"{scheme}{bucket}", key, version)
    path = location[len("file://"):] if location.startswith("file://") else location
    return DatasetName("file", str(Path(path).absolute()), version)


@dataclass(frozen=True)
class StoreDatasets:
    """How the job's store names its own datasets for lineage: a published name's results
    (the store's view) read through the store (`namespace`, names after `prefix`)."""

    namespace: str
    prefix: str = ""

    def of(self, name: str, version: str | None = None) -> DatasetName:
        return DatasetName(self.namespace, f"{self.prefix}{name}", version)


class Source(Protocol):
    """One input file or object. Every read refuses, with an InputError naming the
    location, a source that is gone or unreadable."""

    location: str

    def pin(self) -> Pin:
        """Reads what the source guarantees about itself now."""
        ...

    def stream(self) -> BinaryIO:
        """The whole content, front to back (planning scans it once)."""
        ...

    def read(self, start: int, end: int) -> bytes:
        """Bytes [start, end); an InputError if the source is now shorter than `end`."""
        ...

    def random_access(self) -> BinaryIO:
        """A seekable file object (Parquet reads its footer, then row groups). An object's
        also has `prefetch(start, end)`, which fetches a span in one request."""
        ...

    def still(self, pin: Pin) -> bool:
        """Whether what was read since `pin` was taken is what `pin` describes."""
        ...

    def slice_pin(self) -> Pin | None:
        """The pin a shard's slice carries, so a worker's reads are conditional on it
        (None for a local file: its slices' digests are checked instead)."""
        ...


@dataclass(frozen=True)
class StoredRow:
    """A record of an input read from the store (a job over a published job), as its
    source hands it to the planner."""

    id: str
    text: str | None  # None: the record has none to read (`missing` says why)
    acl: Any
    missing: str | None = None
    carried: Mapping[str, Any] | None = None  # output.carry's fields, as the source holds them


class StoredRows(Protocol):
    """A source whose records are rows the store holds (its `format` is `store`): the
    planner reads them in order, copies them into the version's own records, and a
    worker reads its shard's from there."""

    location: str

    def rows(self) -> Iterator[StoredRow]:
        """Every record, in the input's order."""
        ...


@dataclass(frozen=True)
class ParseContext:
    """What a family's parser needs besides its own section."""

    base_dir: Path  # relative paths in a spec are relative to its file
    storage: Mapping[str, Any]  # input.storage: where the object store is
    # The spec is a planned job's stored form: locations are already resolved, listed and
    # expanded, and are taken as they are (nothing is read again).
    resolved: bool = False


@dataclass(frozen=True)
class SourceContext:
    """What pinning or reopening a snapshot needs besides the source's own section."""

    input: InputSpec  # the fields records are read by (a table checks that its columns hold them)
    store_url: str | None = None  # the store's database, where a catalog may live


@dataclass
class Snapshot:
    """A source as planning pinned it: the locations it is read from, in order, and what
    the snapshot's digest is taken over."""

    source: InputSource  # as pinned (a table's snapshot id written in)
    files: list[Source]
    pins: list[Pin]
    # Whether what was read since the pins were taken is still what they describe.
    still: Callable[[], bool] = field(default=lambda: True)


class InputSource(Protocol):
    """The part of a job's `input` section that says where its snapshot is."""

    @property
    def locations(self) -> tuple[str, ...]:
        """The files or objects it names, where the section names them (a table's data
        files are known only once its snapshot is read)."""
        ...

    @property
    def format(self) -> str | None:
        """The format its files are always read in (a table's Parquet), or None: the spec's
        `input.format`, or else the files' suffixes, decide."""
        ...

    def describe(self) -> str: ...

    def to_dict(self) -> dict[str, Any]:
        """Its keys of the stored input section: what `parse` reads back, resolved."""
        ...

    def snapshot(self, ctx: SourceContext) -> Snapshot:
        """Reads and pins the snapshot (at planning), or reopens the one the stored
        section names (an export's re-read, a check of coverage)."""
        ...

    def datasets(self, pins: Sequence[Mapping[str, Any]], store: StoreDatasets) -> list[DatasetName]:
        """What lineage names as the run's inputs: each dataset the snapshot read, at the
        version planning pinned (`pins`: the stored pins of its files, in order, where the
        version kept them; empty for a version planned before pins were kept)."""
        ...


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
