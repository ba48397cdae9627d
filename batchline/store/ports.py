"""The store's ports: what each caller may ask of it, and nothing more.

A worker sees `WorkerStore`; the planner `PlannerStore` (with the `PlanWriter`
it is handed); status, reports and exports `ReaderStore`; validation and
publication `PublisherStore`. `Store` is all of them, which is what a backend
implements (`batchline.store.core.StoreCore`) and what `open_store` returns.

Every lease operation carries (owner, epoch) and succeeds only while both are
current: fenced writes raise `LeaseLost`, a renewal returns None. All times are
the database's clock (seconds since the epoch), which tests may shift through
`shift_clock` instead of sleeping. On PostgreSQL a worker's port is exactly
what the role made by `batchline grants` may do.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

from batchline.acl import Acl
from batchline.store.beats import LiveWorker, WorkerSeen
from batchline.store.changes import BaseRecord
from batchline.store.files import ShardColumns, ShardUnit
from batchline.store.launches import LaunchRecord
from batchline.store.lineage import OutboxRow
from batchline.store.model import (
    ChargeResult,
    Coverage,
    DeadLetterBound,
    DeadLetterRow,
    Event,
    Halt,
    InputRecord,
    JobInfo,
    JobStatus,
    Lease,
    LeaseHolder,
    PlannedRecord,
    PlannedShard,
    PointerAt,
    Publication,
    ResultChanges,
    ResultRow,
    RouteTotals,
    ShardRow,
    StoredDeadLetter,
    StoredResult,
    ValidationRecord,
)
from batchline.store.paid import PaidSlot
from batchline.store.replicas import ReplicaRecord, ShardRegions, WorkerRegion


class StoreHandle(Protocol):
    url: str
    # How long a lost connection is retried before an operation fails with StoreError: a
    # process that must act on an outage sooner (a runner, a paid worker) lowers it.
    reconnect_seconds: float

    def close(self) -> None: ...

    def where(self) -> str:
        """The store, as messages name it: a SQLite file's path, a URL without its password."""
        ...

    def identity(self) -> str:
        """Who the store is, whatever its URL: what the targets it publishes into record."""
        ...

    def now(self) -> float:
        """The database's clock."""
        ...

    def job(self, version: str) -> JobInfo | None: ...


class ShardLeases(Protocol):
    """Claiming, holding and finishing shards."""

    def claim(self, worker: str, version: str | None = None, routes: Sequence[str] | None = None,
              *, process: dict[str, Any] | None = None, region: str | None = None,
              foreign: bool = True) -> Lease | None:
        """Leases the lowest shard that is ready, whose lease expired, or whose batch at a
        provider is due to be polled; `routes` limits it to shards of those routes.
        `process` identifies the claimer's process, so that its death can be proven. A worker
        of `region` gets a shard whose home is its region first, another region's only when
        `foreign` or when its region has none left to do."""
        ...

    def renew(self, lease: Lease, started: int | None = None) -> Lease | None:
        """Extends the lease; `started` says the owner has started every piece before it.
        The lease returned carries the shard's end now (a split may have moved it)."""
        ...

    def leases(self, version: str) -> list[LeaseHolder]:
        """The version's leased shards, with what their owners' processes said of themselves."""
        ...

    def take_back(self, version: str, holder: LeaseHolder, by: str, proof: dict[str, Any]) -> bool:
        """Ends the lease of an owner proven dead (the proof goes in the event log), fenced on
        its epoch and bumping it; False when that lease had already ended."""
        ...

    def split(self, version: str, worker: str) -> int | None:
        """Moves the unstarted tail of the leased shard that has the most of it to a new ready
        shard; returns its number, or None when no shard has enough left to share."""
        ...

    def release(self, lease: Lease, reason: str, error: str | None = None) -> bool:
        """Gives the shard back: ready again, or, with a batch at a provider, submitted
        and due to be polled at once. `error` says what went wrong where the reason is one
        (a changed input fails the version's run, as lineage reports it)."""
        ...

    def complete(self, lease: Lease, files: Mapping[str, Any] | None = None) -> None:
        """Marks the shard done (idempotent for the same owner and epoch), recording `files`: what
        its worker wrote of it, by target key (files: per-shard); seals the version when it was
        the last. Raises LeaseLost, or StoreError when the shard still has records without an
        outcome."""
        ...

    def open_versions(self) -> list[str]:
        """Ready versions with shards not yet done, oldest first."""
        ...

    def has_open_shards(self, version: str | None = None, routes: Sequence[str] | None = None) -> bool:
        """True while any shard of a ready version (of those routes) is not done."""
        ...

    def halt_of(self, version: str) -> Halt | None:
        """Why the version is halted, while it is (no shard of it is claimed meanwhile)."""
        ...


