"""Files of a version's results: JSONL and Parquet, each row with its record's ACL, written
beside their destination and renamed into place (or uploaded whole to an object), so a
reader never sees a partial file."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchline.errors import BatchlineError
from batchline.store import JobInfo, ReaderStore, StoredResult
from batchline.targets.columns import (
    ACL,
    CARRY_COLUMN,
    PROVENANCE,
    PROVENANCE_COLUMN,
    acl_values,
    arrow_type,
    carry_node,
    carry_values,
    converter,
    output_node,
    output_values,
    provenance_values,
)

if TYPE_CHECKING:
    from batchline.spec import JobVersion

PARQUET_ROWS_PER_GROUP = 50_000


def _rows(store: ReaderStore, version: str) -> Iterator[StoredResult]:
    return store.iter_results(version)


def finished(store: ReaderStore, info: JobInfo, partial: bool) -> JobVersion:
    """The version to export, as read from the store: sealed, or with `partial` any version (a
    half-done job is exported only when asked for by name: a reader of a file cannot tell it
    is half)."""
    from batchline.spec import JobVersion

    if info.state != "sealed" and not partial:
        st = store.status(info.version)
        raise BatchlineError(f"{info.version} is not finished ({st.results + st.dead_letters:,} of "
                             f"{st.records:,} records have an outcome): export it once it is sealed, or pass "
                             "--partial to write the outcomes there are")
    return JobVersion.from_info(info)


def export_jsonl(store: ReaderStore, version: str, out: Path | None) -> int:
    """The results of `version` as JSONL at `out`, or on standard output (see `write_jsonl`)."""
    from batchline.spec import JobVersion

    return write_jsonl(store, JobVersion.of(store, version), out)


def write_jsonl(store: ReaderStore, job: JobVersion, out: Path | None) -> int:
    """The results of `job`'s version, a JSON object a line, at `out` (written beside it and
    renamed into place) or on standard output; the lines written."""
    version, provenance = job.version, job.spec.provenance

    def write(f: Any) -> int:
        n = 0
        for r in _rows(store, version):
            row = {"id": r.record_id, "output": json.loads(r.output), "acl": None if r.acl is None else r.acl.to_list(),
                   "model": r.model}
            if r.carry is not None:
                row["carry"] = r.carry
            if provenance:
                row[PROVENANCE_COLUMN] = r.provenance(version)
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
        return n

    if out is None:
        return write(sys.stdout)
    def write_file(tmp: Path) -> int:
        with tmp.open("w", encoding="utf-8") as f:
            return write(f)

    return atomic_write(out, write_file)


# The Parquet export's format, in each file's key-value metadata: `typed` (output a struct typed
# from the output schema, acl a list of strings). A file without it was written before (output and
# acl JSON text); a dataset folder keeps the format it was staged in (it is never rewritten).
FORMAT_KEY = b"batchline.format"
TYPED = b"typed"


def parquet_schema(output_schema: Mapping[str, Any], carry: Sequence[str] = (), provenance: bool = False) -> Any:
    """The Parquet export's columns: `output`, `acl`, `carry` and `provenance` typed as the Iceberg
    table types them."""
    import pyarrow as pa

    node = output_node(output_schema)
    carried = carry_node(carry)
    return pa.schema([
        ("id", pa.string()), *([("output", arrow_type(node))] if node is not None else []),
        ("raw_output", pa.string()), ("acl", arrow_type(ACL)), ("label", pa.string()),
        ("version", pa.string()),
        ("worker", pa.string()), ("attempt", pa.int32()), ("input_tokens", pa.int64()),
        ("output_tokens", pa.int64()), ("created_at", pa.timestamp("ms", tz="UTC")), ("model", pa.string()),
        *([(CARRY_COLUMN, arrow_type(carried))] if carried is not None else []),
        *([(PROVENANCE_COLUMN, arrow_type(PROVENANCE))] if provenance else []),
    ], metadata={FORMAT_KEY: TYPED})


def export_parquet(store: ReaderStore, version: str, out: Path) -> int:
    """The results of `version` as one Parquet file at `out` (see `write_parquet`)."""
    from batchline.spec import JobVersion

    return write_parquet(store, JobVersion.of(store, version), out)


def write_parquet(store: ReaderStore, job: JobVersion, out: Path) -> int:
    """The results of `job`'s version as one Parquet file at `out`, typed by its output schema,
    written beside it and renamed into place; the rows written."""
    import pyarrow.parquet as pq

    version, spec = job.version, job.spec
    output_schema = spec.output_schema
    schema = parquet_schema(output_schema, spec.input.carry, spec.provenance)
    convert = converter(output_node(output_schema))

    def write(tmp: Path) -> int:
        n = 0
        with pq.ParquetWriter(tmp, schema) as writer:
            batch: list[StoredResult] = []
            for r in _rows(store, version):
                batch.append(r)
                if len(batch) == PARQUET_ROWS_PER_GROUP:
                    writer.write_table(_table(schema, batch, version, convert))
                    n += len(batch)
                    batch = []
            if batch or n == 0:
                writer.write_table(_table(schema, batch, version, convert))
                n += len(batch)
        return n

    return atomic_write(out, write)


def refuse_folder(out: str, flag: str = "--out") -> None:
    """A version's export is one file: a destination that is a folder on this machine is
    refused by name before anything is written (it would end in a rename over the folder)."""
    from batchline.sources import is_remote

    if not is_remote(out) and Path(out).is_dir():
        raise BatchlineError(f"{flag} {out} is a folder: a version's export is one file, so name the file "
                             "(only a published NAME with --format parquet exports into a folder)")


def local_or_url(location: str) -> Path | str:
    """A local path as a Path; an object URL as itself."""
    from batchline.sources import is_remote

    return location if is_remote(location) else Path(location)


def export_to(out: str, write: Callable[[Path], int]) -> int:
    """`write(path)` to a local file, or, for an s3:// or gs:// URL, to a scratch file that is
    then uploaded whole (readers of the object see the old one or the complete new one)."""
    from batchline.sources import is_remote, upload

    if not is_remote(out):
        refuse_folder(out)
        return write(Path(out))

    with tempfile.TemporaryDirectory(prefix="batchline-export-") as scratch:
        local = Path(scratch) / Path(out).name
        n = write(local)
        upload(local, out)
    return n


def _table(schema: Any, rows: list[StoredResult], version: str, convert: Callable[[Any], Any] | None) -> Any:
    import pyarrow as pa

    columns: dict[str, Any] = {
        "id": [r.record_id for r in rows],
        "raw_output": [r.output for r in rows],
        "acl": acl_values(rows),
        "label": [r.label for r in rows],
        "version": [version] * len(rows),
        "worker": [r.worker for r in rows],
        "attempt": [r.attempt for r in rows],
        "input_tokens": [r.input_tokens for r in rows],
        "output_tokens": [r.output_tokens for r in rows],
        "created_at": [int(r.created_at * 1000) for r in rows],
        "model": [r.model for r in rows],
    }
    if "output" in schema.names:
        columns["output"] = output_values(rows, convert, version)
    if CARRY_COLUMN in schema.names:
        columns[CARRY_COLUMN] = carry_values(rows)
    if PROVENANCE_COLUMN in schema.names:
        columns[PROVENANCE_COLUMN] = provenance_values(rows, version)
    return pa.Table.from_pydict(columns, schema=schema)


def umask() -> int:
    """The process's umask, read without changing it where Linux says it (os.umask can only
    be read by setting it, which another thread creating a file at that moment would see)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def as_umask_allows(path: Path, *, folder: bool = False) -> None:
    """The mode a file or folder made by open() or mkdir() would have. Scratch files and folders
    (mkstemp, mkdtemp) are private to their writer whatever the umask, and an export renamed
    into place keeps that: a loader running as another user could not read it."""
    os.chmod(path, (0o777 if folder else 0o666) & ~umask())


