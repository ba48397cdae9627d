"""What the spec holds of its plug-ins: the ports a source's and a target's parsed section fill.

A job's `input` section is parsed, by the family that owns its key, into an `InputSource`
(`input.path` into a `FileSet` of the locations each location family expands), and each
target key of its `output` section into a `TargetSpec`, which builds the `PublicationTarget`
a publish writes and shows. The spec layer owns these types, so a spec names its plug-ins'
parts without importing a plug-in: the families themselves are reached through the registry
(`batchline.registry`), which imports each module only when a spec names it. The families'
base modules (`batchline.sources.base`, `batchline.targets.base`) take their names from here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol

from batchline.registry import location_family

if TYPE_CHECKING:
    from batchline.spec.model import InputSpec, JobSpec
    from batchline.spec.parse import JobVersion
    from batchline.spec.reader import ParseContext, SpecReader
    from batchline.store import ReaderStore, StoredDeadLetter, StoredResult, StoreHandle


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
    """How the job's store names its own datasets for lineage (`namespace`): a published
    name's view, what readers read (`of`, names after `prefix`), and a job's results at one
    version, what its computation wrote whether or not it is ever published (`results`,
    names after `results_prefix`)."""

    namespace: str
    prefix: str = ""
    results_prefix: str = "results."

    def of(self, name: str, version: str | None = None) -> DatasetName:
        return DatasetName(self.namespace, f"{self.prefix}{name}", version)

    def results(self, name: str, version: str | None = None) -> DatasetName:
        return DatasetName(self.namespace, f"{self.results_prefix}{name}", version)


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
class SourceContext:
    """What pinning or reopening a snapshot needs besides the source's own section."""

    input: InputSpec  # the fields records are read by (a table checks that its columns hold them)
    store_url: str | None = None  # the store's database, where a catalog may live
    # Reads the records some results of a version answered (ids -> their shards) from that
    # version's input, by their slices: the snapshot layer's, for a source that reads a job's
    # records with its results (a judge's input).
    records_of: RecordsOf | None = None


class RecordsOf(Protocol):
    def __call__(self, store: Any, version: str, spec: JobSpec, shard_of: Mapping[str, int]
                 ) -> Mapping[str, Any]: ...


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


def pin_version(pin: Mapping[str, Any] | None) -> str | None:
    """The version lineage gives a file or object read at `pin`: its object version or
    generation, else its ETag, else its content digest."""
    if pin is None:
        return None
    for key in ("version", "etag", "digest"):
        if pin.get(key):
            return str(pin[key])
    return None


@dataclass(frozen=True)
class FileSet:
    """An input that is a list of files or objects (`input.path`, or a family's list such as
    a manifest's), each pinned by the family that opens it."""

    locations: tuple[str, ...]
    format: str | None = None

    def describe(self) -> str:
        return ", ".join(self.locations)

    def to_dict(self) -> dict[str, Any]:
        return {"path": list(self.locations)}

    def datasets(self, pins: Sequence[Mapping[str, Any]], store: StoreDatasets) -> list[DatasetName]:
        by_location = {str(p.get("location")): p for p in pins}
        return [location_dataset(location, pin_version(by_location.get(location))) for location in self.locations]

    def snapshot(self, ctx: SourceContext) -> Snapshot:
        files: list[Source] = [location_family(location).open(location, ctx.input.storage_of(location))
                               for location in self.locations]
        pins = [s.pin() for s in files]
        return Snapshot(self, files, pins, lambda: all(s.still(p) for s, p in zip(files, pins, strict=True)))


def expand_paths(value: Any, r: SpecReader, ctx: ParseContext, field: str = "input.path") -> FileSet:
    """`input.path` (one location or a list; or a region's, `field`), each expanded by the
    family that opens it; a stored spec's are taken as they are."""
    items = value if isinstance(value, list) else [value]
    if not items:
        r.fail(field, "is empty")
    locations: list[str] = []
    for i, item in enumerate(items):
        where = f"{field}[{i}]" if isinstance(value, list) else field
        text = r.string(item, where)
        locations.extend([text] if ctx.resolved else location_family(text).expand(text, where, r, ctx))
    return FileSet(tuple(locations))


@dataclass(frozen=True)
class Staging:
    """Where a version's workers write their shard files (`output.*.staging`): one prefix, or one
    per region (`{REGION: PREFIX, ...}`), so each worker writes near where it runs. The first is
    where a worker of no region, or of a region without a prefix of its own, writes. Which prefix
    a shard's file must be under is derived from the store (where the shard's completing lease
    was claimed), never taken from the worker."""

    by_region: tuple[tuple[str, str], ...]  # (region, prefix); one prefix for all has region ""

    @classmethod
    def one(cls, prefix: str) -> Staging:
        return cls((("", prefix),))

    def prefix_for(self, region: str | None) -> str:
        return next((p for r, p in self.by_region if r and r == region), self.by_region[0][1])

    @property
    def prefixes(self) -> list[str]:
        return list(dict.fromkeys(p for _r, p in self.by_region))

    def to_json(self) -> str | dict[str, str]:
        if len(self.by_region) == 1 and not self.by_region[0][0]:
            return self.by_region[0][1]
        return dict(self.by_region)

    def __str__(self) -> str:
        return ", ".join(f"{p} ({r})" if r else p for r, p in self.by_region)


