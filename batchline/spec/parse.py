"""The job spec's parser: YAML into the typed model, each field checked where it is written.

Every section's fields are declared once, with the JSON Schema of each value
(`*_FIELDS`): the parser allows exactly those keys, and `batchline.spec.schema`
makes the spec's JSON Schema from the same declarations. A source's or a target's
section is declared and parsed by its plug-in (batchline.sources, batchline.targets),
found by the key it owns.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path, PurePosixPath
from typing import Any, NoReturn, Protocol

import jsonschema
import yaml

from batchline.acl import Acl, AclUnreadable
from batchline.errors import EngineFatal, SpecError, one_line
from batchline.lake import STORAGE_FIELDS, check_storage_options
from batchline.prompts.examples import DEFAULT_EXAMPLE_CHARS, Example
from batchline.registry import (
    ENGINES,
    FORMATS,
    GRADERS,
    PROVIDERS,
    SOURCES,
    TARGETS,
    is_remote,
    loaded,
    unhonoured_knob,
)
from batchline.registry import keyed as keyed_members
from batchline.spec.deadline import FALLBACK_FIELDS, parse_deadline, parse_fallback
from batchline.spec.model import (
    COMPRESSED_SUFFIXES,
    DEFAULT_ABORT_MIN_OUTCOMES,
    DEFAULT_MAX_BYTES_PER_TOKEN,
    LOCAL_ROUTE,
    MAX_STOP_SEQUENCES,
    NAME_PATTERN,
    OPENAI_BATCH,
    PENALTY_DEFAULTS,
    REPLICA_FALLBACKS,
    REPRODUCE_ON,
    ROUTE_NAME,
    ROWS,
    STORED,
    ChatRules,
    DecodingSpec,
    DriftSpec,
    ExamplesSpec,
    InputSpec,
    JobSpec,
    ModelSpec,
    PromptSpec,
    ProviderSpec,
    Regions,
    Replica,
    ReproduceSpec,
    RetentionSpec,
    RoutingSpec,
    ShardSpec,
    ValidateSpec,
    region_refusal,
)
from batchline.spec.ports import FileSet, GraderContext, GraderParser, expand_paths
from batchline.spec.reader import Fields, ParseContext, SpecReader
from batchline.store import JobInfo, ReaderStore, require_job

# --- each section's fields ---------------------------------------------------------------

_STR: Mapping[str, Any] = {"type": "string", "minLength": 1}
_STRS: Mapping[str, Any] = {"type": "array", "items": _STR}
_INT: Mapping[str, Any] = {"type": "integer"}
_NUM: Mapping[str, Any] = {"type": "number"}
_BOOL: Mapping[str, Any] = {"type": "boolean"}
_MAP: Mapping[str, Any] = {"type": "object"}  # a nested section; batchline.spec.schema fills it in


_NO_DEFAULT = object()


def _doc(schema: Mapping[str, Any], description: str, default: Any = _NO_DEFAULT) -> dict[str, Any]:
    """A field's schema with its description and, where the parser has one, its default
    (taken from the typed model's own default, which the parser applies)."""
    return {**schema, "description": description, **({} if default is _NO_DEFAULT else {"default": default})}


TOP_FIELDS: Fields = {
    "name": _doc({**_STR, "pattern": NAME_PATTERN.pattern},
                 "What publish points at: lower-case letters, digits, '-' or '_', starting with a letter"),
    "input": _doc(_MAP, "Where the records are and how to read them"),
    "model": _doc(_MAP, "The engine, its weights and its options"),
    "prompt": _doc(_MAP, "The shared instruction prefix (not with input.format openai-batch)"),
    "decoding": _doc(_MAP, "How the output is sampled"),
    "output": _doc(_MAP, "The output's JSON Schema, and where a published version is shown"),
    "shards": _doc(_MAP, "How the input is cut and leased (scheduling: not part of the version)"),
    "deadline": _doc(_STR, "An ISO 8601 time, or a window (6h, 90m, 1h30m) from the version's first claim: the "
                           "pacer holds it, ETA and reports measure against it (not part of the version)"),
    "fallback": _doc(_MAP, "Paid workers of the same version a pacer may buy while the job is behind its deadline "
                           "(not part of the version)"),
    "validate": _doc(_MAP, "The gate a sealed version must pass before it is published"),
    "base": _doc(_STR, "published, or a version: carry unchanged records from it"),
    "retention": _doc(_MAP, "How many versions of the name are kept"),
    "routing": _doc(_MAP, "Records of cleared classes sent to hosted batch APIs"),
}
INPUT_FIELDS: Fields = {
    "path": _doc({"anyOf": [_STR, _STRS]}, "A file, an object URL, a list or a glob"),
    "id_field": _doc(_STR, "The field holding each record's id (custom_id for openai-batch)", "id"),
    "text_field": _doc(_STR, "The field holding the text the prompt shows (messages for openai-batch)", "text"),
    "text_fields": _doc({"type": "array", "items": _STR, "minItems": 1, "uniqueItems": True},
                        "Instead of text_field: fields the prompt shows together, each as `name: value` in this "
                        "order, a blank line between (not with openai-batch)"),
    "acl_field": _doc(_STR, "A list of groups (or one) on every record, copied onto its result or dead letter"),
    "acl_missing": _doc(_STRS, "What a missing ACL means; without it a record without one stops planning"),
    "ids": _doc({"enum": ["field", "content"]}, "field: the id_field; content: a digest of each whole row", "field"),
    "max_input_tokens": _doc({**_INT, "minimum": 1}, "A record over this many tokens is a dead letter, uncharged"),
    "max_bytes_per_token": _doc({**_INT, "minimum": 1}, "The planner's cheap bound: longer than max_input_tokens "
                                "times this many UTF-8 bytes is surely over the cap", DEFAULT_MAX_BYTES_PER_TOKEN),
    "format": _doc({"enum": list(FORMATS)}, "How the files are read; default from their suffix "
                   "(openai-batch is never guessed)"),
    "storage": _doc(_MAP, "Where the object store is and how long to wait on it; never a credential"),
    "region": _doc(_STR, "The region input.path's objects are in (a name such as us-east-1)"),
    "replicas": _doc(_MAP, "REGION: a prefix (or {location, storage}) holding the same objects under the same keys "
                           "below the primary's common folder; a worker of REGION reads there"),
    "replica_fallback": _doc({"enum": list(REPLICA_FALLBACKS)}, "primary: a worker whose replica cannot be reached "
                             "reads the primary; none (the default): it gives its shard back"),
    "regions": _doc(_MAP, "REGION: a path, glob or list (or {path, storage}) of objects that live there, instead of "
                          "input.path: each shard's home region, claimed there first"),
}
MODEL_FIELDS: Fields = {
    "engine": _doc({"enum": list(ENGINES)}, "The engine that answers each record"),
    "path": _doc(_STR, "Weights (a file, a folder, pkg:, an object URL), or a server's base URL"),
    "digest": _doc({"type": "string", "pattern": "^sha256:[0-9a-fA-F]{64}$"},
                   "The weights' digest, verified before the first record; required for weights in object storage"),
    "options": _doc(_MAP, "The engine's options (see the engines page); an unknown one is refused"),
}
PROMPT_FIELDS: Fields = {
    "file": _doc(_STR, "A file holding the instruction prefix (or text)"),
    "text": _doc(_STR, "The instruction prefix itself (or file)"),
    "version": _doc({"type": ["string", "number"]}, "The prompt's version, part of the job version"),
    "examples": _doc(_MAP, "Labelled examples: each record is shown the k nearest to its text"),
}
EXAMPLES_FIELDS: Fields = {
    "file": _doc(_STR, "A JSONL file of labelled examples"),
    "items": _doc({"type": "array", "items": {"type": "array", "items": {"type": "string"}}},
                  "The examples as [id, text, label] (a planned job's stored form)"),
    "k": _doc({**_INT, "minimum": 1}, "How many examples each record is shown"),
    "max_chars": _doc({**_INT, "minimum": 1}, "The characters of each example's text shown", ExamplesSpec.max_chars),
    "id_field": _doc(_STR, "The examples' id field", "id"),
    "text_field": _doc(_STR, "The examples' text field", "text"),
    "label_field": _doc(_STR, "The examples' label field", "label"),
}
DECODING_FIELDS: Fields = {
    "temperature": _doc({**_NUM, "minimum": 0}, "Sampling temperature; 0 is greedy", DecodingSpec.temperature),
    "max_tokens": _doc({**_INT, "minimum": 1}, "The most tokens an output may have", DecodingSpec.max_tokens),
    "seed": _doc({**_INT, "minimum": 0}, "The sampling seed", DecodingSpec.seed),
    "top_p": _doc({**_NUM, "minimum": 0}, "Nucleus sampling's probability mass", DecodingSpec.top_p),
    "stop": _doc({"anyOf": [_STR, _STRS, {"type": "null"}]},
                 f"The output ends before the first of these (at most {MAX_STOP_SEQUENCES})"),
    "repetition_penalty": _doc({**_NUM, "exclusiveMinimum": 0},
                               "Divides the logit of every token already in the prompt or output; 1 is none"),
    "frequency_penalty": _doc({**_NUM, "minimum": -2, "maximum": 2},
                              "Minus this times a token's count in the output (the OpenAI API's)"),
    "presence_penalty": _doc({**_NUM, "minimum": -2, "maximum": 2},
                             "Minus this once a token is in the output (the OpenAI API's)"),
}
assert set(PENALTY_DEFAULTS) <= set(DECODING_FIELDS)
OUTPUT_FIELDS: Fields = {
    "schema": _doc({"anyOf": [_STR, {"type": "object"}]}, "A JSON Schema file, or the schema itself"),
    "label_field": _doc(_STR, "The output field that drift, evaluation and the report count as a label"),
    "carry": _doc(_STRS, "Input fields copied onto every result and dead letter, so results join back to "
                  "the input; a record without one stops planning"),
    "provenance": _doc(_BOOL, "Each result's attempt, worker, lease epoch and origin version in the exports, "
                       "tables and index rows", False),
}
_SHARD_TYPES = {"int": _INT, "float": _NUM, "bool": _BOOL, "int | None": _INT, "float | None": _NUM}
_SHARD_DOCS = {
    "size": ("Records per shard, or auto (with interruptions_per_hour, workers and records_per_second); a "
             "Parquet shard is whole row groups, so it holds at least one row group whatever this says"),
    "max_attempts": "The attempt at which a failing record becomes a dead letter",
    "lease_seconds": "How long a claim holds a shard without a renewal",
    "renew_seconds": "How often a worker renews its lease; shorter than lease_seconds",
    "batch_size": "Records handed to the engine child at a time",
    "record_timeout_seconds": "A batch of n may take batch_timeout_seconds plus n times this",
    "batch_timeout_seconds": "A batch's fixed allowance before it counts as hung",
    "grace_seconds": "How long a stopping worker finishes the records in flight",
    "tail_split": "Idle workers split a slow shard's unstarted tail off",
    "size_auto": "Written by the planner for size: auto (a stored spec's form)",
    "interruptions_per_hour": "size: auto: the rate at which workers are interrupted",
    "workers": "size: auto: the fleet's size",
    "records_per_second": "size: auto: one worker's throughput",
    "abort_dead_letter_rate": "Halt the version once its computed outcomes' dead-letter share passes this "
                              "(at least validate.max_dead_letter_rate; default: never)",
    "locality_wait_seconds": "With input.regions: how long a worker with no shard of its region ready waits, since "
                             "it last claimed one, before it takes another region's",
    "abort_min_outcomes": "Outcomes computed before abort_dead_letter_rate is judged (default "
                          f"{DEFAULT_ABORT_MIN_OUTCOMES})",
}
# Every field of ShardSpec (a stored spec writes them all, size_auto among them), with its default.
SHARD_FIELDS: Fields = {
    f.name: _doc({"anyOf": [{**_INT, "minimum": 1}, {"const": "auto"}]} if f.name == "size" else _SHARD_TYPES[str(f.type)],
                 _SHARD_DOCS[f.name], *(() if f.default is None else (f.default,)))
    for f in fields(ShardSpec)
}
VALIDATE_FIELDS: Fields = {
    "max_dead_letter_rate": _doc({**_NUM, "minimum": 0, "maximum": 1}, "The share of records that may end as "
                                 "dead letters", ValidateSpec.max_dead_letter_rate),
    "schema_sample": _doc({**_INT, "minimum": 1}, "Re-check this many stored results against the schema "
                          "(default: every one)"),
    "drift": _doc(_MAP, "The label's distribution against the published version"),
    "reproduce": _doc(_MAP, "Recompute a sample in a fresh engine process and compare with the stored results"),
}
REPRODUCE_FIELDS: Fields = {
    "sample": _doc({**_INT, "minimum": 1}, "How many results are recomputed (all of them where the version has "
                   "fewer), chosen at random by the seed"),
    "min_agreement": _doc({**_NUM, "minimum": 0, "maximum": 1}, "The share that must agree, or the publish is "
                          "refused (default: reported, never a failure)"),
    "seed": _doc({**_INT, "minimum": 0}, "Chooses the sample", ReproduceSpec.seed),
    "batch_size": _doc({**_INT, "minimum": 1}, "Records per batch in the check's engine; never shards.batch_size "
                       "(default: 1, or 2 where the workers' batches hold one)"),
    "on": _doc({"enum": list(REPRODUCE_ON)}, "What must agree: the whole output, or output.label_field",
               ReproduceSpec.on),
    "min_cosine": _doc({**_NUM, "minimum": -1, "maximum": 1}, "An embedding agrees at this cosine similarity "
                       "or more", ReproduceSpec.min_cosine),
}
DRIFT_FIELDS: Fields = {
    "max_psi": _doc({**_NUM, "minimum": 0}, "The largest population stability index allowed", DriftSpec.max_psi),
    "max_new_categories": _doc({**_INT, "minimum": 0}, "Labels the published version did not have",
                               DriftSpec.max_new_categories),
    "max_vanished_categories": _doc({**_INT, "minimum": 0}, "Labels of the published version gone "
                                    "(default: reported, never a failure)"),
}
RETENTION_FIELDS: Fields = {
    "versions": _doc({**_INT, "minimum": 2}, "Versions of the name kept after a publish (never the published one "
                     "or the one a rollback returns to)", RetentionSpec.versions),
}
ROUTING_FIELDS: Fields = {
    "class_field": _doc(_STR, "The record field holding its class; only cleared classes leave"),
    "providers": _doc(_MAP, "The hosted routes, by name"),
}
PROVIDER_FIELDS: Fields = {
    "api": _doc({"enum": list(PROVIDERS)}, "The hosted batch API"),
    "model": _doc(_STR, "The provider's model"),
    "classes": _doc(_STRS, "The classes cleared for this provider (each for one provider only)"),
    "retention": _doc(_STR, "The provider's retention terms, printed before anything is sent"),
    "base_url": _doc(_STR, "The API's address (default: the provider's own)"),
    "api_key_env": _doc(_STR, "The environment variable holding the key (default OPENAI_API_KEY or "
                        "ANTHROPIC_API_KEY)"),
    "completion_window": _doc(_STR, "The batch's completion window", ProviderSpec.completion_window),
    "poll_seconds": _doc({**_NUM, "minimum": 0.01}, "How often a submitted batch is polled",
                         ProviderSpec.poll_seconds),
    "prices": _doc(_MAP, "Batch prices, for the report"),
    "shard_size": _doc({**_INT, "minimum": 1}, "Records per batch (default shards.size)"),
    "options": _doc(_MAP, "Merged into every request body"),
}
PRICES_FIELDS: Fields = {
    "input_per_mtok": _doc({**_NUM, "minimum": 0}, "US dollars per million input tokens"),
    "output_per_mtok": _doc({**_NUM, "minimum": 0}, "US dollars per million output tokens"),
}


def input_fields() -> dict[str, Mapping[str, Any]]:
    """The input section's fields: the core's, each source family's keys and options, and each
    format's options."""
    out: dict[str, Mapping[str, Any]] = dict(INPUT_FIELDS)
    for family in keyed_members(SOURCES).values():
        out.update(family.keys)
        out.update(family.options)
    for fmt in loaded(FORMATS):
        out.update(fmt.options)
    return out


def output_fields() -> dict[str, Mapping[str, Any]]:
    """The output section's fields: the core's, and each target family's keys."""
    out: dict[str, Mapping[str, Any]] = dict(OUTPUT_FIELDS)
    for family in keyed_members(TARGETS).values():
        out.update(family.keys)
    return out


def validate_fields() -> dict[str, Mapping[str, Any]]:
    """The validate section's fields: the core's, and each grader's keys."""
    out: dict[str, Mapping[str, Any]] = dict(VALIDATE_FIELDS)
    for key, grader in graders().items():
        out[key] = grader.keys[key]
    return out


def graders() -> dict[str, GraderParser]:
    """Each `validate` key a GRADERS member owns, and the member."""
    found: dict[str, GraderParser] = keyed_members(GRADERS)
    return found


_Section = tuple[Callable[[], Mapping[str, Mapping[str, Any]]], frozenset[str]]


def _fields_of(grader: GraderParser) -> Mapping[str, Mapping[str, Any]]:
    return grader.fields


class _Sections(Mapping[str, _Section]):
    """`SECTIONS`, with each grader's section added when first read (the graders are found
    through the registry, which imports them only then)."""

    def __init__(self, fixed: Mapping[str, _Section]) -> None:
        self._fixed = fixed
        self._all: dict[str, _Section] | None = None

    def _sections(self) -> dict[str, _Section]:
        if self._all is None:
            found = dict(self._fixed)
            for key, grader in graders().items():
                if grader.fields:
                    found[f"validate.{key}"] = (functools.partial(_fields_of, grader), grader.required)
            self._all = found
        return self._all

    def __getitem__(self, key: str) -> _Section:
        return self._sections()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._sections())

    def __len__(self) -> int:
        return len(self._sections())


