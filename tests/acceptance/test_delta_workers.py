"""Real `batchline worker` processes over a Delta Lake table's version: one killed mid-shard
(its lease taken back on proof, one outcome per record, partition values on every row), and
a data file rewritten after planning refused by name with nothing written. On both stores."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchline.plan.planner import plan
from batchline.spec import load_spec
from batchline.store import Store
from tests.acceptance.test_lake_workers import partly_done
from tests.acceptance.test_worker_faults import owner_pid, sealed, stored_ids
from tests.helpers import (
    call_counts,
    check_invariants,
    kill_9,
    make_records,
    start_worker,
    stop_all,
    wait_for,
)
from tests.integration.test_delta_input import delta_job, slices, write_table

pytestmark = pytest.mark.acceptance

N = 900
SHARD = 100


def test_a_worker_killed_over_a_delta_version_leaves_one_outcome_per_record(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    records = make_records(N)
    table = write_table(tmp_path / "tickets", records[:N // 2], partition_by=["team"])
    write_table(table, records[N // 2:], partition_by=["team"])
    call_log = tmp_path / "calls.log"
    path = delta_job(job_factory, {"uri": str(table)}, acl_field="team",
                     options={"seconds_per_record": 0.004, "call_log": str(call_log)},
                     shards={"size": SHARD, "lease_seconds": 60})
    spec = load_spec(path)
    version = plan(spec, store).version
    assert len({s.path for s in slices(store, version)}) == 6
    procs = [start_worker(store_url, version, tmp_path / f"w{i}.log") for i in range(2)]
    try:
        victim_row = wait_for(lambda: partly_done(store, version), what="a shard partly done")
        victim = owner_pid(victim_row.owner)
        kill_9(victim)
        in_flight = set(call_counts(call_log)) - stored_ids(store, version)
        procs.append(start_worker(store_url, version, tmp_path / "w-replacement.log"))
        wait_for(lambda: sealed(store, version), timeout=180, what="the job to seal")
    finally:
        stop_all(procs)
    results, dead = check_invariants(store, version, spec)
    assert dead == set() and len(results) == N
    assert all(r.acl == [f"team-{int(r.record_id[1:]) % 3}"] for r in store.iter_results(version))
    [taken] = store.events(version, ["take_back"])
    assert (taken.shard_no, taken.worker, taken.detail["proof"]["pid"]) == (victim_row.shard_no, victim_row.owner,
                                                                             victim)
    asked_again = {rid for rid, n in call_counts(call_log).items() if n > 1}
    assert asked_again <= in_flight, f"recomputed records that were already stored: {asked_again - in_flight}"


def test_a_data_file_rewritten_after_planning_is_refused_by_name_and_nothing_is_written(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    table = write_table(tmp_path / "tickets", make_records(150))
    version = plan(load_spec(delta_job(job_factory, {"uri": str(table)})), store).version
    [data_file] = {s.path for s in slices(store, version)}
    # Someone rewrote the file in place: same rows but one text, same name.
    rows = pq.read_table(data_file).to_pylist()
    rows[3]["text"] = "changed after planning"
    pq.write_table(pa.Table.from_pylist(rows), data_file)
    log = tmp_path / "w.log"
    assert start_worker(store_url, version, log).wait(timeout=60) == 3
    assert f"{data_file}:1: input changed since planning" in log.read_text()
    assert not list(store.iter_results(version))
    [refused] = store.events(version, ["input_changed"])
    assert data_file in refused.detail["error"]
    assert all(r.state == "ready" for r in store.shard_rows(version))
