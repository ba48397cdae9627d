"""Whole batchline jobs with `engine: vllm`: real `batchline worker` processes running the
real vLLM (its CPU build, in .venv-vllm: `make test-vllm`) on the tiny random Llama, on
both stores, hurt as preemptible capacity hurts them. No vLLM process outlives its worker."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from batchline.digests import sha256_tree
from batchline.ops.drill.run import gone
from batchline.store import Store, open_store
from tests.helpers import ROOT, check_invariants, planned, start_worker, stop_all, wait_for
from tests.integration.engines.support import save_tiny_llama
from tests.integration.engines.vllm_support import (
    CPU_OPTIONS,
    ENDING_SCHEMA,
    engine_core_pids,
    no_engine_core_but,
)

pytestmark = [pytest.mark.vllm, pytest.mark.acceptance]

PROMPT = "Triage the ticket as JSON: its category, whether it is urgent, and a tag.\n"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(path, hidden_size=256)
    return {"engine": "vllm", "path": str(path), "digest": "sha256:" + sha256_tree(path)}


def vllm_job(job_factory: Callable[..., Path], model: dict[str, Any], n: int, *,
             records: list[dict[str, Any]] | None = None, options: dict[str, Any] | None = None,
             shards: dict[str, Any] | None = None) -> Path:
    path: Path = job_factory(
        records, n=n, model={**model, "options": {**CPU_OPTIONS, **(options or {})}}, prompt=PROMPT, schema=ENDING_SCHEMA,
        decoding={"temperature": 0, "max_tokens": 64, "seed": 0},
        shards={"size": 50, "batch_size": 8, "lease_seconds": 120, "renew_seconds": 1,
                "record_timeout_seconds": 10.0, "batch_timeout_seconds": 60.0, **(shards or {})})
    return path


def descendants(pid: int) -> list[int]:
    """A process's descendants, from /proc (a worker's engine child, its reaper, vLLM's processes)."""
    found: list[int] = []
    todo = [pid]
    while todo:
        current = todo.pop()
        try:
            kids = [int(x) for x in Path(f"/proc/{current}/task/{current}/children").read_text().split()]
        except OSError:
            kids = []
        found.extend(kids)
        todo.extend(kids)
    return found


def leased_and_started(store: Store, version: str) -> Any:
    for row in store.shard_rows(version):
        if row.state == "leased" and 0 < row.results < row.record_count - 8:
            return row
    return None


def worker_env() -> dict[str, str]:
    # vLLM's engine core imports the test's logits processor by name.
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}


def test_a_vllm_job_with_a_worker_killed_mid_shard_loses_and_duplicates_nothing(
        job_factory: Callable[..., Path], tiny_llama: dict[str, Any], store: Store, store_url: str,
        tmp_path: Path) -> None:
    spec, version = planned(vllm_job(job_factory, tiny_llama, 200), store)
    before = engine_core_pids()
    logs = [tmp_path / f"w{i}.log" for i in range(2)]
    procs = [start_worker(store_url, version, log, env=worker_env()) for log in logs]
    try:
        # Two vLLM engines start on a machine the rest of the suite shares: minutes, not seconds.
        victim_row = wait_for(lambda: leased_and_started(store, version), timeout=900,
                              what="a shard partly answered through vLLM", workers=list(zip(procs, logs, strict=True)))
        victim = int(victim_row.owner.split(":")[1])
        family = descendants(victim)
        assert set(family) & engine_core_pids(), "the worker's engine started no vLLM engine core"
        os.kill(victim, signal.SIGKILL)
        # Killing the engine child left vLLM's EngineCore alive: now its process group dies with it.
        wait_for(lambda: gone(victim) and all(gone(p) for p in family), timeout=30,
                 what="the killed worker, its engine child and every vLLM process under it gone")
        survivor = next(p for p in procs if p.pid != victim)
        assert survivor.wait(timeout=600) == 0
    finally:
        stop_all(procs)
    results, dead = check_invariants(store, version, spec)
    assert len(results) + len(dead) == 200
    letters = list(store.iter_dead_letters(version))
    # A random model's answer that max_tokens cuts off is cut off again: one attempt, never three.
    assert all((d.kind, d.attempts) == ("truncated", 1) for d in letters), [(d.kind, d.attempts) for d in letters]
    assert len(results) > 150
    assert all(r.attempt == 1 for r in store.iter_results(version))
    assert not store.events(version, ["engine_fatal"])
    no_engine_core_but(before)


def test_a_record_that_kills_vllms_engine_core_costs_only_itself(
        job_factory: Callable[..., Path], tiny_llama: dict[str, Any], tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    # On SQLite alone: the bisection restarts vLLM four times, and the store plays no part in it.
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    store = open_store(store_url)

    records = [{"id": f"r{i:03d}", "text": f"printer {i} jammed in the meeting room"} for i in range(12)]
    records[5]["text"] = "zebra quartz zebra quartz oracle zebra quartz"
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama["path"])
    poison = tokenizer(records[5]["text"], add_special_tokens=False)["input_ids"][1:-1]
    spec_path = vllm_job(job_factory, tiny_llama, len(records), records=records,
                         options={"logits_processors": ["tests.integration.engines.vllm_poison:KillOnPoison"]},
                         shards={"batch_size": 2, "max_attempts": 1})
    spec, version = planned(spec_path, store)
    before = engine_core_pids()
    worker = start_worker(store_url, version, tmp_path / "w.log",
                          env={**worker_env(), "BATCHLINE_TEST_POISON_IDS": ",".join(map(str, poison))})
    try:
        assert worker.wait(timeout=900) == 0
    finally:
        stop_all([worker])
    results, dead = check_invariants(store, version, spec)
    assert dead == {"r005"} and len(results) == 11
    letter = next(iter(store.iter_dead_letters(version)))
    assert (letter.kind, letter.attempts) == ("crash", 1)
    assert "alone in flight" in letter.error and "engine core died" in letter.error
    crashes = store.events(version, ["engine_crash"])
    assert len(crashes) >= 2  # the batch it was in, then halves of it: bisected, not fatal
    assert not store.events(version, ["engine_fatal"])
    charged = {e.detail["record_id"] for e in store.events(version, ["attempt_failed"])}
    assert charged == {"r005"}
    no_engine_core_but(before)
    store.close()
