"""The workers' port: shards claimed, renewed, split, released and completed under fenced
leases; outcomes written under them; a version halted on its dead letters (I1, I4, I5)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import batchline.store.lineage as lineage
from batchline.acl import Acl
from batchline.errors import StoreError
from batchline.store.base import (
    INPUT_CHANGED,
    MISSING,
    Missing,
    P,
    Row,
    Tx,
    _Lost,
    _scalar,
    acl_value,
    chunks,
    fence,
    no_shard,
    split_point,
    unanswered,
)
from batchline.store.lineage import LineageOutbox
from batchline.store.model import (
    ChargeResult,
    DeadLetterBound,
    DeadLetterRow,
    Halt,
    InputRecord,
    Lease,
    LeaseHolder,
    LeaseLost,
    ResultRow,
    VersionClosed,
    Written,
    within,
)
from batchline.store.rights import NOT_THE_HOLDER, key_hash, new_lease_key


class Leasing(LineageOutbox):
    """The workers' port: shards claimed, renewed, split, released and completed under fenced"""

    def claim(self, worker: str, version: str | None = None, routes: Sequence[str] | None = None,
              *, process: dict[str, Any] | None = None, region: str | None = None,
              foreign: bool = True) -> Lease | None:
        """A shard of `version` (else of the first ready version with one). A worker of a
        `region` is given a shard whose home is its region first; another region's only when
        `foreign` (its locality wait has passed) or its region has no shard left to do."""
        op = uuid.uuid4()
        key = new_lease_key()
        route_list = self._list(list(routes)) if routes is not None else None

        def body(tx: Tx) -> Lease | None:
            versions = [version] if version is not None else [r[0] for r in tx.all(self.q.READY_JOBS)]
            for v in versions:
                params = {"v": v, "routes": route_list, "home": region}
                row = tx.one(self.q.PICK_HOME_SHARD, params) if region is not None else None
                if row is None and (region is None or foreign or tx.one(self.q.HOME_OPEN, params) is None):
                    row = tx.one(self.q.PICK_SHARD, params)
                if row is not None:
                    return self._grant(tx, v, row, worker, process, op, key, region)
            return None

        def recover(tx: Tx) -> Lease | Missing | None:
            for mark in self._marks(tx, op):
                if mark.kind == "claim" and mark.version is not None and mark.shard_no is not None:
                    row = tx.one(self.q.LEASE_BY_CLAIM, {"v": mark.version, "s": mark.shard_no})
                    assert row is not None
                    slice_, count, expires, route, batch, first_piece, end_piece, home = row
                    # If the lease was lost meanwhile, the first fenced write says so.
                    return Lease(mark.version, mark.shard_no, worker, int(mark.epoch or 0), self._unjson(slice_),
                                 int(count), float(expires or 0.0), route,
                                 self._unjson(batch) if batch is not None else None, first_piece, end_piece, home,
                                 key)
            return MISSING

        return self._write(body, recover=recover)

    def _grant(self, tx: Tx, version: str, row: Row, worker: str, process: dict[str, Any] | None,
               op: uuid.UUID, key: str, region: str | None = None) -> Lease:
        shard_no, state, old_owner, old_epoch, slice_, count, route, batch, now, lease_seconds, first, end, home = row
        granted = tx.one(self.q.GRANT_SHARD, {
            "w": worker, "expires": float(now) + float(lease_seconds), "v": version, "s": shard_no,
            "process": self._json(process) if process is not None else None, "region": region,
            "kh": key_hash(key)})
        assert granted is not None
        epoch, expires = int(granted[0]), float(granted[1])
        if state == "leased":
            self._event(tx, "lease_expired", version, old_owner, shard_no, old_epoch, {"reclaimed_by": worker}, op)
        self._event(tx, "claim", version, worker, shard_no, epoch,
                    {"region": region, "home": home} if region is not None or home is not None else None, op)
        self._lineage_claimed(tx, version)
        return Lease(version=version, shard_no=shard_no, owner=worker, epoch=epoch, slice=self._unjson(slice_),
                     record_count=int(count), expires=expires, route=route,
                     batch=self._unjson(batch) if batch is not None else None, first_piece=first, end_piece=end,
                     home=home, key=key)

    def renew(self, lease: Lease, started: int | None = None) -> Lease | None:
        op = uuid.uuid4()

        def body(tx: Tx) -> Lease | _Lost:
            row = tx.one(self.q.RENEW, {**fence(lease), "started": started})
            if row is None:
                return self._refused(tx, lease, "renew", op)
            # The end may have moved down: the shard's tail was split off to another worker.
            return replace(lease, expires=float(row[0]), end_piece=row[1], record_count=int(row[2]))

        renewed = self._write(body, recover=self._recover_refusal(op))
        return None if isinstance(renewed, _Lost) else renewed

    def leases(self, version: str) -> list[LeaseHolder]:
        rows = self._read(lambda tx: tx.all(self.q.LEASE_HOLDERS, {"v": version}))
        return [LeaseHolder(r[0], r[1], int(r[2]), float(r[3]) if r[3] is not None else None,
                            self._unjson(r[4]) if r[4] is not None else None) for r in rows]

    def take_back(self, version: str, holder: LeaseHolder, by: str, proof: dict[str, Any]) -> bool:
        """Ends a lease whose owner is proven dead, at once: fenced on the owner's epoch and
        bumping it, so an owner misjudged alive can only lose its later writes."""
        op = uuid.uuid4()
        lease = Lease(version, holder.shard_no, holder.owner, holder.epoch, {}, 0, holder.expires or 0.0)

        def body(tx: Tx) -> bool:
            taken = tx.run(self.q.TAKE_BACK, fence(lease)) == 1
            if taken:
                self._event(tx, "take_back", version, holder.owner, holder.shard_no, holder.epoch,
                            {"by": by, "proof": proof}, op)
            return taken

        def recover(tx: Tx) -> bool | Missing:
            return True if self._marks(tx, op) else MISSING

        return self._write(body, recover=recover)

    def split(self, version: str, worker: str) -> int | None:
        """Splits the unstarted tail of the leased local shard that has the most of it into a
        new ready shard (see `split_point`); returns the new shard's number, or None. A shard
        holding carried results is never split: the store does not keep which pieces they are
        in, so they would stay counted on the shard that keeps none of their records."""
        op = uuid.uuid4()

        def body(tx: Tx) -> int | None:
            row = tx.one(self.q.SPLIT_CANDIDATE, {"v": version})
            if row is None:
                return None
            shard_no, owner, epoch, slice_json, first, end, started, home = row
            point = split_point(first, end, started)
            if point is None:
                return None
            piece_slice = self._unjson(slice_json)
            moved = piece_slice["pieces"][point - first:end - first]
            records = sum(int(p["records"]) for p in moved)
            dead = sum(int(p.get("dead", 0)) for p in moved)
            new = int(_scalar(tx, self.q.NEXT_SHARD_NO, {"v": version}))
            tx.run(self.q.SHRINK_SHARD, {"v": version, "s": shard_no, "end": point, "old_end": end,
                                         "records": records, "dead": dead})
            tail = {**piece_slice, "pieces": moved, "start": moved[0]["start"], "end": moved[-1]["end"],
                    "first_line": moved[0]["first_line"]}
            tx.run(self.q.SPLIT_SHARD, {"v": version, "new": new, "slice": self._json(tail), "records": records,
                                        "dead": dead, "first": point, "end": end, "home": home})
            self._event(tx, "split", version, owner, shard_no, epoch,
                        {"by": worker, "new_shard": new, "at_piece": point, "end_piece": end, "records": records}, op)
            return new

        def recover(tx: Tx) -> int | Missing | None:
            marks = self._marks(tx, op)
            return int(marks[0].detail["new_shard"]) if marks else MISSING

        return self._write(body, recover=recover)

    def release(self, lease: Lease, reason: str, error: str | None = None) -> bool:
        op = uuid.uuid4()

        def body(tx: Tx) -> bool:
            # A batch already at the provider is not given up with the lease: the shard
            # waits there for the next poller, who must not submit it again.
            released = tx.run(self.q.RELEASE, fence(lease)) == 1
            if released:
                self._event(tx, "release", lease.version, lease.owner, lease.shard_no, lease.epoch,
                            {"reason": reason}, op)
                if reason == INPUT_CHANGED:
                    # No worker gets past a changed input: the run is broken until it is planned anew.
                    self._lineage(tx, lease.version, lineage.FAIL, {"reason": reason, "shard": lease.shard_no,
                                                                    "message": error or "the input changed"})
            else:
                self._refused(tx, lease, "release", op)
            return released

        def recover(tx: Tx) -> bool | Missing:
            marks = self._marks(tx, op)
            return marks[0].kind == "release" if marks else MISSING

        return self._write(body, recover=recover)

    def set_batch(self, lease: Lease, batch: dict[str, Any] | None) -> Lease:
        op = uuid.uuid4()

        def body(tx: Tx) -> _Lost | None:
            changed = tx.run(self.q.SET_BATCH, {**fence(lease), "batch": self._json(batch) if batch is not None
                                                 else None})
            return None if changed == 1 else self._refused(tx, lease, "batch", op)

        if isinstance(self._write(body, recover=self._recover_refusal(op)), _Lost):
            raise LeaseLost.of(lease, "batch")
        return replace(lease, batch=batch)

    def await_provider(self, lease: Lease, batch: dict[str, Any], poll_in: float) -> None:
        op = uuid.uuid4()

        def body(tx: Tx) -> _Lost | None:
            row = tx.one(self.q.SHARD_FOR_AWAIT, {"v": lease.version, "s": lease.shard_no})
            if row is None:
                raise no_shard(lease.version, lease.shard_no)
            state, owner, epoch, previous_json = row
            previous = self._unjson(previous_json) if previous_json is not None else None
            if (owner, epoch) == (lease.owner, lease.epoch) and state == "submitted" and previous == batch:
                return None  # a retry of the same parking
            if tx.run(self.q.AWAIT_PROVIDER, {**fence(lease), "batch": self._json(batch),
                                              "poll_in": float(poll_in)}) != 1:
                return self._refused(tx, lease, "await_provider", op)
            fresh = previous is None or previous.get("batch_id") != batch.get("batch_id")
            self._event(tx, "submitted" if fresh else "provider_wait", lease.version, lease.owner,
                        lease.shard_no, lease.epoch,
                        {"batch_id": batch.get("batch_id"), "requests": batch.get("request_count")}, op)
            return None

        if isinstance(self._write(body, recover=self._recover_refusal(op)), _Lost):
            raise LeaseLost.of(lease, "await_provider")

    def complete(self, lease: Lease, files: Mapping[str, Any] | None = None) -> None:
        op = uuid.uuid4()

        def body(tx: Tx) -> _Lost | None:
            row = tx.one(self.q.SHARD_FOR_COMPLETE, {"v": lease.version, "s": lease.shard_no})
            if row is None:
                raise no_shard(lease.version, lease.shard_no)
            state, owner, epoch, count, results, dead = row
            if (owner, epoch) != (lease.owner, lease.epoch) or state not in ("leased", "done"):
                return self._refused(tx, lease, "complete", op, {"current_epoch": epoch})
            if state == "leased":
                if results + dead != count:
                    raise unanswered(lease, count - results - dead)
                self._finish_shard(tx, lease, int(count), int(results), int(dead), op, files)
            # state == 'done' for this owner and epoch: a retried completion after a
            # lost acknowledgement, which succeeds again.
            return None

        if isinstance(self._write(body, recover=self._recover_refusal(op)), _Lost):
            raise LeaseLost.of(lease, "completion")

    def _finish_shard(self, tx: Tx, lease: Lease, count: int, results: int, dead: int, op: uuid.UUID,
                      files: Mapping[str, Any] | None = None) -> None:
        # The files its worker wrote of it are recorded in the step that completes it, under its
        # fence: a stale owner's file is never the one a publisher adds.
        if tx.run(self.q.FINISH_SHARD, {**fence(lease), "files": self._json(dict(files)) if files else None}) != 1:
            # Its owner and epoch are current (read under the row's lock) but not its key: a
            # worker acting for another's lease.
            raise StoreError(f"shard {lease.shard_no} of {lease.version}: refused: {NOT_THE_HOLDER}")
        self._event(tx, "complete", lease.version, lease.owner, lease.shard_no, lease.epoch,
                    {"records": count, "results": results, "dead_letters": dead}, op)
        self._seal_if_done(tx, lease.version, lease.owner, op)

    def _seal_if_done(self, tx: Tx, version: str, worker: str | None, op: uuid.UUID | None) -> None:
        # Completions of one version take the job's row lock only here, so the one
        # that finishes the last open shard sees (in SEAL's fresh snapshot, after the
        # lock) every other completion committed, and seals exactly once.
        tx.one(self.q.LOCK_JOB, {"v": version})
        if tx.one(self.q.SEAL, {"v": version}) is not None:
            self._event(tx, "seal", version, worker, None, None, None, op)
            self._lineage_sealed(tx, version)

    def halt_of(self, version: str) -> Halt | None:
        row = self._read(lambda tx: tx.one(self.q.JOB_HALT, {"v": version}))
        return self._halt(row[1]) if row is not None and row[0] == "halted" else None

    def judge_dead_letters(self, version: str, worker: str) -> Halt | None:
        figures = self._read(lambda tx: self._figures(tx, version))
        if figures is None:
            return None
        state, bound, dead, outcomes = figures
        if state == "halted":
            return self.halt_of(version)
        if state != "ready" or bound is None or not bound.passed(dead, outcomes):
            return None  # the common case: one read, no write
        op = uuid.uuid4()

        def body(tx: Tx) -> Halt | None:
            now = self._figures(tx, version)
            assert now is not None
            state, bound, dead, outcomes = now
            if state != "ready" or bound is None or not bound.passed(dead, outcomes):
                return self._halt_in(tx, version)
            kind, count, example = tx.one(self.q.DOMINANT_DEAD_KIND, {"v": version}) or ("dead_letter", 0, "")
            halt = Halt(dead, outcomes, bound.rate, bound.min_outcomes, str(kind), int(count), str(example), worker)
            if tx.run(self.q.HALT_JOB, {"v": version, "halt": self._json(halt.to_json())}) != 1:
                return self._halt_in(tx, version)  # another worker halted it, or it was sealed, first
            self._event(tx, "halt", version, worker, None, None, halt.to_json(), op)
            self._lineage(tx, version, lineage.FAIL, {"reason": "halted", "message": halt.message(version),
                                                      **halt.to_json()})
            return halt

        def recover(tx: Tx) -> Halt | Missing | None:
            marks = self._marks(tx, op)
            return Halt.from_json(marks[0].detail) if marks else MISSING

        return self._write(body, recover=recover)

    def open_versions(self) -> list[str]:
        return [r[0] for r in self._read(lambda tx: tx.all(self.q.OPEN_VERSIONS))]

    def has_open_shards(self, version: str | None = None, routes: Sequence[str] | None = None) -> bool:
        params = {"v": version, "routes": self._list(list(routes)) if routes is not None else None}
        stmt = self.q.HAS_OPEN if version is None else self.q.HAS_OPEN_VERSION
        return bool(self._read(lambda tx: _scalar(tx, stmt, params)))

    def answered(self, version: str, record_ids: Sequence[str]) -> set[str]:
        return {r[0] for r in self._by_ids(self.q.ANSWERED, version, record_ids)}

    def input_records(self, version: str, start: int, end: int) -> list[InputRecord]:
        rows = self._read(lambda tx: tx.all(self.q.INPUT_RECORDS, {"v": version, "start": start, "end": end}))
        return [InputRecord(r[0], r[1], acl_value(r[2]), r[3], int(r[4])) for r in rows]

    def attempts(self, version: str, record_ids: Sequence[str]) -> dict[str, int]:
        return {r[0]: int(r[1]) for r in self._by_ids(self.q.ATTEMPTS, version, record_ids)}

    def put_results(self, lease: Lease, rows: Sequence[ResultRow]) -> int:
        # Put-if-absent: a retry after a commit whose acknowledgement was lost finds
        # every row present and inserts none (and counts none).
        return self._fenced_inserts(lease, rows, self._put, "put")

    def charge_attempt(self, lease: Lease, record_id: str, kind: str, error: str, acl: Acl | None,
                       max_attempts: int, piece: int | None = None) -> ChargeResult:
        op = uuid.uuid4()

        def body(tx: Tx) -> ChargeResult | _Lost:
            held = tx.one(self.q.FENCE_LOCK, fence(lease))
            if held is None:
                return self._refused(tx, lease, "charge", op)
            if not held[2]:
                raise VersionClosed.of(lease, "charge")
            if not within(piece, held[0], held[1]):
                # Another shard's record since a split (or one that does not say its piece).
                return ChargeResult(attempts=0, dead_lettered=False)
            if _scalar(tx, self.q.IS_ANSWERED, {"v": lease.version, "r": record_id}):
                return ChargeResult(attempts=0, dead_lettered=False)
            attempts = int(_scalar(tx, self.q.CHARGE, {"v": lease.version, "r": record_id, "kind": kind,
                                                       "error": error}))
            self._event(tx, "attempt_failed", lease.version, lease.owner, lease.shard_no, lease.epoch,
                        {"record_id": record_id, "kind": kind, "attempts": attempts, "error": error[:500]}, op)
            result = ChargeResult(attempts=attempts, dead_lettered=attempts >= max_attempts)
            if result.dead_lettered:
                self._insert_dead(tx, lease, [DeadLetterRow(record_id, kind, error, acl, attempts, piece)])
            return result

        def recover(tx: Tx) -> ChargeResult | _Lost | Missing:
            for mark in self._marks(tx, op):
                if mark.kind == "stale_epoch":
                    return _Lost("charge")
                if mark.kind == "attempt_failed":
                    attempts = int(mark.detail["attempts"])
                    return ChargeResult(attempts=attempts, dead_lettered=attempts >= max_attempts)
            return MISSING

        result = self._write(body, recover=recover)
        if isinstance(result, _Lost):
            raise LeaseLost.of(lease, "charge")
        return result

    def dead_letter(self, lease: Lease, rows: Sequence[DeadLetterRow]) -> int:
        return self._fenced_inserts(lease, rows, self._insert_dead, "dead_letter")

    def _fenced_inserts(self, lease: Lease, rows: Sequence[P],
                        insert: Callable[[Tx, Lease, Sequence[P]], Written], op_name: str) -> int:
        """Rows written in bounded transactions, each fenced by the lease; how many were new.
        Rows of pieces the shard no longer covers (its tail was split off) are refused
        and not counted, and so, on a shard planned with pieces, are rows that do not
        say their piece."""
        inserted = 0
        for chunk in chunks(rows):
            op = uuid.uuid4()

            def body(tx: Tx, chunk: Sequence[P] = chunk, op: uuid.UUID = op) -> int | _Lost:
                written = insert(tx, lease, chunk)
                if not written.held:
                    return self._refused(tx, lease, op_name, op)
                if not written.open:
                    raise VersionClosed.of(lease, op_name)
                return written.rows

            n = self._write(body, recover=self._recover_refusal(op))
            if isinstance(n, _Lost):
                raise LeaseLost.of(lease, op_name)
            inserted += n
        return inserted

    def pin_runtime(self, version: str, runtime: str, worker: str) -> tuple[str, str]:
        def body(tx: Tx) -> tuple[str, str]:
            # The first worker to load the version's engine pins its runtime; later ones read it.
            tx.run(self.q.PIN_RUNTIME, {"v": version, "runtime": runtime, "w": worker})
            row = tx.one(self.q.PINNED_RUNTIME, {"v": version})
            assert row is not None
            return str(row[0]), str(row[1])

        return self._write(body)

    def resume(self, version: str, who: str, reason: str | None, rate: float | None = None,
               min_outcomes: int | None = None) -> DeadLetterBound:
        op = uuid.uuid4()

        def body(tx: Tx) -> DeadLetterBound:
            tx.one(self.q.JOB_STATE_FOR_UPDATE, {"v": version})
            row = tx.one(self.q.JOB, {"v": version})
            if row is None:
                raise self._no_version(version)
            job = self._job(row)
            if job.state != "halted" or job.bound is None:
                raise StoreError(f"cannot resume {version}: it is {job.state}, not halted")
            bound = DeadLetterBound(job.bound.rate if rate is None else rate,
                                    job.bound.min_outcomes if min_outcomes is None else min_outcomes)
            figures = self._figures(tx, version)
            assert figures is not None
            _state, _old, dead, outcomes = figures
            if bound.passed(dead, outcomes):
                raise StoreError(
                    f"cannot resume {version}: {dead:,} of the {outcomes:,} outcomes it computed are dead letters, "
                    f"over {bound.describe()} already, so it would halt again at once; give a higher "
                    f"--abort-dead-letter-rate (1 never halts), or cancel it")
            tx.run(self.q.RESUME_JOB, {"v": version, "abort_rate": bound.rate, "abort_min": bound.min_outcomes})
            self._lineage_resumed(tx, version)
            self._event(tx, "resume", version, None, None, None,
                        {"who": who, "reason": reason, "rate": bound.rate, "min_outcomes": bound.min_outcomes,
                         "was": job.halt.to_json() if job.halt else None}, op)
            # Its last shard may have been completed while it was halted: nobody else would seal it.
            self._seal_if_done(tx, version, None, op)
            return bound

        def recover(tx: Tx) -> DeadLetterBound | Missing:
            for mark in self._marks(tx, op):
                if mark.kind == "resume":
                    return DeadLetterBound(float(mark.detail["rate"]), int(mark.detail["min_outcomes"]))
            return MISSING

        return self._write(body, recover=recover)
