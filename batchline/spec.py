"""The job spec: YAML validated into typed objects, and the job version hash (I2).

Every field that can change a result is hashed into the version; fields that
cannot (store URL, worker count, lease timing, deadline, validation gates) are not.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path, PurePosixPath
from typing import Any, NoReturn, Protocol

import jsonschema
import yaml

from batchline.errors import SpecError
from batchline.fewshot import DEFAULT_EXAMPLE_CHARS, Example, examples_digest
from batchline.lake import check_storage_options, lake_settings
from batchline.registry import ENGINES, PROVIDERS, unhonoured_knob, unknown_option

NAME_PATTERN = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
TEXT_FORMATS = ("jsonl", "csv")
# openai-batch: OpenAI batch input lines (JSONL, read in byte ranges like jsonl), never
# guessed from a suffix since such a file is also plain JSONL.
OPENAI_BATCH = "openai-batch"
FORMATS = (*TEXT_FORMATS, "parquet", OPENAI_BATCH)
OBJECT_SCHEMES = ("s3://", "gs://")
COMPRESSED_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".zstd", ".lz4", ".zip", ".snappy")

# The planner's cheap length bound: a record whose UTF-8 text is longer than
# max_input_tokens * max_bytes_per_token bytes is surely over the cap, since no
# token of the tokenizers batchline supports covers more than this many bytes
# of ordinary text. The worker then counts tokens exactly with the engine.
DEFAULT_MAX_BYTES_PER_TOKEN = 32


STORE_CATALOG = "store"  # a table's catalog named so: a SQL catalog in the job's own store database
_SECRET_QUERY_KEYS = ("password", "secret", "token", "credential", "key")


@dataclass(frozen=True)
class TableRef:
    """An Apache Iceberg table: its catalog and name. The catalog's address and
    credentials come from pyiceberg's own configuration (`PYICEBERG_CATALOG__NAME__URI`,
    `.pyiceberg.yaml`) or, for `catalog: store`, from the store URL the command was
    given; `uri` is only taken when it holds no credential, since the spec is stored."""

    catalog: str
    name: str  # namespace.table
    snapshot_id: int | None = None  # an input: the snapshot read (pinned at planning when left out)
    uri: str | None = None
    warehouse: str | None = None  # where a table made by batchline keeps its files

    def describe(self) -> str:
        at = f" at snapshot {self.snapshot_id}" if self.snapshot_id is not None else ""
        return f"Iceberg table {self.name} in catalog {self.catalog!r}{at}"

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass(frozen=True)
class InputSpec:
    # Local paths (resolved) and object URLs (globs and manifests expanded); each is opened
    # through batchline.sources.
    locations: tuple[str, ...]
    id_field: str = "id"
    text_field: str = "text"
    acl_field: str | None = None
    # What a missing or null ACL means; None: a record without one is refused at planning,
    # since a reader downstream would take a missing ACL for "open to all".
    acl_missing: tuple[str, ...] | None = None
    # "field": the id is the record's `id_field`; "content": a digest of the whole row,
    # stable across snapshots (identical rows numbered by their order).
    ids: str = "field"
    max_input_tokens: int | None = None
    max_bytes_per_token: int = DEFAULT_MAX_BYTES_PER_TOKEN
    format: str = "jsonl"
    class_field: str | None = None  # routing.class_field, read with each record
    # openai-batch only: what every request line must agree with (the job's decoding
    # and output schema), so a line asking for something else is refused at planning.
    chat_rules: ChatRules | None = None
    # An Iceberg table's snapshot instead of files: its data files are the locations,
    # listed at planning from the pinned snapshot.
    table: TableRef | None = None
    # input.storage: where the object store is (endpoint, region) and how long to wait on it;
    # never a credential (see batchline.lake). Not part of the version: it cannot change a result.
    storage: Mapping[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        return self.table.describe() if self.table is not None else ", ".join(self.locations)


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
    """Labelled examples; each record is shown the k nearest (batchline.fewshot)."""

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
    tail_split: bool = True
    # `size: auto`: the planner asks the interruption simulator for the size that
    # minimises the expected makespan at this rate, fleet and throughput.
    size_auto: bool = False
    interruptions_per_hour: float | None = None
    workers: int | None = None
    records_per_second: float | None = None


@dataclass(frozen=True)
class DriftSpec:
    """Gates on the label field's distribution against the version now published."""

    max_psi: float = 0.25
    max_new_categories: int = 0
    max_vanished_categories: int | None = None  # None: reported, never a failure


@dataclass(frozen=True)
class EvalSpec:
    """Accuracy of the label field on a sample of records with known answers."""

    labels: Path
    id_field: str = "id"
    label_field: str = "label"
    field: str | None = None  # the output field compared; default output.label_field
    sample: int = 300
    min_accuracy: float = 0.0
    grader: str | None = None  # "module:function"(output, expected, record_id) -> bool | float


