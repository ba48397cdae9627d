"""A Hypothesis state machine of the shard table against a model of its rules.

Claims, renewals, expiry (by shifting the database clock), reclaims, late puts
and completions carrying old epochs, retried completions and releases, take-backs
of a lease whose owner is proven dead, splits of a shard's unstarted tail (with
the owner's later writes past its new end refused), and for hosted routes the
parking of a shard at a provider (`submitted`, holding no lease, due to be polled
later) with its batch, in any order: the store must do exactly what the model
says, on every store.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, multiple, rule

from batchline.errors import StoreError
from batchline.store import Lease, LeaseLost, PlannedRecord, PlannedShard, ResultRow, Store

LEASE = 100.0
POLL = 50.0  # shorter than one clock shift, far longer than the steps between two
SHARDS = 2
PER_SHARD = 4  # pieces of one record each
PIECES = SHARDS * PER_SHARD


@dataclass
class ModelShard:
    first: int
    end: int
    state: str = "ready"
    owner: str | None = None
    epoch: int = 0
    expires: float | None = None
    results: set[str] = field(default_factory=set)
    batch: dict[str, str] | None = None
    poll_at: float | None = None
    started: int | None = None


def make_machine(store: Store) -> type[RuleBasedStateMachine]:
    class ShardTable(RuleBasedStateMachine):
        leases = Bundle("leases")

        @initialize()
        def plan(self) -> None:
            self.version = f"sm@{uuid.uuid4().hex[:10]}"
            writer = store.begin_plan(self.version, "sm", {"name": "sm", "shards": {"lease_seconds": LEASE}})
            writer.add_shards([PlannedShard(
                s, {"pieces": [{"start": p, "end": p + 1, "first_line": p + 1, "digest": "d", "records": 1}
                               for p in range(s * PER_SHARD, (s + 1) * PER_SHARD)], "start": 0, "end": 0,
                    "first_line": 1}, PER_SHARD, first_piece=s * PER_SHARD, end_piece=(s + 1) * PER_SHARD)
                for s in range(SHARDS)])
            writer.add_records([PlannedRecord(self.rid(p), p // PER_SHARD, "h") for p in range(PIECES)])
            writer.commit(PIECES, SHARDS)
            self.model = [ModelShard(s * PER_SHARD, (s + 1) * PER_SHARD) for s in range(SHARDS)]

        @staticmethod
        def rid(piece: int) -> str:
            return f"r{piece}"

        def current(self, lease: Lease) -> bool:
            m = self.model[lease.shard_no]
            return m.state == "leased" and (m.owner, m.epoch) == (lease.owner, lease.epoch)

        @rule(target=leases, worker=st.sampled_from(["w1", "w2", "w3"]))
        def claim(self, worker: str) -> object:
            now = store.now()
            expected = next((s for s, m in enumerate(self.model)
                             if m.state == "ready" or (m.state == "leased" and m.expires is not None
                                                       and m.expires <= now)
                             or (m.state == "submitted" and m.poll_at is not None and m.poll_at <= now)), None)
            lease = store.claim(worker, self.version)
            if expected is None:
                assert lease is None
                return multiple()
            assert lease is not None and lease.shard_no == expected
            m = self.model[expected]
            assert lease.epoch == m.epoch + 1
            assert lease.batch == m.batch  # whoever claims a shard learns what is at the provider
            m.state, m.owner, m.epoch, m.expires = "leased", worker, lease.epoch, lease.expires
            return lease

        @rule(lease=leases, started=st.none() | st.integers(0, PIECES))
        def renew(self, lease: Lease, started: int | None) -> None:
            expected = self.current(lease)
            renewed = store.renew(lease, started=started)
            assert (renewed is not None) == expected
            if renewed is not None:
                m = self.model[lease.shard_no]
                m.expires = renewed.expires
                m.started = max(m.started if m.started is not None else m.first,
                                started if started is not None else m.first)
                assert renewed.end_piece == m.end and renewed.record_count == m.end - m.first

        @rule(lease=leases, piece=st.integers(0, PIECES - 1))
        def put(self, lease: Lease, piece: int) -> None:
            rid = self.rid(piece)
            m = self.model[lease.shard_no]
            if self.current(lease):
                n = store.put_results(lease, [ResultRow(rid, "{}", piece=piece)])
                mine = m.first <= piece < m.end
                assert n == (1 if mine and rid not in m.results else 0)
                if mine:
                    m.results.add(rid)
                    m.started = max(m.started if m.started is not None else m.first, piece + 1)
            else:
                with pytest.raises(LeaseLost):
                    store.put_results(lease, [ResultRow(rid, "{}", piece=piece)])

        @rule()
        def split(self) -> None:
            from batchline.store.core import split_point

            now = store.now()
            candidates = [(-(m.end - max(m.started if m.started is not None else m.first, m.first)), s)
                          for s, m in enumerate(self.model)
                          if m.state == "leased" and m.expires is not None and m.expires > now]
            new = store.split(self.version, "splitter")
            if not candidates:
                assert new is None
                return
            s = min(candidates)[1]
            m = self.model[s]
            point = split_point(m.first, m.end, m.started)
            if point is None:
                assert new is None
                return
            assert new == len(self.model)
            assert not any(int(r[1:]) >= point for r in m.results)  # nothing stored moves
            self.model.append(ModelShard(point, m.end))
            m.end = point

        @rule(lease=leases)
        def take_back(self, lease: Lease) -> None:
            from batchline.store import LeaseHolder

            expected = self.current(lease)
            holder = LeaseHolder(lease.shard_no, lease.owner, lease.epoch, None, None)
            assert store.take_back(self.version, holder, "prover", {"kind": "test"}) == expected
            if expected:
                m = self.model[lease.shard_no]
                m.state = "submitted" if m.batch and m.batch.get("batch_id") else "ready"
                m.owner, m.expires, m.poll_at, m.epoch = None, None, store.now(), m.epoch + 1

        @rule(lease=leases)
        def complete(self, lease: Lease) -> None:
            m = self.model[lease.shard_no]
            if m.state == "done" and (m.owner, m.epoch) == (lease.owner, lease.epoch):
                store.complete(lease)  # retried completion: succeeds again
            elif self.current(lease) and len(m.results) == m.end - m.first:
                store.complete(lease)
                m.state = "done"
            elif self.current(lease):
                with pytest.raises(StoreError) as info:
                    store.complete(lease)
                assert not isinstance(info.value, LeaseLost)
            else:
                with pytest.raises(LeaseLost):
                    store.complete(lease)

        @rule(lease=leases)
        def release(self, lease: Lease) -> None:
            expected = self.current(lease)
            assert store.release(lease, "test") == expected
            if expected:
                m = self.model[lease.shard_no]
                m.state = "submitted" if m.batch and m.batch.get("batch_id") else "ready"
                m.owner, m.expires, m.poll_at = None, None, store.now()

        @rule(lease=leases, batch_id=st.sampled_from(["b1", "b2"]))
        def park(self, lease: Lease, batch_id: str) -> None:
            m = self.model[lease.shard_no]
            batch = {"batch_id": batch_id}
            retried = m.state == "submitted" and (m.owner, m.epoch) == (lease.owner, lease.epoch) and m.batch == batch
            if self.current(lease) or retried:
                store.await_provider(lease, batch, POLL)
                if not retried:
                    m.state, m.batch, m.expires, m.poll_at = "submitted", batch, None, store.now() + POLL
            else:
                with pytest.raises(LeaseLost):
                    store.await_provider(lease, batch, POLL)

        @rule(lease=leases, intent=st.booleans())
        def record_intent(self, lease: Lease, intent: bool) -> None:
            batch = {"state": "submitting"} if intent else None
            if self.current(lease):
                assert store.set_batch(lease, batch).batch == batch
                self.model[lease.shard_no].batch = batch
            else:
                with pytest.raises(LeaseLost):
                    store.set_batch(lease, batch)

        @rule()
        def expire(self) -> None:
            store.shift_clock(LEASE + 1)

        @invariant()
        def table_matches_model(self) -> None:
            if not hasattr(self, "model"):
                return
            rows = store.shard_rows(self.version)
            assert [(r.state, r.owner, r.epoch, r.results, r.batch_id, r.record_count) for r in rows] == [
                (m.state, m.owner, m.epoch, len(m.results), (m.batch or {}).get("batch_id"), m.end - m.first)
                for m in self.model]
            sealed = all(m.state == "done" for m in self.model)
            job = store.job(self.version)
            assert job is not None and (job.state == "sealed") == sealed

    return ShardTable


def test_shard_table_follows_its_model(store: Store) -> None:
    machine = make_machine(store)
    machine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
    machine.TestCase().runTest()
