"""A Parquet dataset per version of a published name, and a `CURRENT` file naming the one readers use.

    root/NAME/VERSION/part-00000.parquet
    root/NAME/CURRENT            (contains VERSION)

A consumer that reads CURRENT and then the folder it names always sees one whole
version: a version's folder is complete before it is renamed into place, and
CURRENT is replaced (atomically) only after that.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from batchline.errors import BatchlineError
from batchline.store import ReaderStore


def version_folder(version: str) -> str:
    return version.replace("@", "-")


class ParquetDataset:
    def __init__(self, root: Path) -> None:
        self.root = root

    @property
    def key(self) -> str:
        return f"parquet:{self.root}"

    def describe(self) -> str:
        return f"Parquet dataset under {self.root}"

    def folder(self, name: str, version: str) -> Path:
        return self.root / name / version_folder(version)

    def stage(self, store: ReaderStore, version: str) -> None:
        from batchline.export import export_parquet

        info = store.job(version)
        assert info is not None
        folder = self.folder(info.name, version)
        if folder.exists():
            return
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
        try:
            export_parquet(store, version, staging / "part-00000.parquet")
            os.replace(staging, folder)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    def current(self, name: str) -> str | None:
        path = self.root / name / "CURRENT"
        return path.read_text().strip() if path.exists() else None

    def show(self, name: str, version: str, recorded: dict[str, Any] | None) -> dict[str, Any]:
        from batchline.export import atomic_write

        if recorded is not None and self.current(name) != recorded.get("current"):
            raise BatchlineError(f"{self.root / name / 'CURRENT'} names {self.current(name)!r}, not "
                                 f"{recorded.get('current')!r} as the store recorded; not changing it")
        atomic_write(self.root / name / "CURRENT", lambda tmp: tmp.write_text(version_folder(version) + "\n"))
        return {"current": version_folder(version)}

    def restore(self, name: str, recorded: dict[str, Any] | None, shown: dict[str, Any]) -> None:
        from batchline.export import atomic_write

        if self.current(name) != shown.get("current"):
            return  # moved on since: not this publish's to undo
        path = self.root / name / "CURRENT"
        if recorded is None:
            path.unlink(missing_ok=True)
        else:
            atomic_write(path, lambda tmp: tmp.write_text(f"{recorded['current']}\n"))

    def forget(self, name: str, version: str) -> None:
        shutil.rmtree(self.folder(name, version), ignore_errors=True)
