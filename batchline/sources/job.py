"""A published job's results as a job's input (`input.job`): a job over a job.

    input:
      job: ticket-triage        # the name a version of it is published under
      field: output.summary     # the text each record is read from
      acl_field: acl            # the upstream's ACL field: its records' ACLs are carried

The input is pinned at planning to the version the name is published at then
(`job_version` is written into the stored spec; a spec may also name a sealed
version of the job itself). The upstream version and the field are the
snapshot's pin, so the version hash moves when either does, and an incremental
run (`base: published`) carries every record whose text is unchanged (under its
new ACL where the upstream changed only that). `output.carry` carries the fields
the upstream carries, from each upstream result.

Each record is one of the upstream's results: its id, the text of the chosen
output field, and its ACL. Upstream dead letters are not records. A result whose
field is missing, null or not text is a record without text: the planner
dead-letters it (kind `missing_text`, no attempt charged), so coverage and the
dead-letter gate account for it. Planning copies the records into the
downstream version's own rows in the store (text, ACL, content hash, position),
and a worker reads its shard's from there: under the narrow role it reads its
own version's rows and nothing of the upstream's, and a republish of the
upstream after planning changes nothing the downstream reads.

`acl_field` must be given exactly when the upstream carries ACLs, and must name
the upstream's: a downstream never drops the access rules its records came
with, and a reader of its results (a search index) knows they are there.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import closing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from batchline.digests import choose
from batchline.errors import InputError, SpecError
from batchline.sources.base import (
    DatasetName,
    KeyedFamily,
    Pin,
    RowsNotBytes,
    Snapshot,
    SourceContext,
    StoreDatasets,
    StoredRow,
)
from batchline.spec.model import NAME_PATTERN, STORED

if TYPE_CHECKING:
    from batchline.spec.model import InputSpec
    from batchline.spec.ports import RecordsOf
    from batchline.spec.reader import Fields, ParseContext, SpecReader
    from batchline.store import JobInfo, ReaderStore, Store, StoredResult

FIELD_PATTERN = re.compile(r"^(record|output(\.[A-Za-z0-9_][A-Za-z0-9_-]*)+)$")
# input.field: record: each record is the upstream record's own text and its whole output, as a
# judge reads them (`judged_text`).
RECORD = "record"

OPTIONS: Fields = {
    "field": {"type": "string", "pattern": FIELD_PATTERN.pattern,
              "description": "With input.job: the output field each record's text is read from "
                             "(output.NAME, output.NAME.INNER for a nested one), or record: the upstream "
                             "record's text and its whole output, to be judged",
              "examples": ["output.summary"]},
    "sample": {"type": "integer", "minimum": 1,
               "description": "With input.job: read this many of the version's results, chosen at random by "
                              "input.seed (default: every one)"},
    "seed": {"type": "integer", "minimum": 0,
             "description": "With input.job and input.sample: chooses the sample (default 0)"},
    "job_version": {"type": "string", "minLength": 1,
                    "description": "With input.job: the sealed version of it read (the one published when the "
                                   "job is planned when left out; written in at planning)"},
}

# What the rest of the input section says of a file, and why a job's records need none of it.
_NOT_WITH_JOB = {
    "id_field": "each record keeps its id from the upstream job",
    "text_field": "input.field names the output field read",
    "text_fields": "input.field names the output field read",
    "ids": "each record keeps its id from the upstream job",
    "format": "the records are read from the store",
    "acl_missing": "every record keeps the ACL the upstream's record has",
}


def _store(url: str | None, where: str) -> Store:
    from batchline.store import open_store

    if url is None:
        raise InputError(f"{where}: a job over a published job is read from the store, and none was given")
    return open_store(url, create=False)


def field_value(output: Any, field: str) -> tuple[str | None, str | None]:
    """The text at `field` (output.a.b) of a result's output, or None and why there is none."""
    value = output
    for part in field.split(".")[1:]:
        if not isinstance(value, dict) or part not in value:
            return None, "is missing"
        value = value[part]
    if value is None:
        return None, "is null"
    if not isinstance(value, str):
        return None, f"is not text ({type(value).__name__})"
    return value, None