@dataclass(frozen=True)
class ValidateSpec:
    max_dead_letter_rate: float = 0.01
    schema_sample: int | None = None  # None: re-check every stored result
    drift: DriftSpec = field(default_factory=DriftSpec)
    eval: EvalSpec | None = None


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
    deadline: datetime | None
    validate: ValidateSpec
    source: Path | None = None
    label_field: str | None = None
    base: str | None = None  # "published" or a version: carry unchanged records from it
    retention: RetentionSpec = field(default_factory=RetentionSpec)
    routing: RoutingSpec | None = None
    base_version: str | None = None  # a planned version's base, as the planner resolved `base`
    # Where a published version's results go besides the store (an Iceberg table); not
    # part of the version, since it cannot change a result.
    output_table: TableRef | None = None

    def inference_identity(self) -> str:
        """What decides a record's result given its content: a base version's result
        may be carried only when this is the same for both versions."""
        material = self.version_material("")
        del material["input"]["snapshot"], material["name"]
        material.pop("base", None)
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
                "max_input_tokens": self.input.max_input_tokens,
                "max_bytes_per_token": self.input.max_bytes_per_token,
                # New keys enter only when set, so no existing version's hash moves.
                **({"acl_missing": list(self.input.acl_missing)} if self.input.acl_missing is not None else {}),
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
                **({"table": self.input.table.to_dict()} if self.input.table is not None
                   else {"path": list(self.input.locations)}),
                "id_field": self.input.id_field,
                "text_field": self.input.text_field,
                "max_bytes_per_token": self.input.max_bytes_per_token,
                "format": self.input.format,
                **({"storage": dict(self.input.storage)} if self.input.storage else {}),
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
            "shards": dict(self.shards.__dict__),
            "validate": _validate_dict(self.validate),
            "retention": dict(self.retention.__dict__),
        }
        if self.label_field:
            out["output"]["label_field"] = self.label_field
        if self.output_table is not None:
            out["output"]["table"] = self.output_table.to_dict()
        if self.base:
            out["base"] = self.base
        if self.input.acl_field:
            out["input"]["acl_field"] = self.input.acl_field
        if self.input.acl_missing is not None:
            out["input"]["acl_missing"] = list(self.input.acl_missing)
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
            out["deadline"] = self.deadline.isoformat()
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
    if v.eval is not None:
        out["eval"] = {k: (str(val) if isinstance(val, Path) else val)
                       for k, val in v.eval.__dict__.items() if val is not None}
    return out


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


# --- parsing -----------------------------------------------------------------


def load_spec(path: str | Path) -> JobSpec:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SpecError(f"{path}: job spec not found") from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise SpecError(f"{path}: not valid YAML: {_one_line(exc)}") from None
    return parse_spec(raw, base_dir=path.parent, source=path)


def parse_spec(raw: Any, base_dir: Path, source: Path | None = None, *, resolved: bool = False) -> JobSpec:
    """`resolved`: the spec is a planned job's stored form, whose input locations are
    already resolved, listed and expanded, and are taken as they are."""
    where = str(source) if source else "spec"
    r = _Reader(where)
    # prompt is required below unless the input is openai-batch, whose lines carry their prompts.
    top = r.mapping(raw, "", required={"name", "input", "model", "output"},
                    allowed={"name", "input", "model", "prompt", "decoding", "output",
                             "shards", "deadline", "validate", "base", "retention", "routing"})
    name = r.string(top["name"], "name")
    if not NAME_PATTERN.match(name):
        r.fail("name", f"{name!r} must be lower-case letters, digits, '-' or '_', starting with a letter")
    input_spec = _parse_input(r, top, base_dir, resolved)
    chat = input_spec.format == OPENAI_BATCH
    model_spec = _parse_model(r, top["model"], base_dir)
    prompt_spec = _parse_prompt(r, top, base_dir, chat)
    decoding = _parse_decoding(r, top.get("decoding", {}) or {}, model_spec.engine)
    out = r.mapping(top["output"], "output", required={"schema"}, allowed={"schema", "label_field", "table"})
    schema, schema_path = _load_schema(r, out["schema"], base_dir)
    label_field = r.optional_string(out.get("label_field"), "output.label_field")
    if prompt_spec.examples is not None and label_field is None:
        r.fail("prompt.examples", "needs output.label_field: the output field an example's label answers")
    output_table = _parse_table(r, out["table"], "output.table", base_dir) if out.get("table") is not None else None
    shards = _parse_shards(r, top.get("shards", {}) or {})
    deadline = _parse_deadline(r, top.get("deadline"))
    validate = _parse_validate(r, top.get("validate", {}) or {}, base_dir, label_field)
    base = r.optional_string(top.get("base"), "base")
    ret = r.mapping(top.get("retention", {}) or {}, "retention", allowed={"versions"})
    retention = RetentionSpec(versions=r.integer(ret.get("versions", 5), "retention.versions", 2))
    routing = _parse_routing(r, top["routing"]) if top.get("routing") is not None else None
    for provider in routing.providers if routing is not None else ():
        refusal = unhonoured_knob(PROVIDERS[provider.api], decoding.knobs(), "provider")
        if refusal:
            raise SpecError(f"{r.where}: routing.providers.{provider.route}: {refusal}")
    if chat:
        input_spec = replace(input_spec, chat_rules=ChatRules(decoding=decoding, output_schema=schema))
    if routing is not None:
        input_spec = replace(input_spec, class_field=routing.class_field)
    return JobSpec(name=name, input=input_spec, model=model_spec, prompt=prompt_spec,
                   decoding=decoding, output_schema=schema, schema_path=schema_path,
                   shards=shards, deadline=deadline, validate=validate, source=source,
                   label_field=label_field, base=base, retention=retention, routing=routing,
                   output_table=output_table)


