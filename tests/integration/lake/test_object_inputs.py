"""Inputs in object storage: pins, conditional reads, globs, manifests, request counts,
and the store's own faults, against the S3 and GCS stand-ins (tests/integration/lake/support.py)."""

from __future__ import annotations

import hashlib
import io
import json
import re
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchline.errors import InputError, SourceUnavailable, SpecError
from batchline.plan.planner import plan
from batchline.snapshot import Slice, file_digest, read_slice, scan
from batchline.sources import open_source
from batchline.sources.objects import STREAM_CHUNK
from batchline.spec import JobSpec, parse_spec
from batchline.store import Store
from batchline.targets.openai_batch import export_openai_batch
from tests.helpers import make_records, run_to_seal
from tests.integration.lake.support import FaultProxy, GCSStandIn, S3StandIn


def jsonl(records: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def parquet_bytes(n: int, group_rows: int, prefix: str = "p") -> bytes:
    buf = io.BytesIO()
    # Text that does not compress, so row groups are much larger than the footer.
    noise = [hashlib.sha256(str(i).encode()).hexdigest() * 3 for i in range(n)]
    # Every record has an ACL (the specs name acl_field); the same one, so its column is tiny.
    table = pa.table({"id": [f"{prefix}{i:05d}" for i in range(n)], "text": [f"text of {i}" for i in range(n)],
                      "acl": ['["staff"]'] * n, "unread": noise})
    pq.write_table(table, buf, row_group_size=group_rows)
    return buf.getvalue()


def object_spec(tmp_path: Path, input_: dict[str, Any], size: int = 100, **top: Any) -> JobSpec:
    return parse_spec({"name": "lake-job", "input": {"acl_field": "acl", **input_},
                       "model": {"engine": "synthetic"}, "prompt": {"text": "Classify.", "version": "v1"},
                       "output": {"schema": {"type": "object"}}, "shards": {"size": size}, **top},
                      base_dir=tmp_path)


def slices(store: Store, version: str) -> list[Slice]:
    """The planned slices, as a worker gets them: through claims."""
    claimed = []
    while (lease := store.claim("reader", version)) is not None:
        claimed.append((lease.shard_no, Slice.from_json(lease.slice)))
    return [s for _, s in sorted(claimed, key=lambda x: x[0])]


def planned_object(store: Store, tmp_path: Path, bucket: Any, key: str, data: bytes, size: int = 100,
                   **input_: Any) -> tuple[str, JobSpec, list[Slice]]:
    """One object uploaded and planned: its URL, the job's spec and its slices."""
    url = bucket.put(key, data)
    spec = object_spec(tmp_path, {"path": url, **input_}, size=size)
    return url, spec, slices(store, plan(spec, store).version)


# --- pins and conditional reads ----------------------------------------------------------


@pytest.mark.parametrize("versioned", [False, True], ids=["plain", "versioned"])
def test_planning_pins_each_object_with_one_head_and_reads_it_once(
        s3_proxy: FaultProxy, lake_env: S3StandIn, store: Store, tmp_path: Path, versioned: bool) -> None:
    bucket = lake_env.bucket(versioned=versioned)
    url = bucket.put("in/tickets.jsonl", jsonl(make_records(250)))
    spec = object_spec(tmp_path, {"path": url})
    s3_proxy.clear()
    version = plan(spec, store).version
    assert [(s.method, s.range) for s in s3_proxy.requests()] == [("HEAD", None), ("GET", None)]
    pin = open_source(url).pin()
    assert (pin.size, pin.etag is not None, pin.version is not None) == (len(bucket.get("in/tickets.jsonl")),
                                                                          True, versioned)
    planned = slices(store, version)
    assert [s.pin for s in planned] == [pin, pin, pin]
    # A worker reads its slice in one ranged GET of exactly its bytes.
    s3_proxy.clear()
    records = read_slice(planned[1], spec.input)
    assert [r.id for r in records] == [f"r{i:06d}" for i in range(100, 200)]
    [get] = s3_proxy.requests()
    assert (get.method, get.range, get.body_bytes) == ("GET", f"bytes={planned[1].start}-{planned[1].end - 1}",
                                                       planned[1].end - planned[1].start)


def test_an_object_overwritten_after_planning_is_refused_by_key_on_a_bucket_without_versions(
        lake_env: S3StandIn, store: Store, tmp_path: Path) -> None:
    bucket = lake_env.bucket()
    data = jsonl(make_records(150))
    url, spec, [first, _] = planned_object(store, tmp_path, bucket, "in/a.jsonl", data)
    bucket.put("in/a.jsonl", data.replace(b"record number 7 ", b"record number X "))
    with pytest.raises(InputError, match=rf"input changed since planning: {url} \(its ETag is no longer"):
        read_slice(first, spec.input)
    # The same bytes uploaded again are the same content, and the same ETag.
    bucket.put("in/a.jsonl", data)
    assert len(read_slice(first, spec.input)) == 100


def test_a_versioned_object_is_read_at_its_pinned_version_and_refused_once_that_version_is_gone(
        lake_env: S3StandIn, store: Store, tmp_path: Path) -> None:
    bucket = lake_env.bucket(versioned=True)
    url, spec, [first, _] = planned_object(store, tmp_path, bucket, "in/a.jsonl", jsonl(make_records(150)))
    bucket.put("in/a.jsonl", b"not even json\n" * 1000)
    assert [r.id for r in read_slice(first, spec.input)][:2] == ["r000000", "r000001"]
    assert first.pin is not None and first.pin.version is not None
    bucket.delete_version("in/a.jsonl", first.pin.version)
    with pytest.raises(InputError, match=rf"input changed since planning: {url} \(version .* is gone\)"):
        read_slice(first, spec.input)


def test_identical_bytes_uploaded_again_are_a_new_version_of_the_job_on_a_versioned_bucket(
        lake_env: S3StandIn, tmp_path: Path) -> None:
    bucket = lake_env.bucket(versioned=True)
    data = jsonl(make_records(20))
    url = bucket.put("in/a.jsonl", data)
    spec = object_spec(tmp_path, {"path": url})
    before = spec.version(file_digest(spec.input))
    assert spec.version(file_digest(spec.input)) == before
    bucket.put("in/a.jsonl", data)
    assert spec.version(file_digest(spec.input)) != before


# --- globs and manifests ---------------------------------------------------------------


def test_a_glob_is_one_prefix_listing_filtered_segment_by_segment(
        s3_proxy: FaultProxy, lake_env: S3StandIn, tmp_path: Path) -> None:
    bucket = lake_env.bucket()
    for key in ("day=1/a.jsonl", "day=1/b.jsonl", "day=1/sub/c.jsonl", "day=2/a.jsonl", "day=1/a.csv",
                "day=10/a.jsonl"):
        bucket.put(key, jsonl(make_records(1, key)))
    s3_proxy.clear()
    spec = object_spec(tmp_path, {"path": bucket.url("day=1/*.jsonl")})
    assert spec.input.locations == (bucket.url("day=1/a.jsonl"), bucket.url("day=1/b.jsonl"))
    [listing] = s3_proxy.requests()
    assert (listing.method, "prefix=day%3D1%2F" in listing.path) == ("GET", True)
    deep = object_spec(tmp_path, {"path": [bucket.url("day=1*/**/a.jsonl"), bucket.url("day=2/a.jsonl")]})
    assert deep.input.locations == (bucket.url("day=1/a.jsonl"), bucket.url("day=10/a.jsonl"),
                                     bucket.url("day=2/a.jsonl"))


def test_a_glob_lists_a_page_per_thousand_keys(s3_proxy: FaultProxy, lake_env: S3StandIn, tmp_path: Path) -> None:
    bucket = lake_env.bucket()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: bucket.put(f"many/k{i:05d}.jsonl", b""), range(2001)))
    s3_proxy.clear()
    spec = object_spec(tmp_path, {"path": bucket.url("many/k0*.jsonl")})
    assert len(spec.input.locations) == 2001
    assert len(s3_proxy.requests("GET")) == 3


