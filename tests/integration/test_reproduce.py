"""The reproducibility check (`validate.reproduce`): a seeded sample recomputed by the version's
pinned engine in a fresh engine process, in batches of another size than the workers', and
compared with the stored (first) answers; it gates the publish when `min_agreement` is set.
On both stores."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from batchline.api import Jobs
from batchline.digests import choose
from batchline.errors import BatchlineError
from batchline.store import Store

ROOT = Path(__file__).resolve().parents[2]


def reproducing(job_factory: Any, *, n: int = 120, sample: int = 40, options: dict[str, Any] | None = None,
                **reproduce: Any) -> Path:
    return job_factory(n=n, name="repro", options=options or {}, output={"schema": "schema.json",
                                                                        "label_field": "category"},
                       validate={"max_dead_letter_rate": 0.01, "reproduce": {"sample": sample, **reproduce}})


def run(spec: Path, store_url: str) -> str:
    result = Jobs(store_url).run(spec, workers=1, progress=None, log=lambda _m: None)
    assert result.exit_code == 0
    return result.version


def check_of(report: Any) -> dict[str, Any]:
    [check] = [c for c in report.to_json()["checks"] if c["name"] == "reproducibility"]
    return dict(check)


def test_the_synthetic_engine_agrees_with_itself_on_every_record_recomputed_in_other_batches(
        job_factory: Any, store_url: str, store: Store) -> None:
    version = run(reproducing(job_factory, min_agreement=1.0), store_url)
    report = Jobs(store_url).validate(version)
    check = check_of(report)
    assert report.passed and check["passed"]
    details = check["details"]
    assert (details["sample"], details["seed"], details["batch_size"], details["workers_batch_size"]) == (40, 0, 1, 4)
    assert details["agreement"] == details["exact_agreement"] == details["label_agreement"] == 1.0
    assert "40 of 120 results chosen by seed 0" in check["figure"] and "batches of 1 (the workers' 4)" in check["figure"]
    assert store.latest_validation(version) is not None
    Jobs(store_url).publish(version)


def test_an_engine_that_answers_some_records_otherwise_is_refused_its_publish_by_the_gate(
        job_factory: Any, store_url: str, store: Store) -> None:
    unstable = [f"r{i:06d}" for i in range(0, 120, 3)]  # a third of the records
    spec = reproducing(job_factory, sample=120, min_agreement=0.95, seed=7, options={"unstable_on": unstable})
    version = run(spec, store_url)
    report = Jobs(store_url).validate(version)
    check = check_of(report)
    assert not report.passed and not check["passed"]
    assert check["details"]["agreement"] == pytest.approx(80 / 120)
    assert check["details"]["exact_agreement"] == pytest.approx(80 / 120)
    shown = check["details"]["disagreements"]
    assert len(shown) == 5 and all(line.split(":")[0] in unstable for line in shown)
    with pytest.raises(BatchlineError, match="failed its latest validation \\(reproducibility\\)"):
        Jobs(store_url).publish(version)
    assert store.resolve_name("repro") is None


def test_without_min_agreement_disagreement_is_reported_and_never_a_failure(
        job_factory: Any, store_url: str) -> None:
    version = run(reproducing(job_factory, options={"unstable_on": ["r000001"]}, sample=120), store_url)
    check = check_of(Jobs(store_url).validate(version))
    assert check["passed"] and "reported, no limit" in check["figure"]
    assert check["details"]["agreement"] == pytest.approx(119 / 120)


def test_on_label_counts_a_record_whose_label_agrees_though_its_text_does_not(
        job_factory: Any, store_url: str) -> None:
    unstable = [f"r{i:06d}" for i in range(60)]
    version = run(reproducing(job_factory, sample=120, on="label", options={"unstable_on": unstable}), store_url)
    details = check_of(Jobs(store_url).validate(version))["details"]
    assert details["exact_agreement"] == pytest.approx(60 / 120)
    assert details["agreement"] == details["label_agreement"] > details["exact_agreement"]


def test_a_sample_larger_than_the_version_recomputes_all_of_it_and_says_so(
        job_factory: Any, store_url: str) -> None:
    version = run(reproducing(job_factory, n=30, sample=1000), store_url)
    check = check_of(Jobs(store_url).validate(version))
    assert check["details"]["sample"] == 30 and check["details"]["asked"] == 1000
    assert "all 30 results (validate.reproduce.sample 1,000 is more than the version holds)" in check["figure"]


def test_the_seed_chooses_the_same_records_whatever_their_order_and_a_larger_sample_holds_a_smaller() -> None:
    ids = [f"r{i}" for i in range(500)]
    assert choose(iter(ids), 20, 3) == choose(iter(ids[::-1]), 20, 3)
    assert set(choose(iter(ids), 20, 3)) <= set(choose(iter(ids), 50, 3))
    assert choose(iter(ids), 20, 3) != choose(iter(ids), 20, 4)


def test_a_version_whose_engine_is_not_installed_where_validate_runs_is_refused_in_one_line_unpublished(
        job_factory: Any, store_url: str, store: Store, tmp_path: Path) -> None:
    version = run(reproducing(job_factory, min_agreement=0.9), store_url)
    # The engine child of `validate` here cannot import the synthetic engine's module.
    refuse = tmp_path / "refuse"
    refuse.mkdir()
    (refuse / "sitecustomize.py").write_text(
        "import importlib.abc, sys\n"
        "class Refuse(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        # Only in the engine child: the parent reads the engine's declared options.\n"
        "        if name == 'batchline.engines.synthetic' and sys.argv[0].endswith('child.py'):\n"
        "            raise ImportError('No module named batchline.engines.synthetic')\n"
        "sys.meta_path.insert(0, Refuse())\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(refuse), str(ROOT)])}
    done = subprocess.run([sys.executable, "-m", "batchline", "validate", version, "--store", store_url],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 5, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert "validate.reproduce: the synthetic engine cannot load here" in line
    assert "pip install 'batchline[dev]'" in line and "Traceback" not in done.stderr
    assert store.latest_validation(version) is None
    with pytest.raises(BatchlineError, match="has not been validated"):
        Jobs(store_url).publish(version)


def test_the_check_is_in_the_report(job_factory: Any, store_url: str, tmp_path: Path) -> None:
    version = run(reproducing(job_factory, sample=120, options={"unstable_on": ["r000003"]}), store_url)
    Jobs(store_url).validate(version)
    page = tmp_path / "report.html"
    Jobs(store_url).report(version, page)
    html = page.read_text()
    assert "reproducibility" in html and "Recomputed otherwise" in html and "r000003" in html
