"""A hosted route's shard: one batch at the provider at a time, no lease held while it works.

A worker that claims a hosted shard does one of three things and lets go:
  - nothing is at the provider: it records its intent (fenced), submits the
    shard's unanswered records as one batch, and parks the shard `submitted`
    with the provider's batch id, holding no lease;
  - a batch is there and not finished: it parks the shard again until the next poll;
  - the batch has ended: it downloads every answer, validates each against the
    schema, writes results put-if-absent, charges errors as attempts, and
    submits what expired again (or completes the shard when nothing is left).

A worker that dies after recording its intent but before recording the batch
id leaves the intent behind; the next claimer asks the provider for a batch
made for that intent and adopts it, so no record is submitted (or paid for) twice.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from batchline.errors import EngineFatal
from batchline.providers.base import (
    BatchAnswer,
    BatchProvider,
    BatchRequest,
    ProviderError,
    SubmittedBatch,
    custom_id_map,
)
from batchline.snapshot import Record
from batchline.spec import ProviderSpec
from batchline.store import DeadLetterRow, Lease, LeaseLost, ResultRow
from batchline.store.core import chunks
from batchline.worker.shard import ShardContext

# Backoff for a provider that refuses or cannot be reached, doubled per failure in a row.
PROVIDER_RETRY_SECONDS = 30.0
PROVIDER_RETRY_MAX_SECONDS = 900.0
ERROR_KIND = "provider_error"
EXPIRED_KIND = "provider_expired"


class HostedShardRun:
    def __init__(self, ctx: ShardContext, provider: BatchProvider, spec: ProviderSpec,
                 announce: Callable[[str, ProviderSpec], None]) -> None:
        self.ctx = ctx
        self.store = ctx.store
        self.job = ctx.job
        self.provider = provider
        self.spec = spec
        self.announce = announce

    @property
    def lease(self) -> Lease:
        return self.ctx.lease

    @lease.setter
    def lease(self, value: Lease) -> None:
        self.ctx.lease = value

    def run(self) -> str:
        try:
            return self._run()
        except LeaseLost as exc:
            self.ctx.lost(exc)
            return "lost"

    def _run(self) -> str:
        records = self.ctx.records()
        by_id = {r.id: r for r in records}
        to_record = custom_id_map(by_id, self.provider.acceptable_custom_id)
        to_custom = {record_id: custom for custom, record_id in to_record.items()}
        while True:
            batch = self.lease.batch
            if batch is not None and batch.get("batch_id"):
                if self.ctx.stopping:
                    self.store.release(self.lease, self.ctx.stop_reason)  # the batch stays at the provider, and on record
                    return "stopped"
                outcome = self._poll(SubmittedBatch.from_json(batch), by_id, to_record)
                if outcome is not None:
                    return outcome
                continue  # answers are in; what is left goes in a new batch
            answered = self.store.answered(self.lease.version, list(by_id))
            pending = [r for r in records if r.id not in answered]
            if not pending:
                self.store.complete(self.lease)
                return "done"
            if self.ctx.stopping:
                self.store.release(self.lease, self.ctx.stop_reason)
                return "stopped"
            outcome = self._submit(pending, to_custom, batch)
            if outcome != "refused":
                return outcome  # else each record was charged: what is left goes in a new batch

    # -- submitting --

    def _submit(self, pending: list[Record], to_custom: dict[str, str], intent: dict[str, Any] | None) -> str:
        if intent is not None:
            try:
                adopted = self._adopt(intent)
            except ProviderError as exc:
                # Not knowing whether a batch exists, submitting again could pay twice: wait.
                return self._provider_failed(intent, exc, "find")
            if adopted is not None:
                self.store.await_provider(self.lease, {**adopted.to_json(), "expired": intent.get("expired", {})}, 0.0)
                self.ctx.log(f"shard {self.lease.shard_no}: adopted batch {adopted.batch_id}, submitted before a "
                           f"worker stopped; not submitting again")
                return "adopted"
        self.announce(self.lease.version, self.spec)
        tag = f"{self.lease.version}/{self.lease.shard_no}/{self.lease.epoch}"
        intent = {"state": "submitting", "tag": tag, "request_count": len(pending), "since": time.time(),
                  "failures": int((intent or {}).get("failures", 0)), "expired": (intent or {}).get("expired", {})}
        # On record before the provider is called: whoever finds this intent without a
        # batch id asks the provider before submitting again.
        self.lease = self.store.set_batch(self.lease, intent)
        requests = [BatchRequest(to_custom[r.id], self.job.prompt(r.id, r.text))
                    for r in pending]
        try:
            submitted = self.provider.submit(requests, tag)
        except ProviderError as exc:
            if exc.refused and not exc.fatal:
                return self._refused(pending, exc, intent)
            return self._provider_failed(intent, exc, "submit")
        record = {**submitted.to_json(), "submitted_at": self.store.now(), "expired": intent["expired"]}
        self.store.await_provider(self.lease, record, self.spec.poll_seconds)
        self.ctx.log(f"shard {self.lease.shard_no}: submitted {len(requests)} records to {self.spec.route} as batch "
                   f"{submitted.batch_id}")
        return "submitted"

    def _adopt(self, intent: dict[str, Any]) -> SubmittedBatch | None:
        if intent.get("state") != "submitting" or not intent.get("tag"):
            return None
        return self.provider.find(str(intent["tag"]), int(intent.get("request_count", 0)),
                                  float(intent.get("since", 0.0)))

    def _refused(self, pending: list[Record], exc: ProviderError, intent: dict[str, Any]) -> str:
        """The provider refused the batch as a whole: each record in it is charged an
        attempt, so a batch it will never take ends in dead letters instead of a loop."""
        self.ctx.event("provider_error", {"route": self.spec.route, "during": "submit", "error": str(exc)[:500],
                                          "refused": True, "records": len(pending)})
        for record in pending:
            self.ctx.charge(record, ERROR_KIND, f"{self.spec.route}: batch refused: {exc}")
            self.ctx.renew_if_due()
        expired = intent.get("expired") or {}
        self.lease = self.store.set_batch(self.lease, {"expired": expired} if expired else None)
        self.ctx.log(f"shard {self.lease.shard_no}: {self.spec.route} refused the batch ({exc}); "
                   f"{len(pending)} records charged an attempt")
        return "refused"

    def _provider_failed(self, intent: dict[str, Any], exc: ProviderError, during: str) -> str:
        self._fatal(exc)
        failures = int(intent.get("failures", 0)) + 1
        wait = min(PROVIDER_RETRY_SECONDS * 2 ** (failures - 1), PROVIDER_RETRY_MAX_SECONDS)
        self.ctx.event("provider_error", {"route": self.spec.route, "during": during, "error": str(exc)[:500],
                                          "retry_in": wait})
        self.store.await_provider(self.lease, {**intent, "failures": failures, "error": str(exc)[:500]}, wait)
        self.ctx.log(f"shard {self.lease.shard_no}: {self.spec.route} {during} failed ({exc}); retrying in {wait:.0f}s")
        return "provider_error"

    # -- polling and collecting --

    def _poll(self, batch: SubmittedBatch, by_id: dict[str, Record], to_record: dict[str, str]) -> str | None:
        try:
            progress = self.provider.progress(batch)
        except ProviderError as exc:
            return self._wait(batch, f"polling {batch.batch_id} failed ({self._fatal(exc)})")
        if not progress.ended:
            return self._wait(batch, None)
        try:
            answers = list(self.provider.answers(batch))
        except ProviderError as exc:
            return self._wait(batch, f"downloading {batch.batch_id} failed ({self._fatal(exc)})")
        expired = self._collect(batch, progress.status, progress.error, answers, by_id, to_record)
        self.lease = self.store.set_batch(self.lease, {"expired": expired} if expired else None)
        return None

    def _wait(self, batch: SubmittedBatch, problem: str | None) -> str:
        """Parks the shard with its batch until the next poll, holding no lease."""
        self.store.await_provider(self.lease, self.lease.batch or batch.to_json(), self.spec.poll_seconds)
        if problem:
            self.ctx.log(f"shard {self.lease.shard_no}: {problem}; trying again at the next poll")
        return "waiting"

    def _fatal(self, exc: ProviderError) -> ProviderError:
        """Raises EngineFatal for an error no retry can help (credentials refused); else gives it back."""
        if exc.fatal:
            raise EngineFatal(f"{self.spec.route}: {exc}") from None
        return exc

    def _collect(self, batch: SubmittedBatch, status: str, batch_error: str | None, answers: list[BatchAnswer],
                 by_id: dict[str, Record], to_record: dict[str, str]) -> dict[str, int]:
        """Writes what the batch answered; returns, per record it did not answer, how many
        batches in a row have let it expire (carried on the shard to the next batch)."""
        version = self.lease.version
        ids = list(by_id)
        answered = self.store.answered(version, ids)
        attempts = self.store.attempts(version, ids)
        grouped: dict[str, list[BatchAnswer]] = {}
        unknown = 0
        for answer in answers:
            record_id = to_record.get(answer.custom_id)
            if record_id is None:
                unknown += 1
                continue
            grouped.setdefault(record_id, []).append(answer)
        results: list[ResultRow] = []
        failed: list[tuple[Record, str, str]] = []
        counts = {"results": 0, "errors": 0, "expired": 0, "duplicates": 0, "unknown": unknown, "given_up": 0}
        for record_id, group in grouped.items():
            if record_id in answered:
                continue  # an answer we already have: never replaced
            record = by_id[record_id]
            oks = [a for a in group if a.kind == "ok"]
            if len(oks) > 1:
                counts["duplicates"] += len(oks) - 1
            chosen, problem = self._first_valid(oks)
            if chosen is not None:
                canonical, answer = chosen
                results.append(ResultRow(record_id, canonical, record.acl, attempts.get(record_id, 0) + 1,
                                         answer.input_tokens, answer.output_tokens, self.job.label(canonical),
                                         answer.model or self.spec.model, record.piece))
            elif problem is not None:
                failed.append((record, "invalid_output", problem))
            elif any(a.kind == "error" for a in group):
                error = next(a.error for a in group if a.kind == "error") or "error at the provider"
                failed.append((record, ERROR_KIND, f"{self.spec.route}: {error}"))
        # Expired, cancelled, or sent and never answered: not the record's fault, so not
        # charged, and sent again; but a record the provider lets expire batch after batch
        # is given up on, so the job ends rather than waiting a completion window forever.
        expired: dict[str, int] = dict((self.lease.batch or {}).get("expired") or {})
        given_up: list[DeadLetterRow] = []
        if not batch_error:
            for record_id, record in by_id.items():
                group = grouped.get(record_id, [])
                if record_id in answered or any(a.kind in ("ok", "error") for a in group):
                    expired.pop(record_id, None)
                    continue
                expired[record_id] = expired.get(record_id, 0) + 1
                if expired[record_id] >= self.job.spec.shards.max_attempts:
                    given_up.append(DeadLetterRow(
                        record_id, EXPIRED_KIND, f"{self.spec.route}: expired at the provider in "
                        f"{expired.pop(record_id)} batches in a row without an answer", record.acl,
                        attempts.get(record_id, 0), record.piece))
                else:
                    counts["expired"] += 1
        if batch_error and not grouped:
            # The provider refused the batch as a whole: every record in it is charged, so
            # a batch it will never take ends in dead letters instead of a loop.
            sent = [by_id[r] for r in to_record.values() if r in by_id and r not in answered]
            failed.extend((r, ERROR_KIND, f"{self.spec.route}: batch {batch.batch_id} {status}: {batch_error}")
                          for r in sent)
        for chunk in chunks(results, 500):
            counts["results"] += self.ctx.put(chunk)
            self.ctx.renew_if_due()
        for record, kind, error in failed:
            self.ctx.charge(record, kind, error)
            counts["errors"] += 1
            self.ctx.renew_if_due()
        if given_up:
            self.ctx.dead_letter(given_up)
            counts["given_up"] = len(given_up)
        self.ctx.event("provider_collected", {"route": self.spec.route, "batch_id": batch.batch_id,
                                              "status": status, **counts})
        self.ctx.log(f"shard {self.lease.shard_no}: batch {batch.batch_id} {status}: {counts['results']} results, "
                   f"{counts['errors']} errors, {counts['expired']} to send again"
                   + (f", {counts['duplicates']} duplicate answers ignored" if counts["duplicates"] else "")
                   + (f", {unknown} answers for ids not in the shard ignored" if unknown else "")
                   + (f", {len(given_up)} given up after expiring in {self.job.spec.shards.max_attempts} batches"
                      if given_up else ""))
        return expired

    def _first_valid(self, oks: list[BatchAnswer]) -> tuple[tuple[str, BatchAnswer] | None, str | None]:
        """The first answer that passes the schema; a provider that answered one id twice
        does not get to replace the first valid answer with the second."""
        problem = None
        for answer in oks:
            canonical, why = self.job.checker.check(answer.output or "")
            if canonical is not None:
                return (canonical, answer), None
            problem = problem or why or "invalid output"
        return None, problem
