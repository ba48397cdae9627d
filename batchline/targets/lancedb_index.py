"""A published version's vectors in a LanceDB index, each row behind its record's ACL.

    URI/TABLE             one Lance table for every version of a job (TABLE: the job's name, or
                          output.index.table); each job version one Lance version of it, tagged
                          with the job version (NAME.HASH)

Each row holds the record's id, its vector (the output field `vector_field`,
an embedding engine's output), the chosen `fields` of the output, the record's
ACL (a list of groups), the job version that wrote it and, with output.provenance,
which attempt it is.

- `stage` makes the job version's Lance version and tags it once it is whole (its
  rows, then its indexes). An incremental version (`base`) whose base is tagged in
  the table, with rows of the same columns, is the base's Lance version made the
  latest again plus its changes: the rows that differ (new records, results
  computed again, another ACL or other carried values) upserted by id
  (`merge_insert`), and those of records gone deleted; the base's data files are
  shared, not copied. Otherwise the version's rows replace the table's in one
  commit (a new Lance version; older ones keep theirs). Then the indexes a search
  uses: a LABEL_LIST index on the ACL, so the groups filter runs before ranking,
  and from `approximate_min_rows` rows an IVF_PQ vector index; Lance's optimize adds
  new rows to existing indexes (no training again) and merges small files. A
  version's rows are counted before it is tagged: another stager writing into the
  table at the same time is refused, not mixed in. A stage that died before the tag
  is done again from the base.
- `show` checks that the version's tag is there and records its Lance version; it
  moves nothing. The store's pointer is the one truth (as for an Iceberg table's
  main): a search resolves the published version through the store and checks out
  that version's tagged Lance version, which nothing changes once tagged, so it
  answers from one version wholly, whatever a publish, rollback or stage does
  meanwhile. (A version staged before versions shared one table keeps its own table,
  which a search still reads.)
- `restore` has nothing to put back.
- `forget` removes a pruned version's tag, then Lance's cleanup removes the Lance
  versions older than every kept job version's, and with them the files no kept
  job version uses.

A search (`search`) ranks only rows whose ACL shares a group with the caller's:
`array_has_any(acl, [...])` as a prefilter (exact string equality, the groups
checked by `batchline.acl.caller_groups`), so k rows come back whenever k
visible rows exist. With the approximate index, a selective filter can leave the
probed partitions with fewer than k visible rows; then the search is run again
exactly (the `fallback` path). The approximate candidates are re-ranked with the
full vectors (`refine_factor`), so a record's own text ranks it first. A row
whose ACL is null matches no group and is never returned.

Where the rows came from a published job (`input.job`), the search is also given
`admit`: the check of each candidate against the ACL that job publishes now
(`batchline.publish.upstream.CurrentAcls`). Candidates it withholds are replaced
by further ones, fetched in rounds of four times as many, until k are admitted
or no visible row is left, so a revocation upstream never costs a caller the
rows they may still see.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Final

import orjson

from batchline.acl import MAX_K, Groups, check_k, group_filter
from batchline.errors import BatchlineError, SpecError, missing_extra, one_line
from batchline.sources.base import location_dataset
from batchline.store import ReaderStore, StoredResult, StoreHandle
from batchline.targets.base import Admit, Answer, Hit, PublisherWritten, Searchable, TargetFamily
from batchline.targets.columns import (
    ACL as ACL_COLUMN,
)
from batchline.targets.columns import (
    PROVENANCE,
    PROVENANCE_COLUMN,
    acl_values,
    arrow_type,
    provenance_values,
)

if TYPE_CHECKING:
    from batchline.sources.base import DatasetName, StoreDatasets
    from batchline.spec import JobVersion
    from batchline.spec.model import JobSpec
    from batchline.spec.reader import Fields, ParseContext, SpecReader

BATCH_ROWS = 10_000
# Columns of every row; a chosen field may not take one of these names.
ID, VECTOR, ACL, VERSION = "id", "vector", "acl", "version"
# Lance's own column of each hit's distance, named among the columns selected: Lance will
# otherwise stop adding it, and warns on every search that it will.
DISTANCE = "_distance"
RESERVED = (ID, VECTOR, ACL, VERSION)
METRIC: Final = "cosine"
DEFAULT_APPROXIMATE_MIN_ROWS = 50_000
# Where the ACL leaves at most this share of a version's rows visible, the search is exact:
# on 1,000,000 random unit vectors with 1% visible, exact answered in 159 ms at p50 and the
# approximate index, probing every partition, in 192 ms.
EXACT_BELOW_SHARE = 0.05
# On 1,000,000 random unit vectors, every partition probed: a refine factor of 30 kept 0.934 of
# the exact top 10 (p50 341 ms), 50 kept 0.969 (347 ms), 80 kept 0.981 (348 ms): re-ranking is
# cheap beside the scan of every partition, so recall is bought here.
DEFAULT_REFINE_FACTOR = 50
# A version built on its base deletes its changed rows from the base's files. Scattered over a
# file, deletions slow every search of it (200,000 rows: 2% deleted at random 1.10-1.15 times, 5%
# 1.19-1.24 times; 1,000,000 rows, 5%: 1.38 times; the last 5% deleted, one run of rows: 1.01-1.08
# times), and a file rewritten without them is searched as a full build's (1.04 times). So a file
# whose deleted rows reach this share is rewritten without them, its rows' index entries remapped,
# nothing trained again: bytes for search speed, which `rewrite_deleted_share` trades back.
DEFAULT_REWRITE_DELETED_SHARE = 0.03
# A field whose values are not one scalar type is kept as JSON text, marked so in its metadata.
JSON_FIELD = b"batchline.json"
_SCALAR_TYPES = ("string", "integer", "number", "boolean")


class IndexMissing(BatchlineError):
    """The version's table is not in the index (pruned meanwhile, or never staged)."""


