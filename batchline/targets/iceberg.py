"""Results published into an Apache Iceberg table (write, audit, publish).

- `stage` writes a sealed version's results and dead letters, in one commit, as
  the snapshot of a branch named after the version: readers of the table's main
  branch do not see it. Its data files are laid out a shard at a time (one file of
  each shard's rows, in id order): an incremental version shares, as they are, the
  base version's files of every shard whose outcomes it carried whole from the base
  (the same input, so the same rows), and writes new files only for the shards it
  changed; a map of each version's files by shard identity is kept beside the
  table's metadata for the next version to read. With `files: per-shard` the
  workers wrote each shard's file as they completed it, and the store recorded it:
  staging copies each, as validation checked it, into the table's own location
  (`copy_prefix`: out of every worker's reach; refusing, by name, a file deleted or
  altered since the check) and adds the copy, never the worker's file, writing only a
  file of the results carried into a shard. Each copy's pin is recorded in the
  version's map of files. A table without any snapshot refuses writes to a
  branch, so the first stage gives it an empty first snapshot on main (marked
  `batchline.baseline`). The table is made on first use, with columns from the
  output's JSON Schema (`iceberg_schema`); a later version may add columns, which
  are added to the table here (and so appear, empty, on main at once).
- `show` makes the version's branch snapshot main's current snapshot in one
  catalog commit (`set_current_snapshot`: another version's branch is no ancestor
  of main, so `rollback_to_snapshot` cannot do it), and only while main is the
  snapshot the store recorded last (or this version's own, which a publisher that
  stopped after the commit left there); the commit itself asserts that main has not
  moved since it was read. A commit that loses a race to another writer is tried
  again against the new metadata; one that finds main moved is refused.
- `restore` puts main back to the recorded snapshot when the store's own
  publish failed or was refused after the catalog commit, unless main has moved
  on since (another publisher's, whose publication the store recorded).
- `forget` removes a pruned version's branch, expires every snapshot no branch
  reaches any more, and deletes the files only those snapshots used
  (`expire_snapshots` by itself deletes no file): a file a kept version shares
  stays. The version's shard files in staging, and its copies that no kept snapshot
  uses (a publish that stopped before its commit), go with it.

A row's `version` column names the version that wrote its file: a row shared from
the base version names the base. What the table shows is the version its main's
snapshot names (`batchline.version` in its summary), as the store says.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from batchline.errors import BatchlineError, SpecError, one_line
from batchline.sources.base import DatasetName, StoreDatasets
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
from batchline.spec import JobSpec, JobVersion, canonical_json
from batchline.spec.model import region_refusal
from batchline.spec.ports import Staging
from batchline.spec.reader import Fields, ParseContext, SpecReader
from batchline.store import ReaderStore, StoredDeadLetter, StoredResult, StoreHandle
from batchline.store.files import ShardColumns, ShardUnit
from batchline.targets.base import TargetFamily
from batchline.targets.columns import acl_value, converted_outputs
from batchline.targets.files import (
    CheckedFile,
    ShardFileRefused,
    check_shard_files,
    copy_checked_file,
    shard_file_location,
    under,
    validated_files,
    version_prefix,
    write_shard_file,
)
from batchline.targets.iceberg_schema import (
    CARRY_COLUMN,
    ORIGIN_COLUMN,
    PROVENANCE_COLUMN,
    acl_is_text,
    acl_values,
    carry_values,
    converter,
    iceberg_schema,
    origin_values,
    output_node,
    output_values,
    provenance_values,
    schema_change,
)

BATCH_ROWS = 50_000
COMMIT_TRIES = 5  # a catalog commit that lost a race is tried again this many times in all
BASELINE = "batchline.baseline"
NAME_MAPPING = "schema.name-mapping.default"
VERSION_PROPERTY = "batchline.version"
# Each commit writes a metadata file; keep the last hundred, as readers may still hold one.
TABLE_PROPERTIES = {"write.metadata.delete-after-commit.enabled": "true",
                    "write.metadata.previous-versions-max": "100"}


def _commit_failed() -> type[Exception]:
    from pyiceberg.exceptions import CommitFailedException

    return CommitFailedException


class IcebergTable:
    def __init__(self, ref: TableRef, store_url: str | None = None,
                 storage: Mapping[str, Any] | None = None, *, staging: Staging | None = None) -> None:
        self.ref = ref
        self.staging = staging  # where the version's workers wrote their shard files (files: per-shard)
        self.store_url = store_url
        # The job's input.storage: where its object store is (a warehouse in S3 is reached
        # with the same endpoint and region as the job's input).
        self.storage = dict(storage or {})

    @property
    def key(self) -> str:
        return f"iceberg:{self.ref.catalog}/{self.ref.name}"

    def describe(self) -> str:
        return self.ref.describe()

    def claim(self, name: str, store: StoreHandle) -> None:
        """At the table's location (where a catalog would put it, for one not made yet): a
        second store's own catalog (`catalog: store`) would otherwise register a table of its
        own over the same files."""
        from batchline.lake import lake_settings
        from batchline.targets.owner import OWNER_FILE, Owner, claim

        with open_catalog(self.ref, self.store_url, self.storage) as catalog:
            table = load_table(catalog, self.ref)
            if table is not None:
                location = table.location()
            else:
                namespace, table_name = self.ref.name.rsplit(".", 1)
                try:
                    catalog.create_namespace_if_not_exists(namespace)  # as staging makes it: its location says
                    location = catalog._resolve_table_location(None, namespace, table_name)
                except Exception as exc:  # a catalog that places tables itself (REST) cannot say before
                    raise BatchlineError(f"{self.describe()}: cannot tell where the catalog would make the table, "
                                         f"so cannot record this store as its owner ({one_line(exc)}); make the "
                                         f"table first, or name its warehouse") from None
        claim(f"{_local(location).rstrip('/')}/{OWNER_FILE}", Owner.of(store), self.describe(),
              lake_settings(self.storage))

    # --- stage ---------------------------------------------------------------------

    def stage(self, store: ReaderStore, job: JobVersion) -> bool:
        version, spec = job.version, job.spec
        with open_catalog(self.ref, self.store_url, self.storage) as catalog:
            written: dict[str, list[Any]] = {}  # files of this version written so far, kept across tries
            pins: dict[str, dict[str, Any]] = {}  # the copies of the workers' files made so far, by location
            for attempt in range(COMMIT_TRIES):
                table = load_table(catalog, self.ref)
                if table is not None and version in table.metadata.refs:
                    return False  # staged before: a branch is written in one commit, so it is whole
                table = self._table_for(catalog, spec, table)
                try:
                    if table.metadata.current_snapshot_id is None:
                        table.append(_empty(table), snapshot_properties={BASELINE: "true"})
                        continue
                    layout = self._layout(table, store, job, written, pins)
                    layout.commit(table, {VERSION_PROPERTY: version, "batchline.name": job.name}, pins)
                    self._remove_orphans(version, layout, spec.shards.lease_seconds)
                    return True
                except _commit_failed() as exc:
                    if attempt == COMMIT_TRIES - 1:
                        raise BatchlineError(f"{self.describe()}: writing {version} lost {COMMIT_TRIES} races to "
                                             f"other writers ({one_line(exc)}); publish again") from None
        raise BatchlineError(f"{self.describe()}: {version} was not written in {COMMIT_TRIES} tries; publish again")

    def _layout(self, table: Any, store: ReaderStore, job: JobVersion, written: dict[str, list[Any]],
                pins: dict[str, dict[str, Any]]) -> Layout:
        """The version's data files, a shard's rows to a file: the base version's file of a shard
        whose every outcome was carried from it (of the same identity and row shape), else a new
        file written from the store. Files written in an earlier try are not written again."""
        from pyiceberg.io.pyarrow import _dataframe_to_data_files

        version, spec = job.version, job.spec
        acl_text = acl_is_text(table.schema())
        shape = row_shape(spec, acl_text)
        base = base_files(table, spec.base_version, shape) if spec.base_version else {}
        rows = TableRows(table.schema().as_arrow(), spec, version, acl_text=acl_text)
        checked = self._checked_files(store, job)
        write_uuid, counter = uuid.uuid4(), itertools.count()
        layout = Layout(shape)
        def write(results: list[StoredResult], dead: list[StoredDeadLetter]) -> list[Any]:
            if not results and not dead:
                return []
            return list(_dataframe_to_data_files(table.metadata, rows.table(results, dead), table.io, write_uuid,
                                                 counter))

        for unit in store.shard_units(version):
            shared = base.get(unit.identity) if unit.all_carried else None
            if shared is not None and not all(self._publishers(table, f.file_path) for f in shared):
                shared = None  # a worker's file a base published where it was staged: written anew here
            if shared is not None:
                layout.add(unit.identity, shared, reused=True)
                continue
            if unit.identity not in written:
                written[unit.identity] = self._unit_files(table, store, version, unit, write, checked, pins)
            layout.add(unit.identity, written[unit.identity], reused=False)
        return layout

    def _remove_orphans(self, version: str, layout: Layout, lease_seconds: float) -> None:
        """Shard files of the version that no snapshot uses (a stale owner's, whose completion was
        refused), once older than a lease: a stale owner still writing would have lost its lease
        by then. Those newer go when the version is forgotten."""
        if self.staging is None:
            return
        from batchline.sources import delete, listing

        used = {_local(f.file_path) for files in layout.units.values() for f in files}
        cutoff = time.time() - lease_seconds
        for prefix in self._version_prefixes(version):
            for location, written_at in listing(prefix, self.storage):
                if _local(location) not in used and written_at < cutoff and under(location, prefix):
                    delete(location, self.storage)

    def _publishers(self, table: Any, location: str) -> bool:
        """`location` lies where only the publisher writes: under the table's location and under no
        staging prefix."""
        # A folder's own path is tested without its closing `/`, as `under` reads a local path.
        here = location.rstrip("/")
        return under(here, f"{table.metadata.location.rstrip('/')}/") and not any(
            under(here, f"{p.rstrip('/')}/") for p in (self.staging.prefixes if self.staging else []))

    def _copy_prefix(self, table: Any, version: str) -> str:
        """Where the version's checked shard files are copied (`copy_prefix`), refused by name where
        a staging prefix covers it: the workers could write the copies there."""
        prefix = copy_prefix(table.metadata.location, version)
        if not self._publishers(table, prefix):
            covering = next((p for p in (self.staging.prefixes if self.staging else [])
                             if under(prefix.rstrip("/"), f"{p.rstrip('/')}/")), "of a worker")
            raise ShardFileRefused(f"{self.describe()}: the table's location {table.metadata.location} lies under "
                                   f"the staging prefix {covering}, which workers may write: the published copies "
                                   "of their files would be in their reach; give output.table.staging outside the "
                                   "table's location; nothing was published")
        return prefix

    def _version_prefixes(self, version: str) -> list[str]:
        """The version's own staging prefixes, one per region's staging."""
        return [version_prefix(p, version) for p in self.staging.prefixes] if self.staging is not None else []

    def _checked_files(self, store: ReaderStore, job: JobVersion) -> dict[int, CheckedFile]:
        """The workers' shard files as a passing validation checked them against the store; where
        none did (a publish with --force, or a validation made before files were checked), they
        are checked here, in full, and one that is not the store's rows refuses the publish."""
        if self.staging is None:
            return {}
        latest = store.latest_validation(job.version)
        checked = validated_files(latest.report if latest is not None else None, self.key)
        if checked is not None:
            return checked
        output = next(t for t in job.spec.targets if isinstance(t, TableOutput) and t.ref == self.ref)
        checked, problems = check_shard_files(store, job, output, self.key, self.storage)
        if problems:
            raise ShardFileRefused(f"{problems[0]}{f' (and {len(problems) - 1} more)' if len(problems) > 1 else ''}; "
                                   "nothing was published")
        return checked

    def _unit_files(self, table: Any, store: ReaderStore, version: str, unit: ShardUnit,
                    write: Callable[[list[StoredResult], list[StoredDeadLetter]], list[Any]],
                    checked: Mapping[int, CheckedFile], pins: dict[str, dict[str, Any]]) -> list[Any]:
        """A shard's files: the publisher's copy of the one its completing worker wrote (files:
        per-shard), made of the bytes the check pinned, and a file of the results carried into
        it; or, for a shard no worker wrote, one file of its rows written here."""
        from pyiceberg.io.pyarrow import parquet_file_to_data_file

        recorded = (unit.files or {}).get(self.key) if self.staging else None
        if recorded is None:
            return write(*store.shard_outcomes(version, unit.shard_no))
        path = str(recorded.get("path")) if isinstance(recorded, Mapping) else "(no path)"
        known = checked.get(unit.shard_no)
        problem: str | None = None
        if known is None:
            problem = "it was not checked against the store's rows (it was recorded after the validation)"
        elif known.path != path or recorded.get("pin") != dict(known.pin):
            problem = f"its record changed since it was checked (checked: {known.path})"
        else:
            destination = self._copy_prefix(table, version) + path.rstrip("/").rsplit("/", 1)[-1]
            copied = copy_checked_file(known, destination, self.storage)
            if isinstance(copied, str):
                problem = copied
            else:
                pins[destination] = copied
        if problem is None:
            added = parquet_file_to_data_file(table.io, table.metadata,
                                              destination if "://" in destination else f"file://{destination}")
            if added.record_count != int(recorded["rows"]):
                problem = f"it holds {added.record_count:,} rows, not {int(recorded['rows']):,} as its worker wrote"
        if problem is not None:
            raise ShardFileRefused(f"{self.describe()}: the file of shard {unit.shard_no} of {version}, {path}, "
                                   f"{problem}; nothing was published (its rows are in the store: validate again, "
                                   "or make the file again by running that shard's worker again)")
        if not unit.carried:
            return [added]
        results, _dead = store.shard_outcomes(version, unit.shard_no)
        return [added, *write([r for r in results if r.origin is not None], [])]

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
        added = _adds_columns(table.schema(), wanted)
        if added:
            with table.update_schema() as update:
                update.union_by_name(wanted)
            table = catalog.load_table(self.ref.name)
        if self.staging is not None and (added or NAME_MAPPING not in table.metadata.properties):
            # Workers' shard files have no field ids (no worker reaches the catalog): readers map
            # their columns by name, through the table's name mapping, which must name every
            # column the table has now.
            with table.transaction() as txn:
                txn.set_properties({NAME_MAPPING: table.schema().name_mapping.model_dump_json()})
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
            ref = table.metadata.refs.get(version)
            if ref is not None and table.metadata.current_snapshot_id == ref.snapshot_id:
                return None  # this publish's own commit, which a publisher stopped before the store recorded it
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
                # No snapshot of it: what a publish that stopped before its commit left (copies,
                # and the workers' files), unless a kept snapshot uses it.
                self._forget_staging(version, lambda: {_local(p) for p in _files_of(
                    table, [s for s in meta.snapshots if s.snapshot_id in reached])}, table)
                return
            gone = _files_of(table, expired)
            kept = _files_of(table, [s for s in meta.snapshots if s.snapshot_id in reached])
            ours = self._own_prefixes(table, meta.snapshots)
            table.maintenance.expire_snapshots().by_ids([s.snapshot_id for s in expired]).commit()
            for path in sorted(gone - kept):
                if not any(under(path, prefix) for prefix in ours):
                    continue  # not the table's own, nor the expired versions' staging: never deleted here
                with contextlib.suppress(FileNotFoundError):
                    table.io.delete(path)
            kept_here = {_local(p) for p in kept}
            self._forget_staging(version, lambda: kept_here, table)

    def _own_prefixes(self, table: Any, snapshots: list[Any]) -> list[str]:
        """Where a file that expiring snapshots frees may be deleted: under the table's own location,
        and under the staging prefix of each version of `snapshots` (the table's: a version shares
        its base's shard files, which lie under the base's prefix)."""
        own = [f"{table.metadata.location.rstrip('/')}/"]
        for snapshot in snapshots:
            props = snapshot.summary.additional_properties if snapshot.summary else {}
            if props.get(VERSION_PROPERTY):
                own.extend(self._version_prefixes(props[VERSION_PROPERTY]))
        return own

    def _forget_staging(self, version: str, kept: Callable[[], set[str]], table: Any) -> None:
        """What is left of the version's shard files in staging (each copied, or a stale owner's),
        and of its copies, that no kept snapshot uses (`kept()`, read only where a file is found)."""
        from batchline.sources import delete, listing

        prefixes = [*self._version_prefixes(version), _local(copy_prefix(table.metadata.location, version))]
        keep: set[str] | None = None
        for prefix in prefixes:
            for location, _written_at in listing(prefix, self.storage):
                if keep is None:
                    keep = kept()
                if _local(location) not in keep and under(location, prefix):
                    delete(location, self.storage)


