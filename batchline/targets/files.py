"""Files of a version's results: JSONL and Parquet, each row with its record's ACL, written
beside their destination and renamed into place (or uploaded whole to an object), so a
reader never sees a partial file."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from batchline.errors import BatchlineError, one_line
from batchline.store import JobInfo, ReaderStore, StoredResult
from batchline.targets.columns import (
    ACL,
    CARRY_COLUMN,
    ORIGIN_COLUMN,
    PROVENANCE,
    PROVENANCE_COLUMN,
    acl_values,
    arrow_type,
    carry_node,
    carry_values,
    converter,
    origin_values,
    output_node,
    output_values,
    provenance_values,
)

if TYPE_CHECKING:
    from batchline.spec import JobSpec, JobVersion
    from batchline.spec.ports import Staging

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


def iso_ms(seconds: float) -> str:
    """A time as ISO 8601 in UTC to the millisecond, as the JSONL export writes `created_at`."""
    from datetime import UTC, datetime

    return datetime.fromtimestamp(seconds, tz=UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def write_jsonl(store: ReaderStore, job: JobVersion, out: Path | None) -> int:
    """The results of `job`'s version, a JSON object a line, at `out` (written beside it and
    renamed into place) or on standard output; the lines written."""
    version, provenance = job.version, job.spec.provenance

    def write(f: Any) -> int:
        n = 0
        for r in _rows(store, version):
            row = {"id": r.record_id, "output": json.loads(r.output), "acl": None if r.acl is None else r.acl.to_list(),
                   "model": r.model, ORIGIN_COLUMN: r.origin or version, "created_at": iso_ms(r.created_at)}
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
        ("version", pa.string()), (ORIGIN_COLUMN, pa.string()),
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
        ORIGIN_COLUMN: origin_values(rows, version),
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
#
# A worker is untrusted (I8): what it records of its file (path, rows, pin) is a claim. The
# store derives where the file must be (`shard_file_location`, from the version, the shard and
# the epoch that completed it); the pin is whole (`PIN_KEYS`); and before the file is published
# its rows are compared with the rows the store holds (`check_shard_file`), every column.

# What a shard file's pin holds: its size and the sha256 of its bytes, and where the object
# store has them its ETag and version id. A recorded pin must match in every key.
PIN_KEYS = ("size", "digest", "etag", "version")


def shard_file_location(prefix: str, version: str, shard_no: int, epoch: int) -> str:
    """Where a worker writes its shard's file: named by the version, the shard and the lease epoch,
    so a stale owner's file is never the completing owner's."""
    return f"{version_prefix(prefix, version)}shard-{shard_no:06d}-epoch-{epoch}.parquet"


def version_prefix(prefix: str, version: str) -> str:
    """The version's own staging prefix (ending in `/`): its workers' files, and nothing else."""
    return f"{prefix.rstrip('/')}/{version}/"


def whole_pin(size: int, digest: str | None, etag: str | None = None, version: str | None = None) -> dict[str, Any]:
    return {k: v for k, v in (("size", size), ("digest", digest), ("etag", etag), ("version", version))
            if v is not None}


def write_shard_file(location: str, table: Any, storage: Mapping[str, Any]) -> dict[str, Any]:
    """`table` as one Parquet file at `location` (a path, or an s3:// or gs:// URL), whole or not
    at all (written beside and renamed; an object uploaded whole), and what the store records of
    it: the path, the rows, and its whole pin (size, sha256 of its bytes, and an object's ETag
    and version)."""
    import pyarrow.parquet as pq

    from batchline.sources import is_remote, open_source, upload

    written: list[bytes] = []

    def write(tmp: Path) -> int:
        pq.write_table(table, tmp, compression="zstd")
        written.append(tmp.read_bytes())
        return int(table.num_rows)

    if is_remote(location):
        with tempfile.TemporaryDirectory(prefix="batchline-shard-") as scratch:
            local = Path(scratch) / "shard.parquet"
            write(local)
            upload(local, location, storage)
        # The object's ETag and version, as its store gives them; the digest is of the bytes sent.
        pin = open_source(location, storage).pin()
        whole = whole_pin(pin.size, _sha256(written[0]), pin.etag, pin.version)
    else:
        atomic_write(Path(location), write)
        whole = whole_pin(len(written[0]), _sha256(written[0]))
    return {"path": location, "rows": int(table.num_rows), "pin": whole}


def _sha256(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def current_pin(location: str, storage: Mapping[str, Any], *, read: bool = False) -> tuple[dict[str, Any], bytes]:
    """The file's whole pin as it is now, and with `read` its bytes (a file read once, its digest
    made of what was read; an object read conditional on the ETag its pin names, so the digest is
    of the object that ETag names). Without `read` an object's pin has no digest: its ETag and
    version bind its content."""
    from batchline.sources import is_remote, open_source

    source = open_source(location, storage)
    if read and not is_remote(location):
        with source.stream() as f:
            try:
                data = f.read()
            except OSError as exc:
                raise BatchlineError(f"{location}: {exc.strerror or exc}") from None
        return whole_pin(len(data), _sha256(data)), data
    pin = source.pin()
    if not read:
        return whole_pin(pin.size, pin.digest, pin.etag, pin.version), b""
    data = source.read(0, pin.size)
    if len(data) != pin.size:
        raise BatchlineError(f"{location} changed while it was read")
    return whole_pin(pin.size, _sha256(data), pin.etag, pin.version), data


def pin_problem(recorded: Any, have: Mapping[str, Any], whose: str) -> str | None:
    """Why `have` is not the pin `recorded` (every key of PIN_KEYS that `have` holds, and size and
    digest always), or None."""
    if not isinstance(recorded, Mapping) or recorded.get("size") is None or not recorded.get("digest"):
        return f"its pin as {whose} recorded it lacks its size or digest (a pin is whole: {', '.join(PIN_KEYS)})"
    for key in PIN_KEYS:
        if key == "digest" and "digest" not in have:
            continue  # an object's ETag (and version) stand for its content here
        if have.get(key) != recorded.get(key):
            return f"its {key} is {have.get(key)!r}, not {recorded.get(key)!r} as {whose} recorded it"
    return None


@dataclass(frozen=True)
class CheckedFile:
    """A shard's file as the check found it: where, and its whole pin."""

    shard_no: int
    path: str
    pin: Mapping[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "pin": dict(self.pin)}


