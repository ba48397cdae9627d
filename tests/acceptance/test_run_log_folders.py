"""Each `batchline run` writes its worker logs to a folder of its own, named by the store and
the run, so that neither a rerun nor the same job on another store appends to earlier logs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from batchline.ops.runner import default_log_dir, store_key

pytestmark = pytest.mark.acceptance


def run_logs(spec: Path, store_url: str, log_base: Path) -> Path:
    done = subprocess.run([sys.executable, "-m", "batchline", "run", str(spec), "--store", store_url],
                          capture_output=True, text=True, timeout=180,
                          env={**os.environ, "BATCHLINE_LOG_DIR": str(log_base)})
    assert done.returncode == 0, done.stderr[-3000:]
    found = re.search(r"^  worker logs  (.+)$", done.stderr, re.MULTILINE)
    assert found, done.stderr
    return Path(found.group(1))


def test_two_runs_of_one_job_write_their_worker_logs_to_two_folders(job_factory: Any, store_url: str,
                                                                    tmp_path: Path) -> None:
    spec = job_factory(n=20)
    first = run_logs(spec, store_url, tmp_path / "logs")
    first_log = (first / "worker-0.log").read_text()
    second = run_logs(spec, store_url, tmp_path / "logs")
    assert first != second
    assert first.parent == second.parent, "one job on one store keeps its runs side by side"
    assert first.is_relative_to(tmp_path / "logs")
    assert (first / "worker-0.log").read_text() == first_log, "the rerun appended to the first run's log"
    assert "no work left" in (second / "worker-0.log").read_text()


def test_one_job_on_two_stores_logs_to_two_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHLINE_LOG_DIR", str(tmp_path))
    on_sqlite = default_log_dir(f"sqlite:///{tmp_path / 'a.db'}", "job@1")
    on_postgres = default_log_dir("postgresql://postgres@127.0.0.1:5432/bl", "job@1")
    assert on_sqlite.parent != on_postgres.parent
    assert on_sqlite.parent.name.startswith("sqlite-") and on_postgres.parent.name.startswith("postgresql-")
    assert on_sqlite.parent.parent == on_postgres.parent.parent == tmp_path / "batchline-logs" / "job-1"


def test_a_store_is_known_by_where_it_is_never_by_its_password(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    with_password = store_key("postgresql://bl:s3cret@db.example:5432/jobs?password=other&sslmode=require")
    assert with_password == store_key("postgresql://bl:changed@db.example:5432/jobs?sslmode=require")
    assert "s3cret" not in with_password
    assert with_password != store_key("postgresql://bl@db.example:5432/other")
    # One relative SQLite URL names a different file in each folder it is run from.
    monkeypatch.chdir(tmp_path)
    here = store_key("sqlite:///batchline.db")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert store_key("sqlite:///batchline.db") != here
    assert store_key(f"sqlite:///{tmp_path / 'batchline.db'}") == here
