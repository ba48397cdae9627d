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
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from batchline.errors import BatchlineError
from batchline.sources.base import location_dataset
from batchline.store import ReaderStore, StoreHandle
from batchline.targets.base import ExportResult, FileExport, PublisherWritten, TargetFamily

if TYPE_CHECKING:
    from batchline.lake import LakeSettings
    from batchline.sources.base import DatasetName, StoreDatasets
    from batchline.spec import JobVersion
    from batchline.spec.model import JobSpec
    from batchline.spec.reader import Fields, ParseContext, SpecReader

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

    def restore(self, name: str, recorded: dict[str, Any] | None, shown: dict[str, Any]) -> None:
        current, token = self._read_current(name)
        if current != shown.get("current"):
            return  # moved on since: not this publish's to undo
        if recorded is None:
            self._remove_current(name)
        else:
            self._write_current(name, str(recorded["current"]), token)

    @abstractmethod
    def describe(self) -> str: ...

    @abstractmethod
    def _current_path(self, name: str) -> str: ...

    def claim(self, name: str, store: StoreHandle) -> None:
        from batchline.targets.owner import OWNER_FILE, Owner, claim

        claim(f"{self._current_path(name).rsplit('/', 1)[0]}/{OWNER_FILE}", Owner.of(store),
              f"{self.describe()} ({name})", self._settings())

    def _settings(self) -> LakeSettings | None:
        return None

    @abstractmethod
    def _remove_current(self, name: str) -> None: ...

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

    def stage(self, store: ReaderStore, job: JobVersion) -> bool:
        from batchline.targets.files import as_umask_allows, write_parquet

        folder = self.folder(job.name, job.version)
        if folder.exists():
            return False
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
        try:
            as_umask_allows(staging, folder=True)
            write_parquet(store, job, staging / PART)
            os.replace(staging, folder)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return True

    def _current_path(self, name: str) -> str:
        return str(self.root / name / "CURRENT")

    def _read_current(self, name: str) -> tuple[str | None, Any]:
        path = self.root / name / "CURRENT"
        return (path.read_text().strip() if path.exists() else None), None

    def _write_current(self, name: str, text: str, token: Any) -> None:
        from batchline.targets.files import atomic_write

        atomic_write(self.root / name / "CURRENT", lambda tmp: tmp.write_text(text + "\n"))

    def _remove_current(self, name: str) -> None:
        (self.root / name / "CURRENT").unlink(missing_ok=True)

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

    def stage(self, store: ReaderStore, job: JobVersion) -> bool:
        from batchline.sources.objects import object_exists, upload
        from batchline.targets.files import write_parquet

        part = f"{self.folder(job.name, job.version)}/{PART}"
        # Its one object is written whole or not at all, so a version already there is complete.
        if object_exists(part, self.settings):
            return False
        with tempfile.TemporaryDirectory(prefix="batchline-export-") as scratch:
            local = Path(scratch) / PART
            write_parquet(store, job, local)
            upload(local, part, self.settings)
        return True

    def _current_path(self, name: str) -> str:
        return f"{self.root}/{name}/CURRENT"

    def _settings(self) -> LakeSettings | None:
        return self.settings

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

    def _remove_current(self, name: str) -> None:
        from batchline.sources.objects import delete_object

        delete_object(self._current_path(name), self.settings)

    def forget(self, name: str, version: str) -> None:
        from batchline.sources.objects import delete_prefix

        delete_prefix(self.folder(name, version) + "/", self.settings)


def dataset_at(root: str | Path, storage: Mapping[str, Any] | None = None) -> ParquetDataset | ObjectDataset:
    """The dataset flavour for a root: an object prefix (reached with the job's lake settings
    over the environment's) or a local folder."""
    from batchline.sources import is_remote

    text = str(root)
    if is_remote(text):
        from batchline.lake import lake_settings

        return ObjectDataset(text, lake_settings(storage))
    return ParquetDataset(Path(root))


# --- the family ------------------------------------------------------------------------------


