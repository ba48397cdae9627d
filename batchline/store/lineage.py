"""The lineage outbox: each state change of a version that OpenLineage reports, written in the
transaction that makes the change, and sent later by whichever batchline process drains it.

A version's computation is a run: it starts at the version's first claim, completes when it
seals, fails when it is halted (or a worker finds its input changed), and is aborted when it
is cancelled while it runs. A halted version that is resumed runs again as the next attempt
(`jobs.run_attempt`). Publish and rollback are runs of their own. Each of these transitions
writes one row here in the same store transaction as the change itself, keyed so that a
transition is written once however many workers race to it (`dedupe`), and so that a process
killed right after the change leaves its row for the next process to send.

Draining is claim, send, mark: a drainer claims rows for a while (`claimed_until`), sends
them, and marks each sent; a row whose sender died is claimed again once its claim has
lapsed (so a row may be sent twice, never lost: consumers key events by run id, type and
time). A send that fails is tried again later, a bounded number of times, then given up and
kept, with its error, for `batchline lineage` to show.

Mixed into `StoreCore`; the SQL is each backend's (the same statement names). The store
knows nothing of OpenLineage: a row holds the transition and its figures, and the event is
made from it and the version's stored spec when it is sent (`batchline.lineage`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from batchline.store.base import Row, StoreBase

# Transitions of a version's computation run, and the runs of publication.
START, COMPLETE, FAIL, ABORT = "start", "complete", "fail", "abort"
PUBLISH, ROLLBACK = "publish", "rollback"
RUN_KINDS = (START, COMPLETE, FAIL, ABORT)
KINDS = (*RUN_KINDS, PUBLISH, ROLLBACK)


@dataclass(frozen=True)
class OutboxRow:
    """One transition to report."""

    id: int
    version: str
    kind: str  # one of KINDS
    attempt: int  # the computation's attempt (1, then one more per resume)
    at: float  # the database's time of the transition
    detail: Mapping[str, Any]
    tries: int = 0
    sent_at: float | None = None
    given_up_at: float | None = None
    last_error: str | None = None

    @property
    def state(self) -> str:
        return "sent" if self.sent_at is not None else "given up" if self.given_up_at is not None else "pending"


class LineageOutbox(StoreBase):
    """Writing transitions into the outbox (inside the store's own transactions) and draining it."""

    # --- written by the transitions, in their transaction -----------------------------------

    def _lineage(self, tx: Any, version: str, kind: str, detail: Mapping[str, Any] | None = None,
                 attempt: int | None = None, dedupe: str | None = None) -> None:
        """One transition's row; a computation run's transition is written once per attempt."""
        if attempt is None:
            row = tx.one(self.q.LINEAGE_RUN_ATTEMPT, {"v": version})
            attempt = int(row[0]) if row is not None else 1
        if dedupe is None and kind in RUN_KINDS:
            dedupe = f"{version}/{attempt}/{kind}"
        tx.run(self.q.LINEAGE_INSERT, {"v": version, "kind": kind, "attempt": attempt,
                                       "detail": self._json(dict(detail or {})), "dedupe": dedupe})

    def _lineage_claimed(self, tx: Any, version: str) -> None:
        """At each claim: the first claim of an attempt starts its run (one conditional update,
        which changes nothing at every later claim)."""
        row = tx.one(self.q.LINEAGE_START_RUN, {"v": version})
        if row is not None:
            self._lineage(tx, version, START, attempt=int(row[0]))

    def _lineage_sealed(self, tx: Any, version: str) -> None:
        """The run completes: its figures, read once (the version no longer changes). A version
        sealed without a claim of its attempt (resumed with every shard done) starts it too."""
        self._lineage_claimed(tx, version)
        results, dead, carried, tin, tout = (int(x or 0) for x in tx.one(self.q.LINEAGE_FIGURES, {"v": version}))
        by_kind = {str(k): int(n) for k, n in tx.all(self.q.LINEAGE_DEAD_BY_KIND, {"v": version})}
        paid = tx.one(self.q.LINEAGE_PAID, {"v": version})
        self._lineage(tx, version, COMPLETE, {
            "results": results - carried, "carried": carried, "dead_letters": dead, "dead_letters_by_kind": by_kind,
            "input_tokens": tin, "output_tokens": tout,
            "paid_worker_seconds": float(paid[0] or 0.0), "paid_cost": float(paid[1] or 0.0)})

    def _lineage_resumed(self, tx: Any, version: str) -> None:
        """A halted version that runs again is the next attempt: a new run, started at its first claim."""
        tx.run(self.q.LINEAGE_NEXT_ATTEMPT, {"v": version})

    def _lineage_running(self, tx: Any, version: str) -> bool:
        """Whether the version's current attempt has started (its first claim) and not ended."""
        row = tx.one(self.q.LINEAGE_RUN_ATTEMPT, {"v": version})
        return row is not None and row[1] is not None

    # --- draining --------------------------------------------------------------------------

    def _outbox_row(self, r: Row) -> OutboxRow:
        def at(v: Any) -> float | None:
            return float(v) if v is not None else None

        return OutboxRow(int(r[0]), str(r[1]), str(r[2]), int(r[3]), float(r[4]),
                         self._unjson(r[5]) if r[5] is not None else {}, int(r[6]), at(r[7]), at(r[8]), r[9])

    def lineage_claim(self, by: str, *, version: str | None = None, hold_seconds: float = 60.0,
                      limit: int = 100) -> list[OutboxRow]:
        """Rows due to be sent (of `version`, or of every version), in the order they were
        written, claimed by `by` for `hold_seconds`: no other drainer takes them meanwhile."""
        params = {"v": version, "by": by, "hold": hold_seconds, "n": limit}
        rows = self._write(lambda tx: tx.all(self.q.LINEAGE_CLAIM, params))
        return sorted((self._outbox_row(r) for r in rows), key=lambda r: r.id)

    def lineage_sent(self, row_id: int, by: str) -> bool:
        """The row was sent; False when the claim had lapsed and another drainer holds it."""
        changed: int = self._write(lambda tx: tx.run(self.q.LINEAGE_SENT, {"id": row_id, "by": by}))
        return changed == 1

    def lineage_failed(self, row_id: int, by: str, error: str, *, retry_in: float, give_up: bool) -> None:
        """A send failed: tried again after `retry_in` seconds, or kept as given up."""
        self._write(lambda tx: tx.run(self.q.LINEAGE_FAILED, {"id": row_id, "by": by, "error": error[:2000],
                                                              "retry_in": retry_in, "give_up": give_up}))

    def lineage_parent(self, version: str) -> dict[str, Any] | None:
        """The run of the orchestrator's task that launched the version (`namespace`, `name`,
        `run_id`), which the version's events name as their parent; None without one."""
        row = self._read(lambda tx: tx.one(self.q.LINEAGE_PARENT, {"v": version}))
        return self._unjson(row[0]) if row is not None and row[0] is not None else None

    def set_lineage_parent(self, version: str, parent: Mapping[str, str]) -> None:
        """Names the orchestrator's task run as the version's lineage parent (the latest
        launcher's: a retried task keeps its run)."""
        missing = sorted({"namespace", "name", "run_id"} - set(parent))
        if missing:
            raise ValueError(f"a lineage parent needs {', '.join(missing)}")
        wanted = {k: str(parent[k]) for k in ("namespace", "name", "run_id")}
        if self._write(lambda tx: tx.run(self.q.SET_LINEAGE_PARENT, {"v": version, "parent": self._json(wanted)})) != 1:
            raise self._no_version(version)

    def lineage_rows(self, version: str | None = None) -> list[OutboxRow]:
        """Every row (of `version`), sent or not, oldest first."""
        return [self._outbox_row(r) for r in self._read(lambda tx: tx.all(self.q.LINEAGE_ROWS, {"v": version}))]

    def lineage_retry(self, version: str | None = None) -> int:
        """Rows given up on are due again (after the receiver is mended)."""
        changed: int = self._write(lambda tx: tx.run(self.q.LINEAGE_RETRY, {"v": version}))
        return changed
