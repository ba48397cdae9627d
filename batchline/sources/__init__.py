"""Input sources: the families of the SOURCES table (batchline.registry), found by the
location scheme they open or the input key they own (see `base`).

Every reader of a location (the planner's scan, a worker's slice, an export's re-read,
the weights fetcher, an export's upload) reaches it through `location_family`, so the
core never names a concrete source.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import batchline.registry as registry
from batchline.registry import SOURCES, is_remote
from batchline.sources.base import (
    DatasetName,
    InputSource,
    KeyedFamily,
    LocationFamily,
    Pin,
    RowSource,
    Snapshot,
    Source,
    SourceContext,
    SourceFamily,
    StoreDatasets,
    StoredRow,
    location_dataset,
)
from batchline.spec.ports import FileSet, expand_paths, pin_version

__all__ = [
    "DatasetName",
    "FileSet",
    "InputSource",
    "KeyedFamily",
    "LocationFamily",
    "Pin",
    "RowSource",
    "Snapshot",
    "Source",
    "SourceContext",
    "SourceFamily",
    "StoreDatasets",
    "StoredRow",
    "delete",
    "expand_paths",
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
    return registry.loaded(SOURCES)


def keyed_families() -> dict[str, KeyedFamily]:
    """Each input key a family owns, and the family."""
    return {key: f for f in families() if isinstance(f, KeyedFamily) for key in f.keys}


def location_family(location: str) -> LocationFamily:
    """The family that opens `location`: the one whose scheme it starts with (the longest),
    else the one that opens plain paths (`batchline.registry.location_family`)."""
    family: LocationFamily = registry.location_family(location)
    return family


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






