"""`validate.grounded`: output fields whose values must come from the record.

    validate:
      grounded: [entities]                 # or:
      grounded: {fields: [entities], sample: 1000, seed: 0, min_share: 0.9}

Each named field is a string or an array of strings in the output's schema. A result passes
when every value of every named field occurs in its record's text once both are normalised:
letters case-folded (Unicode's casefold) and every run of whitespace made one space, trimmed.
Nothing else is changed: no stemming, no punctuation dropped, no fuzzy match, so an entity
the model rephrased fails as one it invented does. An empty string or an empty array has
nothing to check. The record's text is read again from the input by its shard's slice.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar

from batchline.check.graders.base import (
    Grading,
    Sampled,
    at_least,
    category,
    declared,
    field_value,
    gate_words,
    mapping_or_list,
    output_of,
    sample_fields,
    sampled_results,
    schema_types,
    short,
    types_words,
    with_records,
)
from batchline.check.report import Check
from batchline.spec.ports import GraderContext, GraderSpec
from batchline.spec.reader import Fields, SpecReader

KEY = "grounded"
DEFAULT_SAMPLE = 1000
_SPACE = re.compile(r"\s+")


def normalise(text: str) -> str:
    """Case and whitespace, nothing else."""
    return _SPACE.sub(" ", text.casefold()).strip()


@dataclass(frozen=True)
class GroundedSpec:
    fields: tuple[str, ...]
    sampled: Sampled
    key: str = KEY

    def to_dict(self) -> dict[str, Any]:
        return {"fields": list(self.fields), **self.sampled.to_dict()}


FIELDS: Fields = {
    "fields": {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1,
               "description": "Output fields (a string or an array of strings) whose values must occur in the record"},
    **sample_fields(DEFAULT_SAMPLE, 1.0),
}


class GroundedGrader:
    check: ClassVar[str] = KEY  # the name of the check it reports
    runs_model: ClassVar[bool] = False
    keys: ClassVar[Fields] = {KEY: {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "object"}],
                                    "description": "Output fields whose values must come from the record's text"}}
    fields: ClassVar[Fields] = FIELDS
    required: ClassVar[frozenset[str]] = frozenset({"fields"})

    def parse(self, key: str, value: Any, r: SpecReader, ctx: GraderContext) -> GroundedSpec:
        where = f"validate.{key}"
        sec = r.section(mapping_or_list(r, value, where, "fields"), where, FIELDS, required=set(self.required))
        names = r.string_list(sec["fields"], f"{where}.fields")
        if not names:
            r.fail(f"{where}.fields", "names no field")
        for name in names:
            node = declared(r, ctx.output_schema, name, f"{where}.fields")
            kinds = schema_types(node)
            items = node.get("items") if isinstance(node.get("items"), dict) else None
            strings = kinds == {"string"} or (
                kinds == {"array"} and items is not None and schema_types(items) == {"string"})
            if not strings:
                r.fail(f"{where}.fields", f"{name!r} is {types_words(node)} in the output schema; a grounded "
                                          "field is a string or an array of strings")
        return GroundedSpec(fields=tuple(names), sampled=Sampled.read(r, sec, where, FIELDS))

    def grade(self, grading: Grading, spec: GraderSpec) -> Check:
        assert isinstance(spec, GroundedSpec)
        tally = grading.tally()
        limit = spec.sampled.min_share
        results = sampled_results(grading.store, grading.version, spec.sampled.sample, spec.sampled.seed)
        values_checked = values_missing = 0
        for result, record in with_records(grading, results):
            output = output_of(result)
            text = normalise(record.text)
            missing: list[str] = []
            for name in spec.fields:
                _present, value = field_value(output, name)
                for item in value if isinstance(value, list) else [value]:
                    if not isinstance(item, str) or not item.strip():
                        continue
                    values_checked += 1
                    if normalise(item) not in text:
                        values_missing += 1
                        missing.append(f"{name} {short(item, 60)!r}")
            tally.add(result.record_id, category(grading.spec, output), not missing,
                      "not in the record: " + ", ".join(missing))
        passed = at_least(tally.share, limit, tally.graded)
        figure = (f"{gate_words(tally.share, limit, 'grounded')} of {tally.graded:,} results "
                  f"({', '.join(spec.fields)}; {values_missing:,} of {values_checked:,} values not in their record)")
        return tally.check(KEY, passed, figure, {"fields": list(spec.fields), "values": values_checked,
                                                 "values_missing": values_missing, **spec.sampled.to_dict()})


GROUNDED = GroundedGrader()
