"""decoding.max_tokens against the output the schema asks for (batchline.plan.budget): the
ticket example's schema with a budget of 20 tokens is warned of, naming the bounded fields; a
budget that cannot hold even the smallest output is refused; an engine that does not decode
has no budget."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from batchline.errors import SpecError
from batchline.plan.budget import check_output_budget, output_bytes
from batchline.spec import parse_spec

ROOT = Path(__file__).resolve().parents[2]
TRIAGE = json.loads((ROOT / "examples" / "tickets" / "triage.schema.json").read_text())


def spec(tmp_path: Path, max_tokens: int, schema: dict[str, Any] = TRIAGE, engine: str = "synthetic") -> Any:
    (tmp_path / "in.jsonl").write_text('{"id": "r1", "text": "hello"}\n')
    return parse_spec({"name": "budget", "input": {"path": "in.jsonl"}, "model": {"engine": engine},
                       "prompt": {"text": "Say.\n", "version": 1}, "decoding": {"max_tokens": max_tokens},
                       "output": {"schema": schema}}, tmp_path)


def test_the_largest_and_smallest_outputs_of_the_ticket_schema() -> None:
    smallest = {"category": "Access", "summary": "x", "entities": []}
    assert output_bytes(TRIAGE, largest=False) == len(json.dumps(smallest, separators=(",", ":")))
    largest = {"category": "Administrative rights", "summary": "x" * 100, "entities": ["y" * 40] * 3}
    assert output_bytes(TRIAGE, largest=True) == len(json.dumps(largest, separators=(",", ":")))


def test_planning_accepted_max_tokens_20_with_a_summary_of_up_to_100_characters(tmp_path: Path) -> None:
    warning = check_output_budget(spec(tmp_path, 20))
    assert warning is not None and "decoding.max_tokens 20 may cut off outputs" in warning
    assert "output.summary (maxLength 100)" in warning and "output.entities[] (maxLength 40)" in warning
    assert check_output_budget(spec(tmp_path, 256)) is None


def test_a_budget_that_cannot_hold_the_smallest_output_is_refused(tmp_path: Path) -> None:
    wide = {"type": "object", "properties": {"answer": {"type": "string", "minLength": 200}}, "required": ["answer"]}
    with pytest.raises(SpecError, match=r"decoding.max_tokens: 2 cannot hold even the smallest output"):
        check_output_budget(spec(tmp_path, 2, wide))
    assert check_output_budget(spec(tmp_path, 8, wide)) is not None  # fits only at the planner's bound: warned


def test_an_engine_that_does_not_decode_has_no_budget(tmp_path: Path) -> None:
    vectors = {"type": "object", "properties": {"embedding": {"type": "array", "items": {"type": "number"},
                                                              "minItems": 384, "maxItems": 384}}}
    assert check_output_budget(spec(tmp_path, 1, vectors, engine="embedding")) is None