# A nested section's fields, by where it is (`*` any name), for the JSON Schema; with
# the keys each requires.
SECTIONS: Mapping[str, _Section] = _Sections({
    "": (lambda: TOP_FIELDS, frozenset({"name", "input", "model", "output"})),
    "input": (input_fields, frozenset()),
    "input.storage": (lambda: STORAGE_FIELDS, frozenset()),
    "model": (lambda: MODEL_FIELDS, frozenset({"engine"})),
    "prompt": (lambda: PROMPT_FIELDS, frozenset({"version"})),
    "prompt.examples": (lambda: EXAMPLES_FIELDS, frozenset({"k"})),
    "decoding": (lambda: DECODING_FIELDS, frozenset()),
    "output": (output_fields, frozenset({"schema"})),
    "shards": (lambda: SHARD_FIELDS, frozenset()),
    "validate": (validate_fields, frozenset()),
    "validate.drift": (lambda: DRIFT_FIELDS, frozenset()),
    "validate.reproduce": (lambda: REPRODUCE_FIELDS, frozenset({"sample"})),
    "retention": (lambda: RETENTION_FIELDS, frozenset()),
    "fallback": (lambda: FALLBACK_FIELDS, frozenset({"workers"})),
    "routing": (lambda: ROUTING_FIELDS, frozenset({"class_field", "providers"})),
    "routing.providers.*": (lambda: PROVIDER_FIELDS, frozenset({"api", "model", "classes", "retention"})),
    "routing.providers.*.prices": (lambda: PRICES_FIELDS, frozenset()),
})