def table_name(table: str, version: str) -> str:
    """The Lance table a version's rows are in: the index's table name and the version's hash."""
    return f"{table}-{version.rsplit('@', 1)[-1]}"


# The ways a search ranks: the vector index, every visible row, or every visible row after
# the vector index's probed partitions held too few.
IVF_PQ, EXACT, FALLBACK = "ivf_pq", "exact", "fallback"
# Withheld candidates are replaced by fetching this many times as many again.
REFILL_FACTOR = 4
# A search whose candidates are checked (`admit`) asks for this many times k at first.
CHECKED_MARGIN = 2


# --- the index ------------------------------------------------------------------------------


@dataclass(frozen=True)
class IndexOutput(PublisherWritten, Searchable):
    """`output.index`: where the versions' tables are and what their rows hold; searched
    through the search port (`Searchable`)."""

    uri: str
    table: str | None = None  # default: the job's name
    vector_field: str = "embedding"
    fields: tuple[str, ...] = ()
    approximate_min_rows: int = DEFAULT_APPROXIMATE_MIN_ROWS
    nprobes: int | None = None  # None: every partition of the version's vector index
    refine_factor: int = DEFAULT_REFINE_FACTOR
    rewrite_deleted_share: float = DEFAULT_REWRITE_DELETED_SHARE

    def describe(self) -> str:
        return f"LanceDB index under {self.uri}"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"uri": self.uri, "vector_field": self.vector_field, "fields": list(self.fields),
                               "approximate_min_rows": self.approximate_min_rows,
                               "refine_factor": self.refine_factor,
                               "rewrite_deleted_share": self.rewrite_deleted_share}
        if self.nprobes is not None:
            out["nprobes"] = self.nprobes
        if self.table is not None:
            out["table"] = self.table
        return {"index": out}

    def target(self, store_url: str | None, storage: Mapping[str, Any]) -> LanceIndex:
        return LanceIndex(self, storage)

    def dataset(self, name: str, store: StoreDatasets, state: Mapping[str, Any] | None) -> DatasetName:
        shown = state or {}
        at = shown.get("lance_version", shown.get("table"))
        return location_dataset(f"{self.uri.rstrip('/')}/{self.table or name}", str(at) if at is not None else None)

    def check(self, spec: JobSpec, store_url: str | None) -> None:
        import importlib.util

        try:
            import lancedb  # noqa: F401  # refused before any record is inferred, not at publish
            # pylance rewrites files without their deletions at publish; found, not imported: it
            # warns in every process that forks after importing it.
            if importlib.util.find_spec("lance") is None:
                raise ImportError("lance")
        except ImportError:
            raise SpecError(f"output.index: {missing_extra('Retrieval indexes', 'lancedb and pylance', 'index')}") from None
        upstream_props: dict[str, Any] = {}
        version = upstream_version(spec)
        if version is not None and store_url is not None:
            from contextlib import closing

            from batchline.store import open_store

            with closing(open_store(store_url, create=False)) as store:
                job = store.job(version)
            upstream_props = _properties(job.spec.get("output", {}).get("schema")) if job is not None else {}
        refusal = self.refusal(spec, upstream_props)
        if refusal is not None:
            raise SpecError(f"output.index: {refusal}")

    def refusal(self, spec: JobSpec, upstream: Mapping[str, Any] | None = None) -> str | None:
        """Why this index cannot take the job's results, or None; `upstream`: the output
        fields of the job it reads (input.job), which rows may hold too."""
        if spec.input.acl_field is None:
            return ("the job has no input.acl_field, and the index never holds a row nobody decided the access "
                    "of: name the records' ACL field (input.acl_missing says what a missing one means)")
        props = _properties(spec.output_schema)
        vector = props.get(self.vector_field)
        if not isinstance(vector, dict) or vector.get("type") != "array":
            return (f"vector_field {self.vector_field!r} is not an array in the output schema (an embedding "
                    f"engine's output is {{\"embedding\": [...]}})")
        for name in self.fields:
            if name not in props and name not in spec.input.carry and name not in (upstream or {}):
                have = sorted(props) + [f"{f} (carried)" for f in spec.input.carry] + \
                    [f"{f} (of input.job's output)" for f in sorted(upstream or {})]
                return f"field {name!r} is not in the output schema (it has {', '.join(have) or 'none'})"
        return None

    def table_for(self, name: str) -> str:
        return self.table or name

    def query_vector(self, output: str) -> list[float]:
        """The vector in the engine's output for a query, as a row's is read."""
        vector = orjson.loads(output).get(self.vector_field)
        if not isinstance(vector, list) or not vector:
            raise BatchlineError(f"the job's engine gave no {self.vector_field!r} vector for the query")
        return [float(v) for v in vector]

    def search(self, name: str, version: str, vector: Sequence[float], groups: Groups, k: int, *,
               storage: Mapping[str, Any], admit: Admit | None = None) -> Answer:
        """The published version's nearest rows the groups may see (see the module's doc)."""
        return LanceIndex(self, storage).search(name, version, vector, groups, k, admit=admit)