class UpstreamRecords(RowsNotBytes):
    """The upstream version's results as rows of text: the one location of a job input."""

    rows_are: ClassVar[str] = "a job's records are read from the store, not as a file"

    def __init__(self, store_url: str, version: str, field: str, carry: tuple[str, ...] = (),
                 sample: int | None = None, seed: int = 0, records_of: RecordsOf | None = None) -> None:
        self.store_url = store_url
        self.version = version
        self.field = field
        self.carry = carry  # output.carry: fields of the upstream's carried input, each row's
        self.sample = sample
        self.seed = seed
        self.records_of = records_of  # field: record: reads the upstream's records (SourceContext's)
        self.location = f"job:{version}"

    def rows_between(self, start: int, end: int) -> Sequence[StoredRow]:
        # A job's records are copied into the version's own at planning (its format is `store`).
        raise InputError(f"{self.location}: a job's records are read from the version's own, not the upstream's")

    def rows(self) -> Iterator[StoredRow]:
        with closing(_store(self.store_url, self.location)) as store:
            for page in self._pages(store):
                records = self._records(store, page) if self.field == RECORD else {}
                for result in page:
                    try:
                        output = json.loads(result.output) if result.output is not None else None
                    except ValueError:
                        output = None
                    if self.field == RECORD:
                        record = records.get(result.record_id)
                        text, why = ((judged_text(record.text, result.output), None) if record is not None
                                     else (None, "is not in its shard's slice"))
                    else:
                        text, why = field_value(output, self.field)
                    carried = {name: (result.carry or {}).get(name) for name in self.carry} if self.carry else None
                    yield StoredRow(result.record_id, text, result.acl,
                                    None if why is None else f"{self.field} {why} in {self.version}", carried)

    def _pages(self, store: ReaderStore, size: int = 2000) -> Iterator[list[StoredResult]]:
        """The results read, in pages: every one in id order, or the seeded sample in the order
        of its ranks."""
        if self.sample is not None:
            ids = choose((rid for rid, _o in store.iter_outputs(self.version)), self.sample, self.seed)
            for start in range(0, len(ids), size):
                found = store.results_for(self.version, ids[start:start + size])
                yield [found[rid] for rid in ids[start:start + size] if rid in found]
            return
        page: list[StoredResult] = []
        for result in store.iter_results(self.version):
            page.append(result)
            if len(page) == size:
                yield page
                page = []
        if page:
            yield page

    def _records(self, store: Store, page: Sequence[StoredResult]) -> Mapping[str, Any]:
        """The upstream records the page's results answered, read again from the upstream's
        input by their shards' slices (checked against their digests, as a worker's read is)."""
        from batchline.spec import stored_spec

        job = store.job(self.version)
        if job is None or self.records_of is None:
            raise InputError(f"{self.location}: its records are read with the snapshot layer's reader, and were "
                             "read without it")
        return self.records_of(store, self.version, stored_spec(job), {r.record_id: r.shard_no for r in page})


def judged_text(text: str, output: str) -> str:
    """What a judge is shown of one result: the record as the job read it, and its whole output."""
    return f"Record:\n{text}\n\nOutput:\n{output}"



