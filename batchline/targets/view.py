"""The store's own view of a published name: always there, named by no key of the spec.

`publish` moves the store's pointer, and the view that reads through it (PostgreSQL:
`published.NAME`; SQLite: a view named NAME) shows the new version in the same
transaction: the store is the truth every other target follows, so this family has no
section to parse, nothing to stage and no target to build. It is in the TARGETS table
so that every place readers look is a member of it, and what it needs is said here:
the worker needs nothing of it (the publisher's connection makes it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from batchline.errors import SpecError
from batchline.targets.base import TargetFamily, TargetSpec

if TYPE_CHECKING:
    from batchline.spec.reader import Fields, ParseContext, SpecReader


class StoreView(TargetFamily):
    name = "view"
    keys: ClassVar[Fields] = {}

    def parse(self, key: str, section: Mapping[str, Any], r: SpecReader, ctx: ParseContext) -> TargetSpec:
        raise SpecError(f"output.{key}: the store's view is always published; it takes no section")


VIEW = StoreView()
