"""`batchline grants` prints the read access a worker needs for objects: one policy per bucket
and kind, over the folders the objects share, whatever glob or manifest named them."""

from __future__ import annotations

import json
from pathlib import Path

from batchline.ops.grants import snapshot_access
from batchline.spec import parse_spec
from tests.helpers import make_records
from tests.integration.lake.support import S3StandIn


def policy(line: str) -> dict[str, object]:
    return dict(json.loads(line[line.index("{"):]))


def test_globbed_inputs_and_weights_in_s3_get_one_read_only_policy_each(lake_env: S3StandIn, tmp_path: Path) -> None:
    bucket = lake_env.bucket()
    for day in (1, 2):
        bucket.put(f"in/day={day}/a.jsonl", b"".join(json.dumps(r).encode() + b"\n" for r in make_records(2)))
    spec = parse_spec({"name": "x", "input": {"path": bucket.url("in/*/a.jsonl")},
                       "model": {"engine": "llamacpp", "path": bucket.url("models/llama/"), "digest": "sha256:" + "0" * 64},
                       "prompt": {"text": "x", "version": "v1"}, "output": {"schema": {"type": "object"}}},
                      base_dir=tmp_path)
    inputs, weights = snapshot_access(spec.to_dict())
    assert inputs.startswith(f"input snapshot, 2 objects at s3://{bucket.name}/in/*:")
    assert policy(inputs)["Statement"] == [{"Effect": "Allow", "Action": ["s3:GetObject", "s3:GetObjectVersion"],
                                            "Resource": [f"arn:aws:s3:::{bucket.name}/in/*"]}]
    # A model that is a folder is listed to be fetched, under its own prefix only.
    assert weights.startswith(f"model weights, a folder of objects at s3://{bucket.name}/models/llama/*:")
    listing = policy(weights)["Statement"][1]  # type: ignore[index]
    assert listing["Action"] == ["s3:ListBucket"]
    assert listing["Condition"] == {"StringLike": {"s3:prefix": ["models/llama/*"]}}


def test_one_object_is_granted_exactly_and_gcs_gets_a_condition() -> None:
    [s3, gcs] = snapshot_access({"input": {"path": ["s3://b/in/a.jsonl", "gs://g/x/y.csv", "gs://g/x/z/w.csv"]}})
    assert policy(s3)["Statement"][0]["Resource"] == ["arn:aws:s3:::b/in/a.jsonl"]  # type: ignore[index]
    assert gcs.endswith('resource.name.startsWith("projects/_/buckets/g/objects/x/")')
    [single] = snapshot_access({"input": {"path": "gs://g/x/y.csv"}})
    assert single.endswith('resource.name == "projects/_/buckets/g/objects/x/y.csv"')
