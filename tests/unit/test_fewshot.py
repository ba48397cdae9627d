"""Retrieved examples (`prompt.examples`): the nearest labelled examples go between the
shared prefix and the record, never the record's own answer, and are part of the version."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from batchline.check.outputs import OutputChecker
from batchline.errors import SpecError
from batchline.prompts.examples import Example, ExampleIndex
from batchline.spec import load_spec, parse_spec
from batchline.worker.shard import JobContext
from tests.unit.test_spec import BASE, with_change, write

POOL = [
    Example("e1", "printer paper jam on floor two", "Miscellaneous"),
    Example("e2", "laptop charger broken please replace", "Hardware"),
    Example("e3", "password reset for confluence account", "Access"),
    Example("e4", "laptop screen flickers after docking", "Hardware"),
    Example("e5", "new starter needs an access card", "HR Support"),
]


def test_the_nearest_examples_are_the_most_similar_in_a_stable_order() -> None:
    index = ExampleIndex(POOL, k=2)
    assert [e.id for e in index.nearest("r1", "my laptop charger is broken")] == ["e2", "e4"]
    assert index.nearest("r1", "my laptop charger is broken") == index.nearest("r1", "my laptop charger is broken")
    assert [e.id for e in index.nearest("r1", "reset my confluence password")] == ["e3"]  # only one shares a word
    assert index.nearest("r1", "nothing in common") == []


def test_an_example_never_answers_for_its_own_record() -> None:
    index = ExampleIndex(POOL, k=1)
    # By id: the labelled file overlaps the input.
    assert [e.id for e in index.nearest("e2", "laptop charger broken please replace")] == ["e4"]
    # By text: the same ticket under another id (an evaluated ticket copied into the examples).
    assert [e.id for e in index.nearest("t-9", "laptop charger broken please replace")] == ["e4"]


def test_examples_come_after_the_shared_prefix_and_before_the_record(tmp_path: Path) -> None:
    spec = load_spec(examples_spec(tmp_path, k=2))
    job = JobContext(spec, OutputChecker(spec.output_schema), "Classify.\n", "Answer:")
    prompt = job.prompt("r1", "my laptop charger is broken")
    assert prompt.startswith("Classify.\n<record>\nlaptop screen flickers")
    # The nearest is last, just before the record, each answered with the output's label field.
    assert prompt.index('{"category": "Hardware"}') < prompt.index("laptop charger broken please replace") \
        < prompt.index("my laptop charger is broken")
    assert prompt.endswith("<record>\nmy laptop charger is broken\n</record>\nAnswer:")


def examples_spec(tmp_path: Path, k: int = 2, rows: list[Any] | None = None) -> Path:
    lines = [json.dumps(r) if not isinstance(r, str) else r
             for r in (rows if rows is not None else [{"id": e.id, "ticket": e.text, "label": e.label} for e in POOL])]
    (tmp_path / "labelled.jsonl").write_text("\n".join(lines) + "\n")
    spec = with_change("prompt.examples", {"file": "labelled.jsonl", "k": k, "text_field": "ticket"})
    spec["output"]["label_field"] = "category"
    return write(tmp_path, spec)


def test_examples_are_part_of_the_version_only_when_given(tmp_path: Path) -> None:
    plain = load_spec(write(tmp_path, BASE))
    assert "examples" not in plain.version_material("s")["prompt"]
    first = load_spec(examples_spec(tmp_path, k=2)).version("s")
    assert first != plain.version("s")
    assert load_spec(examples_spec(tmp_path, k=3)).version("s") != first
    relabelled = [{"id": e.id, "ticket": e.text, "label": "Access"} for e in POOL]
    assert load_spec(examples_spec(tmp_path, k=2, rows=relabelled)).version("s") != first


def test_a_planned_spec_carries_its_examples_to_a_worker_with_no_file(tmp_path: Path) -> None:
    spec = load_spec(examples_spec(tmp_path))
    stored = json.loads(json.dumps(spec.to_dict()))
    (tmp_path / "labelled.jsonl").unlink()
    again = parse_spec(stored, base_dir=Path("/"))
    assert again.prompt.examples is not None and again.prompt.examples.items == tuple(POOL)
    assert again.version("s") == spec.version("s")


@pytest.mark.parametrize("rows,message", [
    (['{"id": "a", "ticket": "x", "label": "L"}', "{not json"], "labelled.jsonl, line 2: not valid JSON"),
    ([{"id": "a", "ticket": "x", "label": "L"}, {"id": "a", "ticket": "y", "label": "M"}],
     "labelled.jsonl, line 2: example id 'a' appears twice"),
    ([{"id": "a", "ticket": "x"}], "labelled.jsonl, line 1: example field 'label' must be a non-empty string"),
    ([], "holds no examples"),
])
def test_a_bad_examples_file_is_one_line_naming_file_and_line(tmp_path: Path, rows: list[Any], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        load_spec(examples_spec(tmp_path, rows=rows))


def test_examples_with_bytes_that_are_not_utf8_name_their_line(tmp_path: Path) -> None:
    path = examples_spec(tmp_path)
    (tmp_path / "labelled.jsonl").write_bytes(
        b'\xef\xbb\xbf{"id": "a", "ticket": "x", "label": "L"}\n{"id": "b", "ticket": "caf\xe9", "label": "L"}\n')
    with pytest.raises(SpecError, match=r"labelled\.jsonl, line 2: not valid UTF-8 \(byte 27 of the line\)"):
        load_spec(path)


def test_examples_need_the_label_field_they_answer(tmp_path: Path) -> None:
    (tmp_path / "labelled.jsonl").write_text('{"id": "a", "text": "x", "label": "L"}\n')
    with pytest.raises(SpecError, match=r"prompt\.examples: needs output\.label_field"):
        load_spec(write(tmp_path, with_change("prompt.examples", {"file": "labelled.jsonl", "k": 1})))
