"""Input sources: the families of the SOURCES table (batchline.registry), found by the
location scheme they open or the input key they own (see `base`).

Every reader of a location (the planner's scan, a worker's slice, an export's re-read,
the weights fetcher, an export's upload) reaches it through `location_family`, so the
core never names a concrete source.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchline.errors import BatchlineError
from batchline.registry import SOURCES
from batchline.sources.base import (
    DatasetName,
    InputSource,
    KeyedFamily,
    LocationFamily,
    ParseContext,
    Pin,
    Snapshot,
    Source,
    SourceContext,
    SourceFamily,
    StoreDatasets,
    StoredRow,
    StoredRows,
    location_dataset,
)

if TYPE_CHECKING:
    from batchline.spec.reader import SpecReader

__all__ = [
    "DatasetName",
    "FileSet",
    "InputSource",
    "KeyedFamily",
    "LocationFamily",
    "ParseContext",
    "Pin",
    "Snapshot",
    "Source",
    "SourceContext",
    "SourceFamily",
    "StoreDatasets",
    "StoredRow",
    "StoredRows",
    "delete",
    "families",
    "is_remote",
    "keyed_families",
    "listing",
    "location_dataset",
    "location_family",
    "open_source",
    "pin_version",
    "published_read",
    "snapshot_digest",
    "stored_pins",
    "versions_read",
]


def families() -> list[SourceFamily]:
    """Every family of the table, in its order (each module is batchline's own, and imports
    what its extra brings only when used, so listing them needs no extra)."""
    return [entry.load() for entry in SOURCES.values()]


def keyed_families() -> dict[str, KeyedFamily]:
    """Each input key a family owns, and the family."""
    return {key: f for f in families() if isinstance(f, KeyedFamily) for key in f.keys}


def location_family(location: str) -> LocationFamily:
    """The family that opens `location`: the one whose scheme it starts with (the longest),
    else the one that opens plain paths."""
    best: tuple[int, LocationFamily] | None = None
    for f in families():
        if isinstance(f, LocationFamily):
            for scheme in f.schemes:
                if location.startswith(scheme) and (best is None or len(scheme) > best[0]):
                    best = (len(scheme), f)
    if best is None:
        raise BatchlineError(f"{location}: no input source opens it")
    return best[1]


def is_remote(location: str) -> bool:
    """Whether `location` is reached over the network (an object), not a path on this machine."""
    return "" not in location_family(location).schemes


def open_source(location: str, storage: Mapping[str, Any] | None = None, pin: Pin | None = None) -> Source:
    """The source at `location`, reached with the job's `input.storage` settings (and the
    environment), read conditional on `pin` when one is given."""
    return location_family(location).open(location, storage, pin)


def versions_read(section: Mapping[str, Any]) -> list[str]:
    """The job versions of the store a stored input section reads, as its families say."""
    return [v for f in families() for v in f.reads_versions(section)]


def published_read(section: Mapping[str, Any]) -> list[tuple[str, str | None]]:
    """The published names a stored input section reads, each with the version pinned, as its
    families say."""
    return [p for f in families() for p in f.reads_published(section)]


def upload(path: Path, location: str, storage: Mapping[str, Any] | None = None) -> None:
    """A local file to `location`, whole: readers there see the old content or all of the new."""
    location_family(location).upload(path, location, storage)


def listing(prefix: str, storage: Mapping[str, Any] | None = None) -> list[tuple[str, float]]:
    """Every file or object under `prefix`, with when each was last written."""
    return location_family(prefix).listing(prefix, storage)


def delete(location: str, storage: Mapping[str, Any] | None = None) -> None:
    """Removes a file or object (nothing where it is gone already)."""
    location_family(location).delete(location, storage)


def download(location: str, dest: Path, storage: Mapping[str, Any] | None = None) -> Path:
    """What is at `location` (a file, or a folder when it ends in `/`) copied to `dest`."""
    return location_family(location).download(location, dest, storage)


def snapshot_digest(pins: Sequence[Pin]) -> str:
    """The snapshot's digest: what each source guarantees about itself, in order."""
    outer = hashlib.sha256()
    for pin in pins:
        outer.update(pin.material().encode())
    return "sha256:" + outer.hexdigest()


def stored_pins(snapshot: Snapshot) -> list[dict[str, Any]]:
    """The snapshot's pins as a version keeps them (its stored spec's `pins`): what lineage
    names as the version of each file or object read. A table's single pin is its snapshot,
    which its source's section names already."""
    if len(snapshot.pins) != len(snapshot.files):
        return []
    return [{"location": f.location, **p.to_json(), **({"digest": p.digest} if p.digest else {})}
            for f, p in zip(snapshot.files, snapshot.pins, strict=True)]


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
        files = [open_source(location, ctx.input.storage) for location in self.locations]
        pins = [s.pin() for s in files]
        return Snapshot(self, files, pins, lambda: all(s.still(p) for s, p in zip(files, pins, strict=True)))


def expand_paths(value: Any, r: SpecReader, ctx: ParseContext) -> FileSet:
    """`input.path` (one location or a list), each expanded by the family that opens it;
    a stored spec's are taken as they are."""
    items = value if isinstance(value, list) else [value]
    if not items:
        r.fail("input.path", "is empty")
    locations: list[str] = []
    for i, item in enumerate(items):
        where = f"input.path[{i}]" if isinstance(value, list) else "input.path"
        text = r.string(item, where)
        locations.extend([text] if ctx.resolved else location_family(text).expand(text, where, r, ctx))
    return FileSet(tuple(locations))
