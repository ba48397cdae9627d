"""`input.job`'s section: what it reads, written back as it is read, and each mistake refused
with one line naming the field (what needs the store is in tests/integration/test_job_input.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from batchline.errors import SpecError
from batchline.sources.job import JobSource, field_value
from batchline.spec import STORED, load_spec, parse_spec

SPEC: dict[str, Any] = {
    "name": "summaries",
    "input": {"job": "ticket-triage", "field": "output.summary", "acl_field": "acl"},
    "model": {"engine": "synthetic"},
    "prompt": {"text": "Embed.", "version": "v1"},
    "output": {"schema": "schema.json"},
}


def spec_file(tmp_path: Path, **input_changes: Any) -> Path:
    spec = json.loads(json.dumps(SPEC))
    spec["input"].update(input_changes)
    spec["input"] = {k: v for k, v in spec["input"].items() if v is not None}
    (tmp_path / "schema.json").write_text(json.dumps({"type": "object"}))
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_a_job_input_reads_the_named_jobs_field_from_the_store(tmp_path: Path) -> None:
    spec = load_spec(spec_file(tmp_path))
    assert spec.input.source == JobSource("ticket-triage", "output.summary")
    assert (spec.input.format, spec.input.acl_field, spec.input.locations) == (STORED, "acl", ())
    # The stored form names the version read once planning pins it, and reads back as it was.
    pinned = JobSource("ticket-triage", "output.summary", "ticket-triage@0123456789abcdef")
    stored = {**spec.to_dict(), "input": {**spec.to_dict()["input"], **pinned.to_dict()}}
    again = parse_spec(stored, base_dir=tmp_path, resolved=True)
    assert again.input.source == pinned and again.input.format == STORED


@pytest.mark.parametrize(("changes", "message"), [
    ({"field": None}, "input.field: is required with input.job: the output field each record's text is read "
                      "from (for example output.summary)"),
    ({"field": "summary"}, "input.field: 'summary' must name a field of the job's output: output.NAME "
                           "(output.NAME.INNER for a nested one)"),
    ({"job": "Ticket Triage"}, "input.job: 'Ticket Triage' is not a job's name (lower-case letters, digits, "
                               "'-' or '_')"),
    ({"job_version": "other@0123"}, "input.job_version: 'other@0123' is not a version of 'ticket-triage' "
                                    "(ticket-triage@...)"),
    ({"text_field": "summary"}, "input.text_field: is not used with input.job: input.field names the output "
                                "field read"),
    ({"id_field": "ticket"}, "input.id_field: is not used with input.job: each record keeps its id from the "
                             "upstream job"),
    ({"format": "jsonl"}, "input.format: is not used with input.job: the records are read from the store"),
    ({"acl_missing": ["restricted"]}, "input.acl_missing: is not used with input.job: every record keeps the "
                                      "ACL the upstream's record has"),
    ({"path": "in.jsonl"}, "input: give exactly one of"),
    ({"fields": "output.summary"}, "input.fields: unknown field"),
])
def test_a_mistake_in_a_job_input_is_refused_naming_the_field(tmp_path: Path, changes: dict[str, Any],
                                                               message: str) -> None:
    with pytest.raises(SpecError) as info:
        load_spec(spec_file(tmp_path, **changes))
    assert f"job.yaml: {message}" in str(info.value)


def test_the_field_and_job_version_go_with_input_job_only(tmp_path: Path) -> None:
    (tmp_path / "in.jsonl").write_text('{"id": 1, "text": "x"}\n')
    with pytest.raises(SpecError, match=r"input\.field: goes with input\.job"):
        load_spec(spec_file(tmp_path, job=None, path="in.jsonl", field="output.summary", acl_field=None))


def test_routing_is_refused_over_a_job_input(tmp_path: Path) -> None:
    path = spec_file(tmp_path)
    spec = yaml.safe_load(path.read_text())
    spec["routing"] = {"class_field": "cls", "providers": {"p": {"api": "openai", "model": "m", "classes": ["a"],
                                                                 "retention": "none"}}}
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(SpecError, match=r"routing: is not supported with output\.summary of job ticket-triage"):
        load_spec(path)


@pytest.mark.parametrize(("output", "expected"), [
    ({"summary": "text"}, ("text", None)),
    ({"summary": None}, (None, "is null")),
    ({}, (None, "is missing")),
    ({"summary": ["a"]}, (None, "is not text (list)")),
    (None, (None, "is missing")),
])
def test_a_results_field_is_its_text_or_why_there_is_none(output: Any, expected: tuple[str | None, str | None]
                                                          ) -> None:
    assert field_value(output, "output.summary") == expected


def test_a_nested_field_is_read_through_its_parents() -> None:
    assert field_value({"triage": {"summary": "deep"}}, "output.triage.summary") == ("deep", None)
    assert field_value({"triage": "flat"}, "output.triage.summary") == (None, "is missing")
