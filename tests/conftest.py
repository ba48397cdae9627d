"""Shared fixtures: stores and job specs over generated inputs."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from batchline.store import Store, open_store
from tests.helpers import SIMPLE_SCHEMA, fresh_pg_database, make_records, write_jsonl
from tests.stores import SQLITE, STORES, WORKER_ROLE, WorkerRoles, WorkerRoleStore

# The object-store stand-ins (S3, GCS) and their fixtures, for any test that needs a lake.
pytest_plugins = ("tests.integration.lake.support",)

# Every test that takes a store runs on each backend, as one suite (each PostgreSQL
# run gets a database of its own on the real server); tests/stores.py says which.


@pytest.fixture(params=STORES)
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def store_url(store_kind: str, tmp_path: Path) -> Iterator[str]:
    """The store's URL as its owner reaches it."""
    if store_kind == SQLITE:
        yield f"sqlite:///{tmp_path / 'store.db'}"
        return
    with fresh_pg_database("bl_pg") as url:
        yield url


@pytest.fixture
def worker_roles(store_kind: str, store_url: str) -> Iterator[WorkerRoles | None]:
    if store_kind != WORKER_ROLE:
        yield None
        return
    roles = WorkerRoles(store_url)
    yield roles
    roles.drop()


@pytest.fixture
def store(store_url: str, worker_roles: WorkerRoles | None) -> Iterator[Store]:
    owner = open_store(store_url)
    s: Any = owner if worker_roles is None else WorkerRoleStore(owner, worker_roles)
    yield s
    s.close()


@pytest.fixture
def open_again(store_url: str) -> Callable[[], Store]:
    """Another connection to the same store."""
    return lambda: open_store(store_url)


@pytest.fixture
def worker_url(store_url: str, worker_roles: WorkerRoles | None) -> Callable[[str], str]:
    """The URL a worker of `version` connects with: the role's, where the store has one."""
    return lambda version: store_url if worker_roles is None else worker_roles.url(version)


@pytest.fixture
def job_factory(tmp_path: Path) -> Callable[..., Path]:
    """Writes a job spec (and its input and schema) and returns the spec's path."""
    counter = {"n": 0}

    def make(records: list[dict[str, Any]] | None = None, *, n: int = 200, options: dict[str, Any] | None = None,
             shards: dict[str, Any] | None = None, input_extra: dict[str, Any] | None = None,
             name: str = "test-job", input_path: Path | None = None, prompt: str = "Classify.\n",
             schema: dict[str, Any] | None = None, **top: Any) -> Path:
        counter["n"] += 1
        d = tmp_path / f"job{counter['n']}"
        d.mkdir()
        if input_path is None:
            rows = records if records is not None else make_records(n)
            input_path = write_jsonl(d / "input.jsonl", rows)
        else:
            try:
                rows = [json.loads(line) for line in input_path.read_text().splitlines() if line.strip()]
            except ValueError:  # not JSONL, or the broken input a test is about
                rows = []
        # Records that all have an ACL get acl_field; others do not (a missing one is refused).
        with_acl = bool(rows) and all(isinstance(r, dict) and r.get("acl") is not None for r in rows)
        (d / "schema.json").write_text(json.dumps(schema or SIMPLE_SCHEMA))
        spec: dict[str, Any] = {
            "name": name,
            "input": {"path": str(input_path), "id_field": "id", **({"acl_field": "acl"} if with_acl else {}),
                      **(input_extra or {})},
            "model": {"engine": "synthetic", "options": options or {}},
            "prompt": {"text": prompt, "version": "v1"},
            "output": {"schema": "schema.json"},
            "shards": {"size": 50, "lease_seconds": 30, "renew_seconds": 1, "batch_size": 4,
                       "record_timeout_seconds": 1.0, "batch_timeout_seconds": 1.0, "grace_seconds": 5,
                       **(shards or {})},
            **top,
        }
        path = d / "job.yaml"
        path.write_text(yaml.safe_dump(spec))
        return path

    return make


