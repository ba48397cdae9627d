"""Validation, publication, rollback, retention and incremental runs against
PostgreSQL: the SQLite suite's tests that go through the `Store` protocol only,
collected again here, plus the view tests that read the database directly."""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest

from batchline.publish import publish, rollback
from batchline.store import Store, open_store
from batchline.validate import validate
from tests.helpers import make_records

# Imported to be collected again under this folder's `store_url`.
from tests.unit.test_validate_publish import (  # noqa: F401
    sealed_version,
    test_a_changed_prompt_carries_nothing,
    test_a_clean_version_passes_every_check,
    test_an_incremental_run_infers_only_new_and_changed_records,
    test_dead_letter_rate_over_the_limit_fails,
    test_drift_against_the_published_version,
    test_publish_is_refused_without_a_passing_validation,
    test_retention_removes_old_versions_but_never_the_published_or_its_predecessor,
    test_schema_check_can_sample_and_says_so,
)

pytestmark = pytest.mark.postgres


def view_rows(url: str, name: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return conn.execute(f'SELECT id, version, acl FROM "{name}"').fetchall()


def test_coverage_is_an_anti_join_not_a_count(job_factory: Any, store: Store, store_url: str) -> None:
    _spec, version = sealed_version(job_factory, store, n=60)
    with psycopg.connect(store_url, autocommit=True) as conn:
        conn.execute("UPDATE results SET record_id = 'ghost' WHERE version = %s AND record_id = 'r000007'",
                     (version,))
    cov = validate(store, version).checks[0]
    assert not cov.passed
    assert (cov.details["missing"], cov.details["unexpected"]) == (1, 1)
    assert cov.details["missing_sample"] == ["r000007"] and cov.details["unexpected_sample"] == ["ghost"]


def test_rollback_returns_the_view_to_the_previous_version(job_factory: Any, store: Store, store_url: str) -> None:
    spec, v1 = sealed_version(job_factory, store, n=20)
    _, v2 = sealed_version(job_factory, store, make_records(25, "x"))
    for v in (v1, v2):
        validate(store, v)
        publish(store, v)
    assert {row[1] for row in view_rows(store_url, spec.name)} == {v2}
    assert rollback(store, spec.name) == (v2, v1)
    rows = view_rows(store_url, spec.name)
    assert {row[1] for row in rows} == {v1} and len(rows) == 20
    assert [p.action for p in store.publications(spec.name)] == ["publish", "publish", "rollback"]


def test_a_reader_of_the_view_sees_one_whole_version_while_publishing(
        job_factory: Any, store: Store, store_url: str) -> None:
    spec, v1 = sealed_version(job_factory, store, n=300)
    _, v2 = sealed_version(job_factory, store, make_records(200, "n"))
    for v in (v1, v2):
        validate(store, v)
    publish(store, v1)
    sizes = {v1: 300, v2: 200}
    problems: list[str] = []
    seen: set[str] = set()
    stop = threading.Event()

    def reader() -> None:
        mine = open_store(store_url)
        with psycopg.connect(store_url, autocommit=True) as conn:
            while not stop.is_set():
                version = mine.resolve_name(spec.name)
                assert version is not None
                paged = sum(1 for _ in mine.iter_results(version, page_size=37))
                if paged != sizes[version]:
                    problems.append(f"paged {paged} rows of {version}")
                rows = conn.execute(f'SELECT version, count(*) FROM "{spec.name}" GROUP BY version').fetchall()
                if len(rows) != 1 or rows[0][1] != sizes[rows[0][0]]:
                    problems.append(f"view showed {rows}")
                else:
                    seen.add(rows[0][0])
        mine.close()

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for _ in range(15):
        publish(store, v2)
        rollback(store, spec.name)
    stop.set()
    for t in threads:
        t.join()
    assert problems == []
    assert seen <= {v1, v2} and seen
