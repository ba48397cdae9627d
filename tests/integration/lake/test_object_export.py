"""Exports to object storage: a published name's Parquet dataset under an s3:// prefix, with
CURRENT replaced by a conditional put, so two exporters cannot interleave."""

from __future__ import annotations

import io
import json
from typing import Any

import pyarrow.parquet as pq
import pytest

from batchline.check.validate import validate
from batchline.errors import BatchlineError
from batchline.lake import lake_settings
from batchline.publish.pointer import publish, rollback
from batchline.spec import JobVersion
from batchline.store import Store
from batchline.targets.parquet import ObjectDataset, version_folder
from tests.helpers import make_records, planned, run_to_seal
from tests.integration.lake.support import S3StandIn
from tests.integration.test_cli import cli


def published(job_factory: Any, store: Store, records: list[dict[str, Any]]) -> tuple[str, str]:
    spec, version = planned(job_factory(records), store)
    run_to_seal(store, version)
    validate(store, version)
    publish(store, version)
    return spec.name, version


def test_export_of_a_published_name_to_s3_writes_the_version_then_current(
        job_factory: Any, store: Store, store_url: str, lake_env: S3StandIn) -> None:
    bucket = lake_env.bucket()
    name, v1 = published(job_factory, store, make_records(30))
    done = cli("export", name, "--store", store_url, "--format", "parquet", "--out", bucket.url("warehouse"))
    assert done.returncode == 0, done.stderr
    part = f"warehouse/{name}/{version_folder(v1)}/part-00000.parquet"
    assert bucket.keys("warehouse/") == sorted([part, f"warehouse/{name}/CURRENT"])
    assert bucket.get(f"warehouse/{name}/CURRENT").decode().strip() == version_folder(v1)
    assert pq.read_table(io.BytesIO(bucket.get(part))).num_rows == 30
    # A second version: its folder is added beside the first, and CURRENT moves.
    _, v2 = published(job_factory, store, make_records(40, "x"))
    assert cli("export", name, "--store", store_url, "--format", "parquet",
               "--out", bucket.url("warehouse/")).returncode == 0
    assert bucket.get(f"warehouse/{name}/CURRENT").decode().strip() == version_folder(v2)
    assert len(bucket.keys("warehouse/")) == 3


def test_a_version_exported_to_an_object_url(job_factory: Any, store: Store, store_url: str,
                                             lake_env: S3StandIn) -> None:
    bucket = lake_env.bucket()
    _spec, version = planned(job_factory(make_records(12)), store)
    run_to_seal(store, version)
    assert cli("export", version, "--store", store_url, "--out", bucket.url("out/r.jsonl")).returncode == 0
    assert len(bucket.get("out/r.jsonl").decode().splitlines()) == 12
    assert cli("export", version, "--store", store_url, "--format", "parquet",
               "--out", bucket.url("out/r.parquet")).returncode == 0
    assert pq.read_table(io.BytesIO(bucket.get("out/r.parquet"))).num_rows == 12
    refused = cli("export", version, "--store", store_url, "--format", "openai-batch", "--out", bucket.url("o.jsonl"))
    assert refused.returncode == 1 and "--out must be a local file" in refused.stderr


class _SlowExporter(ObjectDataset):
    """An exporter that read CURRENT, and then lost the race: another exporter replaced it
    before this one's put."""

    def __init__(self, root: str, other: ObjectDataset, name: str, other_version: str) -> None:
        super().__init__(root, lake_settings())
        self.other, self.name, self.other_version = other, name, other_version

    def _read_current(self, name: str) -> tuple[str | None, Any]:
        seen = super()._read_current(name)
        self.other.show(self.name, self.other_version, None)
        return seen


@pytest.mark.parametrize("versioned", [False, True], ids=["plain", "versioned"])
def test_two_exporters_cannot_interleave_on_current(job_factory: Any, store: Store, lake_env: S3StandIn,
                                                    versioned: bool) -> None:
    bucket = lake_env.bucket(versioned=versioned)
    root = bucket.url("warehouse")
    name, v1 = published(job_factory, store, make_records(10))
    _, v2 = published(job_factory, store, make_records(11, "y"))
    first = ObjectDataset(root, lake_settings())
    for v in (v1, v2):
        first.stage(store, JobVersion.of(store, v))
    # Absent CURRENT: If-None-Match. The other exporter creates it first; this one is refused.
    with pytest.raises(BatchlineError, match=rf"{root}/{name}/CURRENT changed while this export replaced it"):
        _SlowExporter(root, first, name, v1).show(name, v2, None)
    assert first.current(name) == version_folder(v1)
    # Present CURRENT: If-Match on its ETag (and version). The other exporter wins again.
    first.show(name, v2, None)
    with pytest.raises(BatchlineError, match="it now names"):
        _SlowExporter(root, first, name, v1).show(name, v2, None)
    assert first.current(name) == version_folder(v1)


def test_publication_to_an_object_dataset_follows_the_pointer_and_forgets_pruned_versions(
        job_factory: Any, store: Store, lake_env: S3StandIn) -> None:
    bucket = lake_env.bucket()
    dataset = ObjectDataset(bucket.url("lake"), lake_settings())
    spec, v1 = planned(job_factory(make_records(20), retention={"versions": 2}), store)
    versions = [v1]
    for i in range(2):
        _, v = planned(job_factory(make_records(21 + i, f"z{i}"), retention={"versions": 2}), store)
        versions.append(v)
    for v in versions:
        run_to_seal(store, v)
        validate(store, v)
        publish(store, v, targets=[dataset])
        assert dataset.current(spec.name) == version_folder(v)
    assert rollback(store, spec.name, targets=[dataset]) == (versions[2], versions[1])
    assert dataset.current(spec.name) == version_folder(versions[1])
    folders = {k.split("/")[2] for k in bucket.keys(f"lake/{spec.name}/") if k.endswith(".parquet")}
    assert version_folder(versions[0]) not in folders
    assert json.loads(json.dumps(store.publications(spec.name)[-1].targets)) == {
        dataset.key: {"current": version_folder(versions[1])}}
