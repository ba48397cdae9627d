"""Exports of a version's results: JSONL and Parquet, each row with its record's ACL;
and OpenAI's batch output and error files.

Files are written beside their destination and renamed into place, so a
reader never sees a partial export.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchline.errors import BatchlineError, InputError
from batchline.store import JobInfo, ReaderStore, StoredResult

PARQUET_ROWS_PER_GROUP = 50_000


def _rows(store: ReaderStore, version: str) -> Iterator[StoredResult]:
    return store.iter_results(version)


def finished(store: ReaderStore, version: str, partial: bool) -> JobInfo:
    """The version to export: sealed, or with `partial` any version (a half-done job is
    exported only when asked for by name: a reader of a file cannot tell it is half)."""
    info = store.job(version)
    if info is None:
        raise BatchlineError(f"no job version {version!r} in {store.url}")
    if info.state != "sealed" and not partial:
        st = store.status(version)
        raise BatchlineError(f"{version} is not finished ({st.results + st.dead_letters:,} of {st.records:,} "
                             "records have an outcome): export it once it is sealed, or pass --partial to "
                             "write the outcomes there are")
    return info


def export_jsonl(store: ReaderStore, version: str, out: Path | None) -> int:
    def write(f: Any) -> int:
        n = 0
        for r in _rows(store, version):
            f.write(json.dumps({"id": r.record_id, "output": json.loads(r.output), "acl": r.acl,
                                "model": r.model}, ensure_ascii=False) + "\n")
            n += 1
        return n

    if out is None:
        return write(sys.stdout)
    def write_file(tmp: Path) -> int:
        with tmp.open("w", encoding="utf-8") as f:
            return write(f)

    return atomic_write(out, write_file)


def export_parquet(store: ReaderStore, version: str, out: Path) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([
        ("id", pa.string()), ("output", pa.string()), ("acl", pa.string()), ("label", pa.string()),
        ("version", pa.string()),
        ("worker", pa.string()), ("attempt", pa.int32()), ("input_tokens", pa.int64()),
        ("output_tokens", pa.int64()), ("created_at", pa.timestamp("ms", tz="UTC")), ("model", pa.string()),
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

    return atomic_write(out, write)


def export_dataset(store: ReaderStore, name: str, root: Path | str) -> tuple[str, str]:
    """The published version of `name` as a Parquet dataset under `root` (a folder, or an
    s3:// or gs:// prefix), with CURRENT naming it (see `batchline.targets.parquet`)."""
    from batchline.targets.parquet import dataset_at

    version = store.resolve_name(name)
    if version is None:
        raise BatchlineError(f"nothing is published under {name!r} in {store.url}")
    dataset = dataset_at(root)
    dataset.stage(store, version)
    # An export on demand, not a publication: CURRENT follows the store's pointer, whatever it named before.
    dataset.show(name, version, None)
    return version, str(dataset.folder(name, version))


def export_to(out: str, write: Callable[[Path], int]) -> int:
    """`write(path)` to a local file, or, for an s3:// or gs:// URL, to a scratch file that is
    then uploaded whole (readers of the object see the old one or the complete new one)."""
    from batchline.sources import is_object_url

    if not is_object_url(out):
        return write(Path(out))
    from batchline.lake import lake_settings
    from batchline.sources.objects import upload

    with tempfile.TemporaryDirectory(prefix="batchline-export-") as scratch:
        local = Path(scratch) / Path(out).name
        n = write(local)
        upload(local, out, lake_settings())
    return n


@dataclass(frozen=True)
class OpenAIBatchExport:
    responses: int  # lines of the output file
    errors: int  # lines of the error file
    pending: int  # input lines in neither file: records without an outcome yet (--partial)


OPENAI_PAGE = 1000


def openai_errors_path(out: Path) -> Path:
    """Where the error file goes beside an output file: `x.jsonl` -> `x.errors.jsonl`."""
    stem = out.name[: -len(".jsonl")] if out.name.endswith(".jsonl") else out.name
    return out.with_name(f"{stem}.errors.jsonl")


def export_openai_batch(store: ReaderStore, version: str, out: Path, errors: Path, *,
                        partial: bool = False) -> OpenAIBatchExport:
    """OpenAI's batch output file (one response line per result) and error file (one line
    per dead letter), both in the order of the job's input, for any job: custom_id is the
    record's id. The input is streamed and results are fetched a page of ids at a time."""
    from batchline.openai_format import error_line, response_line
    from batchline.planner import snapshot_records
    from batchline.snapshot import pinned_sources
    from batchline.sources import snapshot_digest
    from batchline.spec import stored_spec

    info = finished(store, version, partial)
    spec = stored_spec(info)
    # The files follow the input's order, so the input must still be the planned snapshot;
    # the scan below reads each object conditional on the pin checked here.
    sources, pins = pinned_sources(spec.input, store.url)
    if spec.version(snapshot_digest(pins), spec.base_version) != version:
        raise InputError(f"{spec.input.describe()}: the input changed since {version} "
                         "was planned; the export reads it for the order of the lines")
    local_model = _local_model_name(spec.model.engine, spec.model.path, spec.model.options)
    counts = {"responses": 0, "errors": 0, "pending": 0}

    def ids() -> Iterator[str]:
        for record in snapshot_records(spec, store.url, sources):
            yield record.id

    def write(out_tmp: Path, errors_tmp: Path, dead: _DeadLetterIndex) -> int:
        with out_tmp.open("w", encoding="utf-8") as fo, errors_tmp.open("w", encoding="utf-8") as fe:
            for page in _pages(ids(), OPENAI_PAGE):
                found = store.results_for(version, page)
                letters = dead.lookup([i for i in page if i not in found])
                for record_id in page:
                    r = found.get(record_id)
                    if r is not None:
                        line = response_line(version, record_id, r.output, r.created_at,
                                             r.model or local_model,
                                             r.input_tokens, r.output_tokens)
                        fo.write(json.dumps(line, ensure_ascii=False) + "\n")
                        counts["responses"] += 1
                    elif record_id in letters:
                        kind, error = letters[record_id]
                        fe.write(json.dumps(error_line(version, record_id, kind, error), ensure_ascii=False) + "\n")
                        counts["errors"] += 1
                    else:
                        counts["pending"] += 1
        if counts["pending"] and info.state == "sealed":
            raise BatchlineError(f"{counts['pending']:,} records of {version} have no outcome although it is "
                                 "sealed; the store does not cover the input")
        return counts["responses"]

    with tempfile.TemporaryDirectory(prefix="batchline-export-") as folder:
        dead = _DeadLetterIndex(store, version, Path(folder))
        try:
            # The error file is renamed into place just before the output file; a failure
            # before then leaves neither changed.
            atomic_write(out, lambda out_tmp: atomic_write(errors, lambda errors_tmp: write(out_tmp, errors_tmp, dead)))
        finally:
            dead.close()
    return OpenAIBatchExport(counts["responses"], counts["errors"], counts["pending"])


def _local_model_name(engine: str, path: str | None, options: Any) -> str:
    """The model a result names when the store did not record one."""
    if engine == "openai" and options.get("model"):
        return str(options["model"])
    return path or engine


def _pages(items: Iterator[str], size: int) -> Iterator[list[str]]:
    page: list[str] = []
    for item in items:
        page.append(item)
        if len(page) == size:
            yield page
            page = []
    if page:
        yield page


class _DeadLetterIndex:
    """A version's dead letters, copied to a scratch SQLite file: the export looks them
    up a page at a time in input order, and a failed job can have too many to hold."""

    _CHUNK = 500  # ids per query, under SQLite's limit on bound parameters

    def __init__(self, store: ReaderStore, version: str, folder: Path) -> None:
        self.db = sqlite3.connect(folder / "dead-letters.db")
        self.db.execute("CREATE TABLE dead (id TEXT PRIMARY KEY, kind TEXT NOT NULL, error TEXT NOT NULL)")
        self.db.executemany("INSERT INTO dead VALUES (?, ?, ?)",
                            ((d.record_id, d.kind, d.error) for d in store.iter_dead_letters(version)))
        self.db.commit()

    def lookup(self, ids: Sequence[str]) -> dict[str, tuple[str, str]]:
        out: dict[str, tuple[str, str]] = {}
        for i in range(0, len(ids), self._CHUNK):
            chunk = list(ids[i:i + self._CHUNK])
            marks = ",".join("?" * len(chunk))
            for record_id, kind, error in self.db.execute(
                    f"SELECT id, kind, error FROM dead WHERE id IN ({marks})", chunk):
                out[record_id] = (kind, error)
        return out

    def close(self) -> None:
        self.db.close()


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
        "model": [r.model for r in rows],
    }, schema=schema)


def atomic_write(out: Path, write: Any) -> int:
    """`write(tmp)` into a file beside `out`, then renamed over it: readers see the old file or the new."""
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
