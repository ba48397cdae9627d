"""Content digests: files, directories of weights, and streams of bytes; and the seeded
choice of a sample by the digests of its ids.

A multi-file model (a directory) has the digest sha256 over the lines
``<sha256 of file>  <path relative to the directory>\\n`` for every regular file,
sorted by relative path (the format ``sha256sum`` prints), so it can be
reproduced with ``find . -type f | sort | xargs sha256sum | sha256sum``
run from inside the directory (paths without the leading ``./``).
"""

from __future__ import annotations

import hashlib
import heapq
import os
from collections.abc import Iterable
from pathlib import Path

from batchline.errors import EngineFatal


def cache_dir() -> Path:
    """The node's cache, where weights are kept under their digest (`$BATCHLINE_CACHE_DIR`,
    else ~/.cache/batchline)."""
    base = os.environ.get("BATCHLINE_CACHE_DIR")
    return Path(base) if base else Path.home() / ".cache" / "batchline"

_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def sha256_tree(path: Path) -> str:
    """Digest of a file, or of a directory as described in the module docstring."""
    if path.is_file():
        return sha256_file(path)
    lines = []
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        lines.append(f"{sha256_file(file)}  {file.relative_to(path).as_posix()}\n")
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def verify_weights(path: Path, expected: str | None) -> str:
    """Checks weights against the spec's ``sha256:<hex>`` digest; returns the actual digest.

    An absent expectation is refused: a job version must pin its weights.
    """
    if not path.exists():
        raise EngineFatal(f"model weights not found: {path}")
    actual = "sha256:" + sha256_tree(path)
    if expected is None:
        raise EngineFatal(f"model.digest is required; the weights at {path} have {actual}")
    if actual != expected.lower():
        raise EngineFatal(
            f"model weights digest mismatch for {path}: spec says {expected}, file has {actual}"
        )
    return actual


def choose(ids: Iterable[str], sample: int, seed: int) -> list[str]:
    """`sample` ids chosen at random by `seed`: those whose seeded SHA-256 is smallest, so the
    choice is the same from any order of the ids, and a larger sample holds a smaller one.
    Only the sample is held, so `ids` may stream a version's every result."""
    def rank(record_id: str) -> bytes:
        return hashlib.sha256(f"{seed}\0{record_id}".encode()).digest()

    return [i for _r, i in heapq.nsmallest(sample, ((rank(i), i) for i in ids))]
