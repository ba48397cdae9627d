"""The OpenLineage event of an outbox row, made from the row and its version's stored spec.

Runs and jobs:

- a version's computation is a run of the job named as the spec names it; its run id is
  derived from the version and its attempt (`run_id`), so every process that sends one of
  its events names the same run, and a resumed version's next attempt is a new run of the
  same job whose parent facet names the first attempt's run;
- a publish and a rollback are runs of the jobs `NAME.publish` and `NAME.rollback`, each
  with one COMPLETE event (the switch is one atomic step), its parent the computation run
  of the version it shows.

Datasets follow OpenLineage's naming (the namespace is the datasource): the inputs are
what planning pinned, as each source names them (files and objects with their versions or
ETags, a table's snapshot, a Delta version, the upstream job's version); a computation run
outputs the version's results in the store (`results.NAME` at the version, never the published
view, which a version that fails its gate never reaches), with the output schema, column lineage
from the input's text, ACL and carried fields, and its figures at completion; a publication reads
those results and outputs the store's view and each target's dataset, at the version or snapshot
it now shows.

batchline's own facets (`batchline_*`) carry the model and engine runtime, the prompt, the
decoding, the outcomes (results and dead letters by kind, tokens, paid worker time and cost)
and the reproducibility check; their JSON Schemas are `FACETS_SCHEMA_FILE`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import attr
from openlineage.client.event_v2 import InputDataset, Job, OutputDataset, Run, RunEvent, RunState
from openlineage.client.facet_v2 import (
    DatasetFacet,
    JobFacet,
    OutputDatasetFacet,
    RunFacet,
    column_lineage_dataset,
    dataset_version_dataset,
    error_message_run,
    job_type_job,
    output_statistics_output_dataset,
    parent_run,
    processing_engine_run,
    schema_dataset,
    set_producer,
)
from openlineage.client.uuid import generate_static_uuid

from batchline.sources.base import DatasetName, StoreDatasets
from batchline.spec import JobSpec, stored_spec
from batchline.store.lineage import ABORT, COMPLETE, FAIL, PUBLISH, ROLLBACK, START, OutboxRow
from batchline.store.model import JobInfo
from batchline.targets.files import iso_ms
from batchline.version import __version__

PRODUCER = f"https://pypi.org/project/batchline/{__version__}/"
FACETS_SCHEMA_URL = "https://batchline.dev/spec/lineage/1-0-0/facets.json"
FACETS_SCHEMA_FILE = Path(__file__).with_name("facets.json")
INTEGRATION = "BATCHLINE"
# Every facet, the standard ones too, names batchline as what produced it.
set_producer(PRODUCER)

_STATES = {START: RunState.START, COMPLETE: RunState.COMPLETE, FAIL: RunState.FAIL, ABORT: RunState.ABORT,
           PUBLISH: RunState.COMPLETE, ROLLBACK: RunState.COMPLETE}


def run_id(version: str, created_at: float, what: str) -> str:
    """A run's id, the same from every process: a UUIDv7 at the version's planning time whose
    other bits come from `what` (its attempt, or the publication)."""
    instant = datetime.fromtimestamp(created_at, tz=UTC)
    return str(generate_static_uuid(instant, f"batchline\0{version}\0{what}".encode()))


def computation_run_id(job: JobInfo, attempt: int) -> str:
    return run_id(job.version, job.created_at, f"run\0{attempt}")


_iso = iso_ms  # an event's time as the JSONL export writes one


def store_datasets(url: str) -> StoreDatasets:
    """How the store at `url` names its datasets: on PostgreSQL, `postgres://HOST:PORT` with
    a published name's view `DATABASE.published.NAME` and a job's results
    `DATABASE.results.NAME` (the results table's rows of that job, at a version); on SQLite,
    `sqlite://` and the file's absolute path, with the view `NAME` and the results
    `results.NAME`."""
    parts = urlsplit(url)
    if parts.scheme.startswith("postgres"):
        host = parts.hostname or "localhost"
        database = parts.path.lstrip("/") or "postgres"
        return StoreDatasets(f"postgres://{host}:{parts.port or 5432}", f"{database}.published.",
                             f"{database}.results.")
    path = url.split("://", 1)[1] if "://" in url else url
    path = path[1:] if path.startswith("/") else path  # sqlite:///relative and sqlite:////absolute
    return StoreDatasets(f"sqlite://{Path(path).absolute()}", "", "results.")


# --- batchline's facets -------------------------------------------------------------------


def _schema(name: str) -> str:
    return f"{FACETS_SCHEMA_URL}#/$defs/{name}"


@attr.define
class BatchlineJobRunFacet(RunFacet):
    """The job version computed, and which attempt at it this run is."""

    version: str
    attempt: int
    baseVersion: str | None = attr.field(default=None)
    records: int | None = attr.field(default=None)

    @staticmethod
    def _get_schema() -> str:
        return _schema("BatchlineJobRunFacet")


@attr.define
class BatchlineModelRunFacet(RunFacet):
    """The pinned model and the engine runtime its first worker loaded (I2)."""

    engine: str
    path: str | None = attr.field(default=None)
    digest: str | None = attr.field(default=None)
    runtime: str | None = attr.field(default=None)
    options: dict[str, Any] = attr.field(factory=dict)

    @staticmethod
    def _get_schema() -> str:
        return _schema("BatchlineModelRunFacet")


@attr.define
class BatchlinePromptRunFacet(RunFacet):
    version: str
    digest: str

    @staticmethod
    def _get_schema() -> str:
        return _schema("BatchlinePromptRunFacet")


@attr.define
class BatchlineDecodingRunFacet(RunFacet):
    settings: dict[str, Any]

    @staticmethod
    def _get_schema() -> str:
        return _schema("BatchlineDecodingRunFacet")


@attr.define
class BatchlineOutcomesRunFacet(RunFacet):
    """What the run computed: results and dead letters (by kind), carried results, tokens,
    and the paid worker time a pacer bought for its deadline, with its cost."""

    results: int
    carried: int
    deadLetters: int
    deadLettersByKind: dict[str, int]
    inputTokens: int
    outputTokens: int
    paidWorkerSeconds: float
    paidCost: float

    @staticmethod
    def _get_schema() -> str:
        return _schema("BatchlineOutcomesRunFacet")


@attr.define
class BatchlineReproducibilityRunFacet(RunFacet):
    """The validator's recomputation of a sample, compared with the stored results."""

    sample: int
    seed: int
    batchSize: int
    workersBatchSize: int
    exactAgreement: float
    passed: bool
    labelAgreement: float | None = attr.field(default=None)
    cosineMean: float | None = attr.field(default=None)
    cosineMin: float | None = attr.field(default=None)
    minAgreement: float | None = attr.field(default=None)

    @staticmethod
    def _get_schema() -> str:
        return _schema("BatchlineReproducibilityRunFacet")


@attr.define
class BatchlinePublicationRunFacet(RunFacet):
    """A publish or rollback: the name, the version it shows now and the one before."""

    action: str
    name: str
    version: str
    previous: str | None = attr.field(default=None)
    who: str | None = attr.field(default=None)
    reason: str | None = attr.field(default=None)

    @staticmethod
    def _get_schema() -> str:
        return _schema("BatchlinePublicationRunFacet")


CUSTOM_FACETS: tuple[type[RunFacet], ...] = (
    BatchlineJobRunFacet, BatchlineModelRunFacet, BatchlinePromptRunFacet, BatchlineDecodingRunFacet,
    BatchlineOutcomesRunFacet, BatchlineReproducibilityRunFacet, BatchlinePublicationRunFacet)


# --- datasets -------------------------------------------------------------------------------


_JSON_TYPES: Mapping[str, str] = {"string": "string", "integer": "long", "number": "double", "boolean": "boolean"}


def _schema_fields(schema: Any) -> list[schema_dataset.SchemaDatasetFacetFields]:
    """The fields of a JSON Schema object, nested as OpenLineage's schema facet nests them
    (an array's items as its one field `_element`)."""
    props = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(props, dict):
        return []
    return [_schema_field(str(name), sub) for name, sub in props.items()]


def _schema_field(name: str, schema: Any) -> schema_dataset.SchemaDatasetFacetFields:
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):
        kinds = [k for k in kind if k != "null"]
        kind = kinds[0] if len(kinds) == 1 else None
    description = schema.get("description") if isinstance(schema, dict) else None
    if kind == "object":
        return schema_dataset.SchemaDatasetFacetFields(name, "struct", description, fields=_schema_fields(schema))
    if kind == "array":
        items = schema.get("items") if isinstance(schema, dict) else None
        return schema_dataset.SchemaDatasetFacetFields(name, "array", description,
                                                       fields=[_schema_field("_element", items or {})])
    if kind is None and isinstance(schema, dict) and isinstance(schema.get("enum"), list):
        kind = "string"
    return schema_dataset.SchemaDatasetFacetFields(name, _JSON_TYPES.get(str(kind), "json"), description)


