"""A scheduled run (`batchline run --plan-key KEY`, as each worker slot of a nightly
CronJob runs it): the first slot plans and keys the version; a slot restarted after the
input moved on, or a second slot, runs that version instead of planning another."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from batchline.api import _plan_once
from batchline.plan.planner import plan
from batchline.spec import load_spec
from batchline.store import Store
from tests.helpers import make_records, write_jsonl

pytestmark = pytest.mark.acceptance

TONIGHT, TOMORROW = "29420160", "29421600"  # scheduled minutes, as a CronJob's Job names end


def run(spec: Path, store_url: str, key: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "batchline", "run", str(spec), "--store", store_url,
                           "--plan-key", key, *extra], capture_output=True, text=True, timeout=300)


def test_a_slot_restarted_after_the_input_moved_on_runs_the_version_its_run_planned(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    data = tmp_path / "lake" / "tickets.jsonl"
    data.parent.mkdir()
    write_jsonl(data, make_records(60))
    spec = job_factory(input_path=data)
    first = run(spec, store_url, TONIGHT, "--publish")
    assert first.returncode == 0, first.stderr
    version = first.stdout.strip()
    assert store.resolve_name("test-job") == version

    write_jsonl(data, make_records(80))  # the lake moved on before the slot came back
    again = run(spec, store_url, TONIGHT, "--publish")
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == version
    assert f"run '{TONIGHT}' of test-job was planned as {version}; running it" in again.stderr
    assert f"{version} is published as test-job already" in again.stderr
    assert [j.version for j in store.jobs()] == [version]
    assert [p.version for p in store.publications("test-job")] == [version]

    tomorrow = run(spec, store_url, TOMORROW, "--publish")
    assert tomorrow.returncode == 0, tomorrow.stderr
    newer = tomorrow.stdout.strip()
    assert newer != version and store.status(newer).results == 80
    assert store.resolve_name("test-job") == newer


class _RacingSlot:
    """The store as a slot sees it that looked for its run's key just before another
    slot keyed it."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def keyed_version(self, name: str, key: str) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def test_a_slot_that_planned_a_newer_snapshot_runs_the_version_keyed_first_and_cancels_its_own(
        job_factory: Any, store: Store, tmp_path: Path) -> None:
    data = tmp_path / "lake" / "tickets.jsonl"
    data.parent.mkdir()
    write_jsonl(data, make_records(30))
    spec_path = job_factory(input_path=data)
    spec = load_spec(spec_path)
    winner = plan(spec, store).version
    assert store.key_plan(spec.name, TONIGHT, winner) == winner
    write_jsonl(data, make_records(31))
    said: list[str] = []
    racing: Any = _RacingSlot(store)
    result = _plan_once(racing, load_spec(spec_path), TONIGHT, said.append)
    assert (result.version, result.created, result.records) == (winner, False, 30)
    [loser] = [j for j in store.jobs() if j.version != winner]
    assert loser.state == "cancelled"
    assert any(f"was planned as {winner} meanwhile" in line for line in said)
    [cancelled] = store.events(loser.version, ["cancel"])
    assert cancelled.detail["reason"] == f"run '{TONIGHT}' was keyed to {winner} first"
