"""The job spec's typed model, its self-contained stored form, and the job version hash (I2).

Every field that can change a result is hashed into the version; fields that
cannot (store URL, worker count, lease timing, deadline, validation gates, where
results are published) are not. Where the input is and where results go belong to
plug-ins (batchline.sources, batchline.targets): the model holds what their
parsers returned and hashes the input only through its pins.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchline.prompts.examples import DEFAULT_EXAMPLE_CHARS, Example, examples_digest
from batchline.registry import ENGINES, PROVIDERS
from batchline.store import DeadLetterBound

if TYPE_CHECKING:
    from batchline.spec.deadline import Deadline, FallbackSpec
    from batchline.spec.ports import GraderSpec, InputSource, TargetSpec

NAME_PATTERN = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
# The chat input (the FORMATS table's openai-batch: OpenAI batch request lines): its lines carry
# their own conversations, so a job over it has no prompt of its own, and its prompt version is
# this name.
OPENAI_BATCH = "openai-batch"
# An input with no files (the rows port, batchline.sources.base.RowSource): records read from
# the store itself, copied there at planning (a job over a published job), or read by range
# from their source (a warehouse query). A source that reads so says it (`InputSource.format`);
# neither is ever written in a spec.
STORED = "store"
ROWS = "rows"
COMPRESSED_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".zstd", ".lz4", ".zip", ".snappy")

# The planner's cheap length bound: a record whose UTF-8 text is longer than
# max_input_tokens * max_bytes_per_token bytes is surely over the cap, since no
# token of the tokenizers batchline supports covers more than this many bytes
# of ordinary text. The worker then counts tokens exactly with the engine.
DEFAULT_MAX_BYTES_PER_TOKEN = 32


REGION_PATTERN = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
REPLICA_FALLBACKS = ("none", "primary")


def region_refusal(name: object) -> str | None:
    """Why `name` is not a region name (every place a spec or a command names one), or None."""
    if isinstance(name, str) and REGION_PATTERN.fullmatch(name):
        return None
    return f"{name!r} is not a region name (lower-case letters, digits and '-', such as eu-west-1)"


@dataclass(frozen=True)
class Replica:
    """`input.replicas.REGION`: the primary's objects under another bucket or prefix, and how
    that region's object store is reached (merged over `input.storage`)."""

    location: str  # a prefix ending in `/`: an object's key below the primary's root is kept under it
    storage: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> Any:
        return {"location": self.location, "storage": dict(self.storage)} if self.storage else self.location


@dataclass(frozen=True)
class Regions:
    """Where the input's bytes live (`input.region`, `input.replicas`, `input.regions`): which
    location a worker of a region reads and which shards it claims first. Scheduling and
    transfer only: not part of the version, which is the snapshot's content wherever it lies."""

    primary: str | None = None  # input.region: where input.path's objects are
    replicas: Mapping[str, Replica] = field(default_factory=dict)
    fallback: str = "none"  # input.replica_fallback: read the primary when a replica cannot be reached
    # input.regions: each location's home region, and each region's storage settings.
    homes: Mapping[str, str] = field(default_factory=dict)
    storages: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    @property
    def known(self) -> tuple[str, ...]:
        """The regions a worker may say it is in: the primary's, the replicas' and the homes'."""
        named = ([self.primary] if self.primary else []) + list(self.replicas) + list(self.homes.values())
        return tuple(dict.fromkeys(named))

    def home_of(self, location: str) -> str | None:
        """The region a location's bytes live in (None: nowhere known)."""
        return self.homes.get(location, self.primary)

    def storage_for(self, location: str, storage: Mapping[str, Any]) -> Mapping[str, Any]:
        """The storage settings a location is reached with: its home region's over the input's."""
        home = self.homes.get(location)
        extra = self.storages.get(home, {}) if home is not None else {}
        return {**storage, **extra} if extra else storage

    def check_worker(self, region: str | None, recorded: tuple[str, ...] = ()) -> None:
        """A worker's region must be one the input names, or one a replica was recorded for
        (`recorded`), where there is any."""
        known = tuple(dict.fromkeys((*self.known, *recorded)))
        if region is not None and known and region not in known:
            from batchline.errors import ArgumentError

            raise ArgumentError(f"--region {region}: not a region of this job's input (it knows {', '.join(known)})")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.primary:
            out["region"] = self.primary
        if self.replicas:
            out["replicas"] = {r: rep.to_dict() for r, rep in self.replicas.items()}
            out["replica_fallback"] = self.fallback
        if self.homes:
            by_region: dict[str, list[str]] = {}
            for location, region in self.homes.items():
                by_region.setdefault(region, []).append(location)
            out["regions"] = {r: ({"path": locs, "storage": dict(self.storages[r])} if self.storages.get(r)
                                  else locs) for r, locs in by_region.items()}
        return out