@dataclass(frozen=True)
class JobSource:
    """`input.job`: a published job's results, the text of one output field each."""

    name: str
    field: str
    version: str | None = None  # the upstream version read, pinned at planning
    format: str | None = STORED
    sample: int | None = None  # a seeded sample of the results (None: every one)
    seed: int = 0

    @property
    def locations(self) -> tuple[str, ...]:
        return ()

    def describe(self) -> str:
        at = self.version or f"the version published as {self.name}"
        what = "records and outputs" if self.field == RECORD else self.field
        some = f"a sample of {self.sample:,} (seed {self.seed}) of the " if self.sample is not None else ""
        return f"{some}{what} of job {self.name} ({at})"

    def to_dict(self) -> dict[str, Any]:
        return {"job": self.name, "field": self.field, **({"job_version": self.version} if self.version else {}),
                **({"sample": self.sample, "seed": self.seed} if self.sample is not None else {})}

    def datasets(self, pins: Sequence[Mapping[str, Any]], store: StoreDatasets) -> list[DatasetName]:
        # The upstream's results at the version read: what its own computation names as its
        # output, so the two jobs meet in one lineage graph.
        named = store.results(self.name, self.version)
        return [DatasetName(named.namespace, named.name, named.version,
                            (("id", "id"), ("text", self.field), ("acl", "acl"), ("carry", "carry.")))]

    def snapshot(self, ctx: SourceContext) -> Snapshot:
        url = ctx.store_url
        with closing(_store(url, self.describe())) as store:
            upstream = self.upstream(store, ctx.input)
        assert url is not None
        pinned = JobSource(self.name, self.field, upstream.version, sample=self.sample, seed=self.seed)
        material = f"{upstream.version}\0{self.field}".encode()
        if self.sample is not None:
            material += f"\0{self.sample}\0{self.seed}".encode()
        count = upstream.record_count if self.sample is None else min(self.sample, upstream.record_count)
        pin = Pin(f"job:{self.name}", count, digest="sha256:" + hashlib.sha256(material).hexdigest())

        def still() -> bool:
            # A sealed version never changes; it can only be removed meanwhile.
            with closing(_store(url, pinned.describe())) as store:
                job = store.job(upstream.version)
            return job is not None and job.state == "sealed"

        return Snapshot(pinned, [UpstreamRecords(url, upstream.version, self.field, ctx.input.carry, self.sample,
                                                 self.seed, ctx.records_of)], [pin], still)

    def upstream(self, store: ReaderStore, spec: InputSpec) -> JobInfo:
        """The version read (the one named, else the one published now), once it is known to
        be a sealed version of the job whose output has the field, and whose ACLs the spec
        carries."""
        version = self.version or store.resolve_name(self.name)
        if version is None:
            raise InputError(f"input.job: nothing is published as {self.name!r} in {store.where()}; publish a version "
                             "of it first (or name a sealed one in input.job_version)")
        job = store.job(version)
        if job is None or job.name != self.name:
            what = "no such version" if job is None else f"a version of {job.name!r}, not of {self.name!r}"
            raise InputError(f"input.job_version: {version} is {what} in {store.where()}")
        if job.state != "sealed":
            raise InputError(f"input.job_version: {version} is {job.state}; only a sealed version is read")
        _check_field(self.field, job)
        _check_acl(spec, job)
        _check_carry(spec, job)
        return job


def _check_field(field: str, job: JobInfo) -> None:
    """A field the upstream's output schema does not declare is a typo, refused with the fields it has."""
    if field == RECORD:
        return
    schema: Any = job.spec.get("output", {}).get("schema", {})
    walked = "output"
    for part in field.split(".")[1:]:
        properties = schema.get("properties") if isinstance(schema, dict) else None
        if not isinstance(properties, dict):
            return  # a schema that does not list its fields: each record says what it has
        if part not in properties:
            raise SpecError(f"input.field: {job.name}'s output schema ({job.version}) has no {walked}.{part} "
                            f"(fields of {walked}: {', '.join(sorted(properties)) or 'none'})")
        schema = properties[part]
        walked = f"{walked}.{part}"
    kinds = schema.get("type") if isinstance(schema, dict) else None
    kinds = [kinds] if isinstance(kinds, str) else kinds
    if isinstance(kinds, list) and "string" not in kinds:
        raise SpecError(f"input.field: {field} of {job.name} is {' or '.join(map(str, kinds))} in its output schema; "
                        "a job reads text")


