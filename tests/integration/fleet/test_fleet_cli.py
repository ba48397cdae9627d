"""The `launch` and `grants` commands, parsed as `batchline` parses them."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from batchline.cli import fleet
from batchline.errors import BatchlineError
from batchline.store import Store
from tests.helpers import planned


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="batchline")
    fleet.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


EGRESS = ["--egress-cidr", "10.20.0.0/16"]


def test_launch_k8s_prints_one_job_per_worker_with_the_jobs_grace_period(
        lake_env: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    from batchline.plan.planner import plan
    from tests.helpers import make_records
    from tests.integration.lake.test_object_inputs import jsonl, object_spec

    url = lake_env.bucket().put("in/tickets.jsonl", jsonl(make_records(10)))
    version = plan(object_spec(tmp_path, {"path": url}, shards={"size": 100, "grace_seconds": 90}), store).version
    out = tmp_path / "fleet.yaml"
    assert run(["launch", "k8s", "--store", store_url, "--job", version, "--workers", "4", "--image", "img:1",
                "--queue", "gpu", "--store-secret", "bl-store", "--cpu", "8", "--memory", "64Gi",
                "--weights-cache-size", "40Gi", *EGRESS, "--out", str(out)]) == 0
    docs = list(yaml.safe_load_all(out.read_text()))
    jobs = [d for d in docs if d["kind"] == "Job"]
    assert len(jobs) == 4
    assert {j["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] for j in jobs} == {90 + 30}
    assert store_url not in out.read_text()


def test_launch_k8s_refuses_a_version_whose_input_its_pods_cannot_read(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    # Regression: --job rendered workers for an input on this machine (--schedule refused the same).
    _spec, version = planned(job_factory(n=10), store)
    out = tmp_path / "fleet.yaml"
    with pytest.raises(BatchlineError, match=rf"^{re.escape(version)}: input.path: .*input.jsonl is on this machine, "
                                             "where pods elsewhere cannot read it") as refused:
        run(["launch", "k8s", "--store", store_url, "--job", version, "--image", "img:1", "--queue", "q",
             "--store-secret", "s", "--gpus-per-worker", "0", *EGRESS, "--out", str(out)])
    assert refused.value.exit_code == 2 and not out.exists()


def test_launch_refuses_a_version_the_store_does_not_have(store_url: str, store: Store) -> None:
    with pytest.raises(BatchlineError, match=re.escape(f"no job version 'nope@1' in {store.where()}")) as k8s:
        run(["launch", "k8s", "--store", store_url, "--job", "nope@1", "--image", "i", "--queue", "q",
             "--store-secret", "s"])
    with pytest.raises(BatchlineError, match="no job version 'nope@1'") as ray:
        run(["launch", "ray", "--store", store_url, "--job", "nope@1"])
    assert k8s.value.exit_code == ray.value.exit_code == 66


def test_grants_refuses_a_sqlite_store(tmp_path: Path) -> None:
    with pytest.raises(BatchlineError, match="needs a PostgreSQL store"):
        run(["grants", "v@1", "--store", f"sqlite:///{tmp_path / 'store.db'}", "--dry-run"])
