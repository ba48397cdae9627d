"""Tests of what only PostgreSQL has (connection faults, server restarts, narrow roles):
every test here gets its own database on the real server."""

from __future__ import annotations

import pytest


@pytest.fixture
def store_kind() -> str:
    return "postgres"


@pytest.fixture
def pg_url(store_url: str) -> str:
    return store_url