def test_a_glob_that_matches_no_object_is_refused(lake_env: S3StandIn, tmp_path: Path) -> None:
    bucket = lake_env.bucket()
    bucket.put("in/a.jsonl", b"")
    with pytest.raises(SpecError, match=re.escape(f"input.path: '{bucket.url('in/*.csv')}' matches no object")):
        object_spec(tmp_path, {"path": bucket.url("in/*.csv")})


def test_a_manifest_lists_objects_by_url_or_by_key_in_its_own_bucket(
        lake_env: S3StandIn, store: Store, tmp_path: Path) -> None:
    bucket = lake_env.bucket()
    a = bucket.put("in/a.jsonl", jsonl(make_records(30, "a")))
    b = bucket.put("in/b.jsonl", jsonl(make_records(30, "b")))
    manifest = bucket.put("manifests/today.txt", b"# today's snapshot\nin/b.jsonl\n\n" + a.encode() + b"\n")
    spec = object_spec(tmp_path, {"manifest": manifest})
    assert spec.input.locations == (b, a)
    local = tmp_path / "manifest.txt"
    local.write_text(f"{a}\n{b}\n")
    assert object_spec(tmp_path, {"manifest": "manifest.txt"}).input.locations == (a, b)
    # The stored spec names the objects, not the manifest: a worker never reads it.
    stored = spec.to_dict()["input"]
    assert stored["path"] == [b, a] and "manifest" not in stored
    assert plan(spec, store).records == 60


