"""Unit tests start no process and need no service: a test here that asks for PostgreSQL, or
starts a child process, fails at once, so a test of another level cannot settle here."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from typing import Any

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/unit/" in item.nodeid and item.get_closest_marker("postgres") is not None:
            raise pytest.UsageError(f"{item.nodeid} needs PostgreSQL: it is not a unit test (tests/integration)")


@pytest.fixture(autouse=True)
def no_child_processes(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a unit test started a process: it belongs in tests/integration or tests/acceptance")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    yield
