"""bench/engine_overhead.py over the example job, whose prompt retrieves labelled examples."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import yaml

from batchline.check.outputs import OutputChecker
from batchline.prompts.render import split_template
from batchline.spec import load_spec
from batchline.worker.shard import JobContext

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "examples" / "tickets" / "job.yaml"


def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("engine_overhead", ROOT / "bench" / "engine_overhead.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_engine_overhead_could_not_read_the_examples_file_and_left_the_examples_out_of_its_raw_loop(
        tmp_path: Path) -> None:
    module = bench()
    base = yaml.safe_load(JOB.read_text())
    assert "examples" in base["prompt"]
    source = ROOT / "examples" / "tickets" / "tickets.jsonl"
    data = tmp_path / "records.jsonl"
    data.write_text("".join(line + "\n" for line in source.read_text().splitlines()[:3]))
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(module.round_spec(base, JOB.parent, data)))
    spec = load_spec(path)  # written away from the example's folder, it still finds every file
    prefix, suffix = split_template(spec.prompt.text)
    job = JobContext(spec, OutputChecker(spec.output_schema), prefix, suffix)
    requests = module.raw_requests(path)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    assert [r.record_id for r in requests] == [str(row["id"]) for row in rows]
    for request, row in zip(requests, rows, strict=True):
        assert request.prompt == job.prompt(str(row["id"]), row["text"])
        # The nearest labelled tickets sit between the shared prefix and the record.
        assert request.prompt.count("<record>") > 1
