"""Weights in object storage: fetched once per node into a cache keyed by their digest,
verified before they are renamed into place, shared by the node's workers."""

from __future__ import annotations

import hashlib
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest

from batchline.digests import sha256_tree
from batchline.errors import EngineFatal, SpecError
from batchline.spec import parse_spec
from batchline.worker import weights
from batchline.worker.weights import fetch_weights, local_weights
from tests.integration.lake.support import FaultProxy, S3StandIn

WEIGHTS = bytes(range(256)) * 5000  # 1.28 MB: more than one streamed chunk


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("BATCHLINE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_weights_are_fetched_once_per_node_and_kept_under_their_digest(
        cache: Path, s3_proxy: FaultProxy, lake_env: S3StandIn) -> None:
    url = lake_env.bucket().put("models/tiny.gguf", WEIGHTS)
    digest = digest_of(WEIGHTS)
    s3_proxy.clear()
    # The node's workers ask at once: one downloads, the others wait and find it in place.
    paths: list[str | None] = []
    threads = [threading.Thread(target=lambda: paths.append(local_weights(url, digest))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected = cache / "weights" / digest.removeprefix("sha256:") / "tiny.gguf"
    assert paths == [str(expected)] * 4
    assert expected.read_bytes() == WEIGHTS
    assert len(s3_proxy.requests("GET")) == 1
    s3_proxy.clear()
    assert fetch_weights(url, digest) == expected
    assert s3_proxy.requests() == []


def test_weights_that_do_not_match_their_digest_are_never_kept(cache: Path, lake_env: S3StandIn) -> None:
    url = lake_env.bucket().put("models/tiny.gguf", WEIGHTS[:-1] + b"\0")
    with pytest.raises(EngineFatal, match=rf"digest mismatch for {url}: spec says {digest_of(WEIGHTS)}"):
        fetch_weights(url, digest_of(WEIGHTS))
    folder = cache / "weights" / digest_of(WEIGHTS).removeprefix("sha256:")
    assert [p.name for p in folder.iterdir()] == [".lock"]


def test_an_interrupted_download_is_never_loaded_and_the_next_fetch_starts_again(
        cache: Path, lake_env: S3StandIn, monkeypatch: pytest.MonkeyPatch) -> None:
    url = lake_env.bucket().put("models/tiny.gguf", WEIGHTS)
    real = shutil.copyfileobj

    def dies_half_way(src: Any, dst: Any, length: int = 0) -> None:
        dst.write(src.read(len(WEIGHTS) // 2))
        raise KeyboardInterrupt  # the worker is killed mid-download

    monkeypatch.setattr(weights.shutil, "copyfileobj", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        fetch_weights(url, digest_of(WEIGHTS))
    folder = cache / "weights" / digest_of(WEIGHTS).removeprefix("sha256:")
    assert not (folder / "tiny.gguf").exists()
    monkeypatch.setattr(weights.shutil, "copyfileobj", real)
    assert fetch_weights(url, digest_of(WEIGHTS)).read_bytes() == WEIGHTS


def test_a_model_that_is_a_folder_of_objects_has_the_digest_of_the_folder(
        cache: Path, lake_env: S3StandIn, tmp_path: Path) -> None:
    bucket = lake_env.bucket()
    local = tmp_path / "model"
    (local / "tokenizer").mkdir(parents=True)
    (local / "config.json").write_text("{}")
    (local / "tokenizer" / "vocab.txt").write_text("a\nb\n")
    for f in sorted(p for p in local.rglob("*") if p.is_file()):
        bucket.put_file(f"models/m1/{f.relative_to(local).as_posix()}", f)
    digest = "sha256:" + sha256_tree(local)
    fetched = fetch_weights(bucket.url("models/m1/"), digest)
    assert fetched.name == "m1" and sha256_tree(fetched) == digest.removeprefix("sha256:")
    assert (fetched / "tokenizer" / "vocab.txt").read_text() == "a\nb\n"


def test_weights_in_object_storage_need_a_digest(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"model.digest: is required when model.path is an object"):
        parse_spec({"name": "x", "input": {"path": "s3://b/in.jsonl"},
                    "model": {"engine": "llamacpp", "path": "s3://b/models/m.gguf"},
                    "prompt": {"text": "x", "version": "v1"}, "output": {"schema": {"type": "object"}}},
                    base_dir=tmp_path)
