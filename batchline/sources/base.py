"""The source port: what the planner and the workers need of an input's location."""

from __future__ import annotations

from dataclasses import dataclass
from typing import BinaryIO, Protocol


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
        """A seekable file object (Parquet reads its footer, then row groups)."""
        ...
