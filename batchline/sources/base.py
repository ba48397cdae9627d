"""The source port: what the planner and the workers need of an input's location."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, BinaryIO, Protocol


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
