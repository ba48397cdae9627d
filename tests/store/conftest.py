"""Backends the store contract suite runs over: each test gets an empty store."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from batchline.store import Store, open_store
from tests.helpers import PG_ADMIN_URL, database_url, pg_available

BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


@pytest.fixture(params=BACKENDS)
def backend_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'contract.db'}"
        return
    if not pg_available():
        from tests.helpers import postgres_missing

        postgres_missing("PostgreSQL is not running on 127.0.0.1:5432 (make services starts it)")
    import psycopg

    name = f"bl_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield database_url(name)
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def backend(backend_url: str) -> Iterator[Store]:
    s = open_store(backend_url)
    yield s
    s.close()


@pytest.fixture
def open_backend(backend_url: str) -> Callable[[], Store]:
    return lambda: open_store(backend_url)