def _check_carry(spec: InputSpec, job: JobInfo) -> None:
    """output.carry over a job reads the upstream's carried input fields (its own output.carry):
    a field it does not carry would be null in every row, so it is refused, naming those it does."""
    theirs = list(job.spec.get("output", {}).get("carry") or [])
    missing = [name for name in spec.carry if name not in theirs]
    if missing:
        raise SpecError(f"output.carry: {', '.join(map(repr, missing))} is not carried by {job.version} (a job over "
                        f"a job carries the fields its upstream carries: {', '.join(theirs) or 'none'}; add them to "
                        f"{job.name}'s output.carry first)")


def _check_acl(spec: InputSpec, job: JobInfo) -> None:
    theirs = job.spec.get("input", {}).get("acl_field")
    if spec.acl_field == theirs:
        return
    if theirs is None:
        raise SpecError(f"input.acl_field: {job.version}'s records carry no ACL (its input has no acl_field); "
                        "leave it out")
    raise SpecError(f"input.acl_field: {job.version}'s records carry the ACLs of its input.acl_field {theirs!r}; "
                    f"set input.acl_field: {theirs} so that they are carried (a downstream never drops them)")


class JobInput(KeyedFamily):
    """A published job's results as the input (`input.job`, with `input.field`)."""

    name = "job"
    keys: ClassVar[Fields] = {"job": {"type": "string", "pattern": NAME_PATTERN.pattern,
                                      "description": "A published job: its results are the records (pinned at "
                                                     "planning to the version published then)",
                                      "examples": ["ticket-triage"]}}
    options: ClassVar[Fields] = OPTIONS

    def parse(self, key: str, section: Mapping[str, Any], r: SpecReader, ctx: ParseContext) -> JobSource:
        name = r.string(section[key], "input.job")
        if not NAME_PATTERN.fullmatch(name):  # `$` alone would let a trailing newline through
            r.fail("input.job", f"{name!r} is not a job's name (lower-case letters, digits, '-' or '_')")
        if section.get("field") is None:
            r.fail("input.field", "is required with input.job: the output field each record's text is read from "
                                  "(for example output.summary)")
        field = r.string(section["field"], "input.field")
        if not FIELD_PATTERN.match(field):
            r.fail("input.field", f"{field!r} must name a field of the job's output: output.NAME "
                                  "(output.NAME.INNER for a nested one), or be record")
        sample = r.optional_int(section.get("sample"), "input.sample", 1)
        seed = r.integer(section.get("seed", 0), "input.seed", 0)
        if sample is None and section.get("seed") is not None and not ctx.resolved:
            r.fail("input.seed", "chooses input.sample: give the sample too")
        version = r.optional_string(section.get("job_version"), "input.job_version")
        if version is not None and not version.startswith(f"{name}@"):
            r.fail("input.job_version", f"{version!r} is not a version of {name!r} ({name}@...)")
        if not ctx.resolved:  # a stored spec writes the fields every input has
            for other, why in _NOT_WITH_JOB.items():
                if section.get(other) is not None:
                    r.fail(f"input.{other}", f"is not used with input.job: {why}")
        return JobSource(name, field, version, sample=sample, seed=seed)

    def access(self, section: Mapping[str, Any]) -> list[str]:
        if not section.get("job"):
            return []
        return [f"input job {section['job']} (version {section.get('job_version')}, {section.get('field')}): "
                "read from the version's own records in the store, which planning copied there; the worker "
                "needs nothing outside the database, and nothing of the upstream's rows"]

    def reads_versions(self, section: Mapping[str, Any]) -> list[str]:
        version = section.get("job_version") if section.get("job") else None
        return [str(version)] if version else []

    def reads_published(self, section: Mapping[str, Any]) -> list[tuple[str, str | None]]:
        if not section.get("job"):
            return []
        version = section.get("job_version")
        return [(str(section["job"]), str(version) if version else None)]


JOB = JobInput()
