"""The planner: streams the snapshot once into shards, slices and per-record hashes.

Planning writes under the version's `planning` state and becomes visible in
one final commit, so a crash mid-plan leaves nothing a worker or reader sees;
the next plan of the same version discards the leftovers and starts again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from batchline.errors import EngineFatal, InputError, SpecError
from batchline.plan.budget import check_output_budget
from batchline.snapshot import (
    PIECES_PER_SHARD,
    Piece,
    Record,
    ScannedRecord,
    Slice,
    parquet_slice_digest,
    pinned_snapshot,
    read_slice,
    scan,
    scan_with_header,
    shared_columns,
    stored_input,
    text_hash,
)
from batchline.snapshot.formats import InputFormat, input_format
from batchline.snapshot.order import RENUMBERED, Occurrences
from batchline.snapshot.replicas import record_replicas
from batchline.sources import RowSource, Snapshot, Source, snapshot_digest, stored_pins
from batchline.spec import LOCAL_ROUTE, ROWS, STORED, JobSpec, ModelSpec, stored_spec
from batchline.store import (
    DeadLetterRow,
    DuplicateRecord,
    JobInfo,
    PlannedRecord,
    PlannedShard,
    ReaderStore,
    Store,
)
from batchline.store.changes import record_kind
from batchline.store.ports import PlanWriter
from batchline.store.replicas import ReplicaRecord


@dataclass(frozen=True)
class PlanResult:
    version: str
    created: bool
    records: int
    shards: int
    dead_letters: int
    routes: dict[str, int] = field(default_factory=dict)  # records per route


def plan(spec: JobSpec, store: Store, *, log: Callable[[str], None] = lambda _m: None) -> PlanResult:
    spec, snapshot = _pinned_input(spec, store.url)
    sources = snapshot.files
    digest = snapshot_digest(snapshot.pins)
    base = _base_version(spec, store, log)
    version = spec.version(digest, base)
    existing = store.job(version)
    if existing is not None and existing.state not in ("planning", "removed"):
        keep_gate(spec, store, existing, log)
        record_replicas(store, version, _check_replicas(stored_spec(existing), store, version, spec), log)
        return PlanResult(version, False, existing.record_count, existing.shard_count, 0)
    # Before anything is written: a replica that differs stops the plan with nothing planned.
    replicas = _check_replicas(replace(spec, pins=tuple(stored_pins(snapshot))), store, None, spec)

    _check_weights(spec)
    warning = check_output_budget(spec)
    if warning is not None:
        log(warning)
    for target in spec.targets:
        target.check(spec, store.url)
    if spec.shards.size_auto:
        spec = _auto_shard_size(spec, store, base, sources, log)
    writer = store.begin_plan(version, spec.name, {**spec.to_dict(), "base_version": base,
                                                   **({"pins": pins} if (pins := stored_pins(snapshot)) else {})})
    try:
        result = _write_plan(spec, version, writer, sources)
        if base is not None:
            carried = writer.carry_from(base)
            log(f"carried {carried} unchanged records from {base} without inference")
        if not snapshot.still():
            raise InputError("input changed while it was being planned; plan again once it is stable")
        writer.commit(result.records, result.shards)
    except BaseException:
        writer.abort()
        raise
    record_replicas(store, version, replicas, log)
    log(f"planned {version}: {result.records} records in {result.shards} shards"
        + (f", {result.dead_letters} dead letters at planning (over the length cap, or without text)"
           if result.dead_letters else ""))
    if spec.routing is not None:
        log(routes_summary(spec, result.routes))
    return result


def _check_replicas(pinned: JobSpec, store: Store, version: str | None, spec: JobSpec) -> list[ReplicaRecord]:
    """The replicas `spec` names (input.replicas) that the version has not recorded at their
    location, each checked against the version's pinned input (`pinned`: its stored spec, or
    the one about to be). They never move the version, so a replica named at a later plan of
    the same content is added to it."""
    from batchline.snapshot.replicas import check_replicas, spec_replicas
    from batchline.store.model import who

    wanted = spec_replicas(spec)
    recorded = store.replicas(version) if version is not None and wanted else {}
    return check_replicas(pinned, wanted, recorded, who())


def _check_weights(spec: JobSpec) -> None:
    """Weights this machine reaches (a local file or folder, a packaged model) are checked
    against `model.digest` before anything is planned, so a wrong digest is refused here
    rather than by the first worker, with a version left to cancel. Weights it does not
    reach (an object URL, fetched by each node; a path inside the workers' image; a
    package not installed here) are the workers' to check, as before."""
    from batchline.digests import verify_weights
    from batchline.registry import ENGINES
    from batchline.sources import is_remote

    entry = ENGINES[spec.model.engine]
    if entry.remote or (spec.model.path is not None and is_remote(spec.model.path)):
        return
    locate: Callable[[ModelSpec], Path | None] | None = getattr(entry.load(), "local_weights", None)
    if locate is None:
        return
    try:
        path = locate(spec.model)
    except EngineFatal:
        return
    if path is None or not path.exists():
        return
    try:
        verify_weights(path, spec.model.digest)
    except EngineFatal as exc:
        raise EngineFatal(f"{exc}; nothing was planned") from None


