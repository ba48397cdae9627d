"""Output checking: the fast path never accepts what jsonschema rejects."""

from __future__ import annotations

from typing import Any

import pytest

from batchline.check.outputs import OutputChecker

TRIAGE = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "properties": {"category": {"enum": ["a", "b"]}, "summary": {"type": "string", "maxLength": 5}},
    "required": ["category", "summary"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("output,valid", [
    ('{"category": "a", "summary": "ok"}', True),
    ('{"category": "c", "summary": "ok"}', False),
    ('{"category": "a", "summary": "too long"}', False),
    ('{"category": "a", "summary": "ok", "x": 1}', False),
    ('{"category": "a"}', False),
    ("not json", False),
    ("[1, 2]", False),
])
def test_outputs_are_checked_against_the_schema(output: str, valid: bool) -> None:
    canonical, problem = OutputChecker(TRIAGE).check(output)
    assert (canonical is not None) == valid
    assert (problem is None) == valid


def test_a_rejection_names_where() -> None:
    _, problem = OutputChecker(TRIAGE).check('{"category": "z", "summary": "ok"}')
    assert problem is not None and problem.startswith("output fails the schema at category:")


def test_2020_12_keywords_are_left_to_jsonschema() -> None:
    schema: dict[str, Any] = {"type": "array", "prefixItems": [{"type": "integer"}], "items": False}
    checker = OutputChecker(schema)
    assert checker.check("[1]")[0] is not None
    assert checker.check('[1, "extra"]')[0] is None  # draft 7 would read `items: false` differently
    assert checker.check('["x"]')[0] is None
