"""A published job's results as a job's input (`input.job`): pinned at planning to the version
published then, the upstream version and the field in the version hash, unchanged records
carried by an incremental run, the records copied into the downstream's own rows (so a
republish or removal of the upstream after planning changes nothing it reads), a result
without the field dead-lettered at planning, retention keeping an upstream that a version
not sealed yet reads, and mistakes refused with one line. On both stores."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from batchline.acl import Acl
from batchline.api import Jobs
from batchline.check.validate import validate
from batchline.errors import InputError, SpecError, StoreError, VersionHalted
from batchline.plan.planner import plan
from batchline.publish.pointer import prune, publish
from batchline.snapshot import Slice, read_slice
from batchline.spec import JobSpec, load_spec, stored_spec
from batchline.store import ResultRow, Store
from batchline.worker.supervisor import Worker
from tests.helpers import check_invariants, make_records, planned, run_to_seal

N = 120


def publish_upstream(job_factory: Any, store: Store, records: list[dict[str, Any]] | None = None,
                     **kw: Any) -> tuple[JobSpec, str]:
    """The upstream job planned, run, validated and published as `tickets`."""
    spec, version = planned(job_factory(records if records is not None else make_records(N), name="tickets",
                                        **kw), store)
    run_to_seal(store, version)
    assert validate(store, version).passed
    publish(store, version)
    return spec, version


def downstream_job(job_factory: Any, field: str = "output.summary", acl_field: str | None = "acl",
                   **kw: Any) -> Path:
    path = job_factory(n=1, name="summaries", **kw)
    spec = yaml.safe_load(path.read_text())
    spec["input"] = {"job": "tickets", "field": field, **({"acl_field": acl_field} if acl_field else {})}
    path.write_text(yaml.safe_dump(spec))
    return path


def upstream_summaries(store: Store, version: str) -> dict[str, str]:
    return {r.record_id: json.loads(r.output)["summary"] for r in store.iter_results(version)}


def texts_read(store: Store, version: str) -> dict[str, str | None]:
    job = store.job(version)
    assert job is not None
    return {r.record_id: r.text for r in store.input_records(version, 0, job.record_count)}


def test_a_job_over_a_published_job_reads_the_fields_text_with_the_upstreams_ids_and_acls(
        job_factory: Any, store: Store) -> None:
    _up, upstream = publish_upstream(job_factory, store)
    spec = load_spec(downstream_job(job_factory))
    result = plan(spec, store)
    assert result.records == N
    stored = stored_spec(store.job(result.version))  # type: ignore[arg-type]
    assert stored.input.source.to_dict() == {"job": "tickets", "field": "output.summary", "job_version": upstream}
    assert texts_read(store, result.version) == upstream_summaries(store, upstream)

    run_to_seal(store, result.version)
    results, dead = check_invariants(store, result.version, stored)
    assert dead == set() and results == set(upstream_summaries(store, upstream))
    acls = {r.record_id: r.acl for r in store.iter_results(upstream)}
    assert {r.record_id: r.acl for r in store.iter_results(result.version)} == acls
    assert all(acl == [f"group-{int(rid[1:]) % 3}"] for rid, acl in acls.items())


def test_the_version_moves_with_the_upstream_version_and_with_the_field(job_factory: Any, store: Store) -> None:
    publish_upstream(job_factory, store)
    path = downstream_job(job_factory)
    first = plan(load_spec(path), store)
    again = plan(load_spec(path), store)
    assert (again.version, again.created) == (first.version, False)
    other_field = plan(load_spec(downstream_job(job_factory, field="output.category")), store)
    assert other_field.version != first.version

    # The triage job published again under another prompt: the same spec plans a new version.
    publish_upstream(job_factory, store, prompt="Classify, again.\n")
    after = plan(load_spec(path), store)
    assert after.created and after.version not in (first.version, other_field.version)
    assert stored_spec(store.job(first.version)).inference_identity() == load_spec(  # type: ignore[arg-type]
        path).inference_identity()


def test_an_incremental_run_after_a_new_upstream_version_carries_the_records_whose_text_is_unchanged_under_their_acls(
        job_factory: Any, store: Store) -> None:
    records = make_records(N)
    publish_upstream(job_factory, store, records)
    path = downstream_job(job_factory, base="published")
    first = plan(load_spec(path), store)
    run_to_seal(store, first.version)
    assert validate(store, first.version).passed
    publish(store, first.version)

    changed = [dict(r) for r in records]
    for r in changed[:3]:
        r["text"] = f"another text for {r['id']}"  # a new summary
    changed[3]["acl"] = ["group-x"]  # the same summary, another ACL
    _up2, upstream2 = publish_upstream(job_factory, store, changed)
    second = plan(load_spec(path), store)
    assert second.version != first.version
    job = store.job(second.version)
    # An upstream ACL change re-runs nothing downstream: the record is carried under its new ACL.
    assert job is not None and job.carried == N - 3
    run_to_seal(store, second.version)
    computed = {r.record_id for r in store.iter_results(second.version, computed_only=True)}
    assert computed == {r["id"] for r in changed[:3]}
    assert {r.record_id: r.acl for r in store.iter_results(second.version)} == {
        r.record_id: r.acl for r in store.iter_results(upstream2)}


def test_an_upstream_republished_after_planning_does_not_change_what_the_downstream_reads(
        job_factory: Any, store: Store) -> None:
    records = make_records(N)
    _up, upstream = publish_upstream(job_factory, store, records)
    summaries = upstream_summaries(store, upstream)
    downstream = plan(load_spec(downstream_job(job_factory)), store).version

    # After planning, the triage job is published again with other summaries, and the
    # version that was planned on is removed outright: the downstream reads its own rows.
    publish_upstream(job_factory, store, [{**r, "text": f"changed {r['text']}"} for r in records])
    assert store.resolve_name("tickets") != upstream
    store.remove_version(upstream)
    run_to_seal(store, downstream)
    outputs = {r.record_id: json.loads(r.output)["summary"] for r in store.iter_results(downstream)}
    # The synthetic engine's summary is the start of the text it was given: the first version's summaries.
    assert outputs == {rid: " ".join(text.split())[:30] for rid, text in summaries.items()}
    assert stored_spec(store.job(downstream)).input.source.to_dict()["job_version"] == upstream  # type: ignore[arg-type]


NULLABLE = {"type": "object", "additionalProperties": False, "required": ["category"],
            "properties": {"category": {"enum": ["a", "b", "c"]}, "summary": {"type": ["string", "null"]}}}


def seal_with_outputs(store: Store, version: str, outputs: dict[str, dict[str, Any]]) -> None:
    """The version's one shard answered with the outputs given, as a worker would write them."""
    lease = store.claim("hand", version)
    assert lease is not None and store.claim("hand", version) is None
    # Each row says its piece, as a worker's do: the fence refuses those that do not.
    read = read_slice(Slice.from_json(lease.slice), stored_spec(store.job(version)).input, None,  # type: ignore[arg-type]
                      lambda start, end: store.input_records(version, start, end))
    pieces = {r.id: r.piece for r in read}
    store.put_results(lease, [ResultRow(rid, json.dumps(out), acl=Acl(["g"]), piece=pieces[rid])
                              for rid, out in outputs.items()])
    store.complete(lease)


