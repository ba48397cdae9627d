"""The Python API (`batchline.Jobs`), as a notebook or an orchestrator's task uses it, on every store."""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import batchline
from batchline.store import Store


def test_a_job_is_planned_run_validated_published_exported_and_its_history_read_from_python(
        job_factory: Any, store_url: str, tmp_path: Path) -> None:
    jobs = batchline.Jobs(store_url)
    spec = job_factory(n=120, options={"error_on": ["r000005"]}, validate={"max_dead_letter_rate": 0.05})
    said: list[str] = []
    planned = jobs.plan(spec, log=said.append)
    assert planned.created and planned.records == 120 and any(planned.version in m for m in said)

    run = jobs.run(spec, workers=2, progress=None, log=said.append)
    assert (run.version, run.planned, run.sealed, run.exit_code, run.workers) == (
        planned.version, False, True, 0, 2)
    assert run.worker_starts >= 2 and (run.log_dir / "worker-1.log").exists()

    report = jobs.validate(run.version)
    assert report.passed and report.version == run.version
    published = jobs.publish(run.version, log=said.append)
    assert (published.name, published.version, published.previous) == ("test-job", run.version, None)

    status = jobs.status("test-job")  # a published name reads as its version
    assert (status.version, status.state, status.results, status.dead_letters) == (run.version, "sealed", 119, 1)
    [listing] = jobs.versions()
    assert (listing.version, listing.state, listing.records, listing.published) == (run.version, "sealed", 120, True)
    assert [d.record_id for d in jobs.dead_letters(run.version)] == ["r000005"]

    out = tmp_path / "out.jsonl"
    exported = jobs.export("test-job", out=out)
    assert (exported.version, exported.count, exported.path) == (run.version, 119, out)
    assert len(out.read_text().splitlines()) == 119

    [entry] = jobs.history("test-job")
    assert (entry.action, entry.version, entry.previous) == ("publish", run.version, None)
    assert entry.validation is not None and entry.validation["passed"] is True


def test_the_api_raises_the_command_lines_errors_with_their_exit_codes(job_factory: Any, store_url: str,
                                                                       store: Store, tmp_path: Path) -> None:
    jobs = batchline.Jobs(store)  # an open store is used and left open
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\n")
    with pytest.raises(batchline.SpecError) as spec_error:
        jobs.plan(bad)
    assert spec_error.value.exit_code == 2
    with pytest.raises(batchline.BatchlineError, match="no job version or published name 'nope@1'"):
        jobs.status("nope@1")
    with pytest.raises(batchline.BatchlineError, match="no job named 'nope'"):
        jobs.history("nope")
    nowhere = tmp_path / "typo.db"
    with pytest.raises(batchline.StoreError) as store_error:
        batchline.Jobs(f"sqlite:///{nowhere}").versions()
    assert store_error.value.exit_code == 4 and not nowhere.exists()
    version = jobs.plan(job_factory(n=10), log=lambda _m: None).version
    assert jobs.cancel(version, reason="input edited") is True
    with pytest.raises(batchline.BatchlineError, match=f"{version} was cancelled"):
        jobs.run(job_factory(n=10), progress=None, log=lambda _m: None)
    assert store.job(version) is not None  # the store was not closed by the calls


def test_a_run_from_an_orchestrators_worker_thread(job_factory: Any, store_url: str) -> None:
    # Airflow's, Dagster's and Prefect's executors run tasks in threads, where no signal
    # handler can be set.
    spec = job_factory(n=40)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        run = pool.submit(batchline.Jobs(store_url).run, spec, progress=None, log=lambda _m: None).result()
    assert run.sealed and run.exit_code == 0


def test_importing_batchline_loads_neither_readers_nor_stores_nor_drivers() -> None:
    probe = ("import sys, batchline; print(sorted(m for m in sys.modules if m.startswith("
             "('batchline.', 'pyarrow', 'yaml', 'psycopg', 'jsonschema', 'orjson'))))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "['batchline.errors', 'batchline.version']"
    assert batchline.Jobs is __import__("batchline.api").api.Jobs
