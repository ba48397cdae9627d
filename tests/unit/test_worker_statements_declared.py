"""Every statement a worker runs on PostgreSQL declares the access it needs, and
`batchline grants` gives exactly the union: a statement that writes a column its
declaration does not name fails here, before any worker meets `permission denied`."""

from __future__ import annotations

import re

from batchline.ops.grants import worker_rights
from batchline.store import postgres_sql as q

IDENT = r'"?([a-z_][a-z0-9_]*)"?'


def _top_level_split(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def updated_columns(sql: str) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for m in re.finditer(rf"UPDATE\s+{IDENT}(?:\s+[a-z]\b)?\s+SET\s+(.*?)(?=\bFROM\b|\bWHERE\b|\bRETURNING\b|$)",
                         sql, re.S | re.I):
        columns = {part.split("=", 1)[0].strip().strip('"') for part in _top_level_split(m.group(2))}
        out.setdefault(m.group(1), set()).update(columns)
    return out


def inserted_tables(sql: str) -> set[str]:
    return set(re.findall(rf"INSERT\s+INTO\s+{IDENT}", sql, re.I))


def read_tables(sql: str) -> set[str]:
    tables = set(re.findall(rf"\b(?:FROM|JOIN)\s+{IDENT}", sql, re.I)) | set(updated_columns(sql))
    if "batchline_now()" in sql:
        tables.add("clock")  # the clock is read through the function
    # Names a statement defines for itself (CTEs, unnest aliases) are not tables.
    defined = set(re.findall(rf"\b{IDENT}\s+AS\s*\(", sql, re.I)) | {"unnest", "put_stage", "fence", "ins"}
    return tables - defined


def test_every_worker_statement_declares_what_it_writes_and_reads() -> None:
    statements = q.worker_statements()
    assert {"GRANT_SHARD", "RENEW", "RELEASE", "PUT_RESULTS", "PUT_FROM_STAGE", "INSERT_DEAD", "CHARGE",
            "SEAL", "SET_BATCH", "AWAIT_PROVIDER", "FINISH_SHARD", "INSERT_EVENT"} <= set(statements)
    for name, statement in statements.items():
        declared_updates: dict[str, set[str]] = {}
        for a in statement.access:
            if a.privilege == "UPDATE":
                declared_updates.setdefault(a.table, set()).update(a.columns)
        declared_inserts = {a.table for a in statement.access if a.privilege == "INSERT"}
        declared_reads = {a.table for a in statement.access if a.privilege == "SELECT"}
        for table, columns in updated_columns(statement).items():
            assert columns <= declared_updates.get(table, set()), (
                f"{name} updates {sorted(columns - declared_updates.get(table, set()))} of {table}, undeclared")
        assert inserted_tables(statement) <= declared_inserts, f"{name} inserts into undeclared tables"
        assert read_tables(statement) <= declared_reads, (
            f"{name} reads {sorted(read_tables(statement) - declared_reads)}, undeclared")


def test_the_worker_role_is_the_union_of_the_declarations() -> None:
    rights = {(r.table, r.privilege): set(r.columns) for r in worker_rights()}
    for statement in q.worker_statements().values():
        for a in statement.access:
            assert set(a.columns) <= rights[(a.table, a.privilege)]
    # What publication and planning need is never among them: a worker reads the planned
    # records (where the store holds its input) and never writes one.
    assert not {t for t, _ in rights} & {"pointers", "publications", "validations"}
    assert {p for t, p in rights if t == "records"} == {"SELECT"}
    assert ("results", "UPDATE") not in rights and ("jobs", "INSERT") not in rights


def test_the_parser_sees_a_column_a_declaration_misses() -> None:
    # The check above can fail: a statement writing `batch` declared without it is caught.
    statement = q.WorkerStatement("UPDATE shards SET state = 'ready', batch = NULL WHERE version = %(v)s",
                                  q.updates("shards", "state"), *q.reads("shards"))
    assert updated_columns(statement) == {"shards": {"state", "batch"}}
    assert not updated_columns(statement)["shards"] <= {"state"}
