"""`validate.eval`: the label field against known answers, on a sample of labelled records.

    validate:
      eval: {labels: labelled.jsonl, id_field: id, label_field: label, sample: 300,
             min_accuracy: 0.45, min_lift: 0.05}

The sample is spread over the labelled ids by their SHA-256 (not the file's first lines);
labelled records without a result (dead letters, records of other snapshots) are skipped.
Beside the accuracy it reports the majority class's: the share of the sample whose known
answer is the commonest one, which a job answering that one class for every record would
score. A version passes when its accuracy is at least `min_accuracy` and beats the majority
class's by more than nothing and by at least `min_lift`: a gate of 0.3 on eight classes
is not met by a model that answers one class for most records.
"""

from __future__ import annotations

import csv
import hashlib
import importlib
import json
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from batchline.check.graders.base import Grading, category, short
from batchline.check.report import Check
from batchline.errors import BatchlineError
from batchline.spec.ports import GraderContext, GraderSpec
from batchline.spec.reader import Fields, SpecReader

KEY = "eval"
CHECK = "labels"


@dataclass(frozen=True)
class EvalSpec:
    """Accuracy of the label field on a sample of records with known answers."""

    labels: Path
    id_field: str = "id"
    label_field: str = "label"
    field: str | None = None  # the output field compared; default output.label_field
    sample: int = 300
    min_accuracy: float = 0.0
    min_lift: float = 0.0  # over the majority class's accuracy on the same sample
    grader: str | None = None  # "module:function"(output, expected, record_id) -> bool | float
    key: str = KEY

    def to_dict(self) -> dict[str, Any]:
        # min_lift only where set: a version stored before it existed reads back to its own form.
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in self.__dict__.items()
                if v is not None and k != "key" and not (k == "min_lift" and v == EvalSpec.min_lift)}


FIELDS: Fields = {
    "labels": {"type": "string", "minLength": 1, "description": "A JSONL or CSV file of known answers"},
    "id_field": {"type": "string", "minLength": 1, "description": "The labels file's id field",
                 "default": EvalSpec.id_field},
    "label_field": {"type": "string", "minLength": 1, "description": "The labels file's answer field",
                    "default": EvalSpec.label_field},
    "field": {"type": "string", "minLength": 1, "description": "The output field compared (default "
                                                               "output.label_field)"},
    "sample": {"type": "integer", "minimum": 1, "description": "How many labelled records are compared",
               "default": EvalSpec.sample},
    "min_accuracy": {"type": "number", "minimum": 0, "description": "The accuracy (or the grader's mean) "
                                                                    "required", "default": EvalSpec.min_accuracy},
    "min_lift": {"type": "number", "minimum": 0, "description": "How far the accuracy must beat the majority "
                 "class's on the same sample (it must beat it in any case)", "default": EvalSpec.min_lift},
    "grader": {"type": "string", "minLength": 1, "pattern": ":",
               "description": "module:function(output, expected, record_id) instead of equality"},
}


class LabelsGrader:
    check: ClassVar[str] = CHECK  # the name of the check it reports
    runs_model: ClassVar[bool] = False
    keys: ClassVar[Fields] = {KEY: {"type": "object", "description": "Accuracy on a sample of records with "
                                                                      "known answers (the labels grader)"}}
    fields: ClassVar[Fields] = FIELDS
    required: ClassVar[frozenset[str]] = frozenset({"labels"})

    def parse(self, key: str, value: Any, r: SpecReader, ctx: GraderContext) -> EvalSpec:
        ev = r.section(value, f"validate.{key}", FIELDS, required=set(self.required))
        field_name = r.optional_string(ev.get("field"), "validate.eval.field") or ctx.label_field
        if field_name is None:
            r.fail("validate.eval.field", "is required when output.label_field is not set")
        grader = r.optional_string(ev.get("grader"), "validate.eval.grader")
        if grader is not None and ":" not in grader:
            r.fail("validate.eval.grader", f"{grader!r} must be 'module:function'")
        return EvalSpec(
            labels=(ctx.base_dir / r.string(ev["labels"], "validate.eval.labels")).resolve(),
            id_field=r.string(ev.get("id_field", EvalSpec.id_field), "validate.eval.id_field"),
            label_field=r.string(ev.get("label_field", EvalSpec.label_field), "validate.eval.label_field"),
            field=field_name,
            sample=r.integer(ev.get("sample", EvalSpec.sample), "validate.eval.sample", 1),
            min_accuracy=r.number(ev.get("min_accuracy", EvalSpec.min_accuracy), "validate.eval.min_accuracy", 0.0),
            min_lift=r.number(ev.get("min_lift", EvalSpec.min_lift), "validate.eval.min_lift", 0.0, 1.0),
            grader=grader,
        )

    def grade(self, grading: Grading, spec: GraderSpec) -> Check:
        assert isinstance(spec, EvalSpec)
        return check_labels(grading, spec)


