"""One scripted sequence of store operations gives the same results, the same refusal
messages and the same refused operations on every store: the rules are written once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from batchline.acl import Acl
from batchline.errors import StoreError
from batchline.store import (
    DeadLetterRow,
    LeaseLost,
    PlannedRecord,
    PlannedShard,
    ResultRow,
    Store,
    open_store,
)
from tests.helpers import fresh_pg_database

LEASE = 100.0
OUT = '{"category":"a","summary":"s"}'


def attempt(call: Any) -> Any:
    """What an operation gave, or the refusal it raised, as plain values."""
    try:
        return ("ok", call())
    except LeaseLost as exc:
        return ("lease lost", exc.op, str(exc))
    except StoreError as exc:
        return ("refused", str(exc))


def script(store: Store) -> list[Any]:
    seen: list[Any] = []
    writer = store.begin_plan("job@1", "job", {"name": "job", "shards": {"lease_seconds": LEASE}})
    writer.add_shards([PlannedShard(0, {"n": 0}, 3), PlannedShard(1, {"n": 1}, 2, "hosted"),
                       PlannedShard(2, {"n": 2}, 2)])
    writer.add_records([PlannedRecord(f"s{s}-{i}", s, "h") for s, n in ((0, 3), (1, 2), (2, 2))
                        for i in range(n)])
    writer.add_dead_letters(2, [DeadLetterRow("s2-1", "too_long", "over the cap", Acl(["g"]))])
    writer.commit(7, 3)
    first = store.claim("w1", routes=["local"])
    assert first is not None
    seen.append(("claim", first.shard_no, first.epoch, first.route))
    seen.append(attempt(lambda: store.put_results(first, [ResultRow("s0-0", OUT, Acl(["a"]), 1, 10, 3, "a"),
                                                          ResultRow("s0-0", OUT)])))
    seen.append(attempt(lambda: store.complete(first)))
    seen.append(attempt(lambda: store.charge_attempt(first, "s0-1", "engine_error", "boom", None, 2)))
    seen.append(attempt(lambda: store.charge_attempt(first, "s0-1", "engine_error", "boom again", None, 2)))
    seen.append(attempt(lambda: store.dead_letter(first, [DeadLetterRow("s0-0", "too_long", "x")])))
    store.shift_clock(LEASE + 1)
    second = store.claim("w2", "job@1", ["local"])
    assert second is not None
    seen.append(("reclaim", second.shard_no, second.epoch))
    for op in (lambda: store.put_results(first, [ResultRow("s0-2", OUT)]),
               lambda: store.complete(first),
               lambda: store.charge_attempt(first, "s0-2", "crash", "x", None, 3),
               lambda: store.dead_letter(first, [DeadLetterRow("s0-2", "too_long", "x")]),
               lambda: store.renew(first), lambda: store.release(first, "stop")):
        seen.append(attempt(op))
    seen.append(attempt(lambda: store.put_results(second, [ResultRow("s0-2", OUT, None, 2, 5, 1)])))
    seen.append(attempt(lambda: store.complete(second)))
    seen.append(attempt(lambda: store.complete(second)))  # a retried completion succeeds again
    hosted = store.claim("w3", routes=["hosted"])
    assert hosted is not None
    hosted = store.set_batch(hosted, {"state": "submitting", "tag": "t"})
    store.await_provider(hosted, {"batch_id": "b1", "request_count": 2}, 1000.0)
    seen.append(attempt(lambda: store.release(hosted, "late")))
    third = store.claim("w4", routes=["local"])
    assert third is not None
    seen.append(("claim", third.shard_no, third.epoch))
    seen.append(attempt(lambda: store.put_results(third, [ResultRow("s2-0", OUT, None, 1, 7, 2)])))
    seen.append(attempt(lambda: store.release(third, "stop")))
    again = store.claim("w4", routes=["local"])
    assert again is not None
    seen.append(attempt(lambda: store.complete(again)))
    store.shift_clock(1001.0)
    poller = store.claim("w5", routes=["hosted"])
    assert poller is not None
    seen.append(("poll", poller.shard_no, poller.epoch, poller.batch))
    seen.append(attempt(lambda: store.put_results(poller, [ResultRow("s1-0", OUT, None, 1, 4, 4),
                                                           ResultRow("s1-1", OUT, None, 1, 4, 4)])))
    seen.append(attempt(lambda: store.set_batch(poller, None).batch))
    seen.append(attempt(lambda: store.complete(poller)))
    st = store.status("job@1")
    seen.append(("status", st.state, st.records, st.results, st.dead_letters, st.shards, st.dead_letters_by_kind,
                 st.leases_lost, st.records_done_last_minutes))
    seen.append(("routes", {k: v.__dict__ for k, v in sorted(store.route_totals("job@1").items())}))
    seen.append(("tokens", store.token_totals("job@1")))
    cov = store.coverage("job@1")
    seen.append(("coverage", cov.records, cov.missing, cov.unexpected, cov.both, cov.missing_sample,
                 cov.unexpected_sample))
    seen.append(("rows", [(r.shard_no, r.state, r.owner, r.epoch, r.claims, r.record_count, r.results,
                           r.dead_letters, r.route, r.batch_id) for r in store.shard_rows("job@1")]))
    seen.append(("results", [(r.record_id, r.output, r.acl, r.worker, r.epoch, r.attempt, r.input_tokens,
                              r.output_tokens, r.label) for r in store.iter_results("job@1")]))
    seen.append(("dead", [(d.record_id, d.kind, d.error, d.acl, d.attempts, d.worker)
                          for d in store.iter_dead_letters("job@1")]))
    seen.append(("events", [(e.kind, e.worker, e.shard_no, e.epoch, e.detail) for e in store.events("job@1")]))
    seen.append(attempt(lambda: store.begin_plan("job@1", "job", {})))
    # A version halted on its dead letters: refused a resume under which it would halt again, then resumed.
    writer = store.begin_plan("job@2", "job", {"name": "job", "shards": {
        "lease_seconds": LEASE, "abort_dead_letter_rate": 0.5, "abort_min_outcomes": 2}})
    writer.add_shards([PlannedShard(0, {"n": 0}, 3)])
    writer.add_records([PlannedRecord(f"h-{i}", 0, "h") for i in range(3)])
    writer.commit(3, 1)
    bounded = store.claim("w6", "job@2")
    assert bounded is not None
    store.dead_letter(bounded, [DeadLetterRow("h-1", "truncated", "cut off"), DeadLetterRow("h-0", "truncated", "x")])
    seen.append(("halt", store.judge_dead_letters("job@2", "w6"), store.claim("w7", "job@2")))
    for resume in (lambda: store.resume("job@2", "ops", None), lambda: store.resume("job@2", "ops", "ok", rate=1.0),
                   lambda: store.resume("job@2", "ops", None)):
        seen.append(attempt(resume))
    job = store.job("job@2")
    assert job is not None
    seen.append(("halted job", job.state, job.bound, job.halt, store.status("job@2").halt))
    seen.append(("events", [(e.kind, e.worker, e.detail) for e in store.events("job@2", ["halt", "resume"])]))
    return seen


@pytest.mark.postgres
def test_one_script_gives_the_same_outcome_on_every_backend(tmp_path: Path) -> None:
    sqlite = open_store(f"sqlite:///{tmp_path / 'agree.db'}")
    try:
        on_sqlite = script(sqlite)
    finally:
        sqlite.close()
    with fresh_pg_database("bl_agree") as url:
        pg = open_store(url)
        try:
            on_postgres = script(pg)
        finally:
            pg.close()
    for step, (a, b) in enumerate(zip(on_sqlite, on_postgres, strict=True)):
        assert a == b, f"step {step}: SQLite gave {a!r}, PostgreSQL {b!r}"
    # The script went where it means to: refusals of each kind, and a sealed version.
    refused_ops = [s[1] for s in on_sqlite if s[0] == "lease lost"]
    assert refused_ops == ["put", "completion", "charge", "dead_letter"]
    assert ("refused", "shard 0 of job@1 has 2 records without an outcome; not completing it") in on_sqlite
    assert next(s for s in on_sqlite if s[0] == "status")[1] == "sealed"
    halted = next(s for s in on_sqlite if s[0] == "halt")
    assert halted[1] is not None and halted[1].example == "h-0" and halted[2] is None