class OutcomeWriter(Protocol):
    """A leased shard's outcomes: results, charged attempts, dead letters, events."""

    def answered(self, version: str, record_ids: Sequence[str]) -> set[str]: ...

    def attempts(self, version: str, record_ids: Sequence[str]) -> dict[str, int]: ...

    def put_results(self, lease: Lease, rows: Sequence[ResultRow]) -> int:
        """Put-if-absent, fenced; returns how many were new."""
        ...

    def charge_attempt(self, lease: Lease, record_id: str, kind: str, error: str, acl: Acl | None,
                       max_attempts: int, piece: int | None = None) -> ChargeResult:
        """One more failed attempt for the record; a dead letter at `max_attempts`. Nothing
        (attempts 0) for a record already answered or of a piece split off to another shard."""
        ...

    def dead_letter(self, lease: Lease, rows: Sequence[DeadLetterRow]) -> int:
        """Dead letters that are not charged attempts (over the length cap), fenced."""
        ...

    def judge_dead_letters(self, version: str, worker: str) -> Halt | None:
        """Halts a ready version whose bound its dead letters pass (see `DeadLetterBound`),
        for every worker: none claims its shards until it is resumed or cancelled. Returns
        why it is halted (by this call or an earlier one), or None."""
        ...

    def log_event(self, kind: str, *, version: str | None = None, worker: str | None = None,
                  shard_no: int | None = None, epoch: int | None = None,
                  detail: dict[str, Any] | None = None) -> None: ...


class ShardFiles(Protocol):
    """A shard's outcomes, a shard at a time (batchline.store.files)."""

    def shard_outcomes(self, version: str, shard_no: int, *,
                       computed_only: bool = False) -> tuple[list[StoredResult], list[StoredDeadLetter]]:
        """The shard's results (`computed_only`: those computed in this version, what a worker
        may read) and dead letters, each in id order."""
        ...


class ShardInput(Protocol):
    """A leased shard's records, where the store holds its input (a job over a published
    job: planning copied them into the version's own records)."""

    def input_records(self, version: str, start: int, end: int) -> list[InputRecord]:
        """The version's records at positions [start, end), in order."""
        ...


class ProviderParking(Protocol):
    """A hosted route's shard, parked at its provider without a lease."""

    def set_batch(self, lease: Lease, batch: dict[str, Any] | None) -> Lease:
        """Records (or clears) the shard's batch while holding the lease, fenced: the
        intent to submit is on record before the provider is called."""
        ...

    def await_provider(self, lease: Lease, batch: dict[str, Any], poll_in: float) -> None:
        """Parks the shard as `submitted` with its batch, holding no lease: any worker
        may claim it to poll once `poll_in` seconds have passed. Fenced; idempotent."""
        ...


class RuntimePins(Protocol):
    """The engine runtime each version is computed with."""

    def pin_runtime(self, version: str, runtime: str, worker: str) -> tuple[str, str]:
        """Pins `runtime` (an engine's packages and versions) to the version unless one is
        pinned already; returns the pinned runtime and the worker that pinned it."""
        ...


class PaidHeartbeat(Protocol):
    """A paid worker's own start: that it is up, and that it stopped."""

    def paid_seen(self, version: str, slot: str, generation: int, worker: str,
                  process: dict[str, Any] | None, *, claimed: bool = False) -> bool:
        """The worker of a start says it is up (and, `claimed`, that it has claimed); False when
        that start was stopped meanwhile or belongs to another worker: it is to exit."""
        ...

    def paid_stop(self, version: str, slot: str, generation: int, reason: str) -> bool:
        """Ends a start (its worker exited, or its process is gone); False if it had ended."""
        ...

    def paid_budget(self, version: str) -> tuple[float, float]:
        """The version's paid spend so far, and what the paid workers up and unstopped cost an
        hour together: what a paid worker holds `fallback.max_cost` with."""
        ...


class Heartbeats(Protocol):
    """Every worker's heartbeat, from its start to its exit (batchline.store.beats)."""

    def worker_beat(self, version: str, worker: str, *, every: float, paid_slot: str | None = None,
                    process: dict[str, Any] | None = None, region: str | None = None,
                    cross_region_bytes: int = 0) -> None:
        """The worker is up (loading, working or idle) and beats every `every` seconds; in
        `region`, having read `cross_region_bytes` from outside it so far."""
        ...

    def worker_gone(self, version: str, worker: str) -> None:
        """The worker exits: it is no longer capacity."""
        ...