def _arrow_type(schema: Any) -> tuple[Any, bool]:
    """The column type of a field, and whether it holds JSON text."""
    import pyarrow as pa

    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):
        kinds = [k for k in kind if k != "null"]
        kind = kinds[0] if len(kinds) == 1 else None
    if kind is None and isinstance(schema, dict) and isinstance(schema.get("enum"), list) \
            and all(isinstance(v, str) for v in schema["enum"]):
        kind = "string"
    types = {"string": pa.string(), "integer": pa.int64(), "number": pa.float64(), "boolean": pa.bool_()}
    if kind in types:
        return types[kind], False
    return pa.string(), True


def _connect(uri: str, storage: Mapping[str, Any]) -> Any:
    try:
        import lancedb
    except ImportError:
        raise BatchlineError(missing_extra("Retrieval indexes (output.index, batchline search)", "lancedb",
                                           "index")) from None
    from batchline.sources import is_remote

    if not is_remote(uri):
        return lancedb.connect(uri)
    from batchline.lake import lake_settings

    return lancedb.connect(uri, storage_options=lake_settings(storage).object_store_options(uri.split(":", 1)[0]))


def _missing_table(exc: Exception) -> bool:
    text = str(exc).lower()
    return isinstance(exc, FileNotFoundError | ValueError) or "not found" in text or "does not exist" in text


