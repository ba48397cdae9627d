"""What the store holds and hands out: leases, jobs, planned rows, stored outcomes.

The values every port (`batchline.store.ports`) speaks in, and the two errors a
caller must tell apart: `LeaseLost` (a fenced write refused, with the operation
that was refused) and `DuplicateRecord` (an id planned twice).
"""

from __future__ import annotations

import getpass
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from batchline.acl import Acl
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


class VersionClosed(LeaseLost):
    """The lease is current but its version is no longer open (halted while it was held):
    the store refuses its outcomes, and its worker stops as on a preemption notice."""

    def __init__(self, version: str, shard_no: int, epoch: int, op: str) -> None:
        StoreError.__init__(self, f"shard {shard_no} of {version}: {op} refused: the version is not open "
                                  f"(halted)")
        self.op = op


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
    home: str | None = None  # the region its input lives in (input.regions); None: every region's
    # The lease's key (batchline.store.rights): a secret its claimer made, presented with each
    # write under the lease; the store keeps its hash only. Never shown.
    key: str = field(default="", repr=False, compare=False)

    def holds(self, piece: int | None) -> bool:
        return within(piece, self.first_piece, self.end_piece)


def within(piece: int | None, first: int | None, end: int | None) -> bool:
    """Whether a record of `piece` belongs to a shard covering [first, end): always, for a
    shard planned without pieces; never, for a record that does not say its piece when the
    shard has pieces (it could be past a split point, where nothing of it may be written)."""
    if first is None or end is None:
        return True
    return piece is not None and first <= piece < end


def within_sql(piece: str, first: str, end: str) -> str:
    """`within` as a SQL predicate over the three expressions, for a store that filters its
    rows in the statement that writes them."""
    return (f"({first} IS NULL OR {end} IS NULL OR ({piece} IS NOT NULL AND {piece} >= {first} "
            f"AND {piece} < {end}))")


@dataclass(frozen=True)
class Written:
    """What a fenced write found: whether the writer held the lease, whether the version was
    open, and how many of its rows were new."""

    held: bool
    open: bool
    rows: int


def past_highest(rows: Sequence[ResultRow] | Sequence[DeadLetterRow]) -> int | None:
    """The piece after the highest that outcome rows say they are of (None where none says):
    where a shard's pieces started run to once they are written."""
    pieces = [r.piece for r in rows if r.piece is not None]
    return max(pieces) + 1 if pieces else None


@dataclass(frozen=True)
class LeaseHolder:
    """Who holds a leased shard, with what their process told the store about itself."""

    shard_no: int
    owner: str
    epoch: int
    expires: float | None
    process: dict[str, Any] | None


@dataclass(frozen=True)
class DeadLetterBound:
    """When a version is halted on its dead letters: once the outcomes it computed (results
    and dead letters, not those carried from a base version nor the planner's `too_long`)
    number at least `min_outcomes` and more than `rate` of them are dead letters."""

    rate: float
    min_outcomes: int

    def passed(self, dead_letters: int, outcomes: int) -> bool:
        return outcomes >= self.min_outcomes and dead_letters > self.rate * outcomes

    def describe(self) -> str:
        return f"shards.abort_dead_letter_rate {self.rate:g} after {self.min_outcomes} outcomes"


@dataclass(frozen=True)
class Halt:
    """Why a version was halted: its figures when the bound was passed, the kind most of
    its dead letters are, and one record of that kind."""

    dead_letters: int
    outcomes: int
    rate: float
    min_outcomes: int
    kind: str
    kind_count: int
    example: str
    by: str | None = None  # the worker that found the bound passed

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> Halt:
        return cls(**value)

    def message(self, version: str) -> str:
        share = 100.0 * self.dead_letters / self.outcomes if self.outcomes else 0.0
        return (f"{version} is halted: {self.dead_letters:,} of the {self.outcomes:,} outcomes it computed are dead "
                f"letters ({share:.1f}%, over {DeadLetterBound(self.rate, self.min_outcomes).describe()}), "
                f"most of them {self.kind} ({self.kind_count:,}; e.g. record {self.example}); see "
                f"`batchline dead-letters {version}`, then `batchline cancel {version}`, or `batchline resume "
                f"{version} --abort-dead-letter-rate RATE` to go on")


@dataclass(frozen=True)
class JobInfo:
    version: str
    name: str
    state: str  # planning | ready | halted | sealed | cancelled | removed
    spec: dict[str, Any]
    record_count: int
    shard_count: int
    created_at: float
    sealed_at: float | None
    carried: int = 0  # results carried from a base version at planning
    # The bound the version is halted by, as the store holds it (the spec's at planning, or
    # the one given to `resume`); None: never halted on its dead letters.
    bound: DeadLetterBound | None = None
    halt: Halt | None = None  # while halted, why
    planned_dead: int = 0  # dead letters the planner wrote (over the length cap, without text)
    opened_at: float | None = None  # its run start: the first runner, launcher or pacer that opened it


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
    home: str | None = None  # the region its input lives in (input.regions)


