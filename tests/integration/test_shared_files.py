"""A nightly version shares the files of its base: an incremental version (`base: published`) is
staged into the Iceberg table as the base's data files of every shard it carried whole, plus
new files for the shards it changed; retention deletes a file only when no kept snapshot uses
it. Read back by DuckDB, on both stores."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from batchline.check.validate import validate
from batchline.publish.pointer import prune, publish
from batchline.spec import stored_spec
from batchline.store import Store
from batchline.targets import targets_for
from tests.helpers import planned, run_to_seal, write_jsonl
from tests.iceberg_support import main_rows, pyiceberg_table, with_table

TABLE = "lake.results"
N, SHARD = 300, 50


def records(changed: set[int] = frozenset(), prefix: str = "") -> list[dict[str, Any]]:  # type: ignore[assignment]
    return [{"id": f"r{i:05d}", "text": f"{prefix if i in changed else ''}ticket {i} about {i % 7}",
             "acl": ["g"]} for i in range(N)]


def night(job_factory: Any, store: Store, tmp_path: Path, rows: list[dict[str, Any]], name: str,
          **output: Any) -> str:
    path = job_factory(input_path=write_jsonl(tmp_path / f"{name}.jsonl", rows), base="published",
                       shards={"size": SHARD})
    with_table(path, tmp_path / "wh")
    if output:
        spec = yaml.safe_load(path.read_text())
        spec["output"].update(output)
        path.write_text(yaml.safe_dump(spec))
    _spec, version = planned(path, store)
    run_to_seal(store, version)
    assert validate(store, version).passed
    publish(store, version)
    return version


def branch_files(store_url: str, version: str) -> set[str]:
    table = pyiceberg_table(store_url, TABLE)
    snapshot = table.metadata.snapshot_by_id(table.metadata.refs[version].snapshot_id)
    return {e.data_file.file_path for m in snapshot.manifests(table.io) for e in m.fetch_manifest_entry(table.io)}


def read_back(store_url: str) -> dict[str, str]:
    return {row[0]: row[1] for row in main_rows(store_url, TABLE, "id, raw_output")}


def stored(store: Store, version: str) -> dict[str, str]:
    return {r.record_id: r.output for r in store.iter_results(version)}


def test_a_nightly_version_shares_every_file_of_a_shard_it_carried_whole_and_writes_the_rest(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    v1 = night(job_factory, store, tmp_path, records(), "v1")
    first = branch_files(store_url, v1)
    assert len(first) == N // SHARD  # a file per shard
    # The most recent records changed, as nightly changes are: the last shard alone.
    v2 = night(job_factory, store, tmp_path, records(set(range(N - 20, N)), "changed "), "v2")
    second = branch_files(store_url, v2)
    assert len(second) == N // SHARD and len(first & second) == N // SHARD - 1
    assert read_back(store_url) == stored(store, v2)  # every row of v2, once, as the store holds it
    summary = pyiceberg_table(store_url, TABLE).metadata.current_snapshot().summary.additional_properties
    assert (summary["batchline.files-shared"], summary["batchline.files-written"]) == ("5", "1")
    # One record in each shard changed: nothing is shared.
    v3 = night(job_factory, store, tmp_path, records(set(range(0, N, SHARD)), "again "), "v3")
    assert not branch_files(store_url, v3) & second
    assert read_back(store_url) == stored(store, v3)


def test_an_acl_only_change_counts_as_a_changed_row_and_another_row_shape_shares_nothing(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    v1 = night(job_factory, store, tmp_path, records(), "v1")
    rows = records()
    rows[7]["acl"] = ["hr"]
    v2 = night(job_factory, store, tmp_path, rows, "v2")
    assert len(branch_files(store_url, v1) & branch_files(store_url, v2)) == N // SHARD - 1
    acls = {row[0]: row[1] for row in main_rows(store_url, TABLE, "id, acl")}
    assert acls["r00007"] == ["hr"] and acls["r00008"] == ["g"]
    # Provenance adds a column to every row: the same records, another shape, no file shared.
    v3 = night(job_factory, store, tmp_path, rows, "v3", provenance=True)
    assert not branch_files(store_url, v3) & branch_files(store_url, v2)


def test_retention_prunes_the_base_while_the_version_sharing_its_files_is_published_and_every_row_reads_back(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    v1 = night(job_factory, store, tmp_path, records(), "v1")
    v2 = night(job_factory, store, tmp_path, records({N - 1}, "x "), "v2")
    v3 = night(job_factory, store, tmp_path, records({N - 1}, "y "), "v3")
    shared = branch_files(store_url, v1) & branch_files(store_url, v3)
    assert len(shared) == N // SHARD - 1
    info = store.job(v3)
    assert info is not None
    removed = prune(store, info.name, 2, targets=targets_for(stored_spec(info), store_url))
    assert removed == (v1,)
    table = pyiceberg_table(store_url, TABLE)
    assert v1 not in table.metadata.refs
    assert all(Path(p.removeprefix("file://")).exists() for p in shared)  # v2 and v3 use them still
    assert read_back(store_url) == stored(store, v3)
    _ = v2


# --- the retrieval index: a version of one table, built on its base --------------------------------


def folder_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


SUMMARISED = {"type": "object", "properties": {
    "embedding": {"type": "array", "items": {"type": "number", "minimum": 1}, "minItems": 4, "maxItems": 4},
    "summary": {"type": "string", "maxLength": 40}}, "required": ["embedding", "summary"]}


def indexed(store: Store, tmp_path: Path, rows: list[dict[str, Any]], tag: str,
            index: dict[str, Any] | None = None, **top: Any) -> str:
    import json

    from tests.integration.test_retrieval_index import index_job, sealed

    path = index_job(tmp_path, rows, engine="synthetic", tag=tag, base="published",
                     index={"fields": ["summary"], **(index or {})}, **top)
    (path.parent / "schema.json").write_text(json.dumps(SUMMARISED))
    version = sealed(path, store)
    publish(store, version)
    return version


def vector_rows(changed: set[int] = frozenset(), removed: set[int] = frozenset(),  # type: ignore[assignment]
                added: int = 0) -> list[dict[str, Any]]:
    rows = [{"id": f"r{i:05d}", "text": f"{'new ' if i in changed else ''}ticket {i}", "acl": ["g"]}
            for i in range(N) if i not in removed]
    return rows + [{"id": f"z{i:05d}", "text": f"added {i}", "acl": ["g"]} for i in range(added)]


def test_an_index_version_is_its_base_plus_its_changes_and_forgetting_the_base_keeps_it_whole(
        store: Store, store_url: str, tmp_path: Path) -> None:
    from batchline.api import Jobs
    from batchline.targets.lancedb_index import LanceIndex, version_tag

    data = tmp_path / "index" / "tickets-index.lance" / "data"
    v1 = indexed(store, tmp_path, vector_rows(), "1")
    before = {p.name: p.stat().st_size for p in data.iterdir()}
    v2 = indexed(store, tmp_path, vector_rows(changed={3}, removed={4}, added=2), "2")
    after = {p.name: p.stat().st_size for p in data.iterdir()}
    new = {name: size for name, size in after.items() if name not in before}
    assert before.items() <= after.items()  # the base's data files stay, unchanged, shared
    assert 0 < sum(new.values()) < sum(before.values()) / 5  # its changes (3 rows of 301), not a copy
    hits = {h.record_id: h for h in Jobs(store_url).search("tickets-index", "ticket", ["g"], k=N + 10).hits}
    assert len(hits) == N + 1 and "r00004" not in hits and {"z00000", "z00001"} <= set(hits)
    assert hits["r00003"].fields["summary"].startswith("new ticket 3")
    assert all(h.version == v2 for h in hits.values())
    [output] = stored_spec(store.job(v2)).targets  # type: ignore[arg-type]
    lance = LanceIndex(output)  # type: ignore[arg-type]
    table = lance.connect().open_table("tickets-index")
    v1_rows = {v1: N, v2: N + 1}
    for version, rows in v1_rows.items():
        table.checkout(table.tags.get_version(version_tag(version)))
        assert table.count_rows() == rows
    # The base forgotten while v2 is published: v2 reads whole, and v1's tag is gone.
    lance.forget("tickets-index", v1)
    table = lance.connect().open_table("tickets-index")
    assert set(table.tags.list()) == {version_tag(v2)}
    table.checkout(table.tags.get_version(version_tag(v2)))
    assert table.count_rows() == N + 1
    again = {h.record_id for h in Jobs(store_url).search("tickets-index", "ticket", ["g"], k=N + 10).hits}
    assert again == set(hits)


def deletion_files(table: Any, lance_version: int) -> int:
    table.checkout(lance_version)
    return sum(f.deletion_file() is not None for f in table.to_lance().get_fragments())


def test_a_nightly_version_that_deletes_a_tenth_of_a_file_rewrites_it_without_them_and_keeps_its_base(
        store: Store, store_url: str, tmp_path: Path) -> None:
    from batchline.api import Jobs
    from batchline.targets.lancedb_index import LanceIndex, version_tag

    data = tmp_path / "index" / "tickets-index.lance" / "data"
    v1 = indexed(store, tmp_path, vector_rows(), "1")
    before = {p.name: p.stat().st_size for p in data.iterdir()}
    changed = set(range(0, N, 10))  # a tenth, spread over the file: over the default share of 0.03
    v2 = indexed(store, tmp_path, vector_rows(changed=changed), "2")
    [output] = stored_spec(store.job(v2)).targets  # type: ignore[arg-type]
    table = LanceIndex(output).connect().open_table("tickets-index")  # type: ignore[arg-type]
    v2_at = table.tags.get_version(version_tag(v2))
    assert deletion_files(table, v2_at) == 0  # rewritten without its deleted rows
    assert table.count_rows() == N
    assert {ix.name: table.index_stats(ix.name).num_unindexed_rows for ix in table.list_indices()} == \
        {ix.name: 0 for ix in table.list_indices()}
    after = {p.name: p.stat().st_size for p in data.iterdir()}
    assert before.items() <= after.items()  # the base keeps its files while it is kept
    table.checkout(table.tags.get_version(version_tag(v1)))
    assert table.count_rows() == N
    hits = {h.record_id: h for h in Jobs(store_url).search("tickets-index", "ticket", ["g"], k=N + 10).hits}
    assert len(hits) == N and all(h.version == v2 for h in hits.values())
    assert all(hits[f"r{i:05d}"].fields["summary"].startswith("new ticket") for i in changed)
    assert not any(hits[f"r{i:05d}"].fields["summary"].startswith("new") for i in range(N) if i not in changed)


def test_rewrite_deleted_share_one_keeps_the_deletions_as_deletion_files_and_copies_nothing(
        store: Store, store_url: str, tmp_path: Path) -> None:
    from batchline.targets.lancedb_index import LanceIndex, version_tag

    data = tmp_path / "index" / "tickets-index.lance" / "data"
    indexed(store, tmp_path, vector_rows(), "1", index={"rewrite_deleted_share": 1})
    before = folder_size(data)
    v2 = indexed(store, tmp_path, vector_rows(changed=set(range(0, N, 10))), "2",
                 index={"rewrite_deleted_share": 1})
    [output] = stored_spec(store.job(v2)).targets  # type: ignore[arg-type]
    assert output.rewrite_deleted_share == 1  # type: ignore[attr-defined]
    table = LanceIndex(output).connect().open_table("tickets-index")  # type: ignore[arg-type]
    assert deletion_files(table, table.tags.get_version(version_tag(v2))) == 1
    assert table.count_rows() == N
    assert 0 < folder_size(data) - before < before / 5  # its 30 changed rows, not a copy


def test_forget_removes_the_copies_of_shard_files_a_version_owns_and_keeps_those_a_kept_version_shares(
        job_factory: Any, store: Store, store_url: str, tmp_path: Path) -> None:
    """With `files: per-shard` the table names the publisher's copies of the workers' files: a
    nightly version shares its base's copies; forgetting the base deletes its copy no kept
    version uses, and its staging files, and leaves the shared ones."""
    per_shard = {"files": "per-shard"}

    def nightly(rows: list[dict[str, Any]], name: str) -> str:
        path = job_factory(input_path=write_jsonl(tmp_path / f"{name}.jsonl", rows), base="published",
                           shards={"size": SHARD})
        with_table(path, tmp_path / "wh", **per_shard)
        _spec, version = planned(path, store)
        run_to_seal(store, version)
        assert validate(store, version).passed
        publish(store, version)
        return version

    v1 = nightly(records(), "v1")
    first = {p.removeprefix("file://") for p in branch_files(store_url, v1)}
    location = pyiceberg_table(store_url, TABLE).metadata.location.removeprefix("file://")
    assert len(first) == N // SHARD and all(p.startswith(f"{location}/data/batchline-shards/{v1}/") for p in first)
    v2 = nightly(records(set(range(N - 20, N)), "changed "), "v2")
    second = {p.removeprefix("file://") for p in branch_files(store_url, v2)}
    shared, own = first & second, first - second
    assert len(shared) == N // SHARD - 1 and len(own) == 1
    info = store.job(v2)
    assert info is not None
    [target] = targets_for(stored_spec(info), store_url)
    target.forget("test-job", v1)
    assert all(Path(p).exists() for p in second) and not any(Path(p).exists() for p in own)
    assert not list((tmp_path / "wh" / "batchline-staging" / v1).glob("*.parquet"))
    assert read_back(store_url) == stored(store, v2)
