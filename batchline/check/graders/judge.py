"""`validate.judge`: a model of its own grades a seeded sample of the version's results.

    validate:
      judge: {spec: judge.yaml, sample: 100, seed: 0, min_pass: 0.8}

The judge spec is a job spec without a name or an input: its model, its prompt (the rubric),
its decoding, its output schema (a boolean pass field, `pass_field`, and a text reason,
`reason_field`, both required), its shards and its own `validate.max_dead_letter_rate`.
batchline makes it a job over the version being validated: named `NAME-judge`, its input
`input.job: NAME` at this version with `field: record` (each judge record is the record's text
as the job read it and the whole output) and `sample`/`seed` (the same seed, the same
records). So the judge run is a version of its own, pinned as any job is (the judge's model
digest, prompt version and parameters, and the sample) with its own leases, keys and dead
letters: validating again continues it where a killed run left it and never computes a
record twice, and validating a version whose judge run is sealed reads it.

The gate reads the judge version's pass share: the results whose pass field is true, of the
judge's results. A judge version whose dead letters exceed its own limit fails the check,
whatever its pass share: a judge that could not answer has not judged.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import yaml

from batchline.check.graders.base import Grading, category, gate_words, read_limit, short
from batchline.check.report import Check
from batchline.errors import BatchlineError, SpecError, one_line
from batchline.spec import JobSpec, parse_spec
from batchline.spec.ports import GraderContext, GraderSpec
from batchline.spec.reader import Fields, SpecReader

KEY = "judge"
DEFAULT_SAMPLE = 100
# What batchline writes of the judge job itself; the judge spec gives the rest.
MADE_HERE = ("name", "input")


@dataclass(frozen=True)
class JudgeSpec:
    job: JobSpec  # the judge job, over the validated job's name (its version is set when grading)
    sample: int = DEFAULT_SAMPLE
    seed: int = 0
    pass_field: str = "pass"
    reason_field: str = "reason"
    min_pass: float | None = None  # None: reported, never a failure
    workers: int = 1
    key: str = KEY

    def to_dict(self) -> dict[str, Any]:
        stored = {k: v for k, v in self.job.to_dict().items() if k not in MADE_HERE}
        return {"spec": stored, "sample": self.sample, "seed": self.seed, "pass_field": self.pass_field,
                "reason_field": self.reason_field, "min_pass": self.min_pass, "workers": self.workers}

    def over(self, version: str) -> JobSpec:
        """The judge job over `version` (its input's source is the job family's, a dataclass
        with the version it reads)."""
        source = replace(self.job.input.source, version=version)  # type: ignore[type-var]
        return replace(self.job, input=replace(self.job.input, source=source))


FIELDS: Fields = {
    "spec": {"anyOf": [{"type": "string", "minLength": 1}, {"type": "object"}],
             "description": "The judge's job spec file: model, prompt (the rubric), decoding, output schema, "
                            "shards, validate.max_dead_letter_rate; no name or input"},
    "sample": {"type": "integer", "minimum": 1, "description": "How many results are judged, chosen by the seed",
               "default": DEFAULT_SAMPLE},
    "seed": {"type": "integer", "minimum": 0, "description": "Chooses the sample", "default": 0},
    "pass_field": {"type": "string", "minLength": 1, "description": "The judge's boolean output field: the result "
                   "passes", "default": "pass"},
    "reason_field": {"type": "string", "minLength": 1, "description": "The judge's text output field: why",
                     "default": "reason"},
    "min_pass": {"type": ["number", "null"], "minimum": 0, "maximum": 1,
                 "description": "The share of judged results that must pass (null: reported only)"},
    "workers": {"type": "integer", "minimum": 1, "description": "Local workers that run the judge job when "
                                                                "validating", "default": 1},
}


def _judge_raw(r: SpecReader, value: Any, where: str, ctx: GraderContext) -> tuple[dict[str, Any], Path, str]:
    """The judge spec as written (a file, or the stored form), its folder, and what to call it."""
    if isinstance(value, dict):
        return dict(value), ctx.base_dir, where
    path = ctx.base_dir / r.string(value, where)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        r.fail(where, f"cannot read {path}: {one_line(exc)}")
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        r.fail(where, f"{path} is not valid YAML: {one_line(exc)}")
    if not isinstance(raw, dict):
        r.fail(where, f"{path} must be a mapping (a job spec without name and input)")
    return raw, path.parent, f"{where} ({path.name})"


def _require(r: SpecReader, schema: Mapping[str, Any], name: str, kind: str, where: str) -> None:
    properties = schema.get("properties") if isinstance(schema, Mapping) else None
    node = properties.get(name) if isinstance(properties, Mapping) else None
    if not isinstance(node, Mapping):
        r.fail(where, f"the judge's output schema has no {name!r} field (a {kind} the judge must answer)")
    if node.get("type") != kind:
        r.fail(where, f"{name!r} must be of type {kind} in the judge's output schema, not {node.get('type')!r}")
    if name not in (schema.get("required") or []):
        r.fail(where, f"{name!r} must be required in the judge's output schema")


class JudgeGrader:
    check: ClassVar[str] = KEY  # the name of the check it reports
    runs_model: ClassVar[bool] = True
    keys: ClassVar[Fields] = {KEY: {"type": "object", "description": "A judge model grades a seeded sample of the "
                                                                      "results, as a job of its own"}}
    fields: ClassVar[Fields] = FIELDS
    required: ClassVar[frozenset[str]] = frozenset({"spec"})

    def parse(self, key: str, value: Any, r: SpecReader, ctx: GraderContext) -> JudgeSpec:
        where = f"validate.{key}"
        sec = r.section(value, where, FIELDS, required=set(self.required))
        raw, folder, named = _judge_raw(r, sec["spec"], f"{where}.spec", ctx)
        for made in MADE_HERE:
            if made in raw and not ctx.resolved:
                r.fail(f"{where}.spec", f"{made} is made by batchline (the judge job is {ctx.name}-judge, over "
                                        f"the version validated): leave it out")
        judged = (raw.get("validate") or {}) if isinstance(raw.get("validate"), dict) else {}
        extra = sorted(set(judged) - {"max_dead_letter_rate"})
        if extra and not ctx.resolved:  # the stored form writes the section whole
            r.fail(f"{where}.spec", f"validate.{extra[0]}: a judge's own gate is its max_dead_letter_rate only")
        sample = r.integer(sec.get("sample", DEFAULT_SAMPLE), f"{where}.sample", 1)
        seed = r.integer(sec.get("seed", 0), f"{where}.seed", 0)
        source = {"job": ctx.name, "field": "record", "sample": sample, "seed": seed,
                  **({"acl_field": ctx.acl_field} if ctx.acl_field else {})}
        body = {k: v for k, v in raw.items() if k not in MADE_HERE}
        try:
            job = parse_spec({**body, "name": f"{ctx.name}-judge", "input": source}, base_dir=folder,
                             source=Path(named), resolved=ctx.resolved)
        except SpecError as exc:
            raise SpecError(f"{r.where}: {where}.spec: {exc}") from None
        pass_field = r.string(sec.get("pass_field", "pass"), f"{where}.pass_field")
        reason_field = r.string(sec.get("reason_field", "reason"), f"{where}.reason_field")
        _require(r, job.output_schema, pass_field, "boolean", f"{where}.pass_field")
        _require(r, job.output_schema, reason_field, "string", f"{where}.reason_field")
        return JudgeSpec(job=job, sample=sample, seed=seed, pass_field=pass_field, reason_field=reason_field,
                         min_pass=read_limit(r, sec.get("min_pass"), f"{where}.min_pass"),
                         workers=r.integer(sec.get("workers", 1), f"{where}.workers", 1))

    def grade(self, grading: Grading, spec: GraderSpec) -> Check:
        assert isinstance(spec, JudgeSpec)
        if grading.run_job is None:
            raise BatchlineError("validate.judge runs a judge job: validate through batchline (`batchline validate`, "
                                 "Jobs.validate), which starts its workers")
        tally = grading.tally()
        store = grading.store
        judge_version = grading.run_job(spec.over(grading.version), spec.workers)
        st = store.status(judge_version)
        rate = st.dead_letters / st.records if st.records else 0.0
        limit = spec.job.validate.max_dead_letter_rate
        judged = {r.record_id: r for r in store.iter_results(judge_version)}
        graded = store.results_for(grading.version, list(judged))
        for rid, result in judged.items():
            verdict = json.loads(result.output)
            ok = isinstance(verdict, dict) and verdict.get(spec.pass_field) is True
            why = verdict.get(spec.reason_field) if isinstance(verdict, dict) else None
            cat = category(grading.spec, json.loads(graded[rid].output)) if rid in graded else "(none)"
            tally.add(rid, cat, ok, short(str(why), 200))
        judge_failed = rate > limit
        passed = not judge_failed and tally.graded > 0 and (spec.min_pass is None or tally.share >= spec.min_pass)
        figure = (f"{gate_words(tally.share, spec.min_pass)} of {tally.graded:,} results judged by {judge_version} "
                  f"({spec.job.model.label}, prompt {spec.job.prompt.version}; sample {spec.sample:,}, seed "
                  f"{spec.seed})")
        if judge_failed:
            figure = (f"the judge's dead letters {st.dead_letters:,} ({rate:.1%}) exceed its own limit "
                      f"{limit:.1%}: not judged; " + figure)
        return tally.check(KEY, passed, figure, {
            "min_pass": spec.min_pass, "judge_version": judge_version, "judge_dead_letters": st.dead_letters,
            "judge_dead_letter_rate": rate, "judge_max_dead_letter_rate": limit, "seed": spec.seed,
            "sample": spec.sample, "input_tokens": sum(r.input_tokens or 0 for r in judged.values()),
            "output_tokens": sum(r.output_tokens or 0 for r in judged.values())})


JUDGE = JudgeGrader()
