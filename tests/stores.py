"""The stores every store-dependent test runs on, as one parametrized fixture (`store` and
`store_url` in tests/conftest.py): SQLite, PostgreSQL as the store's owner, and, for the
store contract, PostgreSQL under the role `batchline grants` makes.

`postgres-worker-role` runs every method of the worker's port (`WorkerStore`) as the role
made for the version it names, and everything else (planning, reading, publishing) as the
store's owner: the contract then proves that the narrow role can do all that a worker does.
"""

from __future__ import annotations

import inspect
import threading
import uuid
from typing import Any

import psycopg
import pytest

from batchline.store import Store, open_store
from batchline.store.ports import (
    Heartbeats,
    LineageDrain,
    OutcomeWriter,
    PaidHeartbeat,
    ProviderParking,
    RuntimePins,
    ShardFiles,
    ShardInput,
    ShardLeases,
)
from tests.helpers import PG_ADMIN_URL

SQLITE = "sqlite"
POSTGRES = "postgres"
WORKER_ROLE = "postgres-worker-role"
# Every store-dependent test runs on each backend; the store contract also under the worker role.
STORES = [SQLITE, pytest.param(POSTGRES, marks=pytest.mark.postgres)]
CONTRACT_STORES = [*STORES, pytest.param(WORKER_ROLE, marks=pytest.mark.postgres)]

# What a worker may call, from the port itself rather than a list kept by hand.
WORKER_METHODS = frozenset(
    name for port in (ShardLeases, ShardInput, OutcomeWriter, ProviderParking, RuntimePins, PaidHeartbeat, LineageDrain,
                                ShardFiles, Heartbeats)
    for name in vars(port)
    if not name.startswith("_"))


def role_url(url: str, role: str) -> str:
    # Trust authentication on the test server: the user name is the credential.
    return url.replace("postgresql://postgres@", f"postgresql://{role}@")


class WorkerRoles:
    """Roles made by `batchline grants`, one per version, dropped when the test ends."""

    def __init__(self, owner_url: str) -> None:
        self.owner_url = owner_url
        self.roles: dict[str, str] = {}

    def url(self, version: str) -> str:
        from batchline.ops.grants import grant

        if version not in self.roles:
            role = f"bl_contract_{uuid.uuid4().hex[:10]}"
            grant(self.owner_url, version, role=role)
            self.roles[version] = role
        return role_url(self.owner_url, self.roles[version])

    def drop(self) -> None:
        for role in self.roles.values():
            with psycopg.connect(self.owner_url, autocommit=True) as conn:
                conn.execute(f'DROP OWNED BY "{role}"')
            with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
                conn.execute(f'DROP ROLE IF EXISTS "{role}"')


class WorkerRoleStore:
    """The owner's store, except that worker calls go through the version's role."""

    def __init__(self, owner: Store, roles: WorkerRoles) -> None:
        self.owner = owner
        self.roles = roles
        self.by_version: dict[str, Store] = {}
        self.last: str | None = None
        # Workers in threads share it: a version's role is made once.
        self._lock = threading.Lock()

    def _worker_store(self, version: str | None) -> Store:
        version = version or self.last
        assert version is not None, "a worker call before any version was planned"
        with self._lock:
            if version not in self.by_version:
                self.by_version[version] = open_store(self.roles.url(version))
            return self.by_version[version]

    def begin_plan(self, version: str, name: str, spec: dict[str, Any]) -> Any:
        self.last = version
        return self.owner.begin_plan(version, name, spec)

    def __getattr__(self, name: str) -> Any:
        if name not in WORKER_METHODS:
            return getattr(self.owner, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            given = inspect.signature(getattr(self.owner, name)).bind(*args, **kwargs).arguments
            version = given["lease"].version if "lease" in given else given.get("version")
            return getattr(self._worker_store(version), name)(*args, **kwargs)

        return call

    def close(self) -> None:
        for s in self.by_version.values():
            s.close()
        self.owner.close()