def results_schema(spec: JobSpec, provenance: bool = False) -> schema_dataset.SchemaDatasetFacet:
    """The columns of a version's results as every output holds them: the record's id, the
    output's fields, its ACL and carried fields."""
    fields = [schema_dataset.SchemaDatasetFacetFields("id", "string", "the record's id"),
              schema_dataset.SchemaDatasetFacetFields("output", "struct", "the validated answer",
                                                      fields=_schema_fields(dict(spec.output_schema))),
              schema_dataset.SchemaDatasetFacetFields(
                  "acl", "array", "the groups the record may be served to",
                  fields=[schema_dataset.SchemaDatasetFacetFields("_element", "string")])]
    if spec.input.carry:
        fields.append(schema_dataset.SchemaDatasetFacetFields(
            "carry", "struct", "input fields copied onto the result",
            fields=[schema_dataset.SchemaDatasetFacetFields(c, "string") for c in spec.input.carry]))
    return schema_dataset.SchemaDatasetFacet(fields=fields)


def column_lineage(spec: JobSpec, inputs: Sequence[DatasetName]) -> column_lineage_dataset.ColumnLineageDatasetFacet:
    """Each output column from the input fields it comes from: the output's fields are the
    model's answer to the record's text; id, ACL and carried fields are copied as they are."""
    C = column_lineage_dataset

    def from_inputs(role: str, default: str, kind: str, subtype: str, description: str) -> list[C.InputField]:
        return [C.InputField(d.namespace, d.name, d.field(role, default),
                             [C.Transformation(kind, subtype, description, masking=False)]) for d in inputs]

    model = f"{spec.model.engine} model {spec.model.digest or spec.model.path or ''}".strip()
    answered = (f"answered by the {model} to prompt version {spec.prompt.version}, "
                f"validated against the output schema")
    texts = spec.input.text_columns
    fields: dict[str, C.Fields] = {
        "id": C.Fields(from_inputs("id", spec.input.id_field, "DIRECT", "IDENTITY", "the record's id")),
    }
    for name in (dict(spec.output_schema).get("properties") or {}):
        # From every field the record's text is composed of.
        fields[f"output.{name}"] = C.Fields([f for text in texts for f in
                                             from_inputs("text", text, "DIRECT", "TRANSFORMATION", answered)])
    if spec.input.acl_field is not None:
        fields["acl"] = C.Fields(from_inputs("acl", spec.input.acl_field, "DIRECT", "IDENTITY",
                                             "the record's ACL, carried onto its result"))
    for carried in spec.input.carry:
        fields[f"carry.{carried}"] = C.Fields([
            C.InputField(d.namespace, d.name, f"{d.field('carry', '')}{carried}",
                         [C.Transformation("DIRECT", "IDENTITY", "copied from the input", masking=False)])
            for d in inputs])
    return C.ColumnLineageDatasetFacet(fields=fields)