def test_a_result_whose_field_is_missing_or_null_is_a_dead_letter_at_planning_and_costs_no_attempt(
        job_factory: Any, store: Store) -> None:
    _spec, upstream = planned(job_factory(make_records(3), name="tickets", schema=NULLABLE), store)
    seal_with_outputs(store, upstream, {"r000000": {"category": "a", "summary": "kept"},
                                        "r000001": {"category": "b", "summary": None},
                                        "r000002": {"category": "c"}})
    publish(store, upstream, force=True, reason="outputs written by the test")
    result = plan(load_spec(downstream_job(job_factory)), store)
    assert (result.records, result.dead_letters) == (3, 2)
    dead = {d.record_id: d for d in store.iter_dead_letters(result.version)}
    # Each with its record's ACL as the upstream planned it, not the one the test's hand put.
    assert {rid: (d.kind, d.error, d.attempts, d.acl) for rid, d in dead.items()} == {
        "r000001": ("missing_text", f"output.summary is null in {upstream}", 0, ["group-1"]),
        "r000002": ("missing_text", f"output.summary is missing in {upstream}", 0, ["group-2"])}
    run_to_seal(store, result.version)
    [only] = list(store.iter_results(result.version))
    assert only.record_id == "r000000" and json.loads(only.output)["summary"] == "kept"
    coverage = store.coverage(result.version)
    assert (coverage.records, coverage.missing, coverage.unexpected) == (3, 0, 0)