# --- parsing -------------------------------------------------------------------------------


def load_spec(path: str | Path) -> JobSpec:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SpecError(f"{path}: job spec not found") from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise SpecError(f"{path}: not valid YAML: {one_line(exc)}") from None
    return parse_spec(raw, base_dir=path.parent, source=path)


def parse_spec(raw: Any, base_dir: Path, source: Path | None = None, *, resolved: bool = False) -> JobSpec:
    """`resolved`: the spec is a planned job's stored form, whose input locations are
    already resolved, listed and expanded, and are taken as they are."""
    where = str(source) if source else "spec"
    r = SpecReader(where)
    # prompt is required below unless the input is openai-batch, whose lines carry their prompts.
    top = r.section(raw, "", TOP_FIELDS, required=set(SECTIONS[""][1]))
    name = r.string(top["name"], "name")
    if not NAME_PATTERN.fullmatch(name):  # `$` alone would let a trailing newline through
        r.fail("name", f"{name!r} must be lower-case letters, digits, '-' or '_', starting with a letter")
    input_spec = _parse_input(r, top, base_dir, resolved)
    chat = input_spec.format == OPENAI_BATCH
    model_spec = _parse_model(r, top["model"], base_dir, resolved)
    prompt_spec = _parse_prompt(r, top, base_dir, chat)
    decoding = _parse_decoding(r, top.get("decoding", {}) or {}, model_spec.engine)
    out = r.section(top["output"], "output", output_fields(), required=set(SECTIONS["output"][1]))
    schema, schema_path = _load_schema(r, out["schema"], base_dir)
    label_field = r.optional_string(out.get("label_field"), "output.label_field")
    carry = _parse_carry(r, out.get("carry"), chat)
    if prompt_spec.examples is not None and label_field is None:
        r.fail("prompt.examples", "needs output.label_field: the output field an example's label answers")
    ctx = ParseContext(base_dir, input_spec.storage, resolved)
    targets = keyed_members(TARGETS)
    # In the order the section names them: publish stages and shows them in that order.
    named = tuple(targets[key].parse(key, out, r, ctx) for key in out if key in targets and out[key] is not None)
    shards = _parse_shards(r, top.get("shards", {}) or {})
    deadline = parse_deadline(top.get("deadline"), "deadline", r.fail)
    fallback = parse_fallback(top.get("fallback"), r)
    if fallback is not None and deadline is None:
        r.fail("fallback", "buys paid workers to hold a deadline: give deadline too (a time, or a window such as 6h)")
    validate = _parse_validate(r, top.get("validate", {}) or {}, GraderContext(
        name, base_dir, resolved, schema, label_field, input_spec.acl_field, shards.batch_size))
    if validate.reproduce is not None and top.get("routing") is not None:
        r.fail("validate.reproduce", "is not supported with routing: a hosted route's results are not recomputed "
                                     "here")
    if validate.grader("injection") is not None and top.get("routing") is not None:
        r.fail("validate.injection", "is not supported with routing: canaries run through the local engine, and a "
                                     "hosted route's records would be answered by another model")
    provenance = r.boolean(out.get("provenance", False), "output.provenance")
    check_abort_rate(shards.abort_dead_letter_rate, validate, lambda msg: r.fail("shards.abort_dead_letter_rate",
                                                                                msg))
    base = r.optional_string(top.get("base"), "base")
    ret = r.section(top.get("retention", {}) or {}, "retention", RETENTION_FIELDS)
    retention = RetentionSpec(versions=r.integer(ret.get("versions", RetentionSpec.versions), "retention.versions", 2))
    routing = _parse_routing(r, top["routing"]) if top.get("routing") is not None else None
    if routing is not None and input_spec.format in (STORED, ROWS):
        r.fail("routing", f"is not supported with {input_spec.describe()} yet: its records have no class field")
    for provider in routing.providers if routing is not None else ():
        refusal = unhonoured_knob(PROVIDERS[provider.api], decoding.knobs(), "provider")
        if refusal:
            raise SpecError(f"{r.where}: routing.providers.{provider.route}: {refusal}")
    if chat:
        input_spec = replace(input_spec, chat_rules=ChatRules(decoding=decoding, output_schema=schema))
    if routing is not None:
        input_spec = replace(input_spec, class_field=routing.class_field)
    if carry:
        input_spec = replace(input_spec, carry=carry)
    return JobSpec(name=name, input=input_spec, model=model_spec, prompt=prompt_spec,
                   decoding=decoding, output_schema=schema, schema_path=schema_path,
                   shards=shards, deadline=deadline, validate=validate, source=source,
                   label_field=label_field, base=base, retention=retention, routing=routing,
                   targets=named, fallback=fallback, provenance=provenance)