def _input(d: DatasetName) -> InputDataset:
    facets: dict[str, DatasetFacet] = {}
    if d.version is not None:
        facets["version"] = dataset_version_dataset.DatasetVersionDatasetFacet(d.version)
    return InputDataset(d.namespace, d.name, facets=facets)


def _output(d: DatasetName, facets: Mapping[str, DatasetFacet] | None = None,
            output_facets: Mapping[str, OutputDatasetFacet] | None = None) -> OutputDataset:
    all_facets: dict[str, DatasetFacet] = dict(facets or {})
    if d.version is not None:
        all_facets["version"] = dataset_version_dataset.DatasetVersionDatasetFacet(d.version)
    return OutputDataset(d.namespace, d.name, facets=all_facets,
                         outputFacets=dict(output_facets or {}))


# --- the events -------------------------------------------------------------------------------


def _common_run_facets(job: JobInfo, spec: JobSpec, attempt: int, runtime: str | None) -> dict[str, RunFacet]:
    return {
        "processing_engine": processing_engine_run.ProcessingEngineRunFacet(
            version=__version__, name="batchline", openlineageAdapterVersion=_client_version()),
        "batchline_job": BatchlineJobRunFacet(job.version, attempt, spec.base_version, job.record_count),
        "batchline_model": BatchlineModelRunFacet(spec.model.engine, spec.model.path, spec.model.digest, runtime,
                                                  dict(spec.model.options)),
        "batchline_prompt": BatchlinePromptRunFacet(
            spec.prompt.version, "sha256:" + hashlib.sha256(spec.prompt.text.encode()).hexdigest()),
        "batchline_decoding": BatchlineDecodingRunFacet(spec.decoding.to_dict()),
    }