# --- files shared between versions ----------------------------------------------------------

SHAPE_PROPERTY = "batchline.shape"
FILES_PROPERTY = "batchline.files"


def row_shape(spec: JobSpec, acl_text: bool) -> str:
    """What a version's rows hold besides their records' outcomes: the output's columns, the carried
    fields, provenance, and how the ACL is written. Files are shared only between versions of one shape."""
    material = canonical_json({"schema": dict(spec.output_schema), "carry": list(spec.input.carry),
                               "provenance": spec.provenance, "acl_text": acl_text})
    return hashlib.sha256(material.encode()).hexdigest()[:16]


class Layout:
    """A version's data files by the identity of the shard whose rows each holds."""

    def __init__(self, shape: str) -> None:
        self.shape = shape
        self.units: dict[str, list[Any]] = {}
        self.reused = 0
        self.written = 0

    def add(self, identity: str, files: list[Any], *, reused: bool) -> None:
        self.units[identity] = files
        if reused:
            self.reused += len(files)
        else:
            self.written += len(files)

    def commit(self, table: Any, properties: dict[str, str], pins: Mapping[str, Mapping[str, Any]]) -> None:
        """One snapshot of the version's branch holding every file, and beside the table's metadata
        the map of its files by shard identity that the next incremental version reads, with the
        pin of each copy of a worker's file (`pins`, by location) as it was written."""
        path = f"{table.metadata.location}/metadata/batchline-{uuid.uuid4().hex}.files.json"
        paths = {f.file_path for files in self.units.values() for f in files}
        copies = {where: dict(pin) for where, pin in pins.items()
                  if where in paths or f"file://{where}" in paths}
        with table.io.new_output(path).create(overwrite=True) as out:
            out.write(json.dumps({"shape": self.shape, "units": {
                identity: [f.file_path for f in files] for identity, files in self.units.items()},
                **({"copies": copies} if copies else {})}).encode())
        properties = {**properties, SHAPE_PROPERTY: self.shape, FILES_PROPERTY: path,
                      "batchline.files-shared": str(self.reused), "batchline.files-written": str(self.written)}
        version = properties[VERSION_PROPERTY]
        with table.transaction() as txn, \
                txn.update_snapshot(snapshot_properties=properties, branch=version).fast_append() as append:
            for files in self.units.values():
                for f in files:
                    append.append_data_file(f)