def _pinned_input(spec: JobSpec, store_url: str | None) -> tuple[JobSpec, Snapshot]:
    """The input's snapshot as its source pins it. A source whose pin names what was read
    (a table's snapshot id) writes it into the spec, so the stored spec (and every later
    reader of it) names that snapshot."""
    snapshot = pinned_snapshot(spec.input, store_url)
    return replace(spec, input=replace(spec.input, source=snapshot.source)), snapshot


def routes_summary(spec: JobSpec, per_route: dict[str, int]) -> str:
    """Where the records go, and what each provider keeps: said before anything is sent."""
    assert spec.routing is not None
    lines = [f"records by route (class field {spec.routing.class_field!r}; any other class, or none, stays local):",
             f"  {LOCAL_ROUTE}: {per_route.get(LOCAL_ROUTE, 0):,} records on {spec.model.engine}"]
    for p in spec.routing.providers:
        lines.append(f"  {p.route}: {per_route.get(p.route, 0):,} records of classes {', '.join(p.classes)} "
                     f"to {p.api} ({p.model}); data retention there: {p.retention}")
    return "\n".join(lines)


def _base_version(spec: JobSpec, store: ReaderStore, log: Callable[[str], None]) -> str | None:
    """The version whose results an incremental run may carry, if it is compatible."""
    if spec.base is None:
        return None
    base = store.resolve_name(spec.name) if spec.base == "published" else spec.base
    if base is None:
        log(f"nothing is published under {spec.name!r} yet: every record is inferred")
        return None
    info = store.job(base)
    if info is None or info.state != "sealed":
        raise InputError(f"base version {base} is not a sealed version in {store.where()}")
    base_spec = stored_spec(info)
    if base_spec.inference_identity() != spec.inference_identity():
        log(f"{base} used another model, prompt, decoding or schema: every record is inferred")
        return None
    return base


def _auto_shard_size(spec: JobSpec, store: Store, base: str | None, sources: list[Source],
                     log: Callable[[str], None]) -> JobSpec:
    from batchline.sizing.simulate import SimulationDiverged, recommend_shard_size

    sh = spec.shards
    assert sh.interruptions_per_hour is not None and sh.workers and sh.records_per_second
    measured = store.run_throughput(base) if base else 0.0
    rate = measured or sh.records_per_second
    records = sum(estimate_records(s, spec.input.format) for s in sources)
    try:
        size = recommend_shard_size(max(records, 1), sh.workers, rate, sh.interruptions_per_hour,
                                    lease_seconds=sh.lease_seconds)
    except SimulationDiverged as exc:
        raise SpecError(f"shards.size: auto: {exc}") from None
    log(f"shards.size auto: {size} for {sh.interruptions_per_hour:g} interruptions per worker-hour at "
        f"{rate:.1f} records/s ({f'measured on {base}' if measured else 'estimated'}) on {sh.workers} workers, "
        f"~{records:,} records")
    return replace(spec, shards=replace(sh, size=size, size_auto=False))