def atomic_write(out: Path, write: Any) -> int:
    """`write(tmp)` into a file beside `out`, then renamed over it: readers see the old file or the new."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        n = int(write(tmp))
        as_umask_allows(tmp)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return n


# --- a worker's file of its shard (files: per-shard) ----------------------------------------------


def shard_file_location(prefix: str, version: str, shard_no: int, epoch: int) -> str:
    """Where a worker writes its shard's file: named by the version, the shard and the lease epoch,
    so a stale owner's file is never the completing owner's."""
    return f"{prefix.rstrip('/')}/{version}/shard-{shard_no:06d}-epoch-{epoch}.parquet"


def write_shard_file(location: str, table: Any, storage: Mapping[str, Any]) -> dict[str, Any]:
    """`table` as one Parquet file at `location` (a path, or an s3:// or gs:// URL), whole or not
    at all (written beside and renamed; an object uploaded whole), and what the store records of
    it: the path, the rows, and the pin a publisher checks it against (size and content digest
    of a file; size, ETag and version of an object)."""
    import pyarrow.parquet as pq

    from batchline.sources import is_remote, open_source, upload

    def write(tmp: Path) -> int:
        pq.write_table(table, tmp, compression="zstd")
        return int(table.num_rows)

    if is_remote(location):
        with tempfile.TemporaryDirectory(prefix="batchline-shard-") as scratch:
            local = Path(scratch) / "shard.parquet"
            write(local)
            upload(local, location, storage)
    else:
        atomic_write(Path(location), write)
    pin = open_source(location, storage).pin()
    return {"path": location, "rows": int(table.num_rows),
            "pin": {**pin.to_json(), **({"digest": pin.digest} if pin.digest else {})}}


def shard_file_problem(entry: Mapping[str, Any], storage: Mapping[str, Any]) -> str | None:
    """Why a worker's shard file is not what its worker wrote (gone, or another size or content
    now), or None."""
    from batchline.errors import BatchlineError
    from batchline.sources import open_source

    try:
        now = open_source(str(entry["path"]), storage).pin()
    except BatchlineError as exc:
        return f"it cannot be read ({' '.join(str(exc).split())})"
    recorded = dict(entry.get("pin") or {})
    have = {**now.to_json(), **({"digest": now.digest} if now.digest else {})}
    for key in ("size", "digest", "etag", "version"):
        if recorded.get(key) is not None and have.get(key) != recorded.get(key):
            return f"its {key} is {have.get(key)!r}, not {recorded.get(key)!r} as its worker wrote it"
    return None

