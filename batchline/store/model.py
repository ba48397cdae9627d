"""What the store holds and hands out: leases, jobs, planned rows, stored outcomes.

The values every port (`batchline.store.ports`) speaks in, and the two errors a
caller must tell apart: `LeaseLost` (a fenced write refused, with the operation
that was refused) and `DuplicateRecord` (an id planned twice).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from batchline.errors import StoreError

# Rows written in one transaction at most: large enough to amortise the commit,
# small enough that a writer never holds the lock for long.
WRITE_BATCH_ROWS = 2000


# What a fenced operation refused is called, in LeaseLost.op and in the worker's metrics.
FENCED_OPS = ("put", "completion", "charge", "dead_letter", "renew", "batch", "await_provider", "split")


class LeaseLost(StoreError):
    """The (owner, epoch) a fenced operation carried is no longer current; `op` names
    the operation refused (put, completion, charge, dead_letter, renew, release, ...)."""

    def __init__(self, version: str, shard_no: int, epoch: int, op: str) -> None:
        super().__init__(f"lease on shard {shard_no} of {version} lost (epoch {epoch}); {op} refused")
        self.op = op

    @classmethod
    def of(cls, lease: Lease, op: str) -> LeaseLost:
        return cls(lease.version, lease.shard_no, lease.epoch, op)


@dataclass(frozen=True)
class Lease:
    version: str
    shard_no: int
    owner: str
    epoch: int
    slice: dict[str, Any]
    record_count: int
    expires: float
    route: str = "local"  # "local" for the in-house engine, else the hosted provider's route name
    # A hosted route's batch: None before submission, {"state": "submitting", ...} while
    # a submission may be under way, a SubmittedBatch's JSON once the provider has it.
    batch: dict[str, Any] | None = None
    # The pieces [first_piece, end_piece) of the version this lease covers. The end moves
    # down when the shard's unstarted tail is split off to another worker; a renewal
    # brings the new end, and writes for records past it are refused.
    first_piece: int | None = None
    end_piece: int | None = None

    def holds(self, piece: int | None) -> bool:
        return within(piece, self.first_piece, self.end_piece)


def within(piece: int | None, first: int | None, end: int | None) -> bool:
    """Whether a record of `piece` belongs to a shard covering [first, end): always, for a
    shard planned without pieces or a record that does not say."""
    return piece is None or first is None or end is None or first <= piece < end


@dataclass(frozen=True)
class LeaseHolder:
    """Who holds a leased shard, with what their process told the store about itself."""

    shard_no: int
    owner: str
    epoch: int
    expires: float | None
    process: dict[str, Any] | None


@dataclass(frozen=True)
class JobInfo:
    version: str
    name: str
    state: str  # planning | ready | sealed
    spec: dict[str, Any]
    record_count: int
    shard_count: int
    created_at: float
    sealed_at: float | None
    carried: int = 0  # results carried from a base version at planning


@dataclass(frozen=True)
class PlannedShard:
    shard_no: int
    slice: dict[str, Any]
    record_count: int
    route: str = "local"
    # The pieces of the version it covers, [first_piece, end_piece); its slice lists them
    # (`pieces`: each with its bounds, digest, `records` and planned `dead` letters).
    first_piece: int | None = None
    end_piece: int | None = None


@dataclass(frozen=True)
class PlannedRecord:
    record_id: str
    shard_no: int
    content_hash: str
    # output.carry's fields of the record: its results and dead letters are read with them
    # (whichever version computed the result, the values are this version's input's).
    carry: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class ResultRow:
    record_id: str
    output: str  # JSON text, validated against the version's schema
    acl: Any = None
    attempt: int = 1
    input_tokens: int | None = None
    output_tokens: int | None = None
    label: str | None = None  # the spec's output.label_field, kept as its own column
    model: str | None = None  # which model answered: the local engine's or the provider's
    piece: int | None = None  # the record's piece of the shard (see Lease.end_piece)


@dataclass(frozen=True)
class DeadLetterRow:
    record_id: str
    kind: str  # crash | hang | engine_error | invalid_output | truncated | too_long | provider_*
    error: str
    acl: Any = None
    attempts: int = 0
    piece: int | None = None


@dataclass(frozen=True)
class StoredResult:
    record_id: str
    output: str
    acl: Any
    shard_no: int
    worker: str
    epoch: int
    attempt: int
    created_at: float
    input_tokens: int | None
    output_tokens: int | None
    label: str | None = None
    origin: str | None = None  # for a carried result, the version that computed it
    model: str | None = None
    carry: Mapping[str, Any] | None = None  # output.carry's fields of the record, from this version's input


@dataclass(frozen=True)
class StoredDeadLetter:
    record_id: str
    shard_no: int
    kind: str
    error: str
    acl: Any
    attempts: int
    worker: str | None
    created_at: float
    carry: Mapping[str, Any] | None = None  # output.carry's fields of the record


@dataclass(frozen=True)
class Event:
    id: int
    version: str | None
    ts: float
    kind: str
    worker: str | None
    shard_no: int | None
    epoch: int | None
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class JobStatus:
    version: str
    name: str
    state: str
    records: int
    results: int
    dead_letters: int
    shards: dict[str, int]
    dead_letters_by_kind: dict[str, int]
    leases_lost: int  # ran out: another worker reclaimed the shard after its lease expired
    records_done_last_minutes: int  # in shards completed within the window
    window_seconds: float
    now: float

    leases_taken_back: int = 0  # ended at once: their owners were proven dead
    splits: int = 0  # unstarted tails split off to idle workers
    started_at: float | None = None  # the first claim of a shard of this version

    @property
    def rate_window(self) -> float:
        """The seconds the recent rate is over: the window, or the time since the work began
        when that is shorter (a short run is not divided by a long window)."""
        if self.started_at is None:
            return self.window_seconds
        return max(1.0, min(self.window_seconds, self.now - self.started_at))

    @property
    def records_per_second(self) -> float | None:
        """Records of shards completed within the rate window, per second; None before any claim."""
        if self.started_at is None:
            return None
        return self.records_done_last_minutes / self.rate_window

    @property
    def pending(self) -> int:
        return self.records - self.results - self.dead_letters


@dataclass(frozen=True)
class ShardRow:
    shard_no: int
    state: str
    owner: str | None
    epoch: int
    lease_expires: float | None
    claims: int
    record_count: int
    results: int
    dead_letters: int
    route: str = "local"
    batch_id: str | None = None  # the provider's batch in flight, for a hosted route
    poll_at: float | None = None


@dataclass(frozen=True)
class RouteTotals:
    """Where a version's records went, and what answering them took."""

    records: int
    results: int  # computed by this version (carried results are not counted)
    dead_letters: int
    input_tokens: int
    output_tokens: int
    shards: int


@dataclass(frozen=True)
class ChargeResult:
    attempts: int
    dead_lettered: bool


@dataclass(frozen=True)
class Coverage:
    """The anti-join of the snapshot's ids against the stored outcomes."""

    records: int
    missing: int  # planned ids with neither a result nor a dead letter
    unexpected: int  # outcomes for ids the snapshot does not have
    both: int  # ids with a result and a dead letter
    missing_sample: tuple[str, ...]
    unexpected_sample: tuple[str, ...]


@dataclass(frozen=True)
class Publication:
    id: int
    name: str
    version: str
    previous: str | None
    action: str  # publish | rollback
    who: str
    reason: str | None
    validation: dict[str, Any] | None
    ts: float
    # What each publication target showed readers after this publish or rollback, by its key.
    targets: dict[str, Any] | None = None


@dataclass(frozen=True)
class ValidationRecord:
    version: str
    passed: bool
    report: dict[str, Any]
    ts: float


class DuplicateRecord(StoreError):
    def __init__(self, record_id: str, first_shard: int) -> None:
        super().__init__(f"duplicate id {record_id!r}")
        self.record_id = record_id
        self.first_shard = first_shard