def _parse_carry(r: SpecReader, value: Any, chat: bool) -> tuple[str, ...]:
    if value is None:
        return ()
    names = r.string_list(value, "output.carry")
    if not names:
        r.fail("output.carry", "names no field; leave it out to carry none")
    if len(set(names)) != len(names):
        r.fail("output.carry", f"names a field twice: {names}")
    if chat:
        r.fail("output.carry", f"is not supported with input.format {OPENAI_BATCH}: join its results back by "
                               "custom_id, the record's id")
    return tuple(names)


def _parse_input(r: SpecReader, top: Mapping[str, Any], base_dir: Path, resolved: bool) -> InputSpec:
    keyed = keyed_members(SOURCES)
    inp = r.section(top["input"], "input", input_fields())
    storage = check_storage_options(inp.get("storage"), r.where)
    given = [key for key in ("path", "regions", *keyed) if inp.get(key) is not None]
    if len(given) != 1:
        choices = [f"'{key}' ({(input_fields()[key].get('description') or '').lower() or key})"
                   for key in ("path", "regions", *keyed)]
        r.fail("input", f"give exactly one of {', '.join(choices[:-1])} or {choices[-1]}")
    key = given[0]
    for family in keyed.values():
        for option in family.options:
            if inp.get(option) is not None and keyed.get(key) is not family:
                r.fail(f"input.{option}", f"goes with input.{next(iter(family.keys))}")
    ctx = ParseContext(base_dir, storage, resolved)
    regions, homed = _parse_regions(r, inp, ctx, storage)
    source = (expand_paths(inp["path"], r, ctx) if key == "path" else homed if homed is not None
              else keyed[key].parse(key, inp, r, ctx))
    if regions.replicas:
        local = [loc for loc in source.locations if not is_remote(loc)]
        if key != "path" or local:
            r.fail("input.replicas", "mirror objects named by input.path (s3:// or gs://)"
                   + (f"; {local[0]} is a file on this machine" if local else ""))
    for location in source.locations:
        suffix = PurePosixPath(location).suffix.lower()
        if suffix in COMPRESSED_SUFFIXES:
            r.fail("input.path", f"{location} is compressed ({suffix}); batchline reads byte ranges of each "
                                 "shard directly, so decompress it (or convert it to Parquet) first")
    fmt = inp.get("format")
    if source.format is not None:
        if fmt not in (None, source.format):
            r.fail("input.format", f"{source.describe()} is read from its {source.format} files; leave format out")
        fmt = source.format
    elif fmt is None:
        fmt = _format_of(r, source.locations)
    elif fmt not in FORMATS:
        r.fail("input.format", f"{fmt!r} is not one of {', '.join(FORMATS)}")
    reader = FORMATS[fmt].load() if fmt in FORMATS else None  # none for an input with no files
    chat = reader is not None and bool(reader.chat)
    if chat:
        _check_chat_input(r, inp, top)
    elif top.get("prompt") is None:
        r.fail("prompt", "is required")
    ids = r.string(inp.get("ids", INPUT_FIELDS["ids"]["default"]), "input.ids")
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
        try:
            Acl.read(list(acl_missing))
        except AclUnreadable as exc:
            r.fail("input.acl_missing", str(exc))
    format_options = _format_options(r, inp, fmt, reader, acl_field)
    return InputSpec(
        source=source,
        ids=ids,
        acl_missing=acl_missing,
        id_field=(r.string(inp.get("id_field", "custom_id" if chat else INPUT_FIELDS["id_field"]["default"]),
                           "input.id_field")
                  if ids == "field" else "id"),
        text_field=r.string(inp.get("text_field", "messages" if chat else INPUT_FIELDS["text_field"]["default"]),
                            "input.text_field"),
        text_fields=_text_fields(r, inp),
        acl_field=acl_field,
        format_options=format_options,
        max_input_tokens=r.optional_int(inp.get("max_input_tokens"), "input.max_input_tokens", 1),
        max_bytes_per_token=r.integer(
            inp.get("max_bytes_per_token", DEFAULT_MAX_BYTES_PER_TOKEN), "input.max_bytes_per_token", 1
        ),
        format=fmt,
        storage=storage,
        regions=regions,
    )


