"""PostgreSQL variants: every test here gets its own database on the real server.

Overriding `store_url` makes the shared fixtures (`store`, `job_factory`) and
any test imported from the SQLite suites run against PostgreSQL unchanged.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tests.helpers import PG_ADMIN_URL, database_url, pg_available


@pytest.fixture
def pg_url() -> Iterator[str]:
    if not pg_available():
        from tests.helpers import postgres_missing

        postgres_missing("PostgreSQL is not running on 127.0.0.1:5432 (make services starts it)")
    import psycopg

    name = f"bl_pg_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield database_url(name)
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def store_url(pg_url: str) -> str:
    return pg_url
