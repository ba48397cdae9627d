"""Exports of a version: who can read them, what their columns are, and dataset folders kept as staged."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from batchline.publish.export import export_openai_batch, openai_errors_path
from batchline.store import Store
from batchline.targets.files import export_jsonl, export_parquet
from batchline.targets.parquet import dataset_at
from tests.helpers import planned, run_to_seal


@pytest.fixture
def umask_022() -> Iterator[None]:
    before = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(before)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_exports_are_as_readable_as_the_umask_makes_new_files_not_private_to_their_writer(
        job_factory: Any, store: Store, tmp_path: Path, umask_022: None) -> None:
    _spec, version = planned(job_factory(n=30), store)
    run_to_seal(store, version)
    out = tmp_path / "exports"
    export_jsonl(store, version, out / "results.jsonl")
    export_parquet(store, version, out / "results.parquet")
    export_openai_batch(store, version, out / "batch.jsonl", openai_errors_path(out / "batch.jsonl"))
    dataset = dataset_at(tmp_path / "warehouse")
    dataset.stage(store, version)
    dataset.show("test-job", version, None)
    folder = dataset.folder("test-job", version)
    files = [out / "results.jsonl", out / "results.parquet", out / "batch.jsonl", out / "batch.errors.jsonl",
             Path(folder) / "part-00000.parquet", tmp_path / "warehouse" / "test-job" / "CURRENT"]
    assert {str(f): oct(_mode(f)) for f in files} == {str(f): "0o644" for f in files}
    folders = [out, Path(folder), Path(folder).parent]
    assert {str(f): oct(_mode(f)) for f in folders} == {str(f): "0o755" for f in folders}