def estimate_records(source: Source, fmt: str) -> int:
    """A cheap count for sizing: the format's own (Parquet metadata; lines of a text file, or of
    an object's first MiB scaled to its size); every row of an input with no files."""
    if fmt in (STORED, ROWS):
        rows: RowSource = source  # type: ignore[assignment]  # a source of a row input is one
        return sum(1 for _ in rows.rows())
    return input_format(fmt).count(source)


def keep_gate(spec: JobSpec, store: Store, existing: JobInfo, log: Callable[[str], None]) -> None:
    """The spec's gate (its validate section) made the version's: a check added to a job's spec
    applies to the version its content already is, which is not computed again for it. A
    cancelled version keeps the gate it had."""
    from batchline.store.model import who

    gate = spec.to_dict()["validate"]
    if existing.state in ("ready", "halted", "sealed") and existing.spec.get("validate") != gate \
            and store.set_gate(existing.version, gate, who()):
        log(f"{existing.version} is validated by the spec's validate section from now on")


def file_format(spec: JobSpec) -> InputFormat | None:
    """The format the input's files are read in; None for an input with no files."""
    return None if spec.input.format in (STORED, ROWS) else input_format(spec.input.format)


def _write_plan(spec: JobSpec, version: str, writer: PlanWriter, sources: list[Source]) -> PlanResult:
    """Writes the shards, records (each with its ACL as read here, which every reader of its
    outcome reads, and its piece) and planner dead letters."""
    cap = spec.input.max_input_tokens
    byte_bound = cap * spec.input.max_bytes_per_token if cap else None
    shard_no = records = dead_total = 0
    slices: dict[int, Slice] = {}
    per_route: dict[str, int] = {}
    fmt = file_format(spec)
    stored = spec.input.format == STORED  # kept in the version's own records, for its workers

    pieces = 0
    # Records its format would refuse (a CSV job's ACL cells read as one group each holding a
    # list), checked where the format says its job needs it.
    checked = fmt is not None and fmt.checks_records(spec.input)
    occurrences = Occurrences() if spec.input.ids == "content" else None
    for source in sources:
        groups = fmt.row_groups(source) if fmt is not None else None
        header, scanned = scan_with_header(source, spec.input)
        for route, chunk in _route_chunks(scanned, spec, groups):
            if occurrences is not None:
                chunk = occurrences.number(chunk)
            first, last = chunk[0], chunk[-1]
            batch = [s.record for s in chunk]
            for r in batch if checked else ():
                assert fmt is not None
                refusal = fmt.refusal(r, spec.input, source.location)
                if refusal:
                    raise InputError(refusal)
            over = {r.id for r in batch if surely_too_long(r, byte_bound)}
            missing = {r.id for r in batch if r.missing is not None}
            digest, shard_pieces = _digests(source, chunk, spec, pieces, over | missing)
            sl = Slice(path=source.location, format=spec.input.format, start=first.start, end=last.end,
                       columns=shared_columns(source),
                       first_line=first.record.line, digest=digest, header=header,
                       route=route if spec.routing else None, pieces=shard_pieces, pin=source.slice_pin())
            slices[shard_no] = sl
            per_route[route] = per_route.get(route, 0) + len(batch)
            writer.add_shards([PlannedShard(shard_no, sl.to_json(), len(batch), route,
                                            first_piece=pieces, end_piece=pieces + len(shard_pieces),
                                            home=spec.input.regions.homes.get(source.location))])
            pieces += len(shard_pieces)
            piece_of = [piece.no for piece in shard_pieces for _ in range(piece.records)]
            try:
                writer.add_records([PlannedRecord(s.record.id, shard_no, s.record.content_hash,
                                                  stored_input(s) if stored else None, s.record.carried,
                                                  text_hash(s.record, spec.input), s.record.acl, piece)
                                    for s, piece in zip(chunk, piece_of, strict=True)])
            except DuplicateRecord as dup:
                raise _duplicate_error(dup, batch, slices, spec) from None
            planned_dead = [
                DeadLetterRow(r.id, "too_long",
                              f"{len(r.text.encode())} bytes of text is surely over max_input_tokens={cap} "
                              f"(planner bound: {spec.input.max_bytes_per_token} bytes per token)", r.acl)
                if r.id in over else DeadLetterRow(r.id, "missing_text", str(r.missing), r.acl)
                for r in batch if r.id in over or r.id in missing
            ]
            if planned_dead:
                writer.add_dead_letters(shard_no, planned_dead)
            dead_total += len(planned_dead)
            records += len(batch)
            shard_no += 1
    if records == 0:
        raise InputError(f"no records in {spec.input.describe()} (empty input)")
    return PlanResult(version, True, records, shard_no, dead_total, per_route)


