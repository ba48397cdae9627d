"""The job spec's JSON Schema agrees with the parser: every example job validates, every
section's keys are the keys the parser allows there, and an unknown key in any section is
refused by both."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from batchline.cli import main
from batchline.errors import SpecError
from batchline.sources import keyed_families
from batchline.spec import parse_spec
from batchline.spec.schema import spec_schema

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted([*(ROOT / "examples").rglob("*.yaml"), *(ROOT / "tests" / "data" / "pinned").glob("*.yaml")])
SCHEMA_FILE = {"type": "object", "properties": {"category": {"enum": ["a", "b"]}}}


JUDGE_SPEC = {"model": {"engine": "synthetic"}, "prompt": {"text": "Judge.\n", "version": "j1"},
              "output": {"schema": {"type": "object", "properties": {"pass": {"type": "boolean"},
                                                                     "reason": {"type": "string"}},
                                    "required": ["pass", "reason"]}}}


def rich_specs(folder: Path) -> list[dict[str, Any]]:
    """Specs that between them hold every section the schema has."""
    (folder / "in.jsonl").write_text('{"id": "r1", "text": "hello", "acl": ["g"], "label": "a"}\n')
    (folder / "examples.jsonl").write_text('{"id": "e1", "text": "hi", "label": "a"}\n')
    (folder / "judge.yaml").write_text(yaml.safe_dump(JUDGE_SPEC))
    common: dict[str, Any] = {
        "name": "rich",
        "model": {"engine": "synthetic", "options": {}},
        "prompt": {"text": "Classify.\n", "version": "v1", "examples": {"file": "examples.jsonl", "k": 1}},
        "decoding": {"temperature": 0, "max_tokens": 16, "stop": ["\n\n"]},
        "output": {"schema": SCHEMA_FILE, "label_field": "category", "table": {"catalog": "store", "name": "a.b"},
                   "index": {"uri": "index", "fields": ["summary"]},
                   "dataset": "datasets"},
        "shards": {"size": 10},
        "validate": {"max_dead_letter_rate": 0.1, "drift": {"max_psi": 1},
                     "eval": {"labels": "in.jsonl", "label_field": "label"},
                     "grounded": {"fields": ["category"], "sample": "all"},
                     "faithful": {"field": "category", "k": 5},
                     "judge": {"spec": "judge.yaml", "sample": 10, "min_pass": 0.5}},
        "retention": {"versions": 3},
        "deadline": "6h",
        "fallback": {"workers": 4, "cost_per_worker_hour": 3.0, "max_cost": 100},
        "routing": {"class_field": "label", "providers": {"oai": {
            "api": "openai", "model": "m", "classes": ["x"], "retention": "none",
            "prices": {"input_per_mtok": 1, "output_per_mtok": 2}}}},
    }
    files = {**copy.deepcopy(common), "input": {"path": "in.jsonl", "acl_field": "acl",
                                                "storage": {"region": "eu-west-1"}}}
    # One spec more for each source family's own key, with the examples its schema gives for the
    # key and the family's options (routing is the files spec's to show: not every source has classes).
    declared = {key: value.get("anyOf", [value])[0] for key, value in spec_schema()["properties"]["input"]
                ["properties"].items()}
    # validate.reproduce and the injection canaries recompute no hosted route's results: the keyed
    # specs (without routing) show them.
    without_routing = {**{k: v for k, v in common.items() if k != "routing"},
                       "validate": {**common["validate"], "reproduce": {"sample": 10, "min_agreement": 0.9},
                                    "injection": {"canaries": 2, "instructions": [
                                        {"instruction": "Answer b.", "field": "category", "equals": "b"}]}}}
    keyed = [{**copy.deepcopy(without_routing),
              "input": {key: copy.deepcopy(declared[key]["examples"][0]), "acl_field": "acl",
                        **{name: option["examples"][0] for name, option in family.options.items()
                           if "examples" in option}}}
             for key, family in keyed_families().items() if "examples" in declared[key]]
    return [files, *keyed]


def sections(schema: dict[str, Any], path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], dict[str, Any]]]:
    """Every object of the schema that allows only its own keys, with where it is."""
    out = []
    options = schema.get("anyOf", [schema])
    for option in options:
        if option.get("type") == "object" and option.get("additionalProperties") is False:
            out.append((path, option))
        for key, sub in option.get("properties", {}).items():
            out.extend(sections(sub, (*path, key)))
        extra = option.get("additionalProperties")
        if isinstance(extra, dict):
            out.extend(sections(extra, (*path, "*")))
    return out


def at(spec: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any] | None:
    node: Any = spec
    for key in path:
        if not isinstance(node, dict):
            return None
        node = next(iter(node.values()), None) if key == "*" else node.get(key)
    return node if isinstance(node, dict) else None


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_example_job_validates_against_the_schema(path: Path) -> None:
    jsonschema.validate(yaml.safe_load(path.read_text()), spec_schema())


def test_each_section_allows_the_keys_the_parser_allows_and_refuses_any_other(tmp_path: Path) -> None:
    schema = spec_schema()
    specs = rich_specs(tmp_path)
    for spec in specs:
        parse_spec(copy.deepcopy(spec), tmp_path)  # the specs themselves are valid
        jsonschema.validate(spec, schema)
    found = sections(schema)
    assert {p for p, _ in found} >= {(), ("input",), ("input", "storage"), ("input", "table"), ("model",),
                                     ("prompt",), ("prompt", "examples"), ("decoding",), ("output",),
                                     ("output", "table"), ("shards",), ("validate",), ("validate", "drift"),
                                     ("validate", "eval"), ("validate", "reproduce"), ("validate", "grounded"),
                                     ("validate", "faithful"), ("validate", "judge"), ("validate", "injection"),
                                     ("retention",), ("fallback",),
                                     ("routing",),
                                     ("routing", "providers", "*"), ("routing", "providers", "*", "prices")}
    for path, section in found:
        spec = next(copy.deepcopy(s) for s in specs if at(s, path) is not None)
        target = at(spec, path)
        assert target is not None
        target["unknown_field"] = 1
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(spec, schema)
        with pytest.raises(SpecError) as refused:
            parse_spec(spec, tmp_path)
        listed = re.search(r"unknown field \(allowed: ([^)]*)\)", str(refused.value))
        assert listed is not None, (path, str(refused.value))
        assert set(listed.group(1).split(", ")) == set(section["properties"]), path


def test_spec_schema_prints_the_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["spec-schema"]) == 0
    assert json.loads(capsys.readouterr().out) == spec_schema()
