"""A target has one owner: the store that first published into it.

A Parquet dataset, an Iceberg table or a retrieval index names no store of its own. Two stores
given the same target (a mistyped store path that opened a new, empty store; a spec copied to
another deployment) would each move its `CURRENT`, register it in a catalog of their own, or tag
their own versions in it, and each store's record of what the target shows would be wrong. So the
first publish into a target records its store's identity (`identity()`, made once with the store
and kept whatever its URL or path) in a small file beside the target's data, written only where
no such file is (create-if-absent: a rename-free link on a local disk, a conditional put on an
object store), and every publish, rollback or re-stage reads it first and refuses any other
store's, naming both. A file that cannot be read exactly is refused too: an owner is never guessed.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from batchline.errors import BatchlineError
from batchline.registry import is_remote
from batchline.store import StoreHandle

if TYPE_CHECKING:
    from batchline.lake import LakeSettings

# The owner's file, beside (or in) each target's data.
OWNER_FILE = "batchline-owner.json"


class TargetOwned(BatchlineError):
    """A target another store publishes into."""


@dataclass(frozen=True)
class Owner:
    """A store as a target records it: its identity, and where it was (for messages only)."""

    identity: str
    where: str

    @classmethod
    def of(cls, store: StoreHandle) -> Owner:
        return cls(store.identity(), store.where())

    def to_bytes(self) -> bytes:
        return (json.dumps({"store": self.identity, "where": self.where}, sort_keys=True) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes, marker: str) -> Owner:
        try:
            raw = json.loads(data.decode())
        except (UnicodeDecodeError, ValueError):
            raw = None
        if (not isinstance(raw, dict) or set(raw) != {"store", "where"}
                or not all(isinstance(v, str) and v for v in raw.values())):
            raise TargetOwned(f"{marker}: not an owner record batchline wrote (it reads "
                              f"{{\"store\": ID, \"where\": STORE}}); the target's owner cannot be told, so nothing "
                              f"is published into it until the file is fixed or removed by whoever owns the target")
        return cls(raw["store"], raw["where"])


def claim(marker: str | Path, owner: Owner, what: str, settings: LakeSettings | None = None) -> None:
    """Records `owner` as the one store that publishes into `what`, at `marker` (a path or an
    object URL, reached with the job's lake settings), unless a store did first; refuses
    `what` when that store was another."""
    url = str(marker)
    if is_remote(url):
        from batchline.lake import lake_settings
        from batchline.sources.objects import ConditionFailed, put_if, read_object

        settings = settings or lake_settings()
        try:
            put_if(url, owner.to_bytes(), settings, None)
            return
        except ConditionFailed:
            found = read_object(url, settings)
    else:
        present = _create_or_read(Path(url), owner.to_bytes())
        if present is None:
            return
        found = present
    recorded = Owner.from_bytes(found, url)
    if recorded.identity != owner.identity:
        raise TargetOwned(f"{what} belongs to the store {recorded.identity} ({recorded.where}), not to this one, "
                          f"{owner.identity} ({owner.where}): a store publishes only into the targets it made "
                          f"({url} records the owner); name another target, or publish from that store")


def _create_or_read(path: Path, data: bytes) -> bytes | None:
    """Writes `data` at `path` whole if nothing is there (None), or returns what is: the file is
    written aside and linked into place, which fails where a file is, so no reader ever finds a
    part of one and two claimers never both succeed."""
    from batchline.targets.files import as_umask_allows

    with contextlib.suppress(FileNotFoundError):
        return path.read_bytes()  # every publish after the first: nothing to write
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        as_umask_allows(Path(name))
        try:
            os.link(name, path)
        except FileExistsError:
            return path.read_bytes()
        return None
    finally:
        os.unlink(name)
