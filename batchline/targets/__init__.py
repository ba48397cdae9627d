"""Publication targets: where readers see the published version of a name.

The store's own pointer (and the view that reads through it) is the truth:
incremental runs (`base: published`), retention and rollback read it. A target
is another place readers look (a Parquet dataset with a `CURRENT` file, a
warehouse table) that follows the pointer, and the store records, with each
publication, what the target showed readers after it (`Publication.targets`,
by the target's `key`):

- `stage` writes a sealed version there, where readers do not see it yet
  (idempotent: a version staged before is not written again);
- `show` makes a staged version the one readers see, in one atomic step, only
  from the state the store recorded last (`recorded`; None before the first
  publication with this target); it refuses, with one line, a target that
  shows something else, so store and target never disagree silently; it
  returns the state to record;
- `restore` puts a target back to the state the store recorded, when the store's
  own publish failed after `show` (only if the target still shows what `show` left);
- `forget` removes a version's data once retention has dropped the version.

A spec's `output.table` names an Iceberg table (`iceberg.py`); `targets_for`
builds a version's targets from its stored spec.
"""

from __future__ import annotations

from typing import Any, Protocol

from batchline.spec import JobSpec
from batchline.store import ReaderStore


class PublicationTarget(Protocol):
    @property
    def key(self) -> str:
        """Names the target in the store's publication records (no credentials in it)."""
        ...

    def describe(self) -> str: ...

    def stage(self, store: ReaderStore, version: str) -> None: ...

    def show(self, name: str, version: str, recorded: dict[str, Any] | None) -> dict[str, Any]: ...

    def restore(self, name: str, recorded: dict[str, Any] | None, shown: dict[str, Any]) -> None: ...

    def forget(self, name: str, version: str) -> None: ...


def targets_for(spec: JobSpec, store_url: str | None) -> list[PublicationTarget]:
    """The targets a version's spec names (`output.table`); the catalog of `catalog: store`
    is reached through `store_url`, a warehouse in object storage with the job's `input.storage`."""
    if spec.output_table is None:
        return []
    from batchline.targets.iceberg import IcebergTable

    return [IcebergTable(spec.output_table, store_url, spec.input.storage)]