def _client_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("openlineage-python")
    except PackageNotFoundError:
        return "unknown"


def _job(namespace: str, name: str, kind: str) -> Job:
    facets: dict[str, JobFacet] = {"jobType": job_type_job.JobTypeJobFacet("BATCH", INTEGRATION, kind)}
    return Job(namespace, name, facets=facets)


def _root(parent: Mapping[str, str] | None) -> parent_run.Root | None:
    if parent is None:
        return None
    return parent_run.Root(run=parent_run.RootRun(parent["run_id"]),
                           job=parent_run.RootJob(parent["namespace"], parent["name"]))


def event_for(row: OutboxRow, job: JobInfo, *, namespace: str, store: StoreDatasets,
              runtime: str | None = None, parent: Mapping[str, str] | None = None) -> RunEvent:
    """The event of one outbox row of `job`; `parent`: the orchestrator's task run that
    launched the version (`namespace`, `name`, `run_id`), the parent of its first attempt's
    run and the root of every other run of it."""
    spec = stored_spec(job)
    if row.kind in (PUBLISH, ROLLBACK):
        return _publication_event(row, job, spec, namespace, store, runtime, parent)
    facets = _common_run_facets(job, spec, row.attempt, runtime)
    if row.attempt > 1:
        # A resumed version: another run of the same job, whose parent is its first attempt.
        facets["parent"] = parent_run.ParentRunFacet(
            run=parent_run.Run(computation_run_id(job, 1)), job=parent_run.Job(namespace, spec.name),
            root=_root(parent))
    elif parent is not None:
        facets["parent"] = parent_run.ParentRunFacet(
            run=parent_run.Run(parent["run_id"]), job=parent_run.Job(parent["namespace"], parent["name"]),
            root=_root(parent))
    detail = row.detail
    if row.kind in (FAIL, ABORT):
        message = str(detail.get("message") or detail.get("reason") or row.kind)
        if row.kind == ABORT:
            message = f"cancelled by {detail.get('who')}" + (f": {detail['reason']}" if detail.get("reason") else "")
        facets["errorMessage"] = error_message_run.ErrorMessageRunFacet(message, "PYTHON")
    output_stats: dict[str, OutputDatasetFacet] = {}
    if row.kind == COMPLETE:
        facets["batchline_outcomes"] = BatchlineOutcomesRunFacet(
            int(detail.get("results", 0)), int(detail.get("carried", 0)), int(detail.get("dead_letters", 0)),
            {str(k): int(v) for k, v in (detail.get("dead_letters_by_kind") or {}).items()},
            int(detail.get("input_tokens", 0)), int(detail.get("output_tokens", 0)),
            float(detail.get("paid_worker_seconds", 0.0)), float(detail.get("paid_cost", 0.0)))
        output_stats["outputStatistics"] = output_statistics_output_dataset.OutputStatisticsOutputDatasetFacet(
            rowCount=int(detail.get("results", 0)) + int(detail.get("carried", 0)))
    inputs = spec.input.source.datasets(spec.pins, store)
    # The version's results, never the published view: a version that then fails its gate
    # or is cancelled is never what readers read, and only a publication moves the view.
    results = store.results(spec.name, job.version)
    output = _output(results, {"schema": results_schema(spec), "columnLineage": column_lineage(spec, inputs)},
                     output_stats)
    return RunEvent(eventType=_STATES[row.kind], eventTime=_iso(row.at),
                    run=Run(computation_run_id(job, row.attempt), facets=facets),
                    job=_job(namespace, spec.name, "JOB"), producer=PRODUCER,
                    inputs=[_input(d) for d in inputs], outputs=[output])