def _load_grader(path: str) -> Callable[[Any, str, str], Any]:
    module_name, _, func = path.partition(":")
    try:
        grader: Callable[[Any, str, str], Any] = getattr(importlib.import_module(module_name), func)
    except (ImportError, AttributeError) as exc:
        raise BatchlineError(f"validate.eval.grader {path!r} cannot be loaded: {exc}") from None
    return grader


def read_labels(ev: EvalSpec) -> dict[str, str]:
    out: dict[str, str] = {}
    try:
        with ev.labels.open(encoding="utf-8", newline="") as f:
            if ev.labels.suffix.lower() == ".csv":
                for row in csv.DictReader(f):
                    out[str(row[ev.id_field])] = str(row[ev.label_field])
            else:
                for line in f:
                    if line.strip():
                        obj = json.loads(line)
                        if ev.label_field in obj:
                            out[str(obj[ev.id_field])] = str(obj[ev.label_field])
    except (OSError, KeyError, ValueError) as exc:
        raise BatchlineError(f"validate.eval.labels {ev.labels}: cannot read labels: {exc}") from None
    return out


def majority(expected: Mapping[str, str]) -> tuple[str | None, float]:
    """The commonest known answer of a sample and the share of the sample it is."""
    counts = Counter(expected.values())
    if not counts:
        return None, 0.0
    # Ties broken by the label, so the baseline names the same class every time.
    label, n = min(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return label, n / len(expected)


def check_labels(grading: Grading, ev: EvalSpec) -> Check:
    store, version = grading.store, grading.version
    labels = read_labels(ev)
    ordered = sorted(labels, key=lambda i: hashlib.sha256(i.encode()).digest())
    results: dict[str, Any] = {}
    for start in range(0, len(ordered), 2 * ev.sample):
        results.update(store.results_for(version, ordered[start:start + 2 * ev.sample]))
        if len(results) >= ev.sample:
            break
    ids = [i for i in ordered if i in results][:ev.sample]
    grader = _load_grader(ev.grader) if ev.grader else None
    score = 0.0
    tally = grading.tally()
    # Expected label -> answered label -> records: where the misses go, not only how many.
    confusion: dict[str, dict[str, int]] = {}
    for rid in ids:
        value = json.loads(results[rid].output)
        got = value.get(ev.field) if isinstance(value, dict) else None
        points = float(grader(value, labels[rid], rid)) if grader is not None else float(str(got) == labels[rid])
        score += points
        tally.add(rid, category(grading.spec, value), points >= 1.0,
                  f"expected {labels[rid]!r}, answered {short(str(got), 60)!r}")
        row = confusion.setdefault(labels[rid], {})
        row[str(got)] = row.get(str(got), 0) + 1
    accuracy = score / len(ids) if ids else 0.0
    baseline_label, baseline = majority({rid: labels[rid] for rid in ids})
    lift = accuracy - baseline
    passed = bool(ids) and accuracy >= ev.min_accuracy and lift > 0 and lift >= ev.min_lift
    how = f"grader {ev.grader}" if ev.grader else f"{ev.field} == {ev.label_field}"
    figure = (f"accuracy {accuracy:.1%} on {len(ids)} labelled records ({how}; limit {ev.min_accuracy:.0%}); "
              f"the majority class {baseline_label!r} alone {baseline:.1%}, lift {lift:+.1%} "
              f"(must be above 0{f' and at least {ev.min_lift:.0%}' if ev.min_lift else ''})")
    return tally.check(CHECK, passed, figure, {
        "accuracy": accuracy, "sample": len(ids), "labelled": len(labels), "min_accuracy": ev.min_accuracy,
        "majority_label": baseline_label, "majority_accuracy": baseline, "lift": lift, "min_lift": ev.min_lift,
        "field": ev.field, "confusion": confusion})


LABELS = LabelsGrader()
