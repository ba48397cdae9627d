"""Weights in object storage, and the node's cache they are kept in.

A spec's ``model.path`` may be an object URL (``s3://`` or ``gs://``; one object,
or a prefix ending in ``/`` for a model that is a directory), with
``model.digest`` required. The worker's supervisor fetches it once per node,
before it claims a shard, into the cache (``$BATCHLINE_CACHE_DIR``, else
``~/.cache/batchline``) under ``weights/<digest>/``, and hands the engine the
local copy, which the engine verifies on load as it verifies any weights.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from batchline.digests import cache_dir
from batchline.errors import EngineFatal, InputError
from batchline.sources import download, is_remote


def local_weights(path: str | None, digest: str | None, storage: Mapping[str, Any] | None = None) -> str | None:
    """The path an engine loads: `path` itself, or for an object URL the node's cached copy
    of it (fetched first if this node has none)."""
    if path is None or path.startswith("pkg:") or not is_remote(path):
        return path
    if digest is None:
        raise EngineFatal(f"model.digest is required for weights in object storage ({path})")
    return str(fetch_weights(path, digest, storage))


@contextlib.contextmanager
def _node_lock(folder: Path) -> Iterator[None]:
    """One download per node: the node's other workers wait for it, then find it in place."""
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / ".lock").open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def fetch_weights(url: str, digest: str, storage: Mapping[str, Any] | None = None) -> Path:
    """The weights at `url` in ``cache_dir()/weights/<digest>/``: downloaded beside their place,
    checked against `digest`, and only then renamed into place, so a download that was
    interrupted or corrupted is never loaded; what is in place was verified."""
    folder = cache_dir() / "weights" / digest.removeprefix("sha256:")
    name = PurePosixPath(url.rstrip("/")).name
    target = folder / name
    if target.exists():
        return target
    with _node_lock(folder):
        if target.exists():
            return target
        scratch = Path(tempfile.mkdtemp(prefix=".fetch-", dir=folder))
        try:
            try:
                local = download(url, scratch / name, storage)
            except InputError as exc:
                raise EngineFatal(f"model weights: {exc}") from None
            from batchline.digests import sha256_tree

            actual = "sha256:" + sha256_tree(local)
            if actual != digest.lower():
                raise EngineFatal(f"model weights digest mismatch for {url}: spec says {digest}, the object "
                                  f"has {actual}; nothing was kept")
            os.replace(local, target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return target