@dataclass
class LanceIndex:
    output: IndexOutput
    storage: Mapping[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"lancedb:{self.output.uri}"

    def describe(self) -> str:
        return self.output.describe()

    def connect(self) -> Any:
        return _connect(self.output.uri, self.storage)

    def claim(self, name: str, store: StoreHandle) -> None:
        from batchline.lake import lake_settings
        from batchline.targets.owner import OWNER_FILE, Owner, claim

        table = self.output.table_for(name)
        claim(f"{self.output.uri.rstrip('/')}/{table}.{OWNER_FILE}", Owner.of(store),
              f"{self.describe()} (table {table!r})", lake_settings(self.storage))

    # --- stage ---------------------------------------------------------------------

    def stage(self, store: ReaderStore, job: JobVersion) -> bool:
        version, spec = job.version, job.spec
        db = self.connect()
        name = self.output.table_for(job.name)
        tag = version_tag(version)
        table = _open(db, name)
        if table is not None and tag in table.tags.list():
            return False  # tagged once its rows and indexes were whole
        upstream = _upstream_reader(store, spec)
        base = self._incremental_base(table, store, spec, version, upstream)
        if table is not None and base is not None:
            self._apply_changes(table, store, spec, version, base, upstream)
        else:
            schema, batches = self.rows(spec, version, store.iter_results(version), upstream)
            if table is None:
                write_table(db, name, schema, batches)
                table = db.open_table(name)
            else:
                import pyarrow as pa

                table.add(pa.RecordBatchReader.from_batches(schema, batches), mode="overwrite")
        want = store.status(version).results
        if table.count_rows() != want:
            raise BatchlineError(f"{self.describe()}: table {name!r} holds {table.count_rows():,} rows where {version} "
                                 f"has {want:,} results: another writer staged into it at the same time; publish again")
        finish_version(table, self.output, tag)
        return True

    def _incremental_base(self, table: Any | None, store: ReaderStore, spec: JobSpec, version: str,
                          upstream: Upstream | None) -> int | None:
        """The Lance version of the base version, where this version's rows are the base's with
        its changes: the base is tagged in the table, its rows have this version's columns, and
        the fields read from an upstream job are the same upstream version's."""
        base = spec.base_version
        if table is None or base is None or version_tag(base) not in table.tags.list():
            return None
        base_info = store.job(base)
        if base_info is None:
            return None
        from batchline.spec import stored_spec

        props = _properties(spec.output_schema)
        from_upstream = [n for n in self.output.fields if n not in props and n not in spec.input.carry]
        if from_upstream and upstream_version(stored_spec(base_info)) != upstream_version(spec):
            return None
        lance_version = int(table.tags.get_version(version_tag(base)))
        table.checkout(lance_version)
        have = table.schema
        table.checkout_latest()
        first = next(store.iter_results(version, page_size=1), None)
        if first is None:
            return None
        want, _rows = self.rows(spec, version, iter([first]), upstream)
        return lance_version if have.equals(want, check_metadata=True) else None

    def _apply_changes(self, table: Any, store: ReaderStore, spec: JobSpec, version: str, base: int,
                       upstream: Upstream | None) -> None:
        """The rows that differ from the base's, and the records gone (`apply_changes`)."""
        base_version = spec.base_version
        assert base_version is not None
        changed = store.result_rows_changed(base_version, version)

        def results() -> Iterator[StoredResult]:
            while chunk := list(itertools.islice(changed, BATCH_ROWS)):
                found = store.results_for(version, chunk)
                yield from (found[rid] for rid in chunk)

        rows = results()
        first = next(rows, None)
        upserts = self.rows(spec, version, itertools.chain([first], rows), upstream) if first is not None else None
        apply_changes(table, base, upserts, store.result_rows_removed(base_version, version))

    def rows(self, spec: JobSpec, version: str, results: Iterator[StoredResult],
             upstream: Upstream | None = None) -> tuple[Any, Iterator[Any]]:
        """The Arrow schema of the version's table and its rows in batches. A chosen field
        is the result's own output field, else (`upstream`, for a job over a job) the
        upstream result's. The vector's length is the first result's; a result of another
        length is refused by its id."""
        import pyarrow as pa

        props = _properties(spec.output_schema)
        theirs = upstream.properties if upstream is not None else {}
        # Where each field is read: this job's output, the carried input columns, the upstream's output.
        carried = [n for n in self.output.fields if n not in props and n in spec.input.carry]
        own = [n for n in self.output.fields if n not in carried and (n in props or n not in theirs)]
        columns = [(name, *((pa.string(), False) if name in carried else
                             _arrow_type(props.get(name) if name in own else theirs.get(name))))
                   for name in self.output.fields]
        first = next(results, None)
        dims = len(self._vector(first)) if first is not None else _schema_dims(props.get(self.output.vector_field))
        schema = pa.schema([
            pa.field(ID, pa.string(), nullable=False),
            pa.field(VECTOR, pa.list_(pa.float32(), dims)),
            *[pa.field(name, kind, metadata={JSON_FIELD: b"true"} if as_json else None)
              for name, kind, as_json in columns],
            pa.field(ACL, pa.list_(pa.string())),
            pa.field(VERSION, pa.string(), nullable=False),
            *([pa.field(PROVENANCE_COLUMN, arrow_type(PROVENANCE))] if spec.provenance else []),
        ])

        def batch(rows: list[StoredResult]) -> Any:
            outputs = [orjson.loads(r.output) for r in rows]
            if carried:
                outputs = [{**out, **{n: _carried((r.carry or {}).get(n)) for n in carried}}
                           if isinstance(out, dict) else out for r, out in zip(rows, outputs, strict=True)]
            if upstream is not None and len(own) + len(carried) < len(self.output.fields):
                found = upstream.outputs([r.record_id for r in rows])
                outputs = [{**{k: v for k, v in found.get(r.record_id, {}).items()
                               if k not in own and k not in carried}, **out}
                           if isinstance(out, dict) else out for r, out in zip(rows, outputs, strict=True)]
            vectors: list[float] = []
            for r, out in zip(rows, outputs, strict=True):
                vector = self._vector(r, out)
                if len(vector) != dims:
                    raise BatchlineError(f"{version}: record {r.record_id!r}: its {self.output.vector_field} has "
                                         f"{len(vector)} values, not {dims} as the first record's: an index holds "
                                         "vectors of one length")
                vectors.extend(vector)
            arrays = [pa.array([r.record_id for r in rows], pa.string()),
                      pa.FixedSizeListArray.from_arrays(pa.array(vectors, pa.float32()), dims)]
            for name, kind, as_json in columns:
                values = [out.get(name) if isinstance(out, dict) else None for out in outputs]
                if as_json:
                    values = [None if v is None else json.dumps(v, ensure_ascii=False, sort_keys=True)
                              for v in values]
                arrays.append(pa.array(values, kind))
            arrays.append(pa.array(acl_values(rows), arrow_type(ACL_COLUMN)))
            arrays.append(pa.array([version] * len(rows), pa.string()))
            if spec.provenance:
                arrays.append(pa.array(provenance_values(rows, version), arrow_type(PROVENANCE)))
            return pa.RecordBatch.from_arrays(arrays, schema=schema)

        def batches() -> Iterator[Any]:
            if first is None:
                return
            chunk = [first]
            for r in results:
                chunk.append(r)
                if len(chunk) == BATCH_ROWS:
                    yield batch(chunk)
                    chunk = []
            if chunk:
                yield batch(chunk)

        return schema, batches()

    def _vector(self, r: StoredResult, out: Any = None) -> list[float]:
        out = orjson.loads(r.output) if out is None else out
        vector = out.get(self.output.vector_field) if isinstance(out, dict) else None
        if not isinstance(vector, list) or not vector:
            raise BatchlineError(f"record {r.record_id!r}: its output has no {self.output.vector_field!r} vector")
        return vector

    # --- show, restore, forget ---------------------------------------------------------------

    def show(self, name: str, version: str, recorded: dict[str, Any] | None) -> dict[str, Any]:
        opened = self._version(name, version)
        if opened is None:
            raise BatchlineError(f"{self.describe()} has no version of {version} in table "
                                 f"{self.output.table_for(name)!r}: it was not staged")
        table, lance_version = opened
        if lance_version is None:  # a version staged before versions shared one table
            return {"table": table_name(self.output.table_for(name), version), "version": version,
                    "rows": table.count_rows()}
        return {"table": self.output.table_for(name), "tag": version_tag(version), "lance_version": lance_version,
                "version": version, "rows": table.count_rows()}

    def _version(self, name: str, version: str) -> tuple[Any, int | None] | None:
        """The table checked out at the job version's Lance version (its tag), or a version staged
        before versions shared one table: its own table (None as its Lance version)."""
        db = self.connect()
        table = _open(db, self.output.table_for(name))
        tag = version_tag(version)
        if table is not None and tag in table.tags.list():
            lance_version = int(table.tags.get_version(tag))
            table.checkout(lance_version)
            return table, lance_version
        own = _open(db, table_name(self.output.table_for(name), version))
        return (own, None) if own is not None else None

    def restore(self, name: str, recorded: dict[str, Any] | None, shown: dict[str, Any]) -> None:
        return None  # show moved nothing: searches follow the store's pointer

    def forget(self, name: str, version: str) -> None:
        """The job version's tag goes, and with it what no kept job version's Lance version uses."""
        db = self.connect()
        own = table_name(self.output.table_for(name), version)
        if _has_table(db, own):
            db.drop_table(own)
        table = _open(db, self.output.table_for(name))
        if table is not None and version_tag(version) in table.tags.list():
            table.tags.delete(version_tag(version))
            optimize(table)

    # --- search ----------------------------------------------------------------------

    def search(self, name: str, version: str, vector: Sequence[float], groups: Groups,
               k: int, *, exact: bool = False, admit: Admit | None = None) -> Answer:
        """The k rows of `version` nearest `vector` among those the groups may see; `exact`:
        compared with every visible row even where the approximate index is; `admit`: of a
        batch of candidate ids, those that may be served now (others are withheld and
        replaced by further candidates)."""
        where = group_filter(groups, ACL)
        k = check_k(k)
        missing = IndexMissing(f"{self.describe()} has no version of {version} in table "
                               f"{self.output.table_for(name)!r}: publish it again (batchline publish {version} "
                               "re-stages what is missing)")
        from batchline.sources import is_remote

        if not is_remote(self.output.uri) and not Path(self.output.uri).is_dir():
            raise missing  # connecting would make the folder
        opened = self._version(name, version)
        if opened is None:
            raise missing
        table = opened[0]
        approximate = not exact and any(ix.columns == [VECTOR] for ix in table.list_indices())
        rows_in_version = table.count_rows() if approximate else 0
        visible = table.count_rows(where) if approximate else None
        if approximate and visible is not None and visible <= EXACT_BELOW_SHARE * rows_in_version:
            approximate = False  # a selective ACL leaves few rows: ranking them all is as fast, and exact
        nprobes = self.output.nprobes or ivf_partitions(rows_in_version)
        path = IVF_PQ if approximate else EXACT

        def query(exact: bool, limit: int) -> list[dict[str, Any]]:
            q = table.search(list(vector), vector_column_name=VECTOR).distance_type(METRIC) \
                .where(where, prefilter=True).select([ID, VERSION, *self.output.fields, DISTANCE]).limit(limit)
            if exact:
                q = q.bypass_vector_index()
            else:
                q = q.nprobes(nprobes).refine_factor(self.output.refine_factor)
            rows: list[dict[str, Any]] = q.to_arrow().to_pylist()
            return rows

        def ranked(limit: int) -> list[dict[str, Any]]:
            nonlocal path
            rows = query(not approximate, limit)
            if approximate and visible is not None and len(rows) < min(limit, visible):
                path = FALLBACK  # the probed partitions held too few visible rows
                rows = query(True, limit)
            return rows

        verdict: dict[str, bool] = {}
        withheld = 0
        # Checked candidates come with a margin: asking a search for twice as many costs little
        # (it scans the same partitions), while a round for the withheld ones costs a search.
        limit = k if admit is None else min(CHECKED_MARGIN * k, MAX_K)
        while True:
            rows = ranked(limit)
            if admit is None:
                kept = rows
                break
            fresh = [str(r[ID]) for r in rows if str(r[ID]) not in verdict]
            if fresh:
                allowed = admit(fresh)
                verdict.update((rid, rid in allowed) for rid in fresh)
                withheld += len(fresh) - len(allowed & set(fresh))
            kept = [r for r in rows if verdict[str(r[ID])]]
            if len(kept) >= k or len(rows) < limit or (visible is not None and limit >= visible):
                break
            limit *= REFILL_FACTOR
        json_fields = {f.name for f in table.schema if f.metadata and f.metadata.get(JSON_FIELD)}
        # A row shared with a base version says that version; a hit is answered from this one.
        hits = [Hit(str(row[ID]), 1.0 - float(row[DISTANCE]),
                    {f: (json.loads(row[f]) if f in json_fields and row[f] is not None else row[f])
                     for f in self.output.fields}, version) for row in kept[:k]]
        return Answer(hits, path, withheld)


@dataclass(frozen=True)
class Upstream:
    """The results of the version a job over a job reads (input.job), for the fields its
    rows take from there."""

    properties: Mapping[str, Any]
    outputs: Callable[[list[str]], dict[str, Any]]  # record ids -> each one's upstream output


def upstream_version(spec: JobSpec) -> str | None:
    """The version of another job this job's input reads (input.job, pinned at planning)."""
    from batchline.sources.job import JobSource

    source = spec.input.source
    return source.version if isinstance(source, JobSource) else None


def _upstream_reader(store: ReaderStore, spec: JobSpec) -> Upstream | None:
    version = upstream_version(spec)
    job = store.job(version) if version is not None else None
    if version is None or job is None:
        return None

    def outputs(ids: list[str]) -> dict[str, Any]:
        return {rid: orjson.loads(r.output) for rid, r in store.results_for(version, ids).items()}

    return Upstream(_properties(job.spec.get("output", {}).get("schema")), outputs)


def _carried(value: Any) -> str | None:
    """A carried input value as its column holds it: a string as itself, another value as its
    JSON text (as the exports write carried values)."""
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, sort_keys=True)