class LineageDrain(Protocol):
    """The lineage outbox, drained by any process of a job (batchline.store.lineage): a worker
    drains its version's rows, a publisher every row."""

    def lineage_claim(self, by: str, *, version: str | None = None, hold_seconds: float = 60.0,
                      limit: int = 100) -> list[OutboxRow]:
        """Rows due to be sent, oldest first, claimed by `by` for `hold_seconds`."""
        ...

    def lineage_sent(self, row_id: int, by: str) -> bool: ...

    def lineage_failed(self, row_id: int, by: str, error: str, *, retry_in: float, give_up: bool) -> None: ...

    def pinned_runtime(self, version: str) -> str | None:
        """The engine runtime the version's first worker loaded (the events name it)."""
        ...

    def lineage_parent(self, version: str) -> dict[str, Any] | None:
        """The orchestrator's task run that launched the version (the events' parent)."""
        ...


class LineageAdmin(LineageDrain, Protocol):
    """What `batchline lineage` reads and mends of the outbox."""

    def set_lineage_parent(self, version: str, parent: Mapping[str, str]) -> None:
        """Names the orchestrator's task run (`namespace`, `name`, `run_id`) as the version's parent."""
        ...

    def lineage_rows(self, version: str | None = None) -> list[OutboxRow]: ...

    def lineage_retry(self, version: str | None = None) -> int: ...


class ReplicaReader(Protocol):
    """A version's replicas of its input, as the worker reads them (batchline.store.replicas)."""

    def replicas(self, version: str) -> dict[str, ReplicaRecord]:
        """The version's checked replicas by region."""
        ...


class Replicas(ReplicaReader, Protocol):
    """The owner's side: replicas recorded once checked, and where shards and workers ran."""

    def add_replica(self, version: str, replica: ReplicaRecord) -> None: ...

    def shard_regions(self, version: str) -> list[ShardRegions]: ...

    def worker_regions(self, version: str) -> list[WorkerRegion]: ...


class WorkerStore(StoreHandle, ShardLeases, ShardInput, OutcomeWriter, ProviderParking, RuntimePins, PaidHeartbeat,
                  Heartbeats, ShardFiles, LineageDrain, ReplicaReader, Protocol):
    """Everything a worker may call."""


class PlanWriter(Protocol):
    """Writes a plan under the `planning` state; `commit` makes it visible at once."""

    def add_shards(self, shards: Sequence[PlannedShard]) -> None: ...

    def add_records(self, records: Sequence[PlannedRecord]) -> None:
        """Raises DuplicateRecord when an id is already planned in this version."""
        ...

    def add_dead_letters(self, shard_no: int, rows: Sequence[DeadLetterRow]) -> None: ...

    def carry_from(self, base: str) -> int:
        """Carries the base version's results for records whose id and content hash are
        unchanged, or whose text alone is (an ACL-only change: the result takes the record's
        new ACL), by reference (no payload is copied); returns how many."""
        ...

    def commit(self, record_count: int, shard_count: int) -> None: ...

    def abort(self) -> None: ...


class PlannerStore(StoreHandle, Protocol):
    # Made by this opening (a SQLite file that was not there): said once, so a mistyped
    # path is seen at once rather than as an empty store later.
    created: bool

    def close_discarding(self) -> None:
        """Closes the store after a failed plan, removing it where this opening made it and it
        holds no job: a plan that failed on its input leaves no new empty store behind."""
        ...

    def begin_plan(self, version: str, name: str, spec: dict[str, Any]) -> PlanWriter:
        """Starts planning a version; discards what an earlier planner left half-written."""
        ...

    def resolve_name(self, name: str) -> str | None:
        """The version published under a name, if any."""
        ...

    def run_throughput(self, version: str) -> float:
        """Records per second per worker, measured from the event log: the records of
        each completed shard over the time from its claim to its completion (0 if none)."""
        ...

    def keyed_version(self, name: str, key: str) -> str | None:
        """The version a run of `name` keyed `key` (a scheduled run) planned, if one did."""
        ...

    def key_plan(self, name: str, key: str, version: str) -> str:
        """Keys a planned version of `name` as the run `key`, unless another version was
        keyed so first; returns the version the key names from now on. It keeps where the
        name's pointer was then (`keyed_pointer`)."""
        ...

    def keyed_pointer(self, name: str, key: str) -> PointerAt | None:
        """Where `name`'s pointer was when the run `key` first planned (its latest publication
        then), or None: no such run, or one keyed before batchline kept it."""
        ...