@dataclass(frozen=True)
class InputSpec:
    # Where the snapshot is: the part of the section a source plug-in owns (files or objects,
    # globs and manifests expanded; a table's snapshot).
    source: InputSource
    id_field: str = "id"
    text_field: str = "text"
    # input.text_fields: the fields a record's text is composed from, each labelled, in this
    # order (batchline.snapshot.reading.record_text); empty: text_field's value alone.
    text_fields: tuple[str, ...] = ()
    acl_field: str | None = None
    # What a missing or null ACL means; None: a record without one is refused at planning,
    # since a reader downstream would take a missing ACL for "open to all".
    acl_missing: tuple[str, ...] | None = None
    # The options of its format (FORMATS), as the format parsed them: only those set, such as
    # CSV's rule for ACL cells (acl_json, acl_separator).
    format_options: Mapping[str, Any] = field(default_factory=dict)
    # "field": the id is the record's `id_field`; "content": a digest of the whole row,
    # stable across snapshots (identical rows numbered by their order).
    ids: str = "field"
    max_input_tokens: int | None = None
    max_bytes_per_token: int = DEFAULT_MAX_BYTES_PER_TOKEN
    format: str = "jsonl"
    class_field: str | None = None  # routing.class_field, read with each record
    # output.carry: input fields copied onto each record's result and dead letter, read with
    # each record at planning (the store keeps them with the planned record).
    carry: tuple[str, ...] = ()
    # openai-batch only: what every request line must agree with (the job's decoding
    # and output schema), so a line asking for something else is refused at planning.
    chat_rules: ChatRules | None = None
    # input.storage: where the object store is (endpoint, region) and how long to wait on it;
    # never a credential (see batchline.lake). Not part of the version: it cannot change a result.
    storage: Mapping[str, Any] = field(default_factory=dict)
    # Where its bytes live, replicas near other regions (batchline.spec.model.Regions): not
    # part of the version either.
    regions: Regions = field(default_factory=Regions)

    def describe(self) -> str:
        return self.source.describe()

    @property
    def text_columns(self) -> tuple[str, ...]:
        """The fields a record's text is read from: every one of them must be in the input."""
        return self.text_fields or (self.text_field,)

    @property
    def row_columns(self) -> tuple[str, ...]:
        """The fields every row must have: its id's (unless ids are made from the content) and its text's."""
        return self.text_columns if self.ids == "content" else (self.id_field, *self.text_columns)

    def storage_of(self, location: str) -> Mapping[str, Any]:
        """The storage settings `location` is read with: its home region's over `storage`."""
        return self.regions.storage_for(location, self.storage)

    @property
    def locations(self) -> tuple[str, ...]:
        """The files or objects the section names (none for a source that lists its own
        when its snapshot is read)."""
        return self.source.locations


@dataclass(frozen=True)
class ModelSpec:
    engine: str
    path: str | None = None
    digest: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """How a result names the local model that answered it: engine, weights and digest."""
        name = f"{self.engine}:{self.path}" if self.path else self.engine
        return f"{name}@{self.digest[:19]}" if self.digest else name


@dataclass(frozen=True)
class ExamplesSpec:
    """Labelled examples; each record is shown the k nearest (batchline.prompts.examples)."""

    items: tuple[Example, ...]
    k: int
    max_chars: int = DEFAULT_EXAMPLE_CHARS
    file: Path | None = None

    def identity(self) -> dict[str, Any]:
        return {"digest": examples_digest(self.items), "k": self.k, "max_chars": self.max_chars}


