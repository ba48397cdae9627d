"""Backends the store contract suite runs over: each test gets an empty store."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from batchline.store import Store, open_store
from tests.helpers import fresh_pg_database

BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


@pytest.fixture(params=BACKENDS)
def backend_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'contract.db'}"
        return
    with fresh_pg_database("bl_test") as url:
        yield url


@pytest.fixture
def backend(backend_url: str) -> Iterator[Store]:
    s = open_store(backend_url)
    yield s
    s.close()


@pytest.fixture
def open_backend(backend_url: str) -> Callable[[], Store]:
    return lambda: open_store(backend_url)