@dataclass(frozen=True)
class PlannedRecord:
    record_id: str
    shard_no: int
    content_hash: str
    # An input read from the store (a job over a published job): the record's text, ACL and
    # position in the input's order, kept with it so a worker reads them from its own
    # version. `text` None with a position: the record had no text (a planned dead letter).
    input: InputRecord | None = None
    # output.carry's fields of the record: its results and dead letters are read with them
    # (whichever version computed the result, the values are this version's input's).
    carry: Mapping[str, Any] | None = None
    # The hash of what the prompt reads (text and class, not the ACL), where it differs from
    # `content_hash` (a record with an ACL): an incremental plan carries a result whose
    # record changed only its ACL, under the new ACL.
    text_hash: str | None = None
    # The record's ACL as the planner read it: what every reader of its result or dead letter
    # reads (a worker's own word on it is never read; batchline.store.rights).
    acl: Acl | None = None
    # The piece of its shard it lies in (numbered across the version): which shard covers it
    # after a split, for the database's fence on what a worker may answer.
    piece: int | None = None


@dataclass(frozen=True)
class ResultChanges:
    """How one version's results differ from another's (see `VersionChanges.result_changes`)."""

    added: int
    changed: int
    removed: int

    @property
    def total(self) -> int:
        return self.added + self.changed + self.removed

    def describe(self) -> str:
        return f"{self.total:,} records ({self.changed:,} changed, {self.added:,} new, {self.removed:,} removed)"


@dataclass(frozen=True)
class InputRecord:
    """A record of an input the store holds: what a worker reads for its shard."""

    record_id: str
    text: str | None
    acl: Acl | None
    content_hash: str
    position: int


@dataclass(frozen=True)
class ResultRow:
    record_id: str
    output: str  # JSON text, validated against the version's schema
    acl: Acl | None = None
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
    acl: Acl | None = None
    attempts: int = 0
    piece: int | None = None


@dataclass(frozen=True)
class StoredResult:
    record_id: str
    output: str
    acl: Acl | None
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
    # A carried result's worker and lease epoch in the version that computed it.
    origin_worker: str | None = None
    origin_epoch: int | None = None

    def provenance(self, version: str) -> dict[str, Any]:
        """Which attempt this row is (output.provenance): the attempt that computed it, the worker
        and lease epoch it was written under, and the version that computed it (this one, or
        for a carried result the one it was carried from)."""
        carried = self.origin is not None
        return {"attempt": self.attempt, "worker": self.origin_worker if carried else self.worker,
                "epoch": self.origin_epoch if carried else self.epoch,
                "origin_version": self.origin if carried else version}


@dataclass(frozen=True)
class StoredDeadLetter:
    record_id: str
    shard_no: int
    kind: str
    error: str
    acl: Acl | None
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
    records_done_last_minutes: int  # outcomes workers wrote within the window, in any shard
    window_seconds: float
    now: float

    halt: Halt | None = None  # while the version is halted, why
    leases_taken_back: int = 0  # ended at once: their owners were proven dead

    splits: int = 0  # unstarted tails split off to idle workers
    started_at: float | None = None  # the first claim of a shard of this version
    # When its run started (`open_run`), kept across resumes: where a window and the pacing
    # line count from. None for a version no runner, launcher or pacer has opened.
    opened_at: float | None = None
    # Why no worker can finish the version as it is, in one line: a shard whose input
    # changed since planning (its last worker refused it, and none has claimed it since).
    stopped: str | None = None
    # A sealed version: when it sealed. Its rate is then over its whole run (the outcomes it
    # computed, from its first claim to its seal).
    ended_at: float | None = None

    @property
    def run_start(self) -> float | None:
        """Where a deadline's window and the pacing line count from: the run start, else (a
        version only bare workers ran) its first claim."""
        return self.opened_at if self.opened_at is not None else self.started_at

    @property
    def rate_window(self) -> float:
        """The seconds the recent rate is over: the window, or the time since the work began
        when that is shorter (a short run is not divided by a long window); a sealed
        version's whole run."""
        if self.started_at is None:
            return self.window_seconds
        if self.ended_at is not None:
            return max(1.0, self.ended_at - self.started_at)
        return max(1.0, min(self.window_seconds, self.now - self.started_at))

    @property
    def records_per_second(self) -> float | None:
        """Outcomes written within the rate window, per second (a sealed version: over its
        run); None before any claim."""
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
class PointerAt:
    """Where a name's pointer was: its latest publication's id then (None: never published).
    A scheduled run publishes only from where it was when the run first planned."""

    publication: int | None

    def moved(self, history: Sequence[Publication]) -> Publication | None:
        """The publication that moved the pointer since, or None where it is still there."""
        latest = history[-1] if history else None
        return None if (latest.id if latest is not None else None) == self.publication else latest


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


def rollback_target(history: Sequence[Publication], current: str | None) -> str | None:
    """The version a rollback of a name showing `current` returns to, from the name's
    publications oldest first: the one the latest publish of `current` replaced (None:
    none). Never `current` itself: a store written by an older release may hold a
    publish of the published version over itself, which replaced nothing."""
    return next((p.previous for p in reversed(history)
                 if p.version == current and p.action == "publish" and p.previous != current), None)


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


def who() -> str:
    """Who an operation is recorded as done by: this process's user at this host."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"