@dataclass(frozen=True)
class PromptSpec:
    file: Path | None
    version: str
    text: str
    examples: ExamplesSpec | None = None


@dataclass(frozen=True)
class DecodingSpec:
    temperature: float = 0.0
    max_tokens: int = 256
    seed: int = 0
    top_p: float = 1.0
    # Optional knobs against degenerate output (one character repeated until max_tokens):
    # unset, they are not part of the version, so no existing version's hash moves.
    repetition_penalty: float | None = None  # > 1 discourages every token already in prompt or output
    frequency_penalty: float | None = None  # OpenAI's: minus this times a token's count in the output
    presence_penalty: float | None = None  # OpenAI's: minus this once a token is in the output
    stop: tuple[str, ...] = ()  # the output ends before the first of these

    def __post_init__(self) -> None:
        # A list from JSON (the engine child's init, a stored spec) is kept as a tuple.
        object.__setattr__(self, "stop", tuple(self.stop))

    def knobs(self) -> dict[str, Any]:
        """The optional settings that are set, as the version and the stored spec hold them."""
        out: dict[str, Any] = {name: getattr(self, name) for name in PENALTY_DEFAULTS
                               if getattr(self, name) is not None}
        if self.stop:
            out["stop"] = list(self.stop)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "max_tokens": self.max_tokens, "seed": self.seed,
                "top_p": self.top_p, **self.knobs()}


# Each penalty's neutral value: what an unset penalty means to an engine or a request.
PENALTY_DEFAULTS: Mapping[str, float] = {"repetition_penalty": 1.0, "frequency_penalty": 0.0,
                                         "presence_penalty": 0.0}
MAX_STOP_SEQUENCES = 4


@dataclass(frozen=True)
class ChatRules:
    """An engine runs one decoding setting and one output schema per job, so each
    request of an openai-batch input must ask for these or leave them out."""

    decoding: DecodingSpec
    output_schema: Mapping[str, Any]


# Outcomes a version computes before its dead-letter rate is judged, when the spec sets a
# rate and no minimum: enough that a few early dead letters do not halt a healthy job.
DEFAULT_ABORT_MIN_OUTCOMES = 100


@dataclass(frozen=True)
class ShardSpec:
    size: int = 5000
    max_attempts: int = 3
    lease_seconds: float = 600.0
    renew_seconds: float = 30.0
    # Records the supervisor hands the engine child at a time, and how long one
    # record may take before the batch counts as hung (a batch gets
    # batch_timeout_seconds + n * record_timeout_seconds).
    batch_size: int = 16
    record_timeout_seconds: float = 120.0
    batch_timeout_seconds: float = 60.0
    # How long a worker asked to stop (SIGTERM, preemption notice) keeps
    # finishing records in flight before it releases its lease.
    grace_seconds: float = 30.0
    # When no ready shard is left, an idle worker splits the unstarted tail of the leased
    # shard that has the most of it off to itself. Scheduling only: not part of the version.
    # (The interruption simulator's Scenario leaves it off by default, to reproduce the seed
    # design's reference table; it takes its other defaults from here.)
    tail_split: bool = True
    # `size: auto`: the planner asks the interruption simulator for the size that
    # minimises the expected makespan at this rate, fleet and throughput.
    size_auto: bool = False
    interruptions_per_hour: float | None = None
    workers: int | None = None
    records_per_second: float | None = None
    # Fail fast: a version whose dead letters pass this share of the outcomes it computed
    # (once it has computed abort_min_outcomes of them) is halted for every worker, so a
    # wrong max_tokens does not burn the whole night. Off unless set; scheduling, like the
    # rest of this section: not part of the version, and `batchline resume` may change it.
    abort_dead_letter_rate: float | None = None
    abort_min_outcomes: int | None = None
    # With input.regions: how long a worker with no shard of its own region ready waits, since it
    # last claimed one, before it takes another region's (Spark's locality wait, timed per worker).
    locality_wait_seconds: float = 30.0

    @property
    def abort_bound(self) -> DeadLetterBound | None:
        """The bound the version is halted by when its dead letters pass it; None: never."""
        if self.abort_dead_letter_rate is None:
            return None
        return DeadLetterBound(self.abort_dead_letter_rate, self.abort_min_outcomes or DEFAULT_ABORT_MIN_OUTCOMES)


