"""What changed between two versions, read by keys: the rules of the `VersionChanges` port.

Three readers need it, each by the store's keys and never by scanning a target:

- a search of an index over a published job checks its candidates against the ACLs
  the upstream's current publication holds (`result_acls`, one keyed read per batch);
- `status` and `search --json` say by how many records an index is behind its
  upstream (`result_changes` between the version it was planned on and the one
  published now);
- `batchline changes` and `plan --dry-run` say which records an incremental version
  infers, carries or drops against its base (`record_changes`, `removed_records`,
  `base_hashes`).

Mixed into `StoreCore`; the SQL is each backend's (the same statement names).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from batchline.acl import Acl
from batchline.store.base import Row, StoreBase, Tx
from batchline.store.model import ResultChanges

# The kinds of a planned record against its base: new, its text (or class) changed, its
# ACL alone changed, unchanged.
RECORD_KINDS = ("new", "text", "acl", "unchanged")


@dataclass(frozen=True)
class BaseRecord:
    """A base version's record, as an incremental plan of it would compare with."""

    content_hash: str
    text_hash: str  # its content hash where it has no ACL
    answered: bool  # the base has a result for it (a dead letter is inferred again)


def record_kind(base: BaseRecord | None, content_hash: str, text_hash: str | None) -> str:
    """The kind of a record whose hashes are these, against its base's record (None: new):
    the rule `RECORD_CHANGES_PAGE` states in SQL, for a record not planned yet."""
    if base is None:
        return "new"
    if base.content_hash == content_hash:
        return "unchanged"
    return "acl" if base.text_hash == (text_hash or content_hash) else "text"


class VersionChanges(StoreBase):
    """Keyed reads of what differs between two versions of the store."""

    def result_acls(self, version: str, record_ids: Sequence[str]) -> dict[str, Acl | None]:
        """Each result's ACL, by record id, for those of `record_ids` the version has a result for."""
        return {str(r[0]): Acl.from_json(r[1]) for r in self._by_ids(self.q.RESULT_ACLS, version, record_ids)}

    def result_changes(self, old: str, new: str) -> ResultChanges:
        """How the results of `new` differ from those of `old`: records it has that `old` has
        not, records both have whose result (the version that computed it) or ACL differ,
        and records of `old` it has not."""
        p = {"old": old, "new": new}
        row = self._row(self.q.RESULT_CHANGES, p)
        removed = self._row(self.q.RESULTS_REMOVED, p)
        return ResultChanges(int(row[0] or 0), int(row[1] or 0), int(removed[0] or 0))

    def result_rows_changed(self, old: str, new: str, page_size: int = 20_000) -> Iterator[str]:
        """The records whose result row in `new` differs from `old`'s (new records, results
        computed again, another ACL or other carried values), in id order."""
        for r in self._keyset(self.q.RESULT_ROWS_CHANGED_PAGE, {"old": old, "new": new}, page_size):
            yield str(r[0])

    def result_rows_removed(self, old: str, new: str, page_size: int = 20_000) -> Iterator[str]:
        """The records `old` has a result for and `new` has none, in id order."""
        for r in self._keyset(self.q.RESULT_ROWS_REMOVED_PAGE, {"old": old, "new": new}, page_size):
            yield str(r[0])

    def _keyset(self, stmt: str, params: Mapping[str, Any], page_size: int) -> Iterator[Row]:
        last = ""
        while True:
            page = {**params, "after": last, "n": page_size}
            rows: list[Row] = self._read(functools.partial(_all, stmt=stmt, params=page))
            if not rows:
                return
            yield from rows
            last = rows[-1][0]

    def record_changes(self, version: str, base: str, page_size: int = 20_000) -> Iterator[tuple[str, str]]:
        """Each planned record of `version` in id order, with its kind against `base` (RECORD_KINDS)."""
        for r in self._keyset(self.q.RECORD_CHANGES_PAGE, {"v": version, "base": base}, page_size):
            yield str(r[0]), str(r[1])

    def removed_records(self, version: str, base: str, page_size: int = 20_000) -> Iterator[str]:
        """The records of `base` that `version` does not plan, in id order."""
        for r in self._keyset(self.q.RECORDS_REMOVED_PAGE, {"v": version, "base": base}, page_size):
            yield str(r[0])

    def base_hashes(self, base: str, record_ids: Sequence[str]) -> dict[str, BaseRecord]:
        """The base's planned records among `record_ids`, as a plan against it compares them."""
        return {str(r[0]): BaseRecord(str(r[1]), str(r[2] or r[1]), bool(r[3]))
                for r in self._by_ids(self.q.BASE_HASHES, base, record_ids)}

    def record_total(self, version: str) -> int:
        """The version's planned records."""
        row = self._row(self.q.COUNT_RECORDS, {"v": version})
        return int(row[0])


def _all(tx: Tx, *, stmt: str, params: Mapping[str, Any]) -> list[Row]:
    return tx.all(stmt, params)