class PublicationTarget(Protocol):
    @property
    def key(self) -> str:
        """Names the target in the store's publication records (no credentials in it)."""
        ...

    def describe(self) -> str: ...

    def claim(self, name: str, store: StoreHandle) -> None:
        """Records `store` as the one store that publishes `name` into this target, or refuses
        a target that another store publishes into (`batchline.targets.owner`), before anything
        is written there."""
        ...

    def stage(self, store: ReaderStore, job: JobVersion) -> bool:
        """Writes the version where readers do not see it yet (its results read from `store`);
        False: it was there already."""
        ...

    def show(self, name: str, version: str, recorded: dict[str, Any] | None) -> dict[str, Any]: ...

    def restore(self, name: str, recorded: dict[str, Any] | None, shown: dict[str, Any]) -> None: ...

    def forget(self, name: str, version: str) -> None: ...


class TargetSpec(Protocol):
    """The part of a job's `output` section that names one target."""

    def describe(self) -> str: ...

    def to_dict(self) -> dict[str, Any]:
        """Its keys of the stored output section: what its family's `parse` reads back."""
        ...

    def target(self, store_url: str | None, storage: Mapping[str, Any]) -> PublicationTarget:
        """The target, reached with the store URL the command was given (a catalog in the
        store's database) and the job's lake settings (`input.storage`)."""
        ...

    def check(self, spec: JobSpec, store_url: str | None) -> None:
        """Refuses, at planning, a job whose results this target could not take (a table
        whose columns the output schema would change), so nothing is run for nothing."""
        ...

    def dataset(self, name: str, store: StoreDatasets, state: Mapping[str, Any] | None) -> DatasetName:
        """What lineage names as the publication's output here: the table, dataset or index
        of the job `name`, at the version `state` (what `show` returned) says readers see."""
        ...

    def shard_files(self) -> Staging | None:
        """Where the workers of a version write each completed shard's file for this target
        (`files: per-shard`), or None: the publisher writes every file itself."""
        ...

    def write_shard_file(self, spec: JobSpec, version: str, shard_no: int, epoch: int,
                         results: Sequence[StoredResult], dead_letters: Sequence[StoredDeadLetter],
                         storage: Mapping[str, Any], region: str | None = None) -> dict[str, Any]:
        """Writes what a worker computed of its shard (its results and dead letters, in this
        target's columns) as one file named by the version, the shard and the lease epoch, under
        its `region`'s staging prefix, whole or not at all; returns what the store records of it
        (`path`, `rows`, `pin`)."""
        ...

    def stored_shard_rows(self, store: ReaderStore, spec: JobSpec, version: str) -> Callable[[int], Any]:
        """The rows this target's file of each shard must hold (an Arrow table for a shard's
        number), read from the store: what a worker's recorded file is checked against before it
        is published."""
        ...


@dataclass(frozen=True)
class GraderContext:
    """What a grader's parser needs of the job besides its own section of `validate`."""

    name: str  # the job's name
    base_dir: Path  # a file the section names is relative to the spec's folder
    resolved: bool  # a planned job's stored form: files the section named are already inline
    output_schema: Mapping[str, Any]
    label_field: str | None
    acl_field: str | None  # input.acl_field: a grader that runs a job over this one carries the ACLs
    workers_batch: int  # shards.batch_size: the workers' batch size


class GraderSpec(Protocol):
    """A grader's parsed section of `validate` (a type of the grader's own module): `key` is
    the section's key; `to_dict` its stored form, which the grader's parser reads back."""

    @property
    def key(self) -> str: ...

    def to_dict(self) -> Any: ...


class GraderParser(Protocol):
    """The parsing side of a GRADERS member: the `validate` keys it owns (`keys`, each with
    its JSON Schema), the fields of its section where the section is a mapping, and its parser."""

    keys: Mapping[str, Mapping[str, Any]]
    fields: Mapping[str, Mapping[str, Any]]
    required: frozenset[str]
    check: str  # the name of the check it reports
    # Grading runs a model (an engine, or an embedding model): where the model is, then, never
    # on an orchestrator's worker.
    runs_model: bool

    def parse(self, key: str, value: Any, r: SpecReader, ctx: GraderContext) -> GraderSpec: ...
