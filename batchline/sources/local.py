"""A local file (or one on a filesystem every worker mounts)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import BinaryIO, NoReturn

from batchline.errors import InputError
from batchline.sources.base import Pin

_CHUNK = 1 << 20


class LocalFile:
    def __init__(self, location: str | Path, *, named: str | None = None) -> None:
        self.path = Path(location)
        self.location = named or str(location)  # `named`: as a table names the file (a file: URI)

    def __str__(self) -> str:
        return self.location

    def _unreadable(self, exc: OSError) -> NoReturn:
        raise InputError(f"{self.location}: cannot read input: {exc.strerror or exc}") from None

    def pin(self) -> Pin:
        h = hashlib.sha256()
        try:
            st = self.path.stat()
            with self.path.open("rb") as f:
                while chunk := f.read(_CHUNK):
                    h.update(chunk)
        except OSError as exc:
            self._unreadable(exc)
        return Pin(self.path.name, st.st_size, digest=h.hexdigest(), changed_at=st.st_mtime_ns)

    def stream(self) -> BinaryIO:
        try:
            return self.path.open("rb")
        except OSError as exc:
            self._unreadable(exc)

    def read(self, start: int, end: int) -> bytes:
        try:
            with self.path.open("rb") as f:
                f.seek(start)
                data = f.read(end - start)
        except OSError as exc:
            self._unreadable(exc)
        if len(data) != end - start:
            raise InputError(f"{self.location}: input changed since planning (file is shorter than byte {end})")
        return data

    def random_access(self) -> BinaryIO:
        return self.stream()

    def still(self, pin: Pin) -> bool:
        return self.pin() == pin

    def slice_pin(self) -> Pin | None:
        return None