def surely_too_long(record: Record, byte_bound: int | None) -> bool:
    """The planner's cheap bound: a record whose text is over it in bytes is surely over
    max_input_tokens, and is dead-lettered at planning (never charged)."""
    return record.missing is None and byte_bound is not None and len(record.text.encode()) > byte_bound


@dataclass(frozen=True)
class PlanPreview:
    """What planning a spec would do now, found without writing anything (`plan --dry-run`)."""

    version: str
    state: str | None  # the version's state where it is planned already, else None
    base: str | None  # the version it would carry from
    records: int
    carried: int  # results carried from the base, no inference (acl_changed of them under a new ACL)
    acl_changed: int
    new: int  # records the base has no record of
    changed: int  # records whose text (or class) changed
    retried: int  # unchanged records whose base outcome was a dead letter: inferred again
    removed: int  # records of the base the input no longer has
    dead_letters: int  # over the length cap, or without text: dead letters at planning

    @property
    def to_infer(self) -> int:
        return self.records - self.carried - self.dead_letters

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "to_infer": self.to_infer}

    def table(self) -> str:
        planned = f" (planned already: {self.state})" if self.state else " (new)"
        base = f" against base {self.base}" if self.base else " (no base: every record is inferred)"
        lines = [f"would plan {self.version}{planned}{base}",
                 f"  records       {self.records:,}",
                 f"  carried       {self.carried:,} without inference"
                 + (f" ({self.acl_changed:,} of them under a changed ACL)" if self.acl_changed else ""),
                 f"  to infer      {self.to_infer:,} (new {self.new:,}, changed text {self.changed:,}, "
                 f"retried dead letters {self.retried:,})",
                 f"  removed       {self.removed:,} (in the base, not in the input)",
                 f"  dead letters  {self.dead_letters:,} at planning (over the length cap, or without text)",
                 "nothing was written"]
        return "\n".join(lines)


