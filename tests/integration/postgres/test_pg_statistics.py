"""A sealed version's partitions were filled by workers in bulk and may never have been analysed:
the gate's first step gives PostgreSQL their statistics, so every later read of the version page
by page (the schema check, publish, exports) follows the primary key instead of sorting the
whole version for each page (found by the 50 M rehearsal: validating 2,000,000 results took
minutes, not seconds)."""

from __future__ import annotations

import psycopg
import pytest

from batchline.store import PlannedRecord, PlannedShard, ResultRow, Store
from batchline.store.postgres import partition_name
from batchline.store.postgres_sql import COMPUTED_OUTPUTS_PAGE

pytestmark = pytest.mark.postgres

OUT = '{"category":"a","summary":"s"}'
RECORDS = 20_000


def test_a_version_never_analysed_is_paged_through_by_its_key_not_sorted_whole_for_each_page(
        store: Store, pg_url: str) -> None:
    writer = store.begin_plan("job@1", "job", {"name": "job", "shards": {"lease_seconds": 600}})
    writer.add_shards([PlannedShard(0, {"digest": "sha256:a"}, RECORDS)])
    ids = [f"r{i:06d}" for i in range(RECORDS)]
    writer.add_records([PlannedRecord(rid, 0, "h") for rid in ids])
    writer.commit(RECORDS, 1)
    results = partition_name("results", "job@1")
    with psycopg.connect(pg_url, autocommit=True) as conn:
        # Autovacuum must not analyse it first: this is the version as workers leave it.
        conn.execute(f'ALTER TABLE "{results}" SET (autovacuum_enabled = false)')
        lease = store.claim("w1", "job@1")
        assert lease is not None
        store.put_results(lease, [ResultRow(rid, OUT) for rid in ids])
        store.complete(lease)

        def tuples() -> float:
            [(n,)] = conn.execute("SELECT reltuples FROM pg_class WHERE relname = %s", (results,)).fetchall()
            return float(n)

        assert tuples() <= 0  # never analysed
        assert store.coverage("job@1").missing == 0  # the gate's first step
        assert tuples() > 0
        plan = "\n".join(r[0] for r in conn.execute(
            "EXPLAIN " + COMPUTED_OUTPUTS_PAGE, {"v": "job@1", "after": ids[RECORDS // 2], "n": 5000}).fetchall())
    assert f"Index Scan using {results}_pkey" in plan and "Sort" not in plan, plan