class ChangeReader(Protocol):
    """What differs between two versions, read by keys (batchline.store.changes)."""

    def result_acls(self, version: str, record_ids: Sequence[str]) -> dict[str, Acl | None]:
        """Each result's ACL, by record id, for those of `record_ids` the version has a result for."""
        ...

    def result_rows_changed(self, old: str, new: str, page_size: int = 20_000) -> Iterator[str]:
        """The records whose result row in `new` differs from `old`'s, in id order."""
        ...

    def result_rows_removed(self, old: str, new: str, page_size: int = 20_000) -> Iterator[str]:
        """The records `old` has a result for and `new` has none, in id order."""
        ...

    def result_changes(self, old: str, new: str) -> ResultChanges:
        """How the results of `new` differ from those of `old`."""
        ...

    def record_changes(self, version: str, base: str, page_size: int = 20_000) -> Iterator[tuple[str, str]]:
        """Each planned record of `version`, in id order, with its kind against `base`."""
        ...

    def removed_records(self, version: str, base: str, page_size: int = 20_000) -> Iterator[str]:
        """The records of `base` that `version` does not plan."""
        ...

    def base_hashes(self, base: str, record_ids: Sequence[str]) -> dict[str, BaseRecord]:
        """The base's planned records among `record_ids`, as a plan against it compares them."""
        ...

    def record_total(self, version: str) -> int: ...


class ReaderStore(StoreHandle, ChangeReader, ShardFiles, Protocol):
    """Progress, outcomes and history, for status, reports and exports."""

    def jobs(self) -> list[JobInfo]: ...

    def status(self, version: str, window_seconds: float = 300.0) -> JobStatus: ...

    def shard_rows(self, version: str) -> list[ShardRow]: ...

    def shard_units(self, version: str) -> list[ShardUnit]:
        """The version's shards, each with its identity (the input it read) and its outcomes."""
        ...

    def shard_columns(self, version: str, shard_no: int) -> ShardColumns:
        """The outcomes the shard's worker computed, column by column, in id order."""
        ...

    def shard_slice(self, version: str, shard_no: int) -> dict[str, Any]:
        """The slice of the input a shard was planned with (its records are read from it)."""
        ...

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

    def run_throughput(self, version: str) -> float: ...

    def pinned_runtime(self, version: str) -> str | None:
        """The engine runtime the version's first worker loaded, if one has."""
        ...

    def iter_results(self, version: str, page_size: int = 5000, *,
                     computed_only: bool = False) -> Iterator[StoredResult]:
        """The version's results in id order, a page at a time; `computed_only`
        leaves out results carried from a base version."""
        ...

    def iter_outputs(self, version: str, page_size: int = 20_000) -> Iterator[tuple[str, str]]:
        """Each result this version computed, as (record id, output), in id order."""
        ...

    def results_for(self, version: str, record_ids: Sequence[str]) -> dict[str, StoredResult]: ...

    def iter_dead_letters(self, version: str) -> Iterator[StoredDeadLetter]: ...

    def events(self, version: str | None = None, kinds: Sequence[str] | None = None) -> list[Event]: ...

    def planned_ids(self, version: str) -> Iterator[str]: ...

    def resolve_name(self, name: str) -> str | None: ...

    def published(self) -> dict[str, str]:
        """Every published name, with the version it points at."""
        ...

    def label_counts(self, version: str) -> dict[str | None, int]: ...

    def latest_validation(self, version: str) -> ValidationRecord | None: ...

    def publications(self, name: str) -> list[Publication]: ...

    def paid_slots(self, version: str) -> list[PaidSlot]:
        """Every start of every paid slot of the version, by slot and generation."""
        ...

    def paid_spend_seconds(self, version: str) -> float:
        """Paid worker-seconds the version has used, from the store's own record of them."""
        ...

    def workers_seen(self, version: str) -> list[WorkerSeen]:
        """The version's workers heard heartbeat recently and not gone, spot and paid, as each
        says of itself: what a worker says, not capacity (`live_capacity` is)."""
        ...

    def live_capacity(self, version: str) -> list[LiveWorker]:
        """The version's workers that count as capacity now, each with why: the one meaning of a
        heartbeat (batchline.store.beats), which every pacer, an orchestrator's liveness and the
        pools read. A heartbeat is a worker saying it is up, and is not trusted on its own: a
        worker heard recently (within 1.5 of its interval, which the store bounds to 0.1-60 s)
        and not gone counts only while it holds an unexpired lease of the version (`leased`),
        completed a shard within its interval (`completed`), or is loading, its first heartbeat
        within two of the version's restart overheads (`loading`). A paid heartbeat counts
        only as the worker of a launched, unstopped start of that slot and generation."""
        ...

    def loading_allowance(self, version: str) -> float:
        """How long from its first heartbeat a worker of the version counts while loading: two
        restart overheads (the paid starts' measured one, else the spec's, else the default)."""
        ...