def base_files(table: Any, base: str, shape: str) -> dict[str, list[Any]]:
    """The data files of the base version's branch, by shard identity (none where the base was
    staged with another row shape, or before files were laid out by shard)."""
    ref = table.metadata.refs.get(base)
    snapshot = table.metadata.snapshot_by_id(ref.snapshot_id) if ref is not None else None
    props = snapshot.summary.additional_properties if snapshot is not None and snapshot.summary else {}
    if snapshot is None or props.get(SHAPE_PROPERTY) != shape or not props.get(FILES_PROPERTY):
        return {}
    try:
        with table.io.new_input(props[FILES_PROPERTY]).open() as f:
            units: dict[str, list[str]] = json.loads(f.read())["units"]
    except (OSError, ValueError, KeyError):
        return {}  # its map is gone: every file of the version is written anew
    by_path = {}
    for manifest in snapshot.manifests(table.io):
        for entry in manifest.fetch_manifest_entry(table.io):
            by_path[entry.data_file.file_path] = entry.data_file
    return {identity: [by_path[p] for p in paths] for identity, paths in units.items()
            if all(p in by_path for p in paths)}


# Under the table's data folder, the publisher's copies of the workers' checked shard files.
COPIES_FOLDER = "batchline-shards"


def copy_prefix(table_location: str, version: str) -> str:
    """Where the publisher copies a version's checked shard files: the table's own data folder,
    which only the publisher writes (see `copy_checked_file`), a folder per version."""
    return f"{table_location.rstrip('/')}/data/{COPIES_FOLDER}/{version}/"