@dataclass(frozen=True)
class DriftSpec:
    """Gates on the label field's distribution against the version now published."""

    max_psi: float = 0.25
    max_new_categories: int = 0
    max_vanished_categories: int | None = None  # None: reported, never a failure


@dataclass(frozen=True)
class ReproduceSpec:
    """Recompute a seeded sample of the version's results in a fresh engine process, in batches
    of another size than the workers', and compare with what was stored."""

    sample: int
    min_agreement: float | None = None  # None: reported, never a failure
    seed: int = 0
    batch_size: int | None = None  # None: 1 where the workers' batches hold more, else 2
    on: str = "output"  # what must agree for a record to count: the whole output, or its label_field
    min_cosine: float = 0.9999  # an embedding agrees when its cosine with the stored one is at least this

    def check_batch_size(self, workers: int) -> int:
        """The batch size the check runs in: never the workers' own."""
        if self.batch_size is not None:
            return self.batch_size
        return 1 if workers > 1 else 2


REPRODUCE_ON = ("output", "label")


@dataclass(frozen=True)
class ValidateSpec:
    max_dead_letter_rate: float = 0.01
    schema_sample: int | None = None  # None: re-check every stored result
    drift: DriftSpec = field(default_factory=DriftSpec)
    reproduce: ReproduceSpec | None = None
    # The graders the section names (each a GRADERS member's parsed section), in the spec's order.
    graders: tuple[GraderSpec, ...] = ()

    def grader(self, key: str) -> GraderSpec | None:
        """The parsed section `validate.KEY`, where the spec has one."""
        return next((g for g in self.graders if g.key == key), None)


@dataclass(frozen=True)
class RetentionSpec:
    versions: int = 5  # versions of a name kept for rollback; never the published one or its predecessor


LOCAL_ROUTE = "local"
ROUTE_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")


@dataclass(frozen=True)
class ProviderSpec:
    """A hosted batch API that records of the named classes may be sent to."""

    route: str
    api: str  # openai | anthropic
    model: str
    classes: tuple[str, ...]
    retention: str  # the provider's data-retention terms, shown before the first record is sent
    base_url: str | None = None
    api_key_env: str | None = None
    completion_window: str = "24h"
    poll_seconds: float = 60.0
    input_price_per_mtok: float | None = None  # the batch price, per million tokens
    output_price_per_mtok: float | None = None
    shard_size: int | None = None  # records per batch; default shards.size
    options: Mapping[str, Any] = field(default_factory=dict)  # merged into every request body

    def identity(self) -> dict[str, Any]:
        """What can change an answer: the API, the model, the request options and who is sent."""
        return {"api": self.api, "api_revision": PROVIDERS[self.api].revision, "model": self.model,
                "classes": sorted(self.classes), "options": dict(self.options)}


@dataclass(frozen=True)
class RoutingSpec:
    """Which records may leave: only those whose class field names a cleared class.
    A record without the field, or with any other value, stays on the local engine."""

    class_field: str
    providers: tuple[ProviderSpec, ...]

    def route_of(self, data_class: Any) -> str:
        if isinstance(data_class, str):
            for provider in self.providers:
                if data_class in provider.classes:
                    return provider.route
        return LOCAL_ROUTE

    def provider(self, route: str) -> ProviderSpec:
        for provider in self.providers:
            if provider.route == route:
                return provider
        raise KeyError(route)


