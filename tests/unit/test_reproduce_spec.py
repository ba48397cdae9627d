"""`validate.reproduce` and `output.provenance` in the spec: read exactly, refused with the field
named, kept through the stored spec, and neither part of the job version (a gate and where
results go cannot change a result, I2)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from batchline.errors import SpecError
from batchline.spec import ReproduceSpec, load_spec, spec_from_store
from tests.unit.test_spec import BASE, write


def spec_with(tmp_path: Path, validate: Any = None, output: dict[str, Any] | None = None, **top: Any) -> Any:
    raw = {**json.loads(json.dumps(BASE)), **top}
    if validate is not None:
        raw["validate"] = validate
    raw["output"] = {**raw["output"], **(output or {})}
    return load_spec(write(tmp_path, raw))


def test_reproduce_takes_its_defaults_and_checks_in_batches_other_than_the_workers(tmp_path: Path) -> None:
    rep = spec_with(tmp_path, {"reproduce": {"sample": 50}}).validate.reproduce
    assert rep == ReproduceSpec(sample=50)
    assert rep.check_batch_size(8) == 1 and rep.check_batch_size(1) == 2
    assert ReproduceSpec(sample=5, batch_size=3).check_batch_size(8) == 3


@pytest.mark.parametrize(("reproduce", "field", "why"), [
    ({}, "validate.reproduce.sample", "is required"),
    ({"sample": 0}, "validate.reproduce.sample", "at least 1"),
    ({"sample": 5, "min_agreement": 1.5}, "validate.reproduce.min_agreement", "between 0 and 1"),
    ({"sample": 5, "batch_size": 8}, "validate.reproduce.batch_size", r"is the workers' own \(8"),
    ({"sample": 5, "on": "labels"}, "validate.reproduce.on", "must be one of output, label"),
    ({"sample": 5, "on": "label"}, "validate.reproduce.on", "needs output.label_field"),
    ({"sample": 5, "min_agreemnt": 0.9}, "validate.reproduce.min_agreemnt", "unknown field"),
    ({"sample": 5, "min_cosine": 2}, "validate.reproduce.min_cosine", "between -1 and 1"),
])
def test_a_mistake_in_reproduce_is_refused_naming_the_field(tmp_path: Path, reproduce: dict[str, Any], field: str,
                                                            why: str) -> None:
    with pytest.raises(SpecError, match=f"{field}: .*{why}"):
        spec_with(tmp_path, {"reproduce": reproduce}, shards={"size": 10, "batch_size": 8})


def test_reproduce_with_hosted_routes_is_refused(tmp_path: Path) -> None:
    routing = {"class_field": "cls", "providers": {"hosted": {
        "api": "openai", "model": "m", "classes": ["public"], "retention": "30 days"}}}
    with pytest.raises(SpecError, match=r"validate\.reproduce: is not supported with routing"):
        spec_with(tmp_path, {"reproduce": {"sample": 5}}, routing=routing)


def test_provenance_must_be_a_boolean(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"output\.provenance: must be true or false"):
        spec_with(tmp_path, output={"provenance": "yes"})


def test_neither_moves_the_version_and_both_survive_the_stored_spec(tmp_path: Path) -> None:
    plain = spec_with(tmp_path)
    both = spec_with(tmp_path, {"reproduce": {"sample": 7, "min_agreement": 0.9, "seed": 3, "on": "label"}},
                     output={"provenance": True, "label_field": "category"})
    relabelled = spec_with(tmp_path, output={"label_field": "category"})
    assert both.version("sha256:x") == relabelled.version("sha256:x") != plain.version("sha256:x")
    again = spec_from_store(both.to_dict())
    assert again.provenance and again.validate.reproduce == both.validate.reproduce
    assert not spec_from_store(plain.to_dict()).provenance