def _local(path: str) -> str:
    """A data file's location as a table names it (`file:///...`) or as a listing does."""
    return path[len("file://"):] if path.startswith("file://") else path


def unnumbered(schema: Any) -> Any:
    """An Arrow schema without the Iceberg field ids in its fields' metadata (a worker's shard file
    is mapped to the table's columns by name)."""
    import pyarrow as pa

    def field(f: Any) -> Any:
        kind = f.type
        if pa.types.is_struct(kind):
            kind = pa.struct([field(sub) for sub in kind])
        elif pa.types.is_list(kind) or pa.types.is_large_list(kind):
            kind = pa.list_(field(kind.value_field))
        return pa.field(f.name, kind, nullable=f.nullable)

    return pa.schema([field(f) for f in schema])


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


def check_table_schema(ref: TableRef, spec: JobSpec, store_url: str | None, *, per_shard: bool = False) -> None:
    """At planning: a version whose output would change the table other than by adding
    columns is refused, with one line naming the column; and workers' shard files for a table
    whose ACL column is JSON text (made before ACLs were lists), which they could not write."""
    with open_catalog(ref, store_url, spec.input.storage) as catalog:
        table = load_table(catalog, ref)
        if table is None:
            return
        have = table.schema()
        if per_shard and acl_is_text(have):
            raise SpecError(f"output.table {ref.name}: its acl column is JSON text (the table was made before ACLs "
                            f"were lists), which workers' shard files do not write: leave files: {PER_SHARD} out")
        change = schema_change(have, iceberg_schema(spec.output_schema, acl_text=acl_is_text(have),
                                                    carry=spec.input.carry, provenance=spec.provenance))
    if change is not None:
        raise SpecError(f"output.table {ref.name}: {change}; only new columns may be added")


