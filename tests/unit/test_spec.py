"""The job spec: typed validation with errors that name the field, and the version hash (I2)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from batchline.errors import SpecError
from batchline.spec import load_spec

BASE: dict[str, Any] = {
    "name": "triage",
    "input": {"path": "in.jsonl", "id_field": "id", "acl_field": "acl", "max_input_tokens": 100},
    "model": {"engine": "synthetic", "options": {"seconds_per_record": 0}},
    "prompt": {"text": "Classify.", "version": "v1"},
    "decoding": {"temperature": 0, "max_tokens": 50, "seed": 0},
    "output": {"schema": "schema.json"},
    "shards": {"size": 10},
}


def write(tmp_path: Path, spec: dict[str, Any], schema: Any = None) -> Path:
    (tmp_path / "in.jsonl").write_text('{"id": 1, "text": "x"}\n')
    (tmp_path / "schema.json").write_text(json.dumps(schema or {"type": "object"}))
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def with_change(path: str, value: Any, **input_: Any) -> dict[str, Any]:
    """BASE with `path` set to `value` (and `input_` added to its input section)."""
    spec = json.loads(json.dumps(BASE))
    *parents, last = path.split(".")
    node = spec
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value
    spec["input"].update(input_)
    return spec


def version_of(tmp_path: Path, spec: dict[str, Any], snapshot: str = "sha256:aa") -> str:
    return load_spec(write(tmp_path, spec)).version(snapshot)


def test_the_same_spec_gives_the_same_version(tmp_path: Path) -> None:
    assert version_of(tmp_path, BASE) == version_of(tmp_path, BASE)
    assert version_of(tmp_path, BASE).startswith("triage@")


@pytest.mark.parametrize("field,value", [
    ("input.id_field", "key"),
    ("input.text_field", "body"),
    ("input.acl_field", "groups"),
    ("input.max_input_tokens", 200),
    ("model.options", {"seconds_per_record": 1}),
    ("model.digest", "sha256:" + "b" * 64),
    ("prompt.text", "Classify carefully."),
    ("prompt.version", "v2"),
    ("decoding.temperature", 0.7),
    ("decoding.max_tokens", 51),
    ("decoding.seed", 1),
])
def test_every_field_that_can_change_a_result_changes_the_version(tmp_path: Path, field: str, value: Any) -> None:
    assert version_of(tmp_path, with_change(field, value)) != version_of(tmp_path, BASE)


def test_the_snapshot_and_the_schema_change_the_version(tmp_path: Path) -> None:
    assert version_of(tmp_path, BASE, "sha256:bb") != version_of(tmp_path, BASE, "sha256:aa")
    a = load_spec(write(tmp_path, BASE, {"type": "object"})).version("s")
    b = load_spec(write(tmp_path, BASE, {"type": "object", "required": ["x"]})).version("s")
    assert a != b


@pytest.mark.parametrize("field,value", [
    ("shards.size", 99),
    ("shards.lease_seconds", 300),
    ("shards.renew_seconds", 5),
    ("shards.max_attempts", 5),
    ("deadline", "2026-12-01T06:00:00Z"),
    ("validate", {"max_dead_letter_rate": 0.5}),
    ("shards.abort_dead_letter_rate", 0.5),
    ("shards.locality_wait_seconds", 600),
    ("input.region", "us-east-1"),
])
def test_fields_that_cannot_change_a_result_keep_the_version(tmp_path: Path, field: str, value: Any) -> None:
    assert version_of(tmp_path, with_change(field, value)) == version_of(tmp_path, BASE)


def test_to_dict_round_trips_to_the_same_version(tmp_path: Path) -> None:
    from batchline.spec import parse_spec

    spec = load_spec(write(tmp_path, BASE))
    again = parse_spec(spec.to_dict(), base_dir=Path("/"))
    assert again.version("s") == spec.version("s")
    assert again.shards == spec.shards


@pytest.mark.parametrize("spec,message", [
    (with_change("input.colour", "red"), "input.colour: unknown field"),
    (with_change("surprise", 1), "surprise: unknown field"),
    (with_change("model.engine", "gpt"), "model.engine: 'gpt' is not one of"),
    (with_change("shards.size", 0), "shards.size: must be at least 1"),
    (with_change("shards.size", "big"), "shards.size: must be an integer"),
    (with_change("model.digest", "md5:abc"), "model.digest: must be 'sha256:'"),
    (with_change("name", "Bad Name"), "name: 'Bad Name' must be lower-case"),
    # Regression: a name with a trailing newline was accepted (`$` matches before one).
    (with_change("name", "nightly\n"), "name: 'nightly\\n' must be lower-case"),
    (with_change("name", " nightly"), "name: ' nightly' must be lower-case"),
    (with_change("name", "night\x07ly"), "name: 'night\\x07ly' must be lower-case"),
    (with_change("input.path", "in.jsonl.gz"), "compressed (.gz)"),
    (with_change("input.path", "in.txt"), "cannot tell the format"),
    (with_change("deadline", "tomorrow"), "deadline: 'tomorrow' is neither an ISO 8601 time (2026-12-01T06:00:00Z) nor a window"),
    ({k: v for k, v in BASE.items() if k != "model"}, "model: is required"),
    (with_change("input.region", "US East"), "input.region: 'US East' is not a region name"),
    (with_change("input.replicas", {"eu-west-1": "s3://copy/in/"}), "input.replicas: needs input.region"),
    (with_change("input.replica_fallback", "primary"), "input.replica_fallback: goes with input.replicas"),
    (with_change("input.replicas", {"eu": "s3://b/in/"}, region="eu"), "input.replicas.eu: is input.region"),
    (with_change("input.replicas", {"eu": "s3://b/in"}, region="us"), "must be an s3:// or gs:// prefix ending in '/'"),
    (with_change("input.replicas", {"eu": {"location": "s3://b/in/", "endpoint": "x"}}, region="us"),
     "input.replicas.eu.endpoint: unknown field (allowed: location, storage)"),
    (with_change("input.replicas", {"eu": "s3://b/in/"}, region="us"), "input.replicas: mirror objects named by "
                                                                         "input.path"),
])
def test_spec_errors_name_the_field(tmp_path: Path, spec: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError) as info:
        load_spec(write(tmp_path, spec))
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_a_schema_that_is_not_json_schema_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"output.schema: not a valid JSON Schema at type"):
        load_spec(write(tmp_path, BASE, {"type": "frobnicate"}))


def test_a_schema_file_that_is_not_json_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, BASE)
    (tmp_path / "schema.json").write_text("{not json")
    with pytest.raises(SpecError, match=r"output.schema: .* is not JSON"):
        load_spec(path)


def test_yaml_that_does_not_parse_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("name: [unclosed\n")
    with pytest.raises(SpecError, match="not valid YAML") as info:
        load_spec(path)
    assert "\n" not in str(info.value)


def test_a_new_engine_revision_makes_a_new_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from batchline import registry

    before = version_of(tmp_path, BASE)
    monkeypatch.setitem(registry.ENGINES, "synthetic",  # type: ignore[index]
                        dataclasses.replace(registry.ENGINES["synthetic"], revision=2))
    assert version_of(tmp_path, BASE) != before


def test_the_order_of_schema_properties_is_part_of_the_version(tmp_path: Path) -> None:
    # A constrained engine writes properties in the schema's order, so the order
    # changes results (regression: the stored spec sorted its keys, and the
    # engine then wrote entities before summary, unlike the few-shot examples).
    ab = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"}}}
    ba = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "string"}}}
    assert load_spec(write(tmp_path, BASE, ab)).version("s") != load_spec(write(tmp_path, BASE, ba)).version("s")


@pytest.mark.parametrize("shards,message", [
    ({"abort_dead_letter_rate": 0.005},
     "shards.abort_dead_letter_rate: 0.005 is below validate.max_dead_letter_rate (0.01): the version would be "
     "halted at a rate its validation passes"),
    ({"abort_dead_letter_rate": 1.5}, "shards.abort_dead_letter_rate: must be between 0 and 1, not 1.5"),
    ({"abort_min_outcomes": 40},
     "shards.abort_min_outcomes: has no effect without shards.abort_dead_letter_rate; set both"),
    ({"abort_dead_letter_rate": 0.5, "abort_min_outcomes": 0}, "shards.abort_min_outcomes: must be at least 1"),
])
def test_a_dead_letter_bound_that_could_halt_a_passing_job_or_that_does_nothing_is_refused_at_parsing(
        tmp_path: Path, shards: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError) as info:
        load_spec(write(tmp_path, {**BASE, "shards": {**BASE["shards"], **shards}}))
    assert str(info.value) == f"{tmp_path / 'job.yaml'}: {message}"


def test_a_dead_letter_bound_is_read_with_its_default_minimum_and_kept_through_the_stored_spec(
        tmp_path: Path) -> None:
    from batchline.spec import parse_spec
    from batchline.store import DeadLetterBound

    assert load_spec(write(tmp_path, BASE)).shards.abort_bound is None
    assert "abort_dead_letter_rate" not in load_spec(write(tmp_path, BASE)).to_dict()["shards"]
    at_gate = {**BASE, "shards": {"abort_dead_letter_rate": 0.2}, "validate": {"max_dead_letter_rate": 0.2}}
    spec = load_spec(write(tmp_path, at_gate))
    assert spec.shards.abort_bound == DeadLetterBound(0.2, 100)
    again = parse_spec(spec.to_dict(), base_dir=Path("/"))
    assert again.shards == spec.shards
