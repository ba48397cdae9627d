"""A store written by batchline 0.1.0 reads back unchanged with today's code.

tests/data/store-0.1.0/store.db was written once by that release (build.py beside it says
how) and is never rewritten; expected.json holds what its versions, stored specs and
publications read as then. Opening it brings its schema up to date (the migrations since),
and then every stored spec must still parse to the same self-contained form, with the same
inference identity (the key incremental runs carry results by), every version its state and
counts, every name its pointer and history. Publish and rollback rebuild a version's targets
from its stored spec and find what the store recorded for each by the target's key, so the
targets today's code builds from an old spec must carry the keys its publications recorded.
(The Iceberg table's files were not kept: the fixture checks what the store holds.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

import batchline
from batchline.spec import stored_spec
from batchline.store import open_store
from batchline.targets import targets_for

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "store-0.1.0"
EXPECTED: dict[str, Any] = json.loads((FIXTURE / "expected.json").read_text())


@pytest.fixture
def old_store(tmp_path: Path) -> str:
    shutil.copy(FIXTURE / "store.db", tmp_path / "store.db")
    return f"sqlite:///{tmp_path / 'store.db'}"


def plain(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def test_every_stored_spec_reads_back_to_the_form_it_was_stored_in(old_store: str) -> None:
    store = open_store(old_store)
    try:
        assert sorted(j.version for j in store.jobs()) == sorted(EXPECTED["versions"])
        for version, want in EXPECTED["versions"].items():
            info = store.job(version)
            assert info is not None
            assert (info.name, info.state, info.record_count, info.shard_count) == (
                want["name"], want["state"], want["records"], want["shards"]), version
            assert plain(info.spec) == want["stored"], version
            spec = stored_spec(info)
            assert plain(spec.to_dict()) == want["to_dict"], version
            assert spec.inference_identity() == want["inference_identity"], version
            assert spec.base_version == want["base_version"], version
    finally:
        store.close()


def test_every_version_keeps_its_outcomes_and_every_name_its_pointer_and_history(old_store: str) -> None:
    jobs = batchline.Jobs(old_store)
    for version, want in EXPECTED["versions"].items():
        status = jobs.status(version)
        assert (status.results, status.dead_letters) == (want["results"], want["dead_letters"]), version
    published = {j.name: j.version for j in jobs.versions() if j.published}
    assert published == {name: v for name, v in EXPECTED["published"].items() if v is not None}
    for name, want in EXPECTED["history"].items():
        got = [{"version": p.version, "previous": p.previous, "action": p.action, "reason": p.reason,
                "targets": plain(p.targets), "validated": p.validation is not None} for p in jobs.history(name)]
        assert got == want, name


def test_the_targets_built_from_an_old_spec_carry_the_keys_its_publications_recorded(old_store: str) -> None:
    store = open_store(old_store)
    try:
        recorded = {key for pubs in EXPECTED["history"].values() for p in pubs for key in (p["targets"] or {})}
        assert recorded == {"iceberg:store/lake.results"}
        for pubs in EXPECTED["history"].values():
            for p in pubs:
                info = store.job(p["version"])
                assert info is not None
                keys = {t.key for t in targets_for(stored_spec(info), old_store)}
                assert keys == set(p["targets"] or {}), p["version"]
    finally:
        store.close()
