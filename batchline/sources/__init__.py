"""Input sources: where a job's snapshot lives, behind one port (`base.Source`).

A location in a spec is a local path (or a `file:` URI, as an Iceberg table names
its data files) or an object URL (`s3://`, `gs://`); every reader (the planner's
scan, a worker's slice, the OpenAI batch export's re-read, the invariant checks
of the tests) goes through `open_source`. An Iceberg table's snapshot
(`iceberg.py`) is pinned as a whole and read as its data files, wherever they lie.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from batchline.sources.base import Pin, Source
from batchline.sources.local import LocalFile

__all__ = ["LocalFile", "Pin", "Source", "is_object_url", "open_source", "snapshot_digest"]


def is_object_url(location: str) -> bool:
    return location.startswith(("s3://", "gs://"))


def open_source(location: str, storage: Mapping[str, Any] | None = None, pin: Pin | None = None) -> Source:
    """The source at `location`; an object is reached with the job's `input.storage`
    settings (and the environment), and read conditional on `pin` when one is given."""
    if is_object_url(location):
        from batchline.lake import lake_settings
        from batchline.sources.objects import ObjectSource

        return ObjectSource(location, lake_settings(storage), pin)
    if location.startswith("file:"):
        # An Iceberg table's data files are named by URI.
        from urllib.parse import unquote, urlsplit

        return LocalFile(unquote(urlsplit(location).path), named=location)
    return LocalFile(location)


def snapshot_digest(pins: Sequence[Pin]) -> str:
    """The snapshot's digest: what each source guarantees about itself, in order."""
    import hashlib

    outer = hashlib.sha256()
    for pin in pins:
        outer.update(pin.material().encode())
    return "sha256:" + outer.hexdigest()