def _properties(schema: Any) -> dict[str, Any]:
    props = schema.get("properties") if isinstance(schema, dict) else None
    return dict(props) if isinstance(props, dict) else {}


def version_tag(version: str) -> str:
    """The tag of a job version's Lance version: the version with its '@' as '.' (a tag holds
    letters, digits, '.', '-' and '_')."""
    return version.replace("@", ".")


def apply_changes(table: Any, base: int, upserts: tuple[Any, Iterator[Any]] | None, removed: Iterator[str]) -> None:
    """A version built on its base: the base's Lance version made the latest again, then the rows
    of `upserts` (an Arrow schema and its batches) upserted by id and the ids `removed` deleted,
    each a commit of its own, none a copy of the rest (Lance keeps deletions as deletion files)."""
    import pyarrow as pa

    table.restore(base)
    if upserts is not None:
        schema, batches = upserts
        table.merge_insert(ID).when_matched_update_all().when_not_matched_insert_all().execute(
            pa.RecordBatchReader.from_batches(schema, batches))
    while chunk := list(itertools.islice(removed, 1000)):
        table.delete(f"{ID} IN ({', '.join(_quoted(rid) for rid in chunk)})")


def finish_version(table: Any, output: IndexOutput, tag: str) -> None:
    """The latest Lance version made a job version's: its files with many deletions rewritten
    without them, its indexes built or brought up to its rows, its small files merged, then
    tagged (a version is tagged only once whole)."""
    rewrite_deleted(table, output.rewrite_deleted_share)
    build_indexes(table, output)
    optimize(table)
    table.tags.create(tag, table.version)


