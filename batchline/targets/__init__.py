"""Publication targets: where readers see the published version of a name.

The store's own pointer (and the view that reads through it) is the truth:
incremental runs (`base: published`), retention and rollback read it. A target
is another place readers look (a Parquet dataset with a `CURRENT` file, later a
warehouse table) that follows the pointer:

- `stage` writes a sealed version there, where readers do not see it yet
  (idempotent: a version staged before is not written again);
- `show` makes a staged version the one readers see, in one atomic step;
- `forget` removes a version's data once retention has dropped the version.
"""

from __future__ import annotations

from typing import Protocol

from batchline.store import ReaderStore


class PublicationTarget(Protocol):
    def describe(self) -> str: ...

    def stage(self, store: ReaderStore, version: str) -> None: ...

    def show(self, name: str, version: str) -> None: ...

    def forget(self, name: str, version: str) -> None: ...