def preview(spec: JobSpec, store: ReaderStore | None, *, log: Callable[[str], None] = lambda _m: None,
            chunk_size: int = 5000) -> PlanPreview:
    """What `plan` would do with `spec` now (`store`: None where the store does not exist
    yet), read and compared by keys, writing nothing: the input is scanned once and checked
    as planning checks it (ids, ACLs, text), and each record is compared with the base's."""
    import sqlite3
    import tempfile

    store_url = store.url if store is not None else None
    spec, snapshot = _pinned_input(spec, store_url)
    digest = snapshot_digest(snapshot.pins)
    base = _base_version(spec, store, log) if store is not None else None
    version = spec.version(digest, base)
    existing = store.job(version) if store is not None else None
    cap = spec.input.max_input_tokens
    byte_bound = cap * spec.input.max_bytes_per_token if cap else None
    counts = dict.fromkeys(("records", "carried", "acl_changed", "new", "changed", "retried", "matched", "dead"), 0)
    fmt = file_format(spec)
    refuses = fmt if fmt is not None and fmt.checks_records(spec.input) else None
    with tempfile.TemporaryDirectory(prefix="batchline-dry-run-") as scratch:
        # Ids seen so far, on disk: a duplicate is refused as planning refuses it, in any size of input.
        seen = sqlite3.connect(f"{scratch}/seen.db", isolation_level=None)
        seen.execute("PRAGMA journal_mode = OFF")
        seen.execute("CREATE TABLE seen (id TEXT PRIMARY KEY) WITHOUT ROWID")
        occurrences = Occurrences() if spec.input.ids == "content" else None
        for source in snapshot.files:
            pending: list[ScannedRecord] = []
            for scanned in scan(source, spec.input):
                pending.append(scanned)
                if len(pending) == chunk_size:
                    chunk = occurrences.number(pending) if occurrences is not None else pending
                    _preview_chunk([c.record for c in chunk], spec, store, base, byte_bound, counts, seen,
                                   source.location, refuses)
                    pending = []
            if pending:
                chunk = occurrences.number(pending) if occurrences is not None else pending
                _preview_chunk([c.record for c in chunk], spec, store, base, byte_bound, counts, seen,
                               source.location, refuses)
        seen.close()
    if counts["records"] == 0:
        raise InputError(f"no records in {spec.input.describe()} (empty input)")
    removed = (store.record_total(base) - counts["matched"]) if store is not None and base is not None else 0
    return PlanPreview(version, existing.state if existing is not None else None, base, counts["records"],
                       counts["carried"], counts["acl_changed"], counts["new"], counts["changed"],
                       counts["retried"], removed, counts["dead"])


def _preview_chunk(chunk: list[Record], spec: JobSpec, store: ReaderStore | None, base: str | None,
                   byte_bound: int | None, counts: dict[str, int], seen: Any, location: str,
                   refuses: InputFormat | None) -> None:
    import sqlite3

    if refuses is not None:
        for r in chunk:
            refusal = refuses.refusal(r, spec.input, location)
            if refusal:
                raise InputError(refusal)
    try:
        seen.execute("BEGIN")
        seen.executemany("INSERT INTO seen (id) VALUES (?)", [(r.id,) for r in chunk])
        seen.execute("COMMIT")
    except sqlite3.IntegrityError:
        seen.execute("ROLLBACK")
        for r in chunk:
            try:
                seen.execute("INSERT INTO seen (id) VALUES (?)", (r.id,))
            except sqlite3.IntegrityError:
                raise InputError(f"{location}:{r.line}: duplicate id {r.id!r}") from None
    based = store.base_hashes(base, [r.id for r in chunk]) if store is not None and base is not None else {}
    counts["records"] += len(chunk)
    counts["matched"] += len(based)
    for r in chunk:
        if r.missing is not None or surely_too_long(r, byte_bound):
            counts["dead"] += 1
            continue
        found = based.get(r.id)
        kind = record_kind(found, r.content_hash, text_hash(r, spec.input))
        if kind == "new":
            counts["new"] += 1
        elif kind == "text":
            counts["changed"] += 1
        elif found is not None and not found.answered:
            counts["retried"] += 1
        else:
            counts["carried"] += 1
            counts["acl_changed"] += kind == "acl"