@dataclass(frozen=True)
class DatasetOutput(PublisherWritten):
    """`output.dataset`: a folder or object prefix holding a Parquet dataset per version and
    a `CURRENT` naming the published one."""

    root: str

    def describe(self) -> str:
        return f"Parquet dataset under {self.root}"

    def to_dict(self) -> dict[str, Any]:
        return {"dataset": self.root}

    def target(self, store_url: str | None, storage: Mapping[str, Any]) -> ParquetDataset | ObjectDataset:
        return dataset_at(self.root, storage)

    def check(self, spec: JobSpec, store_url: str | None) -> None:
        return None  # a new version is a new folder: nothing there can refuse it

    def dataset(self, name: str, store: StoreDatasets, state: Mapping[str, Any] | None) -> DatasetName:
        # Each name's dataset is its own folder: two jobs under one root are two datasets.
        return location_dataset(f"{self.root.rstrip('/')}/{name}", (state or {}).get("current"))


class ParquetOutput(TargetFamily):
    """A Parquet dataset per version under a root, and `CURRENT` naming the published one
    (`output.dataset`); `export NAME --format parquet` writes one on demand."""

    name = "parquet"
    keys: ClassVar[Fields] = {"dataset": {"type": "string", "minLength": 1,
                        "description": "A folder or s3:// or gs:// prefix: a Parquet dataset per version, and CURRENT"}}

    def parse(self, key: str, section: Mapping[str, Any], r: SpecReader, ctx: ParseContext) -> DatasetOutput:
        from batchline.sources import is_remote

        root = r.string(section[key], "output.dataset")
        return DatasetOutput(root if is_remote(root) else str((ctx.base_dir / root).resolve()))

    def access(self, section: Mapping[str, Any]) -> list[str]:
        root = section.get("dataset")
        if not root:
            return []
        return [f"output dataset {root}: the worker needs nothing of it; the publisher writes each version's folder "
                "and replaces CURRENT there (and deletes pruned versions' folders): give it write access under it, "
                "and readers read access"]

    def pod_refusal(self, section: Mapping[str, Any], where: str) -> str | None:
        from batchline.sources import is_remote

        root = section.get("dataset")
        if root is not None and not is_remote(str(root)):
            return f"output.dataset: {root} is a folder on this machine; give an s3:// or gs:// prefix"
        return None


def export_dataset(store: ReaderStore, name: str, root: Path | str) -> tuple[str, str]:
    """The published version of `name` as a dataset under `root`, with CURRENT naming it:
    an export on demand, not a publication, so CURRENT follows the store's pointer,
    whatever it named before. Returns the version and its folder."""
    from batchline.spec import JobVersion

    version = store.resolve_name(name)
    if version is None:
        raise BatchlineError(f"nothing is published under {name!r} in {store.where()}")
    dataset = dataset_at(root)
    dataset.stage(store, JobVersion.of(store, version))
    dataset.show(name, version, None)
    return version, str(dataset.folder(name, version))


PARQUET = ParquetOutput()


class ParquetFile(FileExport):
    """`export --format parquet`: a version's results as one Parquet file (typed as the Iceberg
    table types them); a published NAME, unless `out` ends in `.parquet`, as a dataset of a
    folder per version under `out` (default `exports`) with NAME/CURRENT naming it."""

    name: ClassVar[str] = "parquet"
    help: ClassVar[str] = ("one Parquet file; a published NAME: a folder per version under --out with "
                           "NAME/CURRENT naming it, unless --out ends in .parquet")

    def export(self, store: ReaderStore, target: str, out: str | None, errors: str | None,
               partial: bool) -> ExportResult:
        from batchline.store import job_or_published
        from batchline.targets.files import export_to, finished, local_or_url, write_parquet

        if store.job(target) is None and not str(out or "").endswith(".parquet"):
            job_or_published(store, target)  # neither a version nor a published name: exit 66
            version, folder = export_dataset(store, target, out if out is not None else "exports")
            return ExportResult(version, store.status(version).results, local_or_url(folder),
                                current=local_or_url(folder.rsplit("/", 1)[0] + "/CURRENT"))
        job = finished(store, job_or_published(store, target), partial)
        dest = out if out is not None else f"{job.version.replace('@', '-')}.parquet"
        return ExportResult(job.version, export_to(dest, lambda p: write_parquet(store, job, p)), local_or_url(dest))


PARQUET_FILE = ParquetFile()