class PaidCapacity(PaidHeartbeat, Protocol):
    """What a runner, launcher or pacer may call to run a version and hold its deadline
    (batchline.store.paid)."""

    def open_run(self, version: str, by: str) -> float:
        """The version's run start, set by the first caller and kept (resumes included)."""
        ...

    def paid_launch(self, version: str, slot: str, by: str, cost_per_hour: float, *,
                    stale_seconds: float, launch_timeout: float) -> int | None:
        """A new start of `slot`, unless one runs ("already there": None)."""
        ...


class PublisherStore(ReaderStore, LineageAdmin, Protocol):
    """Validation and the pointer readers follow (I3)."""

    def coverage(self, version: str, sample: int = 10) -> Coverage: ...

    def record_validation(self, version: str, passed: bool, report: dict[str, Any]) -> None: ...

    def publish(self, name: str, version: str, who: str, reason: str | None,
                validation: dict[str, Any] | None, *, expected: int | None,
                targets: dict[str, Any] | None = None) -> str | None:
        """Points `name` (and the view named after it) at `version` in one atomic
        step, recording what each publication target now shows; returns the
        version it pointed at before. A compare-and-set: `expected` is the id of the
        name's latest publication as the caller read it before moving the targets
        (None: it read none), and a name published or rolled back since is refused
        with `PublicationMoved`, recording nothing."""
        ...

    def rollback(self, name: str, who: str, reason: str | None, *, expected: int | None,
                 targets: dict[str, Any] | None = None) -> tuple[str, str]:
        """Points `name` back at the version published before the current one;
        returns (from, to). The same compare-and-set on `expected` as `publish`."""
        ...

    def remove_version(self, version: str) -> None:
        """Deletes a version's rows, keeping any result a later version carries."""
        ...

    def set_gate(self, version: str, gate: dict[str, Any], who: str) -> bool:
        """Makes `gate` the version's spec's validate section (the gate it is validated by, which
        is not part of what it computes); False where it is that already."""
        ...

    def cancel(self, version: str, who: str, reason: str | None) -> bool:
        """Ends a version nobody will publish: it becomes `cancelled`, no shard of it is
        claimed again, and its leases end (each owner's next fenced write is refused).
        Refused for the version published under its name and the one a rollback would
        return to. False when it was cancelled already."""
        ...

    def resume(self, version: str, who: str, reason: str | None, rate: float | None = None,
               min_outcomes: int | None = None) -> DeadLetterBound:
        """Lifts a halt: the version is ready again under its bound, or under a new `rate`
        and `min_outcomes` the store holds from now on (sealed at once if nothing is left to
        do). Refused when the version is not halted, or when its dead letters pass the bound
        it would resume under (it would halt again at once). Returns that bound."""
        ...

    def delete(self, version: str, who: str) -> bool:
        """Removes the rows of a cancelled version, or of a sealed one that is neither
        published nor what a rollback would return to, keeping any result a later version
        carries; a version still running is refused (cancel it first). False when it was
        removed already."""
        ...


class Launches(Protocol):
    """What an orchestrator's launcher records of the fleet it launched for a version
    (batchline.store.launches): its intent, then what it launched, then its stop."""

    def launch_intent(self, version: str, key: str, launcher: str, by: str) -> tuple[LaunchRecord, bool]:
        """The record of `key`, written as an intent if there was none, and whether this call wrote it."""
        ...

    def launch_recorded(self, version: str, key: str, detail: dict[str, Any]) -> LaunchRecord:
        """Records what the launch of `key` started."""
        ...

    def launch_stopped(self, version: str, key: str, reason: str) -> LaunchRecord | None:
        """Marks the launch of `key` stopped."""
        ...

    def launches(self, version: str) -> list[LaunchRecord]:
        """Every launch record of the version, oldest first."""
        ...


class Store(WorkerStore, PlannerStore, PublisherStore, PaidCapacity, Launches, Replicas, Protocol):
    """A whole store: every port, and the test clock."""

    def shift_clock(self, seconds: float) -> None:
        """Test hook: moves the database's clock forward for every process."""
        ...