def _digests(source: Source, chunk: list[ScannedRecord], spec: JobSpec, first_no: int,
             over: set[str]) -> tuple[str, tuple[Piece, ...]]:
    """The shard's digest and its pieces, each with its own digest: for text formats the
    bytes, for Parquet and records the store holds the ids and content hashes."""
    size = -(-len(chunk) // PIECES_PER_SHARD)
    groups = [chunk[i:i + size] for i in range(0, len(chunk), size)]
    digest_of: Callable[[list[ScannedRecord]], str]
    fmt = file_format(spec)
    if fmt is None or fmt.by_rows:
        def digest_of(items: list[ScannedRecord]) -> str:
            return parquet_slice_digest([s.record for s in items])
    elif spec.routing is None:
        digest_of = _streamed_digest
    else:
        # A route's range holds other routes' records too, so it is read again (once a shard).
        data = source.read(chunk[0].start, chunk[-1].end)
        base = chunk[0].start

        def digest_of(items: list[ScannedRecord]) -> str:
            return "sha256:" + hashlib.sha256(data[items[0].start - base:items[-1].end - base]).hexdigest()
    return digest_of(chunk), tuple(
        Piece(first_no + i, g[0].start, g[-1].end, g[0].record.line, digest_of(g), len(g),
              sum(1 for s in g if s.record.id in over),
              {str(s.record.line): s.record.id for s in g if RENUMBERED in s.record.id})
        for i, g in enumerate(groups))


def _streamed_digest(chunk: list[ScannedRecord]) -> str:
    """The digest of the bytes from the chunk's first record to its last, from the bytes
    the scan streamed by (what reading the range again would give)."""
    first = chunk[0]
    h = hashlib.sha256(first.raw[len(first.raw) - (first.end - first.start):])
    for item in chunk[1:]:
        h.update(item.raw)
    return "sha256:" + h.hexdigest()


def _route_chunks(items: Iterator[ScannedRecord], spec: JobSpec,
                  groups: list[int] | None = None) -> Iterator[tuple[str, list[ScannedRecord]]]:
    """Shards of one route each: records go to their route's open chunk, which is cut
    at that route's shard size. A route's shard spans the bytes from its first record
    to its last, so a rare route's shard is long in bytes but never mixes routes.

    Parquet (`groups`: rows per row group) is cut only where a row group ends, so a
    worker reads whole row groups of its own: a chunk takes the next group while that
    keeps it within the shard size, and always takes at least one."""
    routing = spec.routing
    sizes = {LOCAL_ROUTE: spec.shards.size}
    if routing is not None:
        sizes.update({p.route: p.shard_size or spec.shards.size for p in routing.providers})
    next_rows: dict[int, int] = {}  # row where a group ends -> rows of the group after it
    row = 0
    for i, n in enumerate(groups or ()):
        row += n
        next_rows[row] = groups[i + 1] if groups is not None and i + 1 < len(groups) else 0
    open_chunks: dict[str, list[ScannedRecord]] = {}
    for item in items:
        route = routing.route_of(item.record.data_class) if routing else LOCAL_ROUTE
        chunk = open_chunks.setdefault(route, [])
        chunk.append(item)
        if groups is None:
            if len(chunk) == sizes[route]:
                yield route, chunk
                del open_chunks[route]
        elif item.end in next_rows:
            for name in sorted(open_chunks, key=lambda r: open_chunks[r][0].start):
                if len(open_chunks[name]) + next_rows[item.end] > sizes[name]:
                    yield name, open_chunks.pop(name)
    # What is left of each route, in the order of its first record.
    for route, chunk in sorted(open_chunks.items(), key=lambda kv: kv[1][0].start):
        yield route, chunk


def _duplicate_error(dup: DuplicateRecord, batch: list[Record], slices: dict[int, Slice],
                     spec: JobSpec) -> InputError:
    second = next(r for r in reversed(batch) if r.id == dup.record_id)
    first_slice = slices[dup.first_shard]
    first = next((r for r in read_slice(first_slice, spec.input, spec.routing) if r.id == dup.record_id), None)
    where_first = f"{first_slice.path}:{first.line}" if first else f"shard {dup.first_shard}"
    return InputError(f"{slices[max(slices)].path}:{second.line}: duplicate id {dup.record_id!r} "
                      f"(first at {where_first})")
