"""The target ports: where readers see the published version of a name, besides the store.

The store's own pointer (and the view that reads through it) is the truth:
incremental runs (`base: published`), retention and rollback read it. A target
is another place readers look (a Parquet dataset with a `CURRENT` file, a
warehouse table, a vector index) that follows the pointer, and the store records,
with each publication, what the target showed readers after it
(`Publication.targets`, by the target's `key`, which never changes for a target
once it has been recorded):

- `stage` writes a sealed version there, where readers do not see it yet
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
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    from collections.abc import Sequence

    from batchline.sources.base import DatasetName, ParseContext, StoreDatasets
    from batchline.spec.model import JobSpec
    from batchline.spec.reader import Fields, SpecReader
    from batchline.store import ReaderStore, StoredDeadLetter, StoredResult


class PublicationTarget(Protocol):
    @property
    def key(self) -> str:
        """Names the target in the store's publication records (no credentials in it)."""
        ...

    def describe(self) -> str: ...

    def stage(self, store: ReaderStore, version: str) -> bool:
        """Writes the version where readers do not see it yet; False: it was there already."""
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

    def shard_files(self) -> str | None:
        """Where the workers of a version write each completed shard's file for this target
        (`files: per-shard`), or None: the publisher writes every file itself."""
        ...

    def write_shard_file(self, spec: JobSpec, version: str, shard_no: int, epoch: int,
                         results: Sequence[StoredResult], dead_letters: Sequence[StoredDeadLetter],
                         storage: Mapping[str, Any]) -> dict[str, Any]:
        """Writes what a worker computed of its shard (its results and dead letters, in this
        target's columns) as one file named by the version, the shard and the lease epoch,
        whole or not at all; returns what the store records of it (`path`, `rows`, `pin`)."""
        ...


class PublisherWritten:
    """A target whose files the publisher writes, none of them a worker's (no `files: per-shard`)."""

    def describe(self) -> str:
        raise NotImplementedError

    def shard_files(self) -> str | None:
        return None

    def write_shard_file(self, spec: JobSpec, version: str, shard_no: int, epoch: int,
                         results: Sequence[StoredResult], dead_letters: Sequence[StoredDeadLetter],
                         storage: Mapping[str, Any]) -> dict[str, Any]:
        raise NotImplementedError(f"{self.describe()} takes no shard files from workers")


class TargetFamily(ABC):
    """One member of the TARGETS table."""

    name: ClassVar[str]
    # The output keys that name it (a job may name several targets), each with the JSON
    # Schema of its value.
    keys: ClassVar[Fields]

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