@dataclass(frozen=True)
class JobSpec:
    name: str
    input: InputSpec
    model: ModelSpec
    prompt: PromptSpec
    decoding: DecodingSpec
    output_schema: Mapping[str, Any]
    schema_path: Path | None
    shards: ShardSpec
    deadline: Deadline | None
    validate: ValidateSpec
    source: Path | None = None
    label_field: str | None = None
    base: str | None = None  # "published" or a version: carry unchanged records from it
    retention: RetentionSpec = field(default_factory=RetentionSpec)
    routing: RoutingSpec | None = None
    base_version: str | None = None  # a planned version's base, as the planner resolved `base`
    # Where a published version's results go besides the store (a table, a dataset, an
    # index), in the order the output section names them; not part of the version, since
    # it cannot change a result.
    targets: tuple[TargetSpec, ...] = ()
    # Paid workers a pacer may buy while the job is behind its deadline: not part of the version.
    fallback: FallbackSpec | None = None
    # A planned version's pins of the files and objects it read, in order (lineage names
    # their versions); empty for a version planned before they were kept, or a table's.
    pins: tuple[Mapping[str, Any], ...] = ()
    # output.provenance: each result's attempt, worker, lease epoch and origin version go into
    # the exports, tables and index rows; where results go, not what they are: not hashed.
    provenance: bool = False

    def inference_identity(self) -> str:
        """What decides a record's result given its content: a base version's result
        may be carried only when this is the same for both versions."""
        material = self.version_material("")
        del material["input"]["snapshot"], material["name"]
        material.pop("base", None)
        # Carried fields are copied from this version's input, whatever computed the result.
        material.pop("carry", None)
        return hashlib.sha256(canonical_json(material).encode()).hexdigest()

    def version_material(self, snapshot_digest: str, base_version: str | None = None) -> dict[str, Any]:
        """Everything that can change a result, and nothing else (I2)."""
        model: dict[str, Any] = {
            "engine": self.model.engine,
            "engine_revision": ENGINES[self.model.engine].revision,
            "digest": self.model.digest,
            "options": dict(self.model.options),
        }
        if self.model.digest is None:
            # Without pinned weights the location is the only identity there is.
            model["path"] = self.model.path
        return {
            "name": self.name,
            "input": {
                "snapshot": snapshot_digest,
                "id_field": self.input.id_field,
                "text_field": self.input.text_field,
                "acl_field": self.input.acl_field,
                # Only when set, so no existing version's hash moves.
                **({"text_fields": list(self.input.text_fields)} if self.input.text_fields else {}),
                "max_input_tokens": self.input.max_input_tokens,
                "max_bytes_per_token": self.input.max_bytes_per_token,
                # New keys enter only when set, so no existing version's hash moves.
                **({"acl_missing": list(self.input.acl_missing)} if self.input.acl_missing is not None else {}),
                **self.input.format_options,
                **({"ids": self.input.ids} if self.input.ids != "field" else {}),
            },
            "model": model,
            "prompt": {"text": self.prompt.text, "version": self.prompt.version,
                       **({"examples": self.prompt.examples.identity()} if self.prompt.examples else {})},
            "decoding": {
                "temperature": self.decoding.temperature,
                "max_tokens": self.decoding.max_tokens,
                "seed": self.decoding.seed,
                "top_p": self.decoding.top_p,
                # Only when set, so no existing version's hash moves.
                **self.decoding.knobs(),
            },
            # As written, keys in order: a constrained engine writes an object's
            # properties in the schema's order, so the order changes results.
            "output_schema": json.dumps(self.output_schema, ensure_ascii=False, separators=(",", ":")),
            "label_field": self.label_field,
            # Only when set, so no existing version's hash moves.
            **({"carry": list(self.input.carry)} if self.input.carry else {}),
            **({"base": base_version} if base_version else {}),
            **({"routing": {"class_field": self.routing.class_field,
                            "providers": {p.route: p.identity() for p in self.routing.providers}}}
               if self.routing else {}),
        }

    def version(self, snapshot_digest: str, base_version: str | None = None) -> str:
        material = canonical_json(self.version_material(snapshot_digest, base_version))
        return f"{self.name}@{hashlib.sha256(material.encode()).hexdigest()[:16]}"

    def to_dict(self) -> dict[str, Any]:
        """A self-contained form `parse_spec` reads back: paths resolved, prompt and
        schema inlined, so a worker on another machine needs no spec file."""
        out: dict[str, Any] = {
            "name": self.name,
            "input": {
                # With input.regions the locations are listed under their regions instead.
                **{k: v for k, v in self.input.source.to_dict().items()
                   if not (k == "path" and self.input.regions.homes)},
                "id_field": self.input.id_field,
                **({"text_fields": list(self.input.text_fields)} if self.input.text_fields
                   else {"text_field": self.input.text_field}),
                "max_bytes_per_token": self.input.max_bytes_per_token,
                "format": self.input.format,
                **({"storage": dict(self.input.storage)} if self.input.storage else {}),
                **self.input.regions.to_dict(),
            },
            "model": {"engine": self.model.engine, "options": dict(self.model.options)},
            # An openai-batch job has no prompt section: its lines carry their conversations.
            **({} if self.input.format == OPENAI_BATCH
               else {"prompt": {"text": self.prompt.text, "version": self.prompt.version,
                                **({"examples": {"k": self.prompt.examples.k,
                                                 "max_chars": self.prompt.examples.max_chars,
                                                 "items": [[e.id, e.text, e.label]
                                                           for e in self.prompt.examples.items]}}
                                   if self.prompt.examples else {})}}),
            "decoding": self.decoding.to_dict(),
            "output": {"schema": dict(self.output_schema)},
            # The dead-letter bound only when set, and the locality wait only when not the default,
            # so the stored spec of a job without them is as before.
            "shards": {k: v for k, v in self.shards.__dict__.items()
                       if (v is not None or k not in ("abort_dead_letter_rate", "abort_min_outcomes"))
                       and not (k == "locality_wait_seconds" and v == ShardSpec.locality_wait_seconds)},
            "validate": _validate_dict(self.validate),
            "retention": dict(self.retention.__dict__),
        }
        if self.label_field:
            out["output"]["label_field"] = self.label_field
        if self.input.carry:
            out["output"]["carry"] = list(self.input.carry)
        if self.provenance:
            out["output"]["provenance"] = True
        for target in self.targets:
            out["output"].update(target.to_dict())
        if self.base:
            out["base"] = self.base
        if self.input.acl_field:
            out["input"]["acl_field"] = self.input.acl_field
        if self.input.acl_missing is not None:
            out["input"]["acl_missing"] = list(self.input.acl_missing)
        out["input"].update(self.input.format_options)
        if self.input.ids != "field":
            out["input"]["ids"] = self.input.ids
            del out["input"]["id_field"]
        if self.input.max_input_tokens is not None:
            out["input"]["max_input_tokens"] = self.input.max_input_tokens
        if self.model.path:
            out["model"]["path"] = self.model.path
        if self.model.digest:
            out["model"]["digest"] = self.model.digest
        if self.deadline:
            out["deadline"] = self.deadline.to_json()
        if self.fallback:
            out["fallback"] = self.fallback.to_dict()
        if self.routing:
            out["routing"] = {"class_field": self.routing.class_field,
                              "providers": {p.route: _provider_dict(p) for p in self.routing.providers}}
        return out


def _provider_dict(p: ProviderSpec) -> dict[str, Any]:
    skip = {"route", "input_price_per_mtok", "output_price_per_mtok"}
    out = {k: v for k, v in p.__dict__.items() if k not in skip and v is not None}
    out["classes"] = list(p.classes)
    out["options"] = dict(p.options)
    prices = {"input_per_mtok": p.input_price_per_mtok, "output_per_mtok": p.output_price_per_mtok}
    out["prices"] = {k: v for k, v in prices.items() if v is not None}
    return out


def _validate_dict(v: ValidateSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"max_dead_letter_rate": v.max_dead_letter_rate, "drift": dict(v.drift.__dict__)}
    if v.schema_sample is not None:
        out["schema_sample"] = v.schema_sample
    for grader in v.graders:
        out[grader.key] = grader.to_dict()
    if v.reproduce is not None:
        out["reproduce"] = {k: val for k, val in v.reproduce.__dict__.items() if val is not None}
    return out


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