def _text_fields(r: SpecReader, inp: Mapping[str, Any]) -> tuple[str, ...]:
    """`input.text_fields`: distinct field names, in the order the prompt shows them."""
    raw = inp.get("text_fields")
    if raw is None:
        return ()
    if inp.get("text_field") is not None:
        r.fail("input.text_fields", "and input.text_field cannot both be given: text_field names one field, "
                                    "text_fields several; keep one")
    if not isinstance(raw, list) or not raw:
        r.fail("input.text_fields", f"must be a non-empty list of field names, not {raw!r}")
    for i, name in enumerate(raw):
        if not isinstance(name, str) or not name:
            r.fail(f"input.text_fields[{i}]", f"must be a non-empty string, not {name!r}")
    twice = sorted({name for name in raw if raw.count(name) > 1})
    if twice:
        r.fail("input.text_fields", f"names a field twice: {', '.join(twice)}")
    return tuple(raw)


def _region_name(r: SpecReader, value: Any, where: str) -> str:
    name = r.string(value, where)
    why = region_refusal(name)
    if why is not None:
        r.fail(where, why)
    return name


def _region_entry(r: SpecReader, value: Any, where: str, key: str) -> tuple[Any, dict[str, Any]]:
    """A region's value: its `key` (a location, or locations) alone, or {key, storage}."""
    if not isinstance(value, dict):
        return value, {}
    unknown = sorted(set(value) - {key, "storage"})
    if unknown:
        r.fail(f"{where}.{unknown[0]}", f"unknown field (allowed: {key}, storage)")
    if value.get(key) is None:
        r.fail(f"{where}.{key}", "is required")
    return value[key], check_storage_options(value.get("storage"), r.where, f"{where}.storage")


