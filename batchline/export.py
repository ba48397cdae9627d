"""Exports of a version's results: JSONL and Parquet, each row with its record's ACL.

Files are written beside their destination and renamed into place, so a
reader never sees a partial export.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from batchline.errors import BatchlineError
from batchline.store import Store, StoredResult

PARQUET_ROWS_PER_GROUP = 50_000


def _rows(store: Store, version: str) -> Iterator[StoredResult]:
    return store.iter_results(version)


def export_jsonl(store: Store, version: str, out: Path | None) -> int:
    def write(f: Any) -> int:
        n = 0
        for r in _rows(store, version):
            f.write(json.dumps({"id": r.record_id, "output": json.loads(r.output), "acl": r.acl},
                               ensure_ascii=False) + "\n")
            n += 1
        return n

    if out is None:
        return write(sys.stdout)
    def write_file(tmp: Path) -> int:
        with tmp.open("w", encoding="utf-8") as f:
            return write(f)

    return _atomic(out, write_file)


def export_parquet(store: Store, version: str, out: Path) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([
        ("id", pa.string()), ("output", pa.string()), ("acl", pa.string()), ("label", pa.string()),
        ("version", pa.string()),
        ("worker", pa.string()), ("attempt", pa.int32()), ("input_tokens", pa.int64()),
        ("output_tokens", pa.int64()), ("created_at", pa.timestamp("ms", tz="UTC")),
    ])

    def write(tmp: Path) -> int:
        n = 0
        with pq.ParquetWriter(tmp, schema) as writer:
            batch: list[StoredResult] = []
            for r in _rows(store, version):
                batch.append(r)
                if len(batch) == PARQUET_ROWS_PER_GROUP:
                    writer.write_table(_table(pa, schema, batch, version))
                    n += len(batch)
                    batch = []
            if batch or n == 0:
                writer.write_table(_table(pa, schema, batch, version))
                n += len(batch)
        return n

    return _atomic(out, write)


def export_dataset(store: Store, name: str, root: Path) -> tuple[str, Path]:
    """The warehouse layout: one Parquet dataset per version of a published name,
    and a CURRENT file naming the published one, replaced atomically.

        root/NAME/VERSION/part-00000.parquet
        root/NAME/CURRENT            (contains VERSION)

    A consumer that reads CURRENT and then the folder it names always sees one
    whole version: a version's folder is complete before it is renamed into
    place, and CURRENT is flipped only after that."""
    version = store.resolve_name(name)
    if version is None:
        raise BatchlineError(f"nothing is published under {name!r} in {store.url}")
    base = root / name
    folder = base / version.replace("@", "-")
    if not folder.exists():
        base.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=base))
        try:
            export_parquet(store, version, staging / "part-00000.parquet")
            os.replace(staging, folder)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    _atomic(base / "CURRENT", lambda tmp: tmp.write_text(folder.name + "\n"))
    return version, folder


def _table(pa: Any, schema: Any, rows: list[StoredResult], version: str) -> Any:
    return pa.Table.from_pydict({
        "id": [r.record_id for r in rows],
        "output": [r.output for r in rows],
        "acl": [None if r.acl is None else json.dumps(r.acl, sort_keys=True) for r in rows],
        "label": [r.label for r in rows],
        "version": [version] * len(rows),
        "worker": [r.worker for r in rows],
        "attempt": [r.attempt for r in rows],
        "input_tokens": [r.input_tokens for r in rows],
        "output_tokens": [r.output_tokens for r in rows],
        "created_at": [int(r.created_at * 1000) for r in rows],
    }, schema=schema)


def _atomic(out: Path, write: Any) -> int:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        n = int(write(tmp))
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return n