def test_retention_keeps_an_upstream_version_while_a_version_planned_on_it_is_not_sealed(
        job_factory: Any, store: Store) -> None:
    records = make_records(20)
    keep_two = {"retention": {"versions": 2}}
    _s1, v1 = publish_upstream(job_factory, store, records, **keep_two)
    downstream = plan(load_spec(downstream_job(job_factory)), store).version
    later = [publish_upstream(job_factory, store, [{**r, "text": f"{n} {r['text']}"} for r in records],
                              **keep_two)[1] for n in (2, 3, 4)]
    # Beyond the two versions kept, the second is removed but the first is kept: the downstream reads it.
    assert store.job(later[0]).state == "removed"  # type: ignore[union-attr]
    assert store.job(v1).state == "sealed"  # type: ignore[union-attr]
    run_to_seal(store, downstream)
    assert prune(store, "tickets", 2) == (v1,)
    assert store.job(v1).state == "removed"  # type: ignore[union-attr]
    assert {j.version for j in store.jobs() if j.name == "tickets" and j.state == "sealed"} == set(later[1:])


def test_retention_removed_the_upstream_of_a_halted_downstream_version_as_if_it_were_sealed(
        job_factory: Any, store: Store) -> None:
    """A halted version is not sealed: resumed, it runs again, so the upstream it was planned
    on is kept as for a ready one."""
    records = make_records(20)
    keep_two = {"retention": {"versions": 2}}
    _s1, v1 = publish_upstream(job_factory, store, records, **keep_two)
    downstream = plan(load_spec(downstream_job(
        job_factory, options={"truncate_on": [r["id"] for r in records]},
        shards={"abort_dead_letter_rate": 0.5, "abort_min_outcomes": 5})), store).version
    with pytest.raises(VersionHalted):
        Worker(store, version=downstream, poll_seconds=0.1).run()
    assert store.job(downstream).state == "halted"  # type: ignore[union-attr]
    later = [publish_upstream(job_factory, store, [{**r, "text": f"{n} {r['text']}"} for r in records],
                              **keep_two)[1] for n in (2, 3, 4)]
    assert store.job(later[0]).state == "removed"  # type: ignore[union-attr]
    assert store.job(v1).state == "sealed"  # type: ignore[union-attr]


def test_delete_removed_an_upstream_version_that_a_version_not_sealed_yet_reads(
        job_factory: Any, store: Store, store_url: str) -> None:
    """`delete` keeps what retention keeps: an upstream version a downstream version not
    sealed yet was planned on is refused, with the reader named, until that one seals."""
    records = make_records(10)
    _s1, v1 = publish_upstream(job_factory, store, records)
    downstream = plan(load_spec(downstream_job(job_factory)), store).version
    for n in (2, 3):  # v1 is then neither published nor what a rollback returns to
        publish_upstream(job_factory, store, [{**r, "text": f"{n} {r['text']}"} for r in records])
    jobs = Jobs(store_url)
    with pytest.raises(StoreError, match=rf"^cannot delete {re.escape(v1)}: {re.escape(downstream)} reads it "
                                         r"\(input.job\) and is not sealed yet; let it seal, or cancel it, first$"):
        jobs.delete(v1)
    assert store.job(v1).state == "sealed"  # type: ignore[union-attr]
    run_to_seal(store, downstream)
    assert jobs.delete(v1) is True
    assert store.job(v1).state == "removed"  # type: ignore[union-attr]


def test_a_job_over_a_job_nothing_is_published_as_is_refused_in_one_line(job_factory: Any, store: Store) -> None:
    with pytest.raises(InputError, match=r"input.job: nothing is published as 'tickets' in .*; publish a version"):
        plan(load_spec(downstream_job(job_factory)), store)