def _parse_regions(r: SpecReader, inp: Mapping[str, Any], ctx: ParseContext,
                   storage: Mapping[str, Any]) -> tuple[Regions, FileSet | None]:
    """`input.region`, `input.replicas`, `input.replica_fallback` and `input.regions`; with
    `input.regions`, the input's locations too (each region's, in the order the regions come)."""
    primary = _region_name(r, inp["region"], "input.region") if inp.get("region") is not None else None
    replicas: dict[str, Replica] = {}
    raw = inp.get("replicas")
    if raw is not None:
        if not isinstance(raw, dict) or not raw:
            r.fail("input.replicas", "must map each region to the prefix its copy is under")
        if primary is None:
            r.fail("input.replicas", "needs input.region, the region of input.path's objects")
        for name, value in raw.items():
            where = f"input.replicas.{name}"
            region = _region_name(r, name, where)
            if region == primary:
                r.fail(where, "is input.region; a replica is a copy in another region")
            location, extra = _region_entry(r, value, where, "location")
            location = r.string(location, f"{where}.location" if extra else where)
            if not location.startswith(("s3://", "gs://")) or not location.endswith("/") or any(
                    ch in location for ch in "*?["):
                r.fail(where, f"{location!r} must be an s3:// or gs:// prefix ending in '/'")
            replicas[region] = Replica(location, extra)
    fallback = r.string(inp.get("replica_fallback", "none"), "input.replica_fallback")
    if fallback not in REPLICA_FALLBACKS:
        r.fail("input.replica_fallback", f"{fallback!r} is not one of {', '.join(REPLICA_FALLBACKS)}")
    if inp.get("replica_fallback") is not None and not replicas:
        r.fail("input.replica_fallback", "goes with input.replicas")
    raw = inp.get("regions")
    if raw is None:
        return Regions(primary, replicas, fallback), None
    if primary is not None:
        r.fail("input.region", "goes with input.path; with input.regions each region names its own objects")
    if not isinstance(raw, dict) or not raw:
        r.fail("input.regions", "must map each region to the objects that live there")
    homes: dict[str, str] = {}
    storages: dict[str, dict[str, Any]] = {}
    for name, value in raw.items():
        where = f"input.regions.{name}"
        region = _region_name(r, name, where)
        paths, extra = _region_entry(r, value, where, "path")
        if extra:
            storages[region] = extra
        region_ctx = replace(ctx, storage={**storage, **extra})
        for location in expand_paths(paths, r, region_ctx, f"{where}.path" if extra else where).locations:
            if location in homes:
                r.fail(where, f"{location} is listed under input.regions.{homes[location]} too")
            homes[location] = region
    return Regions(None, {}, fallback, homes, storages), FileSet(tuple(homes))


def _format_options(r: SpecReader, inp: Mapping[str, Any], fmt: str, reader: Any,
                    acl_field: str | None) -> dict[str, Any]:
    """The options of the input's format, as it parses them; an option of another format is
    refused in that format's words (a value equal to the option's default is not set)."""
    for other in loaded(FORMATS):
        if other is reader:
            continue
        for key, schema in other.options.items():
            value = inp.get(key)
            if value is not None and not ("default" in schema and value == schema["default"]):
                r.fail(f"input.{key}", other.foreign_option(key, fmt))
    options: dict[str, Any] = reader.parse_options(inp, acl_field, r) if reader is not None else {}
    return options


def _parse_model(r: SpecReader, raw: Any, base_dir: Path, resolved: bool) -> ModelSpec:
    mod = r.section(raw, "model", MODEL_FIELDS, required={"engine"})
    engine = r.string(mod["engine"], "model.engine")
    if engine not in ENGINES:
        r.fail("model.engine", f"{engine!r} is not one of {', '.join(ENGINES)}")
    digest = r.optional_string(mod.get("digest"), "model.digest")
    if digest is not None and not re.fullmatch(r"sha256:[0-9a-fA-F]{64}", digest):
        r.fail("model.digest", "must be 'sha256:' followed by 64 hex digits")
    model_path = r.optional_string(mod.get("path"), "model.path")
    remote_weights = bool(model_path) and is_remote(str(model_path))
    if model_path and not ENGINES[engine].remote and not model_path.startswith(("pkg:", "/")) and not remote_weights:
        model_path = str((base_dir / model_path).resolve())
    if model_path and not ENGINES[engine].remote and remote_weights and digest is None:
        r.fail("model.digest", f"is required when model.path is an object ({model_path}): each node "
                               "fetches the weights once and keeps them under their digest")
    options = mod.get("options", {}) or {}
    if not isinstance(options, dict):
        r.fail("model.options", "must be a mapping")
    if not resolved:
        # A planned job's stored options are read as they were planned: versions planned before
        # an engine declared its options keep reading.
        _check_options(r, engine, options)
    return ModelSpec(engine=engine, path=model_path, digest=digest.lower() if digest else None, options=options)


def _check_options(r: SpecReader, engine: str, options: Mapping[str, Any]) -> None:
    """Each option is one the engine declares, of the type it takes: a typo would otherwise run
    with the engine's default and enter the version."""
    try:
        declared = ENGINES[engine].options()
    except ImportError as exc:
        raise EngineFatal(f"the {engine} engine's options cannot be read: {one_line(exc)}") from None
    for name, value in options.items():
        option = declared.get(name)
        if option is None:
            r.fail(f"model.options.{name}", f"not an option of the {engine} engine "
                                            f"(its options: {', '.join(sorted(declared)) or 'none'})")
        refusal = option.refusal(value)
        if refusal:
            r.fail(f"model.options.{name}", refusal)


def _parse_prompt(r: SpecReader, top: Mapping[str, Any], base_dir: Path, chat: bool) -> PromptSpec:
    pr = {} if chat else r.section(top["prompt"], "prompt", PROMPT_FIELDS, required={"version"})
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
            r.fail("prompt.file", f"cannot read {prompt_file}: {one_line(exc)}")
    else:
        prompt_text = r.string(pr["text"], "prompt.text")
    examples = _parse_examples(r, pr["examples"], base_dir) if pr.get("examples") is not None else None
    return PromptSpec(file=prompt_file, version=OPENAI_BATCH if chat else str(pr["version"]), text=prompt_text,
                      examples=examples)


