"""Retrieved examples reach the engine from the stored spec alone: workers on either store,
started after the examples file is gone, show each record its nearest examples."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from batchline.check.outputs import OutputChecker
from batchline.prompts.render import split_template
from batchline.spec import stored_spec
from batchline.store import Store
from batchline.worker.shard import JobContext
from tests.helpers import check_invariants, make_records, planned, workers_until_done

pytestmark = pytest.mark.acceptance


def test_workers_show_each_record_its_nearest_examples_from_the_stored_spec(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    examples = tmp_path / "labelled.jsonl"
    examples.write_text("".join(json.dumps({"id": f"e{t}", "text": f"an earlier ticket about topic {t}",
                                            "label": "abc"[t % 3]}) + "\n" for t in range(7)))
    spec_path = job_factory(n=30, output={"schema": "schema.json", "label_field": "category"})
    raw = yaml.safe_load(spec_path.read_text())
    raw["prompt"]["examples"] = {"file": str(examples), "k": 2}
    spec_path.write_text(yaml.safe_dump(raw))
    spec, version = planned(spec_path, store)
    examples.unlink()  # a worker elsewhere has only the store

    workers_until_done(store_url, version, tmp_path)
    check_invariants(store, version, spec)
    info = store.job(version)
    assert info is not None
    stored = stored_spec(info)
    job = JobContext(stored, OutputChecker(stored.output_schema), *split_template(stored.prompt.text))
    texts = {r["id"]: r["text"] for r in make_records(30)}
    # The synthetic engine counts a prompt's tokens at 4 characters each.
    expected = {rid: math.ceil(len(job.prompt(rid, text)) / 4) for rid, text in texts.items()}
    assert {r.record_id: r.input_tokens for r in store.iter_results(version)} == expected
    # Each prompt held its record's two nearest: the example of its own topic is one of them.
    assert "an earlier ticket about topic 5" in job.prompt("r000005", texts["r000005"])
    assert all(expected[rid] > math.ceil(len(f"Classify.\n<record>\n{text}\n</record>\n") / 4)
               for rid, text in texts.items())
