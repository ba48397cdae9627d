"""Which batchline a process runs: its version and a digest of its source.

The supervisor sends its own in the engine child's init and the child refuses
to serve under another, so a worker whose child would run a different
batchline (another interpreter's, or a checkout changed under a long-running
worker) stops with one line instead of mixing code inside a job version.
"""

from __future__ import annotations

import functools
import hashlib
from importlib import metadata
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parents[1]


@functools.cache
def batchline_build() -> str:
    """`VERSION+SOURCE_DIGEST`: the digest covers every module's path and bytes."""
    digest = hashlib.sha256()
    for path in sorted(_PACKAGE.rglob("*.py")):
        digest.update(str(path.relative_to(_PACKAGE)).encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    try:
        version = metadata.version("batchline")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return f"{version}+{digest.hexdigest()[:12]}"
