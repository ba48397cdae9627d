"""A snapshot's records in input order, with the ids planning gives them.

With ids from content (`input.ids: content`) a row's id is a digest of the row, so two
identical rows would share one: `Occurrences` numbers the second `~2`, the third `~3`, in
the order planning reads them. Planning numbers them so, and every later reader in input
order (an export in the input's order, a check of coverage) reads them through
`snapshot_records`, which numbers them the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

from batchline.snapshot.reading import Record, ScannedRecord, input_sources, scan
from batchline.sources import Source
from batchline.spec import JobSpec

RENUMBERED = "~"  # content id ~ occurrence: a row identical to an earlier one


def snapshot_records(spec: JobSpec, store_url: str | None = None,
                     sources: list[Source] | None = None) -> Iterator[Record]:
    """Every record of the snapshot in input order, with the ids the planner gives them
    (ids from content numbered as planning numbers them): what an export in input order
    and a check of coverage read."""
    occurrences = Occurrences() if spec.input.ids == "content" else None
    for source in input_sources(spec.input, store_url) if sources is None else sources:
        pending: list[ScannedRecord] = []
        for scanned in scan(source, spec.input):
            pending.append(scanned)
            if len(pending) == 5000:
                yield from (s.record for s in (occurrences.number(pending) if occurrences else pending))
                pending = []
        yield from (s.record for s in (occurrences.number(pending) if occurrences and pending else pending))


class Occurrences:
    """Numbers rows identical to an earlier row of the snapshot (ids from content): the
    second gets `~2`, the third `~3`. Counted in a scratch SQLite file, so planning's
    memory does not grow with the snapshot."""

    def __init__(self) -> None:
        import sqlite3
        import tempfile

        self._dir = tempfile.TemporaryDirectory(prefix="batchline-ids-")
        self.db = sqlite3.connect(f"{self._dir.name}/seen.db", isolation_level=None)
        self.db.execute("PRAGMA journal_mode = OFF")
        self.db.execute("CREATE TABLE seen (id TEXT PRIMARY KEY, n INTEGER NOT NULL) WITHOUT ROWID")

    def number(self, chunk: list[ScannedRecord]) -> list[ScannedRecord]:
        ids = sorted({s.record.id for s in chunk})
        counts: dict[str, int] = {}
        for i in range(0, len(ids), 500):
            part = ids[i:i + 500]
            counts.update(self.db.execute(
                f"SELECT id, n FROM seen WHERE id IN ({','.join('?' * len(part))})", part).fetchall())
        out = []
        for s in chunk:
            n = counts.get(s.record.id, 0) + 1
            counts[s.record.id] = n
            out.append(s if n == 1 else replace(s, record=replace(s.record, id=f"{s.record.id}{RENUMBERED}{n}")))
        self.db.execute("BEGIN")
        self.db.executemany("INSERT INTO seen (id, n) VALUES (?, ?) ON CONFLICT (id) DO UPDATE SET n = excluded.n",
                            [(i, counts[i]) for i in ids])
        self.db.execute("COMMIT")
        return out
