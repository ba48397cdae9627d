"""The planner's port: a version's plan written under the `planning` state, and keyed runs."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from batchline.errors import StoreError
from batchline.store.base import (
    DuplicateKey,
    T,
    Tx,
    _bound,
    acl_json,
    chunks,
    taken_over,
)
from batchline.store.lineage import LineageOutbox
from batchline.store.model import (
    DeadLetterBound,
    DeadLetterRow,
    DuplicateRecord,
    PlannedRecord,
    PlannedShard,
    PointerAt,
)


class Planning(LineageOutbox):
    """The planner's port: a version's plan written under the `planning` state, and keyed runs."""

    def _check_name(self, name: str) -> None:
        reserved = getattr(self.q, "RESERVED_NAMES", ())
        if name in reserved or name.startswith(getattr(self.q, "RESERVED_PREFIX", "\0")):
            raise StoreError(f"job name {name!r} is the name of one of the store's own tables in {self.where()}, "
                             f"where the published view would be made; rename the job")

    def begin_plan(self, version: str, name: str, spec: dict[str, Any]) -> CorePlanWriter:
        self._check_name(name)
        token = uuid.uuid4().hex

        def body(tx: Tx) -> None:
            # Serialises planners of one version; different versions plan side by side.
            tx.one(self.q.PLAN_LOCK, {"key": version})
            row = tx.one(self.q.JOB_STATE_FOR_UPDATE, {"v": version})
            if row is not None and row[0] != "planning":
                raise StoreError(f"version {version} is already planned")
            self._prepare_version(tx, version)
            self._delete_version(tx, version)
            # Key order kept as written: see spec.version_material.
            tx.run(self.q.INSERT_JOB, {"v": version, "name": name, "spec": self._json(spec), "token": token})

        self._write(body, retry=False)
        shards = spec.get("shards") or {}
        return CorePlanWriter(self, version, token, _bound(shards.get("abort_dead_letter_rate"),
                                                           shards.get("abort_min_outcomes")))

    def _delete_version(self, tx: Tx, version: str) -> None:
        # Only a version still in 'planning' is ever deleted whole: it never existed
        # for anyone, so its rows and its events go.
        for stmt in self.q.DELETE_PLANNING:
            tx.run(stmt, {"v": version})

    def keyed_version(self, name: str, key: str) -> str | None:
        row = self._read(lambda tx: tx.one(self.q.KEYED_VERSION, {"name": name, "key": key}))
        return None if row is None else str(row[0])

    def keyed_pointer(self, name: str, key: str) -> PointerAt | None:
        row = self._read(lambda tx: tx.one(self.q.KEYED_POINTER, {"name": name, "key": key}))
        if row is None or not row[0]:
            return None  # no such run, or one keyed before its pointer was kept
        return PointerAt(int(row[1]) if row[1] is not None else None)

    def key_plan(self, name: str, key: str, version: str) -> str:
        job = self.job(version)
        if job is None or job.name != name or job.state == "planning":
            raise StoreError(f"cannot key {version} as {name!r} run {key!r}: it is not a planned version of {name!r}")

        def body(tx: Tx) -> str:
            # First planner wins; a second, racing one is told the winner's version.
            tx.run(self.q.KEY_PLAN, {"name": name, "key": key, "v": version})
            row = tx.one(self.q.KEYED_VERSION, {"name": name, "key": key})
            assert row is not None
            return str(row[0])

        return self._write(body)


class CorePlanWriter:
    """Writes a plan under the `planning` state. Planning is not retried after a lost
    connection: the planner stops, and the next one discards what this one left."""

    def __init__(self, store: Planning, version: str, token: str, bound: DeadLetterBound | None = None) -> None:
        self.store = store
        self.q = store.q
        self.version = version
        self.token = token
        self.bound = bound  # the spec's, held by the store from the commit on
        # Each distinct ACL once a version, numbered as first met: 50 M records hold a number each.
        self.acl_nos: dict[str, int] = {}

    def _planning(self, body: Callable[[Tx], T]) -> T:
        def checked(tx: Tx) -> T:
            row = tx.one(self.q.PLAN_TOKEN, {"v": self.version})
            if row is None or row[0] != self.token:
                raise taken_over(self.version)
            return body(tx)
        return self.store._write(checked, retry=False)

    def add_shards(self, shards: Sequence[PlannedShard]) -> None:
        rows = [{"v": self.version, "s": s.shard_no, "slice": self.store._json(s.slice), "n": s.record_count,
                 "route": s.route, "first": s.first_piece, "end": s.end_piece, "home": s.home} for s in shards]
        self._planning(lambda tx: tx.many(self.q.INSERT_SHARD, rows))

    def add_records(self, records: Sequence[PlannedRecord]) -> None:
        for chunk in chunks(records, 20_000):
            seen: dict[str, int] = {}
            for r in chunk:
                if r.record_id in seen:
                    raise DuplicateRecord(r.record_id, seen[r.record_id])
                seen[r.record_id] = r.shard_no
            new: list[dict[str, Any]] = []
            nos: list[int | None] = []
            for r in chunk:
                text = acl_json(r.acl)
                if text is None:
                    nos.append(None)
                    continue
                no = self.acl_nos.get(text)
                if no is None:
                    no = self.acl_nos[text] = len(self.acl_nos)
                    new.append({"v": self.version, "n": no, "acl": text})
                nos.append(no)

            def body(tx: Tx, chunk: Sequence[PlannedRecord] = chunk, new: list[dict[str, Any]] = new,
                     nos: list[int | None] = nos) -> None:
                if new:
                    tx.many(self.q.INSERT_ACL, new)
                self.store._insert_records(tx, self.version, chunk, nos)

            try:
                self._planning(body)
            except DuplicateKey:
                raise self._duplicate(chunk) from None

    def _duplicate(self, chunk: Sequence[PlannedRecord]) -> DuplicateRecord | StoreError:
        for r in chunk:
            row = self.store._read(lambda tx, r=r: tx.one(self.q.RECORD_SHARD,  # type: ignore[misc]
                                                          {"v": self.version, "r": r.record_id}))
            if row is not None:
                return DuplicateRecord(r.record_id, int(row[0]))
        return StoreError(f"planning of {self.version}: a record id was refused as a duplicate")

    def add_dead_letters(self, shard_no: int, rows: Sequence[DeadLetterRow]) -> None:
        params = [{"v": self.version, "s": shard_no, "r": r.record_id, "kind": r.kind, "error": r.error}
                  for r in rows]

        def body(tx: Tx) -> None:
            tx.many(self.q.PLAN_DEAD_LETTER, params)
            tx.run(self.q.BUMP_DEAD, {"n": len(rows), "v": self.version, "s": shard_no})

        self._planning(body)

    def carry_from(self, base: str) -> int:
        def body(tx: Tx) -> int:
            p = {"v": self.version, "base": base}
            carried = tx.run(self.q.CARRY, p)
            tx.run(self.q.SET_CARRIED, {"n": carried, "v": self.version})
            # One pass over the carried rows, not one per shard.
            tx.run(self.q.CARRY_COUNTS, p)
            tx.run(self.q.CARRY_DONE, p)
            self.store._event(tx, "carry", self.version, None, None, None, {"base": base, "records": carried})
            return carried
        return self._planning(body)

    def commit(self, record_count: int, shard_count: int) -> None:
        def body(tx: Tx) -> None:
            tx.run(self.q.COMMIT_PLAN, {"records": record_count, "shards": shard_count, "v": self.version,
                                        "abort_rate": self.bound.rate if self.bound else None,
                                        "abort_min": self.bound.min_outcomes if self.bound else None})
            self.store._event(tx, "plan", self.version, None, None, None,
                              {"records": record_count, "shards": shard_count})
            # Nothing left to infer (no shards, or everything carried): sealed at planning, a run
            # that starts and completes at once.
            if tx.one(self.q.SEAL, {"v": self.version}) is not None:
                self.store._lineage_sealed(tx, self.version)
        self._planning(body)
        self.store._planned(self.version)

    def abort(self) -> None:
        def body(tx: Tx) -> None:
            row = tx.one(self.q.PLAN_TOKEN_ANY, {"v": self.version})
            if row is not None and row[0] == self.token:
                self.store._delete_version(tx, self.version)
        # On failure a half-written plan stays invisible in the 'planning' state and is replaced next time.
        with contextlib.suppress(StoreError):
            self.store._write(body, retry=False)
