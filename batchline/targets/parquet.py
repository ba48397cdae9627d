"""A Parquet dataset per version of a published name, and a `CURRENT` file naming the one readers use.

    root/NAME/VERSION/part-00000.parquet
    root/NAME/CURRENT            (contains VERSION)

A consumer that reads CURRENT and then the folder it names always sees one whole
version: a version's folder is complete before CURRENT names it, and CURRENT is
replaced (atomically) only after that. The root is a local folder
(`ParquetDataset`) or an object prefix in S3 or GCS (`ObjectDataset`), where each
object is written whole and CURRENT is replaced by a conditional put, so two
exporters cannot interleave.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchline.errors import BatchlineError
from batchline.store import ReaderStore

if TYPE_CHECKING:
    from batchline.lake import LakeSettings

PART = "part-00000.parquet"


def version_folder(version: str) -> str:
    return version.replace("@", "-")


class _Dataset(ABC):
    """What both flavours share: the layout, and `show` from the state the store recorded."""

    root: Any

    @property
    def key(self) -> str:
        return f"parquet:{self.root}"

    def current(self, name: str) -> str | None:
        return self._read_current(name)[0]

    def show(self, name: str, version: str, recorded: dict[str, Any] | None) -> dict[str, Any]:
        current, token = self._read_current(name)
        if recorded is not None and current != recorded.get("current"):
            raise BatchlineError(f"{self._current_path(name)} names {current!r}, not "
                                 f"{recorded.get('current')!r} as the store recorded; not changing it")
        self._write_current(name, version_folder(version), token)
        return {"current": version_folder(version)}

    @abstractmethod
    def _current_path(self, name: str) -> str: ...

    @abstractmethod
    def _read_current(self, name: str) -> tuple[str | None, Any]:
        """What CURRENT names now, and what a conditional replacement of it needs."""

    @abstractmethod
    def _write_current(self, name: str, text: str, token: Any) -> None: ...


class ParquetDataset(_Dataset):
    def __init__(self, root: Path) -> None:
        self.root: Path = root

    def describe(self) -> str:
        return f"Parquet dataset under {self.root}"

    def folder(self, name: str, version: str) -> Path:
        return self.root / name / version_folder(version)

    def stage(self, store: ReaderStore, version: str) -> None:
        from batchline.publish.files import export_parquet

        info = store.job(version)
        assert info is not None
        folder = self.folder(info.name, version)
        if folder.exists():
            return
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
        try:
            export_parquet(store, version, staging / PART)
            os.replace(staging, folder)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    def _current_path(self, name: str) -> str:
        return str(self.root / name / "CURRENT")

    def _read_current(self, name: str) -> tuple[str | None, Any]:
        path = self.root / name / "CURRENT"
        return (path.read_text().strip() if path.exists() else None), None

    def _write_current(self, name: str, text: str, token: Any) -> None:
        from batchline.publish.files import atomic_write

        atomic_write(self.root / name / "CURRENT", lambda tmp: tmp.write_text(text + "\n"))

    def restore(self, name: str, recorded: dict[str, Any] | None, shown: dict[str, Any]) -> None:
        from batchline.publish.files import atomic_write

        if self.current(name) != shown.get("current"):
            return  # moved on since: not this publish's to undo
        path = self.root / name / "CURRENT"
        if recorded is None:
            path.unlink(missing_ok=True)
        else:
            atomic_write(path, lambda tmp: tmp.write_text(f"{recorded['current']}\n"))

    def forget(self, name: str, version: str) -> None:
        shutil.rmtree(self.folder(name, version), ignore_errors=True)


class ObjectDataset(_Dataset):
    """The same layout under `s3://bucket/prefix` or `gs://bucket/prefix`."""

    def __init__(self, root: str, settings: LakeSettings) -> None:
        self.root: str = root.rstrip("/")
        self.settings = settings

    def describe(self) -> str:
        return f"Parquet dataset under {self.root}"

    def folder(self, name: str, version: str) -> str:
        return f"{self.root}/{name}/{version_folder(version)}"

    def stage(self, store: ReaderStore, version: str) -> None:
        from batchline.publish.files import export_parquet
        from batchline.sources.objects import object_exists, upload

        info = store.job(version)
        assert info is not None
        part = f"{self.folder(info.name, version)}/{PART}"
        # Its one object is written whole or not at all, so a version already there is complete.
        if object_exists(part, self.settings):
            return
        with tempfile.TemporaryDirectory(prefix="batchline-export-") as scratch:
            local = Path(scratch) / PART
            export_parquet(store, version, local)
            upload(local, part, self.settings)

    def _current_path(self, name: str) -> str:
        return f"{self.root}/{name}/CURRENT"

    def _read_current(self, name: str) -> tuple[str | None, Any]:
        from batchline.sources.objects import read_versioned

        found = read_versioned(self._current_path(name), self.settings)
        if found is None:
            return None, None
        data, meta = found
        return data.decode().strip(), meta

    def _write_current(self, name: str, text: str, token: Any) -> None:
        from batchline.sources.objects import ConditionFailed, put_if

        url = self._current_path(name)
        try:
            put_if(url, (text + "\n").encode(), self.settings, token)
        except ConditionFailed:
            now = self.current(name)
            if now == text:  # our own put, whose answer was lost and was retried
                return
            raise BatchlineError(f"{url} changed while this export replaced it (another exporter?): it now "
                                 f"names {now!r}; {text} was not made current") from None

    def forget(self, name: str, version: str) -> None:
        from batchline.sources.objects import delete_prefix

        delete_prefix(self.folder(name, version) + "/", self.settings)


def dataset_at(root: str | Path) -> ParquetDataset | ObjectDataset:
    """The dataset flavour for a root: an object prefix (reached with the environment's lake
    settings) or a local folder."""
    text = str(root)
    if text.startswith(("s3://", "gs://")):
        from batchline.lake import lake_settings

        return ObjectDataset(text, lake_settings())
    return ParquetDataset(Path(root))
