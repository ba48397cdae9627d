"""A local route's shard: records stream through the engine child, outcomes stream back.

Results are written as they complete, in bounded flushes, fenced by the lease's
epoch. When the child crashes or misses a batch's deadline, the records in
flight are bisected in fresh children until the one that fails alone is found,
and only it is charged an attempt (I4). When the worker is asked to stop
(SIGTERM, SIGINT, a preemption notice) the run stops taking records, finishes
what is in flight within the grace period, writes it, and gives the lease back (I5).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batchline.errors import EngineFatal
from batchline.snapshot import Record
from batchline.store import DeadLetterRow, LeaseLost, ResultRow
from batchline.worker.engine_process import EngineProcess, describe_exit
from batchline.worker.shard import ShardContext

FLUSH_ROWS = 500
FLUSH_SECONDS = 0.25
# A child whose output has closed is dead or dying; its status is worth a short wait.
CRASH_STATUS_WAIT_SECONDS = 5.0


@dataclass
class _Group:
    """Records sent to the child together, with the deadline the batch must meet."""

    remaining: dict[str, Record]
    deadline: float
    isolated: bool
    sent: float = 0.0
    size: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    budget: float = 0.0  # batch_timeout + n * record_timeout: how long the engine may take on it


class LocalShardRun:
    def __init__(self, ctx: ShardContext, engine: EngineProcess, restart_engine: Callable[[], EngineProcess]) -> None:
        self.ctx = ctx
        self.job = ctx.job
        self.shards = ctx.job.spec.shards
        self.telemetry = ctx.worker.telemetry
        self.engine = engine
        self.restart_engine = restart_engine
        self.pending: deque[Record] = deque()
        self.isolation: deque[list[Record]] = deque()
        self.groups: list[_Group] = []
        self.attempts: dict[str, int] = {}
        self.results: list[ResultRow] = []
        self.too_long: list[DeadLetterRow] = []
        self.buffer_since = 0.0
        self.started: int | None = None  # every piece before it has had records sent to the engine

    # -- the shard loop --

    def run(self) -> str:
        try:
            return self._run()
        except LeaseLost as exc:
            self.ctx.lost(exc)
            if self._in_flight():
                self.engine = self.restart_engine()  # its records belong to a shard we no longer hold
            return "lost"
        except EngineFatal:
            with contextlib.suppress(LeaseLost):
                self._flush(force=True)  # what was computed before the engine died is good
            raise

    def _run(self) -> str:
        lease = self.ctx.lease
        records = self.ctx.records()
        ids = [r.id for r in records]
        answered = self.ctx.store.answered(lease.version, ids)
        self.attempts = self.ctx.store.attempts(lease.version, ids)
        self.pending.extend(r for r in records if r.id not in answered)
        stop_at: float | None = None
        while True:
            now = time.monotonic()
            if self.ctx.stopping and stop_at is None:
                stop_at = now + self.shards.grace_seconds
                # What the engine has not started goes back: the grace is for what it decodes.
                self.engine.withdraw()
                self.ctx.log(f"stopping: taking back what the engine has not started, finishing what it "
                             f"decodes (grace {self.shards.grace_seconds:.0f}s)")
            if stop_at is not None and (not self.groups or now >= stop_at):
                return self._stop()
            if stop_at is None:
                self._fill(now)
            if not self.groups and not self.pending and not self.isolation:
                break
            msg = self.engine.get(self._wait_seconds(now))
            if msg is not None:
                if msg["op"] == "out":
                    self._outcome(msg)
                elif msg["op"] == "withdrawn":
                    self._withdrawn(msg["ids"])
                elif msg["op"] == "fatal":
                    # The engine says it cannot go on (CUDA error, server gone): no record is to blame.
                    raise EngineFatal(msg["error"])
                elif msg["op"] == "crash":
                    # The engine died under its records and says how; the child exits as it would on a crash.
                    self._failure("crash", msg["error"])
                elif msg["op"] == "eof":
                    self._failure("crash", None)
            now = time.monotonic()
            if self.groups and self.groups[0].deadline <= now:
                self._failure("hang", None)
            self._flush(force=False)
            # Renewing only while the child keeps its deadlines: a hung engine lets the lease lapse.
            if not (self.groups and self.groups[0].deadline <= now):
                end = self.ctx.lease.end_piece
                self.ctx.renew_if_due(now, self.started)
                if self.ctx.lease.end_piece != end:
                    self._drop_split_off()
        self._flush(force=True)
        self.ctx.judge_if_due(force=True)  # the shard's last dead letters, whatever the clock says
        self.ctx.complete()
        return "done"

    def _withdrawn(self, ids: list[str]) -> None:
        """Records the engine gave back unstarted, the worker stopping: unanswered, uncharged."""
        for record_id in ids:
            record = self._take({"id": record_id}, answered=False)
            if record is not None:
                self.pending.append(record)
        self.ctx.log(f"took back {len(ids)} records the engine had not started; "
                     f"{self._in_flight()} still decoding")

    def _drop_split_off(self) -> None:
        """The shard's tail went to another worker: what is not sent yet of it is not sent."""
        holds = self.ctx.lease.holds
        self.pending = deque(r for r in self.pending if holds(r.piece))
        self.isolation = deque(group for group in ([r for r in g if holds(r.piece)] for g in self.isolation) if group)
        self.ctx.log(f"shard {self.ctx.lease.shard_no}: its tail from piece {self.ctx.lease.end_piece} was split off "
                     f"to another worker; {len(self.pending)} records left here")

    def _stop(self) -> str:
        self._flush(force=True)
        if self.groups:
            # Unfinished records are lost, not charged. The worker is stopping, so no
            # new engine is started: the GPU is free as soon as this child is gone.
            self.engine.kill()
            self.groups.clear()
        if not self.pending and not self.isolation:
            self.ctx.complete()
            return "done-then-stopped"
        self.ctx.release(self.ctx.stop_reason)
        return "stopped"

    def _in_flight(self) -> int:
        return sum(len(g.remaining) for g in self.groups)

    def _wait_seconds(self, now: float) -> float:
        waits = [0.5, self.ctx.last_renew + self.shards.renew_seconds - now]
        if self.groups:
            waits.append(self.groups[0].deadline - now)
        if self.results or self.too_long:
            waits.append(self.buffer_since + FLUSH_SECONDS - now)
        return max(0.0, min(waits))

    # -- sending --

    def _fill(self, now: float) -> None:
        if any(g.isolated for g in self.groups):
            return
        if self.isolation:
            if not self.groups:
                self._send(self.isolation.popleft(), isolated=True, now=now)
            return
        size = self.shards.batch_size
        # Two batches in flight keep a streaming engine busy while the next is queued.
        while self.pending and self._in_flight() < 2 * size:
            batch = [self.pending.popleft() for _ in range(min(size, len(self.pending)))]
            batch = self._claim_pieces(batch)
            if batch:
                self._send(batch, isolated=False, now=now)

    def _claim_pieces(self, batch: list[Record]) -> list[Record]:
        """Before the first record of a piece goes to the engine, the store hears that the
        piece is started (a renewal that says so), so a split of this shard's tail never
        takes a piece whose records are already being computed here."""
        pieces = [r.piece for r in batch if r.piece is not None]
        if not pieces or max(pieces) + 1 <= (self.started or 0):
            return batch
        end = self.ctx.lease.end_piece
        self.ctx.renew_now(max(pieces) + 1)
        if self.ctx.lease.end_piece == end:
            return batch
        self._drop_split_off()
        return [r for r in batch if self.ctx.lease.holds(r.piece)]

    def _send(self, records: list[Record], *, isolated: bool, now: float) -> None:
        budget = self.shards.batch_timeout_seconds + len(records) * self.shards.record_timeout_seconds
        start = max([now] + [g.deadline for g in self.groups])
        self.groups.append(_Group({r.id: r for r in records}, start + budget, isolated, now, len(records),
                                  budget=budget))
        pieces = [r.piece for r in records if r.piece is not None]
        if pieces:
            self.started = max(self.started or 0, max(pieces) + 1)  # reported in _claim_pieces
        self.telemetry.in_flight(self._in_flight())
        self.engine.send([self.job.request(r) for r in records])

    # -- receiving --

    def _take(self, msg: dict[str, Any], *, answered: bool = True) -> Record | None:
        for i, g in enumerate(self.groups):
            record = g.remaining.pop(msg["id"], None)
            if record is not None:
                g.input_tokens += msg.get("in") or 0
                g.output_tokens += msg.get("outt") or 0
                if not answered:
                    g.size -= 1  # given back, not answered: not part of the batch's figures
                if not g.remaining:
                    del self.groups[i]
                    if g.size:
                        self.telemetry.engine_batch(g.size, time.monotonic() - g.sent, g.input_tokens,
                                                    g.output_tokens)
                    if i == 0 and self.groups:
                        # A queued batch's clock starts when the one ahead of it is done, not at
                        # that one's deadline: stacked deadlines would grow by a whole budget per
                        # batch sent, and a hang late in a shard would go unseen for minutes.
                        head = self.groups[0]
                        head.deadline = min(head.deadline, time.monotonic() + head.budget)
                self.telemetry.in_flight(self._in_flight())
                return record
        return None

    def _outcome(self, msg: dict[str, Any]) -> None:
        record = self._take(msg)
        if record is None:
            return  # an answer from a batch already given up on
        if not self.ctx.lease.holds(record.piece):
            return  # its piece was split off to another worker, which answers it
        if msg.get("kind") == "too_long":
            self._buffer_dead(DeadLetterRow(record.id, "too_long", msg["error"], record.acl,
                                            self.attempts.get(record.id, 0), record.piece))
        elif msg.get("error") and msg.get("finish") != "length":
            self._charge(record, msg.get("kind") or "engine_error", msg["error"])
        else:
            # An engine that knows its output was cut off says so with an error; another
            # returns what it wrote, and the schema check finds it incomplete.
            canonical, problem = (None, msg["error"]) if msg.get("error") else self.job.checker.check(msg["output"])
            if canonical is None and msg.get("finish") == "length" and self.job.retry_cannot_help_truncation:
                # At temperature 0 a local engine writes the same tokens again and is cut off
                # at the same place: a second attempt costs the same and fails the same.
                self._charge(record, "truncated", f"the output reached decoding.max_tokens="
                             f"{self.job.spec.decoding.max_tokens} at temperature 0 and does not fit the "
                             f"schema ({problem or 'invalid output'}); retrying would write it again",
                             max_attempts=1)
            elif canonical is None:
                self._charge(record, msg.get("kind") or "invalid_output", problem or "invalid output")
            else:
                self._buffer(ResultRow(record.id, canonical, record.acl, self.attempts.get(record.id, 0) + 1,
                                       msg.get("in"), msg.get("outt"), self.job.label(canonical), self.job.model,
                                       record.piece))

    def _buffer(self, row: ResultRow) -> None:
        if not self.results and not self.too_long:
            self.buffer_since = time.monotonic()
        self.results.append(row)

    def _buffer_dead(self, row: DeadLetterRow) -> None:
        if not self.results and not self.too_long:
            self.buffer_since = time.monotonic()
        self.too_long.append(row)

    def _charge(self, record: Record, kind: str, error: str, *, max_attempts: int | None = None) -> None:
        result = self.ctx.charge(record, kind, error, max_attempts=max_attempts)
        if result.attempts == 0:
            return  # answered meanwhile
        self.attempts[record.id] = result.attempts
        if result.dead_lettered:
            return
        if kind in ("crash", "hang"):
            self.isolation.appendleft([record])
        else:
            self.pending.append(record)

    def _failure(self, kind: str, detail: str | None) -> None:
        suspects = [r for g in self.groups for r in g.remaining.values()]
        self.groups.clear()
        self.telemetry.engine_failure(kind)
        code = self.engine.ended(CRASH_STATUS_WAIT_SECONDS) if kind == "crash" else self.engine.exit_code
        self.ctx.event(f"engine_{kind}", {"in_flight": len(suspects), "exit_code": code, "error": detail})
        self.engine = self.restart_engine()
        self.ctx.renew_soon()  # the restart may have taken a while
        if len(suspects) == 1:
            what = (f"engine process died ({describe_exit(code)})" if kind == "crash"
                    else "engine gave no answer before the batch deadline")
            self._charge(suspects[0], kind, f"{what} with this record alone in flight"
                         + (f": {detail}" if detail else ""))
        elif suspects:
            half = len(suspects) // 2
            self.isolation.appendleft(suspects[half:])
            self.isolation.appendleft(suspects[:half])

    # -- writing --

    def _flush(self, *, force: bool) -> None:
        if not self.results and not self.too_long:
            return
        due = (len(self.results) + len(self.too_long) >= FLUSH_ROWS
               or time.monotonic() - self.buffer_since >= FLUSH_SECONDS)
        if not (force or due):
            return
        if self.results:
            self.ctx.put(self.results)
            self.results = []
        if self.too_long:
            self.ctx.dead_letter(self.too_long, outcome="too_long")
            self.too_long = []