# --- rows -------------------------------------------------------------------------------


def _empty(table: Any) -> Any:
    return table.schema().as_arrow().empty_table()


class TableRows:
    """A version's results and dead letters as Arrow batches of the table's schema (`schema`)."""

    def __init__(self, schema: Any, spec: JobSpec, version: str, *, acl_text: bool) -> None:
        self.schema = schema
        self.version = version
        self.acl_text = acl_text
        self.convert = converter(output_node(spec.output_schema))
        self.has_output = "output" in schema.names
        self.carries = bool(spec.input.carry) and CARRY_COLUMN in schema.names
        self.provenance = spec.provenance and PROVENANCE_COLUMN in schema.names
        self.default_model = spec.model.label

    def _batch(self, n: int, columns: dict[str, Any]) -> Any:
        import pyarrow as pa

        # Built a column at a time: a dict per row cost more than reading the store did.
        def array(f: Any) -> Any:
            if f.name not in columns:
                return pa.nulls(n, type=f.type)
            given = columns[f.name]
            if isinstance(given, pa.Array):
                return given if given.type == f.type else given.cast(f.type)
            return pa.array(given, type=f.type)

        arrays = [array(f) for f in self.schema]
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema)

    def results(self, rows: list[StoredResult]) -> Any:
        n, version = len(rows), self.version
        return self._batch(n, {
            "id": [r.record_id for r in rows], "outcome": ["result"] * n,
            **({"output": output_values(rows, self.convert, version)} if self.has_output else {}),
            "raw_output": [r.output for r in rows], "acl": acl_values(rows, self.acl_text), "version": [version] * n,
            ORIGIN_COLUMN: origin_values(rows, version),
            "model": [r.model or self.default_model for r in rows], "label": [r.label for r in rows],
            "attempt": [r.attempt for r in rows], "input_tokens": [r.input_tokens for r in rows],
            "output_tokens": [r.output_tokens for r in rows],
            "created_at": _microseconds([r.created_at for r in rows]),
            **({CARRY_COLUMN: carry_values(rows)} if self.carries else {}),
            **({PROVENANCE_COLUMN: provenance_values(rows, version)} if self.provenance else {})})

    def dead_letters(self, rows: list[StoredDeadLetter]) -> Any:
        n = len(rows)
        return self._batch(n, {
            "id": [d.record_id for d in rows], "outcome": ["dead_letter"] * n, "acl": acl_values(rows, self.acl_text),
            "version": [self.version] * n, ORIGIN_COLUMN: [self.version] * n, "attempt": [d.attempts for d in rows],
            "created_at": _microseconds([d.created_at for d in rows]),
            "error_kind": [d.kind for d in rows], "error": [d.error for d in rows],
            **({CARRY_COLUMN: carry_values(rows)} if self.carries else {})})

    def from_columns(self, c: ShardColumns) -> Any:
        """`table`'s rows for a shard with no carried field and no provenance, from the store's
        columns instead of a row object each: the same values, made a column at a time."""
        import pyarrow as pa

        assert not self.carries and not self.provenance
        n, m, version = len(c.ids), len(c.dead_ids), self.version
        acl_type = self.schema.field("acl").type
        batches = []
        if n:
            batches.append(self._batch(n, {
                "id": c.ids, "outcome": ["result"] * n,
                **({"output": self._typed(c.ids, c.outputs)} if self.has_output else {}),
                "raw_output": c.outputs, "acl": _acls(c.acls, acl_type, self.acl_text), "version": [version] * n,
                ORIGIN_COLUMN: [version] * n,  # a shard's columns are what its worker computed: none carried
                "model": [m or self.default_model for m in c.models], "label": c.labels, "attempt": c.attempts,
                "input_tokens": c.input_tokens, "output_tokens": c.output_tokens,
                "created_at": _microseconds(c.created_at)}))
        if m:
            batches.append(self._batch(m, {
                "id": c.dead_ids, "outcome": ["dead_letter"] * m, "acl": _acls(c.dead_acls, acl_type, self.acl_text),
                "version": [version] * m, ORIGIN_COLUMN: [version] * m, "attempt": c.dead_attempts,
                "created_at": _microseconds(c.dead_created_at),
                "error_kind": c.dead_kinds, "error": c.dead_errors}))
        return pa.Table.from_batches(batches, schema=self.schema)

    def _typed(self, ids: list[str], outputs: list[str]) -> Any:
        """The `output` column from the outputs' JSON text: parsed by Arrow's own JSON reader where
        every value goes in as it is (no converter, one line each), else as `results` does."""
        import pyarrow as pa
        import pyarrow.json as pj

        kind = self.schema.field("output").type
        data = "\n".join(outputs).encode() if self.convert is None else b""
        if self.convert is None and data.count(b"\n") == len(outputs) - 1:
            try:
                parsed = pj.read_json(pa.BufferReader(data), parse_options=pj.ParseOptions(
                    explicit_schema=pa.schema(list(kind)), unexpected_field_behavior="ignore"))
                if parsed.num_rows == len(outputs):
                    return pa.StructArray.from_arrays([parsed.column(f.name).combine_chunks() for f in kind],
                                                      fields=list(kind))
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                pass  # what Arrow's reader will not take, the row-by-row conversion says why
        return pa.array(converted_outputs(ids, outputs, self.convert, self.version), type=kind)

    def table(self, results: list[StoredResult], dead: list[StoredDeadLetter]) -> Any:
        """One shard's rows: its results, then its dead letters."""
        import pyarrow as pa

        batches = [*([self.results(results)] if results else []), *([self.dead_letters(dead)] if dead else [])]
        return pa.Table.from_batches(batches, schema=self.schema)


