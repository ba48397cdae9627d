"""The store contract runs over every backend and, on PostgreSQL, also under the worker's role
(tests/stores.py): each test gets an empty store."""

from __future__ import annotations

import pytest

from tests.stores import CONTRACT_STORES


@pytest.fixture(params=CONTRACT_STORES)
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)
