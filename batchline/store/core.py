"""The store's rules, written once for every backend.

Each operation of the ports (`batchline.store.ports`) is written here: what it
checks, which events it appends, what it refuses and with which words, and the
arithmetic of status, coverage and route totals. A backend
(`batchline.store.sqlite`, `batchline.store.postgres`) brings only its SQL (one
module of named statements, the same names in each) and its transactions:

- `_write(body, recover=...)` runs `body` in one write transaction. A backend
  that can lose a connection after a commit (PostgreSQL) retries, and first
  asks `recover` whether the lost try committed: every operation that is not
  idempotent carries a token that its events record (`_marks`).
- `_read(body, snapshot=...)` runs reads, in one snapshot when asked.
- A few steps whose SQL differs in shape, not in rule: the fenced insert of
  results and of dead letters, bulk planning of records, a version's own
  partitions, statistics before coverage, and the published view.

The operations are grouped by the port they serve, one module each over the shared base
(`batchline.store.base`): the workers' leases and outcomes (`leasing`), planning
(`planning`), reading (`reading`), publication (`publication`), and the smaller ports
(`changes`, `files`, `lineage`, `paid`, `beats`, `launches`). `StoreCore` is all of them at once, which is
what a backend completes.
"""

from __future__ import annotations

from abc import ABC

from batchline.store.base import (
    INPUT_CHANGED,
    DuplicateKey,
    Missing,
    Params,
    Row,
    StoreBase,
    Tx,
    acl_json,
    carry_json,
    chunks,
    fence,
    input_columns,
    split_point,
)
from batchline.store.beats import WorkerBeats
from batchline.store.changes import VersionChanges
from batchline.store.files import ShardOutcomes
from batchline.store.launches import LaunchRecords
from batchline.store.leasing import Leasing
from batchline.store.paid import PaidSlots
from batchline.store.planning import CorePlanWriter, Planning
from batchline.store.publication import Publishing
from batchline.store.reading import Reading
from batchline.store.replicas import ReplicaRecords

__all__ = ["INPUT_CHANGED", "CorePlanWriter", "DuplicateKey", "Missing", "Params", "Row", "StoreBase", "StoreCore",
           "Tx", "acl_json", "carry_json", "chunks", "fence", "input_columns", "split_point"]


class StoreCore(Leasing, Planning, Publishing, Reading, VersionChanges, ShardOutcomes, PaidSlots, WorkerBeats,
                LaunchRecords, ReplicaRecords, ABC):
    """Every port's operation, over a backend's SQL (`q`) and transactions."""