def rewrite_deleted(table: Any, share: float) -> None:
    """Lance's compaction of each file whose deleted rows reach `share` of it: rewritten without
    them, their index entries remapped (pylance's optimizer: LanceDB's optimize has no threshold
    to give). The base version's files stay while a kept version uses them."""
    if share >= 1:
        return
    dataset = table.to_lance()
    if not any(f.deletion_file() is not None for f in dataset.get_fragments()):
        return
    dataset.optimize.compact_files(materialize_deletions=True, materialize_deletions_threshold=share)
    table.checkout_latest()


def optimize(table: Any) -> None:
    """Lance's optimize: new rows join the existing indexes (no training again), small files are
    merged, and the versions older than every kept job version's are removed. Lance refuses a
    cleanup that would reach a tagged version (and keeps those anyway), so the cutoff is just
    before the oldest tagged one, moved back a little where Lance's clock has run past it."""
    tagged = {int(t["version"]) for t in table.tags.list().values()}
    stamps: list[datetime] = [v["timestamp"] for v in table.list_versions() if int(v["version"]) in tagged]
    if not stamps:
        table.optimize()  # Lance's own default age
        return
    oldest = min(stamps)
    for margin in (0.001, 1.0, 60.0):
        age = max(timedelta(0), datetime.now(oldest.tzinfo) - oldest + timedelta(seconds=margin))
        try:
            table.optimize(cleanup_older_than=age)
            return
        except RuntimeError as exc:
            if "tagged version" not in str(exc):
                raise
    table.optimize()