def _parse_examples(r: SpecReader, raw: Any, base_dir: Path) -> ExamplesSpec:
    ex = r.section(raw, "prompt.examples", EXAMPLES_FIELDS, required={"k"})
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
    fields = {name: r.string(ex.get(f"{name}_field", EXAMPLES_FIELDS[f"{name}_field"]["default"]),
                              f"prompt.examples.{name}_field")
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
        r.fail("prompt.examples.file", f"cannot read {path}: {one_line(exc)}")
    if not items:
        r.fail("prompt.examples.file", f"{path} holds no examples")
    return ExamplesSpec(items=tuple(items), k=k, max_chars=max_chars, file=path)


def _parse_decoding(r: SpecReader, raw: Any, engine: str) -> DecodingSpec:
    dec = r.section(raw, "decoding", DECODING_FIELDS)
    repetition = dec.get("repetition_penalty")
    if repetition is not None:
        repetition = r.number(repetition, "decoding.repetition_penalty", float("-inf"))
        if repetition <= 0:
            r.fail("decoding.repetition_penalty", f"must be greater than 0 (1 is none), not {repetition:g}")
    decoding = DecodingSpec(
        temperature=r.number(dec.get("temperature", DecodingSpec.temperature), "decoding.temperature", 0.0),
        max_tokens=r.integer(dec.get("max_tokens", DecodingSpec.max_tokens), "decoding.max_tokens", 1),
        seed=r.integer(dec.get("seed", DecodingSpec.seed), "decoding.seed", 0),
        top_p=r.number(dec.get("top_p", DecodingSpec.top_p), "decoding.top_p", 0.0),
        repetition_penalty=repetition,
        frequency_penalty=_openai_penalty(r, dec, "frequency_penalty"),
        presence_penalty=_openai_penalty(r, dec, "presence_penalty"),
        stop=stop_sequences(dec.get("stop"), lambda message: r.fail("decoding.stop", message)),
    )
    refusal = unhonoured_knob(ENGINES[engine], decoding.knobs(), "engine")
    if refusal:
        raise SpecError(f"{r.where}: {refusal}")
    return decoding


def _openai_penalty(r: SpecReader, dec: Mapping[str, Any], name: str) -> float | None:
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


def check_abort_rate(rate: float | None, validate: ValidateSpec, fail: Callable[[str], NoReturn]) -> None:
    """A version is never halted at a dead-letter rate its validation would pass."""
    if rate is not None and rate < validate.max_dead_letter_rate:
        fail(f"{rate:g} is below validate.max_dead_letter_rate ({validate.max_dead_letter_rate:g}): the version "
             f"would be halted at a rate its validation passes")


def _parse_shards(r: SpecReader, raw: Any) -> ShardSpec:
    sh = r.section(raw, "shards", SHARD_FIELDS)
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
        abort_dead_letter_rate=(r.number(sh["abort_dead_letter_rate"], "shards.abort_dead_letter_rate", 0.0, 1.0)
                                if sh.get("abort_dead_letter_rate") is not None else None),
        abort_min_outcomes=r.optional_int(sh.get("abort_min_outcomes"), "shards.abort_min_outcomes", 1),
        locality_wait_seconds=r.number(sh.get("locality_wait_seconds", defaults.locality_wait_seconds),
                                       "shards.locality_wait_seconds", 0.0),
    )
    if shards.abort_dead_letter_rate is None:
        if shards.abort_min_outcomes is not None:
            r.fail("shards.abort_min_outcomes", "has no effect without shards.abort_dead_letter_rate; set both")
    elif shards.abort_min_outcomes is None:
        # Written out, so the store (which holds the bound from planning on) needs no default of its own.
        shards = replace(shards, abort_min_outcomes=DEFAULT_ABORT_MIN_OUTCOMES)
    if shards.renew_seconds >= shards.lease_seconds:
        r.fail("shards.renew_seconds", "must be shorter than shards.lease_seconds")

    return shards


def _parse_routing(r: SpecReader, raw: Any) -> RoutingSpec:
    ro = r.section(raw, "routing", ROUTING_FIELDS, required={"class_field", "providers"})
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
        pv = r.section(body, where, PROVIDER_FIELDS, required={"api", "model", "classes", "retention"})
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
        prices = r.section(pv.get("prices", {}) or {}, f"{where}.prices", PRICES_FIELDS)
        options = pv.get("options", {}) or {}
        if not isinstance(options, dict):
            r.fail(f"{where}.options", "must be a mapping")
        providers.append(ProviderSpec(
            route=route, api=api, model=r.string(pv["model"], f"{where}.model"),
            classes=tuple(str(c) for c in classes),
            retention=r.string(pv["retention"], f"{where}.retention"),
            base_url=r.optional_string(pv.get("base_url"), f"{where}.base_url"),
            api_key_env=r.optional_string(pv.get("api_key_env"), f"{where}.api_key_env"),
            completion_window=r.string(pv.get("completion_window", ProviderSpec.completion_window),
                                       f"{where}.completion_window"),
            poll_seconds=r.number(pv.get("poll_seconds", ProviderSpec.poll_seconds), f"{where}.poll_seconds", 0.01),
            input_price_per_mtok=(r.number(prices["input_per_mtok"], f"{where}.prices.input_per_mtok", 0.0)
                                  if prices.get("input_per_mtok") is not None else None),
            output_price_per_mtok=(r.number(prices["output_per_mtok"], f"{where}.prices.output_per_mtok", 0.0)
                                   if prices.get("output_per_mtok") is not None else None),
            shard_size=r.optional_int(pv.get("shard_size"), f"{where}.shard_size", 1),
            options=options,
        ))
    return RoutingSpec(class_field=class_field, providers=tuple(providers))


