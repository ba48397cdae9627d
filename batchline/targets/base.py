"""The target ports: where readers see the published version of a name, besides the store.

The store's own pointer (and the view that reads through it) is the truth:
incremental runs (`base: published`), retention and rollback read it. A target
is another place readers look (a Parquet dataset with a `CURRENT` file, a
warehouse table, a vector index) that follows the pointer, and the store records,
with each publication, what the target showed readers after it
(`Publication.targets`, by the target's `key`, which never changes for a target
once it has been recorded):

- `stage` writes a sealed version there (handed its record and its parsed spec,
  `JobVersion`, resolved once by the publisher), where readers do not see it yet
  (idempotent: a version staged before is not written again), and says whether
  it wrote anything: a publish of the version published already stages it again,
  so a target whose data was removed is written back;
- `show` makes a staged version the one readers see, in one atomic step, only
  from the state the store recorded last (`recorded`; None before the first
  publication with this target); it refuses, with one line, a target that
  shows something else, so store and target never disagree silently; it
  returns the state to record;
- `restore` puts a target back to the state the store recorded, when the store's
  own publish failed or was refused after `show` (only if the target still shows
  what `show` left: one that shows something else was moved on since by another
  publisher, whose publication the store recorded, and is left as it is);
- `forget` removes a version's data once retention has dropped the version.

Two publishers of one name are kept apart by the publish path
(`batchline.publish.pointer`), not by each target: the publisher reads the name's
latest publication, shows each target from what it recorded, and the store
records the publication only if that is still the latest one (a compare-and-set
in the store, refused with `PublicationMoved`), else the targets are put back.
So a target that can check nothing in `show` (a store without a conditional
write) still never disagrees with the store once both publishers return.

Each member of the TARGETS table (batchline.registry) is a `TargetFamily`: it owns
keys of the job's `output` section, parses them into a `TargetSpec`, and builds
the `PublicationTarget` from it.

Two more ports a family may fill:

- **search** (`Searchable`): a target whose readers search a published version's
  vectors behind each record's ACL. `batchline search` and `Jobs.search` find it
  among the targets the published version's spec names (`searchable`), embed the
  query with the version's own pinned engine, and hand it the caller's checked
  `Groups` and an `Admit` check of the upstream's current ACLs; the target ranks.
- **export** (`FileExport`, the EXPORTS table): a file a version's results are
  written to on demand (`batchline export --format NAME`, `Jobs.export`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from batchline.spec.ports import PublicationTarget, Staging, TargetSpec

if TYPE_CHECKING:
    from collections.abc import Sequence

    from batchline.acl import Groups
    from batchline.spec.model import JobSpec
    from batchline.spec.reader import Fields, ParseContext, SpecReader
    from batchline.store import ReaderStore, StoredDeadLetter, StoredResult






__all__ = [
    "Admit", "Answer", "ExportResult", "FileExport", "Hit", "PublicationTarget", "PublisherWritten", "Searchable",
    "TargetFamily", "TargetSpec", "searchable",
]


class PublisherWritten:
    """A target whose files the publisher writes, none of them a worker's (no `files: per-shard`)."""

    def describe(self) -> str:
        raise NotImplementedError

    def shard_files(self) -> Staging | None:
        return None

    def write_shard_file(self, spec: JobSpec, version: str, shard_no: int, epoch: int,
                         results: Sequence[StoredResult], dead_letters: Sequence[StoredDeadLetter],
                         storage: Mapping[str, Any], region: str | None = None) -> dict[str, Any]:
        raise NotImplementedError(f"{self.describe()} takes no shard files from workers")

    def stored_shard_rows(self, store: ReaderStore, spec: JobSpec, version: str) -> Callable[[int], Any]:
        raise NotImplementedError(f"{self.describe()} takes no shard files from workers")


class TargetFamily(ABC):
    """One member of the TARGETS table."""

    name: ClassVar[str]
    # The output keys that name it (a job may name several targets), each with the JSON
    # Schema of its value.
    keys: ClassVar[Fields]
    # Whether the targets it builds are searched (`Searchable`): a refused search names its keys.
    searchable: ClassVar[bool] = False

    @abstractmethod
    def parse(self, key: str, section: Mapping[str, Any], r: SpecReader, ctx: ParseContext) -> TargetSpec:
        """Its part of the output section (`section[key]`), validated."""

    def access(self, section: Mapping[str, Any]) -> list[str]:
        """What the publisher (and the worker, which usually needs nothing) must be able to
        reach, as `batchline grants` prints it, for its part of a stored output section."""
        return []

    def pod_refusal(self, section: Mapping[str, Any], where: str) -> str | None:
        """Why a scheduled job's pods could not publish into this part of a raw spec, or None."""
        return None


# --- search -----------------------------------------------------------------------------------

# Of a batch of candidate record ids, those that may be served now.
Admit = Callable[[list[str]], set[str]]


@dataclass(frozen=True)
class Hit:
    """One search result: the record, how near it is (cosine similarity, 1 is the same
    direction), its chosen fields, and the version it was answered from."""

    record_id: str
    score: float
    fields: dict[str, Any]
    version: str

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.record_id, "score": self.score, "fields": self.fields, "version": self.version}


@dataclass(frozen=True)
class Answer:
    """A search's hits (nearest first), the way it ranked (a name its target gives: `exact`,
    `ivf_pq`, `fallback`, ...), and how many candidates its `admit` check withheld."""

    hits: list[Hit]
    path: str
    withheld: int = 0


class Searchable(ABC):
    """The search port: a `TargetSpec` whose target readers search. The caller's groups come
    checked (`batchline.acl.Groups`), and the target serves only rows whose ACL admits them
    (`batchline.acl`'s rule: exact equality); `admit`, where given, is checked of every
    candidate before it is served, and a withheld candidate is replaced by a further one."""

    @abstractmethod
    def query_vector(self, output: str) -> list[float]:
        """The vector in an engine's output for a query (the job's engine, given the query's
        text as a record's), read as a row's vector is read."""

    @abstractmethod
    def search(self, name: str, version: str, vector: Sequence[float], groups: Groups, k: int, *,
               storage: Mapping[str, Any], admit: Admit | None = None) -> Answer:
        """The `k` rows of `version` (published as `name`) nearest `vector` that `groups` may
        see, nearest first; `storage`: the job's lake settings (`input.storage`)."""


def searchable(spec: JobSpec) -> Searchable | None:
    """The target of a version's spec that readers search, or None."""
    for target in spec.targets:
        if isinstance(target, Searchable):
            return target
    return None


# --- export -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExportResult:
    version: str
    count: int  # results written (openai-batch: lines of the output file)
    path: Path | str | None  # an object URL as a string; None: to stdout
    errors: int = 0  # openai-batch: lines of the error file
    errors_path: Path | None = None
    pending: int = 0  # openai-batch with partial: records without an outcome yet
    current: Path | str | None = None  # a published name's Parquet dataset: the CURRENT file naming the version


class FileExport(ABC):
    """A member of the EXPORTS table: a file format a version's results are exported in."""

    name: ClassVar[str]
    help: ClassVar[str]  # one line for `batchline export --help`
    # Whether it writes an error file beside its output (`--errors`).
    errors_file: ClassVar[bool] = False

    @abstractmethod
    def export(self, store: ReaderStore, target: str, out: str | None, errors: str | None,
               partial: bool) -> ExportResult:
        """Writes the results of `target` (a version, or the version published under a name)
        to `out` (None: its default), whole or not at all; a version not sealed yet only with
        `partial`."""