class ShardFileRefused(BatchlineError):
    """A worker's shard file is not the store's rows: nothing is published (as a failed gate)."""


@dataclass(frozen=True)
class LoadedFile:
    """A recorded shard file read whole: its pin as it is, and its rows."""

    path: str
    pin: Mapping[str, Any]
    rows: Any


def load_shard_file(recorded: Any, expected_path: str, storage: Mapping[str, Any]) -> LoadedFile | str:
    """The file a worker recorded for a shard, read once (no store needed: it may run beside the
    store's reads): refused unless it lies at `expected_path`, where the store puts that shard's
    file, and its recorded pin is whole and equal to the file's."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not isinstance(recorded, Mapping) or not isinstance(recorded.get("path"), str):
        return "its worker recorded no file path"
    path = recorded["path"]
    if path != expected_path:
        return f"its worker recorded it at {path}, not at {expected_path}, where the store puts that shard's file"
    try:
        have, data = current_pin(path, storage, read=True)
    except BatchlineError as exc:
        return f"it cannot be read ({one_line(exc)})"
    problem = pin_problem(recorded.get("pin"), have, "its worker")
    if problem is not None:
        return problem
    try:
        return LoadedFile(path, have, pq.read_table(pa.BufferReader(data)))
    except (OSError, ValueError, pa.ArrowException) as exc:
        return f"it is not a Parquet file ({one_line(exc)})"


def check_shard_file(loaded: LoadedFile | str, shard_no: int, expected_rows: Callable[[], Any]) -> CheckedFile | str:
    """A shard's file as `load_shard_file` read it, its rows compared, every column, with
    `expected_rows()` (the shard's rows as the store holds them, in the file's columns): the file
    as checked, or why it is refused."""
    if isinstance(loaded, str):
        return loaded
    problem = rows_problem(loaded.rows, expected_rows())
    return problem if problem is not None else CheckedFile(shard_no, loaded.path, loaded.pin)


def rows_problem(actual: Any, expected: Any) -> str | None:
    """Why a file's rows (`actual`, an Arrow table) are not `expected`, naming the column and
    record, or None: the same columns of the same types, the same ids in the same order, and
    every value equal."""
    have = [(f.name, str(f.type)) for f in actual.schema]
    want = [(f.name, str(f.type)) for f in expected.schema]
    if have != want:
        extra = [n for n, _ in have if n not in dict(want)]
        missing = [n for n, _ in want if n not in dict(have)]
        what = (f"columns {extra} the table has not" if extra else f"no column {missing}" if missing
                else "columns of other types or order than the table's")
        return f"it holds {what}"
    ids, store_ids = actual.column("id").to_pylist(), expected.column("id").to_pylist()
    if ids != store_ids:
        theirs, ours = set(ids), set(store_ids)
        unknown = [i for i in ids if i not in ours]
        lacking = [i for i in store_ids if i not in theirs]
        if unknown:
            return f"it holds {unknown[0]!r}{_more(unknown)}, which the store does not hold in this shard"
        if lacking:
            return f"it lacks {lacking[0]!r}{_more(lacking)}, which the store holds in this shard"
        return "it holds the shard's records more than once or out of the store's order"
    for name in actual.column_names:
        a, b = actual.column(name), expected.column(name)
        if a.equals(b):
            continue
        for record_id, x, y in zip(store_ids, a.to_pylist(), b.to_pylist(), strict=True):
            if x != y:
                return f"its {name} of {record_id!r} is {_short(x)}, the store's {_short(y)}"
        return f"its {name} column differs from the store's"
    return None


def _more(items: Sequence[Any]) -> str:
    return f" (and {len(items) - 1:,} more)" if len(items) > 1 else ""


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# --- the published copy of a checked shard file ----------------------------------------------------
#
# A worker's staging prefix stays writable by it after the check (its credentials cover it, and an
# object store lets whoever may write a key delete and write it again), and Iceberg records only a
# data file's path: a file published where it was staged would be read as the worker leaves it.
# So the publisher copies each checked file, at publish, into the table's own location, which
# only the publisher may write (`batchline grants` gives workers the staging prefix alone), and
# the table names the copy. The copy is made at publish, not at validate: a version is copied
# only when it is published (a validation that is never followed by a publish leaves nothing
# behind), and the copy is made of the bytes read once here and hashed, so a file rewritten
# between the check and the copy is refused by name instead of copied.


def copy_checked_file(checked: CheckedFile, destination: str, storage: Mapping[str, Any]) -> dict[str, Any] | str:
    """The file `checked` names, read once, its pin as the check recorded it (its digest made of the
    bytes read), and those same bytes written whole at `destination`: the copy's pin (size, the
    digest of the bytes written, and where the object store gives them its ETag and version), or
    why nothing was copied."""
    from batchline.sources import is_remote, open_source, upload

    try:
        have, data = current_pin(checked.path, storage, read=True)
    except BatchlineError as exc:
        return f"it cannot be read ({one_line(exc)})"
    problem = pin_problem(checked.pin, have, "the check")
    if problem is not None:
        return problem
    digest = str(have["digest"])
    if is_remote(destination):
        with tempfile.TemporaryDirectory(prefix="batchline-copy-") as scratch:
            local = Path(scratch) / "shard.parquet"
            local.write_bytes(data)
            upload(local, destination, storage)
        pin = open_source(destination, storage).pin()
        copy = whole_pin(pin.size, digest, pin.etag, pin.version)
    else:
        target = Path(destination.removeprefix("file://"))
        atomic_write(target, lambda tmp: tmp.write_bytes(data))
        copy = whole_pin(target.stat().st_size, digest)
    # What lies at the copy's location is the publisher's own write; its size is checked here
    # so that a short or failed write is never registered.
    if copy["size"] != len(data):
        return f"its copy at {destination} holds {copy['size']:,} bytes, not the {len(data):,} that were checked"
    return copy


def under(location: str, prefix: str) -> bool:
    """`location` lies under `prefix` (which ends in `/`), read as written: a `..` segment, or a
    location of another scheme or host, never does."""
    import posixpath

    def plain(text: str) -> str:
        return text[len("file://"):] if text.startswith("file://") else text

    loc, pre = plain(location), plain(prefix)
    if not pre.endswith("/") or ".." in loc.split("/"):
        return False
    _scheme, sep, rest = loc.partition("://")
    if sep:
        return loc.startswith(pre) and "//" not in rest
    return loc.startswith(pre) and posixpath.normpath(loc) == loc


class ShardFileWriter(Protocol):
    """A target whose files the workers write (`files: per-shard`), as the check reads it."""

    def describe(self) -> str: ...

    def shard_files(self) -> Staging | None: ...

    def stored_shard_rows(self, store: ReaderStore, spec: JobSpec, version: str) -> Callable[[int], Any]: ...


SHARD_FILES_CHECK = "shard_files"


def check_shard_files(store: ReaderStore, job: JobVersion, target: ShardFileWriter, key: str,
                      storage: Mapping[str, Any]) -> tuple[dict[int, CheckedFile], list[str]]:
    """Every file the version's workers recorded for `target` (its store key `key`), each checked
    against the store (`check_shard_file`): the files as checked, by shard, and what was refused,
    a line each naming the shard and the file."""
    staging = target.shard_files()
    checked: dict[int, CheckedFile] = {}
    problems: list[str] = []
    if staging is None:
        return checked, problems
    version = job.version
    stored_rows = target.stored_shard_rows(store, job.spec, version)
    units = [(u, (u.files or {}).get(key)) for u in store.shard_units(version)]
    # A shard no worker wrote a file of is written by the publisher from the store.
    # Under the staging prefix of the region its completing lease was claimed in, as the store says.
    recorded = [(u, entry, shard_file_location(staging.prefix_for(u.ran_in), version, u.shard_no, u.epoch))
                for u, entry in units if entry is not None]
    # The next files are read (and their digests made) while the store's rows of this one are;
    # both mostly wait outside the interpreter.
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="batchline-shard-file") as pool:
        loads: list[Future[LoadedFile | str] | None] = [
            pool.submit(load_shard_file, entry, expected, storage) for _u, entry, expected in recorded[:2]]
        for i, (unit, entry, expected) in enumerate(recorded):
            if i + 2 < len(recorded):
                _, ahead, ahead_path = recorded[i + 2]
                loads.append(pool.submit(load_shard_file, ahead, ahead_path, storage))
            future, loads[i] = loads[i], None  # a file's rows are let go once compared
            assert future is not None
            outcome = check_shard_file(future.result(), unit.shard_no, partial(stored_rows, unit.shard_no))
            if isinstance(outcome, CheckedFile):
                checked[unit.shard_no] = outcome
            else:
                where = entry.get("path") if isinstance(entry, Mapping) else None
                problems.append(f"{target.describe()}: the file of shard {unit.shard_no}, {where or expected}: "
                                f"{outcome}")
    return checked, problems


def validated_files(report: Mapping[str, Any] | None, key: str) -> dict[int, CheckedFile] | None:
    """The shard files of target `key` a passing validation checked (its `shard_files` check),
    by shard; None when the report holds no such passing check."""
    for check in (report or {}).get("checks", []):
        if check.get("name") == SHARD_FILES_CHECK and check.get("passed"):
            files = (check.get("details") or {}).get("files", {}).get(key)
            if files is None:
                return None
            return {int(n): CheckedFile(int(n), str(f["path"]), dict(f["pin"])) for n, f in files.items()}
    return None
