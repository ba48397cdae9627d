"""PostgreSQL variants: every test here gets its own database on the real server.

Overriding `store_url` makes the shared fixtures (`store`, `job_factory`) and
any test imported from the SQLite suites run against PostgreSQL unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers import fresh_pg_database


@pytest.fixture
def pg_url() -> Iterator[str]:
    with fresh_pg_database("bl_pg") as url:
        yield url


@pytest.fixture
def store_url(pg_url: str) -> str:
    return pg_url
