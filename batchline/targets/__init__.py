"""Publication targets: the families of the TARGETS table (batchline.registry), each owning
keys of a job's `output` section (see `base`). A job may name several; `targets_for`
builds a version's targets from its stored spec."""

from __future__ import annotations

from typing import TYPE_CHECKING

import batchline.registry as registry
from batchline.registry import TARGETS
from batchline.targets.base import PublicationTarget, TargetFamily, TargetSpec

if TYPE_CHECKING:
    from batchline.spec.model import JobSpec

__all__ = ["PublicationTarget", "TargetFamily", "TargetSpec", "families", "keyed_families", "targets_for"]


def families() -> list[TargetFamily]:
    return registry.loaded(TARGETS)


def keyed_families() -> dict[str, TargetFamily]:
    """Each output key a family owns, and the family."""
    return registry.keyed(TARGETS)


def targets_for(spec: JobSpec, store_url: str | None) -> list[PublicationTarget]:
    """The targets a version's spec names, in the order it names them; a catalog in the
    store's database is reached through `store_url`, object storage with `input.storage`."""
    return [t.target(store_url, spec.input.storage) for t in spec.targets]
