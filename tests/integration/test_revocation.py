"""A revocation upstream is served nowhere once the upstream publishes it (I6): an index over a
published job checks each hit against the ACL the upstream publishes now, whether or not the
downstream has run again, and after a rollback to a version planned on the older upstream;
an ACL-only change costs no inference, upstream or downstream. On both stores.

The downstream here embeds with the synthetic engine (every vector the same: every visible row
ties), which is all the ACL checks need; tests/acceptance/test_revoked_access.py runs the same with
MiniLM, a trained IVF_PQ index and a worker killed mid-shard."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from batchline.api import Jobs
from batchline.check.validate import validate
from batchline.cli import main
from batchline.publish.pointer import publish, rollback
from batchline.publish.upstream import UpstreamUnreadable
from batchline.store import Store
from tests.helpers import Database, call_counts, make_records, planned, run_to_seal, write_jsonl

pytest.importorskip("lancedb")

VECTOR_SCHEMA = {"type": "object", "properties": {"embedding": {"type": "array", "items": {"type": "number", "minimum": 1},
                                                                "minItems": 4, "maxItems": 4}},
                 "required": ["embedding"], "additionalProperties": False}
N = 30  # records; group-1 holds 10 of them


def sealed(path: Path, store: Store) -> str:
    _spec, version = planned(path, store)
    run_to_seal(store, version)
    assert validate(store, version).passed
    return version


class Pipeline:
    """A triage job over a JSONL input, and an index job over its published results."""

    def __init__(self, job_factory: Any, store: Store, tmp_path: Path) -> None:
        self.job_factory, self.store, self.tmp = job_factory, store, tmp_path
        self.calls = tmp_path / "calls.log"
        self.nights = 0

    def upstream(self, records: list[dict[str, Any]]) -> str:
        """Plans, runs, validates and publishes the triage job over `records` (incremental)."""
        self.nights += 1
        path = write_jsonl(self.tmp / f"night{self.nights}.jsonl", records)
        spec = self.job_factory(input_path=path, name="triage", options={"call_log": str(self.calls)},
                                base="published")
        version = sealed(spec, self.store)
        publish(self.store, version)
        return version

    def downstream(self) -> str:
        d = self.tmp / f"index-{self.nights}"
        d.mkdir(exist_ok=True)
        (d / "schema.json").write_text(json.dumps(VECTOR_SCHEMA))
        spec = {"name": "tickets-index", "base": "published",
                "input": {"job": "triage", "field": "output.summary", "acl_field": "acl"},
                "model": {"engine": "synthetic", "options": {"call_log": str(self.calls)}},
                "prompt": {"text": "Embed.\n", "version": "v1"},
                "output": {"schema": "schema.json", "index": {"uri": str(self.tmp / "index"), "fields": ["summary"]}},
                "shards": {"size": 10, "lease_seconds": 30, "renew_seconds": 1, "batch_size": 4}}
        (d / "job.yaml").write_text(yaml.safe_dump(spec))
        version = sealed(d / "job.yaml", self.store)
        publish(self.store, version)
        return version

    def engine_calls(self) -> dict[str, int]:
        """The records the engines were called for since the last look (a search's query aside)."""
        counts = call_counts(self.calls)
        counts.pop("query", None)
        self.calls.unlink(missing_ok=True)
        return counts


def hits(store_url: str, groups: list[str], k: int = 50) -> list[str]:
    return sorted(h.record_id for h in Jobs(store_url).search("tickets-index", "record", groups, k=k).hits)


GROUP_1 = [f"r{i:06d}" for i in range(1, N, 3)]


def test_a_revocation_upstream_is_served_nowhere_from_the_upstream_s_publish_on(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = Pipeline(job_factory, store, tmp_path)
    records = make_records(N)
    u1 = p.upstream(records)
    d1 = p.downstream()
    p.engine_calls()
    assert hits(store_url, ["group-1"]) == GROUP_1

    # r000004 is tightened to legal alone in the input; the triage job runs again and is published.
    tightened = [dict(r) for r in records]
    tightened[4]["acl"] = ["legal"]
    u2 = p.upstream(tightened)
    assert p.engine_calls() == {}  # an ACL-only change: carried, no engine call
    assert {r.record_id: r.acl for r in store.iter_results(u2)}["r000004"] == ["legal"]

    # The index has not run again, and serves r000004 to nobody in group-1 from now on, while
    # still filling k from the rows group-1 may see.
    found = Jobs(store_url).search("tickets-index", "record", ["group-1"], k=50)
    assert found.version == d1 and sorted(h.record_id for h in found.hits) == [i for i in GROUP_1 if i != "r000004"]
    assert found.withheld == 1
    assert len(Jobs(store_url).search("tickets-index", "record", ["group-1"], k=9).hits) == 9
    [lag] = found.behind
    assert (lag.name, lag.planned_on, lag.published, lag.behind) == ("triage", u1, u2, True)
    # The index's own copy never admits a group it did not name: legal finds it once the index runs again.
    assert hits(store_url, ["legal"]) == []

    # status and search --json say by how many records it is behind.
    assert main(["status", d1, "--json", "--store", store_url]) == 0
    [upstream] = json.loads(capsys.readouterr().out)["upstreams"]
    assert (upstream["behind"], upstream["records"], upstream["changes"]) == (
        True, 1, {"added": 0, "changed": 1, "removed": 0})
    assert main(["status", d1, "--store", store_url]) == 0
    assert f"behind its upstream triage: planned on {u1}, {u2} is published now" in capsys.readouterr().out
    assert main(["search", "tickets-index", "--query", "x", "--groups", "group-1", "--json", "--store",
                 store_url]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["withheld"] == 1 and out["upstreams"][0]["records"] == 1 and "r000004" not in {
        h["id"] for h in out["hits"]}

    # The index runs again: nothing is inferred (the ACL alone changed), and its rows take the new ACL.
    d2 = p.downstream()
    assert p.engine_calls() == {}
    assert {r.record_id: r.acl for r in store.iter_results(d2)}["r000004"] == ["legal"]
    found = Jobs(store_url).search("tickets-index", "record", ["group-1"], k=50)
    assert found.version == d2 and found.withheld == 0 and not found.behind[0].behind
    assert hits(store_url, ["legal"]) == ["r000004"]

    # Rolled back to the version planned on the older upstream: still not served to group-1.
    assert rollback(store, "tickets-index") == (d2, d1)
    found = Jobs(store_url).search("tickets-index", "record", ["group-1"], k=50)
    assert found.version == d1 and "r000004" not in {h.record_id for h in found.hits} and found.withheld == 1


def test_the_upstream_s_publish_names_the_published_jobs_that_read_an_older_version_of_it(
        job_factory: Any, store: Store, tmp_path: Path) -> None:
    p = Pipeline(job_factory, store, tmp_path)
    records = make_records(N)
    u1 = p.upstream(records)
    d1 = p.downstream()
    changed = [dict(r) for r in records]
    changed[2]["acl"] = ["legal"]
    path = write_jsonl(tmp_path / "later.jsonl", changed)
    u2 = sealed(job_factory(input_path=path, name="triage", base="published"), store)
    result = publish(store, u2)
    [lag] = result.readers_behind
    assert (lag.reader, lag.name, lag.planned_on, lag.published) == (d1, "triage", u1, u2)
    assert f"tickets-index ({d1}) reads {u1} of triage" in result.summary()


def test_a_record_the_upstream_no_longer_publishes_is_served_to_nobody(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    p = Pipeline(job_factory, store, tmp_path)
    records = make_records(N)
    p.upstream(records)
    p.downstream()
    p.upstream([r for r in records if r["id"] != "r000007"])
    assert "r000007" not in hits(store_url, ["group-1"])
    assert hits(store_url, ["group-1"]) == [i for i in GROUP_1 if i != "r000007"]


def test_a_search_fails_closed_naming_the_job_when_the_upstream_s_publication_cannot_be_read(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = Pipeline(job_factory, store, tmp_path)
    u1 = p.upstream(make_records(N))
    p.downstream()
    # The triage name is pointed at a version whose rows are gone (a cleanup outside batchline):
    # what it publishes now cannot be read, so nothing of it is served.
    with Database(store_url) as db:
        db.execute("UPDATE jobs SET state = 'removed' WHERE version = ?", (u1,))
    with pytest.raises(UpstreamUnreadable) as refused:
        Jobs(store_url).search("tickets-index", "record", ["group-1"], k=5)
    assert "tickets-index serves the records of triage under the ACLs triage publishes now" in str(refused.value)
    assert "nothing is served until triage is published again" in str(refused.value)
    assert refused.value.exit_code == 4
    assert main(["search", "tickets-index", "--query", "x", "--groups", "group-1", "--store", store_url]) == 4
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
