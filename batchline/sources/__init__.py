"""Input sources: where a job's snapshot lives, behind one port (`base.Source`).

A location in a spec is a local path (or a `file:` URI, as an Iceberg table names
its data files); every reader (the planner's scan, a worker's slice, the OpenAI
batch export's re-read) goes through `open_source`, so an object store is one
more adapter here. An Iceberg table's snapshot (`iceberg.py`) is pinned as a
whole and read as its data files.
"""

from __future__ import annotations

from collections.abc import Sequence

from batchline.sources.base import Pin, Source
from batchline.sources.local import LocalFile

__all__ = ["LocalFile", "Pin", "Source", "open_source", "snapshot_digest"]


def open_source(location: str) -> Source:
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
