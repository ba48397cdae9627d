"""The publisher's port: coverage and validation, the name's pointer moved by compare-and-set
(I3), retention, and versions ended by cancel, delete or resume."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

import batchline.store.lineage as lineage
from batchline.errors import PublicationMoved, StoreError
from batchline.store.base import (
    MISSING,
    Missing,
    Tx,
    _scalar,
    coverage_from,
)
from batchline.store.lineage import LineageOutbox
from batchline.store.model import (
    Coverage,
    JobInfo,
    rollback_target,
)


class Publishing(LineageOutbox):
    """The publisher's port: coverage and validation, the name's pointer moved by compare-and-set"""

    def coverage(self, version: str, sample: int = 10) -> Coverage:
        # The gate's first step, and the first read of the whole sealed version: its partitions'
        # statistics are made fresh here (their rows were bulk-loaded by workers, and a planner
        # without counts pages through them in a plan that sorts the whole version for each
        # page: validate, publish and exports after it read the version page by page).
        self._analyse(version)
        if self.q.COVERAGE_PROOF:
            proven = self._read(lambda tx: self._full_coverage(tx, version), snapshot=True)
            if proven is not None:
                return proven

        def body(tx: Tx) -> Coverage:
            p = {"v": version, "n": sample}
            # The backend's steps: counts, and between them the settings its joins want.
            found = [tx.one(stmt, p) for stmt in self.q.COVERAGE_STEPS]
            records, results, dead, matched_results, matched_dead, both = (int(r[0]) for r in found if r)
            counts = (records, results, dead, matched_results + matched_dead, both)

            def samples(missing: int, unexpected: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
                return (tuple(r[0] for r in tx.all(self.q.MISSING_SAMPLE, p)) if missing else (),
                        tuple(r[0] for r in tx.all(self.q.UNEXPECTED_SAMPLE, p)) if unexpected else ())

            return coverage_from(counts, samples)

        # One snapshot for every count, so a count and its sample agree.
        return self._read(body, snapshot=True)

    def _full_coverage(self, tx: Tx, version: str) -> Coverage | None:
        """Coverage, if the counts and id fingerprints of the backend's proof show every
        record with exactly one outcome and no other outcome; None where they do not, and
        the joins count what is wrong."""
        found = [tx.one(stmt, {"v": version}) for stmt in self.q.COVERAGE_PROOF]
        (records, *planned), (results, *answered), (dead, *dropped), (both,) = (
            tuple(int(x) for x in row) for row in found if row)
        if both or records != results + dead:
            return None
        if any(p != a ^ d for p, a, d in zip(planned, answered, dropped, strict=True)):
            return None
        return coverage_from((records, results, dead, results + dead, 0), lambda _m, _u: ((), ()))

    def record_validation(self, version: str, passed: bool, report: dict[str, Any]) -> None:
        op = uuid.uuid4()

        def body(tx: Tx) -> None:
            tx.run(self.q.INSERT_VALIDATION, {"v": version, "passed": passed, "report": self._json(report)})
            self._event(tx, "validate", version, None, None, None, {"passed": passed}, op)

        self._write(body, recover=self._recover_marked(op))

    def _point(self, tx: Tx, name: str, version: str) -> str | None:
        """Moves the pointer in one row update, under the pointer's row lock so two
        publishers of one name queue instead of both reading the same `previous`;
        the view reads through it, so readers switch from the whole old version to
        the whole new one at once."""
        row = tx.one(self.q.POINTER_FOR_UPDATE, {"name": name})
        tx.run(self.q.SET_POINTER, {"name": name, "v": version})
        self._make_view(tx, name)
        if not self._is_view(tx, name):
            # Something else holds the name (a table of the store): readers would not
            # read through the pointer, so nothing is published.
            raise StoreError(f"cannot publish {name!r} in {self.where()}: {name!r} is not the view that reads "
                             f"through the pointer; rename the job")
        return str(row[0]) if row else None

    def _unmoved(self, tx: Tx, name: str, expected: int | None, verb: str) -> None:
        """Refuses, under the name's lock, a publish or rollback whose publisher read a
        publication of the name other than its latest: the targets it moved in between
        were moved from a state the store no longer records."""
        row = tx.one(self.q.LATEST_PUBLICATION, {"name": name})
        latest = int(row[0]) if row else None
        if latest == expected:
            return
        now = (f"it now shows {row[1]}, {'rolled back to' if row[2] == 'rollback' else 'published'} by {row[3]}"
               if row else "its publications are gone")
        raise PublicationMoved(f"cannot {verb}: another publish or rollback of {name!r} came in between "
                               f"({now}); nothing was recorded: see `batchline history {name}` and try again")

    def publish(self, name: str, version: str, who: str, reason: str | None,
                validation: dict[str, Any] | None, *, expected: int | None,
                targets: dict[str, Any] | None = None) -> str | None:
        op = uuid.uuid4()

        def body(tx: Tx) -> str | None:
            tx.one(self.q.PLAN_LOCK, {"key": f"publish:{name}"})
            self._unmoved(tx, name, expected, f"publish {version} as {name!r}")
            # Checked under the name's lock: a version cancelled or removed since the
            # caller looked is not published.
            if not _scalar(tx, self.q.IS_SEALED, {"v": version}):
                raise StoreError(f"cannot publish {version}: it is not sealed (cancelled, removed or unfinished)")
            pointer = tx.one(self.q.POINTER_FOR_UPDATE, {"name": name})
            if pointer is not None and pointer[0] == version:
                # Published already: nothing moves, so history records nothing (a
                # publication of a version over itself would be one a rollback returns to).
                return version
            previous = self._point(tx, name, version)
            tx.run(self.q.INSERT_PUBLICATION, {"name": name, "v": version, "previous": previous,
                                               "action": "publish", "who": who, "reason": reason,
                                               "validation": self._json(validation) if validation else None,
                                               "targets": self._json(targets) if targets else None})
            self._event(tx, "publish", version, None, None, None,
                        {"name": name, "previous": previous, "who": who, "reason": reason}, op)
            self._lineage(tx, version, lineage.PUBLISH, {"name": name, "previous": previous, "who": who,
                                                         "reason": reason, "targets": targets or {},
                                                         "validation": validation})
            return previous

        def recover(tx: Tx) -> str | Missing | None:
            marks = self._marks(tx, op)
            return marks[0].detail.get("previous") if marks else MISSING

        return self._write(body, recover=recover)

    def rollback(self, name: str, who: str, reason: str | None, *, expected: int | None,
                 targets: dict[str, Any] | None = None) -> tuple[str, str]:
        op = uuid.uuid4()

        def body(tx: Tx) -> tuple[str, str]:
            tx.one(self.q.PLAN_LOCK, {"key": f"publish:{name}"})
            row = tx.one(self.q.POINTER_FOR_UPDATE, {"name": name})
            if row is None:
                raise StoreError(f"nothing is published under {name!r}")
            current = str(row[0])
            self._unmoved(tx, name, expected, f"roll {name!r} back from {current}")
            back_to = rollback_target(self._publications(tx, name), current)
            if back_to is None:
                raise StoreError(f"{name!r} has no earlier version to roll back to (current: {current})")
            target = back_to
            if not _scalar(tx, self.q.IS_SEALED, {"v": target}):
                raise StoreError(f"cannot roll {name!r} back to {target}: that version was removed")
            self._point(tx, name, target)
            tx.run(self.q.INSERT_PUBLICATION, {"name": name, "v": target, "previous": current,
                                               "action": "rollback", "who": who, "reason": reason,
                                               "validation": None, "targets": self._json(targets) if targets else None})
            self._event(tx, "rollback", target, None, None, None, {"name": name, "from": current, "who": who}, op)
            self._lineage(tx, target, lineage.ROLLBACK, {"name": name, "previous": current, "who": who,
                                                         "reason": reason, "targets": targets or {}})
            return current, target

        def recover(tx: Tx) -> tuple[str, str] | Missing:
            marks = self._marks(tx, op)
            if marks and marks[0].version is not None:
                return str(marks[0].detail["from"]), marks[0].version
            return MISSING

        return self._write(body, recover=recover)

    def remove_version(self, version: str) -> None:
        def body(tx: Tx) -> None:
            if _scalar(tx, self.q.IS_PUBLISHED, {"v": version}):
                raise StoreError(f"{version} is published; it cannot be removed")
            self._remove_rows(tx, version, None)

        # Every statement is idempotent, and a second `remove` event is harmless.
        self._write(body)

    def _remove_rows(self, tx: Tx, version: str, detail: Mapping[str, Any] | None,
                     op: uuid.UUID | None = None) -> None:
        # Rows that a later version carries stay: they hold that version's payload.
        for stmt in self.q.REMOVE_VERSION:
            tx.run(stmt, {"v": version})
        self._event(tx, "remove", version, None, None, None, detail, op)

    def _kept(self, tx: Tx, version: str, verb: str) -> JobInfo:
        """The job, under its name's publication lock, once it is known to be neither the
        published version of its name nor the one a rollback would return to."""
        row = tx.one(self.q.JOB, {"v": version})
        if row is None:
            raise self._no_version(version)
        # Publish and rollback take the same lock: the pointer cannot move while this runs.
        tx.one(self.q.PLAN_LOCK, {"key": f"publish:{row[1]}"})
        row = tx.one(self.q.JOB, {"v": version})  # its state as it is under the lock
        assert row is not None
        job = self._job(row)
        pointer = tx.one(self.q.POINTER_FOR_UPDATE, {"name": job.name})
        if pointer is not None:
            current = str(pointer[0])
            if current == version:
                raise StoreError(f"cannot {verb} {version}: it is published as {job.name!r}")
            if rollback_target(self._publications(tx, job.name), current) == version:
                raise StoreError(f"cannot {verb} {version}: a rollback of {job.name!r} would return to it")
        return job

    def set_gate(self, version: str, gate: dict[str, Any], who: str) -> bool:
        def body(tx: Tx) -> bool:
            row = tx.one(self.q.JOB, {"v": version})
            if row is None:
                raise StoreError(f"no version {version} in {self.where()}")
            job = self._job(row)
            if job.spec.get("validate") == gate:
                return False
            spec = dict(job.spec)  # the key order kept, the section replaced in place
            spec["validate"] = gate
            if tx.run(self.q.SET_GATE, {"v": version, "spec": self._json(spec)}) != 1:
                raise StoreError(f"cannot change the gate of {version}: it is {job.state}")
            self._event(tx, "gate", version, None, None, None, {"who": who, "was": job.spec.get("validate"),
                                                                "now": gate}, uuid.uuid4())
            return True

        return self._write(body)

    def cancel(self, version: str, who: str, reason: str | None) -> bool:
        op = uuid.uuid4()

        def body(tx: Tx) -> bool:
            job = self._kept(tx, version, "cancel")
            if job.state == "cancelled":
                return False
            if job.state not in ("ready", "halted", "sealed"):
                raise StoreError(f"cannot cancel {version}: it is {job.state}")
            # Leases end before the job's row is taken: a completing worker holds its
            # shard and then the job's row, so this order cannot wait on it in a circle.
            ended = tx.run(self.q.END_LEASES, {"v": version})
            if tx.run(self.q.CANCEL_JOB, {"v": version}) != 1:
                raise StoreError(f"cannot cancel {version}: its state changed meanwhile; look again")
            self._event(tx, "cancel", version, None, None, None,
                        {"who": who, "reason": reason, "was": job.state, "leases_ended": ended}, op)
            if job.state == "ready" and self._lineage_running(tx, version):
                self._lineage(tx, version, lineage.ABORT, {"who": who, "reason": reason})
            return True

        def recover(tx: Tx) -> bool | Missing:
            return True if self._marks(tx, op) else MISSING

        return self._write(body, recover=recover)

    def delete(self, version: str, who: str) -> bool:
        op = uuid.uuid4()

        def body(tx: Tx) -> bool:
            job = self._kept(tx, version, "delete")
            if job.state == "removed":
                return False
            if job.state in ("ready", "halted"):
                raise StoreError(f"cannot delete {version}: it is not finished; cancel it first")
            if job.state not in ("sealed", "cancelled"):
                raise StoreError(f"cannot delete {version}: it is {job.state}")
            self._remove_rows(tx, version, {"who": who, "was": job.state}, op)
            return True

        def recover(tx: Tx) -> bool | Missing:
            return True if self._marks(tx, op) else MISSING

        return self._write(body, recover=recover)

