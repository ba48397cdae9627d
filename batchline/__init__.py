"""batchline: offline LLM jobs that answer every record exactly once.

The Python API is `batchline.Jobs` (see `batchline.api`), loaded on first use so
that `import batchline` stays as cheap as the errors it names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from batchline.errors import (
    BatchlineError,
    EngineFatal,
    InputError,
    SpecError,
    StoreError,
    VersionHalted,
)
from batchline.version import __version__

if TYPE_CHECKING:
    from batchline.api import ExportResult, JobListing, Jobs, RunResult

__all__ = [
    "BatchlineError", "EngineFatal", "ExportResult", "InputError", "JobListing", "Jobs", "RunResult", "SpecError",
    "StoreError", "VersionHalted", "__version__",
]

_API = frozenset({"ExportResult", "JobListing", "Jobs", "RunResult"})


def __getattr__(name: str) -> Any:
    if name in _API:
        from batchline import api

        return getattr(api, name)
    raise AttributeError(f"module 'batchline' has no attribute {name!r}")
