"""Results published into an Apache Iceberg table (write, audit, publish).

- `stage` writes a sealed version's results and dead letters, in one commit, as
  the snapshot of a branch named after the version: readers of the table's main
  branch do not see it. A table without any snapshot refuses writes to a branch,
  so the first stage gives it an empty first snapshot on main (marked
  `batchline.baseline`). The table is made on first use, with columns from the
  output's JSON Schema (`iceberg_schema`); a later version may add columns, which
  are added to the table here (and so appear, empty, on main at once).
- `show` makes the version's branch snapshot main's current snapshot in one
  catalog commit (`set_current_snapshot`: another version's branch is no ancestor
  of main, so `rollback_to_snapshot` cannot do it), and only while main is the
  snapshot the store recorded last; the commit itself asserts that main has not
  moved since it was read. A commit that loses a race to another writer is tried
  again against the new metadata; one that finds main moved is refused.
- `restore` puts main back to the recorded snapshot when the store's own
  publish failed or was refused after the catalog commit, unless main has moved
  on since (another publisher's, whose publication the store recorded).
- `forget` removes a pruned version's branch, expires every snapshot no branch
  reaches any more, and deletes the files only those snapshots used
  (`expire_snapshots` by itself deletes no file).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from batchline.errors import BatchlineError, SpecError, one_line
from batchline.sources.base import DatasetName, ParseContext, StoreDatasets
from batchline.sources.iceberg import (
    STORE_CATALOG,
    TABLE_FIELDS,
    TableRef,
    load_table,
    open_catalog,
    parse_table,
    table_refusal,
    table_schema,
)
from batchline.spec import JobSpec, stored_spec
from batchline.spec.reader import Fields, SpecReader
from batchline.store import ReaderStore, StoredDeadLetter, StoredResult, require_job
from batchline.targets.base import TargetFamily
from batchline.targets.iceberg_schema import (
    CARRY_COLUMN,
    PROVENANCE_COLUMN,
    acl_is_text,
    acl_values,
    carry_values,
    converter,
    iceberg_schema,
    output_node,
    output_values,
    provenance_values,
    schema_change,
)

BATCH_ROWS = 50_000
COMMIT_TRIES = 5  # a catalog commit that lost a race is tried again this many times in all
BASELINE = "batchline.baseline"
VERSION_PROPERTY = "batchline.version"
# Each commit writes a metadata file; keep the last hundred, as readers may still hold one.
TABLE_PROPERTIES = {"write.metadata.delete-after-commit.enabled": "true",
                    "write.metadata.previous-versions-max": "100"}


def _commit_failed() -> type[Exception]:
    from pyiceberg.exceptions import CommitFailedException

    return CommitFailedException


class IcebergTable:
    def __init__(self, ref: TableRef, store_url: str | None = None,
                 storage: Mapping[str, Any] | None = None) -> None:
        self.ref = ref
        self.store_url = store_url
        # The job's input.storage: where its object store is (a warehouse in S3 is reached
        # with the same endpoint and region as the job's input).
        self.storage = dict(storage or {})

    @property
    def key(self) -> str:
        return f"iceberg:{self.ref.catalog}/{self.ref.name}"

    def describe(self) -> str:
        return self.ref.describe()

    # --- stage ---------------------------------------------------------------------

    def stage(self, store: ReaderStore, version: str) -> bool:
        info = require_job(store, version)
        spec = stored_spec(info)
        with open_catalog(self.ref, self.store_url, self.storage) as catalog:
            for attempt in range(COMMIT_TRIES):
                table = load_table(catalog, self.ref)
                if table is not None and version in table.metadata.refs:
                    return False  # staged before: a branch is written in one commit, so it is whole
                table = self._table_for(catalog, spec, table)
                try:
                    if table.metadata.current_snapshot_id is None:
                        table.append(_empty(table), snapshot_properties={BASELINE: "true"})
                        continue
                    reader = _reader(table, store, version, spec)
                    table.append(reader, snapshot_properties={VERSION_PROPERTY: version, "batchline.name": info.name},
                                 branch=version)
                    return True
                except _commit_failed() as exc:
                    if attempt == COMMIT_TRIES - 1:
                        raise BatchlineError(f"{self.describe()}: writing {version} lost {COMMIT_TRIES} races to "
                                             f"other writers ({one_line(exc)}); publish again") from None
        raise BatchlineError(f"{self.describe()}: {version} was not written in {COMMIT_TRIES} tries; publish again")

    def _table_for(self, catalog: Any, spec: JobSpec, table: Any | None) -> Any:
        """The table, made if missing, with any new output columns added. A column the
        version lacks is left empty in its rows (planning refused removing one; an older
        version staged again after a newer one added columns lacks them)."""
        wanted = iceberg_schema(spec.output_schema, acl_text=table is not None and acl_is_text(table.schema()),
                                carry=spec.input.carry, provenance=spec.provenance)
        if table is None:
            namespace = self.ref.name.rsplit(".", 1)[0]
            try:
                catalog.create_namespace_if_not_exists(namespace)
                table = catalog.create_table_if_not_exists(self.ref.name, schema=wanted,
                                                           properties=TABLE_PROPERTIES)
            except Exception as exc:  # pyiceberg raises ValueError without a warehouse, others from the catalog
                raise BatchlineError(f"{self.describe()}: cannot create the table: {one_line(exc)}") from None
            return table
        change = schema_change(table.schema(), wanted, missing_ok=True)
        if change is not None:
            raise SpecError(f"output.table {self.ref.name}: {change}; only new columns may be added")
        if _adds_columns(table.schema(), wanted):
            with table.update_schema() as update:
                update.union_by_name(wanted)
            table = catalog.load_table(self.ref.name)
        return table

    # --- show, restore -----------------------------------------------------------------

    def show(self, name: str, version: str, recorded: dict[str, Any] | None) -> dict[str, Any]:
        def target(table: Any) -> int:
            ref = table.metadata.refs.get(version)
            if ref is None:
                raise BatchlineError(f"{self.describe()} has no branch {version!r}: it was not staged")
            return int(ref.snapshot_id)

        def allowed(table: Any) -> str | None:
            return self._recorded_problem(table, recorded)

        return self._move_main(target, allowed, f"publish {version}")

    def restore(self, name: str, recorded: dict[str, Any] | None, shown: dict[str, Any]) -> None:
        def target(table: Any) -> int:
            if recorded is not None:
                return int(recorded["snapshot_id"])
            baseline = next((s.snapshot_id for s in table.metadata.snapshots
                             if (s.summary and s.summary.additional_properties.get(BASELINE) == "true")), None)
            if baseline is None:
                raise BatchlineError(f"{self.describe()}: no empty first snapshot to go back to")
            return int(baseline)

        def moved_on(table: Any) -> bool:
            # Another publisher moved main since (the one whose publication the store
            # recorded instead of this one): what main shows is not this publish's to undo.
            return bool(table.metadata.current_snapshot_id != shown["snapshot_id"])

        self._move_main(target, lambda _table: None, "put back", leave=moved_on)

    def _move_main(self, target: Callable[[Any], int], allowed: Callable[[Any], str | None],
                   what: str, leave: Callable[[Any], bool] = lambda _table: False) -> dict[str, Any]:
        from pyiceberg.exceptions import CommitFailedException

        with open_catalog(self.ref, self.store_url, self.storage) as catalog:
            for _attempt in range(COMMIT_TRIES):
                table = load_table(catalog, self.ref)
                if table is None:
                    raise BatchlineError(f"{self.describe()}: no such table")
                if leave(table):
                    return self._state(table, table.metadata.current_snapshot_id)
                problem = allowed(table)
                if problem is not None:
                    raise BatchlineError(f"{self.describe()}: {problem}; not changing it (store and table must "
                                         "agree: set main back, or publish into a new table)")
                snapshot_id = target(table)
                try:
                    # The commit asserts that main is still the snapshot read above.
                    table.manage_snapshots().set_current_snapshot(snapshot_id=snapshot_id).commit()
                except CommitFailedException:
                    time.sleep(0.05)
                    continue  # read the new metadata, check again
                return self._state(table, snapshot_id)
        raise BatchlineError(f"{self.describe()}: {what} lost {COMMIT_TRIES} races to other writers; "
                             "nothing was changed: try again")

    def _state(self, table: Any, snapshot_id: int) -> dict[str, Any]:
        snapshot = table.metadata.snapshot_by_id(snapshot_id)
        version = snapshot.summary.additional_properties.get(VERSION_PROPERTY) if snapshot and snapshot.summary \
            else None
        # The metadata file a reader without a catalog (DuckDB's iceberg_scan) opens to read
        # main as this publish left it; a metadata file never changes once written.
        return {"table_uuid": str(table.metadata.table_uuid), "snapshot_id": snapshot_id, "version": version,
                "metadata_location": table.metadata_location}

    def _recorded_problem(self, table: Any, recorded: dict[str, Any] | None) -> str | None:
        """Why main is not what the store recorded last, or None when it is."""
        main = table.metadata.current_snapshot_id
        if recorded is None:
            snapshot = table.metadata.current_snapshot()
            if snapshot is None or (snapshot.summary and
                                    snapshot.summary.additional_properties.get(BASELINE) == "true"):
                return None
            return (f"main is snapshot {main} ({_version_of(snapshot)}), but the store has recorded no "
                    "publication into this table")
        if str(table.metadata.table_uuid) != recorded.get("table_uuid"):
            return (f"the table's UUID is {table.metadata.table_uuid}, not {recorded.get('table_uuid')} as the "
                    "store recorded (it was dropped and made again)")
        if main != recorded.get("snapshot_id"):
            return (f"main is snapshot {main} ({_version_of(table.metadata.current_snapshot())}), not "
                    f"{recorded.get('snapshot_id')} ({recorded.get('version')}) as the store recorded")
        return None

    # --- forget ----------------------------------------------------------------------

    def forget(self, name: str, version: str) -> None:
        from pyiceberg.table.snapshots import ancestors_of

        with open_catalog(self.ref, self.store_url, self.storage) as catalog:
            table = load_table(catalog, self.ref)
            if table is None:
                return
            meta = table.metadata
            ref = meta.refs.get(version)
            if ref is not None and ref.snapshot_id == meta.current_snapshot_id:
                return  # what readers see now is never removed
            if ref is not None:
                table.manage_snapshots().remove_branch(version).commit()
                table = catalog.load_table(self.ref.name)
                meta = table.metadata
            reached = {s.snapshot_id for r in meta.refs.values()
                       for s in ancestors_of(meta.snapshot_by_id(r.snapshot_id), meta)}
            expired = [s for s in meta.snapshots if s.snapshot_id not in reached]
            if not expired:
                return
            gone = _files_of(table, expired)
            kept = _files_of(table, [s for s in meta.snapshots if s.snapshot_id in reached])
            table.maintenance.expire_snapshots().by_ids([s.snapshot_id for s in expired]).commit()
            for path in sorted(gone - kept):
                with contextlib.suppress(FileNotFoundError):
                    table.io.delete(path)


def _version_of(snapshot: Any) -> str:
    if snapshot is None or snapshot.summary is None:
        return "no version"
    props = snapshot.summary.additional_properties
    if props.get(BASELINE) == "true":
        return "the empty first snapshot"
    return props.get(VERSION_PROPERTY) or "not written by batchline"


def _files_of(table: Any, snapshots: list[Any]) -> set[str]:
    """Every file the snapshots use: manifest lists, manifests and the files they list."""
    files: set[str] = set()
    for snapshot in snapshots:
        if snapshot.manifest_list:
            files.add(snapshot.manifest_list)
        for manifest in snapshot.manifests(table.io):
            files.add(manifest.manifest_path)
            for entry in manifest.fetch_manifest_entry(table.io, discard_deleted=False):
                files.add(entry.data_file.file_path)
    return files


def _adds_columns(have: Any, want: Any) -> bool:
    def names(struct: Any, prefix: str = "") -> set[str]:
        from pyiceberg.types import ListType, StructType

        out: set[str] = set()
        for f in struct.fields:
            t = f.field_type
            while isinstance(t, ListType):
                t = t.element_type
            out.add(prefix + f.name)
            if isinstance(t, StructType):
                out |= names(t, f"{prefix}{f.name}.")
        return out

    return bool(names(want.as_struct()) - names(have.as_struct()))


def check_table_schema(ref: TableRef, spec: JobSpec, store_url: str | None) -> None:
    """At planning: a version whose output would change the table other than by adding
    columns is refused, with one line naming the column."""
    with open_catalog(ref, store_url, spec.input.storage) as catalog:
        table = load_table(catalog, ref)
        if table is None:
            return
        have = table.schema()
        change = schema_change(have, iceberg_schema(spec.output_schema, acl_text=acl_is_text(have),
                                                    carry=spec.input.carry, provenance=spec.provenance))
    if change is not None:
        raise SpecError(f"output.table {ref.name}: {change}; only new columns may be added")


# --- rows -------------------------------------------------------------------------------


def _empty(table: Any) -> Any:
    return table.schema().as_arrow().empty_table()


def _reader(table: Any, store: ReaderStore, version: str, spec: JobSpec) -> Any:
    import pyarrow as pa

    schema = table.schema().as_arrow()
    return pa.RecordBatchReader.from_batches(
        schema, _batches(schema, store, version, spec, acl_text=acl_is_text(table.schema())))


def _batches(schema: Any, store: ReaderStore, version: str, spec: JobSpec, *, acl_text: bool) -> Iterator[Any]:
    """The version's results, then its dead letters, as Arrow batches of the table's schema."""
    import pyarrow as pa

    convert = converter(output_node(spec.output_schema))
    has_output = "output" in schema.names
    carries = bool(spec.input.carry) and CARRY_COLUMN in schema.names
    provenance = spec.provenance and PROVENANCE_COLUMN in schema.names
    default_model = spec.model.label

    def batch(n: int, columns: dict[str, Any]) -> Any:
        # Built a column at a time: a dict per row cost more than reading the store did.
        arrays = [pa.array(columns[f.name], type=f.type) if f.name in columns else pa.nulls(n, type=f.type)
                  for f in schema]
        return pa.RecordBatch.from_arrays(arrays, schema=schema)

    def results(rows: list[StoredResult]) -> Any:
        n = len(rows)
        return batch(n, {
            "id": [r.record_id for r in rows], "outcome": ["result"] * n,
            **({"output": output_values(rows, convert, version)} if has_output else {}),
            "raw_output": [r.output for r in rows], "acl": acl_values(rows, acl_text), "version": [version] * n,
            "model": [r.model or default_model for r in rows], "label": [r.label for r in rows],
            "attempt": [r.attempt for r in rows], "input_tokens": [r.input_tokens for r in rows],
            "output_tokens": [r.output_tokens for r in rows],
            "created_at": [int(r.created_at * 1_000_000) for r in rows],
            **({CARRY_COLUMN: carry_values(rows)} if carries else {}),
            **({PROVENANCE_COLUMN: provenance_values(rows, version)} if provenance else {})})

    def dead_letters(rows: list[StoredDeadLetter]) -> Any:
        n = len(rows)
        return batch(n, {
            "id": [d.record_id for d in rows], "outcome": ["dead_letter"] * n, "acl": acl_values(rows, acl_text),
            "version": [version] * n, "attempt": [d.attempts for d in rows],
            "created_at": [int(d.created_at * 1_000_000) for d in rows],
            "error_kind": [d.kind for d in rows], "error": [d.error for d in rows],
            **({CARRY_COLUMN: carry_values(rows)} if carries else {})})

    yield from _in_batches(store.iter_results(version), results)
    yield from _in_batches(store.iter_dead_letters(version), dead_letters)


def _in_batches(rows: Iterator[Any], make: Callable[[list[Any]], Any]) -> Iterator[Any]:
    chunk: list[Any] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) == BATCH_ROWS:
            yield make(chunk)
            chunk = []
    if chunk:
        yield make(chunk)


# --- the family ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TableOutput:
    """`output.table`: the Iceberg table a published version's results go to."""

    ref: TableRef

    def describe(self) -> str:
        return self.ref.describe()

    def to_dict(self) -> dict[str, Any]:
        return {"table": self.ref.to_dict()}

    def target(self, store_url: str | None, storage: Mapping[str, Any]) -> IcebergTable:
        return IcebergTable(self.ref, store_url, storage)

    def check(self, spec: JobSpec, store_url: str | None) -> None:
        check_table_schema(self.ref, spec, store_url)

    def dataset(self, name: str, store: StoreDatasets, state: Mapping[str, Any] | None) -> DatasetName:
        snapshot = (state or {}).get("snapshot_id")
        return self.ref.dataset(store, str(snapshot) if snapshot is not None else None)