def _parse_input(r: _Reader, top: Mapping[str, Any], base_dir: Path, resolved: bool) -> InputSpec:
    inp = r.mapping(top["input"], "input",
                    allowed={"path", "manifest", "table", "id_field", "text_field", "acl_field", "acl_missing",
                             "ids", "max_input_tokens", "max_bytes_per_token", "format", "storage"})
    storage = check_storage_options(inp.get("storage"), r.where)
    if sum(inp.get(k) is not None for k in ("path", "manifest", "table")) != 1:
        r.fail("input", "give exactly one of 'path' (a file, an object URL, a list or a glob), 'manifest' "
                        "(a file or object listing objects) or 'table' (an Iceberg table)")
    table: TableRef | None = None
    locations: tuple[str, ...] = ()
    if inp.get("table") is not None:
        table = _parse_table(r, inp["table"], "input.table", base_dir, snapshot=True)
        if inp.get("format", "parquet") != "parquet":
            r.fail("input.format", "an Iceberg table is read from its Parquet data files; leave format out")
    elif inp.get("manifest") is not None:
        locations = _manifest_locations(r, r.string(inp["manifest"], "input.manifest"), base_dir, storage)
    elif resolved:
        items = inp["path"] if isinstance(inp["path"], list) else [inp["path"]]
        locations = tuple(r.string(p, "input.path") for p in items)
    else:
        locations = _input_locations(r, inp["path"], base_dir, storage)
    for location in locations:
        suffix = PurePosixPath(location).suffix.lower()
        if suffix in COMPRESSED_SUFFIXES:
            r.fail("input.path", f"{location} is compressed ({suffix}); batchline reads byte ranges of each "
                                 "shard directly, so decompress it (or convert it to Parquet) first")
    fmt = inp.get("format")
    if table is not None:
        fmt = "parquet"
    elif fmt is None:
        fmt = _format_of(r, locations)
    elif fmt not in FORMATS:
        r.fail("input.format", f"{fmt!r} is not one of {', '.join(FORMATS)}")
    chat = fmt == OPENAI_BATCH
    if chat:
        _check_chat_input(r, inp, top)
    elif top.get("prompt") is None:
        r.fail("prompt", "is required")
    ids = r.string(inp.get("ids", "field"), "input.ids")
    if ids not in ("field", "content"):
        r.fail("input.ids", f"{ids!r} is not field (the id_field) or content (a digest of each row)")
    if ids == "content" and inp.get("id_field") is not None:
        r.fail("input.id_field", "goes with input.ids: field; with ids: content each id is a digest of its row")
    acl_field = r.optional_string(inp.get("acl_field"), "input.acl_field")
    acl_missing = None
    if inp.get("acl_missing") is not None:
        if acl_field is None:
            r.fail("input.acl_missing", "says what a missing ACL means; it needs input.acl_field")
        acl_missing = tuple(r.string_list(inp["acl_missing"], "input.acl_missing"))
    return InputSpec(
        locations=locations,
        ids=ids,
        acl_missing=acl_missing,
        id_field=(r.string(inp.get("id_field", "custom_id" if chat else "id"), "input.id_field")
                  if ids == "field" else "id"),
        text_field=r.string(inp.get("text_field", "messages" if chat else "text"), "input.text_field"),
        acl_field=acl_field,
        max_input_tokens=r.optional_int(inp.get("max_input_tokens"), "input.max_input_tokens", 1),
        max_bytes_per_token=r.integer(
            inp.get("max_bytes_per_token", DEFAULT_MAX_BYTES_PER_TOKEN), "input.max_bytes_per_token", 1
        ),
        format=fmt,
        table=table,
        storage=storage,
    )


def _parse_table(r: _Reader, raw: Any, where: str, base_dir: Path, *, snapshot: bool = False) -> TableRef:
    allowed = {"catalog", "name", "uri", "warehouse"} | ({"snapshot_id"} if snapshot else set())
    tb = r.mapping(raw, where, required={"catalog", "name"}, allowed=allowed)
    catalog = r.string(tb["catalog"], f"{where}.catalog")
    name = r.string(tb["name"], f"{where}.name")
    if "." not in name.strip(".") or name != name.strip("."):
        r.fail(f"{where}.name", f"{name!r} must be namespace.table")
    uri = r.optional_string(tb.get("uri"), f"{where}.uri")
    if uri is not None:
        if catalog == STORE_CATALOG:
            r.fail(f"{where}.uri", f"catalog {STORE_CATALOG!r} is the store's own database; leave uri out")
        uri = _catalog_uri(r, uri, f"{where}.uri", base_dir)
    warehouse = r.optional_string(tb.get("warehouse"), f"{where}.warehouse")
    if warehouse is not None and "://" not in warehouse:
        warehouse = "file://" + str((base_dir / warehouse).resolve())
    snapshot_id = r.optional_int(tb.get("snapshot_id"), f"{where}.snapshot_id", 0) if snapshot else None
    return TableRef(catalog=catalog, name=name, snapshot_id=snapshot_id, uri=uri, warehouse=warehouse)