def _publication_event(row: OutboxRow, job: JobInfo, spec: JobSpec, namespace: str, store: StoreDatasets,
                       runtime: str | None, parent: Mapping[str, str] | None) -> RunEvent:
    detail = row.detail
    name = str(detail.get("name") or spec.name)
    facets: dict[str, RunFacet] = {
        "processing_engine": processing_engine_run.ProcessingEngineRunFacet(
            version=__version__, name="batchline", openlineageAdapterVersion=_client_version()),
        "parent": parent_run.ParentRunFacet(run=parent_run.Run(computation_run_id(job, row.attempt)),
                                            job=parent_run.Job(namespace, spec.name), root=_root(parent)),
        "batchline_publication": BatchlinePublicationRunFacet(
            row.kind, name, job.version, detail.get("previous"), detail.get("who"), detail.get("reason")),
        "batchline_model": BatchlineModelRunFacet(spec.model.engine, spec.model.path, spec.model.digest, runtime,
                                                  dict(spec.model.options)),
    }
    reproduced = reproducibility_facet(detail.get("validation"))
    if reproduced is not None:
        facets["batchline_reproducibility"] = reproduced
    states: Mapping[str, Any] = detail.get("targets") or {}
    outputs = [_output(store.of(name, job.version), {"schema": results_schema(spec)})]
    for target in spec.targets:
        # What the target showed after this publication, as the store recorded it by its key.
        state = states.get(target.target(None, spec.input.storage).key)
        outputs.append(_output(target.dataset(name, store, state if isinstance(state, Mapping) else None),
                               {"schema": results_schema(spec)}))
    return RunEvent(eventType=_STATES[row.kind], eventTime=_iso(row.at),
                    run=Run(run_id(job.version, job.created_at, f"{row.kind}\0{row.id}"),
                            facets=facets),
                    job=_job(namespace, f"{name}.{row.kind}", "JOB"), producer=PRODUCER,
                    inputs=[_input(store.results(spec.name, job.version))], outputs=outputs)


def version_lineage(store: Any, version: str, published_as: str | None,
                    namespace: str = "batchline") -> tuple[list[InputDataset], list[OutputDataset], dict[str, RunFacet]]:
    """What an orchestrator's own lineage says of a task that ran `version`: the input the
    snapshot pinned, what the version was published to (the store's view and each target,
    as a publish run names them; nothing where it was not published) and batchline's run
    facets (model, prompt, decoding, job)."""
    from batchline.store import require_job

    job = require_job(store, version)
    spec = stored_spec(job)
    datasets = store_datasets(store.url)
    inputs = [_input(d) for d in spec.input.source.datasets(spec.pins, datasets)]
    outputs: list[OutputDataset] = []
    if published_as is not None:
        outputs.append(_output(datasets.of(published_as, version), {"schema": results_schema(spec)}))
        for target in spec.targets:
            outputs.append(_output(target.dataset(published_as, datasets, None), {"schema": results_schema(spec)}))
    facets = _common_run_facets(job, spec, 1, store.pinned_runtime(version))
    return inputs, outputs, facets


def reproducibility_facet(validation: Any) -> BatchlineReproducibilityRunFacet | None:
    """The reproducibility check of a validation report, as a facet (None without one)."""
    if not isinstance(validation, Mapping):
        return None
    for check in validation.get("checks") or ():
        if check.get("name") == "reproducibility" and isinstance(check.get("details"), Mapping):
            d = check["details"]
            if "exact_agreement" not in d:
                return None
            return BatchlineReproducibilityRunFacet(
                int(d.get("sample", 0)), int(d.get("seed", 0)), int(d.get("batch_size", 0)),
                int(d.get("workers_batch_size", 0)), float(d["exact_agreement"]), bool(check.get("passed")),
                d.get("label_agreement"), d.get("cosine_mean"), d.get("cosine_min"), d.get("min_agreement"))
    return None
