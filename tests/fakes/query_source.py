"""A source with no files that exists only in the tests: the rows of a SQL query over a SQLite
database (`input.query: {database, sql}`), as a warehouse query's would be.

It fills the rows port (`batchline.sources.base.RowSource`) from scratch, in the `rows` way:
planning streams the query's rows in order and pins the database as it was (its size and
digest, as a local file is pinned), and each worker reads its shard's rows again from the
database itself by range (`LIMIT ... OFFSET ...` over the query's own order), checked against
what planning read. It is added to the SOURCES table through `batchline.registry.register`, as
a plug-in outside batchline would be; planning and the workers find it through the registry.

The query must give the columns `id`, `text` and `acl` (a JSON array of groups), in a stable
order (an ORDER BY on a unique key).
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from batchline.acl import Acl
from batchline.registry import SOURCES, Plugin, register, unregister
from batchline.sources.base import (
    DatasetName,
    KeyedFamily,
    Pin,
    RowsNotBytes,
    Snapshot,
    SourceContext,
    StoreDatasets,
    StoredRow,
)
from batchline.spec import ROWS
from batchline.spec.reader import Fields, ParseContext, SpecReader

KEY = "query"


def _file_pin(path: Path) -> Pin:
    data = path.read_bytes()
    return Pin(path.name, len(data), digest="sha256:" + hashlib.sha256(data).hexdigest())


class QueryRows(RowsNotBytes):
    """The query's rows, read from the database."""

    rows_are: ClassVar[str] = "a query's records are rows, not a file"

    def __init__(self, database: Path, sql: str) -> None:
        self.database = database
        self.sql = sql
        self.location = f"query:{database}"

    def _select(self, suffix: str = "", params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with sqlite3.connect(f"file:{self.database}?mode=ro", uri=True) as db:
            return db.execute(f"SELECT id, text, acl FROM ({self.sql}) {suffix}", params).fetchall()

    @staticmethod
    def _row(r: tuple[Any, ...]) -> StoredRow:
        return StoredRow(str(r[0]), r[1], None if r[2] is None else Acl.read(json.loads(r[2])))

    def rows(self) -> Iterator[StoredRow]:
        for r in self._select():
            yield self._row(r)

    def rows_between(self, start: int, end: int) -> Sequence[StoredRow]:
        return [self._row(r) for r in self._select("LIMIT ? OFFSET ?", (end - start, start))]

    # The database file is what the query read: pinned as a local file is.
    def pin(self) -> Pin:
        return _file_pin(self.database)

    def still(self, pin: Pin) -> bool:
        return _file_pin(self.database) == pin


@dataclass(frozen=True)
class QuerySource:
    """`input.query`: the rows of `sql` over the SQLite database at `database`."""

    database: str
    sql: str
    format: str | None = ROWS

    @property
    def locations(self) -> tuple[str, ...]:
        return ()

    def describe(self) -> str:
        return f"the query {self.sql!r} over {self.database}"

    def to_dict(self) -> dict[str, Any]:
        return {KEY: {"database": self.database, "sql": self.sql}}

    def snapshot(self, ctx: SourceContext) -> Snapshot:
        rows = QueryRows(Path(self.database), self.sql)
        pin = rows.pin()
        return Snapshot(self, [rows], [pin], lambda: rows.still(pin))  # type: ignore[list-item]

    def datasets(self, pins: Sequence[Mapping[str, Any]], store: StoreDatasets) -> list[DatasetName]:
        return [DatasetName("sqlite", self.database)]


class QueryFamily(KeyedFamily):
    name: ClassVar[str] = "query"
    keys: ClassVar[Fields] = {KEY: {"type": "object", "additionalProperties": False,
                                    "properties": {"database": {"type": "string"}, "sql": {"type": "string"}},
                                    "description": "The rows of a SQL query over a SQLite database"}}

    def parse(self, key: str, section: Mapping[str, Any], r: SpecReader, ctx: ParseContext) -> QuerySource:
        raw = r.section(section[key], f"input.{key}", {"database": {}, "sql": {}}, required={"database", "sql"})
        database = r.string(raw["database"], f"input.{key}.database")
        return QuerySource(database if ctx.resolved else str((ctx.base_dir / database).resolve()),
                           r.string(raw["sql"], f"input.{key}.sql"))


QUERY = QueryFamily()
ENTRY = Plugin("query", f"{__name__}:QUERY")


def registered() -> None:
    register(SOURCES, ENTRY)


def removed() -> None:
    unregister(SOURCES, ENTRY.name)