def _catalog_uri(r: _Reader, uri: str, where: str, base_dir: Path) -> str:
    """A catalog address that may be stored: no password, token or key in it."""
    from urllib.parse import parse_qsl, urlsplit

    parts = urlsplit(uri)
    secret = parts.password is not None or any(
        any(word in key.lower() for word in _SECRET_QUERY_KEYS) for key, _v in parse_qsl(parts.query))
    if secret:
        r.fail(where, "holds a credential, and the spec is stored: put the catalog's address in "
                      "PYICEBERG_CATALOG__<CATALOG>__URI (or .pyiceberg.yaml) and leave uri out")
    if parts.scheme.startswith("sqlite") and uri.startswith(f"{parts.scheme}:///") \
            and not uri.startswith(f"{parts.scheme}:////"):
        # sqlite:///relative.db: relative to the spec, like every other path in it.
        return f"{parts.scheme}:///" + str((base_dir / uri[len(parts.scheme) + 4:]).resolve())
    return uri


def _parse_model(r: _Reader, raw: Any, base_dir: Path) -> ModelSpec:
    mod = r.mapping(raw, "model", required={"engine"},
                    allowed={"engine", "path", "digest", "options"})
    engine = r.string(mod["engine"], "model.engine")
    if engine not in ENGINES:
        r.fail("model.engine", f"{engine!r} is not one of {', '.join(ENGINES)}")
    digest = r.optional_string(mod.get("digest"), "model.digest")
    if digest is not None and not re.fullmatch(r"sha256:[0-9a-fA-F]{64}", digest):
        r.fail("model.digest", "must be 'sha256:' followed by 64 hex digits")
    model_path = r.optional_string(mod.get("path"), "model.path")
    if model_path and engine != "openai" and not model_path.startswith(("pkg:", "/", *OBJECT_SCHEMES)):
        model_path = str((base_dir / model_path).resolve())
    if model_path and model_path.startswith(OBJECT_SCHEMES) and digest is None:
        r.fail("model.digest", f"is required when model.path is an object ({model_path}): each node "
                               "fetches the weights once and keeps them under their digest")
    options = mod.get("options", {}) or {}
    if not isinstance(options, dict):
        r.fail("model.options", "must be a mapping")
    unknown = unknown_option(ENGINES[engine], options)
    if unknown:
        r.fail(*unknown)
    return ModelSpec(engine=engine, path=model_path, digest=digest.lower() if digest else None, options=options)


def _parse_prompt(r: _Reader, top: Mapping[str, Any], base_dir: Path, chat: bool) -> PromptSpec:
    pr = {} if chat else r.mapping(top["prompt"], "prompt", required={"version"},
                                   allowed={"file", "text", "version", "examples"})
    if not chat and ("file" in pr) == ("text" in pr):
        r.fail("prompt", "give exactly one of 'file' or 'text'")
    prompt_file: Path | None = None
    if chat:
        prompt_text = ""
    elif "file" in pr:
        prompt_file = (base_dir / r.string(pr["file"], "prompt.file")).resolve()
        try:
            prompt_text = prompt_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            r.fail("prompt.file", f"cannot read {prompt_file}: {_one_line(exc)}")
    else:
        prompt_text = r.string(pr["text"], "prompt.text")
    examples = _parse_examples(r, pr["examples"], base_dir) if pr.get("examples") is not None else None
    return PromptSpec(file=prompt_file, version=OPENAI_BATCH if chat else str(pr["version"]), text=prompt_text,
                      examples=examples)


