"""What an orchestrator launched for a version: the rules of the `LaunchRecords` port.

A scheduler's task (an Airflow operator, a Dagster asset) that launches a fleet for a
version writes its intent first, under a key of its own (the DAG, task, run and map index:
the same on every retry of one task run), then launches, then records what it launched
(the Kubernetes objects, the Ray submission, the local runner's process). A retry reads
the record: `launched` is re-attached to and nothing is launched again; an `intent` with
nothing recorded is an orphaned launch (the task died between the two writes), which the
launcher completes idempotently (a Kubernetes object that exists, a Ray submission id that
exists); `stopped` says why it was stopped, and the next try of the key launches again.
Recording an intent opens the version's run (`open_run`), so a deadline counts from the
first launch.

Mixed into `StoreCore`; the SQL is each backend's (the same statement names).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchline.errors import StoreError
from batchline.store.base import Row, StoreBase

INTENT, LAUNCHED, STOPPED = "intent", "launched", "stopped"


@dataclass(frozen=True)
class LaunchRecord:
    """One launch of a version's fleet, by the key of what launched it."""

    version: str
    key: str
    launcher: str  # local, ray, kubernetes
    state: str  # intent, launched, stopped
    by: str
    created_at: float
    detail: dict[str, Any] | None  # what was launched, as the launcher names it
    launched_at: float | None
    stopped_at: float | None
    stop_reason: str | None

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "key": self.key, "launcher": self.launcher, "state": self.state,
                "by": self.by, "created_at": self.created_at, "detail": self.detail,
                "launched_at": self.launched_at, "stopped_at": self.stopped_at, "stop_reason": self.stop_reason}


class LaunchRecords(StoreBase):
    """Launch records of a version: intent, launch, stop."""

    def _launch(self, r: Row) -> LaunchRecord:
        def at(v: Any) -> float | None:
            return float(v) if v is not None else None

        return LaunchRecord(str(r[0]), str(r[1]), str(r[2]), str(r[3]), str(r[4]), float(r[5]),
                            self._unjson(r[6]) if r[6] is not None else None, at(r[7]), at(r[8]), r[9])

    def launch_intent(self, version: str, key: str, launcher: str, by: str) -> tuple[LaunchRecord, bool]:
        """The launch record of `key` for `version`, written as an intent if there was none or
        the one there was stopped (a task run again after a kill launches again); with whether
        this call wrote it. A live record under the key with another launcher is refused: a
        retry launches as its first try did."""

        def body(tx: Any) -> tuple[LaunchRecord, bool]:
            if tx.one(self.q.LOCK_JOB, {"v": version}) is None:
                raise self._no_version(version)
            made = tx.run(self.q.LAUNCH_INTENT, {"v": version, "key": key, "launcher": launcher, "by": by}) == 1
            if made:
                self._event(tx, "launch", version, by, None, None, {"key": key, "launcher": launcher})
                if tx.run(self.q.OPEN_RUN, {"v": version}) == 1:
                    self._event(tx, "open", version, by, None, None, {})
            row = tx.one(self.q.LAUNCH_ROW, {"v": version, "key": key})
            assert row is not None
            return self._launch(row), made

        record, made = self._write(body)
        if record.launcher != launcher:
            raise StoreError(f"{version}: launch {key!r} was made by the {record.launcher} launcher, "
                             f"not {launcher}: a retry launches as its first try did")
        return record, made

    def launch_recorded(self, version: str, key: str, detail: dict[str, Any]) -> LaunchRecord:
        """Records what the launch of `key` started; refused once it was stopped."""

        def body(tx: Any) -> LaunchRecord:
            tx.run(self.q.LAUNCH_DONE, {"v": version, "key": key, "detail": self._json(detail)})
            row = tx.one(self.q.LAUNCH_ROW, {"v": version, "key": key})
            if row is None:
                raise StoreError(f"{version}: no launch {key!r} to record (write its intent first)")
            return self._launch(row)

        record: LaunchRecord = self._write(body)
        if record.state == STOPPED:
            raise StoreError(f"{version}: launch {key!r} was stopped ({record.stop_reason}); not recording it")
        return record

    def launch_stopped(self, version: str, key: str, reason: str) -> LaunchRecord | None:
        """Marks the launch of `key` stopped (kept stopped: a second stop changes nothing)."""

        def body(tx: Any) -> LaunchRecord | None:
            tx.run(self.q.LAUNCH_STOP, {"v": version, "key": key, "reason": reason})
            row = tx.one(self.q.LAUNCH_ROW, {"v": version, "key": key})
            return self._launch(row) if row is not None else None

        stopped: LaunchRecord | None = self._write(body)
        return stopped

    def launches(self, version: str) -> list[LaunchRecord]:
        """Every launch record of the version, oldest first."""
        return [self._launch(r) for r in self._read(lambda tx: tx.all(self.q.LAUNCHES, {"v": version}))]
