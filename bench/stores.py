"""A new, empty store for one benchmark run: a SQLite file in the run's folder, or a database
of its own on the PostgreSQL at 127.0.0.1:5432 (trust auth, user postgres), dropped after."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path

PG_ADMIN = "postgresql://postgres@127.0.0.1:5432"


@contextlib.contextmanager
def new_store(kind: str, folder: Path, prefix: str = "bench") -> Iterator[str]:
    """The store's URL: `kind` is sqlite or postgres."""
    if kind == "sqlite":
        yield f"sqlite:///{folder / 'store.db'}"
        return
    import psycopg

    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(f"{PG_ADMIN}/postgres", autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{PG_ADMIN}/{name}"
    finally:
        with psycopg.connect(f"{PG_ADMIN}/postgres", autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
