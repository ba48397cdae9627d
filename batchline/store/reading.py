"""Reading a version: its status and figures, its outcomes, its publications."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from batchline.store.base import (
    SHARD_STATES,
    StoreBase,
    Tx,
    _scalar,
    no_shard,
    route_totals_from,
    stored_dead_letter,
    stored_result,
)
from batchline.store.model import (
    JobStatus,
    Publication,
    RouteTotals,
    ShardRow,
    StoredDeadLetter,
    StoredResult,
    ValidationRecord,
)


class Reading(StoreBase):
    """Reading a version: its status and figures, its outcomes, its publications."""

    def status(self, version: str, window_seconds: float = 300.0) -> JobStatus:
        def body(tx: Tx) -> JobStatus:
            row = tx.one(self.q.JOB, {"v": version})
            if row is None:
                raise self._no_version(version)
            job = self._job(row)
            now = float(_scalar(tx, self.q.NOW))
            shards = dict.fromkeys(SHARD_STATES, 0)
            results = dead = 0
            for state, n, r, d in tx.all(self.q.STATUS_SHARDS, {"v": version}):
                shards[state] = int(n)
                results += int(r or 0)
                dead += int(d or 0)
            by_kind = {k: int(n) for k, n in tx.all(self.q.DEAD_BY_KIND, {"v": version})}
            lost = int(_scalar(tx, self.q.LEASES_LOST, {"v": version}))
            taken, splits = (int(_scalar(tx, self.q.COUNT_EVENTS, {"v": version, "kind": k}))
                             for k in ("take_back", "split"))
            first_claim = _scalar(tx, self.q.FIRST_CLAIM, {"v": version})
            # A sealed version's rate is over its own run, first claim to seal: the clock
            # running on after the seal does not lower it.
            ended = job.sealed_at if job.state == "sealed" and first_claim is not None else None
            since = float(first_claim) if ended is not None else now - window_seconds
            recent = int(_scalar(tx, self.q.RECENT, {"v": version, "since": since}))
            stopped = None
            if job.state == "ready":
                refused = tx.one(self.q.STOPPED_BY_INPUT, {"v": version})
                if refused is not None:
                    error = (self._unjson(refused[1]) or {}).get("error") or "input changed since planning"
                    stopped = f"shard {refused[0]}: {error}"
            return JobStatus(version=version, name=job.name, state=job.state, records=job.record_count,
                             results=results, dead_letters=dead, shards=shards, dead_letters_by_kind=by_kind,
                             leases_lost=lost, records_done_last_minutes=recent, window_seconds=window_seconds,
                             now=now, halt=job.halt, leases_taken_back=taken, splits=splits,
                             started_at=float(first_claim) if first_claim is not None else None,
                             stopped=stopped, ended_at=ended, opened_at=job.opened_at)

        return self._read(body, snapshot=True)

    def shard_slice(self, version: str, shard_no: int) -> dict[str, Any]:
        row = self._read(lambda tx: tx.one(self.q.SHARD_SLICE, {"v": version, "s": shard_no}))
        if row is None:
            raise no_shard(version, shard_no)
        return dict(self._unjson(row[0]))

    def shard_rows(self, version: str) -> list[ShardRow]:
        rows = self._read(lambda tx: tx.all(self.q.SHARD_ROWS, {"v": version}))
        return [ShardRow(r[0], r[1], r[2], int(r[3]), float(r[4]) if r[4] is not None else None, int(r[5]),
                         int(r[6]), int(r[7]), int(r[8]), r[9], r[10],
                         float(r[11]) if r[11] is not None else None) for r in rows]

    def route_totals(self, version: str) -> dict[str, RouteTotals]:
        return route_totals_from(self._read(lambda tx: tx.all(self.q.ROUTE_TOTALS, {"v": version})))

    def token_totals(self, version: str) -> tuple[int, int]:
        row = self._read(lambda tx: tx.one(self.q.TOKEN_TOTALS, {"v": version}))
        assert row is not None
        return int(row[0] or 0), int(row[1] or 0)

    def result_histogram(self, version: str, start: float, width: float, bins: int) -> list[tuple[int, int, int]]:
        params = {"v": version, "start": start, "width": width, "last": max(bins - 1, 0)}
        return [(int(a), int(b), int(n)) for a, b, n in self._read(lambda tx: tx.all(self.q.RESULT_HISTOGRAM,
                                                                                      params))]

    def run_throughput(self, version: str) -> float:
        row = self._read(lambda tx: tx.one(self.q.RUN_THROUGHPUT, {"v": version}))
        records, seconds = row if row is not None else (None, None)
        return float(records) / float(seconds) if records and seconds and seconds > 0 else 0.0

    def iter_results(self, version: str, page_size: int = 5000, *,
                     computed_only: bool = False) -> Iterator[StoredResult]:
        stmt = self._carrying(version, "COMPUTED_RESULTS_PAGE" if computed_only else "RESULTS_PAGE")
        for r in self._pages(stmt, version, page_size):
            yield stored_result(r)

    def iter_outputs(self, version: str, page_size: int = 20_000) -> Iterator[tuple[str, str]]:
        """Each result this version computed (none carried), as its record id and output, in id
        order: the two columns the gate's schema check reads, without the rest of each row."""
        for r in self._pages(self.q.COMPUTED_OUTPUTS_PAGE, version, page_size):
            yield str(r[0]), str(r[1])

    def results_for(self, version: str, record_ids: Sequence[str]) -> dict[str, StoredResult]:
        stmt = self._carrying(version, "RESULTS_FOR")
        return {r[0]: stored_result(r) for r in self._by_ids(stmt, version, record_ids)}

    def iter_dead_letters(self, version: str) -> Iterator[StoredDeadLetter]:
        for r in self._pages(self._carrying(version, "DEAD_LETTERS_PAGE"), version, 5000):
            yield stored_dead_letter(r)

    def planned_ids(self, version: str) -> Iterator[str]:
        for r in self._pages(self.q.PLANNED_PAGE, version, 20_000):
            yield r[0]

    def resolve_name(self, name: str) -> str | None:
        row = self._read(lambda tx: tx.one(self.q.RESOLVE_NAME, {"name": name}))
        return str(row[0]) if row else None

    def published(self) -> dict[str, str]:
        return {str(r[0]): str(r[1]) for r in self._read(lambda tx: tx.all(self.q.POINTERS))}

    def label_counts(self, version: str) -> dict[str | None, int]:
        return {r[0]: int(r[1]) for r in self._read(lambda tx: tx.all(self.q.LABEL_COUNTS, {"v": version}))}

    def latest_validation(self, version: str) -> ValidationRecord | None:
        row = self._read(lambda tx: tx.one(self.q.LATEST_VALIDATION, {"v": version}))
        return ValidationRecord(version, bool(row[0]), self._unjson(row[1]), float(row[2])) if row else None

    def publications(self, name: str) -> list[Publication]:
        return self._read(lambda tx: self._publications(tx, name))

    def pinned_runtime(self, version: str) -> str | None:
        row = self._read(lambda tx: tx.one(self.q.PINNED_RUNTIME, {"v": version}))
        return None if row is None else str(row[0])
