"""Stores by URL: `sqlite:///path` (the default, one machine) or `postgresql://...`."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from batchline.errors import NoSuchVersion, StoreError
from batchline.store.model import (
    ChargeResult,
    DeadLetterBound,
    DeadLetterRow,
    DuplicateRecord,
    Event,
    Halt,
    InputRecord,
    JobInfo,
    JobStatus,
    Lease,
    LeaseHolder,
    LeaseLost,
    PlannedRecord,
    PlannedShard,
    ResultChanges,
    ResultRow,
    RouteTotals,
    ShardRow,
    StoredDeadLetter,
    StoredResult,
    VersionClosed,
)
from batchline.store.ports import (
    PlannerStore,
    PlanWriter,
    PublisherStore,
    ReaderStore,
    Store,
    StoreHandle,
    WorkerStore,
)

DEFAULT_URL = "sqlite:///batchline.db"

__all__ = [
    "DEFAULT_URL", "ChargeResult", "DeadLetterBound", "DeadLetterRow", "DuplicateRecord", "Event", "Halt",
    "InputRecord", "JobInfo", "JobStatus", "Lease", "LeaseHolder", "LeaseLost", "PlanWriter", "PlannedRecord",
    "PlannedShard", "PlannerStore", "PublisherStore",
    "ReaderStore", "ResultChanges", "ResultRow", "RouteTotals", "ShardRow", "Store", "StoreHandle", "StoredDeadLetter",
    "StoredResult",
    "VersionClosed", "WorkerStore", "default_url", "job_or_published", "open_store", "require_job",
]


def require_job(store: StoreHandle, version: str) -> JobInfo:
    """The version's job, or `NoSuchVersion` (exit 66) naming the store as `where()` does:
    a message built from the store's URL would show its password."""
    info = store.job(version)
    if info is None:
        raise NoSuchVersion(version, store.where())
    return info


def job_or_published(store: ReaderStore, target: str) -> JobInfo:
    """The job of `target`, a version or the name it is published under; else
    `NoSuchVersion` (exit 66), as `require_job`."""
    info = store.job(target)
    if info is None:
        resolved = store.resolve_name(target)
        info = store.job(resolved) if resolved else None
        if info is None:
            raise NoSuchVersion(target, store.where(), or_name=True)
    return info


def default_url() -> str:
    return os.environ.get("BATCHLINE_STORE", DEFAULT_URL)


def open_store(url: str | None = None, *, create: bool = True, wait_seconds: float = 0.0,
               log: Callable[[str], None] = lambda _m: None, worker: bool = False) -> Store:
    """The store at `url`. `create`: a SQLite store that does not exist is made (planning);
    otherwise it is refused with its path, as a PostgreSQL database that does not exist
    always is. `wait_seconds`: how long to wait for a server that cannot be reached yet
    (a worker's start). `worker`: a worker's store, whose PostgreSQL sessions the server ends
    when one sits inside a transaction (`postgres.WORKER_SESSION_SETTINGS`)."""
    url = url or default_url()
    if url.startswith("sqlite:///"):
        from batchline.store.sqlite import SQLiteStore

        # sqlite:///relative.db and sqlite:////absolute/path.db, as SQLAlchemy spells them.
        return SQLiteStore(Path(url[len("sqlite:///"):]), url=url, create=create)
    if url.startswith(("postgresql://", "postgres://")):
        try:
            from batchline.store.postgres import (  # type: ignore[import-not-found,unused-ignore]
                WORKER_SESSION_SETTINGS,
                PostgresStore,
            )
        except ImportError as exc:
            raise StoreError(f"the PostgreSQL store is not available: {exc}") from None
        store: Store = PostgresStore(url, wait_seconds=wait_seconds, log=log,
                                     settings=WORKER_SESSION_SETTINGS if worker else None)
        return store
    raise StoreError(f"unknown store URL {url!r}: use sqlite:///path/to/file.db or postgresql://...")