def _parse_examples(r: _Reader, raw: Any, base_dir: Path) -> ExamplesSpec:
    ex = r.mapping(raw, "prompt.examples", required={"k"},
                   allowed={"file", "items", "k", "max_chars", "id_field", "text_field", "label_field"})
    k = r.integer(ex["k"], "prompt.examples.k", 1)
    max_chars = r.integer(ex.get("max_chars", DEFAULT_EXAMPLE_CHARS), "prompt.examples.max_chars", 1)
    if ("file" in ex) == ("items" in ex):
        r.fail("prompt.examples", "give exactly one of 'file' or 'items'")
    if "items" in ex:  # a planned job's stored form
        rows = ex["items"]
        if not isinstance(rows, list) or not all(
                isinstance(row, list) and len(row) == 3 and all(isinstance(x, str) for x in row) for row in rows):
            r.fail("prompt.examples.items", "must be a list of [id, text, label] string triples")
        return ExamplesSpec(items=tuple(Example(*row) for row in rows), k=k, max_chars=max_chars)
    path = (base_dir / r.string(ex["file"], "prompt.examples.file")).resolve()
    fields = {name: r.string(ex.get(f"{name}_field", name), f"prompt.examples.{name}_field")
              for name in ("id", "text", "label")}
    items: list[Example] = []
    seen: set[str] = set()
    try:
        with path.open("rb") as f:
            for line_no, raw in enumerate(f, 1):
                where = f"{path}, line {line_no}"
                try:
                    line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
                except UnicodeDecodeError as exc:
                    raise SpecError(f"{where}: not valid UTF-8 (byte {exc.start + 1} of the line)") from None
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise SpecError(f"{where}: not valid JSON: {exc.msg} at column {exc.colno}") from None
                values: list[str] = []
                for name in ("id", "text", "label"):
                    value = row.get(fields[name]) if isinstance(row, dict) else None
                    if not isinstance(value, str) or not value:
                        raise SpecError(f"{where}: example field {fields[name]!r} must be a non-empty string")
                    values.append(value)
                if values[0] in seen:
                    raise SpecError(f"{where}: example id {values[0]!r} appears twice")
                seen.add(values[0])
                items.append(Example(*values))
    except OSError as exc:
        r.fail("prompt.examples.file", f"cannot read {path}: {_one_line(exc)}")
    if not items:
        r.fail("prompt.examples.file", f"{path} holds no examples")
    return ExamplesSpec(items=tuple(items), k=k, max_chars=max_chars, file=path)


def _parse_decoding(r: _Reader, raw: Any, engine: str) -> DecodingSpec:
    dec = r.mapping(raw, "decoding",
                    allowed={"temperature", "max_tokens", "seed", "top_p", "stop", *PENALTY_DEFAULTS})
    repetition = dec.get("repetition_penalty")
    if repetition is not None:
        repetition = r.number(repetition, "decoding.repetition_penalty", float("-inf"))
        if repetition <= 0:
            r.fail("decoding.repetition_penalty", f"must be greater than 0 (1 is none), not {repetition:g}")
    decoding = DecodingSpec(
        temperature=r.number(dec.get("temperature", 0.0), "decoding.temperature", 0.0),
        max_tokens=r.integer(dec.get("max_tokens", 256), "decoding.max_tokens", 1),
        seed=r.integer(dec.get("seed", 0), "decoding.seed", 0),
        top_p=r.number(dec.get("top_p", 1.0), "decoding.top_p", 0.0),
        repetition_penalty=repetition,
        frequency_penalty=_openai_penalty(r, dec, "frequency_penalty"),
        presence_penalty=_openai_penalty(r, dec, "presence_penalty"),
        stop=stop_sequences(dec.get("stop"), lambda message: r.fail("decoding.stop", message)),
    )
    refusal = unhonoured_knob(ENGINES[engine], decoding.knobs(), "engine")
    if refusal:
        raise SpecError(f"{r.where}: {refusal}")
    return decoding


def _openai_penalty(r: _Reader, dec: Mapping[str, Any], name: str) -> float | None:
    value = dec.get(name)
    return None if value is None else r.number(value, f"decoding.{name}", -2.0, 2.0)


def stop_sequences(value: Any, fail: Callable[[str], NoReturn]) -> tuple[str, ...]:
    """A stop setting as the spec and OpenAI requests write it (a string, a list of them
    or null), normalised to a tuple; `fail` is called with a one-line reason."""
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        fail(f"must be a non-empty string or a list of them, not {value!r}")
    if len(stops) > MAX_STOP_SEQUENCES:
        fail(f"has {len(stops)} sequences; at most {MAX_STOP_SEQUENCES} are allowed")
    return tuple(stops)


def _parse_shards(r: _Reader, raw: Any) -> ShardSpec:
    sh = r.mapping(raw, "shards", allowed=set(ShardSpec.__dataclass_fields__))
    defaults = ShardSpec()
    size_auto = sh.get("size") == "auto"
    if size_auto:
        for needed in ("interruptions_per_hour", "workers", "records_per_second"):
            if sh.get(needed) is None:
                r.fail(f"shards.{needed}", "is required with shards.size: auto")
    shards = ShardSpec(
        size=defaults.size if size_auto else r.integer(sh.get("size", defaults.size), "shards.size", 1),
        size_auto=size_auto,
        interruptions_per_hour=(r.number(sh["interruptions_per_hour"], "shards.interruptions_per_hour", 0.0)
                                if sh.get("interruptions_per_hour") is not None else None),
        workers=r.optional_int(sh.get("workers"), "shards.workers", 1),
        records_per_second=(r.number(sh["records_per_second"], "shards.records_per_second", 1e-6)
                            if sh.get("records_per_second") is not None else None),
        max_attempts=r.integer(sh.get("max_attempts", defaults.max_attempts), "shards.max_attempts", 1),
        lease_seconds=r.number(sh.get("lease_seconds", defaults.lease_seconds), "shards.lease_seconds", 0.1),
        renew_seconds=r.number(sh.get("renew_seconds", defaults.renew_seconds), "shards.renew_seconds", 0.05),
        batch_size=r.integer(sh.get("batch_size", defaults.batch_size), "shards.batch_size", 1),
        record_timeout_seconds=r.number(
            sh.get("record_timeout_seconds", defaults.record_timeout_seconds), "shards.record_timeout_seconds", 0.01
        ),
        batch_timeout_seconds=r.number(
            sh.get("batch_timeout_seconds", defaults.batch_timeout_seconds), "shards.batch_timeout_seconds", 0.0
        ),
        grace_seconds=r.number(sh.get("grace_seconds", defaults.grace_seconds), "shards.grace_seconds", 0.0),
        tail_split=r.boolean(sh.get("tail_split", defaults.tail_split), "shards.tail_split"),
    )
    if shards.renew_seconds >= shards.lease_seconds:
        r.fail("shards.renew_seconds", "must be shorter than shards.lease_seconds")

    return shards