class IcebergOutput(TargetFamily):
    """An Apache Iceberg table (write, audit, publish)."""

    name = "iceberg"
    keys: ClassVar[Fields] = {"table": table_schema(
        TABLE_FIELDS, "An Apache Iceberg table whose main follows the published version")}

    def parse(self, key: str, section: Mapping[str, Any], r: SpecReader, ctx: ParseContext) -> TableOutput:
        return TableOutput(parse_table(r, section[key], "output.table", ctx.base_dir))

    def access(self, section: Mapping[str, Any]) -> list[str]:
        output = section.get("table")
        if not output:
            return []
        sql = output["catalog"] == STORE_CATALOG or not str(output.get("uri", "")).startswith(("http://", "https://"))
        rights = ("SELECT, INSERT, UPDATE and DELETE on the catalog's tables iceberg_tables and "
                  "iceberg_namespace_properties" + (" (in the store's database; the worker role made here has none)"
                                                    if output["catalog"] == STORE_CATALOG else "")
                  if sql else "the catalog's right to create, load and commit to that table")
        return [f"output table {output['name']} (catalog {output['catalog']!r}): the worker needs nothing of it; the "
                f"publisher (publish, rollback, retention) needs {rights}, and to write and delete files under the "
                f"table's location{' in ' + output['warehouse'] if output.get('warehouse') else ''} (it writes each "
                "version's data and metadata files and deletes pruned versions' files)"]

    def pod_refusal(self, section: Mapping[str, Any], where: str) -> str | None:
        return table_refusal(section.get("table"), "output.table")


ICEBERG = IcebergOutput()
