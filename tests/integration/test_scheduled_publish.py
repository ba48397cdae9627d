"""A scheduled run publishes only from where its name's pointer was when the run first planned:
a cleared old run's task validates its version but never moves the pointer back past a newer
night's, unless told why (kept in the history)."""

from __future__ import annotations

from typing import Any

import pytest

from batchline.api import Jobs
from batchline.errors import PointerMovedOn
from batchline.store import Store
from tests.helpers import make_records, run_to_seal

LAST_NIGHT = "airflow:nightly/triage/scheduled__2026-12-05T01:00:00+00:00/-1"
TONIGHT = "airflow:nightly/triage/scheduled__2026-12-06T01:00:00+00:00/-1"


def night(jobs: Jobs, store: Store, spec: Any, key: str) -> str:
    version = jobs.plan(spec, plan_key=key, log=lambda _m: None).version
    run_to_seal(store, version)
    assert jobs.validate(version).passed
    return version


def test_a_cleared_old_runs_task_does_not_publish_its_version_over_a_newer_nights(
        job_factory: Any, store: Store) -> None:
    jobs = Jobs(store)
    older = night(jobs, store, job_factory(make_records(20)), LAST_NIGHT)
    newer = night(jobs, store, job_factory(make_records(25, "x")), TONIGHT)
    assert jobs.publish(newer, plan_key=TONIGHT, log=lambda _m: None).changed
    with pytest.raises(PointerMovedOn, match=rf"^test-job moved on since the run that planned {older} began: it now "
                                             rf"shows {newer} \(publish by .*\), so {older} is validated but not "
                                             r"published over it"):
        jobs.publish(older, plan_key=LAST_NIGHT, log=lambda _m: None)
    assert store.resolve_name("test-job") == newer and len(store.publications("test-job")) == 1


def test_an_old_run_told_why_publishes_over_the_newer_and_the_history_keeps_the_reason(
        job_factory: Any, store: Store) -> None:
    jobs = Jobs(store)
    older = night(jobs, store, job_factory(make_records(20)), LAST_NIGHT)
    newer = night(jobs, store, job_factory(make_records(25, "x")), TONIGHT)
    jobs.publish(newer, plan_key=TONIGHT, log=lambda _m: None)
    jobs.publish(older, plan_key=LAST_NIGHT, over_newer="tonight's input was truncated", log=lambda _m: None)
    assert store.resolve_name("test-job") == older
    assert store.publications("test-job")[-1].reason == f"published over {newer}: tonight's input was truncated"


def test_a_run_whose_pointer_did_not_move_publishes_as_before_even_over_an_older_version(
        job_factory: Any, store: Store) -> None:
    jobs = Jobs(store)
    first = night(jobs, store, job_factory(make_records(20)), LAST_NIGHT)
    jobs.publish(first, plan_key=LAST_NIGHT, log=lambda _m: None)
    second = night(jobs, store, job_factory(make_records(25, "x")), TONIGHT)  # planned with first published
    assert jobs.publish(second, plan_key=TONIGHT, log=lambda _m: None).previous == first
    assert store.publications("test-job")[-1].reason is None
    # A publish without a run's key (the command line) is never held by a run's pointer.
    assert jobs.publish(first, log=lambda _m: None).previous == second