def _parse_deadline(r: _Reader, value: Any) -> datetime | None:
    if value is None:
        return None
    if isinstance(value, datetime):
        return value
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        r.fail("deadline", f"{value!r} is not an ISO 8601 time")


_PROVIDER_FIELDS = {"api", "model", "classes", "retention", "base_url", "api_key_env", "completion_window",
                    "poll_seconds", "prices", "shard_size", "options"}


def _parse_routing(r: _Reader, raw: Any) -> RoutingSpec:
    ro = r.mapping(raw, "routing", required={"class_field", "providers"}, allowed={"class_field", "providers"})
    class_field = r.string(ro["class_field"], "routing.class_field")
    providers_raw = r.mapping(ro["providers"], "routing.providers", allowed=set(ro["providers"] or {}))
    if not providers_raw:
        r.fail("routing.providers", "names no provider; leave routing out to keep every record local")
    providers: list[ProviderSpec] = []
    cleared: dict[str, str] = {}
    for route, body in providers_raw.items():
        where = f"routing.providers.{route}"
        if not isinstance(route, str) or not ROUTE_NAME.match(route) or route == LOCAL_ROUTE:
            r.fail(where, f"route name {route!r} must be lower-case letters, digits, '-' or '_' "
                          f"and not {LOCAL_ROUTE!r}")
        pv = r.mapping(body, where, required={"api", "model", "classes", "retention"}, allowed=_PROVIDER_FIELDS)
        api = r.string(pv["api"], f"{where}.api")
        if api not in PROVIDERS:
            r.fail(f"{where}.api", f"{api!r} is not one of {', '.join(PROVIDERS)}")
        classes = pv["classes"]
        if not isinstance(classes, list) or not classes:
            r.fail(f"{where}.classes", "must be a non-empty list of class names")
        for i, cls in enumerate(classes):
            name = r.string(cls, f"{where}.classes[{i}]")
            if name in cleared:
                r.fail(f"{where}.classes[{i}]", f"class {name!r} is already cleared for {cleared[name]!r}; "
                                                "a class goes to one provider")
            cleared[name] = route
        prices = r.mapping(pv.get("prices", {}) or {}, f"{where}.prices",
                           allowed={"input_per_mtok", "output_per_mtok"})
        options = pv.get("options", {}) or {}
        if not isinstance(options, dict):
            r.fail(f"{where}.options", "must be a mapping")
        providers.append(ProviderSpec(
            route=route, api=api, model=r.string(pv["model"], f"{where}.model"),
            classes=tuple(str(c) for c in classes),
            retention=r.string(pv["retention"], f"{where}.retention"),
            base_url=r.optional_string(pv.get("base_url"), f"{where}.base_url"),
            api_key_env=r.optional_string(pv.get("api_key_env"), f"{where}.api_key_env"),
            completion_window=r.string(pv.get("completion_window", "24h"), f"{where}.completion_window"),
            poll_seconds=r.number(pv.get("poll_seconds", 60.0), f"{where}.poll_seconds", 0.01),
            input_price_per_mtok=(r.number(prices["input_per_mtok"], f"{where}.prices.input_per_mtok", 0.0)
                                  if prices.get("input_per_mtok") is not None else None),
            output_price_per_mtok=(r.number(prices["output_per_mtok"], f"{where}.prices.output_per_mtok", 0.0)
                                   if prices.get("output_per_mtok") is not None else None),
            shard_size=r.optional_int(pv.get("shard_size"), f"{where}.shard_size", 1),
            options=options,
        ))
    return RoutingSpec(class_field=class_field, providers=tuple(providers))


STORE_ONLY_KEYS = ("base_version",)


def spec_from_store(data: Mapping[str, Any]) -> JobSpec:
    """The spec a version was planned with, from its self-contained stored form."""
    spec = parse_spec({k: v for k, v in data.items() if k not in STORE_ONLY_KEYS}, base_dir=Path("/"),
                      resolved=True)
    return replace(spec, base_version=data.get("base_version"))


class _PlannedJob(Protocol):
    @property
    def spec(self) -> Mapping[str, Any]: ...


def stored_spec(job: _PlannedJob) -> JobSpec:
    """The spec of a planned job (a store's JobInfo), as every reader of it should see it:
    parsed, with every default applied once, here."""
    return spec_from_store(job.spec)


