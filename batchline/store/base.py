"""The `Store` protocol: the shard table, results, dead letters and the event log.

Every lease operation carries (owner, epoch) and succeeds only while both are
current. Fenced writes raise `LeaseLost` when they are not; renewals return
False. All times are the database's clock (seconds since the epoch), which
tests may shift through `shift_clock` instead of sleeping.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from batchline.errors import StoreError

# Rows written in one transaction at most: large enough to amortise the commit,
# small enough that a writer never holds the lock for long.
WRITE_BATCH_ROWS = 2000


class LeaseLost(StoreError):
    """The (owner, epoch) a fenced write carried is no longer current."""

    def __init__(self, message: str, op: str = "") -> None:
        super().__init__(message)
        self.op = op  # put | completion | charge | dead_letter | renew


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


@dataclass(frozen=True)
class PlannedRecord:
    record_id: str
    shard_no: int
    content_hash: str


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


@dataclass(frozen=True)
class DeadLetterRow:
    record_id: str
    kind: str  # crash | hang | engine_error | invalid_output | too_long
    error: str
    acl: Any = None
    attempts: int = 0


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
    leases_lost: int
    records_done_last_minutes: int  # in shards completed within the window
    window_seconds: float
    now: float

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


@dataclass(frozen=True)
class ValidationRecord:
    version: str
    passed: bool
    report: dict[str, Any]
    ts: float


class PlanWriter(Protocol):
    """Writes a plan under the `planning` state; `commit` makes it visible at once."""

    def add_shards(self, shards: Sequence[PlannedShard]) -> None: ...

    def add_records(self, records: Sequence[PlannedRecord]) -> None:
        """Raises DuplicateRecord when an id is already planned in this version."""
        ...

    def add_dead_letters(self, shard_no: int, rows: Sequence[DeadLetterRow]) -> None: ...

    def carry_from(self, base: str) -> int:
        """Carries the base version's results for records whose id and content hash
        are unchanged, by reference (no payload is copied); returns how many."""
        ...

    def commit(self, record_count: int, shard_count: int) -> None: ...

    def abort(self) -> None: ...


class DuplicateRecord(StoreError):
    def __init__(self, record_id: str, first_shard: int) -> None:
        super().__init__(f"duplicate id {record_id!r}")
        self.record_id = record_id
        self.first_shard = first_shard


class Store(Protocol):
    url: str

    def close(self) -> None: ...

    # the clock
    def now(self) -> float: ...

    def shift_clock(self, seconds: float) -> None:
        """Test hook: moves the database's clock forward for every process."""
        ...

    # jobs and planning
    def job(self, version: str) -> JobInfo | None: ...

    def jobs(self) -> list[JobInfo]: ...

    def begin_plan(self, version: str, name: str, spec: dict[str, Any]) -> PlanWriter:
        """Starts planning a version; discards what an earlier planner left half-written."""
        ...

    # leases
    def claim(self, worker: str, version: str | None = None, routes: Sequence[str] | None = None) -> Lease | None:
        """Leases the lowest shard that is ready, whose lease expired, or whose batch at a
        provider is due to be polled; `routes` limits it to shards of those routes."""
        ...

    def renew(self, lease: Lease) -> Lease | None: ...

    def release(self, lease: Lease, reason: str) -> bool:
        """Gives the shard back: ready again, or, with a batch at a provider, submitted
        and due to be polled at once."""
        ...

    def set_batch(self, lease: Lease, batch: dict[str, Any] | None) -> Lease:
        """Records (or clears) the shard's batch while holding the lease, fenced: the
        intent to submit is on record before the provider is called."""
        ...

    def await_provider(self, lease: Lease, batch: dict[str, Any], poll_in: float) -> None:
        """Parks the shard as `submitted` with its batch, holding no lease: any worker
        may claim it to poll once `poll_in` seconds have passed. Fenced; idempotent."""
        ...

    def complete(self, lease: Lease) -> None:
        """Marks the shard done (idempotent for the same owner and epoch); seals the
        version when it was the last. Raises LeaseLost, or StoreError when the
        shard still has records without an outcome."""
        ...

    def open_versions(self) -> list[str]:
        """Ready versions with shards not yet done, oldest first."""
        ...

    def has_open_shards(self, version: str | None = None, routes: Sequence[str] | None = None) -> bool:
        """True while any shard of a ready version (of those routes) is not done."""
        ...

    # records
    def answered(self, version: str, record_ids: Sequence[str]) -> set[str]: ...

    def attempts(self, version: str, record_ids: Sequence[str]) -> dict[str, int]: ...

    def put_results(self, lease: Lease, rows: Sequence[ResultRow]) -> int:
        """Put-if-absent, fenced; returns how many were new."""
        ...

    def charge_attempt(self, lease: Lease, record_id: str, kind: str, error: str, acl: Any,
                       max_attempts: int) -> ChargeResult: ...

    def dead_letter(self, lease: Lease, rows: Sequence[DeadLetterRow]) -> int:
        """Dead letters that are not charged attempts (over the length cap), fenced."""
        ...

    def log_event(self, kind: str, *, version: str | None = None, worker: str | None = None,
                  shard_no: int | None = None, epoch: int | None = None,
                  detail: dict[str, Any] | None = None) -> None: ...

    # reading
    def status(self, version: str, window_seconds: float = 300.0) -> JobStatus: ...

    def shard_rows(self, version: str) -> list[ShardRow]: ...

    def route_totals(self, version: str) -> dict[str, RouteTotals]:
        """Records, outcomes and tokens per route."""
        ...

    def token_totals(self, version: str) -> tuple[int, int]:
        """Input and output tokens of the results this version computed."""
        ...

    def result_histogram(self, version: str, start: float, width: float, bins: int) -> list[tuple[int, int, int]]:
        """The results this version computed, counted in the store by (attempt, time bin):
        bin i holds created_at in [start + i*width, start + (i+1)*width), the first and
        last bins also what falls before or after. Rows of (attempt, bin, count)."""
        ...

    def run_throughput(self, version: str) -> float:
        """Records per second per worker, measured from the event log: the records of
        each completed shard over the time from its claim to its completion (0 if none)."""
        ...

    def iter_results(self, version: str, page_size: int = 5000, *,
                     computed_only: bool = False) -> Iterator[StoredResult]:
        """The version's results in id order, a page at a time; `computed_only`
        leaves out results carried from a base version."""
        ...

    def iter_dead_letters(self, version: str) -> Iterator[StoredDeadLetter]: ...

    def events(self, version: str | None = None, kinds: Sequence[str] | None = None) -> list[Event]: ...

    def planned_ids(self, version: str) -> Iterator[str]: ...

    def resolve_name(self, name: str) -> str | None:
        """The version published under a name, if any."""
        ...

    # validation and publication
    def coverage(self, version: str, sample: int = 10) -> Coverage: ...

    def label_counts(self, version: str) -> dict[str | None, int]: ...

    def results_for(self, version: str, record_ids: Sequence[str]) -> dict[str, StoredResult]: ...

    def record_validation(self, version: str, passed: bool, report: dict[str, Any]) -> None: ...

    def latest_validation(self, version: str) -> ValidationRecord | None: ...

    def publish(self, name: str, version: str, who: str, reason: str | None,
                validation: dict[str, Any] | None) -> str | None:
        """Points `name` (and the view named after it) at `version` in one atomic
        step; returns the version it pointed at before."""
        ...

    def rollback(self, name: str, who: str, reason: str | None) -> tuple[str, str]:
        """Points `name` back at the version published before the current one;
        returns (from, to)."""
        ...

    def publications(self, name: str) -> list[Publication]: ...

    def remove_version(self, version: str) -> None:
        """Deletes a version's rows, keeping any result a later version carries."""
        ...