def _acls(texts: list[str | None], kind: Any, as_text: bool) -> Any:
    """The `acl` column from the store's ACL texts: each distinct one read once (`Acl.from_json`,
    as a stored result's is), then taken by index (Arrow finds the distinct ones)."""
    import pyarrow as pa

    from batchline.acl import Acl

    encoded = pa.array(texts, type=pa.string()).dictionary_encode()
    values = [acl_value(None if t is None else Acl.from_json(t), as_text) for t in encoded.dictionary.to_pylist()]
    # A missing ACL is a null index; a null of the column's type where it is taken.
    return pa.array(values, type=kind).take(encoded.indices)


def _microseconds(seconds: list[float]) -> Any:
    """The `created_at` column from the store's seconds: each times a million, truncated toward
    zero (as `int(t * 1_000_000)` would), made by Arrow."""
    import pyarrow as pa
    import pyarrow.compute as pc

    product = pc.multiply(pa.array(seconds, type=pa.float64()), 1_000_000.0)
    return pc.cast(product, pa.int64(), safe=False)


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


PER_SHARD = "per-shard"
# What the output's table section holds besides the table's own fields.
OUTPUT_TABLE_FIELDS: Fields = {
    "files": {"enum": [PER_SHARD], "description": "per-shard: each worker writes its completed shard's file into "
                                                  "the staging prefix; publishing copies each checked file into the "
                                                  "table's location, out of the workers' reach, and adds the copies"},
    "staging": {"anyOf": [{"type": "string", "minLength": 1},
                          {"type": "object", "minProperties": 1, "additionalProperties": {"type": "string"}}],
                "description": "Where workers write shard files (a folder or an s3:// or gs:// prefix; default: "
                               "the warehouse's batchline-staging), or REGION: prefix for each region's workers "
                               "(the first for a worker of no region or of another)"},
}


