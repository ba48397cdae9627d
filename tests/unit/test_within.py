"""A shard covers a record's piece by one rule (`within`), which PostgreSQL's put states as SQL
(`within_sql`): the two agree on every case, a shard without pieces and a row without one included."""

from __future__ import annotations

import itertools
import sqlite3

from batchline.store.model import within, within_sql


def test_the_sql_form_of_within_agrees_with_it_on_every_case() -> None:
    values = (None, 0, 1, 2, 3)
    cases = list(itertools.product(values, values, values))
    predicate = within_sql(":piece", ":first", ":end")
    with sqlite3.connect(":memory:") as conn:
        said = [bool(conn.execute(f"SELECT COALESCE({predicate}, 0)", {"piece": piece, "first": first,
                                                                      "end": end}).fetchone()[0])
                for piece, first, end in cases]
    assert said == [within(piece, first, end) for piece, first, end in cases]
    assert within(None, 0, 2) is False and within(None, None, None) is True
