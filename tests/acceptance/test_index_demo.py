"""`make demo-index` (examples/index_demo.py) as a user runs it: the triage published, its
summaries embedded over `input.job` into a LanceDB index, and searched as two groups. What
the demo prints is checked here again against the store and the search itself, so a demo
that stopped checking would still fail."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from batchline.api import Jobs

ROOT = Path(__file__).resolve().parents[2]


def test_the_index_demo_keeps_a_desk_only_ticket_from_hr_and_finds_it_first_for_the_desk(tmp_path: Path) -> None:
    out = tmp_path / "index"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "examples.index_demo", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    [checked] = [line for line in done.stdout.splitlines() if line.startswith("checked: ")]

    jobs = Jobs(f"sqlite:///{out / 'batchline.db'}")
    triage = [json.loads(line) for line in (out / "triage-results.jsonl").read_text().splitlines()]
    desk_only = next(r for r in triage if r["acl"] == ["it-service-desk"])
    assert desk_only["id"] in checked
    query = desk_only["output"]["summary"]
    hr = jobs.search("ticket-summaries", query=query, groups=["hr-confidential"], k=50).hits
    assert hr and desk_only["id"] not in [h.record_id for h in hr]
    desk = jobs.search("ticket-summaries", query=query, groups=["it-service-desk"], k=5).hits
    assert desk[0].record_id == desk_only["id"]

    # Run again, the demo finds both versions done and published, plans and publishes nothing
    # new, and checks the same.
    versions = [(v.version, v.state, v.published) for v in jobs.versions()]
    assert len(versions) == 2 and all(published for _v, _s, published in versions)
    again = subprocess.run([sys.executable, "-m", "examples.index_demo", "--out", str(out)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert [(v.version, v.state, v.published) for v in jobs.versions()] == versions
    assert again.stderr.count("already; nothing changed") == 2, again.stderr[-2000:]
    assert "nothing was left to answer" in again.stderr
    assert [line for line in again.stdout.splitlines() if line.startswith("checked: ")] == [checked]