@dataclass(frozen=True)
class TableOutput:
    """`output.table`: the Iceberg table a published version's results go to; with `files:
    per-shard`, written by the workers a shard at a time under `staging`."""

    ref: TableRef
    files: str | None = None
    staging: Staging | None = None

    def describe(self) -> str:
        return self.ref.describe()

    def to_dict(self) -> dict[str, Any]:
        return {"table": {**self.ref.to_dict(), **({"files": self.files, "staging": self.staging.to_json()}
                                                   if self.files and self.staging is not None else {})}}

    def target(self, store_url: str | None, storage: Mapping[str, Any]) -> IcebergTable:
        return IcebergTable(self.ref, store_url, storage, staging=self.shard_files())

    def check(self, spec: JobSpec, store_url: str | None) -> None:
        check_table_schema(self.ref, spec, store_url, per_shard=self.files == PER_SHARD)

    def shard_files(self) -> Staging | None:
        return self.staging if self.files == PER_SHARD else None

    def write_shard_file(self, spec: JobSpec, version: str, shard_no: int, epoch: int,
                         results: Sequence[StoredResult], dead_letters: Sequence[StoredDeadLetter],
                         storage: Mapping[str, Any], region: str | None = None) -> dict[str, Any]:
        """The shard's rows (`shard_rows`) as one file named by the version, shard and epoch, under
        the staging prefix of the worker's region."""
        assert self.staging is not None
        rows = self.shard_rows(spec, version, results, dead_letters)
        location = shard_file_location(self.staging.prefix_for(region), version, shard_no, epoch)
        return write_shard_file(location, rows, storage)

    def _file_rows(self, spec: JobSpec, version: str) -> TableRows:
        # The table's columns as `iceberg_schema` makes them from the spec (a worker reaches no
        # catalog), without field ids: publishing maps a file's columns by name.
        arrow = unnumbered(iceberg_schema(spec.output_schema, carry=spec.input.carry,
                                          provenance=spec.provenance).as_arrow())
        return TableRows(arrow, spec, version, acl_text=False)

    def shard_rows(self, spec: JobSpec, version: str, results: Sequence[StoredResult],
                   dead_letters: Sequence[StoredDeadLetter]) -> Any:
        """A shard's rows in its file's columns: what its worker writes."""
        return self._file_rows(spec, version).table(list(results), list(dead_letters))

    def stored_shard_rows(self, store: ReaderStore, spec: JobSpec, version: str) -> Callable[[int], Any]:
        """The rows the file of each shard must hold, from the store: what it is checked against.
        Read column by column where the rows carry no input field and no provenance (a million
        rows in seconds), else through `shard_rows` itself."""
        rows = self._file_rows(spec, version)
        if rows.carries or rows.provenance:
            return lambda shard_no: rows.table(*store.shard_outcomes(version, shard_no, computed_only=True))
        return lambda shard_no: rows.from_columns(store.shard_columns(version, shard_no))

    def dataset(self, name: str, store: StoreDatasets, state: Mapping[str, Any] | None) -> DatasetName:
        snapshot = (state or {}).get("snapshot_id")
        return self.ref.dataset(store, str(snapshot) if snapshot is not None else None)


