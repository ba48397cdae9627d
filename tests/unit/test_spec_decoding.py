"""The optional decoding knobs: repetition, frequency and presence penalties and stop sequences.

They enter the version only when set, so no existing version's hash moves; an
engine or provider that cannot honour one that is set is refused at parsing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from batchline.engines import create_engine
from batchline.engines.base import EngineConfig
from batchline.errors import EngineFatal, SpecError
from batchline.spec import DecodingSpec, ModelSpec, load_spec, parse_spec
from tests.unit.test_spec import BASE, version_of, with_change, write

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tickets" / "job.yaml"


def test_versions_computed_before_the_knobs_existed_do_not_move(tmp_path: Path) -> None:
    # Both hashes were computed on the code before the knobs (and retrieved examples) were
    # added; the example job as it was then is the one of today without its examples.
    assert version_of(tmp_path, BASE) == "triage@e7cb7a3070bdf9b4"
    raw = yaml.safe_load(EXAMPLE.read_text())
    del raw["prompt"]["examples"]
    was = parse_spec(raw, base_dir=EXAMPLE.parent, source=EXAMPLE)
    assert was.version("sha256:" + "0" * 64) == "ticket-triage@3604b8279671c044"


@pytest.mark.parametrize("field,value", [
    ("decoding.repetition_penalty", 1.3),
    ("decoding.frequency_penalty", 0.5),
    ("decoding.presence_penalty", -0.5),
    ("decoding.stop", "\n\n"),
    ("decoding.stop", ["END", "###"]),
])
def test_a_set_knob_changes_the_version(tmp_path: Path, field: str, value: Any) -> None:
    assert version_of(tmp_path, with_change(field, value)) != version_of(tmp_path, BASE)


@pytest.mark.parametrize("field,value", [
    ("decoding.repetition_penalty", None),
    ("decoding.frequency_penalty", None),
    ("decoding.stop", None),
    ("decoding.stop", []),
])
def test_a_knob_left_unset_keeps_the_version(tmp_path: Path, field: str, value: Any) -> None:
    assert version_of(tmp_path, with_change(field, value)) == version_of(tmp_path, BASE)


def test_a_single_stop_string_is_the_same_setting_as_a_list_of_it(tmp_path: Path) -> None:
    one = load_spec(write(tmp_path, with_change("decoding.stop", "END")))
    assert one.decoding.stop == ("END",)
    assert one.version("s") == version_of(tmp_path, with_change("decoding.stop", ["END"]), "s")


def test_the_knobs_round_trip_through_the_stored_form(tmp_path: Path) -> None:
    raw = with_change("decoding", {"temperature": 0.5, "max_tokens": 40, "seed": 2, "repetition_penalty": 1.2,
                                   "frequency_penalty": 0.4, "presence_penalty": 0.1, "stop": ["}\n", "END"]})
    spec = load_spec(write(tmp_path, raw))
    again = parse_spec(spec.to_dict(), base_dir=Path("/"))
    assert again.decoding == spec.decoding
    assert again.version("s") == spec.version("s")
    # The engine child gets the decoding as JSON and rebuilds it.
    assert DecodingSpec(**spec.decoding.to_dict()) == spec.decoding
    unset = load_spec(write(tmp_path, BASE))
    assert set(unset.to_dict()["decoding"]) == {"temperature", "max_tokens", "seed", "top_p"}


@pytest.mark.parametrize("field,value,message", [
    ("decoding.repetition_penalty", 0, "decoding.repetition_penalty: must be greater than 0 (1 is none), not 0"),
    ("decoding.repetition_penalty", -1.5, "decoding.repetition_penalty: must be greater than 0"),
    ("decoding.repetition_penalty", "high", "decoding.repetition_penalty: must be a number, not 'high'"),
    ("decoding.frequency_penalty", 2.5, "decoding.frequency_penalty: must be between -2 and 2, not 2.5"),
    ("decoding.presence_penalty", -3, "decoding.presence_penalty: must be between -2 and 2, not -3"),
    ("decoding.stop", "", "decoding.stop: must be a non-empty string or a list of them, not ''"),
    ("decoding.stop", ["a", 1], "decoding.stop: must be a non-empty string or a list of them, not ['a', 1]"),
    ("decoding.stop", {"a": 1}, "decoding.stop: must be a non-empty string or a list of them"),
    ("decoding.stop", ["a", "b", "c", "d", "e"], "decoding.stop: has 5 sequences; at most 4 are allowed"),
    ("decoding.top_k", 5, "decoding.top_k: unknown field"),
])
def test_a_bad_knob_is_refused_with_one_line_naming_it(tmp_path: Path, field: str, value: Any,
                                                       message: str) -> None:
    with pytest.raises(SpecError) as info:
        load_spec(write(tmp_path, with_change(field, value)))
    assert message in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("engine,knob,value", [
    ("openai", "repetition_penalty", 1.2),
    ("embedding", "stop", ["x"]),
    ("embedding", "frequency_penalty", 0.5),
])
def test_an_engine_that_cannot_honour_a_knob_is_refused_at_parsing(tmp_path: Path, engine: str, knob: str,
                                                                   value: Any) -> None:
    spec = with_change(f"decoding.{knob}", value)
    spec["model"] = {"engine": engine, "path": "http://127.0.0.1:1/v1"} if engine == "openai" else {"engine": engine}
    with pytest.raises(SpecError) as info:
        load_spec(write(tmp_path, spec))
    text = str(info.value)
    assert f"decoding.{knob} is set but the {engine} engine cannot honour it" in text, text
    assert "\n" not in text


def test_engines_that_honour_a_knob_accept_it(tmp_path: Path) -> None:
    for engine, knob in [("openai", "frequency_penalty"), ("openai", "stop"), ("llamacpp", "repetition_penalty"),
                         ("transformers", "presence_penalty"), ("vllm", "repetition_penalty")]:
        spec = with_change(f"decoding.{knob}", ["x"] if knob == "stop" else 1.1)
        spec["model"] = {"engine": engine, "path": "http://127.0.0.1:1/v1" if engine == "openai" else "/m"}
        assert load_spec(write(tmp_path, spec)).decoding.knobs()


def test_a_provider_that_cannot_honour_a_knob_is_refused_at_parsing(tmp_path: Path) -> None:
    spec = with_change("decoding.stop", ["END"])
    spec["routing"] = {"class_field": "cls", "providers": {
        "claude": {"api": "anthropic", "model": "claude-x", "classes": ["public"], "retention": "none"}}}
    with pytest.raises(SpecError) as info:
        load_spec(write(tmp_path, spec))
    assert ("routing.providers.claude: decoding.stop is set but the anthropic provider cannot honour it"
            in str(info.value))


def test_building_an_engine_refuses_a_knob_it_cannot_honour() -> None:
    config = EngineConfig(model=ModelSpec(engine="openai", path="http://127.0.0.1:1/v1"),
                          decoding=DecodingSpec(repetition_penalty=1.2), output_schema={"type": "object"})
    with pytest.raises(EngineFatal, match=r"decoding\.repetition_penalty is set but the openai engine cannot"):
        create_engine(config)


def test_the_synthetic_engine_cuts_its_output_at_a_stop_sequence() -> None:
    from tests.integration.engines.support import ListSource, make_request

    schema = {"type": "object", "properties": {"summary": {"type": "string"}}, "required": ["summary"]}
    outputs = []
    for stop in ((), ("shipping",)):
        engine = create_engine(EngineConfig(model=ModelSpec(engine="synthetic"), output_schema=schema,
                                            decoding=DecodingSpec(stop=stop, repetition_penalty=1.2)))
        engine.load()
        outputs.append(next(iter(engine.generate(ListSource([make_request("r", "Say.\n", "late shipping")])))))
        engine.close()
    assert outputs[0].output == '{"summary":"late shipping"}'
    assert outputs[1].output == '{"summary":"late '


def test_penalties_follow_the_definitions_vllm_and_the_openai_api_use() -> None:
    import numpy as np

    from batchline.engines.decoding import TokenPenalties, cut_at_stop

    penalties = TokenPenalties(DecodingSpec(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
                               prompt=[1, 2])
    penalties.add([2, 3, 3])
    logits = np.array([1.0, 2.0, -2.0, 4.0, 5.0], dtype=np.float32)
    # 1: in the prompt, 2 / 2; 2: in both, -2 * 2 - (0.5 + 0.25); 3: twice in the output,
    # 4 / 2 - (2 * 0.5 + 0.25); 0 and 4: untouched.
    assert penalties.apply(logits).tolist() == [1.0, 1.0, -4.75, 0.75, 5.0]
    assert logits.tolist() == [1.0, 2.0, -2.0, 4.0, 5.0]
    assert cut_at_stop("abcXdefY", ["Y", "X"]) == ("abc", True)
    assert cut_at_stop("abc", ["Z"]) == ("abc", False)