def _parse_validate(r: _Reader, raw: Any, base_dir: Path, label_field: str | None) -> ValidateSpec:
    val = r.mapping(raw, "validate", allowed={"max_dead_letter_rate", "schema_sample", "drift", "eval"})
    dr = r.mapping(val.get("drift", {}) or {}, "validate.drift",
                   allowed={"max_psi", "max_new_categories", "max_vanished_categories"})
    drift = DriftSpec(
        max_psi=r.number(dr.get("max_psi", 0.25), "validate.drift.max_psi", 0.0),
        max_new_categories=r.integer(dr.get("max_new_categories", 0), "validate.drift.max_new_categories", 0),
        max_vanished_categories=r.optional_int(dr.get("max_vanished_categories"),
                                               "validate.drift.max_vanished_categories", 0),
    )
    evaluation = None
    if val.get("eval") is not None:
        ev = r.mapping(val["eval"], "validate.eval", required={"labels"},
                       allowed={"labels", "id_field", "label_field", "field", "sample", "min_accuracy", "grader"})
        field_name = r.optional_string(ev.get("field"), "validate.eval.field") or label_field
        if field_name is None:
            r.fail("validate.eval.field", "is required when output.label_field is not set")
        grader = r.optional_string(ev.get("grader"), "validate.eval.grader")
        if grader is not None and ":" not in grader:
            r.fail("validate.eval.grader", f"{grader!r} must be 'module:function'")
        evaluation = EvalSpec(
            labels=(base_dir / r.string(ev["labels"], "validate.eval.labels")).resolve(),
            id_field=r.string(ev.get("id_field", "id"), "validate.eval.id_field"),
            label_field=r.string(ev.get("label_field", "label"), "validate.eval.label_field"),
            field=field_name,
            sample=r.integer(ev.get("sample", 300), "validate.eval.sample", 1),
            min_accuracy=r.number(ev.get("min_accuracy", 0.0), "validate.eval.min_accuracy", 0.0),
            grader=grader,
        )
    return ValidateSpec(
        max_dead_letter_rate=r.number(val.get("max_dead_letter_rate", 0.01), "validate.max_dead_letter_rate", 0.0,
                                      1.0),
        schema_sample=r.optional_int(val.get("schema_sample"), "validate.schema_sample", 1),
        drift=drift,
        eval=evaluation,
    )


def _input_locations(r: _Reader, value: Any, base_dir: Path, storage: Mapping[str, Any]) -> tuple[str, ...]:
    items = value if isinstance(value, list) else [value]
    if not items:
        r.fail("input.path", "is empty")
    paths: list[str] = []
    for i, item in enumerate(items):
        text = r.string(item, f"input.path[{i}]" if isinstance(value, list) else "input.path")
        if text.startswith(OBJECT_SCHEMES):
            paths.extend(_object_locations(r, text, storage))
        elif any(ch in text for ch in "*?["):
            matches = sorted(base_dir.glob(text)) if not Path(text).is_absolute() else sorted(
                Path("/").glob(text.lstrip("/")))
            if not matches:
                r.fail("input.path", f"{text!r} matches no file")
            paths.extend(str(m.resolve()) for m in matches)
        else:
            paths.append(str((base_dir / text).resolve()))
    return tuple(paths)


def _object_locations(r: _Reader, url: str, storage: Mapping[str, Any]) -> list[str]:
    """An object URL as it is, or a glob's matches from one prefix listing."""
    from batchline.sources.objects import expand_glob, has_glob, split_url

    _scheme, _bucket, key = split_url(url)
    if not key or key.endswith("/"):
        r.fail("input.path", f"{url} names a bucket or a folder, not an object; add a glob such as "
                             f"{url.rstrip('/')}/*.jsonl")
    if not has_glob(key):
        return [url]
    matches = expand_glob(url, lake_settings(storage))
    if not matches:
        r.fail("input.path", f"{url!r} matches no object")
    return matches


def _manifest_locations(r: _Reader, manifest: str, base_dir: Path, storage: Mapping[str, Any]) -> tuple[str, ...]:
    """The objects a manifest lists, one a line: an object URL, or (in a manifest that is
    itself an object) a key in the manifest's bucket. Blank lines and `#` comments are skipped."""
    bucket_url = None
    if manifest.startswith(OBJECT_SCHEMES):
        from batchline.sources.objects import read_object, split_url

        scheme, bucket, _key = split_url(manifest)
        bucket_url = f"{scheme}://{bucket}/"
        data = read_object(manifest, lake_settings(storage))
    else:
        path = (base_dir / manifest).resolve()
        manifest = str(path)
        try:
            data = path.read_bytes()
        except OSError as exc:
            r.fail("input.manifest", f"cannot read {path}: {_one_line(exc.strerror or exc)}")
    try:
        lines = data.decode("utf-8-sig").splitlines()
    except UnicodeDecodeError:
        r.fail("input.manifest", f"{manifest} is not UTF-8 text")
    seen: dict[str, int] = {}
    for line_no, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if not line.startswith(OBJECT_SCHEMES):
            if bucket_url is None:
                r.fail("input.manifest", f"{manifest}:{line_no}: {line!r} is not an object URL (s3://bucket/key "
                                         "or gs://bucket/key); a key alone needs a manifest in the same bucket")
            line = bucket_url + line.lstrip("/")
        if line in seen:
            r.fail("input.manifest", f"{manifest}:{line_no}: {line} is listed again (first at line {seen[line]})")
        seen[line] = line_no
    if not seen:
        r.fail("input.manifest", f"{manifest} lists no object")
    return tuple(seen)