def test_a_field_the_upstreams_schema_does_not_have_is_refused_with_the_fields_it_has(
        job_factory: Any, store: Store) -> None:
    _spec, upstream = publish_upstream(job_factory, store, make_records(5))
    with pytest.raises(SpecError) as info:
        plan(load_spec(downstream_job(job_factory, field="output.sumary")), store)
    assert str(info.value) == (f"input.field: tickets's output schema ({upstream}) has no output.sumary "
                               "(fields of output: category, summary)")


def test_an_acl_field_other_than_the_upstreams_is_refused_and_a_missing_one_is_asked_for(
        job_factory: Any, store: Store) -> None:
    publish_upstream(job_factory, store, make_records(5))
    with pytest.raises(SpecError, match=r"input.acl_field: .* set input.acl_field: acl so that they are carried"):
        plan(load_spec(downstream_job(job_factory, acl_field=None)), store)
    with pytest.raises(SpecError, match=r"input.acl_field: .*carry the ACLs of its input.acl_field 'acl'"):
        plan(load_spec(downstream_job(job_factory, acl_field="groups")), store)


def test_a_named_upstream_version_is_read_instead_of_the_published_one(job_factory: Any, store: Store) -> None:
    records = make_records(10)
    _s1, v1 = publish_upstream(job_factory, store, records)
    publish_upstream(job_factory, store, [{**r, "text": "new " + r["text"]} for r in records])
    path = downstream_job(job_factory)
    spec = yaml.safe_load(path.read_text())
    spec["input"]["job_version"] = v1
    path.write_text(yaml.safe_dump(spec))
    version = plan(load_spec(path), store).version
    assert texts_read(store, version) == upstream_summaries(store, v1)
    spec["input"]["job_version"] = "tickets@0000000000000000"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(InputError, match=r"input.job_version: tickets@0000000000000000 is no such version"):
        plan(load_spec(path), store)


def test_output_carry_over_a_published_job_writes_the_upstream_s_carried_fields_not_nulls(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    records = make_records(12)
    for i, r in enumerate(records):
        r["region"], r["customer_id"] = f"eu-{i % 2}", 1000 + i
    publish_upstream(job_factory, store, records, output={"schema": "schema.json", "carry": ["region", "customer_id"]})
    path = downstream_job(job_factory, output={"schema": "schema.json", "carry": ["region", "customer_id"]})
    version = plan(load_spec(path), store).version
    run_to_seal(store, version)
    want = {r["id"]: {"region": r["region"], "customer_id": r["customer_id"]} for r in records}
    assert {r.record_id: r.carry for r in store.iter_results(version)} == want
    Jobs(store_url).export(version, format="jsonl", out=tmp_path / "out.jsonl")
    assert {json.loads(line)["id"]: json.loads(line)["carry"] for line in (tmp_path / "out.jsonl").open()} == want
    import pyarrow.parquet as pq

    Jobs(store_url).export(version, format="parquet", out=tmp_path / "out.parquet")
    assert {r["id"]: r["carry"] for r in pq.read_table(tmp_path / "out.parquet").to_pylist()} == {
        rid: {"region": c["region"], "customer_id": str(c["customer_id"])} for rid, c in want.items()}


def test_output_carry_over_a_job_that_does_not_carry_the_field_is_refused_at_planning_naming_what_it_carries(
        job_factory: Any, store: Store) -> None:
    records = make_records(6)
    for r in records:
        r["region"] = "eu"
    publish_upstream(job_factory, store, records, output={"schema": "schema.json", "carry": ["region"]})
    path = downstream_job(job_factory, output={"schema": "schema.json", "carry": ["region", "customer_id"]})
    jobs = len(store.jobs())
    with pytest.raises(SpecError, match=r"output\.carry: 'customer_id' is not carried by tickets@\w+ \(a job over a "
                                        r"job carries the fields its upstream carries: region;") as refused:
        plan(load_spec(path), store)
    assert "\n" not in str(refused.value) and len(store.jobs()) == jobs
