"""The store contract for scheduled runs: a run's key names the one version it planned.
The first planner to key a version wins; a second, racing planner is told the winner's
version, so every worker slot of one scheduled run works on one version."""

from __future__ import annotations

import pytest

from batchline.errors import StoreError
from batchline.store import Store
from tests.integration.store.test_contract import plan_version


def test_the_first_version_keyed_for_a_run_is_the_one_every_later_planner_gets(store: Store) -> None:
    plan_version(store, "job@1")
    plan_version(store, "job@2")
    assert store.keyed_version("job", "29420160") is None
    assert store.key_plan("job", "29420160", "job@1") == "job@1"
    # A slot that saw a newer snapshot planned job@2 meanwhile: the run stays job@1.
    assert store.key_plan("job", "29420160", "job@2") == "job@1"
    assert store.keyed_version("job", "29420160") == "job@1"
    # The next night is a run of its own.
    assert store.key_plan("job", "29421600", "job@2") == "job@2"
    assert store.keyed_version("job", "29420160") == "job@1"


def test_keys_are_per_job_name(store: Store) -> None:
    plan_version(store, "job@1")
    store.key_plan("job", "k", "job@1")
    assert store.keyed_version("other", "k") is None


def test_only_a_planned_version_of_that_name_is_keyed(store: Store) -> None:
    plan_version(store, "job@1")
    with pytest.raises(StoreError, match="not a planned version of 'other'"):
        store.key_plan("other", "k", "job@1")
    with pytest.raises(StoreError, match="not a planned version"):
        store.key_plan("job", "k", "job@9")
    assert store.keyed_version("job", "k") is None