def _staging(r: SpecReader, given: Any, ctx: ParseContext) -> Staging:
    """`output.table.staging`: one prefix, or REGION: prefix (each resolved as a path or URL)."""

    def resolved(text: str) -> str:
        return (text if "://" in text else str((ctx.base_dir / text).resolve())).removeprefix("file://")

    if isinstance(given, dict):
        if not given:
            r.fail("output.table.staging", "names no region; give a prefix, or REGION: prefix for each")
        by_region = []
        for region, prefix in given.items():
            where = f"output.table.staging.{region}"
            why = region_refusal(region)
            if why is not None:
                r.fail(where, why)
            by_region.append((str(region), resolved(r.string(prefix, where))))
        return Staging(tuple(by_region))
    return Staging.one(resolved(r.string(given, "output.table.staging")))


class IcebergOutput(TargetFamily):
    """An Apache Iceberg table (write, audit, publish)."""

    name = "iceberg"
    keys: ClassVar[Fields] = {"table": table_schema(
        {**TABLE_FIELDS, **OUTPUT_TABLE_FIELDS}, "An Apache Iceberg table whose main follows the published version")}

    def parse(self, key: str, section: Mapping[str, Any], r: SpecReader, ctx: ParseContext) -> TableOutput:
        ref = parse_table(r, section[key], "output.table", ctx.base_dir, extra=OUTPUT_TABLE_FIELDS)
        raw = section[key]
        files = raw.get("files")
        if files is not None and files != PER_SHARD:
            r.fail("output.table.files", f"must be {PER_SHARD}, not {files!r}")
        given = raw.get("staging")
        if given is not None and files is None:
            r.fail("output.table.staging", f"is where workers write shard files: give files: {PER_SHARD} too")
        if files is not None and given is None:
            if ref.warehouse is None:
                r.fail("output.table.staging", f"is required with files: {PER_SHARD} where no warehouse is given: "
                                               "where workers write their shard files")
            given = f"{ref.warehouse.rstrip('/')}/batchline-staging"
        if given is None:
            return TableOutput(ref, files, None)
        staging = _staging(r, given, ctx)
        # The warehouse as the table's section was read: a URL (file:// for a folder).
        warehouse = (ref.warehouse or "").rstrip("/")
        for prefix in staging.prefixes if warehouse else []:
            if warehouse == f"file://{prefix.rstrip('/')}" or warehouse == prefix.rstrip("/") or \
                    under(warehouse, f"{prefix.rstrip('/')}/"):
                # Workers may write under the staging prefix: the table's files, and the copies of
                # theirs the publisher makes there, would be in their reach.
                r.fail("output.table.staging", f"{prefix} holds the warehouse {ref.warehouse}, where the published "
                                               "copies of the workers' files lie: give a prefix beside it (the "
                                               "default is the warehouse's batchline-staging)")
        return TableOutput(ref, files, staging)

    def access(self, section: Mapping[str, Any]) -> list[str]:
        output = section.get("table")
        if not output:
            return []
        sql = output["catalog"] == STORE_CATALOG or not str(output.get("uri", "")).startswith(("http://", "https://"))
        rights = ("SELECT, INSERT, UPDATE and DELETE on the catalog's tables iceberg_tables and "
                  "iceberg_namespace_properties" + (" (in the store's database; the worker role made here has none)"
                                                    if output["catalog"] == STORE_CATALOG else "")
                  if sql else "the catalog's right to create, load and commit to that table")
        given = output.get("staging") if output.get("files") == PER_SHARD else None
        staging = ", ".join(given.values()) if isinstance(given, dict) else given
        worker = (f"the worker needs no catalog right, only to write objects under {staging}/VERSION/ (each "
                  "completed shard's file, named by the version, the shard and the lease epoch), and nothing under "
                  "the table's location, where the publisher copies each checked file: give it no right there"
                  if staging else "the worker needs nothing of it")
        return [f"output table {output['name']} (catalog {output['catalog']!r}): {worker}; the "
                f"publisher (publish, rollback, retention) needs {rights}, and to write and delete files under the "
                f"table's location{' in ' + output['warehouse'] if output.get('warehouse') else ''} (it writes each "
                "version's data and metadata files, the copies of the workers' checked shard files under "
                f"data/{COPIES_FOLDER}/ included, and deletes pruned versions' files)"
                + (f", and to read and delete those under {staging}" if staging else "")]

    def pod_refusal(self, section: Mapping[str, Any], where: str) -> str | None:
        table = section.get("table")
        staging = table.get("staging") if isinstance(table, dict) and table.get("files") == PER_SHARD else None
        if staging is not None and "://" not in str(staging):
            return (f"output.table.staging: {staging} is a folder on this machine, where pods elsewhere cannot write "
                    "their shard files; give an s3:// or gs:// staging prefix")
        return table_refusal(table, "output.table")


ICEBERG = IcebergOutput()
