"""The search port: a second searchable target, not built on Lance and existing only in the
tests (tests/fakes/memory_index.py, an in-memory index searched exactly), added to the TARGETS
table through `batchline.registry.register` as an outside plug-in would be, is searched by
`Jobs.search` and `batchline search` with no change to either: they find it through the
registry by what the published version's spec names. On both stores."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from batchline.api import Jobs
from batchline.check.validate import validate
from batchline.cli import main
from batchline.errors import BatchlineError
from batchline.publish.pointer import publish
from batchline.registry import TARGETS
from batchline.store import open_store
from tests.fakes import memory_index
from tests.helpers import planned, run_to_seal, write_jsonl

TICKETS = Path(__file__).resolve().parents[2] / "examples" / "tickets" / "tickets.jsonl"
NAME = "tickets-memory"


@pytest.fixture
def memory_target() -> Iterator[None]:
    memory_index.registered()
    try:
        yield
    finally:
        memory_index.removed()


def tickets(n: int) -> list[dict[str, Any]]:
    """The example's first n tickets (their first words), every fifth restricted to hr alone."""
    rows = [json.loads(line) for line in TICKETS.read_text().splitlines()[:n]]
    return [{"id": r["id"], "text": " ".join(r["text"].split()[:16]), "acl": ["hr"] if i % 5 == 0 else ["desk"]}
            for i, r in enumerate(rows)]


def job(tmp_path: Path, records: list[dict[str, Any]], output: dict[str, Any]) -> Path:
    from batchline.engines.models import MINILM_PACKAGE, packaged_model_digest

    write_jsonl(tmp_path / "input.jsonl", records)
    (tmp_path / "schema.json").write_text(json.dumps(
        {"type": "object", "properties": {"embedding": {"type": "array", "items": {"type": "number"}}},
         "required": ["embedding"]}))
    spec = {"name": NAME, "input": {"path": "input.jsonl", "id_field": "id", "text_field": "text", "acl_field": "acl"},
            "model": {"engine": "embedding", "digest": packaged_model_digest(MINILM_PACKAGE),
                      "options": {"device": "cpu"}},
            "prompt": {"text": "Embed.\n", "version": "v1"},
            "output": {"schema": "schema.json", **output},
            "shards": {"size": 20, "lease_seconds": 60, "renew_seconds": 2, "batch_size": 16}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_a_target_outside_batchline_is_searched_by_the_api_and_the_cli_through_the_registry(
        memory_target: None, store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("sentence_transformers")
    assert "memory" in TARGETS
    records = tickets(30)
    with contextlib.closing(open_store(store_url)) as store:
        _spec, version = planned(job(tmp_path, records, {"memory_index": {}}), store)
        run_to_seal(store, version)
        assert validate(store, version).passed
        publish(store, version)
    assert (NAME, version) in memory_index.ROWS  # publish staged it through the port

    desk = {r["id"] for r in records if r["acl"] == ["desk"]}
    hr = {r["id"] for r in records if r["acl"] == ["hr"]}
    own = records[3]  # a desk ticket: its own text ranks it first
    found = Jobs(store_url).search(NAME, own["text"], ["desk"], k=5)
    assert found.version == version and found.path == "memory-exact" and found.withheld == 0
    assert found.hits[0].record_id == own["id"]
    assert len(found.hits) == 5 and {h.record_id for h in found.hits} <= desk
    assert [h.score for h in found.hits] == sorted((h.score for h in found.hits), reverse=True)

    assert main(["search", NAME, "--query", records[0]["text"], "--groups", "hr", "--k", "100", "--json",
                 "--store", store_url]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["version"], out["path"]) == (version, "memory-exact")
    assert {h["id"] for h in out["hits"]} == hr and out["hits"][0]["id"] == records[0]["id"]
    assert [version, version] == memory_index.SEARCHES  # both reached the test's target, not another


def test_a_version_without_a_searchable_target_is_refused_naming_every_key_that_makes_one(
        memory_target: None, store_url: str, tmp_path: Path) -> None:
    pytest.importorskip("sentence_transformers")
    with contextlib.closing(open_store(store_url)) as store:
        _spec, version = planned(job(tmp_path, tickets(4), {}), store)
        run_to_seal(store, version)
        assert validate(store, version).passed
        publish(store, version)
    with pytest.raises(BatchlineError, match=r"has no output\.index or output\.memory_index: nothing of it is "
                                             r"searched"):
        Jobs(store_url).search(NAME, "printer", ["desk"])
    assert memory_index.SEARCHES == []