@pytest.mark.parametrize("content,message", [
    (b"in/a.jsonl\n", r"manifest.txt:1: 'in/a.jsonl' is not an object URL"),
    (b"s3://b/k.jsonl\ns3://b/k.jsonl\n", r"manifest.txt:2: s3://b/k.jsonl is listed again \(first at line 1\)"),
    (b"# nothing\n\n", r"manifest.txt lists no object"),
])
def test_a_bad_manifest_is_refused_with_its_line(tmp_path: Path, content: bytes, message: str) -> None:
    (tmp_path / "manifest.txt").write_bytes(content)
    with pytest.raises(SpecError, match=message):
        object_spec(tmp_path, {"manifest": "manifest.txt"})


@pytest.mark.parametrize("storage,message", [
    ({"secret_access_key": "x"}, r"input.storage.secret_access_key: credentials never go in a spec"),
    ({"aws_session_token": "x"}, r"input.storage.aws_session_token: credentials never go in a spec"),
    ({"endpoint": "http://user:pw@minio:9000"}, r"input.storage.endpoint: an endpoint with a user, password"),
    ({"endpoint": "minio:9000"}, r"must be an http:// or https:// URL"),
    ({"colour": "blue"}, r"input.storage.colour: unknown field"),
    ({"timeout_seconds": 0}, r"input.storage.timeout_seconds: must be a positive number"),
])
def test_storage_options_hold_no_secret(tmp_path: Path, storage: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        object_spec(tmp_path, {"path": "s3://b/k.jsonl", "storage": storage})


def test_storage_options_are_stored_with_the_job_but_are_not_part_of_its_version(tmp_path: Path) -> None:
    plain = object_spec(tmp_path, {"path": "s3://b/k.jsonl"})
    with_endpoint = object_spec(tmp_path, {"path": "s3://b/k.jsonl",
                                           "storage": {"endpoint": "http://minio:9000", "region": "eu-west-1"}})
    assert with_endpoint.to_dict()["input"]["storage"] == {"endpoint": "http://minio:9000", "region": "eu-west-1"}
    assert plain.version("sha256:x") == with_endpoint.version("sha256:x")


# --- formats: CSV and Parquet objects ------------------------------------------------------


def test_a_csv_object_is_read_in_byte_ranges_with_its_header_from_the_same_stream(
        s3_proxy: FaultProxy, lake_env: S3StandIn, store: Store, tmp_path: Path) -> None:
    bucket = lake_env.bucket()
    rows = "".join(f'c{i},"line one\nline two of {i}",g\n' for i in range(120))
    url = bucket.put("in/a.csv", ("id,text,acl\n" + rows).encode())
    spec = object_spec(tmp_path, {"path": url}, size=50)
    s3_proxy.clear()
    version = plan(spec, store).version
    assert [s.method for s in s3_proxy.requests()] == ["HEAD", "GET"]
    s3_proxy.clear()
    records = [r for sl in slices(store, version) for r in read_slice(sl, spec.input)]
    assert [r.id for r in records] == [f"c{i}" for i in range(120)]
    assert records[7].text == "line one\nline two of 7"
    assert len(s3_proxy.requests("GET")) == 3


def byte_spans(gets: list[Any]) -> list[tuple[int, int]]:
    """The byte ranges of ranged GETs, sorted; asserts that none overlaps another."""
    spans = sorted((int(a), int(b)) for a, b in (g.range.removeprefix("bytes=").split("-") for g in gets))
    overlapping = [(x, y) for x, y in pairwise(spans) if y[0] <= x[1]]
    assert not overlapping, f"bytes read twice: {overlapping}"
    return spans


def test_a_parquet_object_is_read_a_row_group_at_a_time_and_no_byte_twice(
        s3_proxy: FaultProxy, lake_env: S3StandIn, store: Store, tmp_path: Path) -> None:
    bucket = lake_env.bucket()
    # Row groups far larger than the footer read, so each is a request of its own.
    data = parquet_bytes(4000, 500)
    url = bucket.put("in/a.parquet", data)
    spec = object_spec(tmp_path, {"path": url}, size=1000)
    s3_proxy.clear()
    version = plan(spec, store).version
    head, footer, *groups = s3_proxy.requests()
    assert head.method == "HEAD" and footer.range is not None and footer.range.endswith(f"-{len(data) - 1}")
    # A GET per row group, except where the footer's 64 KiB already held the group's columns.
    assert 7 <= len(groups) <= 8
    byte_spans([footer, *groups])
    planned = slices(store, version)
    assert [(s.start, s.end) for s in planned] == [(0, 1000), (1000, 2000), (2000, 3000), (3000, 4000)]
    s3_proxy.clear()
    records = read_slice(planned[1], spec.input)
    assert [r.id for r in records] == [f"p{i:05d}" for i in range(1000, 2000)]
    gets = s3_proxy.requests("GET")
    assert len(gets) == 3  # the footer and the slice's two row groups
    byte_spans(gets)
    # Only the columns the job reads: the unread column's bytes are not fetched.
    assert sum(g.body_bytes for g in gets) < len(data) / 4


def test_a_parquet_object_overwritten_after_planning_is_refused_by_key(
        lake_env: S3StandIn, store: Store, tmp_path: Path) -> None:
    bucket = lake_env.bucket()
    url, spec, [first, *_] = planned_object(store, tmp_path, bucket, "in/a.parquet", parquet_bytes(300, 100))
    bucket.put("in/a.parquet", parquet_bytes(300, 100, prefix="q"))
    with pytest.raises(InputError, match=rf"input changed since planning: {url}"):
        read_slice(first, spec.input)


# --- everything that reads the input again ---------------------------------------------------


def test_the_openai_batch_export_and_auto_shard_sizes_read_objects(
        lake_env: S3StandIn, store: Store, tmp_path: Path) -> None:
    bucket = lake_env.bucket()
    url = bucket.put("in/a.jsonl", jsonl(make_records(120)))
    spec = object_spec(tmp_path, {"path": url}, size=100)
    auto = object_spec(tmp_path, {"path": url})
    auto = parse_spec({**auto.to_dict(), "shards": {"size": "auto", "interruptions_per_hour": 0.5,
                                                     "workers": 2, "records_per_second": 50}},
                      base_dir=tmp_path)
    assert plan(auto, store).shards >= 1
    version = plan(spec, store).version
    run_to_seal(store, version)
    out = tmp_path / "out.jsonl"
    done = export_openai_batch(store, version, out, tmp_path / "err.jsonl")
    assert done.responses == 120
    assert [json.loads(line)["custom_id"] for line in out.read_text().splitlines()] == [
        f"r{i:06d}" for i in range(120)]
    # The invariant checks of the acceptance tests scan object locations too.
    assert len(list(scan(url, spec.input))) == 120


# --- the lake's own faults -----------------------------------------------------------------


def test_throttling_a_reset_mid_range_and_a_stall_are_retried(
        s3_proxy: FaultProxy, lake_env: S3StandIn, store: Store, tmp_path: Path) -> None:
    _url, spec, [sl] = planned_object(store, tmp_path, lake_env.bucket(), "in/a.jsonl", jsonl(make_records(100)),
                                      storage={"timeout_seconds": 0.5})
    s3_proxy.clear()
    s3_proxy.throttle(3)
    assert len(read_slice(sl, spec.input)) == 100
    assert [s.status for s in s3_proxy.requests()] == [503, 503, 503, 206]
    s3_proxy.clear()
    s3_proxy.reset_mid_body(1)
    assert len(read_slice(sl, spec.input)) == 100
    assert [s.body_bytes for s in s3_proxy.requests()] == [(sl.end - sl.start) // 2, sl.end - sl.start]
    s3_proxy.clear()
    s3_proxy.stall(1, 2.0)
    assert len(read_slice(sl, spec.input)) == 100


def test_a_reset_in_the_middle_of_planning_resumes_where_the_stream_stopped(
        s3_proxy: FaultProxy, lake_env: S3StandIn, store: Store, tmp_path: Path) -> None:
    bucket = lake_env.bucket()
    data = jsonl(make_records(40_000))
    assert len(data) > 3 * STREAM_CHUNK
    url = bucket.put("in/a.jsonl", data)
    spec = object_spec(tmp_path, {"path": url}, size=5000)
    s3_proxy.clear()
    s3_proxy.reset_mid_body(1)
    assert plan(spec, store).records == 40_000
    first, again = s3_proxy.requests("GET")
    # The stream had handed on chunks of at least 1 MiB before the reset; the second GET
    # starts after the last of them instead of at byte 0.
    assert first.range is None and first.body_bytes == len(data) // 2
    assert again.range is not None
    resumed_at = int(again.range.removeprefix("bytes=").removesuffix("-"))
    assert STREAM_CHUNK <= resumed_at <= len(data) // 2
    assert again.body_bytes == len(data) - resumed_at


def test_a_store_that_stays_unreachable_past_the_bound_raises_source_unavailable(
        s3_proxy: FaultProxy, lake_env: S3StandIn, store: Store, tmp_path: Path) -> None:
    url, spec, [sl] = planned_object(store, tmp_path, lake_env.bucket(), "in/a.jsonl", jsonl(make_records(100)),
                                     storage={"unavailable_seconds": 1.5})
    s3_proxy.throttle(10_000)
    with pytest.raises(SourceUnavailable, match=rf"{url}: the object store did not answer for 1.5s"):
        read_slice(sl, spec.input)
    assert len(s3_proxy.requests()) > 2


# --- GCS ------------------------------------------------------------------------------------


@pytest.fixture
def gcs_env(gcs_standin: GCSStandIn, monkeypatch: pytest.MonkeyPatch) -> GCSStandIn:
    for key, value in gcs_standin.env().items():
        monkeypatch.setenv(key, value)
    return gcs_standin


@pytest.mark.parametrize("versioned", [False, True], ids=["plain", "versioned"])
def test_a_gcs_object_is_pinned_by_generation(gcs_env: GCSStandIn, store: Store, tmp_path: Path,
                                              versioned: bool) -> None:
    bucket = gcs_env.bucket(versioned=versioned)
    data = jsonl(make_records(150))
    url, spec, [first, _] = planned_object(store, tmp_path, bucket, "in/a.jsonl", data)
    assert first.pin is not None and first.pin.version is not None
    assert len(read_slice(first, spec.input)) == 100
    bucket.put("in/a.jsonl", data.replace(b"record number 7 ", b"record number X "))
    if versioned:
        assert len(read_slice(first, spec.input)) == 100
    else:
        with pytest.raises(InputError, match=rf"input changed since planning: {url} \(version .* is gone\)"):
            read_slice(first, spec.input)


def test_a_gcs_glob_lists_the_prefix(gcs_env: GCSStandIn, tmp_path: Path) -> None:
    bucket = gcs_env.bucket()
    for key in ("in/a.jsonl", "in/b.jsonl", "in/c.csv"):
        bucket.put(key, b"")
    assert object_spec(tmp_path, {"path": bucket.url("in/*.jsonl")}).input.locations == (
        bucket.url("in/a.jsonl"), bucket.url("in/b.jsonl"))