def _check_chat_input(r: _Reader, inp: Mapping[str, Any], top: Mapping[str, Any]) -> None:
    """An openai-batch line has fixed fields and carries its whole conversation."""
    for key, fixed in (("id_field", "custom_id"), ("text_field", "messages")):
        if inp.get(key, fixed) != fixed:
            r.fail(f"input.{key}", f"is always {fixed!r} with input.format {OPENAI_BATCH}; leave it out")
    if inp.get("acl_field") is not None:
        r.fail("input.acl_field", f"an {OPENAI_BATCH} line has no field for an ACL; convert the file to "
                                  "jsonl to carry one")
    if top.get("prompt") is not None:
        r.fail("prompt", f"is not used with input.format {OPENAI_BATCH}: each line's messages are its whole "
                         "prompt; put shared instructions in a system message of each line")
    if top.get("routing") is not None:
        # Hosted routes are sent a rendered prompt, which would drop all but the last turn.
        r.fail("routing", f"is not supported with input.format {OPENAI_BATCH} yet: hosted providers are "
                          "sent one prompt, not a conversation")


def _format_of(r: _Reader, locations: tuple[str, ...]) -> str:
    formats: set[str] = set()
    for p in locations:
        suffix = PurePosixPath(p).suffix.lower()
        fmt = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".parquet": "parquet"}.get(suffix)
        if fmt is None:
            r.fail("input.path", f"{p}: cannot tell the format from {suffix or 'no suffix'!r}; "
                                 "set input.format to jsonl, csv or parquet")
        formats.add(fmt)
    if len(formats) > 1:
        r.fail("input.path", f"mixes formats {sorted(formats)}; one job reads one format")
    return formats.pop()


def _load_schema(r: _Reader, value: Any, base_dir: Path) -> tuple[dict[str, Any], Path | None]:
    schema_path: Path | None = None
    if isinstance(value, dict):
        schema = value
    else:
        schema_path = (base_dir / r.string(value, "output.schema")).resolve()
        try:
            schema = json.loads(schema_path.read_text(encoding="utf-8"))
        except OSError as exc:
            r.fail("output.schema", f"cannot read {schema_path}: {_one_line(exc)}")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            r.fail("output.schema", f"{schema_path} is not JSON: {_one_line(exc)}")
    if not isinstance(schema, dict):
        r.fail("output.schema", "must be a JSON object")
    validator_cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator_cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        path = "/".join(str(p) for p in exc.path) or "(root)"
        r.fail("output.schema", f"not a valid JSON Schema at {path}: {_one_line(exc.message)}")
    return schema, schema_path


def _one_line(exc: object) -> str:
    return " ".join(str(exc).split())


class _Reader:
    """Small typed accessors that name the offending field in every error."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, field_name: str, message: str) -> NoReturn:
        raise SpecError(f"{self.where}: {field_name}: {message}")

    def mapping(self, value: Any, name: str, *, required: set[str] | None = None,
                allowed: set[str]) -> dict[str, Any]:
        label = name or "(top level)"
        if not isinstance(value, dict):
            self.fail(label, "must be a mapping")
        for key in value:
            if key not in allowed:
                full = f"{name}.{key}" if name else str(key)
                self.fail(full, f"unknown field (allowed: {', '.join(sorted(allowed))})")
        for key in sorted(required or ()):
            if key not in value or value[key] is None:
                self.fail(f"{name}.{key}" if name else key, "is required")
        return value

    def string(self, value: Any, name: str) -> str:
        if not isinstance(value, str) or not value:
            self.fail(name, "must be a non-empty string")
        return str(value)

    def optional_string(self, value: Any, name: str) -> str | None:
        return None if value is None else self.string(value, name)

    def integer(self, value: Any, name: str, minimum: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(name, f"must be an integer, not {value!r}")
        if value < minimum:
            self.fail(name, f"must be at least {minimum}")
        return int(value)

    def optional_int(self, value: Any, name: str, minimum: int) -> int | None:
        return None if value is None else self.integer(value, name, minimum)

    def string_list(self, value: Any, name: str) -> list[str]:
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            self.fail(name, f"must be a list of non-empty strings, not {value!r}")
        return list(value)

    def boolean(self, value: Any, name: str) -> bool:
        if not isinstance(value, bool):
            self.fail(name, f"must be true or false, not {value!r}")
        return value

    def number(self, value: Any, name: str, minimum: float, maximum: float | None = None) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            self.fail(name, f"must be a number, not {value!r}")
        if maximum is not None and not minimum <= value <= maximum:
            self.fail(name, f"must be between {minimum:g} and {maximum:g}, not {value!r}")
        if value < minimum:
            self.fail(name, f"must be at least {minimum}")
        return float(value)
