"""A local file (or one on a filesystem every worker mounts)."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, NoReturn
from urllib.parse import unquote, urlsplit

from batchline.errors import InputError
from batchline.sources.base import LocationFamily, Pin

if TYPE_CHECKING:
    from batchline.spec.reader import ParseContext, SpecReader

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


class LocalFiles(LocationFamily):
    """Paths on this machine (or on a filesystem every worker mounts), and `file:` URIs, as a
    table names its data files. Globs are expanded at planning, relative to the spec's folder."""

    name = "local"
    schemes = ("", "file:")

    def expand(self, location: str, where: str, r: SpecReader, ctx: ParseContext) -> list[str]:
        if location.startswith("file:"):
            return [location]
        if any(ch in location for ch in "*?["):
            matches = sorted(ctx.base_dir.glob(location)) if not Path(location).is_absolute() else sorted(
                Path("/").glob(location.lstrip("/")))
            if not matches:
                r.fail("input.path", f"{location!r} matches no file")
            return [str(m.resolve()) for m in matches]
        return [str((ctx.base_dir / location).resolve())]

    def open(self, location: str, storage: Mapping[str, Any] | None = None, pin: Pin | None = None) -> LocalFile:
        if location.startswith("file:"):
            return LocalFile(unquote(urlsplit(location).path), named=location)
        return LocalFile(location)

    def upload(self, path: Path, location: str, storage: Mapping[str, Any] | None = None) -> None:
        dest = Path(location)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.upload")
        shutil.copyfile(path, tmp)
        os.replace(tmp, dest)

    def listing(self, prefix: str, storage: Mapping[str, Any] | None = None) -> list[tuple[str, float]]:
        folder = Path(unquote(urlsplit(prefix).path) if prefix.startswith("file:") else prefix)
        if not folder.is_dir():
            return []
        return sorted((str(p), p.stat().st_mtime) for p in folder.rglob("*") if p.is_file())

    def delete(self, location: str, storage: Mapping[str, Any] | None = None) -> None:
        Path(unquote(urlsplit(location).path) if location.startswith("file:") else location).unlink(missing_ok=True)

    def download(self, location: str, dest: Path, storage: Mapping[str, Any] | None = None) -> Path:
        source = Path(location)
        if source.is_dir():
            shutil.copytree(source, dest)
        else:
            shutil.copyfile(source, dest)
        return dest

    def location_access(self, locations: Sequence[str], what: str) -> list[str]:
        return [f"{what} {path}: the database cannot guard it; mount it read-only into the worker (a volume of "
                "its own, not a host path shared with other workloads), readable by the worker's user and writable "
                "by no worker" for path in locations]

    def location_refusal(self, location: str, where: str) -> str | None:
        return (f"{location} is on this machine, where pods elsewhere cannot read it: give an object URL, "
                "prefix or glob, or a table")


LOCAL = LocalFiles()