def _open(db: Any, name: str) -> Any | None:
    return db.open_table(name) if _has_table(db, name) else None


def _quoted(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _has_table(db: Any, name: str) -> bool:
    try:
        db.open_table(name)
    except Exception as exc:
        if _missing_table(exc):
            return False
        raise BatchlineError(f"cannot open LanceDB table {name!r}: {one_line(exc)}") from None
    return True


def write_table(db: Any, name: str, schema: Any, batches: Iterator[Any]) -> None:
    """Creates the table with every row in one commit. Another writer that created it first
    wrote the same version's rows, so its table is taken as this one."""
    import pyarrow as pa

    refused: list[BatchlineError] = []

    def kept(source: Iterator[Any]) -> Iterator[Any]:
        # Lance reports an error raised while it reads the rows as its own; ours is one line.
        try:
            yield from source
        except BatchlineError as exc:
            refused.append(exc)
            raise

    reader = pa.RecordBatchReader.from_batches(schema, kept(batches))
    try:
        db.create_table(name, data=reader, schema=schema, mode="create")
    except (OSError, ValueError, RuntimeError) as exc:
        if refused:
            raise refused[0] from None
        if "exist" in str(exc).lower() and _has_table(db, name):
            return
        raise


def build_indexes(table: Any, output: IndexOutput) -> bool:
    """The ACL's LABEL_LIST index, and from `approximate_min_rows` rows the IVF_PQ index,
    each made unless it is there already; whether it made one."""
    have = {tuple(ix.columns) for ix in table.list_indices()}
    rows = table.count_rows()
    if rows == 0:
        return False
    from lancedb.index import IvfPq, LabelList

    made = False
    if (ACL,) not in have:
        table.create_index(ACL, config=LabelList())
        made = True
    if rows >= output.approximate_min_rows and (VECTOR,) not in have:
        dims = table.schema.field(VECTOR).type.list_size
        table.create_index(VECTOR, config=IvfPq(
            distance_type=METRIC, num_partitions=ivf_partitions(rows), num_sub_vectors=pq_sub_vectors(dims)))
        made = True
    return made


def ivf_partitions(rows: int) -> int:
    """About 4,096 rows a partition, as Lance advises, and at least one. On random unit
    vectors, which do not cluster as real text's do, only probing every partition keeps 0.95
    of the exact top 10 (100,000 rows, 24 partitions: 20 probed kept 0.92, all 24 0.98;
    1,000,000 rows, 244 partitions: 32 kept 0.31, 122 0.71, all 0.95), so a search probes
    them all unless `nprobes` says otherwise."""
    return max(1, min(4096, rows // 4096))


def pq_sub_vectors(dims: int) -> int:
    """Sub-vectors of 4 dimensions where the length divides so (else 2, else 1 dimension):
    on 384-dimension vectors, 8 dimensions a sub-vector kept about 0.7 of the exact top 10
    at a refine factor of 10, and 4 dimensions 0.93 (0.99 at 30), for twice the training."""
    for width in (4, 2):
        if dims % width == 0:
            return dims // width
    return dims


def _schema_dims(schema: Any) -> int:
    if isinstance(schema, dict) and schema.get("minItems") == schema.get("maxItems") \
            and isinstance(schema.get("minItems"), int) and schema["minItems"] > 0:
        return int(schema["minItems"])
    return 1


# --- the family ------------------------------------------------------------------------------

INDEX_FIELDS: Fields = {
    "uri": {"type": "string", "minLength": 1,
            "description": "A folder, or an s3:// or gs:// prefix: one Lance table, each published version a tagged "
                           "Lance version of it"},
    "table": {"type": "string", "pattern": "^[A-Za-z0-9_-]+$",
              "description": "The table's name (default: the job's name)"},
    "vector_field": {"type": "string", "minLength": 1, "default": IndexOutput.vector_field,
                     "description": "The output field holding the vector"},
    "fields": {"type": "array", "items": {"type": "string", "minLength": 1}, "default": [],
               "description": "Fields each row holds and each hit returns: this job's output fields, its "
                              "carried input columns (output.carry), or the output fields of the job it reads "
                              "(input.job)"},
    "approximate_min_rows": {"type": "integer", "minimum": 1, "default": DEFAULT_APPROXIMATE_MIN_ROWS,
                             "description": "Versions of at least this many rows get an approximate (IVF_PQ) index"},
    "nprobes": {"type": "integer", "minimum": 1,
                "description": "Partitions an approximate search probes (default: every partition, which kept "
                               "0.95 of the exact top 10 on a million random vectors; fewer answer sooner and, "
                               "on vectors that cluster as real text's do, may keep as many)"},
    "refine_factor": {"type": "integer", "minimum": 1, "default": DEFAULT_REFINE_FACTOR,
                      "description": "An approximate search re-ranks this many times k candidates with the full "
                                     "vectors"},
    "rewrite_deleted_share": {
        "type": "number", "minimum": 0, "maximum": 1, "default": DEFAULT_REWRITE_DELETED_SHARE,
        "description": "A version built on its base rewrites each of the table's files whose deleted rows (its "
                       "changed and removed records) reach this share of it, so its searches are as fast as a "
                       "full build's; 1 never rewrites (deletions slow a search by up to 1.4 times), 0 rewrites "
                       "every file with a deletion"},
}


class LanceDBOutput(TargetFamily):
    """A LanceDB index of a version's vectors, searched behind each record's ACL."""

    name = "lancedb"
    searchable = True
    keys: ClassVar[Fields] = {"index": {
        "type": "object", "properties": dict(INDEX_FIELDS), "required": ["uri"], "additionalProperties": False,
        "description": "A LanceDB index of the output's vectors, each row behind its record's ACL",
        "examples": [{"uri": "s3://lake/index", "fields": ["summary"]}]}}

    def parse(self, key: str, section: Mapping[str, Any], r: SpecReader, ctx: ParseContext) -> IndexOutput:
        from batchline.sources import is_remote

        raw = r.section(section[key], "output.index", INDEX_FIELDS, required={"uri"})
        uri = r.string(raw["uri"], "output.index.uri")
        if not is_remote(uri):
            uri = str((ctx.base_dir / uri).resolve())
        table = r.optional_string(raw.get("table"), "output.index.table")
        if table is not None and not all(c.isalnum() or c in "_-" for c in table):
            r.fail("output.index.table", f"{table!r} may hold only letters, digits, '_' and '-'")
        fields = tuple(r.string_list(raw.get("fields", []), "output.index.fields"))
        for name in fields:
            if name in RESERVED:
                r.fail("output.index.fields", f"{name!r} is a column of every row ({', '.join(RESERVED)}); "
                                              "choose another field")
        if len(set(fields)) != len(fields):
            r.fail("output.index.fields", "names a field twice")
        vector_field = r.optional_string(raw.get("vector_field"), "output.index.vector_field")

        def integer(key: str, default: int) -> int:
            return r.integer(raw.get(key, default), f"output.index.{key}", 1)

        return IndexOutput(uri, table, vector_field or IndexOutput.vector_field, fields,
                           integer("approximate_min_rows", DEFAULT_APPROXIMATE_MIN_ROWS),
                           None if raw.get("nprobes") is None else integer("nprobes", 1),
                           integer("refine_factor", DEFAULT_REFINE_FACTOR),
                           r.number(raw.get("rewrite_deleted_share", DEFAULT_REWRITE_DELETED_SHARE),
                                    "output.index.rewrite_deleted_share", 0, 1))

    def access(self, section: Mapping[str, Any]) -> list[str]:
        index = section.get("index")
        if not index:
            return []
        return [f"output index {index['uri']}: the worker needs nothing of it; the publisher writes one table "
                "under it, a tagged Lance version of it per job version, and cleans up pruned versions' files: "
                "give it write access there, and searchers read access (and read access to the store, where the "
                "published version is)"]

    def pod_refusal(self, section: Mapping[str, Any], where: str) -> str | None:
        from batchline.sources import is_remote

        index = section.get("index")
        if index and not is_remote(str(index.get("uri", ""))):
            return f"output.index.uri: {index.get('uri')} is a folder on this machine; give an s3:// or gs:// prefix"
        return None


LANCEDB = LanceDBOutput()