def _parse_reproduce(r: SpecReader, raw: Any, label_field: str | None, workers_batch: int) -> ReproduceSpec:
    rep = r.section(raw, "validate.reproduce", REPRODUCE_FIELDS, required={"sample"})
    on = rep.get("on", ReproduceSpec.on)
    if on not in REPRODUCE_ON:
        r.fail("validate.reproduce.on", f"must be one of {', '.join(REPRODUCE_ON)}, not {on!r}")
    if on == "label" and label_field is None:
        r.fail("validate.reproduce.on", "label needs output.label_field: the output field that must agree")
    batch = r.optional_int(rep.get("batch_size"), "validate.reproduce.batch_size", 1)
    if batch is not None and batch == workers_batch:
        r.fail("validate.reproduce.batch_size", f"is the workers' own ({workers_batch}, shards.batch_size): the check "
                                                "recomputes in batches of another size, which a batch-invariant "
                                                "engine answers the same")
    minimum = rep.get("min_agreement")
    return ReproduceSpec(
        sample=r.integer(rep["sample"], "validate.reproduce.sample", 1),
        min_agreement=r.number(minimum, "validate.reproduce.min_agreement", 0.0, 1.0) if minimum is not None
        else None,
        seed=r.integer(rep.get("seed", ReproduceSpec.seed), "validate.reproduce.seed", 0),
        batch_size=batch, on=str(on),
        min_cosine=r.number(rep.get("min_cosine", ReproduceSpec.min_cosine), "validate.reproduce.min_cosine", -1.0,
                            1.0))


def _parse_validate(r: SpecReader, raw: Any, ctx: GraderContext) -> ValidateSpec:
    val = r.section(raw, "validate", validate_fields())
    dr = r.section(val.get("drift", {}) or {}, "validate.drift", DRIFT_FIELDS)
    drift = DriftSpec(
        max_psi=r.number(dr.get("max_psi", DriftSpec.max_psi), "validate.drift.max_psi", 0.0),
        max_new_categories=r.integer(dr.get("max_new_categories", DriftSpec.max_new_categories),
                                     "validate.drift.max_new_categories", 0),
        max_vanished_categories=r.optional_int(dr.get("max_vanished_categories"),
                                               "validate.drift.max_vanished_categories", 0),
    )
    members = graders()
    # In the order the section names them: the report shows them in that order.
    parsed = tuple(members[key].parse(key, val[key], r, ctx) for key in val
                   if key in members and val[key] is not None)
    return ValidateSpec(
        max_dead_letter_rate=r.number(val.get("max_dead_letter_rate", ValidateSpec.max_dead_letter_rate),
                                      "validate.max_dead_letter_rate", 0.0, 1.0),
        schema_sample=r.optional_int(val.get("schema_sample"), "validate.schema_sample", 1),
        drift=drift,
        reproduce=_parse_reproduce(r, val["reproduce"], ctx.label_field, ctx.workers_batch)
        if val.get("reproduce") is not None else None,
        graders=parsed,
    )


def _check_chat_input(r: SpecReader, inp: Mapping[str, Any], top: Mapping[str, Any]) -> None:
    """An openai-batch line has fixed fields and carries its whole conversation."""
    for key, fixed in (("id_field", "custom_id"), ("text_field", "messages")):
        if inp.get(key, fixed) != fixed:
            r.fail(f"input.{key}", f"is always {fixed!r} with input.format {OPENAI_BATCH}; leave it out")
    if inp.get("text_fields") is not None:
        r.fail("input.text_fields", f"is not used with input.format {OPENAI_BATCH}: each line's messages are its "
                                    "whole prompt; leave it out")
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


def _format_of(r: SpecReader, locations: tuple[str, ...]) -> str:
    formats: set[str] = set()
    for p in locations:
        suffix = PurePosixPath(p).suffix.lower()
        by_suffix = {s: f.name for f in loaded(FORMATS) for s in f.suffixes}
        fmt = by_suffix.get(suffix)
        if fmt is None:
            guessed = list(dict.fromkeys(by_suffix.values()))
            r.fail("input.path", f"{p}: cannot tell the format from {suffix or 'no suffix'!r}; "
                                 f"set input.format to {', '.join(guessed[:-1])} or {guessed[-1]}")
        formats.add(fmt)
    if len(formats) > 1:
        r.fail("input.path", f"mixes formats {sorted(formats)}; one job reads one format")
    return formats.pop()


def _load_schema(r: SpecReader, value: Any, base_dir: Path) -> tuple[dict[str, Any], Path | None]:
    schema_path: Path | None = None
    if isinstance(value, dict):
        schema = value
    else:
        schema_path = (base_dir / r.string(value, "output.schema")).resolve()
        try:
            schema = json.loads(schema_path.read_text(encoding="utf-8"))
        except OSError as exc:
            r.fail("output.schema", f"cannot read {schema_path}: {one_line(exc)}")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            r.fail("output.schema", f"{schema_path} is not JSON: {one_line(exc)}")
    if not isinstance(schema, dict):
        r.fail("output.schema", "must be a JSON object")
    validator_cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator_cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        path = "/".join(str(p) for p in exc.path) or "(root)"
        r.fail("output.schema", f"not a valid JSON Schema at {path}: {one_line(exc.message)}")
    return schema, schema_path


# What planning adds to a version's stored spec: its resolved base, and the pins of its input.
STORE_ONLY_KEYS = ("base_version", "pins")


def spec_from_store(data: Mapping[str, Any]) -> JobSpec:
    """The spec a version was planned with, from its self-contained stored form."""
    spec = parse_spec({k: v for k, v in data.items() if k not in STORE_ONLY_KEYS}, base_dir=Path("/"),
                      resolved=True)
    return replace(spec, base_version=data.get("base_version"), pins=tuple(data.get("pins") or ()))


class _PlannedJob(Protocol):
    @property
    def spec(self) -> Mapping[str, Any]: ...


def stored_spec(job: _PlannedJob) -> JobSpec:
    """The spec of a planned job (a store's JobInfo), as every reader of it should see it:
    parsed, with every default applied once, here."""
    return spec_from_store(job.spec)


@dataclass(frozen=True)
class JobVersion:
    """A planned version as every reader past planning is handed it: its record in the store
    and its spec, parsed once (`of`), so a publish does not read and parse it again for each
    target."""

    info: JobInfo
    spec: JobSpec

    @property
    def version(self) -> str:
        return self.info.version

    @property
    def name(self) -> str:
        return self.info.name

    @classmethod
    def of(cls, store: ReaderStore, version: str) -> JobVersion:
        """The version as the store holds it now (`NoSuchVersion`, exit 66, when it does not)."""
        return cls.from_info(require_job(store, version))

    @classmethod
    def from_info(cls, info: JobInfo) -> JobVersion:
        """The version of a record already read from the store, its spec parsed."""
        return cls(info, stored_spec(info))
